"""One run at a time on a checkpoint directory: a claim the operating system lets go when the
process holding it ends.

The claim is an exclusive ``flock`` on a file in the directory, which names its
holder (process id, host, start time). A second run on the directory finds the
lock held and is refused in one line naming the holder. A run killed before it
let go leaves the file's text but not the lock: the next run takes the claim
over, and says whose it was.

Example:
  >>> claim = take("run/checkpoints", "checkpoint.dir")
  >>> claim.taken_over      # "process 4242 on host a, since 2026-12-07 10:00:00", or None.
  >>> claim.release()
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
from typing import Optional

from jaxoffload.train.config import ConfigError

FILE = ".jaxoffload-claim"


class Claim:
  """A held claim on a directory.

  Attributes:
    directory: the claimed directory.
    taken_over: the holder a killed run left the claim to, as ``holder`` words it; None
      where the claim was free.
  """

  def __init__(self, directory: str, handle: int, taken_over: Optional[str]):
    self.directory, self._handle, self.taken_over = directory, handle, taken_over

  def release(self) -> None:
    """Lets go: the next run finds the claim free and unnamed."""
    if self._handle is None:
      return
    try:
      # Emptied, never deleted: a run that opened the file meanwhile would lock a name
      # no longer in the directory.
      os.ftruncate(self._handle, 0)
    except OSError:
      pass  # A name left behind reads as a killed run's: the next run takes it over.
    finally:
      os.close(self._handle)  # Closing lets go of the lock.
      self._handle = None


def take(directory: str, key: str) -> Claim:
  """Claims ``directory`` (which exists) for this process.

  Args:
    directory: the directory to claim.
    key: the config key that named it, for the refusal.

  Returns:
    The claim, held until ``Claim.release`` or the process's end.

  Raises:
    ConfigError: naming the directory and the run that holds it, or why the directory
      cannot be claimed (a read-only or full disk, a file system without locks).
  """
  cannot = lambda error: ConfigError(f"{key} {directory!r} cannot be claimed for this run: "
                                     f"{error.strerror}")
  try:
    handle = os.open(os.path.join(directory, FILE), os.O_RDWR | os.O_CREAT, 0o644)
  except OSError as error:
    raise cannot(error) from None
  try:
    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    left = _holder(handle)
    record = {"pid": os.getpid(), "host": socket.gethostname(),
              "since": datetime.datetime.now().isoformat(sep=" ", timespec="seconds")}
    os.ftruncate(handle, 0)
    os.pwrite(handle, json.dumps(record).encode(), 0)
  except BlockingIOError:
    holder = _holder(handle)
    os.close(handle)
    raise ConfigError(f"{key} {directory!r} is in use by another run ({holder or 'unnamed'}): "
                      f"wait for it to end, or give this run another {key}") from None
  except OSError as error:
    os.close(handle)
    raise cannot(error) from None
  return Claim(directory, handle, left)


def _holder(handle: int) -> Optional[str]:
  """Who the claim file names, in words; None where it is empty or unreadable."""
  try:
    record = json.loads(os.pread(handle, 4096, 0) or b"null")
    return f"process {record['pid']} on host {record['host']}, since {record['since']}"
  except (ValueError, TypeError, KeyError, OSError):
    return None
