"""The transformations inside Flax NNX's ``nnx.Optimizer``: initialised on ``Param``
variables, updated with arrays, jitted with ``nnx.jit`` or not; losses against
``optax.adamw``'s, the offloaded moments in pinned_host."""

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import jaxoffload

STEPS = 20
SCHEDULE = optax.linear_schedule(1e-2, 1e-3, STEPS)


class MLP(nnx.Module):

  def __init__(self, rngs: nnx.Rngs):
    self.l1 = nnx.Linear(16, 48, rngs=rngs)
    self.l2 = nnx.Linear(48, 4, rngs=rngs)

  def __call__(self, x):
    return self.l2(jax.nn.relu(self.l1(x)))


def adamw(offloaded, **kwargs):
  """``jaxoffload.offload_adamw`` with ``kwargs``, or where not ``offloaded`` optax's."""
  if offloaded is None:
    return optax.adamw(SCHEDULE, weight_decay=1e-2)
  return jaxoffload.offload_adamw(SCHEDULE, weight_decay=1e-2, **offloaded)


# One row per way a user builds the optimizer: a function of the Adam in it.
WAYS = {
    "alone": lambda adam: adam,
    "clipped": lambda adam: optax.chain(optax.clip_by_global_norm(0.05), adam),
    "multi-steps": lambda adam: optax.MultiSteps(adam, every_k_schedule=2),
}


def losses(tx, jit: bool) -> tuple[list[float], nnx.Optimizer]:
  model = MLP(nnx.Rngs(0))
  opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
  x = jax.random.normal(jax.random.key(1), (8, 16))
  y = jax.random.normal(jax.random.key(2), (8, 4))

  def step(model, opt):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    opt.update(model, grads)
    return loss

  step = nnx.jit(step) if jit else step
  return [float(step(model, opt)) for _ in range(STEPS)], opt


def offloaded_state(opt: nnx.Optimizer) -> jaxoffload.ScaleByOffloadedAdamState:
  is_state = lambda x: isinstance(x, jaxoffload.ScaleByOffloadedAdamState)
  state, = [x for x in jax.tree.leaves(nnx.as_pure(opt.opt_state), is_leaf=is_state)
            if is_state(x)]
  return state


# Eager steps dispatch every operation on its own: the slow tier's.
CASES = [pytest.param(way, update_on, jit, id=f"{way}-{update_on}-{'jit' if jit else 'eager'}",
                      marks=() if jit else pytest.mark.slow)
         for way in WAYS for update_on in ("device", "host") for jit in (True, False)
         if jit or way == "alone"]


@pytest.mark.parametrize("way, update_on, jit", CASES)
def test_nnx_optimizer_trains_as_optax_adamw(way, update_on, jit):
  got, opt = losses(WAYS[way](adamw({"offload_fraction": 1.0, "update_on": update_on})), jit)
  want, _ = losses(WAYS[way](adamw(None)), jit)
  assert max(abs(a - b) / abs(b) for a, b in zip(got, want)) <= 1e-5
  state = offloaded_state(opt)
  assert all(state.plan.offloaded)
  assert {x.sharding.memory_kind for x in jax.tree.leaves((state.mu, state.nu))} == {
      "pinned_host"}


@pytest.mark.parametrize("update_on", ["device", "host"])
def test_under_inject_hyperparams_the_learning_rate_is_the_users(update_on):
  injected = lambda adam: optax.inject_hyperparams(
      lambda learning_rate: adam(learning_rate, weight_decay=1e-2))(learning_rate=1e-2)
  got, opt = losses(injected(lambda lr, **kw: jaxoffload.offload_adamw(
      lr, offload_fraction=1.0, update_on=update_on, **kw)), jit=True)
  want, _ = losses(injected(optax.adamw), jit=True)
  assert max(abs(a - b) / abs(b) for a, b in zip(got, want)) <= 1e-5
  assert nnx.as_pure(opt.opt_state).hyperparams["learning_rate"] == pytest.approx(1e-2)


def test_a_mask_sees_nnx_paths_without_their_variables():
  kernels = lambda path, _: path.endswith("kernel")
  _, opt = losses(adamw({"offload_mask": kernels, "update_on": "device"}), jit=True)
  plan = offloaded_state(opt).plan
  leaves = jax.tree_util.tree_flatten_with_path(nnx.as_pure(nnx.state(MLP(nnx.Rngs(0)),
                                                                         nnx.Param)))[0]
  names = [jax.tree_util.keystr(path) for path, _ in leaves]
  assert [n.endswith("'kernel']") for n in names] == list(plan.offloaded)
  assert any(plan.offloaded) and not all(plan.offloaded)
