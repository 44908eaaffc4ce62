"""A Llama-style decoder in Flax whose layer groups each have their own activation placement.

The layers are ``nn.scan``-ned over a stacked layer axis 0, one scan per
``remat.LayerGroup``: with ``cpu_offloading_num_layers = N`` the first N layers
form one stack and the rest another, so each group can have its own remat
policy and, being its own parameter leaves, its own memory kind: a group with
``offload_weights`` keeps its stack in pinned_host. ``regroup``
moves parameters between groupings, so runs with different N start from the
same weights.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxoffload._compat import to_device
from jaxoffload.remat import LayerGroup, remat_policy


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Sizes and dtypes of the model; the defaults are a tiny model for tests and CPU runs."""

  vocab_size: int = 256
  hidden_size: int = 64
  intermediate_size: int = 176
  num_layers: int = 4
  num_heads: int = 4
  num_kv_heads: int = 2
  max_seq_len: int = 64
  dtype: Any = jnp.float32  # Compute dtype of activations and matmuls.
  param_dtype: Any = jnp.float32
  tie_embeddings: bool = False
  rope_theta: float = 10000.0
  norm_eps: float = 1e-5

  @property
  def head_dim(self) -> int:
    return self.hidden_size // self.num_heads


class RMSNorm(nn.Module):
  """Root-mean-square layer norm, computed in float32."""

  config: LlamaConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.config.param_dtype)
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.config.norm_eps)
    return (normed * scale.astype(jnp.float32)).astype(self.config.dtype)


def rotary(x: jax.Array, theta: float) -> jax.Array:
  """Rotary position embedding of ``x`` [batch, seq, heads, head_dim], positions 0..seq-1."""
  half = x.shape[-1] // 2
  freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angles = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * freqs[None, :]
  sin, cos = jnp.sin(angles)[None, :, None, :], jnp.cos(angles)[None, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _dense(features, config: LlamaConfig, name: str, axis=-1) -> nn.DenseGeneral:
  return nn.DenseGeneral(features, axis=axis, use_bias=False, dtype=config.dtype,
                         param_dtype=config.param_dtype, name=name,
                         kernel_init=nn.initializers.normal(0.02))


class Attention(nn.Module):
  """Grouped-query causal self-attention through ``jax.nn.dot_product_attention``."""

  config: LlamaConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    c = self.config
    q = _dense((c.num_heads, c.head_dim), c, "query")(x)
    k = _dense((c.num_kv_heads, c.head_dim), c, "key")(x)
    v = _dense((c.num_kv_heads, c.head_dim), c, "value")(x)
    q = checkpoint_name(rotary(q, c.rope_theta), "query_proj")
    k = checkpoint_name(rotary(k, c.rope_theta), "key_proj")
    v = checkpoint_name(v, "value_proj")
    out = checkpoint_name(jax.nn.dot_product_attention(q, k, v, is_causal=True), "attention_out")
    return _dense(c.hidden_size, c, "out", axis=(-2, -1))(out)


class MLP(nn.Module):
  """SwiGLU feed-forward block."""

  config: LlamaConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    c = self.config
    gate = checkpoint_name(_dense(c.intermediate_size, c, "gate")(x), "mlp_gate")
    up = checkpoint_name(_dense(c.intermediate_size, c, "up")(x), "mlp_up")
    return checkpoint_name(_dense(c.hidden_size, c, "down")(nn.silu(gate) * up), "mlp_out")


class DecoderLayer(nn.Module):
  """One pre-norm decoder layer; its signature suits ``nn.scan`` (carry in, carry out)."""

  config: LlamaConfig

  @nn.compact
  def __call__(self, x: jax.Array, _: None) -> tuple[jax.Array, None]:
    x = checkpoint_name(x, "layer_input")
    x = x + Attention(self.config, name="attention")(RMSNorm(self.config, name="attention_norm")(x))
    x = checkpoint_name(x, "mlp_input")
    x = x + MLP(self.config, name="mlp")(RMSNorm(self.config, name="mlp_norm")(x))
    return x, None


def group_name(group: LayerGroup) -> str:
  """The parameter collection name of a layer group, for example ``"layers_0_11"``."""
  return f"layers_{group.start}_{group.stop}"


class Llama(nn.Module):
  """The decoder: token embedding, one scanned stack per layer group, final norm, LM head."""

  config: LlamaConfig
  groups: tuple[LayerGroup, ...]

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    c = self.config
    embed = nn.Embed(c.vocab_size, c.hidden_size, dtype=c.dtype, param_dtype=c.param_dtype,
                     embedding_init=nn.initializers.normal(0.02), name="embed")
    x = embed(tokens)
    for group in self.groups:
      layer = DecoderLayer
      if group.placements is not None:
        layer = nn.remat(layer, policy=remat_policy(group.placements), prevent_cse=False)
      if group.offload_weights:
        # Inside the scan each layer's slice of the host-resident stack comes to
        # the device just before use; its gradient goes back to host memory.
        layer = nn.map_variables(layer, "params", trans_in_fn=to_device, init=True)
      stack = nn.scan(layer, variable_axes={"params": 0}, split_rngs={"params": True},
                      length=group.stop - group.start)
      x, _ = stack(c, name=group_name(group))(x, None)
    x = RMSNorm(c, name="final_norm")(x)
    if c.tie_embeddings:
      return embed.attend(x).astype(jnp.float32)
    return _dense(c.vocab_size, c, "lm_head")(x).astype(jnp.float32)


def next_token_loss(logits: jax.Array, tokens: jax.Array) -> jax.Array:
  """Mean cross-entropy of predicting ``tokens[:, 1:]`` from ``logits[:, :-1]``."""
  log_probs = jax.nn.log_softmax(logits[:, :-1], axis=-1)
  picked = jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1)
  return -jnp.mean(picked)


_GROUP_NAME = re.compile(r"layers_(\d+)_(\d+)")


def regroup(params: dict, groups: Sequence[LayerGroup]) -> dict:
  """The same weights with the layer stacks cut at ``groups``' boundaries.

  Example:
    >>> params = regroup(params, layer_groups(cfg.num_layers, offload_num_layers=11))
  """
  stacks = sorted((int(m.group(1)), name) for name in params
                  if (m := _GROUP_NAME.fullmatch(name)))
  layers = jax.tree.map(lambda *xs: jnp.concatenate(xs), *[params[name] for _, name in stacks])
  rest = {name: value for name, value in params.items() if not _GROUP_NAME.fullmatch(name)}
  for group in groups:
    rest[group_name(group)] = jax.tree.map(lambda x: x[group.start:group.stop], layers)
  return rest
