"""HostAdamW: host updates equal optax's, whole, by piece, summed, sharded and resumed."""

import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxoffload
from jaxoffload._compat import to_device, to_host
from jaxoffload.host import host_adamw, numpy_views
from jaxoffload.host.host_adamw import HostAdamW
from jaxoffload.train import load_config
from jaxoffload.train.schedule import learning_rate
from tests.helpers import max_rel_diff

HYPER = dict(b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
CLIP = 1.0
STEPS = 6
schedule = optax.linear_schedule(3e-2, 3e-3, STEPS)


def loss_fn(weights, batch):
  x, y = batch
  hidden = jnp.tanh(x @ weights[0])
  return jnp.mean((hidden @ weights[1] - y) ** 2)


def problem():
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  weights = [jax.random.normal(keys[0], (8, 16)), jax.random.normal(keys[1], (16, 4))]
  batches = [(jax.random.normal(jax.random.fold_in(keys[2], t), (32, 8)),
              jax.random.normal(jax.random.fold_in(keys[3], t), (32, 4))) for t in range(STEPS)]
  return weights, batches


@jax.jit
def device_step(host_weights, batch):
  """Gradients of host-resident weights, back in host memory, and the clipping factor."""
  grads = jax.grad(loss_fn)([to_device(w) for w in host_weights], batch)
  norm = optax.tree.norm([g.astype(jnp.float32) for g in grads])
  scale = jnp.where(norm < CLIP, 1.0, CLIP / norm)
  return [to_host(g) for g in grads], scale


def optax_reference(weights, batches, *, device_dtypes=None):
  """optax's clipped AdamW, its gradients taken at the weights cast to ``device_dtypes``."""
  opt = optax.chain(optax.clip_by_global_norm(CLIP), optax.adamw(schedule, **HYPER))
  state = opt.init(weights)
  cast = lambda ws: [w.astype(d) for w, d in zip(ws, device_dtypes or [jnp.float32] * len(ws))]
  for batch in batches:
    grads = [g.astype(jnp.float32) for g in jax.grad(loss_fn)(cast(weights), batch)]
    updates, state = opt.update(grads, state, weights)
    weights = optax.apply_updates(weights, updates)
  return weights


def host_run(weights, batches, *, shardings=None, device_dtypes=None, **options):
  one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  shardings = shardings or [one_device] * len(weights)
  host = HostAdamW([jax.device_put(np.array(w), s.with_memory_kind("pinned_host"))
                    for w, s in zip(weights, shardings)],
                   learning_rate=schedule, device_dtypes=device_dtypes, **HYPER, **options)
  for batch in batches:
    grads, scale = device_step(host.params, batch)
    host.update(grads, scale)
  host.finish()
  assert host.count == len(batches)
  assert {w.sharding.memory_kind for w in host.params} == {"pinned_host"}
  assert [w.dtype for w in host.params] == (device_dtypes or [jnp.float32] * len(weights))
  return host.snapshot()


def test_host_updates_equal_optax():
  weights, batches = problem()
  assert max_rel_diff(host_run(weights, batches), optax_reference(weights, batches)) <= 1e-6


@jax.jit
def device_step_by_piece(host_weights, batch):
  """``device_step``'s gradients by piece: leaf 0 a layer at a time (its rows), leaf 1 whole."""
  grads, scale = device_step(host_weights, batch)
  pieces = {(0, layer): to_host(to_device(grads[0])[layer]) for layer in range(8)}
  return {**pieces, (1, None): grads[1]}, scale


@pytest.mark.parametrize("applied_by", ["caller", "thread", "thread, given as made"])
def test_held_pieces_update_as_the_whole_step_does(applied_by):
  weights, batches = problem()
  pinned = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
  host = HostAdamW([jax.device_put(np.array(w), pinned) for w in weights],
                   learning_rate=schedule, **HYPER)
  rng = np.random.default_rng(0)
  for step, batch in enumerate(batches):
    # In any order, over several calls; all before the step that reads the weights.
    host.apply_held([(0, layer) for layer in range(4)])
    host.apply_held()
    pieces, scale = device_step_by_piece(host.params, batch)
    order = list(pieces)
    rng.shuffle(order)
    if applied_by == "thread, given as made":  # Some now, the rest in two handfuls.
      host.hold({p: pieces[p] for p in order[:3]}, scale, order=order)
      host.add_held({p: pieces[p] for p in order[3:6]})
      host.add_held({p: pieces[p] for p in order[6:]})
    else:
      host.hold(pieces, scale, order=order if applied_by == "thread" else None)
    assert host.count == step + 1
    host.apply_held(order[:5])
  host.finish()
  whole = host_run(weights, batches)
  assert all(np.array_equal(a, b) for a, b in zip(host.snapshot(), whole))
  assert max_rel_diff(whole, optax_reference(weights, batches)) <= 1e-6


def test_holding_in_order_checks_the_order_and_raises_the_threads_error():
  weights, batches = problem()
  host = HostAdamW([to_host(w) for w in weights], learning_rate=schedule, **HYPER)
  pieces, scale = device_step_by_piece(host.params, batches[0])
  with pytest.raises(ValueError, match="got 8 entries for 8 pieces, 1 of those held missing"):
    host.hold(pieces, scale, order=list(pieces)[1:])
  with pytest.raises(ValueError, match="got 10 entries for 9 pieces, 0 of those held missing"):
    host.hold(pieces, scale, order=[*pieces, (1, None)])
  assert host.count == 0
  pieces[(0, 3)] = to_host(jnp.zeros(5))  # Not layer 3's shape: the kernel refuses it.
  host.hold(pieces, scale, order=list(pieces))
  with pytest.raises(ValueError, match=r"grad has shape \(5,\), param has \(16,\)"):
    host.apply_held()
  with pytest.raises(ValueError, match=r"grad has shape \(5,\)"):  # The update stays unfinished.
    host.finish()


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_speculative_updates_equal_plain_ones_however_far_they_got_ahead(scale):
  weights, batches = problem()
  pinned = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
  runs = {}
  for ahead in (None, 0, 9):  # Not speculative; the scale given before any piece, after all.
    host = HostAdamW([jax.device_put(np.array(w), pinned) for w in weights],
                     learning_rate=schedule, **HYPER)
    for batch in batches:
      pieces, _ = device_step_by_piece(host.params, batch)
      if ahead is None:
        host.hold(pieces, jnp.float32(scale), order=list(pieces))
      else:
        host.hold({}, None, order=list(pieces), speculative=True)
        if ahead == 0:
          host.add_held({}, jnp.float32(scale))
        host.add_held(pieces)
        if ahead == 9:  # Every piece applied ahead of the scale before it comes.
          deadline = time.monotonic() + 60
          while host.pieces_applied_ahead < len(pieces) and time.monotonic() < deadline:
            time.sleep(0.01)
          assert host.pieces_applied_ahead == len(pieces)
          host.add_held({}, jnp.float32(scale))
      host.apply_held()
    runs[ahead] = host.snapshot()
    assert host.last_grad_scale == scale
    steps = len(batches)
    assert (host.speculated, host.undone) == ((0, 0) if ahead is None else
                                              (steps, 0 if scale == 1 else steps))
  # The same arithmetic however far the thread got: the result does not depend on timing.
  assert all(np.array_equal(a, b) for a, b in zip(runs[0], runs[9]))
  if scale != 1:  # Taken back and applied scaled: a few roundings from applying scaled.
    assert 0 < max_rel_diff(runs[9], runs[None]) <= 1e-6
  else:
    assert all(np.array_equal(a, b) for a, b in zip(runs[9], runs[None]))


def test_pieces_given_later_are_checked_and_a_cancelled_update_stays_unfinished():
  weights, batches = problem()
  host = HostAdamW([to_host(w) for w in weights], learning_rate=schedule, **HYPER)
  pieces, scale = device_step_by_piece(host.params, batches[0])
  order = list(pieces)
  with pytest.raises(ValueError, match=r"hold\(..., order=...\) first"):
    host.add_held({order[0]: pieces[order[0]]})
  host.hold({order[0]: pieces[order[0]]}, scale, order=order)
  host.apply_held([order[0]])
  for given in (order[0], (2, None)):  # Given before; in no leaf.
    with pytest.raises(ValueError, match=re.escape(f"piece {given} is not in the order, or was "
                                                   "given before")):
      host.add_held({given: pieces[order[0]]})
  with pytest.raises(ValueError, match="the update already has its scale"):
    host.add_held({}, scale)
  host.add_held({order[1]: pieces[order[1]]})
  # The step's backward pass failed: the thread must not wait for the pieces that never come.
  host.cancel_held(RuntimeError("backward failed"))
  with pytest.raises(RuntimeError, match="backward failed"):
    host.apply_held()
  with pytest.raises(RuntimeError, match="backward failed"):  # The update stays unfinished.
    host.finish()


def test_a_profiler_trace_names_each_piece_the_host_updates(tmp_path):
  weights, batches = problem()
  host = HostAdamW([to_host(w) for w in weights], learning_rate=schedule, **HYPER)
  pieces, scale = device_step_by_piece(host.params, batches[0])
  host.hold(pieces, scale)
  with jax.profiler.trace(str(tmp_path)):
    host.apply_held()
  [trace] = tmp_path.glob("**/*.xplane.pb")
  named = [dict(event.stats) for plane in jax.profiler.ProfileData.from_file(str(trace)).planes
           for line in plane.lines for event in line.events if event.name == "HostAdamW update"]
  # (leaf, layer), -1 for a whole leaf.
  assert sorted((e["leaf"], e["layer"]) for e in named) == sorted(
      (leaf, -1 if layer is None else layer) for leaf, layer in pieces)


def test_bfloat16_on_the_wire_equals_optax_at_bfloat16_weights():
  # The device reads leaf 0 rounded to bfloat16 and sends its gradient in
  # bfloat16; the host's float32 weights take optax's update of that gradient.
  weights, batches = problem()
  dtypes = [jnp.bfloat16, jnp.float32]
  want = optax_reference(weights, batches, device_dtypes=dtypes)
  got = host_run(weights, batches, device_dtypes=dtypes)
  assert max_rel_diff(got, want) <= 1e-6
  # Not the float32 run: the rounding shows, so the check above has teeth.
  assert max_rel_diff(got, host_run(weights, batches)) > 1e-4


def test_bfloat16_moments_round_as_the_device_optimizer_rounds_them():
  weights, batches = problem()
  compact = dict(mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16)
  host = HostAdamW([to_host(w) for w in weights], learning_rate=schedule, **HYPER, **compact)
  grads, _ = device_step(host.params, batches[0])
  host.update(grads)
  saved = host.checkpoint()
  # One step from one state and gradient, on the CPU, whose float32 arithmetic is the
  # kernel's (a GPU's fused multiply-adds can leave a moment a bit apart, and the hash of
  # its bits rounds it another way): the same bits.
  cpu = lambda tree: jax.device_put(tree, jax.devices("cpu")[0])
  opt = jaxoffload.offload_adamw(schedule, **HYPER, **compact, stochastic_rounding=True,
                                 offload_fraction=0.0)
  with jax.default_device(jax.devices("cpu")[0]):
    updates, (state, *_) = opt.update(cpu([np.asarray(g) for g in grads]),
                                      opt.init(cpu(weights)), cpu(weights))
  for name in ("mu", "nu"):
    for got, want in zip(saved[name], getattr(state, name)):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want, np.float32))
  assert max_rel_diff(host.snapshot(), optax.apply_updates(cpu(weights), updates)) <= 1e-6
  # Over steps, a float32 rounding apart rounds a moment the other way: near float32's run.
  float32 = optax_reference(weights, batches)
  assert 1e-5 < max_rel_diff(host_run(weights, batches, **compact), float32) <= 1e-3
  host = HostAdamW([to_host(w) for w in weights], learning_rate=1e-3, **compact)
  with pytest.raises(ValueError, match="stochastic roundings cannot be taken back exactly"):
    host.hold({}, None, order=[(0, None), (1, None)], speculative=True)
  with pytest.raises(ValueError, match=r"nu_dtype must be one of \['float32', 'bfloat16', "
                                       r"'int8'\], got float16"):
    HostAdamW([to_host(w) for w in weights], learning_rate=1e-3, nu_dtype=jnp.float16)


@pytest.mark.parametrize("compact, bound", [
    (dict(mu_dtype=jnp.int8, nu_dtype=jnp.int8), 3e-3),
    (dict(bfloat16_weights=True), 3e-2),
    pytest.param(dict(bfloat16_weights=True, mu_dtype=jnp.int8, nu_dtype=jnp.int8), 3e-2,
                 marks=pytest.mark.slow)],
    ids=["8-bit moments", "bfloat16 weights", "both"])
def test_compact_state_trains_close_to_optax(compact, bound):
  weights, batches = problem()
  if compact.pop("bfloat16_weights", False):
    weights = [w.astype(jnp.bfloat16) for w in weights]
    compact["device_dtypes"] = [jnp.bfloat16] * len(weights)
  float32 = optax_reference([w.astype(jnp.float32) for w in weights], batches)
  got = host_run(weights, batches, **compact)
  assert 1e-5 < max_rel_diff(got, float32) <= bound
  host = HostAdamW([to_host(w) for w in weights], learning_rate=1e-3, **compact)
  assert not host.can_take_back


def test_other_device_dtypes_are_refused():
  with pytest.raises(ValueError, match="leaf 1: the device reads float32 or bfloat16, not float16"):
    HostAdamW([to_host(jnp.zeros(4)), to_host(jnp.zeros(4))], learning_rate=1e-3,
              device_dtypes=[jnp.bfloat16, jnp.float16])


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices (the CPU backend has 8 in CI)")
def test_sharded_and_replicated_weights_update_shard_by_shard():
  # On the CPU backend the replicas of a device_put numpy array share one buffer.
  weights, batches = problem()
  mesh = jax.make_mesh((4,), ("x",), devices=jax.devices()[:4])
  shardings = [jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x", None)),
               jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())]
  got = host_run(weights, batches, shardings=shardings)
  assert max_rel_diff(got, optax_reference(weights, batches)) <= 1e-6


def test_weights_of_other_dtypes_are_refused():
  with pytest.raises(ValueError, match="HostAdamW keeps float32 or bfloat16 weights; leaf 0 is "
                                       "float16"):
    HostAdamW([to_host(jnp.zeros(4, jnp.float16))], learning_rate=1e-3)
  with pytest.raises(ValueError, match="leaf 0: bfloat16 weights are read in bfloat16, not "
                                       "float32"):
    HostAdamW([to_host(jnp.zeros(4, jnp.bfloat16))], learning_rate=1e-3,
              device_dtypes=[jnp.float32])


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices (the CPU backend has 8 in CI)")
@pytest.mark.parametrize("device_dtypes, moment_dtype, weight_dtype", [
    (None, jnp.float32, jnp.float32), ([jnp.bfloat16, jnp.float32], jnp.float32, jnp.float32),
    (None, jnp.bfloat16, jnp.float32), ([jnp.bfloat16, jnp.float32], jnp.int8, jnp.float32),
    ([jnp.bfloat16] * 2, jnp.int8, jnp.bfloat16)],
    ids=["float32", "split-master", "bfloat16-moments", "8-bit-moments", "bfloat16-weights"])
def test_a_loaded_checkpoint_continues_exactly(device_dtypes, moment_dtype, weight_dtype):
  # Each format, sharded over four devices, saved as float32 and read back into itself.
  weights, batches = problem()
  weights = [w.astype(weight_dtype) for w in weights]
  mesh = jax.make_mesh((4,), ("x",), devices=jax.devices()[:4])
  pinned = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x", None),
                                      memory_kind="pinned_host")
  make = lambda: HostAdamW([jax.device_put(np.array(w), pinned) for w in weights],
                           learning_rate=schedule, device_dtypes=device_dtypes,
                           mu_dtype=moment_dtype, nu_dtype=moment_dtype, **HYPER)

  def steps(host, batches):
    for batch in batches:
      host.update(*device_step(host.params, batch))

  whole, resumed = make(), make()
  steps(whole, batches)
  steps(resumed, batches[:3])
  saved = resumed.checkpoint()
  steps(resumed, batches[3:4])  # Moves on after the save, as a run does.
  shapes = lambda state: jax.tree.map(lambda x: (x.shape, x.dtype), state)
  assert shapes(resumed.checkpoint_target()) == shapes(saved)
  resumed.load(saved)
  assert resumed.count == 3
  steps(resumed, batches[3:])
  whole.finish()
  resumed.finish()
  assert max_rel_diff(resumed.snapshot(), whole.snapshot()) == 0.0


def test_the_schedule_is_evaluated_once_per_table_not_at_each_update():
  # An evaluation per update would queue behind the device step in flight: the rates of
  # a table's updates are evaluated together, when it is filled.
  evaluated = []

  def schedule(count):
    jax.debug.callback(evaluated.append, count)
    return 1e-3 * (1 + count)

  weights, batches = problem()
  host = HostAdamW([to_host(jnp.asarray(w)) for w in weights], learning_rate=schedule, **HYPER)
  for batch in batches:
    host.update(*device_step(host.params, batch))
  host.finish()
  table = list(range(host_adamw._SCHEDULE_TABLE))
  assert [int(c) for c in evaluated] == table
  assert host._learning_rate(1500) == pytest.approx(1e-3 * 1501)
  assert [int(c) for c in evaluated] == table + [1500 + c for c in table]


def test_learning_rates_round_as_in_the_device_step():
  # optax evaluates the schedule at a scalar count inside the step; a vectorised
  # table rounded some of the trainer's rates one bit apart on XLA:CPU.
  sched = learning_rate(load_config("configs/llama_1b.yaml", []))
  host = HostAdamW([to_host(jnp.ones(4))], learning_rate=sched, **HYPER)
  in_step = jax.jit(sched)
  for count in range(0, 2500, 7):  # Warm-up, decay, and three tables.
    assert host._learning_rate(count) == float(in_step(jnp.int32(count))), count


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices (the CPU backend has 8 in CI)")
def test_summed_micro_batches_update_as_their_sum_does():
  weights, batches = problem()
  mesh = jax.make_mesh((4,), ("x",), devices=jax.devices()[:4])
  shardings = [jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x", None),
                                          memory_kind="pinned_host"),
               jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(),
                                          memory_kind="pinned_host")]
  make = lambda: HostAdamW([jax.device_put(np.array(w), s) for w, s in zip(weights, shardings)],
                           learning_rate=schedule, **HYPER)
  summed, whole = make(), make()
  for step in range(2):
    micro = [device_step(summed.params, batch)[0] for batch in batches[2 * step:2 * step + 2]]
    summed.accumulate(micro[0])
    squares = summed.accumulate(micro[1], square_sum=True)
    total = [np.asarray(a) + np.asarray(b) for a, b in zip(*micro)]
    # Each element once: the replicated leaf's four copies count as one.
    assert squares == pytest.approx(sum(np.sum(t.astype(np.float64) ** 2) for t in total),
                                    rel=1e-12)
    total = [jax.device_put(t, s) for t, s in zip(total, shardings)]
    summed.update((), 0.5)
    whole.update(total, 0.5)
  assert max_rel_diff(summed.snapshot(), whole.snapshot()) == 0.0
  with pytest.raises(ValueError, match="update after accumulate applies the sums"):
    summed.accumulate(micro[0])
    summed.update(micro[0])


def test_host_array_copies_compile_once_per_dtype_and_shape():
  x = jax.device_put(jnp.arange(16.0).reshape(4, 4))
  for _ in range(3):
    np.testing.assert_array_equal(np.asarray(numpy_views.copy(x)), np.asarray(x))
    assert numpy_views.copy(x, jnp.bfloat16).dtype == jnp.bfloat16
  for dtype in (None, jnp.dtype(jnp.bfloat16)):
    assert numpy_views._copier(dtype, x.sharding)._cache_size() == 1


def test_the_device_waits_for_room_before_it_sends_more_gradients():
  import concurrent.futures

  from jaxoffload.host.held_update import HeldUpdate
  grads = {(i, None): to_host(jnp.full(256, float(i))) for i in range(4)}
  applied = []
  executor = concurrent.futures.ThreadPoolExecutor(1)
  held = HeldUpdate({}, lambda piece, grad, scale: applied.append(piece), 1.0,
                    order=list(grads), executor=executor)
  for piece, grad in grads.items():
    held.wait_for_room(0)  # No gradient pending: those given before are applied.
    assert applied == list(grads)[:piece[0]]
    held.add({piece: grad})
  assert held.apply() and applied == list(grads)
  # Without its scale the update cannot apply them (clipped, not speculating): no waiting.
  held = HeldUpdate({}, lambda *_: None, None, order=[(0, None)], executor=executor)
  held.add(dict([next(iter(grads.items()))]))
  held.wait_for_room(0)
  held.add({}, 1.0)
  assert held.apply()
