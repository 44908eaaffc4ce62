"""Which parameter leaves have their optimizer state kept in host memory.

The choice is made once from the parameter tree's shapes, so it is static under
``jax.jit`` and the same at ``init`` and at every ``update``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Union

import jax
import numpy as np
from flax import nnx

# A pytree of bools with the parameters' structure, or a predicate on a leaf's path
# ("layers/mlp/kernel") and the leaf itself.
OffloadMask = Union[Any, Callable[[str, Any], bool]]


def leaf_path(key_path: tuple[Any, ...]) -> str:
  """A leaf's path as '/'-joined key names, for example ``"layers/0/kernel"``."""
  parts = []
  for key in key_path:
    for attr in ("key", "name", "idx"):
      if hasattr(key, attr):
        parts.append(str(getattr(key, attr)))
        break
    else:
      parts.append(str(key))
  return "/".join(parts)


def array_values(params: Any) -> Any:
  """``params`` with each Flax NNX ``Variable`` replaced by its array.

  ``nnx.Optimizer`` initialises a transformation on its model's ``Param`` variables and
  updates it with plain arrays: the state, and the paths an ``offload_mask`` sees
  (``"l1/kernel"``), follow the arrays.
  """
  is_variable = lambda x: isinstance(x, nnx.Variable)
  return jax.tree.map(lambda x: x.get_value() if is_variable(x) else x, params,
                      is_leaf=is_variable)


def check_fraction(offload_fraction: Any) -> float:
  """Returns ``offload_fraction`` as a float, or raises ValueError naming it."""
  if isinstance(offload_fraction, jax.core.Tracer):
    raise ValueError(
        "offload_fraction must be a concrete number, got a traced value: it decides "
        "where state lives, which cannot change inside jit. Under optax.inject_hyperparams "
        "pass static_args=('offload_fraction',)")
  if isinstance(offload_fraction, (jax.Array, np.ndarray)) and offload_fraction.shape == ():
    offload_fraction = offload_fraction.item()
  if isinstance(offload_fraction, bool) or not isinstance(offload_fraction, (int, float)):
    raise ValueError(
        f"offload_fraction must be a number in [0.0, 1.0], got {offload_fraction!r}")
  if not 0.0 <= offload_fraction <= 1.0:  # NaN fails this too.
    raise ValueError(f"offload_fraction must be in [0.0, 1.0], got {offload_fraction!r}")
  return float(offload_fraction)


@dataclasses.dataclass(frozen=True)
class OffloadPlan:
  """The leaves whose optimizer state lives in host memory.

  A pytree node with no array leaves: stored in an optimizer state, it travels
  through ``jax.jit`` as static structure, so the placement chosen at ``init``
  is the one every ``update`` uses.

  Attributes:
    treedef: the parameters' tree structure.
    offloaded: one bool per parameter leaf, in ``jax.tree.leaves`` order.
    offloaded_paths: the offloaded leaves' paths, in tree order.
    offloaded_elements: parameter elements whose state is offloaded.
    total_elements: all parameter elements.
    shardings: per parameter leaf, its ``NamedSharding`` where the parameters
      carried one (arrays, or ``jax.ShapeDtypeStruct``s with a sharding), else None:
      state streamed through the devices goes a shard per device. Not part of the
      plan's identity: a state made by a traced ``init`` (which sees no shardings)
      has the same structure as one made eagerly.
  """

  treedef: Any
  offloaded: tuple[bool, ...]
  offloaded_paths: tuple[str, ...]
  offloaded_elements: int
  total_elements: int
  shardings: tuple[Any, ...] = dataclasses.field(default=(), compare=False)

  @property
  def mask(self) -> Any:
    """A pytree of bools with the parameters' structure; True means offloaded."""
    return jax.tree_util.tree_unflatten(self.treedef, self.offloaded)

  @property
  def fraction(self) -> float:
    """The achieved share of parameter elements whose state is offloaded."""
    return self.offloaded_elements / self.total_elements if self.total_elements else 0.0

  def __str__(self) -> str:
    return (f"optimizer state offloaded for {self.offloaded_elements:,} of "
            f"{self.total_elements:,} parameter elements ({self.fraction:.2%}) in "
            f"{len(self.offloaded_paths)} leaves")


def plan_offload(params: Any, *, offload_fraction: float = 1.0,
                 offload_mask: OffloadMask | None = None,
                 first: OffloadMask | None = None) -> OffloadPlan:
  """Chooses the parameter leaves whose optimizer state goes to host memory.

  Without a mask, the leaves offloaded are those whose share of the elements
  lies nearest ``offload_fraction``: the largest leaves first, each taken
  while it fits under the share, then the smallest one left out if adding it
  lands nearer; at least one leaf when the fraction is above 0. Leaves are
  never split, so the achieved share (``plan.fraction``) misses the one asked
  for by up to half a leaf (more only when a single leaf passes it). Megatron-Core's
  HybridDeviceOptimizer fills its CPU share in parameter order instead; with
  per-layer tensors that lands near the share, but a scanned model's leaves
  stack every layer (one MLP leaf of a 22-layer 1.1B model holds 23% of the
  elements), so filling in order can miss the share by a quarter of the model.
  ``first`` puts some leaves ahead of the rest (largest first among each).

  Scalar (0-d) leaves always stay on the device: offloading one saves a few
  bytes, and jit's donation pairs buffers with outputs by shape, so a host
  scalar can be paired with a device scalar (a hyperparameter, a step count).

  Args:
    params: the parameter pytree (arrays or ``jax.ShapeDtypeStruct``).
    offload_fraction: the share of parameter elements to offload, in [0.0, 1.0].
    offload_mask: picks the leaves instead of ``offload_fraction``: a pytree of
      bools with the parameters' structure, or ``fn(path, leaf) -> bool`` where
      ``path`` is the leaf's '/'-joined key path.
    first: with ``offload_fraction``, leaves (picked as ``offload_mask`` picks) offered
      before any other, each taken while it fits the share: those whose weights live in
      host memory already, whose update then stays there.

  Returns:
    An ``OffloadPlan``; ``print(plan)`` shows the achieved share.

  Example:
    >>> plan = plan_offload({"a": jnp.zeros(30), "b": jnp.zeros(10)}, offload_fraction=0.3)
    >>> plan.fraction
    0.25
  """
  fraction = check_fraction(offload_fraction)
  if first is not None and offload_mask is not None:
    raise ValueError("first orders the leaves offload_fraction takes; offload_mask picks "
                     "them itself: pass one of the two")
  path_leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  sizes = [math.prod(leaf.shape) for _, leaf in path_leaves]
  paths = [leaf_path(key_path) for key_path, _ in path_leaves]
  total = sum(sizes)
  candidates = [len(leaf.shape) > 0 for _, leaf in path_leaves]

  if offload_mask is None:
    ahead = ([False] * len(sizes) if first is None
             else _picked("first", first, paths, path_leaves, treedef))
    chosen = _nearest_share(sizes, candidates, fraction * total, ahead)
  else:
    chosen = _picked("offload_mask", offload_mask, paths, path_leaves, treedef)
  chosen = [c and candidate for c, candidate in zip(chosen, candidates)]

  return OffloadPlan(
      treedef=treedef,
      offloaded=tuple(chosen),
      offloaded_paths=tuple(p for p, c in zip(paths, chosen) if c),
      offloaded_elements=sum(s for s, c in zip(sizes, chosen) if c),
      total_elements=total,
      shardings=tuple(named_sharding(leaf) for _, leaf in path_leaves),
  )


def named_sharding(leaf: Any) -> jax.sharding.NamedSharding | None:
  """``leaf``'s sharding where it is a ``NamedSharding`` (None for traced or unplaced
  leaves, whose sharding jit decides)."""
  sharding = None if isinstance(leaf, jax.core.Tracer) else getattr(leaf, "sharding", None)
  return sharding if isinstance(sharding, jax.sharding.NamedSharding) else None


def _picked(name: str, mask: OffloadMask, paths: list[str], path_leaves: list,
            treedef: Any) -> list[bool]:
  """Per leaf, whether ``mask`` (a predicate or a tree of bools, named ``name``) picks it."""
  if callable(mask):
    return [bool(mask(path, leaf)) for path, (_, leaf) in zip(paths, path_leaves)]
  mask_leaves, mask_treedef = jax.tree_util.tree_flatten(mask)
  if mask_treedef != treedef:
    raise ValueError(
        f"{name} must have the parameters' tree structure; got {mask_treedef}, expected "
        f"{treedef}")
  bad = [m for m in mask_leaves if not isinstance(m, (bool, np.bool_))]
  if bad:
    raise ValueError(f"{name} leaves must be bools, got {bad[0]!r}")
  return [bool(m) for m in mask_leaves]


def _nearest_share(sizes: list[int], candidates: list[bool], target: float,
                   first: list[bool]) -> list[bool]:
  """The candidate leaves to take so that their sizes sum near ``target``, those marked
  ``first`` ahead of the rest (see plan_offload)."""
  order = sorted((i for i, c in enumerate(candidates) if c),
                 key=lambda i: (not first[i], -sizes[i]))
  chosen, taken = [False] * len(sizes), 0
  for i in order:
    if taken + sizes[i] <= target:
      chosen[i], taken = True, taken + sizes[i]
  left_out = [i for i in order if not chosen[i]]
  if left_out:
    smallest = min(left_out, key=lambda i: sizes[i])
    if taken + sizes[smallest] - target < target - taken or (target > 0 and taken == 0):
      chosen[smallest] = True
  return chosen


def replicated_like(tree: Any) -> jax.sharding.Sharding | None:
  """A sharding that replicates a scalar over the devices of the tree's first placed leaf.

  Optimizer scalars (the step count) placed this way are committed like the
  offloaded state, so ``jax.jit`` sees the same argument shardings at every step
  and compiles once. None when no leaf has a sharding (traced or unplaced).
  """
  for leaf in jax.tree.leaves(tree):
    sharding = None if isinstance(leaf, jax.core.Tracer) else getattr(leaf, "sharding", None)
    if sharding is not None:
      if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
      if len(sharding.device_set) == 1:
        return jax.sharding.SingleDeviceSharding(next(iter(sharding.device_set)))
      return None
  return None


jax.tree_util.register_pytree_node(OffloadPlan, lambda plan: ((), plan), lambda plan, _: plan)


def find_offload_plan(opt_state: Any) -> OffloadPlan:
  """Returns the ``OffloadPlan`` inside an optimizer state, however deeply it is wrapped.

  Raises:
    ValueError: if the state holds no offloaded optimizer, or more than one.
  """
  plans = [x for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, OffloadPlan))
           if isinstance(x, OffloadPlan)]
  if len(plans) != 1:
    raise ValueError(f"expected one offloaded optimizer in the state, found {len(plans)}")
  return plans[0]
