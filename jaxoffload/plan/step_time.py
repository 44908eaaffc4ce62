"""How long a step of a setting takes on this machine, predicted before anything is allocated.

A step is predicted to take the sum of:

- the device's forward and backward passes: per micro-batch, a fixed part
  (embedding, head, loss) and each layer's time under its activation setting
  (saved, recomputed in part or in full, offloaded, weights offloaded), as a
  ``Calibration`` of this machine measured them (the planner's
  ``jaxoffload.plan.timing.calibrate`` times 1- and 2-layer versions of the model
  at the config's micro-batch size), and scaled to another micro-batch size by a
  line through a second timing at half the size (a part of the time does not
  shrink with it);
- where the trainer moves the offloaded layers' activations
  (``model.cpu_offloading_double_buffering``), each such layer costs a saved
  layer's time plus what the device waits for copies back (``moved_copies``
  follows ``train.per_layer.moved``'s copies through a micro-batch at this machine's link
  rates, a layer's forward pass taken as a third of its time, its backward pass
  two thirds); with their weights in pinned_host, each program waits for its layer,
  sent on the same link a program ahead;
- with weights in pinned_host, the device optimizer's update bringing its leaves
  of them over and back whole, unless the backward pass updates them a layer at a time
  (``offloaded_group_bytes``);
- the device's AdamW on the leaves it keeps: their bytes over the device's
  copy bandwidth, measured alongside;
- what optimizer offload adds: ``pricing``'s prices from this machine's
  link and host-kernel rates (copies and host work that nothing hides);
- with the host kernel summing micro-batches: each further micro-batch's
  copies, and the last sum, which the update waits for.

Without a calibration (the trainer's ``optimizer_offload_fraction=auto``, which keeps
the config's compute), only what offload adds is predicted.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax

from jaxoffload.host import pricing
from jaxoffload.memory import offloaded_activation_bytes
from jaxoffload.train import implied
from jaxoffload.train.config import Config
from jaxoffload.train.offload_choice import price_updates
from jaxoffload.train.per_layer.moved import PROGRAMS_AHEAD
from jaxoffload.train.per_layer.offloaded_layers import offloaded_group_bytes
from jaxoffload.train.setup import Setup

# Bytes the device's AdamW reads and writes per element: the weight, the gradient
# and both moments read, the weight and moments written (float32).
_ADAM_BYTES_PER_ELEMENT = 28
# The settings of the layers activation offload leaves alone, by their recompute_granularity.
REST_MODES = {None: "save", "selective": "selective", "full": "recompute"}


@dataclasses.dataclass(frozen=True)
class Calibration:
  """What the device's compute costs on this machine, at one micro-batch size.

  Attributes:
    micro_batch_size: the sequences each timing ran on.
    fixed_s: a forward and backward pass's time outside the layers.
    layer_s: one layer's forward and backward time, by ``timed_modes``' names.
    overhead: the share of a micro-batch's time that does not shrink with it,
      from a second timing at half the size (0 where the size is 1).
    device_bandwidth: bytes per second a device-to-device copy reads and writes.
  """

  micro_batch_size: int
  fixed_s: float
  layer_s: dict[str, float]
  overhead: float
  device_bandwidth: float

  def scale(self, micro_batch_size: int) -> float:
    """A micro-batch of ``micro_batch_size``'s time over the calibrated one's."""
    return (1 - self.overhead) * micro_batch_size / self.micro_batch_size + self.overhead


def layer_modes(config: Config) -> dict[str, int]:
  """How many of ``config``'s layers run in each activation setting, by its name (those
  ``timed_modes`` leaves out are priced from the saved layer's time and the link's)."""
  m = config.model
  offloaded = m.cpu_offloading_num_layers if m.cpu_offloading else 0
  modes = {_rest_mode(config): m.num_layers - offloaded}
  if offloaded:
    modes[_offload_mode(config)] = offloaded
  return modes


def _rest_mode(config: Config) -> str:
  """The setting of the layers activation offload leaves alone."""
  return REST_MODES[config.model.recompute_granularity]


def timed_modes(config: Config) -> list[str]:
  """The activation settings of ``config``'s layers that a calibration times: all but the
  layers whose activations the trainer moves (their compute is a saved layer's)."""
  return [mode for mode in layer_modes(config) if mode != _moved_mode(config)]


def _offload_mode(config: Config) -> str:
  """The setting of the first ``cpu_offloading_num_layers`` layers, by name."""
  m = config.model
  parts = [f"offload {m.cpu_offloading_policy}" if m.cpu_offloading_activations else "recompute"]
  if m.cpu_offloading_weights:
    parts.append("weights")
  if implied.moves_activations(config):
    parts.append("moved by the trainer")
  return " + ".join(parts)


def _moved_mode(config: Config) -> Optional[str]:
  """The offloaded layers' setting where the trainer moves their activations, else None."""
  moved = implied.moves_activations(config) and config.model.cpu_offloading_num_layers > 0
  return _offload_mode(config) if moved else None


@dataclasses.dataclass(frozen=True)
class MovedCopies:
  """What moving the offloaded layers' activations costs a micro-batch (``train.per_layer.moved``).

  Attributes:
    wait_s: the seconds the device waits for the moved layers' copies back and, with their
      weights in pinned_host, for their weights.
    held_bytes: one device's bytes of originals still held as the backward pass reaches
      the moved layers (their copies out not ended, or chosen to be read in place), beyond
      the two layers' that a compiled step counts (``train.per_layer.footprint``).
  """

  wait_s: float
  held_bytes: int


def moved_copies(setup: Setup, calibration: Calibration, machine: pricing.Machine
                 ) -> Optional[MovedCopies]:
  """``train.per_layer.moved``'s copies through one micro-batch of ``setup``, followed in time: the
  copies out start as each moved layer's forward pass ends, one after another on the link;
  going backward, each layer's is chosen as Python dispatches the layer above's backward
  program, ``moved.PROGRAMS_AHEAD`` programs ahead of the device: its original if its
  copy has not ended, else the copy back, which starts then, one after another on the
  link, and which its backward pass waits for. With the layers' weights in pinned_host,
  each program waits for its layer, sent on the link to the device as Python dispatches
  the program before. None where the trainer moves nothing."""
  if _moved_mode(setup.config) is None:
    return None
  t, m = setup.config.train, setup.config.model
  layers = m.cpu_offloading_num_layers
  each = offloaded_activation_bytes(setup.model, setup.groups, t.micro_batch_size,
                                    m.seq_length) / layers / setup.mesh.size
  sent = offloaded_group_bytes(setup)[0] / machine.host_to_device
  scale = calibration.scale(t.micro_batch_size)
  layer_s = scale * calibration.layer_s["save"]
  forward, backward = layer_s / 3, 2 * layer_s / 3
  # Forward: layer i's weights start over as program i - 1 - PROGRAMS_AHEAD starts.
  starts, ended, up, down, now = [], [], 0.0, 0.0, 0.0
  for layer in range(layers):
    up = max(starts[layer - 1 - PROGRAMS_AHEAD] if layer > PROGRAMS_AHEAD else 0.0, up) + sent
    starts.append(max(now, up))
    now = starts[-1] + forward
    down = max(now, down) + each / machine.device_to_host
    ended.append(down)
  # The rest of the model's compute runs between the moved layers' forward and backward passes.
  turn = now + scale * calibration.fixed_s + sum(
      n * scale * calibration.layer_s[mode] for mode, n in layer_modes(setup.config).items()
      if mode != _moved_mode(setup.config))
  # When each layer's backward pass starts; those above the moved ones (the head's taken as
  # a saved layer's) end at the turn.
  back = {layers + k: turn - (k + 1) * backward for k in range(PROGRAMS_AHEAD + 1)}
  now, in_place = turn, set()
  for layer in reversed(range(layers)):
    chosen = ready = back[layer + 1 + PROGRAMS_AHEAD]
    if ended[layer] > chosen:  # Its original, its copy out not ended.
      in_place.add(layer)
    else:
      up = ready = max(chosen, up) + each / machine.host_to_device
    if sent:  # Its weights, after its activations.
      up = ready = max(chosen, up) + sent
    back[layer] = max(now, ready)
    now = back[layer] + backward
  held = sum(end > turn or layer in in_place for layer, end in enumerate(ended))
  waited = now - turn + starts[-1] + forward - layers * layer_s
  return MovedCopies(waited, int(each * max(held - 2, 0)))


def predict_s(setup: Setup, calibration: Optional[Calibration], machine: pricing.Machine
              ) -> float:
  """The predicted seconds of a step of ``setup`` (see the module's docstring); without a
  calibration, only what offload adds to the device's own compute."""
  config = setup.config
  elements = [x.size for x in jax.tree.leaves(setup.param_shapes)]
  offloaded = setup.offload.offloaded if setup.offload else (False,) * len(elements)
  total = 0.0
  if calibration is not None:
    scale = calibration.scale(config.train.micro_batch_size)
    moved = _moved_mode(config)
    layer_s = lambda mode: calibration.layer_s["save" if mode == moved else mode]
    compute = calibration.fixed_s + sum(n * layer_s(mode)
                                        for mode, n in layer_modes(config).items())
    copies = 0.0 if moved is None else moved_copies(setup, calibration, machine).wait_s
    # The device optimizer's update brings its leaves of weights in pinned_host over and back.
    updated = offloaded_group_bytes(setup)[1]
    total += updated / machine.host_to_device + updated / machine.device_to_host
    on_device = sum(n for n, off in zip(elements, offloaded) if not (off and setup.host_kernel))
    total += (setup.micro_batches * (scale * compute + copies)
              + on_device * _ADAM_BYTES_PER_ELEMENT / calibration.device_bandwidth)
  if setup.offload is not None:
    place = config.optimizer.optimizer_offload_update_on
    total += price_updates(config, setup.implied, setup.offload, machine,
                           host_kernel=place == "host_kernel").predicted_s[place]
  if setup.sums_on_host and machine.sum_rate:
    host = sum(n for n, off in zip(elements, offloaded) if off)
    wire = lambda dtypes: sum(n * d.itemsize for n, d in zip(
        [n for n, off in zip(elements, offloaded) if off], dtypes))
    each = (wire(setup.weight_transfer_dtypes) / machine.host_to_device
            + wire(setup.transfer_dtypes) / machine.device_to_host)
    total += (setup.micro_batches - 1) * each + host / machine.sum_rate
  return total
