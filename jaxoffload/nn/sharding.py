"""Mesh and parameter shardings from the model's logical axis names.

Parameters and activations carry logical axis names ("embed", "mlp", "heads",
...); ``LOGICAL_RULES`` maps them to the mesh axes ``data``, ``fsdp`` and
``tensor``: batch over data and fsdp, weights' embedding axis over fsdp, and
heads, MLP and vocabulary over tensor. The residual stream is replicated over
tensor (Megatron's tensor parallelism without sequence parallelism): sharding
its hidden axis there too made XLA's partitioner compute wrong row-parallel
matmuls on a data x fsdp x tensor mesh (``tests/test_model.py`` checks the
sharded model against one device).
"""

from __future__ import annotations

from typing import Any, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxoffload._compat import PINNED_HOST

MESH_AXES = ("data", "fsdp", "tensor")

LOGICAL_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("embed_activation", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("norm", None),
    ("layers", None),
)


def make_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A (data, fsdp, tensor) mesh over the first ``data * fsdp * tensor`` devices.

  Raises:
    ValueError: if there are fewer devices than the mesh needs, or, across several
      processes, more than it uses (the first would all be one process's).
  """
  devices = list(devices if devices is not None else jax.devices())
  size = data * fsdp * tensor
  if size > len(devices):
    raise ValueError(f"mesh data={data} x fsdp={fsdp} x tensor={tensor} needs {size} devices, "
                     f"{len(devices)} are present")
  if jax.process_count() > 1 and size != len(devices):
    raise ValueError(f"mesh data={data} x fsdp={fsdp} x tensor={tensor} must use all "
                     f"{len(devices)} devices of the {jax.process_count()} processes")
  return Mesh(np.array(devices[:size]).reshape(data, fsdp, tensor), MESH_AXES)


def logical_shardings(mesh: Mesh, logical_specs: Any,
                      rules: Sequence[tuple[str, Any]] = LOGICAL_RULES) -> Any:
  """``NamedSharding``s for a pytree of logical ``PartitionSpec``s."""
  return nn.logical_to_mesh_sharding(logical_specs, mesh, rules)


def batch_sharding(mesh: Mesh, rules: Sequence[tuple[str, Any]] = LOGICAL_RULES) -> NamedSharding:
  """Sharding of a [batch, length] token array."""
  return logical_shardings(mesh, PartitionSpec("batch", "length"), rules)


def in_pinned_host(shardings: Any) -> Any:
  """The same shardings, in host memory."""
  return jax.tree.map(lambda s: s.with_memory_kind(PINNED_HOST), shardings)
