"""A step a program per piece of the model: the host kernel's update overlapping the next
step's forward pass a layer at a time, and the offloaded layers' activations moved by the
trainer between programs.

With the host kernel, wherever it can (``Setup.overlaps_host_update``), a step
runs the model as a program per piece (``train.per_layer.pieces``): the embedding,
each layer and the head forward, then each layer and the embedding backward,
then the device optimizer's update. The host kernel holds step t's gradients
(``HostAdamW.hold``) and its thread applies them in the order step t + 1's
forward programs read them; each piece's weights go to the device once its
update is applied: the device computes the first layers while the host
updates the later ones.
The update is the single program's (exact, the same clipping); only when the
host applies it moves. A step's host gradients leave the device as each layer's
backward program ends, copied beside the next program (``moved.placed``). Without
clipping (``optimizer.clip_grad=0``) the update needs no global norm, and the
thread starts on each piece as soon as its gradient is on the host: during this
step's backward pass. With clipping, after a step that did not clip, it starts
so too, as if this step would not clip either
(``optimizer.speculate_cpu_optimizer_step``,
``HostAdamW.hold(speculative=True)``); a step that does clip has its update
taken back and applied again, scaled.

With several micro-batches (``optimizer.accumulate_offloaded_grads_on=device``)
each runs the same programs, the host kernel's weights brought over once a step,
and each backward program adds its gradients into the device's sums
(``grads.add_to_sum``, as the one-program step does); the last micro-batch's
backward programs send the sums' mean, so the host's update starts during the
last backward pass.

Where the update starts without the clipping factor (unclipped), the device sends
no more than ``GRADIENT_BYTES_AHEAD`` of the host's gradients ahead of it: the
host never holds a whole step's.

With ``model.cpu_offloading_double_buffering`` (``Setup.moves_activations``), with or
without the host kernel, an offloaded layer's forward program keeps its activations on
the device; they go to pinned_host as the program ends, while the next layer's runs, and
come back while the layer above runs its backward program, unless the link is still
behind (``train.per_layer.moved``).

A group whose weights live in pinned_host (``model.cpu_offloading_weights``) brings a layer
over for each program that reads it, forward and backward, sent a program ahead; unclipped,
the device's AdamW updates it a layer at a time in the backward pass
(``train.per_layer.offloaded_layers``).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional

import jax

from jaxoffload._compat import PINNED_HOST
from jaxoffload.host.host_adamw import HostAdamW
from jaxoffload.nn import layered
from jaxoffload.train.per_layer.footprint import HeldBytes
from jaxoffload.train.per_layer.moved import DeviceScalars, Moves, placed
from jaxoffload.train.per_layer.offloaded_layers import OffloadedLayers
from jaxoffload.train.per_layer.pieces import PiecePrograms
from jaxoffload.train.programs import StepPrograms

# How many bytes of the host kernel's gradients the backward pass may send ahead of its
# update, where the update needs no clipping factor to start: enough to keep the kernel
# busy, little beside its state (``train.host_memory.needed`` counts it).
GRADIENT_BYTES_AHEAD = 2**30


class _Step(NamedTuple):
  """What one step's programs read beside their own outputs."""

  device_leaves: list
  host_params: list  # The host kernel's leaves, in host memory.
  tokens: jax.Array
  run: Callable  # run(name, jitted, static args, *args): one program.
  host: Optional[HostAdamW]  # None while compiling.
  fetched: dict  # Per piece, its host kernel leaves on the device.
  sums: dict  # Per piece, its gradients' sums over the micro-batches so far.
  step: Any  # The update's count, which salts the sums' rounding; None for one micro-batch.
  moves: Moves  # The moved layers' activations.
  layers: OffloadedLayers  # The weight-offloaded groups' layers.
  scalars: Callable  # scalars(i): the integer i as the programs take it (``DeviceScalars``).


class OverlappedStep:
  """A step's programs, a piece of the model each, and the order the host updates in.

  Example:
    >>> step = OverlappedStep(programs)
    >>> device_leaves, opt_state, loss, grad_norm = step(device_leaves, host, opt_state, tokens)
  """

  def __init__(self, programs: StepPrograms):
    self.setup = programs.setup
    self.piece = PiecePrograms(programs)
    p = self.piece
    # The host kernel's pieces in the order the forward programs first read them (a shared
    # embedding's by the embedding's and the head's).
    self.update_order = list(dict.fromkeys([
        *p.host_pieces(layered.EMBED),
        *(piece for name, group in p.layer_groups.items()
          for index in range(group.stop - group.start) for piece in p.host_pieces(name, index)),
        *(piece for name in p.head for piece in p.host_pieces(name))]))
    self._compiled: dict[str, jax.stages.Compiled] = {}
    self._scalars = DeviceScalars(self.setup.mesh)
    # Python kept within ``moved.PROGRAMS_AHEAD`` programs of the device: where activations
    # or weights move, so that copies are judged near the device's time; and on XLA:CPU,
    # where a launch that finds its device's programs in flight at their bound waits holding
    # a thread of the client's pool (as many as the devices), which the bodies of a program
    # with collectives all need at once: far enough ahead, that launch waits on a collective
    # that waits on it.
    self._paced = bool(p.moved or p.weights_offloaded or jax.default_backend() == "cpu")

  def __call__(self, device_leaves: list, host: Optional[HostAdamW], opt_state: Any,
               tokens: jax.Array) -> tuple[list, Any, jax.Array, jax.Array]:
    """One step: ``(device leaves, optimizer state, loss, gradients' global norm)``; the host
    holds this step's update of its leaves, to apply during the next step (``HostAdamW.hold``;
    ``HostAdamW.apply_held`` before reading them otherwise)."""

    moves = Moves()

    def run(key, jitted, static, *args):
      compiled = self._compiled.get(key)
      outputs = compiled(*args) if compiled is not None else jitted(*static, *args)
      # A layer sent ahead then takes device memory a few programs, not a pass, before it is
      # read.
      if self._paced:
        moves.dispatched(outputs)
      return outputs

    return self._chain(device_leaves, [] if host is None else host.params, opt_state, tokens,
                       run, host, moves, self._scalars)

  @property
  def compiled(self) -> dict[str, jax.stages.Compiled]:
    """The programs ``compile`` made, by name (for instance ``backward layers middle``: a
    layer group's backward program for a micro-batch neither first nor last)."""
    return dict(self._compiled)

  def compile(self, device_leaves: list, host_params: list, opt_state: Any, tokens: jax.Array,
              compiler_options: Optional[dict] = None
              ) -> tuple[dict[str, jax.stages.Compiled], int]:
    """Compiles the step's programs for arguments like these (arrays or shapes), with XLA's
    ``compiler_options``, which later steps then run; returns them by name with the bytes,
    on one device, that the step holds beside the parameters and state
    (``HeldBytes.total``)."""
    held = HeldBytes(self.piece)

    def run(key, jitted, static, *args):
      if key not in self._compiled:
        self._compiled[key] = jitted.lower(*static, *args).compile(compiler_options)
      shapes = jax.eval_shape(functools.partial(jitted, *static), *args)
      out = jax.tree.map(lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                                  sharding=sharding),
                         shapes, self._compiled[key].output_shardings)
      held.record(key, static, args, out)
      return out

    self._chain(device_leaves, host_params, opt_state, tokens, run, None, Moves(),
                self._scalars.shape)
    return dict(self._compiled), held.total(device_leaves)

  def _chain(self, device_leaves, host_params, opt_state, tokens, run, host, moves, scalars):
    """The step's programs in order, each through ``run(name, jitted, static args, *args)``;
    with a ``host``, its held pieces applied as the first forward programs need them; the
    moved activations through ``moves``; the integers they take made by ``scalars``."""
    n = self.piece.micro_batches
    step = run("count", self.piece.count, (), opt_state) if n > 1 else None
    layers = OffloadedLayers(self.piece, device_leaves, host_params, host, run, scalars,
                             opt_state, step)
    this = _Step(device_leaves, host_params, tokens, run, host, {}, {}, step, moves, layers,
                 scalars)
    loss = None
    for micro in range(n - 1):  # Their gradients go into the sums.
      loss = self._add_micro_batch(this, micro, loss)
    loss, dx, shared_embed, head_grads, embed_pullback, saved = self._forward_and_head(
        this, n - 1, loss)
    squares, device_grads = [], {}
    held = self._collect(head_grads, squares, device_grads)
    # The update takes the head's gradients, the first made, and each layer's as its backward
    # program is dispatched. Unclipped, it needs no norm and starts at once; clipped, it
    # waits for the clipping factor, or after an unclipped step starts as if this one were
    # unclipped too.
    clips = self.setup.clips_gradients
    if host is not None:
      host.hold(held, None if clips else 1.0, order=self.update_order,
                speculative=self.setup.speculates and host.last_grad_scale == 1.0)
    give = host.add_held if host is not None else held.update
    try:
      self._backward_pass(this, saved, dx, embed_pullback, shared_embed, n - 1,
                          lambda grads, index: give(self._collect(grads, squares, device_grads,
                                                                  index)))
      # The groups updated a layer at a time stay out of it (``PiecePrograms.update``).
      device_leaves, opt_state, loss, grad_norm, clip_factor = run(
          "update", self.piece.update, (), layers.taken_out(device_leaves),
          layers.with_moments(opt_state), loss, device_grads, squares)
      device_leaves = layers.finish(device_leaves)
    except BaseException as error:  # The thread must not wait for what never comes.
      if host is not None:
        host.cancel_held(error)
      raise
    if host is not None and clips:
      host.add_held({}, clip_factor)
    return device_leaves, opt_state, loss, grad_norm

  def _add_micro_batch(self, this: _Step, micro: int, loss: Any) -> Any:
    """Micro-batch ``micro``, not the last: its gradients added into the sums; returns the
    loss summed so far. What it keeps for its backward pass goes on return."""
    loss, dx, shared_embed, head_grads, embed_pullback, saved = self._forward_and_head(
        this, micro, loss)
    this.sums.update({(name, None): g for name, g in head_grads.items()})
    self._backward_pass(this, saved, dx, embed_pullback, shared_embed, micro, None)
    return loss

  def _forward_and_head(self, this: _Step, micro: int, loss: Any) -> tuple:
    """Micro-batch ``micro``'s forward programs and head: ``(loss summed so far, gradient at
    the last layer's output, a shared embedding's share of its gradient, the head's
    gradients, the embedding's pullback, each layer's (name, index, input, what its forward
    program kept))``."""
    last = micro == self.piece.micro_batches - 1
    weights = lambda name, index=None, release=last: self._weights(this, name, index, release)
    # A shared embedding is the head's too: kept for it.
    x, embed_pullback = this.run(
        "embed forward", self.piece.embed_forward, (),
        *weights(layered.EMBED, release=last and layered.EMBED not in self.piece.head),
        this.tokens, this.scalars(micro))
    saved = []
    for name, group in self.piece.layer_groups.items():
      for index in range(group.stop - group.start):  # The backward program takes the weights.
        y, kept = this.run(f"forward {name}", self.piece.forward, (name,),
                           *weights(name, index, release=False), this.scalars(index), x)
        if name in self.piece.moved:  # Copied out while the next layer's program runs.
          kept = this.moves.leave(kept)
        saved.append((name, index, x if self.piece.layouts[name].takes_input else None, kept))
        x = y
    loss, dx, shared_embed, head_grads = this.run(
        f"head {self._stage(micro)}", self.piece.head_step[not last], (last,),
        {name: weights(name) for name in self.piece.head}, x, this.tokens, this.scalars(micro),
        loss, self._take(this.sums, self.piece.head_grads), this.step)
    return loss, dx, shared_embed, head_grads, embed_pullback, saved

  def _backward_pass(self, this: _Step, saved, dx, embed_pullback, shared_embed, micro,
                     give):
    """Micro-batch ``micro``'s layers' and embedding's backward programs: each adds its
    gradients into the sums (by piece), or, given ``give``, makes the step's and calls
    ``give(gradients, layer index)``."""
    last = give is not None
    stage, adds, sums = self._stage(micro), not last, this.sums
    while saved:  # Each layer's activations (and, the last time, weights) go as it ends.
      name, index, x, kept = saved.pop()
      if name in self.piece.moved:
        kept = this.moves.on_device(kept)
      if saved and saved[-1][0] in self.piece.moved:  # The next one's, under this program.
        this.moves.ahead(saved[-1][3])
      if last and this.host is not None:
        # No more of the host's gradients ahead of its update than this: the device waits
        # rather than fill host memory with a whole step's.
        this.host.wait_for_room(GRADIENT_BYTES_AHEAD)
      weights = self._weights(this, name, index, release=last, forward=False)
      # The layer above's new weights, where the backward pass updates the group.
      written = this.layers.pending(name) if last else None
      dx, grads, stacks = this.run(
          f"backward {name} {stage}{' writing' if written else ''}", self.piece.backward[adds],
          (name, last), *weights, this.scalars(index), x, kept, dx,
          sums.pop((name, index), None), this.step, this.scalars(micro), written)
      if last:
        grads = this.layers.update(name, index, weights[0], grads, stacks)
      self._file(grads, index, sums, give)
    self._file(this.run(f"embed backward {stage}", self.piece.embed_backward[adds], (last,),
                        embed_pullback, dx, shared_embed,
                        sums.pop((layered.EMBED, None), None), this.step, this.scalars(micro)),
               None, sums, give)

  @staticmethod
  def _file(grads: dict, index: Any, sums: dict, give: Any) -> None:
    """A program's gradients by parameter name: into ``sums``, or to ``give``."""
    if give is None:
      sums.update({(name, index): g for name, g in grads.items()})
    else:
      give(grads, index)

  def _stage(self, micro: int) -> str:
    """Which variant of the gradient programs micro-batch ``micro`` runs: they differ in
    whether sums come in and whether the step's gradients go out."""
    if self.piece.micro_batches == 1:
      return "only"
    return {0: "first", self.piece.micro_batches - 1: "last"}.get(micro, "middle")

  def _weights(self, this: _Step, name: str, index: Any, release: bool, forward: bool = True
               ) -> tuple[list, list]:
    """Piece ``(name, index)``'s device leaves and its host kernel leaves on the device, cut
    to the layer: brought over, once its held update is applied, by the first micro-batch
    that reads them, and let go (``release``) by the last micro-batch's last program that
    reads them; a weight-offloaded group's, by each program (``OffloadedLayers.get``)."""
    if name in self.piece.weights_offloaded:
      return this.layers.get(name, index, forward)
    key = (name, index)
    if key not in this.fetched:
      # Only a forward program applies: by a backward program the update held is this
      # step's, which the backward programs make.
      if this.host is not None and forward:
        this.host.apply_held(self.piece.host_pieces(name, index))
      leaves = [this.host_params[i] for i in self.piece.host_ids.get(name, [])]
      this.fetched[key] = (this.run(f"fetch {name}", self.piece.fetch, (name,), leaves,
                                    None if index is None else this.scalars(index))
                           if leaves else [])
    fetched = this.fetched.pop(key) if release else this.fetched[key]
    return [this.device_leaves[i] for i in self.piece.device_ids.get(name, [])], fetched

  @staticmethod
  def _take(sums: dict, names: tuple) -> Any:
    """The sums of ``names``' gradients (non-layer pieces), taken out; None before any."""
    taken = {name: sums.pop((name, None)) for name in names if (name, None) in sums}
    return taken or None

  def _collect(self, grads: dict, squares: list, device_grads: dict, index: Any = None
               ) -> dict:
    """Files a program's gradients: the rest by name; returns the host kernel's by piece,
    each on its way to host memory (a copy that runs beside the device's next program)."""
    pieces = {}
    for name, (host, square_sum, device) in grads.items():
      if host:
        pieces.update(zip(self.piece.host_pieces(name, index), placed(host, PINNED_HOST)))
      squares.append(square_sum)
      device_grads.setdefault(name, []).append(device)
    return pieces
