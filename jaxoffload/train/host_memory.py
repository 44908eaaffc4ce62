"""The host memory a run will hold, what the machine can give it, and the guard between them.

``check`` runs before anything is allocated: a setting that cannot fit ends
with one line naming the bytes and the keys that lower them, never in the
kernel's OOM killer. The arithmetic counts every buffer this process's
devices keep in host memory, shard by shard (a leaf replicated over two
devices is held twice), as the trainer will allocate them.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Optional

import jax

from jaxoffload.host import kernel_state
from jaxoffload.memory import available, offloaded_activation_bytes, parse_bytes, size
from jaxoffload.nn.model import group_name
from jaxoffload.optim.offload_plan import leaf_path
from jaxoffload.train import levers, weights as weights_
from jaxoffload.train.checkpoints import checkpoint_dir, host_checkpoint
from jaxoffload.train.config import ConfigError
from jaxoffload.train.per_layer.overlap import GRADIENT_BYTES_AHEAD
from jaxoffload.train.setup import Setup

# XLA's pinned host allocator holds more than the arrays in it, and JAX's
# runtime (with the CUDA libraries it loads), the compiler and the data need some
# memory of their own (docs/performance.md#host-memory).
PINNED_POOL_SLACK = 1 / 8
RUNTIME_BYTES = 4 * 2**30
# On GPUs that pool is a BFC allocator: it grows by regions, the first of 2 MiB and
# each one twice the last, until a region would pass the pool's limit.
FIRST_POOL_REGION = 2 * 2**20
# How many times its checkpoint's bytes a save of the host kernel's state adds to the
# host's memory where several processes hold it (orbax gathers it); one process writes it
# a piece at a time (host_checkpoint.SAVE_BYTES); other state adds them once
# (docs/performance.md#host-memory).
HOST_KERNEL_SAVE_COPIES = 2.5
# XLA's pinned pool on GPUs stops at 64 GiB unless this variable says otherwise.
PINNED_POOL_VARIABLE = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
DEFAULT_PINNED_POOL_GIB = 64


@dataclasses.dataclass(frozen=True)
class HostBytes:
  """The host memory a run will hold beyond what the process holds now.

  Attributes:
    held: what stays allocated while it trains, by what holds it.
    transient: what one phase holds and then frees (loading the first weights,
      one step's offloaded activations, a checkpoint's copy of the state); only the
      largest counts.
    pinned: of what is held, the bytes of the arrays in XLA's pinned pool (every local
      device's).
  """

  held: dict[str, int]
  transient: dict[str, int]
  pinned: int = 0

  @property
  def total(self) -> int:
    return sum(self.held.values()) + max(self.transient.values(), default=0)

  def __str__(self) -> str:
    parts = {**self.held, **self.transient}
    return ", ".join(f"{name} {size(n)}" for name, n in parts.items() if n)


# The parts of the state a run holds in host memory, as the refusal names them.
HELD_PARTS = ("optimizer state", "host kernel weights", "host kernel gradients",
              "host kernel moments and sums", "offloaded weights")


def local_elements(shape: Any, sharding: jax.sharding.Sharding) -> int:
  """Elements of this process's shards of an array of ``shape`` placed by ``sharding``, each
  device's counted (a replicated array is held once per device)."""
  return math.prod(sharding.shard_shape(tuple(shape))) * len(sharding.addressable_devices)


def needed(setup: Setup) -> HostBytes:
  """The host memory ``setup``'s run will allocate, by what holds it."""
  held, pinned, saved = _state(setup, local_elements)
  held["pinned allocator overhead"] = (
      pinned_pool_bytes(pinned, pinned_pool_limit(), jax.local_device_count()) - pinned)
  held["JAX runtime"] = RUNTIME_BYTES
  share = jax.local_device_count() / jax.device_count()
  transient = {"loading the first weights": weights_.staging_bytes(setup),
               "a step's batch": batch_bytes(setup),
               "offloaded activations": int(share * _activation_bytes(setup)),
               "saving a checkpoint": int(saved) if setup.config.checkpoint.dir else 0}
  return HostBytes(held, transient, pinned)


def batch_bytes(setup: Setup) -> int:
  """The host memory a step's batch takes as it is made: every process makes the whole
  global batch (int32 tokens), and holds it twice while it is cast and placed."""
  return 2 * math.prod(setup.batch_shape.shape) * setup.batch_shape.dtype.itemsize


def pinned_per_device(setup: Setup) -> int:
  """The bytes of arrays one device's pinned pool holds at once: its shards of the state
  that lives there, and of one step's offloaded activations. Needs no backend (an
  ``abstract_setup`` will do)."""
  _, pinned, _ = _state(setup, lambda shape, sharding: math.prod(sharding.shard_shape(shape)))
  return pinned + _activation_bytes(setup) // setup.mesh.size


def largest_pinned_array(setup: Setup) -> int:
  """The bytes of the largest array one device's pinned pool holds: a host kernel leaf's
  weights or gradients, an offloaded moment, an offloaded weight. Needs no backend."""
  shapes, shardings = jax.tree.leaves(setup.param_shapes), jax.tree.leaves(setup.param_shardings)
  offloaded = setup.offload.offloaded if setup.offload else (False,) * len(shapes)
  transfer = iter(zip(setup.transfer_dtypes, setup.weight_transfer_dtypes))
  moments = setup.moment_dtypes
  largest = 0
  for shape, sharding, off, fetch in zip(shapes, shardings, offloaded,
                                         jax.tree.leaves(setup.fetched_by_model)):
    elements = math.prod(sharding.shard_shape(shape.shape))
    if off and setup.host_kernel:
      itemsize = max(d.itemsize for d in next(transfer))
    elif off:
      itemsize = max(kernel_state.moment_bytes(d, shape.shape) for d in moments)
    else:
      itemsize = shape.dtype.itemsize if fetch else 0
    largest = max(largest, int(elements * itemsize))
  return largest


def _activation_bytes(setup: Setup) -> int:
  """One step's offloaded activations, every device's."""
  m, t = setup.config.model, setup.config.train
  return offloaded_activation_bytes(setup.model, setup.groups, t.micro_batch_size, m.seq_length)


def _state(setup: Setup, elements_of) -> tuple[dict[str, int], int, float]:
  """What the run's state holds in host memory, by part, with the elements
  ``elements_of(shape, sharding)`` of each leaf: ``(parts, pinned bytes, bytes a save
  copies)``."""
  paths, _ = jax.tree_util.tree_flatten_with_path(setup.param_shapes)
  shapes, shardings = jax.tree.leaves(setup.param_shapes), jax.tree.leaves(setup.param_shardings)
  offloaded = setup.offload.offloaded if setup.offload else (False,) * len(shapes)
  layers = {group_name(g): g.stop - g.start for g in setup.groups}
  by_layer = setup.weights_updated_by_layer
  grads_by_piece: dict[str, float] = {}  # Per program's pieces: one layer's, or the rest's.
  fetched = jax.tree.leaves(setup.fetched_by_model)
  held = dict.fromkeys(HELD_PARTS, 0)
  transfer = iter(zip(setup.transfer_dtypes, setup.weight_transfer_dtypes))
  moments = setup.moment_dtypes
  pinned = saved = 0  # What a save adds: copies of the state a checkpoint holds.
  host_pieces = 0  # And the host kernel's pieces, written one at a time.
  for (path, _), shape, sharding, off, fetch, checkpointed in zip(
      paths, shapes, shardings, offloaded, fetched, checkpoint_dir.bytes_per_element(setup)):
    elements = elements_of(shape.shape, sharding)
    moment_bytes = sum(kernel_state.moment_bytes(d, sharding.shard_shape(shape.shape))
                       for d in moments)
    if off and setup.host_kernel:
      wire, weights_read_in = next(transfer)
      weights, others = kernel_state.host_bytes_per_element(
          weights_read_in, master_dtype=shape.dtype, moment_bytes=moment_bytes)
      split = others - moment_bytes
      # Each step's gradients arrive in pinned memory; micro-batches summed on the host hold
      # one more (the next arrive while the last are added), and their float32 sums.
      grads = (2 if setup.sums_on_host else 1) * wire.itemsize
      held["host kernel weights"] += elements * (weights + split)
      held["host kernel gradients"] += elements * grads
      name = leaf_path(path).split("/")[0]
      piece = name if name in layers else ""
      grads_by_piece[piece] = grads_by_piece.get(piece, 0) + elements * grads / layers.get(name, 1)
      held["host kernel moments and sums"] += int(elements * (
          moment_bytes + (4 if setup.sums_on_host else 0)))
      pinned += elements * (weights + grads)
      if setup.config.distributed.initialize:
        saved += elements * checkpointed * HOST_KERNEL_SAVE_COPIES
      else:
        host_pieces = host_checkpoint.SAVE_BYTES
      continue
    if off:
      held["optimizer state"] += int(elements * moment_bytes)
      pinned += int(elements * moment_bytes)
    if fetch:
      # And their new values, which the update brings back beside them, unless the backward
      # pass writes them into the stack a layer at a time.
      copies = 1 if leaf_path(path).split("/")[0] in by_layer else 2
      held["offloaded weights"] += copies * elements * shape.dtype.itemsize
      pinned += copies * elements * shape.dtype.itemsize
    saved += elements * checkpointed
  if setup.overlaps_host_update and not setup.clips_gradients:
    # Consumed as they come (train.overlap): the head's and the embedding's, a layer's, and
    # what the device may send ahead.
    bound = GRADIENT_BYTES_AHEAD + grads_by_piece.pop("", 0) + max(grads_by_piece.values(),
                                                                    default=0)
    kept = min(held["host kernel gradients"], int(bound))
    pinned -= held["host kernel gradients"] - kept
    held["host kernel gradients"] = kept
  return held, pinned, saved + host_pieces


def pinned_pool_bytes(pinned: int, limit: Optional[int], devices: int = 1) -> int:
  """The host memory XLA's pinned pools take to hold ``pinned`` bytes of arrays at once.

  Args:
    pinned: the arrays' bytes, spread evenly over ``devices``.
    limit: each device's pool limit (``pinned_pool_limit``); None where the pinned
      arrays take their own bytes and an eighth more.
    devices: how many local devices hold them, each with its own pool.

  Returns:
    Every pool's bytes. On GPUs a pool grows by regions, each twice the last from 2 MiB,
    until it holds its arrays and an eighth more (fragmentation) or reaches ``limit``:
    up to twice its arrays.

  Example:
    >>> pinned_pool_bytes(44 * 2**30, 64 * 2**30) // 2**30  # A 64 GiB pool for 44 GiB.
    64
  """
  if limit is None or pinned == 0:
    return pinned + int(PINNED_POOL_SLACK * pinned)
  wanted, pool, region = (1 + PINNED_POOL_SLACK) * pinned / devices, 0, FIRST_POOL_REGION
  while pool < wanted and pool < limit:
    pool += min(region, limit - pool)
    region *= 2
  return pool * devices


def pinned_pool_limit() -> Optional[int]:
  """The bytes XLA's pinned pool gives each GPU (``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB``, 64 GiB
  unless set before JAX started); None on other backends."""
  if jax.default_backend() != "gpu":
    return None
  return int(float(os.environ.get(PINNED_POOL_VARIABLE, DEFAULT_PINNED_POOL_GIB)) * 2**30)


def check(setup: Setup) -> HostBytes:
  """What ``needed`` says, once it is known to fit.

  Raises:
    ConfigError: one line with the bytes needed, the bytes available and the
      keys that lower the largest parts.

  Example:
    >>> setup = resolve(load_config("configs/llama_8b_offload.yaml"))
    >>> print(check(setup))  # Or the refusal's line.
    optimizer state 48.2 GB, offloaded activations 3.1 GB, pinned allocator overhead 6.0 GB, ...
  """
  need = needed(setup)
  pool = pinned_pool_limit()
  per_device = int((1 + PINNED_POOL_SLACK) * pinned_per_device(setup))
  if pool is not None and per_device > pool:
    keys = levers.lowering_keys(setup)
    pinned_by = (keys["host kernel weights"] + keys["host kernel gradients"]
                 if setup.host_kernel else keys["optimizer state"])
    raise ConfigError(
        f"host memory: this run pins about {size(per_device)} of host memory per GPU, more than "
        f"XLA's pinned pool gives ({size(pool)}, {PINNED_POOL_VARIABLE}); set "
        f"{PINNED_POOL_VARIABLE}={math.ceil(per_device / 2**30)} or more before starting, or "
        f"lower the pinned bytes with {', '.join(dict.fromkeys(pinned_by))}")
  limit = setup.config.train.host_memory_limit
  have, source = available(None if limit is None else parse_bytes(limit))
  if need.total <= have:
    return need
  # The keys of the parts that matter, largest first.
  advice = pool_limit_advice(need)
  lowered_by = {**levers.lowering_keys(setup),
                "pinned allocator overhead": [advice] if advice else []}
  parts = sorted(((n, name) for name, n in {**need.held, **need.transient}.items()
                  if lowered_by.get(name) and n >= need.total / 10), reverse=True)
  keys = list(dict.fromkeys(key for _, name in parts for key in lowered_by[name]))
  keys = ", ".join(levers.with_figures(setup, keys, lambda s: needed(s).total))
  own = ("raise train.host_memory_limit" if limit is not None
         else "set train.host_memory_limit where that figure is wrong")
  raise ConfigError(f"host memory: this run needs about {size(need.total)} more ({need}) but "
                    f"{size(max(have, 0))} is {source}; "
                    + (f"lower it with {keys}, or {own}" if keys else own))


def pool_limit_advice(need: HostBytes) -> str:
  """How to keep a GPU's pinned pool near its arrays: the pool limit that still holds them,
  to set before JAX starts; empty where that would not save a tenth of the pool.

  Example:
    >>> pool_limit_advice(check(setup))  # 44 GiB of pinned arrays on one GPU.
    "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=50 before starting (XLA's pinned pool then holds ..."
  """
  limit, devices = pinned_pool_limit(), jax.local_device_count()
  if limit is None:
    return ""
  gib = math.ceil((1 + PINNED_POOL_SLACK) * need.pinned / devices / 2**30)
  pool, capped = (pinned_pool_bytes(need.pinned, n, devices) for n in (limit, gib * 2**30))
  if capped > pool - pool / 10:
    return ""
  return (f"{PINNED_POOL_VARIABLE}={gib} before starting (XLA's pinned pool then holds "
          f"{size(capped)}, not {size(pool)})")
