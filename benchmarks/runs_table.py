"""A table of trainer runs from their JSONL records and logs, each beside its mesh's baseline.

  python benchmarks/runs_table.py RUNS_DIR --out benchmarks/runs/NAME \
      --meta device="2 x NVIDIA H200" jax=0.11.2 date=2026-11-29 command="..."

Run NAME_base is the baseline of NAME_off and NAME_base_again; a run's figures
are the medians over its steps after the first (compilation and warm-up).
Counts the lines where XLA turned host-memory data movement into host
computation ("host memory space" warnings), the sign of a slow offload.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics

GIB = 2**30


def summary(directory: pathlib.Path, name: str) -> dict:
  records = [json.loads(line) for line in (directory / f"{name}.jsonl").read_text().splitlines()]
  log = (directory / f"{name}.log").read_text()
  steady = records[1:] or records
  median = lambda key: statistics.median(r[key] for r in steady)
  return {"run": name, "steps": len(records), "step_s": median("step_s"),
          "tokens_per_s": median("tokens_per_s"),
          "mfu": median("mfu") if steady[0]["mfu"] is not None else None,
          "peak_device_gib": max(r["peak_device_bytes"] or 0 for r in records) / GIB,
          "pinned_host_gib": records[-1]["pinned_host_bytes"] / GIB,
          "host_compute_warnings": log.count("host memory space"),
          "losses": [r["loss"] for r in records]}


def compare(runs: dict[str, dict]) -> None:
  """Adds to each run with a ``_base`` twin its step-time ratio and largest loss difference."""
  for name, run in runs.items():
    base = runs.get(name.rsplit("_", 1)[0] + "_base") or runs.get(name.replace("_base_again",
                                                                                "_base"))
    if base is None or base is run:
      continue
    run["vs_base_step"] = run["step_s"] / base["step_s"]
    run["max_abs_loss_diff"] = max(abs(a - b) for a, b in zip(run["losses"], base["losses"]))


def markdown(runs: dict[str, dict], note: str) -> str:
  lines = [note, "",
           "| run | steps | step (s) | vs its baseline | tokens/s | MFU | peak device / GPU (GiB) "
           "| pinned host (GiB) | max loss diff vs baseline | host-compute warnings |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for r in runs.values():
    ratio = f"{r['vs_base_step']:.2f}x" if "vs_base_step" in r else "-"
    diff = f"{r['max_abs_loss_diff']:.2e}" if "max_abs_loss_diff" in r else "-"
    mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
    lines.append(f"| {r['run']} | {r['steps']} | {r['step_s']:.3f} | {ratio} "
                 f"| {r['tokens_per_s']:,.0f} | {mfu} | {r['peak_device_gib']:.2f} "
                 f"| {r['pinned_host_gib']:.2f} | {diff} | {r['host_compute_warnings']} |")
  return "\n".join(lines) + "\n"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("runs", type=pathlib.Path)
  parser.add_argument("--out", required=True, help="output path prefix (.json and .md)")
  parser.add_argument("--note", default="", help="markdown put above the table")
  parser.add_argument("--meta", nargs="*", default=[], metavar="KEY=VALUE",
                      help="where and how the runs were made (device, jax, date, command)")
  args = parser.parse_args()
  meta = dict(item.split("=", 1) for item in args.meta)
  names = sorted(p.stem for p in args.runs.glob("*.jsonl"))
  runs = {name: summary(args.runs, name) for name in names}
  compare(runs)
  pathlib.Path(f"{args.out}.json").write_text(
      json.dumps({"meta": meta, "runs": list(runs.values())}, indent=1) + "\n")
  note = "\n".join([args.note, *(f"{k}: {v}" for k, v in meta.items())]).strip()
  table = markdown(runs, note)
  pathlib.Path(f"{args.out}.md").write_text(table)
  print(table)


if __name__ == "__main__":
  main()
