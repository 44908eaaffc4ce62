"""Compiling steps for their device peak alone, several at once, for the searches that
judge settings by XLA's memory analysis.

XLA compiles without holding Python's lock, so a few threads compile a few steps in about
the time of one: ``Peaks`` lets a search ask for the steps it will likely judge next while
it waits for the one it judges now. These compiles skip autotuning: it would time kernels
on the device, under the other compiles' load, and keep its picks for the process's own
step; what it picks changes the step's buffers little (a matrix product's workspace),
within the search's headroom (``ladder.DEVICE_HEADROOM``).
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

from jaxoffload.train.config import Config
from jaxoffload.train.setup import Setup
from jaxoffload.train.step import Trainer

# Each compile also uses a few threads of its own (LLVM's).
_CORES_PER_COMPILE = 4
_MOST_WORKERS = 4


def workers() -> int:
  """How many programs to compile at once on this machine: 1 on a small one."""
  return max(1, min(_MOST_WORKERS, (os.cpu_count() or 1) // _CORES_PER_COMPILE))


ANALYSIS_ONLY = {"xla_gpu_autotune_level": 0}


def step_peaks(setup: Setup) -> tuple[int, ...]:
  """XLA's device peak of each phase of ``setup``'s step (``CompiledStep.phase_bytes``; the
  step's, for one program), compiled from shapes alone, without autotuning."""
  compiled = Trainer.from_shapes(setup).compile(setup.batch_shape,
                                                compiler_options=ANALYSIS_ONLY)
  return compiled.phase_bytes or (compiled.device_bytes,)


class Peaks:
  """Steps' device peaks by phase (``step_peaks``), each config's compiled once (settings
  named by other overrides share it), ``workers`` at a time.

  ``ask`` starts a compile and returns; ``get`` waits for one (asking for it first). A search
  asks ahead only where ``workers`` > 1: with one thread a step asked for ahead would delay
  the one it needs next. Use it as a context manager: leaving cancels what was asked for and
  not started, and waits for what was, so that no compile outlives the search.

  Example:
    >>> with Peaks() as peaks:
    ...   peaks.ask(setup_b)
    ...   fits = max(peaks.get(setup_a)) <= budget
  """

  def __init__(self, threads: Optional[int] = None):
    self.workers = threads or workers()
    self._pool = ThreadPoolExecutor(self.workers)
    self._futures: dict[Config, Future] = {}

  def __enter__(self) -> "Peaks":
    return self

  def __exit__(self, *exc) -> None:
    self._pool.shutdown(wait=True, cancel_futures=True)

  def ask(self, setup: Setup) -> None:
    """Starts compiling ``setup``'s step unless its config's was asked for before."""
    if setup.config not in self._futures:
      self._futures[setup.config] = self._pool.submit(step_peaks, setup)

  def get(self, setup: Setup) -> tuple[int, ...]:
    """The device peak of each phase of ``setup``'s step, compiled (once)."""
    self.ask(setup)
    return self._futures[setup.config].result()
