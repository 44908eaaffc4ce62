"""Where the bytes of a pytree of arrays live, and how much device memory a program used."""

from __future__ import annotations

import collections
from typing import Any

import jax

from jaxoffload._compat import memory_kind


def bytes_by_memory_kind(tree: Any) -> dict[str, int]:
  """Sums the global bytes of a pytree's arrays per memory kind ("device", "pinned_host").

  Example:
    >>> bytes_by_memory_kind(opt_state)
    {'device': 4, 'pinned_host': 2048}
  """
  totals: dict[str, int] = collections.Counter()
  for leaf in jax.tree.leaves(tree):
    if isinstance(leaf, jax.Array):
      totals[memory_kind(leaf)] += leaf.nbytes
  return dict(totals)


def peak_device_bytes(device: jax.Device | None = None) -> int | None:
  """Peak bytes in use since the process started on ``device``, or on the fullest local device.

  None where JAX reports none (CPU).
  """
  devices = [device] if device is not None else jax.local_devices()
  peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in devices]
  peaks = [p for p in peaks if p is not None]
  return max(peaks) if peaks else None
