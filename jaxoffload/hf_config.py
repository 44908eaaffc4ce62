"""A Hugging Face Llama ``config.json`` as a ``model.LlamaConfig``, and back.

Every field that changes the model's math is mapped: sizes, grouped-query
heads, ``head_dim``, ``rope_theta``, Llama 3.1's ``rope_scaling`` (in the
``rope_scaling`` / ``rope_theta`` fields most published checkpoints carry, or
the ``rope_parameters`` field newer transformers write), ``rms_norm_eps``,
``tie_word_embeddings``, ``max_position_embeddings`` and the vocabulary. What
the model does not implement (biases, sliding windows, other rope types,
experts, other activations) is refused, naming the field and its value.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

from jaxoffload.model import LlamaConfig

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


def read_config(directory: str, **overrides: Any) -> LlamaConfig:
  """The ``LlamaConfig`` of a checkpoint directory's ``config.json``.

  Args:
    directory: the checkpoint directory.
    **overrides: LlamaConfig fields the checkpoint does not decide (``dtype``,
      ``params_dtype``, ``seq_length``, ``attention_implementation``).

  Raises:
    CheckpointError: naming the file and the field it cannot read or does not support.
  """
  file = os.path.join(directory, CONFIG_FILE)
  try:
    with open(file) as f:
      raw = json.load(f)
  except OSError as error:
    raise CheckpointError(f"{file}: cannot be read ({error.strerror})") from None
  except ValueError as error:
    raise CheckpointError(f"{file}: not valid JSON ({error})") from None
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
  """The dtype config.json says the weights are stored in (``torch_dtype`` or ``dtype``)."""
  with open(os.path.join(directory, CONFIG_FILE)) as f:
    raw = json.load(f)
  dtype = raw.get("torch_dtype") or raw.get("dtype")
  return dtype if dtype in DTYPES else None


def hf_config(config: LlamaConfig, dtype: str) -> dict[str, Any]:
  """``config`` as transformers' LlamaConfig fields, with weights stored in ``dtype``."""
  rope_scaling = None
  if config.rope_scaling_factor is not None:
    rope_scaling = {
        "rope_type": "llama3", "factor": config.rope_scaling_factor,
        "low_freq_factor": config.rope_scaling_low_freq_factor,
        "high_freq_factor": config.rope_scaling_high_freq_factor,
        "original_max_position_embeddings": config.rope_scaling_original_max_position_embeddings}
  return {
      "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
      "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
      "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
      "num_attention_heads": config.num_attention_heads,
      "num_key_value_heads": config.num_query_groups, "head_dim": config.head_dim,
      "max_position_embeddings": config.max_position_embeddings or config.seq_length,
      "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
      "rope_scaling": rope_scaling,
      "tie_word_embeddings": config.share_embeddings_and_output_weights,
      "attention_bias": False, "mlp_bias": False, "torch_dtype": dtype,
  }
