"""Weights and Adam moments on the host, updated by the host's cores between device steps.

ZeRO-Offload's arrangement, for the leaves you choose: their float32 weights
live in ``pinned_host`` memory (the device step reads them there), their Adam
moments in host memory only the host touches, and ``HostAdamW`` applies each
step's gradients with the multi-threaded ``host.adam`` kernel. Only the
gradients come down and the weights go up.

With ``device_dtypes`` bfloat16 for a leaf, the host keeps its float32 master
split in two (TransformerEngine's ``store_param_remainders``): the bfloat16
weights the device reads, in ``pinned_host``, and the 16 bits they drop, in
host memory only the host touches; the device sends its gradient in
bfloat16: half the bytes each way, and 4 bytes of host memory an element for
an exact float32 master. A model that multiplies in bfloat16 rounds those
weights itself (to nearest, ties to even where the split rounds ties away from
zero); the gradient's rounding is new only when it did not come out of a
bfloat16 matmul already. bfloat16 weights (``main_params_dtype=bfloat16``)
are their own master, each update rounded stochastically. The moments are
float32, bfloat16 or 8-bit (``jaxoffload.optim.blockwise``).

``hold`` and ``apply_held`` spread one exact update over the next device step,
a piece at a time, even from before its scale is known (``jaxoffload.host.held_steps``).

The update writes into JAX arrays behind JAX's back (``host.adam.writable_view``):
keep to the loop below (dispatch the step, then ``update``), and never pass
``HostAdamW.params`` to ``np.asarray``; read them through a computation,
``HostAdamW.snapshot`` or ``HostAdamW.checkpoint``.

Example:
  >>> host = HostAdamW(offloaded_weights, learning_rate=schedule, weight_decay=0.1)
  >>> for tokens in batches:
  ...   device_weights, opt_state, grads, clip_scale, loss = step(
  ...       device_weights, host.params, opt_state, tokens)
  ...   host.update(grads, clip_scale)
  >>> host.finish()
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxoffload._compat import DEVICE_KIND
from jaxoffload.host import adam, numpy_views
from jaxoffload.host.held_steps import HeldSteps
from jaxoffload.host.held_update import Piece
from jaxoffload.host.kernel_state import HostState, check_leaves

Schedule = Union[float, Callable[[int], float]]

# Learning rates come from a table of this many updates, filled ahead: a JAX
# schedule evaluated at each update would queue behind the device step in
# flight, and ``hold`` would wait for that step to finish.
_SCHEDULE_TABLE = 1024


class HostAdamW(HeldSteps):
  """AdamW for weights kept in host memory, applied by the host's cores between device steps.

  Args:
    params: the offloaded weights, any sharding (each process updates its own shards),
      which this object takes over: float32 masters, in ``pinned_host`` memory (in device
      memory where the device reads them in bfloat16: they are split where they lie); or
      bfloat16 weights in ``pinned_host``, their own master.
    learning_rate: a float, or ``schedule(count) -> float`` with optax's
      convention (count 0 for the first update).
    b1, b2, eps, weight_decay: as ``optax.adamw``.
    device_dtypes: per leaf, the dtype the device reads its weights in:
      float32 (the default) or bfloat16 (see the module's docstring); bfloat16 for
      bfloat16 weights. Its gradients may come in either, whichever this is.
    mu_dtype, nu_dtype: the moments' dtypes: float32 (the default), bfloat16
      (stored rounded stochastically as ``jaxoffload.optim.offloaded_adam`` rounds them) or int8
      (``jaxoffload.optim.blockwise``'s 8-bit blocks): fewer bytes for the kernel to
      read and write.

  Raises:
    ValueError: naming the leaf that is neither float32 nor bfloat16, not in host
      memory, or given a device dtype it cannot have; or the moment dtype.
  """

  def __init__(self, params: Sequence[jax.Array], *, learning_rate: Schedule,
               b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, weight_decay: float = 1e-4,
               device_dtypes: Optional[Sequence] = None, mu_dtype: Any = jnp.float32,
               nu_dtype: Any = jnp.float32):
    device_dtypes = ([p.dtype for p in params] if device_dtypes is None
                     else [jnp.dtype(d) for d in device_dtypes])
    check_leaves(params, device_dtypes, mu_dtype, nu_dtype)
    schedule = learning_rate if callable(learning_rate) else (lambda _: learning_rate)
    self._schedule = jax.jit(schedule)
    self._rates_start, self._rates = 0, self._schedule_table(0)
    self._hyper = dict(b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
    self.state = HostState(params, device_dtypes, mu_dtype, nu_dtype)
    super().__init__()  # No update held yet.
    # Per leaf and shard, the float32 sums of accumulate(); _summed: they hold this step's.
    self._sums: Optional[list[list[np.ndarray]]] = None
    self._summed = False
    self.count = 0  # Updates applied.
    self.last_grad_scale: Optional[float] = None  # The last update's scale, once read.

  def __str__(self) -> str:
    elements = sum(p.size for p in self.params)
    split = sum(self.state.split)
    return (f"host kernel: {len(self.params)} leaves ({elements:,} parameter elements) with "
            f"their weights and Adam moments ({self.state.mu_dtype.name}, "
            f"{self.state.nu_dtype.name}) in host memory, {adam.max_threads()} threads"
            + (f", {split} leaves read in bfloat16 beside their float32 masters' remainders"
               if split else ""))

  @property
  def moment_bytes(self) -> int:
    """Host memory of the Adam moments, every shard's."""
    return self.state.moment_bytes

  @property
  def unpinned_bytes(self) -> int:
    """Host memory outside the pinned pool: the moments, the split masters' remainders, and
    the gradient sums once allocated."""
    return (self.moment_bytes + self.state.remainder_bytes
            + sum(t.nbytes for leaf in self._sums or [] for t in leaf))

  @property
  def weight_bytes(self) -> int:
    """Host memory of the weights and their masters: what the device no longer holds."""
    return self.state.pinned_bytes + self.state.remainder_bytes

  @property
  def pinned_bytes(self) -> int:
    """Pinned host memory of the weights the device reads, every shard's."""
    return self.state.pinned_bytes

  @property
  def params(self) -> list[jax.Array]:
    """The weights the next device step must read, in each leaf's device dtype."""
    return list(self.state.params)

  @property
  def weights(self) -> list[jax.Array]:
    """The float32 masters with every update applied so far: the live arrays where a master
    is whole float32, copies on the CPU backend where it is split or bfloat16."""
    return [p if p.dtype == jnp.float32 else numpy_views.whole_copy(
        self.state.masters(leaf), p, jnp.float32) for leaf, p in enumerate(self.state.params)]

  def update(self, grads: Sequence[jax.Array], grad_scale: Union[float, jax.Array] = 1.0
             ) -> None:
    """Applies ``grads`` (one per leaf, in host memory).

    Call it right after dispatching the device step that produced ``grads``:
    it waits for them. ``grad_scale`` multiplies the gradients first
    (global-norm clipping's factor, computed on the device). After
    ``accumulate``, it applies the sums instead: pass ``grads=()``, and a
    ``grad_scale`` that also divides by the number of micro-batches.
    """
    self.apply_held()
    if self._summed:
      if grads:
        raise ValueError("update after accumulate applies the sums: pass no gradients")
      self._summed = False
      grads = self._sums
    self._apply(grads, grad_scale)

  def accumulate(self, grads: Sequence[jax.Array], *, square_sum: bool = False) -> float:
    """Adds one micro-batch's ``grads`` (one per leaf, in host memory) into float32 sums that
    the next ``update()`` applies: gradient accumulation that keeps no sum on the device.

    Call it right after dispatching the next device program, so that the host
    adds while the device computes; it waits for ``grads``.

    Args:
      grads: one per leaf, float32 or in the leaf's device dtype.
      square_sum: also return the sum of the squares of the new sums over this
        process's shards (each element once, replicas skipped): their share of
        the squared global norm, for clipping.

    Returns:
      That sum of squares (float64), or 0.0 without ``square_sum``.
    """
    jax.block_until_ready(grads)
    if self._sums is None:  # Pages are taken as the first sums fill them.
      self._sums = [[np.empty(v.shape, np.float32) for v in views] for views in self.state.views]
    squares = 0.0
    for sums, grad in zip(self._sums, grads):
      first_replicas = [shard.replica_id == 0 for shard in numpy_views.sorted_shards(grad)]
      for total, view, counted in zip(sums, numpy_views.shard_views(grad), first_replicas):
        squares += adam.accumulate(total, view, first=not self._summed,
                                        square_sum=square_sum and counted)
    self._summed = True
    return squares

  def finish(self) -> None:
    """Applies the held gradients, if any, so that ``params`` has every update."""
    self.apply_held()

  def checkpoint(self, *, copy: bool = True) -> dict:
    """The host state as JAX arrays in host memory, for orbax to save.

    The float32 masters (``weights``): whole float32 ones keep their shardings, split and
    bfloat16 ones are copies like the moments, which are whole float32 arrays (whatever
    their dtype here) on the CPU backend (placed like the weights where this process holds
    only some of a leaf's shards).

    Args:
      copy: live masters copied into new arrays that later updates leave alone. With
        False, the live masters themselves, which the save must have written before the
        next ``update``.
    """
    params, weights = self.state.params, self.weights
    if copy:  # Copied before returning: the next update rewrites them in place.
      weights = jax.block_until_ready([numpy_views.copy(w) if w is live else w
                                       for w, live in zip(weights, params)])
    return {"count": np.array(self.count, np.int64), "params": weights,
            **{name: [numpy_views.whole_copy(self.state.moments(name, leaf), p, jnp.float32)
                      for leaf, p in enumerate(params)] for name in ("mu", "nu")}}

  def checkpoint_target(self) -> dict:
    """What ``checkpoint`` returns, as shapes and placements: orbax's restore target."""
    like = lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32, sharding=p.sharding)
    return {"count": np.array(0, np.int64),
            **{name: [like(p) for p in self.state.params] for name in ("params", "mu", "nu")}}

  def load(self, state: dict) -> None:
    """Continues from a state ``checkpoint`` made (restored into ``checkpoint_target``)."""
    placed = []
    for saved, now, split in zip(state["params"], self.state.params, self.state.split):
      if split:  # Split in device memory: the master never enters the pinned pool whole.
        placed.append(jax.device_put(saved, now.sharding.with_memory_kind(DEVICE_KIND)))
        continue
      if saved.sharding != now.sharding:
        saved = jax.device_put(saved, now.sharding)
      # A copy the kernel may write: XLA's own buffer, never read into numpy.
      placed.append(numpy_views.copy(saved, None if saved.dtype == now.dtype else now.dtype))
    self.state.place(placed)
    self.load_moments(state)

  def load_moments(self, state: dict) -> None:
    """Continues from a checkpoint's moments and update count, keeping the weights it holds.

    Args:
      state: ``checkpoint``'s items but ``params``. ``mu`` and ``nu`` may be any
        iterables of whole leaves (JAX or numpy arrays, float32), read one at a time:
        a generator that reads each from disk holds one leaf in memory at once.
    """
    self.state.load_moments(state["mu"], state["nu"])
    self.count = int(state["count"])
    self._rates_start, self._rates = self.count, self._schedule_table(self.count)

  def snapshot(self) -> list[np.ndarray]:
    """Copies of the current float32 weights as numpy arrays (for checks and checkpoints)."""
    # A live master through a computation: converting it would make JAX keep that
    # conversion and show it again after the next in-place update.
    return [np.asarray(numpy_views.copy(w)) if w is live else np.asarray(w)
            for w, live in zip(self.weights, self.state.params)]

  def _schedule_table(self, start: int) -> np.ndarray:
    """The learning rates of updates ``start + 1`` to ``start + _SCHEDULE_TABLE``."""
    # One scalar program, as optax evaluates the schedule inside the step: vectorised, or
    # mapped over the counts in one program, XLA:CPU rounded some rates one bit apart.
    rates = [self._schedule(np.int32(count))
             for count in range(start, start + _SCHEDULE_TABLE)]
    return np.asarray(jax.device_get(rates), np.float64)

  def _learning_rate(self, count: int) -> float:
    """The rate of update ``count + 1`` (optax's schedules count from 0)."""
    if not self._rates_start <= count < self._rates_start + _SCHEDULE_TABLE:
      self._rates_start = count
      self._rates = self._schedule_table(count)
    return float(self._rates[count - self._rates_start])

  def _apply(self, grads: Sequence[jax.Array], grad_scale) -> None:
    """Applies ``grads`` to the weights in place, once they are ready: the step that read the
    weights has then finished, and the next is not yet dispatched."""
    jax.block_until_ready((grads, grad_scale))
    scale = self.last_grad_scale = numpy_views.read_scalar(grad_scale)
    self.count += 1
    learning_rate = self._learning_rate(self.count - 1)
    for leaf, grad in enumerate(grads):
      self._apply_piece((leaf, None), grad, scale, learning_rate, self.count)

  def _apply_piece(self, piece: Piece, grad: Union[jax.Array, list], scale: float,
                   learning_rate: float, count: int, *, undo: bool = False) -> None:
    """Applies a leaf's gradient, or one layer's of a stacked leaf (``piece``), as update
    ``count``; with ``undo``, takes that back."""
    leaf, layer = piece
    # A leaf's gradient: an array in host memory, or a sum's shards.
    views = grad if isinstance(grad, list) else numpy_views.shard_views(grad)
    settings = dict(learning_rate=learning_rate, count=count, grad_scale=scale, **self._hyper)
    # Named in a jax.profiler trace, beside the device programs it overlaps.
    with jax.profiler.TraceAnnotation("HostAdamW undo" if undo else "HostAdamW update",
                                      leaf=leaf, layer=-1 if layer is None else layer):
      for shard, grad_view in enumerate(views):
        param, remainder, mu, nu = self.state.update_arrays(leaf, layer, shard)
        (adam.adamw_undo if undo else adam.adamw_update)(
            param, grad_view, mu, nu, remainder=remainder, **settings)

