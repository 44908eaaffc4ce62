"""What the trainer moves between a step's programs (``train.per_layer.overlap``): activations to
pinned_host and back, and the layers of weights kept in pinned_host to the device.

A moved layer's forward program keeps its activations on the device; a copy
to pinned_host starts as the program ends, beside the next layer's program.
The device original is let go once its copy has ended: until then the device
holds it anyway (the copy reads it). Going backward, a layer's activations
are wanted one layer ahead of its backward program. Where the original is
still held then (the link is behind the device), the program reads it and
nothing comes back: at the end of a fast forward pass the last layers'
copies have not ended, and waiting for them to end and come back would
leave the device idle. Elsewhere the copy starts back beside the layer
above's backward program.

Each choice is made as Python dispatches programs; ``Moves.dispatched`` keeps
Python within ``PROGRAMS_AHEAD`` programs of the device, so that a copy seen
unfinished is unfinished a few programs before the device needs it, and the
copies back start a few programs, not a whole pass, before they are wanted
(each takes device memory as it starts).

Example:
  >>> moves = Moves()
  >>> moves.dispatched(outputs)         # After each program of the step.
  >>> layer = moves.leave(kept)         # As its forward program is dispatched.
  >>> moves.ahead(layer)                # As the layer above's backward program is.
  >>> kept = moves.on_device(layer)     # For its own.

A weight-offloaded group's layer comes to the device by the runtime's own transfer
(``layer_to_device``), issued a program ahead of the program that reads it: a program that
cut it out of the stack would run in turn with the compute, the transfer runs beside it.
"""

from __future__ import annotations

import collections
from typing import Any, Optional

import jax
import numpy as np

from jaxoffload._compat import DEVICE_KIND, PINNED_HOST
from jaxoffload.host.adam import writable_view

# How many programs the dispatching thread may run ahead of the device while activations
# move: two keep one queued behind the one running.
PROGRAMS_AHEAD = 2


class DeviceScalars:
  """The small integers a step's programs take (a layer's index, a micro-batch's), each on
  the device once, replicated over ``mesh``. A NumPy integer would cross the link as its
  program is called, on the stream that carries the layers sent ahead, and the program
  would wait behind them.

  Example:
    >>> scalars = DeviceScalars(mesh)
    >>> y, kept = pieces.forward("layers", device, fetched, scalars(3), x)
  """

  def __init__(self, mesh: jax.sharding.Mesh):
    self._sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    self._made: dict[int, jax.Array] = {}

  def __call__(self, value: int) -> jax.Array:
    """``value`` as an int32 on the device, placed the first time it is asked for."""
    if value not in self._made:
      self._made[value] = jax.device_put(np.int32(value), self._sharding)
    return self._made[value]

  def shape(self, value: int) -> jax.ShapeDtypeStruct:
    """What ``self(value)`` is, for compiling without placing it."""
    del value  # Every one alike.
    return jax.ShapeDtypeStruct((), np.int32, sharding=self._sharding)


def placed(arrays: list, memory_kind: str) -> list:
  """``arrays`` in ``memory_kind`` (a copy each that runs beside the device's programs; none
  where they are there already); shapes, while compiling, as they are."""
  return [_to_memory_kind(x, memory_kind)
          if isinstance(x, jax.Array) and x.sharding.memory_kind != memory_kind else x
          for x in arrays]


def _to_memory_kind(x: jax.Array, memory_kind: str) -> jax.Array:
  """``x`` copied to ``memory_kind``. Where this process holds only some of its shards, a
  copy per shard: JAX would otherwise run a program over all the devices."""
  sharding = x.sharding.with_memory_kind(memory_kind)
  if x.is_fully_addressable:
    return jax.device_put(x, sharding)
  shards = [jax.device_put(s.data, s.data.sharding.with_memory_kind(memory_kind))
            for s in x.addressable_shards]
  return jax.make_array_from_single_device_arrays(x.shape, sharding, shards)


def layer_sharding(stack_sharding: jax.sharding.NamedSharding) -> jax.sharding.NamedSharding:
  """Where one layer of a stack placed by ``stack_sharding`` goes on the device: as the stack,
  less its (unsharded) layer axis."""
  return jax.sharding.NamedSharding(stack_sharding.mesh,
                                    jax.sharding.PartitionSpec(*stack_sharding.spec[1:]),
                                    memory_kind=DEVICE_KIND)


def pinned_views(stack: Any) -> Optional[list]:
  """Each shard of ``stack`` (in pinned_host) as its device and a numpy view of its bytes, once
  the program that wrote them has ended (a step's first layer waits for the last update
  anyway); None for a shape, while compiling. The views stay valid while ``stack``, or an
  array it was donated to in place, lives."""
  if not isinstance(stack, jax.Array):
    return None
  stack.block_until_ready()
  return [(shard.device, writable_view(shard.data)) for shard in stack.addressable_shards]


def layer_to_device(stack: Any, index: int, views: Optional[list] = None) -> Any:
  """Layer ``index`` of ``stack`` (a group's stacked weights in pinned_host) on the device:
  each shard's layer sent from a numpy view of its pinned bytes (``views``, default
  ``pinned_views(stack)``), a transfer that runs beside the device's programs; the shape,
  while compiling. Its layer axis is never sharded (``sharding.LOGICAL_RULES``)."""
  sharding = layer_sharding(stack.sharding)
  views = views or pinned_views(stack)
  if views is None:
    return jax.ShapeDtypeStruct(stack.shape[1:], stack.dtype, sharding=sharding)
  # The transfer reads the bytes behind JAX's back, which is why the views wait for the
  # program that wrote them.
  layers = [jax.device_put(view[index], device) for device, view in views]
  return jax.make_array_from_single_device_arrays(stack.shape[1:], sharding, layers)


def wait_for(arrays: list) -> None:
  """Waits until ``arrays`` are written; those a later program took (donated) are gone, and
  any other one of the same program ends with them."""
  jax.block_until_ready([x for x in arrays if not x.is_deleted()])


def copy_ended(copy: list) -> bool:
  """Whether every array of ``copy`` is written (shapes, while compiling, are)."""
  return all(x.is_ready() for x in copy if isinstance(x, jax.Array))


class MovedLayer:
  """One layer's moved activations.

  Attributes:
    original: on the device, as its forward program kept them; None once let go.
    copy: in pinned_host; None once the original is chosen for the backward program.
    back: the copy brought back to the device; None until it starts back.
  """

  def __init__(self, kept: list):
    self.original = kept
    self.copy = placed(kept, PINNED_HOST)
    self.back = None


class Moves:
  """A step's moved layers, their originals let go as their copies end."""

  def __init__(self):
    # Those whose originals are held, in the order they left: their copies end in it.
    self._held: collections.deque[MovedLayer] = collections.deque()
    # The outputs of the programs the device may not have run yet.
    self._programs: collections.deque[list] = collections.deque()

  def dispatched(self, outputs: Any) -> None:
    """After a program is dispatched, with its outputs: waits for the program
    ``PROGRAMS_AHEAD`` before it, then lets go of the originals whose copies have ended."""
    self._programs.append([x for x in jax.tree.leaves(outputs) if isinstance(x, jax.Array)])
    if len(self._programs) > PROGRAMS_AHEAD:
      wait_for(self._programs.popleft())
    self.release()

  def leave(self, kept: list) -> MovedLayer:
    """Starts a layer's activations to pinned_host."""
    layer = MovedLayer(kept)
    self._held.append(layer)
    return layer

  def release(self) -> None:
    """Lets go of the originals whose copies have ended."""
    while self._held and copy_ended(self._held[0].copy):
      self._held.popleft().original = None

  def ahead(self, layer: MovedLayer) -> None:
    """Chooses where ``layer``'s backward program reads its activations, a layer ahead: the
    original while it is held, else the copy, which starts back now."""
    if layer.back is not None or layer.copy is None:  # Chosen already.
      return
    if layer.original is not None:  # Released up to the last program (``dispatched``).
      held = self._held.pop()
      assert held is layer, "the backward pass takes moved layers in the reverse order"
      layer.copy = None
    else:
      layer.back = placed(layer.copy, DEVICE_KIND)

  def on_device(self, layer: MovedLayer) -> list:
    """``layer``'s activations on the device, for its backward program."""
    self.ahead(layer)
    return layer.original if layer.original is not None else layer.back
