"""Orbax checkpoints of a ``Trainer``: asynchronous saves, restored straight into its placements.

Orbax records no memory kind, so a restore reads into a target that names
each leaf's sharding and memory kind: offloaded state goes straight back to
host memory.
"""

from __future__ import annotations

import os
from typing import Optional

import jax
import orbax.checkpoint as ocp

from jaxoffload.train.config import Config
from jaxoffload.train.step import Trainer


def manager(config: Config) -> Optional[ocp.CheckpointManager]:
  """Orbax's manager of ``checkpoint.dir`` (the newest ``keep`` kept); None without a dir."""
  c = config.checkpoint
  if c.dir is None:
    return None
  options = ocp.CheckpointManagerOptions(max_to_keep=c.keep, enable_async_checkpointing=True)
  return ocp.CheckpointManager(os.path.abspath(c.dir), options=options)


def save(checkpoints: ocp.CheckpointManager, step: int, trainer: Trainer) -> None:
  """Starts an asynchronous save of the trainer's parameters and optimizer state."""
  tree = {"params": trainer.params, "opt_state": trainer.opt_state}
  if trainer.host is not None:
    tree["host"] = trainer.host.checkpoint()
  checkpoints.save(step, args=ocp.args.StandardSave(tree))


def restore(checkpoints: ocp.CheckpointManager, step: int, trainer: Trainer) -> None:
  """Loads step ``step``'s parameters and optimizer state into ``trainer``, in its placements."""
  like = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
  target = jax.tree.map(like, {"params": trainer.params, "opt_state": trainer.opt_state})
  if trainer.host is not None:
    target["host"] = trainer.host.checkpoint_target()
  restored = checkpoints.restore(step, args=ocp.args.StandardRestore(target))
  trainer.params, trainer.opt_state = restored["params"], restored["opt_state"]
  if trainer.host is not None:
    trainer.host.load(restored["host"])
