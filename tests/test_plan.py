"""The planner: the table, the pruning of fractions, the pick, and the command it prints."""

import subprocess
import sys

import pytest

from jaxoffload import autoplace, plan
from jaxoffload.train import load_config

MACHINE = autoplace.Machine(host_to_device=50e9, device_to_host=50e9, kernel_rate=5e9,
                            kernel_threads=16)


def test_the_smallest_fraction_that_fits_is_each_placements_candidate(monkeypatch):
  judged = []

  def judge(config, fraction, update_on, machine):
    judged.append((fraction, update_on))
    # As on a GPU: offload moves device bytes to the host and adds time; the host
    # kernel also moves the weights, so it frees more device memory and costs more host.
    kernel = update_on == "host_kernel"
    return plan.Candidate(fraction, update_on, fraction,
                          device_bytes=int((100 - (80 if kernel else 60) * fraction) * 1e6),
                          host_bytes=int((10 + (170 if kernel else 50) * fraction) * 1e6),
                          added_s=fraction * (0.2 if kernel else 0.3))

  monkeypatch.setattr(plan, "judge", judge)
  monkeypatch.setattr(autoplace, "measure_machine", lambda: MACHINE)
  lines = []
  best = plan.plan(load_config(None, []), device_budget=int(70e6), host_budget=int(100e6),
                   log=lines.append)
  # Device: 0.75 is the first under 95% of 70 MB, so 1.0 is never compiled. The host
  # kernel fits the device from 0.5 but needs 95 MB of host memory, over 90% of 100 MB.
  assert judged == [(0.0, "device"), (0.25, "device"), (0.5, "device"), (0.75, "device"),
                    (0.25, "host_kernel"), (0.5, "host_kernel")]
  assert (best.fraction, best.update_on) == (0.75, "device")
  assert lines[3] == "| 0.00 | - | 0.00 | 100 MB | 10 MB | 0.0 ms | no: device |"
  assert lines[-1] == "| 0.50 | host_kernel | 0.50 | 60 MB | 95 MB | 100.0 ms | no: host |"


@pytest.mark.slow
def test_the_planner_prints_a_command_that_trains():
  result = subprocess.run([sys.executable, "-m", "jaxoffload.plan", "train.train_iters=2"],
                          capture_output=True, text=True, timeout=300, check=False)
  assert result.returncode == 0, result.stderr[-2000:]
  assert "| offload | update on | achieved | device peak | host | added a step | fits |" in (
      result.stdout)
  command = result.stdout.strip().splitlines()[-1].split()
  assert command[:3] == ["python", "-m", "jaxoffload.train"]
  trained = subprocess.run([sys.executable, *command[1:]], capture_output=True, text=True,
                           timeout=300, check=False)
  assert trained.returncode == 0, trained.stderr[-2000:]
  assert "2 steps: loss" in trained.stdout


@pytest.mark.slow
def test_when_nothing_fits_the_planner_says_so_in_one_line():
  result = subprocess.run([sys.executable, "-m", "jaxoffload.plan", "train.host_memory_limit=1MB"],
                          capture_output=True, text=True, timeout=300, check=False)
  assert result.returncode == 2
  assert result.stderr.strip().splitlines()[-1].startswith("error: no candidate fits this machine")
