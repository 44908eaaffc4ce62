"""The loss and its gradients on a step's batch: all micro-batches in one program, or one."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxoffload import rounding
from jaxoffload._compat import to_device
from jaxoffload.nn.model import Llama, next_token_loss


def micro_batch(tokens: jax.Array, micro_batches: int, index: Any) -> jax.Array:
  """Micro-batch ``index`` of a step's sequences: every ``micro_batches``-th one from
  ``index``, so that each device's shard of the batch holds its share of every micro-batch.

  Example:
    >>> micro_batch(tokens, 4, 1)  # Sequences 1, 5, 9, ...
  """
  return tokens.reshape(-1, micro_batches, tokens.shape[-1])[:, index]


def loss_and_grads(model: Llama, params: Any, tokens: jax.Array, left_on_host: Any = None
                   ) -> tuple[jax.Array, Any]:
  """The loss on ``tokens`` and its gradients in device memory: the gradients of weights kept
  in host memory arrive there and are brought over, but those ``left_on_host`` marks (a tree
  of bools like ``params``)."""
  value_and_grad = jax.value_and_grad(
      lambda p: next_token_loss(model.apply({"params": p}, tokens), tokens))
  loss, grads = value_and_grad(params)
  if left_on_host is None:
    return loss, jax.tree.map(to_device, grads)
  return loss, jax.tree.map(lambda g, left: g if left else to_device(g), grads, left_on_host)


def add_to_sum(total: jax.Array, value: jax.Array, salt: Any) -> jax.Array:
  """``total + value`` in float32, kept in ``total``'s dtype: a bfloat16 sum is rounded
  stochastically (salted by ``salt``, different for each micro-batch of each step), so
  that it stays the float32 sum on average; each addition's error is below one bfloat16
  step of the sum.

  Example:
    >>> total = add_to_sum(total, grad, step * micro_batches + index)
  """
  return rounding.stochastic_round(total.astype(jnp.float32) + value.astype(jnp.float32), salt,
                                   total.dtype)


def mean_loss_and_grads(model: Llama, params: Any, tokens: jax.Array, micro_batches: int,
                        sum_dtype: Any = jnp.float32, step: Any = 0) -> tuple[jax.Array, Any]:
  """The mean loss and gradients over ``micro_batches`` micro-batches, in one program: a scan
  sums the gradients in ``sum_dtype`` (``add_to_sum``, salted by ``step`` and the
  micro-batch), whatever the leaves' dtype, and returns their mean in float32."""
  if micro_batches == 1:
    return loss_and_grads(model, params, tokens)

  def accumulate(total, index):
    loss_sum, sums = total
    loss, grads = loss_and_grads(model, params, micro_batch(tokens, micro_batches, index))
    salt = step * micro_batches + index
    return (loss_sum + loss, jax.tree.map(lambda t, g: add_to_sum(t, g, salt), sums, grads)), None

  zeros = (jnp.zeros(()), jax.tree.map(lambda p: jnp.zeros(p.shape, sum_dtype), params))
  (loss, grads), _ = jax.lax.scan(accumulate, zeros, jnp.arange(micro_batches))
  return jax.tree.map(lambda x: x.astype(jnp.float32) / micro_batches, (loss, grads))
