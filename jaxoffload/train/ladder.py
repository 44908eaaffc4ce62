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

from jaxoffload import autoplace
from jaxoffload.train import host_memory
from jaxoffload.train.compiling import Peaks
from jaxoffload.train.config import Config, ConfigError, ModelConfig
from jaxoffload.train.loading import override
from jaxoffload.train.resolve import Setup, resolve
from jaxoffload.train.step import Trainer, resident_device_bytes
from jaxoffload.train.step_time import Calibration, moved_copies, predict_s

DEVICE_HEADROOM = 0.05  # XLA's estimate leaves out fragmentation and the runtime's own use.
HOST_HEADROOM = 0.10  # The guard's arithmetic leaves out allocator growth it cannot see.
# The depths a ladder's step is compiled at to predict its peak at any depth (``Ladder.others``):
# deep enough that XLA's offload copies reach the schedule they keep in deeper models.
SHALLOW = (4, 6)
# The least depth predicted from ``SHALLOW``: the search compiles a model whole where it
# predicts a fit anyway, so the shallow compiles pay where they are well under one whole one.
DEEP = 2 * sum(SHALLOW)


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
  asked for; ``least``, ``predict`` and ``verify`` search them (the device's bytes fall
  and the host's rise as the fraction does). Its ``place`` is the update placement and where
  the host kernel's leaves' gradients are summed (None: as the config says)."""

  def __init__(self, config: Config, name: str, base: list[str],
               place: tuple[str, Optional[str]],
               machine: autoplace.Machine, calibration: Optional[Calibration], baseline: int):
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
    self._shallows: dict[tuple[int, int], Optional[Setup]] = {}

  def judge(self, step: int) -> Optional[tuple[Setup, Candidate]]:
    """Step ``step``'s setup and candidate (not compiled); None where a rule refuses it."""
    if step not in self._setups:
      fraction = step / self.steps
      overrides = self.base + offload_overrides(fraction, *self.place)
      try:
        setup = resolve(override(self.config, overrides))
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

  def least(self, budgets: Budgets) -> Candidate:
    """The least offload whose state alone fits both budgets, found without compiling (its
    verdict empty); or, with its verdict, why none does."""
    resident_fits = lambda step: self.judge(step) is not None and (
        budgets.device is None
        or self.resident_bytes(step) <= (1 - DEVICE_HEADROOM) * budgets.device)
    self._least = _first(0, self.steps, resident_fits)
    if self._least is None:
      most = self.judge(self.steps)
      if most is None:  # Its offload refused: a row that says why, never compiled. (Without
        # offload it is another placement's setting.)
        sizes = [o.split("=")[1] for o in self.base if o.startswith("train.micro_batch_size=")]
        size = int(sizes[-1]) if sizes else self.config.train.micro_batch_size
        return Candidate(self.name, size, 1.0, self.place[0], "-", "-", 0.0, None, 0,
                         math.inf, tuple(self.base + offload_overrides(1.0, *self.place)),
                         f"refused: {self._refusal}")
      return dataclasses.replace(most[1], verdict="no: device (its state alone)")
    candidate = self.judge(self._least)[1]
    return candidate if budgets.fits_host(candidate) else dataclasses.replace(
        candidate, verdict="no: host")

  def predict(self, budgets: Budgets, peaks: Peaks) -> Candidate:
    """The least offload that the most offload's predicted peak (``others``) predicts to fit
    the device, not yet compiled (its verdict empty; ``bound``, ``verify``); where none is
    predicted to, the most offload, compiled only if ``verify`` is reached (its ``bound``,
    a layer-sized step below it, may already be slower than the pick). What the step holds
    beyond its resident state (activations, gradients, temporaries: ``others``), with
    another fraction's resident state, predicts that fraction's peak. ``peaks`` holds the
    device peaks compiled so far and gets this ladder's. Where the device's budget is
    unknown (CPUs) nothing is compiled: the least offload, judged by the host alone."""
    if budgets.device is None:  # No budget to judge a peak against: the least offload wins.
      candidate = self.judge(self._least)[1]
      return dataclasses.replace(candidate, verdict="fits" if budgets.fits_host(candidate)
                                 else "no: host")
    self._compiled = {}
    self._guess = self._predicted_fit(budgets, self.others(peaks))
    self._beyond = self._guess is None
    if self._beyond:
      self._guess = self.steps
    return self.judge(self._guess)[1]

  def _predicted_fit(self, budgets: Budgets, others: int) -> Optional[int]:
    """The least step whose resident state and ``others`` fit the device; None if none."""
    return _first(self._least, self.steps, lambda step: budgets.fits_device(
        dataclasses.replace(self.judge(step)[1], device_bytes=others + self.resident_bytes(step))))

  def others(self, peaks: Peaks) -> int:
    """What the step at the most offload holds on the device beyond its resident state,
    and the moved activations' originals the link leaves there (``step_time.moved_copies``).
    Compiled at two shallow depths (``SHALLOW``) and drawn to the model's by a line, each
    phase of the step on its own (a program per layer holds the larger of what the layers'
    programs and the update need): activations, gradients and their sums grow a layer at
    a time. An offload by XLA of fewer layers than all but the last lies between the lines
    of the same model with none and with all but the last offloaded, in proportion to its
    offloaded layers (each holds what it holds in place of a saved layer's): those are the
    shallow versions of the ladders that save everything and that offload most, compiled
    once for all of them. A model shallower than ``DEEP``, or one whose shallow versions
    the rules refuse, is compiled itself."""
    lines = self._shallow_lines()
    if not lines:
      return self._peak(self.steps, peaks) - self.resident_bytes(self.steps)
    for pair in lines:
      for small in pair:
        peaks.ask(small)
    drawn = [self._drawn(pair, peaks) for pair in lines]
    if len(drawn) == 2:  # Between none and all but the last layer offloaded.
      offloaded = self.judge(self.steps)[0].config.model.cpu_offloading_num_layers
      share = offloaded / (self.steps - 1)
      drawn = [[none + (most - none) * share for none, most in zip(*drawn)]]
    return round(max(drawn[0])) + self._moved_bytes(self.steps)

  def _drawn(self, pair: tuple[Setup, Setup], peaks: Peaks) -> list[float]:
    """Each phase's bytes beyond the resident state, drawn from ``pair``'s depths to the
    model's."""
    one, two = ([peak - resident_device_bytes(Trainer.from_shapes(small))
                 for peak in peaks.get(small)] for small in pair)
    steps = (self.steps - SHALLOW[0]) / (SHALLOW[1] - SHALLOW[0])
    return [a + (b - a) * steps for a, b in zip(one, two)]

  def _shallow_lines(self) -> list[tuple[Setup, Setup]]:
    """The most offload's versions at ``SHALLOW``'s depths that ``others`` draws its lines
    through: one pair, or two for a partial offload by XLA; none where ``others`` compiles
    the model itself."""
    if self.steps < DEEP:
      return []
    model = self.judge(self.steps)[0].config.model
    offloaded = model.cpu_offloading_num_layers if model.cpu_offloading else 0
    if 0 < offloaded < self.steps - 1 and not model.cpu_offloading_double_buffering:
      counts = [lambda depth: 0, lambda depth: depth - 1]
    elif offloaded == self.steps - 1:
      counts = [lambda depth: depth - 1]
    else:  # Moved by the trainer, or none: as many in proportion.
      counts = [lambda depth: offloaded and max(1, round(offloaded * depth / self.steps))]
    lines = [tuple(self._shallow(depth, count(depth)) for depth in SHALLOW) for count in counts]
    return [] if any(None in pair for pair in lines) else lines

  def _shallow(self, depth: int, offloaded: int) -> Optional[Setup]:
    """The most offload's setting with ``depth`` layers, ``offloaded`` of them offloaded;
    None where the rules refuse it. Without offload, its offload keys are their defaults:
    every such version of a model is one config, compiled once."""
    if (depth, offloaded) not in self._shallows:
      overrides = list(self.judge(self.steps)[1].overrides) + [
          f"model.num_layers={depth}", f"model.cpu_offloading_num_layers={offloaded}"]
      try:
        config = override(self.config, overrides + (
            [] if offloaded else ["model.cpu_offloading=False"]))
        if not offloaded:
          config = dataclasses.replace(config, model=_without_offload(config.model))
        self._shallows[depth, offloaded] = resolve(config)
      except ConfigError:
        self._shallows[depth, offloaded] = None
    return self._shallows[depth, offloaded]

  def holds_no_less(self, other: "Ladder") -> bool:
    """Whether this ladder's most offload holds at least what ``other``'s holds on the
    device, known without compiling: the same update placement and config but for its
    micro-batch, no smaller, and its activation offload, no larger (no more layers sending
    their activations or weights to the host, by the same policy and mover)."""
    if self.place != other.place or self.judge(self.steps) is None:
      return False
    mine, theirs = (ladder.judge(ladder.steps)[0].config for ladder in (self, other))
    neither = lambda config: dataclasses.replace(
        config, model=_without_offload(config.model),
        train=dataclasses.replace(config.train, micro_batch_size=0))
    acts, weights = zip(*(_offloaded_layers(c.model) for c in (mine, theirs)))
    same_mover = mine.model.cpu_offloading_double_buffering == \
        theirs.model.cpu_offloading_double_buffering
    return (neither(mine) == neither(theirs)
            and mine.train.micro_batch_size >= theirs.train.micro_batch_size
            and acts[0] <= acts[1] and weights[0] <= weights[1] and same_mover
            and (not acts[0] or mine.model.cpu_offloading_policy
                 == theirs.model.cpu_offloading_policy))

  def bound(self) -> float:
    """Once ``predict`` predicted, the step time of a layer-sized step below the predicted
    fit: the least ``verify`` finds unless the prediction was cautious by more than that
    step (the peaks it predicts from grow with the fraction, so it seldom is)."""
    return self.judge(max(self._guess - 1, self._least))[1].step_s

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
    ``predict`` made one, else what ``others`` compiles."""
    if predicted:
      self._ask(self._guess, peaks)
    elif self.judge(self.steps) is not None:
      lines = self._shallow_lines()
      for pair in lines:
        for small in pair:
          peaks.ask(small)
      if not lines:
        self._ask(self.steps, peaks)

  def _ask(self, step: int, peaks: Peaks) -> None:
    judged = self.judge(step)
    if judged is not None:
      peaks.ask(judged[0])

  def _fits(self, step: int, budgets: Budgets, peaks: Peaks) -> bool:
    """Whether step ``step``'s compiled peak (``_peak``) fits the device; its row, with that
    peak, kept in ``_compiled``."""
    self._compiled[step] = dataclasses.replace(self.judge(step)[1],
                                               device_bytes=self._peak(step, peaks))
    return budgets.fits_device(self._compiled[step])

  def _peak(self, step: int, peaks: Peaks) -> int:
    """Step ``step``'s compiled device peak, with the moved activations' originals that the
    link leaves on the device."""
    return max(peaks.get(self.judge(step)[0])) + self._moved_bytes(step)

  def _moved_bytes(self, step: int) -> int:
    """With a calibration, the moved activations' originals of step ``step`` that the link
    leaves on the device (``step_time.moved_copies``)."""
    moved = self.calibration and moved_copies(self.judge(step)[0], self.calibration,
                                              self.machine)
    return moved.held_bytes if moved else 0

  def resident_bytes(self, step: int) -> int:
    """The device bytes step ``step``'s parameters and optimizer state hold between steps."""
    if step not in self._resident:
      self._resident[step] = resident_device_bytes(Trainer.from_shapes(self.judge(step)[0]))
    return self._resident[step]


def _offloaded_layers(model: ModelConfig) -> tuple[int, int]:
  """How many of ``model``'s layers send their activations, and their weights, to the host."""
  layers = model.cpu_offloading_num_layers if model.cpu_offloading else 0
  return (layers if model.cpu_offloading_activations else 0,
          layers if model.cpu_offloading_weights else 0)


def _without_offload(model: ModelConfig) -> ModelConfig:
  """``model`` with no activation or weights offload, its offload keys at their defaults."""
  default = ModelConfig()
  return dataclasses.replace(model, **{key: getattr(default, key) for key in (
      "cpu_offloading", "cpu_offloading_num_layers", "cpu_offloading_activations",
      "cpu_offloading_weights", "cpu_offloading_double_buffering", "cpu_offloading_policy")})


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
