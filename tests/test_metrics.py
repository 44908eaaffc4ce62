"""Run reports: FLOPs per token against a count of the model's weights, MFU, and the JSONL record."""

import errno
import io
import json
import math
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxoffload.nn.model import Llama, LlamaConfig, next_token_loss
from jaxoffload.nn.params import init_params
from jaxoffload.train import (__main__ as train_main, advice, levers, load_config, metrics,
                              resolve, run)
from jaxoffload.train.step import Trainer


@pytest.mark.parametrize("config", [
    LlamaConfig(), LlamaConfig(share_embeddings_and_output_weights=True, num_query_groups=4)])
def test_flops_per_token_counts_every_matmul_weight(config):
  tokens = jnp.zeros((1, 16), jnp.int32)
  params = init_params(Llama(config), jax.random.PRNGKey(0), tokens)
  kernels = sum(x.size for path, x in jax.tree_util.tree_leaves_with_path(params)
                if "kernel" in jax.tree_util.keystr(path))
  head = config.vocab_size * config.hidden_size if config.share_embeddings_and_output_weights else 0
  causal_attention = 6 * config.num_layers * 16 * config.num_attention_heads * config.head_dim
  assert metrics.flops_per_token(config, 16) == 6 * (kernels + head) + causal_attention


def test_records_carry_mfu_and_memory_and_go_to_jsonl():
  out, lines = io.StringIO(), []
  meter = metrics.Monitor(total_steps=4, tokens_per_step=1000, flops_per_token=2e9,
                          peak_flops=1e13, pinned_host_bytes=3 * 2**30, log=lines.append,
                          log_interval=2, jsonl=out, peak_device_bytes=lambda: 5 * 2**30)
  for step, seconds in enumerate([0.5, 0.4, 0.4, 0.4], start=1):
    meter.record(step=step, loss=4.0 / step, step_s=seconds, learning_rate=1e-3 * step,
                 grad_norm=2.0, eval_loss=2.0 if step == 4 else None)
  records = [json.loads(line) for line in out.getvalue().splitlines()]
  assert [r["step"] for r in records] == [1, 2, 3, 4]
  assert records[1]["tokens_per_s"] == pytest.approx(2500)
  assert records[1]["mfu"] == pytest.approx(2500 * 2e9 / 1e13)
  assert records[1]["peak_device_bytes"] == 5 * 2**30
  assert records[1]["pinned_host_bytes"] == 3 * 2**30
  assert records[2]["learning_rate"] == pytest.approx(3e-3) and records[2]["grad_norm"] == 2.0
  assert records[2]["eval_loss"] is None
  assert records[3]["eval_perplexity"] == pytest.approx(math.exp(2.0))
  assert len(lines) == 3  # Steps 1, 2 and 4.
  assert "MFU 50.0%" in lines[1] and "pinned host 3.00 GiB" in lines[1]
  assert "eval 2.0000 (ppl 7.39)" in lines[2]
  assert meter.summary().startswith("4 steps: loss 4.0000 -> 1.0000; eval loss 2.0000 (ppl "
                                    "7.39); median step 400.0 ms")


def test_unknown_devices_get_no_mfu():
  assert metrics.peak_flops(jax.devices("cpu")[0], jnp.bfloat16) is None


@pytest.mark.slow
def test_a_run_records_the_rate_the_norm_host_memory_and_held_out_loss(tmp_path):
  config = load_config(None, ["train.train_iters=4", "eval.interval=2", "eval.iters=3",
                              f"logging.jsonl={tmp_path}/logs/steps.jsonl",
                              f"logging.tensorboard_dir={tmp_path}/tb"])
  result = run(config, log=lambda _: None)
  records = [json.loads(line)
             for line in (tmp_path / "logs" / "steps.jsonl").read_text().splitlines()]
  setup = result.setup
  assert [r["learning_rate"] for r in records] == pytest.approx(
      [float(setup.schedule(i)) for i in range(4)])
  # The first step's gradient norm, from the initial weights and the first batch.
  params = init_params(Llama(setup.model), jax.random.PRNGKey(0), jnp.zeros((1, 2), jnp.int32))
  tokens = jnp.asarray(setup.data.train(0))
  grads = jax.grad(lambda p: next_token_loss(Llama(setup.model).apply({"params": p}, tokens),
                                             tokens))(params)
  norm = math.sqrt(sum(float(np.sum(np.asarray(g, np.float64) ** 2)) for g in jax.tree.leaves(grads)))
  assert records[0]["grad_norm"] == pytest.approx(norm, rel=1e-5)
  assert all(r["host_rss_bytes"] > 2**20 for r in records)
  assert [r["eval_loss"] is not None for r in records] == [False, True, False, True]
  for r in records[1::2]:
    assert r["eval_perplexity"] == pytest.approx(math.exp(r["eval_loss"]))
  (events,) = (tmp_path / "tb").iterdir()
  content = events.read_bytes()
  assert all(name.encode() in content for name in ("loss", "grad_norm", "eval_loss"))


@pytest.mark.parametrize("key, under_a_file, error", [
    ("logging.jsonl", "file/steps.jsonl", "File exists: {tmp}/file"),
    ("logging.tensorboard_dir", "file/tb", "Not a directory: {tmp}/file/tb"),
    ("logging.profile_dir", "file/profile", "Not a directory: {tmp}/file/profile")])
def test_an_output_that_cannot_be_written_stops_the_run_in_one_line_before_it_compiles(
    tmp_path, capsys, monkeypatch, key, under_a_file, error):
  (tmp_path / "file").write_text("")
  monkeypatch.setattr(Trainer, "compile", lambda *_: pytest.fail("the run went on to compile"))
  with pytest.raises(SystemExit) as exit_:
    train_main.main([f"{key}={tmp_path}/{under_a_file}"])
  assert exit_.value.code == 2
  assert capsys.readouterr().err.strip().splitlines()[-1] == (
      f"error: {key}={tmp_path}/{under_a_file}: cannot be written "
      f"({error.format(tmp=tmp_path)})")


def test_a_profile_that_cannot_be_written_is_warned_of_and_the_run_goes_on(tmp_path):
  logged, folder = [], tmp_path / "file" / "profile"
  profiler = metrics.Profiler(str(folder), start=1, steps=1, log=logged.append)
  profiler.before(1)
  (tmp_path / "file").write_text("")  # Made under the trace: its folder cannot be.
  profiler.after(1, jnp.ones(3))
  (line,) = logged
  assert line.startswith(f"warning: the profile of steps 1-1 was not written to {folder}: ")
  (tmp_path / "file").unlink()
  jax.profiler.stop_trace()  # JAX's trace is still open: ended here, for the tests after.


@pytest.mark.slow
def test_a_window_of_steps_is_profiled(tmp_path):
  logged = []
  run(load_config(None, ["train.train_iters=4", f"logging.profile_dir={tmp_path}",
                         "logging.profile_start_step=2", "logging.profile_steps=2"]),
      log=logged.append)
  assert f"profiled steps 2-3 into {tmp_path}" in logged
  assert list(tmp_path.rglob("*.xplane.pb"))


def test_out_of_device_memory_names_the_keys_and_writes_the_memory_profile(tmp_path, capsys,
                                                                           monkeypatch):
  def out_of_memory(config, **_):
    raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 111 GiB")

  monkeypatch.setattr(train_main, "train", out_of_memory)
  with pytest.raises(SystemExit) as exit_:
    train_main.main([f"logging.jsonl={tmp_path}/steps.jsonl"])
  assert exit_.value.code == 1
  (err,) = capsys.readouterr().err.splitlines()
  profile = err.split("what the device held: ")[1]
  assert os.path.dirname(profile) == str(tmp_path) and os.path.getsize(profile) > 0
  # Each lever once, as the setting to make, with what it frees.
  assert re.fullmatch(
      r"error: out of device memory: RESOURCE_EXHAUSTED: Out of memory allocating 111 GiB; "
      r"lower it with optimizer.optimizer_cpu_offload=True optimizer.optimizer_offload_fraction"
      r"=1.0 \(frees about \d+ MB\); train.micro_batch_size=4 \(now 8; frees about \d+ MB\); "
      r"model.recompute_granularity=selective \(frees about \d+ MB\); "
      r"model.recompute_granularity=full \(frees about \d+ MB\) \(docs/config.md\); what the "
      r"device held: .+", err)


def refused_in(directory, write):
  """``write(path)`` that fails as a read-only file system does inside ``directory``."""
  def written(path):
    if os.path.dirname(path) == directory:
      raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
    return write(path)
  return written


@pytest.mark.parametrize("where", ["checkpoint.dir", "read-only checkpoint.dir", None])
def test_the_memory_profile_goes_beside_the_checkpoints_or_into_a_new_directory_never_here(
    tmp_path, capsys, monkeypatch, where):
  def out_of_memory(config, **_):
    raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 111 GiB")

  monkeypatch.setattr(train_main, "train", out_of_memory)
  here = tmp_path / "here"
  here.mkdir()
  monkeypatch.chdir(here)
  (tmp_path / "run").mkdir()
  if where == "read-only checkpoint.dir":
    # A read-only disk there: refused at the write (root writes through permissions).
    monkeypatch.setattr(train_main.jax.profiler, "save_device_memory_profile", refused_in(
        f"{tmp_path}/run", train_main.jax.profiler.save_device_memory_profile))
  with pytest.raises(SystemExit):
    train_main.main([f"checkpoint.dir={tmp_path}/run"] if where else [])
  profile = capsys.readouterr().err.splitlines()[0].split("what the device held: ")[1]
  assert os.path.getsize(profile) > 0 and not os.listdir(here)
  if where == "checkpoint.dir":
    assert os.path.dirname(profile) == f"{tmp_path}/run"
  else:
    assert os.path.basename(os.path.dirname(profile)).startswith("jaxoffload-")
    shutil.rmtree(os.path.dirname(profile))


@pytest.mark.parametrize("config, lever", [
    ([], "train.micro_batch_size=4"),
    pytest.param([], "model.recompute_granularity=full", marks=pytest.mark.slow),
    pytest.param([], "model.recompute_granularity=selective", marks=pytest.mark.slow),
    # Every layer recomputed, the one program keeps each layer's input.
    pytest.param(["model.recompute_granularity=full"], "train.micro_batch_size=4",
                 marks=pytest.mark.slow),
    # The sums beside a micro-batch's gradients.
    pytest.param(["train.micro_batch_size=4"], "optimizer.grad_accum_dtype=bfloat16",
                 marks=pytest.mark.slow)])
def test_what_a_device_lever_frees_is_near_what_xla_compiles(config, lever):
  # On a CPU every buffer counts as device memory: for these levers, which move no state to
  # the host, XLA's compiled peaks of the step with and without the lever are the reference.
  def compiled(setup):
    tokens = setup.global_batch(0)
    return Trainer.from_shapes(setup).compile(jax.ShapeDtypeStruct(
        tokens.shape, tokens.dtype, sharding=tokens.sharding)).device_bytes

  base = resolve(load_config(None, config))
  other = resolve(load_config(None, [*config, lever]))
  freed = levers.device_need(base) - levers.device_need(other)
  assert freed == pytest.approx(compiled(base) - compiled(other), rel=0.35)
  # The lever is named with that figure, in whole MB.
  assert levers.device_figures(base, [lever]) == [f"{lever} (frees about {freed / 1e6:.0f} MB)"]


def test_out_of_pinned_host_memory_names_the_pool_limit(capsys, monkeypatch):
  def out_of_pinned_memory(config, **_):
    raise jax.errors.JaxRuntimeError(
        "RESOURCE_EXHAUSTED: Out of host memory while trying to allocate 6.59GiB with allocator "
        "xla_gpu_host_bfc on device 0.")

  monkeypatch.setattr(train_main, "train", out_of_pinned_memory)
  monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "37")
  with pytest.raises(SystemExit) as exit_:
    train_main.main([])
  assert exit_.value.code == 1
  assert capsys.readouterr().err == (
      "error: out of XLA's pinned host memory: RESOURCE_EXHAUSTED: Out of host memory while "
      "trying to allocate 6.59GiB with allocator xla_gpu_host_bfc on device 0.; each GPU's pool "
      "stops at XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=37 GiB: start again with "
      "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB set higher, within the host's free memory\n")


def test_xlas_failure_inside_one_program_names_the_program_per_layer(capsys, monkeypatch):
  def failing(config, **_):
    raise IndexError("absl::container_internal::raw_hash_map<>::at\n--------------------\n"
                     "For simplicity, JAX has removed its internal frames")

  monkeypatch.setattr(train_main, "train", failing)
  with pytest.raises(SystemExit) as exit_:
    train_main.main([])
  assert exit_.value.code == 1
  assert capsys.readouterr().err == (
      "error: XLA failed running the step: absl::container_internal::raw_hash_map<>::at; it has "
      "failed so with host offload inside one program on some GPUs, where a program per layer "
      "(model.cpu_offloading_double_buffering=True, or train.per_layer_step=True) ran\n")
  # Any other IndexError is a bug of ours, and keeps its traceback.
  monkeypatch.setattr(train_main, "train", lambda config, **_: [][0])
  with pytest.raises(IndexError, match="list index out of range"):
    train_main.main([])


@pytest.mark.parametrize("overrides, named", [
    # Everything offloaded, the smallest micro-batch, every layer recomputed: nothing to name.
    (["optimizer.optimizer_cpu_offload=True", "optimizer.optimizer_offload_fraction=1.0",
      "optimizer.optimizer_offload_update_on=host_kernel", "train.micro_batch_size=1",
      "optimizer.grad_accum_dtype=bfloat16", "model.recompute_granularity=full"], []),
    # At fraction 1.0 on the device placement: not a larger fraction, the host kernel.
    (["optimizer.optimizer_cpu_offload=True", "optimizer.optimizer_offload_fraction=1.0",
      "optimizer.optimizer_offload_update_on=device", "train.micro_batch_size=1", "model.recompute_granularity=selective"],
     ["optimizer.optimizer_offload_update_on=host_kernel (the device then holds no float32 "
      "weights or gradients of the offloaded leaves)", "optimizer.grad_accum_dtype=bfloat16",
      "model.recompute_granularity=full"]),
    # The largest micro-batch below the run's that divides the global batch.
    (["train.global_batch_size=6", "train.micro_batch_size=3", "model.cpu_offloading=True",
      "model.cpu_offloading_num_layers=1"],
     ["optimizer.optimizer_cpu_offload=True optimizer.optimizer_offload_fraction=1.0",
      "train.micro_batch_size=2 (now 3)", "optimizer.grad_accum_dtype=bfloat16",
      "model.cpu_offloading_num_layers=3 (now 1)"]),
])
def test_out_of_memory_advice_names_only_levers_not_at_their_limit(overrides, named):
  assert advice.device_memory_levers(load_config(None, overrides)) == named


def test_out_of_memory_advice_starts_from_what_the_auto_settings_chose(tmp_path, capsys,
                                                                       monkeypatch):
  offload = ["optimizer.optimizer_cpu_offload=True", "optimizer.optimizer_offload_fraction=1.0",
             "train.micro_batch_size=1", "optimizer.grad_accum_dtype=bfloat16",
             "model.recompute_granularity=full"]

  def out_of_memory(config, **_):  # After resolve chose the host kernel for the auto placement.
    error = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 9 GiB")
    error.resolved_config = load_config(None, offload + [
        "optimizer.optimizer_offload_update_on=host_kernel"])
    raise error

  monkeypatch.setattr(train_main, "train", out_of_memory)
  with pytest.raises(SystemExit):
    train_main.main(offload + [f"logging.jsonl={tmp_path}/steps.jsonl"])
  # Every lever is at its limit once the host kernel holds the state.
  (err,) = capsys.readouterr().err.splitlines()
  assert err.startswith("error: out of device memory: RESOURCE_EXHAUSTED: Out of memory "
                        "allocating 9 GiB; every setting that lowers device memory is at its "
                        "limit: a smaller model")


def test_small_memory_figures_keep_their_digits():
  lines = []
  meter = metrics.Monitor(total_steps=1, tokens_per_step=1000, flops_per_token=2e9,
                          peak_flops=None, pinned_host_bytes=1741312, log=lines.append,
                          host_rss_bytes=lambda: 600 * 2**20)
  meter.record(step=1, loss=1.0, step_s=0.1, learning_rate=1e-3, grad_norm=1.0)
  assert lines[0].endswith("pinned host 1.66 MiB  host RSS 0.59 GiB")
  assert meter.summary().endswith("pinned host 1.66 MiB  host RSS 0.59 GiB")
  for num_bytes, shown in [(0, "0.00 GiB"), (5, "5 B"), (3 * 2**10, "3.00 KiB"),
                           (2**30 // 100, "0.01 GiB"), (40 * 2**30, "40.00 GiB")]:
    assert metrics._memory(None, num_bytes, None) == f"pinned host {shown}"


def tiny_run(*overrides):
  """The lines and records of two steps of the tiny default model."""
  lines = []
  result = run(load_config(None, ["train.train_iters=2", *overrides]), log=lines.append)
  return lines, result.records


@pytest.mark.slow
def test_progress_bar_false_logs_the_figures_without_the_bar():
  drawn, _ = tiny_run()
  plain, _ = tiny_run("logging.progress_bar=False")
  steps = lambda lines: [line for line in lines if "/2  loss " in line]
  assert [line.split("  loss ")[0] for line in steps(drawn)] == [
      "[##########..........] step 1/2", "[####################] step 2/2"]
  assert [line.split("  loss ")[0] for line in steps(plain)] == ["step 1/2", "step 2/2"]
  assert not any("[#" in line for line in plain)
  assert all(" ms  " in line and " tok/s  " in line for line in steps(plain))


@pytest.mark.slow
def test_a_cpu_run_reports_its_offloaded_pinned_host_bytes():
  offloaded, records = tiny_run("optimizer.optimizer_cpu_offload=True",
                                "optimizer.optimizer_offload_fraction=1.0",
                                "optimizer.optimizer_offload_update_on=device")
  # Both Adam moments of every parameter element, float32.
  moments = 2 * 4 * sum(x.size for x in jax.tree.leaves(
      init_params(Llama(LlamaConfig()), jax.random.PRNGKey(0), jnp.zeros((1, 2), jnp.int32))))
  assert all(r.pinned_host_bytes >= moments for r in records)
  assert "pinned host 0.00 GiB" not in "\n".join(offloaded)
  assert re.search(r"pinned host [1-9][\d.]* MiB", offloaded[-1])
  kept, records = tiny_run()
  assert [r.pinned_host_bytes for r in records] == [0, 0]
  assert "pinned host 0.00 GiB" in kept[-1]
