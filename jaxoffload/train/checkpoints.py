"""Orbax checkpoints of a ``Trainer``: asynchronous saves, restored straight into its placements.

A checkpoint holds four items: ``params`` (the whole parameter tree, whatever
was offloaded), ``opt_state``, ``host`` (the host kernel's moments, if any) and
``meta`` (the resolved config and the step, as JSON). Orbax records no memory
kind, so a restore reads into a target that names each leaf's sharding and
memory kind: offloaded state goes straight back to host memory. ``params``
alone can be read into any placement: to fine-tune from another run
(``checkpoint.init_from``) or to export (``python -m jaxoffload.export``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

import orbax.checkpoint as ocp

from jaxoffload.train.config import Config, ConfigError
from jaxoffload.train.step import Trainer


def manager(config: Config) -> Optional[ocp.CheckpointManager]:
  """Orbax's manager of ``checkpoint.dir`` (the newest ``keep`` kept); None without a dir."""
  c = config.checkpoint
  if c.dir is None:
    return None
  options = ocp.CheckpointManagerOptions(max_to_keep=c.keep, enable_async_checkpointing=True)
  return ocp.CheckpointManager(os.path.abspath(c.dir), options=options)


def save(checkpoints: ocp.CheckpointManager, step: int, trainer: Trainer) -> None:
  """Starts an asynchronous save of the trainer's state, its config and the step."""
  items = {name: ocp.args.StandardSave(tree) for name, tree in trainer.checkpoint().items()}
  meta = {"step": step, "config": dataclasses.asdict(trainer.setup.config)}
  checkpoints.save(step, args=ocp.args.Composite(meta=ocp.args.JsonSave(meta), **items))


def restore(checkpoints: ocp.CheckpointManager, step: int, trainer: Trainer) -> None:
  """Loads step ``step`` into ``trainer``, each leaf in the trainer's placement."""
  items = {name: ocp.args.StandardRestore(target)
           for name, target in trainer.checkpoint_target().items()}
  restored = checkpoints.restore(step, args=ocp.args.Composite(**items))
  trainer.load({name: restored[name] for name in items})


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


def restore_params(checkpoints: ocp.CheckpointManager, step: int, target: Any) -> Any:
  """Step ``step``'s parameter tree alone, read into ``target``'s shapes and placements."""
  restored = checkpoints.restore(
      step, args=ocp.args.Composite(params=ocp.args.StandardRestore(target)))
  return restored["params"]
