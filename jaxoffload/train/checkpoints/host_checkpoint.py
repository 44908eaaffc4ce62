"""The host kernel's leaves in a checkpoint, written a few rows at a time from the live state.

A checkpoint holds each leaf's float32 parameter and moments (``checkpoints``). Orbax
copies a tree whole before it writes it: for the host kernel's leaves that copy is 12
bytes an element in float32, more than the host keeps beside the state of a model that
needs the host kernel at all. This item (``host``) writes them instead as ``.npy``
files, ``host/<params|mu|nu>/<leaf path, dotted>.npy``, each filled a few rows at a
time (split masters joined, 8-bit moments decoded), so a save adds about
``CHUNK_BYTES`` to the host's memory. ``reader`` reads them, memory-mapped, where it
reads orbax's leaves; the item sits in orbax's temporary step directory until the
whole step is written, as every other item does.

Example:
  >>> items = {"host": HostLeavesSave({"embed.embedding": HostLeaf(shape, rows)})}
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Callable, NamedTuple, Optional

import numpy as np
import orbax.checkpoint as ocp

ITEM = "host"
NAMES = ("params", "mu", "nu")
# The float32 bytes of one piece a save writes at once, per name.
CHUNK_BYTES = 64 * 2**20
# What a save holds at once: a piece, and the temporaries that join or decode it.
SAVE_BYTES = 4 * CHUNK_BYTES


class HostLeaf(NamedTuple):
  """One host kernel leaf as a save writes it.

  Attributes:
    shape: the whole leaf's shape.
    rows: ``rows(name, first_axis_slice)``: the float32 values of those rows of the
      leaf's ``params``, ``mu`` or ``nu`` (every row at once where the leaf has fewer
      than two axes: 8-bit moments keep one row of scales for such a leaf).
  """

  shape: tuple[int, ...]
  rows: Callable[[str, slice], np.ndarray]


def file_name(keys: tuple[str, ...]) -> str:
  """A leaf's file in its name's directory."""
  return ".".join(keys) + ".npy"


class HostLeavesHandler(ocp.CheckpointHandler):
  """Writes ``HostLeavesSave``'s leaves; ``reader`` reads them (``saved_file``)."""

  def save(self, directory, args: "HostLeavesSave") -> None:
    for name in NAMES:
      os.makedirs(os.path.join(directory, name), exist_ok=True)
    for path, leaf in args.leaves.items():
      step = _rows_a_chunk(leaf.shape)
      for name in NAMES:
        target = os.path.join(directory, name, file_name(tuple(path.split("/"))))
        out = np.lib.format.open_memmap(target, mode="w+", dtype=np.float32, shape=leaf.shape)
        rows = leaf.shape[0] if leaf.shape else 1
        for start in range(0, rows, step):
          part = slice(start, min(start + step, rows))
          out[part if leaf.shape else ...] = leaf.rows(name, part)
        out.flush()
        del out

  def restore(self, directory, args: Any = None) -> str:
    """The item's directory: ``reader`` maps its files one leaf at a time."""
    return os.fspath(directory)


@ocp.args.register_with_handler(HostLeavesHandler, for_save=True, for_restore=True)
@dataclasses.dataclass
class HostLeavesSave(ocp.args.CheckpointArgs):
  """The ``host`` item's save: per leaf path (``"layers_0_4/attention/q/kernel"``), a
  ``HostLeaf``."""

  leaves: dict[str, HostLeaf]


def saved_file(step_dir: str, item: str, keys: tuple[str, ...]) -> Optional[str]:
  """The ``.npy`` file holding leaf ``keys`` of ``item`` in a step, where this item holds it."""
  path = os.path.join(step_dir, ITEM, item, file_name(keys))
  return path if os.path.isfile(path) else None


def _rows_a_chunk(shape: tuple[int, ...]) -> int:
  """How many rows of a leaf of ``shape`` one piece holds: every row where it has fewer than
  two axes."""
  if len(shape) < 2:
    return max(shape[0] if shape else 1, 1)
  return max(1, CHUNK_BYTES // (4 * math.prod(shape[1:])))
