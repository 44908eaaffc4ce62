"""A Flax NNX model trained by ``nnx.Optimizer`` with every Adam moment in host memory.

  python examples/nnx_optimizer.py

``jaxoffload.offload_adamw`` goes where ``optax.adamw`` would: ``nnx.Optimizer``
initialises it on the model's ``Param`` variables and ``nnx.jit`` compiles the step.
The moments stream through the device for each update and go back to pinned host memory.
"""

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jaxoffload


class MLP(nnx.Module):
  """A small regression model: what you would write anyway."""

  def __init__(self, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(8, 128, rngs=rngs)
    self.out = nnx.Linear(128, 1, rngs=rngs)

  def __call__(self, x):
    return self.out(nnx.gelu(self.hidden(x)))


def main(steps: int = 40) -> list[float]:
  model = MLP(nnx.Rngs(0))
  schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 10, steps)
  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   jaxoffload.offload_adamw(schedule, weight_decay=1e-4, offload_fraction=1.0,
                                            update_on="device"))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  x = jax.random.normal(jax.random.key(1), (256, 8))
  y = jnp.sin(x @ jnp.linspace(-1.0, 1.0, 8))[:, None]

  @nnx.jit
  def train_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    optimizer.update(model, grads)
    return loss

  losses = [float(train_step(model, optimizer, x, y)) for _ in range(steps)]
  print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} in {steps} steps; moments in "
        f"{sorted(jaxoffload.bytes_by_memory_kind(nnx.as_pure(optimizer.opt_state)))}")
  return losses


if __name__ == "__main__":
  main()
