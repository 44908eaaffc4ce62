"""The scripts behind docs/performance.md: each explains itself, and the quick ones run on a CPU."""

import glob
import json
import os
import runpy
import subprocess
import sys

import numba
import pytest

SCRIPTS = sorted(p for p in glob.glob("benchmarks/*.py") if not p.endswith("common.py"))


def run(*args, timeout=300, python=sys.executable):
  return subprocess.run([str(python), *args], capture_output=True, text=True, timeout=timeout,
                        check=False, env=dict(os.environ, PYTHONPATH="."))


def run_here(monkeypatch, script, *args):
  """Runs ``python SCRIPT ARGS`` in this process, as the --help test does: no interpreter
  and JAX to start again. The settings a script runs in processes of its own still run in
  them; a failure raises here."""
  monkeypatch.syspath_prepend("benchmarks")
  monkeypatch.setattr(sys, "argv", [script, *args])
  monkeypatch.setenv("PYTHONPATH", ".")  # For its processes, as ``run`` sets it.
  threads = numba.get_num_threads()  # host_adam.py sets numba's threads per measurement.
  try:
    runpy.run_path(script, run_name="__main__")
  finally:
    numba.set_num_threads(threads)


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_benchmark_has_help(script, capsys, monkeypatch):
  # In this process, as ``python SCRIPT --help`` runs it (the scripts import their
  # neighbour common.py).
  monkeypatch.syspath_prepend("benchmarks")
  monkeypatch.setattr(sys, "argv", [script, "--help"])
  with pytest.raises(SystemExit) as exit_:
    runpy.run_path(script, run_name="__main__")
  assert exit_.value.code == 0
  out = capsys.readouterr().out
  assert out.startswith("usage: ") and "--out" in out


# It measures its own process's memory and sizes XLA's pinned host pool before JAX starts:
# it runs in a fresh process.
OWN_PROCESS = {"benchmarks/host_memory.py"}


@pytest.mark.slow
@pytest.mark.parametrize("args, rows", [
    (["benchmarks/host_adam.py", "--params", "1", "--repeats", "1"], "method"),
    (["benchmarks/copy_duplex.py", "--gib", "0.01", "--repeats", "2"], "copies"),
    (["benchmarks/fetch_paths.py", "--layers", "3", "--layer-mib", "1", "--width", "64",
      "--matmuls", "1", "--repeats", "1"], "GB/s"),
    (["benchmarks/activation_offload.py", "--size", "miniature", "--seq", "32", "--batch", "2",
      "--steps", "1", "--modes", "save,offload:all:qkv"], "mode"),
    (["benchmarks/optimizer_step.py", "--size", "miniature", "--steps", "1", "--fractions", "0.5",
      "--modes", "device"], "update_on"),
    (["benchmarks/host_memory.py", "train.train_iters=1"], "phases"),
    (["benchmarks/offload_table.py", "--steps", "1", "--fractions", "0.5", "--columns",
      "unclipped"], "step_ratio"),
    (["benchmarks/offload_table.py", "--steps", "1", "--fractions", "0.5", "--columns",
      "unclipped-float32-weights", "model.dtype=bfloat16"], "step_ratio"),
    (["benchmarks/host_memory_share.py", "--host", "0.1", "--stream", "0.1", "--layers", "2",
      "--matmul", "64", "--repeats", "1"], "parts"),
    (["benchmarks/compact_quality.py", "--source", "jaxoffload/plan", "--steps", "4",
      "--eval-interval", "2", "--eval-iters", "1", "--settings", "0,2"], "eval_loss"),
    # The calibration that exploring needs has a test of its own (test_plan).
    (["benchmarks/planner.py", "--steps", "2", "--offload-only", "train.global_batch_size=2",
      "train.micro_batch_size=2"], "ran"),
])
def test_the_quick_benchmarks_run_on_a_cpu(tmp_path, monkeypatch, args, rows):
  if args[0] in OWN_PROCESS:
    done = run(*args, "--out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr[-2000:]
  else:
    run_here(monkeypatch, *args, "--out", str(tmp_path / "out"))
  results = json.loads((tmp_path / "out.json").read_text())["results"]
  assert results and all(rows in r for r in results)
  assert (tmp_path / "out.md").read_text().startswith("# ")


@pytest.mark.slow
def test_step_trace_reads_the_trainers_trace(tmp_path, monkeypatch):
  trace = tmp_path / "trace"
  # The profiler names the Python thread after the binary: ``python3`` on the GPU machine.
  # The one beside this interpreter, which a virtual environment has too (a link elsewhere
  # would leave the environment's packages behind).
  python3 = os.path.join(os.path.dirname(sys.executable), "python3")
  done = run("-m", "jaxoffload.train", "train.train_iters=4", "optimizer.optimizer_cpu_offload=True",
             "optimizer.optimizer_offload_fraction=0.5",
             "optimizer.optimizer_offload_update_on=host_kernel", f"logging.profile_dir={trace}",
             "logging.profile_start_step=2", "logging.profile_steps=2", python=python3)
  assert done.returncode == 0, done.stderr[-2000:]
  run_here(monkeypatch, "benchmarks/step_trace.py", str(trace), "--min-ms", "0", "--out",
           str(tmp_path / "out"))
  steps = json.loads((tmp_path / "out.json").read_text())["results"]
  assert len(steps) == 2
  for step in steps:  # The overlapped step: a program per layer.
    assert any(name.startswith("PjitFunction(jit(_layer_forward")
               for name in step["time_by_call_ms"])
    assert step["long_calls"] and step["compute_busy_ms"] is None  # No device stream on a CPU.
  # The first step's update, on the host kernel's thread, runs after it returns and before
  # the second step's forward programs read it: inside the two windows.
  assert sum(step["time_by_call_ms"].get("HostAdamW update", 0) for step in steps) > 0
  with pytest.raises(SystemExit) as missing:  # sys.exit(message): status 1, the message.
    run_here(monkeypatch, "benchmarks/step_trace.py", str(tmp_path / "none"), "--out",
             str(tmp_path / "x"))
  assert "no trace (*.xplane.pb) under" in missing.value.code


def test_the_offload_table_refuses_float32_weights_for_a_float32_model(tmp_path, monkeypatch,
                                                                      capsys):
  with pytest.raises(SystemExit) as exit_:
    run_here(monkeypatch, "benchmarks/offload_table.py", "--columns",
             "unclipped-float32-weights", "--out", str(tmp_path / "out"))
  assert exit_.value.code == 2
  assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
      "error: column 'unclipped-float32-weights' needs a model that computes in bfloat16 "
      "(model.dtype=bfloat16); a float32 model's weights go up in float32 anyway")
