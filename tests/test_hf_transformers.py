"""Against transformers itself, on the fly (the ``hf`` extra: ``pip install -e '.[hf]'``).

Random Llama checkpoints written by transformers: their logits, and the loss
after one AdamW step, equal ours. What we write, transformers reads as we
meant it; the fixture maker writes checkpoints we import.
"""

import json
import os
import runpy
import shutil
import sys
import tempfile

import jax.numpy as jnp
import numpy as np
import pytest

from jaxoffload import hf
from jaxoffload.hf.config import older_keys
from jaxoffload.nn.model import Llama
from jaxoffload.train import load_config, resolve, run

pytestmark = pytest.mark.slow
FIXTURES = "tests/fixtures"


@pytest.fixture(scope="module")
def torch():
  # Imported here, not at collection: the fast tier never pays for torch.
  return pytest.importorskip("torch")


@pytest.fixture(scope="module")
def transformers(torch):
  return pytest.importorskip("transformers")

COMMON = dict(vocab_size=128, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
              max_position_embeddings=64, rms_norm_eps=1e-6)
MODELS = {
    "gqa-llama3-rope": dict(num_attention_heads=6, num_key_value_heads=2,
                            rope_parameters={"rope_type": "llama3", "rope_theta": 200.0,
                                             "factor": 4.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 16}),
    "tied-wide-heads": dict(num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                            tie_word_embeddings=True),
}


def checkpoint(torch, transformers, tmp_path, name):
  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON, **MODELS[name]))
  model.save_pretrained(tmp_path / name, safe_serialization=True)
  return model, str(tmp_path / name)


@pytest.mark.parametrize("name", MODELS)
def test_logits_equal_transformers(torch, transformers, tmp_path, name):
  model, directory = checkpoint(torch, transformers, tmp_path, name)
  tokens = np.random.default_rng(0).integers(0, COMMON["vocab_size"], (2, 40))
  with torch.no_grad():
    want = model(torch.tensor(tokens)).logits.numpy()
  config, params = hf.load_checkpoint(directory)
  got = np.asarray(Llama(config).apply({"params": params}, jnp.asarray(tokens)))
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("offload", [[], ["optimizer.optimizer_cpu_offload=True",
                                          "optimizer.optimizer_offload_fraction=1.0",
                                          "optimizer.optimizer_offload_update_on=host_kernel"]],
                         ids=["no-offload", "host-kernel"])
def test_one_adamw_step_lands_where_torch_lands(torch, transformers, tmp_path, offload):
  model, directory = checkpoint(torch, transformers, tmp_path, "gqa-llama3-rope")
  lr, b1, b2, eps, decay = 1e-2, 0.9, 0.95, 1e-8, 0.1
  config = load_config(None, [
      f"model.hf_checkpoint={directory}", "model.seq_length=32", "train.train_iters=2",
      "train.global_batch_size=4", "train.micro_batch_size=4", f"optimizer.lr={lr}",
      f"optimizer.min_lr={lr}", "optimizer.lr_warmup_iters=0", "optimizer.lr_decay_style=constant",
      f"optimizer.adam_beta1={b1}", f"optimizer.adam_beta2={b2}", f"optimizer.adam_eps={eps}",
      f"optimizer.weight_decay={decay}", "optimizer.clip_grad=1e9", *offload])
  batches = [torch.tensor(resolve(config).data.train(i)).long() for i in range(2)]
  ours = run(config, log=lambda _: None).losses
  optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(b1, b2), eps=eps,
                                weight_decay=decay)
  theirs = []
  for tokens in batches:
    loss = model(tokens, labels=tokens).loss
    theirs.append(float(loss.detach()))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
  np.testing.assert_allclose(ours, theirs, rtol=2e-5)


def test_a_float32_tree_saved_by_default_loads_bit_exactly_in_transformers(
    torch, transformers, tmp_path):
  source = os.path.join(FIXTURES, "tiny_llama")
  config, params = hf.load_checkpoint(source)
  hf.save_checkpoint(str(tmp_path), config, params)
  # dtype="auto": the dtype config.json names.
  ours, want = (transformers.AutoModelForCausalLM.from_pretrained(d, dtype="auto").state_dict()
                for d in (str(tmp_path), source))
  assert sorted(ours) == sorted(want)
  for name, tensor in want.items():
    assert ours[name].dtype == tensor.dtype == torch.float32
    assert torch.equal(ours[name].view(torch.int32), tensor.view(torch.int32)), name


def test_the_written_config_is_transformers_own_with_the_sources_fields(
    torch, transformers, tmp_path, monkeypatch):
  source = tmp_path / "source"
  shutil.copytree(os.path.join(FIXTURES, "tiny_llama"), source)
  raw = json.loads((source / "config.json").read_text())
  raw.update(bos_token_id=5, eos_token_id=[6, 7], initializer_range=0.01)
  (source / "config.json").write_text(json.dumps(raw))
  config, params = hf.load_checkpoint(str(source))
  hf.save_checkpoint(str(tmp_path / "out"), config, params, source=str(source))
  read = transformers.AutoConfig.from_pretrained(str(tmp_path / "out"))
  assert (read.bos_token_id, read.eos_token_id, read.initializer_range) == (5, [6, 7], 0.01)
  assert read.dtype == torch.float32 and read.rope_parameters == raw["rope_parameters"]
  settings = lambda directory: transformers.AutoConfig.from_pretrained(directory).to_diff_dict()
  assert read.to_diff_dict() == settings(str(source))
  # Without transformers, the same fields, in the keys transformers 5 takes.
  monkeypatch.setitem(sys.modules, "transformers", None)
  hf.save_checkpoint(str(tmp_path / "bare"), config, params, source=str(source))
  monkeypatch.undo()
  fields = json.loads((tmp_path / "bare" / "config.json").read_text())
  assert "transformers_version" not in fields
  assert settings(str(tmp_path / "bare")) == read.to_diff_dict()
  # What an older transformers would be given describes the same config.
  assert (transformers.LlamaConfig(**older_keys(fields)).to_dict()
          == transformers.LlamaConfig(**fields).to_dict())


def test_the_fixture_maker_writes_checkpoints_we_import_in_a_new_directory(
    torch, transformers, tmp_path, monkeypatch):
  def fixtures():
    files = [os.path.join(FIXTURES, name, file) for name in ("tiny_llama", "tiny_llama_tied")
             for file in os.listdir(os.path.join(FIXTURES, name))]
    return {file: os.stat(file).st_mtime_ns for file in files}

  before = fixtures()
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
  out = runpy.run_path(os.path.join(FIXTURES, "make_tiny_llama.py"), run_name="maker")["main"]()
  assert os.path.dirname(out) == str(tmp_path) and fixtures() == before
  for name in ("tiny_llama", "tiny_llama_tied"):
    reference = np.load(os.path.join(out, name, "reference.npz"))
    config, params = hf.load_checkpoint(os.path.join(out, name))
    got = Llama(config).apply({"params": params}, jnp.asarray(reference["tokens"]))
    np.testing.assert_allclose(np.asarray(got), reference["logits"], atol=1e-5, rtol=0)
