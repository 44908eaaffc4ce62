"""The model split into layer programs: the same loss and gradients as the whole model's."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from jaxoffload.nn import layered, remat
from jaxoffload.nn.model import Llama, LlamaConfig, group_name, next_token_loss
from jaxoffload.nn.params import init_params
from tests.helpers import max_rel_diff

CONFIG = LlamaConfig()
GROUPS = {
    "save-everything": remat.layer_groups(CONFIG.num_layers),
    "two-groups": remat.layer_groups(CONFIG.num_layers, offload_num_layers=1,
                                     offload_placements=remat.RECOMPUTE_ALL),
    "activation-offload": remat.layer_groups(CONFIG.num_layers, offload_num_layers=2),
    "selective": remat.megatron_layer_groups(CONFIG.num_layers, recompute_granularity="selective"),
}


def _split_grads(model, params, tokens):
  """The loss and gradients through ``layered``'s pieces, a program each, as the trainer runs
  them (the layers' forward programs compile once per group, taking the layer's index)."""
  x, embed_pullback = jax.jit(jax.vjp, static_argnums=0)(
      lambda p: layered.embed(model, p, tokens), params[layered.EMBED])
  groups = {group_name(group): group for group in model.groups}
  layouts, saved = {}, []

  def forward(name, stack, index, x):
    y, layouts[name], kept = layered.layer_forward(model, groups[name],
                                                   layered.layer_slice(stack, index), x)
    return y, kept

  def backward(name, stack, index, x, kept, dy):
    return layered.backward(layouts[name], kept, layered.layer_slice(stack, index), x, dy)

  forward, backward = (jax.jit(f, static_argnums=0) for f in (forward, backward))
  for name, group in groups.items():
    for index in range(group.stop - group.start):
      y, kept = forward(name, params[name], index, x)
      saved.append((name, index, x, kept))
      x = y
  head = {name: params[name] for name in layered.head_names(model)}
  loss, head_grads, dx = jax.jit(lambda head, x: (lambda loss, pullback: (loss, *pullback(
      jnp.ones_like(loss))))(*jax.vjp(lambda p, x: layered.head_loss(model, p, x, tokens),
                                      head, x)))(head, x)
  layer_grads = []
  for name, index, x, kept in reversed(saved):
    grads, dx = backward(name, params[name], index, x, kept, dx)
    layer_grads.insert(0, grads)
  (embed_grads,) = jax.jit(lambda pullback, dx: pullback(dx))(embed_pullback, dx)
  grads = dict(head_grads)
  if layered.EMBED in grads:  # Shared with the head: both parts of the gradient add up.
    embed_grads = jax.tree.map(jnp.add, grads[layered.EMBED], embed_grads)
  grads[layered.EMBED] = embed_grads
  index = 0
  for group in model.groups:
    stop = index + group.stop - group.start
    grads[group_name(group)] = jax.tree.map(lambda *layers: jnp.stack(layers),
                                            *layer_grads[index:stop])
    index = stop
  return loss, grads


# The fast tier runs the split end to end: test_train's host-kernel-overlapped.
@pytest.mark.slow
@pytest.mark.parametrize("shared", [False, True], ids=["lm-head", "shared-embedding"])
@pytest.mark.parametrize("name", list(GROUPS))
def test_split_backward_matches_whole_model(name, shared):
  config = dataclasses.replace(CONFIG, share_embeddings_and_output_weights=shared)
  model = Llama(config, GROUPS[name])
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 32), 0, config.vocab_size)
  params = init_params(model, jax.random.PRNGKey(0), tokens)
  whole = jax.value_and_grad(
      lambda p: next_token_loss(model.apply({"params": p}, tokens), tokens))
  loss, grads = whole(params)
  split_loss, split_grads = _split_grads(model, params, tokens)
  assert jax.tree.structure(split_grads) == jax.tree.structure(grads)
  assert abs(float(split_loss) - float(loss)) < 1e-6 * float(loss)
  assert max_rel_diff(split_grads, grads) < 1e-5


@pytest.mark.parametrize("placements, saved", [
    (remat.RECOMPUTE_ALL, []),
    (remat.RECOMPUTE_SELECTIVE, [name for name in remat.ACTIVATION_NAMES if name != "layer_input"]),
    (remat.SAVE_EVERYTHING, None),
], ids=["full", "selective", "save-everything"])
def test_a_layer_keeps_its_saved_activations_and_no_copy_of_its_weights_or_input(placements, saved):
  config = dataclasses.replace(CONFIG, dtype="bfloat16")  # Weights cast inside the layer.
  (group,) = remat.layer_groups(config.num_layers, base_placements=placements)
  model = Llama(config, (group,))
  tokens = jnp.zeros((2, 32), jnp.int32)
  # In bfloat16, as the host kernel's weights come to the device: the casts change nothing.
  stack = jax.tree.map(lambda w: w.astype(jnp.bfloat16),
                       init_params(model, jax.random.PRNGKey(0), tokens)[group_name(group)])
  x = jnp.ones((2, 32, config.hidden_size), jnp.bfloat16)
  layouts = []

  def forward(stack, x):
    y, layout, kept = layered.layer_forward(model, group, layered.layer_slice(stack, 0), x)
    layouts.append(layout)
    return y, kept

  _, kept = jax.eval_shape(forward, stack, x)
  (layout,) = layouts
  kernels = [w for w in jax.tree.leaves(stack) if w.ndim == 3]
  # Each weight matrix is read again, not kept; a remat policy reads x again, not a copy.
  assert sum(isinstance(s, int) for s in layout.sources) >= len(kernels)
  assert layout.takes_input == (placements is not None)
  if saved is not None:  # Each saved name's activation, of this micro-batch's tokens.
    assert len(kept) == len(saved)
    assert all(leaf.shape[:2] == x.shape[:2] for leaf in kept)
