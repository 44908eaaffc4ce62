"""The host kernel's state, shard by shard: the weights a device reads, their masters, Adam's moments.

``HostAdamW`` keeps it here. Per leaf, its weights live in ``pinned_host``
(where the device step reads them) as float32, as the bfloat16 half of a
float32 master whose other 16 bits (the remainder) live beside the moments in
host memory only the host reads, or as bfloat16 weights that are their own
master. The moments are float32, bfloat16 or 8-bit blocks
(``host.adam.CodedMoment``). ``update_arrays`` hands the kernel one piece's
arrays of a shard; ``masters`` and ``moments`` give float32 copies for
checkpoints, and ``load_moments`` takes them back in any of those dtypes.
``host_bytes_per_element`` and ``moment_bytes`` count its bytes before it
allocates any (the trainer's host-memory guard); ``check_leaves`` says which
weights and dtypes it cannot take.
"""

from __future__ import annotations

import functools
from typing import Any, Iterable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxoffload import rounding
from jaxoffload._compat import DEVICE_KIND, PINNED_HOST, to_device, to_host
from jaxoffload.host import adam, numpy_views
from jaxoffload.optim import blockwise

MOMENT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), blockwise.DTYPE)


def host_bytes_per_element(device_dtype: Any = jnp.float32, *, master_dtype: Any = jnp.float32,
                           summed: bool = False, moment_bytes: float = 8) -> tuple[int, float]:
  """The host bytes ``HostAdamW`` holds per element of a leaf, before it allocates them.

  Args:
    device_dtype: as ``HostAdamW``'s ``device_dtypes``, for the leaf.
    master_dtype: the weights' dtype, float32 or bfloat16 (its own master).
    summed: whether ``accumulate`` sums micro-batches' gradients.
    moment_bytes: both moments' bytes per element (``moment_bytes``).

  Returns:
    ``(pinned, unpinned)``: the weights the device reads, and what only the host reads:
    the remainders of a split master, the two moments (with the gradients' float32 sums
    when ``summed``).

  Example:
    >>> pinned, unpinned = host_bytes_per_element(jnp.bfloat16)  # (2, 10): a split master.
  """
  split = (jnp.dtype(master_dtype) == jnp.float32 and jnp.dtype(device_dtype) == jnp.bfloat16)
  pinned = jnp.dtype(master_dtype).itemsize - (2 if split else 0)
  return pinned, (2 if split else 0) + moment_bytes + (4 if summed else 0)


def moment_bytes(dtype: Any, shape: tuple[int, ...] = ()) -> float:
  """A moment's host bytes an element in ``dtype`` (int8: ``jaxoffload.optim.blockwise``'s)."""
  if blockwise.is_blockwise(dtype):
    return blockwise.bytes_per_element(shape) if shape else 1 + 4 / blockwise.BLOCK
  return jnp.dtype(dtype).itemsize


def check_leaves(weights: Sequence[jax.Array], device_dtypes: Sequence[jnp.dtype],
                 mu_dtype: Any, nu_dtype: Any) -> None:
  """Raises where a ``HostState`` could not take these arguments, before it allocates any.

  Args:
    weights, device_dtypes, mu_dtype, nu_dtype: as ``HostState``'s.

  Raises:
    ValueError: naming the leaf that is neither float32 nor bfloat16, not in host memory,
      or given a device dtype it cannot have; the moment dtype; or when ``device_dtypes``
      has not one entry per leaf.
  """
  if len(device_dtypes) != len(weights):
    raise ValueError(f"device_dtypes has {len(device_dtypes)} entries for {len(weights)} leaves")
  for i, (w, dtype) in enumerate(zip(weights, device_dtypes)):
    _check_leaf(i, w, dtype)
  for name, dtype in (("mu_dtype", mu_dtype), ("nu_dtype", nu_dtype)):
    if jnp.dtype(dtype) not in MOMENT_DTYPES:
      raise ValueError(f"{name} must be one of {[d.name for d in MOMENT_DTYPES]}, got "
                       f"{jnp.dtype(dtype)}")


class HostState:
  """Per leaf and shard, the arrays ``host.adam.adamw_update`` updates in place.

  Args:
    weights: per leaf, float32 (a master) or bfloat16 (its own master) arrays in host
      memory, which this state takes over (no one else may hold them).
    device_dtypes: per leaf, the dtype the device reads its weights in; bfloat16 of a
      float32 master splits it (the device reads the bfloat16 half).
    mu_dtype, nu_dtype: the moments' dtypes (``MOMENT_DTYPES``; int8: 8-bit blocks).
  """

  def __init__(self, weights: Sequence[jax.Array], device_dtypes: Sequence[Any],
               mu_dtype: Any, nu_dtype: Any):
    self.device_dtypes = [jnp.dtype(d) for d in device_dtypes]
    self.mu_dtype, self.nu_dtype = jnp.dtype(mu_dtype), jnp.dtype(nu_dtype)
    self.place(weights)
    # Only the host reads the moments: plain host memory, outside XLA's pinned pool.
    self.mu = [[_zeros(v.shape, self.mu_dtype, signed=True) for v in views]
               for views in self.views]
    self.nu = [[_zeros(v.shape, self.nu_dtype, signed=False) for v in views]
               for views in self.views]

  def place(self, weights: Sequence[jax.Array]) -> None:
    """Takes ``weights`` (float32 masters, or bfloat16 weights) as the state's weights."""
    self.params, self.remainders = [], []
    for w, dtype in zip(weights, self.device_dtypes):
      if len({shard.data.unsafe_buffer_pointer() for shard in w.addressable_shards}) < len(
          w.addressable_shards):
        # Replicas sharing one buffer (jax.device_put of numpy on the CPU backend): the
        # kernel would update it once per shard.
        w = numpy_views.copy(w)
      remainders = None
      if w.dtype == jnp.float32 and dtype == jnp.bfloat16:
        w, remainders = _split(w)
      self.params.append(w)
      self.remainders.append(remainders)
    jax.block_until_ready(self.params)
    self.views = [numpy_views.shard_views(w) for w in self.params]

  def update_arrays(self, leaf: int, layer: Optional[int], shard: int) -> tuple:
    """``(param, remainder, mu, nu)`` of a leaf's shard, cut to ``layer`` (None: whole)."""
    part = (lambda x: x) if layer is None else (lambda x: None if x is None else x[layer])
    remainders = self.remainders[leaf]
    return (part(self.views[leaf][shard]), part(None if remainders is None else remainders[shard]),
            part(self.mu[leaf][shard]), part(self.nu[leaf][shard]))

  def masters(self, leaf: int) -> list[np.ndarray]:
    """Float32 copies of a leaf's masters, shard by shard."""
    return [self.float32("params", leaf, shard) for shard in range(len(self.views[leaf]))]

  def moments(self, name: str, leaf: int) -> list[np.ndarray]:
    """Float32 copies of a leaf's ``mu`` or ``nu``, shard by shard."""
    return [self.float32(name, leaf, shard) for shard in range(len(self.views[leaf]))]

  def float32(self, name: str, leaf: int, shard: int, rows: slice = slice(None)) -> np.ndarray:
    """A float32 copy of ``rows`` (of the first axis) of a leaf's shard: its master
    (``name`` ``"params"``), ``mu`` or ``nu``. An 8-bit moment of fewer than two axes is
    one row of blocks: take it whole."""
    if name == "params":
      view, remainders = self.views[leaf][shard], self.remainders[leaf]
      if remainders is None:
        return view[rows].astype(np.float32)
      return rounding.join_master(view[rows], remainders[shard][rows])
    moment = getattr(self, name)[leaf][shard]
    if isinstance(moment, adam.CodedMoment):
      whole = moment.codes.ndim < 2
      return (moment if whole else adam.CodedMoment(moment.codes[rows],
                                                         moment.scales[rows])).decode()
    return moment[rows].astype(np.float32)

  def leaf_rows(self, name: str, leaf: int, rows: slice) -> np.ndarray:
    """A float32 copy of ``rows`` (of the first axis) of a whole leaf's master (``name``
    ``"params"``), ``mu`` or ``nu``, from its shards (replicas read once); nothing else
    of the leaf is copied. Needs every shard in this process."""
    like = self.params[leaf]
    if not like.is_fully_addressable:
      raise ValueError(f"leaf {leaf} has shards in other processes")
    if not like.shape:
      return self.float32(name, leaf, 0)
    first, stop, _ = rows.indices(like.shape[0])
    out = np.empty((stop - first,) + like.shape[1:], np.float32)
    indices = like.sharding.addressable_devices_indices_map(like.shape)
    seen = set()
    for shard, array_shard in enumerate(numpy_views.sorted_shards(like)):
      index = indices[array_shard.device]
      bounds = tuple(part.indices(n)[:2] for part, n in zip(index, like.shape))
      low, high = bounds[0]
      start, end = max(low, first), min(high, stop)
      if bounds in seen or start >= end:
        continue
      seen.add(bounds)
      out[(slice(start - first, end - first),) + tuple(index[1:])] = self.float32(
          name, leaf, shard, slice(start - low, end - low))
    return out

  def load_moments(self, mu: Iterable, nu: Iterable) -> None:
    """Takes whole float32 moments (JAX or numpy arrays, a leaf at a time) into this state's
    shards and dtypes (bfloat16 rounded to nearest; 8-bit codes rounded stochastically)."""
    for saved, moments in ((mu, self.mu), (nu, self.nu)):
      for values, shards, like in zip(saved, moments, self.params):
        for shard, part in zip(shards, numpy_views.shard_values(values, like)):
          if isinstance(shard, adam.CodedMoment):
            shard.assign(part)
          else:
            shard[...] = part

  @property
  def split(self) -> list[bool]:
    """Per leaf, whether its float32 master is split (``device_dtypes`` bfloat16)."""
    return [r is not None for r in self.remainders]

  @property
  def float32_masters(self) -> bool:
    """Whether every leaf's master is float32 (whole or split): an update can be undone."""
    return all(p.dtype == jnp.float32 or r is not None
               for p, r in zip(self.params, self.remainders))

  @property
  def pinned_bytes(self) -> int:
    """Pinned host memory of the weights the device reads, every shard's."""
    return sum(shard.data.nbytes for a in self.params for shard in a.addressable_shards)

  @property
  def remainder_bytes(self) -> int:
    return sum(r.nbytes for leaf in self.remainders if leaf is not None for r in leaf)

  @property
  def moment_bytes(self) -> int:
    """Host memory of the Adam moments, every shard's."""
    return sum(m.nbytes for moments in (self.mu, self.nu) for leaf in moments for m in leaf)


def _check_leaf(index: int, param: jax.Array, device_dtype: jnp.dtype) -> None:
  """Raises ValueError naming leaf ``index`` where ``HostAdamW`` cannot take it."""
  if param.dtype not in (jnp.float32, jnp.bfloat16):
    raise ValueError(f"HostAdamW keeps float32 or bfloat16 weights; leaf {index} is {param.dtype}")
  if device_dtype not in (jnp.float32, jnp.bfloat16):
    raise ValueError(f"leaf {index}: the device reads float32 or bfloat16, not {device_dtype}")
  if param.dtype == jnp.bfloat16 and device_dtype != jnp.bfloat16:
    raise ValueError(f"leaf {index}: bfloat16 weights are read in bfloat16, not {device_dtype}")
  split = param.dtype == jnp.float32 and device_dtype == jnp.bfloat16
  if (not split and param.sharding.memory_kind != "pinned_host"
      and jax.default_backend() != "cpu"):
    raise ValueError(f"leaf {index} must be in pinned_host memory, not "
                     f"{param.sharding.memory_kind}")


def _split(master: jax.Array) -> tuple[jax.Array, list[np.ndarray]]:
  """A float32 master's bfloat16 half in ``pinned_host`` and its remainders in numpy, shard by
  shard: split where it lies (pass it in device memory, and it never enters the pinned pool
  whole)."""
  sharding = master.sharding.with_memory_kind(PINNED_HOST)
  high, low = _splitter(sharding)(master)
  return high, [np.array(shard.data) for shard in numpy_views.sorted_shards(low)]


@functools.cache
def _splitter(sharding: jax.sharding.Sharding):
  def split(master):
    bits = jax.lax.bitcast_convert_type(to_device(master), jnp.uint32)
    high = ((bits >> 16) + ((bits >> 15) & 1)).astype(jnp.uint16)
    quiet_nan = ((bits >> 16) & 0x8000 | 0x7FC0).astype(jnp.uint16)
    high = jnp.where(jnp.isnan(to_device(master)), quiet_nan, high)
    return (to_host(jax.lax.bitcast_convert_type(high, jnp.bfloat16)),
            (bits & 0xFFFF).astype(jnp.uint16))

  return jax.jit(split, out_shardings=(sharding, sharding.with_memory_kind(DEVICE_KIND)))


def _zeros(shape: tuple[int, ...], dtype: jnp.dtype, *, signed: bool) -> adam.Moment:
  if blockwise.is_blockwise(dtype):
    return adam.CodedMoment.zeros(shape, signed=signed)
  return np.zeros(shape, dtype)
