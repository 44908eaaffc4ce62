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

import numpy as np

import common

LAST = 10  # The steps whose slope must fall.


def verdict(losses: list[float]) -> dict:
  """What the curve did: its first and last losses, the slope of its last ``LAST``, and
  whether it passes."""
  tail = losses[-LAST:]
  slope = float(np.polyfit(np.arange(len(tail)), tail, 1)[0]) if len(tail) > 1 else 0.0
  return {"first": losses[0], "last": losses[-1], "last_ten_slope": slope,
          "falls": losses[-1] < losses[0] and slope < 0}


def train(config: str, overrides: list[str], jsonl: str) -> dict:
  """Trains ``config`` in its own process, its steps' records written to ``jsonl`` (kept
  with the report, and read even where the run is cut short); returns its losses, step
  times and verdict."""
  if os.path.exists(jsonl):
    os.remove(jsonl)  # The trainer appends.
  done = subprocess.run([sys.executable, "-m", "jaxoffload.train", "--config", config,
                         *overrides, f"logging.jsonl={jsonl}", "logging.progress_bar=False"],
                        capture_output=True, text=True, check=False)
  records = ([json.loads(line) for line in open(jsonl)] if os.path.exists(jsonl) else [])
  if done.returncode != 0 or not records:
    sys.stderr.write(done.stderr[-3000:])
    raise SystemExit(f"{config} failed (exit status {done.returncode})")
  losses = [r["loss"] for r in records]
  mfu = [r["mfu"] for r in records[1:] if r["mfu"] is not None]
  return {"config": config, "overrides": overrides, "losses": losses,
          "median_step_s": float(np.median([r["step_s"] for r in records[1:] or records])),
          "median_mfu": float(np.median(mfu)) if mfu else None,
          "peak_device_bytes": max((r["peak_device_bytes"] or 0) for r in records),
          **verdict(losses)}


def main() -> None:
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
  mfu = lambda r: "" if r["median_mfu"] is None else f"{100 * r['median_mfu']:.1f}%"
  rows = [f"| {r['config']} | {len(r['losses'])} | {r['first']:.3f} | {r['last']:.3f} | "
          f"{r['last_ten_slope']:+.4f} | {r['median_step_s']:.3f} | {mfu(r)} | "
          f"{'yes' if r['falls'] else 'no'} |" for r in results]
  table = "\n".join([
      "# Shipped configs, each for its own train_iters", "",
      "| config | steps | first loss | last loss | slope of the last ten | median step (s) "
      "| MFU | falls |", "|---|---|---|---|---|---|---|---|", *rows, ""])
  common.write_report(args.out, common.metadata(sys.argv), results, table)


if __name__ == "__main__":
  main()
