"""The jitted programs of a training step, from a ``Setup`` alone.

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

from typing import Any

import jax
import jax.numpy as jnp
import optax
from optax import tree_utils as otu

from jaxoffload import rounding
from jaxoffload._compat import DEVICE_KIND, PINNED_HOST, to_device, to_host
from jaxoffload.nn.model import next_token_loss
from jaxoffload.train.grads import add_to_sum, loss_and_grads, mean_loss_and_grads, micro_batch
from jaxoffload.train.optimizer import device_shapes, optimizer, state_shardings
from jaxoffload.train.setup import Setup


class StepPrograms:
  """A step's optimizer, where each leaf of its arguments lives, and its jitted programs.

  Attributes:
    setup: what the run was resolved to.
    optimizer: the device's optimizer (``optimizer.optimizer``).
    abstract_state: its state's shapes; ``state_shardings`` where each leaf lives.
    is_host: per parameter leaf, whether the host kernel holds it.
    step: ``(device leaves, host kernel's leaves, state, tokens) -> (device leaves,
      state, loss, global norm, host kernel's gradients, its clipping factor)``.
    zero_sums, micro_step, update_step: with ``Setup.sums_on_host``, a step is
      ``micro_step`` per micro-batch, the host summing its leaves' gradients, then
      ``update_step``.
    eval_loss: the loss at the current parameters.
  """

  def __init__(self, setup: Setup):
    self.setup = setup
    self.treedef = jax.tree.structure(setup.param_shapes)
    self.is_host = list(setup.offload.offloaded if setup.host_kernel
                        else (False,) * self.treedef.num_leaves)
    self.optimizer = optimizer(setup)
    self.abstract_state = jax.eval_shape(self.optimizer.init, device_shapes(setup))
    self.state_shardings = state_shardings(setup, self.abstract_state)
    shardings = jax.tree.leaves(setup.param_shardings)
    replicated = jax.sharding.NamedSharding(setup.mesh, jax.sharding.PartitionSpec())
    host_scalar = replicated.with_memory_kind(PINNED_HOST) if setup.host_kernel else None
    device_leaves, host_leaves = self.device_only(shardings), self.host_leaves(shardings)
    self.step = jax.jit(self._train_step, donate_argnums=(0, 2), out_shardings=(
        device_leaves, self.state_shardings, None, None, host_leaves, host_scalar))
    # apply_sums's: the device leaves, the state, the loss, the norm, the host's factor.
    self.update_shardings = (device_leaves, self.state_shardings, None, None, host_scalar)
    if setup.sums_on_host:
      sums = (replicated, [s.with_memory_kind(DEVICE_KIND) for s in device_leaves])
      self.zero_sums = jax.jit(self._zeros, out_shardings=sums)
      self.micro_step = jax.jit(self._micro_grads, donate_argnums=(2,),
                                out_shardings=(sums, host_leaves))
      self.update_step = jax.jit(self.apply_sums, donate_argnums=(0, 1),
                                 out_shardings=self.update_shardings)
    self.eval_loss = jax.jit(self._loss)

  def device_only(self, leaves: list) -> list:
    """Of one entry per parameter leaf, those the device optimizer holds."""
    return [x for x, h in zip(leaves, self.is_host) if not h]

  def host_leaves(self, leaves: list) -> list:
    """Of one entry per parameter leaf, those the host kernel holds."""
    return [x for x, h in zip(leaves, self.is_host) if h]

  def tree(self, device_leaves, host_leaves) -> Any:
    """The parameters' tree of the device optimizer's leaves and the host kernel's."""
    device, host = iter(device_leaves), iter(host_leaves)
    return self.treedef.unflatten([next(host) if h else next(device) for h in self.is_host])

  def model_params(self, device_leaves, host_leaves) -> Any:
    """The parameter tree as the model reads it."""
    params = self.tree(device_leaves, host_leaves)
    # The model brings weight-offloaded groups to the device layer by layer;
    # the host kernel's other leaves come now.
    return jax.tree.map(lambda p, fetched: p if fetched else to_device(p), params,
                        self.setup.fetched_by_model)

  def _loss(self, device_leaves, host_leaves, tokens):
    model = self.setup.llama
    params = self.model_params(device_leaves, host_leaves)
    return next_token_loss(model.apply({"params": params}, tokens), tokens)

  def _train_step(self, device_leaves, host_leaves, opt_state, tokens):
    setup = self.setup
    params = self.model_params(device_leaves, host_leaves)
    loss, grads = mean_loss_and_grads(setup.llama, params, tokens, setup.micro_batches,
                                      setup.grad_accum_dtype, step=step_count(opt_state))
    host_grads = []
    if setup.host_kernel:
      host_grads = [to_host(g.astype(d))
                    for g, d in zip(self.host_leaves(jax.tree.leaves(grads)),
                                    setup.transfer_dtypes)]
      # The norm in float32, as the host keeps these leaves.
      grads = jax.tree.map(lambda g, host: g.astype(jnp.float32) if host else g, grads,
                           setup.offload.mask)
    new_leaves, opt_state, grad_norm, clip_factor = self._update(params, grads, opt_state)
    return new_leaves, opt_state, loss, grad_norm, host_grads, self._to_host(clip_factor)

  def _zeros(self):
    """The sums a step starts from: the loss's, and the device leaves' gradients' (in
    ``Setup.grad_accum_dtype``)."""
    return jnp.zeros(()), [jnp.zeros(p.shape, self.setup.grad_accum_dtype)
                           for p in self.device_only(jax.tree.leaves(self.setup.param_shapes))]

  def _micro_grads(self, device_leaves, host_leaves, sums, tokens, index, step):
    """Micro-batch ``index``'s loss and device gradients added into ``sums`` (at update
    ``step``, which salts their rounding), and the host kernel's leaves' gradients sent to
    host memory, in the dtypes they travel in."""
    setup = self.setup
    params = self.model_params(device_leaves, host_leaves)
    # The host kernel's leaves that the model fetches send their gradients to host memory
    # layer by layer: they stay there.
    left_on_host = self.treedef.unflatten(
        [f and h for f, h in zip(jax.tree.leaves(setup.fetched_by_model), self.is_host)])
    loss, grads = loss_and_grads(setup.llama, params,
                                 micro_batch(tokens, setup.micro_batches, index), left_on_host)
    leaves = jax.tree.leaves(grads)
    loss_sum, totals = sums
    salt = step * setup.micro_batches + index
    totals = [add_to_sum(t, g, salt) for t, g in zip(totals, self.device_only(leaves))]
    return (loss_sum + loss, totals), [
        to_host(g.astype(d)) for g, d in zip(self.host_leaves(leaves), setup.transfer_dtypes)]

  def apply_sums(self, device_leaves, opt_state, sums, host_squares, *, count=None):
    """The update from the micro-batches' sums: their mean, clipped by the global norm, to
    which the host kernel's leaves add ``host_squares`` (their sums' squares, summed).
    ``count``: how many micro-batches the sums are over (the config's unless given; 1 for
    sums that are their mean already)."""
    setup = self.setup
    count = count or setup.micro_batches
    loss_sum, totals = sums
    device = iter([t.astype(jnp.float32) / count for t in totals])
    # The host kernel's leaves stand in as one number whose square is their share of the
    # squared norm, and zeros: the clipping reads them, the masked AdamW never does.
    stand_ins = iter([jnp.sqrt(host_squares) / count] + [jnp.zeros(())] * len(self.is_host))
    grads = self.treedef.unflatten([next(stand_ins) if h else next(device)
                                     for h in self.is_host])
    params = self.tree(device_leaves, [jnp.zeros(())] * sum(self.is_host))
    new_leaves, opt_state, grad_norm, clip_factor = self._update(params, grads, opt_state)
    # The host applies the sums themselves: the mean's division goes with the clipping.
    return (new_leaves, opt_state, loss_sum / count, grad_norm,
            self._to_host(clip_factor, count))

  def _to_host(self, clip_factor, count: int = 1):
    """The clipping factor over ``count`` where the host kernel reads it (computed on the
    device first: arithmetic on a value in host memory would make XLA compute on the host);
    None without the host kernel."""
    return to_host(clip_factor / count) if self.setup.host_kernel else None

  def _update(self, params, grads, opt_state):
    """Clipping and the device optimizer's update: the new device leaves, the state, the
    global norm (before clipping) and, with the host kernel, its clipping factor (on the
    device)."""
    setup = self.setup
    # The same norm as optax.clip_by_global_norm's in the optimizer.
    grad_norm = optax.tree.norm(grads)
    clip_factor = None
    if setup.host_kernel:
      # What clip_by_global_norm multiplies the device leaves' gradients by.
      max_norm = setup.config.optimizer.clip_grad
      clip_factor = (jnp.where(grad_norm < max_norm, 1.0, max_norm / grad_norm)
                     if setup.clips_gradients else jnp.ones(()))
    device_params = jax.tree.map(to_device, params)
    updates, opt_state = self.optimizer.update(grads, opt_state, device_params)
    # bfloat16 parameters move by their updates in expectation (optimizer.main_params_dtype).
    new_params = rounding.apply_updates(device_params, updates, step_count(opt_state))
    new_params = jax.tree.map(lambda p, fetched: to_host(p) if fetched else p, new_params,
                              setup.fetched_by_model)
    return self.device_only(jax.tree.leaves(new_params)), opt_state, grad_norm, clip_factor


def step_count(opt_state: Any) -> jax.Array:
  """The updates applied so far, as the optimizer's state counts them."""
  return otu.tree_get_all_with_path(opt_state, "count")[0][1]
