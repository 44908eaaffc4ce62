"""Stopping by a signal: the run ends after the step in flight, saved there, and resumes."""

import json
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from jaxoffload.train import load_config, metrics, stopping, train
from tests.helpers import QUIET, checkpoint_entries


def signalled_at(monkeypatch, step: int, *signums: int) -> None:
  """Each of ``signums`` raised in this process once step ``step`` is recorded."""
  record = metrics.Monitor.record

  def record_then_signal(self, **figures):
    record(self, **figures)
    if figures["step"] == step:
      for signum in signums:
        signal.raise_signal(signum)

  monkeypatch.setattr(metrics.Monitor, "record", record_then_signal)


@pytest.mark.parametrize("signum", [signal.SIGTERM, pytest.param(signal.SIGINT,
                                                                   marks=pytest.mark.slow)],
                         ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_the_run_after_its_step_saved_there_and_the_run_resumes_exactly(
    tmp_path, monkeypatch, signum):
  whole = train(load_config(None, ["train.train_iters=6"]), log=QUIET)
  config = load_config(None, ["train.train_iters=6", f"checkpoint.dir={tmp_path}",
                              "checkpoint.save_interval=100"])
  before = signal.getsignal(signum)
  signalled_at(monkeypatch, 2, signum)
  with pytest.raises(stopping.Stopped) as stopped:
    train(config, log=QUIET)
  name = signal.Signals(signum).name
  assert str(stopped.value) == (f"stopped by {name} after step 2 of 6; saved a checkpoint "
                                f"of step 2 in {tmp_path}: the same command resumes it")
  assert stopped.value.signum == signum
  assert checkpoint_entries(tmp_path) == ["2"]
  assert signal.getsignal(signum) is before
  monkeypatch.undo()
  logged = []
  resumed = train(config, log=logged.append)
  assert logged[0] == f"resumed from step 2 in {tmp_path}"
  np.testing.assert_array_equal(resumed, whole[2:])


def test_a_second_ctrl_c_stops_the_run_at_once(tmp_path, monkeypatch, capfd):
  before = signal.getsignal(signal.SIGINT)
  signalled_at(monkeypatch, 1, signal.SIGINT, signal.SIGINT)
  with pytest.raises(KeyboardInterrupt):
    train(load_config(None, ["train.train_iters=3", f"checkpoint.dir={tmp_path}"]), log=QUIET)
  # The first was taken as a request to stop after the step; the second did not wait for it.
  assert "SIGINT: stopping after this step (Ctrl-C again stops at once)" in capfd.readouterr().err
  assert checkpoint_entries(tmp_path) == []
  assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.parametrize("overrides, saved", [
    ([], "nothing saved (checkpoint.dir is not set)"),
    (["checkpoint.dir=/ckpt", "checkpoint.resume=False"],
     "saved a checkpoint of step 3 in /ckpt: the same command with checkpoint.resume=True "
     "resumes it")])
def test_the_stop_says_what_was_saved_and_how_to_resume(overrides, saved):
  stopped = stopping.stopped(signal.SIGINT, 3, load_config(None, overrides))
  assert str(stopped) == f"stopped by SIGINT after step 3 of 100; {saved}"


@pytest.mark.slow
def test_the_train_command_stopped_by_sigterm_exits_143_saying_where_it_saved(tmp_path):
  jsonl = tmp_path / "steps.jsonl"
  run = subprocess.Popen(
      [sys.executable, "-m", "jaxoffload.train", "train.train_iters=100000",
       f"checkpoint.dir={tmp_path}/ckpt", f"logging.jsonl={jsonl}", "logging.progress_bar=False"],
      stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
  deadline = time.monotonic() + 300
  while not (jsonl.exists() and jsonl.read_text().strip()) and time.monotonic() < deadline:
    assert run.poll() is None, run.stderr.read()[-2000:]
    time.sleep(0.2)
  run.send_signal(signal.SIGTERM)
  _, err = run.communicate(timeout=300)
  assert run.returncode == 128 + signal.SIGTERM, err[-2000:]
  step = json.loads(jsonl.read_text().splitlines()[-1])["step"]
  assert err.strip().splitlines()[-1] == (
      f"stopped by SIGTERM after step {step} of 100000; saved a checkpoint of step {step} in "
      f"{tmp_path}/ckpt: the same command resumes it")
  assert checkpoint_entries(tmp_path / "ckpt") == [str(step)]
