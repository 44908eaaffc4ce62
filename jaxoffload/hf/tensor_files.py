"""Safetensors files read at the page cache's speed: ``MappedFile`` and ``copy_blocks``.

A safetensors file is an 8-byte little-endian header length, a JSON header
giving each tensor's dtype, shape and byte range, then the bytes.
``MappedFile`` maps the file and gives each tensor as a read-only numpy view;
``copy_blocks`` copies views into arrays a block of rows at a time on a pool
of threads (numpy releases the GIL in its copies), converting bfloat16 to
float32 by moving its bits and transposing in narrow tiles, which keep each
tile's writes within a few cache lines.

Example:
  >>> file = MappedFile("model.safetensors")
  >>> out = np.empty(file.shape("lm_head.weight")[::-1], np.float32)
  >>> copy_blocks([(out, file.tensor("lm_head.weight"), True)])
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import math
import os
import struct
from typing import Sequence

import ml_dtypes
import numpy as np

from jaxoffload.hf.config import CheckpointError

# The safetensors dtypes a Llama checkpoint's tensors come in.
DTYPES = {"BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16),
          "F32": np.dtype(np.float32)}
_ROWS = 256  # Rows of a tensor one task copies.
_TILE = 16  # Rows transposed at once.


class MappedFile:
  """One safetensors file, mapped into memory.

  Raises:
    CheckpointError: naming the file, where its header cannot be read.
  """

  def __init__(self, path: str):
    try:
      size = os.path.getsize(path)
      with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > size - 8:
          raise ValueError(f"a header of {length} bytes in a file of {size}")
        header = json.loads(f.read(length))
      self._entries = {name: (entry["dtype"], tuple(entry["shape"]),
                              tuple(entry["data_offsets"]))
                       for name, entry in header.items() if name != "__metadata__"}
      if any(end > size - 8 - length for _, _, (_, end) in self._entries.values()):
        raise ValueError("a tensor ends past the file's end")
      self._bytes = np.memmap(path, np.uint8, "r") if self._entries else np.empty(0, np.uint8)
    except (OSError, ValueError, KeyError, TypeError, struct.error) as error:
      raise CheckpointError(f"{path}: not a readable safetensors file ({error})") from None
    self.path, self._start = path, 8 + length

  def keys(self) -> list[str]:
    return list(self._entries)

  def shape(self, name: str) -> tuple[int, ...]:
    return self._entries[name][1]

  def tensor(self, name: str) -> np.ndarray:
    """Tensor ``name`` as a read-only view of the mapped file."""
    dtype, shape, (begin, end) = self._entries[name]
    if dtype not in DTYPES:
      raise CheckpointError(f"{self.path}: tensor {name} is {dtype}; a Llama checkpoint's "
                            f"tensors are one of {sorted(DTYPES)}")
    if end - begin != math.prod(shape) * DTYPES[dtype].itemsize:
      raise CheckpointError(f"{self.path}: tensor {name} has {end - begin} bytes for its shape "
                            f"{list(shape)} of {dtype}")
    return self._bytes[self._start + begin:self._start + end].view(DTYPES[dtype]).reshape(shape)


def copy_blocks(copies: Sequence[tuple[np.ndarray, np.ndarray, bool]]) -> None:
  """Copies each ``(out, source, transposed)``: ``source`` into ``out`` in ``out``'s dtype,
  transposed (a 2-D ``source``) where asked, a block of rows at a time on every core."""
  tasks = [(out, source, transposed, start)
           for out, source, transposed in copies for start in range(0, source.shape[0], _ROWS)]
  for future in [_pool().submit(_copy_rows, *task) for task in tasks]:
    future.result()


@functools.cache
def _pool() -> concurrent.futures.ThreadPoolExecutor:
  # The cores this process may run on, where the platform says (not macOS).
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  return concurrent.futures.ThreadPoolExecutor(cores or 1, thread_name_prefix="tensor_files")


def _copy_rows(out: np.ndarray, source: np.ndarray, transposed: bool, start: int) -> None:
  """Rows ``start`` to ``start + _ROWS`` of ``source`` into ``out``."""
  rows = slice(start, start + _ROWS)
  if not transposed:
    if source.dtype == DTYPES["BF16"] and out.dtype == np.float32:
      np.left_shift(source[rows].view(np.uint16), 16, out=out[rows].view(np.uint32),
                    dtype=np.uint32)
    else:
      out[rows] = _converted(source[rows], out.dtype)
    return
  block = _converted(source[rows], out.dtype)
  for i in range(0, block.shape[0], _TILE):
    out[:, start + i:start + i + _TILE] = block[i:i + _TILE].T


def _converted(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
  """``values`` in ``dtype``: bfloat16 to float32 by its bits (exact, and faster than a cast)."""
  if values.dtype == dtype:
    return values
  if values.dtype == DTYPES["BF16"] and dtype == np.float32:
    return (values.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
  return values.astype(dtype)
