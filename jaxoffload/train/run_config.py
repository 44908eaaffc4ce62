"""The trainer's run sections: its data, evaluation, logging, mesh, processes and checkpoints.

These say how a run is fed, watched, spread over devices and hosts, and saved,
not what it trains (``jaxoffload.train.config`` holds the model, optimizer and
train sections, and ``Config``, which re-exports these). Like those, each is a
frozen dataclass whose ``Attributes`` docstring is its part of ``docs/config.md``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """``data.*``: where the training tokens come from.

  Every batch is a function of train.seed and the step, so a resumed run sees
  the same tokens as an uninterrupted one.

  Attributes:
    dataset: synthetic (counting sequences: the loss falls fast) or text.
    path: with dataset=text, a text file, a JSONL file (one document per line), or a
      directory or glob of them; tokenized once and cached in .jaxoffload_cache/ beside
      it; null: the corpus shipped with jaxoffload (fixed, so loss curves compare across
      versions).
    tokenizer: a tokenizer.json, or a directory holding one; null: model.hf_checkpoint's
      if it has one, else UTF-8 bytes (needs model.vocab_size >= 256).
    text_field: the field of each JSONL line that holds its text.
    eos_token: the token put between documents; null: the eos_token of the
      tokenizer_config.json beside the tokenizer (id 0 for bytes).
  """

  dataset: str = "synthetic"
  path: Optional[str] = None
  tokenizer: Optional[str] = None
  text_field: str = "text"
  eos_token: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """``eval.*``: held-out loss and perplexity during training.

  Attributes:
    interval: steps between evaluations (and one at the last step); 0: none.
    iters: held-out batches of train.micro_batch_size sequences per evaluation.
    fraction: the share of the text held out, cut at a document boundary (synthetic
      data draws its held-out batches from a stream of their own).
  """

  interval: int = 0
  iters: int = 10
  fraction: float = 0.05


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
  """``logging.*``: the progress line and the per-step JSONL record.

  MFU counts the model's matmul and attention FLOPs against the chip's dense
  peak (``jaxoffload.train.metrics.PEAK_FLOPS``); null on devices not listed.

  Attributes:
    log_interval: steps between progress lines; 0: ten a run.
    jsonl: a file to append one JSON record per step to (step, loss, step_s,
      tokens_per_s, mfu, learning_rate, grad_norm, peak_device_bytes, pinned_host_bytes,
      host_rss_bytes, and eval_loss and eval_perplexity at evaluations).
    progress_bar: on a terminal, one progress line redrawn in place; false: a line
      each log_interval without the bar.
    tensorboard_dir: a directory for TensorBoard event files of the same figures
      (needs tensorboardX: pip install 'jaxoffload[metrics]').
    profile_dir: a directory for a ``jax.profiler`` trace of profile_steps steps from
      profile_start_step (TensorBoard's or Perfetto's trace viewer reads it); the host
      kernel's updates show in it as "HostAdamW update", with their leaf and layer.
    profile_start_step: the first step traced.
    profile_steps: how many steps are traced.
  """

  log_interval: int = 0
  jsonl: Optional[str] = None
  progress_bar: bool = True
  tensorboard_dir: Optional[str] = None
  profile_dir: Optional[str] = None
  profile_start_step: int = 3
  profile_steps: int = 3


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """``mesh.*``: devices along each mesh axis.

  The batch is sharded over data and fsdp, weights over fsdp, heads, MLP and
  vocabulary over tensor (``jaxoffload.nn.sharding.LOGICAL_RULES``).

  Attributes:
    data: data-parallel devices.
    fsdp: devices that shard parameters, gradients and optimizer state; divides
      model.hidden_size.
    tensor: tensor-parallel devices; divides model.vocab_size, model.intermediate_size,
      and the query and the key/value heads' widths (heads x kv_channels).
  """

  data: int = 1
  fsdp: int = 1
  tensor: int = 1


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
  """``distributed.*``: one process per host, joined by ``jax.distributed.initialize``.

  How to run across hosts: [multihost.md](multihost.md).

  Attributes:
    initialize: call jax.distributed.initialize before anything else.
    coordinator_address: host:port of process 0, the same on every process; null:
      detected on clusters JAX knows (SLURM, Open MPI, TPU pods, Kubernetes).
    num_processes: how many processes; null: detected.
    process_id: this process's index in [0, num_processes - 1]; null: detected.
  """

  initialize: bool = False
  coordinator_address: Optional[str] = None
  num_processes: Optional[int] = None
  process_id: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """``checkpoint.*``: orbax checkpoints of parameters and optimizer state.

  A run that stops on a NaN or infinite loss saves nothing more and names the
  newest good checkpoint. SIGTERM (a scheduler's) or Ctrl-C stops a run after the
  step in flight and saves that step (a second Ctrl-C stops it at once); the
  command exits with 128 plus the signal's number.

  Attributes:
    dir: where orbax writes checkpoints (asynchronously); null: none. A run whose dir has
      less free space than one checkpoint (parameters and both moments) is refused before
      it trains; a save that fails stops the run in one line naming the complete steps.
    save_interval: steps between saves; the last step is always saved.
    keep: how many of the newest checkpoints to keep.
    resume: continue from the newest checkpoint in dir, under any offload setting of
      the same model: another optimizer_offload_fraction or update placement,
      activation or weights offload, moment dtypes; each leaf is read straight into
      its new placement. A step that cannot be read is renamed STEP.unreadable (never
      deleted) and the one before it resumed.
    init_from: another run's checkpoint directory (its newest step) or one step in it
      to take the first weights from, with a fresh optimizer state; a checkpoint to
      resume from in dir comes first.
  """

  dir: Optional[str] = None
  save_interval: int = 100
  keep: int = 3
  resume: bool = True
  init_from: Optional[str] = None
