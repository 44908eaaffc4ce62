"""Checkpoints: a resumed run continues exactly, into the same memory kinds, even after a kill."""

import json
import re
import shutil
import subprocess
import sys
import types

import jax
import numpy as np
import pytest

from jaxoffload.memory import size
from jaxoffload.nn.params import regroup
from jaxoffload.nn.remat import layer_groups
from jaxoffload.optim.offload_plan import leaf_path
from jaxoffload.train import Trainer, load_config, resolve, train
from jaxoffload.train.checkpoints import checkpoint_dir, claims, host_checkpoint, saves as ckpt
from jaxoffload.train.config import ConfigError
from tests.helpers import HOST_KERNEL, QUIET, checkpoint_entries, listed, on_tmpfs

OFFLOAD = HOST_KERNEL[:2]


@pytest.mark.parametrize("offload", [
    [],
    # Resumed, the first step starts its update before its clipping where the uninterrupted
    # run's did (optimizer.speculate_cpu_optimizer_step): the tiny model's first clipped
    # step is the first after the save.
    pytest.param(HOST_KERNEL, marks=pytest.mark.slow),
    pytest.param(HOST_KERNEL + ["optimizer.offload_transfer_dtype=bfloat16",
                                "model.dtype=bfloat16"], marks=pytest.mark.slow),
    pytest.param(HOST_KERNEL + ["optimizer.exp_avg_dtype=bfloat16",
                                "optimizer.exp_avg_sq_dtype=bfloat16"], marks=pytest.mark.slow),
    # Overlapped over micro-batches: bfloat16 sums rounded as salted by the restored count.
    pytest.param(HOST_KERNEL + ["train.micro_batch_size=4",
                                "optimizer.accumulate_offloaded_grads_on=device",
                                "optimizer.grad_accum_dtype=bfloat16"], marks=pytest.mark.slow),
    # 8-bit moments in pinned_host, saved as float32 values and encoded again on resume.
    pytest.param(OFFLOAD + ["optimizer.optimizer_offload_update_on=host",
                            "optimizer.exp_avg_dtype=int8", "optimizer.exp_avg_sq_dtype=int8"],
                 marks=pytest.mark.slow),
    # Tokenized text with a held-out split and evaluations: the batches are a
    # function of the step, and the evaluations' losses land in the records.
    pytest.param(["data.dataset=text", "data.tokenizer=tests/fixtures/tiny_llama",
                  "eval.interval=3", "eval.iters=2"], marks=pytest.mark.slow),
], ids=["plain", "host-kernel", "host-kernel-bfloat16", "host-kernel-bfloat16-moments",
         "host-kernel-overlapped-bfloat16-sums", "offloaded-8-bit-moments", "text-with-evaluation"])
def test_resume_continues_exactly(tmp_path, offload):
  whole = train(load_config(None, ["train.train_iters=10", *offload]), log=QUIET)
  with_checkpoints = load_config(None, ["train.train_iters=10", f"checkpoint.dir={tmp_path}",
                                        "checkpoint.save_interval=100", *offload])
  first = train(with_checkpoints, log=QUIET, stop_after_step=5)
  logged = []
  second = train(with_checkpoints, log=logged.append)
  assert logged[0] == f"resumed from step 5 in {tmp_path}"
  np.testing.assert_array_equal(first + second, whole)
  assert checkpoint_entries(tmp_path) == ["10", "5"]


KILL_DURING_SAVE = """
import os, signal, sys
from jaxoffload.train import load_config, train

real_rename = os.rename

def rename(src, dst, *args, **kwargs):
  # Orbax writes a checkpoint into a temporary directory and renames it when
  # complete: dying just before that rename is dying in the middle of a save.
  if os.path.basename(os.fspath(dst)) == sys.argv[2]:
    os.kill(os.getpid(), signal.SIGKILL)
  return real_rename(src, dst, *args, **kwargs)

os.rename = rename
train(load_config(None, sys.argv[3:]), log=lambda _: None)
"""


@pytest.mark.slow
def test_a_run_killed_during_a_save_resumes_from_the_last_complete_checkpoint(tmp_path):
  overrides = ["train.train_iters=10", f"checkpoint.dir={tmp_path}", "checkpoint.save_interval=3",
               "optimizer.optimizer_cpu_offload=True", "optimizer.optimizer_offload_fraction=0.5",
               "optimizer.optimizer_offload_update_on=device"]
  killed = subprocess.run([sys.executable, "-c", KILL_DURING_SAVE, "-", "6", *overrides],
                          capture_output=True, text=True, timeout=600, check=False)
  assert killed.returncode == -9, killed.stderr[-2000:]
  leftovers = sorted(p.name for p in tmp_path.iterdir())
  assert "3" in leftovers and "6" not in leftovers
  assert any(name.startswith("6.") for name in leftovers), leftovers  # The unfinished save.
  logged = []
  resumed = train(load_config(None, overrides), log=logged.append)
  # The killed run's claim is taken over, and what its unfinished save wrote removed.
  assert re.fullmatch(r"note: checkpoint.dir was claimed by process \d+ on host .+, since .+, "
                      r"which ended without letting go; this run takes it over", logged[0])
  assert logged[1] == f"resumed from step 3 in {tmp_path}"
  assert checkpoint_entries(tmp_path) == ["10", "6", "9"]  # The newest three kept.
  whole = train(load_config(None, overrides[:1] + overrides[3:]), log=QUIET)
  np.testing.assert_array_equal(resumed, whole[3:])


@pytest.mark.slow
def test_offloaded_state_is_restored_into_pinned_host(tmp_path):
  config = load_config(None, ["optimizer.optimizer_cpu_offload=True",
                              "optimizer.optimizer_offload_fraction=0.5",
                              "optimizer.optimizer_offload_update_on=device",
                              "model.cpu_offloading=True", "model.cpu_offloading_num_layers=2",
                              "model.cpu_offloading_weights=True", f"checkpoint.dir={tmp_path}"])
  setup = resolve(config)
  saved = Trainer(setup)
  kinds = lambda tree: [x.sharding.memory_kind for x in jax.tree.leaves(tree)]
  assert "pinned_host" in kinds(saved.params) and "pinned_host" in kinds(saved.opt_state)
  assert setup.state_in_host_memory
  checkpoints = ckpt.manager(config)
  saved.step(saved.setup.global_batch(0))  # Restored values must differ from fresh ones.
  ckpt.save(checkpoints, 1, saved)
  checkpoints.wait_until_finished()
  restored = Trainer(setup, *ckpt.read(checkpoints, 1, setup))
  state = lambda t: (t.params, t.opt_state)
  assert kinds(state(restored)) == kinds(state(saved))
  for got, want in zip(jax.tree.leaves(state(restored)), jax.tree.leaves(state(saved))):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("overrides", [
    [], ["model.cpu_offloading=True", "model.cpu_offloading_num_layers=1"],
    ["optimizer.optimizer_cpu_offload=True", "optimizer.optimizer_offload_fraction=0.5"],
    ["model.cpu_offloading=True", "model.cpu_offloading_num_layers=1",
     "model.cpu_offloading_activations=False", "model.cpu_offloading_weights=True"],
    ["optimizer.optimizer_cpu_offload=True", "optimizer.optimizer_offload_fraction=1.0",
     "optimizer.optimizer_offload_update_on=host_kernel"]],
    ids=["none", "activations", "optimizer", "weights", "host-kernel"])
def test_state_in_host_memory_says_whether_the_trainer_keeps_state_there(overrides):
  # Saves of such state must finish before the next step updates or donates it.
  setup = resolve(load_config(None, overrides))
  trainer = Trainer(setup)
  kinds = {x.sharding.memory_kind for x in jax.tree.leaves((trainer.params, trainer.opt_state))}
  assert setup.state_in_host_memory == ("pinned_host" in kinds or trainer.host is not None)


def test_nan_stop_keeps_the_last_good_checkpoint(tmp_path):
  config = load_config(None, ["train.train_iters=8", "optimizer.lr=1e30", "optimizer.min_lr=1e29",
                              "optimizer.lr_warmup_iters=0", f"checkpoint.dir={tmp_path}",
                              "checkpoint.save_interval=1"])
  with pytest.raises(FloatingPointError) as stop:
    train(config, log=QUIET)
  step = int(re.search(r"at step (\d+)", str(stop.value)).group(1))
  saved = sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit())
  assert saved and max(saved) == step - 1
  assert f"the newest good checkpoint is step {step - 1}" in str(stop.value)


def damage(step_dir):
  (step_dir / "params" / "manifest.ocdbt").write_bytes(b"\x9c not a manifest " * 8)


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_is_kept_aside_and_the_run_resumes_before_it(tmp_path):
  overrides = ["train.train_iters=6", f"checkpoint.dir={tmp_path}", "checkpoint.save_interval=2"]
  whole = train(load_config(None, overrides), log=QUIET)
  damage(tmp_path / "6")
  logged = []
  resumed = train(load_config(None, overrides + ["checkpoint.resume=True"]), log=logged.append)
  assert re.fullmatch(rf"warning: checkpoint step 6 cannot be read \(ValueError: .+\); kept as "
                      rf"{re.escape(str(tmp_path / '6.unreadable'))}", logged[0])
  assert logged[1] == f"resumed from step 4 in {tmp_path}"
  np.testing.assert_array_equal(resumed, whole[4:])
  assert checkpoint_entries(tmp_path) == ["2", "4", "6", "6.unreadable"]


@pytest.mark.slow
def test_when_no_checkpoint_can_be_read_the_run_refuses_and_renames_nothing(tmp_path):
  overrides = ["train.train_iters=2", f"checkpoint.dir={tmp_path}", "checkpoint.save_interval=1"]
  train(load_config(None, overrides), log=QUIET)
  for step in ("1", "2"):
    damage(tmp_path / step)
  with pytest.raises(ConfigError, match=rf"^no checkpoint in {re.escape(str(tmp_path))} can be "
                                        rf"read; the oldest, step 1: ValueError: "):
    train(load_config(None, overrides + ["checkpoint.resume=True"]), log=QUIET)
  assert checkpoint_entries(tmp_path) == ["1", "2"]


def test_a_checkpoint_dir_that_is_a_file_is_refused(tmp_path):
  (tmp_path / "file").write_text("")
  with pytest.raises(ConfigError, match=r"^checkpoint.dir '.+/file' is a file, not a directory$"):
    train(load_config(None, [f"checkpoint.dir={tmp_path / 'file'}"]), log=QUIET)


@pytest.mark.slow
def test_a_run_resumes_across_offload_fractions_and_update_placements_exactly(tmp_path):
  base = ["train.train_iters=3", f"checkpoint.dir={tmp_path}", "checkpoint.save_interval=1",
          "checkpoint.resume=True", "optimizer.optimizer_cpu_offload=True"]
  segments = [["optimizer.optimizer_offload_fraction=0.5"],
              ["optimizer.optimizer_offload_fraction=1.0",
               "optimizer.optimizer_offload_update_on=host"],
              ["optimizer.optimizer_offload_fraction=0.0"]]
  losses = []
  for stop, segment in zip((1, 2, 3), segments):
    losses += train(load_config(None, base + segment), log=QUIET, stop_after_step=stop)
  whole = train(load_config(None, base[:1] + base[4:] + segments[0]), log=QUIET)
  np.testing.assert_array_equal(losses, whole)


@pytest.mark.slow
def test_what_cannot_resume_is_named_and_nothing_is_renamed(tmp_path):
  base = ["train.train_iters=2", f"checkpoint.dir={tmp_path}", "checkpoint.resume=True"]
  train(load_config(None, base), log=QUIET, stop_after_step=1)
  with pytest.raises(ConfigError, match=rf"^checkpoint step 1 in {re.escape(str(tmp_path))} "
                                        r"holds another model \(model.hidden_size: 64 -> 128\): "
                                        r"give this run a new checkpoint.dir$"):
    train(load_config(None, base + ["model.hidden_size=128"]), log=QUIET)
  assert checkpoint_entries(tmp_path) == ["1"]


@pytest.mark.slow
def test_a_checkpoint_past_train_iters_is_refused_before_compiling(tmp_path):
  base = [f"checkpoint.dir={tmp_path}", "train.train_iters=4"]
  train(load_config(None, base), log=QUIET, stop_after_step=3)
  logged = []
  with pytest.raises(ConfigError, match=rf"^checkpoint step 3 in {re.escape(str(tmp_path))} is "
                                        r"past train.train_iters=2: raise train.train_iters, or "
                                        r"give this run a new checkpoint.dir$"):
    train(load_config(None, base + ["train.train_iters=2"]), log=logged.append)
  assert not any(line.startswith("compiled") for line in logged)


@pytest.mark.slow
def test_a_resume_that_changes_the_learning_rate_says_so(tmp_path):
  base = [f"checkpoint.dir={tmp_path}", "optimizer.lr_warmup_iters=2"]
  train(load_config(None, base + ["train.train_iters=4"]), log=QUIET, stop_after_step=3)
  logged = []
  train(load_config(None, base + ["train.train_iters=8"]), log=logged.append, stop_after_step=4)
  setups = [resolve(load_config(None, base + [f"train.train_iters={n}"])) for n in (4, 8)]
  saved, now = (float(s.schedule(3)) for s in setups)
  assert saved != now
  assert (f"note: the learning-rate schedule changed at resume (train.train_iters 4 -> 8): step "
          f"4 runs at {now:.3g}, where the saved run's schedule gives {saved:.3g}") in logged
  # The same keys: nothing to say.
  logged.clear()
  train(load_config(None, base + ["train.train_iters=8"]), log=logged.append, stop_after_step=5)
  assert not any("schedule changed" in line for line in logged)


@pytest.mark.slow
def test_a_checkpoint_of_the_removed_delayed_update_resumes_only_without_held_gradients(
    tmp_path):
  # As jaxoffload wrote them with optimizer.delayed_update: the key in the saved config,
  # and in meta the keys of the held gradients' item (empty when none was held).
  base = ["train.train_iters=2", f"checkpoint.dir={tmp_path}", "checkpoint.resume=True"]
  whole = train(load_config(None, base[:1]), log=QUIET)
  train(load_config(None, base), log=QUIET, stop_after_step=1)
  meta_path = tmp_path / "1" / "meta" / "metadata"
  meta = json.loads(meta_path.read_text())

  def written_with(delayed, held):
    meta["config"]["optimizer"].update(delayed_update=delayed, delayed_update_after=0)
    meta_path.write_text(json.dumps({**meta, "host_kernel": held}))

  written_with(True, ["held_grads", "held_scale"])
  with pytest.raises(ConfigError, match=rf"^checkpoint step 1 in {re.escape(str(tmp_path))} "
                                        r"cannot be resumed \(it holds the held gradients of a "
                                        r"delayed host update .+ checkpoint.init_from="):
    train(load_config(None, base), log=QUIET)
  written_with(False, [])
  logged = []
  resumed = train(load_config(None, base), log=logged.append)
  assert logged[0] == f"resumed from step 1 in {tmp_path}"
  np.testing.assert_array_equal(resumed, whole[1:])


def one_stack(tree, num_layers):
  """A checkpoint tree with its layer stacks joined, in numpy: comparable across groupings."""
  return regroup(jax.tree.map(np.asarray, tree), layer_groups(num_layers))


ACTIVATIONS = ["model.cpu_offloading=True", "model.cpu_offloading_num_layers=1"]


@pytest.mark.parametrize("before, after", [
    pytest.param(OFFLOAD, HOST_KERNEL[:1] + ["optimizer.optimizer_offload_fraction=1.0",
                                             "optimizer.optimizer_offload_update_on=host_kernel"],
                 id="device-to-host-kernel", marks=pytest.mark.slow),
    pytest.param(HOST_KERNEL, ["optimizer.optimizer_cpu_offload=False"] + ACTIVATIONS
                 + ["model.cpu_offloading_weights=True"], id="host-kernel-to-weights-offload",
                 marks=pytest.mark.slow),
    pytest.param(ACTIVATIONS + ["optimizer.exp_avg_dtype=bfloat16"], OFFLOAD,
                 id="bfloat16-moments-and-layer-groups", marks=pytest.mark.slow),
    # Split masters and 8-bit moments, saved as float32, into float32 state on the device.
    pytest.param(HOST_KERNEL[:1] + ["optimizer.optimizer_offload_fraction=1.0",
                                    "optimizer.optimizer_offload_update_on=host_kernel",
                                    "model.dtype=bfloat16", "optimizer.offload_transfer_dtype=bfloat16",
                                    "optimizer.exp_avg_dtype=int8", "optimizer.exp_avg_sq_dtype=int8"],
                 ["model.dtype=bfloat16"] + OFFLOAD, id="compact-host-kernel-to-device",
                 marks=pytest.mark.slow),
    # 8-bit moments on the device into the host kernel's 8-bit moments.
    pytest.param(["optimizer.exp_avg_dtype=int8", "optimizer.exp_avg_sq_dtype=int8"],
                 HOST_KERNEL + ["optimizer.exp_avg_dtype=int8", "optimizer.exp_avg_sq_dtype=int8"],
                 id="8-bit-moments-device-to-host-kernel", marks=pytest.mark.slow),
])
def test_a_checkpoint_resumes_under_another_setting_with_its_state_intact(tmp_path, before,
                                                                          after):
  directory = [f"checkpoint.dir={tmp_path}"]
  run_before = load_config(None, directory + before)
  trainer = Trainer(resolve(run_before))
  trainer.step(trainer.setup.global_batch(0))
  checkpoints = ckpt.manager(run_before)
  ckpt.save(checkpoints, 1, trainer)
  checkpoints.wait_until_finished()
  setup = resolve(load_config(None, directory + after))
  resumed = Trainer(setup, *ckpt.read(checkpoints, 1, setup))
  # Each leaf where the new setting keeps it, with the values saved (bfloat16 widens exactly).
  saved, restored = trainer.checkpoint(), resumed.checkpoint()
  for name in ("params", "mu", "nu"):
    layers = setup.model.num_layers
    for got, want in zip(jax.tree.leaves(one_stack(restored[name], layers)),
                         jax.tree.leaves(one_stack(saved[name], layers))):
      np.testing.assert_array_equal(got, want.astype(got.dtype))
  want_kinds = jax.tree.leaves(Trainer.from_shapes(setup).opt_state)
  assert ([x.sharding.memory_kind for x in jax.tree.leaves(resumed.opt_state)]
          == [x.sharding.memory_kind for x in want_kinds])
  assert float(resumed.step(setup.global_batch(1))[0]) == pytest.approx(
      float(trainer.step(trainer.setup.global_batch(1))[0]), rel=1e-5)


@pytest.mark.parametrize("offload", [pytest.param(OFFLOAD, marks=pytest.mark.slow),
                                     pytest.param(HOST_KERNEL, marks=pytest.mark.slow)],
                         ids=["device", "host-kernel"])
def test_saving_host_resident_state_every_step_changes_no_loss(tmp_path, offload):
  # Orbax reads host-resident buffers in place (on a GPU a step may then not donate them
  # while a save is in flight), and saves the host kernel's live buffers: no copies.
  base = ["train.train_iters=3", *offload]
  whole = train(load_config(None, base), log=QUIET)
  saved = train(load_config(None, base + [f"checkpoint.dir={tmp_path}",
                                          "checkpoint.save_interval=1"]), log=QUIET)
  np.testing.assert_array_equal(saved, whole)
  assert checkpoint_entries(tmp_path) == ["1", "2", "3"]
  # Step 2's checkpoint holds step 2's state, though step 3 ran right after the save.
  shutil.rmtree(tmp_path / "3")
  resumed = train(load_config(None, base + [f"checkpoint.dir={tmp_path}"]), log=QUIET)
  np.testing.assert_array_equal(resumed, whole[2:])


@pytest.mark.slow
def test_the_host_kernels_leaves_are_written_from_the_live_state_in_float32(tmp_path,
                                                                           monkeypatch):
  # Split masters and 8-bit moments: joined and decoded a piece at a time, so that a
  # save copies none of the state whole.
  setup = resolve(load_config(None, [f"checkpoint.dir={tmp_path}", "model.dtype=bfloat16",
                                     "optimizer.offload_transfer_dtype=bfloat16",
                                     "optimizer.exp_avg_dtype=int8",
                                     "optimizer.exp_avg_sq_dtype=int8", *HOST_KERNEL]))
  trainer = Trainer(setup)
  trainer.step(setup.global_batch(0))
  checkpoints = ckpt.manager(setup.config)
  monkeypatch.setattr(host_checkpoint, "CHUNK_BYTES", 4096)  # Several pieces a leaf.
  ckpt.save(checkpoints, 1, trainer)
  saved = trainer.checkpoint()
  paths = [leaf_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(saved["params"])[0]]
  on_host = trainer.programs.host_leaves(paths)
  assert on_host
  for name in ("params", "mu", "nu"):
    for path, want in zip(paths, jax.tree.leaves(saved[name])):
      file = host_checkpoint.saved_file(str(tmp_path / "1"), name, tuple(path.split("/")))
      assert (file is not None) == (path in on_host)
      if file is not None:
        np.testing.assert_array_equal(np.load(file), np.asarray(want))


def test_a_disk_too_small_for_one_checkpoint_is_refused_before_training(tmp_path, monkeypatch):
  setup = resolve(load_config(None, [f"checkpoint.dir={tmp_path}"]))
  # The default model's float32 parameters and moments: 12 bytes an element.
  elements = sum(x.size for x in jax.tree.leaves(setup.param_shapes))
  assert checkpoint_dir.size_on_disk(setup) == 12 * elements
  monkeypatch.setattr(checkpoint_dir.shutil, "disk_usage", lambda path: types.SimpleNamespace(
      total=10**9, used=10**9 - 10**6, free=10**6))
  with pytest.raises(ConfigError, match=(
      rf"^checkpoint.dir '{tmp_path}' has 1 MB free, less than one checkpoint of this run "
      rf"needs \({size(12 * elements)}\); free space there or choose another checkpoint.dir$")):
    train(load_config(None, [f"checkpoint.dir={tmp_path}"]), log=QUIET)
  assert checkpoint_entries(tmp_path) == []


@pytest.mark.slow
def test_a_disk_that_fills_during_a_save_ends_the_run_in_one_line_keeping_what_is_complete(
    tmp_path):
  # The tiny model's checkpoint takes about 2.5 MB: the disk holds one, not two.
  assert 2e6 < checkpoint_dir.size_on_disk(resolve(load_config(None, []))) < 3e6
  (tmp_path / "ckpt").mkdir()
  command = [sys.executable, "-m", "jaxoffload.train", "train.train_iters=6",
             "checkpoint.save_interval=2", "checkpoint.keep=5",
             f"checkpoint.dir={tmp_path / 'ckpt'}", "logging.progress_bar=False"]
  full = subprocess.run(on_tmpfs(tmp_path / "ckpt", "size=4m", command), capture_output=True,
                        text=True, timeout=600, check=False)
  assert full.returncode == 2, full.stderr[-3000:]
  # Step 4's save is not started: the disk has not the room step 2's took.
  assert re.fullmatch(
      rf"error: checkpoint.dir '{re.escape(str(tmp_path / 'ckpt'))}' has \d+ MB free, less than "
      r"the checkpoint of step 4 needs \(\d+ MB\); the run stopped; its complete checkpoints: "
      r"steps \[2\]: free space there, and the same command resumes\n", full.stderr)
  # The complete step kept, the failed one's partial files gone, the claim let go.
  assert listed(full.stdout) == [claims.FILE, "2"]


def test_a_save_that_fails_stops_in_one_line_keeping_the_complete_checkpoints(tmp_path,
                                                                              monkeypatch):
  # As tensorstore reports a full disk, on the second save.
  save = ckpt.ocp.CheckpointManager.save
  def failing_save(self, step, *args, **kwargs):
    if step == 4:
      raise ValueError("RESOURCE_EXHAUSTED: Error writing \"params/0.0\" in OCDBT database: "
                       "Failed to write 4096 bytes to file 7: No space left on device "
                       "[os_error_code='28']")
    return save(self, step, *args, **kwargs)
  monkeypatch.setattr(ckpt.ocp.CheckpointManager, "save", failing_save)
  config = load_config(None, ["train.train_iters=6", f"checkpoint.dir={tmp_path}",
                              "checkpoint.save_interval=2"])
  with pytest.raises(ConfigError, match=(
      rf"^a checkpoint could not be written to '{tmp_path}' \(No space left on device\); the "
      r"run stopped; its complete checkpoints: steps \[2\]$")):
    train(config, log=QUIET)
  monkeypatch.setattr(ckpt.ocp.CheckpointManager, "save", save)
  resumed = train(config, log=QUIET)
  assert len(resumed) == 4  # Steps 3 to 6, from step 2's checkpoint.
