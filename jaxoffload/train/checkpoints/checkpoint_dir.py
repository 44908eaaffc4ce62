"""``checkpoint.dir`` before orbax opens it: made, claimed by one run, and its disk's room
for a checkpoint checked, with every process of a run agreeing.

Example:
  >>> claim = checkpoint_dir.claim(config)   # Refuses a directory another run holds.
  >>> checkpoint_dir.check_space(path, setup)  # Refuses a disk one checkpoint overfills.
"""

from __future__ import annotations

import math
import os
import shutil
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from jaxoffload.memory import size
from jaxoffload.train.checkpoints import claims
from jaxoffload.train.config import Config, ConfigError
from jaxoffload.train.setup import Setup


def made(path: str) -> str:
  """``checkpoint.dir`` as an absolute path, made where missing.

  Args:
    path: the directory, as configured.

  Returns:
    Its absolute path.

  Raises:
    ConfigError: naming it, when it is a file or cannot be made or written.
  """
  path = os.path.abspath(path)
  if os.path.exists(path) and not os.path.isdir(path):
    raise ConfigError(f"checkpoint.dir {path!r} is a file, not a directory")
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as error:
    raise ConfigError(f"checkpoint.dir {path!r} cannot be created: {error.strerror}") from None
  if not os.access(path, os.W_OK | os.X_OK):
    raise ConfigError(f"checkpoint.dir {path!r} is not writable")
  return path


def claim(config: Config) -> Optional[claims.Claim]:
  """Makes ``checkpoint.dir`` where missing and claims it for this run, before orbax opens
  it: process 0 holds the claim for every process of the run.

  Args:
    config: the run's config.

  Returns:
    The claim in process 0; None without a dir, and in the other processes.

  Raises:
    ConfigError: in every process, naming the directory when it is a file or cannot be
      written, or the run that holds it.
  """
  if config.checkpoint.dir is None:
    return None
  held, refusal = None, None
  try:
    directory = made(config.checkpoint.dir)
    if jax.process_index() == 0:
      held = claims.take(directory, "checkpoint.dir")
  except ConfigError as error:
    refusal = error
  _agree(refusal, "checkpoint.dir")
  return held


def bytes_per_element(setup: Setup) -> list[int]:
  """Per parameter leaf, the bytes a checkpoint holds of each element: the parameter and
  both moments, float32 for the host kernel's leaves and for 8-bit moments."""
  moment_bytes = sum(4 if d == "int8" else jnp.dtype(d).itemsize
                     for d in setup.moment_dtypes)
  shapes = jax.tree.leaves(setup.param_shapes)
  host = setup.offload.offloaded if setup.host_kernel else (False,) * len(shapes)
  return [12 if on_host else p.dtype.itemsize + moment_bytes for p, on_host in zip(shapes, host)]


def size_on_disk(setup: Setup) -> int:
  """About the bytes one checkpoint of ``setup``'s run writes, before compression."""
  return sum(math.prod(p.shape) * n for p, n in zip(jax.tree.leaves(setup.param_shapes),
                                                      bytes_per_element(setup)))


def check_space(directory: str, setup: Setup, step: Optional[int] = None,
                complete: Sequence[int] = ()) -> None:
  """Refuses a checkpoint that the disk of ``directory`` cannot hold: the run's first,
  before it trains (``step`` None), or step ``step``'s, before its save starts.

  Args:
    directory: ``checkpoint.dir``, made.
    setup: the run.
    step: the step about to be saved; None before training.
    complete: the steps whose checkpoints are complete, for the refusal.

  Raises:
    ConfigError: in every process, naming the directory, its free bytes and a
      checkpoint's; for a step, the complete checkpoints the run stops with.
  """
  free, need = shutil.disk_usage(directory).free, size_on_disk(setup)
  refusal = None
  if free < need:
    stops = ("free space there or choose another checkpoint.dir" if step is None else
             f"the run stopped; its complete checkpoints: steps {sorted(complete) or 'none'}: "
             "free space there, and the same command resumes")
    refusal = ConfigError(f"checkpoint.dir {directory!r} has {size(free)} free, less than "
                          f"{'one checkpoint of this run' if step is None else f'the checkpoint of step {step}'}"
                          f" needs ({size(need)}); {stops}")
  _agree(refusal, "checkpoint.dir")


def _agree(refusal: Optional[ConfigError], key: str) -> None:
  """Raises ``refusal`` here, and in every other process of the run where any refused:
  none goes on to wait for a process that stopped.

  Raises:
    ConfigError: this process's refusal, or one naming the process that refused.
  """
  if jax.process_count() > 1:
    agreed = np.asarray(multihost_utils.process_allgather(np.int32(refusal is None)))
    if refusal is None and not agreed.all():
      refusal = ConfigError(f"{key}: process {int(np.argmin(agreed))} of this run refused it "
                            f"(its line says why)")
  if refusal is not None:
    raise refusal
