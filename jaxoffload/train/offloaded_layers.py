"""A step's weight-offloaded layers (``model.cpu_offloading_weights``), a program per layer
(``train.overlap``): each brought to the device for the programs that read it, and, where
the device's AdamW updates them unclipped, updated a layer at a time.

A layer comes over by the runtime's own transfer (``moved.layer_to_device``), issued a
program ahead of the program that reads it, forward and backward.

Unclipped, the update of a layer needs nothing from the rest of the step: where the
device's AdamW holds a group (float32 moments, not streamed: ``groups_updated_by_layer``),
the last micro-batch's backward pass updates each of its layers as its gradients are made,
from the layer already on the device for its backward program, and the new layer goes back
to its stack in pinned_host beside the next layer's program (a copy out, then into the
stack's bytes on the host's cores). The step's update program leaves the group alone: the
group never crosses the link whole, as it must where the update needs the global norm
first.

Example:
  >>> layers = OffloadedLayers(piece, device_leaves, host_params, host, run, opt_state)
  >>> device, fetched = layers.get("layers_0_20", 3, forward=True)
  >>> grads = layers.update("layers_0_20", 3, device, grads)  # Its backward program's.
  >>> device_leaves, opt_state, ... = update(layers.taken_out(device_leaves),
  ...                                      layers.with_moments(opt_state), ...)
  >>> device_leaves = layers.finish(device_leaves)
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax import tree_utils as otu

from jaxoffload import layered, rounding, tensor_files
from jaxoffload._compat import PINNED_HOST
from jaxoffload.host_adam import writable_view
from jaxoffload.model import group_name
from jaxoffload.train.moved import PROGRAMS_AHEAD, layer_to_device, placed, wait_for

# How many layers' new weights may be in pinned_host beside their stack, on their way into
# it: the layer being written and those its copy is behind (the dispatching thread, kept
# within ``moved.PROGRAMS_AHEAD`` programs of the device, waits beyond that).
COPIES_WRITTEN_BACK = PROGRAMS_AHEAD + 1


def groups_updated_by_layer(setup: Any) -> set[str]:
  """The weight-offloaded groups that a step a program per layer updates a layer at a time in
  its backward pass: unclipped, those the device's own ``optax.adamw`` holds (float32
  moments in device memory, none of their leaves the host kernel's)."""
  if (not setup.runs_per_layer or setup.clips_gradients or setup.compact_moments
      or setup.offload is not None and not setup.host_kernel):
    return set()
  kernel = setup.offload.offloaded if setup.host_kernel else itertools.repeat(False)
  paths, _ = jax.tree_util.tree_flatten_with_path(setup.param_shapes)
  return ({group_name(g) for g in setup.groups if g.offload_weights}
          - {path[0].key for (path, _), host in zip(paths, kernel) if host})


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


@functools.cache
def _writer() -> concurrent.futures.ThreadPoolExecutor:
  # One thread: a layer's copy waits for its transfer, then copies on every core.
  return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="offloaded_layers")


def _write(stacks: list, index: int, layer: list) -> None:
  """Layer ``index`` of ``stacks`` (in pinned_host) overwritten by ``layer`` (its leaves, in
  pinned_host), shard by shard, once ``layer``'s copies have ended."""
  wait_for(layer)
  copies = []
  for stack, leaf in zip(stacks, layer):
    sources = {shard.device: shard.data for shard in leaf.addressable_shards}
    copies += [(writable_view(shard.data)[index], writable_view(sources[shard.device]), False)
               for shard in stack.addressable_shards]
  tensor_files.copy_blocks(copies)


class OffloadedLayers:
  """A step's weight-offloaded layers: sent ahead, updated a layer at a time where the group
  is (``PiecePrograms.updated_by_layer``), and written back.

  Args:
    piece: the step's ``PiecePrograms``.
    device_leaves, host_params: the device optimizer's leaves and the host kernel's.
    host: the host kernel (None: none, or compiling); its held update of a layer is applied
      before the layer is sent for a forward program.
    run: runs one program (``OverlappedStep``'s).
    opt_state: the device optimizer's state, whose moments of the groups updated here
      are taken out for the step (``with_moments`` puts them back).
    count: its update count, where the step has it already.
  """

  def __init__(self, piece: Any, device_leaves: list, host_params: list, host: Any,
               run: Callable, opt_state: Any, count: Optional[Any] = None):
    self.piece, self.device_leaves, self.host_params = piece, device_leaves, host_params
    self.host, self.run = host, run
    self._ahead: dict = {}  # Per layer (group, index), its leaves on their way over.
    self._writes: list[concurrent.futures.Future] = []
    # Per updated group, its parameter leaves' positions, moments and stacks.
    self._positions = {name: [piece.device_positions[i] for i in piece.device_ids[name]]
                       for name in piece.updated_by_layer}
    self._moments = {name: moments_of(opt_state, piece.programs.treedef, positions)
                     for name, positions in self._positions.items()}
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
    send = lambda leaves, ids: [layer_to_device(leaves[i], index) for i in ids]
    return (send(self.device_leaves, self.piece.device_ids.get(name, [])),
            send(self.host_params, self.piece.host_ids.get(name, [])))

  def update(self, name: str, index: int, weights: list, grads: dict) -> dict:
    """Where group ``name`` is updated a layer at a time: layer ``index``'s update from its
    backward program's ``grads`` (``PiecePrograms.backward``'s) and the ``weights`` it read,
    and its new weights on their way back to the stacks. Returns ``grads`` with the
    layer's device gradients taken and their squares added to those the update's global
    norm counts (``PiecePrograms.update``)."""
    if name not in self._moments:
      return grads
    host, square_sum, device = grads[name]
    new, mu, nu, squares = self.run(f"update {name}", self.piece.layer_update, (name,),
                                    weights, device, *self._moments[name], self._count,
                                    np.int32(index))
    self._moments[name] = mu, nu
    if isinstance(squares, jax.Array):  # Not while compiling.
      if len(self._writes) >= COPIES_WRITTEN_BACK - 1:  # No more in pinned_host at once.
        self._writes[-(COPIES_WRITTEN_BACK - 1)].result()
      stacks = [self.device_leaves[i] for i in self.piece.device_ids[name]]
      self._writes.append(_writer().submit(_write, stacks, index, placed(new, PINNED_HOST)))
    return {**grads, name: (host, square_sum + squares, [])}

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
    """Once the step's update program is dispatched: ``device_leaves`` (its outputs) with the
    updated groups' stacks, once their layers are written."""
    for write in self._writes:
      write.result()
    device_leaves = list(device_leaves)
    for name in self._moments:
      for i in self.piece.device_ids[name]:
        stack = self.device_leaves[i]
        # A new array over the same bytes: one that was read may keep what it read.
        device_leaves[i] = stack if not isinstance(stack, jax.Array) else (
            jax.make_array_from_single_device_arrays(
                stack.shape, stack.sharding, [s.data for s in stack.addressable_shards]))
    return device_leaves
