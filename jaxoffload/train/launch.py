"""What must happen before JAX starts its backends: XLA flags, the pinned pool's size, and
joining other processes."""

from __future__ import annotations

import math
import os
from typing import Optional

import jax

from jaxoffload.train import host_memory
from jaxoffload.train.config import Config
from jaxoffload.train.resolve import abstract_setup

# The pinned pool's size in GiB that size_pinned_pool set for this process, if it did.
sized_pinned_pool_gib: Optional[int] = None

# Megatron's CUDA graphs, in XLA's terms: command buffers that capture loops and
# conditionals too, not only XLA's default kernels and library calls.
COMMAND_BUFFER_FLAG = ("--xla_gpu_enable_command_buffer="
                       "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL")


def set_xla_flags(config: Config) -> None:
  """Adds the XLA flags the config asks for; they act only if JAX has not started its backends."""
  if config.model.cuda_graph_impl != "none":
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {COMMAND_BUFFER_FLAG}".strip()


def size_pinned_pool(config: Config) -> Optional[int]:
  """Sizes XLA's pinned host pool of each GPU for ``config``'s run before JAX starts its
  backends: the arrays it holds at once (``host_memory.pinned_per_device``), an eighth
  more and room for its largest array again, in whole GiB
  (``host_memory.PINNED_POOL_VARIABLE``). The pool never gives memory
  back and grows by doubling regions up to its limit: sized so, it holds what the run
  pins and little more. Leaves a limit set by the user, and a config whose ``auto``
  settings only the machine decides, to XLA's default.

  Returns:
    The GiB set, or None.
  """
  global sized_pinned_pool_gib
  if host_memory.PINNED_POOL_VARIABLE in os.environ:
    return None
  try:
    setup = abstract_setup(config)
  except ValueError:  # auto: decided once the machine is measured.
    return None
  pinned = host_memory.pinned_per_device(setup)
  if not pinned:
    return None
  # The pool hands out runs of its regions; once they are cut up, no region may hold a run
  # as long as the largest array: room for one more of it.
  gib = math.ceil(((1 + host_memory.PINNED_POOL_SLACK) * pinned
                   + host_memory.largest_pinned_array(setup)) / 2**30)
  os.environ[host_memory.PINNED_POOL_VARIABLE] = str(gib)
  sized_pinned_pool_gib = gib
  return gib


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
