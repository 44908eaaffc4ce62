"""Weights and Adam moments on the host, updated by the host's cores between device steps.

ZeRO-Offload's arrangement, for the leaves you choose: their float32 weights
live in ``pinned_host`` memory (your device step reads them from there), their
Adam moments in host memory that only the host touches, and ``HostAdamW``
applies each step's gradients with the multi-threaded ``host_adam`` kernel,
writing the weights the next device step reads. The device never holds their
optimizer state; only the gradients come down and the weights go up.

With ``delayed=True`` (ZeRO-Offload's one-step delayed parameter update) the
host applies step t's gradients while the device computes step t + 1, so
host work hides under device work: step t + 1's gradients are then taken at
weights that lack step t's update (the other leaves, if any, are not
delayed). The weights alternate between two buffers, one read by the device
while the host writes the other.

The update writes into JAX arrays behind JAX's back (``host_adam.writable_view``):
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

from typing import Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxoffload import host_adam

Schedule = Union[float, Callable[[int], float]]

# Learning rates come from a table of this many updates, filled ahead: a JAX
# schedule evaluated at each update would queue behind the device step in
# flight, and the delayed update would wait for that step to finish.
_SCHEDULE_TABLE = 1024


def _sorted_shards(array: jax.Array) -> list:
  return sorted(array.addressable_shards, key=lambda s: s.device.id)


def _shard_views(array: jax.Array) -> list[np.ndarray]:
  """Writable views of the array's addressable shards, in a fixed (device) order."""
  return [host_adam.writable_view(shard.data) for shard in _sorted_shards(array)]


def _copy(array: jax.Array) -> jax.Array:
  """A new array with ``array``'s values and placement, read through a computation."""
  return jax.jit(jnp.copy, out_shardings=array.sharding)(array)


def _read_scalar(value: Union[float, jax.Array]) -> float:
  """A ready scalar's value; read in place from host memory when it is there.

  Converting a device scalar goes through a transfer, which may queue behind
  the device step in flight.
  """
  if isinstance(value, jax.Array):
    shard = value.addressable_shards[0]
    if value.sharding.memory_kind == "pinned_host" or shard.device.platform == "cpu":
      return float(host_adam.writable_view(shard.data))
  return float(np.asarray(value))


def _gather(shards: Sequence[np.ndarray], like: jax.Array) -> jax.Array:
  """Per-shard numpy arrays as one JAX array placed like ``like``."""
  # Copies: device_put may keep using a numpy array's memory, and these change.
  placed = [jax.device_put(values.copy(), jax.sharding.SingleDeviceSharding(
      shard.device, memory_kind=like.sharding.memory_kind))
            for values, shard in zip(shards, _sorted_shards(like))]
  return jax.make_array_from_single_device_arrays(like.shape, like.sharding, placed)


class HostAdamW:
  """AdamW for weights kept in host memory, applied by the host's cores between device steps.

  Args:
    params: the offloaded weights, float32 arrays in ``pinned_host`` memory
      (any sharding; each process updates its own shards).
    learning_rate: a float, or ``schedule(count) -> float`` with optax's
      convention (count 0 for the first update).
    b1, b2, eps, weight_decay: as ``optax.adamw``.
    delayed: apply each call's gradients one call later, so that the host's
      work overlaps the next device step (see the module's docstring).

  Raises:
    ValueError: naming the leaf that is not float32 or not in host memory.
  """

  def __init__(self, params: Sequence[jax.Array], *, learning_rate: Schedule,
               b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, weight_decay: float = 1e-4,
               delayed: bool = False):
    for i, p in enumerate(params):
      if p.dtype != jnp.float32:
        raise ValueError(f"HostAdamW keeps float32 weights; leaf {i} is {p.dtype}")
      if p.sharding.memory_kind != "pinned_host" and jax.default_backend() != "cpu":
        raise ValueError(f"leaf {i} must be in pinned_host memory, not {p.sharding.memory_kind}")
    self._schedule = learning_rate if callable(learning_rate) else (lambda _: learning_rate)
    self._rates_start, self._rates = 0, self._schedule_table(0)
    self._hyper = dict(b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
    self.delayed = delayed
    jax.block_until_ready(params)
    self._buffers = [list(params)]
    if delayed:
      self._buffers.append(jax.block_until_ready([_copy(p) for p in params]))
    self._views = [[_shard_views(p) for p in buffer] for buffer in self._buffers]
    self._mu = [[np.zeros_like(v) for v in views] for views in self._views[0]]
    self._nu = [[np.zeros_like(v) for v in views] for views in self._views[0]]
    self._current = 0
    self._held: Optional[tuple[Sequence[jax.Array], jax.Array]] = None
    self.count = 0  # Updates applied.

  def __str__(self) -> str:
    elements = sum(p.size for p in self.params)
    return (f"host kernel: {len(self.params)} leaves ({elements:,} parameter elements) with their "
            f"weights and Adam moments in host memory, {host_adam.max_threads()} threads, "
            + ("updates one step delayed" if self.delayed else "exact updates"))

  @property
  def moment_bytes(self) -> int:
    """Host memory of the Adam moments (not pinned: only the host reads them)."""
    return sum(m.nbytes for moments in (self._mu, self._nu) for leaf in moments for m in leaf)

  @property
  def params(self) -> list[jax.Array]:
    """The weights the next device step must read."""
    return self._buffers[self._current]

  def update(self, grads: Sequence[jax.Array], grad_scale: Union[float, jax.Array] = 1.0
             ) -> None:
    """Applies ``grads`` (one per leaf, in host memory), or with ``delayed`` the previous call's.

    Call it right after dispatching the device step that produced ``grads``:
    it waits for what it applies. ``grad_scale`` multiplies the gradients
    first (global-norm clipping's factor, computed on the device).
    """
    if not self.delayed:
      self._apply(grads, grad_scale, into=self._current)
      return
    held, self._held = self._held, (grads, grad_scale)
    if held is not None:
      # The other buffer was last read by the step before the one just
      # dispatched, which finished before its gradients (waited for in _apply).
      self._apply(*held, into=1 - self._current)
      self._current = 1 - self._current

  def finish(self) -> None:
    """Applies the held gradients, if any, so that ``params`` has every update."""
    if self._held is not None:
      held, self._held = self._held, None
      self._apply(*held, into=1 - self._current)
      self._current = 1 - self._current

  def checkpoint(self) -> dict:
    """The host state as new JAX arrays in host memory, for orbax to save.

    Weights and moments keep the weights' shardings; with ``delayed`` the
    gradients still waiting to be applied are part of the state (call it after
    ``update``, before ``finish``), so that a resumed run continues exactly.
    """
    state = {"count": np.array(self.count, np.int64),
             "params": [_copy(p) for p in self.params],
             "mu": [_gather(shards, p) for shards, p in zip(self._mu, self.params)],
             "nu": [_gather(shards, p) for shards, p in zip(self._nu, self.params)]}
    if self._held is not None:
      state["held_grads"], state["held_scale"] = list(self._held[0]), jnp.asarray(self._held[1])
    return state

  def checkpoint_target(self) -> dict:
    """What ``checkpoint`` returns, as shapes and placements: orbax's restore target."""
    like = lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=p.sharding)
    state = {"count": np.array(0, np.int64), "params": [like(p) for p in self.params],
             "mu": [like(p) for p in self.params], "nu": [like(p) for p in self.params]}
    if self.delayed:
      state["held_grads"] = [like(p) for p in self.params]
      state["held_scale"] = jax.ShapeDtypeStruct((), jnp.float32)
    return state

  def load(self, state: dict) -> None:
    """Continues from a state ``checkpoint`` made (restored into ``checkpoint_target``)."""
    # Copies the kernel may write: XLA's own buffers, never read into numpy.
    params = jax.block_until_ready([_copy(p) for p in state["params"]])
    self._buffers = [params] + ([[_copy(p) for p in params]] if self.delayed else [])
    self._views = [[_shard_views(p) for p in buffer] for buffer in self._buffers]
    for saved, moments in ((state["mu"], self._mu), (state["nu"], self._nu)):
      for array, shards in zip(saved, moments):
        for shard, values in zip(shards, _sorted_shards(array)):
          shard[...] = np.asarray(values.data)
    self._current = 0
    self.count = int(state["count"])
    self._rates_start, self._rates = self.count, self._schedule_table(self.count)
    self._held = ((list(state["held_grads"]), state["held_scale"])
                  if "held_grads" in state else None)

  def snapshot(self) -> list[np.ndarray]:
    """Copies of the current weights as numpy arrays (for checks and checkpoints)."""
    # Through a computation: converting the live arrays would make JAX keep
    # that conversion and show it again after the next in-place update.
    return [np.asarray(_copy(p)) for p in self.params]

  def _schedule_table(self, start: int) -> np.ndarray:
    """The learning rates of updates ``start + 1`` to ``start + _SCHEDULE_TABLE``."""
    counts = jnp.arange(start, start + _SCHEDULE_TABLE)
    return np.broadcast_to(np.asarray(jax.vmap(self._schedule)(counts), np.float64), counts.shape)

  def _learning_rate(self, count: int) -> float:
    """The rate of update ``count + 1`` (optax's schedules count from 0)."""
    if not self._rates_start <= count < self._rates_start + _SCHEDULE_TABLE:
      self._rates_start = count
      self._rates = self._schedule_table(count)
    return float(self._rates[count - self._rates_start])

  def _apply(self, grads: Sequence[jax.Array], grad_scale, into: int) -> None:
    jax.block_until_ready((grads, grad_scale))
    scale = _read_scalar(grad_scale)
    self.count += 1
    learning_rate = self._learning_rate(self.count - 1)
    current, target = self._views[self._current], self._views[into]
    for leaf, grad in enumerate(grads):
      for shard, grad_view in enumerate(_shard_views(grad)):
        host_adam.adamw_update(current[leaf][shard], grad_view, self._mu[leaf][shard],
                               self._nu[leaf][shard], learning_rate=learning_rate,
                               count=self.count, grad_scale=scale, out=target[leaf][shard],
                               **self._hyper)
