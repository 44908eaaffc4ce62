"""The fastest optimizer offload that fits this machine: ``python -m jaxoffload.plan``.

  python -m jaxoffload.plan --config configs/llama_8b_offload.yaml [section.key=value ...]

For the config's model, batch and activation settings, each candidate
optimizer offload (a fraction of the parameter elements, updated on the
device or by the host kernel) is judged before anything is allocated:

- device peak: XLA's memory analysis of the step compiled from shapes alone
  (``Trainer.from_shapes``), against the device's memory less ``DEVICE_HEADROOM``;
- host bytes: the host-memory guard's arithmetic (``train.host_memory``) plus
  what this process holds, against what the machine gives less ``HOST_HEADROOM``;
- time: what offload adds to a step, priced from this machine's measured link
  and host-kernel rates (``jaxoffload.autoplace``); the device's own compute is
  the same for every candidate, so the candidates rank by it alone.

Fractions are tried from the smallest up: the device peak falls and the host
bytes and time rise as more is offloaded, so the first fraction that fits the
device is each placement's fastest, and the ones above it are not compiled.
The pick is the fastest that fits both; the line to train with it is printed.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Optional

import jax

from jaxoffload import autoplace
from jaxoffload.memory import host_rss_bytes, parse_bytes
from jaxoffload.train import host_memory, load_config, resolve, rules, Trainer
from jaxoffload.train.config import Config, ConfigError
from jaxoffload.train.resolve import host_kernel_allowed, price_updates

FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)
DEVICE_HEADROOM = 0.05  # XLA's estimate leaves out fragmentation and the runtime's own use.
HOST_HEADROOM = 0.10  # The guard's arithmetic leaves out allocator growth it cannot see.


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One setting and what it needs.

  Attributes:
    fraction: ``optimizer.optimizer_offload_fraction`` asked for (0: no offload).
    update_on: ``optimizer.optimizer_offload_update_on``.
    achieved: the share of elements the plan offloads (whole leaves).
    device_bytes: XLA's device peak of the step: arguments, outputs and temporaries.
    host_bytes: the host memory the process will hold.
    added_s: the seconds offload is predicted to add to a step.
  """

  fraction: float
  update_on: str
  achieved: float
  device_bytes: int
  host_bytes: int
  added_s: float

  def overrides(self) -> list[str]:
    if not self.fraction:
      return ["optimizer.optimizer_cpu_offload=False"]
    return ["optimizer.optimizer_cpu_offload=True",
            f"optimizer.optimizer_offload_fraction={self.fraction}",
            f"optimizer.optimizer_offload_update_on={self.update_on}"]


def judge(config: Config, fraction: float, update_on: str,
          machine: autoplace.Machine) -> Candidate:
  """``config`` with this optimizer offload, compiled from shapes and priced."""
  optimizer = dataclasses.replace(config.optimizer, optimizer_cpu_offload=fraction > 0,
                                  optimizer_offload_fraction=fraction,
                                  optimizer_offload_update_on=update_on)
  candidate = dataclasses.replace(config, optimizer=optimizer)
  rules.check(candidate)
  setup = resolve(candidate)
  tokens = setup.global_batch(0)
  compiled = Trainer.from_shapes(setup).compile(jax.ShapeDtypeStruct(
      tokens.shape, tokens.dtype, sharding=tokens.sharding))
  host = (host_rss_bytes() or 0) + host_memory.needed(setup).total
  added = 0.0 if setup.offload is None else price_updates(
      setup.config, setup.offload, machine, host_kernel=update_on == "host_kernel"
  ).predicted_s[update_on]
  return Candidate(fraction, update_on, setup.offload.fraction if setup.offload else 0.0,
                   compiled.device_bytes, host, added)


def plan(config: Config, *, device_budget: Optional[int], host_budget: int,
         log=print) -> Optional[Candidate]:
  """Judges the candidates, logs a table, and returns the fastest that fits (None if none).

  Args:
    config: a checked config; its optimizer offload keys are what is planned.
    device_budget: bytes the step may use on each device; None where unknown (CPU).
    host_budget: bytes this process may hold.
  """
  machine = autoplace.measure_machine()
  places = ["device"] + (["host_kernel"] if machine.kernel_rate is not None
                         and host_kernel_allowed(config) else [])
  fits_device = lambda c: device_budget is None or c.device_bytes <= (
      1 - DEVICE_HEADROOM) * device_budget
  fits_host = lambda c: c.host_bytes <= (1 - HOST_HEADROOM) * host_budget
  judged = []
  for update_on in places:
    for fraction in FRACTIONS if update_on == "device" else FRACTIONS[1:]:
      judged.append(judge(config, fraction, update_on, machine))
      if fits_device(judged[-1]):
        break
  log(f"{machine}; device budget "
      + ("unknown (on a CPU, XLA counts every buffer as device memory)" if device_budget is None
         else host_memory.size(device_budget))
      + f", host budget {host_memory.size(host_budget)}")
  log("| offload | update on | achieved | device peak | host | added a step | fits |")
  log("|---|---|---|---|---|---|---|")
  for c in judged:
    short = [name for name, ok in (("device", fits_device(c)), ("host", fits_host(c))) if not ok]
    fits = "no: " + " and ".join(short) if short else "yes"
    log(f"| {c.fraction:.2f} | {c.update_on if c.fraction else '-'} | {c.achieved:.2f} | "
        f"{host_memory.size(c.device_bytes)} | {host_memory.size(c.host_bytes)} | "
        f"{c.added_s * 1e3:,.1f} ms | {fits} |")
  fitting = [c for c in judged if fits_device(c) and fits_host(c)]
  return min(fitting, key=lambda c: c.added_s) if fitting else None


def main(argv: Optional[list[str]] = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m jaxoffload.plan", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", help="the trainer config to plan for")
  parser.add_argument("--device-memory", type=int, default=None,
                      help="bytes each device gives the step; default: what JAX reports")
  parser.add_argument("overrides", nargs="*", metavar="section.key=value")
  args = parser.parse_args(argv)
  try:
    config = load_config(args.config, args.overrides)
    limit = config.train.host_memory_limit
    host_budget = (host_memory.available(None if limit is None else parse_bytes(limit))[0]
                   + (host_rss_bytes() or 0))
    device_budget = args.device_memory or (jax.devices()[0].memory_stats() or {}).get(
        "bytes_limit")
    best = plan(config, device_budget=device_budget, host_budget=host_budget)
  except ConfigError as error:
    print(f"error: {error}", file=sys.stderr)
    raise SystemExit(2) from None
  if best is None:
    print("error: no candidate fits this machine: lower train.micro_batch_size, offload "
          "activations (model.cpu_offloading_num_layers) or weights", file=sys.stderr)
    raise SystemExit(2)
  command = " ".join(["python -m jaxoffload.train"] + (["--config", args.config] if args.config
                                                        else []) + args.overrides
                     + best.overrides())
  print(f"fastest that fits: offload {best.fraction:.2f} on {best.update_on}, predicted "
        f"+{best.added_s * 1e3:,.1f} ms a step:\n  {command}")


if __name__ == "__main__":
  main()
