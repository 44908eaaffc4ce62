"""The reference system's rules, and this trainer's, as pure functions of a ``Config``.

``check`` raises ``ConfigError`` with the reference's wording where it has one;
what a checked config implies is ``implied``'s. Nothing here reads files or the
machine: what the backend decides is ``advice``'s.
"""

from __future__ import annotations

from typing import Any, Sequence

from jaxoffload.memory import parse_bytes
from jaxoffload.nn import remat
from jaxoffload.optim.offload_plan import check_fraction
from jaxoffload.optim.offloaded_adam import UPDATE_PLACES
from jaxoffload.train.config import Config, ConfigError, ModelConfig, OptimizerConfig
from jaxoffload.train.implied import host_update_overlap_blocker, layer_groups, per_layer_blocker
from jaxoffload.train.tokenizer import BYTE_VOCAB_SIZE

DTYPES = ("float32", "bfloat16")
# Adam's moments may also be 8-bit blocks (jaxoffload.optim.blockwise).
MOMENT_DTYPES = DTYPES + ("int8",)
ATTENTION_IMPLEMENTATIONS = (None, "xla", "cudnn")
CUDA_GRAPH_IMPLS = ("none", "local", "transformer_engine")
LR_DECAY_STYLES = ("constant", "linear", "cosine")
UPDATE_PLACEMENTS = UPDATE_PLACES + ("host_kernel", "auto")
GRAD_SUMS_PLACES = ("host", "device")
DATASETS = ("synthetic", "text")


def check(config: Config) -> None:
  """Raises ``ConfigError`` for the first rule ``config`` breaks, naming the key."""
  _check_choices(config)
  _check_sizes(config)
  _check_optimizer(config)
  _check_host_kernel(config)
  _check_model(config)
  _check_data_and_processes(config)
  _check_mesh(config)
  layer_groups(config)


def _one_of(key: str, value: Any, allowed: Sequence[Any]) -> None:
  if value not in allowed:
    raise ConfigError(f"{key} must be one of {list(allowed)}, got {value!r}")


def _at_least(key: str, value: float, low: float) -> None:
  if not value >= low:  # NaN fails too.
    raise ConfigError(f"{key} must be at least {low}, got {value}")


def _check_choices(config: Config) -> None:
  m, o = config.model, config.optimizer
  _one_of("model.dtype", m.dtype, DTYPES)
  _one_of("model.params_dtype", m.params_dtype, DTYPES)
  _one_of("model.cuda_graph_impl", m.cuda_graph_impl, CUDA_GRAPH_IMPLS)
  _one_of("model.cpu_offloading_policy", m.cpu_offloading_policy, list(remat.OFFLOAD_PRESETS))
  _one_of("model.attention_implementation", m.attention_implementation,
          ATTENTION_IMPLEMENTATIONS)
  _one_of("optimizer.lr_decay_style", o.lr_decay_style, LR_DECAY_STYLES)
  _one_of("optimizer.optimizer_offload_update_on", o.optimizer_offload_update_on,
          UPDATE_PLACEMENTS)
  _one_of("optimizer.offload_transfer_dtype", o.offload_transfer_dtype, DTYPES + ("auto",))
  _one_of("optimizer.accumulate_offloaded_grads_on", o.accumulate_offloaded_grads_on,
          GRAD_SUMS_PLACES)
  _one_of("optimizer.grad_accum_dtype", o.grad_accum_dtype, (None,) + DTYPES)
  _one_of("optimizer.exp_avg_dtype", o.exp_avg_dtype, (None,) + MOMENT_DTYPES)
  _one_of("optimizer.exp_avg_sq_dtype", o.exp_avg_sq_dtype, (None,) + MOMENT_DTYPES)
  _one_of("optimizer.main_params_dtype", o.main_params_dtype, (None,) + DTYPES)
  if o.main_params_dtype not in (None, m.params_dtype):
    raise ConfigError(
        f"optimizer.main_params_dtype={o.main_params_dtype} with model.params_dtype="
        f"{m.params_dtype}: jaxoffload keeps no second copy of the parameters; set both to "
        f"float32 (the model computes in model.dtype) or both to bfloat16 (updates rounded "
        f"stochastically)")
  _one_of("data.dataset", config.data.dataset, DATASETS)
  _one_of("train.fit", config.train.fit, (None, "auto"))


def _check_sizes(config: Config) -> None:
  m, t, c = config.model, config.train, config.checkpoint
  for key in ("hidden_size", "intermediate_size", "num_layers", "num_attention_heads",
              "num_query_groups"):
    _at_least(f"model.{key}", getattr(m, key), 1)
  # A one-token vocabulary has nothing to predict: its loss is zero from the first step.
  _at_least("model.vocab_size", m.vocab_size, 2)
  # The loss predicts each token from those before it: one sequence needs two.
  _at_least("model.seq_length", m.seq_length, 2)
  if m.kv_channels is None and m.hidden_size % m.num_attention_heads:
    raise ConfigError(f"model.hidden_size ({m.hidden_size}) must be a multiple of "
                      f"model.num_attention_heads ({m.num_attention_heads}), or set "
                      f"model.kv_channels")
  if m.head_dim < 2 or m.head_dim % 2:
    raise ConfigError(f"each attention head must be an even number of channels wide, got "
                      f"{m.head_dim}: rotary embeddings split a head in two halves")
  if m.max_position_embeddings is not None and m.seq_length > m.max_position_embeddings:
    raise ConfigError(f"model.seq_length ({m.seq_length}) is longer than "
                      f"model.max_position_embeddings ({m.max_position_embeddings})")
  if m.num_attention_heads % m.num_query_groups:
    raise ConfigError(f"model.num_attention_heads ({m.num_attention_heads}) must be a multiple "
                      f"of model.num_query_groups ({m.num_query_groups})")
  if not m.rope_theta > 0 or not m.rms_norm_eps >= 0:
    raise ConfigError(f"model.rope_theta must be > 0 and model.rms_norm_eps >= 0, got "
                      f"{m.rope_theta} and {m.rms_norm_eps}")
  if m.rope_scaling_factor is not None and not (
      m.rope_scaling_factor > 0
      and 0 < m.rope_scaling_low_freq_factor < m.rope_scaling_high_freq_factor
      and m.rope_scaling_original_max_position_embeddings > 0):
    raise ConfigError("model.rope_scaling_* must be positive with low_freq_factor below "
                      "high_freq_factor")
  for key, value in (("train.train_iters", t.train_iters),
                     ("train.global_batch_size", t.global_batch_size),
                     ("train.micro_batch_size", t.micro_batch_size),
                     ("checkpoint.save_interval", c.save_interval), ("checkpoint.keep", c.keep)):
    _at_least(key, value, 1)
  _at_least("logging.log_interval", config.logging.log_interval, 0)
  _at_least("train.seed", t.seed, 0)  # NumPy's generators of the text batches take no other.
  for key, value in (("train.host_memory_limit", t.host_memory_limit),
                     ("train.device_memory_limit", t.device_memory_limit)):
    if value is not None:
      try:
        limit = parse_bytes(value)
      except ValueError as error:
        raise ConfigError(f"{key}: {error}") from None
      _at_least(key, limit, 1)
  if t.compilation_cache_dir == "":
    raise ConfigError("train.compilation_cache_dir must name a directory or be null, got ''")
  if t.global_batch_size % t.micro_batch_size:
    raise ConfigError(f"train.global_batch_size ({t.global_batch_size}) must be a multiple of "
                      f"train.micro_batch_size ({t.micro_batch_size})")


def _check_optimizer(config: Config) -> None:
  o = config.optimizer
  if not o.lr > 0 or not 0 <= o.min_lr <= o.lr:
    raise ConfigError(f"optimizer.lr must be > 0 and optimizer.min_lr in [0, lr], got lr="
                      f"{o.lr}, min_lr={o.min_lr}")
  _at_least("optimizer.lr_warmup_iters", o.lr_warmup_iters, 0)
  for key in ("adam_beta1", "adam_beta2"):
    if not 0 <= getattr(o, key) < 1:
      raise ConfigError(f"optimizer.{key} must be in [0, 1), got {getattr(o, key)}")
  if not o.adam_eps > 0:
    raise ConfigError(f"optimizer.adam_eps must be > 0, got {o.adam_eps}")
  if not o.clip_grad >= 0:
    raise ConfigError(f"optimizer.clip_grad must be >= 0 (0: no clipping), got {o.clip_grad}")
  _at_least("optimizer.weight_decay", o.weight_decay, 0)
  fraction, unset = o.optimizer_offload_fraction, OptimizerConfig.optimizer_offload_fraction
  if fraction == "auto":
    if not o.optimizer_cpu_offload:
      raise ConfigError("optimizer.optimizer_offload_fraction=auto picks how much to offload: "
                        "it needs optimizer.optimizer_cpu_offload=True")
  else:
    try:
      check_fraction(fraction)
    except ValueError:
      raise ConfigError(f"optimizer.optimizer_offload_fraction must be in [0.0, 1.0] or auto, "
                        f"got {fraction!r}") from None
    # The default, which settings without offload may name beside the switch (the planner's).
    if not o.optimizer_cpu_offload and fraction != unset:
      raise ConfigError(f"optimizer.optimizer_offload_fraction={fraction} needs "
                        f"optimizer.optimizer_cpu_offload=True; without it the fraction must "
                        f"be {unset}")
  if o.overlap_cpu_optimizer_d2h_h2d and o.optimizer_offload_update_on == "host":
    raise ConfigError(
        "optimizer.overlap_cpu_optimizer_d2h_h2d=True overlaps the update with the device's "
        "work: it needs optimizer.optimizer_offload_update_on=device, host_kernel or auto, "
        "got 'host'")
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


def _check_host_kernel(config: Config) -> None:
  m, o = config.model, config.optimizer
  for key, dtype in (("exp_avg_dtype", o.exp_avg_dtype), ("exp_avg_sq_dtype", o.exp_avg_sq_dtype)):
    if dtype == "int8" and o.optimizer_cpu_offload and o.optimizer_offload_update_on == "device":
      raise ConfigError(f"optimizer.{key}=int8 (8-bit blocks) updates where the blocks live, "
                        f"not streamed through the device: set "
                        f"optimizer.optimizer_offload_update_on to host_kernel, host or auto, "
                        f"got 'device'")
  if o.offload_transfer_dtype == "bfloat16":
    if o.optimizer_offload_update_on not in ("host_kernel", "auto"):
      raise ConfigError(f"optimizer.offload_transfer_dtype={o.offload_transfer_dtype} needs "
                        f"optimizer.optimizer_offload_update_on=host_kernel (or auto), got "
                        f"{o.optimizer_offload_update_on!r}")
    if m.dtype != "bfloat16":
      raise ConfigError(f"optimizer.offload_transfer_dtype={o.offload_transfer_dtype} sends the "
                        f"weights the model multiplies in bfloat16; model.dtype is {m.dtype!r}, "
                        f"so none would be")
  blocker = host_update_overlap_blocker(config)
  if (o.overlap_cpu_optimizer_d2h_h2d and o.optimizer_offload_update_on == "host_kernel"
      and blocker):
    raise ConfigError(f"optimizer.overlap_cpu_optimizer_d2h_h2d=True with the host kernel: "
                      f"{blocker}")


def _check_model(config: Config) -> None:
  m = config.model
  if m.cpu_offloading and m.pipeline_model_parallel_size > 1:
    raise ConfigError("Currently there is no support for Pipeline parallelism with CPU offloading")
  if m.pipeline_model_parallel_size != 1:
    raise ConfigError("model.pipeline_model_parallel_size must be 1: jaxoffload has no pipeline "
                      "parallelism; shard over mesh.fsdp and mesh.tensor instead")
  if m.cpu_offloading and m.cuda_graph_impl != "none":
    raise ConfigError("CUDA graphs not supported with CPU offloading.")
  unset = ModelConfig.cpu_offloading_num_layers
  if not m.cpu_offloading and m.cpu_offloading_num_layers != unset:
    # Megatron ignores the count without its switch; a count given means offload was meant.
    raise ConfigError(f"model.cpu_offloading_num_layers={m.cpu_offloading_num_layers} needs "
                      f"model.cpu_offloading=True; without it the count must be {unset}")
  blocker = per_layer_blocker(config)
  if m.cpu_offloading and m.cpu_offloading_double_buffering and blocker:
    raise ConfigError(f"model.cpu_offloading_double_buffering=True runs the model a program per "
                      f"layer: {blocker}")
  if config.train.per_layer_step and blocker:
    raise ConfigError(f"train.per_layer_step=True runs the model a program per layer: {blocker}")


def _check_data_and_processes(config: Config) -> None:
  data, d, e = config.data, config.distributed, config.eval
  bytes_ = data.tokenizer is None and config.model.hf_checkpoint is None
  if data.dataset == "text" and bytes_ and config.model.vocab_size < BYTE_VOCAB_SIZE:
    raise ConfigError(f"data.dataset=text needs model.vocab_size >= {BYTE_VOCAB_SIZE} "
                      f"(byte tokens), got {config.model.vocab_size}; or name data.tokenizer")
  for key in ("path", "tokenizer", "eos_token"):
    if data.dataset == "synthetic" and getattr(data, key) is not None:
      raise ConfigError(f"data.{key} is set but data.dataset is 'synthetic'; "
                        f"set data.dataset=text to train on text")
  _at_least("eval.interval", e.interval, 0)
  _at_least("eval.iters", e.iters, 1)
  if not 0 < e.fraction <= 0.5:
    raise ConfigError(f"eval.fraction must be in (0, 0.5], got {e.fraction}")
  if config.checkpoint.init_from and config.model.hf_checkpoint:
    raise ConfigError("checkpoint.init_from and model.hf_checkpoint both name the first "
                      "weights; set one")
  _at_least("logging.profile_start_step", config.logging.profile_start_step, 1)
  _at_least("logging.profile_steps", config.logging.profile_steps, 1)
  if not d.initialize and (d.coordinator_address, d.num_processes, d.process_id) != (None,) * 3:
    raise ConfigError("distributed.coordinator_address, num_processes and process_id take effect "
                      "only with distributed.initialize=True")
  if d.num_processes is not None and d.num_processes < 1:
    raise ConfigError(f"distributed.num_processes must be at least 1, got {d.num_processes}")
  if d.process_id is not None and not 0 <= d.process_id < (d.num_processes or d.process_id + 1):
    raise ConfigError(f"distributed.process_id must be in [0, distributed.num_processes - 1], "
                      f"got {d.process_id}")


def _check_mesh(config: Config) -> None:
  m, mesh = config.model, config.mesh
  for axis in ("data", "fsdp", "tensor"):
    _at_least(f"mesh.{axis}", getattr(mesh, axis), 1)
  # The weights' axes each mesh axis shards (jaxoffload.nn.sharding.LOGICAL_RULES): a weight's
  # axis splits into equal shards only.
  heads = lambda key, count: (f"model.{key} x model.kv_channels ({count} x {m.head_dim})",
                              count * m.head_dim)
  sharded = {"fsdp": [(f"model.hidden_size ({m.hidden_size})", m.hidden_size)],
             "tensor": [(f"model.vocab_size ({m.vocab_size})", m.vocab_size),
                        (f"model.intermediate_size ({m.intermediate_size})", m.intermediate_size),
                        heads("num_attention_heads", m.num_attention_heads),
                        heads("num_query_groups", m.num_query_groups)]}
  for axis, sizes in sharded.items():
    ways = getattr(mesh, axis)
    indivisible = [name for name, size in sizes if size % ways]
    if indivisible:
      raise ConfigError(f"mesh.{axis}={ways} must divide {', '.join(indivisible)}: it shards "
                        f"those weights' axes")
