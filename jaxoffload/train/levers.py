"""The settings that lower a run's host or device memory from where it stands, with figures.

``lowering_keys`` names the host's per part of the guard's arithmetic
(``train.host_memory.needed``), none already at its limit; ``with_figures``
gives each the run's need with it set, reckoned from shapes alone, so that a
refusal says how far each would go. ``device_figures`` does the same for the
device levers an out-of-memory error names (``advice.device_memory_levers``):
what each frees of ``device_need``; ``fitting_device_levers`` compiles each to keep those
under which the step fits a device.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp

from jaxoffload.memory import size
from jaxoffload.nn import layered, remat
from jaxoffload.nn.model import group_name
from jaxoffload.train.config import ConfigError
from jaxoffload.train.loading import override
from jaxoffload.train.resolve import resolve_like
from jaxoffload.train.setup import Setup
from jaxoffload.train.step import Trainer, resident_device_bytes

# Levers named by their key alone: their figure is at half the run's value.
HALVED = ("optimizer.optimizer_offload_fraction", "model.cpu_offloading_num_layers",
          "train.micro_batch_size")


def lowering_keys(setup: Setup) -> dict[str, list[str]]:
  """Per part of ``host_memory.needed``, the settings that would lower it from where
  ``setup`` stands: none already at its limit."""
  c = setup.config
  o, m = c.optimizer, c.model
  fraction = [] if setup.offload is None else ["optimizer.optimizer_offload_fraction"]
  moments = setup.moment_dtypes
  smaller = lambda compact: [f"optimizer.{key}={compact}" for key, dtype in
                             zip(("exp_avg_dtype", "exp_avg_sq_dtype"), moments)
                             if jnp.dtype(dtype).itemsize > jnp.dtype(compact).itemsize]
  streamed = o.optimizer_offload_update_on == "device"  # Which cannot keep 8-bit blocks.
  micro_batch = ["train.micro_batch_size"] if c.train.micro_batch_size > 1 else []
  keys = {"optimizer state": fraction + smaller("bfloat16" if streamed else "int8"),
          "offloaded weights": ["model.cpu_offloading_num_layers"],
          "offloaded activations": ["model.cpu_offloading_num_layers"] + micro_batch,
          "saving a checkpoint": ["no checkpoint.dir"],
          "a step's batch": ["train.global_batch_size", "model.seq_length"]}
  if setup.host_kernel:
    keys["host kernel weights"] = fraction + (
        ["model.params_dtype=bfloat16 (bfloat16 masters)"] if m.params_dtype == "float32" else [])
    keys["host kernel gradients"] = (
        ["optimizer.offload_transfer_dtype=bfloat16"]
        if o.offload_transfer_dtype == "float32" and m.dtype == "bfloat16" else [])
    keys["host kernel moments and sums"] = fraction + smaller("int8") + (
        ["optimizer.accumulate_offloaded_grads_on=device"] if setup.sums_on_host else [])
    # Several processes' saves gather the host kernel's state (one process writes it a piece
    # at a time); the device's streamed update cannot keep 8-bit moments.
    if c.distributed.initialize and "int8" not in moments:
      keys["saving a checkpoint"].insert(0, "optimizer.optimizer_offload_update_on=device "
                                            "(whose saves copy less)")
  return keys


def with_figures(setup: Setup, keys: list[str], need: Callable[[Setup], int]) -> list[str]:
  """Each of ``keys`` (``lowering_keys``' names) as the setting to make, with ``need`` of the
  run once it is set; a key that sets nothing of the config (an environment variable), or
  whose setting no run could take, as it is."""
  out = []
  for key in keys:
    setting = _setting(setup, key)
    try:
      figure = size(need(_with_setting(setup, setting)))
    except (ConfigError, ValueError):
      out.append(key)
      continue
    out.append(_noted(setting, f"needs {figure}"))
  return out


def device_figures(setup: Setup, settings: list[str]) -> list[str]:
  """Each of ``settings`` (space-separated ``key=value``s, then a note in parentheses or
  none) with what it would free of one device's memory (``device_need``), where the
  arithmetic finds it frees some; none that the config's rules refuse."""
  need, out = device_need(setup), []
  for setting in settings:
    try:
      other = _with_setting(setup, setting)
    except ConfigError:  # No run could take it.
      continue
    except ValueError:  # Not reckoned from shapes (an auto fraction): named as it is.
      out.append(setting)
      continue
    freed = need - device_need(other)
    out.append(_noted(setting, f"frees about {size(freed)}") if freed > 0 else setting)
  return out


def fitting_device_levers(setup: Setup, settings: list[str], limit: int) -> list[str]:
  """Of ``settings`` (as ``device_figures`` takes them), those under which the step,
  compiled from shapes, peaks at most ``limit`` bytes on one device, each noted with its
  peak, the lowest peak first; none that the config's rules refuse."""
  peaks = {}
  for setting in settings:
    try:
      other = _with_setting(setup, setting)
    except (ConfigError, ValueError):
      continue
    peak = Trainer.from_shapes(other).compile(other.batch_shape).device_bytes
    if peak <= limit:
      peaks[_noted(setting, f"peak {size(peak)}")] = peak
  return sorted(peaks, key=peaks.get)


def device_need(setup: Setup) -> int:
  """What one device holds at the step's peak, reckoned from shapes: the parameters and
  optimizer state it keeps, the gradients it makes with their sums over micro-batches, and
  what each layer keeps on the device for its backward pass (``layered.layer_forward``'s
  leaves and, where its backward pass reads it, its input; offloaded ones left out), with
  all of one layer's as its backward pass runs. The host kernel's weights and gradients
  count whole where one program holds them; where the step runs a program per layer or sums
  them on the host, not at all (a layer's at a time). XLA's temporaries are not counted: a
  lever's figure is a difference of two."""
  trainer = Trainer.from_shapes(setup)
  shard = lambda x, sharding: math.prod(sharding.shard_shape(x.shape))
  leaves = list(zip(jax.tree.leaves(setup.param_shapes), jax.tree.leaves(setup.param_shardings),
                    trainer.programs.is_host))
  by_layer = setup.runs_per_layer or setup.sums_on_host  # The host kernel's pieces.
  grads = sum(shard(x, s) * x.dtype.itemsize for x, s, host in leaves
              if not (host and by_layer))
  host_weights = 0 if by_layer else sum(
      shard(x, s) * dtype.itemsize for (x, s, _), dtype in zip(
          [leaf for leaf in leaves if leaf[2]], setup.weight_transfer_dtypes))
  sums = (sum(shard(x, s) for x, s, host in leaves if not (host and setup.sums_on_host))
          * setup.grad_accum_dtype.itemsize if setup.micro_batches > 1 else 0)
  kept = sum((g.stop - g.start) * _kept_bytes(setup, g) for g in setup.groups)
  # The layer being taken back holds all of its activations meanwhile, recomputed or kept.
  kept += max(_kept_bytes(setup, dataclasses.replace(g, placements=None))
              - _kept_bytes(setup, g) for g in setup.groups)
  # One program holds a micro-batch's gradients beside the sums; a program per layer adds
  # each layer's into them as it makes them.
  gradients = max(grads, sums) if setup.runs_per_layer else grads + sums
  return resident_device_bytes(trainer) + host_weights + gradients + kept // setup.mesh.size


def _kept_bytes(setup: Setup, group: remat.LayerGroup) -> int:
  """What a layer of ``group`` keeps on the device for its backward pass, a micro-batch's
  (all devices'): its offloaded activations counted as recomputed, its input where the
  backward pass reads it."""
  if group.placements is not None:
    group = dataclasses.replace(group, placements={
        name: remat.Placement.RECOMPUTE if p is remat.Placement.OFFLOAD else p
        for name, p in remat.check_placements(group.placements).items()})
  m = setup.config.model
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype),
                        setup.param_shapes[group_name(group)])
  x = jax.ShapeDtypeStruct((setup.config.train.micro_batch_size, m.seq_length, m.hidden_size),
                           jnp.dtype(m.dtype))
  layouts = []

  def kept(p, x):
    _, layout, leaves = layered.layer_forward(setup.llama, group, p, x)
    layouts.append(layout)
    return leaves

  leaves = jax.tree.leaves(jax.eval_shape(kept, params, x))
  return sum(k.size * k.dtype.itemsize for k in leaves + [x] * layouts[0].takes_input)


def _with_setting(setup: Setup, setting: str) -> Setup:
  """``setup``'s run with ``setting`` made: space-separated ``key=value``s, then a note in
  parentheses or none."""
  return resolve_like(setup, override(setup.config, setting.split(" (")[0].split()))


def _noted(setting: str, figure: str) -> str:
  """``setting`` with ``figure`` inside the note it carries, or as one: "key=value (why;
  figure)"."""
  return f"{setting[:-1]}; {figure})" if setting.endswith(")") else f"{setting} ({figure})"


def _setting(setup: Setup, key: str) -> str:
  """``key=value`` for a lever: as named, or at half the run's value for ``HALVED``."""
  if key == "no checkpoint.dir":
    return "checkpoint.dir=null"
  if key in HALVED:
    section, name = key.split(".")
    value = getattr(getattr(setup.config, section), name)
    return f"{key}={value / 2 if isinstance(value, float) else value // 2}"
  return key
