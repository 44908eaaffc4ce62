"""What a checked ``Config``'s keys imply, by the reference's rules and this trainer's:
``implied`` computes it once, for ``resolve``.

Example:
  derived = implied(load_config(None, ["train.micro_batch_size=2"]))
  derived.micro_batches  # 4: the default 8 sequences a step, 2 a forward pass
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from jaxoffload.nn import remat
from jaxoffload.train.config import Config, ConfigError


@dataclasses.dataclass(frozen=True)
class Implied:
  """What a config's keys imply, each by the function of its name below."""

  # The config's layer groups (``layer_groups``); ``Setup.groups`` adds what the run fetches.
  groups: tuple[remat.LayerGroup, ...]
  moment_dtypes: tuple[str, str]  # Adam's two moments' dtypes.
  micro_batches: int  # How many micro-batches make a step.
  clips_gradients: bool  # Whether the update clips by the global norm.
  host_update_overlaps: bool  # Whether a host kernel update overlaps the next forward pass.
  moves_activations: bool  # Whether the trainer moves the offloaded activations itself.


def implied(config: Config) -> Implied:
  """Everything ``config`` implies (``Implied``).

  Raises:
    ConfigError: for layer-group keys Megatron's rules refuse.
  """
  return Implied(groups=layer_groups(config), moment_dtypes=moment_dtypes(config),
                 micro_batches=micro_batches(config), clips_gradients=clips_gradients(config),
                 host_update_overlaps=host_update_overlaps(config),
                 moves_activations=moves_activations(config))


def layer_groups(config: Config) -> tuple[remat.LayerGroup, ...]:
  """The model's layer groups from the ``model.cpu_offloading*`` keys, by Megatron's rules."""
  m = config.model
  try:
    return remat.megatron_layer_groups(
        m.num_layers, cpu_offloading=m.cpu_offloading,
        cpu_offloading_num_layers=m.cpu_offloading_num_layers,
        cpu_offloading_activations=m.cpu_offloading_activations,
        cpu_offloading_weights=m.cpu_offloading_weights,
        recompute_granularity=m.recompute_granularity,
        fine_grained_activation_offloading=m.fine_grained_activation_offloading,
        offload_placements=remat.offload_preset(m.cpu_offloading_policy))
  except ValueError as error:
    raise ConfigError(str(error)) from None


def moment_dtypes(config: Config) -> tuple[str, str]:
  """The dtypes of Adam's two moments: ``optimizer.exp_avg*_dtype``, else the parameters'."""
  o, params = config.optimizer, config.model.params_dtype
  return o.exp_avg_dtype or params, o.exp_avg_sq_dtype or params


def micro_batches(config: Config) -> int:
  """How many micro-batches make a step: ``train.global_batch_size`` over
  ``train.micro_batch_size``."""
  t = config.train
  return t.global_batch_size // t.micro_batch_size


def clips_gradients(config: Config) -> bool:
  """Whether the update clips the gradients by their global norm: ``optimizer.clip_grad``
  > 0 (0 turns clipping off)."""
  return config.optimizer.clip_grad > 0


def host_update_overlaps(config: Config) -> bool:
  """Whether a host kernel update of ``config`` overlaps the next step's forward pass, a
  program per layer: unless ``optimizer.overlap_cpu_optimizer_d2h_h2d=False``, wherever
  it can (``host_update_overlap_blocker``)."""
  return (config.optimizer.overlap_cpu_optimizer_d2h_h2d is not False
          and host_update_overlap_blocker(config) is None)


def moves_activations(config: Config) -> bool:
  """Whether the trainer moves the offloaded layers' activations itself, a program per layer
  (``model.cpu_offloading_double_buffering``)."""
  m = config.model
  return m.cpu_offloading and m.cpu_offloading_double_buffering and m.cpu_offloading_activations


def per_layer_blocker(config: Config) -> Optional[str]:
  """Why the model cannot run a program per layer (``train.per_layer.overlap``) for the trainer to move
  activations or for ``train.per_layer_step``, or None where it can: as the host kernel's
  overlap, where it may update on the host kernel; and never with
  ``optimizer.overlap_cpu_optimizer_d2h_h2d=False``, whose update runs after one program."""
  o = config.optimizer
  kernel = o.optimizer_cpu_offload and o.optimizer_offload_update_on in ("host_kernel", "auto")
  if kernel and o.overlap_cpu_optimizer_d2h_h2d is False:
    return ("optimizer.overlap_cpu_optimizer_d2h_h2d=False runs the host kernel's update after "
            "one program: leave it null")
  return host_update_overlap_blocker(config) if kernel else None


def host_update_overlap_blocker(config: Config) -> Optional[str]:
  """Why the host kernel's update cannot overlap the next forward pass a program per layer
  (``train.per_layer.overlap``), or None where it can: with several micro-batches it needs the
  gradients summed on the device."""
  o, t = config.optimizer, config.train
  if (t.micro_batch_size != t.global_batch_size
      and o.accumulate_offloaded_grads_on != "device"):
    return (f"with several micro-batches it sums every gradient on the device: "
            f"optimizer.accumulate_offloaded_grads_on must be 'device', got "
            f"{o.accumulate_offloaded_grads_on!r}")
  return None
