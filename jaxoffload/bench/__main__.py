"""Price every offload setting for your model and machine: ``python -m jaxoffload.bench``.

  python -m jaxoffload.bench --config configs/llama_1b.yaml --steps 10 --out bench/llama_1b

Runs the trainer once per setting (baseline, twice, as a program per layer and as
one program with its layers' loop unrolled, or kept where the config unrolls it;
optimizer offload at fractions 0.25, 0.5 and 1.0 with every other key at its
default, then with each update placement, the device placement and the host
kernel with and without overlap, and the host kernel with bfloat16 transfers (a
model that computes in bfloat16); activation offload of half and of all but one
layer; both offloads together), each in a fresh process so that no setting's
memory shows in another's, on the same data and seed. Reports per
setting the median and spread of step time, tokens/s, MFU, peak device memory
(measured, and XLA's compiled estimate), pinned host memory, the step-time and
memory ratios against the baseline, and the largest loss difference from the
baseline. Writes OUT.json, OUT.md and, with matplotlib, OUT_memory.png and
OUT_frontier.png; ``--replot OUT.json`` redraws the plots elsewhere, and
``--resume`` runs only the settings OUT.json lacks (after a run cut short).
``--setting 'NAME=key=value ...'`` adds a setting of your own (the baseline is
the config with the overrides common to all).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
from typing import Optional

from jaxoffload.bench import report, settings
from jaxoffload.train import ConfigError, load_config


def resumed(args: argparse.Namespace) -> tuple[list[dict], str]:
  """The results OUT.json holds, if it measured this config for as many steps, and the
  command that made them; nothing without it."""
  path = args.out + ".json"
  if not os.path.exists(path):
    return [], ""
  with open(path) as f:
    saved = json.load(f)
  config = args.config or "(defaults)"
  if (saved["meta"]["config"], saved["meta"]["steps"]) != (config, args.steps):
    raise SystemExit(f"--resume: {path} measured {saved['meta']['config']} for "
                     f"{saved['meta']['steps']} steps, not {config} for {args.steps}")
  print(f"resumed {len(saved['results'])} settings from {path}", flush=True)
  return saved["results"], saved["meta"]["command"] + ", then "


def main(argv: Optional[list[str]] = None) -> None:
  args = _parser().parse_args(argv)
  if args.replot:
    report.replot(args.replot)
    return
  if args.child:
    print(json.dumps(settings.measure(args.config, args.overrides)))
    return
  common = [*args.overrides, f"train.train_iters={args.steps}", "checkpoint.dir=null",
            "logging.progress_bar=False"]
  try:
    matrix = _matrix(args, common)
  except ConfigError as error:
    print(f"error: {error}", file=sys.stderr)
    raise SystemExit(2) from None
  env = dict(os.environ)
  env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {args.xla_flags}".strip()
  results, earlier_command = resumed(args) if args.resume else ([], "")
  table = None
  for name, overrides in matrix.items():
    if name in {r["setting"] for r in results}:
      continue
    results.append({"setting": name, "overrides": overrides,
                    **_run_child(args.config, common + overrides, env, name)})
    print(f"{name}: median step {results[-1]['step_s_median'] * 1e3:.1f} ms", flush=True)
    settings.compare(results)
    # From the children: this process never starts a backend, which on a GPU
    # would take its share of the memory the settings are measured in.
    meta = {"config": args.config or "(defaults)", "steps": args.steps,
            **{key: results[0][key] for key in ("device", "device_count", "jax")},
            "host_cores": os.cpu_count(), "date": datetime.date.today().isoformat(),
            "xla_flags": env["XLA_FLAGS"],
            "command": (earlier_command + "python -m jaxoffload.bench "
                        + shlex.join(argv or sys.argv[1:]))}
    # After every setting: a run cut short keeps its part.
    table = report.write(args.out, meta, results)
  if table is None:
    print(f"nothing left to run: {args.out}.json holds every setting")
    return
  print(table)
  report.replot(args.out + ".json")


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="python -m jaxoffload.bench", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", help="the trainer config to price (default: the tiny model)")
  parser.add_argument("--steps", type=int, default=10, help="steps per setting")
  parser.add_argument("--settings", help="comma-separated names from the default matrix "
                                         "(the baseline is always run first)")
  parser.add_argument("--setting", action="append", default=[], metavar="NAME=OVERRIDES",
                      help="a setting of your own, repeatable: its name, '=', and its "
                           "overrides, space-separated (then only the baseline, these and "
                           "--settings run)")
  parser.add_argument("--out", default="bench/results", help="output path prefix")
  parser.add_argument("--xla-flags", default="",
                      help="XLA_FLAGS for every setting (write --xla-flags=...); on a GPU, "
                           "--xla-flags=--xla_gpu_deterministic_ops=true "
                           "makes equal programs give equal losses")
  parser.add_argument("--replot", metavar="JSON", help="only redraw the plots of a results file")
  parser.add_argument("--resume", action="store_true",
                      help="keep the settings OUT.json holds (same config and steps), run the rest")
  parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                      help="applied to every setting")
  return parser


def _matrix(args: argparse.Namespace, common: list[str]) -> dict[str, list[str]]:
  """The settings to run, each checked as a config before any runs."""
  model = load_config(args.config, common).model
  matrix = settings.default_settings(model.num_layers, model.dtype == "bfloat16",
                                     model.scan_layers)
  if model.dtype != "bfloat16" and not args.settings:
    print(settings.BF16_TRANSFERS_NOTE, file=sys.stderr)
  if args.settings or args.setting:
    chosen = [name.strip() for name in (args.settings or "").split(",") if name.strip()]
    unknown = [name for name in chosen if name not in matrix]
    if unknown:
      raise ConfigError(f"unknown settings {unknown}; known: {list(matrix)}")
    matrix = {name: matrix[name] for name in ["baseline", *chosen]}
  for setting in args.setting:
    name, equals, overrides = setting.partition("=")
    if not equals or not name.strip() or name.strip() in matrix:
      raise ConfigError(f"--setting {setting!r}: write NAME=OVERRIDES, a name not already "
                        f"taken ({list(matrix)}) and space-separated section.key=value")
    matrix[name.strip()] = shlex.split(overrides)
  for overrides in matrix.values():
    load_config(args.config, common + overrides)
  return matrix


def _run_child(config: Optional[str], overrides: list[str], env: dict, name: str) -> dict:
  """One setting's figures, measured in a fresh process."""
  command = [sys.executable, "-m", "jaxoffload.bench", "--child"]
  command += (["--config", config] if config else []) + overrides
  done = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
  if done.returncode != 0:
    sys.stderr.write(done.stderr[-3000:])
    raise SystemExit(f"setting {name!r} failed (exit status {done.returncode})")
  return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
  main()
