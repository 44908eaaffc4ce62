"""offload_adamw inside optax's combinators gives the same numbers as optax.adamw there."""

import jax
import optax
import pytest

import jaxoffload
from tests.helpers import assert_moments_placed, max_rel_diff, mixed_params, train

MODES = ["host", "device"]
SCHEDULE = optax.linear_schedule(1e-2, 1e-3, 12)


def assert_same_training(ours, ref, steps=12):
  params = mixed_params()
  got, state, _ = train(ours, params, steps)
  want, _, _ = train(ref, params, steps)
  assert max_rel_diff(got, want) <= 1e-5
  return state


@pytest.mark.parametrize("update_on", ["device", pytest.param("host", marks=pytest.mark.slow)])
def test_inside_chain_with_clipping(update_on):
  assert_same_training(
      optax.chain(optax.clip_by_global_norm(1.0),
                  jaxoffload.offload_adamw(SCHEDULE, offload_fraction=0.5, update_on=update_on)),
      optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(SCHEDULE)))


@pytest.mark.parametrize("update_on", MODES)
def test_under_inject_hyperparams(update_on):
  ours = optax.inject_hyperparams(jaxoffload.offload_adamw)(
      learning_rate=SCHEDULE, b1=0.8, offload_fraction=0.5, update_on=update_on)
  ref = optax.inject_hyperparams(optax.adamw)(learning_rate=SCHEDULE, b1=0.8)
  state = assert_same_training(ours, ref)
  assert state.hyperparams["b1"] == pytest.approx(0.8)


def test_jitted_init_under_inject_hyperparams_needs_static_fraction():
  params = mixed_params()
  traced = optax.inject_hyperparams(jaxoffload.offload_adamw)(learning_rate=1e-3, offload_fraction=0.5)
  with pytest.raises(ValueError, match=r"static_args=\('offload_fraction',\)"):
    jax.jit(traced.init)(params)
  static = optax.inject_hyperparams(jaxoffload.offload_adamw, static_args=("offload_fraction",))(
      learning_rate=1e-3, offload_fraction=0.5)
  assert jaxoffload.find_offload_plan(jax.jit(static.init)(params)).fraction > 0


@pytest.mark.parametrize("update_on", MODES)
def test_under_multi_steps(update_on):
  ours = optax.MultiSteps(jaxoffload.offload_adamw(SCHEDULE, offload_fraction=1.0,
                                                   update_on=update_on), every_k_schedule=3)
  ref = optax.MultiSteps(optax.adamw(SCHEDULE), every_k_schedule=3)
  state = assert_same_training(ours, ref)
  assert jaxoffload.find_offload_plan(state).fraction > 0.99
  assert_moments_placed(state.inner_opt_state[0])
