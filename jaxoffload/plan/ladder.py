"""One setting's candidates by optimizer offload fraction, judged before anything is allocated.

A ``Ladder`` is a combination of activation setting, micro-batch size and update placement,
its offload fraction in layer-sized steps; it judges each step's device and host bytes and
predicted time (a ``Candidate``) against the ``Budgets``, compiling as little as it can.
``fit.search`` searches several of them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

from jaxoffload.host import pricing
from jaxoffload.plan import shallow
from jaxoffload.plan.compiling import Peaks
from jaxoffload.plan.step_time import Calibration, moved_copies, predict_s
from jaxoffload.train import host_memory
from jaxoffload.train.config import Config, ConfigError
from jaxoffload.train.loading import override
from jaxoffload.train.resolve import resolve
from jaxoffload.train.setup import Setup
from jaxoffload.train.step import Trainer, resident_device_bytes

DEVICE_HEADROOM = 0.05  # XLA's estimate leaves out fragmentation and the runtime's own use.
HOST_HEADROOM = 0.10  # The guard's arithmetic leaves out allocator growth it cannot see.


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One setting and what it needs.

  Attributes:
    activations: the name of its activation setting (the planner's
      ``activation_settings``; ``as configured`` for the config's own).
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
    step_s: the predicted seconds of a step (``step_time``); without a calibration,
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


class Ladder:
  """One combination's candidates by offload fraction, ``k / num_layers``, resolved when
  asked for; ``least_fitting``, ``predict`` and ``verify`` search them (the device's bytes fall
  and the host's rise as the fraction does). Its ``place`` is the update placement and where
  the host kernel's leaves' gradients are summed (None: as the config says)."""

  def __init__(self, config: Config, name: str, base: list[str],
               place: tuple[str, Optional[str]],
               machine: pricing.Machine, calibration: Optional[Calibration], baseline: int):
    self.config, self.name, self.base, self.place = config, name, base, place
    self.machine, self.calibration, self.baseline = machine, calibration, baseline
    self.steps = config.model.num_layers
    self._setups: dict[int, Optional[tuple[Setup, Candidate]]] = {}
    self._least: Optional[int] = None
    self._refusal = ""  # Why the config's rules refused a step, the last one they did.
    self._resident: dict[int, int] = {}
    self._compiled: dict[int, Candidate] = {}  # Per step compiled, its row with its peak.
    self._guess: Optional[int] = None  # Where ``predict`` found the least fit would be,
    self._beyond = False  # or the most offload, where it found none.
    self._lines: Optional[list[shallow.Pair]] = None  # ``shallow.versions``, once found.

  def candidate(self, step: int) -> Optional[tuple[Setup, Candidate]]:
    """Step ``step``'s setup and candidate (not compiled); None where a rule refuses it."""
    if step not in self._setups:
      fraction = step / self.steps
      overrides = self.base + offload_overrides(fraction, *self.place)
      try:
        setup = resolve(override(self.config, overrides), with_data=False)
      except ConfigError as error:
        self._setups[step], self._refusal = None, str(error)
        return None
      grad_sums = "host" if setup.sums_on_host else "device" if setup.micro_batches > 1 else "-"
      moments = "/".join(dict.fromkeys(setup.moment_dtypes))
      self._setups[step] = setup, Candidate(
          self.name, setup.config.train.micro_batch_size, fraction,
          self.place[0] if fraction else "-", grad_sums, moments,
          setup.offload.fraction if setup.offload else 0.0,
          None, self.baseline + host_memory.needed(setup).total,
          predict_s(setup, self.calibration, self.machine), tuple(overrides))
    return self._setups[step]

  def least_fitting(self, budgets: Budgets) -> Candidate:
    """The least offload whose state alone fits both budgets, found without compiling (its
    verdict empty); or, with its verdict, why none does."""
    resident_fits = lambda step: self.candidate(step) is not None and (
        budgets.device is None
        or self.resident_bytes(step) <= (1 - DEVICE_HEADROOM) * budgets.device)
    self._least = _first(0, self.steps, resident_fits)
    if self._least is None:
      most = self.candidate(self.steps)
      if most is None:  # Its offload refused: a row that says why, never compiled. (Without
        # offload it is another placement's setting.)
        sizes = [o.split("=")[1] for o in self.base if o.startswith("train.micro_batch_size=")]
        size = int(sizes[-1]) if sizes else self.config.train.micro_batch_size
        return Candidate(self.name, size, 1.0, self.place[0], "-", "-", 0.0, None, 0,
                         math.inf, tuple(self.base + offload_overrides(1.0, *self.place)),
                         f"refused: {self._refusal}")
      return dataclasses.replace(most[1], verdict="no: device (its state alone)")
    candidate = self.candidate(self._least)[1]
    return candidate if budgets.fits_host(candidate) else dataclasses.replace(
        candidate, verdict="no: host")

  def predict(self, budgets: Budgets, peaks: Peaks) -> Candidate:
    """The least offload that the most offload's predicted peak (``transient_bytes``) fits
    the device, not yet compiled (its verdict empty; ``time_bound``, ``verify``); where none is
    predicted to, the most offload, compiled only if ``verify`` is reached (its ``time_bound``,
    a layer-sized step below it, may already be slower than the pick). What the step holds
    beyond its resident state (activations, gradients, temporaries: ``transient_bytes``), with
    another fraction's resident state, predicts that fraction's peak. ``peaks`` holds the
    device peaks compiled so far and gets this ladder's. Where the device's budget is
    unknown (CPUs) nothing is compiled: the least offload, judged by the host alone."""
    if budgets.device is None:  # No budget to judge a peak against: the least offload wins.
      candidate = self.candidate(self._least)[1]
      return dataclasses.replace(candidate, verdict="fits" if budgets.fits_host(candidate)
                                 else "no: host")
    self._compiled = {}
    self._guess = self._predicted_fit(budgets, self.transient_bytes(peaks))
    self._beyond = self._guess is None
    if self._beyond:
      self._guess = self.steps
    return self.candidate(self._guess)[1]

  def _predicted_fit(self, budgets: Budgets, transient: int) -> Optional[int]:
    """The least step whose resident state and ``transient`` bytes (``transient_bytes``) fit
    the device; None if none."""
    return _first(self._least, self.steps, lambda step: budgets.fits_device(dataclasses.replace(
        self.candidate(step)[1], device_bytes=transient + self.resident_bytes(step))))

  def transient_bytes(self, peaks: Peaks) -> int:
    """What the step at the most offload holds on the device beyond its resident state,
    and the moved activations' originals the link leaves there (``step_time.moved_copies``):
    drawn from shallow versions of it (``shallow``), or compiled whole where the model is
    shallower than ``shallow.DEEP`` or the rules refuse its shallow versions."""
    lines = self._shallow_lines()
    if not lines:
      return self._peak(self.steps, peaks) - self.resident_bytes(self.steps)
    return shallow.transient_bytes(lines, self.candidate(self.steps)[0].config.model,
                          peaks) + self._moved_bytes(self.steps)

  def _shallow_lines(self) -> list[shallow.Pair]:
    """The most offload's ``shallow.versions``, found once."""
    if self._lines is None:
      setup, candidate = self.candidate(self.steps)
      self._lines = shallow.versions(self.config, candidate.overrides, setup.config.model)
    return self._lines

  def holds_no_less(self, other: "Ladder") -> bool:
    """Whether this ladder's most offload holds at least what ``other``'s holds on the
    device, known without compiling: the same update placement and config but for its
    micro-batch, no smaller (and summed over micro-batches where the other's is: a step of
    one micro-batch holds no sums), and its activation offload, no larger (no more layers
    sending their activations or weights to the host, by the same policy and mover)."""
    if self.place != other.place or self.candidate(self.steps) is None:
      return False
    mine, theirs = (ladder.candidate(ladder.steps)[0].config for ladder in (self, other))
    neither = lambda config: dataclasses.replace(
        config, model=shallow.without_offload(config.model),
        train=dataclasses.replace(config.train, micro_batch_size=0))
    acts, weights = zip(*(shallow.offloaded_layers(c.model) for c in (mine, theirs)))
    same_mover = mine.model.cpu_offloading_double_buffering == \
        theirs.model.cpu_offloading_double_buffering
    accumulates = lambda config: config.train.micro_batch_size < config.train.global_batch_size
    return (neither(mine) == neither(theirs)
            and mine.train.micro_batch_size >= theirs.train.micro_batch_size
            and accumulates(mine) == accumulates(theirs)
            and acts[0] <= acts[1] and weights[0] <= weights[1] and same_mover
            and (not acts[0] or mine.model.cpu_offloading_policy
                 == theirs.model.cpu_offloading_policy))

  def time_bound(self) -> float:
    """Once ``predict`` predicted, the step time of a layer-sized step below the predicted
    fit: the least ``verify`` finds unless the prediction was cautious by more than that
    step (the peaks it predicts from grow with the fraction, so it seldom is)."""
    return self.candidate(max(self._guess - 1, self._least))[1].step_s

  def verify(self, budgets: Budgets, peaks: Peaks) -> Candidate:
    """After ``predict``: the least offload whose compiled step fits the device, and
    whether it fits the host. The predicted fit is compiled, and the step below it where
    that fits too (then a bisection below); where it does not (a wrong prediction), a
    bisection above it. Where no fit was predicted, the most offload is compiled: its row
    where it does not fit the device (then nothing does); else its compiled peak predicts
    again, as the line's did."""
    fits = lambda step: self._fits(step, budgets, peaks)
    assert self._guess is not None, "verify follows predict"
    if self._beyond:  # Ruled out only once compiled whole: a line drawn may err.
      if not fits(self.steps):
        return dataclasses.replace(self._compiled[self.steps], verdict="no: device")
      self._guess = self._predicted_fit(
          budgets, self._compiled[self.steps].device_bytes - self.resident_bytes(self.steps))
    guess = self._guess
    if peaks.workers > 1 and guess > self._least:  # Judged next where the guess fits.
      self._ask(guess - 1, peaks)
    if not fits(guess):
      step = _first(guess + 1, self.steps, fits)
    elif guess > self._least and fits(guess - 1):
      step = _first(self._least, guess - 1, fits)
    else:
      step = guess
    return dataclasses.replace(self._compiled[step], verdict="fits" if budgets.fits_host(
        self._compiled[step]) else "no: host")

  def ask_ahead(self, peaks: Peaks, *, predicted: bool) -> None:
    """Starts compiling what this ladder's next judgement compiles first: its guess once
    ``predict`` made one, else what ``transient_bytes`` compiles."""
    if predicted:
      self._ask(self._guess, peaks)
    elif self.candidate(self.steps) is not None:
      lines = self._shallow_lines()
      for pair in lines:
        for small in pair:
          peaks.ask(small)
      if not lines:
        self._ask(self.steps, peaks)

  def _ask(self, step: int, peaks: Peaks) -> None:
    judged = self.candidate(step)
    if judged is not None:
      peaks.ask(judged[0])

  def _fits(self, step: int, budgets: Budgets, peaks: Peaks) -> bool:
    """Whether step ``step``'s compiled peak (``_peak``) fits the device; its row, with that
    peak, kept in ``_compiled``."""
    self._compiled[step] = dataclasses.replace(self.candidate(step)[1],
                                               device_bytes=self._peak(step, peaks))
    return budgets.fits_device(self._compiled[step])

  def _peak(self, step: int, peaks: Peaks) -> int:
    """Step ``step``'s compiled device peak, with the moved activations' originals that the
    link leaves on the device."""
    return max(peaks.get(self.candidate(step)[0])) + self._moved_bytes(step)

  def _moved_bytes(self, step: int) -> int:
    """With a calibration, the moved activations' originals of step ``step`` that the link
    leaves on the device (``step_time.moved_copies``)."""
    moved = self.calibration and moved_copies(self.candidate(step)[0], self.calibration,
                                              self.machine)
    return moved.held_bytes if moved else 0

  def resident_bytes(self, step: int) -> int:
    """The device bytes step ``step``'s parameters and optimizer state hold between steps."""
    if step not in self._resident:
      self._resident[step] = resident_device_bytes(Trainer.from_shapes(self.candidate(step)[0]))
    return self._resident[step]


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
  """The overrides of an optimizer offload of ``fraction`` updated on ``place``, its host
  kernel's leaves' gradients summed on ``grad_sums`` (None: as the config says)."""
  if not fraction:
    return ["optimizer.optimizer_cpu_offload=False", "optimizer.optimizer_offload_fraction=0.0"]
  return ["optimizer.optimizer_cpu_offload=True",
          f"optimizer.optimizer_offload_fraction={fraction}",
          f"optimizer.optimizer_offload_update_on={place}"] + (
              [] if grad_sums is None else
              [f"optimizer.accumulate_offloaded_grads_on={grad_sums}"])
