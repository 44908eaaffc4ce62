"""One step from a checked ``Config`` to everything a run needs, computed once: ``resolve``.

The model's config and layer groups, the mesh, the parameters' shapes and
placements, the optimizer offload plan and where it updates (measured on
this machine for ``optimizer_offload_update_on=auto``), the learning-rate
schedule and the batches. The trainer, the benchmark runner and tests take
a ``Setup`` and derive nothing from the config again.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import optax

from jaxoffload.nn import sharding
from jaxoffload.nn.model import Llama, LlamaConfig, compute_dtypes, group_name
from jaxoffload.nn.params import cut_param_shapes
from jaxoffload.nn.remat import LayerGroup
from jaxoffload.optim.offload_plan import OffloadPlan, leaf_path, plan_offload
from jaxoffload.train import data, rules
from jaxoffload.train.config import Config, ConfigError
from jaxoffload.train.offload_choice import (candidate_places,
                                             resolve_update_place)
from jaxoffload.train.schedule import learning_rate


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
    micro_batches: how many micro-batches make a step (``rules.micro_batches``).
    clips_gradients: whether the update clips the gradients by their global norm
      (``optimizer.clip_grad`` > 0): the host kernel's overlapped update then needs the
      whole backward pass's norm, or speculates (``speculates``).
    moment_dtypes: the dtypes of Adam's two moments (``rules.moment_dtypes``).
    host_kernel: whether the offloaded leaves update with the host kernel (``HostAdamW``).
    overlaps_host_update: whether the host kernel's update overlaps the next step's forward
      pass, a program per layer (``train.per_layer.overlap``): unless
      ``optimizer.overlap_cpu_optimizer_d2h_h2d=False``, wherever it can
      (``rules.host_update_overlap_blocker``).
    transfer_dtypes: per host kernel leaf, the dtype its gradients travel in and its weights
      reach the model in: bfloat16 for bfloat16 parameters, and for those the model
      multiplies in bfloat16 with ``offload_transfer_dtype=bfloat16``; float32 otherwise.
    weight_transfer_dtypes: per host kernel leaf, the dtype the device reads its weights in
      from host memory: ``transfer_dtypes`` where the host keeps float32 masters split
      (``optimizer.store_param_remainders``) and bfloat16 parameters as they are, float32
      otherwise (the device rounds them itself).
    moves_activations: whether the trainer moves the offloaded layers' activations itself,
      a program per layer (``model.cpu_offloading_double_buffering``), not XLA's remat
      policy inside one program.
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
  data: Optional[data.Data]
  micro_batches: int
  clips_gradients: bool
  moment_dtypes: tuple[str, str]
  host_kernel: bool
  overlaps_host_update: bool
  transfer_dtypes: tuple[jnp.dtype, ...]
  weight_transfer_dtypes: tuple[jnp.dtype, ...]
  moves_activations: bool

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
        _host_leaves(self.param_shapes, self.offload), self.weight_transfer_dtypes)])
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


def resolve(config: Config, *, with_data: bool = True, choices: Sequence[str] = ()) -> Setup:
  """Everything a run of ``config`` needs (``config`` checked by ``load_config``).

  Args:
    config: the run's config.
    with_data: read or make the run's batches; False for a setup that only compiles and
      sizes its step (``Setup.batch_shape``), as the planner's many do: a text corpus is
      then not read again for each.
    choices: what the planner chose for ``config`` (``jaxoffload.plan.choose``'s lines),
      shown before this machine's own choices.

  Raises:
    ConfigError: for what depends on this machine or the files named: a mesh
      that does not use every device of several processes, an unreadable text
      file, the host kernel without numba.
    ValueError: for ``optimizer_offload_fraction=auto``, which the planner picks first.
  """
  if config.optimizer.optimizer_offload_fraction == "auto":
    raise ValueError("optimizer_offload_fraction=auto is the planner's to pick "
                     "(jaxoffload.plan.choose): resolve the config it returns")
  choices = list(choices)
  offload = _offload_plan(config)
  config, choice = resolve_update_place(config, offload)
  if choice is not None:
    choices.append(str(choice))
  if (offload is not None and config.optimizer.optimizer_offload_update_on == "host_kernel"
      and importlib.util.find_spec("numba") is None):
    raise ConfigError("optimizer_offload_update_on=host_kernel needs numba: "
                      "pip install 'jaxoffload[host]'")
  return _placed(config, offload, _mesh(config), data.make(config) if with_data else None,
                 tuple(choices))


def abstract_setup(config: Config) -> Setup:
  """``resolve``'s placements of a config that names them (its offload's fraction and
  placement, not ``auto``), over an abstract mesh of its sizes, with no data: what memory
  its run will hold, reckoned before JAX starts a backend (which ``resolve`` starts).

  Raises:
    ValueError: for a config with an ``auto`` setting that only this machine decides.
  """
  if config.optimizer.optimizer_offload_fraction == "auto":
    raise ValueError("optimizer_offload_fraction=auto is decided on this machine: resolve the "
                     "config")
  if _offload_plan(config) is not None and len(candidate_places(config)) > 1:
    raise ValueError("optimizer_offload_update_on=auto is decided on this machine: resolve the "
                     "config")
  m = config.mesh
  return _without_data(config, jax.sharding.AbstractMesh((m.data, m.fsdp, m.tensor),
                                                         sharding.MESH_AXES))


def variant(setup: Setup, config: Config) -> Setup:
  """The ``Setup`` of ``config``, a resolved run's config with a setting changed (its
  placements named, no ``auto``), over the run's mesh, with no data: what the run would
  hold with that setting."""
  return _without_data(config, setup.mesh)


def _without_data(config: Config, mesh: Any) -> Setup:
  offload = _offload_plan(config)
  config, _ = resolve_update_place(config, offload)
  return _placed(config, offload, mesh, None, ())


def _offload_plan(config: Config) -> Optional[OffloadPlan]:
  """Which leaves' optimizer state ``config`` offloads (None without optimizer offload)."""
  o = config.optimizer
  if not o.optimizer_cpu_offload:
    return None
  shapes, _ = cut_param_shapes(config.model.llama(), _layer_ranges(config))
  # Leaves whose weights live in pinned_host already go first: their update then stays
  # beside them, where the device's would bring the whole group over and back.
  host_groups = tuple(group_name(g) + "/" for g in rules.layer_groups(config)
                      if g.offload_weights)
  return plan_offload(shapes, offload_fraction=o.optimizer_offload_fraction,
                      first=lambda path, _: path.startswith(host_groups))


def _placed(config: Config, offload: Optional[OffloadPlan], mesh: Any,
            run_data: Optional[data.Data], choices: tuple[str, ...]) -> Setup:
  """The ``Setup`` of a config whose placements are decided, over ``mesh``."""
  groups = rules.layer_groups(config)
  model = config.model.llama()
  shapes, specs = cut_param_shapes(model, _layer_ranges(config))
  shardings = sharding.logical_shardings(mesh, specs)
  host_groups = {group_name(g) for g in groups if g.offload_weights}
  fetched = jax.tree_util.tree_map_with_path(
      lambda path, _: leaf_path(path).split("/")[0] in host_groups, shapes)
  host_kernel = (offload is not None
                 and config.optimizer.optimizer_offload_update_on == "host_kernel")
  # Weight-offloaded groups live in pinned_host; so do the host kernel's leaves
  # (ZeRO-Offload's split: their weights stay with their optimizer state).
  in_host = fetched if not host_kernel else jax.tree.map(lambda a, b: a or b, fetched,
                                                          offload.mask)
  shardings = jax.tree.map(lambda s, host: s.with_memory_kind("pinned_host") if host else s,
                           shardings, in_host)
  transfer, weight_transfer = (_transfer_dtypes(config, model, shapes, offload) if host_kernel
                                else ((), ()))
  setup = Setup(config=config, model=model, groups=groups, mesh=mesh, param_shapes=shapes,
                param_shardings=shardings, offload=offload, fetched_by_model=fetched,
                schedule=learning_rate(config), choices=choices, data=run_data,
                micro_batches=rules.micro_batches(config),
                clips_gradients=rules.clips_gradients(config),
                moment_dtypes=rules.moment_dtypes(config), host_kernel=host_kernel,
                overlaps_host_update=host_kernel and rules.host_update_overlaps(config),
                transfer_dtypes=transfer, weight_transfer_dtypes=weight_transfer,
                moves_activations=rules.moves_activations(config))
  if setup.sums_on_host:
    # The model fetches the host kernel's stacked leaves a layer at a time, and their
    # gradients leave the device as they are made.
    groups, fetched = _fetching_host_leaves(groups, in_host)
    setup = dataclasses.replace(setup, groups=groups, fetched_by_model=fetched)
  return setup


def _host_leaves(tree: Any, offload: OffloadPlan) -> list:
  """Of a tree like the parameters, the leaves ``offload`` offloads."""
  return [x for x, host in zip(jax.tree.leaves(tree), offload.offloaded) if host]


def _transfer_dtypes(config: Config, model: LlamaConfig, shapes: Any, offload: OffloadPlan
                     ) -> tuple[tuple[jnp.dtype, ...], tuple[jnp.dtype, ...]]:
  """The host kernel's leaves' ``Setup.transfer_dtypes`` and ``weight_transfer_dtypes``."""
  wire = jnp.dtype(config.optimizer.offload_transfer_dtype)
  multiplied_in = _host_leaves(compute_dtypes(shapes, model), offload)
  params = _host_leaves(shapes, offload)
  transfer = tuple(p.dtype if p.dtype == jnp.bfloat16 else wire if d == jnp.bfloat16
                   else jnp.dtype(jnp.float32) for p, d in zip(params, multiplied_in))
  if config.optimizer.store_param_remainders:
    return transfer, transfer
  return transfer, tuple(p.dtype for p in params)


def _layer_ranges(config: Config) -> tuple[tuple[int, int], ...]:
  return tuple((g.start, g.stop) for g in rules.layer_groups(config))


def _fetching_host_leaves(groups: tuple[LayerGroup, ...], in_host: Any
                          ) -> tuple[tuple[LayerGroup, ...], Any]:
  """``groups`` with ``fetch_weights`` where a stacked leaf lives in host memory, and which
  leaves the model then fetches: those of such groups in host memory."""
  paths = [leaf_path(path) for path, _ in jax.tree_util.tree_flatten_with_path(in_host)[0]]
  hosted = {path.split("/")[0] for path, host in zip(paths, jax.tree.leaves(in_host)) if host}
  groups = tuple(dataclasses.replace(g, fetch_weights=g.fetch_weights or group_name(g) in hosted)
                 for g in groups)
  fetching = {group_name(g) for g in groups if g.offload_weights or g.fetch_weights}
  fetched = jax.tree.unflatten(jax.tree.structure(in_host), [
      host and path.split("/")[0] in fetching
      for path, host in zip(paths, jax.tree.leaves(in_host))])
  return groups, fetched


def _mesh(config: Config) -> jax.sharding.Mesh:
  m = config.mesh
  try:
    return sharding.make_mesh(m.data, m.fsdp, m.tensor)
  except ValueError as error:
    raise ConfigError(str(error)) from None
