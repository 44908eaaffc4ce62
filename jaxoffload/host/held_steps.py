"""``HostAdamW``'s held updates: one step's exact update spread over the next device step.

``hold`` and ``apply_held`` spread one exact update over the next device step,
a piece at a time (a leaf, or one layer of a leaf stacked over layers): apply
each piece just before dispatching the program that reads it, and the host
updates the later layers while the device computes the first
(``jaxoffload.train.per_layer.overlap``); given the order, a thread applies them
(``jaxoffload.host.held_update``), from the moment their gradients come through
``add_held``, even before their scale (``hold(speculative=True)``: an update
whose scale is not 1 is taken back, ``host.adam.adamw_undo``, and applied scaled).

``HeldSteps`` is that half of ``HostAdamW``'s methods, kept apart from how an
update is applied (``jaxoffload.host.host_adamw``).
"""

from __future__ import annotations

import concurrent.futures
from typing import Iterable, Mapping, Optional, Sequence, Union

import jax
import jax.numpy as jnp

from jaxoffload.host.held_update import HeldUpdate, Piece


class HeldSteps:
  """``HostAdamW``'s held-update methods, as its base class.

  They take one step's gradients by piece and apply them later through ``HostAdamW``'s
  ``_apply_piece(piece, grad, scale, learning_rate, count, *, undo)`` and
  ``_learning_rate(count)``; they read its ``state`` (a ``HostState``) and move its
  ``count`` (updates applied) and ``last_grad_scale`` (the last update's scale).
  """

  def __init__(self):
    self._held: Optional[HeldUpdate] = None  # hold()'s update, until every piece is applied.
    self._background: Optional[concurrent.futures.ThreadPoolExecutor] = None  # hold(order=)'s.
    self.speculated = 0  # Updates applied ahead of their scale (hold(speculative=True)).
    self.undone = 0  # Of those, the ones taken back: their scale was not 1.

  def hold(self, grads: Mapping[Piece, jax.Array],
           grad_scale: Union[None, float, jax.Array] = 1.0, *,
           order: Optional[Sequence[Piece]] = None, speculative: bool = False) -> None:
    """Takes one step's gradients by piece, for ``apply_held`` to apply a piece at a time.

    An exact update spread over the next device step: apply each piece just
    before the program that reads its weights is dispatched, so that the host
    updates one while the device computes with those before it. A piece is
    ``(leaf, layer)``: a leaf's index and, for a leaf stacked over layers
    (axis 0), one layer's index, its gradient that layer's slice; or
    ``(leaf, None)`` for the whole leaf. The update counts (``count``) from
    now; ``params`` holds it once every piece is applied.

    Args:
      grads: per piece, its gradient in host memory; with those ``add_held`` gives later,
        they cover every leaf once.
      grad_scale: as ``update``'s; with ``order``, None: it comes through ``add_held``.
      order: every piece, in the order the device will read them: a thread of this
        object's then applies them from now on, each once its gradient is ready (the
        first in this order among those ready), and ``apply_held`` waits for them. The
        caller's thread stays free to dispatch the device's programs meanwhile. The
        pieces not in ``grads`` come through ``add_held``, while the device still makes
        them: the update then overlaps the backward pass too.
      speculative: with ``order``, the thread applies pieces before the scale is known,
        as if it were 1. If it is not, every piece is taken back
        (``host.adam.adamw_undo``) and applied scaled, however many had started: within
        a few float32 roundings of applying it scaled at once, and the same whatever
        the timing. Needs float32 moments.

    Raises:
      ValueError: for a speculative update without ``order`` or that cannot be taken back.
    """
    if speculative and (order is None or not self.can_take_back):
      raise ValueError("a speculative update needs an order, float32 moments and float32 "
                       "masters (stochastic roundings cannot be taken back exactly)")
    self.apply_held()
    if order is not None and self._background is None:
      self._background = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="HostAdamW")
    count, learning_rate = self.count + 1, self._learning_rate(self.count)  # The next update's.
    apply = lambda undo: (lambda piece, grad, scale: self._apply_piece(
        piece, grad, scale, learning_rate, count, undo=undo))
    self._held = HeldUpdate(grads, apply(False), grad_scale, order=order,
                            executor=self._background,
                            take_back=apply(True) if speculative else None)
    self.count = count
    self.speculated += speculative

  @property
  def pieces_applied_ahead(self) -> int:
    """How many pieces of the held update its thread has applied before reading their
    scale (``hold(speculative=True)``); 0 with none held."""
    return 0 if self._held is None else self._held.applied_ahead

  @property
  def can_take_back(self) -> bool:
    """Whether an update can be taken back (``hold(speculative=True)``): float32 moments and
    float32 masters, whole or split."""
    return (self.state.mu_dtype == self.state.nu_dtype == jnp.float32
            and self.state.float32_masters)

  def apply_held(self, pieces: Optional[Iterable[Piece]] = None) -> None:
    """Applies the held gradients of ``pieces`` (None: all still held), waiting for them;
    pieces already applied or not held are skipped. After ``hold(order=...)``, waits for
    the thread that applies them instead, and raises what it raised.

    Example:
      >>> host.hold({(0, layer): g for layer, g in enumerate(layer_grads)}, clip_factor)
      >>> host.apply_held([(0, 0)])  # Before dispatching the program that reads layer 0.
    """
    if self._held is not None and self._held.apply(pieces):
      self.last_grad_scale = self._held.scale_read
      self.undone += self._held.taken_back
      self._held = None

  def add_held(self, grads: Mapping[Piece, jax.Array],
               grad_scale: Union[None, float, jax.Array] = None) -> None:
    """Gives the held update (``hold(order=...)``) more pieces' gradients, as the device
    makes them, and its scale where ``hold`` had none.

    Raises:
      ValueError: as ``HeldUpdate.add``; when no update is held.
    """
    if self._held is None:
      raise ValueError("add_held gives pieces to a held update: hold(..., order=...) first")
    self._held.add(grads, grad_scale)

  def wait_for_room(self, limit: int) -> None:
    """Waits until the held update's gradients given and not yet applied hold at most
    ``limit`` bytes (``HeldUpdate.wait_for_room``); at once with none held."""
    if self._held is not None:
      self._held.wait_for_room(limit)

  def cancel_held(self, error: BaseException) -> None:
    """Stops the held update's thread, if any, before pieces it waits for come: they and
    every later ``apply_held`` raise ``error``, and the state is no step's."""
    if self._held is not None and self._held.applied_by_thread:
      self._held.cancel(error)
