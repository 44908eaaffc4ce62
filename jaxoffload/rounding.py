"""Stochastic rounding of float32 to bfloat16, for optimizer state and parameters kept in bfloat16.

Adam's second moment decays by ``b2`` (0.999) each step: a relative change of
0.1%, below bfloat16's half step (0.4%), so rounding to nearest leaves it where
it was and it never decays. Rounding up with probability equal to the
fraction cut off keeps every update in expectation.

The random bits are a hash of the value's own bits and a salt (the step),
not a random key: the same function runs on the device, in host computation
and in every streamed piece of a leaf without knowing where in the leaf it is,
and a run is reproducible.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

# Multipliers of the "lowbias32" integer hash (``jaxoffload.host_adam`` hashes as this does).
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
