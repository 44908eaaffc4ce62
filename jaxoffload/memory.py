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
  """The device's peak bytes in use since the process started; None where JAX reports none (CPU)."""
  stats = (device or jax.local_devices()[0]).memory_stats()
  return None if not stats else stats.get("peak_bytes_in_use")
