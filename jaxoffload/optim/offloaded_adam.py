"""Adam whose moments live partly in host memory: ``scale_by_offloaded_adam`` and ``offload_adamw``."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax import tree_utils as otu

from jaxoffload._compat import DEVICE_KIND, PINNED_HOST, to_host
from jaxoffload.optim import blockwise
from jaxoffload.optim.offload_plan import (OffloadMask, OffloadPlan, array_values, check_fraction,
                                           plan_offload, replicated_like)
from jaxoffload.optim.streaming import run_on_host, run_streamed
from jaxoffload.rounding import stochastic_round

UPDATE_PLACES = ("host", "device")
# Largest piece of host state that update_on="device" brings to the device at once.
DEFAULT_CHUNK_BYTES = 16 * 2**20


class ScaleByOffloadedAdamState(NamedTuple):
  """State of ``scale_by_offloaded_adam``; ``mu`` and ``nu`` mirror ``optax.ScaleByAdamState``."""

  count: jax.Array  # int32 scalar in device memory: steps taken, for bias correction.
  # First moments; the plan's offloaded leaves live in pinned_host. With mu_dtype=int8 a
  # leaf is a blockwise.BlockwiseMoment (codes and scales).
  mu: optax.Updates
  nu: optax.Updates  # Second moments; placed like mu.
  plan: OffloadPlan  # Static (no arrays): which leaves are offloaded, fixed at init.


def _check_update_on(update_on: str) -> None:
  if update_on not in UPDATE_PLACES:
    raise ValueError(f"update_on must be one of {UPDATE_PLACES}, got {update_on!r}")


# How far the achieved share may miss offload_fraction before init warns.
FRACTION_TOLERANCE = 0.05


def _check_float_leaves(params: Any) -> None:
  for key_path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    if not jnp.issubdtype(leaf.dtype, jnp.floating):
      raise ValueError(
          f"scale_by_offloaded_adam needs floating-point parameters; leaf "
          f"{jax.tree_util.keystr(key_path)} has dtype {leaf.dtype}. Allowed: float16, "
          "bfloat16, float32, float64. Mask such leaves out with optax.masked.")


def _is_static_number(x: Any) -> bool:
  return isinstance(x, (int, float))


def _zeros(leaf: Any, offloaded: bool, dtype: Optional[Any], *, signed: bool) -> Any:
  """A zero moment for ``leaf``, in pinned_host if ``offloaded``, else beside the leaf.

  int8 makes a ``blockwise.BlockwiseMoment``: codes beside the leaf, scales sharded
  along the leaf's rows.
  """
  dtype = dtype or leaf.dtype
  if blockwise.is_blockwise(dtype):
    sharding = None if isinstance(leaf, jax.core.Tracer) else getattr(leaf, "sharding", None)
    scales = jax.ShapeDtypeStruct(blockwise.scales_shape(leaf.shape), jnp.float32,
                                  sharding=blockwise.scales_sharding(sharding, leaf.ndim))
    return blockwise.BlockwiseMoment(
        _zeros_like(leaf, blockwise.code_dtype(signed), offloaded),
        _zeros_like(scales, jnp.float32, offloaded))
  return _zeros_like(leaf, dtype, offloaded)


def _zeros_like(leaf: Any, dtype: Any, offloaded: bool) -> jax.Array:
  sharding = None if isinstance(leaf, jax.core.Tracer) else getattr(leaf, "sharding", None)
  if sharding is None:  # Traced: jit's sharding propagation places the zeros.
    moment = jnp.zeros(leaf.shape, dtype)
    return to_host(moment) if offloaded else moment
  if offloaded:
    # Filled from host zeros, so init never holds offloaded moments in device
    # memory, even briefly.
    return jax.device_put(np.zeros(leaf.shape, dtype), sharding.with_memory_kind(PINNED_HOST))
  return jnp.zeros(leaf.shape, dtype, device=sharding.with_memory_kind(DEVICE_KIND))


def _elementwise_adam(hyper: dict, dynamic: tuple[str, ...], stochastic_rounding: bool):
  """Adam's moment update and direction as ``streaming``'s elementwise function.

  Its scalars are the step count and the ``dynamic`` hyperparameters' values;
  the others are the numbers in ``hyper``. The new moments keep their inputs'
  dtypes, rounded stochastically into bfloat16 with ``stochastic_rounding``; a
  ``blockwise.BlockwiseMoment`` updates as its float32 value and is encoded again.
  The direction reads the new moments before they are rounded or encoded.
  """

  def adam(scalars, device_in, host_in):
    count, *values = scalars
    h = {**hyper, **dict(zip(dynamic, values))}
    (g,), (mu, nu) = device_in, host_in
    new_mu = otu.tree_update_moment(g, _value(mu), h["b1"], 1)
    new_nu = otu.tree_update_moment_per_elem_norm(g, _value(nu), h["b2"], 2)
    mu_hat = otu.tree_bias_correction(new_mu, h["b1"], count)
    nu_hat = otu.tree_bias_correction(new_nu, h["b2"], count)
    # optax adds eps_root (0.0 in optax.adamw) inside the root; keep its ops.
    direction = mu_hat / (jnp.sqrt(nu_hat + 0.0) + h["eps"])
    # Salted by the step, and differently for the two moments.
    return (direction,), (_store(new_mu, mu, 2 * count, stochastic_rounding, signed=True),
                          _store(new_nu, nu, 2 * count + 1, stochastic_rounding, signed=False))

  return adam


def _value(moment: Any) -> jax.Array:
  return moment.value() if isinstance(moment, blockwise.BlockwiseMoment) else moment


def _store(new: jax.Array, old: Any, seed: jax.Array, stochastic_rounding: bool, *,
           signed: bool) -> Any:
  """``new`` in ``old``'s storage."""
  if isinstance(old, blockwise.BlockwiseMoment):
    return blockwise.BlockwiseMoment.of(new, signed=signed)
  if stochastic_rounding:
    return stochastic_round(new, seed, old.dtype)
  return new.astype(old.dtype)


def scale_by_offloaded_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    *,
    mu_dtype: Optional[Any] = None,
    nu_dtype: Optional[Any] = None,
    stochastic_rounding: bool = False,
    offload_fraction: float = 1.0,
    offload_mask: OffloadMask | None = None,
    update_on: str = "host",
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    overlap_transfers: bool = False,
    shardings: Optional[Any] = None,
) -> optax.GradientTransformation:
  """Scales updates by Adam with ``optax.scale_by_adam``'s arithmetic, with moments partly in host memory.

  The moments (``mu`` and ``nu``) of the leaves chosen by ``offload_fraction``
  (see ``plan_offload``) or by ``offload_mask`` live in ``pinned_host`` memory;
  the other leaves' moments stay on the device and update as in optax.

  Args:
    b1: decay rate of the first moment.
    b2: decay rate of the second moment.
    eps: added to the denominator's square root.
    mu_dtype: dtype of the first moment; None keeps the parameters' dtype. int8
      stores 8-bit blocks (``jaxoffload.optim.blockwise``: a byte an element and a
      float32 scale per 256 elements of a row, as torchao's ``AdamW8bit``),
      encoded to the nearest level; the state leaf is then a
      ``blockwise.BlockwiseMoment``. Offloaded 8-bit moments need ``update_on="host"``.
    nu_dtype: dtype of the second moment, likewise.
    stochastic_rounding: round floating moments into bfloat16 up or down at random
      (``jaxoffload.rounding``) rather than to nearest, which leaves a bfloat16
      ``nu`` stuck: its per-step decay is below half a bfloat16 step.
    offload_fraction: share of parameter elements whose moments go to host
      memory, in [0.0, 1.0]; whole leaves are chosen, those whose share lies
      nearest (see ``plan_offload``).
    offload_mask: picks the offloaded leaves instead (a pytree of bools, or
      ``fn(path, leaf) -> bool``); leave ``offload_fraction`` at 1.0 with it.
    update_on: where offloaded leaves update. ``"host"``: gradients go to host
      memory, the host CPU updates the moments there and only the scaled
      update comes back. ``"device"``: the moments stream through the device in
      ``chunk_bytes`` pieces and go back. Both run the same arithmetic; on a
      GPU, its rounding and the host CPU's can differ in the last bit.
    chunk_bytes: with ``update_on="device"``, the most host state brought to
      the device at once, per leaf.
    overlap_transfers: with ``update_on="device"``, bring each piece in while
      the previous one updates (two pieces on the device at once): what
      Megatron's ``overlap_cpu_optimizer_d2h_h2d`` asks for.
    shardings: the parameters' ``NamedSharding``s, a tree like them; with
      ``update_on="device"``, each device streams its own shard of a sharded leaf's
      state, so that no piece crosses devices. Default: those of the parameters
      ``init`` receives, where they carry one (under a jitted ``init`` they do
      not: pass them).

  Returns:
    An ``optax.GradientTransformation``. Its state carries the ``OffloadPlan``;
    ``print(jaxoffload.find_offload_plan(state))`` shows the achieved share.

  Example:
    >>> opt = optax.chain(scale_by_offloaded_adam(offload_fraction=0.5), optax.scale(-1e-3))
    >>> state = opt.init(params)
    >>> def step(params, state, grads):
    ...   updates, state = opt.update(grads, state, params)
    ...   return optax.apply_updates(params, updates), state
    >>> shardings = jax.tree.map(lambda x: x.sharding, (params, state))
    >>> step = jax.jit(step, donate_argnums=(0, 1), out_shardings=shardings)
  """
  _check_update_on(update_on)
  if not isinstance(offload_fraction, jax.core.Tracer):
    check_fraction(offload_fraction)
    if offload_mask is not None and check_fraction(offload_fraction) != 1.0:
      raise ValueError(
          f"offload_mask picks the offloaded leaves itself; got offload_fraction="
          f"{offload_fraction!r} beside it. Leave offload_fraction at 1.0 with a mask.")
  if not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
    raise ValueError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
  if overlap_transfers and update_on != "device":
    raise ValueError(f"overlap_transfers=True streams through the device: it needs "
                     f"update_on='device', got {update_on!r}")
  mu_dtype = None if mu_dtype is None else jax.dtypes.canonicalize_dtype(mu_dtype)
  nu_dtype = None if nu_dtype is None else jax.dtypes.canonicalize_dtype(nu_dtype)
  for name, dtype in (("mu_dtype", mu_dtype), ("nu_dtype", nu_dtype)):
    if dtype is not None and not jnp.issubdtype(dtype, jnp.floating) and (
        not blockwise.is_blockwise(dtype)):
      raise ValueError(f"{name} must be a floating dtype or int8 (8-bit blocks), got {dtype}")

  def init_fn(params):
    params = array_values(params)
    _check_float_leaves(params)
    fraction = check_fraction(offload_fraction)
    plan = plan_offload(params, offload_fraction=fraction, offload_mask=offload_mask)
    if offload_mask is None and abs(plan.fraction - fraction) > FRACTION_TOLERANCE:
      warnings.warn(f"offload_fraction={fraction}: whole leaves offload "
                    f"{plan.fraction:.2f} of the parameter elements ({plan}); pick the leaves "
                    f"with offload_mask, or split large ones", stacklevel=2)
    blocks = [n for n, d in (("mu_dtype", mu_dtype), ("nu_dtype", nu_dtype))
              if blockwise.is_blockwise(d)]
    if blocks and update_on == "device" and any(plan.offloaded):
      raise ValueError(f"{blocks[0]}=int8 keeps 8-bit blocks, which update where they live: "
                       f"offloaded ones on the host; use update_on='host', got 'device'")
    if shardings is not None:
      try:
        given = plan.treedef.flatten_up_to(shardings)
      except (ValueError, TypeError) as error:
        raise ValueError(f"shardings must have the parameters' tree structure "
                         f"{plan.treedef}: {error}") from None
      plan = dataclasses.replace(plan, shardings=tuple(given))
    count = jnp.zeros([], jnp.int32)
    count_sharding = replicated_like(params)
    if count_sharding is not None:
      count = jax.device_put(count, count_sharding)
    return ScaleByOffloadedAdamState(
        count=count,
        mu=jax.tree.map(lambda p, o: _zeros(p, o, mu_dtype, signed=True), params, plan.mask),
        nu=jax.tree.map(lambda p, o: _zeros(p, o, nu_dtype, signed=False), params, plan.mask),
        plan=plan)

  def update_fn(updates, state, params=None):
    del params
    plan = state.plan
    grads, treedef = jax.tree.flatten(updates)
    if treedef != plan.treedef:
      raise ValueError(
          f"updates do not have the structure the state was initialised with: got "
          f"{treedef}, expected {plan.treedef}")
    count_inc = optax.safe_increment(state.count)
    # Hyperparameters given as arrays (optax.inject_hyperparams) are operands the
    # host path must receive in host memory; Python numbers stay compile-time
    # constants, as in optax, so that 1 - b1 is rounded as optax rounds it.
    hyper = {"b1": b1, "b2": b2, "eps": eps}
    dynamic = tuple(k for k, v in hyper.items() if not _is_static_number(v))
    scalars = (count_inc, *(jnp.asarray(hyper[k]) for k in dynamic))
    adam = _elementwise_adam(hyper, dynamic, stochastic_rounding)
    directions, new_mu, new_nu = [], [], []
    for g, mu, nu, offloaded, sharding in zip(
        grads, treedef.flatten_up_to(state.mu), treedef.flatten_up_to(state.nu),
        plan.offloaded, plan.shardings or (None,) * len(grads)):
      if not offloaded:
        (direction,), (mu, nu) = adam(scalars, (g,), (mu, nu))
      elif update_on == "host":
        (direction,), (mu, nu) = run_on_host(adam, scalars, (g,), (mu, nu))
      else:
        (direction,), (mu, nu) = run_streamed(adam, scalars, (g,), (mu, nu),
                                              chunk_bytes=chunk_bytes, overlap=overlap_transfers,
                                              sharding=sharding)
      directions.append(direction)
      new_mu.append(mu)
      new_nu.append(nu)
    new_state = ScaleByOffloadedAdamState(
        count=count_inc, mu=treedef.unflatten(new_mu), nu=treedef.unflatten(new_nu), plan=plan)
    return treedef.unflatten(directions), new_state

  return optax.GradientTransformation(init_fn, update_fn)


def offload_adamw(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-4,
    mask: Optional[Any] = None,
    *,
    mu_dtype: Optional[Any] = None,
    nu_dtype: Optional[Any] = None,
    stochastic_rounding: bool = False,
    offload_fraction: float = 1.0,
    offload_mask: OffloadMask | None = None,
    update_on: str = "host",
    overlap_transfers: bool = False,
    shardings: Optional[Any] = None,
) -> optax.GradientTransformation:
  """``optax.adamw`` with a chosen share of its moments in host memory.

  Args:
    learning_rate: a number or an optax schedule.
    b1, b2, eps, weight_decay, mask: as in ``optax.adamw``.
    mu_dtype, nu_dtype, stochastic_rounding, offload_fraction, offload_mask, update_on,
      overlap_transfers, shardings: as in ``scale_by_offloaded_adam``. Under
      ``optax.inject_hyperparams`` with a jitted ``init``, name ``offload_fraction``
      in ``static_args``.

  Returns:
    An ``optax.GradientTransformation`` that gives the same updates as
    ``optax.adamw`` with the same arguments.

  Example:
    >>> opt = offload_adamw(optax.cosine_decay_schedule(3e-4, 1000), offload_fraction=0.25)
    >>> opt_state = opt.init(params)
  """
  return optax.chain(
      scale_by_offloaded_adam(b1, b2, eps, mu_dtype=mu_dtype, nu_dtype=nu_dtype,
                              stochastic_rounding=stochastic_rounding,
                              offload_fraction=offload_fraction, offload_mask=offload_mask,
                              update_on=update_on, overlap_transfers=overlap_transfers,
                              shardings=shardings),
      optax.add_decayed_weights(weight_decay, mask),
      optax.scale_by_learning_rate(learning_rate),
  )
