"""The settings that lower a run's host memory from where it stands, and what it needs with each.

``lowering_keys`` names them per part of the guard's arithmetic
(``train.host_memory.needed``), none already at its limit; ``with_figures``
gives each the run's need with it set, reckoned from shapes alone, so that a
refusal says how far each would go.
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp

from jaxoffload.memory import size
from jaxoffload.train.config import ConfigError
from jaxoffload.train.loading import override
from jaxoffload.train.resolve import Setup, variant

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
          "saving a checkpoint": ["no checkpoint.dir"]}
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
      figure = size(need(variant(setup, override(setup.config, [setting.split(" ")[0]]))))
    except (ConfigError, ValueError):
      out.append(key)
      continue
    # Inside a note the lever already carries: "key=value (why; needs N GB)".
    out.append(f"{setting[:-1]}; needs {figure})" if setting.endswith(")")
               else f"{setting} (needs {figure})")
  return out


def _setting(setup: Setup, key: str) -> str:
  """``key=value`` for a lever: as named, or at half the run's value for ``HALVED``."""
  if key == "no checkpoint.dir":
    return "checkpoint.dir=null"
  if key in HALVED:
    section, name = key.split(".")
    value = getattr(getattr(setup.config, section), name)
    return f"{key}={value / 2 if isinstance(value, float) else value // 2}"
  return key
