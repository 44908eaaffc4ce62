"""The one place that knows how JAX's memory-space and host-compute APIs differ by version.

jax 0.10.x offers ``compute_on2(f, compute_type=, out_memory_spaces=)`` next to the older
``compute_on`` context manager; jax 0.11.x turned ``compute_on`` itself into that
keyword-only decorator. Everything else in the package
goes through the names below, so a new JAX version means editing this file only.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from jax.experimental import compute_on as _compute_on

HOST = jax.memory.Space.Host
DEVICE = jax.memory.Space.Device
PINNED_HOST = "pinned_host"
DEVICE_KIND = "device"


def on_host(fn: Callable[..., Any], out_memory_spaces: Any) -> Callable[..., Any]:
  """Returns ``fn`` compiled to run on the host CPU inside the device program.

  Every operand of the returned function must already live in host memory: XLA
  refuses an op that mixes host and device operands.
  """
  compute_on2 = getattr(_compute_on, "compute_on2", None)
  if compute_on2 is not None:
    return compute_on2(fn, compute_type="device_host", out_memory_spaces=out_memory_spaces)
  return _compute_on.compute_on(fn, compute_type="device_host", out_memory_spaces=out_memory_spaces)


def to_host(x: Any) -> Any:
  """Moves ``x`` to host memory, keeping its sharding (a no-op if it is there)."""
  return jax.device_put(x, HOST)


def to_device(x: Any) -> Any:
  """Moves ``x`` to device memory, keeping its sharding (a no-op if it is there)."""
  return jax.device_put(x, DEVICE)


def memory_kind(x: Any) -> str | None:
  """The memory kind (``"device"``, ``"pinned_host"``) of a concrete array, else None."""
  sharding = getattr(x, "sharding", None)
  return getattr(sharding, "memory_kind", None)
