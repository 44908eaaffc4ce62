"""The candidate settings, the search for the fastest one that fits, and its table."""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import jax

from jaxoffload import autoplace
from jaxoffload.memory import host_rss_bytes
from jaxoffload.plan.timing import Calibration, calibrate, predict_s
from jaxoffload.train import Trainer, host_memory, resolve
from jaxoffload.train.config import Config, ConfigError
from jaxoffload.train.loading import override
from jaxoffload.train.resolve import Setup
from jaxoffload.train.rules import GRAD_SUMS_PLACES, moment_dtypes
from jaxoffload.train.step import resident_device_bytes

DEVICE_HEADROOM = 0.05  # XLA's estimate leaves out fragmentation and the runtime's own use.
HOST_HEADROOM = 0.10  # The guard's arithmetic leaves out allocator growth it cannot see.
PLACES = ("device", "host_kernel")
# Adam's moments in the storages the planner falls back to, smallest last, where the
# config's own fit nowhere: bfloat16 (rounded stochastically), then 8-bit blocks.
COMPACT_MOMENTS = ("bfloat16", "int8")
_MOMENT_BYTES = {"float32": 4, "bfloat16": 2, "int8": 1}
Log = Callable[[str], None]


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One setting and what it needs.

  Attributes:
    activations: the name of its activation setting (``activation_settings``).
    micro_batch_size: ``train.micro_batch_size``.
    fraction: ``optimizer.optimizer_offload_fraction`` (0: no optimizer offload).
    update_on: ``optimizer.optimizer_offload_update_on``.
    grad_sums: where gradients are summed over micro-batches (the host kernel's leaves'
      with ``optimizer.accumulate_offloaded_grads_on=host``); ``-`` without accumulation.
    moments: the dtype of Adam's moments (``int8``: 8-bit blocks), "/"-joined where the
      two differ.
    achieved: the share of elements the plan offloads (whole leaves).
    device_bytes: XLA's device peak of the step; None where it was not compiled.
    host_bytes: the host memory the process will hold.
    step_s: the predicted seconds of a step (``timing``); without a calibration,
      only what offload adds to it.
    overrides: the config overrides that make this setting.
    verdict: what the search found: ``fits``, what it does not fit, or why it was
      not compiled.
  """

  activations: str
  micro_batch_size: int
  fraction: float
  update_on: str
  grad_sums: str
  moments: str
  achieved: float
  device_bytes: Optional[int]
  host_bytes: int
  step_s: float
  overrides: tuple[str, ...]
  verdict: str = ""


@dataclasses.dataclass(frozen=True)
class Budgets:
  """What a setting may use: device bytes (None where unknown) and host bytes."""

  device: Optional[int]
  host: int

  def fits_device(self, candidate: Candidate) -> bool:
    return (self.device is None or candidate.device_bytes is not None
            and candidate.device_bytes <= (1 - DEVICE_HEADROOM) * self.device)

  def fits_host(self, candidate: Candidate) -> bool:
    return candidate.host_bytes <= (1 - HOST_HEADROOM) * self.host


def activation_settings(config: Config) -> dict[str, list[str]]:
  """The activation settings the planner tries, by name: the config's own, saving every
  activation, recomputing the attention kernel (selective) or every layer, and offloading
  the config's policy (with and without the weights) for every layer but the last
  (Megatron's limit)."""
  m = config.model
  off = lambda weights: ["model.cpu_offloading=True", "model.recompute_granularity=null",
                         f"model.cpu_offloading_num_layers={m.num_layers - 1}",
                         "model.cpu_offloading_activations=True",
                         f"model.cpu_offloading_weights={weights}"]
  no_offload = ["model.cpu_offloading=False", "model.cpu_offloading_num_layers=0"]
  settings = {"as configured": []}
  settings["save everything"] = no_offload + ["model.recompute_granularity=null"]
  settings["recompute selectively"] = no_offload + ["model.recompute_granularity=selective"]
  settings["recompute every layer"] = no_offload + ["model.recompute_granularity=full"]
  if m.num_layers > 1:
    settings[f"offload {m.cpu_offloading_policy}, {m.num_layers - 1} layers"] = off(False)
    settings[f"offload {m.cpu_offloading_policy} and weights, {m.num_layers - 1} layers"] = (
        off(True))
  # The config's own setting once: under another name where one of these is the same.
  if any(o and override(config, o).model == m for o in settings.values()):
    del settings["as configured"]
  return settings


def plan(config: Config, budgets: Budgets, *, explore: bool = True, compact: bool = True,
         log: Log = print, machine: Optional[autoplace.Machine] = None,
         calibration: Optional[Calibration] = None) -> tuple[Optional[Candidate], list[Candidate]]:
  """The fastest candidate that fits ``budgets``, and what each combination came to.

  Each combination of activation setting, micro-batch size and update placement
  (with the host kernel and accumulation, and where its leaves' gradients are summed)
  is a ladder of offload fractions in layer-sized steps. Its least fraction
  whose state alone fits (found without compiling) bounds its step time from
  below; ladders are tried fastest bound first, until the pick is faster than
  every bound left. A ladder is compiled at its most offload (if that does not
  fit, neither does a larger micro-batch of its activation setting), then at its
  least, then bisected.

  Args:
    config: a checked config; its optimizer offload is what is planned, and with
      ``explore`` its activation setting and micro-batch size too.
    budgets: what the step may use.
    explore: also try the other activation settings and micro-batch sizes, their
      compute timed by a short calibration on this device, and both places for the
      host kernel's gradient sums; else keep the config's.
    compact: where nothing fits with the config's moments, search again with each
      storage of ``COMPACT_MOMENTS`` smaller than them, until one fits.
    machine: this machine's link and host-kernel rates; default: measured now.
    calibration: the device compute's times; default: measured now when exploring.

  Returns:
    ``(pick, rows)``: the pick, None when nothing fits; and each combination's
    outcome, fastest first.
  """
  baseline = host_rss_bytes() or 0  # What a run holds before its state, as the guard counts.
  machine = machine or autoplace.measure_machine()
  settings = activation_settings(config) if explore else {"as configured": []}
  sizes = _micro_batch_sizes(config) if explore else [config.train.micro_batch_size]
  if explore and calibration is None:
    calibration = calibrate([override(config, o) for o in settings.values()], log=log)
  places = [p for p in PLACES if p == "device" or machine.kernel_rate is not None]
  if not explore and config.optimizer.optimizer_offload_update_on in PLACES:
    places = [config.optimizer.optimizer_offload_update_on]

  def sums(place, size):  # Where the host kernel's leaves' gradients may be summed.
    accumulates = size < config.train.global_batch_size
    return GRAD_SUMS_PLACES if explore and accumulates and place == "host_kernel" else (None,)

  rows = []
  for moments in _moment_settings(config, compact):
    # The device's streamed update cannot keep 8-bit blocks (rules).
    kept = [p for p in places if not (p == "device" and "int8" in " ".join(moments))]
    ladders = [_Ladder(config, name, list(o) + [f"train.micro_batch_size={size}"] + moments,
                       (place, at), machine, calibration, baseline)
               for name, o in settings.items() for size in sizes for place in kept
               for at in sums(place, size)]
    best, found = _search(ladders, budgets)
    rows += found
    if best is not None:
      break
  return best, rows


def _moment_settings(config: Config, compact: bool) -> list[list[str]]:
  """The overrides of each moment storage to search: the config's own, then (with
  ``compact``) each of ``COMPACT_MOMENTS`` smaller than the config's largest moment."""
  largest = max(_MOMENT_BYTES[d] for d in moment_dtypes(config))
  return [[]] + [[f"optimizer.exp_avg_dtype={d}", f"optimizer.exp_avg_sq_dtype={d}"]
                 for d in COMPACT_MOMENTS if compact and _MOMENT_BYTES[d] < largest]


def _search(ladders: list["_Ladder"], budgets: Budgets
            ) -> tuple[Optional[Candidate], list[Candidate]]:
  """``plan``'s search over ``ladders``: bounds first, then the compiled steps."""
  rows = {n: ladder.least(budgets) for n, ladder in enumerate(ladders)}
  device_bytes = {}  # Per setting's overrides, its compiled step's device peak.
  # Per activation setting and placement, the least micro-batch that cannot fit.
  best, too_large = None, {}
  for n in sorted((n for n, row in rows.items() if not row.verdict),
                  key=lambda n: rows[n].step_s):
    row = rows[n]
    if best is not None and row.step_s >= best.step_s:
      rows[n] = dataclasses.replace(row, verdict="not compiled: slower than the pick")
    elif row.micro_batch_size >= too_large.get((row.activations, ladders[n].place), math.inf):
      rows[n] = dataclasses.replace(row, verdict="not compiled: a smaller micro-batch does "
                                                 "not fit the device")
    else:
      rows[n] = ladders[n].smallest_fitting(budgets, device_bytes)
      if rows[n].verdict == "no: device":
        setting = row.activations, ladders[n].place
        too_large[setting] = min(row.micro_batch_size, too_large.get(setting, math.inf))
      if rows[n].verdict == "fits" and (best is None or rows[n].step_s < best.step_s):
        best = rows[n]
  # Without offload, both placements are one setting: its row once.
  unique = {}
  for n in sorted(rows, key=lambda n: rows[n].step_s):
    unique.setdefault(rows[n].overrides, rows[n])
  return best, list(unique.values())


class _Ladder:
  """One combination's candidates by offload fraction, ``k / num_layers``, resolved when
  asked for; ``least`` and ``smallest_fitting`` bisect them (the device's bytes fall and
  the host's rise as the fraction does). Its ``place`` is the update placement and where
  the host kernel's leaves' gradients are summed (None: as the config says)."""

  def __init__(self, config: Config, name: str, base: list[str],
               place: tuple[str, Optional[str]],
               machine: autoplace.Machine, calibration: Optional[Calibration], baseline: int):
    self.config, self.name, self.base, self.place = config, name, base, place
    self.machine, self.calibration, self.baseline = machine, calibration, baseline
    self.steps = config.model.num_layers
    self._setups: dict[int, Optional[tuple[Setup, Candidate]]] = {}
    self._least: Optional[int] = None

  def judge(self, step: int) -> Optional[tuple[Setup, Candidate]]:
    """Step ``step``'s setup and candidate (not compiled); None where a rule refuses it."""
    if step not in self._setups:
      fraction = step / self.steps
      overrides = self.base + offload_overrides(fraction, *self.place)
      try:
        setup = resolve(override(self.config, overrides))
      except ConfigError:
        self._setups[step] = None
        return None
      grad_sums = "host" if setup.sums_on_host else "device" if setup.micro_batches > 1 else "-"
      moments = "/".join(dict.fromkeys(moment_dtypes(setup.config)))
      self._setups[step] = setup, Candidate(
          self.name, setup.config.train.micro_batch_size, fraction,
          self.place[0] if fraction else "-", grad_sums, moments,
          setup.offload.fraction if setup.offload else 0.0,
          None, self.baseline + host_memory.needed(setup).total,
          predict_s(setup, self.calibration, self.machine), tuple(overrides))
    return self._setups[step]

  def least(self, budgets: Budgets) -> Candidate:
    """The least offload whose state alone fits both budgets, found without compiling (its
    verdict empty); or, with its verdict, why none does."""
    resident_fits = lambda step: self.judge(step) is not None and (
        budgets.device is None or resident_device_bytes(Trainer.from_shapes(
            self.judge(step)[0])) <= (1 - DEVICE_HEADROOM) * budgets.device)
    self._least = _first(0, self.steps, resident_fits)
    if self._least is None:
      last = self.judge(self.steps) or self.judge(0)
      return dataclasses.replace(last[1], verdict="no: device (its state alone)")
    candidate = self.judge(self._least)[1]
    return candidate if budgets.fits_host(candidate) else dataclasses.replace(
        candidate, verdict="no: host")

  def smallest_fitting(self, budgets: Budgets, device_bytes: dict) -> Candidate:
    """The least offload whose compiled step fits the device, and whether it fits the host;
    or the most offloaded one tried, which does not fit the device. ``device_bytes`` holds
    the device peaks compiled so far, by overrides, and gets this ladder's."""
    compiled = {}

    def fits(step):
      setup, candidate = self.judge(step)
      if candidate.overrides not in device_bytes:
        tokens = setup.global_batch(0)
        device_bytes[candidate.overrides] = Trainer.from_shapes(setup).compile(
            jax.ShapeDtypeStruct(tokens.shape, tokens.dtype, sharding=tokens.sharding)
        ).device_bytes
      compiled[step] = dataclasses.replace(candidate,
                                           device_bytes=device_bytes[candidate.overrides])
      return budgets.fits_device(compiled[step])

    # The most offload first: where it does not fit, nothing does. Then the least: where it
    # fits, no bisection is needed.
    if not fits(self.steps):
      return dataclasses.replace(compiled[self.steps], verdict="no: device")
    step = self._least if fits(self._least) else _first(self._least + 1, self.steps, fits)
    return dataclasses.replace(compiled[step], verdict="fits" if budgets.fits_host(
        compiled[step]) else "no: host")


def _first(low: int, high: int, holds: Callable[[int], bool]) -> Optional[int]:
  """The least step in ``[low, high]`` where ``holds``, which holds from some step on."""
  found = None
  while low <= high:
    middle = (low + high) // 2
    if holds(middle):
      found, high = middle, middle - 1
    else:
      low = middle + 1
  return found


def offload_overrides(fraction: float, place: str, grad_sums: Optional[str] = None) -> list[str]:
  if not fraction:
    return ["optimizer.optimizer_cpu_offload=False", "optimizer.optimizer_offload_fraction=0.0"]
  return ["optimizer.optimizer_cpu_offload=True",
          f"optimizer.optimizer_offload_fraction={fraction}",
          f"optimizer.optimizer_offload_update_on={place}"] + (
              [] if grad_sums is None else
              [f"optimizer.accumulate_offloaded_grads_on={grad_sums}"])


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
