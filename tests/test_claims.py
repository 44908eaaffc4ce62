"""A checkpoint directory belongs to one run at a time: a second is refused naming the first,
and a claim a killed run left is taken over."""

import errno
import json
import os
import re
import subprocess
import sys
import time

import pytest

from jaxoffload.train import ConfigError, load_config, train
from jaxoffload.train.checkpoints import claims
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
  claim = tmp_path / "ckpt" / claims.FILE
  with open(tmp_path / "first.err", "w") as err:
    first = subprocess.Popen(
        [sys.executable, "-m", "jaxoffload.train", "train.train_iters=100000",
         f"checkpoint.dir={tmp_path}/ckpt", "checkpoint.save_interval=100000"],
        stdout=subprocess.DEVNULL, stderr=err)
  try:
    deadline = time.monotonic() + 300
    while not (claim.exists() and claim.read_text()):  # The first run's claim, named.
      assert first.poll() is None, (tmp_path / "first.err").read_text()[-2000:]
      assert time.monotonic() < deadline, "the first run claimed nothing in 300 s"
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


@pytest.mark.parametrize("call, code", [("flock", errno.ENOLCK), ("pwrite", errno.ENOSPC)])
def test_a_directory_that_cannot_be_claimed_is_refused_in_one_line_and_held_by_no_one(
    tmp_path, monkeypatch, call, code):
  # A file system without locks (some NFS mounts), or a disk too full for the holder's name.
  def fails(*args):
    raise OSError(code, os.strerror(code))

  with monkeypatch.context() as patched:
    patched.setattr(claims.fcntl if call == "flock" else claims.os, call, fails)
    with pytest.raises(ConfigError, match=(
        rf"^checkpoint.dir '{re.escape(str(tmp_path))}' cannot be claimed for this run: "
        rf"{os.strerror(code)}$")):
      claims.take(str(tmp_path), "checkpoint.dir")
  claims.take(str(tmp_path), "checkpoint.dir").release()  # Nothing was left holding it.
