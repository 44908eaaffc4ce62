"""What the benchmark scripts share: one fresh process per setting, timing, and the run's metadata."""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Sequence


def run_children(script: str, settings: Sequence[Sequence[str]], common_args: Sequence[str]
                 ) -> list[dict]:
  """Runs ``script --child SETTING... COMMON_ARGS`` once per setting; returns each JSON result.

  A fresh process per setting keeps one setting's peak device memory out of the next.
  """
  results = []
  for setting in settings:
    out = subprocess.run([sys.executable, script, "--child", *setting, *common_args],
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
      sys.stderr.write(out.stderr[-3000:])
      raise SystemExit(f"setting {' '.join(setting)} failed (exit status {out.returncode})")
    results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(json.dumps({k: v for k, v in results[-1].items() if not isinstance(v, (list, dict))}),
          flush=True)
  return results


def time_steps(step: Callable[[], Any], steps: int) -> list[float]:
  """Seconds of each of ``steps`` calls after one warm-up call, each waited for."""
  import jax

  times = []
  for _ in range(steps + 1):
    start = time.perf_counter()
    jax.block_until_ready(step())
    times.append(time.perf_counter() - start)
  return times[1:]


def median(times: Sequence[float]) -> float:
  return statistics.median(times)


def metadata(argv: Sequence[str]) -> dict:
  """Device, JAX version, host cores, date and the command that made the results."""
  import jax

  return {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
          "host_cores": os.cpu_count(), "date": datetime.date.today().isoformat(),
          "command": "python " + " ".join(argv)}


def write_report(out: str, meta: dict, results: list[dict], table: str) -> None:
  """Writes ``out``.json and ``out``.md and prints the table."""
  os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
  with open(out + ".json", "w") as f:
    json.dump({"meta": meta, "results": results}, f, indent=1)
  with open(out + ".md", "w") as f:
    f.write(table)
  print(table)
