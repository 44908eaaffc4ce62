"""Every example runs at its own tiny shapes and does what its docstring says."""

import re
import runpy

import jax
import numpy as np
import pytest

from jaxoffload import hf
from tests.helpers import max_rel_diff


def example(name: str) -> dict:
  """The example's module globals, as ``python examples/NAME.py`` would load them (main not run)."""
  return runpy.run_path(f"examples/{name}.py", run_name="example")


def test_optax_chain_trains_with_half_the_moments_in_host_memory(capsys):
  losses = example("optax_chain")["main"](steps=40)
  assert losses[-1] < 0.3 * losses[0]
  out = capsys.readouterr().out
  share = float(re.search(r"\(([\d.]+)%\)", out).group(1))
  assert 40 < share < 60
  assert "moments in ['device', 'pinned_host']" in out


def test_activation_offload_keeps_the_gradients_of_the_plain_model():
  loss, grads, plain_loss, plain_grads, host_values = example("activation_offload")["main"]()
  assert host_values > 0
  np.testing.assert_allclose(float(loss), float(plain_loss), rtol=1e-6)
  assert max_rel_diff(grads, plain_grads) <= 1e-6


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (the CPU backend has them in CI)")
def test_sharded_offload_keeps_each_shard_of_the_moments_in_its_hosts_memory(capsys):
  example("sharded_offload")["main"]()
  out = capsys.readouterr().out
  losses = [float(x) for x in re.findall(r"step \d loss ([\d.]+)", out)]
  assert len(losses) == 5 and losses[-1] < losses[0]
  assert "mu['mlp']: pinned_host, spec P(None, 'tensor')" in out
  assert "mu['embed']: device, spec P('fsdp', 'tensor')" in out


@pytest.mark.slow
def test_finetune_hf_trains_evaluates_and_exports(tmp_path):
  result = example("finetune_hf")["main"](out=str(tmp_path), steps=12)
  losses = result.losses
  assert losses[-1] < losses[0]
  assert [r.step for r in result.records if r.eval_loss is not None] == [4, 8, 12]
  config, _ = hf.load_checkpoint(str(tmp_path / "hf"))
  assert config == hf.load_checkpoint("tests/fixtures/tiny_llama")[0]
  assert (tmp_path / "hf" / "tokenizer.json").exists()
