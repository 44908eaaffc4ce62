"""How a layer's weights cross between pinned host memory and the device beside the
device's compute: fetched to it, and written back.

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

A layer's new weights, made on the device after its compute, go back either

- ``program``: a jitted program that writes the layer into the pinned stack,
  donated, in place (as ``train.per_layer.offloaded_layers`` writes a weight-offloaded
  group updated a layer at a time): a program, so it runs in turn with the
  compute; or
- ``device_put``: ``jax.device_put`` to a pinned array of its own, the
  runtime's transfer; or
- ``device_put and host copy``: the same, then copied into the stack's bytes
  on the host by a thread pool (``tensor_files.copy_blocks``) as it lands.

Rows: the compute alone, each way alone (its bandwidth), and the compute with
each; medians of ``--repeats`` after a warm-up. A way hidden by the compute
shows as a row near "compute alone".
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from common import median, metadata, time_steps, write_report
from jaxoffload.hf.tensor_files import copy_blocks
from jaxoffload.host.adam import writable_view


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
  # A layer's new weights, a fresh device array after its compute (as its update makes them).
  made = jax.jit(lambda x, weights: weights + x[0, 0])

  def compute(get=lambda i: resident, put=None):
    x, ahead = x0, get(0)
    for i in range(args.layers):
      weights = ahead
      if i + 1 < args.layers:
        ahead = get(i + 1)  # Issued before this layer's compute.
      x = layer(x, weights)
      if put is not None:
        put(i, made(x, resident))
    return x if put is None else (x, put(None, None))

  def fetch_only(get):
    return [get(i) for i in range(args.layers)]

  def put_only(put):
    for i in range(args.layers):
      put(i, made(x0, resident))
    return put(None, None)

  rows_out = [("compute alone", compute, 0)]
  for name, get in fetch.items():
    rows_out.append((f"fetch by {name} alone", functools.partial(fetch_only, get), stack.nbytes))
    rows_out.append((f"compute with fetch by {name}", functools.partial(compute, get), 0))
  for name, put in writes(stack, view, pinned).items():
    rows_out.append((f"write by {name} alone", functools.partial(put_only, put), stack.nbytes))
    rows_out.append((f"compute with write by {name}",
                     functools.partial(compute, put=put), 0))
  results = []
  for name, step, moved in rows_out:
    seconds = median(time_steps(step, args.repeats))
    results.append({"setting": name, "seconds": seconds,
                    "GB/s": round(moved / seconds / 1e9, 1) if moved else None})
  base = results[0]["seconds"]
  meta = metadata(sys.argv) | {"layer_bytes": stack.nbytes // args.layers}
  lines = [f"# A layer's weights between pinned memory and the device, {args.layers} layers of "
           f"{args.layer_mib:g} MiB", "",
           f"Device: {meta['device']}; JAX {meta['jax']}; {meta['date']}.",
           f"Command: `{meta['command']}`", "",
           "| setting | ms | vs compute alone | GB/s |", "|---|---|---|---|"]
  lines += [f"| {r['setting']} | {r['seconds'] * 1e3:.1f} | {r['seconds'] / base:.2f}x | "
            f"{r['GB/s'] or '-'} |" for r in results]
  write_report(args.out, meta, results, "\n".join(lines) + "\n")


def writes(stack: jax.Array, view: np.ndarray, pinned: jax.sharding.Sharding) -> dict:
  """Each way a layer's new weights on the device go back into ``stack``: a function of
  ``(index, layer)`` that starts the layer back, and, called ``(None, None)`` at the end of a
  pass, returns what to wait for."""
  in_place = jax.jit(lambda s, x, i: jax.lax.dynamic_update_index_in_dim(
      s, jax.device_put(x, pinned), i, 0), donate_argnums=0, out_shardings=pinned)
  # Its own, donated: ``view`` stays over ``stack``.
  state = {"stack": jax.device_put(stack, pinned, may_alias=False)}

  def by_program(i, layer):
    if i is not None:
      state["stack"] = in_place(state["stack"], layer, np.int32(i))
    return state["stack"]

  landed = []

  def by_device_put(i, layer):
    if i is not None:
      landed.append(jax.device_put(layer, pinned))
      return None
    done, landed[:] = list(landed), []
    return done

  pool = concurrent.futures.ThreadPoolExecutor(1)
  copies = []

  def into_stack(i, out):
    copy_blocks([(view[i], writable_view(jax.block_until_ready(out)), False)])

  def by_device_put_and_copy(i, layer):
    if i is not None:
      copies.append(pool.submit(into_stack, i, jax.device_put(layer, pinned)))
      return None
    for copy in copies:
      copy.result()
    copies.clear()
    return None

  return {"program": by_program, "device_put": by_device_put,
          "device_put and host copy": by_device_put_and_copy}


if __name__ == "__main__":
  main()
