"""Each shipped config trained for its own train.train_iters: does its loss fall?

  PYTHONPATH=. python benchmarks/config_losses.py configs/llama_8b_offload.yaml \
      [configs/...] [--set key=value ...] --out benchmarks/runs/config_losses_gpu

A config passes when its last step's loss is below its first and the losses of its
last ten steps fall (their least-squares slope is negative). Each config trains in a
process of its own, through ``python -m jaxoffload.train``, nothing set but the JSONL
file and ``--set``'s overrides.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Optional

import numpy as np

import common

LAST = 10  # The steps whose slope must fall.


def verdict(losses: list[float]) -> dict:
  """What a curve did.

  Args:
    losses: a run's loss at each step.

  Returns:
    Its first and last losses, the least-squares slope of its last ``LAST`` and whether
    it falls (the last below the first and that slope negative).
  """
  tail = losses[-LAST:]
  slope = float(np.polyfit(np.arange(len(tail)), tail, 1)[0]) if len(tail) > 1 else 0.0
  return {"first": losses[0], "last": losses[-1], "last_ten_slope": slope,
          "falls": losses[-1] < losses[0] and slope < 0}


def train(config: str, overrides: list[str], jsonl: str) -> dict:
  """Trains ``config`` in its own process.

  Args:
    config: the YAML file.
    overrides: ``key=value`` settings after it.
    jsonl: where its steps' records go, kept with the report and read even where the run
      ends early (a run that fails does not pass).

  Returns:
    Its losses, exit status, median step time and MFU, peak device bytes and ``verdict``.
  """
  if os.path.exists(jsonl):
    os.remove(jsonl)  # The trainer appends.
  done = subprocess.run([sys.executable, "-m", "jaxoffload.train", "--config", config,
                         *overrides, f"logging.jsonl={jsonl}", "logging.progress_bar=False"],
                        capture_output=True, text=True, check=False)
  records = []
  if os.path.exists(jsonl):
    with open(jsonl) as lines:
      for line in lines:
        try:
          records.append(json.loads(line))
        except ValueError:  # The last line of a run killed as it wrote it.
          break
  if done.returncode != 0:
    sys.stderr.write(done.stderr[-3000:])
    print(f"{config} failed (exit status {done.returncode}) after {len(records)} steps",
          file=sys.stderr)
  if not records:
    raise SystemExit(f"{config} trained no step")
  losses = [r["loss"] for r in records]
  mfu = [r["mfu"] for r in records[1:] if r["mfu"] is not None]
  return {"config": config, "overrides": overrides, "exit_status": done.returncode,
          "losses": losses,
          "median_step_s": float(np.median([r["step_s"] for r in records[1:] or records])),
          "median_mfu": float(np.median(mfu)) if mfu else None,
          "peak_device_bytes": max((r["peak_device_bytes"] or 0) for r in records),
          **verdict(losses), "falls": verdict(losses)["falls"] and done.returncode == 0}


def _percent(fraction: Optional[float]) -> str:
  return "" if fraction is None else f"{100 * fraction:.1f}%"


def main() -> None:
  """Trains each config named, prints its result and writes the report."""
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("configs", nargs="+")
  parser.add_argument("--set", nargs="*", default=[], metavar="key=value",
                      help="overrides for every config")
  parser.add_argument("--out", required=True,
                      help="writes OUT.json, OUT.md and each config's steps in OUT_CONFIG.jsonl")
  args = parser.parse_args()
  results = []
  for config in args.configs:
    name = os.path.splitext(os.path.basename(config))[0]
    results.append(train(config, args.set, f"{args.out}_{name}.jsonl"))
    print(json.dumps({k: v for k, v in results[-1].items() if k != "losses"}), flush=True)
  rows = [f"| {r['config']} | {len(r['losses'])} | {r['first']:.3f} | {r['last']:.3f} | "
          f"{r['last_ten_slope']:+.4f} | {r['median_step_s']:.3f} | {_percent(r['median_mfu'])} | "
          f"{'yes' if r['falls'] else 'no'} |" for r in results]
  table = "\n".join([
      "# Shipped configs, each for its own train_iters", "",
      "| config | steps | first loss | last loss | slope of the last ten | median step (s) "
      "| MFU | falls |", "|---|---|---|---|---|---|---|---|", *rows, ""])
  common.write_report(args.out, common.metadata(sys.argv), results, table)


if __name__ == "__main__":
  main()
