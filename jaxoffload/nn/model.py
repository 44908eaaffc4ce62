"""A Llama-style decoder in Flax whose layer groups each have their own activation placement.

The layers are ``nn.scan``-ned over a stacked layer axis 0, one scan per
``remat.LayerGroup``: with ``cpu_offloading_num_layers = N`` the first N layers
form one stack and the rest another, so each group can have its own remat
policy and, being its own parameter leaves, its own memory kind: a group with
``offload_weights`` keeps its stack in pinned_host. ``jaxoffload.nn.params``
finds, initialises and regroups the parameter tree.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh

from jaxoffload._compat import to_device
from jaxoffload.nn import sharding
from jaxoffload.nn.remat import LayerGroup, layer_groups


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """The model's shape and numerics; the defaults are a tiny model for tests and CPU runs.

  Field names are Megatron-Bridge's where it has one (the trainer's ``model.*``
  keys are these fields), Hugging Face's otherwise.

  Attributes:
    vocab_size: tokens in the vocabulary.
    hidden_size: width of the residual stream.
    intermediate_size: width of the SwiGLU feed-forward block.
    num_layers: decoder layers.
    num_attention_heads: query heads.
    num_query_groups: key/value heads (grouped-query attention); divides num_attention_heads.
    kv_channels: width of each attention head; null: hidden_size / num_attention_heads
      (Hugging Face's head_dim).
    seq_length: tokens per training sequence.
    max_position_embeddings: the longest sequence the checkpoint was made for; null:
      no limit. seq_length may not exceed it.
    dtype: compute dtype of activations and matmuls: float32 or bfloat16.
    params_dtype: dtype the parameters are stored in: float32 or bfloat16.
    share_embeddings_and_output_weights: the LM head is the token embedding, transposed.
    rope_theta: base of the rotary position embedding's frequencies.
    rope_scaling_factor: Llama 3.1's rope scaling (rope_type llama3): low frequencies
      divided by this factor, high ones kept, those between blended; null: none.
    rope_scaling_low_freq_factor: with rope scaling, wavelengths above
      original_max_position_embeddings / this factor are scaled in full.
    rope_scaling_high_freq_factor: with rope scaling, wavelengths below
      original_max_position_embeddings / this factor are kept.
    rope_scaling_original_max_position_embeddings: with rope scaling, the context
      length the frequencies were trained for.
    rms_norm_eps: added to the mean square in RMSNorm.
    attention_implementation: ``jax.nn.dot_product_attention``'s implementation:
      xla, cudnn, or null for cuDNN's fused kernel on a GPU with 16-bit compute and
      XLA elsewhere (JAX's own null means XLA, whose backward keeps every layer's
      score matrix).
    scan_layers: run each layer group as a loop over its stacked layers (MaxText's
      name), which compiles in the time of one layer; False unrolls the loop over the
      same stacks: XLA compiles every layer on its own, longer, and schedules the step
      across them, on a GPU faster and in less memory (docs/performance.md's baseline;
      configs/llama_1b.yaml sets it), but recomputing early: recompute and activation
      offload inside it save no memory (the trainer warns). A step run a program per
      layer (``jaxoffload.train.per_layer.overlap``) has no loop to unroll.
  """

  vocab_size: int = 256
  hidden_size: int = 64
  intermediate_size: int = 176
  num_layers: int = 4
  num_attention_heads: int = 4
  num_query_groups: int = 2
  kv_channels: Optional[int] = None
  seq_length: int = 64
  max_position_embeddings: Optional[int] = None
  dtype: str = "float32"
  params_dtype: str = "float32"
  share_embeddings_and_output_weights: bool = False
  rope_theta: float = 10000.0
  rope_scaling_factor: Optional[float] = None
  rope_scaling_low_freq_factor: float = 1.0
  rope_scaling_high_freq_factor: float = 4.0
  rope_scaling_original_max_position_embeddings: int = 8192
  rms_norm_eps: float = 1e-5
  attention_implementation: Optional[str] = None
  scan_layers: bool = True

  @property
  def attention(self) -> str:
    """The attention implementation this config runs with on the default backend."""
    if self.attention_implementation is not None:
      return self.attention_implementation
    fused = jax.default_backend() == "gpu" and jnp.dtype(self.dtype).itemsize == 2
    return "cudnn" if fused else "xla"

  @property
  def head_dim(self) -> int:
    """Width of each attention head."""
    return self.kv_channels or self.hidden_size // self.num_attention_heads


# RMSNorm's weight: the one parameter the model multiplies in float32 whatever
# its compute dtype.
NORM_SCALE = "scale"


def compute_dtypes(params: Any, config: LlamaConfig) -> Any:
  """Per parameter leaf, the dtype the model multiplies it in: float32 for norm scales,
  ``config.dtype`` for the rest (matmul weights and embeddings)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: jnp.dtype(jnp.float32 if getattr(path[-1], "key", None) == NORM_SCALE
                                else config.dtype), params)


class RMSNorm(nn.Module):
  """Root-mean-square layer norm, computed in float32."""

  config: LlamaConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    c = self.config
    init = nn.with_logical_partitioning(nn.initializers.ones, ("norm",))
    scale = self.param(NORM_SCALE, init, (x.shape[-1],), jnp.dtype(c.params_dtype))
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + c.rms_norm_eps)
    return (normed * scale.astype(jnp.float32)).astype(c.dtype)


def rope_frequencies(config: LlamaConfig) -> jax.Array:
  """The rotary embedding's angular frequencies, [head_dim / 2], float32, as Llama defines them.

  With ``rope_scaling_factor`` they follow Llama 3.1's rule: frequencies whose
  wavelength is above ``original / low_freq_factor`` are divided by the factor,
  those below ``original / high_freq_factor`` kept, those between blended.
  """
  dim = config.head_dim
  freqs = 1.0 / (config.rope_theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
  factor = config.rope_scaling_factor
  if factor is None:
    return freqs
  low, high = config.rope_scaling_low_freq_factor, config.rope_scaling_high_freq_factor
  original = config.rope_scaling_original_max_position_embeddings
  wavelength = 2 * jnp.pi / freqs
  scaled = jnp.where(wavelength > original / low, freqs / factor, freqs)
  smooth = (original / wavelength - low) / (high - low)
  blended = (1 - smooth) * scaled / factor + smooth * scaled
  between = ~(wavelength < original / high) & ~(wavelength > original / low)
  return jnp.where(between, blended, scaled)


def rotary(x: jax.Array, freqs: jax.Array) -> jax.Array:
  """Rotary position embedding of ``x`` [batch, seq, heads, head_dim], positions 0..seq-1."""
  angles = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * freqs[None, :]
  sin, cos = jnp.sin(angles)[None, :, None, :], jnp.cos(angles)[None, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _dense(features: int, config: LlamaConfig, name: str,
           logical_axes: tuple[str, str]) -> nn.Dense:
  init = nn.with_logical_partitioning(nn.initializers.normal(0.02), logical_axes)
  return nn.Dense(features, use_bias=False, dtype=jnp.dtype(config.dtype),
                  param_dtype=jnp.dtype(config.params_dtype), name=name, kernel_init=init)


def constrain(mesh: Optional[Mesh], x: jax.Array, *feature_axes: Optional[str]) -> jax.Array:
  """``x`` [batch, length, ...] sharded over ``mesh`` by its batch and feature axes.

  Without these XLA may shard a matmul over its contracting axis and gather
  the activations instead of the weights, which costs far more device memory.
  """
  if mesh is None:
    return x
  return nn.with_logical_constraint(x, ("batch", "length", *feature_axes),
                                    rules=sharding.LOGICAL_RULES, mesh=mesh)


class Attention(nn.Module):
  """Grouped-query causal self-attention through ``jax.nn.dot_product_attention``."""

  config: LlamaConfig
  mesh: Optional[Mesh] = None

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    c, mesh = self.config, self.mesh

    def heads(name: str, axis: str, count: int) -> jax.Array:
      y = _dense(count * c.head_dim, c, name, ("embed", axis))(x)
      return constrain(mesh, y.reshape(*y.shape[:-1], count, c.head_dim), axis, None)

    q = heads("query", "heads", c.num_attention_heads)
    k = heads("key", "kv_heads", c.num_query_groups)
    v = heads("value", "kv_heads", c.num_query_groups)
    freqs = rope_frequencies(c)
    q = checkpoint_name(rotary(q, freqs), "query_proj")
    k = checkpoint_name(rotary(k, freqs), "key_proj")
    v = checkpoint_name(v, "value_proj")
    out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=c.attention)
    out = checkpoint_name(constrain(mesh, out, "heads", None), "attention_out")
    out = out.reshape(*out.shape[:-2], c.num_attention_heads * c.head_dim)
    out = _dense(c.hidden_size, c, "out", ("heads", "embed"))(out)
    return constrain(mesh, out, "embed_activation")


class MLP(nn.Module):
  """SwiGLU feed-forward block."""

  config: LlamaConfig
  mesh: Optional[Mesh] = None

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    c = self.config
    hidden = lambda name: constrain(
        self.mesh, _dense(c.intermediate_size, c, name, ("embed", "mlp"))(x), "mlp")
    gate = checkpoint_name(hidden("gate"), "mlp_gate")
    up = checkpoint_name(hidden("up"), "mlp_up")
    down = _dense(c.hidden_size, c, "down", ("mlp", "embed"))
    return constrain(self.mesh, down(nn.silu(gate) * up), "embed_activation")


class DecoderLayer(nn.Module):
  """One pre-norm decoder layer; its signature suits ``nn.scan`` (carry in, carry out)."""

  config: LlamaConfig
  mesh: Optional[Mesh] = None

  @nn.compact
  def __call__(self, x: jax.Array, _: None) -> tuple[jax.Array, None]:
    c, mesh = self.config, self.mesh
    x = checkpoint_name(constrain(mesh, x, "embed_activation"), "layer_input")
    x = x + Attention(c, mesh, name="attention")(RMSNorm(c, name="attention_norm")(x))
    x = checkpoint_name(x, "mlp_input")
    x = x + MLP(c, mesh, name="mlp")(RMSNorm(c, name="mlp_norm")(x))
    return x, None


def group_name(group: LayerGroup) -> str:
  """The parameter collection name of a layer group, for example ``"layers_0_11"``."""
  return f"layers_{group.start}_{group.stop}"


class Llama(nn.Module):
  """The decoder: token embedding, one scanned stack per layer group, final norm, LM head.

  Attributes:
    config: sizes and dtypes.
    groups: the layer groups, each with its activation placement and weights'
      memory kind (``remat.layer_groups``); None: one group that saves everything.
    mesh: the mesh activations are sharded over (``sharding.LOGICAL_RULES``);
      None leaves their placement to XLA.

  Example:
    >>> model = Llama(LlamaConfig())
    >>> params = model.init(jax.random.PRNGKey(0), tokens)["params"]
    >>> logits = model.apply({"params": params}, tokens)  # [batch, length, vocab]
  """

  config: LlamaConfig
  groups: Optional[tuple[LayerGroup, ...]] = None
  mesh: Optional[Mesh] = None

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    c = self.config
    embed = embedding(c)
    x = constrain(self.mesh, embed(tokens), "embed_activation")
    for group in self.groups or layer_groups(c.num_layers):
      layer = DecoderLayer
      if group.offload_weights or group.fetch_weights:
        # Inside the scan each layer's slice of the host-resident stack comes to
        # the device just before use; its gradient goes back to host memory.
        # Fetched inside the remat below, if the group has one, so that the backward
        # pass fetches it again instead of keeping every layer's device copy.
        layer = nn.map_variables(layer, "params", trans_in_fn=to_device, init=True)
      policy = group.policy()
      if policy is not None:
        layer = nn.remat(layer, policy=policy, prevent_cse=False)
      length = group.stop - group.start
      stack = nn.scan(layer, variable_axes={"params": 0}, split_rngs={"params": True},
                      length=length, unroll=1 if c.scan_layers else length,
                      metadata_params={nn.PARTITION_NAME: "layers"})
      x, _ = stack(c, self.mesh, name=group_name(group))(x, None)
    lm_head = None if c.share_embeddings_and_output_weights else output_layer(c)
    return output_logits(c, self.mesh, x, RMSNorm(c, name="final_norm"), embed, lm_head)


def embedding(config: LlamaConfig) -> nn.Embed:
  """The token embedding (parameters ``embed``)."""
  return nn.Embed(config.vocab_size, config.hidden_size, dtype=jnp.dtype(config.dtype),
                  param_dtype=jnp.dtype(config.params_dtype),
                  embedding_init=nn.with_logical_partitioning(nn.initializers.normal(0.02),
                                                              ("vocab", "embed")),
                  name="embed")


def output_layer(config: LlamaConfig) -> nn.Dense:
  """The LM head of a model that does not share it with the embedding (``lm_head``)."""
  return _dense(config.vocab_size, config, "lm_head", ("embed", "vocab"))


def output_logits(config: LlamaConfig, mesh: Optional[Mesh], x: jax.Array, final_norm: RMSNorm,
                  embed: nn.Embed, lm_head: Optional[nn.Dense]) -> jax.Array:
  """The float32 logits of the last layer's output ``x``: the final norm, then the LM head
  (``lm_head``, or the embedding transposed where it is None)."""
  x = final_norm(x)
  logits = embed.attend(x) if lm_head is None else lm_head(x)
  return constrain(mesh, logits, "vocab").astype(jnp.float32)


def next_token_loss(logits: jax.Array, tokens: jax.Array) -> jax.Array:
  """Mean cross-entropy of predicting ``tokens[:, 1:]`` from ``logits[:, :-1]``."""
  log_probs = jax.nn.log_softmax(logits[:, :-1], axis=-1)
  # A one-hot product rather than a gather keeps the work local to each shard
  # when the vocabulary is sharded.
  targets = jax.nn.one_hot(tokens[:, 1:], logits.shape[-1], dtype=log_probs.dtype)
  return -jnp.mean(jnp.sum(log_probs * targets, axis=-1))
