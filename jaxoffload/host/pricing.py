"""Choosing where offloaded optimizer state updates, from what this machine measures.

Both exact placements add copies and work to every step that nothing hides:

- ``device``: the Adam moments of the offloaded leaves come to the device and
  go back, one direction at a time.
- ``host_kernel``: the offloaded leaves' weights come to the device and their
  gradients go back (in float32, or bfloat16 with ``offload_transfer_dtype``),
  then the host's cores update weights and moments. Where the trainer
  overlaps that update with the next forward pass (``jaxoffload.train.per_layer.overlap``;
  unclipped, with the backward pass too), only the kernel's time beyond that
  device work adds to the step.

``measure_machine`` times one copy each way and one call of the host kernel;
``choose`` prices each placement and picks the cheaper; within ``TIE`` of each
other, the host kernel, which also takes the weights off the device. XLA's own
host computation (``host``) runs on one core and is never chosen. How close
the predictions come to measured step times:
[performance](../docs/performance.md#optimizer-offload).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import time
from typing import Callable, NamedTuple

import jax
import ml_dtypes
import numpy as np

from jaxoffload._compat import DEVICE_KIND, PINNED_HOST
from jaxoffload.host import adam

_PROBE_BYTES = 256 * 2**20
_PROBE_ELEMENTS = 32 * 2**20
_PROBE_ROW = 4096  # Elements of a row: 8-bit moments keep a scale per block of one.
# On the cpu backend the device's memory is the host's, and what is planned there is small:
# probes this many times smaller, still far past the caches, measure the same rates sooner.
CPU_PROBE_DIVISOR = 8
_REPEATS = 3
# Predictions this close are a tie: within the predictions' own error.
TIE = 0.1


class KernelFormats(NamedTuple):
  """How a run stores what the host kernel updates (``host.kernels``' names): what its
  update is timed on, the kernel's rate depending on it."""

  grads: str = "float32"  # Or bfloat16, as the gradients travel.
  weights: str = "float32"  # host_kernels.WEIGHTS
  mu: str = "float32"  # host_kernels.MOMENTS
  nu: str = "float32"

  def __str__(self) -> str:
    return f"{self.grads} gradients, {self.weights} weights, {self.mu}/{self.nu} moments"


@dataclasses.dataclass(frozen=True)
class Machine:
  """What the placements' costs depend on, measured on this machine."""

  host_to_device: float  # Bytes per second, one device.
  device_to_host: float
  kernel_rate: float | None  # Host-kernel parameter elements per second; None without numba.
  kernel_threads: int | None
  sum_rate: float | None = None  # Gradient elements the host adds into its sums per second.
  formats: KernelFormats = KernelFormats()  # What kernel_rate was timed on.

  def __str__(self) -> str:
    link = (f"copies {self.host_to_device / 1e9:.1f} GB/s to the device, "
            f"{self.device_to_host / 1e9:.1f} GB/s back")
    if self.kernel_rate is None:
      return link + "; no host kernel (numba is not installed)"
    return (link + f"; host kernel {self.kernel_rate / 1e9:.2f} G params/s on "
            f"{self.kernel_threads} threads ({self.formats})")


@dataclasses.dataclass(frozen=True)
class Choice:
  """The placement chosen, and each candidate's predicted seconds added to a step."""

  place: str
  predicted_s: dict[str, float]
  machine: Machine

  def __str__(self) -> str:
    def ms(place):
      value = self.predicted_s[place] * 1e3
      return f"+{value:,.1f} ms" if value >= 1 else f"+{value:.2g} ms"

    others = ", ".join(f"{place} {ms(place)}" for place in self.predicted_s if place != self.place)
    return (f"optimizer_offload_update_on=auto chose {self.place}: predicted {ms(self.place)} "
            f"a step (" + (others or "no other candidate") + f"; {self.machine})")


def best_seconds(fn: Callable[[], object]) -> float:
  """The fastest of ``_REPEATS`` calls of ``fn``, after one that compiles and allocates: the
  least disturbed by whatever else the machine runs."""
  fn()
  times = []
  for _ in range(_REPEATS):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return min(times)


def measure_machine(device: jax.Device | None = None,
                    formats: KernelFormats = KernelFormats()) -> Machine:
  """Times a 256 MiB copy each way between ``device`` (default: the first local one) and its
  pinned host memory, and the host kernel's update (on arrays stored as ``formats`` says)
  and gradient sum on 32 M elements (best of three each; an eighth of each on the cpu
  backend); once per device and formats in a process, whose later calls get the same
  figures."""
  return _measure(device or jax.local_devices()[0], formats)


@functools.cache
def _measure(device: jax.Device, formats: KernelFormats) -> Machine:
  divisor = CPU_PROBE_DIVISOR if device.platform == "cpu" else 1
  probe_bytes, probe_elements = _PROBE_BYTES // divisor, _PROBE_ELEMENTS // divisor
  on = lambda kind: jax.sharding.SingleDeviceSharding(device, memory_kind=kind)
  host = jax.block_until_ready(
      jax.device_put(np.zeros(probe_bytes // 4, np.float32), on(PINNED_HOST)))
  held = {}

  def down():
    held["device"] = jax.block_until_ready(jax.device_put(host, on(DEVICE_KIND)))

  down()
  up = lambda: jax.block_until_ready(jax.device_put(held["device"], on(PINNED_HOST)))
  host_to_device = probe_bytes / best_seconds(down)
  device_to_host = probe_bytes / best_seconds(up)
  if importlib.util.find_spec("numba") is None:
    return Machine(host_to_device, device_to_host, None, None)

  *arrays, remainder = _kernel_arrays((probe_elements // _PROBE_ROW, _PROBE_ROW), formats)
  update = lambda: adam.adamw_update(*arrays, learning_rate=0.0, count=1,
                                          remainder=remainder)
  rate = probe_elements / best_seconds(update)
  total = np.full(arrays[1].shape, 0.5, np.float32)
  add = lambda: adam.accumulate(total, arrays[1], square_sum=True)
  return Machine(host_to_device, device_to_host, rate, adam.max_threads(),
                 probe_elements / best_seconds(add), formats)


def _kernel_arrays(shape: tuple[int, int], formats: KernelFormats) -> tuple:
  """``host.adam.adamw_update``'s weights, gradients, moments and remainder, stored as
  ``formats`` says. Filled, not zeros: untouched zero pages are all one page, which the
  kernel reads from cache, far faster than it reads a training step's gradients."""
  filled = lambda dtype: np.full(shape, 0.5, dtype)
  bf16 = ml_dtypes.bfloat16
  grads = filled(bf16 if formats.grads == "bfloat16" else np.float32)
  weights = filled(np.float32 if formats.weights == "float32" else bf16)
  remainder = np.full(shape, 0x1234, np.uint16) if formats.weights == "split" else None

  def moment(dtype: str, signed: bool):
    if dtype == "int8":
      coded = adam.CodedMoment.zeros(shape, signed=signed)
      coded.codes.fill(3)
      coded.scales.fill(0.5)
      return coded
    return filled(bf16 if dtype == "bfloat16" else np.float32)

  return weights, grads, moment(formats.mu, True), moment(formats.nu, False), remainder


def choose(machine: Machine, *, offloaded_elements: int, moment_bytes_per_element: int,
           transfer_bytes_per_element: int, weight_bytes_per_element: int | None = None,
           local_elements: int | None = None,
           host_kernel: bool = True, overlap_s: float = 0.0) -> Choice:
  """Prices the exact placements and picks the cheaper (the host kernel in a tie).

  Args:
    machine: what ``measure_machine`` measured.
    offloaded_elements: parameter elements whose state is offloaded, per
      device (a device copies only its shards).
    moment_bytes_per_element: bytes of both Adam moments per element (8 in float32).
    transfer_bytes_per_element: bytes of one weight or gradient element on the
      wire with the host kernel (4, or 2 with bfloat16 transfers).
    weight_bytes_per_element: of one weight element on its way up, where it differs
      (4 for bfloat16 transfers without the host's bfloat16 copies).
    local_elements: offloaded elements of all this process's devices, which
      the host kernel updates with this host's cores; default
      ``offloaded_elements``.
    host_kernel: whether the host kernel is a candidate (numba installed,
      float32 parameters).
    overlap_s: seconds of device work the host kernel's update runs under (where
      the trainer overlaps them, ``jaxoffload.train.offload_choice.overlap_seconds``):
      the kernel's time up to it adds nothing.

  Returns:
    A ``Choice``; ``str(choice)`` is the line to show the user.
  """
  link = lambda nbytes: nbytes / machine.host_to_device + nbytes / machine.device_to_host
  predicted = {"device": link(offloaded_elements * moment_bytes_per_element)}
  if host_kernel and machine.kernel_rate is not None:
    local = offloaded_elements if local_elements is None else local_elements
    up = weight_bytes_per_element or transfer_bytes_per_element
    predicted["host_kernel"] = (offloaded_elements * up / machine.host_to_device
                                + offloaded_elements * transfer_bytes_per_element
                                / machine.device_to_host
                                + max(0.0, local / machine.kernel_rate - overlap_s))
  fastest = min(predicted, key=predicted.get)
  if "host_kernel" in predicted and predicted["host_kernel"] <= (1 + TIE) * predicted[fastest]:
    fastest = "host_kernel"
  return Choice(fastest, predicted, machine)
