"""Stochastic rounding to bfloat16: near its value, unbiased, and what keeps Adam's nu moving."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxoffload.rounding import apply_updates, stochastic_round
from jaxoffload.train.grads import add_to_sum


def test_each_value_lands_within_one_bfloat16_step():
  x = np.random.default_rng(0).standard_normal(100_000).astype(np.float32)
  rounded = stochastic_round(jnp.asarray(x), 3)
  assert rounded.dtype == jnp.bfloat16
  step = np.spacing(np.abs(x)).astype(np.float64) * 2**16  # bfloat16 keeps 16 fewer bits.
  assert np.all(np.abs(np.asarray(rounded, np.float64) - x) < step)


def test_on_average_a_value_rounds_to_itself_where_nearest_rounding_is_biased():
  x = jnp.float32(1 + 2**-9)  # A quarter of the way from 1 to the next bfloat16, 1 + 2**-7.
  salts = jnp.arange(4096)
  rounded = np.asarray(jax.vmap(lambda s: stochastic_round(x, s))(salts), np.float64)
  assert set(np.unique(rounded)) == {1.0, 1 + 2**-7}
  assert abs(rounded.mean() - (1 + 2**-9)) < 2.5e-4  # Nearest rounding is off by 2**-9.
  assert float(x.astype(jnp.bfloat16)) == 1.0


def test_a_bfloat16_second_moment_decays_with_stochastic_rounding_and_sticks_without():
  b2, rng = 0.999, np.random.default_rng(1)
  exact = np.zeros(1000)
  stochastic = nearest = jnp.zeros(1000, jnp.bfloat16)
  update = lambda nu, g: b2 * nu.astype(jnp.float32) + (1 - b2) * g**2
  step_sr = jax.jit(lambda nu, g, t: stochastic_round(update(nu, g), t))
  step_rn = jax.jit(lambda nu, g: update(nu, g).astype(jnp.bfloat16))
  for t in range(1500):  # Large gradients, then small ones: nu must decay by b2**1300.
    g = (rng.standard_normal(1000) * (1.0 if t < 200 else 0.1)).astype(np.float32)
    exact = b2 * exact + (1 - b2) * g.astype(np.float64)**2
    stochastic, nearest = step_sr(stochastic, g, t), step_rn(nearest, g)
  error = lambda nu: np.abs(np.asarray(nu, np.float64) - exact) / exact
  assert np.mean(error(stochastic)) < 0.1
  assert abs(np.mean(np.asarray(stochastic, np.float64)) / np.mean(exact) - 1) < 0.02
  assert np.mean(error(nearest)) > 1.0  # Stuck near where the large gradients left it.


def test_bfloat16_parameters_follow_updates_below_half_their_step():
  # Updates of about a tenth of a bfloat16 step in [1, 2): rounded to nearest, all are lost.
  rng = np.random.default_rng(2)
  start = (1.5 + 0.4 * rng.uniform(-1, 1, 10_000)).astype(jnp.bfloat16)
  steps = (-2**-7 / 10 * rng.uniform(0.5, 1.5, 10_000)).astype(np.float32)
  params = {"w": jnp.asarray(start), "b": jnp.ones(3, jnp.float32)}
  updates = {"w": jnp.asarray(steps), "b": jnp.full(3, 0.25)}
  stochastic = nearest = params
  step = jax.jit(apply_updates)
  for t in range(200):
    stochastic = step(stochastic, updates, t)
    nearest = jax.tree.map(lambda p, u: (p + u).astype(p.dtype), nearest, updates)
  exact = start.astype(np.float64) + 200 * steps.astype(np.float64)  # About 0.16 down.
  np.testing.assert_array_equal(nearest["w"], start)
  error = np.asarray(stochastic["w"], np.float64) - exact
  # Each a random walk (0.03 after 200 roundings, a few bfloat16 steps); on average none,
  # where nearest rounding is 0.16 off.
  assert abs(np.mean(error)) < 1e-3 and np.max(np.abs(error)) < 0.2
  assert stochastic["w"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(stochastic["b"], np.full(3, 51.0, np.float32))


def test_a_bfloat16_sum_of_micro_batches_stays_within_a_step_an_addition_and_unbiased():
  micro = np.random.default_rng(1).standard_normal((8, 100_000)).astype(np.float32)
  total, exact, bound = jnp.zeros(micro.shape[1], jnp.bfloat16), np.zeros(micro.shape[1]), 0.0
  for index, grads in enumerate(micro):
    total = add_to_sum(total, jnp.asarray(grads), index)
    exact += grads
    # Each addition rounds the float32 sum to one of its two bfloat16 neighbours: less
    # than one step apart at the larger of the exact sum and the rounded one.
    larger = np.maximum(np.abs(exact), np.abs(np.asarray(total, np.float64))).astype(np.float32)
    bound = bound + np.spacing(larger).astype(np.float64) * 2**16
  error = np.asarray(total, np.float64) - exact
  assert total.dtype == jnp.bfloat16
  assert np.all(np.abs(error) <= bound)
  # Unbiased: the errors' mean is within four standard errors of zero.
  assert abs(error.mean()) < 4 * error.std() / np.sqrt(error.size)
  # A float32 sum is the plain float32 sum.
  float32 = jnp.zeros(micro.shape[1], jnp.float32)
  for index, grads in enumerate(micro):
    float32 = add_to_sum(float32, jnp.asarray(grads), index)
  np.testing.assert_array_equal(np.asarray(float32), micro.sum(0, dtype=np.float32))
