"""The named activations of a transformer layer and where each goes between forward and backward.

This module is the single source of truth for activation names: the model tags
its tensors with ``checkpoint_name(x, name)`` for the names below, and the remat
policies here decide, name by name, whether a tensor is saved in device memory,
offloaded to ``pinned_host`` memory, or dropped and recomputed in the backward
pass. Anything a layer computes without a name is recomputed under any policy.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Callable, Mapping, Optional, Sequence, Union

import jax


class Placement(str, enum.Enum):
  """Where a named activation waits between the forward and the backward pass."""

  SAVE = "save"  # Kept in device memory.
  OFFLOAD = "offload"  # Copied to pinned_host after the forward, back for the backward.
  RECOMPUTE = "recompute"  # Dropped; the backward pass computes it again.


# In the order a layer computes them.
ACTIVATION_NAMES = (
    "layer_input",  # The residual stream entering the layer.
    "query_proj",  # Queries after the projection and rotary embedding.
    "key_proj",  # Keys after the projection and rotary embedding.
    "value_proj",  # Values after the projection.
    "attention_out",  # The attention kernel's output, before the output projection.
    "mlp_input",  # The residual stream after attention, before the MLP's norm.
    "mlp_gate",  # The gate projection, before its activation.
    "mlp_up",  # The up projection.
)
# The MLP's output has no name: the backward pass never needs it (the residual
# sum's gradient does not depend on its operands), so no policy could save it.

# What a layer group uses: one placement per name, or None to save every
# intermediate (no rematerialisation at all).
Placements = Optional[Mapping[str, Union[Placement, str]]]

SAVE_EVERYTHING: Placements = None
SAVE_NAMED = {name: Placement.SAVE for name in ACTIVATION_NAMES}
RECOMPUTE_ALL = {name: Placement.RECOMPUTE for name in ACTIVATION_NAMES}
# Megatron's "selective" recompute: the attention kernel again in the backward pass (and the
# layer's norms, rotary embedding and MLP activation), every projection's output saved. The
# layer's input is not named: every remat policy saves it as the layer's argument.
RECOMPUTE_SELECTIVE = {**SAVE_NAMED, "layer_input": Placement.RECOMPUTE}
OFFLOAD_ALL = {name: Placement.OFFLOAD for name in ACTIVATION_NAMES}

def check_placements(placements: Mapping[str, Union[Placement, str]], *,
                     names: Sequence[str] = ACTIVATION_NAMES) -> dict[str, Placement]:
  """Returns a placement for every activation name; names left out are recomputed.

  Args:
    placements: a placement (or its value, "save", "offload", "recompute") per name.
    names: the names the model tags with ``checkpoint_name``; default: ``model.Llama``'s.

  Raises:
    ValueError: naming an unknown activation name or placement.
  """
  unknown = sorted(set(placements) - set(names))
  if unknown:
    raise ValueError(f"unknown activation names {unknown}; known: {list(names)}")
  checked = {}
  for name in names:
    value = placements.get(name, Placement.RECOMPUTE)
    try:
      checked[name] = Placement(value)
    except ValueError:
      raise ValueError(f"placement of {name!r} must be one of "
                       f"{[p.value for p in Placement]}, got {value!r}") from None
  return checked


# Named sets of activations to offload, the rest recomputed. Recomputing a
# projection costs about hidden_size FLOPs per byte it would have moved, the
# attention kernel about 2 * seq_len, the residual stream almost nothing.
OFFLOAD_PRESETS = {
    "all": ACTIVATION_NAMES,
    "qkv": ("query_proj", "key_proj", "value_proj"),  # MaxText's qkv_proj_offloaded.
    "attention": ("query_proj", "key_proj", "value_proj", "attention_out"),
    "mlp": ("mlp_gate", "mlp_up"),
    "qkv_mlp": ("query_proj", "key_proj", "value_proj", "mlp_gate", "mlp_up"),
    "matmuls": ("query_proj", "key_proj", "value_proj", "attention_out", "mlp_gate", "mlp_up"),
    "residual": ("layer_input", "mlp_input"),
}


def offload_preset(name: str) -> dict[str, Placement]:
  """Placements that offload the activations of ``OFFLOAD_PRESETS[name]`` and recompute the rest.

  Raises:
    ValueError: naming the unknown preset and the known ones.
  """
  if name not in OFFLOAD_PRESETS:
    raise ValueError(f"unknown offload preset {name!r}; known: {sorted(OFFLOAD_PRESETS)}")
  return check_placements({n: Placement.OFFLOAD for n in OFFLOAD_PRESETS[name]})


# What offloaded layers do unless told otherwise: q/k/v offloaded, the rest recomputed
# (each preset's cost: docs/performance.md#activation-offload).
DEFAULT_OFFLOAD_PRESET = "qkv"
OFFLOAD_DEFAULT = offload_preset(DEFAULT_OFFLOAD_PRESET)


def remat_policy(placements: Mapping[str, Union[Placement, str]], *,
                 names: Sequence[str] = ACTIVATION_NAMES) -> Callable[..., object]:
  """The ``jax.checkpoint`` policy that places each named activation as asked.

  Args:
    placements: as ``check_placements``: names left out are recomputed.
    names: the names your model tags with ``checkpoint_name``; default: ``model.Llama``'s.

  Returns:
    A policy for ``jax.checkpoint`` or ``flax.linen.remat``: offloaded names go to
    ``pinned_host`` after the forward pass and come back for the backward.

  Example:
    >>> policy = remat_policy({"query_proj": "offload", "layer_input": "save"})
    >>> layer = jax.checkpoint(layer_fn, policy=policy)
  """
  checked = check_placements(placements, names=names)
  saved = [name for name, p in checked.items() if p is Placement.SAVE]
  offloaded = [name for name, p in checked.items() if p is Placement.OFFLOAD]
  if not offloaded:
    return jax.checkpoint_policies.save_only_these_names(*saved)
  return jax.checkpoint_policies.save_and_offload_only_these_names(
      names_which_can_be_saved=saved, names_which_can_be_offloaded=offloaded,
      offload_src="device", offload_dst="pinned_host")


@dataclasses.dataclass(frozen=True)
class LayerGroup:
  """Consecutive layers ``[start, stop)`` that share one activation placement.

  Attributes:
    start, stop: the layers, ``[start, stop)``.
    placements: one ``Placement`` per activation name, or None to save all.
    offload_weights: the group's weights live in pinned_host and come to the
      device one layer at a time, in the forward and the backward pass.
    fetch_weights: those of the group's weights that live in host memory come to
      the device one layer at a time, and their gradients go back to host memory
      one layer at a time, as the backward pass makes them; the activations are
      placed as ``placements`` says (with it, a group that saves everything keeps
      the device copies for the backward pass).
  """

  start: int
  stop: int
  placements: Placements
  offload_weights: bool = False
  fetch_weights: bool = False

  def policy(self) -> Optional[Callable[..., object]]:
    """The group's ``jax.checkpoint`` policy; None when nothing needs rematerialising."""
    if self.placements is not None:
      return remat_policy(self.placements)
    if self.offload_weights:
      # Saving the named activations only: saving everything would keep the
      # device copies of the weights (and their casts) for the backward pass.
      return remat_policy(SAVE_NAMED)
    return None

  def wrap(self, layer_fn: Callable[..., object]) -> Callable[..., object]:
    """``layer_fn`` under this group's remat policy (unchanged when there is none)."""
    policy = self.policy()
    if policy is None:
      return layer_fn
    return jax.checkpoint(layer_fn, policy=policy, prevent_cse=False)


def layer_groups(num_layers: int, *, offload_num_layers: int = 0,
                 offload_placements: Placements = OFFLOAD_DEFAULT,
                 base_placements: Placements = SAVE_EVERYTHING,
                 offload_weights: bool = False) -> tuple[LayerGroup, ...]:
  """Splits the layers into the first ``offload_num_layers`` and the rest.

  With Megatron-Bridge's meaning of ``cpu_offloading_num_layers = N``: layers
  ``[0, N)`` use ``offload_placements``, layers ``[N, num_layers)`` use
  ``base_placements`` (save everything, or recompute some or all under
  ``recompute_granularity``). With ``offload_weights`` (Megatron's
  ``cpu_offloading_weights``) the first group's weights live in pinned_host.
  Empty groups are left out.

  Raises:
    ValueError: if ``offload_num_layers`` is outside [0, num_layers - 1], with
      the reference's bounds.
  """
  if not 0 <= offload_num_layers < num_layers:
    raise ValueError(
        f"cpu_offloading_num_layers must be in [0, num_layers - 1] = [0, {num_layers - 1}], "
        f"got {offload_num_layers}")
  groups = (LayerGroup(0, offload_num_layers, offload_placements, offload_weights),
            LayerGroup(offload_num_layers, num_layers, base_placements))
  return tuple(g for g in groups if g.stop > g.start)


RECOMPUTE_GRANULARITIES = (None, "selective", "full")


def megatron_layer_groups(num_layers: int, *, cpu_offloading: bool = False,
                          cpu_offloading_num_layers: int = 0,
                          cpu_offloading_activations: bool = True,
                          cpu_offloading_weights: bool = False,
                          recompute_granularity: Optional[str] = None,
                          fine_grained_activation_offloading: bool = False,
                          offload_placements: Placements = OFFLOAD_DEFAULT
                          ) -> tuple[LayerGroup, ...]:
  """Layer groups from Megatron-Bridge's ``model.*`` offload settings, checked by its rules.

  Args:
    num_layers: transformer layers in the model.
    cpu_offloading: the master switch of activation (and weight) offload.
    cpu_offloading_num_layers: how many leading layers offload, in [0, num_layers - 1].
    cpu_offloading_activations: offload those layers' named activations.
    cpu_offloading_weights: keep those layers' weights in pinned_host.
    recompute_granularity: None, "selective" (``RECOMPUTE_SELECTIVE``: the attention kernel
      and elementwise ops recomputed) or "full" to recompute every layer's activations.
    fine_grained_activation_offloading: Megatron's module-level offload, which
      excludes layer-level offload (and is not implemented here).
    offload_placements: what the offloaded layers do with each named activation.

  Returns:
    The groups for ``model.Llama``.

  Raises:
    ValueError: with the reference's wording, for a combination it refuses.
  """
  if recompute_granularity not in RECOMPUTE_GRANULARITIES:
    raise ValueError(f"recompute_granularity must be one of {list(RECOMPUTE_GRANULARITIES)}, "
                     f"got {recompute_granularity!r}")
  base = {"full": RECOMPUTE_ALL, "selective": RECOMPUTE_SELECTIVE}.get(recompute_granularity,
                                                                     SAVE_EVERYTHING)
  if fine_grained_activation_offloading:
    if cpu_offloading:
      raise ValueError("fine_grained_activation_offloading cannot be enabled with cpu_offloading.")
    raise ValueError("fine_grained_activation_offloading is not implemented in jaxoffload; "
                     "use cpu_offloading with per-name offload_placements instead")
  if not cpu_offloading:
    return layer_groups(num_layers, base_placements=base)
  if recompute_granularity is not None:
    raise ValueError("CPU offloading does not work when activation recomputation is enabled")
  return layer_groups(
      num_layers, offload_num_layers=cpu_offloading_num_layers,
      offload_placements=offload_placements if cpu_offloading_activations else SAVE_EVERYTHING,
      base_placements=base, offload_weights=cpu_offloading_weights)
