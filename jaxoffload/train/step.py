"""The train step of a ``Setup``: placed parameters, optimizer state, and one jitted update.

One optimizer for every setting: ``optax.chain(optax.clip_by_global_norm,
X)`` where X is ``optax.adamw``, ``jaxoffload.offload_adamw`` (the plan's
leaves' moments in host memory), or, with the host kernel, ``optax.adamw``
masked to the device leaves. The host kernel's leaves send their raw
gradients to host memory as the backward pass makes them, and the clipping
factor after them: clipped on the device, they could leave only once every
gradient exists, since the factor needs the global norm.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax import tree_utils as otu

import jaxoffload
from jaxoffload import remat
from jaxoffload._compat import DEVICE_KIND, PINNED_HOST, to_device, to_host
from jaxoffload.host_offload import HostAdamW
from jaxoffload.model import Llama, next_token_loss
from jaxoffload.params import init_params
from jaxoffload.placement import leaf_path
from jaxoffload.train import rules
from jaxoffload.train.resolve import Setup


def optimizer(setup: Setup) -> optax.GradientTransformation:
  """Clipped AdamW on the schedule; its state partly in host memory with optimizer offload."""
  o = setup.config.optimizer
  hyper = dict(b1=o.adam_beta1, b2=o.adam_beta2, eps=o.adam_eps, weight_decay=o.weight_decay)
  compact = rules.compact_moments(setup.config)
  mu_dtype, nu_dtype = rules.moment_dtypes(setup.config)
  if setup.host_kernel:
    on_device = jax.tree.map(lambda offloaded: not offloaded, setup.offload.mask)
    adamw = optax.masked(optax.adamw(setup.schedule, **hyper), on_device)
  elif setup.offload is not None or compact:
    # With no offload, an empty mask: offload_adamw is optax.adamw with moment dtypes.
    mask = setup.offload.mask if setup.offload is not None else jax.tree.map(
        lambda _: False, setup.param_shapes)
    adamw = jaxoffload.offload_adamw(
        setup.schedule, **hyper, offload_mask=mask,
        update_on=o.optimizer_offload_update_on if setup.offload is not None else "device",
        overlap_transfers=o.overlap_cpu_optimizer_d2h_h2d, mu_dtype=mu_dtype, nu_dtype=nu_dtype,
        stochastic_rounding=compact)
  else:
    adamw = optax.adamw(setup.schedule, **hyper)
  return optax.chain(optax.clip_by_global_norm(o.clip_grad), adamw)


def host_adamw(setup: Setup, weights: list[jax.Array]) -> HostAdamW:
  """The host kernel's optimizer for the offloaded leaves' float32 ``weights``."""
  o = setup.config.optimizer
  return HostAdamW(weights, learning_rate=setup.schedule, b1=o.adam_beta1, b2=o.adam_beta2,
                   eps=o.adam_eps, weight_decay=o.weight_decay, delayed=o.delayed_update,
                   delay_after=o.delayed_update_after,
                   predict_weights=o.delayed_update_predict_weights,
                   device_dtypes=setup.transfer_dtypes)


class Moments(NamedTuple):
  """Adam's state as a checkpoint holds it, whatever held it: what any setting resumes from.

  Attributes:
    count: updates applied.
    mu: the first moments, a tree like the parameters. A leaf of the host kernel's
      may be a function that reads it (``read() -> array``), so that each is read
      only when its turn comes.
    nu: the second moments, likewise.
    host_kernel: the host kernel's delayed-update state (``HostAdamW.checkpoint``'s
      count, held gradients and predicted weights); None when it holds none.
  """

  count: int
  mu: Any
  nu: Any
  host_kernel: Optional[dict] = None


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
      self.opt_state = jax.device_put(self._opt.init(_device_shapes(setup)),
                                      self._state_shardings)
    else:
      self._load_moments(moments)

  @classmethod
  def from_shapes(cls, setup: Setup) -> "Trainer":
    """A trainer whose parameters and state are shapes and placements, nothing allocated: it
    compiles (``compile``, and XLA's memory analysis of the step) but does not step.

    Example:
      >>> analysis = Trainer.from_shapes(setup).compile(tokens).memory_analysis()
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
                            zip([p for p, h in zip(leaves, trainer._is_host) if h],
                                setup.transfer_dtypes if setup.host_kernel else [])]
    trainer.opt_state = jax.tree.map(struct, trainer._abstract_state, trainer._state_shardings)
    return trainer

  def _build(self, setup: Setup) -> None:
    """What the step is, from ``setup`` alone: the optimizer, where every leaf of the step's
    arguments lives, and the jitted step."""
    self.setup = setup
    self._treedef = jax.tree.structure(setup.param_shapes)
    self._is_host = list(setup.offload.offloaded if setup.host_kernel
                         else (False,) * self._treedef.num_leaves)
    self._host_shapes: list[jax.ShapeDtypeStruct] = []
    self._opt = optimizer(setup)
    self._abstract_state = jax.eval_shape(self._opt.init, _device_shapes(setup))
    self._state_shardings = _state_shardings(setup, self._abstract_state)
    shardings = jax.tree.leaves(setup.param_shardings)
    host_scalar = jax.sharding.NamedSharding(setup.mesh, jax.sharding.PartitionSpec(),
                                             memory_kind="pinned_host")
    out_shardings = ([s for s, h in zip(shardings, self._is_host) if not h],
                     self._state_shardings, None, None,
                     [s for s, h in zip(shardings, self._is_host) if h],
                     host_scalar if setup.host_kernel else None)
    self._step = jax.jit(self._train_step, donate_argnums=(0, 2), out_shardings=out_shardings)
    self._eval_loss = jax.jit(self._loss)
    self._compiled = None

  @property
  def host_params(self) -> list[jax.Array]:
    """What the step reads of the host kernel's leaves (none without it)."""
    return self._host_shapes if self.host is None else self.host.params

  def compile(self, tokens: jax.Array) -> jax.stages.Compiled:
    """Compiles the step for batches like ``tokens``; later steps run this program."""
    self._compiled = self._step.lower(self.params, self.host_params, self.opt_state,
                                      tokens).compile()
    return self._compiled

  def step(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One update from ``tokens``; returns the loss (before the update) and the gradients'
    global norm (before clipping)."""
    step = self._compiled or self._step
    self.params, self.opt_state, loss, grad_norm, host_grads, clip_factor = step(
        self.params, self.host_params, self.opt_state, tokens)
    if self.host is not None:
      self.host.update(host_grads, clip_factor)
    return loss, grad_norm

  def evaluate(self, tokens: jax.Array) -> jax.Array:
    """The loss on ``tokens`` at the current parameters, with no update."""
    return self._eval_loss(self.params, self.host_params, tokens)

  def checkpoint(self) -> dict:
    """The whole state as placement-free trees, for orbax: ``params`` (the host kernel's
    leaves as its float32 weights), ``mu`` and ``nu`` like it, and ``host_kernel`` with a
    delayed update's held gradients (see ``Moments``). Any setting of the same model resumes
    from it (``restore_targets``)."""
    mu, nu = (otu.tree_get(self.opt_state, name) for name in ("mu", "nu"))
    if self.host is None:
      return {"params": self._tree(self.params, []), "mu": mu, "nu": nu}
    host = self.host.checkpoint()
    items = {"params": self._tree(self.params, host.pop("params")),
             "mu": self._tree(self._device_only(mu), host.pop("mu")),
             "nu": self._tree(self._device_only(nu), host.pop("nu"))}
    if self.host.delayed:
      items["host_kernel"] = host
    return items

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
              for p in self._host_leaves(self.setup.param_shapes)]
      targets[name] = self._tree(placed, host)
    o = self.setup.config.optimizer
    if self.setup.host_kernel and o.delayed_update:  # As HostAdamW.checkpoint_target.
      wire = [like(p, s).update(dtype=d) for p, s, d in zip(
          self._host_leaves(self.setup.param_shapes), self._host_leaves(self.setup.param_shardings),
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

  def _device_only(self, tree: Any) -> list:
    """The leaves of ``tree`` the device optimizer holds (not the host kernel's)."""
    return [x for x, h in zip(self._treedef.flatten_up_to(tree), self._is_host) if not h]

  def _host_leaves(self, tree: Any) -> list:
    """The leaves of ``tree`` the host kernel holds."""
    return [x for x, h in zip(self._treedef.flatten_up_to(tree), self._is_host) if h]

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
    loss, grads = _loss_and_grads(setup, params, tokens)
    host_grads, clip_factor = [], None
    if setup.host_kernel:
      raw = [g for g, h in zip(jax.tree.leaves(grads), self._is_host) if h]
      host_grads = [to_host(g.astype(d)) for g, d in zip(raw, setup.transfer_dtypes)]
      # The norm in float32, as the host keeps these leaves.
      grads = jax.tree.map(lambda g, host: g.astype(jnp.float32) if host else g, grads,
                           setup.offload.mask)
    # The same norm as optax.clip_by_global_norm's in the optimizer below.
    grad_norm = optax.tree.norm(grads)
    if setup.host_kernel:
      # What clip_by_global_norm multiplies the device leaves' gradients by.
      max_norm = setup.config.optimizer.clip_grad
      clip_factor = to_host(jnp.where(grad_norm < max_norm, 1.0, max_norm / grad_norm))
    device_params = jax.tree.map(to_device, params)
    updates, opt_state = self._opt.update(grads, opt_state, device_params)
    new_params = optax.apply_updates(device_params, updates)
    new_params = jax.tree.map(lambda p, fetched: to_host(p) if fetched else p, new_params,
                              setup.fetched_by_model)
    return ([p for p, h in zip(jax.tree.leaves(new_params), self._is_host) if not h], opt_state,
            loss, grad_norm, host_grads, clip_factor)

def _device_shapes(setup: Setup) -> Any:
  """The parameters' shapes and shardings in device memory: what the optimizer's state is
  made from (host-resident weights must not be read, and offloaded state starts where the
  plan says)."""
  return jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s.with_memory_kind(
          DEVICE_KIND)), setup.param_shapes, setup.param_shardings)


def _state_shardings(setup: Setup, state: Any) -> Any:
  """Where each leaf of the optimizer state lives: a moment beside its parameter, in
  pinned_host where the plan offloads it, and a scalar replicated over the mesh (so that
  step 1 sees the placements every later step sees, and the step compiles once)."""
  offloaded = (setup.offload.offloaded if setup.offload is not None and not setup.host_kernel
               else (False,) * len(jax.tree.leaves(setup.param_shapes)))
  beside = {leaf_path(path): s.with_memory_kind(PINNED_HOST if off else DEVICE_KIND)
            for (path, s), off in zip(
                jax.tree_util.tree_flatten_with_path(setup.param_shardings)[0], offloaded)}
  replicated = jax.sharding.NamedSharding(setup.mesh, jax.sharding.PartitionSpec())

  def place(path, leaf):
    if not leaf.shape:
      return replicated
    state_path = leaf_path(path)  # Ends with its parameter's: "1/0/mu/embed/embedding".
    return beside[max((p for p in beside if state_path.endswith("/" + p)), key=len)]

  return jax.tree_util.tree_map_with_path(place, state)


def _init_params(setup: Setup) -> Any:
  """The parameters, each leaf written once, straight into its placement."""
  # Initialised as one stack and cut at the groups: every offload setting starts
  # from the same weights, so their losses can be compared step by step.
  one_stack = Llama(setup.model, remat.layer_groups(setup.model.num_layers))
  return init_params(one_stack, jax.random.PRNGKey(setup.config.train.seed),
                     jnp.zeros((1, 2), jnp.int32), setup.param_shardings, groups=setup.groups)


def _loss_and_grads(setup: Setup, params, tokens):
  """Mean loss and gradients over the micro-batches, the gradients in device memory."""
  model = setup.llama

  def grad_fn(params, tokens):
    value_and_grad = jax.value_and_grad(
        lambda p: next_token_loss(model.apply({"params": p}, tokens), tokens))
    # Gradients of weights kept in host memory arrive there.
    return jax.tree.map(to_device, value_and_grad(params))

  if setup.micro_batches == 1:
    return grad_fn(params, tokens)
  split = tokens.reshape(setup.micro_batches, -1, tokens.shape[-1])

  def accumulate(total, micro):
    return jax.tree.map(jnp.add, total, grad_fn(params, micro)), None

  # Summed in float32 whatever the leaves' dtype.
  zeros = (jnp.zeros(()), jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))
  (loss, grads), _ = jax.lax.scan(accumulate, zeros, split)
  return jax.tree.map(lambda x: x / setup.micro_batches, (loss, grads))
