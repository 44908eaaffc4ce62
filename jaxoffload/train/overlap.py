"""A host-kernel step whose update overlaps the next step's forward pass, a layer at a time.

With the host kernel, wherever it can (``Setup.overlaps_host_update``), a step
runs the model as a program per piece (``jaxoffload.layered``): the
embedding, each layer and the head forward, then each layer and the
embedding backward, then the device optimizer's update. The host kernel
holds step t's gradients (``HostAdamW.hold``) and its thread applies them in
the order step t + 1's forward programs read them; each forward program is
dispatched once its pieces are applied: the device computes the first layers
while the host updates the later ones.
The update is the single program's (exact, the same clipping); only when the
host applies it moves. A step's host gradients leave the device as each
layer's backward program ends. Without clipping (``optimizer.clip_grad=0``)
the update needs no global norm, and the thread starts on each piece as soon
as its gradient is on the host: during this step's backward pass. With
clipping, after a step that did not clip, it starts so too, as if this step
would not clip either (``optimizer.speculate_cpu_optimizer_step``,
``HostAdamW.hold(speculative=True)``); a step that does clip has its update
taken back and applied again, scaled.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxoffload import layered
from jaxoffload._compat import DEVICE_KIND, to_device, to_host
from jaxoffload.host_offload import HostAdamW
from jaxoffload.model import group_name
from jaxoffload.train.programs import StepPrograms


class OverlappedStep:
  """A step's programs, a piece of the model each, and the order the host updates in.

  Example:
    >>> step = OverlappedStep(programs)
    >>> device_leaves, opt_state, loss, grad_norm = step(device_leaves, host, opt_state, tokens)
  """

  def __init__(self, programs: StepPrograms):
    setup = self.setup = programs.setup
    self.programs = programs
    self.model = setup.llama
    self.layer_groups = {group_name(g): g for g in setup.groups}
    self.head = layered.head_names(self.model)
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
    self.wire = setup.transfer_dtypes
    # The host kernel's pieces in the order the forward programs first read them (a shared
    # embedding's by the embedding's and the head's).
    self.update_order = list(dict.fromkeys([
        *self._pieces(layered.EMBED),
        *(piece for name, group in self.layer_groups.items()
          for index in range(group.stop - group.start) for piece in self._pieces(name, index)),
        *(piece for name in self.head for piece in self._pieces(name))]))
    # Where each host kernel leaf's gradient goes: cut as its weights (a layer's, as a layer
    # of them), so that each shard meets the shard of weights it updates.
    self.grad_shardings = {}
    for (path, _), sharding, host in zip(paths, jax.tree.leaves(setup.param_shardings),
                                         programs.is_host):
      if host:
        spec = sharding.spec[1:] if path[0].key in self.layer_groups else sharding.spec
        self.grad_shardings[len(self.grad_shardings)] = jax.sharding.NamedSharding(
            sharding.mesh, jax.sharding.PartitionSpec(*spec), memory_kind=DEVICE_KIND)
    self._forward = jax.jit(self._layer_forward, static_argnums=0)
    self._embed_forward = jax.jit(self._embed_forward_piece)
    self._head_step = jax.jit(self._head_piece)
    self._backward = jax.jit(self._layer_backward, static_argnums=(0, 1), donate_argnums=(3,))
    self._embed_backward = jax.jit(self._embed_backward_piece)
    self._update = jax.jit(self._apply_update, donate_argnums=(0, 1),
                           out_shardings=programs.update_shardings)
    self._compiled: dict[str, jax.stages.Compiled] = {}

  def __call__(self, device_leaves: list, host: HostAdamW, opt_state: Any, tokens: jax.Array
               ) -> tuple[list, Any, jax.Array, jax.Array]:
    """One step: ``(device leaves, optimizer state, loss, gradients' global norm)``; the host
    holds this step's update of its leaves, to apply during the next step (``HostAdamW.hold``;
    ``HostAdamW.apply_held`` before reading them otherwise)."""

    def run(key, jitted, static, *args):
      compiled = self._compiled.get(key)
      return compiled(*args) if compiled is not None else jitted(*static, *args)

    return self._chain(device_leaves, host.params, opt_state, tokens, run, host)

  def compile(self, device_leaves: list, host_params: list, opt_state: Any, tokens: jax.Array
              ) -> tuple[dict[str, jax.stages.Compiled], int]:
    """Compiles the step's programs for arguments like these (arrays or shapes), which later
    steps then run; returns them by name with the bytes of the activations the forward
    programs keep for the backward ones, on one device."""
    saved = []

    def run(key, jitted, static, *args):
      if key not in self._compiled:
        self._compiled[key] = jitted.lower(*static, *args).compile()
      shapes = jax.eval_shape(functools.partial(jitted, *static), *args)
      out = jax.tree.map(lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                                  sharding=sharding),
                         shapes, self._compiled[key].output_shardings)
      if key.startswith("forward") or key == "embed forward":
        saved.extend(jax.tree.leaves(out[1]))
      return out

    self._chain(device_leaves, host_params, opt_state, tokens, run, None)
    saved_bytes = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
                      for x in saved)
    return dict(self._compiled), saved_bytes

  def _chain(self, device_leaves, host_params, opt_state, tokens, run, host):
    """The step's programs in order, each through ``run(name, jitted, static args, *args)``;
    with a ``host``, its held pieces applied as the forward programs need them."""
    leaves = lambda name: ([device_leaves[i] for i in self.device_ids.get(name, [])],
                           [host_params[i] for i in self.host_ids.get(name, [])])
    apply_held = host.apply_held if host is not None else lambda pieces: None
    apply_held(self._pieces(layered.EMBED))
    x, embed_pullback = run("embed forward", self._embed_forward, (), *leaves(layered.EMBED),
                            tokens)
    saved = []
    for name, group in self.layer_groups.items():
      for index in range(group.stop - group.start):
        apply_held(self._pieces(name, index))
        x, pullback = run(f"forward {name}", self._forward, (name,), *leaves(name),
                          np.int32(index), x)
        saved.append((name, index, *jax.tree.flatten(pullback)[::-1]))
    for name in self.head:
      apply_held(self._pieces(name))
    loss, dx, shared_embed, head_grads = run("head", self._head_step, (),
                                             {name: leaves(name) for name in self.head}, x,
                                             tokens)
    squares, device_grads = [], {}
    held = self._collect(head_grads, squares, device_grads)
    # The update takes the head's gradients, the first made, and each layer's as its backward
    # program is dispatched. Unclipped, it needs no norm and starts at once; clipped, it
    # waits for the clipping factor, or after an unclipped step starts as if this one were
    # unclipped too.
    clips = self.setup.clips_gradients
    if host is not None:
      host.hold(held, None if clips else 1.0, order=self.update_order,
                speculative=clips and self.setup.speculates and host.last_grad_scale == 1.0)
    try:
      self._backward_pass(saved, dx, embed_pullback, shared_embed, run,
                          host.add_held if host is not None else held.update, squares,
                          device_grads)
      device_leaves, opt_state, loss, grad_norm, clip_factor = run(
          "update", self._update, (), device_leaves, opt_state, loss, device_grads, squares)
    except BaseException as error:  # The thread must not wait for what never comes.
      if host is not None:
        host.cancel_held(error)
      raise
    if host is not None and clips:
      host.add_held({}, clip_factor)
    return device_leaves, opt_state, loss, grad_norm

  def _backward_pass(self, saved, dx, embed_pullback, shared_embed, run, give, squares,
                     device_grads):
    """The layers' and the embedding's backward programs; ``give(pieces)`` takes each one's
    host kernel gradients by piece."""
    # A group's layers share the first one's pullback structure: one compile per group.
    first = {name: structure for name, index, structure, _ in saved if index == 0}
    while saved:  # Each layer's activations go as its backward program ends.
      name, index, _, pullback_leaves = saved.pop()
      dx, grads = run(f"backward {name}", self._backward, (name, first[name]), pullback_leaves,
                      dx)
      give(self._collect(grads, squares, device_grads, index))
    give(self._collect(run("embed backward", self._embed_backward, (), embed_pullback, dx,
                           shared_embed), squares, device_grads))

  def _pieces(self, name: str, index: Any = None) -> list[tuple[int, Any]]:
    """The host kernel's pieces of parameter ``name`` (layer ``index`` of a group's)."""
    return [(leaf, index) for leaf in self.host_ids.get(name, [])]

  def _collect(self, grads: dict, squares: list, device_grads: dict, index: Any = None
               ) -> dict:
    """Files a program's gradients: the rest by name; returns the host kernel's by piece."""
    pieces = {}
    for name, (host, square_sum, device) in grads.items():
      pieces.update(zip(self._pieces(name, index), host))
      squares.append(square_sum)
      device_grads.setdefault(name, []).append(device)
    return pieces

  def _params(self, name: str, device: list, host: list, index: Any = None) -> Any:
    """Parameter ``name``'s tree on the device from its leaves (layer ``index`` of a group's)."""
    device, host = iter(device), iter(host)
    leaves = [next(host) if h else next(device) for h in self.is_host[name]]
    if index is not None:  # Cut first: of a host leaf, only the layer comes over.
      leaves = layered.layer_slice(leaves, index)
    return jax.tree.structure(self.setup.param_shapes[name]).unflatten(
        [to_device(x) for x in leaves])

  def _split(self, name: str, grads: Any) -> tuple[list, jax.Array, list]:
    """Parameter ``name``'s gradients: the host kernel's sent to host memory in the dtype they
    travel in, the sum of their squares (in float32, as the host keeps them), the rest."""
    host, device = [], []
    for g, h in zip(jax.tree.leaves(grads), self.is_host[name]):
      (host if h else device).append(g)
    ids = self.host_ids.get(name, [])
    square_sum = sum((jnp.sum(jnp.square(g.astype(jnp.float32))) for g in host), jnp.zeros(()))
    sent = [to_host(jax.lax.with_sharding_constraint(g.astype(self.wire[i]),
                                                     self.grad_shardings[i]))
            for g, i in zip(host, ids)]
    return sent, square_sum, device

  def _embed_forward_piece(self, device, host, tokens):
    params = self._params(layered.EMBED, device, host)
    return jax.vjp(lambda p: layered.embed(self.model, p, tokens), params)

  def _layer_forward(self, name, device, host, index, x):
    params = self._params(name, device, host, index)
    group = self.layer_groups[name]
    return jax.vjp(lambda p, x: layered.layer(self.model, group, p, x), params, x)

  def _head_piece(self, head, x, tokens):
    """The loss, its gradient at the last layer's output, a shared embedding's share of its
    gradient (None unless shared) and the head's split gradients."""
    params = {name: self._params(name, *head[name]) for name in self.head}
    loss, pullback = jax.vjp(lambda p, x: layered.head_loss(self.model, p, x, tokens), params, x)
    grads, dx = pullback(jnp.ones_like(loss))
    shared = grads.pop(layered.EMBED, None)  # Split with the embedding's own share.
    return loss, dx, shared, {name: self._split(name, g) for name, g in grads.items()}

  def _layer_backward(self, name, structure, pullback_leaves, dy):
    grads, dx = layered.backward(structure, pullback_leaves, dy)
    return dx, {name: self._split(name, grads)}

  def _embed_backward_piece(self, pullback, dx, shared):
    (grads,) = pullback(dx)
    if shared is not None:
      grads = jax.tree.map(jnp.add, grads, shared)
    return {layered.EMBED: self._split(layered.EMBED, grads)}

  def _apply_update(self, device_leaves, opt_state, loss, device_grads, squares):
    """The device optimizer's update, with the global norm that both parts' gradients make."""
    grads = [None] * len(device_leaves)
    for name, parts in device_grads.items():
      if name in self.layer_groups:  # A program per layer, the last layer first.
        leaves = [jnp.stack(layers) for layers in zip(*reversed(parts))]
      else:
        (leaves,) = parts
      for position, g in zip(self.device_ids.get(name, []), leaves):
        grads[position] = g
    return self.programs.apply_sums(device_leaves, opt_state, (loss, grads), sum(squares))
