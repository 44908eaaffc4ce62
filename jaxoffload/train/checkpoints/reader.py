"""Reading a checkpoint's trees into any setting: leaf by leaf, regrouped, cast and placed.

A checkpoint's ``params``, ``mu`` and ``nu`` are trees of the parameters'
structure in the layer grouping of the run that wrote them. ``read_tree`` reads
one into another run's grouping (another ``cpu_offloading_num_layers``, weights
offload), dtypes and placements, one leaf at a time: a leaf whose layers the
two groupings cut alike goes straight into its placement; one they cut
differently is joined from the saved stacks in host memory first. The host
stages one leaf and the saved stacks it is cut from at a time (``staging_bytes``),
whatever the model's size.
"""

from __future__ import annotations

import functools
import math
import operator
import os
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxoffload.nn.params import group_layers
from jaxoffload.optim.offload_plan import leaf_path
from jaxoffload.train.checkpoints import host_checkpoint


def read_tree(checkpoints: ocp.CheckpointManager, step: int, item: str,
              saved_groups: Sequence[range], targets: Any) -> Any:
  """Item ``item`` of step ``step``, saved with the layer groups ``saved_groups``, read into
  ``targets`` (a tree of ``jax.ShapeDtypeStruct``s in the new grouping).

  Returns:
    ``targets``' tree: each leaf a placed array, or where a target's sharding is
    None, a function that reads that leaf into a numpy array when called.

  Example:
    >>> params = read_tree(checkpoints, 100, "params", [range(0, 11), range(11, 22)],
    ...                    targets)
  """

  def read(key_path, target):
    keys = tuple(leaf_path(key_path).split("/"))
    pieces = _pieces(keys, target.shape, saved_groups)
    if target.sharding is None:
      return functools.partial(_joined, checkpoints, step, item, pieces, target.dtype)
    if pieces == [Piece(keys, None, target.shape)]:
      return _restore(checkpoints, step, item, keys, target)
    values = _joined(checkpoints, step, item, pieces, target.dtype)
    return jax.make_array_from_callback(target.shape, target.sharding, lambda i: values[i])

  return jax.tree_util.tree_map_with_path(read, targets)


def staging_bytes(targets: Any, num_layers: int) -> int:
  """The most host bytes ``read_tree`` stages at once for ``targets`` of a ``num_layers``
  model: one leaf, and beside it the saved stacks it is cut from, which hold at most every
  layer (float32 at most)."""
  def most(path, target) -> int:
    saved = target.shape if group_layers(path[0].key) is None else (
        (num_layers,) + tuple(target.shape[1:]))
    return (math.prod(target.shape) + math.prod(saved)) * 4

  return max(jax.tree.leaves(jax.tree_util.tree_map_with_path(most, targets)), default=0)


class Piece(NamedTuple):
  """Where some of a leaf's values lie in a checkpoint.

  Attributes:
    keys: the saved leaf's path.
    rows: the rows of the saved leaf to take; None: all of it, as it is.
    shape: the saved leaf's shape.
  """

  keys: tuple[str, ...]
  rows: Optional[slice]
  shape: tuple[int, ...]


def _pieces(keys: tuple[str, ...], shape: tuple[int, ...], saved_groups: Sequence[range]
            ) -> list[Piece]:
  """The pieces of the checkpoint that make up the leaf at ``keys`` of ``shape``, in order."""
  layers = group_layers(keys[0])
  if layers is None or layers in saved_groups:
    return [Piece(keys, None, tuple(shape))]
  pieces = []
  for saved in saved_groups:
    start, stop = max(saved.start, layers.start), min(saved.stop, layers.stop)
    if start < stop:
      pieces.append(Piece((f"layers_{saved.start}_{saved.stop}",) + keys[1:],
                          slice(start - saved.start, stop - saved.start),
                          (len(saved),) + tuple(shape[1:])))
  return pieces


def _joined(checkpoints, step, item, pieces: Sequence[Piece], dtype) -> np.ndarray:
  """A leaf as a numpy array in ``dtype``, its pieces read from the checkpoint and joined."""
  parts = []
  for piece in pieces:
    values = _restore(checkpoints, step, item, piece.keys,
                      jax.ShapeDtypeStruct(piece.shape, dtype))
    parts.append(values if piece.rows is None else values[piece.rows])
  return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _restore(checkpoints, step, item, keys: tuple[str, ...],
             target: jax.ShapeDtypeStruct) -> jax.Array | np.ndarray:
  """One saved leaf in ``target``'s dtype: placed by its sharding, or numpy without one."""
  saved = host_checkpoint.saved_file(os.path.join(os.fspath(checkpoints.directory), str(step)),
                                     item, keys)
  if saved is not None:  # The host kernel's, mapped: read a shard at a time.
    values = np.load(saved, mmap_mode="r")
    # Copied out of the read-only map: the CPU backend may keep using a numpy array's
    # memory, and the host kernel writes its arrays in place.
    if target.sharding is None:
      return np.array(values, target.dtype)
    return jax.make_array_from_callback(target.shape, target.sharding,
                                        lambda index: np.array(values[index], target.dtype))
  nest: Callable[[Any], Any] = lambda leaf: functools.reduce(lambda tree, k: {k: tree},
                                                             reversed(keys), leaf)
  args = (ocp.RestoreArgs(restore_type=np.ndarray, dtype=target.dtype)
          if target.sharding is None else
          ocp.ArrayRestoreArgs(sharding=target.sharding, dtype=target.dtype,
                               global_shape=target.shape))
  restored = checkpoints.restore(step, args=ocp.args.Composite(**{item: ocp.args.PyTreeRestore(
      item=nest(target), restore_args=nest(args), partial_restore=True)}))[item]
  return functools.reduce(operator.getitem, keys, restored)
