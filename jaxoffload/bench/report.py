"""What ``python -m jaxoffload.bench`` writes: the JSON records, a markdown table and plots."""

from __future__ import annotations

import json
import os
from typing import Any, Optional

from jaxoffload.bench.settings import NOISE_FLOOR
from jaxoffload.train.loading import parse_override

GIB = 2**30


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
    label = curve_label(r)
    if label is not None:
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


def curve_label(result: dict) -> Optional[str]:
  """The memory plot's curve for a setting that offloads the optimizer alone at a fraction it
  names; None for others (their point is on the frontier plot).

  A curve holds one point per fraction, so what the default settings vary
  besides the fraction (placement, overlap, transfer dtype) goes into the label.
  """
  place = _override(result, "optimizer.optimizer_offload_update_on")
  if (place is None or _override(result, "optimizer.optimizer_offload_fraction") is None
      or _override(result, "model.cpu_offloading")):
    return None
  # Left alone, the overlap is the placement's default (host_kernel overlaps, device does
  # not), so only a value written in the setting is named.
  overlap = _override(result, "optimizer.overlap_cpu_optimizer_d2h_h2d")
  transfers = _override(result, "optimizer.offload_transfer_dtype")
  return " ".join([f"update on {place}"]
                  + (["bf16 transfers"] if transfers == "bfloat16" else [])
                  + ({True: ["overlapped"], False: ["no overlap"]}.get(overlap, [])))


def _override(result: dict, key: str) -> Any:
  """The value a setting gives ``key``, read as the trainer reads it (YAML: "False" is
  False); None when it leaves it alone."""
  values = [parse_override(o)[1] for o in result["overrides"] if o.split("=", 1)[0] == key]
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
