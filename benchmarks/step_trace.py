"""Where a traced training step spends its time: the host's calls and the device's idle gaps.

  python -m jaxoffload.train --config configs/llama_1b.yaml OVERRIDES \\
      logging.profile_dir=OUT/trace logging.profile_start_step=5 logging.profile_steps=2
  PYTHONPATH=. python3 benchmarks/step_trace.py OUT/trace --out OUT/step_trace

Reads the ``jax.profiler`` trace the trainer writes (``logging.profile_dir``)
and reports, for each traced step (``Trainer.step``, up to the next one's start):

- the step's wall time on the host, and the time in each kind of call worth
  naming (dispatching a program, applying the host kernel's update, waiting
  for it, sending a weight-offloaded layer, XLA's CUDA-graph updates), summed by
  name: a call inside another counts in both;
- the outermost of those calls longer than ``--min-ms``, in order, with their
  start in the step (in the JSON);
- on a GPU, the compute stream's busy time between this step's start and the
  next's, and its idle gaps longer than 1 ms: where the device's compute waited
  for the host or for a transfer (the copy streams' time is left out: it may run
  beside the compute, or be what the compute waits for).
"""

from __future__ import annotations

import argparse
import collections
import glob
import re
import sys

import jax

from common import metadata, write_report

STEP = re.compile(r"step\.py:\d+ step$")
# Calls that name what the step waits for or dispatches (jax.profiler's Python tracer).
WORTH_NAMING = re.compile(r"(overlap\.py:\d+ run$| apply_held$| hold$|HostAdamW update|"
                          r"PjitFunction|command_buffer::update|block_until_ready|"
                          r" layer_to_device$| pinned_views$)")


def named_calls(events: list[tuple], start: int, end: int) -> list[tuple]:
  """The events (start, duration, name) within [start, end] worth naming, in order, each
  once: an event inside another of its name (a re-entered wrapper) is left out."""
  found, open_until = [], {}
  for event in events:
    if start <= event[0] and event[0] + event[1] <= end and WORTH_NAMING.search(event[2]):
      if event[0] >= open_until.get(event[2], -1):
        found.append(event)
        open_until[event[2]] = event[0] + event[1]
  return found


def outermost(events: list[tuple]) -> list[tuple]:
  """Of ordered events, those inside no earlier one."""
  kept, reached = [], -1
  for event in events:
    if event[0] >= reached:
      kept.append(event)
      reached = event[0] + event[1]
  return kept


def device_gaps(device: list[tuple], start: int, end: int) -> tuple[float, list]:
  """Busy milliseconds of ``device`` events (start, end) in [start, end), and the gaps."""
  busy, reached, gaps = 0, start, []
  for s, e in device:
    if e <= start or s >= end:
      continue
    s, e = max(s, start), min(e, end)
    if s > reached + 1_000_000:
      gaps.append((round((reached - start) / 1e6, 1), round((s - reached) / 1e6, 1)))
    if e > reached:
      busy, reached = busy + e - max(s, reached), e
  return busy / 1e6, gaps


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("trace_dir", help="the trainer's logging.profile_dir")
  parser.add_argument("--min-ms", type=float, default=2.0, help="list calls at least this long")
  parser.add_argument("--out", default="step_trace")
  args = parser.parse_args()

  paths = glob.glob(f"{args.trace_dir}/**/*.xplane.pb", recursive=True)
  if not paths:
    sys.exit(f"no trace (*.xplane.pb) under {args.trace_dir}: run the trainer with "
             f"logging.profile_dir={args.trace_dir}")
  host, device = [], []
  for plane in jax.profiler.ProfileData.from_file(sorted(paths)[-1]).planes:
    for line in plane.lines:
      if line.name.startswith("python"):  # The Python tracer's thread, named as the binary.
        host += [(e.start_ns, e.duration_ns, e.name) for e in line.events]
      elif plane.name.startswith("/device:") and "Compute" in line.name:
        device += [(e.start_ns, e.start_ns + e.duration_ns) for e in line.events]
  host.sort()
  device.sort()
  steps = [e for e in host if STEP.search(e[2])]
  if not steps:
    names = collections.Counter(e[2] for e in host).most_common(8)
    sys.exit(f"no Trainer.step in the trace under {args.trace_dir}; {len(host)} events on "
             f"its python lines, the most frequent: {names}")

  results, lines = [], []
  for k, step in enumerate(steps):
    # Up to the next step: the host kernel's thread may still be updating after this returns.
    end = steps[k + 1][0] if k + 1 < len(steps) else step[0] + step[1]
    named = named_calls(host, step[0], end)
    totals = collections.Counter()
    for event in named:
      totals[event[2]] += event[1] / 1e6
    calls = [{"at_ms": round((e[0] - step[0]) / 1e6, 1), "ms": round(e[1] / 1e6, 2),
              "call": e[2]} for e in outermost(named) if e[1] >= args.min_ms * 1e6]
    busy, gaps = device_gaps(device, step[0], end)
    results.append({"step": k, "ms": round(step[1] / 1e6, 1),
                    "time_by_call_ms": {n: round(t, 1) for n, t in totals.most_common()},
                    "long_calls": calls, "compute_busy_ms": round(busy, 1) if device else None,
                    "device_window_ms": round((end - step[0]) / 1e6, 1), "device_gaps": gaps})
    lines += [f"## Traced step {k}: {step[1] / 1e6:.1f} ms on the host", "",
              "| call (summed) | ms |", "|---|---|"]
    lines += [f"| `{n}` | {t:.1f} |" for n, t in totals.most_common(12)]
    if device:
      lines += ["", f"Compute busy {busy:.1f} of {(end - step[0]) / 1e6:.1f} ms; idle gaps over "
                    f"1 ms (at ms, ms long): {gaps}"]
    lines += [""]
  meta = metadata(sys.argv)
  table = "\n".join([f"# Where a traced step spends its time: {args.trace_dir}", "",
                     f"JAX {meta['jax']}; {meta['date']}.", ""] + lines)
  write_report(args.out, meta, results, table)


if __name__ == "__main__":
  main()
