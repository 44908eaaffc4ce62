"""How far the one-step-delayed host update's loss curve lies from the exact one's, on text.

  python benchmarks/delayed_vs_exact.py --steps 300 --out docs/benchmarks/delayed_vs_exact_tiny \
      [--config configs/X.yaml] [--stdlib-corpus FILE] [section.key=value ...]

Trains the same model on the same text batches: without offload, with every
leaf on the host kernel (exact), with the kernel's delayed update
(``optimizer.delayed_update``: step t's gradients are taken at weights that
lack step t - 1's update), and, for each ``--delay-after N``, delayed after N
exact updates (``optimizer.delayed_update_after``); with ``--predict-weights``
the delayed runs read predicted weights
(``optimizer.delayed_update_predict_weights``). Reports each curve's
largest gap from the no-offload one, per step and as a moving average over
``--window`` steps.

The default text is the trainer's shipped corpus, which a 1.1B model learns
by heart within a few hundred steps; ``--stdlib-corpus FILE`` writes the Python
standard library's sources (tens of MB, fixed for a Python version) to FILE
and trains on that instead.
"""

from __future__ import annotations

import argparse
import hashlib
import pathlib
import sys
import sysconfig

import numpy as np

from common import metadata, write_report
from jaxoffload.train import load_config, train

HOST_KERNEL = ["optimizer.optimizer_cpu_offload=True", "optimizer.optimizer_offload_fraction=1.0",
               "optimizer.optimizer_offload_update_on=host_kernel"]
RUNS = {"no offload": [], "host kernel, exact": HOST_KERNEL,
        "host kernel, delayed": HOST_KERNEL + ["optimizer.delayed_update=True"]}


def write_stdlib_corpus(path: str) -> dict:
  """Writes the standard library's ``.py`` files (no tests, no site-packages), in path order."""
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  skip = {"site-packages", "dist-packages", "test", "tests", "idlelib"}
  files = sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))
  text = "\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in files)
  data = text.encode("utf-8")
  pathlib.Path(path).write_bytes(data)
  return {"file": path, "python_stdlib": str(root), "files": len(files), "bytes": len(data),
          "sha256": hashlib.sha256(data).hexdigest()}


def moving_average(values: np.ndarray, window: int) -> np.ndarray:
  return np.convolve(values, np.ones(window) / window, mode="valid")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", help="a trainer config (default: the tiny model)")
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--window", type=int, default=20, help="steps in the moving average")
  parser.add_argument("--out", default="docs/benchmarks/delayed_vs_exact_tiny")
  parser.add_argument("--delay-after", type=int, action="append", default=[], metavar="N",
                      help="also run the delayed update after N exact ones (repeatable)")
  parser.add_argument("--skip", action="append", default=[], choices=["exact", "delayed"],
                      help="leave out the exact or the always-delayed run (repeatable)")
  parser.add_argument("--predict-weights", action="store_true",
                      help="run the delayed settings with optimizer.delayed_update_predict_weights")
  parser.add_argument("--stdlib-corpus", metavar="FILE",
                      help="write the Python standard library's sources to FILE and train on it")
  parser.add_argument("overrides", nargs="*", metavar="section.key=value")
  args = parser.parse_args()
  corpus = write_stdlib_corpus(args.stdlib_corpus) if args.stdlib_corpus else None
  common = ["data.dataset=text", f"train.train_iters={args.steps}", *args.overrides]
  if corpus:
    common.append(f"data.path={corpus['file']}")
  skipped = {f"host kernel, {name}" for name in args.skip}
  runs = {name: extra for name, extra in RUNS.items() if name not in skipped}
  for n in args.delay_after:
    runs[f"host kernel, delayed after {n} exact"] = (
        RUNS["host kernel, delayed"] + [f"optimizer.delayed_update_after={n}"])
  if args.predict_weights:
    runs = {name + (", predicted weights" if "delayed" in name else ""):
            extra + ["optimizer.delayed_update_predict_weights=True"] * ("delayed" in name)
            for name, extra in runs.items()}
  losses = {name: np.array(train(load_config(args.config, common + extra), log=lambda _: None))
            for name, extra in runs.items()}
  reference = losses["no offload"]
  results = []
  for name, curve in losses.items():
    gap = np.abs(curve - reference)
    smooth_gap = np.abs(moving_average(curve, args.window) - moving_average(reference, args.window))
    results.append({"run": name, "losses": curve.tolist(), "first_loss": float(curve[0]),
                    "last_loss": float(curve[-1]), "max_gap": float(gap.max()),
                    "max_gap_step": int(gap.argmax()) + 1,
                    "max_smoothed_gap": float(smooth_gap.max()),
                    "final_smoothed_gap": float(smooth_gap[-1])})
  meta = dict(metadata(sys.argv), config=args.config or "defaults (tiny)", steps=args.steps,
              window=args.window, overrides=common, corpus=corpus)
  lines = [f"# Delayed against exact host updates, {args.steps} steps of text",
           "", f"Device: {meta['device']}; JAX {meta['jax']}; {meta['date']}.",
           f"Command: `{meta['command']}`", "",
           *([f"Text: the Python standard library at {corpus['python_stdlib']}, "
              f"{corpus['files']} files, {corpus['bytes']:,} bytes, sha256 "
              f"{corpus['sha256'][:16]}...", ""] if corpus else []),
           f"| run | loss, first -> last | largest gap from no offload (step) "
           f"| largest gap of {args.window}-step averages | at the end (averaged) |",
           "|---|---|---|---|---|"]
  for r in results:
    lines.append(f"| {r['run']} | {r['first_loss']:.4f} -> {r['last_loss']:.4f} "
                 f"| {r['max_gap']:.2e} ({r['max_gap_step']}) | {r['max_smoothed_gap']:.2e} "
                 f"| {r['final_smoothed_gap']:.2e} |")
  write_report(args.out, meta, results, "\n".join(lines) + "\n")


if __name__ == "__main__":
  main()
