"""Stopping a run between steps: SIGTERM (a scheduler taking the machine back) or SIGINT
(Ctrl-C) asks the run to end after the step in flight, with a checkpoint of that step.

A step of a large offloaded model takes seconds to minutes, and the steps since the last
save are lost to a plain kill; a scheduler sends SIGTERM first. A second Ctrl-C stops the
run at once (``KeyboardInterrupt``). Across several processes JAX's preemption service
(``jax.distributed``) takes SIGTERM, and the processes agree on the step to stop after
(orbax's ``reached_preemption``), so that they save together.

Example:
  >>> with StopRequests(checkpoints) as stop:
  ...   for step in range(1, config.train.train_iters + 1):
  ...     train_one(step)
  ...     signum = stop.asked(step)
  ...     if signum is not None:
  ...       save(step)
  ...       raise stopped(signum, step, config)
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any, Optional

import jax

from jaxoffload.train.config import Config

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stopped(Exception):
  """A run stopped by a signal between steps; its message says after which step and where
  its checkpoint is."""

  def __init__(self, message: str, signum: int):
    super().__init__(message)
    self.signum = signum


class StopRequests:
  """Catches SIGTERM and SIGINT while a run's steps run, as requests to stop after the step
  in flight.

  Args:
    checkpoints: the run's orbax manager (None: none), whose ``reached_preemption`` tells
      a process of several when JAX's preemption service was asked to stop.
  """

  def __init__(self, checkpoints: Any = None):
    self.checkpoints = checkpoints
    self.signum: Optional[int] = None
    self._previous: dict = {}

  def __enter__(self) -> "StopRequests":
    # Signal handlers belong to the main thread; several processes stop by JAX's service.
    if threading.current_thread() is threading.main_thread() and jax.process_count() == 1:
      self._previous = {signum: signal.signal(signum, self._ask) for signum in SIGNALS}
    return self

  def __exit__(self, *_) -> None:
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)

  def _ask(self, signum: int, _frame) -> None:
    self.signum = signum
    if signum == signal.SIGINT:
      signal.signal(signal.SIGINT, signal.default_int_handler)
    again = " (Ctrl-C again stops at once)" if signum == signal.SIGINT else ""
    os.write(2, f"\n{signal.Signals(signum).name}: stopping after this step{again}\n".encode())

  def asked(self, step: int) -> Optional[int]:
    """The signal that asked the run to stop, after step ``step``; None if none."""
    if (self.signum is None and self.checkpoints is not None and jax.process_count() > 1
        and self.checkpoints.reached_preemption(step)):
      self.signum = signal.SIGTERM
    return self.signum


def stopped(signum: int, step: int, config: Config) -> Stopped:
  """The ``Stopped`` of a run ``signum`` stopped after ``step``, its checkpoint saved there
  where the run has a ``checkpoint.dir``."""
  c = config.checkpoint
  if c.dir is None:
    saved = "nothing saved (checkpoint.dir is not set)"
  else:
    resume = "" if c.resume else " with checkpoint.resume=True"
    saved = f"saved a checkpoint of step {step} in {c.dir}: the same command{resume} resumes it"
  return Stopped(f"stopped by {signal.Signals(signum).name} after step {step} of "
                 f"{config.train.train_iters}; {saved}", signum)
