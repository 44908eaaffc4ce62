"""Trains a small model with offloaded optimizer state: ``python -m jaxoffload.train``.

With no arguments it fits a tiny two-layer network to a fixed random target on
whatever backend JAX finds (CPU included) in seconds, printing the loss as it
falls, the achieved offload share and where the optimizer state's bytes live.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import optax

import jaxoffload


def init_params(key: jax.Array, width: int) -> dict:
  k1, k2 = jax.random.split(key)
  return {
      "hidden": {"kernel": jax.random.normal(k1, (width, 4 * width)) / jnp.sqrt(width),
                 "bias": jnp.zeros(4 * width)},
      "out": {"kernel": jax.random.normal(k2, (4 * width, width)) / jnp.sqrt(4 * width)},
  }


def forward(params: dict, x: jax.Array) -> jax.Array:
  h = jax.nn.gelu(x @ params["hidden"]["kernel"] + params["hidden"]["bias"])
  return h @ params["out"]["kernel"]


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--width", type=int, default=64)
  parser.add_argument("--offload-fraction", type=float, default=0.5)
  parser.add_argument("--update-on", choices=["host", "device"], default="host")
  parser.add_argument("--lr", type=float, default=3e-3)
  args = parser.parse_args(argv)

  key_params, key_x, key_target = jax.random.split(jax.random.PRNGKey(0), 3)
  params = init_params(key_params, args.width)
  x = jax.random.normal(key_x, (256, args.width))
  y = forward(init_params(key_target, args.width), x)
  try:
    opt = jaxoffload.offload_adamw(optax.cosine_decay_schedule(args.lr, args.steps),
                                   offload_fraction=args.offload_fraction, update_on=args.update_on)
  except ValueError as error:
    parser.exit(2, f"error: {error}\n")
  state = opt.init(params)

  def loss_fn(params):
    return jnp.mean((forward(params, x) - y) ** 2)

  def step(params, state):
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  shardings = jax.tree.map(lambda a: a.sharding, (params, state))
  step = jax.jit(step, donate_argnums=(0, 1), out_shardings=(*shardings, None))
  print(f"backend {jax.default_backend()}; {jaxoffload.find_offload_plan(state)}")
  print(f"optimizer state bytes by memory kind: {jaxoffload.bytes_by_memory_kind(state)}")
  start = time.perf_counter()
  for i in range(1, args.steps + 1):
    params, state, loss = step(params, state)
    if i == 1 or i % max(1, args.steps // 10) == 0:
      print(f"step {i:5d}  loss {float(loss):.6f}")
  print(f"{args.steps} steps in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
  main()
