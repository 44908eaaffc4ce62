"""Typed training configuration with Megatron-Bridge's key names, loaded from YAML and checked once.

``load_config(path, overrides)`` reads a YAML file, applies ``section.key=value``
overrides, and checks every key's name and type and every rule of the reference
system before anything is compiled. Problems raise ``ConfigError`` with one
message that names the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import os
import typing
from typing import Any, Optional, Sequence

import yaml

from jaxoffload import remat
from jaxoffload.adam import UPDATE_PLACES
from jaxoffload.data import BYTE_VOCAB_SIZE, corpus_tokens
from jaxoffload.placement import check_fraction


class ConfigError(ValueError):
  """A configuration the trainer refuses; the message names the key and what is allowed."""


@dataclasses.dataclass
class ModelConfig:
  """``model.*``: sizes, dtypes and activation offload (Megatron-Bridge names)."""

  vocab_size: int = 256
  hidden_size: int = 64
  intermediate_size: int = 176
  num_layers: int = 4
  num_attention_heads: int = 4
  num_query_groups: int = 2  # Key/value heads.
  seq_length: int = 64
  dtype: str = "float32"  # Compute dtype: float32 or bfloat16.
  params_dtype: str = "float32"
  share_embeddings_and_output_weights: bool = False
  cpu_offloading: bool = False
  cpu_offloading_num_layers: int = 0
  cpu_offloading_activations: bool = True
  cpu_offloading_weights: bool = False
  cpu_offloading_double_buffering: bool = False  # True is refused: XLA schedules the copies.
  # Which named activations offloaded layers send to pinned_host (the others are
  # recomputed): a key of remat.OFFLOAD_PRESETS. A jaxoffload extension.
  cpu_offloading_policy: str = remat.DEFAULT_OFFLOAD_PRESET
  # jax.nn.dot_product_attention's implementation: xla, cudnn, or null for cuDNN
  # on a GPU with bfloat16 compute.
  attention_implementation: Optional[str] = None
  recompute_granularity: Optional[str] = None
  fine_grained_activation_offloading: bool = False
  pipeline_model_parallel_size: int = 1
  cuda_graph_impl: str = "none"


@dataclasses.dataclass
class OptimizerConfig:
  """``optimizer.*``: AdamW, its schedule and clipping, and optimizer offload."""

  lr: float = 3e-3
  min_lr: float = 3e-4
  lr_warmup_iters: int = 10
  lr_decay_style: str = "cosine"
  adam_beta1: float = 0.9
  adam_beta2: float = 0.95
  adam_eps: float = 1e-8
  weight_decay: float = 0.1
  clip_grad: float = 1.0
  optimizer_cpu_offload: bool = False
  optimizer_offload_fraction: float = 0.0
  # With update_on=device: fetch each piece of state while the previous one
  # updates (double buffering).
  overlap_cpu_optimizer_d2h_h2d: bool = False
  # Where offloaded state updates: device (streamed through it), host (XLA's
  # host computation), host_kernel (weights and moments on the host, updated
  # by jaxoffload.host_adam's multi-threaded kernel between device steps), or
  # auto (the exact placement this machine runs fastest: jaxoffload.autoplace).
  optimizer_offload_update_on: str = "device"
  # With host_kernel: apply step t's update while the device computes step t+1
  # (ZeRO-Offload's one-step delayed parameter update).
  delayed_update: bool = False
  # With delayed_update: updates applied exactly before the delay begins.
  delayed_update_after: int = 0
  # With delayed_update: the device reads the weights moved once more by their
  # latest update, standing in for the update still pending (weight prediction).
  delayed_update_predict_weights: bool = False
  # With host_kernel: the dtype of the offloaded weights the device reads and
  # of their gradients it sends back. bfloat16 halves the copies; only weights
  # the model multiplies in bfloat16 travel so (see docs/config.md).
  offload_transfer_dtype: str = "float32"
  use_torch_optimizer_for_cpu_offload: bool = False  # True is refused: there is no torch here.
  # State sharded over the devices that hold the parameters: what mesh.fsdp
  # does already; refused with mesh.data > 1, naming mesh.fsdp.
  use_distributed_optimizer: bool = False


@dataclasses.dataclass
class TrainConfig:
  """``train.*``: steps, batch sizes (gradient accumulation when they differ) and seed."""

  train_iters: int = 100
  global_batch_size: int = 8
  micro_batch_size: int = 8
  seed: int = 0


@dataclasses.dataclass
class DataConfig:
  """``data.*``: where the training tokens come from (``jaxoffload.data``)."""

  dataset: str = "synthetic"  # synthetic, or text (byte tokens, model.vocab_size >= 256).
  text_file: Optional[str] = None  # A UTF-8 text file; None: the package's own source.


@dataclasses.dataclass
class LoggingConfig:
  """``logging.*``: the progress line and the per-step JSONL record."""

  log_interval: int = 0  # Steps between progress lines; 0: ten lines a run.
  jsonl: Optional[str] = None  # A file to append one JSON record per step to.
  progress_bar: bool = True  # On a terminal, one line redrawn in place.


@dataclasses.dataclass
class MeshConfig:
  """``mesh.*``: how many devices along each mesh axis."""

  data: int = 1
  fsdp: int = 1
  tensor: int = 1


@dataclasses.dataclass
class DistributedConfig:
  """``distributed.*``: one process per host, joined by ``jax.distributed.initialize``."""

  initialize: bool = False  # Call jax.distributed.initialize before anything else.
  # Left null, JAX detects them on clusters it knows (SLURM, Open MPI, TPU pods,
  # Kubernetes); name them elsewhere, the same address on every process.
  coordinator_address: Optional[str] = None  # host:port of process 0.
  num_processes: Optional[int] = None
  process_id: Optional[int] = None


@dataclasses.dataclass
class CheckpointConfig:
  """``checkpoint.*``: orbax checkpoints of parameters and optimizer state."""

  dir: Optional[str] = None  # None: no checkpoints.
  save_interval: int = 100  # Steps between saves; the last step is always saved.
  keep: int = 3  # How many of the newest checkpoints to keep.
  resume: bool = True  # Continue from the newest checkpoint in dir, if there is one.


@dataclasses.dataclass
class Config:
  """The whole configuration."""

  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
  train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
  distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
  checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)


DTYPES = ("float32", "bfloat16")
ATTENTION_IMPLEMENTATIONS = (None, "xla", "cudnn")
CUDA_GRAPH_IMPLS = ("none", "local", "transformer_engine")
LR_DECAY_STYLES = ("constant", "linear", "cosine")
TRANSFER_DTYPES = ("float32", "bfloat16")
DATASETS = ("synthetic", "text")


def _sections() -> dict[str, type]:
  return {f.name: typing.get_type_hints(Config)[f.name] for f in dataclasses.fields(Config)}


def _closest(name: str, candidates: Sequence[str]) -> str:
  match = difflib.get_close_matches(name, candidates, n=1, cutoff=0.5)
  return f"; did you mean {match[0]!r}?" if match else f"; valid: {', '.join(candidates)}"


def _coerce(key: str, value: Any, expected: Any) -> Any:
  """``value`` as the field's type (ints widen to floats), or a ConfigError naming the key."""
  allowed = typing.get_args(expected) if typing.get_origin(expected) is typing.Union else (expected,)
  if value is None and type(None) in allowed:
    return None
  for kind in allowed:
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
      return float(value)
    if kind is float and isinstance(value, str):
      # YAML reads 3e-4 (no dot) as a string; a float field takes it as the number.
      try:
        return float(value)
      except ValueError:
        pass
    if kind is not type(None) and type(value) is kind:
      return value
  names = " or ".join("null" if kind is type(None) else kind.__name__ for kind in allowed)
  raise ConfigError(f"{key} must be {names}, got {value!r} ({type(value).__name__})")


def _set(config: Config, dotted: str, value: Any) -> None:
  section_name, _, key = dotted.partition(".")
  sections = _sections()
  if section_name not in sections or not key:
    raise ConfigError(f"unknown config key {dotted!r}" + _closest(
        section_name, [f"{s}." for s in sections]))
  section = getattr(config, section_name)
  hints = typing.get_type_hints(type(section))
  if key not in hints:
    raise ConfigError(f"unknown config key {dotted!r}" + _closest(
        dotted, [f"{section_name}.{k}" for k in hints]))
  setattr(section, key, _coerce(dotted, value, hints[key]))


def _flatten(tree: Any, prefix: str = "") -> list[tuple[str, Any]]:
  if not isinstance(tree, dict):
    return [(prefix, tree)]
  if prefix.count(".") >= 1:
    raise ConfigError(f"config key {prefix!r} takes a value, not a mapping")
  items = []
  for key, value in tree.items():
    items += _flatten(value, f"{prefix}.{key}" if prefix else str(key))
  return items


def _check_one_of(key: str, value: Any, allowed: Sequence[Any]) -> None:
  if value not in allowed:
    raise ConfigError(f"{key} must be one of {list(allowed)}, got {value!r}")


def validate(config: Config) -> tuple[remat.LayerGroup, ...]:
  """Checks every rule of the reference system; returns the model's layer groups.

  Raises:
    ConfigError: with the reference's wording where it has one.
  """
  m, o = config.model, config.optimizer
  _check_one_of("model.dtype", m.dtype, DTYPES)
  _check_one_of("model.params_dtype", m.params_dtype, DTYPES)
  _check_one_of("model.cuda_graph_impl", m.cuda_graph_impl, CUDA_GRAPH_IMPLS)
  _check_one_of("model.cpu_offloading_policy", m.cpu_offloading_policy,
                list(remat.OFFLOAD_PRESETS))
  _check_one_of("model.attention_implementation", m.attention_implementation,
                ATTENTION_IMPLEMENTATIONS)
  _check_one_of("optimizer.lr_decay_style", o.lr_decay_style, LR_DECAY_STYLES)
  _check_one_of("optimizer.optimizer_offload_update_on", o.optimizer_offload_update_on,
                UPDATE_PLACES + ("host_kernel", "auto"))
  _check_one_of("optimizer.offload_transfer_dtype", o.offload_transfer_dtype, TRANSFER_DTYPES)
  if o.offload_transfer_dtype != "float32":
    if o.optimizer_offload_update_on not in ("host_kernel", "auto"):
      raise ConfigError(f"optimizer.offload_transfer_dtype={o.offload_transfer_dtype} needs "
                        f"optimizer.optimizer_offload_update_on=host_kernel (or auto), got "
                        f"{o.optimizer_offload_update_on!r}")
    if m.dtype != "bfloat16":
      raise ConfigError(f"optimizer.offload_transfer_dtype={o.offload_transfer_dtype} sends the "
                        f"weights the model multiplies in bfloat16; model.dtype is {m.dtype!r}, "
                        f"so none would be")
  if o.delayed_update and o.optimizer_offload_update_on != "host_kernel":
    raise ConfigError("optimizer.delayed_update=True needs optimizer.optimizer_offload_update_on="
                      f"host_kernel, got {o.optimizer_offload_update_on!r}")
  if o.delayed_update_after < 0:
    raise ConfigError(f"optimizer.delayed_update_after must be >= 0, got {o.delayed_update_after}")
  if o.delayed_update_after and not o.delayed_update:
    raise ConfigError(f"optimizer.delayed_update_after={o.delayed_update_after} counts the exact "
                      f"updates before a delayed_update; set optimizer.delayed_update=True")
  if o.delayed_update_predict_weights and not o.delayed_update:
    raise ConfigError("optimizer.delayed_update_predict_weights=True predicts the update a delayed "
                      "step lacks; set optimizer.delayed_update=True")
  if o.optimizer_cpu_offload and o.optimizer_offload_update_on == "host_kernel":
    if m.params_dtype != "float32":
      raise ConfigError("optimizer_offload_update_on=host_kernel keeps float32 weights on the "
                        f"host; model.params_dtype must be float32, got {m.params_dtype!r}")
    if importlib.util.find_spec("numba") is None:
      raise ConfigError("optimizer_offload_update_on=host_kernel needs numba: "
                        "pip install 'jaxoffload[host]'")
  if m.cpu_offloading and m.pipeline_model_parallel_size > 1:
    raise ConfigError("Currently there is no support for Pipeline parallelism with CPU offloading")
  if m.pipeline_model_parallel_size != 1:
    raise ConfigError("model.pipeline_model_parallel_size must be 1: jaxoffload has no pipeline "
                      "parallelism; shard over mesh.fsdp and mesh.tensor instead")
  if m.cpu_offloading and m.cuda_graph_impl != "none":
    raise ConfigError("CUDA graphs not supported with CPU offloading.")
  if m.cpu_offloading_double_buffering:
    raise ConfigError("model.cpu_offloading_double_buffering=True has no setting in JAX: XLA's "
                      "scheduler decides when offloaded layers' copies start; its flag "
                      "--xla_gpu_enable_pipelined_host_offloading is the nearest (measured in "
                      "docs/benchmarks/activation_offload.md: no faster)")
  if o.use_torch_optimizer_for_cpu_offload:
    raise ConfigError("optimizer.use_torch_optimizer_for_cpu_offload=True: jaxoffload has no "
                      "torch optimizer; offloaded state updates in XLA or with its own "
                      "multi-threaded host kernel, chosen by "
                      "optimizer.optimizer_offload_update_on (device, host, host_kernel or auto)")
  if o.use_distributed_optimizer and config.mesh.data > 1:
    raise ConfigError(f"optimizer.use_distributed_optimizer=True with mesh.data="
                      f"{config.mesh.data}: shard the optimizer state with mesh.fsdp="
                      f"{config.mesh.data} instead (it shards parameters, gradients and "
                      f"optimizer state alike)")
  _check_one_of("data.dataset", config.data.dataset, DATASETS)
  if config.data.dataset == "text":
    if m.vocab_size < BYTE_VOCAB_SIZE:
      raise ConfigError(f"data.dataset=text needs model.vocab_size >= {BYTE_VOCAB_SIZE} "
                        f"(byte tokens), got {m.vocab_size}")
    try:
      corpus_tokens(config.data.text_file, m.seq_length)
    except ValueError as error:
      raise ConfigError(str(error)) from None
  elif config.data.text_file is not None:
    raise ConfigError("data.text_file is set but data.dataset is 'synthetic'; "
                      "set data.dataset=text to train on it")
  if config.logging.log_interval < 0:
    raise ConfigError(f"logging.log_interval must be at least 0, got "
                      f"{config.logging.log_interval}")
  d = config.distributed
  if not d.initialize and (d.coordinator_address, d.num_processes, d.process_id) != (None,) * 3:
    raise ConfigError("distributed.coordinator_address, num_processes and process_id take effect "
                      "only with distributed.initialize=True")
  if d.num_processes is not None and d.num_processes < 1:
    raise ConfigError(f"distributed.num_processes must be at least 1, got {d.num_processes}")
  if d.process_id is not None and not 0 <= d.process_id < (d.num_processes or d.process_id + 1):
    raise ConfigError(f"distributed.process_id must be in [0, distributed.num_processes - 1], "
                      f"got {d.process_id}")
  if o.overlap_cpu_optimizer_d2h_h2d and o.optimizer_offload_update_on != "device":
    raise ConfigError(
        f"optimizer.overlap_cpu_optimizer_d2h_h2d=True overlaps the copies of state streamed "
        f"through the device: it needs optimizer.optimizer_offload_update_on=device, got "
        f"{o.optimizer_offload_update_on!r} (with host_kernel, delayed_update=True overlaps)")
  for key, value in (("train.train_iters", config.train.train_iters),
                     ("train.global_batch_size", config.train.global_batch_size),
                     ("train.micro_batch_size", config.train.micro_batch_size),
                     ("checkpoint.save_interval", config.checkpoint.save_interval),
                     ("checkpoint.keep", config.checkpoint.keep)):
    if value < 1:
      raise ConfigError(f"{key} must be at least 1, got {value}")
  if config.train.global_batch_size % config.train.micro_batch_size:
    raise ConfigError(
        f"train.global_batch_size ({config.train.global_batch_size}) must be a multiple of "
        f"train.micro_batch_size ({config.train.micro_batch_size})")
  try:
    check_fraction(o.optimizer_offload_fraction)
  except ValueError:
    raise ConfigError(f"optimizer.optimizer_offload_fraction must be in [0.0, 1.0], got "
                      f"{o.optimizer_offload_fraction!r}") from None
  try:
    return remat.megatron_layer_groups(
        m.num_layers, cpu_offloading=m.cpu_offloading,
        cpu_offloading_num_layers=m.cpu_offloading_num_layers,
        cpu_offloading_activations=m.cpu_offloading_activations,
        cpu_offloading_weights=m.cpu_offloading_weights,
        recompute_granularity=m.recompute_granularity,
        fine_grained_activation_offloading=m.fine_grained_activation_offloading,
        offload_placements=remat.offload_preset(m.cpu_offloading_policy))
  except ValueError as error:
    raise ConfigError(str(error)) from None


def parse_override(text: str) -> tuple[str, Any]:
  """``"optimizer.lr=3e-4"`` as ``("optimizer.lr", 3e-4)``; values are read as YAML."""
  key, sep, raw = text.partition("=")
  if not sep or not key:
    raise ConfigError(f"override {text!r} must look like section.key=value")
  return key.strip(), yaml.safe_load(raw) if raw.strip() else None


def _file_items(path: str, including: tuple[str, ...]) -> list[tuple[str, Any]]:
  """The file's (key, value) pairs, after those of the file its ``base_config`` names."""
  try:
    with open(path) as f:
      data = yaml.safe_load(f) or {}
  except OSError as error:
    raise ConfigError(f"cannot read config file {path!r}: {error.strerror}") from None
  except yaml.YAMLError as error:
    raise ConfigError(f"config file {path!r} is not valid YAML: {error}") from None
  if not isinstance(data, dict):
    raise ConfigError(f"config file {path!r} must hold a mapping of sections")
  base = data.pop("base_config", None)
  if base is None:
    return _flatten(data)
  if not isinstance(base, str):
    raise ConfigError(f"base_config in {path!r} must be a file name, got {base!r}")
  # Relative to the including file, as a user reading it would expect.
  base_path = os.path.normpath(os.path.join(os.path.dirname(path), base))
  chain = including + (os.path.normpath(path),)
  if base_path in chain:
    raise ConfigError(f"config files include each other: {' -> '.join(chain + (base_path,))}")
  return _file_items(base_path, chain) + _flatten(data)


def load_config(path: Optional[str] = None, overrides: Sequence[str] = ()) -> Config:
  """Reads ``path`` (YAML, optional), applies ``overrides`` and validates once.

  A file may start from another: ``base_config: llama_1b.yaml`` (a path
  relative to the file) reads that one first, then this file's keys over it.

  Example:
    >>> config = load_config("configs/tiny.yaml", ["optimizer.optimizer_offload_fraction=0.5"])

  Raises:
    ConfigError: naming the key for an unknown key, a wrong type or a broken rule.
  """
  config = Config()
  items = [] if path is None else _file_items(path, ())
  items += [parse_override(text) for text in overrides]
  for key, value in items:
    _set(config, key, value)
  validate(config)
  return config
