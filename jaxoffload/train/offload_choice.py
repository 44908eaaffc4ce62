"""Where a run's offloaded state updates with ``optimizer_offload_update_on=auto`` (the
default), each exact placement priced on this machine (``pricing``) under the device work
the trainer hides it under, and the dtype its transfers take (``offload_transfer_dtype=auto``)."""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from jaxoffload.host import pricing
from jaxoffload.host.kernel_state import moment_bytes
from jaxoffload.optim.offload_plan import OffloadPlan
from jaxoffload.train import metrics
from jaxoffload.train.config import Config
from jaxoffload.train.implied import Implied

# The share of the device's peak a forward pass is priced at, where the host kernel's update
# hides under it: about the MFU of the trainer's own baselines
# (docs/performance.md#optimizer-offload).
_FORWARD_MFU = 0.4


def forward_seconds(config: Config) -> float:
  """About how long one device takes for a step's forward pass of ``config``: its FLOPs at
  ``_FORWARD_MFU`` of the device's peak; 0 where the peak is unknown (CPUs)."""
  peak = metrics.peak_flops(jax.devices()[0], config.model.dtype)
  if not peak:
    return 0.0
  tokens = config.train.global_batch_size * config.model.seq_length / jax.device_count()
  # A third of a training step's FLOPs: the backward pass does twice the forward's work.
  flops = tokens * metrics.flops_per_token(config.model.llama(), config.model.seq_length) / 3
  return flops / (peak * _FORWARD_MFU)


def overlap_seconds(config: Config, derived: Implied) -> float:
  """About how much device time a step of ``config`` (which implies ``derived``) hides the
  host kernel's update under:
  the next forward pass of the first micro-batch where the trainer overlaps them
  (``train.per_layer.overlap``), and unclipped the last micro-batch's backward pass too; 0 where it
  does not overlap."""
  if not derived.host_update_overlaps:
    return 0.0
  # The backward pass does twice the forward's work. Clipped, priced as if every step
  # clipped: a speculated update starts earlier only after a step that did not.
  return (forward_seconds(config) / derived.micro_batches
          * (1 if derived.clips_gradients else 3))


def price_updates(config: Config, derived: Implied, offload: OffloadPlan,
                  machine: pricing.Machine, *, host_kernel: bool) -> pricing.Choice:
  """What each exact update placement adds to a step of ``config`` (which implies
  ``derived``) with ``offload``, on
  ``machine`` (the host kernel priced only where ``host_kernel`` and the config allow it,
  with the transfer dtype it would take, and under the device work the trainer would
  overlap it with, ``overlap_seconds``)."""
  o = config.optimizer
  # Each device copies its own shards; the host kernel updates all of this process's (the
  # mesh's devices are spread evenly over the processes).
  m = config.mesh
  per_device = offload.offloaded_elements // (m.fsdp * m.tensor)
  local_devices = m.data * m.fsdp * m.tensor // jax.process_count()
  wire = jnp.dtype(transfer_dtype(config, "host_kernel")).itemsize
  return pricing.choose(
      machine, offloaded_elements=per_device,
      moment_bytes_per_element=sum(moment_bytes(d) for d in derived.moment_dtypes),
      transfer_bytes_per_element=wire,
      weight_bytes_per_element=(None if o.store_param_remainders
                                else jnp.dtype(config.model.params_dtype).itemsize),
      local_elements=per_device * local_devices,
      host_kernel=host_kernel,
      overlap_s=overlap_seconds(config, derived))


def transfer_dtype(config: Config, place: str) -> str:
  """The dtype the host kernel's weights and gradients cross in, for ``config`` updated on
  ``place``: ``optimizer.offload_transfer_dtype``, or for auto bfloat16 where the host kernel
  updates a model that multiplies in bfloat16 (half the bytes each way), else float32."""
  wire = config.optimizer.offload_transfer_dtype
  if wire != "auto":
    return wire
  return "bfloat16" if place == "host_kernel" and config.model.dtype == "bfloat16" else "float32"


def kernel_formats(config: Config, moments: tuple[str, str]) -> pricing.KernelFormats:
  """How the host kernel would store ``config``'s leaves: gradients as they travel, float32
  masters split where the device reads them in bfloat16 (``store_param_remainders``), and
  the moments in their dtypes (``moments``)."""
  wire = transfer_dtype(config, "host_kernel")
  split = wire == "bfloat16" and config.optimizer.store_param_remainders
  weights = ("bfloat16" if config.model.params_dtype == "bfloat16" else
             "split" if split else "float32")
  return pricing.KernelFormats(wire, weights, *moments)


def with_update_place(config: Config, place: str) -> Config:
  """``config`` updating its offloaded state on ``place``, its transfer dtype decided."""
  return dataclasses.replace(config, optimizer=dataclasses.replace(
      config.optimizer, optimizer_offload_update_on=place,
      offload_transfer_dtype=transfer_dtype(config, place)))


def candidate_places(config: Config, moments: tuple[str, str]) -> tuple[str, ...]:
  """The placements ``config``'s offloaded state (its moments in ``moments``) may update
  on: its own, or for auto the
  host kernel (where numba is installed) and the device's stream, which cannot keep 8-bit
  blocks (rules: the host's XLA computation stands in without numba)."""
  place = config.optimizer.optimizer_offload_update_on
  if place != "auto":
    return (place,)
  kernel = importlib.util.find_spec("numba") is not None
  if "int8" in moments:
    return ("host_kernel" if kernel else "host",)
  return ("device", "host_kernel") if kernel else ("device",)


def resolve_update_place(config: Config, derived: Implied, offload: Optional[OffloadPlan]
                          ) -> tuple[Config, Optional[pricing.Choice]]:
  """``config`` with ``optimizer_offload_update_on=auto`` replaced by the exact placement this
  machine runs fastest, and that choice, and ``offload_transfer_dtype=auto`` by the dtype
  that placement takes (``transfer_dtype``). Without offload, there is nothing to decide:
  ``config`` unchanged."""
  if offload is None:
    return config, None
  places = candidate_places(config, derived.moment_dtypes)
  if len(places) == 1:
    return with_update_place(config, places[0]), None
  formats = kernel_formats(config, derived.moment_dtypes)
  choice = price_updates(config, derived, offload, pricing.measure_machine(formats=formats),
                         host_kernel="host_kernel" in places)
  if jax.process_count() > 1:
    # Every process must build the same program: process 0's choice holds.
    places = list(choice.predicted_s)
    first = multihost_utils.broadcast_one_to_all(np.int32(places.index(choice.place)))
    choice = dataclasses.replace(choice, place=places[int(first)])
  return with_update_place(config, choice.place), choice
