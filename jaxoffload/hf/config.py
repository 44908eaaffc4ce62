"""A Hugging Face Llama ``config.json`` as a ``model.LlamaConfig``, and back.

Every field that changes the model's math is mapped: sizes, grouped-query
heads, ``head_dim``, ``rope_theta``, Llama 3.1's ``rope_scaling`` (in the
``rope_scaling`` / ``rope_theta`` fields most published checkpoints carry, or
the ``rope_parameters`` field newer transformers write), ``rms_norm_eps``,
``tie_word_embeddings``, ``max_position_embeddings`` and the vocabulary. What
the model does not implement (biases, sliding windows, other rope types,
experts, other activations) is refused, naming the field and its value.
Written back, the fields are in the installed transformers' own keys (without
it, transformers 5's: ``dtype``, ``rope_parameters``), and the fields of the
checkpoint the model came from that it does not decide are kept.
"""

from __future__ import annotations

import inspect
import json
import os
from typing import Any, Optional

from jaxoffload.nn.model import LlamaConfig

CONFIG_FILE = "config.json"
DTYPES = ("bfloat16", "float16", "float32")


class CheckpointError(ValueError):
  """A checkpoint that cannot be read as a Llama; the message names the file and the problem."""


def _refuse_unsupported(file: str, raw: dict) -> None:
  model_type = raw.get("model_type")
  if model_type != "llama":
    raise CheckpointError(f"{file}: model_type {model_type!r} is not supported; jaxoffload reads "
                          f"Llama checkpoints (model_type 'llama')")
  for key in ("attention_bias", "mlp_bias"):
    if raw.get(key):
      raise CheckpointError(f"{file}: {key}={raw[key]!r}: the model has no biases")
  if raw.get("hidden_act", "silu") != "silu":
    raise CheckpointError(f"{file}: hidden_act={raw['hidden_act']!r}: the model's MLP is SwiGLU "
                          f"(silu)")
  for key in ("sliding_window", "num_local_experts", "num_experts"):
    if raw.get(key):
      raise CheckpointError(f"{file}: {key}={raw[key]!r} is not supported: the model has full "
                            f"attention and one MLP per layer")


def _rope(file: str, raw: dict) -> dict[str, Any]:
  """The rope fields of LlamaConfig from either way config.json may write them."""
  parameters = raw.get("rope_parameters") or {}
  theta = parameters.get("rope_theta", raw.get("rope_theta", 10000.0))
  scaling = raw.get("rope_scaling") or parameters
  kind = scaling.get("rope_type", scaling.get("type", "default"))
  if kind == "default":
    return {"rope_theta": float(theta)}
  if kind != "llama3":
    field = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
    raise CheckpointError(f"{file}: {field} rope_type {kind!r} is not supported; only "
                          f"'default' and 'llama3'")
  return {"rope_theta": float(theta), "rope_scaling_factor": float(scaling["factor"]),
          "rope_scaling_low_freq_factor": float(scaling["low_freq_factor"]),
          "rope_scaling_high_freq_factor": float(scaling["high_freq_factor"]),
          "rope_scaling_original_max_position_embeddings":
              int(scaling["original_max_position_embeddings"])}


def read_raw_config(directory: str) -> dict[str, Any]:
  """A checkpoint directory's ``config.json`` as written, every field kept.

  Raises:
    CheckpointError: naming the file, when it cannot be read as a JSON object.
  """
  file = os.path.join(directory, CONFIG_FILE)
  try:
    with open(file) as f:
      raw = json.load(f)
  except OSError as error:
    raise CheckpointError(f"{file}: cannot be read ({error.strerror})") from None
  except ValueError as error:
    raise CheckpointError(f"{file}: not valid JSON ({error})") from None
  if not isinstance(raw, dict):
    raise CheckpointError(f"{file}: holds a JSON {type(raw).__name__}; a config is a JSON object")
  return raw


def read_config(directory: str, **overrides: Any) -> LlamaConfig:
  """The ``LlamaConfig`` of a checkpoint directory's ``config.json``.

  Args:
    directory: the checkpoint directory.
    **overrides: LlamaConfig fields the checkpoint does not decide (``dtype``,
      ``params_dtype``, ``seq_length``, ``attention_implementation``, ``scan_layers``).

  Raises:
    CheckpointError: naming the file and the field it cannot read or does not support.
  """
  file = os.path.join(directory, CONFIG_FILE)
  raw = read_raw_config(directory)
  _refuse_unsupported(file, raw)
  try:
    heads = raw["num_attention_heads"]
    head_dim = raw.get("head_dim")
    fields = dict(
        vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"], num_layers=raw["num_hidden_layers"],
        num_attention_heads=heads, num_query_groups=raw.get("num_key_value_heads", heads),
        kv_channels=None if head_dim in (None, raw["hidden_size"] // heads) else head_dim,
        max_position_embeddings=raw.get("max_position_embeddings"),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        share_embeddings_and_output_weights=bool(raw.get("tie_word_embeddings", False)),
        **_rope(file, raw))
  except KeyError as error:
    raise CheckpointError(f"{file}: the field {error.args[0]!r} is missing") from None
  return LlamaConfig(**{**fields, **overrides})


def stored_dtype(directory: str) -> Optional[str]:
  """The dtype config.json says the weights are stored in (``dtype``, or ``torch_dtype``)."""
  raw = read_raw_config(directory)
  dtype = raw.get("dtype") or raw.get("torch_dtype")
  return dtype if dtype in DTYPES else None


def hf_config(config: LlamaConfig, dtype: str,
              source: Optional[dict[str, Any]] = None) -> dict[str, Any]:
  """``config`` as the fields of a ``config.json``, with weights stored in ``dtype``.

  Args:
    config: the model's config.
    dtype: the tensors' dtype on disk.
    source: the ``config.json`` fields of the checkpoint the model was imported from:
      those the model does not decide (token ids, ``initializer_range``, ``use_cache``...)
      are kept.

  Returns:
    What the installed transformers' ``LlamaConfig.save_pretrained`` writes for these
    fields, its keys and defaults; without transformers, the same fields in the keys
    transformers 5 writes.
  """
  rope = {"rope_type": "default", "rope_theta": config.rope_theta}
  if config.rope_scaling_factor is not None:
    rope = {
        "rope_type": "llama3", "rope_theta": config.rope_theta,
        "factor": config.rope_scaling_factor,
        "low_freq_factor": config.rope_scaling_low_freq_factor,
        "high_freq_factor": config.rope_scaling_high_freq_factor,
        "original_max_position_embeddings": config.rope_scaling_original_max_position_embeddings}
  model = {
      "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
      "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
      "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
      "num_attention_heads": config.num_attention_heads,
      "num_key_value_heads": config.num_query_groups, "head_dim": config.head_dim,
      "max_position_embeddings": config.max_position_embeddings or config.seq_length,
      "rms_norm_eps": config.rms_norm_eps, "rope_parameters": rope,
      "tie_word_embeddings": config.share_embeddings_and_output_weights,
      "attention_bias": False, "mlp_bias": False, "dtype": dtype,
  }
  # The older spellings of what the model decides would contradict it; the version is
  # the writer's, not the source's.
  superseded = {"torch_dtype", "rope_theta", "rope_scaling", "transformers_version"}
  kept = {k: v for k, v in (source or {}).items() if k not in model and k not in superseded}
  fields = {**kept, **model}
  try:
    from transformers import LlamaConfig as TransformersConfig  # The hf extra: optional.
  except ImportError:
    return fields
  # Through transformers' own class, the file holds the keys and defaults that the
  # transformers reading it will expect, as its save_pretrained would write them.
  if "rope_parameters" not in inspect.signature(TransformersConfig.__init__).parameters:
    fields = older_keys(fields)
  return TransformersConfig(**fields).to_diff_dict()


def older_keys(fields: dict[str, Any]) -> dict[str, Any]:
  """``fields`` with rope and dtype in the keys transformers before 5 takes, which would
  keep ``rope_parameters`` as an unknown field and give the model its default rope."""
  fields = dict(fields)
  rope = dict(fields.pop("rope_parameters"))
  fields["rope_theta"] = rope.pop("rope_theta")
  fields["rope_scaling"] = None if rope["rope_type"] == "default" else rope
  fields["torch_dtype"] = fields.pop("dtype")
  return fields
