"""JAX arrays in host memory as numpy arrays, shard by shard: views to write, copies, gathers.

The host kernel (``HostAdamW``) updates the shards of JAX arrays in host memory
in place through numpy views (``host.adam.writable_view``'s rules apply), and
hands orbax copies that later updates leave alone.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxoffload._compat import to_device, to_host
from jaxoffload.host import adam


def sorted_shards(array: jax.Array) -> list:
  """The array's addressable shards in device order."""
  return sorted(array.addressable_shards, key=lambda s: s.device.id)


def shard_views(array: jax.Array) -> list[np.ndarray]:
  """Writable views of the array's addressable shards, in a fixed (device) order."""
  return [adam.writable_view(shard.data) for shard in sorted_shards(array)]


def copy(array: jax.Array, dtype=None) -> jax.Array:
  """A new array with ``array``'s values (cast to ``dtype``) and placement, made by a
  computation."""
  return _copier(None if dtype is None else jnp.dtype(dtype), array.sharding)(array)


@functools.cache
def _copier(dtype, sharding: jax.sharding.Sharding) -> Callable[[jax.Array], jax.Array]:
  """``copy``'s program for ``dtype`` and ``sharding``: made once, so that it compiles once
  per shape."""
  # Cast on the device: XLA would run a cast in host memory on one host core.
  cast = lambda x: to_host(to_device(x).astype(dtype)) if dtype else jnp.copy(x)
  return jax.jit(cast, out_shardings=sharding)


def read_scalar(value: Union[float, jax.Array]) -> float:
  """A ready scalar's value; read in place from host memory when it is there.

  Converting a device scalar goes through a transfer, which may queue behind
  the device step in flight.
  """
  if isinstance(value, jax.Array):
    # A shard: the global scalar may span other processes' devices, every one holding it.
    shard = value.addressable_shards[0]
    if value.sharding.memory_kind == "pinned_host" or shard.device.platform == "cpu":
      return float(adam.writable_view(shard.data))
    return float(np.asarray(shard.data))
  return float(value)


def shard_values(values: Any, like: jax.Array) -> list[np.ndarray]:
  """This process's shards of the whole leaf ``values`` (a JAX or numpy array), cut as
  ``like`` is and in its device order."""
  if isinstance(values, jax.Array) and values.sharding == like.sharding:
    return [np.asarray(shard.data) for shard in sorted_shards(values)]
  indices = like.sharding.addressable_devices_indices_map(like.shape)
  whole = np.asarray(values)
  return [whole[indices[shard.device]] for shard in sorted_shards(like)]


def whole_copy(shards: Sequence[np.ndarray], like: jax.Array, dtype=None) -> jax.Array:
  """A copy of per-shard numpy arrays cut like ``like``, as a JAX array of ``dtype`` (``like``'s
  unless given): whole on the CPU backend, outside XLA's pinned pool (which never gives
  memory back); or, where this process holds only some of the leaf's shards, placed like
  ``like`` (pinned, then)."""
  dtype = like.dtype if dtype is None else dtype
  if not like.is_fully_addressable:
    return gather(shards, like, dtype)
  whole = np.empty(like.shape, dtype)
  indices = like.sharding.addressable_devices_indices_map(like.shape)
  for values, shard in zip(shards, sorted_shards(like)):
    whole[indices[shard.device]] = values
  return jax.device_put(whole, jax.devices("cpu")[0])


def gather(shards: Sequence[np.ndarray], like: jax.Array, dtype=None) -> jax.Array:
  """Per-shard numpy arrays as one JAX array of ``dtype`` (``like``'s unless given) placed like
  ``like``."""
  # Copies: device_put may keep using a numpy array's memory, and these change.
  dtype = like.dtype if dtype is None else dtype
  placed = [jax.device_put(values.astype(dtype), jax.sharding.SingleDeviceSharding(
      shard.device, memory_kind=like.sharding.memory_kind))
            for values, shard in zip(shards, sorted_shards(like))]
  return jax.make_array_from_single_device_arrays(like.shape, like.sharding, placed)
