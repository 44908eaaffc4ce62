"""Your own Flax model, trained with offloaded Adam inside optax's combinators.

  python examples/optax_chain.py

Half of Adam's moments live in pinned host memory and stream through the
device for the update; the rest of the chain is plain optax: clipping, weight
decay, a schedule, hyperparameters injected into the state (so they can be
changed between steps) and gradient accumulation with ``optax.MultiSteps``.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import jaxoffload


class MLP(nn.Module):
  """A small regression model: what you would write anyway."""

  @nn.compact
  def __call__(self, x):
    for _ in range(3):
      x = nn.gelu(nn.Dense(128)(x))
    return nn.Dense(1)(x)


def adamw(learning_rate, weight_decay):
  return optax.chain(
      optax.clip_by_global_norm(1.0),
      jaxoffload.scale_by_offloaded_adam(b2=0.95, offload_fraction=0.5, update_on="device"),
      optax.add_decayed_weights(weight_decay),
      optax.scale_by_learning_rate(learning_rate))


def main(steps: int = 40) -> list[float]:
  model = MLP()
  x = jax.random.normal(jax.random.PRNGKey(0), (256, 8))
  y = jnp.sin(x @ jnp.linspace(-1.0, 1.0, 8))[:, None]
  params = model.init(jax.random.PRNGKey(1), x)["params"]

  schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 10, steps)
  opt = optax.inject_hyperparams(adamw)(learning_rate=schedule, weight_decay=1e-4)
  opt = optax.MultiSteps(opt, every_k_schedule=2)  # One update per two batches.
  state = opt.init(params)
  print(jaxoffload.find_offload_plan(state))

  def loss_fn(params, x, y):
    return jnp.mean((model.apply({"params": params}, x) - y) ** 2)

  def train_step(params, state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  # Pin the outputs to the inputs' shardings and memory kinds, so that donated
  # host buffers are reused for host outputs.
  shardings = jax.tree.map(lambda a: a.sharding, (params, state))
  train_step = jax.jit(train_step, donate_argnums=(0, 1), out_shardings=(*shardings, None))
  losses = []
  for step in range(steps):
    batch = slice(128 * (step % 2), 128 * (step % 2 + 1))
    params, state, loss = train_step(params, state, x[batch], y[batch])
    losses.append(float(loss))
  print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} in {steps} steps; moments in "
        f"{sorted(jaxoffload.bytes_by_memory_kind(state))}")
  return losses


if __name__ == "__main__":
  main()
