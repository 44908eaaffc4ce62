"""Several processes joined by jax.distributed train like one process with all their devices."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from jaxoffload.train import ConfigError, load_config, train
from jaxoffload.train.checkpoints import claims
from tests.helpers import checkpoint_entries

COMMON = ["train.train_iters=5", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2",
          "optimizer.optimizer_cpu_offload=True", "optimizer.optimizer_offload_fraction=0.5",
          "model.cpu_offloading=True", "model.cpu_offloading_num_layers=2"]


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


TWO_PROCESSES = pytest.mark.skipif(jax.default_backend() != "cpu" or len(jax.devices()) < 8,
                                   reason="two CPU processes of 4 devices against this "
                                          "process's 8")


def run_two(tmp_path, overrides: list[str]) -> list[tuple[int, str, str]]:
  """Runs ``python -m jaxoffload.train OVERRIDES`` as the two processes of one run, of 4 CPU
  devices each; returns each one's exit status, stdout and stderr, or fails the test naming
  where each waits when they have not ended in 300 s."""
  port = free_port()
  # Faulthandler prints every thread's stack on SIGABRT: what a hung process waits on;
  # unbuffered, the lines it printed before survive the abort.
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
             PYTHONFAULTHANDLER="1", PYTHONUNBUFFERED="1")
  processes = [
      subprocess.Popen(
          [sys.executable, "-m", "jaxoffload.train", *overrides, "distributed.initialize=True",
           f"distributed.coordinator_address=localhost:{port}", "distributed.num_processes=2",
           f"distributed.process_id={i}", f"logging.jsonl={tmp_path}/steps{i}.jsonl"],
          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
      for i in range(2)]
  deadline = time.monotonic() + 300
  try:
    outputs = [p.communicate(timeout=max(deadline - time.monotonic(), 1)) for p in processes]
  except subprocess.TimeoutExpired:
    for p in processes:
      p.send_signal(signal.SIGABRT)
    # Each process's own last lines (its placement, its last step; not gloo's) and its
    # threads' stacks.
    ended = [p.communicate() for p in processes]
    own = lambda out: [line for line in out.splitlines() if not line.startswith("[Gloo]")][-4:]
    pytest.fail("the two processes did not end in 300 s:\n" + "\n".join(
        f"process {i}, its output ending {own(out)}; its stacks:\n{err[-8000:]}"
        for i, (out, err) in enumerate(ended)))
  return [(p.returncode, out, err) for p, (out, err) in zip(processes, outputs)]


@pytest.mark.slow
@TWO_PROCESSES
# Each placement named: auto's choice depends on the machine. The host kernel's step runs a
# program per layer, its gradients copied to each process's pinned memory as they come.
@pytest.mark.parametrize("update_on", ["device", "host_kernel"])
def test_two_processes_of_four_devices_train_like_one_of_eight(tmp_path, update_on):
  common = [*COMMON, f"optimizer.optimizer_offload_update_on={update_on}"]
  ran = run_two(tmp_path, [*common, f"checkpoint.dir={tmp_path}/checkpoints"])
  for status, _, err in ran:
    assert status == 0, err[-3000:]
  (_, out0, _), (_, out1, _) = ran
  # Only process 0 reports (gloo writes its own lines on both).
  assert "backend cpu (8 x cpu)" in out0 and "5 steps: loss" in out0
  assert ("host kernel: " in out0) == (update_on == "host_kernel")
  assert "backend" not in out1 and "loss" not in out1
  assert not (tmp_path / "steps1.jsonl").exists()
  losses = [json.loads(line)["loss"] for line in (tmp_path / "steps0.jsonl").read_text().splitlines()]
  want = train(load_config(None, common), log=lambda _: None)
  np.testing.assert_allclose(losses, want, rtol=1e-5)
  assert checkpoint_entries(tmp_path / "checkpoints") == ["5"]


@pytest.mark.slow
@TWO_PROCESSES
def test_a_checkpoint_dir_another_run_holds_refuses_both_processes_in_a_line_each(tmp_path):
  held = claims.take(str(tmp_path), "checkpoint.dir")  # Another run's, in this process.
  try:
    ran = run_two(tmp_path, [*COMMON, f"checkpoint.dir={tmp_path}"])
  finally:
    held.release()
  (status0, _, err0), (status1, _, err1) = ran
  assert status0 == status1 == 2, (err0[-2000:], err1[-2000:])
  assert re.search(rf"^error: checkpoint.dir '{re.escape(str(tmp_path))}' is in use by another "
                   rf"run \(process {os.getpid()} on host ", err0, re.M), err0[-2000:]
  assert err1.endswith("error: checkpoint.dir: process 0 of this run refused it (its line says "
                       "why)\n"), err1[-2000:]
  assert checkpoint_entries(tmp_path) == []


@pytest.mark.parametrize("overrides, message", [
    (["distributed.num_processes=2"], "take effect only with distributed.initialize=True"),
    (["distributed.initialize=True", "distributed.num_processes=2", "distributed.process_id=2"],
     r"distributed.process_id must be in \[0, distributed.num_processes - 1\], got 2"),
    (["distributed.initialize=True", "distributed.num_processes=0"],
     "distributed.num_processes must be at least 1, got 0"),
])
def test_bad_distributed_settings_name_the_key(overrides, message):
  with pytest.raises(ConfigError, match=message):
    load_config(None, overrides)
