"""How a layer's weights in pinned host memory reach the device beside the device's compute.

  PYTHONPATH=. python3 benchmarks/fetch_paths.py --out benchmarks/runs/fetch_paths_h200

A stack of ``--layers`` layers of ``--layer-mib`` MiB (bfloat16) lives in
pinned host memory, as the host kernel's weights and weight-offloaded groups do.
Each layer's compute is a chain of matmuls on the device that also reads that
layer's weights. The weights come over either

- ``program``: a jitted program that slices the layer out of the pinned stack
  and copies it to the device (the trainer's ``fetch`` today): a program, so it
  runs in turn with the compute programs; or
- ``device_put``: ``jax.device_put`` of a numpy view of the layer's bytes in the
  same pinned buffer, issued a layer ahead: the runtime's own transfer, which may
  run beside the compute. (The trainer reads the host kernel's weights by the
  program: this way was no faster there, docs' run BW.)

Rows: the compute alone, each fetch alone (its bandwidth), and the compute with
each fetch; medians of ``--repeats`` after a warm-up. A fetch hidden by the
compute shows as a row near "compute alone".
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from common import median, metadata, time_steps, write_report
from jaxoffload.host_adam import writable_view


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--layers", type=int, default=22)
  parser.add_argument("--layer-mib", type=float, default=84.0,
                      help="bytes of one layer's bfloat16 weights (the 1.1B shape's: 84 MiB)")
  parser.add_argument("--width", type=int, default=4096,
                      help="the compute's square matmul size")
  parser.add_argument("--matmuls", type=int, default=8, help="matmuls a layer")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--out", default="benchmarks/runs/fetch_paths")
  args = parser.parse_args()

  device = jax.devices()[0]
  on_device = jax.sharding.SingleDeviceSharding(device)
  pinned = on_device.with_memory_kind("pinned_host")
  row = 4096
  rows = max(int(args.layer_mib * 2**20) // (2 * row), 1)
  stack = jax.device_put(np.ones((args.layers, rows, row), jnp.bfloat16), pinned)
  view = writable_view(stack)  # The same pinned bytes, as numpy.
  x0 = jax.device_put(jnp.ones((args.width, args.width), jnp.bfloat16), on_device)
  w = jax.device_put(jnp.full((args.width, args.width), 1e-4, jnp.bfloat16), on_device)

  @jax.jit
  def layer(x, weights):
    for _ in range(args.matmuls):
      x = jnp.tanh(x @ w)
    return x + weights[0, : args.width].astype(x.dtype).sum() * 0

  program = jax.jit(lambda s, i: jax.lax.dynamic_index_in_dim(s, i, keepdims=False),
                    out_shardings=on_device)
  fetch = {
      "program": lambda i: program(stack, np.int32(i)),
      "device_put": lambda i: jax.device_put(view[i], on_device),
  }
  resident = jax.device_put(np.ones((rows, row), jnp.bfloat16), on_device)

  def compute(get):
    x, ahead = x0, get(0)
    for i in range(args.layers):
      weights = ahead
      if i + 1 < args.layers:
        ahead = get(i + 1)  # Issued before this layer's compute.
      x = layer(x, weights)
    return x

  def fetch_only(get):
    return [get(i) for i in range(args.layers)]

  rows_out = [("compute alone", lambda: compute(lambda i: resident), 0)]
  for name, get in fetch.items():
    rows_out.append((f"{name} alone", lambda get=get: fetch_only(get), stack.nbytes))
    rows_out.append((f"compute with {name}", lambda get=get: compute(get), 0))
  results = []
  for name, step, moved in rows_out:
    seconds = median(time_steps(step, args.repeats))
    results.append({"setting": name, "seconds": seconds,
                    "GB/s": round(moved / seconds / 1e9, 1) if moved else None})
  base = results[0]["seconds"]
  meta = metadata(sys.argv) | {"layer_bytes": stack.nbytes // args.layers}
  lines = [f"# A layer's weights from pinned memory, {args.layers} layers of "
           f"{args.layer_mib:g} MiB", "",
           f"Device: {meta['device']}; JAX {meta['jax']}; {meta['date']}.",
           f"Command: `{meta['command']}`", "",
           "| setting | ms | vs compute alone | GB/s |", "|---|---|---|---|"]
  lines += [f"| {r['setting']} | {r['seconds'] * 1e3:.1f} | {r['seconds'] / base:.2f}x | "
            f"{r['GB/s'] or '-'} |" for r in results]
  write_report(args.out, meta, results, "\n".join(lines) + "\n")


if __name__ == "__main__":
  main()
