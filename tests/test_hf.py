"""Hugging Face checkpoints: transformers' logits on import, bit-exact round trips, clear refusals."""

import dataclasses
import json
import os
import shutil
import stat

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxoffload import hf
from jaxoffload.hf.config import CheckpointError, read_config
from jaxoffload.nn import sharding
from jaxoffload.nn.model import Llama
from jaxoffload.nn.params import logical_param_specs
from jaxoffload.nn.remat import layer_groups

FIXTURES = "tests/fixtures"
CHECKPOINTS = ["tiny_llama", "tiny_llama_tied"]


def reference(name):
  data = np.load(os.path.join(FIXTURES, name, "reference.npz"))
  return jnp.asarray(data["tokens"]), data["logits"]


def logits(config, params, tokens, groups=None):
  return np.asarray(Llama(config, groups).apply({"params": params}, tokens))


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_imported_logits_are_transformers_logits(name):
  # The fixtures cover grouped-query attention, Llama 3.1's rope scaling, tied
  # embeddings, a head width apart from hidden / heads, float32 and bfloat16 files.
  tokens, want = reference(name)
  config, params = hf.load_checkpoint(os.path.join(FIXTURES, name))
  got = logits(config, params, tokens)
  assert got.shape == want.shape
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("change", [dict(rope_scaling_factor=None),
                                    dict(rope_scaling_high_freq_factor=2.0),
                                    dict(rope_theta=10000.0)])
def test_each_rope_field_changes_the_logits(change):
  tokens, want = reference("tiny_llama")
  config, params = hf.load_checkpoint(os.path.join(FIXTURES, "tiny_llama"))
  got = logits(dataclasses.replace(config, **change), params, tokens)
  assert np.max(np.abs(got - want)) > 1e-4


def test_the_fixture_configs_map_every_field():
  config = read_config(os.path.join(FIXTURES, "tiny_llama"))
  assert (config.num_attention_heads, config.num_query_groups, config.head_dim) == (4, 2, 8)
  assert (config.rope_theta, config.rope_scaling_factor,
          config.rope_scaling_original_max_position_embeddings) == (100.0, 8.0, 32)
  assert not config.share_embeddings_and_output_weights
  tied = read_config(os.path.join(FIXTURES, "tiny_llama_tied"))
  assert tied.share_embeddings_and_output_weights and tied.head_dim == 16
  assert (tied.num_query_groups, tied.rope_theta, tied.rope_scaling_factor) == (1, 500000.0, None)


def copy_checkpoint(tmp_path, name="tiny_llama"):
  target = tmp_path / name
  shutil.copytree(os.path.join(FIXTURES, name), target)
  return target


def rewrite_config(directory, **fields):
  path = directory / "config.json"
  raw = {**json.loads(path.read_text()), **fields}
  path.write_text(json.dumps({k: v for k, v in raw.items() if v is not None}))


def test_the_older_rope_fields_read_the_same(tmp_path):
  directory = copy_checkpoint(tmp_path)
  rope = json.loads((directory / "config.json").read_text())["rope_parameters"]
  rewrite_config(directory, rope_parameters=None, rope_theta=rope["rope_theta"],
                 rope_scaling={"type": "llama3", **{k: v for k, v in rope.items()
                                                    if k not in ("rope_type", "rope_theta")}})
  assert read_config(str(directory)) == read_config(os.path.join(FIXTURES, "tiny_llama"))


def bits(x):
  """The array's bytes as unsigned integers: equal only where every bit is."""
  x = np.asarray(x)
  return x.view(f"u{x.dtype.itemsize}")


def without_version(directory):
  """config.json's fields but the version of transformers that wrote it."""
  with open(os.path.join(directory, "config.json")) as f:
    return {k: v for k, v in json.load(f).items() if k != "transformers_version"}


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_import_export_import_is_bit_exact(tmp_path, name):
  # The source's dtype (float32 and bfloat16 files), and its config.json, are kept.
  source = os.path.join(FIXTURES, name)
  config, params = hf.load_checkpoint(source)
  hf.save_checkpoint(str(tmp_path), config, params, source=source)
  again_config, again = hf.load_checkpoint(str(tmp_path))
  assert again_config == config
  for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  original, written = (load_file(os.path.join(d, "model.safetensors")) for d in (source, tmp_path))
  assert sorted(written) == sorted(original)
  for key in original:
    assert written[key].dtype == original[key].dtype
    np.testing.assert_array_equal(written[key], original[key])
  assert without_version(tmp_path) == without_version(source)


@pytest.mark.parametrize("params_dtype", ["float32", "bfloat16"])
def test_by_default_the_parameters_are_stored_in_their_own_dtype(tmp_path, params_dtype):
  directory = os.path.join(FIXTURES, "tiny_llama")
  config, params = hf.load_checkpoint(directory,
                                      config=read_config(directory, params_dtype=params_dtype))
  if params_dtype == "float32":  # Values bfloat16 would round, as torch's init drew them.
    kernel = np.asarray(params["lm_head"]["kernel"])
    assert not np.array_equal(kernel, kernel.astype(jnp.bfloat16).astype(np.float32))
  hf.save_checkpoint(str(tmp_path), config, params)
  assert json.loads((tmp_path / "config.json").read_text())["dtype"] == params_dtype
  stored = load_file(str(tmp_path / "model.safetensors"))
  assert {str(t.dtype) for t in stored.values()} == {params_dtype}
  _, again = hf.load_checkpoint(str(tmp_path), config=config)
  for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(params)):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(bits(a), bits(b))


def test_mixed_parameters_are_stored_in_float32_and_others_need_a_dtype(tmp_path):
  config, params = hf.load_checkpoint(os.path.join(FIXTURES, "tiny_llama"))
  mixed = {**params, "embed": jax.tree.map(lambda x: x.astype(jnp.bfloat16), params["embed"])}
  hf.save_checkpoint(str(tmp_path / "mixed"), config, mixed)
  _, again = hf.load_checkpoint(str(tmp_path / "mixed"))
  for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(mixed)):
    np.testing.assert_array_equal(bits(a), bits(np.asarray(b).astype(np.float32)))
  wide = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
  with pytest.raises(ValueError, match=r"^parameters of dtype float64 cannot be stored as they "
                                       r"are; pass dtype= one of bfloat16, float16, float32$"):
    hf.save_checkpoint(str(tmp_path / "wide"), config, wide)
  with pytest.raises(ValueError, match=r"^dtype 'int8' cannot be stored; save_checkpoint writes "
                                       r"bfloat16, float16, float32$"):
    hf.save_checkpoint(str(tmp_path / "int8"), config, params, dtype="int8")
  assert not (tmp_path / "wide").exists() and not (tmp_path / "int8").exists()


def test_config_json_keeps_the_sources_fields_in_the_current_keys(tmp_path):
  source = copy_checkpoint(tmp_path)
  rope = json.loads((source / "config.json").read_text())["rope_parameters"]
  # A source in the keys transformers 4 wrote, with fields the model does not decide
  # that are not transformers' defaults.
  rewrite_config(source, dtype=None, torch_dtype="float32", rope_parameters=None,
                 rope_theta=rope["rope_theta"],
                 rope_scaling={k: v for k, v in rope.items() if k != "rope_theta"},
                 bos_token_id=5, eos_token_id=[6, 7], initializer_range=0.01, use_cache=False)
  config, params = hf.load_checkpoint(str(source))
  hf.save_checkpoint(str(tmp_path / "out"), config, params, source=str(source))
  written = json.loads((tmp_path / "out" / "config.json").read_text())
  assert (written["dtype"], written["rope_parameters"]) == ("float32", rope)
  assert not {"torch_dtype", "rope_theta", "rope_scaling"} & set(written)
  assert ([written[k] for k in ("bos_token_id", "eos_token_id", "initializer_range", "use_cache")]
          == [5, [6, 7], 0.01, False])
  assert read_config(str(tmp_path / "out")) == config


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640)], ids=["022", "027"])
def test_written_files_follow_the_umask(tmp_path, umask, mode):
  config, params = hf.load_checkpoint(os.path.join(FIXTURES, "tiny_llama"))
  previous = os.umask(umask)
  try:
    hf.save_checkpoint(str(tmp_path), config, params, max_shard_bytes=40_000)
  finally:
    os.umask(previous)
  modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
  assert {"config.json", "model.safetensors.index.json"} <= set(modes)
  assert sum(name.endswith(".safetensors") for name in modes) > 1
  assert set(modes.values()) == {mode}, {name: oct(m) for name, m in modes.items()}


def test_shards_and_an_index_past_the_shard_size(tmp_path):
  config, params = hf.load_checkpoint(os.path.join(FIXTURES, "tiny_llama"))
  hf.save_checkpoint(str(tmp_path), config, params, dtype="float32", max_shard_bytes=40_000)
  index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
  files = sorted(set(index["weight_map"].values()))
  assert len(files) > 1 and not (tmp_path / "model.safetensors").exists()
  assert sorted(p.name for p in tmp_path.glob("model-*")) == files  # No partial shard left.
  for file in files:  # Written as each filled: none over the size unless one tensor is.
    tensors = load_file(tmp_path / file)
    assert len(tensors) == 1 or sum(t.nbytes for t in tensors.values()) <= 40_000
  _, again = hf.load_checkpoint(str(tmp_path))
  for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (the CPU backend has them in CI)")
def test_leaves_load_straight_into_their_shards_and_memory_kinds():
  directory = os.path.join(FIXTURES, "tiny_llama")
  tokens, want = reference("tiny_llama")
  config = read_config(directory)
  groups = layer_groups(config.num_layers, offload_num_layers=1, offload_weights=True)
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  shardings = sharding.logical_shardings(mesh, logical_param_specs(Llama(config, groups), tokens))
  shardings["layers_0_1"] = sharding.in_pinned_host(shardings["layers_0_1"])
  _, params = hf.load_checkpoint(directory, groups=groups, shardings=shardings)
  for leaf, placed in zip(jax.tree.leaves(params), jax.tree.leaves(shardings)):
    assert leaf.sharding == placed
  assert {x.sharding.memory_kind for x in jax.tree.leaves(params["layers_0_1"])} == {"pinned_host"}
  got = jax.jit(lambda p, t: Llama(config, groups).apply({"params": p}, t))(params, tokens)
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=0)


def checkpoint_error(directory):
  with pytest.raises(CheckpointError) as error:
    hf.load_checkpoint(str(directory))
  message = str(error.value)
  assert "\n" not in message
  return message


def test_bad_checkpoints_are_named_in_one_line(tmp_path):
  directory = copy_checkpoint(tmp_path)
  weights = load_file(str(directory / "model.safetensors"))
  # A tensor of the wrong shape.
  bad = dict(weights, **{"model.layers.1.mlp.up_proj.weight": np.zeros((64, 16), np.float32)})
  save_file(bad, str(directory / "model.safetensors"))
  assert checkpoint_error(directory) == (
      f"{directory}/model.safetensors: tensor model.layers.1.mlp.up_proj.weight has shape "
      f"[64, 16]; config.json makes it [64, 32]")
  # A missing shard.
  (directory / "model.safetensors").unlink()
  (directory / "model.safetensors.index.json").write_text(json.dumps(
      {"weight_map": {name: "model-00001-of-00002.safetensors" for name in weights}}))
  assert checkpoint_error(directory) == (
      f"{directory}/model.safetensors.index.json names the shard "
      f"model-00001-of-00002.safetensors, which is missing from {directory}")
  # A corrupt header.
  (directory / "model.safetensors.index.json").unlink()
  (directory / "model.safetensors").write_bytes(b"\xff" * 64)
  assert checkpoint_error(directory).startswith(
      f"{directory}/model.safetensors: not a readable safetensors file (")


@pytest.mark.parametrize("fields, message", [
    (dict(model_type="mistral"), "model_type 'mistral' is not supported; jaxoffload reads Llama "
                                 "checkpoints (model_type 'llama')"),
    (dict(attention_bias=True), "attention_bias=True: the model has no biases"),
    (dict(sliding_window=4096), "sliding_window=4096 is not supported: the model has full "
                                "attention and one MLP per layer"),
    (dict(num_local_experts=8), "num_local_experts=8 is not supported: the model has full "
                                "attention and one MLP per layer"),
    (dict(hidden_act="gelu"), "hidden_act='gelu': the model's MLP is SwiGLU (silu)"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
     "rope_parameters rope_type 'yarn' is not supported; only 'default' and 'llama3'"),
    (dict(hidden_size=None), "the field 'hidden_size' is missing"),
])
def test_what_the_model_does_not_implement_is_refused(tmp_path, fields, message):
  directory = copy_checkpoint(tmp_path)
  rewrite_config(directory, **fields)
  assert checkpoint_error(directory) == f"{directory}/config.json: {message}"


def test_an_unexpected_tensor_is_refused(tmp_path):
  directory = copy_checkpoint(tmp_path)
  weights = load_file(str(directory / "model.safetensors"))
  weights["model.layers.0.self_attn.q_proj.bias"] = np.zeros(32, np.float32)
  save_file(weights, str(directory / "model.safetensors"))
  assert checkpoint_error(directory) == (
      f"{directory}/model.safetensors: tensor model.layers.0.self_attn.q_proj.bias is not part "
      f"of the Llama model config.json describes")
