"""What must happen before JAX starts its backends (XLA flags, the pinned pool's size,
joining other processes) or compiles (where compiled programs are kept)."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Optional

import jax

from jaxoffload.train import host_memory
from jaxoffload.train.config import Config
from jaxoffload.train.implied import moment_dtypes
from jaxoffload.train.offload_choice import candidate_places, with_update_place
from jaxoffload.train.resolve import abstract_setup
from jaxoffload.train.setup import Setup

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


# The most bytes of compiled programs kept between runs; the least recently used go first.
COMPILATION_CACHE_BYTES = 16 * 2**30


def keep_compiled(config: Config) -> Optional[str]:
  """Turns on JAX's persistent compilation cache in ``train.compilation_cache_dir``, so that a
  later run or plan of the same shapes loads its programs instead of compiling them (the
  planner's verified pick among them); leaves a cache JAX was given already
  (``JAX_COMPILATION_CACHE_DIR``) as it was set. Every program is kept, however quickly it
  compiled: a step run a program per layer is many such programs, which together take
  most of its compile. Call before the first compile.

  Returns:
    The directory set, or None.
  """
  directory = config.train.compilation_cache_dir
  if directory is None or jax.config.jax_compilation_cache_dir:
    return None
  directory = os.path.expanduser(directory)
  jax.config.update("jax_compilation_cache_dir", directory)
  jax.config.update("jax_compilation_cache_max_size", COMPILATION_CACHE_BYTES)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  return directory


def size_pinned_pool(config: Config) -> Optional[int]:
  """Sizes XLA's pinned host pool of each GPU for ``config``'s run before JAX starts its
  backends: the arrays it holds at once (``host_memory.pinned_per_device``), an eighth
  more and room for its largest array again, in whole GiB
  (``host_memory.PINNED_POOL_VARIABLE``); for ``auto`` settings, the largest of what
  they may choose. The pool never gives memory back and grows by doubling regions up to
  its limit: sized so, it holds what the run pins and little more. Leaves a limit set by
  the user to it.

  Returns:
    The GiB set, or None.
  """
  global sized_pinned_pool_gib
  if host_memory.PINNED_POOL_VARIABLE in os.environ:
    return None
  pools = [_pool_bytes(abstract_setup(c)) for c in _choices(config)]
  if not max(pools):
    return None
  gib = math.ceil(max(pools) / 2**30)
  os.environ[host_memory.PINNED_POOL_VARIABLE] = str(gib)
  sized_pinned_pool_gib = gib
  return gib


def _choices(config: Config) -> list[Config]:
  """``config`` with each fraction and placement its ``auto`` settings may choose: the most
  offload for an auto fraction, each candidate placement for an auto one."""
  o = config.optimizer
  if not o.optimizer_cpu_offload:
    return [config]
  if o.optimizer_offload_fraction == "auto":
    config = dataclasses.replace(config, optimizer=dataclasses.replace(
        o, optimizer_offload_fraction=1.0))
  places = candidate_places(config, moment_dtypes(config))
  return [with_update_place(config, place) for place in places]


def _pool_bytes(setup: Setup) -> int:
  """The pinned pool ``setup``'s run needs: what it pins at once, an eighth more, and room
  for its largest array again (once the pool's regions are cut up, no region may hold a
  run of them as long as the largest array)."""
  pinned = host_memory.pinned_per_device(setup)
  if not pinned:
    return 0
  return int((1 + host_memory.PINNED_POOL_SLACK) * pinned
             + host_memory.largest_pinned_array(setup))


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
