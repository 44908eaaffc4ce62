"""Two ways to run an elementwise update whose state lives in host memory.

Both take ``fn(scalars, device_inputs, host_inputs) -> (device_outputs,
host_outputs)``: an elementwise function of same-shaped arrays, plus scalar
arrays (a step count, injected hyperparameters) that it may not close over,
because the host path needs every operand in host memory.

- ``run_on_host`` runs ``fn`` on the host CPU: device inputs travel down, host
  state never leaves host memory, device outputs travel back up.
- ``run_streamed`` runs ``fn`` on the device over bounded chunks of the leaf, so
  at most one chunk of host state occupies device memory at a time.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxoffload._compat import HOST, on_host, to_device, to_host

ElementwiseFn = Callable[[Sequence[Any], Sequence[Any], Sequence[Any]],
                         tuple[Sequence[Any], Sequence[Any]]]

# How far above the smallest admissible chunk count to look for one that divides
# the leaf evenly, before streaming the leaf whole.
_DIVISOR_SEARCH_SPAN = 4


def run_on_host(fn: ElementwiseFn, scalars: Sequence[Any], device_inputs: Sequence[Any],
                host_inputs: Sequence[Any]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
  """Runs ``fn`` on the host; returns device outputs on the device, host outputs on the host."""
  host_fn = on_host(fn, out_memory_spaces=HOST)
  device_out, host_out = host_fn(to_host(tuple(scalars)), to_host(tuple(device_inputs)),
                                 to_host(tuple(host_inputs)))
  return tuple(to_device(tuple(device_out))), tuple(to_host(tuple(host_out)))


def num_chunks(num_elements: int, host_bytes_per_element: int, chunk_bytes: int) -> int:
  """How many equal pieces to stream a leaf in, so that each carries at most ``chunk_bytes``.

  Returns the smallest divisor of ``num_elements`` that keeps a piece under
  ``chunk_bytes``; 1 (the whole leaf) when no divisor lies near that count.
  """
  fewest = max(1, math.ceil(num_elements * host_bytes_per_element / chunk_bytes))
  for count in range(fewest, min(num_elements, _DIVISOR_SEARCH_SPAN * fewest) + 1):
    if num_elements % count == 0:
      return count
  return 1


def run_streamed(fn: ElementwiseFn, scalars: Sequence[Any], device_inputs: Sequence[Any],
                 host_inputs: Sequence[Any], *, chunk_bytes: int, overlap: bool = False,
                 sharding: Optional[jax.sharding.NamedSharding] = None
                 ) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
  """Runs ``fn`` on the device, bringing host inputs in ``chunk_bytes`` pieces.

  The pieces are the iterations of a ``lax.fori_loop`` over the flattened
  leaf, so XLA cannot bring them all in at once: each piece is copied in,
  updated and copied back before the next one's buffers are needed. Every
  output overwrites its input's piece in the loop carry (device outputs must
  match the device inputs' shapes and dtypes): donated host state is updated
  in place, and a dead device input's buffer (a gradient) holds the output, so
  neither side needs a second leaf-sized buffer or a copy into one.

  With ``overlap`` each iteration also fetches the next piece, which depends
  only on host state, so that XLA may copy it in while this piece updates and
  goes back (double buffering: one more piece of device memory). XLA:GPU may
  still run the loop's copies one at a time
  ([performance](../docs/performance.md#optimizer-offload)).

  With a ``sharding`` that splits the leaf over devices, each device streams its
  own shard (``chunk_bytes`` a device): pieces of the whole flattened leaf would
  cross shards, and XLA would gather them.
  """
  if _splits(sharding, device_inputs[0].shape):
    per_shard = functools.partial(run_streamed, fn, chunk_bytes=chunk_bytes, overlap=overlap)
    spec = sharding.spec
    return jax.shard_map(per_shard, mesh=sharding.mesh, in_specs=(P(), spec, spec),
                         out_specs=(spec, spec))(
                             tuple(scalars), tuple(device_inputs), tuple(host_inputs))
  shape = device_inputs[0].shape
  size = math.prod(shape)
  host_bytes = sum(x.dtype.itemsize for x in host_inputs)
  count = num_chunks(size, host_bytes, chunk_bytes)
  if count == 1:
    device_out, host_out = fn(scalars, tuple(device_inputs), tuple(to_device(tuple(host_inputs))))
    return tuple(device_out), tuple(to_host(tuple(host_out)))

  def split(x):
    return x.reshape(count, size // count)

  def piece(x, index):
    return jax.lax.dynamic_index_in_dim(x, index, keepdims=False)

  def put(x, value, index):
    return jax.lax.dynamic_update_index_in_dim(x, value, index, 0)

  def fetch(host_pieces, index):
    return to_device(tuple(piece(x, index) for x in host_pieces))

  def update(index, device_pieces, host_pieces, fetched):
    device_out, host_out = fn(scalars, tuple(piece(x, index) for x in device_pieces), fetched)
    return (tuple(put(x, out, index) for x, out in zip(device_pieces, device_out)),
            tuple(put(x, out, index) for x, out in zip(host_pieces, to_host(tuple(host_out)))))

  def body(index, carry):
    device_pieces, host_pieces = carry
    return update(index, device_pieces, host_pieces, fetch(host_pieces, index))

  def overlapped_body(index, carry):
    device_pieces, host_pieces, fetched = carry
    # The last iteration fetches its own piece again, unused: simpler than a branch.
    following = fetch(host_pieces, jnp.minimum(index + 1, count - 1))
    # Reading piece i + 1 before piece i is written back lets XLA write the host
    # buffer in place; left unordered, XLA:GPU copied the whole buffer in every
    # iteration (tests/test_gpu.py looks for such copies).
    following, host_pieces = jax.lax.optimization_barrier((following, host_pieces))
    return (*update(index, device_pieces, host_pieces, fetched), following)

  carry = (tuple(map(split, device_inputs)), tuple(map(split, to_host(tuple(host_inputs)))))
  if overlap:
    carry = (*carry, fetch(carry[1], 0))
  device_out, host_out, *_ = jax.lax.fori_loop(0, count, overlapped_body if overlap else body,
                                                carry)
  device_out = tuple(x.reshape(shape) for x in device_out)
  host_out = tuple(to_host(tuple(x.reshape(shape) for x in host_out)))
  return device_out, host_out


def _splits(sharding: Optional[jax.sharding.NamedSharding], shape: tuple[int, ...]) -> bool:
  """Whether ``sharding`` splits a leaf of ``shape`` over devices, into equal shards (what
  ``shard_map`` needs; a leaf split unevenly streams whole, and XLA gathers its pieces)."""
  if sharding is None:
    return False
  mesh_shape = sharding.mesh.shape
  ways = [math.prod(mesh_shape[a] for a in ((axes,) if isinstance(axes, str) else axes or ()))
          for axes in sharding.spec]
  return math.prod(ways) > 1 and all(n % w == 0 for n, w in zip(shape, ways))
