"""The host kernels' numba code: AdamW a block of elements at a time, its undo, gradient sums.

Each kernel is compiled once per combination of storage formats, the formats
fixed at compile time so that the loops have no branches on them and
vectorise. Arrays come flat; bfloat16 ones as their uint16 bits.
``jaxoffload.host.adam`` checks the arrays and calls these.

The weights are stored one of three ways (``WEIGHTS``): float32; ``split``,
the float32 master as the bfloat16 weight a device reads plus the 16 bits it
drops (TransformerEngine's ``store_param_remainders``: the bfloat16 half is the
master rounded to nearest, ties away from zero, and the remainder restores the
master exactly); or bfloat16, each update rounded stochastically. The moments
are float32, bfloat16 (rounded stochastically) or ``jaxoffload.optim.blockwise``'s
8-bit codes (``MOMENTS``).
"""

from __future__ import annotations

import functools

import numpy as np

from jaxoffload import rounding
from jaxoffload.optim import blockwise

try:
  import numba
except ImportError:  # The in-graph transforms work without it.
  numba = None

WEIGHTS = ("float32", "split", "bfloat16")
MOMENTS = ("float32", "bfloat16", "int8")

_HASH_1, _HASH_2 = rounding.HASH_MULTIPLIERS
_SIGNED_STEP, _UNSIGNED_STEP = blockwise.SIGNED_STEP, blockwise.UNSIGNED_STEP
_BLOCK = blockwise.BLOCK
_GROUP = 64  # blocks per parallel iteration of the 8-bit step
_TINY = np.float32(np.finfo(np.float32).tiny)


def require_numba() -> None:
  if numba is None:
    raise ImportError("jaxoffload's host kernel needs numba: pip install 'jaxoffload[host]'")


def _jit_inline(f):
  return numba.njit(inline="always")(f) if numba else f


@_jit_inline
def _widen(bits):
  # numba widens integer arithmetic to 64 bits: each result is cut back to 32.
  return np.uint32(np.uint32(bits) << 16).view(np.float32)


@_jit_inline
def _hash(bits):
  # jaxoffload.rounding.hash_bits.
  h = np.uint32(bits)
  h = np.uint32(h ^ (h >> 16))
  h = np.uint32(h * np.uint32(_HASH_1))
  h = np.uint32(h ^ (h >> 15))
  h = np.uint32(h * np.uint32(_HASH_2))
  return np.uint32(h ^ (h >> 16))


@_jit_inline
def _stochastic_bfloat16(x, salt):
  # jaxoffload.rounding.stochastic_round, bit for bit: noise from a hash of the value's bits
  # and the salt, added below the 16 bits bfloat16 keeps.
  bits = np.float32(x).view(np.uint32)
  return np.uint16(np.uint32(bits + (_hash(bits ^ salt) & 0xFFFF)) >> 16)


@_jit_inline
def _join(high, low):
  # The float32 of a split weight: the bfloat16 half was rounded up where the remainder's
  # top bit is set.
  bits = np.uint32((np.uint32(high) << 16) | np.uint32(low))
  return np.uint32(bits - np.uint32(0x10000 if low >= 0x8000 else 0)).view(np.float32)


@_jit_inline
def _split_high(x):
  # A NaN stays a NaN of its sign (its remainder would round it into the sign bit). A
  # select, not a branch, so that the loops around it vectorise.
  bits = np.float32(x).view(np.uint32)
  rounded = np.uint16(np.uint32((bits >> 16) + ((bits >> 15) & 1)))
  quiet_nan = np.uint16(np.uint32((bits >> 16) & 0x8000) | 0x7FC0)
  return quiet_nan if x != x else rounded


@_jit_inline
def _split_low(x):
  return np.uint16(np.float32(x).view(np.uint32) & 0xFFFF)


@_jit_inline
def _block_bounds(block, row_length):
  # The elements of a block: BLOCK of a row, the row's last block shorter. Unsigned, so that
  # indexing needs no wrap-around of negative indices: the loops over them vectorise.
  per_row = (row_length + _BLOCK - 1) // _BLOCK
  row = block // per_row
  start = np.uint64(row * row_length + (block - row * per_row) * _BLOCK)
  return start, np.uint64(min(start + _BLOCK, (row + 1) * row_length))


@_jit_inline
def _blocks(size, row_length):
  return size // row_length * ((row_length + _BLOCK - 1) // _BLOCK)


@_jit_inline
def _inverse(scale):
  # jaxoffload.optim.blockwise's inverse scale; an all-zero block's codes come out zero.
  return np.float32(1) / max(scale, _TINY)


@_jit_inline
def _level(code, signed):
  # jaxoffload.optim.blockwise.level: the level of a code's magnitude (a float32 of a whole
  # number), as a fraction of its block's scale. Float arithmetic throughout: numba's
  # integers are 64 bits wide, whose conversions to float do not vectorise.
  square = code * code
  if signed:
    return square * _SIGNED_STEP
  return (square * square) * _UNSIGNED_STEP


@_jit_inline
def _decode(code, scale, signed):
  # jaxoffload.optim.blockwise.decode of one element.
  c = np.float32(np.int32(code))
  magnitude = _level(c, signed) * scale
  return -magnitude if c < 0 else magnitude


@_jit_inline
def _encode(x, inverse_scale, signed):
  # jaxoffload.optim.blockwise.encode of one element, given its block's inverse scale: the nearest
  # code of the companded magnitude. Selects, not branches, and no division: the loops
  # around it vectorise.
  top = np.float32(127 if signed else 255)
  root = np.sqrt(abs(x) * inverse_scale)
  if not signed:
    root = np.sqrt(root)
  code = min(np.floor(root * top + np.float32(0.5)), top)
  return np.int32((-code if x < 0 else code) if signed else code)


@_jit_inline
def _moments(i, grad, mu, mu_scale, nu, nu_scale, hyper, formats):
  # Element i's new moments, as optax.adamw, in float32. 8-bit moments decode with their
  # block's old scale.
  grad_is_bf16, _, _, mu_bf16, mu_codes, nu_bf16, nu_codes = formats
  grad_scale, _, b1, b2, one_minus_b1, one_minus_b2, _, _, _, _, _, _, _ = hyper
  g = (_widen(grad[i]) if grad_is_bf16 else grad[i]) * grad_scale
  old_m = _decode(mu[i], mu_scale, True) if mu_codes else _widen(mu[i]) if mu_bf16 else mu[i]
  old_v = _decode(nu[i], nu_scale, False) if nu_codes else _widen(nu[i]) if nu_bf16 else nu[i]
  return b1 * old_m + one_minus_b1 * g, b2 * old_v + one_minus_b2 * (g * g)


@_jit_inline
def _store_moment(moment, i, value, inverse_scale, salt, codes, bf16, signed):
  if codes:
    moment[i] = _encode(value, inverse_scale, signed)
  elif bf16:
    moment[i] = _stochastic_bfloat16(value, salt)
  else:
    moment[i] = value


@_jit_inline
def _store(i, param, remainder, mu, m, mu_inverse, nu, v, nu_inverse, hyper, formats):
  # Element i's moments stored (8-bit ones encoded with their block's new scale) and its
  # weight updated: bias correction, decoupled weight decay, learning rate. The update
  # reads the new moments before they are stored rounded, as jaxoffload.optim.offloaded_adam does.
  _, split, bf16_weights, mu_bf16, mu_codes, nu_bf16, nu_codes = formats
  (_, lr, _, _, _, _, eps, weight_decay, inverse_bias1, inverse_bias2, mu_salt, nu_salt,
   param_salt) = hyper
  _store_moment(mu, i, m, mu_inverse, mu_salt, mu_codes, mu_bf16, True)
  _store_moment(nu, i, v, nu_inverse, nu_salt, nu_codes, nu_bf16, False)
  if split:
    p = _join(param[i], remainder[i])
  elif bf16_weights:
    p = _widen(param[i])
  else:
    p = param[i]
  new = p - lr * ((m * inverse_bias1) / (np.sqrt(v * inverse_bias2) + eps) + weight_decay * p)
  if split:
    param[i] = _split_high(new)
    remainder[i] = _split_low(new)
  elif bf16_weights:
    param[i] = _stochastic_bfloat16(new, param_salt)
  else:
    param[i] = new


@functools.cache
def step_kernel(grad_is_bf16: bool, weights: str, mu: str, nu: str):
  """The AdamW step for one kind of gradient, weights and moments (``WEIGHTS``, ``MOMENTS``)."""
  require_numba()
  mu_codes, nu_codes = mu == "int8", nu == "int8"
  coded = mu_codes or nu_codes
  # Constants of the kernel's closure, which numba folds: the loops have no branches on them.
  # Plain values, not functions, so that its cache entry is found again by the next process.
  formats = (grad_is_bf16, weights == "split", weights == "bfloat16", mu == "bfloat16",
             mu_codes, nu == "bfloat16", nu_codes)

  # nogil: HostAdamW's background thread updates while the caller's dispatches.
  @numba.njit(parallel=True, cache=True, nogil=True)
  def step(param, remainder, grad, mu, mu_scales, nu, nu_scales, row_length, grad_scale, lr,
           b1, b2, one_minus_b1, one_minus_b2, eps, weight_decay, bias1, bias2, mu_salt,
           nu_salt, param_salt):
    zero = np.float32(0)
    # The bias corrections' reciprocals, multiplied by: a division an element costs more.
    hyper = (grad_scale, lr, b1, b2, one_minus_b1, one_minus_b2, eps, weight_decay,
             np.float32(1) / bias1, np.float32(1) / bias2, mu_salt, nu_salt, param_salt)
    if not coded:
      for i in numba.prange(param.size):
        m, v = _moments(i, grad, mu, zero, nu, zero, hyper, formats)
        _store(i, param, remainder, mu, m, zero, nu, v, zero, hyper, formats)
      return
    # A block of a row at a time: its new moments into scratch, with their largest
    # magnitudes (the new scales), then stored. The maximum is taken over the floats' bits,
    # an order non-negative floats share: an integer maximum vectorises. A group of blocks
    # per parallel iteration shares one scratch allocation.
    blocks = _blocks(param.size, row_length)
    for group in numba.prange((blocks + _GROUP - 1) // _GROUP):
      new_mu = np.empty(_BLOCK, np.float32)
      new_nu = np.empty(_BLOCK, np.float32)
      for block in range(group * _GROUP, min(blocks, (group + 1) * _GROUP)):
        start, stop = _block_bounds(block, row_length)
        old_mu_scale = mu_scales[block] if mu_codes else zero
        old_nu_scale = nu_scales[block] if nu_codes else zero
        mu_bits, nu_bits = np.uint32(0), np.uint32(0)
        for i in range(start, stop):
          m, v = _moments(i, grad, mu, old_mu_scale, nu, old_nu_scale, hyper, formats)
          new_mu[i - start], new_nu[i - start] = m, v
          mu_bits = max(mu_bits, np.uint32(np.float32(m).view(np.uint32) & 0x7FFFFFFF))
          nu_bits = max(nu_bits, np.uint32(np.float32(v).view(np.uint32) & 0x7FFFFFFF))
        mu_scale = np.uint32(mu_bits).view(np.float32)
        nu_scale = np.uint32(nu_bits).view(np.float32)
        mu_inverse, nu_inverse = _inverse(mu_scale), _inverse(nu_scale)
        for i in range(start, stop):
          _store(i, param, remainder, mu, new_mu[i - start], mu_inverse, nu,
                 new_nu[i - start], nu_inverse, hyper, formats)
        if mu_codes:
          mu_scales[block] = mu_scale
        if nu_codes:
          nu_scales[block] = nu_scale

  return step


@functools.cache
def undo_kernel(grad_is_bf16: bool, split: bool):
  """``step_kernel``'s step with float32 moments run backwards, for one kind of gradient
  and of float32 master (whole or split)."""
  require_numba()

  @numba.njit(parallel=True, cache=True, nogil=True)
  def undo(param, remainder, grad, mu, nu, grad_scale, lr, b1, b2, one_minus_b1, one_minus_b2,
           eps, decay, bias1, bias2):
    # The step's update is a function of the new moments; the weight decay, a factor on the
    # old weight: new = old * (1 - lr * weight_decay) - lr * update.
    inverse_bias1, inverse_bias2 = np.float32(1) / bias1, np.float32(1) / bias2  # As the step.
    for i in numba.prange(param.size):
      g = (_widen(grad[i]) if grad_is_bf16 else grad[i]) * grad_scale
      m = mu[i]
      v = nu[i]
      update = (m * inverse_bias1) / (np.sqrt(v * inverse_bias2) + eps)
      p = _join(param[i], remainder[i]) if split else param[i]
      old = (p + lr * update) / decay
      if split:
        param[i] = _split_high(old)
        remainder[i] = _split_low(old)
      else:
        param[i] = old
      mu[i] = (m - one_minus_b1 * g) / b1
      # A moment that was ~0 comes back as rounding noise, which may be negative.
      nu[i] = max((v - one_minus_b2 * (g * g)) / b2, np.float32(0))

  return undo


@functools.cache
def encode_kernel(signed: bool):
  """Float32 values into 8-bit codes and their blocks' scales (``jaxoffload.optim.blockwise``)."""
  require_numba()

  @numba.njit(parallel=True, cache=True)
  def encode(values, codes, scales, row_length):
    for block in numba.prange(_blocks(values.size, row_length)):
      start, stop = _block_bounds(block, row_length)
      scale = np.float32(0)
      for i in range(start, stop):
        scale = max(scale, abs(values[i]))
      scales[block] = scale
      inverse = _inverse(scale)
      for i in range(start, stop):
        codes[i] = _encode(values[i], inverse, signed)

  return encode


@functools.cache
def decode_kernel(signed: bool):
  """8-bit codes and their blocks' scales into float32 values."""
  require_numba()

  @numba.njit(parallel=True, cache=True)
  def decode(codes, scales, values, row_length):
    for block in numba.prange(_blocks(codes.size, row_length)):
      start, stop = _block_bounds(block, row_length)
      for i in range(start, stop):
        values[i] = _decode(codes[i], scales[block], signed)

  return decode


@functools.cache
def sum_kernel(grad_is_bf16: bool, first: bool, square_sum: bool):
  """The gradient sum compiled for one kind of gradient, start and norm."""
  require_numba()

  @numba.njit(parallel=True, cache=True)
  def accumulate(total, grad):
    # A float64 sum of squares: the norm of billions of float32 elements.
    squares = 0.0
    for i in numba.prange(total.size):
      g = _widen(grad[i]) if grad_is_bf16 else grad[i]
      t = g if first else total[i] + g
      total[i] = t
      if square_sum:
        squares += np.float64(t) * np.float64(t)
    return squares

  return accumulate
