"""The host AdamW kernel: optax.adamw's numbers, in place, and on JAX's own host buffers."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

from jaxoffload import rounding
from jaxoffload.host import adam
from jaxoffload.optim import blockwise
from tests import helpers

HYPER = dict(b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
SCHEDULE = [3e-3, 2e-3, 1e-3, 1e-3, 5e-4]


def float64_adamw(param, grads):
  return helpers.float64_adamw(param, grads, SCHEDULE, **HYPER)


@pytest.fixture
def problem():
  rng = np.random.default_rng(0)
  param = rng.standard_normal((64, 33)).astype(np.float32)
  grads = [rng.standard_normal(param.shape).astype(np.float32) for _ in SCHEDULE]
  return param, grads


def test_matches_optax_adamw_and_float64(problem):
  param, grads = problem
  got, mu, nu = param.copy(), np.zeros_like(param), np.zeros_like(param)
  for count, (grad, lr) in enumerate(zip(grads, SCHEDULE), start=1):
    adam.adamw_update(got, grad, mu, nu, learning_rate=lr, count=count, **HYPER)

  want = jnp.asarray(param)
  opt = optax.adamw(lambda count: jnp.asarray(SCHEDULE)[count], **HYPER)
  state = opt.init(want)
  for grad in grads:
    updates, state = opt.update(jnp.asarray(grad), state, want)
    want = optax.apply_updates(want, updates)

  exact = float64_adamw(param, grads)
  scale = np.max(np.abs(exact))
  assert np.max(np.abs(got - exact)) / scale <= 1e-6
  assert np.max(np.abs(got - np.asarray(want))) / scale <= 1e-6
  np.testing.assert_allclose(mu, np.asarray(state[0].mu), rtol=1e-6, atol=1e-7)


def test_updates_a_jax_host_array_in_place(problem):
  param, grads = problem
  expected = param.copy()
  adam.adamw_update(expected, grads[0], np.zeros_like(param), np.zeros_like(param),
                         learning_rate=1e-2, count=1, **HYPER)
  host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
  # A copy: on the CPU backend device_put may share the numpy array's memory.
  weights = jax.device_put(param.copy(), host)
  mu, nu = (jax.device_put(np.zeros_like(param), host) for _ in range(2))
  jax.block_until_ready((weights, mu, nu))
  views = [adam.writable_view(x) for x in (weights, mu, nu)]
  adam.adamw_update(views[0], grads[0], views[1], views[2], learning_rate=1e-2, count=1,
                         **HYPER)
  # A computation reads the buffer itself, as the next training step would.
  np.testing.assert_array_equal(np.asarray(jax.jit(lambda w: w * 1.0)(weights)), expected)
  assert weights.sharding.memory_kind == "pinned_host"


@pytest.mark.parametrize("change, message", [
    (lambda a: a.astype(np.float64), "grad must be float32 or bfloat16, got float64"),
    (lambda a: np.asfortranarray(a), "grad must be C-contiguous"),
    (lambda a: a[:, :4].copy(), r"grad has shape \(64, 4\), param has \(64, 33\)"),
])
def test_bad_arrays_are_named(problem, change, message):
  param, grads = problem
  zeros = np.zeros_like(param)
  with pytest.raises(ValueError, match=message):
    adam.adamw_update(param, change(grads[0]), zeros, zeros.copy(), learning_rate=1e-3,
                           count=1)


def test_step_count_starts_at_one(problem):
  param, grads = problem
  with pytest.raises(ValueError, match="count must be at least 1"):
    adam.adamw_update(param, grads[0], np.zeros_like(param), np.zeros_like(param),
                           learning_rate=1e-3, count=0)


def test_writable_view_refuses_sharded_arrays():
  # CPU devices: the test's CPU backend has 8 wherever it runs, a GPU machine too.
  mesh = jax.make_mesh((2,), ("x",), devices=jax.devices("cpu")[:2])
  sharded = jax.device_put(np.zeros(8, np.float32),
                           jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x")))
  with pytest.raises(ValueError, match="writable_view takes an array of one shard, got 2"):
    adam.writable_view(sharded)


def test_scaled_gradients_update_as_the_scaled_gradients_do(problem):
  param, grads = problem
  prescaled, moments = param.copy(), [np.zeros_like(param) for _ in range(4)]
  adam.adamw_update(prescaled, grads[0] * np.float32(0.5), moments[0], moments[1],
                         learning_rate=1e-2, count=1, **HYPER)
  scaled = param.copy()
  adam.adamw_update(scaled, grads[0], moments[2], moments[3], learning_rate=1e-2, count=1,
                         grad_scale=0.5, **HYPER)
  assert not np.array_equal(scaled, param)
  np.testing.assert_array_equal(scaled, prescaled)
  np.testing.assert_array_equal(moments[2], moments[0])


def test_bfloat16_gradients_update_as_their_float32_values(problem):
  param, grads = problem
  grad_bf16 = grads[0].astype(ml_dtypes.bfloat16)
  want, moments = param.copy(), [np.zeros_like(param) for _ in range(4)]
  adam.adamw_update(want, grad_bf16.astype(np.float32), moments[0], moments[1],
                         learning_rate=1e-2, count=1, **HYPER)
  got = param.copy()
  adam.adamw_update(got, grad_bf16, moments[2], moments[3], learning_rate=1e-2, count=1,
                         **HYPER)
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(moments[2], moments[0])


def test_split_weights_are_the_float32_master_exactly(problem):
  param, grads = problem
  # Ties, specials and the largest float: where a wrong split would show.
  param[0, :7] = [1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -0.0, np.inf, np.nan, 3.0e38, -2.5e-3]
  high, remainder = rounding.split_master(param)
  np.testing.assert_array_equal(rounding.join_master(high, remainder).view(np.uint32)[1:],
                                param.view(np.uint32)[1:])
  # The bfloat16 half is the master rounded to nearest, ties away from zero.
  assert high.view(ml_dtypes.bfloat16)[0, :2].astype(np.float32).tolist() == [
      1.0 + 2.0**-7, 1.0 + 2.0**-6]
  assert np.isnan(high.view(ml_dtypes.bfloat16)[0, 4])
  untied = np.abs(param.view(np.uint32).astype(np.int64) & 0xFFFF) != 0x8000
  numbers = untied & np.isfinite(param)
  np.testing.assert_array_equal(high[numbers], param.astype(ml_dtypes.bfloat16).view(np.uint16)[numbers])

  whole, moments = param.copy(), [np.zeros_like(param) for _ in range(4)]
  weights = high.view(ml_dtypes.bfloat16)
  for count, grad in enumerate(grads[:3], start=1):
    adam.adamw_update(whole, grad, moments[0], moments[1], learning_rate=1e-2,
                           count=count, **HYPER)
    adam.adamw_update(weights, grad, moments[2], moments[3], learning_rate=1e-2,
                           count=count, remainder=remainder, **HYPER)
  finite = np.isfinite(whole)
  np.testing.assert_array_equal(rounding.join_master(weights, remainder)[finite], whole[finite])
  np.testing.assert_array_equal(weights, rounding.split_master(whole)[0].view(ml_dtypes.bfloat16))
  with pytest.raises(ValueError, match="a remainder completes bfloat16 weights; param is float32"):
    adam.adamw_update(whole, grads[0], moments[0], moments[1], learning_rate=1e-2,
                           count=4, remainder=remainder)


def test_bfloat16_weights_round_each_update_stochastically_as_the_device_does(problem):
  param, grads = problem
  weights = param.astype(ml_dtypes.bfloat16)
  settings = dict(learning_rate=1e-2, count=3, **HYPER)
  unrounded, moments = weights.astype(np.float32), [np.zeros_like(param) for _ in range(4)]
  adam.adamw_update(unrounded, grads[0], moments[0], moments[1], **settings)
  adam.adamw_update(weights, grads[0], moments[2], moments[3], **settings)
  device = np.asarray(rounding.stochastic_round(jnp.asarray(unrounded), 3))
  np.testing.assert_array_equal(weights.view(np.uint16), device.view(np.uint16))
  with pytest.raises(ValueError, match="bfloat16 weights without their remainder cannot be "
                                       "taken back"):
    adam.adamw_undo(weights, grads[0], moments[2], moments[3], **settings)


@pytest.mark.parametrize("moments", ["int8", pytest.param("mu int8", marks=pytest.mark.slow),
                                     pytest.param("nu int8", marks=pytest.mark.slow)])
def test_eight_bit_moments_are_the_float32_ones_encoded_as_jax_encodes_them(problem, moments):
  param, grads = problem
  coded = {"mu": "mu" in moments or moments == "int8", "nu": "nu" in moments or moments == "int8"}
  rng = np.random.default_rng(3)
  history = {"mu": 0.1 * rng.standard_normal(param.shape), "nu": rng.random(param.shape)}
  stored = {}
  for name, signed in (("mu", True), ("nu", False)):
    if coded[name]:
      stored[name] = adam.CodedMoment.zeros(param.shape, signed=signed)
      stored[name].assign(history[name])
      history[name] = stored[name].decode()  # The values the kernel starts from.
    else:
      stored[name] = history[name].astype(np.float32)
  settings = dict(learning_rate=1e-2, count=5, **HYPER)
  want = [param.copy(), history["mu"].astype(np.float32), history["nu"].astype(np.float32)]
  adam.adamw_update(*want[:1], grads[0], *want[1:], **settings)
  got = param.copy()
  adam.adamw_update(got, grads[0], stored["mu"], stored["nu"], **settings)
  # The update reads the new moments before they are encoded ...
  np.testing.assert_array_equal(got, want[0])
  # ... which are stored as jaxoffload.optim.blockwise encodes them.
  for name, signed, unrounded in (("mu", True, want[1]), ("nu", False, want[2])):
    if not coded[name]:
      np.testing.assert_array_equal(stored[name], unrounded)
      continue
    codes, scales = blockwise.encode(jnp.asarray(unrounded), signed=signed)
    np.testing.assert_array_equal(stored[name].codes, np.asarray(codes))
    np.testing.assert_array_equal(stored[name].scales, np.asarray(scales))
    assert stored[name].scales.shape == (64, 1)  # A row of 33 elements: one block.


def test_eight_bit_moments_train_close_to_float64_adam():
  rng = np.random.default_rng(4)
  param = rng.standard_normal((8, 1000)).astype(np.float32)  # Rows of four blocks, one short.
  grads = [rng.standard_normal(param.shape).astype(np.float32) * np.float32(1 + 9 * k % 3)
           for k in range(len(SCHEDULE))]
  exact = float64_adamw(param, grads)
  results = {}
  for kind in ("float32", "bfloat16", "int8"):
    got = param.copy()
    if kind == "int8":
      mu = adam.CodedMoment.zeros(param.shape, signed=True)
      nu = adam.CodedMoment.zeros(param.shape, signed=False)
    else:
      mu, nu = np.zeros(param.shape, kind), np.zeros(param.shape, kind)
    for count, (grad, lr) in enumerate(zip(grads, SCHEDULE), start=1):
      adam.adamw_update(got, grad, mu, nu, learning_rate=lr, count=count, **HYPER)
    results[kind] = np.max(np.abs(got - exact)) / np.max(np.abs(param - exact))
  # Each error as a share of how far the weights moved.
  assert results["float32"] < 1e-4
  assert results["bfloat16"] < 1e-2
  assert results["int8"] < 3e-2


def test_eight_bit_moments_of_a_wrong_kind_are_named(problem):
  param, grads = problem
  mu = adam.CodedMoment.zeros(param.shape, signed=True)
  with pytest.raises(ValueError, match="nu must have uint8 codes, got int8"):
    adam.adamw_update(param, grads[0], mu, mu, learning_rate=1e-3, count=1)
  nu = adam.CodedMoment.zeros(param.shape, signed=False)
  with pytest.raises(ValueError, match="mu must be float32, got 8-bit codes"):
    adam.adamw_undo(param, grads[0], mu, nu, learning_rate=1e-3, count=1)


def test_gradients_sum_in_float32_and_their_squares_in_float64(problem):
  _, grads = problem
  total = np.full_like(grads[0], np.nan)  # Not read by the first sum.
  adam.accumulate(total, grads[0], first=True)
  halved = grads[1].astype(ml_dtypes.bfloat16)
  squares = adam.accumulate(total, halved, square_sum=True)
  want = grads[0] + halved.astype(np.float32)
  np.testing.assert_array_equal(total, want)
  assert squares == pytest.approx(float(np.sum(want.astype(np.float64) ** 2)), rel=1e-12)
  assert adam.accumulate(total, grads[2]) == 0.0
  with pytest.raises(ValueError, match=r"grad has shape \(64, 4\), total has \(64, 33\)"):
    adam.accumulate(total, grads[0][:, :4].copy())


@pytest.mark.parametrize("grad_dtype", [np.float32, ml_dtypes.bfloat16])
def test_an_undone_update_restores_the_state_and_a_scaled_redo_matches_one_update(problem,
                                                                                  grad_dtype):
  param, grads = problem
  settings = dict(learning_rate=1e-2, count=3, **HYPER)
  rng = np.random.default_rng(1)
  # Moments of an earlier history, well above a rounding of the new gradient's terms.
  mu = (0.3 * rng.standard_normal(param.shape)).astype(np.float32)
  nu = (0.5 + rng.random(param.shape)).astype(np.float32)
  grad = grads[0].astype(grad_dtype)
  state = [param.copy(), mu.copy(), nu.copy()]
  adam.adamw_update(state[0], grad, state[1], state[2], **settings)
  assert not np.array_equal(state[0], param)
  adam.adamw_undo(state[0], grad, state[1], state[2], **settings)
  for got, want in zip(state, (param, mu, nu)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

  # Undone and redone scaled, as a clipped speculation is: a few roundings from updating
  # scaled at once (whose own distance from float64 the first test bounds).
  adam.adamw_update(state[0], grad, state[1], state[2], grad_scale=0.05, **settings)
  once = [param.copy(), mu.copy(), nu.copy()]
  adam.adamw_update(once[0], grad, once[1], once[2], grad_scale=0.05, **settings)
  np.testing.assert_allclose(state[0], once[0], rtol=1e-6, atol=1e-7)
  for got, want in zip(state[1:], once[1:]):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_an_undone_second_moment_never_goes_below_zero(problem):
  param, grads = problem
  # A first update from zero moments: undone, the second moment is rounding noise around 0.
  mu, nu = np.zeros_like(param), np.zeros_like(param)
  settings = dict(learning_rate=1e-2, count=1, **HYPER)
  adam.adamw_update(param, grads[0], mu, nu, **settings)
  adam.adamw_undo(param, grads[0], mu, nu, **settings)
  assert nu.min() >= 0.0 and nu.max() <= 1e-6 * np.max(grads[0] ** 2)
  with pytest.raises(ValueError, match="count must be at least 1"):
    adam.adamw_undo(param, grads[0], mu, nu, learning_rate=1e-2, count=0)


def test_bfloat16_moments_round_stochastically_as_the_device_does(problem):
  param, grads = problem
  rng = np.random.default_rng(2)
  mu = (0.1 * rng.standard_normal(param.shape)).astype(ml_dtypes.bfloat16)
  nu = rng.random(param.shape).astype(ml_dtypes.bfloat16)
  settings = dict(learning_rate=1e-2, count=7, **HYPER)
  got = [param.copy(), mu.copy(), nu.copy()]
  adam.adamw_update(got[0], grads[0], got[1], got[2], **settings)
  # The update is float32 moments' (computed before rounding) ...
  want = [param.copy(), mu.astype(np.float32), nu.astype(np.float32)]
  adam.adamw_update(want[0], grads[0], want[1], want[2], **settings)
  np.testing.assert_array_equal(got[0], want[0])
  # ... and the moments are stored as jaxoffload.optim.offloaded_adam rounds them, salted by the step.
  for stored, unrounded, salt in ((got[1], want[1], 14), (got[2], want[2], 15)):
    device = np.asarray(rounding.stochastic_round(jnp.asarray(unrounded), salt))
    np.testing.assert_array_equal(stored.view(np.uint16), device.view(np.uint16))
    assert not np.array_equal(stored, unrounded.astype(ml_dtypes.bfloat16))  # Not nearest.
  with pytest.raises(ValueError, match="mu must be float32, got bfloat16"):
    adam.adamw_undo(*got[:1], grads[0], *got[1:], **settings)


COMPILE_A_STEP = """
import ml_dtypes, numpy as np
from jaxoffload.host import adam
param = np.zeros(64, ml_dtypes.bfloat16)
adam.adamw_update(param, np.ones(64, ml_dtypes.bfloat16), np.zeros(64, ml_dtypes.bfloat16),
                       np.zeros(64, ml_dtypes.bfloat16), learning_rate=1e-3, count=1,
                       remainder=np.zeros(64, np.uint16))
"""


@pytest.mark.slow
def test_the_next_process_finds_the_compiled_step_in_numbas_cache(tmp_path):
  # A kernel whose cache key changes from process to process compiles again in every run
  # and leaves one more file in the cache each time.
  environment = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
  cached = []
  for _ in range(2):
    subprocess.run([sys.executable, "-c", COMPILE_A_STEP], env=environment, check=True)
    cached.append(sorted(p.name for p in tmp_path.rglob("*step_kernel*")))
  assert cached[0] and cached[1] == cached[0]
