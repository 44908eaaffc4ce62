"""Streaming Adam moments through the device in pieces laid out in straight-line code.

  PYTHONPATH=. python3 benchmarks/unrolled_streaming.py --pieces 22 --out docs/benchmarks/unrolled_streaming_h200

``benchmarks/copy_duplex.py`` found that one XLA program copies to and from host
memory at once on the H200 (97-99 GB/s for both together, 54 each alone), while
the library's streaming loop (``run_streamed``, a ``fori_loop`` over pieces)
moves one direction at a time, double-buffered or not. This times one leaf the
shape of TinyLlama-1.1B's stacked MLP projection (22 x 5632 x 2048 float32,
two moments in pinned host memory, 2 GB), updated by Adam's moment arithmetic:

- ``loop``: the library's ``run_streamed`` (16 MiB pieces, one at a time);
- ``unrolled``: ``--pieces`` pieces along the stacked axis, each brought in,
  updated and written back into the donated host buffer at a static offset,
  as straight-line code that XLA's scheduler may interleave;
- ``unrolled, window 2``: the same, but piece i + 2 is fetched only once piece
  i has updated, so at most two pieces' moments sit in device memory;
- ``unrolled, apart``: the pieces' new moments written to host buffers of
  their own (no chain of in-place writes; not donated, each step starts from
  the same moments);
- ``pieces``: the moments kept as one host buffer per piece, so that each
  piece moves by a whole-buffer copy rather than a slice of a host buffer
  (which XLA:GPU runs as a kernel reading host memory); ``pieces, window 2``
  with the window above;
- ``pieces, device_put``: the same host buffers moved by ``jax.device_put``
  between one small update program per piece (every piece's moments may sit
  in device memory at once; XLA's temporary bytes are not counted);
- ``whole``: the leaf brought in at once (the upper bound on device memory).

Each row: median seconds, the copy rate (moments in and out over that time),
XLA's temporary device bytes, whole-buffer host copies in the compiled program
(each one a full extra copy), and the largest error of the second moment
against the formula.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

from common import median, metadata, time_steps, write_report
from jaxoffload import streaming
from jaxoffload.adam import DEFAULT_CHUNK_BYTES
from jaxoffload._compat import PINNED_HOST, to_device, to_host

B1, B2 = 0.9, 0.999


def adam(scalars, device_in, host_in):
  (count,), (g,), (mu, nu) = scalars, device_in, host_in
  mu = B1 * mu + (1 - B1) * g
  nu = B2 * nu + (1 - B2) * g * g
  direction = (mu / (1 - B1**count)) / (jnp.sqrt(nu / (1 - B2**count)) + 1e-8)
  return (direction,), (mu, nu)


def unrolled(scalars, g, host, pieces: int, window: int | None):
  """Updates ``pieces`` static slices of the stacked axis one after another in the program."""
  size = g.shape[0] // pieces
  host = tuple(to_host(x) for x in host)
  directions = []
  for i in range(pieces):
    sl = slice(i * size, (i + 1) * size)
    wanted = tuple(x[sl] for x in host)
    if window is not None and i >= window:
      # Fetch this piece only after the piece `window` places back has updated.
      wanted, _ = jax.lax.optimization_barrier((wanted, directions[i - window]))
    (direction,), new = adam(scalars, (g[sl],), to_device(wanted))
    directions.append(direction)
    new = to_host(tuple(new))
    host = tuple(jax.lax.dynamic_update_slice_in_dim(x, n, i * size, 0) for x, n in zip(host, new))
  return (jnp.concatenate(directions),), host


def unrolled_apart(scalars, g, host, pieces: int):
  """Like ``unrolled``, but each piece's new moments go to a host buffer of their own."""
  size = g.shape[0] // pieces
  directions, new_pieces = [], []
  for i in range(pieces):
    sl = slice(i * size, (i + 1) * size)
    (direction,), new = adam(scalars, (g[sl],), to_device(tuple(to_host(x)[sl] for x in host)))
    directions.append(direction)
    new_pieces.append(to_host(tuple(new)))
  return (jnp.concatenate(directions),), tuple(zip(*new_pieces))


def pieced(scalars, g, host, window: int | None):
  """Updates moments kept as one host buffer per piece: whole-buffer copies, no slicing."""
  pieces = len(host[0])
  size = g.shape[0] // pieces
  directions, new_pieces = [], []
  for i in range(pieces):
    wanted = tuple(moment[i] for moment in host)
    if window is not None and i >= window:
      wanted, _ = jax.lax.optimization_barrier((wanted, directions[i - window]))
    (direction,), new = adam(scalars, (g[i * size:(i + 1) * size],), to_device(wanted))
    directions.append(direction)
    new_pieces.append(to_host(tuple(new)))
  return (jnp.concatenate(directions),), tuple(zip(*new_pieces))


def driven(update_piece, scalars, g_pieces, host, device_sharding, host_sharding):
  """Moves each piece with ``jax.device_put`` outside any program (the runtime's
  transfer streams) and updates it with a jitted program of its own; all
  dispatched at once, so piece i + 1 comes in while piece i goes out."""
  incoming = [jax.device_put((mu, nu), device_sharding) for mu, nu in zip(*host)]
  outgoing = [jax.device_put(update_piece(scalars, g, mu, nu)[1], host_sharding)
              for g, (mu, nu) in zip(g_pieces, incoming)]
  return tuple(zip(*outgoing))


def whole(scalars, g, host):
  (direction,), new = adam(scalars, (g,), to_device(tuple(host)))
  return (direction,), tuple(to_host(new))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--shape", default="22,5632,2048")
  parser.add_argument("--pieces", type=int, default=22)
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--out", default="docs/benchmarks/unrolled_streaming")
  parser.add_argument("--dump", metavar="DIR", help="also write each variant's compiled program")
  args = parser.parse_args()
  shape = tuple(int(n) for n in args.shape.split(","))
  if shape[0] % args.pieces:
    parser.error(f"--pieces {args.pieces} does not divide the leading axis {shape[0]}")
  device = jax.devices()[0]
  host_sharding = jax.sharding.SingleDeviceSharding(device, memory_kind=PINNED_HOST)
  rng = np.random.default_rng(0)
  g = jax.device_put(rng.standard_normal(shape, np.float32), device)
  first = tuple(np.abs(rng.standard_normal(shape, np.float32)) for _ in range(2))
  scalars = (jnp.asarray(3.0),)

  variants = {
      "loop": lambda s, g, h: streaming.run_streamed(adam, s, (g,), h,
                                                     chunk_bytes=DEFAULT_CHUNK_BYTES),
      "unrolled": lambda s, g, h: unrolled(s, g, h, args.pieces, None),
      "unrolled, window 2": lambda s, g, h: unrolled(s, g, h, args.pieces, 2),
      "unrolled, apart": lambda s, g, h: unrolled_apart(s, g, h, args.pieces),
      "pieces": lambda s, g, h: pieced(s, g, h, None),
      "pieces, window 2": lambda s, g, h: pieced(s, g, h, 2),
      "pieces, device_put": None,  # Not one program: see driven().
      "whole": whole,
  }
  chained = {name: name != "unrolled, apart" for name in variants}
  size = shape[0] // args.pieces

  def host_state(name):
    if name.startswith("pieces"):
      return tuple(tuple(jax.device_put(x[i * size:(i + 1) * size], host_sharding)
                         for i in range(args.pieces)) for x in first)
    return tuple(jax.device_put(x, host_sharding) for x in first)

  if args.dump:
    os.makedirs(args.dump, exist_ok=True)
  results = []
  update_piece = jax.jit(lambda s, g, mu, nu: adam(s, (g,), (mu, nu)), donate_argnums=(2, 3))
  g_pieces = [g[i * size:(i + 1) * size] for i in range(args.pieces)]
  for name, fn in variants.items():
    host = host_state(name)
    if fn is None:
      step = lambda s, g, h: (driven(update_piece, s, g_pieces, h, g.sharding, host_sharding),
                              None)
      temp, host_buffer_copies = None, 0
    else:
      # Host state first: donation pairs a donated input with the first output of
      # its shape, which must not be the direction in device memory.
      step = jax.jit(lambda s, g, h, fn=fn: fn(s, g, h)[::-1],
                     donate_argnums=(2,) if chained[name] else ())
      compiled = step.lower(scalars, g, host).compile()
      program = compiled.as_text()
      if args.dump:
        with open(f"{args.dump}/{name.replace(' ', '').replace(',', '_')}.hlo.txt", "w") as f:
          f.write(program)
      host_buffer_copies = len(re.findall(r"\{[0-9,]+:S\(5\)\} copy\(", program))
      temp = compiled.memory_analysis().temp_size_in_bytes

    outputs = None

    def one_step():
      nonlocal host, outputs
      outputs, _ = step(scalars, g, host)
      if chained[name]:
        host = outputs
      return outputs

    times = time_steps(one_step, args.steps)
    # n updates from `first` with one gradient, in float64: b2^n nu0 + (1 - b2^n) g^2.
    updates = args.steps + 1 if chained[name] else 1
    expected_nu = (B2**updates * first[1].astype(np.float64)
                   + (1 - B2**updates) * np.square(np.asarray(g, np.float64)))
    nu = outputs[1]
    if not isinstance(nu, jax.Array):
      nu = np.concatenate([np.asarray(x) for x in nu])
    error = float(np.max(np.abs(np.asarray(nu) - expected_nu)))
    kinds = sorted({x.sharding.memory_kind for x in jax.tree.leaves(outputs)})
    seconds = median(times)
    moved = 2 * 2 * 4 * int(np.prod(shape))  # Two float32 moments, in and out.
    results.append({"variant": name, "seconds": seconds, "times": times,
                    "gb_per_s": moved / seconds / 1e9, "temp_bytes": temp,
                    "host_buffer_copies": host_buffer_copies, "nu_max_error": error,
                    "host_memory_kinds": kinds})
    print(results[-1], flush=True)

  meta = metadata(sys.argv)
  lines = [f"# Streaming a {args.shape} leaf's moments: loop against straight-line pieces",
           "", f"Device: {meta['device']}; JAX {meta['jax']}; {meta['date']}.",
           f"Command: `{meta['command']}`", "",
           "| variant | median (ms) | GB/s in + out | temp device (MiB) | whole host-buffer copies "
           "| nu max error |", "|---|---|---|---|---|---|"]
  lines += [f"| {r['variant']} | {1e3 * r['seconds']:.2f} | {r['gb_per_s']:.1f} "
            f"| {'-' if r['temp_bytes'] is None else round(r['temp_bytes'] / 2**20)} "
            f"| {r['host_buffer_copies']} "
            f"| {r['nu_max_error']:.1e} |" for r in results]
  write_report(args.out, meta, results, "\n".join(lines) + "\n")


if __name__ == "__main__":
  main()
