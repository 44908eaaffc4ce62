"""The optimizer of a ``Setup``, where its state lives, and that state as checkpoints hold it.

One optimizer for every setting: ``optax.chain(optax.clip_by_global_norm,
X)`` where X is ``optax.adamw``, ``jaxoffload.offload_adamw`` (the plan's
leaves' moments in host memory), or, with the host kernel, ``optax.adamw``
masked to the device leaves beside a ``HostAdamW`` for the rest.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

import jaxoffload
from jaxoffload._compat import DEVICE_KIND, PINNED_HOST
from jaxoffload.host.host_adamw import HostAdamW
from jaxoffload.optim import blockwise
from jaxoffload.optim.offload_plan import leaf_path
from jaxoffload.train.setup import Setup


def optimizer(setup: Setup) -> optax.GradientTransformation:
  """Clipped AdamW on the schedule; its state partly in host memory with optimizer offload."""
  o = setup.config.optimizer
  hyper = _adamw_hyperparameters(setup)
  compact = setup.compact_moments
  mu_dtype, nu_dtype = setup.moment_dtypes
  if setup.host_kernel:
    on_device = jax.tree.map(lambda offloaded: not offloaded, setup.offload.mask)
    # The leaves the host kernel leaves on the device, with moments of the same dtypes.
    device_adamw = (jaxoffload.offload_adamw(setup.schedule, **hyper, offload_fraction=0.0,
                                             mu_dtype=mu_dtype, nu_dtype=nu_dtype,
                                             stochastic_rounding=True) if compact
                    else plain_adamw(setup))
    adamw = optax.masked(device_adamw, on_device)
  elif setup.offload is not None or compact:
    # With no offload, an empty mask: offload_adamw is optax.adamw with moment dtypes.
    mask = setup.offload.mask if setup.offload is not None else jax.tree.map(
        lambda _: False, setup.param_shapes)
    adamw = jaxoffload.offload_adamw(
        setup.schedule, **hyper, offload_mask=mask,
        update_on=o.optimizer_offload_update_on if setup.offload is not None else "device",
        overlap_transfers=bool(o.overlap_cpu_optimizer_d2h_h2d), mu_dtype=mu_dtype,
        nu_dtype=nu_dtype, stochastic_rounding=compact, shardings=setup.param_shardings)
  else:
    adamw = plain_adamw(setup)
  # The same state with or without clipping: a checkpoint resumes under either.
  clip = optax.clip_by_global_norm(o.clip_grad) if setup.clips_gradients else optax.identity()
  return optax.chain(clip, adamw)


def plain_adamw(setup: Setup) -> optax.GradientTransformation:
  """``optax.adamw`` on the schedule with the config's hyperparameters: what the device
  optimizer applies to its leaves with float32 moments, a whole leaf or a layer of it at
  a time (``train.per_layer.offloaded_layers``)."""
  return optax.adamw(setup.schedule, **_adamw_hyperparameters(setup))


def _adamw_hyperparameters(setup: Setup) -> dict:
  o = setup.config.optimizer
  return dict(b1=o.adam_beta1, b2=o.adam_beta2, eps=o.adam_eps, weight_decay=o.weight_decay)


def host_adamw(setup: Setup, weights: list[jax.Array]) -> HostAdamW:
  """The host kernel's optimizer for the offloaded leaves' float32 ``weights``."""
  o = setup.config.optimizer
  mu_dtype, nu_dtype = setup.moment_dtypes
  return HostAdamW(weights, learning_rate=setup.schedule, b1=o.adam_beta1, b2=o.adam_beta2,
                   eps=o.adam_eps, weight_decay=o.weight_decay,
                   device_dtypes=setup.weight_transfer_dtypes, mu_dtype=mu_dtype,
                   nu_dtype=nu_dtype)


class Moments(NamedTuple):
  """Adam's state as a checkpoint holds it, whatever held it: what any setting resumes from.

  Attributes:
    count: updates applied.
    mu: the first moments, a tree like the parameters. A leaf of the host kernel's
      may be a function that reads it (``read() -> array``), so that each is read
      only when its turn comes.
    nu: the second moments, likewise.
  """

  count: int
  mu: Any
  nu: Any


def device_shapes(setup: Setup) -> Any:
  """The parameters' shapes and shardings in device memory: what the optimizer's state is
  made from (host-resident weights must not be read, and offloaded state starts where the
  plan says)."""
  return jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s.with_memory_kind(
          DEVICE_KIND)), setup.param_shapes, setup.param_shardings)


def state_shardings(setup: Setup, state: Any) -> Any:
  """Where each leaf of the optimizer state lives: a moment beside its parameter, in
  pinned_host where the plan offloads it (8-bit blocks' scales split as its rows are), and a
  scalar replicated over the mesh (so that step 1 sees the placements every later step sees,
  and the step compiles once)."""
  offloaded = (setup.offload.offloaded if setup.offload is not None and not setup.host_kernel
               else (False,) * len(jax.tree.leaves(setup.param_shapes)))
  beside = {leaf_path(path): (s.with_memory_kind(PINNED_HOST if off else DEVICE_KIND), p.ndim)
            for (path, s), p, off in zip(
                jax.tree_util.tree_flatten_with_path(setup.param_shardings)[0],
                jax.tree.leaves(setup.param_shapes), offloaded)}
  replicated = jax.sharding.NamedSharding(setup.mesh, jax.sharding.PartitionSpec())

  def place(path, leaf):
    if not leaf.shape:
      return replicated
    state_path = leaf_path(path)  # Ends with its parameter's: "1/0/mu/embed/embedding".
    part = path[-1].name if isinstance(path[-1], jax.tree_util.GetAttrKey) else None
    if part in blockwise.BlockwiseMoment._fields:  # ".../embed/embedding/codes"
      state_path = state_path.rsplit("/", 1)[0]
    sharding, ndim = beside[max((p for p in beside if state_path.endswith("/" + p)), key=len)]
    return blockwise.scales_sharding(sharding, ndim) if part == "scales" else sharding

  return jax.tree_util.tree_map_with_path(place, state)


def _is_blocks(x: Any) -> bool:
  return isinstance(x, blockwise.BlockwiseMoment)


def moment_values(moments: Any) -> Any:
  """``moments`` with each 8-bit one (``blockwise.BlockwiseMoment``) as its float32 value,
  where its codes are: what a checkpoint holds."""
  value = lambda m: jax.jit(blockwise.BlockwiseMoment.value, out_shardings=m.codes.sharding)(m)
  return jax.tree.map(lambda m: value(m) if _is_blocks(m) else m, moments, is_leaf=_is_blocks)


def value_targets(abstract: Any, shardings: Any) -> Any:
  """``moment_values``' shapes, dtypes and placements, for moments like ``abstract`` placed
  at ``shardings``: where a checkpoint's moments are read to."""

  def target(x, sharding):
    if _is_blocks(x):
      return jax.ShapeDtypeStruct(x.codes.shape, jnp.float32, sharding=sharding.codes)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

  return jax.tree.map(target, abstract, shardings, is_leaf=_is_blocks)


def stored_moments(values: Any, abstract: Any, shardings: Any) -> Any:
  """``values`` (``moment_values``') stored as ``abstract``'s leaves are: encoded into 8-bit
  blocks placed at ``shardings`` where ``abstract`` has them."""

  def store(value, x, sharding):
    if not _is_blocks(x):
      return value
    encode = functools.partial(blockwise.BlockwiseMoment.of, signed=x.codes.dtype == jnp.int8)
    return jax.jit(encode, out_shardings=sharding)(value)

  return jax.tree.map(store, values, abstract, shardings)
