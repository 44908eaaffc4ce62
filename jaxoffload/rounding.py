"""Float32 to bfloat16: stochastic rounding for state kept in bfloat16, exact splits of masters.

Adam's second moment decays by ``b2`` (0.999) each step: a relative change of
0.1%, below bfloat16's half step (0.4%), so rounding to nearest leaves it where
it was and it never decays. Rounding up with probability equal to the
fraction cut off keeps every update in expectation.

The random bits are a hash of the value's own bits and a salt (the step),
not a random key: the same function runs on the device, in host computation
and in every streamed piece of a leaf without knowing where in the leaf it is,
and a run is reproducible.

A split master is kept exactly instead: ``split_master`` cuts a float32 master into the
bfloat16 weight a device reads (rounded to nearest) and the 16 bits that restore it, and
``join_master`` puts the two back together.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# Multipliers of the "lowbias32" integer hash (``jaxoffload.host.adam`` hashes as this does).
HASH_MULTIPLIERS = (0x7FEB352D, 0x846CA68B)
# Spreads consecutive salts (steps) over the hash's input.
GOLDEN = 0x9E3779B9


def hash_bits(bits: jax.Array) -> jax.Array:
  """The lowbias32 hash of each uint32: well-spread bits for stochastic rounding."""
  bits = bits ^ (bits >> 16)
  bits = bits * jnp.uint32(HASH_MULTIPLIERS[0])
  bits = bits ^ (bits >> 15)
  bits = bits * jnp.uint32(HASH_MULTIPLIERS[1])
  return bits ^ (bits >> 16)


def stochastic_round(x: jax.Array, salt: Any, dtype: Any = jnp.bfloat16) -> jax.Array:
  """``x`` rounded to ``dtype``, up or down at random in proportion to the distance.

  Args:
    x: the values; computed in float32.
    salt: an integer (a step count, a moment's index) mixed into the random
      bits, so that the same value rounds differently at different steps.
    dtype: bfloat16 (stochastic); any other dtype is a plain cast.

  Returns:
    An array of ``dtype``: each element one of the two ``dtype`` values around
    its ``x``, the nearer one more often, equal to ``x`` on average.

  Example:
    >>> nu = stochastic_round(b2 * nu + (1 - b2) * g**2, salt=count)
  """
  if jnp.dtype(dtype) != jnp.bfloat16:
    return x.astype(dtype)
  bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
  salt = jnp.asarray(salt).astype(jnp.uint32) * jnp.uint32(GOLDEN)
  noise = hash_bits(bits ^ salt) & jnp.uint32(0xFFFF)
  # bfloat16 keeps float32's upper 16 bits: adding noise below them carries into
  # them with probability (the cut-off bits) / 2**16, then the cut is exact.
  rounded = (bits + noise) & jnp.uint32(0xFFFF0000)
  return jax.lax.bitcast_convert_type(rounded, jnp.float32).astype(jnp.bfloat16)


def apply_updates(params: Any, updates: Any, salt: Any) -> Any:
  """``optax.apply_updates``, with bfloat16 parameters rounded stochastically.

  A bfloat16 parameter keeps 8 bits of mantissa: an update below half its step
  is lost when rounded to nearest, and a long run of them never moves it.
  Here ``p + u`` is computed in float32 and rounded up or down in proportion, so
  that the parameter moves by ``u`` in expectation; other dtypes are as optax's.

  Args:
    params, updates: trees of one structure.
    salt: an integer that changes each step (the update count).

  Example:
    >>> params = apply_updates(params, updates, salt=count)
  """
  def apply(p, u):
    if p.dtype != jnp.bfloat16:
      return (p + u).astype(p.dtype)
    return stochastic_round(p.astype(jnp.float32) + u.astype(jnp.float32), salt)

  return jax.tree.map(apply, params, updates)


def join_master(high: np.ndarray, remainder: np.ndarray) -> np.ndarray:
  """The float32 master of a split weight: its bfloat16 half and its uint16 remainder."""
  bits = (high.view(np.uint16).astype(np.uint32) << 16) | remainder.astype(np.uint32)
  bits -= np.where(remainder >= 0x8000, np.uint32(0x10000), np.uint32(0))
  return bits.view(np.float32)


def split_master(master: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """A float32 master as its bfloat16 half (bits, uint16) and its uint16 remainder."""
  master = np.ascontiguousarray(master, np.float32)
  bits = master.view(np.uint32)
  high = ((bits >> 16) + ((bits >> 15) & 1)).astype(np.uint16)
  high = np.where(np.isnan(master), ((bits >> 16) & 0x8000 | 0x7FC0).astype(np.uint16), high)
  return high, (bits & 0xFFFF).astype(np.uint16)
