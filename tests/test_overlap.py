"""The step a program per piece of the model (``jaxoffload.train.per_layer.overlap``): the host kernel's
update overlapping the next forward pass, and activations moved by the trainer."""

import jax
import numpy as np
import pytest

from jaxoffload import plan_offload
from jaxoffload.train import Trainer, load_config, resolve, train, weights
from jaxoffload.train.per_layer import offloaded_layers, overlap
from tests.helpers import HOST_KERNEL, QUIET, max_rel_diff

STEPS = 5
SLOW = pytest.mark.slow
MOVED = ["model.cpu_offloading=True", "model.cpu_offloading_num_layers=2",
         "model.cpu_offloading_double_buffering=True"]


@pytest.mark.parametrize("overrides", [
    # The slow tier: the fast tier has the overlapped step's losses in test_train, clipped.
    pytest.param(HOST_KERNEL, marks=SLOW, id="overlapped"),
    pytest.param([*HOST_KERNEL, "optimizer.overlap_cpu_optimizer_d2h_h2d=False"], marks=SLOW,
                 id="one-program"),
])
def test_unclipped_host_kernel_losses_equal_the_unclipped_baseline(overrides):
  # Unclipped, the overlapped step's host update starts during the backward pass.
  unclipped = [f"train.train_iters={STEPS}", "optimizer.clip_grad=0"]
  whole_model = train(load_config(None, unclipped), log=QUIET)
  np.testing.assert_allclose(train(load_config(None, [*unclipped, *overrides]), log=QUIET),
                             whole_model, rtol=1e-5)


# The tiny model's gradient norms over 8 steps: 0.81 0.74 0.79 0.91 0.86 1.1 1.38 1.42 (the
# same over micro-batches, whose mean is the batch's gradient). At clip_grad=1, steps 2-6
# start early, after an unclipped step, and step 6 clips.
@SLOW
@pytest.mark.parametrize("clip_grad, speculated, undone", [(1e6, 7, 0), (1.0, 5, 1)])
@pytest.mark.parametrize("micro_batches", [
    pytest.param([], id="one-micro-batch"),
    pytest.param(["train.micro_batch_size=4", "optimizer.accumulate_offloaded_grads_on=device"],
                 id="two-micro-batches")])
def test_updates_started_before_their_clipping_equal_those_started_after_it(
    clip_grad, speculated, undone, micro_batches):
  def run(speculate):
    setup = resolve(load_config(None, [
        *HOST_KERNEL[:1], "optimizer.optimizer_offload_fraction=1.0", *HOST_KERNEL[2:],
        f"optimizer.clip_grad={clip_grad}", f"optimizer.speculate_cpu_optimizer_step={speculate}",
        *micro_batches]))
    assert setup.overlaps_host_update
    trainer = Trainer(setup, weights.initial(setup))
    norms = [float(trainer.step(setup.global_batch(step))[1]) for step in range(8)]
    trainer.host.finish()
    np.testing.assert_array_equal(np.array(norms) > 1.0, np.arange(8) >= 5)
    assert (trainer.host.speculated, trainer.host.undone) == (
        (speculated, undone) if speculate else (0, 0))
    return trainer.host.snapshot()

  plain, started_early = run(False), run(True)
  if undone:  # Taken back and applied clipped: a few float32 roundings apart.
    assert 0 < max_rel_diff(started_early, plain) <= 1e-6
  else:
    assert all(np.array_equal(a, b) for a, b in zip(started_early, plain))


def test_the_host_kernel_overlaps_the_next_forward_pass_wherever_it_can():
  trainer = lambda *more: Trainer.from_shapes(resolve(load_config(None, [*HOST_KERNEL, *more])))
  assert trainer().overlapped is not None
  assert trainer("optimizer.overlap_cpu_optimizer_d2h_h2d=False").overlapped is None
  assert trainer("train.micro_batch_size=4").overlapped is None  # A program per micro-batch.
  assert trainer("train.micro_batch_size=4",
                 "optimizer.accumulate_offloaded_grads_on=device").overlapped is not None


def test_the_step_runs_a_program_per_layer_without_offload_only_where_asked():
  trainer = lambda *more: Trainer.from_shapes(resolve(load_config(None, list(more))))
  assert trainer().overlapped is None
  assert trainer("train.per_layer_step=True").overlapped is not None


@SLOW
@pytest.mark.parametrize("micro_batches", [
    pytest.param([], id="one-micro-batch"),
    pytest.param(["train.micro_batch_size=4", "optimizer.accumulate_offloaded_grads_on=device"],
                 id="two-micro-batches")])
def test_an_overlapped_update_of_a_shared_embedding_sums_both_its_gradients(micro_batches):
  shared = [f"train.train_iters={STEPS}", "model.share_embeddings_and_output_weights=True",
            *micro_batches]
  whole_model = train(load_config(None, shared), log=QUIET)
  overlapped = train(load_config(None, [*shared, *HOST_KERNEL[:1],
                                        "optimizer.optimizer_offload_fraction=1.0",
                                        *HOST_KERNEL[2:],
                                        "optimizer.overlap_cpu_optimizer_d2h_h2d=True"]),
                     log=QUIET)
  assert whole_model[-1] < whole_model[0]
  np.testing.assert_allclose(overlapped, whole_model, rtol=1e-5)


TWO_MICRO_BATCHES = ["train.micro_batch_size=4", "optimizer.accumulate_offloaded_grads_on=device"]


@SLOW
@pytest.mark.parametrize("micro_batches", [
    pytest.param([], id="one-micro-batch"),
    pytest.param(TWO_MICRO_BATCHES, id="two-micro-batches"),
    pytest.param([*TWO_MICRO_BATCHES, "optimizer.optimizer_offload_fraction=0.3"],
                 id="two-micro-batches-device-leaves")])
def test_the_overlapped_steps_compiled_peak_bounds_what_its_programs_leave_on_the_device(
    micro_batches):
  # Wide layers, so that the host kernel's weights outweigh the activations: a second copy
  # of them kept on the device would pass the estimate.
  setup = resolve(load_config(None, [
      *HOST_KERNEL[:1], "optimizer.optimizer_offload_fraction=1.0", *HOST_KERNEL[2:],
      "model.hidden_size=512", "model.intermediate_size=1408", "model.seq_length=16",
      *micro_batches]))
  tokens = setup.global_batch(0)
  estimate = Trainer.from_shapes(setup).compile(jax.ShapeDtypeStruct(
      tokens.shape, tokens.dtype, sharding=tokens.sharding)).device_bytes
  trainer = Trainer(setup, weights.initial(setup))
  device_bytes = lambda: sum(a.nbytes for a in jax.live_arrays()
                             if not a.is_deleted() and a.sharding.memory_kind == "device")
  before, live = device_bytes(), []

  def measured(program):
    def run(*args):
      out = jax.block_until_ready(program(*args))
      live.append(device_bytes() - before)
      return out
    return run

  pieces = trainer.overlapped.piece
  for name in ("fetch", "forward", "embed_forward", "update"):
    setattr(pieces, name, measured(getattr(pieces, name)))
  for programs in (pieces.head_step, pieces.backward, pieces.embed_backward):
    programs.update({adds: measured(program) for adds, program in programs.items()})
  for step in range(2):
    trainer.step(setup.global_batch(step))
  assert len(live) > 4 * setup.model.num_layers
  # What lives besides the parameters and state the trainer held before the step.
  resident = sum(a.nbytes for a in jax.tree.leaves((trainer.params, trainer.opt_state))
                 if a.sharding.memory_kind == "device")
  assert max(live) <= estimate - resident, (max(live), estimate, resident)
  device_grads = sum(a.nbytes for a in jax.tree.leaves(trainer.params)
                     if a.sharding.memory_kind == "device")
  if setup.offload.fraction < 1:  # The sums' pieces become these: counted once, not beside them.
    assert estimate - resident - max(live) < device_grads, (max(live), estimate, resident)


@pytest.mark.parametrize("recompute, takes_input", [("null", False), ("full", True)])
def test_the_overlapped_step_keeps_a_layers_input_only_where_its_backward_pass_reads_it(
    recompute, takes_input):
  # Saving everything, the backward pass reads what the layer made of its input: a kept input
  # would be a whole activation a layer held for nothing.
  setup = resolve(load_config(None, [*HOST_KERNEL, f"model.recompute_granularity={recompute}"]))
  trainer = Trainer(setup, weights.initial(setup))
  pieces, inputs = trainer.overlapped.piece, []

  def recording(program):
    def run(name, last, device, fetched, index, x, *rest):
      inputs.append(x)
      return program(name, last, device, fetched, index, x, *rest)
    return run

  pieces.backward.update({adds: recording(p) for adds, p in pieces.backward.items()})
  trainer.step(setup.global_batch(0))
  assert len(inputs) == setup.model.num_layers
  assert all((x is not None) == takes_input for x in inputs)


@pytest.mark.slow
def test_an_unclipped_overlapped_step_sends_no_gradient_ahead_of_the_hosts_update(monkeypatch):
  # With no room ahead, each layer's backward program waits until the host has applied
  # every gradient sent before it: the host never holds more than one program's.
  from jaxoffload.host import held_update
  from jaxoffload.train.per_layer import overlap
  monkeypatch.setattr(overlap, "GRADIENT_BYTES_AHEAD", 0)
  pending = []
  wait = held_update.HeldUpdate.wait_for_room

  def recorded(self, limit):
    wait(self, limit)
    pending.append(self._pending)

  monkeypatch.setattr(held_update.HeldUpdate, "wait_for_room", recorded)
  config = load_config(None, [f"train.train_iters={STEPS}", *HOST_KERNEL[:1],
                              "optimizer.optimizer_offload_fraction=1.0", *HOST_KERNEL[2:],
                              "optimizer.clip_grad=0"])
  assert resolve(config).overlaps_host_update
  waited = train(config, log=QUIET)
  assert pending == [0] * (STEPS * config.model.num_layers)
  # Waiting changes no number.
  monkeypatch.setattr(held_update.HeldUpdate, "wait_for_room", lambda self, limit: None)
  assert train(config, log=QUIET) == waited


def test_moves_keep_dispatch_within_two_programs_of_the_device(monkeypatch):
  from jaxoffload.train.per_layer import moved
  outputs = [[jax.numpy.full(2, i, np.float32) for _ in range(2)] for i in range(4)]
  outputs[1][0].delete()  # Taken by a later program.
  moved.wait_for(outputs[1])  # Waits on the rest.
  waited = []
  monkeypatch.setattr(moved, "wait_for", waited.append)
  monkeypatch.setattr(moved, "copy_ended", lambda copy: True)
  moves = moved.Moves()
  layer = moves.leave([jax.numpy.ones(3)])
  for program in outputs:
    moves.dispatched(program)
  # Each program waits for the one two before it.
  assert [[id(x) for x in wait] for wait in waited] == [[id(x) for x in program]
                                                        for program in outputs[:2]]
  # Its copy ended, the layer's original goes at the first program after it left.
  assert layer.original is None and layer.copy is not None


@SLOW
@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (the CPU backend has them in CI)")
def test_moved_activations_come_back_a_layer_ahead_or_are_read_where_they_are(monkeypatch):
  from jaxoffload.train.per_layer import moved
  original, copies, outs = moved.placed, [], []

  def recorded(arrays, memory_kind):  # Per copy: from where, to where.
    copies.append(({x.sharding.memory_kind for x in arrays}, memory_kind))
    placed = original(arrays, memory_kind)
    if memory_kind == "pinned_host":
      outs.append(placed)
    return placed

  monkeypatch.setattr(moved, "placed", recorded)
  mesh = ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]

  def trained(double_buffering):
    moved = f"model.cpu_offloading_double_buffering={double_buffering}"
    setup = resolve(load_config(None, [*MOVED[:2], *mesh, moved]))
    assert setup.runs_per_layer == double_buffering
    trainer = Trainer(setup)
    for i in range(2):
      trainer.step(setup.global_batch(i))
    return jax.tree.leaves(trainer.params)

  one_program = trained(False)  # XLA's offload inside one program.
  device, host = {"device"}, {"pinned_host"}
  # Per step, layers 0 and 1 leave after their forward programs. Going backward, where the
  # link keeps up, each comes back while the layer above it is popped for its backward
  # program (layer 1 under layer 2, which is not moved, as layer 3); where it is behind,
  # a layer whose copy has not ended (layer 1 here, layer 0's ended) is read in place.
  out = [(device, "pinned_host")] * 2
  expected = {"keeps up": out + [(host, "device")] * 2, "behind": out + [(host, "device")]}
  ended = {"keeps up": lambda copy: True,
           "behind": lambda copy: any(copy is c for c in outs[::2])}
  for link, copy_ended in ended.items():
    monkeypatch.setattr(moved, "copy_ended", copy_ended)
    copies.clear()
    outs.clear()
    # The same float32 steps however far behind.
    assert max_rel_diff(trained(True), one_program) <= 1e-6
    assert copies == 2 * expected[link], link


def test_the_state_of_weights_in_pinned_host_is_the_first_a_fraction_offloads():
  # Their update then stays beside them, where the device's would bring the group over and
  # back each step.
  weights = ["model.cpu_offloading=True", "model.cpu_offloading_num_layers=2",
             "model.cpu_offloading_weights=True"]
  shapes = resolve(load_config(None, weights)).param_shapes
  leaves, _ = jax.tree_util.tree_flatten_with_path(shapes)
  group = {jax.tree_util.keystr(path): x.size for path, x in leaves
           if path[0].key == "layers_0_2" and x.ndim > 0}
  share = sum(group.values()) / sum(x.size for _, x in leaves)
  offloaded = lambda plan: {jax.tree_util.keystr(path)
                            for (path, _), host in zip(leaves, plan.offloaded) if host}
  assert offloaded(plan_offload(shapes, offload_fraction=share)) != set(group)  # Largest first.
  setup = resolve(load_config(None, [*weights, *HOST_KERNEL[:1],
                                     f"optimizer.optimizer_offload_fraction={share}"]))
  assert offloaded(setup.offload) == set(group)


@SLOW
@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (the CPU backend has them in CI)")
def test_offloaded_weights_come_over_for_each_program_that_reads_them(monkeypatch):
  weights = ["model.cpu_offloading=True", "model.cpu_offloading_num_layers=2",
             "model.cpu_offloading_weights=True", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]
  to_device = offloaded_layers.layer_to_device

  def trained(overrides):
    """The parameters after two steps, with what came over: each layer sent (its index,
    where the stack is and where the layer went) and each fetch program run (group, layer)."""
    setup = resolve(load_config(None, [*weights, *overrides]))
    trainer = Trainer(setup)
    sent, fetches = [], []

    def send(stack, index, views=None):
      layer = to_device(stack, index, views)
      sent.append((index, stack.sharding.memory_kind, layer.sharding.memory_kind))
      return layer

    monkeypatch.setattr(offloaded_layers, "layer_to_device", send)
    if setup.runs_per_layer:
      piece = trainer.overlapped.piece
      jitted = piece.fetch

      def fetch(name, host, index):
        fetches.append((name, None if index is None else int(index)))
        return jitted(name, host, index)

      piece.fetch = fetch
    for i in range(2):
      trainer.step(setup.global_batch(i))
    return setup, trainer.checkpoint()["params"], sent, fetches

  _, one_program, _, _ = trained([])  # Whose scan fetches them.
  # Each program reads its layer of the group's stack in pinned_host, sent to the device a
  # program ahead: up the group going forward, down it going backward; the device
  # optimizer's stacks and the host kernel's alike.
  leaves = len(jax.tree.leaves(one_program["layers_0_2"]))
  step = [(i, "pinned_host", "device") for i in (0, 1, 1, 0) for _ in range(leaves)]
  setup, params, sent, fetches = trained(["train.per_layer_step=True"])
  assert setup.runs_per_layer
  assert max_rel_diff(params, one_program) <= 1e-6  # The same float32 steps.
  assert {x.sharding.memory_kind for x in jax.tree.leaves(params["layers_0_2"])} == {
      "pinned_host"}
  assert (sent, fetches) == (2 * step, [])
  setup, params, sent, fetches = trained(
      [*HOST_KERNEL[:1], "optimizer.optimizer_offload_fraction=1.0", *HOST_KERNEL[2:]])
  assert setup.runs_per_layer
  assert max_rel_diff(params, one_program) <= 1e-6
  # The other group's layers come over once a step, kept for both passes.
  assert sent == 2 * step
  assert [f for f in fetches if f[0] == "layers_2_4"] == 2 * [("layers_2_4", 0),
                                                              ("layers_2_4", 1)]
  assert not any(name == "layers_0_2" for name, _ in fetches)


@SLOW
@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (the CPU backend has them in CI)")
@pytest.mark.parametrize("micro_batches", [[], ["train.micro_batch_size=2"]],
                         ids=["one-micro-batch", "four-micro-batches"])
def test_unclipped_offloaded_weights_update_a_layer_at_a_time_as_in_one_program(micro_batches):
  weights = ["model.cpu_offloading=True", "model.cpu_offloading_num_layers=2",
             "model.cpu_offloading_weights=True", "optimizer.clip_grad=0", "mesh.data=2",
             "mesh.fsdp=2", "mesh.tensor=2", *micro_batches]
  written = []  # Per write, (the program, the layer it writes).

  def trained(overrides):
    setup = resolve(load_config(None, [*weights, *overrides]))
    trainer = Trainer(setup)
    if setup.runs_per_layer:
      piece = trainer.overlapped.piece
      backward, write = piece.backward[False], piece.write_layer

      def recorded(name, last, *args):
        if args[-1] is not None:  # It writes the layer above its own.
          written.append(("backward", int(args[2])))
        return backward(name, last, *args)

      piece.backward[False] = recorded
      piece.write_layer = lambda stacks, layer, index: (
          written.append(("its own", None, int(index))), write(stacks, layer, index))[1]
    losses = [trainer.step(setup.global_batch(i))[0] for i in range(3)]
    return trainer, losses, trainer.checkpoint()

  _, losses, one_program = trained([])  # Its update moves the whole group.
  trainer, per_layer_losses, state = trained(["train.per_layer_step=True"])
  assert trainer.overlapped.piece.updated_by_layer == {"layers_0_2"}
  np.testing.assert_allclose(per_layer_losses, losses, rtol=1e-6)
  for name in ("params", "mu", "nu"):
    assert max_rel_diff(state[name], one_program[name]) <= 1e-6, name
  assert {x.sharding.memory_kind for x in jax.tree.leaves(state["params"]["layers_0_2"])} == {
      "pinned_host"}
  # Each step, layer 0's backward program writes layer 1 into the stacks, and a program of
  # its own layer 0 after it.
  assert written == 3 * [("backward", 0), ("its own", None, 0)]


@SLOW
def test_the_overlapped_steps_programs_take_their_integers_on_the_device():
  # A NumPy integer would cross the link as its program is called, on the stream that
  # carries the layers sent ahead, and the program would wait behind them.
  setup = resolve(load_config(None, [*MOVED, "model.cpu_offloading_weights=True",
                                     "optimizer.clip_grad=0", "train.micro_batch_size=4"]))
  trainer = Trainer(setup)
  trainer.compile(setup.global_batch(0))
  programs, taken = trainer.overlapped._compiled, []
  for key, program in programs.items():
    programs[key] = lambda *args, program=program, key=key: (
        taken.append((key, jax.tree.leaves(args))), program(*args))[1]
  trainer.step(setup.global_batch(0))
  # Layers' indices, micro-batches' and the written layer's among them.
  assert {"forward layers_0_2", "backward layers_0_2 last writing", "update layers_0_2",
          "write layers_0_2"} <= {key for key, _ in taken}
  assert [key for key, leaves in taken if any(isinstance(x, np.generic) for x in leaves)] == []
