"""Safetensors files mapped and copied a block of rows at a time, against safetensors' reader."""

import json
import struct

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxoffload.hf.config import CheckpointError
from jaxoffload.hf.tensor_files import MappedFile, copy_blocks

# Rows that are no multiple of a task's 256 or a tile's 16.
SHAPE = (531, 37)


def tensors() -> dict[str, np.ndarray]:
  values = np.random.default_rng(0).standard_normal(SHAPE, np.float32)
  return {"bf16": values.astype(ml_dtypes.bfloat16), "f16": values.astype(np.float16),
          "f32": values, "norm": values[0].astype(ml_dtypes.bfloat16)}


def test_a_mapped_file_holds_what_safetensors_reads(tmp_path):
  save_file(tensors(), str(tmp_path / "a.safetensors"), metadata={"format": "pt"})
  file = MappedFile(str(tmp_path / "a.safetensors"))
  want = load_file(str(tmp_path / "a.safetensors"))
  assert sorted(file.keys()) == sorted(want)
  for name, values in want.items():
    assert file.shape(name) == values.shape
    got = file.tensor(name)
    assert got.dtype == values.dtype
    np.testing.assert_array_equal(got, values)


@pytest.mark.parametrize("name", ["bf16", "f16", "f32"])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
@pytest.mark.parametrize("transposed", [False, True])
def test_copies_convert_as_numpy_casts_and_transpose(name, dtype, transposed):
  source = tensors()[name]
  out = np.empty(SHAPE[::-1] if transposed else SHAPE, dtype)
  copy_blocks([(out, source, transposed)])
  want = source.astype(dtype)
  np.testing.assert_array_equal(out, want.T if transposed else want)


def test_many_copies_at_once_each_reach_their_own_array():
  sources = [np.full(SHAPE, k, ml_dtypes.bfloat16) for k in range(5)] + [tensors()["norm"]]
  outs = [np.empty(s.shape, np.float32) for s in sources]
  copy_blocks([(out, source, False) for out, source in zip(outs, sources)])
  for out, source in zip(outs, sources):
    np.testing.assert_array_equal(out, source.astype(np.float32))


@pytest.mark.parametrize("header, message", [
    (b"\xff" * 8, "not a readable safetensors file (a header of"),
    (struct.pack("<Q", 2) + b"{]", "not a readable safetensors file"),
    (struct.pack("<Q", 80) + json.dumps(
        {"w": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 8]}}).encode().ljust(80),
     "a tensor ends past the file's end"),
])
def test_a_damaged_file_is_named_in_one_line(tmp_path, header, message):
  path = tmp_path / "bad.safetensors"
  path.write_bytes(header)
  with pytest.raises(CheckpointError, match=f"^{path}: .*" + message.replace("(", r"\(")):
    MappedFile(str(path))


def test_a_tensor_whose_bytes_miss_its_shape_or_dtype_is_named(tmp_path):
  entries = {"short": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 6]},
             "ints": {"dtype": "I64", "shape": [1], "data_offsets": [6, 14]}}
  header = json.dumps(entries).encode()
  path = tmp_path / "odd.safetensors"
  path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(14))
  file = MappedFile(str(path))
  with pytest.raises(CheckpointError,
                     match=r"tensor short has 6 bytes for its shape \[4\] of BF16"):
    file.tensor("short")
  with pytest.raises(CheckpointError, match="tensor ints is I64; a Llama checkpoint's tensors"):
    file.tensor("ints")
