"""Where offload_adamw keeps its state: memory kinds, bytes per kind, compilation, sharding."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxoffload
from tests.helpers import (assert_moments_placed, max_rel_diff, mixed_params, moment_kinds,
                           relayouts, train)

MODES = ["host", "device"]


@pytest.mark.parametrize("update_on", MODES)
@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_offloaded_moments_stay_in_pinned_host(update_on, jit):
  opt = jaxoffload.offload_adamw(1e-3, offload_fraction=0.5, update_on=update_on)
  seen = []
  # Plain donation, no out_shardings: safe here, as no device output of the step
  # comes before an offloaded moment of the same shape without a donated input.
  train(opt, mixed_params(), 3, jit=jit, on_state=lambda s: seen.append(moment_kinds(s[0])),
        pin_out_shardings=False)
  assert len(seen) == 4  # After init and after each of the three steps.
  for kinds in seen:
    assert {k for o, k in kinds if o} == {"pinned_host"}
    assert {k for o, k in kinds if not o} == {"device"}


@pytest.mark.parametrize("update_on", MODES)
def test_second_step_does_not_recompile(update_on):
  opt = jaxoffload.offload_adamw(1e-3, offload_fraction=0.5, update_on=update_on)
  _, _, step = train(opt, mixed_params(), 3)
  assert step._cache_size() == 1


@pytest.mark.parametrize("fraction", [0.0, 0.25, 0.5, 1.0])
def test_state_bytes_per_memory_kind_match_achieved_fraction(fraction):
  params = mixed_params()
  state = jaxoffload.offload_adamw(1e-3, offload_fraction=fraction).init(params)
  plan = jaxoffload.find_offload_plan(state)
  moments = (state[0].mu, state[0].nu)
  by_kind = jaxoffload.bytes_by_memory_kind(moments)
  itemsize = 4
  assert by_kind.get("pinned_host", 0) == 2 * itemsize * plan.offloaded_elements
  assert by_kind.get("device", 0) == 2 * itemsize * (plan.total_elements - plan.offloaded_elements)
  left_out = [x.size for x, o in zip(jax.tree.leaves(params), plan.offloaded)
              if not o and x.ndim > 0]
  assert abs(plan.offloaded_elements - fraction * plan.total_elements) <= min(
      left_out, default=0) / 2 + 1  # + 1: the scalar 'scale' leaf stays on the device.


def test_scalar_leaves_stay_on_device():
  params = {"w": jnp.zeros(8), "scale": jnp.zeros(())}
  assert jaxoffload.plan_offload(params).offloaded_paths == ("w",)
  assert jaxoffload.plan_offload(params, offload_mask=lambda p, x: True).offloaded_paths == ("w",)


def test_plan_takes_the_share_nearest_the_fraction():
  params = {"a": jnp.zeros(30), "b": jnp.zeros(60), "c": jnp.zeros(10)}
  nearest = {0.3: ("a",), 0.4: ("a", "c"), 0.62: ("b",), 0.68: ("b", "c"), 0.9: ("a", "b"),
             0.96: ("a", "b", "c"), 0.04: ("c",), 0.0: ()}
  for fraction, paths in nearest.items():
    assert jaxoffload.plan_offload(params, offload_fraction=fraction).offloaded_paths == paths
  # Filling in tree order would take 'a' and 'b' (90%) for 40%.
  assert "40.00%" in str(jaxoffload.plan_offload(params, offload_fraction=0.4))


def test_plan_takes_the_first_leaves_ahead_of_larger_ones():
  params = {"a": jnp.zeros(30), "b": jnp.zeros(60), "c": jnp.zeros(10)}
  first = lambda path, leaf: path == "c"
  ahead = {0.6: ("a", "c"), 0.1: ("c",), 0.7: ("b", "c"), 1.0: ("a", "b", "c")}
  for fraction, paths in ahead.items():
    plan = jaxoffload.plan_offload(params, offload_fraction=fraction, first=first)
    assert plan.offloaded_paths == paths, fraction
  # Largest first, 0.6 takes 'b' alone.
  assert jaxoffload.plan_offload(params, offload_fraction=0.6).offloaded_paths == ("b",)
  with pytest.raises(ValueError, match="first must have the parameters' tree structure"):
    jaxoffload.plan_offload(params, offload_fraction=0.5, first={"a": True})
  with pytest.raises(ValueError, match="offload_mask picks them itself"):
    jaxoffload.plan_offload(params, offload_mask=first, first=first)


def test_plan_takes_a_leaf_for_any_fraction_above_zero():
  params = {"big": jnp.zeros(1000), "small": jnp.zeros(100)}
  assert jaxoffload.plan_offload(params, offload_fraction=0.001).offloaded_paths == ("small",)


@pytest.mark.parametrize("seed", range(20))
def test_plan_misses_the_share_by_at_most_half_a_leaf(seed):
  rng = np.random.default_rng(seed)
  sizes = rng.integers(1, 1000, size=rng.integers(2, 12))
  params = {f"leaf{i:02d}": jax.ShapeDtypeStruct((int(n),), jnp.float32)
            for i, n in enumerate(sizes)}
  fraction = float(rng.uniform(0.01, 1.0))
  plan = jaxoffload.plan_offload(params, offload_fraction=fraction)
  offloaded = [n for n, o in zip(sizes, plan.offloaded) if o]
  left_out = [n for n, o in zip(sizes, plan.offloaded) if not o]
  error = plan.offloaded_elements - fraction * sizes.sum()
  if error <= 0:
    assert -error <= min(left_out) / 2
  else:  # Past the share by adding a leaf that lands nearer, or the one leaf taken.
    assert error <= max(offloaded) / 2 or len(offloaded) == 1


def test_plan_from_mask_tree_and_predicate():
  params = mixed_params()
  by_path = jaxoffload.plan_offload(params, offload_mask=lambda path, leaf: path.startswith("layer/"))
  assert by_path.offloaded_paths == ("layer/bias", "layer/kernel", "layer/out")
  mask = jax.tree.map(lambda _: False, params)
  mask["embed"] = True
  by_tree = jaxoffload.plan_offload(params, offload_mask=mask)
  assert by_tree.offloaded_paths == ("embed",)
  state = jaxoffload.offload_adamw(1e-3, offload_mask=mask).init(params)
  assert state[0].mu["embed"].sharding.memory_kind == "pinned_host"
  assert state[0].mu["norm"].sharding.memory_kind == "device"


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), "half", True])
def test_fraction_outside_range_is_refused(bad):
  with pytest.raises(ValueError, match=r"offload_fraction must be .*\[0\.0, 1\.0\].*got"):
    jaxoffload.offload_adamw(1e-3, offload_fraction=bad)


def test_unknown_update_place_is_refused():
  with pytest.raises(ValueError, match=r"update_on must be one of \('host', 'device'\), got 'gpu'"):
    jaxoffload.scale_by_offloaded_adam(update_on="gpu")


def test_integer_leaf_is_refused():
  opt = jaxoffload.offload_adamw(1e-3)
  with pytest.raises(ValueError, match=r"\['step'\] has dtype int32.*Allowed: float16, bfloat16"):
    opt.init({"w": jnp.zeros(3), "step": jnp.zeros((), jnp.int32)})


def test_mask_with_fraction_is_refused():
  with pytest.raises(ValueError, match="offload_mask picks the offloaded leaves itself"):
    jaxoffload.offload_adamw(1e-3, offload_fraction=0.5, offload_mask=lambda p, x: True)


def test_shardings_of_another_structure_are_refused():
  opt = jaxoffload.scale_by_offloaded_adam(update_on="device", shardings={"b": None})
  with pytest.raises(ValueError, match="shardings must have the parameters' tree structure"):
    opt.init({"a": jnp.zeros(2)})


def test_mask_of_wrong_structure_is_refused():
  with pytest.raises(ValueError, match="offload_mask must have the parameters' tree structure"):
    jaxoffload.plan_offload({"a": jnp.zeros(2)}, offload_mask={"b": True})


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (the CPU backend has them in CI)")
@pytest.mark.parametrize("fraction", [0.5, 1.0])
@pytest.mark.parametrize("update_on", MODES)
def test_sharded_state_follows_parameter_sharding(update_on, fraction):
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("fsdp", "tensor"))
  specs = {"embed": P("fsdp", "tensor"), "layer": {"kernel": P(None, "tensor"), "bias": P("tensor"),
                                                   "out": P("tensor", "fsdp")},
           "norm": P(), "scale": P()}
  params = mixed_params()
  sharded = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)
  opt = optax.chain(jaxoffload.scale_by_offloaded_adam(offload_fraction=fraction, update_on=update_on,
                                                       chunk_bytes=1024),
                    optax.scale(-1e-2))
  got, state, step = train(opt, sharded, 5)
  want, _, _ = train(optax.chain(optax.scale_by_adam(), optax.scale(-1e-2)), params, 5)
  assert max_rel_diff(got, want) <= 1e-5
  assert step._cache_size() == 1
  assert_moments_placed(state[0])
  for moments in (state[0].mu, state[0].nu):
    for x, spec in zip(jax.tree.leaves(moments), jax.tree.leaves(specs)):
      kind = x.sharding.memory_kind
      assert x.sharding.is_equivalent_to(NamedSharding(mesh, spec, memory_kind=kind), x.ndim)
      # Each device's shard lives in that device's own memory of that kind.
      assert {s.data.sharding.memory_kind for s in x.addressable_shards} == {kind}


def test_relayouts_finds_a_transpose():
  hlo = jax.jit(lambda x: jnp.transpose(x.reshape(8, 8, 32), (2, 0, 1)) + 1).lower(
      jnp.ones((64, 32))).compile().as_text()
  assert relayouts(hlo)
  assert relayouts(jax.jit(lambda x: x * 2 + 1).lower(jnp.ones((64, 32))).compile().as_text()) == []


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (the CPU backend has them in CI)")
@pytest.mark.parametrize("overlap", [False, pytest.param(True, marks=pytest.mark.slow)])
@pytest.mark.parametrize("jit_init", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["eager-init", "jitted-init"])
def test_a_sharded_streamed_update_moves_no_state_between_devices(overlap, jit_init):
  # Pieces of a whole flattened leaf would cross its shards: XLA would gather them.
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("fsdp", "tensor"))
  specs = {"embed": P("fsdp", "tensor"), "kernel": P(None, "tensor"), "out": P("tensor", "fsdp")}
  shapes = {"embed": (64, 32), "kernel": (32, 48), "out": (48, 32)}
  params = {k: jax.device_put(jnp.ones(shapes[k]), NamedSharding(mesh, specs[k])) for k in specs}
  make = lambda shardings=None: jaxoffload.scale_by_offloaded_adam(
      update_on="device", chunk_bytes=256, overlap_transfers=overlap, shardings=shardings)
  opt = make()
  state = opt.init(params)
  if jit_init:  # A jitted init sees no shardings: they are given, as the trainer gives them.
    opt = make(jax.tree.map(lambda x: x.sharding, params))
    state = jax.jit(opt.init, out_shardings=jax.tree.map(lambda x: x.sharding, state))(params)
  grads = jax.tree.map(lambda p: p * jnp.linspace(-1, 1, p.size).reshape(p.shape), params)
  update = jax.jit(opt.update, donate_argnums=(1,),
                   out_shardings=jax.tree.map(lambda x: x.sharding, (params, state)))
  hlo = update.lower(grads, state).compile().as_text()
  assert " while(" in hlo  # Streamed in pieces.
  for collective in ("all-gather", "all-to-all", "collective-permute", "all-reduce"):
    assert f" {collective}(" not in hlo, collective
  # Nor between layouts: on two GPUs re-layouts of the offloaded state cost the most.
  assert relayouts(hlo) == []
  adam = optax.scale_by_adam()
  reference = adam.init(params)
  for _ in range(2):  # The second step reuses the first's program.
    got, state = update(grads, state)
    want, reference = adam.update(grads, reference)
  assert max_rel_diff(got, want) <= 1e-6
  assert update._cache_size() == 1
  assert_moments_placed(state)


def test_a_share_whole_leaves_miss_is_warned_about_where_the_state_is_made():
  params = {"big": jnp.zeros((90, 10)), "small": jnp.zeros(100)}  # 90% and 10%.
  with pytest.warns(UserWarning, match=r"offload_fraction=0.5: whole leaves offload 0.10 of the "
                                       r"parameter elements \(optimizer state offloaded for 100 "
                                       r"of 1,000 .*\); pick the leaves with offload_mask"):
    jaxoffload.scale_by_offloaded_adam(offload_fraction=0.5).init(params)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    jaxoffload.scale_by_offloaded_adam(offload_fraction=0.9).init(params)
    jaxoffload.scale_by_offloaded_adam(offload_mask=lambda path, _: path == "big").init(params)
