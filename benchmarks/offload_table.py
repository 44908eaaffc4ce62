"""The optimizer-offload table of docs/performance.md: each update placement's step time and
device peak over no offload, at each offload fraction.

  python benchmarks/offload_table.py --config configs/llama_1b.yaml --steps 50 --out OUT/table

Runs ``python -m jaxoffload.bench`` once per column, each with its own baseline
and the baseline again (the noise its ratios and losses are read against):

- ``unclipped``: the host kernel (with bfloat16 transfers for a model that
  computes in bfloat16) and ``optimizer.clip_grad=0``: its update runs from the
  backward pass on;
- ``unclipped-float32-weights``: the same with float32 weights in pinned memory
  (``optimizer.store_param_remainders=False``): the device reads them and rounds
  them itself, twice the bytes up;
- ``clip-never-reached``: the same with ``clip_grad=1e6``: the update is
  speculated from the backward pass on (``optimizer.speculate_cpu_optimizer_step``);
- ``config-clipping``: the same with the config's ``clip_grad``;
- ``one-program``: the host kernel without the overlap
  (``overlap_cpu_optimizer_d2h_h2d=false``);
- ``device``: the moments streamed through the device.

Writes each column's bench report (OUT_COLUMN.json and .md) and the table
(OUT.json, OUT.md): per fraction and column, the step-time ratio, the peak
device memory and the largest loss difference from that column's baseline.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from common import metadata, write_report

from jaxoffload.train import load_config

OFFLOAD = ["optimizer.optimizer_cpu_offload=True"]
ON_HOST_KERNEL = "optimizer.optimizer_offload_update_on=host_kernel"
HOST_KERNEL = [*OFFLOAD, ON_HOST_KERNEL]
# With the host kernel, for a model that computes in bfloat16.
HALVED = ["optimizer.offload_transfer_dtype=bfloat16"]
FLOAT32_WEIGHTS = "unclipped-float32-weights"  # Only for a model that computes in bfloat16.
# Per column: overrides for its baseline too (clipping), and for its offloaded settings.
COLUMNS = {
    "unclipped": (["optimizer.clip_grad=0"], HOST_KERNEL),
    FLOAT32_WEIGHTS: (["optimizer.clip_grad=0"],
                      [*HOST_KERNEL, "optimizer.store_param_remainders=False"]),
    "clip-never-reached": (["optimizer.clip_grad=1e6"], HOST_KERNEL),
    "config-clipping": ([], HOST_KERNEL),
    "one-program": ([], [*HOST_KERNEL, "optimizer.overlap_cpu_optimizer_d2h_h2d=False"]),
    "device": ([], [*OFFLOAD, "optimizer.optimizer_offload_update_on=device"]),
}
NOISE = "baseline again"  # jaxoffload.bench's name for the baseline's second run.


def run_column(args: argparse.Namespace, column: str, bfloat16: bool) -> list[dict]:
  """One bench run for ``column`` (``bfloat16``: the model computes in it); its results,
  each setting named by its fraction."""
  common, offloaded = COLUMNS[column]
  if ON_HOST_KERNEL in offloaded and bfloat16:
    offloaded = [*offloaded, *HALVED]
  out = f"{args.out}_{column}"
  command = [sys.executable, "-m", "jaxoffload.bench", "--steps", str(args.steps), "--out", out,
             "--settings", NOISE, *(["--config", args.config] if args.config else [])]
  for fraction in args.fractions:
    command += ["--setting", " ".join(
        [f"{fraction}=optimizer.optimizer_offload_fraction={fraction}", *offloaded])]
  done = subprocess.run([*command, *args.overrides, *common], check=False)
  if done.returncode != 0:
    raise SystemExit(f"column {column!r} failed (exit status {done.returncode})")
  with open(out + ".json") as f:
    return json.load(f)["results"]


def gib(nbytes):
  """Bytes in GiB; None where the backend does not report them (CPUs)."""
  return None if nbytes is None else nbytes / 2**30


def rows(column: str, results: list[dict], fractions: list[str]) -> list[dict]:
  """The table's entries of one column: a row per fraction, read against its baseline."""
  by_name = {r["setting"]: r for r in results}
  noise = by_name[NOISE]
  return [{"column": column, "fraction": float(f), "step_ratio": by_name[f]["step_ratio"],
           "peak_device_gib": gib(by_name[f]["peak_device_bytes"]),
           "max_abs_loss_diff": by_name[f]["max_abs_loss_diff"],
           "noise_step_ratio": noise["step_ratio"],
           "noise_loss_diff": noise["max_abs_loss_diff"],
           "baseline_step_s": by_name["baseline"]["step_s_median"]} for f in fractions]


def table(meta: dict, results: list[dict], columns: list[str], fractions: list[str]) -> str:
  """The markdown page: the table, then each column's baseline and noise."""
  cell = {(r["column"], r["fraction"]): r for r in results}
  peak = lambda g: "peak unknown" if g is None else f"{g:.2f} GiB"
  lines = ["# Optimizer offload: step time and device peak over no offload",
           "", f"Device: {meta['device']}; JAX {meta['jax']}; {meta['host_cores']} host cores; "
           f"{meta['date']}.", f"Command: `{meta['command']}`", "",
           "| fraction | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
  for f in map(float, fractions):
    lines.append(f"| {f:g} | " + " | ".join(
        f"{cell[c, f]['step_ratio']:.2f}x, {peak(cell[c, f]['peak_device_gib'])}, "
        f"loss {cell[c, f]['max_abs_loss_diff']:.1e}" for c in columns) + " |")
  lines.append("")
  for c in columns:
    first = cell[c, float(fractions[0])]
    lines.append(f"- {c}: baseline {first['baseline_step_s']:.4f} s; run again "
                 f"{first['noise_step_ratio']:.2f}x, loss {first['noise_loss_diff']:.1e}")
  return "\n".join(lines) + "\n"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter,
                                   epilog="\n".join(__doc__.splitlines()[2:]))
  parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                      help="applied to every setting of every column")
  parser.add_argument("--config", help="the trainer config (default: the tiny model)")
  parser.add_argument("--steps", type=int, default=50)
  parser.add_argument("--fractions", default="0.25,0.5,1.0")
  parser.add_argument("--columns", help=f"comma-separated, of {list(COLUMNS)} (default: "
                      f"all; {FLOAT32_WEIGHTS!r} only for a model computing in bfloat16)")
  parser.add_argument("--out", default="offload_table", help="output path prefix")
  args = parser.parse_args()
  args.fractions = [f.strip() for f in args.fractions.split(",")]
  bfloat16 = load_config(args.config, args.overrides).model.dtype == "bfloat16"
  applicable = [c for c in COLUMNS if bfloat16 or c != FLOAT32_WEIGHTS]
  columns = [c.strip() for c in args.columns.split(",")] if args.columns else applicable
  unknown = [c for c in columns if c not in COLUMNS]
  if unknown:
    parser.error(f"unknown columns {unknown}; known: {list(COLUMNS)}")
  if FLOAT32_WEIGHTS in columns and not bfloat16:
    parser.error(f"column {FLOAT32_WEIGHTS!r} needs a model that computes in bfloat16 "
                 "(model.dtype=bfloat16); a float32 model's weights go up in float32 anyway")
  results = [row for column in columns
             for row in rows(column, run_column(args, column, bfloat16), args.fractions)]
  meta = metadata(sys.argv)
  write_report(args.out, meta, results, table(meta, results, columns, args.fractions))


if __name__ == "__main__":
  main()
