"""A step's weight-offloaded layers (``model.cpu_offloading_weights``), a program per layer
(``train.per_layer.overlap``): each brought to the device for the programs that read it, and, where
the device's AdamW updates them unclipped, updated a layer at a time.

A layer comes over by the runtime's own transfer (``moved.layer_to_device``), issued a
program ahead of the program that reads it, forward and backward.

Unclipped, the update of a layer needs nothing from the rest of the step: where the
device's AdamW holds a group (float32 moments, not streamed:
``Setup.weights_updated_by_layer``), the last micro-batch's backward pass updates each of
its layers as its gradients are made, from the layer already on the device for its backward
program, and the next layer's backward program writes the new layer into its stacks in
pinned_host in place (the stacks donated to it), so that the copy out runs beside that
program's compute; the last layer's goes after it, in a program of its own. The step's
update program leaves the group alone: the group never crosses the link whole, as it must
where the update needs the global norm first. The sends read each stack through views
taken before any write (``moved.pinned_views``).

Example:
  >>> layers = OffloadedLayers(piece, device_leaves, host_params, host, run, scalars,
  ...                          opt_state)
  >>> device, fetched = layers.get("layers_0_20", 3, forward=True)
  >>> written = layers.pending("layers_0_20")  # For layer 3's backward program to write.
  >>> grads = layers.update("layers_0_20", 3, device, grads, stacks)  # That program's.
  >>> device_leaves, opt_state, ... = update(layers.taken_out(device_leaves),
  ...                                      layers.with_moments(opt_state), ...)
  >>> device_leaves = layers.finish(device_leaves)
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax
from optax import tree_utils as otu

from jaxoffload import rounding
from jaxoffload._compat import to_host
from jaxoffload.nn import layered
from jaxoffload.nn.model import group_name
from jaxoffload.train.per_layer.moved import layer_to_device, pinned_views
from jaxoffload.train.setup import Setup


def adamw_layer(adamw: optax.GradientTransformation, weights: list, grads: list, mu: list,
                nu: list, count: jax.Array, index: jax.Array) -> tuple:
  """Layer ``index``'s update by ``adamw`` at update ``count`` (before it), as the update of
  the whole stacks makes it: ``(new weights, mu, nu, the gradients' squares summed)``, each
  moment a stack with the layer's replaced."""
  state = otu.tree_set(adamw.init(weights), mu=[layered.layer_slice(m, index) for m in mu],
                       nu=[layered.layer_slice(v, index) for v in nu], count=count)
  updates, state = adamw.update(grads, state, weights)
  # Salted as the step's update salts a bfloat16 weight's rounding: with the count after it.
  new = rounding.apply_updates(weights, updates, count + 1)
  put = lambda stacks, name: [jax.lax.dynamic_update_index_in_dim(s, x, index, 0)
                              for s, x in zip(stacks, otu.tree_get(state, name))]
  squares = sum((jnp.sum(jnp.square(g.astype(jnp.float32))) for g in grads), jnp.zeros(()))
  return new, put(mu, "mu"), put(nu, "nu"), squares


def moments_of(opt_state: Any, treedef: Any, positions: list[int]) -> tuple[list, list]:
  """The first and second moments, from ``opt_state``, of the parameter leaves at
  ``positions`` (in ``treedef``'s order)."""
  pick = lambda name: [treedef.flatten_up_to(otu.tree_get(opt_state, name))[i]
                       for i in positions]
  return pick("mu"), pick("nu")


def with_moments(opt_state: Any, treedef: Any, positions: list[int], mu: list, nu: list
                 ) -> Any:
  """``opt_state`` with the moments of the parameter leaves at ``positions`` replaced."""
  def put(name, values):
    leaves = treedef.flatten_up_to(otu.tree_get(opt_state, name))
    for i, x in zip(positions, values):
      leaves[i] = x
    return treedef.unflatten(leaves)

  return otu.tree_set(opt_state, mu=put("mu", mu), nu=put("nu", nu))


def write_layer(stacks: list, layer: list, index: jax.Array) -> list:
  """``stacks`` (in pinned_host) with layer ``index`` overwritten by ``layer`` (on the
  device): in place where the stacks are donated."""
  return [jax.lax.dynamic_update_index_in_dim(stack, to_host(x), index, 0)
          for stack, x in zip(stacks, layer)]


class OffloadedLayers:
  """A step's weight-offloaded layers: sent ahead, updated a layer at a time where the group
  is (``PiecePrograms.updated_by_layer``), and written back.

  Args:
    piece: the step's ``PiecePrograms``.
    device_leaves, host_params: the device optimizer's leaves and the host kernel's (an
      updated group's stacks replaced, in a copy of the list, as programs write them).
    host: the host kernel (None: none, or compiling); its held update of a layer is applied
      before the layer is sent for a forward program.
    run: runs one program (``OverlappedStep``'s).
    scalars: an index's integer for a program (``moved.DeviceScalars``).
    opt_state: the device optimizer's state, whose moments of the groups updated here
      are taken out for the step (``with_moments`` puts them back).
    count: its update count, where the step has it already.
  """

  def __init__(self, piece: Any, device_leaves: list, host_params: list, host: Any,
               run: Callable, scalars: Callable, opt_state: Any, count: Optional[Any] = None):
    self.piece, self.device_leaves, self.host_params = piece, list(device_leaves), host_params
    self.host, self.run, self.scalars = host, run, scalars
    self._ahead: dict = {}  # Per layer (group, index), its leaves on their way over.
    # Per stack sent from (device leaves' or host kernel's, position), its views, taken
    # before any write; and the stacks they view, alive until the step ends.
    self._views: dict = {}
    self._stacks: list = []
    # Per updated group: its leaves' positions among the parameters, their moments, and
    # its last updated layer, (index, new weights), until a program writes it.
    self._positions = {name: [piece.device_positions[i] for i in piece.device_ids[name]]
                       for name in piece.updated_by_layer}
    self._moments = {name: moments_of(opt_state, piece.programs.treedef, positions)
                     for name, positions in self._positions.items()}
    self._pending: dict = {}
    if self._moments and count is None:
      count = run("count", piece.count, (), opt_state)
    self._count = count

  def get(self, name: str, index: int, forward: bool) -> tuple[list, list]:
    """Layer ``index`` of group ``name`` on the device (its device leaves and its host kernel
    leaves), and the next program's layer (the one above going forward, below going
    backward) sent after it, to come over while this one's program runs."""
    layer = self._ahead.pop((name, index), None) or self._send(name, index, forward)
    group = self.piece.layer_groups[name]
    following = index + 1 if forward else index - 1
    if 0 <= following < group.stop - group.start:
      self._ahead[(name, following)] = self._send(name, following, forward)
    return layer

  def _send(self, name: str, index: int, forward: bool) -> tuple[list, list]:
    """Starts layer ``index`` of group ``name`` to the device: its device leaves and, going
    forward once its held update is applied, its host kernel leaves."""
    if self.host is not None and forward:
      self.host.apply_held(self.piece.host_pieces(name, index))

    def send(leaves, ids, kind):
      for i in ids:
        if (kind, i) not in self._views:
          self._views[(kind, i)] = pinned_views(leaves[i])
          self._stacks.append(leaves[i])
      return [layer_to_device(leaves[i], index, self._views[(kind, i)]) for i in ids]

    return (send(self.device_leaves, self.piece.device_ids.get(name, []), "device"),
            send(self.host_params, self.piece.host_ids.get(name, []), "host"))

  def pending(self, name: str) -> Optional[tuple]:
    """What the next backward program of group ``name`` writes, at the index above its own:
    ``(its stacks, the last updated layer's new weights)``, given up to that program; None
    if nothing."""
    if name not in self._pending:
      return None
    return self._stacks_of(name), self._pending.pop(name)[1]

  def _stacks_of(self, name: str) -> list:
    """Group ``name``'s stacks of the device optimizer's leaves, as the last program left them."""
    return [self.device_leaves[i] for i in self.piece.device_ids[name]]

  def update(self, name: str, index: int, weights: list, grads: dict,
             stacks: Optional[list] = None) -> dict:
    """Where group ``name`` is updated a layer at a time: layer ``index``'s update from its
    backward program's ``grads`` (``PiecePrograms.backward``'s) and the ``weights`` it read,
    its new weights kept for the next program to write; ``stacks``: the group's stacks
    that program wrote (None: it wrote none). Returns ``grads`` with the layer's device
    gradients taken and their squares added to those the update's global norm counts
    (``PiecePrograms.update``)."""
    if name not in self._moments:
      return grads
    self._replace(name, stacks)
    host, square_sum, device = grads[name]
    new, mu, nu, squares = self.run(f"update {name}", self.piece.layer_update, (name,),
                                    weights, device, *self._moments[name], self._count,
                                    self.scalars(index))
    self._moments[name] = mu, nu
    self._pending[name] = index, new
    if isinstance(squares, jax.Array):  # Not shapes, while compiling.
      square_sum = square_sum + squares
    return {**grads, name: (host, square_sum, [])}

  def _replace(self, name: str, stacks: Optional[list]) -> None:
    if stacks is not None:
      for i, stack in zip(self.piece.device_ids[name], stacks):
        self.device_leaves[i] = stack

  def taken_out(self, device_leaves: list) -> list:
    """``device_leaves`` as the step's update program takes them: None for the stacks of the
    groups updated a layer at a time."""
    taken = {i for name in self._moments for i in self.piece.device_ids[name]}
    return [None if i in taken else x for i, x in enumerate(device_leaves)]

  def with_moments(self, opt_state: Any) -> Any:
    """``opt_state`` with the updated groups' moments as the backward pass left them."""
    for name, positions in self._positions.items():
      opt_state = with_moments(opt_state, self.piece.programs.treedef, positions,
                               *self._moments[name])
    return opt_state

  def finish(self, device_leaves: list) -> list:
    """After the step's update program: ``device_leaves`` (its outputs) with the updated
    groups' stacks, their last layers written."""
    for name, (index, new) in self._pending.items():
      self._replace(name, self.run(f"write {name}", self.piece.write_layer, (),
                                   self._stacks_of(name), new, self.scalars(index)))
    self._pending.clear()
    device_leaves = list(device_leaves)
    for name in self._moments:
      for i in self.piece.device_ids[name]:
        device_leaves[i] = self.device_leaves[i]
    return device_leaves


def offloaded_group_bytes(setup: Setup) -> tuple[int, int]:
  """One device's bytes of the weight-offloaded group: a layer's as it crosses the link to
  each program that reads it (the host kernel's leaves in the dtype the host keeps them
  in), and the whole group's device optimizer leaves, which its update brings over and
  back (none where the backward pass updates it a layer at a time, each layer going back
  beside the next one's program: ``offloaded_layers``)."""
  groups = {group_name(g): g.stop - g.start for g in setup.groups if g.offload_weights}
  by_layer = setup.weights_updated_by_layer
  offloaded = setup.offload.offloaded if setup.offload else itertools.repeat(False)
  kept_as = iter(setup.weight_transfer_dtypes)
  layer = updated = 0
  paths, _ = jax.tree_util.tree_flatten_with_path(setup.param_shapes)
  for (path, x), sharding, off in zip(paths, jax.tree.leaves(setup.param_shardings), offloaded):
    host = off and setup.host_kernel
    dtype = next(kept_as) if host else x.dtype
    if path[0].key in groups:
      elements = math.prod(sharding.shard_shape(x.shape))
      layer += elements * dtype.itemsize // groups[path[0].key]
      updated += 0 if host or path[0].key in by_layer else elements * x.dtype.itemsize
  return layer, updated
