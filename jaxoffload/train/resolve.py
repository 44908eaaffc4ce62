"""One step from a checked ``Config`` to everything a run needs, computed once: ``resolve``.

The model's config and layer groups, the mesh, the parameters' shapes and
placements, the optimizer offload plan and where it updates (priced on
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

from jaxoffload.nn import sharding
from jaxoffload.nn.model import LlamaConfig, compute_dtypes, group_name
from jaxoffload.nn.params import cut_param_shapes
from jaxoffload.nn.remat import LayerGroup
from jaxoffload.optim.offload_plan import OffloadPlan, leaf_path, plan_offload
from jaxoffload.train import data
from jaxoffload.train.config import Config, ConfigError
from jaxoffload.train.implied import Implied, implied
from jaxoffload.train.offload_choice import candidate_places, resolve_update_place
from jaxoffload.train.schedule import learning_rate
from jaxoffload.train.setup import Setup, host_leaves


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
  derived = implied(config)
  offload = _offload_plan(config, derived)
  config, choice = resolve_update_place(config, derived, offload)
  if choice is not None:
    choices.append(str(choice))
  if (offload is not None and config.optimizer.optimizer_offload_update_on == "host_kernel"
      and importlib.util.find_spec("numba") is None):
    raise ConfigError("optimizer_offload_update_on=host_kernel needs numba: "
                      "pip install 'jaxoffload[host]'")
  return _placed(config, derived, offload, _mesh(config),
                 data.make(config) if with_data else None, tuple(choices))


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
  derived = implied(config)
  if (_offload_plan(config, derived) is not None
      and len(candidate_places(config, derived.moment_dtypes)) > 1):
    raise ValueError("optimizer_offload_update_on=auto is decided on this machine: resolve the "
                     "config")
  m = config.mesh
  return _without_data(config, jax.sharding.AbstractMesh((m.data, m.fsdp, m.tensor),
                                                         sharding.MESH_AXES))


def resolve_like(setup: Setup, config: Config) -> Setup:
  """The ``Setup`` of ``config``, a resolved run's config with a setting changed (its
  placements named, no ``auto``), over the run's mesh, with no data: what the run would
  hold with that setting."""
  return _without_data(config, setup.mesh)


def _without_data(config: Config, mesh: Any) -> Setup:
  derived = implied(config)
  offload = _offload_plan(config, derived)
  config, _ = resolve_update_place(config, derived, offload)
  return _placed(config, derived, offload, mesh, None, ())


def _offload_plan(config: Config, derived: Implied) -> Optional[OffloadPlan]:
  """Which leaves' optimizer state ``config`` offloads (None without optimizer offload)."""
  o = config.optimizer
  if not o.optimizer_cpu_offload:
    return None
  shapes, _ = cut_param_shapes(config.model.llama(), _layer_ranges(derived.groups))
  # Leaves whose weights live in pinned_host already go first: their update then stays
  # beside them, where the device's would bring the whole group over and back.
  host_groups = tuple(group_name(g) + "/" for g in derived.groups
                      if g.offload_weights)
  return plan_offload(shapes, offload_fraction=o.optimizer_offload_fraction,
                      first=lambda path, _: path.startswith(host_groups))


def _placed(config: Config, derived: Implied, offload: Optional[OffloadPlan], mesh: Any,
            run_data: Optional[data.Data], choices: tuple[str, ...]) -> Setup:
  """The ``Setup`` of a config whose placements are decided, over ``mesh``."""
  groups = derived.groups
  model = config.model.llama()
  shapes, specs = cut_param_shapes(model, _layer_ranges(groups))
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
                implied=derived, host_kernel=host_kernel,
                overlaps_host_update=host_kernel and derived.host_update_overlaps,
                transfer_dtypes=transfer, weight_transfer_dtypes=weight_transfer)
  if setup.sums_on_host:
    # The model fetches the host kernel's stacked leaves a layer at a time, and their
    # gradients leave the device as they are made.
    groups, fetched = _fetchinghost_leaves(groups, in_host)
    setup = dataclasses.replace(setup, groups=groups, fetched_by_model=fetched)
  return setup


def _transfer_dtypes(config: Config, model: LlamaConfig, shapes: Any, offload: OffloadPlan
                     ) -> tuple[tuple[jnp.dtype, ...], tuple[jnp.dtype, ...]]:
  """The host kernel's leaves' ``Setup.transfer_dtypes`` and ``weight_transfer_dtypes``."""
  wire = jnp.dtype(config.optimizer.offload_transfer_dtype)
  multiplied_in = host_leaves(compute_dtypes(shapes, model), offload)
  params = host_leaves(shapes, offload)
  transfer = tuple(p.dtype if p.dtype == jnp.bfloat16 else wire if d == jnp.bfloat16
                   else jnp.dtype(jnp.float32) for p, d in zip(params, multiplied_in))
  if config.optimizer.store_param_remainders:
    return transfer, transfer
  return transfer, tuple(p.dtype for p in params)


def _layer_ranges(groups: tuple[LayerGroup, ...]) -> tuple[tuple[int, int], ...]:
  return tuple((g.start, g.stop) for g in groups)


def _fetchinghost_leaves(groups: tuple[LayerGroup, ...], in_host: Any
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
