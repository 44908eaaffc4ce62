"""The planner's wider search: the activation settings, micro-batch sizes and moment
storages it tries besides the offload (``plan.ladder``'s ladders, searched by
``plan.fit``), and its table."""

from __future__ import annotations

import time
from typing import Optional

import jax

from jaxoffload.host import pricing
from jaxoffload.memory import host_rss_bytes
from jaxoffload.plan import fit, xla_logs
from jaxoffload.plan.fit import Log
from jaxoffload.plan.ladder import Budgets, Candidate, Ladder
from jaxoffload.plan.step_time import Calibration
from jaxoffload.plan.timing import calibrate
from jaxoffload.train import host_memory
from jaxoffload.train.config import Config, ConfigError
from jaxoffload.train.implied import moment_dtypes
from jaxoffload.train.loading import override
from jaxoffload.train.offload_choice import kernel_formats
from jaxoffload.train.rules import GRAD_SUMS_PLACES

# Adam's moments in the storages the planner falls back to, smallest last, where the
# config's own fit nowhere: bfloat16 (rounded stochastically), then 8-bit blocks.
COMPACT_MOMENTS = ("bfloat16", "int8")
_MOMENT_BYTES = {"float32": 4, "bfloat16": 2, "int8": 1}


def activation_settings(config: Config, backend: Optional[str] = None) -> dict[str, list[str]]:
  """The activation settings the planner tries, by name: the config's own, saving every
  activation, recomputing the attention kernel (selective) or every layer, and, but on a
  CPU, offloading the config's policy for every layer but the last (Megatron's limit): by
  XLA inside one program, with the weights too, and moved by the trainer a program per
  layer (so too every activation, Megatron's policy). XLA's offloads are also tried on
  fewer layers (``partial_depths``), the rest saved: where an offloaded layer costs more
  than a saved one, the fastest setting that fits offloads the fewest layers that fit.

  Args:
    config: a checked config.
    backend: the backend the run trains on; default: JAX's. On ``cpu`` an activation
      offload frees no memory (``train.advice``): no offload setting is offered there.

  Returns:
    Each setting's overrides of ``config``, by name; none that the config's rules refuse.
  """
  m = config.model
  off = lambda weights, layers: [
      "model.cpu_offloading=True", "model.recompute_granularity=null",
      f"model.cpu_offloading_num_layers={layers}", "model.cpu_offloading_activations=True",
      f"model.cpu_offloading_weights={weights}", "model.cpu_offloading_double_buffering=False"]
  no_offload = ["model.cpu_offloading=False", "model.cpu_offloading_num_layers=0"]
  settings = {"as configured": []}
  settings["save everything"] = no_offload + ["model.recompute_granularity=null"]
  settings["recompute selectively"] = no_offload + ["model.recompute_granularity=selective"]
  settings["recompute every layer"] = no_offload + ["model.recompute_granularity=full"]
  most = m.num_layers - 1
  if most and (backend or jax.default_backend()) != "cpu":
    policy = m.cpu_offloading_policy
    settings[f"offload {policy}, {_layers(most)}"] = off(False, most)
    settings[f"offload {policy} and weights, {_layers(most)}"] = off(True, most)
    # Moved by the trainer, a policy's copies cost only what the layers' compute leaves
    # bare: Megatron's, every activation, too. (Its layers cost a saved layer's compute:
    # offloading fewer would free less and save nothing.)
    for moved in dict.fromkeys((policy, "all")):
      settings[f"offload {moved}, {_layers(most)}, moved by the trainer"] = off(False, most) + [
          f"model.cpu_offloading_policy={moved}", "model.cpu_offloading_double_buffering=True"]
    for layers in partial_depths(m.num_layers):
      settings[f"offload {policy}, {_layers(layers)}"] = off(False, layers)
      settings[f"offload {policy} and weights, {_layers(layers)}"] = off(True, layers)
  models = {}
  for name, o in settings.items():
    try:
      models[name] = override(config, o).model
    except ConfigError:  # Refused: never calibrated nor searched.
      pass
  # The config's own setting once: under another name where one of these is the same.
  if any(name != "as configured" and model == m for name, model in models.items()):
    del models["as configured"]
  return {name: settings[name] for name in models}


def partial_depths(num_layers: int) -> list[int]:
  """The numbers of layers below Megatron's limit (all but the last) that the planner also
  offloads: about a quarter, a half and three quarters of the limit, fewest first."""
  most = num_layers - 1
  return sorted({round(most * share) for share in (0.25, 0.5, 0.75)} - {0, most})


def _layers(n: int) -> str:
  return f"{n} layer" if n == 1 else f"{n} layers"


def plan(config: Config, budgets: Budgets, *, explore: bool = True, compact: bool = True,
         log: Log = print, machine: Optional[pricing.Machine] = None,
         calibration: Optional[Calibration] = None) -> tuple[Optional[Candidate], list[Candidate]]:
  """The fastest candidate that fits ``budgets``, and what each combination came to.

  Each combination of activation setting, micro-batch size and update placement
  (with the host kernel and accumulation, and where its leaves' gradients are summed)
  is a ladder of offload fractions in layer-sized steps (``plan.ladder.Ladder``), and
  ``plan.fit.search`` finds the fastest that fits, compiling as few as it can (none where
  the device's budget is unknown); where nothing does, the ladders of each smaller moment
  storage are searched the same way. XLA's log lines meanwhile are dropped (``xla_logs``).

  Args:
    config: a checked config; its optimizer offload is what is planned, and with
      ``explore`` its activation setting and micro-batch size too.
    budgets: what the step may use.
    explore: also try the other activation settings and micro-batch sizes, their
      compute timed by a short calibration on this device, and both places for the
      host kernel's gradient sums; else keep the config's.
    compact: where nothing fits with the config's moments, search again with each
      storage of ``COMPACT_MOMENTS`` smaller than them, until one fits.
    log: where the line explaining the host column (``host_column``) and the
      calibration's go.
    machine: this machine's link and host-kernel rates; default: measured now.
    calibration: the device compute's times; default: measured now when exploring.

  Returns:
    ``(pick, rows)``: the pick, None when nothing fits; and each combination's
    outcome, fastest first.
  """
  baseline = host_rss_bytes() or 0  # What a run holds before its state, as the guard counts.
  log(host_column(baseline))
  seconds = {"start": time.perf_counter()}
  formats = kernel_formats(config, moment_dtypes(config))
  machine = machine or pricing.measure_machine(formats=formats)
  seconds["measuring the link and the host kernel"] = time.perf_counter()
  settings = activation_settings(config) if explore else {"as configured": []}
  sizes = _micro_batch_sizes(config) if explore else [config.train.micro_batch_size]
  if explore and calibration is None:
    with xla_logs.dropped():
      calibration = calibrate([override(config, o) for o in settings.values()], log=log)
  seconds["the calibration"] = time.perf_counter()
  places = fit.update_places(config, keep=not explore)

  def sums(place, size):  # Where the host kernel's leaves' gradients may be summed.
    accumulates = size < config.train.global_batch_size
    return GRAD_SUMS_PLACES if explore and accumulates and place == "host_kernel" else (None,)

  rows = []
  for moments in _moment_settings(config, compact):
    # The device's streamed update cannot keep 8-bit blocks (rules).
    kept = [p for p in places if not (p == "device" and "int8" in " ".join(moments))]
    ladders = [Ladder(config, name, list(o) + [f"train.micro_batch_size={size}"] + moments,
                          (place, at), machine, calibration, baseline)
               for name, o in settings.items() for size in sizes for place in kept
               for at in sums(place, size)]
    with xla_logs.dropped():
      best, found = fit.search(ladders, budgets)
    rows += found
    if best is not None:
      break
  seconds["the search"] = time.perf_counter()
  marks = list(seconds.items())
  log(f"planned in {marks[-1][1] - marks[0][1]:.0f} s: " + ", ".join(
      f"{name} {end - start:.0f} s" for (_, start), (name, end) in zip(marks, marks[1:])))
  return best, rows


def host_column(baseline: int) -> str:
  """What the table's host column counts, for a process holding ``baseline`` bytes now."""
  return (f"host: what this process holds now ({host_memory.size(baseline)}), the JAX "
          f"runtime's reserve ({host_memory.size(host_memory.RUNTIME_BYTES)}, as the "
          f"host-memory guard counts it) and what the run keeps in host memory (offloaded "
          f"state and activations, XLA's pinned pool)")


def _moment_settings(config: Config, compact: bool) -> list[list[str]]:
  """The overrides of each moment storage to search: the config's own, then (with
  ``compact``) each of ``COMPACT_MOMENTS`` smaller than the config's largest moment."""
  largest = max(_MOMENT_BYTES[d] for d in moment_dtypes(config))
  return [[]] + [[f"optimizer.exp_avg_dtype={d}", f"optimizer.exp_avg_sq_dtype={d}"]
                 for d in COMPACT_MOMENTS if compact and _MOMENT_BYTES[d] < largest]


def _micro_batch_sizes(config: Config) -> list[int]:
  """The micro-batch sizes tried, largest first: the config's, twice it, a half and a quarter
  of it, where the global batch divides into them."""
  total, size = config.train.global_batch_size, config.train.micro_batch_size
  return [s for s in dict.fromkeys((2 * size, size, size // 2, size // 4))
          if 1 <= s <= total and total % s == 0]


def table(rows: list[Candidate], pick: Optional[Candidate]) -> list[str]:
  """One markdown row per combination the planner judged, the pick marked."""
  lines = ["| activations | micro-batch | update on | gradient sums | moments | offload (achieved) "
           "| device peak | host | predicted step | fits |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for c in rows:
    device = "-" if c.device_bytes is None else host_memory.size(c.device_bytes)
    lines.append(f"| {c.activations} | {c.micro_batch_size} | {c.update_on} | {c.grad_sums} "
                 f"| {c.moments} "
                 f"| {c.fraction:.2f} "
                 f"({c.achieved:.2f}) | {device} | {host_memory.size(c.host_bytes)} | "
                 f"{c.step_s * 1e3:,.1f} ms | {c.verdict}{' (pick)' if c == pick else ''} |")
  return lines
