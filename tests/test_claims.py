"""A checkpoint directory belongs to one run at a time: a second is refused naming the first,
and a claim a killed run left is taken over."""

import json
import os
import re
import subprocess
import sys
import time

import pytest

from jaxoffload.train import ConfigError, claims, load_config, train
from tests.helpers import QUIET, checkpoint_entries


def test_a_held_claim_refuses_a_second_run_naming_the_first_and_nothing_is_written(tmp_path):
  held = claims.take(str(tmp_path), "checkpoint.dir")
  assert held.taken_over is None
  holder = json.loads((tmp_path / claims.FILE).read_text())
  assert holder["pid"] == os.getpid()
  with pytest.raises(ConfigError, match=(
      rf"^checkpoint.dir '{re.escape(str(tmp_path))}' is in use by another run \(process "
      rf"{os.getpid()} on host {re.escape(holder['host'])}, since .+\): wait for it to end, or "
      r"give this run another checkpoint.dir$")):
    train(load_config(None, ["train.train_iters=2", f"checkpoint.dir={tmp_path}"]), log=QUIET)
  assert sorted(os.listdir(tmp_path)) == [claims.FILE]  # No step, and the claim still ours.
  assert json.loads((tmp_path / claims.FILE).read_text()) == holder
  held.release()
  assert len(train(load_config(None, ["train.train_iters=2", f"checkpoint.dir={tmp_path}"]),
                   log=QUIET)) == 2
  assert checkpoint_entries(tmp_path) == ["2"]


def test_a_claim_left_by_an_ended_process_is_taken_over_and_named(tmp_path):
  # What a killed run leaves: its record, no lock.
  (tmp_path / claims.FILE).write_text(json.dumps(
      {"pid": 4242, "host": "elsewhere", "since": "2026-01-02 03:04:05"}))
  logged = []
  train(load_config(None, ["train.train_iters=1", f"checkpoint.dir={tmp_path}"]),
        log=logged.append)
  assert logged[0] == ("note: checkpoint.dir was claimed by process 4242 on host elsewhere, "
                       "since 2026-01-02 03:04:05, which ended without letting go; this run "
                       "takes it over")
  assert checkpoint_entries(tmp_path) == ["1"]


@pytest.mark.slow
def test_two_train_commands_on_one_checkpoint_dir_the_second_refused_in_one_line(tmp_path):
  jsonl = tmp_path / "steps.jsonl"
  first = subprocess.Popen(
      [sys.executable, "-m", "jaxoffload.train", "train.train_iters=100000",
       f"checkpoint.dir={tmp_path}/ckpt", "checkpoint.save_interval=100000",
       f"logging.jsonl={jsonl}"],
      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.monotonic() + 300
    while not (jsonl.exists() and jsonl.read_text().strip()) and time.monotonic() < deadline:
      assert first.poll() is None, first.stderr.read()[-2000:]
      time.sleep(0.2)
    second = subprocess.run([sys.executable, "-m", "jaxoffload.train", "train.train_iters=2",
                             f"checkpoint.dir={tmp_path}/ckpt"],
                            capture_output=True, text=True, timeout=300, check=False)
  finally:
    first.kill()
    first.communicate()
  assert second.returncode == 2
  assert re.fullmatch(
      rf"error: checkpoint.dir '{re.escape(str(tmp_path))}/ckpt' is in use by another run "
      rf"\(process {first.pid} on host .+, since .+\): wait for it to end, or give this run "
      r"another checkpoint.dir\n", second.stderr)
  assert os.listdir(tmp_path / "ckpt") == [claims.FILE]  # The killed run saved nothing.
