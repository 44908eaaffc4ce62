"""The planner's pick against its run: predicted step time and peaks beside the measured ones.

  python benchmarks/planner.py --out OUT/planner_8b --steps 4 \
      --config configs/llama_8b_offload.yaml train.global_batch_size=32

In one process the planner (``jaxoffload.plan``) calibrates, searches and
picks; in a fresh one the trainer runs the pick for ``--steps`` steps. The
report gives the planner's table, then the pick's predicted step time, device
peak and host memory beside the median step (the first left out), the
device's peak and the process's peak RSS.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from common import metadata, run_children, write_report


def plan_child(config_path: str, overrides: list[str], device_memory: int | None,
               explore: bool) -> dict:
  from jaxoffload import plan
  from jaxoffload.train import load_config

  config = load_config(config_path, overrides)
  budgets = plan.budgets_of(config, device_memory)
  pick, rows = plan.plan(config, budgets, explore=explore,
                         log=lambda line: print(line, file=sys.stderr))
  return {"table": plan.table(rows, pick), "device_budget": budgets.device,
          "host_budget": budgets.host,
          "pick": None if pick is None else {
              "overrides": list(pick.overrides), "step_s": pick.step_s,
              "device_bytes": pick.device_bytes, "host_bytes": pick.host_bytes}}


def train_child(config_path: str, overrides: list[str], device_memory: int | None,
                explore: bool) -> dict:
  del device_memory, explore  # The pick trains on the whole device: its peak is what it needs.
  from jaxoffload.memory import peak_device_bytes, peak_host_rss_bytes
  from jaxoffload.train import launch, load_config, run

  config = load_config(config_path, overrides + ["logging.progress_bar=False"])
  # Before JAX starts its backends, as the trainer's command does.
  launch.set_xla_flags(config)
  launch.size_pinned_pool(config)
  result = run(config, log=lambda line: print(line, file=sys.stderr))
  times = [r.step_s for r in result.records]
  return {"step_s": times, "median_step_s": statistics.median(times[1:] or times),
          "peak_device_bytes": peak_device_bytes(), "peak_rss_bytes": peak_host_rss_bytes(),
          "losses": result.losses}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", help="the trainer config to plan for")
  parser.add_argument("--out", default="planner", help="report path, without .json/.md")
  parser.add_argument("--steps", type=int, default=4, help="steps the pick trains")
  parser.add_argument("--device-memory", type=int, default=None,
                      help="bytes the plan may use of each device (default: what JAX reports), "
                           "to plan for a smaller device")
  parser.add_argument("--offload-only", action="store_true",
                      help="keep the config's activation setting, micro-batch size and place "
                           "of the host kernel's gradient sums")
  parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
  parser.add_argument("overrides", nargs="*", metavar="section.key=value")
  args = parser.parse_args()
  if args.child:
    work = {"plan": plan_child, "train": train_child}[args.child[0]]
    print(json.dumps(work(args.config, args.child[1:] + args.overrides, args.device_memory,
                          not args.offload_only)))
    return
  common = ((["--config", args.config] if args.config else [])
            + ([f"--device-memory={args.device_memory}"] if args.device_memory else [])
            + (["--offload-only"] if args.offload_only else [])
            + args.overrides)
  result, = run_children(__file__, [["plan"]], common)
  pick = result["pick"]
  lines = [f"# The planner's pick and its run ({' '.join(common)})", "", *result["table"]]
  if pick is None:
    lines.append("\nNothing fits this machine.")
  else:
    ran, = run_children(__file__, [["train", *pick["overrides"],
                                    f"train.train_iters={args.steps}"]], common)
    result["ran"] = ran
    gib = lambda n: "-" if n is None else f"{n / 2**30:.2f} GiB"
    lines += ["", f"Pick: `{' '.join(pick['overrides'])}`", "",
              "| | step | device peak | host |", "|---|---|---|---|",
              f"| predicted | {pick['step_s']:.3f} s | {gib(pick['device_bytes'])} | "
              f"{gib(pick['host_bytes'])} |",
              f"| measured | {ran['median_step_s']:.3f} s | {gib(ran['peak_device_bytes'])} | "
              f"{gib(ran['peak_rss_bytes'])} (peak RSS) |"]
  write_report(args.out, metadata(sys.argv), [result], "\n".join(lines) + "\n")


if __name__ == "__main__":
  main()
