"""A Llama's loss as pieces (the embedding, each layer, the head), each its own program.

A step split this way runs a program per layer, forward and backward: the
host can update a layer's weights between the programs that read them (the
host kernel's overlap, ``jaxoffload.train.per_layer.overlap``), and a layer's gradients
are ready while the device computes the layers below. ``layer_forward`` runs a
layer and keeps the activations its group's remat policy saves, but not the
layer's weights or input, which its pullback would otherwise hold a copy of
(a program's outputs are new buffers); ``backward`` runs the layer's backward
pass in a program of its own from what was kept and those inputs again.
A group whose weights live in host memory (``offload_weights``) brings a
layer over for each program that reads it (``jaxoffload.train.per_layer.pieces``).

Example:
  >>> x, embed_pullback = jax.vjp(lambda p: embed(model, p, tokens), params["embed"])
  >>> weights = layer_slice(params[group_name(group)], 0)
  >>> y, layout, kept = layer_forward(model, group, weights, x)
  >>> loss, head_pullback = jax.vjp(lambda p, x: head_loss(model, p, x, tokens), head, y)
  >>> head_grads, dy = head_pullback(1.0)
  >>> layer_grads, dx = backward(layout, kept, weights, x, dy)
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Union

import jax

from jaxoffload.nn.model import (DecoderLayer, Llama, RMSNorm, constrain, embedding,
                                 next_token_loss, output_layer, output_logits)
from jaxoffload.nn.remat import LayerGroup

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


INPUT = "x"  # A pullback leaf that is the layer's input (``PullbackLayout.sources``).


class PullbackLayout(NamedTuple):
  """Where a layer's pullback finds its leaves: those ``layer_forward`` kept, and its inputs."""

  structure: Any  # The pullback's tree structure.
  sources: tuple[Union[int, str, None], ...]  # Per leaf: its position among the weights'
  # leaves, INPUT for the layer's input x, or None for the next of those kept.

  @property
  def takes_input(self) -> bool:
    """Whether the backward pass reads the layer's input x itself (under a remat policy;
    saving everything, it reads what the layer made of x instead)."""
    return INPUT in self.sources


def layer_forward(model: Llama, group: LayerGroup, params: Any, x: jax.Array
                  ) -> tuple[jax.Array, PullbackLayout, list]:
  """One layer of ``group`` on ``x``: ``(its output, its pullback's layout, the leaves kept
  for the backward pass)``. The pullback's leaves that are the layer's weights or ``x``
  themselves are left out: ``backward`` takes those again."""
  y, pullback = jax.vjp(lambda p, x: layer(model, group, p, x), params, x)
  leaves, structure = jax.tree.flatten(pullback)
  weights = jax.tree.leaves(params)
  source = lambda leaf: INPUT if leaf is x else next(
      (i for i, w in enumerate(weights) if w is leaf), None)
  sources = tuple(source(leaf) for leaf in leaves)
  return y, PullbackLayout(structure, sources), [
      leaf for leaf, s in zip(leaves, sources) if s is None]


def backward(layout: PullbackLayout, kept: list, params: Any, x: Optional[jax.Array],
             dy: jax.Array) -> tuple[Any, jax.Array]:
  """A layer's backward pass: ``(its weights' gradients, the gradient of its input x)``, from
  what ``layer_forward`` kept and the same ``params`` and ``x`` (None unless
  ``layout.takes_input``). The layout may be any layer's of the same group."""
  kept, weights = iter(kept), jax.tree.leaves(params)
  leaves = [next(kept) if s is None else x if s == INPUT else weights[s]
            for s in layout.sources]
  return jax.tree.unflatten(layout.structure, leaves)(dy)
