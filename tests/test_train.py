"""The trainer: the default run, its error exits, and equal losses whatever is offloaded."""

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxoffload.config import load_config, validate
from jaxoffload.model import Llama, abstract_params
from jaxoffload.placement import leaf_path
from jaxoffload.train import (COMMAND_BUFFER_FLAG, batch_at, build, checkpoint_manager,
                              global_batch, llama_config, restore, set_xla_flags,
                              offload_warnings, run, train)

STEPS = 5


def run_cli(*args):
  return subprocess.run([sys.executable, "-m", "jaxoffload.train", *args],
                        capture_output=True, text=True, timeout=600, check=False)


def test_default_run_trains_and_the_loss_falls():
  result = run_cli("train.train_iters=30")
  assert result.returncode == 0, result.stderr
  first, last = re.search(r"30 steps: loss ([\d.]+) -> ([\d.]+);", result.stdout).groups()
  assert float(last) < 0.8 * float(first)


@pytest.mark.parametrize("args, message", [
    (["model.cpu_offloading=True", "model.recompute_granularity=full"],
     "error: CPU offloading does not work when activation recomputation is enabled\n"),
    (["model.cpu_offloading=True", "model.pipeline_model_parallel_size=2"],
     "error: Currently there is no support for Pipeline parallelism with CPU offloading\n"),
    (["model.cpu_offloading=True", "model.cuda_graph_impl=transformer_engine"],
     "error: CUDA graphs not supported with CPU offloading.\n"),
    (["model.cpu_offloading=True", "model.fine_grained_activation_offloading=True"],
     "error: fine_grained_activation_offloading cannot be enabled with cpu_offloading.\n"),
    (["model.cpu_offloading=True", "model.cpu_offloading_num_layers=4"],
     "error: cpu_offloading_num_layers must be in [0, num_layers - 1] = [0, 3], got 4\n"),
    (["optimizer.optimizer_offload_fraction=-0.1"],
     "error: optimizer.optimizer_offload_fraction must be in [0.0, 1.0], got -0.1\n"),
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
    ["optimizer.optimizer_cpu_offload=True", "optimizer.optimizer_offload_fraction=0.5",
     "optimizer.optimizer_offload_update_on=device", "optimizer.overlap_cpu_optimizer_d2h_h2d=True"],
    ["model.cpu_offloading=True", "model.cpu_offloading_num_layers=2"],
    ["model.cpu_offloading=True", "model.cpu_offloading_num_layers=3",
     "model.cpu_offloading_weights=True", "optimizer.optimizer_cpu_offload=True",
     "optimizer.optimizer_offload_fraction=1.0"],
    ["train.micro_batch_size=4"],
    ["optimizer.optimizer_cpu_offload=True", "optimizer.optimizer_offload_fraction=0.5",
     "optimizer.optimizer_offload_update_on=host_kernel", "train.micro_batch_size=4"],
    ["model.cpu_offloading=True", "model.cpu_offloading_num_layers=3",
     "model.cpu_offloading_weights=True", "optimizer.optimizer_cpu_offload=True",
     "optimizer.optimizer_offload_fraction=1.0", "optimizer.optimizer_offload_update_on=host_kernel"],
], ids=["optimizer-host", "optimizer-device", "optimizer-device-overlap", "activations", "weights-and-optimizer",
        "accumulation", "host-kernel", "host-kernel-and-weights"])
def test_losses_equal_the_baseline(overrides, baseline_losses):
  losses = train(load_config(None, [f"train.train_iters={STEPS}", *overrides]), log=lambda _: None)
  assert baseline_losses[-1] < baseline_losses[0]
  np.testing.assert_allclose(losses, baseline_losses, rtol=1e-5)


@pytest.mark.parametrize("overrides", [[], ["optimizer.optimizer_cpu_offload=True",
                                            "optimizer.optimizer_offload_fraction=0.5"]])
def test_train_step_compiles_once(overrides):
  config = load_config(None, overrides)
  params, state, step, batch_sharding, _ = build(config)
  for i in range(3):
    params, state, _ = step(params, state, jax.device_put(batch_at(config, i),
                                                          batch_sharding))
  assert step._cache_size() == 1


@pytest.mark.parametrize("offload", [[], ["model.cpu_offloading=True",
                                         "model.cpu_offloading_num_layers=2",
                                         "optimizer.optimizer_cpu_offload=True",
                                         "optimizer.optimizer_offload_fraction=0.5"]],
                         ids=["no-offload", "offload"])
def test_fsdp_gathers_weights_never_activations(offload):
  config = load_config(None, ["mesh.fsdp=2", "train.global_batch_size=4",
                              "train.micro_batch_size=4", *offload])
  params, state, step, batch_sharding, _ = build(config)
  hlo = step.lower(params, state, global_batch(config, 0, batch_sharding)).compile().as_text()
  gathered = re.findall(r"= f32\[([\d,]+)\][^ ]* all-gather\(", hlo)
  activation = f"4,{config.model.seq_length},"
  assert gathered, "the sharded weights must be gathered"
  assert not [shape for shape in gathered if shape.startswith(activation)], gathered


def test_nan_loss_stops_with_the_step():
  config = load_config(None, ["train.train_iters=5", "optimizer.lr=1e30", "optimizer.min_lr=1e29",
                              "optimizer.lr_warmup_iters=0"])
  with pytest.raises(FloatingPointError, match=r"loss is nan at step \d; stopping"):
    train(config, log=lambda _: None)


HOST_KERNEL = ["optimizer.optimizer_cpu_offload=True", "optimizer.optimizer_offload_fraction=0.5",
               "optimizer.optimizer_offload_update_on=host_kernel"]


@pytest.mark.parametrize("offload", [
    [], ["optimizer.optimizer_cpu_offload=True", "optimizer.optimizer_offload_fraction=0.5"],
    HOST_KERNEL, HOST_KERNEL + ["optimizer.delayed_update=True"],
    HOST_KERNEL + ["optimizer.delayed_update=True", "optimizer.offload_transfer_dtype=bfloat16",
                   "model.dtype=bfloat16"],
    HOST_KERNEL + ["optimizer.delayed_update=True", "optimizer.delayed_update_predict_weights=True"],
], ids=["plain", "optimizer-offload", "host-kernel", "host-kernel-delayed",
        "host-kernel-delayed-bfloat16", "host-kernel-delayed-predicted"])
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


KILL_DURING_SAVE = """
import os, signal, sys
from jaxoffload.config import load_config, validate
from jaxoffload.model import Llama, abstract_params
from jaxoffload.placement import leaf_path
from jaxoffload.train import train

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


def test_a_run_killed_during_a_save_resumes_from_the_last_complete_checkpoint(tmp_path):
  overrides = ["train.train_iters=10", f"checkpoint.dir={tmp_path}", "checkpoint.save_interval=3",
               "optimizer.optimizer_cpu_offload=True", "optimizer.optimizer_offload_fraction=0.5"]
  killed = subprocess.run([sys.executable, "-c", KILL_DURING_SAVE, "-", "6", *overrides],
                          capture_output=True, text=True, timeout=600, check=False)
  assert killed.returncode == -9, killed.stderr[-2000:]
  leftovers = sorted(p.name for p in tmp_path.iterdir())
  assert "3" in leftovers and "6" not in leftovers
  assert any(name.startswith("6.") for name in leftovers), leftovers  # The unfinished save.
  logged = []
  resumed = train(load_config(None, overrides), log=logged.append)
  assert logged[0] == f"resumed from step 3 in {tmp_path}"
  whole = train(load_config(None, overrides[:1] + overrides[3:]), log=lambda _: None)
  np.testing.assert_array_equal(resumed, whole[3:])


def test_text_data_is_learned_and_every_step_goes_to_jsonl(tmp_path):
  log = tmp_path / "steps.jsonl"
  losses = train(load_config(None, ["data.dataset=text", "train.train_iters=40",
                                    f"logging.jsonl={log}"]), log=lambda _: None)
  records = [json.loads(line) for line in log.read_text().splitlines()]
  assert [r["step"] for r in records] == list(range(1, 41))
  assert [r["loss"] for r in records] == losses
  assert all(r["tokens_per_s"] > 0 and r["step_s"] > 0 for r in records)
  # Byte-level text starts near uniform guessing (ln 256 = 5.5) and must fall well below it.
  # The corpus is the package's own source, so the exact curve moves with every code change.
  assert losses[0] > 5.0 and np.mean(losses[-5:]) < losses[0] - 1.5


def test_help_shows_examples_and_points_at_the_config_reference():
  result = run_cli("--help")
  assert result.returncode == 0
  assert "docs/config.md" in result.stdout and "--config configs/llama_1b.yaml" in result.stdout


def test_cuda_graphs_turn_on_xla_command_buffers_for_the_run():
  result = run_cli("model.cuda_graph_impl=local", "train.train_iters=3")
  assert result.returncode == 0, result.stderr
  assert "warning" not in result.stdout and "3 steps: loss" in result.stdout
  config = load_config(None, ["model.cuda_graph_impl=transformer_engine"])
  with pytest.MonkeyPatch.context() as patch:
    patch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/dump")
    set_xla_flags(config)
    assert os.environ["XLA_FLAGS"] == f"--xla_dump_to=/tmp/dump {COMMAND_BUFFER_FLAG}"


def test_offloaded_state_is_restored_into_pinned_host(tmp_path):
  config = load_config(None, ["optimizer.optimizer_cpu_offload=True",
                              "optimizer.optimizer_offload_fraction=0.5",
                              "model.cpu_offloading=True", "model.cpu_offloading_num_layers=2",
                              "model.cpu_offloading_weights=True", f"checkpoint.dir={tmp_path}"])
  params, state, _, _, _ = build(config)
  kinds = lambda tree: [x.sharding.memory_kind for x in jax.tree.leaves(tree)]
  assert "pinned_host" in kinds(params) and "pinned_host" in kinds(state)
  checkpoints = checkpoint_manager(config)
  checkpoints.save(1, args=ocp.args.StandardSave({"params": params, "opt_state": state}))
  checkpoints.wait_until_finished()
  restored_params, restored_state = restore(checkpoints, 1, params, state)
  assert kinds(restored_params) == kinds(params) and kinds(restored_state) == kinds(state)
  for got, want in zip(jax.tree.leaves((restored_params, restored_state)),
                       jax.tree.leaves((params, state))):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_nan_stop_keeps_the_last_good_checkpoint(tmp_path):
  config = load_config(None, ["train.train_iters=8", "optimizer.lr=1e30", "optimizer.min_lr=1e29",
                              "optimizer.lr_warmup_iters=0", f"checkpoint.dir={tmp_path}",
                              "checkpoint.save_interval=1"])
  with pytest.raises(FloatingPointError) as stop:
    train(config, log=lambda _: None)
  step = int(re.search(r"at step (\d+)", str(stop.value)).group(1))
  saved = sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit())
  assert saved and max(saved) == step - 1
  assert f"the newest good checkpoint is step {step - 1}" in str(stop.value)


def test_delayed_host_updates_train_one_step_behind(baseline_losses):
  host_kernel = ["optimizer.optimizer_cpu_offload=True", "optimizer.optimizer_offload_fraction=1.0",
                 "optimizer.optimizer_offload_update_on=host_kernel", f"train.train_iters={STEPS}"]
  delayed = train(load_config(None, host_kernel + ["optimizer.delayed_update=True"]),
                  log=lambda _: None)
  # The warm-up's first learning rate is 0, so steps 1 and 2 see the initial
  # weights in both runs; from step 3 the delayed run is one update behind.
  assert delayed[:2] == baseline_losses[:2] and delayed[2] != baseline_losses[2]
  assert delayed[-1] < delayed[0] and abs(delayed[-1] - baseline_losses[-1]) < 0.05 * delayed[0]


def test_bfloat16_transfers_change_no_loss_and_keep_norm_scales_float32():
  # With one micro-batch the model rounds those weights to bfloat16 itself and
  # their gradients come out of bfloat16 matmuls: halving the copies changes no number.
  overrides = [f"train.train_iters={STEPS}", "model.dtype=bfloat16",
               *HOST_KERNEL[:1], "optimizer.optimizer_offload_fraction=1.0", *HOST_KERNEL[2:]]
  halved = load_config(None, overrides + ["optimizer.offload_transfer_dtype=bfloat16"])
  losses = train(halved, log=lambda _: None)
  assert losses == train(load_config(None, overrides), log=lambda _: None)
  params, state, step, batch_sharding, host = build(halved)
  *_, grads, _ = step(params, host.params, state, global_batch(halved, 0, batch_sharding))
  model = Llama(llama_config(halved), validate(halved))
  paths = jax.tree_util.tree_flatten_with_path(abstract_params(model, batch_at(halved, 0)))[0]
  norm_scales = [leaf_path(path).endswith("norm/scale") for path, _ in paths]
  assert any(norm_scales) and not all(norm_scales)
  for is_scale, param, grad, weights in zip(norm_scales, host.params, grads, host.weights):
    assert param.dtype == grad.dtype == (jnp.float32 if is_scale else jnp.bfloat16)
    assert weights.dtype == jnp.float32


def test_offloaded_state_counts_the_host_kernels_weights_and_moments_once():
  # Its second weight buffer (delayed updates) is pinned memory, not state the
  # device would otherwise hold: the predicted saving leaves it out.
  config = load_config(None, ["train.train_iters=2", *HOST_KERNEL[:1],
                              "optimizer.optimizer_offload_fraction=1.0", *HOST_KERNEL[2:],
                              "optimizer.delayed_update=True"])
  shapes = abstract_params(Llama(llama_config(config), validate(config)), batch_at(config, 0))
  weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))
  result = run(config, log=lambda _: None)
  assert result.offloaded_state_bytes == 3 * weight_bytes


def test_host_kernel_step_leaves_what_the_host_reads_in_host_memory():
  # The host then reads the gradients and the clipping factor in place, with no
  # transfer that could queue behind the next device step.
  config = load_config(None, ["optimizer.optimizer_cpu_offload=True",
                              "optimizer.optimizer_offload_fraction=1.0",
                              "optimizer.optimizer_offload_update_on=host_kernel"])
  params, state, step, batch_sharding, host = build(config)
  *_, grads, clip_scale = step(params, host.params, state, global_batch(config, 0, batch_sharding))
  assert {g.sharding.memory_kind for g in grads} == {"pinned_host"}
  assert clip_scale.sharding.memory_kind == "pinned_host"


SHARDED = "warning: optimizer offload streamed through the device on a mesh with fsdp="
DELAYED = ("warning: optimizer.delayed_update=True takes each gradient one update late after "
           "the first 0 updates")


@pytest.mark.parametrize("overrides, backend, warned", [
    (["mesh.fsdp=2"], "gpu", [SHARDED]),
    (["mesh.tensor=2"], "gpu", [SHARDED]),
    (["mesh.data=2"], "gpu", []),
    (["mesh.fsdp=2"], "cpu", []),
    (["mesh.fsdp=2", "optimizer.optimizer_offload_update_on=host"], "gpu", []),
    (["optimizer.overlap_cpu_optimizer_d2h_h2d=True"], "gpu", []),
    (["optimizer.overlap_cpu_optimizer_d2h_h2d=True", "mesh.fsdp=2"], "gpu", [SHARDED]),
    ([*HOST_KERNEL, "optimizer.delayed_update=True"], "cpu", [DELAYED]),
    ([*HOST_KERNEL, "optimizer.delayed_update=True"], "gpu", [DELAYED]),
    (HOST_KERNEL, "gpu", []),
])
def test_combinations_measured_slow_or_worse_are_warned_about(overrides, backend, warned):
  config = load_config(None, ["optimizer.optimizer_cpu_offload=True",
                              "optimizer.optimizer_offload_fraction=0.5", *overrides])
  warnings = offload_warnings(config, backend)
  assert len(warnings) == len(warned)
  for warning, start in zip(warnings, warned):
    assert warning.startswith(start)
  if SHARDED in warned:
    assert "mesh.data avoids it" in warnings[0]
