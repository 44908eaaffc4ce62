"""The trainer's ``optimizer_offload_fraction=auto``: the planner's search over the offload alone."""

from __future__ import annotations

from typing import Optional

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxoffload.memory import available, host_rss_bytes, parse_bytes
from jaxoffload.plan.search import PLACES, Budgets, Log, offload_overrides, plan
from jaxoffload.train import host_memory
from jaxoffload.train.config import Config, ConfigError
from jaxoffload.train.loading import override


def budgets_of(config: Config, device_memory: Optional[int] = None) -> Budgets:
  """This machine's budgets: the device's memory (``device_memory``, else what JAX reports;
  None on CPUs) and the host memory left to this process (``train.host_memory_limit``, else
  what the machine and its cgroup leave), counting what it holds now."""
  limit = config.train.host_memory_limit
  host = available(None if limit is None else parse_bytes(limit))[0]
  device = device_memory or (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
  return Budgets(device, host + (host_rss_bytes() or 0))


def fastest_offload(config: Config, log: Log = print) -> Config:
  """``config`` with ``optimizer.optimizer_offload_fraction=auto`` replaced by the least
  offload that fits this machine, on the placement that adds least to a step (of the
  config's ``optimizer_offload_update_on``, or both with auto).

  Raises:
    ConfigError: when no fraction fits, naming the keys that free more memory.
  """
  budgets = budgets_of(config)
  best, _ = plan(config, budgets, explore=False, compact=False, log=log)
  overrides = None if best is None else list(best.overrides)
  if jax.process_count() > 1:  # Every process must build the same program: process 0's pick.
    picked = np.array([-1.0, 0.0] if best is None else
                      [best.fraction, float(best.update_on == "host_kernel")])
    fraction, host_kernel = multihost_utils.broadcast_one_to_all(picked)
    overrides = (None if fraction < 0 else
                 offload_overrides(float(fraction), PLACES[int(host_kernel)]))
  if overrides is None:
    raise ConfigError("optimizer.optimizer_offload_fraction=auto: no offload fits this machine "
                      "(python -m jaxoffload.plan --offload-only shows each); offload "
                      "activations (model.cpu_offloading_num_layers), recompute them "
                      "(model.recompute_granularity=full) or lower train.micro_batch_size")
  if best is not None:
    log(f"optimizer_offload_fraction=auto chose {best.fraction:.2f} on {best.update_on} "
        f"(achieved {best.achieved:.2f}; device peak "
        f"{host_memory.size(best.device_bytes or 0)}, host {host_memory.size(best.host_bytes)}; "
        f"predicted +{best.step_s * 1e3:,.1f} ms a step)")
  return override(config, overrides)
