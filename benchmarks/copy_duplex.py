"""Do copies to and from host memory run at once? Four ways to move one buffer each way.

  PYTHONPATH=. python3 benchmarks/copy_duplex.py --gib 2 --out benchmarks/runs/copy_duplex_h200

An exact offloaded update must bring its moments in and send them back between
the backward pass and the next forward pass. If both directions ran at once,
streaming the state in pieces (piece i + 1 in while piece i goes out) would
take one direction's time instead of both. This times, for a buffer of
``--gib`` GiB each way:

- ``in``: one jitted program copying a pinned-host buffer to the device;
- ``out``: one copying a device buffer to pinned host;
- ``both, one program``: the two independent copies in one jitted program;
- ``both, device_put``: the two copies as back-to-back ``jax.device_put`` calls
  outside any program (the runtime's transfer path), waited for together.

Times are medians of ``--repeats`` runs after one warm-up; "GB/s" is the bytes
moved (both directions for the "both" rows) over that time. Duplex shows as a
"both" row near the slower single direction's time.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

from common import median, metadata, time_steps, write_report

to_device = lambda x: jax.device_put(x, jax.memory.Space.Device)
to_host = lambda x: jax.device_put(x, jax.memory.Space.Host)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--gib", type=float, default=2.0, help="size of each buffer")
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--out", default="benchmarks/runs/copy_duplex")
  parser.add_argument("--dump", metavar="FILE",
                      help="also write the compiled program of 'both, one program'")
  args = parser.parse_args()

  elements = int(args.gib * 2**30) // 4
  device = jax.devices()[0]
  device_sharding = jax.sharding.SingleDeviceSharding(device)
  host_sharding = device_sharding.with_memory_kind("pinned_host")
  on_device = jax.device_put(jnp.arange(elements, dtype=jnp.float32), device_sharding)
  on_host = jax.device_put(on_device + 1, host_sharding)
  nbytes = elements * 4

  copy_in = jax.jit(to_device)
  copy_out = jax.jit(to_host)
  copy_both = jax.jit(lambda h, d: (to_device(h), to_host(d)))

  def timed(copies) -> float:
    return median(time_steps(copies, args.repeats))

  if args.dump:
    with open(args.dump, "w") as f:
      f.write(copy_both.lower(on_host, on_device).compile().as_text())
  rows = {
      "in": (timed(lambda: copy_in(on_host)), nbytes),
      "out": (timed(lambda: copy_out(on_device)), nbytes),
      "both, one program": (timed(lambda: copy_both(on_host, on_device)), 2 * nbytes),
      "both, device_put": (timed(lambda: (jax.device_put(on_host, device_sharding),
                                          jax.device_put(on_device, host_sharding))),
                           2 * nbytes),
  }
  # The copies must have moved the values, or the times mean nothing.
  back, out = copy_both(on_host, on_device)
  assert bool(jnp.array_equal(back, on_device + 1)), "copy in changed the values"
  assert out.sharding.memory_kind == "pinned_host" and back.sharding.memory_kind == "device"

  meta = metadata(sys.argv)
  results = [{"copies": name, "seconds": s, "bytes": b, "gb_per_s": b / s / 1e9}
             for name, (s, b) in rows.items()]
  single = max(rows["in"][0], rows["out"][0])
  lines = [f"# Copies to and from host memory, {args.gib:g} GiB each way",
           "", f"Device: {meta['device']}; JAX {meta['jax']}; {meta['date']}.",
           f"Command: `{meta['command']}`", "",
           "| copies | median (ms) | GB/s | vs the slower single direction |",
           "|---|---|---|---|"]
  lines += [f"| {r['copies']} | {1e3 * r['seconds']:.2f} | {r['gb_per_s']:.1f} "
            f"| {r['seconds'] / single:.2f}x |" for r in results]
  write_report(args.out, meta, results, "\n".join(lines) + "\n")


if __name__ == "__main__":
  main()
