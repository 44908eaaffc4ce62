"""Held-out loss of compact optimizer state against exact float32 AdamW, on a corpus no run memorises.

  python benchmarks/compact_quality.py --config configs/llama_1b.yaml --steps 1000 \
      --out benchmarks/runs/compact_quality

The corpus is this Python installation's standard library: each of its ``.py``
sources (none from site-packages or its test suites) one document of a JSONL
file, read as UTF-8 bytes; tens of megabytes, so a run of a few thousand
sequences sees each byte about once. The trainer holds out its last
``eval.fraction`` at a document boundary. Each setting trains from the same
seed in its own process with the device placement (the host kernel updates
the same storage bit for bit: tests/test_compact_moments.py), and reports its
last held-out loss beside the exact run's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile

from common import metadata, write_report

BFLOAT16_MOMENTS = ["optimizer.exp_avg_dtype=bfloat16", "optimizer.exp_avg_sq_dtype=bfloat16"]
SETTINGS = {
    "float32 master, float32 moments (exact)": [],
    "float32 master, bfloat16 moments": BFLOAT16_MOMENTS,
    "float32 master, 8-bit moments": ["optimizer.exp_avg_dtype=int8",
                                      "optimizer.exp_avg_sq_dtype=int8"],
    "bfloat16 master (stochastic rounding), bfloat16 moments": [
        "model.params_dtype=bfloat16"] + BFLOAT16_MOMENTS,
}


def write_corpus(source: str, path: str) -> dict:
  """Writes each ``.py`` file under ``source`` (no site-packages, no tests) as a JSONL line."""
  skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
  files = sorted(os.path.join(root, name) for root, dirs, names in os.walk(source)
                 if not skip & set(os.path.relpath(root, source).split(os.sep))
                 for name in names if name.endswith(".py"))
  size = 0
  with open(path, "w", encoding="utf-8") as out:
    for file in files:
      with open(file, encoding="utf-8", errors="replace") as f:
        text = f.read()
      size += len(text.encode("utf-8"))
      out.write(json.dumps({"text": text}) + "\n")
  return {"source": source, "files": len(files), "bytes": size}


def run_setting(name: str, args: argparse.Namespace, corpus: str) -> dict:
  """Trains one setting in its own process; its last held-out loss and step records."""
  records = os.path.join(args.work, name.split(",")[0].replace(" ", "_") + f"_{len(name)}.jsonl")
  if os.path.exists(records):
    os.remove(records)
  command = [sys.executable, "-m", "jaxoffload.train", *(["--config", args.config] * bool(
      args.config)), "data.dataset=text", f"data.path={corpus}", f"train.train_iters={args.steps}",
             f"eval.interval={args.eval_interval}", f"eval.iters={args.eval_iters}",
             f"logging.jsonl={records}", "logging.progress_bar=False", *args.overrides,
             *SETTINGS[name]]
  out = subprocess.run(command, capture_output=True, text=True, check=False)
  if out.returncode != 0:
    sys.stderr.write(out.stderr[-3000:])
    raise SystemExit(f"{name} failed (exit status {out.returncode})")
  with open(records) as f:
    steps = [json.loads(line) for line in f]
  evaluated = [r for r in steps if r.get("eval_loss") is not None]
  return {"setting": name, "overrides": SETTINGS[name], "eval_loss": evaluated[-1]["eval_loss"],
          "eval_curve": [(r["step"], r["eval_loss"]) for r in evaluated],
          "train_loss": steps[-1]["loss"], "step_s": sorted(r["step_s"] for r in steps)[len(steps) // 2]}


def table(meta: dict, results: list[dict]) -> str:
  exact = results[0]["eval_loss"]
  corpus = meta["corpus"]
  lines = [f"# Compact optimizer state: held-out loss after {meta['steps']} steps", "",
           f"{meta['device']}, JAX {meta['jax']}, {meta['date']}: `{meta['command']}`; corpus "
           f"{corpus['files']} files, {corpus['bytes'] / 1e6:.1f} MB (Python {meta['python']}).",
           "", "| setting | held-out loss | vs exact | last training loss | step (median) |",
           "|---|---|---|---|---|"]
  for r in results:
    lines.append(f"| {r['setting']} | {r['eval_loss']:.4f} | {r['eval_loss'] / exact - 1:+.2%} "
                 f"| {r['train_loss']:.4f} | {r['step_s'] * 1e3:.0f} ms |")
  return "\n".join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", default=None, help="the trainer config (default: tiny)")
  parser.add_argument("--steps", type=int, default=1000)
  parser.add_argument("--eval-interval", type=int, default=250)
  parser.add_argument("--eval-iters", type=int, default=20)
  parser.add_argument("--source", default=sysconfig.get_paths()["stdlib"],
                      help="the directory whose .py files make the corpus")
  parser.add_argument("--settings", default=",".join(str(i) for i in range(len(SETTINGS))),
                      help="which settings, by their index in the table, comma-separated")
  parser.add_argument("--work", default=None,
                      help="where the corpus and records go (default: a temporary directory)")
  parser.add_argument("--out", default="benchmarks/runs/compact_quality")
  parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                      help="for every setting, e.g. train.global_batch_size=4")
  args = parser.parse_args()
  with tempfile.TemporaryDirectory() as temporary:
    args.work = args.work or temporary
    os.makedirs(args.work, exist_ok=True)
    corpus = os.path.join(args.work, "corpus.jsonl")
    meta = {**metadata(sys.argv), "corpus": write_corpus(args.source, corpus),
            "python": sys.version.split()[0], "steps": args.steps}
    names = [list(SETTINGS)[int(i)] for i in args.settings.split(",")]
    results = []
    for name in names:
      results.append(run_setting(name, args, corpus))
      print(json.dumps({k: results[-1][k] for k in ("setting", "eval_loss", "step_s")}),
            flush=True)
  write_report(args.out, meta, results, table(meta, results))


if __name__ == "__main__":
  main()
