"""AdamW on the host's cores, in place, outside any XLA program.

XLA's host computation (``compute_on('device_host')``) runs on one core; a
numba kernel uses them all (docs/performance.md#host-adam). This module is
that kernel: ``adamw_update`` applies one AdamW step to float32 arrays in
place, with optax.adamw's arithmetic, using every core numba is allowed; it
also takes bfloat16 gradients and writes a bfloat16 copy of the new weights,
for a device that reads and sends half the bytes, and keeps the moments in
float32 or bfloat16. ``adamw_undo`` takes an update back.

It works on numpy arrays. ``writable_view`` gives one over the memory of a
single-shard JAX array in host memory, so the kernel can update JAX's pinned
buffers without copies; that writes behind JAX's back, with the rules listed
there. Needs the ``host`` extra (numba).
"""

from __future__ import annotations

import ctypes
import functools
import math

import jax
import ml_dtypes
import numpy as np

from jaxoffload import rounding

try:
  import numba
except ImportError:  # The in-graph transforms work without it.
  numba = None


def _require_numba() -> None:
  if numba is None:
    raise ImportError("jaxoffload.host_adam needs numba: pip install 'jaxoffload[host]'")


@numba.njit(inline="always") if numba else (lambda f: f)
def _widen(bits):
  # numba widens integer arithmetic to 64 bits: each result is cut back to 32.
  return np.uint32(np.uint32(bits) << 16).view(np.float32)


@numba.njit(inline="always") if numba else (lambda f: f)
def _round_to_bfloat16(x):
  # Round to nearest even, as XLA's convert; a NaN stays a quiet NaN of its sign. A select,
  # not a branch, so that the loops around it vectorise.
  bits = np.float32(x).view(np.uint32)
  rounded = np.uint16(np.uint32(bits + 0x7FFF + ((bits >> 16) & 1)) >> 16)
  quiet_nan = np.uint16(np.uint32((bits >> 16) & 0x8000) | 0x7FC0)
  return quiet_nan if x != x else rounded


_HASH_1, _HASH_2 = rounding.HASH_MULTIPLIERS


@numba.njit(inline="always") if numba else (lambda f: f)
def _stochastic_bfloat16(x, salt):
  # jaxoffload.rounding.stochastic_round, bit for bit: noise from a hash of the value's bits
  # and the salt, added below the 16 bits bfloat16 keeps.
  bits = np.float32(x).view(np.uint32)
  h = np.uint32(bits ^ salt)
  h = np.uint32(h ^ (h >> 16))
  h = np.uint32(h * np.uint32(_HASH_1))
  h = np.uint32(h ^ (h >> 15))
  h = np.uint32(h * np.uint32(_HASH_2))
  h = np.uint32(h ^ (h >> 16))
  return np.uint16(np.uint32(bits + (h & 0xFFFF)) >> 16)


@functools.cache
def _step_kernel(grad_is_bf16: bool, has_copy: bool, mu_is_bf16: bool = False,
                 nu_is_bf16: bool = False):
  """The AdamW step compiled for one kind of gradient and of each moment, with or without the
  bfloat16 copy: with the choices fixed at compile time the loop has no branches, and
  vectorises."""
  _require_numba()

  # nogil: HostAdamW's background thread updates while the caller's dispatches.
  @numba.njit(parallel=True, cache=True, nogil=True)
  def step(param, grad, copy, mu, nu, grad_scale, lr, b1, b2, one_minus_b1, one_minus_b2, eps,
           weight_decay, bias1, bias2, mu_salt, nu_salt):
    # Element by element, as optax.adamw: moments, bias correction, decoupled
    # weight decay, learning rate. Scalars are float32, so is the arithmetic.
    # bfloat16 arrays come as their uint16 bits; bfloat16 moments are stored rounded
    # stochastically, the update computed from them before rounding (as jaxoffload.adam).
    for i in numba.prange(param.size):
      g = (_widen(grad[i]) if grad_is_bf16 else grad[i]) * grad_scale
      m = b1 * (_widen(mu[i]) if mu_is_bf16 else mu[i]) + one_minus_b1 * g
      v = b2 * (_widen(nu[i]) if nu_is_bf16 else nu[i]) + one_minus_b2 * (g * g)
      if mu_is_bf16:
        mu[i] = _stochastic_bfloat16(m, mu_salt)
      else:
        mu[i] = m
      if nu_is_bf16:
        nu[i] = _stochastic_bfloat16(v, nu_salt)
      else:
        nu[i] = v
      update = (m / bias1) / (np.float32(math.sqrt(v / bias2)) + eps) + weight_decay * param[i]
      new = param[i] - lr * update
      param[i] = new
      if has_copy:
        copy[i] = _round_to_bfloat16(new)

  return step


@functools.cache
def _undo_kernel(grad_is_bf16: bool):
  """``_step_kernel``'s step run backwards, for one kind of gradient."""
  _require_numba()

  @numba.njit(parallel=True, cache=True, nogil=True)
  def undo(param, grad, mu, nu, grad_scale, lr, b1, b2, one_minus_b1, one_minus_b2, eps, decay,
           bias1, bias2):
    # The step's update is a function of the new moments; the weight decay, a factor on the
    # old weight: new = old * (1 - lr * weight_decay) - lr * update.
    for i in numba.prange(param.size):
      g = (_widen(grad[i]) if grad_is_bf16 else grad[i]) * grad_scale
      m = mu[i]
      v = nu[i]
      update = (m / bias1) / (np.float32(math.sqrt(v / bias2)) + eps)
      param[i] = (param[i] + lr * update) / decay
      mu[i] = (m - one_minus_b1 * g) / b1
      # A moment that was ~0 comes back as rounding noise, which may be negative.
      nu[i] = max((v - one_minus_b2 * (g * g)) / b2, np.float32(0))

  return undo


@functools.cache
def _sum_kernel(grad_is_bf16: bool, first: bool, square_sum: bool):
  """The gradient sum compiled for one kind of gradient, start and norm (as ``_step_kernel``)."""
  _require_numba()

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


def accumulate(total: np.ndarray, grad: np.ndarray, *, first: bool = False,
               square_sum: bool = False) -> float:
  """Adds ``grad`` into the float32 ``total`` in place, on every core numba may use.

  Args:
    total: the running sum, float32, C-contiguous; overwritten.
    grad: float32 or bfloat16, of ``total``'s shape.
    first: start the sum: ``total`` becomes ``grad`` (its old values are not read).
    square_sum: also return the sum of the squares of the new total (in float64).

  Returns:
    That sum of squares, or 0.0 without ``square_sum``.

  Example:
    >>> accumulate(total, g0, first=True); squares = accumulate(total, g1, square_sum=True)
  """
  for name, array, dtypes in (("total", total, (np.float32,)),
                              ("grad", grad, (np.float32, ml_dtypes.bfloat16))):
    _check_array(name, array, dtypes, total, "total")
  grad_is_bf16 = grad.dtype == ml_dtypes.bfloat16
  flat = grad.reshape(-1)
  kernel = _sum_kernel(grad_is_bf16, first, square_sum)
  return float(kernel(total.reshape(-1), flat.view(np.uint16) if grad_is_bf16 else flat))


def _check_array(name: str, array: np.ndarray, dtypes: tuple, like: np.ndarray, like_name: str
                 ) -> None:
  """Raises ValueError naming ``array`` when its dtype, layout or shape (``like``'s) is not
  what the kernel takes."""
  if array.dtype not in dtypes:
    raise ValueError(f"{name} must be {' or '.join(np.dtype(d).name for d in dtypes)}, "
                     f"got {array.dtype}")
  if not array.flags.c_contiguous:
    raise ValueError(f"{name} must be C-contiguous")
  if array.shape != like.shape:
    raise ValueError(f"{name} has shape {array.shape}, {like_name} has {like.shape}")


def adamw_update(param: np.ndarray, grad: np.ndarray, mu: np.ndarray, nu: np.ndarray, *,
                 learning_rate: float, count: int, b1: float = 0.9, b2: float = 0.999,
                 eps: float = 1e-8, weight_decay: float = 1e-4, grad_scale: float = 1.0,
                 copy: np.ndarray | None = None) -> None:
  """One AdamW step on float32 weights and their moments, in place, on every core numba may use.

  Args:
    param: float32 weights, C-contiguous; overwritten.
    mu, nu: the moments, of that shape, float32 or bfloat16 (each kept rounded
      stochastically, bit for bit as ``jaxoffload.rounding.stochastic_round`` with
      the device optimizer's salts); overwritten.
    grad: the gradient, float32 or bfloat16, of that shape.
    learning_rate: this step's learning rate.
    count: the step number, from 1, for the bias corrections.
    b1, b2, eps, weight_decay: as ``optax.adamw``.
    grad_scale: multiplies the gradient first (global-norm clipping's factor).
    copy: a bfloat16 array that also receives the new parameters, rounded to nearest
      even as XLA's conversion does (what a device reading bfloat16 weights reads).

  Raises:
    ValueError: naming the array that is of a wrong dtype, not contiguous or
      of another shape.

  Example:
    >>> adamw_update(w, g, m, v, learning_rate=3e-4, count=1)
  """
  _check_step_arrays(param, grad, mu, nu, copy, count,
                     moment_dtypes=(np.float32, ml_dtypes.bfloat16))
  is_bf16 = [a.dtype == ml_dtypes.bfloat16 for a in (grad, mu, nu)]
  flat = lambda a, bf16: _bits(a) if bf16 else a.reshape(-1)
  f32 = np.float32
  _step_kernel(is_bf16[0], copy is not None, is_bf16[1], is_bf16[2])(
      param.reshape(-1), flat(grad, is_bf16[0]),
      np.zeros(1, np.uint16) if copy is None else _bits(copy), flat(mu, is_bf16[1]),
      flat(nu, is_bf16[2]),
      # optax takes 1 - b1 in Python's float64 and rounds it once: 0.1, not
      # float32(1) - float32(0.9) = 0.100000024.
      f32(grad_scale), f32(learning_rate), f32(b1), f32(b2), f32(1 - b1), f32(1 - b2),
      f32(eps), f32(weight_decay), f32(1 - b1**count), f32(1 - b2**count),
      # jaxoffload.adam's salts: the moments' own, from the step count.
      _salt(2 * count), _salt(2 * count + 1))


def adamw_undo(param: np.ndarray, grad: np.ndarray, mu: np.ndarray, nu: np.ndarray, *,
               learning_rate: float, count: int, b1: float = 0.9, b2: float = 0.999,
               eps: float = 1e-8, weight_decay: float = 1e-4, grad_scale: float = 1.0) -> None:
  """Takes back the ``adamw_update`` of the same arguments, in place, up to rounding.

  For an update applied before its gradient's scale was known (``HostAdamW``'s
  speculation): undo it, then update again with the right ``grad_scale``. The
  weights and first moment come back within a few float32 roundings; the second
  moment within a rounding of its updated value (where ``grad**2`` outweighed
  it, that is the whole of it), and never below zero. A bfloat16 copy is left as
  it is, for the update that follows to rewrite.

  Args:
    param, grad, mu, nu, learning_rate, count, b1, b2, eps, weight_decay,
      grad_scale: exactly as the ``adamw_update`` being undone had them.

  Raises:
    ValueError: as ``adamw_update``.

  Example:
    >>> adamw_update(w, g, m, v, learning_rate=3e-4, count=5)
    >>> adamw_undo(w, g, m, v, learning_rate=3e-4, count=5)  # w, m, v as before
  """
  _check_step_arrays(param, grad, mu, nu, None, count)
  grad_is_bf16 = grad.dtype == ml_dtypes.bfloat16
  f32 = np.float32
  _undo_kernel(grad_is_bf16)(
      param.reshape(-1), _bits(grad) if grad_is_bf16 else grad.reshape(-1), mu.reshape(-1),
      nu.reshape(-1), f32(grad_scale), f32(learning_rate), f32(b1), f32(b2), f32(1 - b1),
      f32(1 - b2), f32(eps), f32(1 - learning_rate * weight_decay), f32(1 - b1**count),
      f32(1 - b2**count))


def _salt(value: int) -> np.uint32:
  """``jaxoffload.rounding``'s salt for ``value``: spread by the golden ratio, in 32 bits."""
  return np.uint32((value * rounding.GOLDEN) & 0xFFFFFFFF)


def _bits(array: np.ndarray) -> np.ndarray:
  """A bfloat16 array's elements as their uint16 bits, flat: how the kernels take them."""
  return array.reshape(-1).view(np.uint16)


def _check_step_arrays(param, grad, mu, nu, copy, count: int, *,
                       moment_dtypes: tuple = (np.float32,)) -> None:
  """Raises ValueError naming the first of the step's arrays or ``count`` the kernel refuses."""
  allowed = {"grad": (np.float32, ml_dtypes.bfloat16), "copy": (ml_dtypes.bfloat16,),
             "mu": moment_dtypes, "nu": moment_dtypes}
  arrays = {"param": param, "grad": grad, "mu": mu, "nu": nu, "copy": copy}
  for name, array in arrays.items():
    if array is not None:
      _check_array(name, array, allowed.get(name, (np.float32,)), param, "param")
  if count < 1:
    raise ValueError(f"count must be at least 1 (the first step is 1), got {count}")


def writable_view(array: jax.Array) -> np.ndarray:
  """A writable numpy array over the memory of a one-shard JAX array in host memory.

  For the host kernel to update JAX's pinned buffers in place. Writing behind
  JAX's back is safe only if: the array is in host memory (``pinned_host``, or
  any array on the CPU backend); every computation that reads or writes it
  has finished (``jax.block_until_ready``) before you write and no
  transfer of it is in flight while you do; no other array shares its buffer
  (donation can make one, and on the CPU backend ``jax.device_put`` of a numpy
  array may keep using that array's memory); and it was never converted with
  ``np.asarray`` or printed before the write, since JAX keeps that first
  conversion and would show it again.

  Raises:
    ValueError: for an array of several shards or in device memory.
  """
  shards = array.addressable_shards
  if len(shards) != 1 or array.sharding.device_set != {shards[0].device}:
    raise ValueError(f"writable_view takes an array of one shard, got {len(shards)} on "
                     f"{len(array.sharding.device_set)} devices")
  kind = array.sharding.memory_kind
  if shards[0].device.platform != "cpu" and kind != "pinned_host":
    raise ValueError(f"writable_view needs host memory; the array is in {kind!r}")
  data = shards[0].data
  pointer = data.unsafe_buffer_pointer()
  buffer = (ctypes.c_byte * data.nbytes).from_address(pointer)
  return np.frombuffer(buffer, dtype=data.dtype).reshape(data.shape)


def max_threads() -> int:
  """How many threads the kernel may use (numba's setting; ``NUMBA_NUM_THREADS`` caps it)."""
  _require_numba()
  return numba.get_num_threads()
