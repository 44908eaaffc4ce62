"""Price every offload setting for your model and machine: ``python -m jaxoffload.bench``.

  python -m jaxoffload.bench --config configs/llama_1b.yaml --steps 10 --out bench/llama_1b

Runs the trainer once per setting (baseline, twice; optimizer offload at
fractions 0.25, 0.5 and 1.0 with each update placement, the device placement
with and without overlapped copies, and the host kernel's delayed update and
bfloat16 transfers at 1.0; activation offload of half and of all but one
layer; both offloads together), each in a fresh process so that no setting's
memory shows in another's, on the same data and seed. Reports per
setting the median and spread of step time, tokens/s, MFU, peak device memory
(measured, and XLA's compiled estimate), pinned host memory, the step-time and
memory ratios against the baseline, and the largest loss difference from the
baseline. Writes OUT.json, OUT.md and, with matplotlib, OUT_memory.png and
OUT_frontier.png; ``--replot OUT.json`` redraws the plots elsewhere, and
``--resume`` runs only the settings OUT.json lacks (after a run cut short).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
from typing import Optional

import jax

from jaxoffload.config import ConfigError, load_config, validate
from jaxoffload.model import offloaded_activation_bytes
from jaxoffload.train import llama_config, run

GIB = 2**30
FRACTIONS = (0.25, 0.5, 1.0)
NOISE_FLOOR = "baseline again"


def default_settings(num_layers: int, bfloat16_compute: bool) -> dict[str, list[str]]:
  """Setting name -> trainer overrides; the baseline first. bfloat16 transfers of the host
  kernel's weights and gradients are priced only for a model that computes in bfloat16."""
  optimizer = lambda f, place: ["optimizer.optimizer_cpu_offload=True",
                                f"optimizer.optimizer_offload_fraction={f}",
                                f"optimizer.optimizer_offload_update_on={place}"]
  activations = lambda n: ["model.cpu_offloading=True", f"model.cpu_offloading_num_layers={n}"]
  # The baseline twice: their loss and time differences are the noise floor
  # (nondeterministic kernels, clocks) that every other setting's are read against.
  settings = {"baseline": [], NOISE_FLOOR: []}
  for f in FRACTIONS:
    settings[f"optimizer {f} device"] = optimizer(f, "device")
  for f in FRACTIONS:
    settings[f"optimizer {f} device overlap"] = (
        optimizer(f, "device") + ["optimizer.overlap_cpu_optimizer_d2h_h2d=True"])
  for n in sorted({max(num_layers // 2, 1), num_layers - 1}):
    settings[f"activations {n} layers"] = activations(n)
  settings[f"optimizer 0.5 device + activations {num_layers - 1} layers"] = (
      optimizer(0.5, "device") + activations(num_layers - 1))
  for f in FRACTIONS:
    settings[f"optimizer {f} host_kernel"] = optimizer(f, "host_kernel")
  delayed = ["optimizer.delayed_update=True"]
  halved = ["optimizer.offload_transfer_dtype=bfloat16"]
  settings["optimizer 1.0 host_kernel delayed"] = optimizer(1.0, "host_kernel") + delayed
  if bfloat16_compute:
    settings["optimizer 1.0 host_kernel bf16 transfers"] = optimizer(1.0, "host_kernel") + halved
    settings["optimizer 1.0 host_kernel delayed bf16 transfers"] = (
        optimizer(1.0, "host_kernel") + delayed + halved)
  # The slowest last, so that a run cut short has the rest.
  for f in FRACTIONS:
    settings[f"optimizer {f} host"] = optimizer(f, "host")
  return settings


def predicted_activation_bytes(config) -> int:
  """What the config's activation offload moves to the host in one forward pass, by arithmetic."""
  return offloaded_activation_bytes(llama_config(config), validate(config),
                                    config.train.micro_batch_size, config.model.seq_length)


def measure(config_path: Optional[str], overrides: list[str]) -> dict:
  """One setting's figures, from a trainer run in this process."""
  config = load_config(config_path, overrides)
  result = run(config, log=lambda line: print(line, file=sys.stderr))
  times = [r.step_s for r in result.records]
  last = result.records[-1]
  return {
      "step_s": times, "step_s_median": statistics.median(times),
      "step_s_min": min(times), "step_s_max": max(times),
      "tokens_per_s": statistics.median(r.tokens_per_s for r in result.records),
      "mfu": statistics.median(r.mfu for r in result.records) if last.mfu is not None else None,
      "losses": result.losses,
      "peak_device_bytes": last.peak_device_bytes,
      "compiled_device_bytes": result.compiled_device_bytes,
      "compiled_host_temp_bytes": result.compiled_host_temp_bytes,
      "offloaded_state_bytes": result.offloaded_state_bytes,
      "offloaded_activation_bytes": predicted_activation_bytes(config),
      "pinned_host_bytes": last.pinned_host_bytes,
      "device": jax.devices()[0].device_kind, "device_count": jax.device_count(),
      "jax": jax.__version__,
  }


def compare(results: list[dict]) -> None:
  """Adds each setting's ratios and loss difference against the first (the baseline)."""
  base = results[0]
  base_bytes = base["peak_device_bytes"] or base["compiled_device_bytes"]
  for r in results:
    r["step_ratio"] = r["step_s_median"] / base["step_s_median"]
    r["device_bytes"] = r["peak_device_bytes"] or r["compiled_device_bytes"]
    r["memory_ratio"] = r["device_bytes"] / base_bytes
    # What the arithmetic says leaves the device: offloaded state and activations.
    # Offloaded layers also recompute what they do not offload, so their
    # measured saving can pass the prediction.
    r["predicted_saving_bytes"] = r["offloaded_state_bytes"] + r["offloaded_activation_bytes"]
    r["measured_saving_bytes"] = base_bytes - r["device_bytes"]
    r["max_abs_loss_diff"] = max(abs(a - b) for a, b in zip(r["losses"], base["losses"]))


def markdown(meta: dict, results: list[dict]) -> str:
  mfu = lambda r: f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
  gib = lambda b: f"{b / GIB:.2f}" if b is not None else "-"
  lines = [
      f"# Offload settings for `{meta['config']}`, {meta['steps']} steps each",
      "",
      f"Device: {meta['device_count']} x {meta['device']}; JAX {meta['jax']}; "
      f"{meta['host_cores']} host cores; {meta['date']}"
      + (f"; XLA_FLAGS `{meta['xla_flags']}`." if meta.get("xla_flags") else "."),
      f"Command: `{meta['command']}`",
      "",
      "| setting | step (s) median [min, max] | vs baseline | tokens/s | MFU | peak device (GiB) "
      "| XLA estimate (GiB) | memory vs baseline | predicted / measured saving (GiB) "
      "| pinned host (GiB) | max loss diff |",
      "|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in results:
    lines.append(
        f"| {r['setting']} | {r['step_s_median']:.4f} [{r['step_s_min']:.4f}, "
        f"{r['step_s_max']:.4f}] | {r['step_ratio']:.2f}x | {r['tokens_per_s']:,.0f} | {mfu(r)} "
        f"| {gib(r['peak_device_bytes'])} | {gib(r['compiled_device_bytes'])} "
        f"| {r['memory_ratio']:.2f} | {gib(r['predicted_saving_bytes'])} / "
        f"{gib(r['measured_saving_bytes'])} | {gib(r['pinned_host_bytes'])} "
        f"| {r['max_abs_loss_diff']:.2e} |")
  noise = [r for r in results if r["setting"] == NOISE_FLOOR]
  offloads = [r for r in results[1:] if r["setting"] != NOISE_FLOOR]
  worst = max(offloads or results, key=lambda r: r["max_abs_loss_diff"])
  lines += ["", f"Largest loss difference from the baseline: {worst['max_abs_loss_diff']:.2e} "
            f"({worst['setting']})."]
  if noise:
    lines.append(f"The baseline run again, the noise floor of nondeterministic kernels: "
                 f"{noise[0]['max_abs_loss_diff']:.2e}, {noise[0]['step_ratio']:.2f}x.")
  return "\n".join(lines) + "\n"


def plot(out: str, results: list[dict]) -> list[str]:
  """The memory/step-time plots against offload fraction and the frontier; their paths."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (memory, ratio) = plt.subplots(1, 2, figsize=(11, 4))
  # One curve per way of updating: the baseline, then the settings that offload
  # the optimizer alone that way.
  curves: dict[str, list] = {}
  for r in results:
    place = _override(r, "optimizer.optimizer_offload_update_on")
    if place is None or _override(r, "model.cpu_offloading") is not None:
      continue
    label = " ".join([f"update on {place}"]
                     + ["overlapped"] * (_override(r, "optimizer.overlap_cpu_optimizer_d2h_h2d")
                                         is not None)
                     + ["delayed"] * (_override(r, "optimizer.delayed_update") is not None))
    curves.setdefault(label, [(0.0, results[0])]).append(
        (float(_override(r, "optimizer.optimizer_offload_fraction")), r))
  for label, points in curves.items():
    xs = [f for f, _ in points]
    memory.plot(xs, [r["device_bytes"] / GIB for _, r in points], "o-", label=label)
    ratio.plot(xs, [r["step_ratio"] for _, r in points], "o-", label=label)
  memory.set(xlabel="optimizer_offload_fraction", ylabel="peak device memory (GiB)")
  ratio.set(xlabel="optimizer_offload_fraction", ylabel="step time / baseline")
  for axis in (memory, ratio):
    axis.grid(alpha=0.3)
    axis.legend()
  fig.tight_layout()
  paths = [out + "_memory.png", out + "_frontier.png"]
  fig.savefig(paths[0], dpi=120)
  fig, axis = plt.subplots(figsize=(7, 5))
  for r in results:
    axis.scatter(r["device_bytes"] / GIB, r["step_ratio"])
    axis.annotate(r["setting"], (r["device_bytes"] / GIB, r["step_ratio"]), fontsize=7,
                  xytext=(4, 2), textcoords="offset points")
  axis.set(xlabel="peak device memory (GiB)", ylabel="step time / baseline",
           title="Memory against time, every setting")
  axis.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(paths[1], dpi=120)
  return paths


def _override(result: dict, key: str) -> Optional[str]:
  """The value a setting gives ``key``, as written; None when it leaves it alone."""
  values = [o.split("=", 1)[1] for o in result["overrides"] if o.split("=", 1)[0] == key]
  return values[-1] if values else None


def write(out: str, meta: dict, results: list[dict]) -> str:
  """Writes OUT.json and OUT.md; returns the table."""
  os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
  with open(out + ".json", "w") as f:
    json.dump({"meta": meta, "results": results}, f, indent=1)
  table = markdown(meta, results)
  with open(out + ".md", "w") as f:
    f.write(table)
  return table


def replot(json_path: str) -> None:
  """Draws the plots of a results file beside it, where matplotlib is installed."""
  try:
    import matplotlib  # noqa: F401
  except ImportError:
    print(f"matplotlib is not installed: no plots (pip install 'jaxoffload[bench]', then "
          f"python -m jaxoffload.bench --replot {json_path})")
    return
  with open(json_path) as f:
    results = json.load(f)["results"]
  for path in plot(json_path[:-len(".json")], results):
    print(f"wrote {path}")


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
  parser = argparse.ArgumentParser(prog="python -m jaxoffload.bench", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", help="the trainer config to price (default: the tiny model)")
  parser.add_argument("--steps", type=int, default=10, help="steps per setting")
  parser.add_argument("--settings", help="comma-separated names from the default matrix "
                                         "(the baseline is always run first)")
  parser.add_argument("--out", default="bench/results", help="output path prefix")
  parser.add_argument("--xla-flags", default="",
                      help="XLA_FLAGS for every setting (write --xla-flags=...); on a GPU, "
                           "--xla-flags=--xla_gpu_deterministic_ops=true "
                           "makes equal programs give equal losses (see docs/benchmarks)")
  parser.add_argument("--replot", metavar="JSON", help="only redraw the plots of a results file")
  parser.add_argument("--resume", action="store_true",
                      help="keep the settings OUT.json holds (same config and steps), run the rest")
  parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                      help="applied to every setting")
  args = parser.parse_args(argv)
  if args.replot:
    replot(args.replot)
    return
  if args.child:
    print(json.dumps(measure(args.config, args.overrides)))
    return

  common = [*args.overrides, f"train.train_iters={args.steps}", "checkpoint.dir=null",
            "logging.progress_bar=False"]
  try:
    model = load_config(args.config, common).model
    matrix = default_settings(model.num_layers, model.dtype == "bfloat16")
    if args.settings:
      chosen = [name.strip() for name in args.settings.split(",")]
      unknown = [name for name in chosen if name not in matrix]
      if unknown:
        raise ConfigError(f"unknown settings {unknown}; known: {list(matrix)}")
      matrix = {name: matrix[name] for name in ["baseline", *chosen]}
    for overrides in matrix.values():
      load_config(args.config, common + overrides)
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
    command = [sys.executable, "-m", "jaxoffload.bench", "--child"]
    command += (["--config", args.config] if args.config else []) + common + overrides
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
      sys.stderr.write(done.stderr[-3000:])
      raise SystemExit(f"setting {name!r} failed (exit status {done.returncode})")
    results.append({"setting": name, "overrides": overrides,
                    **json.loads(done.stdout.strip().splitlines()[-1])})
    print(f"{name}: median step {results[-1]['step_s_median'] * 1e3:.1f} ms", flush=True)
    compare(results)
    # From the children: this process never starts a backend, which on a GPU
    # would take its share of the memory the settings are measured in.
    meta = {"config": args.config or "(defaults)", "steps": args.steps,
            **{key: results[0][key] for key in ("device", "device_count", "jax")},
            "host_cores": os.cpu_count(), "date": datetime.date.today().isoformat(),
            "xla_flags": env["XLA_FLAGS"],
            "command": (earlier_command + "python -m jaxoffload.bench "
                        + shlex.join(argv or sys.argv[1:]))}
    table = write(args.out, meta, results)  # After every setting: a cut-short run keeps its part.
  if table is None:
    print(f"nothing left to run: {args.out}.json holds every setting")
    return
  print(table)
  replot(args.out + ".json")


if __name__ == "__main__":
  main()
