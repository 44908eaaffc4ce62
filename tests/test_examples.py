"""Every example runs at its own tiny shapes and does what its docstring says."""

import os
import re
import runpy
import subprocess
import tempfile

import jax
import numpy as np
import pytest

from jaxoffload import hf
from tests.helpers import max_rel_diff


def untracked_files() -> set[str]:
  """The files ``git status --porcelain`` lists as untracked, one by one, ignored ones left out."""
  status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"],
                          capture_output=True, text=True, check=True).stdout
  return {line[3:] for line in status.splitlines() if line.startswith("?? ")}


@pytest.fixture(autouse=True)
def leaves_no_file_in_the_repository():
  # Users run the examples from a clone: whatever one writes must go elsewhere. Files
  # already there are left out, and edits to tracked ones, which are not an example's.
  before = untracked_files()
  yield
  assert untracked_files() - before == set()


def test_every_example_is_run_here():
  with open(__file__) as f:
    tested = set(re.findall(r'example\("(\w+)"\)', f.read()))
  assert tested == {name[:-3] for name in os.listdir("examples") if name.endswith(".py")}


def test_the_readme_python_blocks_run_as_written(capsys):
  with open("README.md") as f:
    blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
  assert blocks
  for block in blocks:
    exec(compile(block, "README.md", "exec"), {})
  out = capsys.readouterr().out
  # Half of the moments offloaded, and the loss down from about 1.4 (y is ones).
  assert "offloaded for 65,536 of 131,072 parameter elements (50.00%)" in out
  assert float(re.search(r"loss (\d+\.\d+)", out).group(1)) < 0.5


def test_the_library_guides_python_blocks_run_as_written(capsys):
  with open("docs/library.md") as f:
    blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
  assert len(blocks) == 2
  for block in blocks:
    exec(compile(block, "docs/library.md", "exec"), {})
  out = capsys.readouterr().out
  # The kernels of both layers offloaded, their biases not; the loss down from about 1.
  assert "offloaded for 1,088 of 1,153 parameter elements" in out
  assert float(re.search(r"nnx loss (\d+\.\d+)", out).group(1)) < 0.5
  assert "restored into ['device', 'pinned_host']" in out


def example(name: str) -> dict:
  """The example's module globals, as ``python examples/NAME.py`` would load them (main not run)."""
  return runpy.run_path(f"examples/{name}.py", run_name="example")


def test_nnx_optimizer_trains_with_the_moments_in_host_memory(capsys):
  losses = example("nnx_optimizer")["main"](steps=40)
  assert losses[-1] < 0.5 * losses[0]
  assert "moments in ['device', 'pinned_host']" in capsys.readouterr().out


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
def test_finetune_hf_trains_evaluates_and_exports(tmp_path, monkeypatch, capsys):
  # Its default output directory, as a user running it from the repository gets it.
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
  result = example("finetune_hf")["main"](steps=12)
  losses = result.losses
  assert losses[-1] < losses[0]
  assert [r.step for r in result.records if r.eval_loss is not None] == [4, 8, 12]
  [out] = tmp_path.glob("finetuned-*")
  assert capsys.readouterr().out.splitlines()[-1].endswith(f" to {out}/hf")
  config, _ = hf.load_checkpoint(str(out / "hf"))
  assert config == hf.load_checkpoint("tests/fixtures/tiny_llama")[0]
  assert (out / "hf" / "tokenizer.json").exists()
