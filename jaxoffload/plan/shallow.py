"""A deep model's step peak predicted from compiles of shallow versions of it.

What a step holds on the device beyond its resident state (activations, gradients and their
sums, temporaries) grows a layer at a time: compiled at two shallow depths (``SHALLOW``),
each phase of the step (a program per layer holds the larger of what the layers' programs
and the update need) is drawn to the model's depth by a line. An offload by XLA of fewer
layers than all but the last lies between the lines of the same model with none and with
all but the last offloaded, in proportion to its offloaded layers (each holds what it holds
in place of a saved layer's): the shallow versions of the settings that save everything and
that offload most, compiled once for all of them (``compiling.Peaks`` keys a compile by its
config). ``ladder.Ladder.transient_bytes`` predicts its most offload's peak so.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from jaxoffload.plan.compiling import Peaks
from jaxoffload.train.config import Config, ConfigError, ModelConfig
from jaxoffload.train.loading import override
from jaxoffload.train.resolve import resolve
from jaxoffload.train.setup import Setup
from jaxoffload.train.step import Trainer, resident_device_bytes

# The depths compiled: deep enough that XLA's offload copies reach the schedule they keep in
# deeper models.
SHALLOW = (4, 6)
# The least depth predicted from ``SHALLOW``: the search compiles a model whole where it
# predicts a fit anyway, so the shallow compiles pay where they are well under one whole one.
DEEP = 2 * sum(SHALLOW)

Pair = tuple[Setup, Setup]


def versions(config: Config, overrides: Sequence[str], model: ModelConfig) -> list[Pair]:
  """The versions at ``SHALLOW``'s depths of ``config`` changed by ``overrides`` (into
  ``model``) that its lines are drawn through: one pair, or two for a partial offload by
  XLA; none where the model is shallower than ``DEEP`` or the rules refuse a version
  (compile it whole)."""
  layers = model.num_layers
  offloaded = model.cpu_offloading_num_layers if model.cpu_offloading else 0
  if layers < DEEP:
    return []
  if 0 < offloaded < layers - 1 and not model.cpu_offloading_double_buffering:
    counts = [lambda depth: 0, lambda depth: depth - 1]
  elif offloaded == layers - 1:
    counts = [lambda depth: depth - 1]
  else:  # Moved by the trainer, or none: as many in proportion.
    counts = [lambda depth: offloaded and max(1, round(offloaded * depth / layers))]
  lines = [tuple(_version(config, overrides, depth, count(depth)) for depth in SHALLOW)
           for count in counts]
  return [] if any(None in pair for pair in lines) else lines


def _version(config: Config, overrides: Sequence[str], depth: int,
             offloaded: int) -> Optional[Setup]:
  """``config`` changed by ``overrides`` with ``depth`` layers, ``offloaded`` of them
  offloaded; None where the rules refuse it. Without offload, its offload keys are their
  defaults: every such version of a model is one config, compiled once."""
  try:
    small = override(config, list(overrides) + [
        f"model.num_layers={depth}", f"model.cpu_offloading_num_layers={offloaded}"]
        + ([] if offloaded else ["model.cpu_offloading=False"]))
    if not offloaded:
      small = dataclasses.replace(small, model=without_offload(small.model))
    return resolve(small, with_data=False)
  except ConfigError:
    return None


def transient_bytes(lines: list[Pair], model: ModelConfig, peaks: Peaks) -> int:
  """What ``model``'s step holds on the device beyond its resident state: each phase drawn
  from ``lines`` (``versions``) to its depth, the largest."""
  for pair in lines:
    for small in pair:
      peaks.ask(small)
  drawn = [_drawn(pair, model.num_layers, peaks) for pair in lines]
  if len(drawn) == 2:  # Between none and all but the last layer offloaded.
    share = model.cpu_offloading_num_layers / (model.num_layers - 1)
    drawn = [[none + (most - none) * share for none, most in zip(*drawn)]]
  return round(max(drawn[0]))


def _drawn(pair: Pair, layers: int, peaks: Peaks) -> list[float]:
  """Each phase's bytes beyond the resident state, drawn from ``pair``'s depths to
  ``layers``."""
  one, two = ([peak - resident_device_bytes(Trainer.from_shapes(small))
               for peak in peaks.get(small)] for small in pair)
  steps = (layers - SHALLOW[0]) / (SHALLOW[1] - SHALLOW[0])
  return [a + (b - a) * steps for a, b in zip(one, two)]


def offloaded_layers(model: ModelConfig) -> tuple[int, int]:
  """How many of ``model``'s layers send their activations, and their weights, to the host."""
  layers = model.cpu_offloading_num_layers if model.cpu_offloading else 0
  return (layers if model.cpu_offloading_activations else 0,
          layers if model.cpu_offloading_weights else 0)


def without_offload(model: ModelConfig) -> ModelConfig:
  """``model`` with no activation or weights offload, its offload keys at their defaults."""
  default = ModelConfig()
  return dataclasses.replace(model, **{key: getattr(default, key) for key in (
      "cpu_offloading", "cpu_offloading_num_layers", "cpu_offloading_activations",
      "cpu_offloading_weights", "cpu_offloading_double_buffering", "cpu_offloading_policy")})
