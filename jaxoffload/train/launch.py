"""What must happen before JAX starts its backends: XLA flags, and joining other processes."""

from __future__ import annotations

import math
import os

import jax

from jaxoffload.memory import parse_bytes
from jaxoffload.train.config import Config

# Megatron's CUDA graphs, in XLA's terms: command buffers that capture loops and
# conditionals too, not only XLA's default kernels and library calls.
COMMAND_BUFFER_FLAG = ("--xla_gpu_enable_command_buffer="
                       "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL")


# XLA's pinned host pool on GPUs stops at 64 GB unless told otherwise.
PINNED_POOL_VARIABLE = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"


def set_xla_flags(config: Config) -> None:
  """Adds the XLA flags the config asks for, and lets XLA's pinned host pool grow to the host
  memory the run may use (the host-memory guard, not the pool's default cap, decides what
  fits); they act only if JAX has not started its backends."""
  if config.model.cuda_graph_impl != "none":
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {COMMAND_BUFFER_FLAG}".strip()
  if PINNED_POOL_VARIABLE not in os.environ:
    limit = config.train.host_memory_limit
    size = parse_bytes(limit) if limit is not None else _memory_total()
    if size:
      os.environ[PINNED_POOL_VARIABLE] = str(math.ceil(size / 2**30))


def _memory_total() -> int | None:
  """The machine's memory in bytes (MemTotal), None where it does not say."""
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemTotal:"):
          return int(line.split()[1]) * 1024
  except (OSError, ValueError, IndexError):
    pass
  return None


def start_processes(config: Config) -> None:
  """Joins this process to the others with ``jax.distributed.initialize`` when the config asks.

  Must run before JAX starts its backends. On CPUs the processes exchange data
  through gloo.
  """
  d = config.distributed
  if not d.initialize:
    return
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=d.coordinator_address,
                             num_processes=d.num_processes, process_id=d.process_id)
