"""Hugging Face Llama checkpoints in and out: ``load_checkpoint`` and ``save_checkpoint``.

A checkpoint is a directory as transformers' ``save_pretrained`` writes it:
``config.json`` and ``model.safetensors``, or shards named by
``model.safetensors.index.json``, in bfloat16, float16 or float32. Loading
copies each tensor from the memory-mapped files on every core
(``jaxoffload.hf.tensor_files``) and writes each parameter leaf once, straight
into its sharding and memory kind: every device receives only its shard, and
the host holds one leaf at a time.

Example:
  >>> config, params = load_checkpoint("Llama-3.2-1B")
  >>> logits = Llama(config).apply({"params": params}, tokens)  # [batch, length, vocab]
  >>> save_checkpoint("fine-tuned", config, params)
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any, Iterator, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from jaxoffload._compat import to_device
from jaxoffload.hf.config import (CONFIG_FILE, DTYPES, CheckpointError, hf_config, read_config,
                                  read_raw_config, stored_dtype)
from jaxoffload.hf.tensor_files import MappedFile, copy_blocks
from jaxoffload.nn.model import Llama, LlamaConfig
from jaxoffload.nn.params import abstract_params
from jaxoffload.nn.remat import LayerGroup
from jaxoffload.optim.offload_plan import leaf_path

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# transformers' save_pretrained default.
MAX_SHARD_BYTES = 5 * 10**9

# Per parameter of a decoder layer: its tensor's name in layer i, and whether
# it is stored transposed (torch's Linear keeps [out, in]; a Dense kernel is [in, out]).
LAYER_TENSORS = {
    "attention_norm/scale": ("input_layernorm.weight", False),
    "attention/query/kernel": ("self_attn.q_proj.weight", True),
    "attention/key/kernel": ("self_attn.k_proj.weight", True),
    "attention/value/kernel": ("self_attn.v_proj.weight", True),
    "attention/out/kernel": ("self_attn.o_proj.weight", True),
    "mlp_norm/scale": ("post_attention_layernorm.weight", False),
    "mlp/gate/kernel": ("mlp.gate_proj.weight", True),
    "mlp/up/kernel": ("mlp.up_proj.weight", True),
    "mlp/down/kernel": ("mlp.down_proj.weight", True),
}
GLOBAL_TENSORS = {
    "embed/embedding": ("model.embed_tokens.weight", False),
    "final_norm/scale": ("model.norm.weight", False),
    "lm_head/kernel": ("lm_head.weight", True),
}
# Tensors some checkpoints carry that the model computes itself.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _sources(path: str) -> tuple[list[str], bool]:
  """The names of a leaf's tensors (one per layer of a stacked leaf), and whether transposed."""
  group, _, rest = path.partition("/")
  if group in ("embed", "final_norm", "lm_head"):
    name, transposed = GLOBAL_TENSORS[path]
    return [name], transposed
  start, stop = (int(n) for n in group.split("_")[1:])
  name, transposed = LAYER_TENSORS[rest]
  return [f"model.layers.{i}.{name}" for i in range(start, stop)], transposed


def _weight_map(directory: str) -> dict[str, str]:
  """Tensor name -> the safetensors file that holds it."""
  index = os.path.join(directory, INDEX_FILE)
  single = os.path.join(directory, WEIGHTS_FILE)
  if os.path.exists(index):
    try:
      with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as error:
      raise CheckpointError(f"{index}: not a safetensors index ({error})") from None
    files = {name: os.path.join(directory, file) for name, file in weight_map.items()}
    for file in sorted(set(files.values())):
      if not os.path.exists(file):
        raise CheckpointError(f"{index} names the shard {os.path.basename(file)}, which is "
                              f"missing from {directory}")
    return files
  if not os.path.exists(single):
    raise CheckpointError(f"{directory} holds neither {WEIGHTS_FILE} nor {INDEX_FILE}")
  return {name: single for name in MappedFile(single).keys()}


def _check_tensors(directory: str, names: dict[str, str], files: dict[str, MappedFile],
                   expected: dict[str, tuple]) -> None:
  """Every tensor the model needs is there with its shape, and nothing it would ignore."""
  for name, shape in expected.items():
    if name not in names:
      raise CheckpointError(f"{directory}: tensor {name} is in no safetensors file")
    found = files[names[name]].shape(name)
    if found != shape:
      raise CheckpointError(f"{names[name]}: tensor {name} has shape {list(found)}; "
                            f"config.json makes it {list(shape)}")
  for name, file in names.items():
    if name not in expected and not name.endswith(IGNORED_SUFFIXES):
      raise CheckpointError(f"{file}: tensor {name} is not part of the Llama model "
                            f"config.json describes")


def tensor_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
  """Every tensor a checkpoint of ``config`` holds, by name, with its shape on disk."""
  shapes = abstract_params(Llama(config), jnp.zeros((1, 2), jnp.int32))
  expected = {}
  for key_path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]:
    path = leaf_path(key_path)
    names, transposed = _sources(path)
    shape = leaf.shape[1:] if path.startswith("layers_") else leaf.shape
    for name in names:
      expected[name] = tuple(reversed(shape)) if transposed else tuple(shape)
  return expected


def load_checkpoint(directory: str, *, config: Optional[LlamaConfig] = None,
                    groups: Optional[Sequence[LayerGroup]] = None,
                    shardings: Any = None) -> tuple[LlamaConfig, Any]:
  """Reads a Llama checkpoint directory into the model's config and parameter tree.

  Args:
    directory: what ``save_pretrained`` wrote: ``config.json`` and safetensors.
    config: the model config to load into (its shape must be the checkpoint's; its
      ``params_dtype`` is what the parameters become); default ``read_config``'s.
    groups: the layer groups the parameters' stacks are cut at (``model.Llama``'s).
    shardings: a pytree of shardings, one per parameter leaf (memory kinds
      included): each leaf is written straight there; default: the default device.

  Returns:
    ``(config, params)`` such that ``Llama(config, groups).apply({"params": params},
    tokens)`` gives the checkpoint's logits.

  Raises:
    CheckpointError: one line naming the file and the problem.
  """
  config = config or read_config(directory)
  probe = jnp.zeros((1, 2), jnp.int32)
  shapes = abstract_params(Llama(config, groups), probe)
  paths = [leaf_path(path) for path, _ in jax.tree_util.tree_flatten_with_path(shapes)[0]]
  names = _weight_map(directory)
  files = {file: MappedFile(file) for file in sorted(set(names.values()))}
  _check_tensors(directory, names, files, tensor_shapes(config))

  def place(path, leaf, sharding):
    read = _reader(_sources(path), path.startswith("layers_"), names, files, leaf.dtype)
    if sharding is None:
      return jnp.asarray(read((slice(None),) * len(leaf.shape)))
    return jax.make_array_from_callback(leaf.shape, sharding, read)

  leaf_shardings = [None] * len(paths) if shardings is None else jax.tree.leaves(shardings)
  leaves = [place(p, leaf, s) for p, leaf, s in zip(paths, jax.tree.leaves(shapes),
                                                    leaf_shardings)]
  return config, jax.tree.unflatten(jax.tree.structure(shapes), leaves)


def _reader(source: tuple[list[str], bool], stacked: bool, names: dict[str, str],
            files: dict[str, MappedFile], dtype):
  """``index -> numpy`` for one leaf: the part ``index`` selects, in the leaf's layout."""
  tensors, transposed = source

  def view(name: str, index: tuple) -> np.ndarray:  # The part on disk, in the disk's layout.
    return files[names[name]].tensor(name)[tuple(reversed(index)) if transposed else index]

  def copy(views: list[np.ndarray]) -> np.ndarray:
    shape = views[0].shape[::-1] if transposed else views[0].shape
    out = np.empty((len(views), *shape), dtype)
    # Straight from the page cache into the leaf: the host holds the leaf once.
    copy_blocks([(part, v, transposed) for part, v in zip(out, views)])
    return out

  def read(index: tuple) -> np.ndarray:
    if not stacked:
      return copy([view(tensors[0], index)])[0]
    return copy([view(name, index[1:]) for name in tensors[index[0]]])

  return read


def _tensor(leaf: Any, index: Optional[int], dtype, transposed: bool) -> np.ndarray:
  """The checkpoint tensor ``leaf`` holds (its layer ``index`` when stacked), in ``dtype``."""
  if isinstance(leaf, jax.Array):
    return np.asarray(_stored(leaf, index, dtype=dtype, transposed=transposed))
  part = leaf if index is None else leaf[index]
  return np.ascontiguousarray((part.T if transposed else part).astype(dtype))


@functools.partial(jax.jit, static_argnames=("dtype", "transposed"))
def _stored(leaf: jax.Array, index: Optional[jax.Array], *, dtype, transposed: bool) -> jax.Array:
  """Cast and laid out on the device, so the host receives only the stored bytes; a new
  array (``jnp.copy``), so the host copy ``np.asarray`` caches dies with it, not with the
  run's parameter."""
  part = to_device(leaf if index is None else leaf[index]).astype(dtype)
  return jnp.copy(part.T if transposed else part)


def _tensors(config: LlamaConfig, params: Any, dtype) -> Iterator[tuple[str, np.ndarray]]:
  """The checkpoint's tensors, in transformers' order, one on the host at a time."""
  by_path = {leaf_path(path): leaf
             for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
  yield GLOBAL_TENSORS["embed/embedding"][0], _tensor(by_path["embed/embedding"], None, dtype,
                                                       False)
  groups = sorted({p.split("/")[0] for p in by_path if p.startswith("layers_")},
                  key=lambda g: int(g.split("_")[1]))
  for group in groups:
    start = int(group.split("_")[1])
    for sub, (name, transposed) in LAYER_TENSORS.items():
      stack = by_path[f"{group}/{sub}"]
      for i in range(stack.shape[0]):
        yield f"model.layers.{start + i}.{name}", _tensor(stack, i, dtype, transposed)
  yield GLOBAL_TENSORS["final_norm/scale"][0], _tensor(by_path["final_norm/scale"], None, dtype,
                                                        False)
  if not config.share_embeddings_and_output_weights:
    yield "lm_head.weight", _tensor(by_path["lm_head/kernel"], None, dtype, True)


def _params_dtype(params: Any) -> str:
  """The parameters' own dtype; float32 where they mix, which holds each of them exactly."""
  names = {np.dtype(leaf.dtype).name for leaf in jax.tree.leaves(params)}
  if not names <= set(DTYPES):
    raise ValueError(f"parameters of dtype {', '.join(sorted(names - set(DTYPES)))} cannot be "
                     f"stored as they are; pass dtype= one of {', '.join(DTYPES)}")
  return names.pop() if len(names) == 1 else "float32"


def umask() -> int:
  """The process's umask, read without changing it where Linux shows it."""
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith("Umask:"):
          return int(line.split()[1], 8)
  except OSError:
    pass
  # Elsewhere only setting it tells it; it is set back at once, but a file another
  # thread creates in between gets 022.
  mask = os.umask(0o022)
  os.umask(mask)
  return mask


def save_checkpoint(directory: str, config: LlamaConfig, params: Any, *,
                    dtype: Optional[str] = None, source: Optional[str] = None,
                    max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
  """Writes ``params`` as a checkpoint transformers and ``load_checkpoint`` read.

  Each shard is written as soon as it is full, so the host holds at most one
  shard and one tensor more; each tensor is cast on the device, which holds
  one tensor more while it is.

  Args:
    directory: created if missing; ``config.json`` and one safetensors file, or
      shards and ``model.safetensors.index.json`` past ``max_shard_bytes``.
    config: the model's config.
    params: its parameter tree, any layer grouping, sharding or memory kind.
    dtype: the tensors' dtype on disk: bfloat16, float16 or float32; default: the
      ``source`` checkpoint's, else the parameters' own (float32 where they mix), so
      that loading gives back the same values.
    source: the checkpoint directory the model was imported from: its ``config.json``
      fields the model does not decide (token ids, ``initializer_range``...) are kept.

  Raises:
    ValueError: ``dtype`` is none of the three, or ``params`` need one named.
    CheckpointError: ``source`` has no readable ``config.json``.

  Example:
    >>> save_checkpoint("fine-tuned", config, params, source="Llama-3.2-1B")
  """
  raw = read_raw_config(source) if source is not None else None
  if dtype is None:
    dtype = (stored_dtype(source) if source is not None else None) or _params_dtype(params)
  stored = dtype if isinstance(dtype, str) else np.dtype(dtype).name
  if stored not in DTYPES:
    raise ValueError(f"dtype {stored!r} cannot be stored; save_checkpoint writes "
                     f"{', '.join(DTYPES)}")
  dtype = jnp.dtype(stored)
  os.makedirs(directory, exist_ok=True)
  # safetensors writes through a temporary file, created 0600 and renamed into place;
  # the checkpoint's files get the mode any file the user creates gets.
  mode = 0o666 & ~umask()
  # Shards are written under their number alone: their count is known only at the end.
  written: list[tuple[str, dict[str, int]]] = []
  shard: dict[str, np.ndarray] = {}

  def flush() -> None:
    file = os.path.join(directory, f"model-{len(written) + 1:05d}.safetensors.partial")
    save_file(shard, file, metadata={"format": "pt"})
    os.chmod(file, mode)
    written.append((file, {name: tensor.nbytes for name, tensor in shard.items()}))
    shard.clear()

  for name, tensor in _tensors(config, params, dtype):
    if shard and sum(t.nbytes for t in shard.values()) + tensor.nbytes > max_shard_bytes:
      flush()
    shard[name] = tensor
  flush()
  files = ([WEIGHTS_FILE] if len(written) == 1 else
           [f"model-{i + 1:05d}-of-{len(written):05d}.safetensors" for i in range(len(written))])
  for file, (partial, _) in zip(files, written):
    os.replace(partial, os.path.join(directory, file))
  if len(written) > 1:
    index = {"metadata": {"total_size": sum(sum(sizes.values()) for _, sizes in written)},
             "weight_map": {name: file for file, (_, sizes) in zip(files, written)
                            for name in sizes}}
    with open(os.path.join(directory, INDEX_FILE), "w") as f:
      json.dump(index, f, indent=2)
  with open(os.path.join(directory, CONFIG_FILE), "w") as f:
    json.dump(hf_config(config, dtype.name, raw), f, indent=2, sort_keys=True)
    f.write("\n")
