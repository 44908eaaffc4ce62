"""Keeping XLA's C++ log lines out of the planner's output.

XLA writes them (absl's format: severity, date, time, thread, ``file:line]``) straight to
file descriptor 2 while it compiles, out of Python's reach; ``dropped`` takes that
descriptor for a while and gives back everything else that was written to it.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from typing import Iterator

# E0207 18:44:44.481770 1957515 gpu_hlo_schedule.cc:815] ...; and absl's note before its first.
_XLA_LINE = re.compile(rb"[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [\w./-]+:\d+\] ")
_ABSL_NOTE = b"WARNING: All log messages before absl::InitializeLog() is called are written"


@contextlib.contextmanager
def dropped() -> Iterator[None]:
  """Captures what is written to file descriptor 2 meanwhile, by anything in the process;
  on leaving, writes back to it, in order, every line that is not an XLA log line."""
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as captured:
    os.dup2(captured.fileno(), 2)
    try:
      yield
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      captured.seek(0)
      kept = b"".join(line for line in captured
                      if not (_XLA_LINE.match(line) or line.startswith(_ABSL_NOTE)))
      while kept:
        kept = kept[os.write(2, kept):]
