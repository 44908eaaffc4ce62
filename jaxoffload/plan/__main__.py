"""``python -m jaxoffload.plan``: the table of candidates and the fastest that fits."""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from jaxoffload import plan as planner
from jaxoffload.train import host_memory, launch, load_config
from jaxoffload.train.config import ConfigError


def main(argv: Optional[list[str]] = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m jaxoffload.plan",
                                   description=planner.__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", help="the trainer config to plan for")
  parser.add_argument("--device-memory", type=int, default=None,
                      help="bytes each device gives the step; default: what JAX reports")
  parser.add_argument("--offload-only", action="store_true",
                      help="keep the config's activation setting, micro-batch size and place of "
                           "the host kernel's gradient sums")
  parser.add_argument("overrides", nargs="*", metavar="section.key=value")
  args = parser.parse_args(argv)
  try:
    config = load_config(args.config, args.overrides)
    launch.keep_compiled(config)
    budgets = planner.budgets_of(config, args.device_memory)
    print("device budget "
          + ("unknown (on a CPU, XLA counts every buffer as device memory: no step is "
             "compiled, the host budget decides)"
             if budgets.device is None else host_memory.size(budgets.device))
          + f", host budget {host_memory.size(budgets.host)}")
    best, rows = planner.plan(config, budgets, explore=not args.offload_only)
  except ConfigError as error:
    print(f"error: {error}", file=sys.stderr)
    raise SystemExit(2) from None
  print("\n".join(planner.table(rows, best)))
  if best is None:
    print("error: no candidate fits this machine: lower train.global_batch_size or give the "
          "run more host memory (train.host_memory_limit)", file=sys.stderr)
    raise SystemExit(2)
  command = " ".join(["python -m jaxoffload.train"]
                     + (["--config", args.config] if args.config else []) + args.overrides
                     + list(best.overrides))
  print(f"fastest that fits: {best.activations}, micro-batch {best.micro_batch_size}, offload "
        f"{best.fraction:.2f} on {best.update_on}, {best.moments} moments: predicted "
        f"{best.step_s * 1e3:,.1f} ms a step\n  {command}")


if __name__ == "__main__":
  main()
