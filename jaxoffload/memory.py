"""Where the bytes of training state live, how many an activation offload moves, device peaks
and host memory, and sizes written as ``"64GB"``."""

from __future__ import annotations

import collections
import os
import re
import resource
from typing import Any, Optional, Sequence, Union

import jax
import jax.numpy as jnp

from jaxoffload._compat import memory_kind
from jaxoffload.nn.model import LlamaConfig
from jaxoffload.nn.remat import LayerGroup

SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
              "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: Union[int, str]) -> int:
  """A size as bytes: an int, or a string such as ``"64GB"``, ``"1.5 TiB"`` or ``"8e9"``.

  Raises:
    ValueError: naming the value, when it is no size.

  Example:
    >>> parse_bytes("64GB"), parse_bytes("1GiB")
    (64000000000, 1073741824)
  """
  if isinstance(value, int) and not isinstance(value, bool):
    return value
  match = re.fullmatch(r"\s*(\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)\s*", str(value))
  if match and match.group(2).lower() in SIZE_UNITS:
    return int(float(match.group(1)) * SIZE_UNITS[match.group(2).lower()])
  raise ValueError(f"{value!r} is not a size: give bytes, or a number with one of "
                   f"{', '.join(u.upper() for u in SIZE_UNITS if u)}")


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


def compiled_device_bytes(analysis: Any) -> int:
  """A compiled program's device bytes from XLA's memory analysis: arguments, outputs and
  temporaries, donated buffers counted once (host memory spaces are counted apart).

  Example:
    >>> compiled_device_bytes(jax.jit(step).lower(*args).compile().memory_analysis())
  """
  return (analysis.argument_size_in_bytes + analysis.output_size_in_bytes
          - analysis.alias_size_in_bytes + analysis.temp_size_in_bytes)


def host_rss_bytes() -> int | None:
  """This process's resident host memory now, in bytes; None where the system does not say.

  Pinned buffers, the host kernel's moments and memory-mapped files that were
  read all count.
  """
  try:
    with open("/proc/self/statm") as f:
      return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
  except (OSError, ValueError, IndexError):
    return None


def peak_host_rss_bytes() -> int:
  """This process's peak resident host memory so far, in bytes (Linux's ``ru_maxrss``)."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def activation_bytes(config: LlamaConfig, batch: int, seq_len: int) -> dict[str, int]:
  """Bytes of each named activation of one layer, as ``remat.ACTIVATION_NAMES`` lists them.

  Example:
    >>> per_layer = activation_bytes(config, batch=8, seq_len=2048)
    >>> offloaded = num_offloaded_layers * per_layer["query_proj"]
  """
  tokens_bytes = batch * seq_len * jnp.dtype(config.dtype).itemsize
  hidden = config.num_attention_heads * config.head_dim
  kv = config.num_query_groups * config.head_dim
  widths = {"layer_input": config.hidden_size, "query_proj": hidden, "key_proj": kv,
            "value_proj": kv, "attention_out": hidden, "mlp_input": config.hidden_size,
            "mlp_gate": config.intermediate_size, "mlp_up": config.intermediate_size}
  return {name: tokens_bytes * width for name, width in widths.items()}


def offloaded_activation_bytes(config: LlamaConfig, groups: Sequence[LayerGroup], batch: int,
                               seq_len: int) -> int:
  """Bytes the groups' placements send to pinned_host in one forward pass of ``batch`` sequences."""
  per_layer = activation_bytes(config, batch, seq_len)
  return sum((g.stop - g.start) * per_layer[name] for g in groups if g.placements
             for name, placement in g.placements.items() if placement == "offload")


def size(n: int) -> str:
  """``n`` bytes for a person: ``"1.3 TB"``, ``"64.2 GB"``, ``"310 MB"``."""
  if abs(n) >= 1e12:
    return f"{n / 1e12:,.1f} TB"
  return f"{n / 1e9:.1f} GB" if abs(n) >= 1e9 else f"{n / 1e6:.0f} MB"


def available(limit: Optional[int]) -> tuple[int, str]:
  """The host bytes this process may still allocate, and where that figure comes from:
  ``limit`` (``train.host_memory_limit``) less what the process holds, else the machine's
  and the cgroup's."""
  if limit is not None:
    held = host_rss_bytes() or 0
    return limit - held, (f"left under train.host_memory_limit={size(limit)} with the "
                          f"{size(held)} this process holds")
  figures = []
  meminfo = _read_keyed("/proc/meminfo")
  if "MemAvailable" in meminfo:
    figures.append((meminfo["MemAvailable"] * 1024, "available (MemAvailable in /proc/meminfo)"))
  cgroup = _cgroup_available()
  if cgroup is not None:
    figures.append((cgroup, "left under the cgroup's memory limit"))
  return min(figures) if figures else (2**63, "no limit found")


def _read_keyed(path: str) -> dict[str, int]:
  """``key value`` or ``key: value kB`` lines as ints; empty if the file is unreadable."""
  try:
    with open(path) as f:
      lines = [line.replace(":", " ").split() for line in f]
  except OSError:
    return {}
  return {words[0]: int(words[1]) for words in lines if len(words) >= 2 and words[1].isdigit()}


def _cgroup_available() -> Optional[int]:
  """The cgroup's limit less what it uses, counting reclaimable page cache as free."""
  for limit_file, usage_file, stat_file in (
      ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory.stat"),
      ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes",
       "/sys/fs/cgroup/memory/memory.stat")):
    try:
      with open(limit_file) as f:
        limit = f.read().strip()
      with open(usage_file) as f:
        usage = int(f.read())
    except (OSError, ValueError):
      continue
    if not limit.isdigit() or int(limit) >= 2**60:  # "max", or v1's "no limit".
      return None
    stat = _read_keyed(stat_file)
    return int(limit) - usage + stat.get("inactive_file", stat.get("total_inactive_file", 0))
  return None
