"""The model's parameter tree: shapes and logical specs without allocating, placed init, regrouping.

A ``model.Llama`` keeps one stacked leaf per weight and layer group
(``layers_0_11``, ``layers_11_22``, ...). ``regroup`` cuts or joins those
stacks, so runs with different groupings start from the same weights.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxoffload.nn.model import Llama, LlamaConfig, group_name
from jaxoffload.nn.remat import LayerGroup


def _boxed_shapes(model: Llama, tokens: Any) -> Any:
  # tokens as an argument: an array or its shape, which starts no backend.
  return jax.eval_shape(lambda t: model.init(jax.random.PRNGKey(0), t)["params"], tokens)


def logical_param_specs(model: Llama, tokens: jax.Array) -> Any:
  """The parameters' logical ``PartitionSpec``s, found without allocating them."""
  return nn.get_partition_spec(_boxed_shapes(model, tokens))


def abstract_params(model: Llama, tokens: jax.Array) -> Any:
  """The parameters' shapes and dtypes (``jax.ShapeDtypeStruct``s), found without allocating them."""
  return nn.meta.unbox(_boxed_shapes(model, tokens))


@functools.lru_cache(maxsize=64)
def cut_param_shapes(model: LlamaConfig, layers: tuple[tuple[int, int], ...]
                     ) -> tuple[Any, Any]:
  """The parameters' shapes and logical specs with layer groups cut at ``layers``: traced
  once per model and cut (a planner resolves many settings of one model).

  Args:
    model: the model's config.
    layers: each layer group's (start, stop).

  Returns:
    ``abstract_params`` and ``logical_param_specs`` of that model.
  """
  # Parameters' shapes depend neither on the tokens nor on the attention's implementation:
  # shapes and a named one, which start no backend.
  model = dataclasses.replace(model, attention_implementation="xla")
  llama = Llama(model, tuple(LayerGroup(start, stop, None) for start, stop in layers))
  probe = jax.ShapeDtypeStruct((1, 2), jnp.int32)
  return abstract_params(llama, probe), logical_param_specs(llama, probe)


def init_params(model: Llama, key: jax.Array, tokens: jax.Array, shardings: Any = None,
                groups: Optional[Sequence[LayerGroup]] = None) -> Any:
  """Initialises the parameters under ``jax.jit``, placed by ``shardings`` when given.

  With ``groups`` the layer stacks are cut at their boundaries in the same
  program (see ``regroup``), so each leaf is written once, straight into its
  sharding and memory kind.

  Example:
    >>> specs = logical_param_specs(model, tokens)
    >>> params = init_params(model, key, tokens, sharding.logical_shardings(mesh, specs))
  """

  def init(key):
    params = nn.meta.unbox(model.init(key, tokens)["params"])
    return params if groups is None else regroup(params, groups)

  return jax.jit(init, out_shardings=shardings)(key)


_GROUP_NAME = re.compile(r"layers_(\d+)_(\d+)")


def group_layers(name: str) -> Optional[range]:
  """The layers of a layer group's collection name (``"layers_0_11"``: layers 0 to 10);
  None for any other name."""
  match = _GROUP_NAME.fullmatch(name)
  return range(int(match.group(1)), int(match.group(2))) if match else None


def regroup(params: dict, groups: Sequence[LayerGroup]) -> dict:
  """The same weights with the layer stacks cut at ``groups``' boundaries.

  Example:
    >>> params = regroup(params, layer_groups(cfg.num_layers, offload_num_layers=11))
  """
  stacks = sorted((layers.start, name) for name in params
                  if (layers := group_layers(name)) is not None)
  layers = jax.tree.map(lambda *xs: jnp.concatenate(xs), *[params[name] for _, name in stacks])
  rest = {name: value for name, value in params.items() if group_layers(name) is None}
  for group in groups:
    rest[group_name(group)] = jax.tree.map(lambda x: x[group.start:group.stop], layers)
  return rest
