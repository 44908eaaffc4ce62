"""A run's trainer: placed parameters and optimizer state, and the jitted programs of a step.

A step is one program: the model's gradients over the micro-batches (summed on
the device), global-norm clipping and the update. With the host kernel its
leaves send their raw gradients to host memory as the backward pass makes
them, and the clipping factor after them: clipped on the device, they could
leave only once every gradient exists, since the factor needs the global norm.

With the host kernel and several micro-batches, a step is one program per
micro-batch, then one for the update: the host kernel's leaves' gradients of
each micro-batch go to host memory, where ``HostAdamW.accumulate`` sums them
while the device computes the next, so that the device holds no sum of
theirs; the update clips with the global norm that both sums make.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from optax import tree_utils as otu

from jaxoffload import remat, rounding
from jaxoffload._compat import DEVICE_KIND, PINNED_HOST, to_device, to_host
from jaxoffload.host_offload import HostAdamW
from jaxoffload.memory import compiled_device_bytes
from jaxoffload.model import Llama, next_token_loss
from jaxoffload.params import init_params
from jaxoffload.train.grads import loss_and_grads, mean_loss_and_grads, micro_batch
from jaxoffload.train.optimizer import (Moments, device_shapes, host_adamw, optimizer,
                                        state_shardings)
from jaxoffload.train.resolve import Setup


class CompiledStep(NamedTuple):
  """A step's compiled programs and the device memory they need.

  Attributes:
    programs: the step; or, summing on the host, the micro-batch's and the update's.
    device_bytes: XLA's device peak of the step: the largest program's arguments,
      outputs and temporaries (aliased donations once), with the state that stays
      in device memory beside it.
    host_temp_bytes: the largest program's host temporaries.
  """

  programs: tuple[jax.stages.Compiled, ...]
  device_bytes: int
  host_temp_bytes: int


class Trainer:
  """A run's parameters and optimizer state, and the jitted step that updates them.

  Attributes:
    params: the parameter leaves the step updates, in tree order: every leaf but
      the host kernel's.
    opt_state: the optimizer's state (``optimizer(setup)``).
    host: the host kernel's ``HostAdamW``, holding its leaves; None without it.

  Example:
    >>> setup = resolve(config)
    >>> trainer = Trainer(setup)
    >>> loss = trainer.step(setup.global_batch(0))
  """

  def __init__(self, setup: Setup, params: Any = None, moments: Optional[Moments] = None):
    """Places ``params`` (None: initialised from the seed) and ``moments`` (None: zeros)."""
    self._build(setup)
    leaves = jax.tree.leaves(_init_params(setup) if params is None else params)
    self.params = [p for p, h in zip(leaves, self._is_host) if not h]
    self.host: Optional[HostAdamW] = (
        host_adamw(setup, [p for p, h in zip(leaves, self._is_host) if h]) if setup.host_kernel
        else None)
    if moments is None:
      self.opt_state = jax.device_put(self._opt.init(device_shapes(setup)),
                                      self._state_shardings)
    else:
      self._load_moments(moments)

  @classmethod
  def from_shapes(cls, setup: Setup) -> "Trainer":
    """A trainer whose parameters and state are shapes and placements, nothing allocated: it
    compiles (``compile``, with XLA's memory analysis of the step) but does not step.

    Example:
      >>> device_bytes = Trainer.from_shapes(setup).compile(tokens).device_bytes
    """
    trainer = cls.__new__(cls)
    trainer._build(setup)
    struct = lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    leaves = [struct(x, s) for x, s in zip(jax.tree.leaves(setup.param_shapes),
                                           jax.tree.leaves(setup.param_shardings))]
    trainer.params = [p for p, h in zip(leaves, trainer._is_host) if not h]
    trainer.host = None
    # What HostAdamW.params would be: each leaf in the dtype the device reads it in.
    trainer._host_shapes = [jax.ShapeDtypeStruct(p.shape, d, sharding=p.sharding) for p, d in
                            zip(trainer._host_leaves(leaves),
                                setup.transfer_dtypes if setup.host_kernel else [])]
    trainer.opt_state = jax.tree.map(struct, trainer._abstract_state, trainer._state_shardings)
    return trainer

  def _build(self, setup: Setup) -> None:
    """What the step is, from ``setup`` alone: the optimizer, where every leaf of the step's
    arguments lives, and the jitted programs."""
    self.setup = setup
    self._treedef = jax.tree.structure(setup.param_shapes)
    self._is_host = list(setup.offload.offloaded if setup.host_kernel
                         else (False,) * self._treedef.num_leaves)
    self._host_shapes: list[jax.ShapeDtypeStruct] = []
    self._opt = optimizer(setup)
    self._abstract_state = jax.eval_shape(self._opt.init, device_shapes(setup))
    self._state_shardings = state_shardings(setup, self._abstract_state)
    shardings = jax.tree.leaves(setup.param_shardings)
    replicated = jax.sharding.NamedSharding(setup.mesh, jax.sharding.PartitionSpec())
    host_scalar = replicated.with_memory_kind(PINNED_HOST) if setup.host_kernel else None
    device_leaves, host_leaves = self._device_only(shardings), self._host_leaves(shardings)
    self._step = jax.jit(self._train_step, donate_argnums=(0, 2), out_shardings=(
        device_leaves, self._state_shardings, None, None, host_leaves, host_scalar))
    self.sums_on_host = setup.host_kernel and setup.micro_batches > 1
    if self.sums_on_host:
      sums = (replicated, [s.with_memory_kind(DEVICE_KIND) for s in device_leaves])
      self._zero_sums = jax.jit(self._zeros, out_shardings=sums)
      self._micro_step = jax.jit(self._micro_grads, donate_argnums=(2,),
                                 out_shardings=(sums, host_leaves))
      self._update_step = jax.jit(self._apply_sums, donate_argnums=(0, 1), out_shardings=(
          device_leaves, self._state_shardings, None, None, host_scalar))
    self._eval_loss = jax.jit(self._loss)
    self._compiled: tuple[jax.stages.Compiled, ...] = ()

  @property
  def host_params(self) -> list[jax.Array]:
    """What the step reads of the host kernel's leaves (none without it)."""
    return self._host_shapes if self.host is None else self.host.params

  def compile(self, tokens: jax.Array) -> CompiledStep:
    """Compiles the step for batches like ``tokens``; later steps run these programs."""
    if not self.sums_on_host:
      self._compiled = (self._step.lower(self.params, self.host_params, self.opt_state,
                                         tokens).compile(),)
      analysis = self._compiled[0].memory_analysis()
      return CompiledStep(self._compiled, compiled_device_bytes(analysis),
                          analysis.host_temp_size_in_bytes)
    sums = jax.eval_shape(self._zero_sums)
    self._compiled = (
        self._micro_step.lower(self.params, self.host_params, sums, tokens, 0).compile(),
        self._update_step.lower(self.params, self.opt_state, sums, 0.0).compile())
    micro, update = (program.memory_analysis() for program in self._compiled)
    # The optimizer state stays in device memory while the micro-batches run.
    resident = _device_bytes(self.opt_state)
    return CompiledStep(self._compiled, max(compiled_device_bytes(micro) + resident,
                                            compiled_device_bytes(update)),
                        max(micro.host_temp_size_in_bytes, update.host_temp_size_in_bytes))

  def step(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One update from ``tokens``; returns the loss (before the update) and the gradients'
    global norm (before clipping)."""
    if self.sums_on_host:
      return self._step_summing_on_host(tokens)
    step = self._compiled[0] if self._compiled else self._step
    self.params, self.opt_state, loss, grad_norm, host_grads, clip_factor = step(
        self.params, self.host_params, self.opt_state, tokens)
    if self.host is not None:
      self.host.update(host_grads, clip_factor)
    return loss, grad_norm

  def _step_summing_on_host(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``step`` a micro-batch at a time, the host summing its leaves' gradients."""
    micro_step, update_step = self._compiled or (self._micro_step, self._update_step)
    sums, pending = self._zero_sums(), None
    for index in range(self.setup.micro_batches):
      sums, host_grads = micro_step(self.params, self.host_params, sums, tokens, index)
      if pending is not None:  # The previous micro-batch's, while the device computes this one.
        self.host.accumulate(pending)
      pending = host_grads
    squares = self.host.accumulate(pending, square_sum=True)
    if jax.process_count() > 1:  # Each process summed its own shards.
      squares = float(np.sum(multihost_utils.process_allgather(np.float64(squares))))
    self.params, self.opt_state, loss, grad_norm, host_scale = update_step(
        self.params, self.opt_state, sums, squares)
    self.host.update((), host_scale)
    return loss, grad_norm

  def evaluate(self, tokens: jax.Array) -> jax.Array:
    """The loss on ``tokens`` at the current parameters, with no update."""
    return self._eval_loss(self.params, self.host_params, tokens)

  def checkpoint(self) -> dict:
    """The whole state as placement-free trees, for orbax: ``params`` (the host kernel's
    leaves as its float32 weights), ``mu`` and ``nu`` like it, and ``host_kernel`` with a
    delayed update's held gradients (see ``Moments``). Any setting of the same model resumes
    from it (``restore_targets``). Host-resident leaves are the live buffers: save them
    before the next step (``holds_host_state``)."""
    mu, nu = (otu.tree_get(self.opt_state, name) for name in ("mu", "nu"))
    if self.host is None:
      return {"params": self._tree(self.params, []), "mu": mu, "nu": nu}
    host = self.host.checkpoint(copy=False)  # The save finishes before the next update.
    # The device optimizer's moments of the host kernel's leaves are MaskedNodes.
    device = lambda tree: self._device_only(self._treedef.flatten_up_to(tree))
    items = {"params": self._tree(self.params, host.pop("params")),
             "mu": self._tree(device(mu), host.pop("mu")),
             "nu": self._tree(device(nu), host.pop("nu"))}
    if self.host.delayed:
      items["host_kernel"] = host
    return items

  @property
  def holds_host_state(self) -> bool:
    """Whether the state has buffers in host memory that a step updates in place or donates:
    a checkpoint reads them where they are, and must finish before the next step."""
    return self.host is not None or any(
        x.sharding.memory_kind == PINNED_HOST for x in jax.tree.leaves(
            (self.params, self.opt_state)))

  def restore_targets(self) -> dict:
    """What ``checkpoint`` returns, as this trainer's shapes, dtypes and placements: where
    orbax reads a checkpoint to. The host kernel's moments have no placement (``sharding``
    None): they are read into numpy, one leaf at a time."""
    like = lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    targets = {"params": jax.tree.map(like, self.setup.param_shapes, self.setup.param_shardings)}
    for name in ("mu", "nu"):
      placed = jax.tree.leaves(jax.tree.map(like, otu.tree_get(self._abstract_state, name),
                                            otu.tree_get(self._state_shardings, name)))
      host = [jax.ShapeDtypeStruct(p.shape, jnp.float32, sharding=None)
              for p in self._host_leaves(jax.tree.leaves(self.setup.param_shapes))]
      targets[name] = self._tree(placed, host)
    o = self.setup.config.optimizer
    if self.setup.host_kernel and o.delayed_update:  # As HostAdamW.checkpoint_target.
      wire = [like(p, s).update(dtype=d) for p, s, d in zip(
          self._host_leaves(jax.tree.leaves(self.setup.param_shapes)),
          self._host_leaves(jax.tree.leaves(self.setup.param_shardings)),
          self.setup.transfer_dtypes)]
      targets["host_kernel"] = {"count": np.array(0, np.int64), "held_grads": wire,
                                "held_scale": jax.ShapeDtypeStruct((), jnp.float32),
                                **({"device_params": wire} if o.delayed_update_predict_weights
                                   else {})}
    return targets

  def _load_moments(self, moments: Moments) -> None:
    """The optimizer state from ``moments``, each leaf where this setting keeps it."""
    read = lambda x: x() if callable(x) else x
    mu, nu = jax.tree.leaves(moments.mu), jax.tree.leaves(moments.nu)
    if self.host is not None:
      picked = lambda leaves: (read(x) for x, h in zip(leaves, self._is_host) if h)
      self.host.load_moments({"count": moments.count, **(moments.host_kernel or {}),
                              "mu": picked(mu), "nu": picked(nu)})
    unflatten = lambda leaves: self._treedef.unflatten(
        [optax.MaskedNode() if h else x for x, h in zip(leaves, self._is_host)])
    state = otu.tree_set(self._abstract_state, mu=unflatten(mu), nu=unflatten(nu))
    # What is left unset is the step counts, each its own buffer (the step donates them).
    self.opt_state = jax.tree.map(
        lambda x, s: x if isinstance(x, jax.Array) else jax.device_put(
            np.asarray(moments.count, x.dtype), s), state, self._state_shardings)

  def _device_only(self, leaves: list) -> list:
    """Of one entry per parameter leaf, those the device optimizer holds."""
    return [x for x, h in zip(leaves, self._is_host) if not h]

  def _host_leaves(self, leaves: list) -> list:
    """Of one entry per parameter leaf, those the host kernel holds."""
    return [x for x, h in zip(leaves, self._is_host) if h]

  def _tree(self, device_leaves, host_leaves) -> Any:
    device, host = iter(device_leaves), iter(host_leaves)
    return self._treedef.unflatten([next(host) if h else next(device) for h in self._is_host])

  def _model_params(self, device_leaves, host_leaves) -> Any:
    """The parameter tree as the model reads it."""
    params = self._tree(device_leaves, host_leaves)
    # The model brings weight-offloaded groups to the device layer by layer;
    # the host kernel's other leaves come now.
    return jax.tree.map(lambda p, fetched: p if fetched else to_device(p), params,
                        self.setup.fetched_by_model)

  def _loss(self, device_leaves, host_leaves, tokens):
    model = self.setup.llama
    params = self._model_params(device_leaves, host_leaves)
    return next_token_loss(model.apply({"params": params}, tokens), tokens)

  def _train_step(self, device_leaves, host_leaves, opt_state, tokens):
    setup = self.setup
    params = self._model_params(device_leaves, host_leaves)
    loss, grads = mean_loss_and_grads(setup.llama, params, tokens, setup.micro_batches)
    host_grads = []
    if setup.host_kernel:
      host_grads = [to_host(g.astype(d))
                    for g, d in zip(self._host_leaves(jax.tree.leaves(grads)),
                                    setup.transfer_dtypes)]
      # The norm in float32, as the host keeps these leaves.
      grads = jax.tree.map(lambda g, host: g.astype(jnp.float32) if host else g, grads,
                           setup.offload.mask)
    new_leaves, opt_state, grad_norm, clip_factor = self._update(params, grads, opt_state)
    return new_leaves, opt_state, loss, grad_norm, host_grads, clip_factor

  def _zeros(self):
    """The sums a step starts from: the loss's, and the device leaves' gradients' (float32)."""
    return jnp.zeros(()), [jnp.zeros(p.shape, jnp.float32)
                           for p in self._device_only(jax.tree.leaves(self.setup.param_shapes))]

  def _micro_grads(self, device_leaves, host_leaves, sums, tokens, index):
    """Micro-batch ``index``'s loss and device gradients added into ``sums``, and the host
    kernel's leaves' gradients sent to host memory, in the dtypes they travel in."""
    setup = self.setup
    params = self._model_params(device_leaves, host_leaves)
    # The host kernel's leaves that the model fetches send their gradients to host memory
    # layer by layer: they stay there.
    left_on_host = self._treedef.unflatten(
        [f and h for f, h in zip(jax.tree.leaves(setup.fetched_by_model), self._is_host)])
    loss, grads = loss_and_grads(setup.llama, params,
                                 micro_batch(tokens, setup.micro_batches, index), left_on_host)
    leaves = jax.tree.leaves(grads)
    loss_sum, totals = sums
    totals = [t + g.astype(jnp.float32) for t, g in zip(totals, self._device_only(leaves))]
    return (loss_sum + loss, totals), [
        to_host(g.astype(d)) for g, d in zip(self._host_leaves(leaves), setup.transfer_dtypes)]

  def _apply_sums(self, device_leaves, opt_state, sums, host_squares):
    """The update from the micro-batches' sums: their mean, clipped by the global norm, to
    which the host kernel's leaves add ``host_squares`` (their sums' squares, summed)."""
    setup = self.setup
    count = setup.micro_batches
    loss_sum, totals = sums
    device = iter([t / count for t in totals])
    # The host kernel's leaves stand in as one number whose square is their share of the
    # squared norm, and zeros: the clipping reads them, the masked AdamW never does.
    stand_ins = iter([jnp.sqrt(host_squares) / count] + [jnp.zeros(())] * len(self._is_host))
    grads = self._treedef.unflatten([next(stand_ins) if h else next(device)
                                     for h in self._is_host])
    params = self._tree(device_leaves, [jnp.zeros(())] * sum(self._is_host))
    new_leaves, opt_state, grad_norm, clip_factor = self._update(params, grads, opt_state)
    # The host applies the sums themselves: the mean's division goes with the clipping.
    return new_leaves, opt_state, loss_sum / count, grad_norm, clip_factor / count

  def _update(self, params, grads, opt_state):
    """Clipping and the device optimizer's update: the new device leaves, the state, the
    global norm (before clipping) and, with the host kernel, its clipping factor."""
    setup = self.setup
    # The same norm as optax.clip_by_global_norm's in the optimizer.
    grad_norm = optax.tree.norm(grads)
    clip_factor = None
    if setup.host_kernel:
      # What clip_by_global_norm multiplies the device leaves' gradients by.
      max_norm = setup.config.optimizer.clip_grad
      clip_factor = to_host(jnp.where(grad_norm < max_norm, 1.0, max_norm / grad_norm))
    device_params = jax.tree.map(to_device, params)
    updates, opt_state = self._opt.update(grads, opt_state, device_params)
    # bfloat16 parameters move by their updates in expectation (optimizer.main_params_dtype).
    count = otu.tree_get_all_with_path(opt_state, "count")[0][1]
    new_params = rounding.apply_updates(device_params, updates, count)
    new_params = jax.tree.map(lambda p, fetched: to_host(p) if fetched else p, new_params,
                              setup.fetched_by_model)
    return self._device_only(jax.tree.leaves(new_params)), opt_state, grad_norm, clip_factor


def _init_params(setup: Setup) -> Any:
  """The parameters, each leaf written once, straight into its placement."""
  # Initialised as one stack and cut at the groups: every offload setting starts
  # from the same weights, so their losses can be compared step by step.
  one_stack = Llama(setup.model, remat.layer_groups(setup.model.num_layers))
  return init_params(one_stack, jax.random.PRNGKey(setup.config.train.seed),
                     jnp.zeros((1, 2), jnp.int32), setup.param_shardings, groups=setup.groups)


def resident_device_bytes(trainer: Trainer) -> int:
  """The bytes one device holds of ``trainer``'s parameters and optimizer state between
  steps (arrays, or the shapes of ``Trainer.from_shapes``)."""
  return _device_bytes((trainer.params, trainer.opt_state))


def _device_bytes(tree: Any) -> int:
  """The bytes one device holds of ``tree``'s leaves in device memory (arrays or shapes)."""
  return max((sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
                  for x in jax.tree.leaves(tree) if x.sharding.memory_kind == DEVICE_KIND
                  and device in x.sharding.device_set)
              for device in {d for x in jax.tree.leaves(tree) for d in x.sharding.device_set}),
             default=0)
