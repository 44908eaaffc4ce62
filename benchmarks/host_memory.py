"""The host memory a training run holds, phase by phase, beside what the guard predicts.

  python benchmarks/host_memory.py --out OUT/host_memory --config configs/llama_1b.yaml \
      optimizer.optimizer_cpu_offload=True optimizer.optimizer_offload_update_on=host_kernel

Runs the trainer for a few steps (``train.train_iters``, 3 unless given) in this
process while a thread samples its RSS every 20 ms, and reports the peak RSS
through each phase (resolving the config and starting JAX, placing the first
weights, building the host kernel, compiling, each step) beside the guard's
figure (``jaxoffload.train.host_memory.needed``) and its parts. Set
``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`` before it to see a GPU's pinned pool capped.
"""

from __future__ import annotations

import argparse
import re
import sys
import threading
import time

from common import metadata, write_report


class RssSampler:
  """The process's peak RSS since the last ``take``, sampled on a thread."""

  def __init__(self, host_rss_bytes, interval_s: float = 0.02):
    self._read, self._peak = host_rss_bytes, 0
    threading.Thread(target=self._sample, args=(interval_s,), daemon=True).start()

  def _sample(self, interval_s: float) -> None:
    while True:
      self._peak = max(self._peak, self._read() or 0)
      time.sleep(interval_s)

  def take(self) -> int:
    peak, self._peak = max(self._peak, self._read() or 0), 0
    return peak


def measure(config_path: str | None, overrides: list[str]) -> dict:
  """Each phase's peak RSS, and the guard's prediction, for one run."""
  from jaxoffload.memory import host_rss_bytes
  from jaxoffload.train import host_memory, launch, load_config, resolve, step
  from jaxoffload.train.loop import run

  sampler, phases = RssSampler(host_rss_bytes), []
  mark = lambda name: phases.append({"phase": name, "peak_rss_bytes": sampler.take()})
  config = load_config(config_path, ["train.train_iters=3", "checkpoint.dir=null",
                                     "logging.progress_bar=False", *overrides])
  launch.size_pinned_pool(config)  # As the trainer's command does, before JAX starts.
  need = host_memory.needed(resolve(config))
  mark("resolve the config, start JAX")
  # The trainer's phases, as it calls them.
  for owner, name, label in ((step, "_init_params", "place the first weights"),
                             (step, "host_adamw", "build the host kernel"),
                             (step.Trainer, "compile", "compile the step")):
    original = getattr(owner, name)
    setattr(owner, name, lambda *a, original=original, label=label, **k: (
        original(*a, **k), mark(label))[0])
  steps = lambda line: [mark(f"step {n}") for n in re.findall(r"\bstep (\d+)/", line)]
  result = run(config, log=steps)
  return {"needed_bytes": need.total, "needed_parts": {**need.held, **need.transient},
          "pinned_array_bytes": need.pinned, "phases": phases,
          "peak_rss_bytes": max(p["peak_rss_bytes"] for p in phases),
          "step_s": [r.step_s for r in result.records]}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", help="the trainer config (default: the tiny model)")
  parser.add_argument("--out", default="host_memory", help="report path, without .json/.md")
  parser.add_argument("overrides", nargs="*", metavar="section.key=value")
  args = parser.parse_args()
  result = measure(args.config, args.overrides)
  gib = lambda n: f"{n / 2**30:.2f} GiB"
  lines = [f"# Host memory by phase ({args.config or 'the tiny model'} "
           f"{' '.join(args.overrides)})", "",
           f"Predicted by the guard: {gib(result['needed_bytes'])} (" + ", ".join(
               f"{name} {gib(n)}" for name, n in result["needed_parts"].items() if n) + ")",
           "", "| phase | peak RSS |", "|---|---|",
           *[f"| {p['phase']} | {gib(p['peak_rss_bytes'])} |" for p in result["phases"]]]
  write_report(args.out, metadata(sys.argv), [result], "\n".join(lines) + "\n")


if __name__ == "__main__":
  main()
