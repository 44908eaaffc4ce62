"""One step's update held by piece, applied a piece at a time by the caller or by a thread.

``HostAdamW.hold`` keeps a step's gradients in a ``HeldUpdate`` so that each
piece (a leaf, or one layer of a leaf stacked over layers) is applied just
before the device program that reads it is dispatched. Given an order, a
thread applies the pieces from the start, each once its gradient is ready
(the first in that order among the ready ones), and ``apply`` only waits for
them: the caller's thread stays free to dispatch device programs. Gradients
may come while the device still makes them (``add``): with a scale known
beforehand, the update runs during the backward pass that makes them.

Example:
  >>> held = HeldUpdate(grads, apply_piece, clip_factor, order=pieces, executor=pool)
  >>> held.apply([(0, 0)])  # Before dispatching the program that reads layer 0.
  >>> held.apply()          # True: every piece is applied.
"""

from __future__ import annotations

import concurrent.futures
import heapq
import threading
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import jax
import numpy as np

from jaxoffload.host import numpy_views

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
      a scalar JAX array, read once it is ready; with ``order``, None: it comes
      later, through ``add``.
    order: every piece, in the order they will be asked for: a thread of
      ``executor`` then applies them, each as soon as its gradient is ready,
      the first in this order among those ready. Pieces not in ``grads`` come
      later, through ``add``.
    executor: the thread that applies them, with ``order``.
    take_back: with ``order``, takes back ``apply_piece`` of the same arguments:
      the thread then applies pieces before their scale is known, as if it were
      1 (each counts as applied once the scale is read). If it is not 1, every
      piece is applied unscaled, taken back and applied scaled, however many
      had started: the result does not depend on the timing.

  Raises:
    ValueError: when ``order`` lists a piece twice or lacks one of ``grads``.
  """

  def __init__(self, grads: Mapping[Piece, jax.Array], apply_piece: ApplyPiece,
               grad_scale: Union[None, float, jax.Array] = 1.0, *,
               order: Optional[Sequence[Piece]] = None,
               executor: Optional[concurrent.futures.Executor] = None,
               take_back: Optional[ApplyPiece] = None):
    if order is not None and (len(set(order)) != len(order) or not set(grads) <= set(order)):
      raise ValueError(f"order must list each piece once, and every piece held: got "
                       f"{len(order)} entries for {len(set(order))} pieces, "
                       f"{len(set(grads) - set(order))} of those held missing")
    self._grads, self._apply_piece, self._scale = dict(grads), apply_piece, grad_scale
    self._take_back = take_back
    self.scale_read: Optional[float] = None  # The scale, once read.
    self.applied_ahead = 0  # Pieces the thread applied before it read the scale.
    # With an order: per piece, done once the thread has applied it.
    self._applied: Optional[dict[Piece, concurrent.futures.Future]] = None
    if order is not None:
      self._applied = {piece: concurrent.futures.Future() for piece in order}
      self._rank = {piece: rank for rank, piece in enumerate(order)}
      # The pieces in the order their gradients came (the order the device makes them),
      # how many of those are known ready, and those ready but not applied, by rank.
      self._arrivals, self._seen, self._ready = list(self._grads), 0, []
      self._known = set(self._grads)  # The pieces given so far.
      # Bytes of the gradients given and not yet applied (and let go).
      self._pending = sum(_nbytes(g) for g in self._grads.values())
      self._given = threading.Condition()
      self._error: Optional[BaseException] = None
      self._finished = False  # The thread has returned.
      executor.submit(self._apply_in_order)

  def add(self, grads: Mapping[Piece, jax.Array],
          grad_scale: Union[None, float, jax.Array] = None) -> None:
    """Gives the thread more pieces' gradients (``order``'s, not given before), and the
    scale where the update was held without one.

    Raises:
      ValueError: without ``order``; for a piece not in ``order``, or given before; for a
        second scale.
    """
    if self._applied is None:
      raise ValueError("only an update held with an order takes pieces later")
    with self._given:
      for piece in grads:
        if piece not in self._applied or piece in self._known:
          raise ValueError(f"piece {piece} is not in the order, or was given before")
      if grad_scale is not None:
        if self._scale is not None:
          raise ValueError("the update already has its scale")
        self._scale = grad_scale
      self._grads.update(grads)
      self._arrivals.extend(grads)
      self._known.update(grads)
      self._pending += sum(_nbytes(g) for g in grads.values())
      self._given.notify_all()

  @property
  def applied_by_thread(self) -> bool:
    """Whether a thread applies the pieces (given an ``order``)."""
    return self._applied is not None

  @property
  def taken_back(self) -> bool:
    """Whether the update was applied ahead of its scale and taken back: a scale not 1."""
    return self._take_back is not None and self.scale_read not in (None, 1.0)

  def cancel(self, error: BaseException) -> None:
    """Stops the thread: the pieces it has not applied fail with ``error``, raised where
    ``apply`` waits for them (the update stays unfinished)."""
    with self._given:
      self._error = error
      self._given.notify_all()

  def wait_for_room(self, limit: int) -> None:
    """Waits until the gradients given and not yet applied hold at most ``limit`` bytes: the
    device then sends no more than that ahead of the thread. Returns at once where the
    thread holds them longer (no scale yet: the update waits for it, or applies ahead of
    it and keeps them to take back), or has stopped."""
    if self._applied is None:
      return
    with self._given:
      while (self._pending > limit and self._scale is not None and self._error is None
             and not self._finished):
        self._given.wait()

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
        self.scale_read = numpy_views.read_scalar(self._scale)
        self._apply_piece(piece, grad, self.scale_read)
    return not self._grads

  def _apply_in_order(self) -> None:
    """The thread's work: every piece, the first of ``order`` among those ready, each marked
    once applied; ahead of the scale, with ``take_back``."""
    try:
      ahead = []  # Pieces applied unscaled before the scale was read, with their gradients.
      if self._take_back is None:
        self._read_scale()
      for _ in range(len(self._applied)):
        piece = self._next_ready()
        with self._given:
          grad = self._grads.pop(piece)  # Freed once applied.
        if self.scale_read is None and self._scale_ready():
          self._settle(ahead)
        if self.scale_read is None:
          self._apply_piece(piece, grad, 1.0)
          ahead.append((piece, grad))
          self.applied_ahead += 1
          continue
        if self._take_back is not None and self.scale_read != 1.0:
          self._apply_piece(piece, grad, 1.0)  # The arithmetic of the pieces applied ahead.
          self._take_back(piece, grad, 1.0)
        self._apply_piece(piece, grad, self.scale_read)
        self._applied[piece].set_result(None)
        self._let_go(grad)
      if self.scale_read is None:
        self._settle(ahead)
    except BaseException as error:  # Raised where apply waits for these pieces.
      for done in self._applied.values():
        if not done.done():
          done.set_exception(error)
    finally:
      with self._given:
        self._finished = True
        self._given.notify_all()

  def _scale_ready(self) -> bool:
    """Whether the scale has been given and computed."""
    with self._given:
      return self._scale is not None and all(
          x.is_ready() for x in jax.tree.leaves(self._scale) if isinstance(x, jax.Array))

  def _read_scale(self) -> None:
    """Waits for the scale to be given and computed, and reads it."""
    with self._given:
      while self._scale is None:
        if self._error is not None:
          raise self._error
        self._given.wait()
    self.scale_read = numpy_views.read_scalar(jax.block_until_ready(self._scale))

  def _settle(self, ahead: list) -> None:
    """Reads the scale; the pieces applied ahead of it count as applied, taken back and
    applied again scaled first if it is not 1."""
    self._read_scale()
    for piece, grad in ahead:
      if self.scale_read != 1.0:
        self._take_back(piece, grad, 1.0)
        self._apply_piece(piece, grad, self.scale_read)
      self._applied[piece].set_result(None)
      self._let_go(grad)
    ahead.clear()

  def _let_go(self, grad: Any) -> None:
    """Counts an applied piece's gradient out of those pending."""
    with self._given:
      self._pending -= _nbytes(grad)
      self._given.notify_all()

  def _next_ready(self) -> Piece:
    """The first piece of ``order`` among those whose gradients are ready, waiting for one."""
    while True:
      with self._given:
        while True:
          if self._error is not None:
            raise self._error
          # The device makes the gradients in the order they came: ready ones first.
          while (self._seen < len(self._arrivals) and all(
              x.is_ready() for x in jax.tree.leaves(self._grads[self._arrivals[self._seen]]))):
            piece = self._arrivals[self._seen]
            heapq.heappush(self._ready, (self._rank[piece], piece))
            self._seen += 1
          if self._ready:
            return heapq.heappop(self._ready)[1]
          if self._seen < len(self._arrivals):
            pending = self._grads[self._arrivals[self._seen]]
            break
          self._given.wait()
      jax.block_until_ready(pending)  # The next to come; not holding the lock meanwhile.


def _nbytes(grad: Any) -> int:
  """A piece's gradient's bytes in this process's memory: a host array's shards, or a sum's."""
  return sum(x.nbytes if isinstance(x, np.ndarray) else
             sum(shard.data.nbytes for shard in x.addressable_shards)
             for x in jax.tree.leaves(grad))
