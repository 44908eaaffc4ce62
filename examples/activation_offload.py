"""Offload chosen activations of your own scanned model to host memory between forward and backward.

  python examples/activation_offload.py

Tag tensors with ``checkpoint_name``, then give ``nn.remat`` the policy
``jaxoffload.remat_policy`` makes: tagged tensors named "offload" wait in
pinned host memory for the backward pass, "save" ones stay on the device, and
everything else is recomputed. The gradients are those of the plain model.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

import jaxoffload

NAMES = ("block_input", "hidden")


class Block(nn.Module):
  """A residual MLP block; its signature suits ``nn.scan`` (carry in, carry out)."""

  @nn.compact
  def __call__(self, x, _):
    x = checkpoint_name(x, "block_input")
    hidden = checkpoint_name(nn.Dense(4 * x.shape[-1])(x), "hidden")
    return x + nn.Dense(x.shape[-1])(nn.gelu(hidden)), None


class Stack(nn.Module):
  """``layers`` blocks scanned over a stacked parameter axis, each under ``policy``."""

  layers: int
  policy: object = None

  @nn.compact
  def __call__(self, x):
    block = Block if self.policy is None else nn.remat(Block, policy=self.policy,
                                                      prevent_cse=False)
    x, _ = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                   length=self.layers)(name="blocks")(x, None)
    return jnp.mean(x ** 2)


def gradients(policy, params, x):
  loss = lambda p: Stack(layers=4, policy=policy).apply({"params": p}, x)
  return jax.jit(jax.value_and_grad(loss))(params)


def main():
  x = jax.random.normal(jax.random.PRNGKey(0), (8, 16, 64))
  params = Stack(layers=4).init(jax.random.PRNGKey(1), x)["params"]
  policy = jaxoffload.remat_policy({"hidden": "offload", "block_input": "save"}, names=NAMES)
  loss_fn = lambda p: Stack(layers=4, policy=policy).apply({"params": p}, x)
  # Offloaded residuals show in the program as values in host memory ("<host>").
  host_values = str(jax.make_jaxpr(jax.grad(loss_fn))(params)).count("<host>")
  (loss, grads), (plain_loss, plain_grads) = gradients(policy, params, x), gradients(None, params, x)
  diff = max(float(jnp.max(jnp.abs(a - b)))
             for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(plain_grads)))
  print(f"loss {float(loss):.6f} (plain {float(plain_loss):.6f}); {host_values} values in host "
        f"memory; largest gradient difference {diff:.2e}")
  return loss, grads, plain_loss, plain_grads, host_values


if __name__ == "__main__":
  main()
