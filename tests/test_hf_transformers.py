"""Against transformers itself, on the fly (the ``hf`` extra: ``pip install -e '.[hf]'``).

Random Llama checkpoints written by transformers: their logits, and the loss
after one AdamW step, equal ours.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxoffload import hf
from jaxoffload.model import Llama
from jaxoffload.train import load_config, resolve, run

pytestmark = pytest.mark.slow


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
