"""offload_adamw on parameters sharded over a mesh: each shard's moments live in its device's host memory.

Runs anywhere; on a CPU-only machine it fakes 8 devices:

  python examples/sharded_offload.py
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jaxoffload  # noqa: E402


def main():
  devices = np.array(jax.devices())
  mesh = jax.sharding.Mesh(devices.reshape(-1, 2) if devices.size % 2 == 0 else devices.reshape(-1, 1),
                           ("fsdp", "tensor"))
  specs = {"embed": P("fsdp", "tensor"), "mlp": P(None, "tensor"), "norm": P()}
  shapes = {"embed": (512, 64), "mlp": (64, 256), "norm": (64,)}
  params = {name: jax.device_put(jnp.full(shape, 0.1), NamedSharding(mesh, specs[name]))
            for name, shape in shapes.items()}

  opt = jaxoffload.offload_adamw(1e-2, offload_fraction=0.5, update_on="device")
  state = opt.init(params)
  print(jaxoffload.find_offload_plan(state))

  def loss_fn(params):
    return jnp.mean(jnp.tanh(params["embed"] @ params["mlp"]) ** 2) + jnp.sum(params["norm"] ** 2)

  def step(params, state):
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  shardings = jax.tree.map(lambda x: x.sharding, (params, state))
  step = jax.jit(step, donate_argnums=(0, 1), out_shardings=(*shardings, None))
  for i in range(5):
    params, state, loss = step(params, state)
    print(f"step {i + 1} loss {float(loss):.6f}")
  for name, mu in state[0].mu.items():
    print(f"mu[{name!r}]: {mu.sharding.memory_kind}, spec {mu.sharding.spec}")


if __name__ == "__main__":
  main()
