"""A run's first weights: from a Hugging Face checkpoint, from another run, or random (None).

Both sources write each leaf straight into the run's placement, one leaf at a
time. Another run's checkpoint may have cut its layer stacks elsewhere (another
``cpu_offloading_num_layers``): ``reader.read_tree`` joins its stacks anew.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jaxoffload import hf
from jaxoffload.hf.config import CheckpointError
from jaxoffload.nn.model import Llama
from jaxoffload.nn.params import abstract_params
from jaxoffload.train import implied
from jaxoffload.train.checkpoints import checkpoint_meta, reader, saves as ckpt
from jaxoffload.train.config import ConfigError
from jaxoffload.train.loading import config_from_dict
from jaxoffload.train.setup import Setup


def initial(setup: Setup) -> Optional[Any]:
  """The first parameters ``setup`` names (``model.hf_checkpoint``, ``checkpoint.init_from``),
  placed as ``setup.initial_param_shardings`` says; None for a random start.

  Raises:
    ConfigError: one line naming the checkpoint and what is wrong with it.
  """
  c = setup.config
  if c.model.hf_checkpoint is not None:
    try:
      return hf.load_checkpoint(c.model.hf_checkpoint, config=setup.model, groups=setup.groups,
                                shardings=setup.initial_param_shardings)[1]
    except CheckpointError as error:
      raise ConfigError(str(error)) from None
  if c.checkpoint.init_from is not None:
    return from_run(setup, c.checkpoint.init_from)
  return None


def targets(shapes: Any, shardings: Any) -> Any:
  """``jax.ShapeDtypeStruct``s of ``shapes`` placed by ``shardings`` (one sharding for all, or
  a tree of them)."""
  if isinstance(shardings, jax.sharding.Sharding):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings),
                        shapes)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes,
                      shardings)


def run_params(path: str) -> tuple[Any, Any]:
  """Another run's checkpoint: its config, and its parameters in its own layer grouping, read
  onto the CPU."""
  checkpoints, step = checkpoint_meta.locate(path)
  config = config_from_dict(checkpoint_meta.read_meta(checkpoints, step)["config"])
  shapes = abstract_params(Llama(config.model.llama(), implied.layer_groups(config)),
                           jnp.zeros((1, 2), jnp.int32))
  cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
  # Read leaf by leaf: the host kernel's leaves are files of their own (train.host_checkpoint).
  return config, reader.read_tree(checkpoints, step, "params", ckpt.layer_ranges(config),
                                  targets(shapes, cpu))


def staging_bytes(setup: Setup) -> int:
  """Host bytes the first weights pass through on their way to their placement: the largest
  leaf shard of a Hugging Face checkpoint, or what ``reader.read_tree`` stages."""
  c = setup.config
  if c.model.hf_checkpoint is not None:
    return max(math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
               for x, s in zip(jax.tree.leaves(setup.param_shapes),
                               jax.tree.leaves(setup.param_shardings)))
  if c.checkpoint.init_from is not None or c.checkpoint.dir is not None:
    # Maybe resumed from checkpoint.dir, or started from another run.
    return reader.staging_bytes(setup.param_shapes, setup.model.num_layers)
  return 0  # Initialised on the devices.


def from_run(setup: Setup, path: str) -> Any:
  """The parameters of the run checkpointed in ``path``, in ``setup``'s grouping, dtypes and
  placements (``load_config`` gave ``setup`` that run's model shape)."""
  checkpoints, step = checkpoint_meta.locate(path)
  theirs = config_from_dict(checkpoint_meta.read_meta(checkpoints, step)["config"])
  return reader.read_tree(checkpoints, step, "params", ckpt.layer_ranges(theirs),
                          targets(setup.param_shapes, setup.initial_param_shardings))
