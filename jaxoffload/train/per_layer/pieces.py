"""The step's programs a piece of the model each, for ``jaxoffload.train.per_layer.overlap``.

The embedding, each layer and the head forward (``jax.vjp``: each keeps the
activations its pullback needs, a layer's without its weights and input,
``layered.layer_forward``), the layers and the embedding backward (a layer's
from those weights and input again), and the device optimizer's update. The
host kernel's weights come to the device a piece at a time (``fetch``); each
program that makes gradients either adds them into the micro-batches' sums or,
for the step's last micro-batch, makes the host kernel's share in the dtype it
travels in, cut as the weights it updates (the step copies it to host memory as
the program ends, beside the next program), and keeps the rest.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxoffload._compat import DEVICE_KIND, to_device
from jaxoffload.nn import layered, remat
from jaxoffload.nn.model import group_name
from jaxoffload.train.grads import add_to_sum, micro_batch
from jaxoffload.train.optimizer import plain_adamw
from jaxoffload.train.per_layer.offloaded_layers import (adamw_layer, moments_of, with_moments,
                                                         write_layer)
from jaxoffload.train.programs import StepPrograms, step_count


class PiecePrograms:
  """The jitted programs of a step run a piece of the model at a time.

  Example:
    >>> pieces = PiecePrograms(programs)
    >>> y, kept = pieces.forward("layers", device, fetched, np.int32(0), x)
  """

  def __init__(self, programs: StepPrograms):
    setup = self.setup = programs.setup
    self.programs = programs
    self.model = setup.llama
    self.layer_groups = {group_name(g): g for g in setup.groups}
    # Where the trainer moves activations (``Setup.moves_activations``), a layer's forward
    # program keeps on the device what its group offloads, and the step sends that to
    # pinned_host as the program ends (``train.per_layer.overlap``): the groups it does so for.
    self.moved = {name for name, g in self.layer_groups.items()
                  if setup.moves_activations and g.placements is not None
                  and remat.Placement.OFFLOAD in remat.check_placements(g.placements).values()}
    self.forward_groups = {name: _kept_on_device(g) if name in self.moved else g
                           for name, g in self.layer_groups.items()}
    # Groups whose weights live in pinned_host (``model.cpu_offloading_weights``): each program
    # reads a layer the step brings over for it (``train.per_layer.overlap``), and lets it go as it ends.
    self.weights_offloaded = {name for name, g in self.layer_groups.items() if g.offload_weights}
    self.head = layered.head_names(self.model)
    # Those the head program makes gradients for: a shared embedding's share goes to the
    # embedding's backward program.
    self.head_grads = tuple(name for name in self.head if name != layered.EMBED)
    # Per top-level parameter name: its leaves' positions among the device optimizer's
    # leaves and among the host kernel's, and which of its leaves are the host kernel's.
    self.device_ids, self.host_ids, self.is_host = {}, {}, {}
    counts = {True: 0, False: 0}
    paths, _ = jax.tree_util.tree_flatten_with_path(setup.param_shapes)
    for (path, _), host in zip(paths, programs.is_host):
      name = path[0].key
      self.is_host.setdefault(name, []).append(host)
      (self.host_ids if host else self.device_ids).setdefault(name, []).append(counts[host])
      counts[host] += 1
    # Each device optimizer leaf's position among all the parameter leaves.
    self.device_positions = [i for i, host in enumerate(programs.is_host) if not host]
    # Weight-offloaded groups whose backward pass updates them a layer at a time
    # (``train.per_layer.offloaded_layers``).
    self.updated_by_layer = setup.weights_updated_by_layer
    self.wire = setup.transfer_dtypes
    # Where each host kernel leaf's gradient goes: cut as its weights (a layer's, as a layer
    # of them), so that each shard meets the shard of weights it updates.
    self.grad_shardings = {}
    for (path, _), sharding, host in zip(paths, jax.tree.leaves(setup.param_shardings),
                                         programs.is_host):
      if host:
        spec = sharding.spec[1:] if path[0].key in self.layer_groups else sharding.spec
        self.grad_shardings[len(self.grad_shardings)] = jax.sharding.NamedSharding(
            sharding.mesh, jax.sharding.PartitionSpec(*spec), memory_kind=DEVICE_KIND)
    self.micro_batches = setup.micro_batches
    # Per layer group: where its backward programs find their pullbacks' leaves, recorded as
    # its forward program is traced (``layered.PullbackLayout``).
    self.layouts: dict[str, layered.PullbackLayout] = {}
    self.count = jax.jit(step_count)
    self.fetch = jax.jit(self._fetch_piece, static_argnums=0)
    self.forward = jax.jit(self._layer_forward, static_argnums=0)
    self.embed_forward = jax.jit(self._embed_forward_piece)
    # Programs that make gradients, by whether they add them into sums that the next
    # micro-batch's programs take (the sums then given up) or make the step's own.
    self.head_step = {adds: jax.jit(self._head_piece, static_argnums=0,
                                    donate_argnums=(5, 6) if adds else ())
                      for adds in (True, False)}
    self.backward = {adds: jax.jit(self._layer_backward, static_argnums=(0, 1),
                                   donate_argnums=(7, 8, 11) if adds else (7, 11))
                     for adds in (True, False)}
    self.embed_backward = {adds: jax.jit(self._embed_backward_piece, static_argnums=0,
                                         donate_argnums=(4,) if adds else ())
                           for adds in (True, False)}
    self.update = jax.jit(self._apply_update, donate_argnums=(0, 1),
                          out_shardings=programs.update_shardings)
    self.layer_update = jax.jit(
        lambda name, *args: adamw_layer(plain_adamw(setup), *args), static_argnums=0,
        donate_argnums=(3, 4))
    self.write_layer = jax.jit(write_layer, donate_argnums=0)

  def host_pieces(self, name: str, index: Any = None) -> list[tuple[int, Any]]:
    """The host kernel's pieces of parameter ``name`` (layer ``index`` of a group's)."""
    return [(leaf, index) for leaf in self.host_ids.get(name, [])]

  def _params(self, name: str, device: list, fetched: list, index: Any = None) -> Any:
    """Parameter ``name``'s tree on the device from its device leaves and its fetched host
    kernel leaves (``_fetch_piece``), layer ``index`` of a group's (a weight-offloaded
    group's leaves come as the layer already, ``train.per_layer.overlap``)."""
    if name in self.weights_offloaded:  # Sent as the host keeps them.
      fetched = [x.astype(self.wire[i]) for x, i in zip(fetched, self.host_ids.get(name, []))]
    device, fetched = iter(device), iter(fetched)
    leaves = [next(fetched) if h else next(device) for h in self.is_host[name]]
    if index is not None and name not in self.weights_offloaded:
      leaves = [x if h else layered.layer_slice(x, index)
                for x, h in zip(leaves, self.is_host[name])]
    return jax.tree.structure(self.setup.param_shapes[name]).unflatten(
        [to_device(x) for x in leaves])

  def _fetch_piece(self, name: str, host: list, index: Any) -> list:
    """Parameter ``name``'s host kernel leaves on the device, cut to layer ``index`` first
    (None: whole): only the layer comes over, rounded to the dtype it travels in where the
    host keeps no copy in it (``Setup.weight_transfer_dtypes``)."""
    return [to_device(x if index is None else layered.layer_slice(x, index)).astype(self.wire[i])
            for x, i in zip(host, self.host_ids.get(name, []))]

  def _finish(self, name: str, grads: Any, sums: Any, step: Any, micro: Any, last: bool
              ) -> Any:
    """Parameter ``name``'s gradients, from one micro-batch: added into ``sums`` (None: the
    first), or, for the ``last``, the step's, split for the host and the device
    (``_split``): the sums' mean, as ``grads.mean_loss_and_grads`` makes it."""
    n = self.micro_batches
    if n == 1:
      return self._split(name, grads)
    leaves = jax.tree.leaves(grads)
    if sums is None:
      sums = [jnp.zeros(g.shape, self.setup.grad_accum_dtype) for g in leaves]
    sums = [add_to_sum(t, g, step * n + micro) for t, g in zip(sums, leaves)]
    if not last:
      return sums
    return self._split(name, jax.tree.structure(grads).unflatten(
        [t.astype(jnp.float32) / n for t in sums]))

  def _split(self, name: str, grads: Any) -> tuple[list, jax.Array, list]:
    """Parameter ``name``'s gradients: the host kernel's in the dtype they travel in, on the
    device (``train.per_layer.overlap`` copies them to host memory outside the program, so that the
    copy runs beside the next one), the sum of their squares (in float32, as the host
    keeps them), the rest."""
    host, device = [], []
    for g, h in zip(jax.tree.leaves(grads), self.is_host[name]):
      (host if h else device).append(g)
    ids = self.host_ids.get(name, [])
    square_sum = sum((jnp.sum(jnp.square(g.astype(jnp.float32))) for g in host), jnp.zeros(()))
    sent = [jax.lax.with_sharding_constraint(g.astype(self.wire[i]), self.grad_shardings[i])
            for g, i in zip(host, ids)]
    return sent, square_sum, device

  def _embed_forward_piece(self, device, fetched, tokens, micro):
    params = self._params(layered.EMBED, device, fetched)
    tokens = micro_batch(tokens, self.micro_batches, micro)
    return jax.vjp(lambda p: layered.embed(self.model, p, tokens), params)

  def _layer_forward(self, name, device, fetched, index, x):
    """Layer ``index`` of group ``name`` on ``x``: ``(its output, what its backward program
    takes beside its weights and x)``."""
    y, self.layouts[name], kept = layered.layer_forward(
        self.model, self.forward_groups[name], self._params(name, device, fetched, index), x)
    return y, kept

  def _head_piece(self, last, head, x, tokens, micro, loss_sum, sums, step):
    """The loss summed over the micro-batches so far, its gradient at the last layer's
    output, a shared embedding's share of its gradient (None unless shared) and the head's
    gradients (``_finish``)."""
    params = {name: self._params(name, *head[name]) for name in self.head}
    tokens = micro_batch(tokens, self.micro_batches, micro)
    loss, pullback = jax.vjp(lambda p, x: layered.head_loss(self.model, p, x, tokens), params, x)
    grads, dx = pullback(jnp.ones_like(loss))
    shared = grads.pop(layered.EMBED, None)  # Summed with the embedding's own share.
    sums = sums or {}
    return (loss if loss_sum is None else loss_sum + loss), dx, shared, {
        name: self._finish(name, g, sums.get(name), step, micro, last) for name, g in grads.items()}

  def _layer_backward(self, name, last, device, fetched, index, x, kept, dy, sums, step, micro,
                      written):
    """The gradients at layer ``index``'s input and of its weights (``_finish``), from the
    same arguments as its forward program (x only where its layout takes it) and what that
    kept; and, given ``written`` (``OffloadedLayers.pending``), its stacks with the layer
    above written, a copy out beside this layer's compute."""
    grads, dx = layered.backward(self.layouts[name], kept,
                                 self._params(name, device, fetched, index), x, dy)
    return (dx, {name: self._finish(name, grads, sums, step, micro, last)},
            written and write_layer(*written, index + 1))

  def _embed_backward_piece(self, last, pullback, dx, shared, sums, step, micro):
    (grads,) = pullback(dx)
    if shared is not None:
      grads = jax.tree.map(jnp.add, grads, shared)
    return {layered.EMBED: self._finish(layered.EMBED, grads, sums, step, micro, last)}

  def _apply_update(self, device_leaves, opt_state, loss_sum, device_grads, squares):
    """The device optimizer's update, with the global norm that every leaf's gradients make
    (the gradients are the micro-batches' mean already; ``squares``: the sums of the
    squares of those it is not given). The groups updated a layer at a time come as None,
    and so go: they stand in for the norm as the host kernel's leaves do, and their
    moments leave as they came."""
    grads = [None] * len(device_leaves)
    for name, parts in device_grads.items():
      if name in self.updated_by_layer:  # Their gradients went to their layers' updates.
        continue
      if name in self.layer_groups:  # A program per layer, the last layer first.
        leaves = [jnp.stack(layers) for layers in zip(*reversed(parts))]
      else:
        (leaves,) = parts
      for position, g in zip(self.device_ids.get(name, []), leaves):
        grads[position] = g
    taken = [i for name in self.updated_by_layer for i in self.device_ids[name]]
    if not taken:
      return self.programs.apply_sums(device_leaves, opt_state,
                                      (loss_sum / self.micro_batches, grads), sum(squares),
                                      count=1)
    stand_ins = iter([jnp.sqrt(sum(squares))] + [jnp.zeros(())] * len(taken))
    for i in taken:
      grads[i], device_leaves[i] = next(stand_ins), jnp.zeros(())
    positions = [self.device_positions[i] for i in taken]
    moments = moments_of(opt_state, self.programs.treedef, positions)
    new_leaves, new_state, *rest = self.programs.apply_sums(
        device_leaves, opt_state, (loss_sum / self.micro_batches, grads), jnp.zeros(()),
        count=1)
    for i in taken:
      new_leaves[i] = None
    return (new_leaves, with_moments(new_state, self.programs.treedef, positions, *moments),
            *rest)


def _kept_on_device(group: remat.LayerGroup) -> remat.LayerGroup:
  """``group`` saving on the device what it offloads."""
  placements = {name: remat.Placement.SAVE if p is remat.Placement.OFFLOAD else p
                for name, p in remat.check_placements(group.placements).items()}
  return dataclasses.replace(group, placements=placements)
