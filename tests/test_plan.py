"""The planner: the table, the pruning of fractions, the pick, and the command it prints."""

import pytest

from jaxoffload import autoplace, plan
from jaxoffload.train import load_config
from jaxoffload.train.__main__ import main as train_main

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
def test_the_planner_prints_a_command_that_trains(monkeypatch, capsys):
  monkeypatch.setattr(autoplace, "measure_machine", lambda: MACHINE)
  plan.main(["train.train_iters=2"])
  out = capsys.readouterr().out
  assert "| offload | update on | achieved | device peak | host | added a step | fits |" in out
  command = out.strip().splitlines()[-1].split()
  assert command[:3] == ["python", "-m", "jaxoffload.train"]
  train_main(command[3:])
  assert "2 steps: loss" in capsys.readouterr().out


def test_when_nothing_fits_the_planner_says_so_in_one_line(monkeypatch, capsys):
  monkeypatch.setattr(autoplace, "measure_machine", lambda: MACHINE)
  monkeypatch.setattr(plan, "judge", lambda config, fraction, update_on, machine: plan.Candidate(
      fraction, update_on, fraction, device_bytes=0, host_bytes=10**9, added_s=0.0))
  with pytest.raises(SystemExit) as stop:
    plan.main(["train.host_memory_limit=1MB"])
  assert stop.value.code == 2
  assert capsys.readouterr().err.startswith("error: no candidate fits this machine: ")
