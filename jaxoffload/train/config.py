"""The trainer's configuration: typed sections with Megatron-Bridge's key names.

Each section is a frozen dataclass whose ``Attributes`` docstring documents its
keys; ``docs/config.md`` is generated from these docstrings
(``python -m jaxoffload.train.reference``). ``jaxoffload.train.loading`` reads
YAML and overrides into a ``Config``; ``jaxoffload.train.rules`` checks it.

This module holds what is trained (model, optimizer, train) and ``Config``; the
run's sections (data, eval, logging, mesh, distributed, checkpoint) live in
``jaxoffload.train.run_config`` and are re-exported here, so every section
imports from this module.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

from jaxoffload.nn import remat
from jaxoffload.nn.model import LlamaConfig
# Re-exported: every section imports from here.
from jaxoffload.train.run_config import (CheckpointConfig, DataConfig, DistributedConfig,
                                         EvalConfig, LoggingConfig, MeshConfig)


class ConfigError(ValueError):
  """A configuration the trainer refuses; the message names the key and what is allowed."""


@dataclasses.dataclass(frozen=True)
class ModelConfig(LlamaConfig):
  """``model.*``: the model's shape and numerics, and activation and weight offload.

  The shape and numerics are the fields of ``jaxoffload.nn.model.LlamaConfig``;
  the offload keys follow Megatron-Bridge. Its rules, in its words: activation
  offload with ``pipeline_model_parallel_size > 1`` ("Currently there is no
  support for Pipeline parallelism with CPU offloading"), with
  ``recompute_granularity`` ("CPU offloading does not work when activation
  recomputation is enabled"), with CUDA graphs ("CUDA graphs not supported with
  CPU offloading."), with fine-grained offload
  ("fine_grained_activation_offloading cannot be enabled with cpu_offloading.").

  Attributes:
    hf_checkpoint: a Hugging Face Llama checkpoint directory (``config.json`` and
      safetensors, as ``save_pretrained`` writes them) to start from: its config.json
      sets the model's shape (shape keys given beside it must agree), its weights the
      first parameters, its tokenizer.json the text's tokenizer.
    cpu_offloading: activation (and weight) offload, Megatron's master switch.
    cpu_offloading_num_layers: the first N layers offload; N in [0, num_layers - 1], with
      cpu_offloading (0 without it).
    cpu_offloading_activations: those layers send their named activations to pinned_host.
    cpu_offloading_weights: those layers' weights live in pinned_host and come to the
      device layer by layer, for the forward and again for the backward pass.
    cpu_offloading_double_buffering: the trainer, not XLA, moves the offloaded layers'
      activations: the model runs a program per layer, each layer's named activations
      go to pinned_host as its forward program ends and come back a layer ahead of its
      backward program, while the device computes the neighbouring layer; where their
      copy has not ended by then, the backward program reads them where they are. The
      device holds a layer's activations until its copy ends: on a link slower than the
      forward pass, more than two layers' (the planner counts them). False: XLA's remat
      policy moves them inside one program.
    cpu_offloading_policy: which named activations the offloaded layers send to
      pinned_host, the rest recomputed: a key of ``jaxoffload.nn.remat.OFFLOAD_PRESETS``
      (all, qkv, attention, mlp, qkv_mlp, matmuls, residual). A jaxoffload extension;
      why qkv: [performance](performance.md#activation-offload).
    recompute_granularity: null to save every activation for the backward pass;
      selective to recompute the attention kernel and the elementwise ops, saving the
      projections' outputs; full to recompute every layer's activations.
    fine_grained_activation_offloading: Megatron's module-level offload: not
      implemented (per-name policies cover it); True is refused.
    pipeline_model_parallel_size: must be 1: no pipeline parallelism; shard with mesh.*.
    cuda_graph_impl: local or transformer_engine: XLA's GPU command buffers (CUDA
      graphs) also capture loops and conditionals (set by ``python -m
      jaxoffload.train`` before JAX starts); none: XLA's defaults.
  """

  hf_checkpoint: Optional[str] = None
  cpu_offloading: bool = False
  cpu_offloading_num_layers: int = 0
  cpu_offloading_activations: bool = True
  cpu_offloading_weights: bool = False
  cpu_offloading_double_buffering: bool = False
  cpu_offloading_policy: str = remat.DEFAULT_OFFLOAD_PRESET
  recompute_granularity: Optional[str] = None
  fine_grained_activation_offloading: bool = False
  pipeline_model_parallel_size: int = 1
  cuda_graph_impl: str = "none"

  def llama(self) -> LlamaConfig:
    """The model's own config: this section without its offload keys."""
    return LlamaConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(LlamaConfig)})


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """``optimizer.*``: AdamW, its schedule and clipping, and optimizer offload.

  Attributes:
    lr: peak learning rate.
    min_lr: final learning rate.
    lr_warmup_iters: linear warm-up steps from 0.
    lr_decay_style: constant, linear or cosine decay after the warm-up.
    adam_beta1: AdamW's b1.
    adam_beta2: AdamW's b2.
    adam_eps: AdamW's eps.
    weight_decay: decoupled weight decay.
    clip_grad: global-norm gradient clipping (``optax.clip_by_global_norm``); 0: none.
      Without it, the host kernel can start a step's update during its backward pass.
    optimizer_cpu_offload: keep the optimizer state of part of the parameters in host
      memory (``jaxoffload.offload_adamw``, or the host kernel).
    optimizer_offload_fraction: with optimizer_cpu_offload (0.0 without it), the share of
      parameter elements whose state is offloaded, in [0.0, 1.0]: whole leaves, those whose
      share lies nearest, the weight-offloaded layers' first (the trainer logs the achieved
      share); or auto: the least share (in layer-sized steps) whose step fits this
      machine's device and host memory, compiled from shapes before anything is allocated,
      on the placement that adds least
      (``python -m jaxoffload.plan --offload-only`` shows the search).
    optimizer_offload_update_on: where offloaded state updates: device (moments
      streamed through the device in chunks), host (XLA's host computation, one core),
      host_kernel (ZeRO-Offload's split: the chosen leaves' float32 weights and moments
      live on the host and ``jaxoffload.host.adam``'s multi-threaded kernel updates them
      between device steps; needs numba), or auto, the default (the trainer times this
      machine's link and host kernel, prices device and host_kernel, each with the
      transfer dtype it would take (where the host kernel's update overlaps the next
      forward pass, its time under that pass costs nothing), takes the cheaper and
      prints why: ``jaxoffload.host.pricing``; 8-bit moments take host_kernel).
    overlap_cpu_optimizer_d2h_h2d: with optimizer_offload_update_on=device, true fetches
      each streamed piece of state while the previous one updates (double buffering, one
      more piece of device memory). With host_kernel, the model runs a program per layer
      and the host applies each layer's update just before the next step's forward pass
      reads it, while the device computes the layers before it: null (the default) does
      so wherever it can (with several micro-batches, gradient sums on the device:
      accumulate_offloaded_grads_on=device), true insists, false never does.
    speculate_cpu_optimizer_step: with that overlap and clipping, after a step whose
      gradients were not clipped, the host starts the next step's update during its
      backward pass, as if it would not clip either; a step that does clip has its
      update taken back and applied again, scaled (two more passes over the
      offloaded state that step): within a few float32 roundings of the plain
      update, and the same whatever the timing, so runs still repeat and resume
      exactly. Needs float32 moments (never with bfloat16 ones)
      ([performance](performance.md#optimizer-offload)).
    offload_transfer_dtype: with host_kernel, the dtype in which the device reads the
      offloaded weights and sends their clipped gradients: bfloat16 halves both copies
      for the leaves the model multiplies in bfloat16 (norm scales stay float32);
      needs model.dtype=bfloat16. auto, the default: bfloat16 where it may be, else
      float32.
    store_param_remainders: with offload_transfer_dtype=bfloat16 (Megatron-Core's name),
      the host kernel keeps each float32 master as the bfloat16 weight the device reads
      (2 bytes of pinned host memory an element) and the 16 bits it drops (2 bytes of
      host memory outside the pinned pool): the exact float32 master at 4 bytes, read
      and sent up in bfloat16. The device computes with the master rounded to nearest,
      ties away from zero (XLA's own cast rounds ties to even: they differ in one element
      in 65536, by one bfloat16 step). False: float32 weights in pinned memory, which the
      device reads and rounds itself, twice the bytes up.
    accumulate_offloaded_grads_on: with host_kernel and gradient accumulation, where
      the host kernel's leaves' gradients are summed over the micro-batches: host (a
      program per micro-batch; the model fetches their stacked weights a layer at a
      time and their gradients leave the device as they are made, so the device
      holds neither them nor their sums) or device (every leaf's gradients summed
      on the device, in grad_accum_dtype, and the host's update overlapping the
      device's work as overlap_cpu_optimizer_d2h_h2d says: faster where the sums
      fit; ``python -m jaxoffload.plan`` tries both).
    grad_accum_dtype: with gradient accumulation, the dtype of the device's sums of
      the gradients over micro-batches (DeepSpeed's name); null: float32. bfloat16
      halves their memory and rounds each addition stochastically, so that the sum
      stays the float32 sum on average, each addition off by less than one bfloat16
      step of the sum ([performance](performance.md#gradient-accumulation)).
    exp_avg_dtype: dtype of Adam's first moment, float32, bfloat16 or int8 (Megatron-Core's
      precision-aware optimizer); null: model.params_dtype. A bfloat16 moment of
      float32 parameters halves its memory, device or host, and is rounded
      stochastically (``jaxoffload.rounding``) so that training tracks float32
      ([performance](performance.md#compact-optimizer-state)). int8: 8-bit blockwise
      (torchao's AdamW8bit, bitsandbytes' 8-bit Adam): a byte an element and a float32
      scale per block of 256 elements of a row (``jaxoffload.optim.blockwise``), each element
      the nearest level; kept on the device, by the host kernel or with
      optimizer_offload_update_on=host, not streamed (device). The host kernel rounds
      and encodes as the device does, bit for bit.
    exp_avg_sq_dtype: the same for the second moment.
    main_params_dtype: dtype of the parameters the optimizer updates (Megatron-Core's
      name); null: model.params_dtype, which it must equal: jaxoffload keeps no second
      copy of the parameters (with float32 parameters the model computes in
      model.dtype). bfloat16 halves the parameters' memory and rounds each update
      stochastically (``jaxoffload.rounding.apply_updates``), as bfloat16 moments are;
      the host kernel does the same on the host (2 bytes an element, the smallest state).
    use_torch_optimizer_for_cpu_offload: there is no torch here: True is refused,
      naming optimizer_offload_update_on.
    use_distributed_optimizer: optimizer state sharded over the devices, which in
      JAX mesh.fsdp does for parameters, gradients and state alike: accepted with
      mesh.data = 1, refused with mesh.data > 1 (use mesh.fsdp).
  """

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
  optimizer_offload_fraction: Union[float, str] = 0.0
  optimizer_offload_update_on: str = "auto"
  overlap_cpu_optimizer_d2h_h2d: Optional[bool] = None
  speculate_cpu_optimizer_step: bool = True
  offload_transfer_dtype: str = "auto"
  store_param_remainders: bool = True
  accumulate_offloaded_grads_on: str = "host"
  grad_accum_dtype: Optional[str] = None
  exp_avg_dtype: Optional[str] = None
  exp_avg_sq_dtype: Optional[str] = None
  main_params_dtype: Optional[str] = None
  use_torch_optimizer_for_cpu_offload: bool = False
  use_distributed_optimizer: bool = False


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """``train.*``: steps, batch sizes, seed and where compiled programs are kept.

  Attributes:
    train_iters: steps.
    global_batch_size: sequences per step.
    micro_batch_size: sequences per forward pass; gradients accumulate over
      global_batch_size / micro_batch_size of them.
    seed: of the parameters and the synthetic data.
    host_memory_limit: the host memory this process may hold, in bytes or as a
      size such as 64GB or 60GiB; null: what the machine (MemAvailable) and the
      cgroup leave. A run that would need more is refused before it allocates.
    device_memory_limit: the device memory each device may use, in bytes or as a size
      such as 24GB; null: the device's own (a GPU's allocator limit). The trainer refuses a
      step whose compiled peak is above it before the first step, and the planner and the
      bench fit settings under it: a stand-in for a smaller GPU.
    fit: ``auto``: before the run, the planner's search (``python -m jaxoffload.plan``)
      picks the fastest setting of the optimizer offload, the activations and the
      micro-batch size that fits the device and the host, and the run says what it chose in
      one line; null: the config's own settings.
    per_layer_step: run every step as a program per piece of the model
      (``jaxoffload.train.per_layer.overlap``) even where nothing needs it, to compare it with
      the one-program step (the no-offload baseline included). The host kernel's
      overlapped update and cpu_offloading_double_buffering run so anyway.
    compilation_cache_dir: where compiled programs are kept for later runs and plans of
      the same shapes (JAX's persistent compilation cache); null: nowhere. A directory
      set by JAX_COMPILATION_CACHE_DIR comes first.
  """

  train_iters: int = 100
  global_batch_size: int = 8
  micro_batch_size: int = 8
  seed: int = 0
  host_memory_limit: Optional[Union[int, str]] = None
  device_memory_limit: Optional[Union[int, str]] = None
  fit: Optional[str] = None
  per_layer_step: bool = False
  compilation_cache_dir: Optional[str] = "~/.cache/jaxoffload/xla"


@dataclasses.dataclass(frozen=True)
class Config:
  """The whole configuration, one field per section."""

  model: ModelConfig = ModelConfig()
  optimizer: OptimizerConfig = OptimizerConfig()
  train: TrainConfig = TrainConfig()
  data: DataConfig = DataConfig()
  eval: EvalConfig = EvalConfig()
  logging: LoggingConfig = LoggingConfig()
  mesh: MeshConfig = MeshConfig()
  distributed: DistributedConfig = DistributedConfig()
  checkpoint: CheckpointConfig = CheckpointConfig()
