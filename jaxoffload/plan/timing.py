"""How long a step of a setting takes on this machine, predicted from a short calibration.

A step is predicted to take the sum of:

- the device's forward and backward passes: per micro-batch, a fixed part
  (embedding, head, loss) and each layer's time under its activation setting
  (saved, recomputed in part or in full, offloaded, weights offloaded), measured
  here on 1- to 3-layer versions of the model at the config's micro-batch size
  (``calibrate``), and scaled to another micro-batch size by a line through a
  second timing at half the size (a part of the time does not shrink with it);
- the device's AdamW on the leaves it keeps: their bytes over the device's
  copy bandwidth, measured alongside;
- what optimizer offload adds: ``autoplace``'s prices from this machine's
  link and host-kernel rates (copies and host work that nothing hides);
- with the host kernel summing micro-batches: each further micro-batch's
  copies, and the last sum, which the update waits for.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from jaxoffload import autoplace
from jaxoffload.params import init_params
from jaxoffload.train import resolve
from jaxoffload.train.config import Config
from jaxoffload.train.loading import override
from jaxoffload.train.grads import loss_and_grads
from jaxoffload.train.resolve import Setup
from jaxoffload.train.update_place import price_updates

_REPEATS = 3
_COPY_BYTES = 256 * 2**20
# Bytes the device's AdamW reads and writes per element: the weight, the gradient
# and both moments read, the weight and moments written (float32).
_ADAM_BYTES_PER_ELEMENT = 28


@dataclasses.dataclass(frozen=True)
class Calibration:
  """What the device's compute costs on this machine, at one micro-batch size.

  Attributes:
    micro_batch_size: the sequences each timing ran on.
    fixed_s: a forward and backward pass's time outside the layers.
    layer_s: one layer's forward and backward time, by ``layer_modes``' names.
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
  """How many of ``config``'s layers run in each activation setting, by its name."""
  m = config.model
  offloaded = m.cpu_offloading_num_layers if m.cpu_offloading else 0
  modes = {_rest_mode(config): m.num_layers - offloaded}
  if offloaded:
    modes[_offload_mode(config)] = offloaded
  return modes


# The settings of the layers activation offload leaves alone, by their recompute_granularity.
_REST_MODES = {None: "save", "selective": "selective", "full": "recompute"}


def _rest_mode(config: Config) -> str:
  """The setting of the layers activation offload leaves alone."""
  return _REST_MODES[config.model.recompute_granularity]


def _offload_mode(config: Config) -> str:
  """The setting of the first ``cpu_offloading_num_layers`` layers, by name."""
  m = config.model
  parts = [f"offload {m.cpu_offloading_policy}" if m.cpu_offloading_activations else "recompute"]
  if m.cpu_offloading_weights:
    parts.append("weights")
  return " + ".join(parts)


def calibrate(configs: list[Config], *, log: Callable[[str], None] = print) -> Calibration:
  """Times the forward and backward pass of small versions of ``configs``' model (each
  activation setting they use, once) and a device copy.

  The configs share the model's shape and micro-batch size; the first names both.
  """
  base = configs[0]
  save_one, save_two = (_fwd_bwd_s(base, _rest_layers("save", n)) for n in (1, 2))
  layer_s = {"save": max(save_two - save_one, 0.0)}
  fixed_s = max(save_one - layer_s["save"], 0.0)
  for config in configs:
    for mode in layer_modes(config):
      if mode not in layer_s:
        layers = ((lambda n: _rest_layers(mode, n)) if mode in _REST_MODES.values()
                  else _offloaded_layers)
        one, two = (_fwd_bwd_s(config, layers(n)) for n in (1, 2))
        layer_s[mode] = max(two - one, 0.0)
  size = base.train.micro_batch_size
  overhead = 0.0
  if size > 1:  # Time = a + b x size, from the two-layer model at half the size.
    half = _fwd_bwd_s(base, _rest_layers("save", 2) + [f"train.micro_batch_size={size // 2}"])
    overhead = min(max((2 * half - save_two) / save_two, 0.0), 1.0) if save_two > 0 else 0.0
  log(f"calibrated a micro-batch of {size}: "
      + ", ".join(f"{mode} {s * 1e3:,.1f} ms a layer" for mode, s in layer_s.items())
      + f", {fixed_s * 1e3:,.1f} ms outside the layers; {overhead:.0%} of it does not shrink "
      f"with the micro-batch")
  return Calibration(size, fixed_s, layer_s, overhead, _device_bandwidth())


def predict_s(setup: Setup, calibration: Optional[Calibration], machine: autoplace.Machine
              ) -> float:
  """The predicted seconds of a step of ``setup`` (see the module's docstring); without a
  calibration, only what offload adds to the device's own compute."""
  config = setup.config
  elements = [x.size for x in jax.tree.leaves(setup.param_shapes)]
  offloaded = setup.offload.offloaded if setup.offload else (False,) * len(elements)
  total = 0.0
  if calibration is not None:
    scale = calibration.scale(config.train.micro_batch_size)
    compute = calibration.fixed_s + sum(n * calibration.layer_s[mode]
                                        for mode, n in layer_modes(config).items())
    on_device = sum(n for n, off in zip(elements, offloaded) if not (off and setup.host_kernel))
    total = (setup.micro_batches * scale * compute
             + on_device * _ADAM_BYTES_PER_ELEMENT / calibration.device_bandwidth)
  if setup.offload is not None:
    place = config.optimizer.optimizer_offload_update_on
    total += price_updates(config, setup.offload, machine,
                           host_kernel=place == "host_kernel").predicted_s[place]
  if setup.sums_on_host and machine.sum_rate:
    host = sum(n for n, off in zip(elements, offloaded) if off)
    wire = lambda dtypes: sum(n * d.itemsize for n, d in zip(
        [n for n, off in zip(elements, offloaded) if off], dtypes))
    each = (wire(setup.weight_transfer_dtypes) / machine.host_to_device
            + wire(setup.transfer_dtypes) / machine.device_to_host)
    total += (setup.micro_batches - 1) * each + host / machine.sum_rate
  return total


def _rest_layers(mode: str, n: int) -> list[str]:
  """Overrides for a model of ``n`` layers, all in ``mode`` (a value of ``_REST_MODES``)."""
  granularity = next(g for g, m in _REST_MODES.items() if m == mode)
  return [f"model.num_layers={n}", "model.cpu_offloading=False",
          "model.cpu_offloading_num_layers=0", f"model.recompute_granularity={granularity or 'null'}"]


def _offloaded_layers(n: int) -> list[str]:
  """Overrides for ``n`` layers offloaded as the config says, and one saved layer after them
  (Megatron's rule: at most num_layers - 1 offloaded)."""
  return [f"model.num_layers={n + 1}", f"model.cpu_offloading_num_layers={n}",
          "model.recompute_granularity=null"]


def _fwd_bwd_s(config: Config, overrides: list[str]) -> float:
  """The median seconds of a jitted forward and backward pass of ``config`` changed by
  ``overrides``, on one micro-batch of synthetic tokens, its weights in device memory
  (the optimizer's offload is priced apart; the host kernel's weights would be in host
  memory, which the plain model does not read)."""
  small = override(config, overrides + [
      "data.dataset=synthetic", "data.path=null", "data.tokenizer=null", "data.eos_token=null",
      "model.hf_checkpoint=null", "checkpoint.init_from=null",
      "optimizer.optimizer_cpu_offload=False", "optimizer.optimizer_offload_fraction=0.0"])
  small = override(small, [f"train.global_batch_size={small.train.micro_batch_size}"])
  setup = resolve(small)
  tokens = setup.global_batch(0)
  params = init_params(setup.llama, jax.random.PRNGKey(0), tokens[:, :2], setup.param_shardings)
  step = jax.jit(lambda p, x: loss_and_grads(setup.llama, p, x))
  return _median_s(lambda: jax.block_until_ready(step(params, tokens)))


def _device_bandwidth() -> float:
  """Bytes per second the first device reads and writes in a large copy."""
  x = jnp.ones(_COPY_BYTES // 4, jnp.float32, device=jax.devices()[0])
  copy = jax.jit(lambda x: x + 1)
  return 2 * _COPY_BYTES / _median_s(lambda: jax.block_until_ready(copy(x)))


def _median_s(fn: Callable[[], object]) -> float:
  fn()  # Compiles.
  times = []
  for _ in range(_REPEATS):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times)
