"""The trainer: the default run, its error exits, and equal losses whatever is offloaded."""

import subprocess
import sys

import numpy as np
import pytest

from jaxoffload.config import load_config
import jax

from jaxoffload.train import build, synthetic_batches, train

STEPS = 5


def run_cli(*args):
  return subprocess.run([sys.executable, "-m", "jaxoffload.train", *args],
                        capture_output=True, text=True, timeout=600, check=False)


def test_default_run_trains_and_the_loss_falls():
  result = run_cli("train.train_iters=30")
  assert result.returncode == 0, result.stderr
  first, last = result.stdout.strip().splitlines()[-1].split("loss ")[1].split(" -> ")
  assert float(last) < 0.8 * float(first)


@pytest.mark.parametrize("args, message", [
    (["model.cpu_offloading=True", "model.recompute_granularity=full"],
     "error: CPU offloading does not work when activation recomputation is enabled\n"),
    (["optimizer.optimizer_offload_fractoin=0.5"],
     "error: unknown config key 'optimizer.optimizer_offload_fractoin'; "
     "did you mean 'optimizer.optimizer_offload_fraction'?\n"),
    (["train.train_iters=ten"], "error: train.train_iters must be int, got 'ten' (str)\n"),
])
def test_config_errors_exit_2_with_one_line_and_no_traceback(args, message):
  result = run_cli(*args)
  assert result.returncode == 2
  assert result.stderr == message
  assert result.stdout == ""


@pytest.fixture(scope="module")
def baseline_losses():
  return train(load_config(None, [f"train.train_iters={STEPS}"]), log=lambda _: None)


@pytest.mark.parametrize("overrides", [
    ["optimizer.optimizer_cpu_offload=True", "optimizer.optimizer_offload_fraction=0.5",
     "optimizer.optimizer_offload_update_on=host"],
    ["optimizer.optimizer_cpu_offload=True", "optimizer.optimizer_offload_fraction=0.5",
     "optimizer.optimizer_offload_update_on=device"],
    ["model.cpu_offloading=True", "model.cpu_offloading_num_layers=2"],
    ["model.cpu_offloading=True", "model.cpu_offloading_num_layers=3",
     "model.cpu_offloading_weights=True", "optimizer.optimizer_cpu_offload=True",
     "optimizer.optimizer_offload_fraction=1.0"],
    ["train.micro_batch_size=4"],
], ids=["optimizer-host", "optimizer-device", "activations", "weights-and-optimizer",
        "accumulation"])
def test_losses_equal_the_baseline(overrides, baseline_losses):
  losses = train(load_config(None, [f"train.train_iters={STEPS}", *overrides]), log=lambda _: None)
  assert baseline_losses[-1] < baseline_losses[0]
  np.testing.assert_allclose(losses, baseline_losses, rtol=1e-5)


@pytest.mark.parametrize("overrides", [[], ["optimizer.optimizer_cpu_offload=True",
                                            "optimizer.optimizer_offload_fraction=0.5"]])
def test_train_step_compiles_once(overrides):
  config = load_config(None, overrides)
  params, state, step, batch_sharding = build(config)
  for i in range(3):
    params, state, _ = step(params, state, jax.device_put(synthetic_batches(config, i),
                                                          batch_sharding))
  assert step._cache_size() == 1


def test_nan_loss_stops_with_the_step():
  config = load_config(None, ["train.train_iters=5", "optimizer.lr=1e30", "optimizer.min_lr=1e29",
                              "optimizer.lr_warmup_iters=0"])
  with pytest.raises(FloatingPointError, match=r"loss is nan at step \d; stopping"):
    train(config, log=lambda _: None)


@pytest.mark.parametrize("offload", [[], ["optimizer.optimizer_cpu_offload=True",
                                          "optimizer.optimizer_offload_fraction=0.5"]],
                         ids=["plain", "optimizer-offload"])
def test_resume_continues_exactly(tmp_path, offload):
  quiet = lambda _: None
  whole = train(load_config(None, ["train.train_iters=10", *offload]), log=quiet)
  with_checkpoints = load_config(None, ["train.train_iters=10", f"checkpoint.dir={tmp_path}",
                                        "checkpoint.save_interval=100", *offload])
  first = train(with_checkpoints, log=quiet, stop_after_step=5)
  logged = []
  second = train(with_checkpoints, log=logged.append)
  assert logged[0] == f"resumed from step 5 in {tmp_path}"
  np.testing.assert_array_equal(first + second, whole)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["10", "5"]
