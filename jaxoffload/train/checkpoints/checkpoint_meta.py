"""Which checkpoint a path names, and what it ran with, read without the trainer: ``locate``
and ``read_meta`` (a ``meta`` item's step and resolved config, as ``checkpoints.save``
wrote it).

Example:
  >>> meta = read_meta(*locate("run/checkpoints"))   # Its newest step.
  >>> meta["step"], meta["config"]["model"]["num_layers"]
"""

from __future__ import annotations

import os
from typing import Any

import orbax.checkpoint as ocp

from jaxoffload.train.config import ConfigError


def locate(path: str) -> tuple[ocp.CheckpointManager, int]:
  """The manager and step of ``path``: a checkpoint directory (its newest step) or a step in one.

  Raises:
    ConfigError: naming the path, when it holds no checkpoint.
  """
  path = os.path.abspath(path)
  parent, name = os.path.split(path)
  if name.isdigit() and os.path.isdir(path):
    return ocp.CheckpointManager(parent), int(name)
  if not os.path.isdir(path):
    raise ConfigError(f"checkpoint {path!r} is not a directory")
  checkpoints = ocp.CheckpointManager(path)
  step = checkpoints.latest_step()
  if step is None:
    raise ConfigError(f"{path!r} holds no checkpoint")
  return checkpoints, step


def read_meta(checkpoints: ocp.CheckpointManager, step: int) -> dict[str, Any]:
  """The ``meta`` item of a step: ``{"step": ..., "config": {...}}``."""
  return checkpoints.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]


