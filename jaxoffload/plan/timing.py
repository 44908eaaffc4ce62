"""The calibration a step-time prediction (``jaxoffload.plan.step_time``) is made from.

``calibrate`` times, on this device, the forward and backward pass of small versions of
the model at the config's micro-batch size: with every layer saved, at 1 and 2 layers (one
layer's time is their difference, the rest of the first the fixed part); each other
activation setting once, at 1 layer (an offloaded one with a saved layer after it), its
layer's time being what that adds to the fixed part (and the saved layer), but for layers
whose activations the trainer moves, priced from the saved layer (``step_time``); the 2-layer
model again at half the size (what part of the time does not shrink with it); and a large
device copy (the bandwidth the device's AdamW is priced at). The timed parameters are
filled with a constant, not initialised: their values do not change the time, and
initialising them would compile a program per timing.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxoffload.host.pricing import CPU_PROBE_DIVISOR, best_seconds
from jaxoffload.memory import available, parse_bytes
from jaxoffload.nn.sharding import batch_sharding
from jaxoffload.plan.compiling import workers
from jaxoffload.plan.step_time import REST_MODES, Calibration, timed_modes
from jaxoffload.train import host_memory
from jaxoffload.train.config import Config, ConfigError
from jaxoffload.train.grads import loss_and_grads
from jaxoffload.train.loading import override
from jaxoffload.train.resolve import resolve
from jaxoffload.train.setup import Setup
from jaxoffload.train.weights import targets

_COPY_BYTES = 256 * 2**20
# A typical initial weight's size: the timed parameters' every element.
_FILL = 0.02


def calibrate(configs: list[Config], *, log: Callable[[str], None] = print) -> Calibration:
  """Times the forward and backward pass of small versions of ``configs``' model (each
  activation setting they use, once) and a device copy.

  Args:
    configs: the settings to calibrate, sharing the model's shape and micro-batch size;
      the first names both.
    log: where the line of what was measured goes.

  Returns:
    The ``Calibration``: the saved layers' time from two depths, every other setting's
    from one depth less the fixed part (and, offloaded, the saved layer after it).

  Raises:
    ConfigError: on a CPU, where a timed model would not fit the host's free memory.
  """
  base = configs[0]
  size = base.train.micro_batch_size
  programs = {"save 1": (base, _rest_layers("save", 1)), "save 2": (base, _rest_layers("save", 2))}
  for config in configs:
    for mode in timed_modes(config):
      if mode != "save" and mode not in programs:
        rest = mode in REST_MODES.values()
        programs[mode] = (config, _rest_layers(mode, 1) if rest else _OFFLOADED_LAYER)
  if size > 1:  # Time = a + b x size, from the two-layer model at half the size.
    programs["half"] = (base, _rest_layers("save", 2) + [f"train.micro_batch_size={size // 2}"])
  seconds = dict(zip(programs, _fwd_bwd_seconds(list(programs.values()))))
  save_one, save_two = seconds.pop("save 1"), seconds.pop("save 2")
  layer_s = {"save": max(save_two - save_one, 0.0)}
  fixed_s = max(save_one - layer_s["save"], 0.0)
  half = seconds.pop("half", None)
  for mode, one in seconds.items():
    offloaded = mode not in REST_MODES.values()
    layer_s[mode] = max(one - fixed_s - (layer_s["save"] if offloaded else 0.0), 0.0)
  overhead = 0.0
  if half is not None and save_two > 0:
    overhead = min(max((2 * half - save_two) / save_two, 0.0), 1.0)
  log(f"calibrated a micro-batch of {size}: "
      + ", ".join(f"{mode} {s * 1e3:,.1f} ms a layer" for mode, s in layer_s.items())
      + f", {fixed_s * 1e3:,.1f} ms outside the layers; {overhead:.0%} of it does not shrink "
      f"with the micro-batch")
  return Calibration(size, fixed_s, layer_s, overhead, _device_bandwidth())


def _rest_layers(mode: str, n: int) -> list[str]:
  """Overrides for a model of ``n`` layers, all in ``mode`` (a value of ``REST_MODES``)."""
  granularity = next(g for g, m in REST_MODES.items() if m == mode)
  return [f"model.num_layers={n}", "model.cpu_offloading=False",
          "model.cpu_offloading_num_layers=0",
          f"model.recompute_granularity={granularity or 'null'}"]


# One layer offloaded as the config says, and a saved layer after it (Megatron's rule: at
# most num_layers - 1 offloaded).
_OFFLOADED_LAYER = ["model.num_layers=2", "model.cpu_offloading_num_layers=1",
                    "model.recompute_granularity=null"]


def _fwd_bwd_seconds(programs: list[tuple[Config, list[str]]]) -> list[float]:
  """The best seconds of a jitted forward and backward pass of each config changed by its
  overrides, on one micro-batch of synthetic tokens, its weights in device memory (the
  optimizer's offload is priced apart; the host kernel's weights would be in host memory,
  which the plain model does not read).

  The first program compiles alone, autotuning the kernels the others share (XLA keeps what
  it picked for the process); the others then compile ``compiling.workers()`` at a time. Each
  is timed alone, the shallower first, each reading the arrays of the parameters its
  predecessor read alike.

  Raises:
    ConfigError: on a CPU, before any program runs, where one would not fit the host's
      free memory (``_refuse_beyond_host``).
  """
  setups = [_small_setup(config, overrides) for config, overrides in programs]
  first = _compiled(setups[0])
  with ThreadPoolExecutor(workers()) as pool:
    steps = [first] + list(pool.map(_compiled, setups[1:]))
  for step, setup in zip(steps, setups):
    _refuse_beyond_host(step, setup)
  seconds, filled = {}, {}
  for n in sorted(range(len(setups)), key=lambda n: setups[n].config.model.num_layers):
    step, setup = steps[n], setups[n]
    (params, tokens), filled = _inputs(setup, filled)
    seconds[n] = best_seconds(lambda: jax.block_until_ready(step(params, tokens)))
  return [seconds[n] for n in range(len(setups))]


def _small_setup(config: Config, overrides: list[str]) -> Setup:
  """What ``config`` changed by ``overrides`` runs: without optimizer offload, one micro-batch
  a step, and no data (``_inputs`` makes its tokens)."""
  small = override(config, overrides + [
      "optimizer.optimizer_cpu_offload=False", "optimizer.optimizer_offload_fraction=0.0"])
  return resolve(override(small, [f"train.global_batch_size={small.train.micro_batch_size}"]),
                 with_data=False)


def _compiled(setup: Setup) -> jax.stages.Compiled:
  """``setup``'s forward and backward pass, compiled from shapes alone."""
  return jax.jit(lambda p, x: loss_and_grads(setup.llama, p, x)).lower(
      targets(setup.param_shapes, setup.param_shardings), setup.batch_shape).compile()


def _refuse_beyond_host(compiled: jax.stages.Compiled, setup: Setup) -> None:
  """Refuses, on a CPU, a timed program that needs more memory than the host has free beside
  the JAX runtime's own (``host_memory.RUNTIME_BYTES``): there the devices' memory is the
  host's, and the kernel would kill the process.

  Raises:
    ConfigError: naming the program's size, the host's free memory and what to do instead.
  """
  devices = setup.mesh.devices.flat
  if devices[0].platform != "cpu":
    return
  analysis = compiled.memory_analysis()
  need = len(devices) * (analysis.argument_size_in_bytes + analysis.output_size_in_bytes
                         + analysis.temp_size_in_bytes - analysis.alias_size_in_bytes)
  free, where = available(None if setup.config.train.host_memory_limit is None
                          else parse_bytes(setup.config.train.host_memory_limit))
  if need + host_memory.RUNTIME_BYTES > free:
    c = setup.config
    raise ConfigError(
        f"the planner's calibration, a {c.model.num_layers}-layer model at micro-batch "
        f"{c.train.micro_batch_size}, needs {host_memory.size(need)} on this CPU beside the "
        f"JAX runtime's {host_memory.size(host_memory.RUNTIME_BYTES)}, more than the "
        f"{host_memory.size(max(free, 0))} {where}: plan on the accelerator the run trains on, "
        f"or with --offload-only (no calibration)")


def _inputs(setup: Setup, filled: dict) -> tuple[tuple[Any, jax.Array], dict]:
  """``setup``'s parameters, every element ``_FILL``, and a micro-batch of tokens counting up,
  placed as its run places them; and its parameters by shape, dtype and sharding. Built on
  the host: their values do not change the time, and initialising or drawing them would
  compile programs of their own. A parameter found in ``filled`` (the last program's) is
  read again, not filled anew."""
  read = {}

  def parameter(x: jax.ShapeDtypeStruct, sharding: jax.sharding.Sharding) -> jax.Array:
    key = (x.shape, x.dtype, sharding)
    if key not in read:
      read[key] = filled[key] if key in filled else _placed(
          np.broadcast_to(np.asarray(_FILL, x.dtype), x.shape), sharding)
    return read[key]

  params = jax.tree.map(parameter, setup.param_shapes, setup.param_shardings)
  m, size = setup.config.model, setup.config.train.micro_batch_size
  tokens = np.arange(size * m.seq_length, dtype=np.int32).reshape(size, -1) % m.vocab_size
  return (params, _placed(tokens, batch_sharding(setup.mesh))), read


def _placed(values: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
  return jax.make_array_from_callback(values.shape, sharding, lambda index: values[index])


def _device_bandwidth() -> float:
  """Bytes per second the first device reads and writes in a large copy (smaller on a CPU,
  as ``pricing``'s probes are)."""
  device = jax.devices()[0]
  copy_bytes = _COPY_BYTES // (CPU_PROBE_DIVISOR if device.platform == "cpu" else 1)
  x = jnp.ones(copy_bytes // 4, jnp.float32, device=device)
  copy = jax.jit(lambda x: x + 1)
  return 2 * copy_bytes / best_seconds(lambda: jax.block_until_ready(copy(x)))
