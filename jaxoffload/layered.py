"""A Llama's loss as pieces (the embedding, each layer, the head), each its own program.

A step split this way runs a program per layer, forward and backward: the
host can update a layer's weights between the programs that read them (the
host kernel's overlap, ``jaxoffload.train.overlap``), and a layer's gradients
are ready while the device computes the layers below. ``jax.vjp`` of a piece
gives its pullback, whose leaves are the activations the piece saved (as its
group's remat policy decides); ``backward`` runs a layer's pullback in a
program of its own. Groups that keep their weights in host memory
(``offload_weights``, ``fetch_weights``) bring each layer in inside the
model's scan, and are not run this way.

Example:
  >>> x, embed_pullback = jax.vjp(lambda p: embed(model, p, tokens), params["embed"])
  >>> x, pullback = jax.vjp(lambda p, x: layer(model, group, p, x),
  ...                       layer_slice(params[group_name(group)], 0), x)
  >>> loss, head_pullback = jax.vjp(lambda p, x: head_loss(model, p, x, tokens), head, x)
  >>> head_grads, dx = head_pullback(1.0)
  >>> layer_grads, dx = backward(*jax.tree.flatten(pullback)[::-1], dx)
"""

from __future__ import annotations

from typing import Any

import jax

from jaxoffload.model import (DecoderLayer, Llama, RMSNorm, constrain, embedding,
                              next_token_loss, output_layer, output_logits)
from jaxoffload.remat import LayerGroup

EMBED = "embed"


def head_names(model: Llama) -> tuple[str, ...]:
  """The top-level parameter names the head reads (the embedding too when it is shared)."""
  shared = model.config.share_embeddings_and_output_weights
  return ("final_norm", EMBED) if shared else ("final_norm", "lm_head")


def layer_slice(stack: Any, index: Any) -> Any:
  """Layer ``index`` (an int or a traced scalar) of a group's stacked parameters."""
  return jax.tree.map(lambda p: jax.lax.dynamic_index_in_dim(p, index, keepdims=False), stack)


def embed(model: Llama, params: Any, tokens: jax.Array) -> jax.Array:
  """The embedding's output: the first layer's input."""
  x = embedding(model.config).apply({"params": params}, tokens)
  return constrain(model.mesh, x, "embed_activation")


def layer(model: Llama, group: LayerGroup, params: Any, x: jax.Array) -> jax.Array:
  """One layer of ``group`` on ``x``, under the group's remat policy (which decides what its
  pullback keeps)."""
  apply = lambda p, x: DecoderLayer(model.config, model.mesh).apply({"params": p}, x, None)[0]
  return group.wrap(apply)(params, x)


def head_loss(model: Llama, params: dict, x: jax.Array, tokens: jax.Array) -> jax.Array:
  """The mean next-token loss of the last layer's output ``x``; ``params`` holds
  ``head_names``' parameters."""
  c = model.config
  bound = lambda module, name: module.bind({"params": params[name]}) if name in params else None
  logits = output_logits(c, model.mesh, x, bound(RMSNorm(c), "final_norm"),
                         bound(embedding(c), EMBED), bound(output_layer(c), "lm_head"))
  return next_token_loss(logits, tokens)


def backward(structure: Any, leaves: list, dy: jax.Array) -> tuple[Any, jax.Array]:
  """A layer's backward pass from its pullback's ``structure`` and ``leaves``: ``(its
  parameters' gradients, the gradient of its input)``. The leaves are the activations the
  layer saved; the structure may be any layer's of the same group, so that a jitted
  ``backward`` compiles once per group."""
  return jax.tree.unflatten(structure, leaves)(dy)
