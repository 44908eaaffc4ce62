"""One step's update held by piece, applied a piece at a time by the caller or by a thread.

``HostAdamW.hold`` keeps a step's gradients in a ``HeldUpdate`` so that each
piece (a leaf, or one layer of a leaf stacked over layers) is applied just
before the device program that reads it is dispatched. Given an order, a
thread applies the pieces in that order from the start, and ``apply`` only
waits for them: the caller's thread stays free to dispatch device programs.

Example:
  >>> held = HeldUpdate(grads, apply_piece, clip_factor, order=pieces, executor=pool)
  >>> held.apply([(0, 0)])  # Before dispatching the program that reads layer 0.
  >>> held.apply()          # True: every piece is applied.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import jax

from jaxoffload import host_arrays

# A leaf's index, and a layer's index along axis 0 of a stacked leaf (None: all of it).
Piece = tuple[int, Optional[int]]
# Applies one piece's gradient (a host array, or a sum's shards) times a scale.
ApplyPiece = Callable[[Piece, Any, float], None]


class HeldUpdate:
  """A step's gradients by piece, each applied once by ``apply_piece(piece, grad, scale)``.

  Args:
    grads: per piece, its gradient in host memory.
    apply_piece: applies one piece's gradient, multiplied by ``scale`` (a float).
    grad_scale: the gradients' scale (global-norm clipping's factor), a float or
      a scalar JAX array, read once it is ready.
    order: every piece of ``grads``, in the order they will be asked for: a
      thread of ``executor`` then applies them in that order.
    executor: the thread that applies them, with ``order``.

  Raises:
    ValueError: when ``order`` does not list each piece of ``grads`` once.
  """

  def __init__(self, grads: Mapping[Piece, jax.Array], apply_piece: ApplyPiece,
               grad_scale: Union[float, jax.Array] = 1.0, *,
               order: Optional[Sequence[Piece]] = None,
               executor: Optional[concurrent.futures.Executor] = None):
    if order is not None and (len(order) != len(grads) or set(order) != set(grads)):
      raise ValueError(f"order must list each of the {len(grads)} pieces held once, got "
                       f"{len(order)} entries ({len(set(order) - set(grads))} not held)")
    self._grads, self._apply_piece, self._scale = dict(grads), apply_piece, grad_scale
    # With an order: per piece, done once the thread has applied it.
    self._applied: Optional[dict[Piece, concurrent.futures.Future]] = None
    if order is not None:
      self._applied = {piece: concurrent.futures.Future() for piece in order}
      executor.submit(self._apply_in_order)

  def apply(self, pieces: Optional[Iterable[Piece]] = None) -> bool:
    """Applies ``pieces`` (None: all not yet applied), or waits for the thread to have;
    pieces already applied or not held are skipped. Raises what applying them raised.

    Returns:
      Whether every piece is now applied.
    """
    if self._applied is not None:
      for piece in list(self._applied) if pieces is None else pieces:
        if piece in self._applied:
          self._applied[piece].result()
      if not all(done.done() for done in self._applied.values()):
        return False
      for done in self._applied.values():
        done.result()  # A piece not asked for may have failed.
      return True
    for piece in list(self._grads) if pieces is None else pieces:
      grad = self._grads.pop(piece, None)
      if grad is not None:
        jax.block_until_ready((grad, self._scale))
        self._apply_piece(piece, grad, host_arrays.read_scalar(self._scale))
    return not self._grads

  def _apply_in_order(self) -> None:
    """The thread's work: every piece in order, each marked once applied."""
    try:
      scale = host_arrays.read_scalar(jax.block_until_ready(self._scale))
      for piece, done in self._applied.items():
        grad = jax.block_until_ready(self._grads.pop(piece))  # Freed once applied.
        self._apply_piece(piece, grad, scale)
        done.set_result(None)
    except BaseException as error:  # Raised where apply waits for these pieces.
      for done in self._applied.values():
        if not done.done():
          done.set_exception(error)
