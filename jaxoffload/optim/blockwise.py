"""8-bit blockwise Adam moments: a code a byte, and one float32 scale per block of 256.

The format of torchao's ``AdamW8bit`` and bitsandbytes' 8-bit blockwise Adam
in outline (their quantization map differs): a moment is cut into blocks of
``BLOCK`` consecutive elements along each row (a leaf's rows are its slices
along the first axis, one row for a leaf of fewer than two axes; a layer of a
stack is one row), each block stores its largest magnitude as a float32 scale,
and each element a byte that indexes a level between 0 and that scale:

- the first moment, signed: an int8 code ``c`` in [-127, 127], the value
  ``sign(c) * (c / 127)**2 * scale``;
- the second moment, never negative: a uint8 code ``c`` in [0, 255], the value
  ``(c / 255)**4 * scale``.

The levels crowd near zero (square and fourth-power companding), where a
block's small elements lie; an element takes the code nearest its companded
magnitude (``c = round(127 * sqrt(|m| / scale))``, ``round(255 * (v /
scale)**0.25)``). A slow decay is not lost to rounding: the scale, the block's
largest magnitude, decays with the block. A moment takes 1 byte and 4 / 256
bytes of scale an element. ``jaxoffload.host.kernels`` encodes and decodes
the same codes bit for bit.

Example:
  >>> codes, scales = encode(mu, signed=True)
  >>> mu = decode(codes, scales, signed=True)
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 256
# A code's level, as a fraction of its block's scale, is code**2 times the first, or
# code**4 times the second, in float32 (``level``).
SIGNED_STEP = np.float32(1 / 127**2)
UNSIGNED_STEP = np.float32(1 / 255**4)
# The dtype that names this format where a moment's dtype is asked for.
DTYPE = jnp.dtype(jnp.int8)


def is_blockwise(dtype: Any) -> bool:
  """Whether a moment dtype names this format (``int8``)."""
  return dtype is not None and jnp.dtype(dtype) == DTYPE


def code_dtype(signed: bool) -> np.dtype:
  """The codes' dtype: int8 for the first moment, uint8 for the second."""
  return np.dtype(np.int8 if signed else np.uint8)


def rows(shape: tuple[int, ...]) -> tuple[int, int]:
  """``(rows, elements a row)`` of a moment of ``shape``."""
  if len(shape) < 2:
    return 1, math.prod(shape)
  return shape[0], math.prod(shape[1:])


def scales_shape(shape: tuple[int, ...]) -> tuple[int, int]:
  """The shape of a moment's scales: a row of blocks per row of the moment."""
  count, length = rows(shape)
  return count, -(-length // BLOCK)


def scales_sharding(sharding: Any, ndim: int) -> Any:
  """Where a moment's scales live, given its codes' ``sharding``: split as its rows are."""
  if not isinstance(sharding, jax.sharding.NamedSharding):
    return sharding
  rows = sharding.spec[0] if ndim >= 2 and len(sharding.spec) else None
  return sharding.update(spec=jax.sharding.PartitionSpec(rows, None))


def bytes_per_element(shape: tuple[int, ...]) -> float:
  """What a moment of ``shape`` holds an element: its code and its share of the scales."""
  return 1 + 4 * math.prod(scales_shape(shape)) / max(math.prod(shape), 1)


def _blocks(x: jax.Array) -> jax.Array:
  """``x`` as ``(rows, blocks, BLOCK)``, each row's last block padded with zeros."""
  count, length = rows(x.shape)
  blocks = -(-length // BLOCK)
  flat = x.reshape(count, length)
  return jnp.pad(flat, ((0, 0), (0, blocks * BLOCK - length))).reshape(count, blocks, BLOCK)


def _unblocks(blocks: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  count, length = rows(shape)
  return blocks.reshape(count, -1)[:, :length].reshape(shape)


class BlockwiseMoment(NamedTuple):
  """A moment in this format inside a JAX state (a pytree of two arrays, as optax states hold).

  ``jaxoffload.host.adam.CodedMoment`` is the same format in numpy arrays.
  """

  codes: jax.Array  # int8 for a first moment, uint8 for a second; the moment's shape.
  scales: jax.Array  # float32, ``scales_shape``: each block's largest magnitude.

  @classmethod
  def of(cls, x: jax.Array, *, signed: bool) -> "BlockwiseMoment":
    """``x`` encoded: signed for a first moment, else a second."""
    return cls(*encode(x, signed=signed))

  def value(self) -> jax.Array:
    """The float32 moment stored."""
    return decode(self.codes, self.scales, signed=self.codes.dtype == jnp.int8)


# Each code magnitude's level, as code**2 * SIGNED_STEP (or code**4 * UNSIGNED_STEP) rounds it
# in float32. Looked up rather than multiplied: XLA reassociates a multiplication by a
# constant with the scale's, which rounds otherwise than the host kernel.
_LEVELS = {True: np.arange(128, dtype=np.float32)**2 * SIGNED_STEP,
           False: (np.arange(256, dtype=np.float32)**2)**2 * UNSIGNED_STEP}


def level(codes: jax.Array, *, signed: bool) -> jax.Array:
  """The level of each code's magnitude, a fraction of its block's scale."""
  table = jnp.asarray(_LEVELS[signed])
  if jax.typeof(codes).memory_space == jax.memory.Space.Host:  # Updated by the host CPU.
    table = jax.device_put(table, jax.memory.Space.Host)
  return table[jnp.abs(codes.astype(jnp.int32))]


def encode(x: jax.Array, *, signed: bool) -> tuple[jax.Array, jax.Array]:
  """``x``'s codes (``x``'s shape) and scales (``scales_shape``).

  Args:
    x: the moment, float32 (never negative unless ``signed``).
    signed: the first moment's format; else the second's.
  """
  x = x.astype(jnp.float32)
  blocks = _blocks(x)
  scales = jnp.max(jnp.abs(blocks), axis=-1)
  # A zero block divides zeros by the smallest normal number: its codes are zeros.
  inverse = 1 / jnp.maximum(scales, jnp.finfo(jnp.float32).tiny)
  root = jnp.sqrt(jnp.abs(blocks) * inverse[..., None])
  if not signed:
    root = jnp.sqrt(root)
  top = jnp.float32(127 if signed else 255)
  codes = jnp.minimum(jnp.floor(root * top + jnp.float32(0.5)), top)
  if signed:
    codes = jnp.where(blocks < 0, -codes, codes)
  return _unblocks(codes.astype(jnp.int32).astype(code_dtype(signed)), x.shape), scales


def decode(codes: jax.Array, scales: jax.Array, *, signed: bool) -> jax.Array:
  """The float32 moment that ``codes`` and ``scales`` (``encode``'s) store."""
  blocks = _blocks(codes.astype(jnp.int32))
  values = level(blocks, signed=signed) * scales[..., None]
  if signed:
    values = jnp.where(blocks < 0, -values, values)
  return _unblocks(values, codes.shape)
