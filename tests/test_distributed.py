"""Several processes joined by jax.distributed train like one process with all their devices."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from jaxoffload.train import ConfigError, claims, load_config, train

COMMON = ["train.train_iters=5", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2",
          "optimizer.optimizer_cpu_offload=True", "optimizer.optimizer_offload_fraction=0.5",
          "model.cpu_offloading=True", "model.cpu_offloading_num_layers=2"]


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.skipif(jax.default_backend() != "cpu" or len(jax.devices()) < 8,
                    reason="two CPU processes of 4 devices against this process's 8")
# Each placement named: auto's choice depends on the machine. The host kernel's step runs a
# program per layer, its gradients copied to each process's pinned memory as they come.
@pytest.mark.parametrize("update_on", ["device", "host_kernel"])
def test_two_processes_of_four_devices_train_like_one_of_eight(tmp_path, update_on):
  common = [*COMMON, f"optimizer.optimizer_offload_update_on={update_on}"]
  port = free_port()
  # Faulthandler prints every thread's stack on SIGABRT: what a hung process waits on;
  # unbuffered, the lines it printed before survive the abort.
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
             PYTHONFAULTHANDLER="1", PYTHONUNBUFFERED="1")
  processes = [
      subprocess.Popen(
          # auto: each process measures its machine; process 0's choice holds for both.
          [sys.executable, "-m", "jaxoffload.train", *common, "distributed.initialize=True",
           f"distributed.coordinator_address=localhost:{port}", "distributed.num_processes=2",
           f"distributed.process_id={i}", f"logging.jsonl={tmp_path}/steps{i}.jsonl",
           f"checkpoint.dir={tmp_path}/checkpoints"],
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
  for p, (_, err) in zip(processes, outputs):
    assert p.returncode == 0, err[-3000:]
  # Only process 0 reports (gloo writes its own lines on both).
  assert "backend cpu (8 x cpu)" in outputs[0][0] and "5 steps: loss" in outputs[0][0]
  assert ("host kernel: " in outputs[0][0]) == (update_on == "host_kernel")
  assert "backend" not in outputs[1][0] and "loss" not in outputs[1][0]
  assert not (tmp_path / "steps1.jsonl").exists()
  losses = [json.loads(line)["loss"] for line in (tmp_path / "steps0.jsonl").read_text().splitlines()]
  want = train(load_config(None, common), log=lambda _: None)
  np.testing.assert_allclose(losses, want, rtol=1e-5)
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [claims.FILE, "5"]


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
