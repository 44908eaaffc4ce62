"""The device memory a step cannot do without, and the guards that refuse a step no device
here can hold: by arithmetic before anything compiles (``check``), and by XLA's memory
analysis of the compiled step before the first step runs (``check_compiled``).

``floor`` is a lower bound, not an estimate: what one device holds of the parameters and
optimizer state between steps, and its share of the largest array one micro-batch makes
whole: its float32 logits, which the loss reads at once, or a layer's attention scores
where the attention implementation writes them out (``xla``). A run above it cannot fit,
whatever XLA does with the rest; one below it may still not (XLA's temporaries, the other
activations).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from jaxoffload.memory import available, parse_bytes, size
from jaxoffload.train import advice, levers
from jaxoffload.train.config import Config, ConfigError
from jaxoffload.train.setup import Setup
from jaxoffload.train.step import Trainer, resident_device_bytes


@dataclasses.dataclass(frozen=True)
class Floor:
  """What one device must hold at least during a step.

  Attributes:
    state: its parameters and optimizer state in device memory.
    activation: its share of the largest array one micro-batch makes whole.
    activation_name: what that array is.
  """

  state: int
  activation: int
  activation_name: str

  @property
  def total(self) -> int:
    return self.state + self.activation


def floor(setup: Setup) -> Floor:
  """The least one device holds at ``setup``'s step, reckoned from shapes."""
  m, t = setup.model, setup.config.train
  arrays = {"float32 logits": t.micro_batch_size * m.seq_length * m.vocab_size * 4}
  if m.attention == "xla":
    arrays["attention scores"] = (t.micro_batch_size * m.num_attention_heads * m.seq_length**2
                                  * jnp.dtype(m.dtype).itemsize)
  name = max(arrays, key=arrays.get)
  # However the mesh splits it, some device holds at least its even share.
  return Floor(resident_device_bytes(Trainer.from_shapes(setup)),
               arrays[name] // setup.mesh.size, name)


def capacity(config: Config) -> tuple[int, str]:
  """The bytes each local device may use, and where that figure comes from:
  ``train.device_memory_limit`` where it is below the device's own; the GPU's allocator
  limit; or on a CPU the host memory its devices share, split among them."""
  device = jax.local_devices()[0]
  limit = (device.memory_stats() or {}).get("bytes_limit")
  asked = config.train.device_memory_limit
  if asked is not None and (limit is None or parse_bytes(asked) < limit):
    return parse_bytes(asked), f"train.device_memory_limit={asked}"
  if limit is not None:
    return limit, f"{device.device_kind}'s allocator limit"
  have, source = available(None)
  devices = jax.local_device_count()
  return have // devices, source + (f", shared by {devices} devices" if devices > 1 else "")


def check(setup: Setup, have: Optional[tuple[int, str]] = None) -> Floor:
  """What ``floor`` says, once one device can hold it.

  Args:
    setup: the run.
    have: the bytes each device may use and where that figure comes from; default
      ``capacity``'s.

  Raises:
    ConfigError: one line with the floor's parts, the device's bytes and the keys that
      lower the larger part.
  """
  need = floor(setup)
  limit, source = have or capacity(setup.config)
  if need.total <= limit:
    return need
  t = setup.config.train
  if need.activation >= need.state:
    keys = (["train.micro_batch_size"] if t.micro_batch_size > 1 else []) + [
        "model.seq_length", "more devices (mesh.data, mesh.fsdp)"]
    if need.activation_name == "attention scores" and jax.default_backend() == "gpu":
      keys.insert(0, "model.attention_implementation=cudnn (which writes no scores out)")
  else:
    keys = advice.device_memory_levers(setup.config) + ["more devices (mesh.fsdp)"]
  raise ConfigError(
      f"device memory: one device needs at least {size(need.total)} for this step (its "
      f"parameters and optimizer state {size(need.state)}, its share of one micro-batch's "
      f"{need.activation_name} {size(need.activation)}) but has {size(limit)} ({source}); "
      f"lower it with {', '.join(keys)}")


def check_compiled(setup: Setup, peak: int, have: Optional[tuple[int, str]] = None) -> None:
  """Refuses a step whose compiled device peak one device cannot hold, before it runs.

  Args:
    setup: the run.
    peak: XLA's device peak of its compiled programs: the step's (``CompiledStep.device_bytes``)
      and the evaluation's (``Trainer.compile_evaluation``).
    have: the bytes each device may use and where that figure comes from; default
      ``capacity``'s.

  Raises:
    ConfigError: one line with the peak, the device's bytes and the settings under which
      the step, compiled again, fits (``levers.fitting_device_levers``), the lowest peak
      first.
  """
  limit, source = have or capacity(setup.config)
  if peak <= limit:
    return
  fitting = levers.fitting_device_levers(setup, advice.device_memory_levers(setup.config),
                                         limit)
  remedy = (f"it fits with {'; or '.join(fitting)}" if fitting else
            "no one setting fits: combine them (python -m jaxoffload.plan finds one), or use "
            "more devices (mesh.fsdp)")
  raise ConfigError(f"device memory: the compiled step needs {size(peak)} on one device "
                    f"(XLA's memory analysis) but it has {size(limit)} ({source}); {remedy}")
