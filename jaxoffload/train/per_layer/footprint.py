"""What a step a program per piece of the model holds on one device beside its parameters and
optimizer state, tallied from its programs' shapes as ``OverlappedStep.compile`` traces them.

XLA's memory analysis sees one program at a time; between programs the step holds what the
forward programs keep for the backward ones, the weights brought from host memory, the
gradients on their way there and, with several micro-batches, the gradients' sums.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import jax
import numpy as np

from jaxoffload.train.per_layer.moved import PROGRAMS_AHEAD
from jaxoffload.train.per_layer.offloaded_layers import offloaded_group_bytes
from jaxoffload.train.per_layer.pieces import PiecePrograms


def _nbytes(arrays) -> int:
  """Bytes on one device of ``arrays`` (arrays or shapes with shardings)."""
  return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in arrays)


class HeldBytes:
  """Tallies a step's programs, given in the order they run, into the bytes held between them.

  Example:
    >>> held = HeldBytes(piece)
    >>> for key, static, args, out in programs: held.record(key, static, args, out)
    >>> held.total(device_leaves)
  """

  def __init__(self, piece: PiecePrograms):
    self.piece = piece
    self.saved, self.fetched, self.moved = [], [], []
    self._heads = 0

  def record(self, key: str, static: tuple, args: tuple, out: Any) -> None:
    """Counts what program ``key`` (with its static and other arguments, and outputs'
    shapes) leaves on the device for later programs. Only the first micro-batch's forward
    programs count: every micro-batch keeps alike, and lets go before the next."""
    if key.startswith("head"):
      self._heads += 1
    first = not self._heads
    if first and key == "embed forward":
      self.saved.append(_nbytes(jax.tree.leaves(out[1])))
    if first and key.startswith("forward"):
      # What the step moves to host memory is on the device for two layers where the link
      # keeps up (more where it is behind, ``train.per_layer.moved``): the one leaving, and the one
      # coming back ahead of its backward program.
      name = static[0]
      (self.moved if name in self.piece.moved else self.saved).append(
          _nbytes(jax.tree.leaves(out[1])))
      if self.piece.layouts[name].takes_input:
        self.saved.append(_nbytes([args[-1]]))
    if key.startswith("fetch"):
      self.fetched.append(_nbytes(jax.tree.leaves(out)))

  def total(self, device_leaves: list) -> int:
    """The bytes the step holds beside the parameters and state: what a micro-batch's forward
    programs keep for the backward ones (the layers' inputs and activations, the host
    kernel's weights; a weight-offloaded group's, a few layers' at a time), the host kernel's
    gradients on their way to host memory (two pieces' at most), and the device leaves'
    gradients, which with several micro-batches the last micro-batch's backward programs
    make from the gradients' sums a piece at a time (the larger of the two, and one piece
    of both where they cross)."""
    piece = self.piece
    # The host kernel's gradients stay on the device until their copy ends: a program's
    # and the one before's at most.
    sent = self._per_piece(lambda dtype, host: 0 if host is None else piece.wire[host].itemsize)
    # A weight-offloaded layer is sent as Python dispatches the program before the one that
    # reads it, up to PROGRAMS_AHEAD programs ahead of the device: the layers of the program
    # running, of those queued, and of the one sent.
    sent_ahead = offloaded_group_bytes(piece.programs.setup)[0]
    kept = (sum(self.saved) + sum(self.fetched) + (PROGRAMS_AHEAD + 2) * sent_ahead
            + 2 * max(self.moved, default=0) + 2 * max(sent.values()))
    # The device leaves' gradients, but a layer's of a group the backward pass updates a
    # layer at a time (``train.per_layer.offloaded_layers``).
    by_layer = {i: piece.layer_groups[name] for name in piece.updated_by_layer
                for i in piece.device_ids[name]}
    grads = sum(_nbytes([x]) // ((by_layer[i].stop - by_layer[i].start) if i in by_layer else 1)
                for i, x in enumerate(device_leaves))
    if piece.micro_batches == 1:
      return kept + grads
    # Per piece, its sums of every leaf's gradients and its device leaves' gradients.
    setup = piece.programs.setup
    accumulated = setup.grad_accum_dtype.itemsize
    sums = accumulated * sum(math.prod(sharding.shard_shape(x.shape)) for x, sharding in zip(
        jax.tree.leaves(setup.param_shapes), jax.tree.leaves(setup.param_shardings)))
    pieces = self._per_piece(
        lambda dtype, host: accumulated + (0 if host is not None else dtype.itemsize))
    return kept + max(sums, grads) + max(pieces.values())

  def _per_piece(self, element_bytes: Callable[[np.dtype, Optional[int]], int]
                 ) -> dict[str, int]:
    """Per piece of the model (a layer of a group's leaves, or a whole parameter), by name:
    the bytes on one device of its leaves' elements at ``element_bytes(the leaf's dtype, its
    position among the host kernel's leaves, or None)`` each."""
    setup = self.piece.programs.setup
    pieces, hosts = {}, 0
    paths, _ = jax.tree_util.tree_flatten_with_path(setup.param_shapes)
    for (path, x), sharding, host in zip(paths, jax.tree.leaves(setup.param_shardings),
                                         self.piece.programs.is_host):
      name = path[0].key
      elements = math.prod(sharding.shard_shape(x.shape)) // (
          x.shape[0] if name in self.piece.layer_groups else 1)
      pieces[name] = pieces.get(name, 0) + elements * element_bytes(
          x.dtype, hosts if host else None)
      hosts += host
    return pieces
