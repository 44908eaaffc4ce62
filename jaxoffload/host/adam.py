"""AdamW on the host's cores, in place, outside any XLA program.

XLA's host computation (``compute_on('device_host')``) runs on one core; a
numba kernel uses them all (docs/performance.md#host-adam). ``adamw_update``
applies one AdamW step in place, with optax.adamw's arithmetic (the bias
corrections multiplied by their reciprocals: a rounding apart), on every core
numba is allowed. It takes float32 or bfloat16 gradients; float32 weights,
bfloat16 weights with the 16-bit remainders that make them an exact float32
master (a device reads the bfloat16 half), or bfloat16 weights alone; and
moments in float32, bfloat16 or 8-bit blocks (``CodedMoment``). The loops
live in ``jaxoffload.host.kernels``. ``adamw_undo`` takes an update back.

It works on numpy arrays. ``writable_view`` gives one over the memory of a
single-shard JAX array in host memory, so the kernel can update JAX's pinned
buffers without copies; that writes behind JAX's back, with the rules listed
there. Needs the ``host`` extra (numba).
"""

from __future__ import annotations

import ctypes
import dataclasses
from typing import Optional, Union

import jax
import ml_dtypes
import numpy as np

from jaxoffload import rounding
from jaxoffload.host import kernels
from jaxoffload.host.kernels import require_numba
from jaxoffload.optim import blockwise

# The kernels' view of a moment's storage, by dtype (``host.kernels.MOMENTS``).
_MOMENT_KINDS = {np.dtype(np.float32): "float32", np.dtype(ml_dtypes.bfloat16): "bfloat16"}


@dataclasses.dataclass(frozen=True)
class CodedMoment:
  """A moment in ``jaxoffload.optim.blockwise``'s 8-bit format, in numpy arrays the kernel updates.

  Attributes:
    codes: int8 for a first moment, uint8 for a second; the moment's shape.
    scales: float32, ``blockwise.scales_shape(codes.shape)``: a scale per block of a row.

  Example:
    >>> mu = CodedMoment.zeros((4, 64, 32), signed=True)
    >>> mu[2].decode().shape  # Layer 2 of a stacked leaf: one row.
    (64, 32)
  """

  codes: np.ndarray
  scales: np.ndarray

  @classmethod
  def zeros(cls, shape: tuple[int, ...], *, signed: bool) -> "CodedMoment":
    return cls(np.zeros(shape, blockwise.code_dtype(signed)),
               np.zeros(blockwise.scales_shape(shape), np.float32))

  @property
  def signed(self) -> bool:
    return self.codes.dtype == np.int8

  @property
  def shape(self) -> tuple[int, ...]:
    return self.codes.shape

  @property
  def nbytes(self) -> int:
    return self.codes.nbytes + self.scales.nbytes

  def __getitem__(self, index: int) -> "CodedMoment":
    """Row ``index`` of a moment stacked along its first axis."""
    return CodedMoment(self.codes[index], self.scales[index][None])

  def decode(self) -> np.ndarray:
    """The float32 moment the codes store."""
    out = np.empty(self.shape, np.float32)
    if out.size:
      kernels.decode_kernel(self.signed)(self.codes.reshape(-1), self.scales.reshape(-1),
                                         out.reshape(-1), self.codes.size // len(self.scales))
    return out

  def assign(self, values: np.ndarray) -> None:
    """Stores float32 ``values`` (of the moment's shape)."""
    values = np.ascontiguousarray(values, np.float32)
    if values.shape != self.shape:
      raise ValueError(f"values have shape {values.shape}, the moment has {self.shape}")
    if values.size:
      kernels.encode_kernel(self.signed)(values.reshape(-1), self.codes.reshape(-1),
                                         self.scales.reshape(-1),
                                         self.codes.size // len(self.scales))


Moment = Union[np.ndarray, CodedMoment]


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
  kernel = kernels.sum_kernel(grad_is_bf16, first, square_sum)
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


def adamw_update(param: np.ndarray, grad: np.ndarray, mu: Moment, nu: Moment, *,
                 learning_rate: float, count: int, b1: float = 0.9, b2: float = 0.999,
                 eps: float = 1e-8, weight_decay: float = 1e-4, grad_scale: float = 1.0,
                 remainder: Optional[np.ndarray] = None) -> None:
  """One AdamW step on weights and their moments, in place, on every core numba may use.

  Args:
    param: the weights, C-contiguous; overwritten. float32; or bfloat16 with
      ``remainder``: the float32 master split in two (``host.kernels``), exact; or
      bfloat16 alone, each update rounded stochastically (salted by ``count``, as
      ``jaxoffload.rounding.apply_updates`` rounds).
    grad: the gradient, float32 or bfloat16, of that shape.
    mu, nu: the moments, of that shape: float32 or bfloat16 arrays (bfloat16 kept
      rounded stochastically, bit for bit as ``jaxoffload.rounding.stochastic_round``
      with the device optimizer's salts), or ``CodedMoment``s (8-bit, as
      ``jaxoffload.optim.blockwise`` encodes them); overwritten.
    learning_rate: this step's learning rate.
    count: the step number, from 1, for the bias corrections.
    b1, b2, eps, weight_decay: as ``optax.adamw``.
    grad_scale: multiplies the gradient first (global-norm clipping's factor).
    remainder: uint16, the low halves of a split float32 master (bfloat16 ``param``).

  Raises:
    ValueError: naming the array that is of a wrong dtype, not contiguous or
      of another shape.

  Example:
    >>> adamw_update(w, g, m, v, learning_rate=3e-4, count=1)
  """
  weights = _check_step_arrays(param, grad, mu, nu, remainder, count)
  if param.size == 0:
    return
  flat = lambda a: _bits(a) if a.dtype == ml_dtypes.bfloat16 else a.reshape(-1)
  placeholder = np.zeros(1, np.float32)
  storage = lambda m: ("int8", m.codes.reshape(-1), m.scales.reshape(-1)) if isinstance(
      m, CodedMoment) else (_MOMENT_KINDS[m.dtype], flat(m), placeholder)
  (mu_kind, mu_values, mu_scales), (nu_kind, nu_values, nu_scales) = storage(mu), storage(nu)
  rows = len(mu.scales) if isinstance(mu, CodedMoment) else (
      len(nu.scales) if isinstance(nu, CodedMoment) else 1)
  f32 = np.float32
  row_length = param.size // rows
  kernels.step_kernel(grad.dtype == ml_dtypes.bfloat16, weights, mu_kind, nu_kind)(
      flat(param), np.zeros(1, np.uint16) if remainder is None else remainder.reshape(-1),
      flat(grad), mu_values, mu_scales, nu_values, nu_scales, row_length,
      # optax takes 1 - b1 in Python's float64 and rounds it once: 0.1, not
      # float32(1) - float32(0.9) = 0.100000024.
      f32(grad_scale), f32(learning_rate), f32(b1), f32(b2), f32(1 - b1), f32(1 - b2),
      f32(eps), f32(weight_decay), f32(1 - b1**count), f32(1 - b2**count),
      # jaxoffload.optim.offloaded_adam's salts: the moments' own, from the step count; the weights', the
      # count (jaxoffload.rounding.apply_updates's).
      _salt(2 * count), _salt(2 * count + 1), _salt(count))


def adamw_undo(param: np.ndarray, grad: np.ndarray, mu: np.ndarray, nu: np.ndarray, *,
               learning_rate: float, count: int, b1: float = 0.9, b2: float = 0.999,
               eps: float = 1e-8, weight_decay: float = 1e-4, grad_scale: float = 1.0,
               remainder: Optional[np.ndarray] = None) -> None:
  """Takes back the ``adamw_update`` of the same arguments, in place, up to rounding.

  For an update applied before its gradient's scale was known (``HostAdamW``'s
  speculation): undo it, then update again with the right ``grad_scale``. The
  weights and first moment come back within a few float32 roundings; the second
  moment within a rounding of its updated value (where ``grad**2`` outweighed
  it, that is the whole of it), and never below zero. Needs float32 moments and a
  float32 master, whole or split.

  Args:
    param, grad, mu, nu, learning_rate, count, b1, b2, eps, weight_decay,
      grad_scale, remainder: exactly as the ``adamw_update`` being undone had them.

  Raises:
    ValueError: as ``adamw_update``; for moments that are not float32 or bfloat16 weights
      without their remainder.

  Example:
    >>> adamw_update(w, g, m, v, learning_rate=3e-4, count=5)
    >>> adamw_undo(w, g, m, v, learning_rate=3e-4, count=5)  # w, m, v as before
  """
  weights = _check_step_arrays(param, grad, mu, nu, remainder, count,
                               moment_dtypes=(np.float32,))
  if weights == "bfloat16":
    raise ValueError("an update of bfloat16 weights without their remainder cannot be taken "
                     "back (its rounding was stochastic)")
  if param.size == 0:
    return
  grad_is_bf16 = grad.dtype == ml_dtypes.bfloat16
  f32 = np.float32
  kernels.undo_kernel(grad_is_bf16, weights == "split")(
      _bits(param) if weights == "split" else param.reshape(-1),
      np.zeros(1, np.uint16) if remainder is None else remainder.reshape(-1),
      _bits(grad) if grad_is_bf16 else grad.reshape(-1), mu.reshape(-1), nu.reshape(-1),
      f32(grad_scale), f32(learning_rate), f32(b1), f32(b2), f32(1 - b1), f32(1 - b2),
      f32(eps), f32(1 - learning_rate * weight_decay), f32(1 - b1**count), f32(1 - b2**count))


def _salt(value: int) -> np.uint32:
  """``jaxoffload.rounding``'s salt for ``value``: spread by the golden ratio, in 32 bits."""
  return np.uint32((value * rounding.GOLDEN) & 0xFFFFFFFF)


def _bits(array: np.ndarray) -> np.ndarray:
  """A bfloat16 array's elements as their uint16 bits, flat: how the kernels take them."""
  return array.reshape(-1).view(np.uint16)


def _check_step_arrays(param, grad, mu, nu, remainder, count: int, *,
                       moment_dtypes: tuple = (np.float32, ml_dtypes.bfloat16)) -> str:
  """How the weights are stored (``host.kernels.WEIGHTS``); raises ValueError naming the
  first of the step's arrays, or ``count``, that the kernel refuses."""
  _check_array("param", param, (np.float32, ml_dtypes.bfloat16), param, "param")
  _check_array("grad", grad, (np.float32, ml_dtypes.bfloat16), param, "param")
  if remainder is not None:
    if param.dtype != ml_dtypes.bfloat16:
      raise ValueError(f"a remainder completes bfloat16 weights; param is {param.dtype}")
    _check_array("remainder", remainder, (np.uint16,), param, "param")
  for name, moment in (("mu", mu), ("nu", nu)):
    if isinstance(moment, CodedMoment):
      if len(moment_dtypes) < 2:
        raise ValueError(f"{name} must be float32, got 8-bit codes")
      if moment.signed != (name == "mu"):
        raise ValueError(f"{name} must have {'int8' if name == 'mu' else 'uint8'} codes, got "
                         f"{moment.codes.dtype}")
      _check_array(f"{name}.codes", moment.codes, (moment.codes.dtype,), param, "param")
      _check_array(f"{name}.scales", moment.scales, (np.float32,), moment.scales,
                   f"{name}.scales")
      rows = moment.scales.shape[0] if moment.scales.ndim == 2 else 0
      need = (rows, -(-moment.codes.size // rows // blockwise.BLOCK)) if rows else None
      if need is None or moment.codes.size % rows or moment.scales.shape != need:
        raise ValueError(f"{name}.scales has shape {moment.scales.shape}: its codes need a row "
                         f"of scales, one per block of {blockwise.BLOCK}, for each of rows "
                         f"that divide them evenly")
    else:
      _check_array(name, moment, moment_dtypes, param, "param")
  if count < 1:
    raise ValueError(f"count must be at least 1 (the first step is 1), got {count}")
  if param.dtype == np.float32:
    return "float32"
  return "split" if remainder is not None else "bfloat16"


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
  require_numba()
  import numba  # Installed: require_numba says so.
  return numba.get_num_threads()
