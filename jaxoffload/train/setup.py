"""What a run needs, resolved once from its ``Config`` (by ``resolve``): ``Setup``."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import optax

from jaxoffload.nn import sharding
from jaxoffload.nn.model import Llama, LlamaConfig, group_name
from jaxoffload.nn.remat import LayerGroup
from jaxoffload.optim.offload_plan import OffloadPlan
from jaxoffload.train.data import Data
from jaxoffload.train.config import Config
from jaxoffload.train.implied import Implied


@dataclasses.dataclass(frozen=True)
class Setup:
  """What a run needs, resolved once from its ``Config``.

  Attributes:
    config: the config, with ``auto`` fractions and placements replaced by the choice.
    model: the model's own config.
    groups: its layer groups (activation placement, weights offload).
    mesh: the (data, fsdp, tensor) mesh.
    param_shapes: the parameters' ``jax.ShapeDtypeStruct``s.
    param_shardings: where each parameter lives: sharding and memory kind.
    offload: which leaves' optimizer state is offloaded; None without optimizer offload.
    fetched_by_model: per leaf, True for weights in host memory that the model brings to
      the device layer by layer: weight-offloaded groups', and the host kernel's stacked
      leaves when it sums micro-batches.
    schedule: the learning rate at each update.
    choices: what each ``auto`` chose and why, a line each.
    data: the training and held-out batches (numpy), and the tokenizer; None in an
      ``abstract_setup`` and where ``resolve`` was asked for none.
    implied: what the config's keys imply (micro-batches, clipping, moment dtypes, ...),
      computed once; ``micro_batches``, ``clips_gradients``, ``moment_dtypes`` and
      ``moves_activations`` read it.
    host_kernel: whether the offloaded leaves update with the host kernel (``HostAdamW``).
    overlaps_host_update: whether the host kernel's update overlaps the next step's forward
      pass, a program per layer (``train.per_layer.overlap``): unless
      ``optimizer.overlap_cpu_optimizer_d2h_h2d=False``, wherever it can
      (``implied.host_update_overlap_blocker``).
    transfer_dtypes: per host kernel leaf, the dtype its gradients travel in and its weights
      reach the model in: bfloat16 for bfloat16 parameters, and for those the model
      multiplies in bfloat16 with ``offload_transfer_dtype=bfloat16``; float32 otherwise.
    weight_transfer_dtypes: per host kernel leaf, the dtype the device reads its weights in
      from host memory: ``transfer_dtypes`` where the host keeps float32 masters split
      (``optimizer.store_param_remainders``) and bfloat16 parameters as they are, float32
      otherwise (the device rounds them itself).
  """

  config: Config
  model: LlamaConfig
  groups: tuple[LayerGroup, ...]
  mesh: jax.sharding.Mesh
  param_shapes: Any
  param_shardings: Any
  offload: Optional[OffloadPlan]
  fetched_by_model: Any
  schedule: optax.Schedule
  choices: tuple[str, ...]
  data: Optional[Data]
  implied: Implied
  host_kernel: bool
  overlaps_host_update: bool
  transfer_dtypes: tuple[jnp.dtype, ...]
  weight_transfer_dtypes: tuple[jnp.dtype, ...]

  @property
  def micro_batches(self) -> int:
    """How many micro-batches make a step."""
    return self.implied.micro_batches

  @property
  def clips_gradients(self) -> bool:
    """Whether the update clips the gradients by their global norm (``optimizer.clip_grad``
    > 0): the host kernel's overlapped update then needs the whole backward pass's norm, or
    speculates (``speculates``)."""
    return self.implied.clips_gradients

  @property
  def moment_dtypes(self) -> tuple[str, str]:
    """The dtypes of Adam's two moments."""
    return self.implied.moment_dtypes

  @property
  def moves_activations(self) -> bool:
    """Whether the trainer moves the offloaded layers' activations itself, a program per
    layer (``model.cpu_offloading_double_buffering``), not XLA's remat policy inside one
    program."""
    return self.implied.moves_activations

  @property
  def runs_per_layer(self) -> bool:
    """Whether a step runs a program per piece of the model (``train.per_layer.overlap``): for the host
    kernel's overlapped update, for the trainer to move activations, or where
    ``train.per_layer_step`` asks."""
    return (self.overlaps_host_update or self.moves_activations
            or self.config.train.per_layer_step)

  @property
  def initial_param_shardings(self) -> Any:
    """Where the first parameters are placed: ``param_shardings``, but in device memory for
    the host kernel's float32 masters that it splits (``HostAdamW`` splits them there: a
    float32 master never enters XLA's pinned pool, which never gives memory back)."""
    if not self.host_kernel:
      return self.param_shardings
    split = iter([p.dtype == jnp.float32 and d == jnp.bfloat16 for p, d in zip(
        host_leaves(self.param_shapes, self.offload), self.weight_transfer_dtypes)])
    return jax.tree.map(lambda s, host: s.with_memory_kind("device") if host and next(split)
                        else s, self.param_shardings, self.offload.mask)

  @property
  def compact_moments(self) -> bool:
    """Whether a moment is stored in bfloat16 or 8 bits (rounded stochastically)."""
    return any(d != "float32" for d in self.moment_dtypes)

  @property
  def speculates(self) -> bool:
    """Whether the overlapped host update, clipped, may start during the backward pass as
    if unclipped (``optimizer.speculate_cpu_optimizer_step``): not with compact moments,
    which cannot be taken back exactly."""
    return (self.overlaps_host_update and self.clips_gradients
            and self.config.optimizer.speculate_cpu_optimizer_step
            and not self.compact_moments)

  @property
  def sums_on_host(self) -> bool:
    """Whether the host kernel sums its leaves' gradients over micro-batches (a program per
    micro-batch, ``StepPrograms``): with it, several micro-batches and
    ``optimizer.accumulate_offloaded_grads_on=host``."""
    return (self.host_kernel and self.micro_batches > 1
            and self.config.optimizer.accumulate_offloaded_grads_on == "host")

  @property
  def grad_accum_dtype(self) -> jnp.dtype:
    """The dtype of the device's sums of gradients over micro-batches
    (``optimizer.grad_accum_dtype``)."""
    return jnp.dtype(self.config.optimizer.grad_accum_dtype or "float32")

  @property
  def state_in_host_memory(self) -> bool:
    """Whether parameters or optimizer state live in host memory, where a step updates or
    donates them in place: a checkpoint reads them there, and must finish first."""
    return (self.host_kernel or any(jax.tree.leaves(self.fetched_by_model))
            or (self.offload is not None and any(self.offload.offloaded)))

  @property
  def weights_updated_by_layer(self) -> frozenset[str]:
    """The weight-offloaded groups whose backward pass updates them a layer at a time
    (``train.per_layer.offloaded_layers``): on the step a program per layer, unclipped, those the
    device's own ``optax.adamw`` holds (float32 moments in device memory, none of their
    leaves the host kernel's)."""
    if (not self.runs_per_layer or self.clips_gradients or self.compact_moments
        or self.offload is not None and not self.host_kernel):
      return frozenset()
    paths, _ = jax.tree_util.tree_flatten_with_path(self.param_shapes)
    kernel = self.offload.offloaded if self.host_kernel else (False,) * len(paths)
    return frozenset({group_name(g) for g in self.groups if g.offload_weights}
                     - {path[0].key for (path, _), host in zip(paths, kernel) if host})

  @property
  def llama(self) -> Llama:
    """The model, its layer groups and its mesh."""
    return Llama(self.model, self.groups, self.mesh)

  @property
  def batch_shape(self) -> jax.ShapeDtypeStruct:
    """The shape, dtype and placement of ``global_batch``'s arrays: what a step compiles for."""
    t = self.config.train
    return jax.ShapeDtypeStruct((t.global_batch_size, self.model.seq_length), jnp.int32,
                                sharding=sharding.batch_sharding(self.mesh))

  def global_batch(self, step: int) -> jax.Array:
    """Step ``step``'s tokens as one array over the mesh; each process places only its shards.

    Every process computes the same global batch from the seed and the step, so
    no process needs another's data.
    """
    return self._placed(self.data.train(step))

  def eval_batch(self, i: int) -> jax.Array:
    """The ``i``-th held-out batch, placed like ``global_batch``."""
    return self._placed(self.data.eval(i))

  def _placed(self, tokens) -> jax.Array:
    return jax.make_array_from_callback(tokens.shape, sharding.batch_sharding(self.mesh),
                                        lambda index: tokens[index])


def host_leaves(tree: Any, offload: OffloadPlan) -> list:
  """Of a tree like the parameters, the leaves ``offload`` offloads."""
  return [x for x, host in zip(jax.tree.leaves(tree), offload.offloaded) if host]
