"""Does streaming Adam state through the device add to what the host kernel updates?

  PYTHONPATH=. python3 benchmarks/host_memory_share.py --host 25 --stream 25 --out OUT/share

The host kernel (``jaxoffload.host.adam``) reads and writes the weights (a
split float32 master) and float32 moments in host memory; the ``device`` placement streams the same bytes
through the link and updates them on the device. Both read host memory, so
splitting the offloaded leaves between them pays only if host memory serves
both at once. This times, over ``--layers`` layers, each alone and at once:

- ``compute``: a layer's worth of device matmuls per layer (the forward pass);
- ``host``: the kernel's AdamW step on ``--host`` M elements per layer;
- ``stream``: ``--stream`` M elements per layer of float32 weights and moments
  copied to the device (``jax.device_put``, ``--ahead`` layers ahead), updated
  there and copied back to pinned host memory.

Times are medians of ``--repeats`` runs after one warm-up. "host GB/s" counts
the host-memory bytes each part reads and writes (26 an element for the kernel
with bfloat16 gradients and a split master, 24 for a streamed element): a row that
runs near the sum of its parts' times at the same GB/s is bound by host memory.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from common import median, metadata, time_steps, write_report
from jaxoffload import rounding
from jaxoffload.host import adam

KERNEL_BYTES, STREAMED_BYTES = 26, 24
PARTS = {"compute": (0, 0, 1), "host": (1, 0, 0), "stream": (0, 1, 0),
         "host + compute": (1, 0, 1), "stream + compute": (0, 1, 1),
         "host + stream": (1, 1, 0), "all three": (1, 1, 1)}


@jax.jit
def device_adamw(p, m, v, g):
  """AdamW's element-wise arithmetic (constant rates: only the bytes matter here)."""
  g = g.astype(jnp.float32)
  m = 0.9 * m + 0.1 * g
  v = 0.999 * v + 0.001 * g * g
  p = p - 1e-4 * (m / (jnp.sqrt(v) + 1e-8) + 1e-4 * p)
  return p, m, v


@jax.jit
def layer_compute(a):
  x = a
  for _ in range(4):
    x = (x @ a).astype(jnp.bfloat16) * 1e-4
  return x


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--host", type=float, default=25.0, help="M elements a layer, host kernel")
  parser.add_argument("--stream", type=float, default=25.0, help="M elements a layer, streamed")
  parser.add_argument("--layers", type=int, default=22)
  parser.add_argument("--ahead", type=int, default=2, help="layers copied in ahead")
  parser.add_argument("--matmul", type=int, default=8192, help="side of compute's matmuls")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--out", default="benchmarks/runs/host_memory_share")
  args = parser.parse_args()

  n_host, n_stream = int(args.host * 1e6), int(args.stream * 1e6)
  device = jax.devices()[0]
  on_device = jax.sharding.SingleDeviceSharding(device)
  pinned = on_device.with_memory_kind("pinned_host")
  host = [dict(param=np.ones(n_host, ml_dtypes.bfloat16), mu=np.zeros(n_host, np.float32),
               nu=np.zeros(n_host, np.float32), grad=np.ones(n_host, ml_dtypes.bfloat16),
               remainder=np.zeros(n_host, np.uint16)) for _ in range(args.layers)]
  streamed = [[jax.device_put(np.full(n_stream, k, np.float32), pinned) for k in range(3)]
              for _ in range(args.layers)]
  grads = [jnp.ones(n_stream, jnp.bfloat16) for _ in range(args.layers)]
  a = jnp.ones((args.matmul, args.matmul), jnp.bfloat16)

  def one_pass(kernel: int, stream: int, compute: int) -> None:
    """Per layer: the streamed share's copies and update dispatched, the kernel run, the
    layer's compute dispatched; then waits for everything."""
    incoming, out = {}, None
    fetch = lambda l: incoming.setdefault(l, jax.device_put(streamed[l], on_device))
    for l in range(min(args.ahead, args.layers) if stream else 0):
      fetch(l)
    for l in range(args.layers):
      if stream:
        if l + args.ahead < args.layers:
          fetch(l + args.ahead)
        streamed[l] = jax.device_put(list(device_adamw(*incoming.pop(l), grads[l])), pinned)
      if kernel:
        h = host[l]
        adam.adamw_update(h["param"], h["grad"], h["mu"], h["nu"], learning_rate=1e-4,
                               count=1, remainder=h["remainder"])
      if compute:
        out = layer_compute(a)
    jax.block_until_ready((out, streamed))

  results = []
  for name, parts in PARTS.items():
    seconds = median(time_steps(lambda: one_pass(*parts), args.repeats))
    moved = args.layers * (parts[0] * n_host * KERNEL_BYTES + parts[1] * n_stream * STREAMED_BYTES)
    results.append({"parts": name, "seconds": seconds, "host_bytes": moved,
                    "host_gb_per_s": moved / seconds / 1e9})
  assert {x.sharding.memory_kind for x in streamed[0]} == {"pinned_host"}
  master = rounding.join_master(host[0]["param"][:1], host[0]["remainder"][:1])
  assert master[0] != 1.0, "the kernel did not update"

  meta = metadata(sys.argv)
  lines = [f"# Host kernel and device streaming sharing host memory: {args.host:g} M + "
           f"{args.stream:g} M elements a layer, {args.layers} layers", "",
           f"Device: {meta['device']}; JAX {meta['jax']}; {meta['date']}; "
           f"{adam.max_threads()} kernel threads.", f"Command: `{meta['command']}`", "",
           "| parts | median (ms) | host GB/s |", "|---|---|---|"]
  lines += [f"| {r['parts']} | {1e3 * r['seconds']:.1f} | {r['host_gb_per_s']:.0f} |"
            for r in results]
  write_report(args.out, meta, results, "\n".join(lines) + "\n")


if __name__ == "__main__":
  main()
