"""The least optimizer offload that fits this machine, found before anything is allocated.

``optimizer.optimizer_offload_fraction=auto`` runs ``least_offload`` on the config's own
activation setting and micro-batch size; the planner (``jaxoffload.plan``) runs the same
``Ladder`` and ``search`` over more of them.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Callable, Optional

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxoffload.host import pricing
from jaxoffload.memory import available, host_rss_bytes, parse_bytes
from jaxoffload.plan.compiling import Peaks
from jaxoffload.plan.ladder import Budgets, Candidate, Ladder, offload_overrides
from jaxoffload.train import host_memory
from jaxoffload.train.config import Config, ConfigError
from jaxoffload.train.implied import moment_dtypes
from jaxoffload.train.loading import override
from jaxoffload.train.offload_choice import candidate_places, kernel_formats

PLACES = ("device", "host_kernel")
Log = Callable[[str], None]


def budgets_of(config: Config, device_memory: Optional[int] = None) -> Budgets:
  """This machine's budgets: the device's memory (``device_memory``, else the least of
  ``train.device_memory_limit`` and what JAX reports; None on CPUs without that limit) and
  the host memory left to this process (``train.host_memory_limit``, else what the machine
  and its cgroup leave), counting what it holds now."""
  limit = config.train.host_memory_limit
  host = available(None if limit is None else parse_bytes(limit))[0]
  known = [(jax.devices()[0].memory_stats() or {}).get("bytes_limit"),
           config.train.device_memory_limit and parse_bytes(config.train.device_memory_limit)]
  device = device_memory or min((d for d in known if d), default=None)
  return Budgets(device, host + (host_rss_bytes() or 0))


def fastest_offload(config: Config, log: Log = print) -> Config:
  """``config`` with ``optimizer.optimizer_offload_fraction=auto`` replaced by the least
  offload that fits this machine, on the placement that adds least to a step (of the
  config's ``optimizer_offload_update_on``, or both with auto).

  Raises:
    ConfigError: when no fraction fits, naming the keys that free more memory.
  """
  budgets = budgets_of(config)
  best, _ = least_offload(config, budgets)
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
    peak = "-" if best.device_bytes is None else host_memory.size(best.device_bytes)
    log(f"optimizer_offload_fraction=auto chose {best.fraction:.2f} on {best.update_on} "
        f"(achieved {best.achieved:.2f}; device peak {peak}, host "
        f"{host_memory.size(best.host_bytes)}; predicted +{best.step_s * 1e3:,.1f} ms a step)")
  return override(config, overrides)


def least_offload(config: Config, budgets: Budgets, machine: Optional[pricing.Machine] = None
                  ) -> tuple[Optional[Candidate], list[Candidate]]:
  """The least offload that fits ``budgets`` with the config's activation setting and
  micro-batch size, on its update placement (both where it names none) and the fastest of
  them; and each placement's outcome, fastest first. ``machine``: this machine's link and
  host-kernel rates; default: measured now."""
  baseline = host_rss_bytes() or 0  # What a run holds before its state, as the guard counts.
  formats = kernel_formats(config, moment_dtypes(config))
  machine = machine or pricing.measure_machine(formats=formats)
  size = [f"train.micro_batch_size={config.train.micro_batch_size}"]
  return search([Ladder(config, "as configured", size, (place, None), machine, None, baseline)
                 for place in update_places(config, keep=True)], budgets)


def update_places(config: Config, *, keep: bool) -> list[str]:
  """The update placements to search: those of ``PLACES`` that ``auto`` may choose for
  ``config`` (``offload_choice.candidate_places``); with ``keep``, the config's own where it
  names one."""
  o = config.optimizer
  if keep and o.optimizer_offload_update_on in PLACES:
    return [o.optimizer_offload_update_on]
  auto = dataclasses.replace(config, optimizer=dataclasses.replace(
      o, optimizer_offload_update_on="auto"))
  return [p for p in candidate_places(auto, moment_dtypes(auto)) if p in PLACES]


def search(ladders: list[Ladder], budgets: Budgets) -> tuple[Optional[Candidate], list[Candidate]]:
  """The fastest candidate of ``ladders`` that fits ``budgets``, and each ladder's outcome,
  fastest first.

  Best first, by a bound on each ladder's step time that tightens as it is compiled: at
  first its least fraction whose state alone fits (found without compiling); once its
  most offload's peak is predicted (``Ladder.transient_bytes``: compiled at two shallow depths),
  a layer-sized step below where that peak predicts the least fit, or below the most
  offload where it predicts none (``Ladder.predict``: a bound if the prediction errs by no
  more than that step); then the fit itself, compiled there (``Ladder.verify``; where the
  most offload, compiled whole, does not fit, neither does any ladder that holds no less:
  ``Ladder.holds_no_less``). The search stops once the pick is faster than every bound
  left; where the device's budget is unknown, nothing is compiled. Meanwhile what the next
  ladders in line would compile first is compiled on other threads (``compiling.Peaks``):
  the outcome is the same.
  """
  rows = {n: ladder.least_fitting(budgets) for n, ladder in enumerate(ladders)}
  best, ruled_out = None, []  # Ladders whose most offload, compiled whole, did not fit.
  faster = lambda row: row.verdict == "fits" and (best is None or row.step_s < best.step_s)
  held_more = lambda n: next(
      (m for m in ruled_out if ladders[n].holds_no_less(ladders[m])), None)
  skipped = lambda bound, n, predicted: (best is not None and bound >= best.step_s) or (
      not predicted and held_more(n) is not None)
  queue = [(row.step_s, n, False) for n, row in rows.items() if not row.verdict]
  heapq.heapify(queue)
  with Peaks() as peaks:
    while queue:
      bound, n, predicted = heapq.heappop(queue)
      row, ladder = rows[n], ladders[n]
      if budgets.device is not None and peaks.workers > 1:  # What is likely judged next.
        for ahead in heapq.nsmallest(peaks.workers - 1, queue):
          if not skipped(*ahead):
            ladders[ahead[1]].ask_ahead(peaks, predicted=ahead[2])
      if best is not None and bound >= best.step_s:
        rows[n] = dataclasses.replace(row, verdict=(
            "its peak predicted: slower than the pick" if predicted
            else "not compiled: slower than the pick"))
      elif predicted:
        rows[n] = ladder.verify(budgets, peaks)
        if rows[n].verdict == "no: device":
          ruled_out.append(n)
        best = rows[n] if faster(rows[n]) else best
      elif (fails := held_more(n)) is not None:
        rows[n] = dataclasses.replace(row, verdict=(
            f"not compiled: holds no less than {rows[fails].activations} at micro-batch "
            f"{rows[fails].micro_batch_size}, which does not fit the device"))
      else:
        rows[n] = ladder.predict(budgets, peaks)
        if not rows[n].verdict:  # Predicted where the device's budget is known.
          heapq.heappush(queue, (ladder.time_bound(), n, True))
        best = rows[n] if faster(rows[n]) else best
  # Without offload, both placements are one setting: its row once, the pick's where it is.
  unique = {}
  for n in sorted(rows, key=lambda n: (rows[n].step_s, rows[n] != best)):
    unique.setdefault(rows[n].overrides, rows[n])
  return best, list(unique.values())
