"""Starting from a Hugging Face checkpoint or another run, and exporting back, through the trainer."""

import json
import os
import stat
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxoffload import hf
from jaxoffload.nn.model import Llama, next_token_loss
from jaxoffload.train import ConfigError, Trainer, load_config, resolve, run, weights
from jaxoffload.train.__main__ import main
from jaxoffload.train.export import export, main as export_main
from tests.helpers import QUIET, listed, on_tmpfs

CHECKPOINT = "tests/fixtures/tiny_llama"
FINE_TUNE = [f"model.hf_checkpoint={CHECKPOINT}", "data.dataset=text", "model.seq_length=32",
             "train.global_batch_size=4", "train.micro_batch_size=4"]


@pytest.mark.parametrize("offload", [
    pytest.param([], marks=pytest.mark.slow, id="no-offload"),
    pytest.param(["optimizer.optimizer_cpu_offload=True", "optimizer.optimizer_offload_fraction=1.0",
                  "optimizer.optimizer_offload_update_on=host_kernel", "model.cpu_offloading=True",
                  "model.cpu_offloading_num_layers=1", "model.cpu_offloading_weights=True"],
                 marks=pytest.mark.slow, id="host-kernel-and-weights"),
])
def test_the_first_loss_is_the_checkpoints_own(offload):
  config = load_config(None, FINE_TUNE + ["train.train_iters=1", *offload])
  setup = resolve(config)
  assert setup.model.num_layers == 2 and setup.model.rope_scaling_factor == 8.0
  losses = run(config, log=QUIET).losses
  model_config, params = hf.load_checkpoint(CHECKPOINT, config=setup.model)
  tokens = jnp.asarray(setup.data.train(0))
  want = next_token_loss(Llama(model_config).apply({"params": params}, tokens), tokens)
  np.testing.assert_allclose(losses[0], float(want), rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("offload", [
    [], ["optimizer.optimizer_cpu_offload=True", "optimizer.optimizer_offload_fraction=0.5",
         "optimizer.optimizer_offload_update_on=host_kernel"]], ids=["no-offload", "host-kernel"])
def test_fine_tuning_checkpoints_and_exports_bit_exactly(tmp_path, offload):
  # One step at the warm-up's first learning rate, 0, leaves the weights as they came. The
  # host kernel's leaves are saved as files of their own, which the export reads too.
  run(load_config(None, FINE_TUNE + ["train.train_iters=1", f"checkpoint.dir={tmp_path}/run",
                                     *offload]), log=QUIET)
  files = export(str(tmp_path / "run"), str(tmp_path / "hf"))
  assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(files)
  original = load_file(os.path.join(CHECKPOINT, "model.safetensors"))
  exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
  assert sorted(exported) == sorted(original)
  for name, tensor in original.items():
    assert exported[name].dtype == tensor.dtype
    np.testing.assert_array_equal(exported[name], tensor)
  assert hf.load_checkpoint(str(tmp_path / "hf"))[0] == hf.load_checkpoint(CHECKPOINT)[0]
  # The source's config.json, every field kept but the writer's version.
  written = json.loads((tmp_path / "hf" / "config.json").read_text())
  with open(os.path.join(CHECKPOINT, "config.json")) as f:
    source = json.load(f)
  assert {**written, "transformers_version": None} == {**source, "transformers_version": None}
  # Shared like any file the user creates.
  umask = os.umask(0)
  os.umask(umask)
  assert {stat.S_IMODE(os.stat(tmp_path / "hf" / f).st_mode) for f in files} == {0o666 & ~umask}


@pytest.mark.slow
def test_another_runs_weights_start_a_run_whatever_its_grouping(tmp_path):
  first = FINE_TUNE + ["train.train_iters=3", f"checkpoint.dir={tmp_path}/first",
                       "model.cpu_offloading=True", "model.cpu_offloading_num_layers=1"]
  run(load_config(None, first), log=QUIET)
  _, trained = weights.run_params(str(tmp_path / "first"))
  assert sorted(k for k in trained if k.startswith("layers")) == ["layers_0_1", "layers_1_2"]
  second = load_config(None, FINE_TUNE[1:] + [f"checkpoint.init_from={tmp_path}/first",
                                              f"data.tokenizer={CHECKPOINT}",
                                              "optimizer.optimizer_cpu_offload=True",
                                              "optimizer.optimizer_offload_fraction=0.5",
                                              "optimizer.optimizer_offload_update_on=device"])
  setup = resolve(second)
  assert [g.stop - g.start for g in setup.groups] == [2]
  params = Trainer(setup, weights.initial(setup)).checkpoint()["params"]
  np.testing.assert_array_equal(np.asarray(params["layers_0_2"]["mlp"]["up"]["kernel"]),
                                np.concatenate([np.asarray(trained["layers_0_1"]["mlp"]["up"]["kernel"]),
                                                np.asarray(trained["layers_1_2"]["mlp"]["up"]["kernel"])]))
  for name in ("embed", "lm_head", "final_norm"):
    for got, want in zip(jax.tree.leaves(params[name]), jax.tree.leaves(trained[name])):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.slow
def test_a_run_of_another_model_is_refused(tmp_path, capsys):
  run(load_config(None, ["train.train_iters=1", f"checkpoint.dir={tmp_path}"]), log=QUIET)
  with pytest.raises(SystemExit) as exit_:
    main([f"checkpoint.init_from={tmp_path}", "model.num_layers=2", "train.train_iters=1"])
  assert exit_.value.code == 2
  assert capsys.readouterr().err == (
      f"error: model.num_layers=2 disagrees with the run in {tmp_path}, which makes it 4; "
      f"leave model.num_layers out\n")


def broken_copy(tmp_path, damage):
  directory = tmp_path / "broken"
  directory.mkdir()
  for name in os.listdir(CHECKPOINT):
    (directory / name).write_bytes(open(os.path.join(CHECKPOINT, name), "rb").read())
  damage(directory)
  return directory


def wrong_shape(directory):
  weights = load_file(str(directory / "model.safetensors"))
  weights["model.norm.weight"] = np.ones(16, np.float32)
  save_file(weights, str(directory / "model.safetensors"))


def missing_shard(directory):
  names = load_file(str(directory / "model.safetensors"))
  (directory / "model.safetensors").unlink()
  (directory / "model.safetensors.index.json").write_text(json.dumps(
      {"weight_map": {name: "model-00002-of-00002.safetensors" for name in names}}))


def unknown_architecture(directory):
  config = json.loads((directory / "config.json").read_text())
  (directory / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))


@pytest.mark.parametrize("damage, problem", [
    (lambda d: (d / "model.safetensors").write_bytes(b"\x00" * 32),
     "/model.safetensors: not a readable safetensors file"),
    (wrong_shape, "/model.safetensors: tensor model.norm.weight has shape [16]; config.json "
                  "makes it [32]"),
    (missing_shard, "/model.safetensors.index.json names the shard "
                    "model-00002-of-00002.safetensors, which is missing"),
    (unknown_architecture, "/config.json: model_type 'gpt2' is not supported"),
], ids=["corrupt-header", "wrong-shape", "missing-shard", "unknown-architecture"])
def test_a_bad_checkpoint_exits_2_with_one_line(tmp_path, capsys, damage, problem):
  directory = broken_copy(tmp_path, damage)
  with pytest.raises(SystemExit) as exit_:
    main([f"model.hf_checkpoint={directory}", "train.train_iters=1", "model.seq_length=32"])
  assert exit_.value.code == 2
  err = capsys.readouterr().err
  assert err.startswith(f"error: {directory}{problem}") and err.count("\n") == 1


def test_export_of_no_run_exits_2_with_one_line(tmp_path, capsys):
  with pytest.raises(SystemExit) as exit_:
    export_main([str(tmp_path / "no-run"), str(tmp_path / "out")])
  assert exit_.value.code == 2
  assert capsys.readouterr().err == f"error: checkpoint '{tmp_path}/no-run' is not a directory\n"


@pytest.fixture(scope="module")
def exported_run(tmp_path_factory):
  """A run of the fine-tuning config, one step, checkpointed: what the export tests read."""
  directory = tmp_path_factory.mktemp("exported") / "run"
  run(load_config(None, FINE_TUNE + ["train.train_iters=1", f"checkpoint.dir={directory}"]),
      log=QUIET)
  return directory


@pytest.mark.parametrize("existing", ["a file", "a directory with a file"])
def test_export_onto_an_existing_path_exits_2_with_one_line_and_changes_nothing(
    tmp_path, capsys, exported_run, existing):
  out = tmp_path / "out"
  if existing == "a file":
    out.write_text("keep me")
  else:
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
  with pytest.raises(SystemExit) as exit_:
    export_main([str(exported_run), str(out)])
  assert exit_.value.code == 2
  ending = "exists" if existing == "a file" else "exists and is not empty"
  assert capsys.readouterr().err == f"error: '{out}' {ending}: give the export a new directory\n"
  kept = out if existing == "a file" else out / "notes.txt"
  assert kept.read_text() == "keep me" and os.listdir(tmp_path) == ["out"]


@pytest.mark.parametrize("out", [pytest.param("out", marks=pytest.mark.slow), "new/parents/out"])
def test_export_into_an_empty_or_new_directory_fills_it(tmp_path, exported_run, out):
  if out == "out":
    (tmp_path / "out").mkdir()
  assert "model.safetensors" in export(str(exported_run), str(tmp_path / out))
  assert os.listdir(tmp_path / out / "..") == ["out"]  # Nothing left beside it.


@pytest.mark.slow
@pytest.mark.parametrize("options, reason", [("size=64k", "No space left on device"),
                                             ("ro", "Read-only file system")])
def test_export_onto_a_full_or_read_only_disk_exits_2_with_one_line_and_leaves_nothing(
    tmp_path, exported_run, options, reason):
  (tmp_path / "disk").mkdir()
  done = subprocess.run(
      on_tmpfs(tmp_path / "disk", options, [sys.executable, "-m", "jaxoffload.train.export",
                                            str(exported_run), str(tmp_path / "disk/hf")]),
      capture_output=True, text=True, timeout=300, check=False)
  assert done.returncode == 2, done.stderr[-2000:]
  assert done.stderr == f"error: '{tmp_path}/disk/hf' cannot be written: {reason}\n"
  assert listed(done.stdout) == []


@pytest.mark.parametrize("path, overrides, key, value", [
    (None, ["model.num_layers=5"], "num_layers", 5),
    # Given, though equal to the default: still not the checkpoint's.
    (None, ["model.hidden_size=64"], "hidden_size", 64),
    # A config file's shape beside a checkpoint of another.
    ("configs/tiny.yaml", [], "hidden_size", 64)])
def test_shape_keys_beside_a_checkpoint_must_agree(path, overrides, key, value):
  with pytest.raises(ConfigError, match=rf"^model.{key}={value} disagrees with "
                                        r"tests/fixtures/tiny_llama/config.json, which makes it "
                                        rf"\d+; leave model.{key} out$"):
    load_config(path, [f"model.hf_checkpoint={CHECKPOINT}", *overrides])
  agreeing = load_config(None, [f"model.hf_checkpoint={CHECKPOINT}", "model.hidden_size=32"])
  assert agreeing.model.hidden_size == 32
