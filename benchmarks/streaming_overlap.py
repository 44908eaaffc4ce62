"""Streaming Adam moments through the device: one piece at a time, or double-buffered.

  PYTHONPATH=. python3 benchmarks/streaming_overlap.py OUTDIR [elements in Mi]

One float32 leaf (default 256 Mi elements) whose two moments live in pinned host
memory, updated in 16 and 64 MiB pieces by:
- serial: ``jaxoffload.streaming.run_streamed`` without overlap;
- unordered: double-buffered, the next piece read from the buffer the current
  piece is written into, with nothing ordering the two (the library's loop
  before commit 42be5f9);
- ordered: the same, the read ordered before the write (the library's loop since);
- pingpong: reads from one host buffer, writes into another (no hazard at all).
Prints each one's median time, XLA's temporary bytes and the aggregate copy rate,
and writes the compiled HLO of each beside a summary in OUTDIR.
"""
import os, re, statistics, sys, time
import jax, jax.numpy as jnp, numpy as np
from jaxoffload._compat import to_device, to_host
from jaxoffload import streaming

out = sys.argv[1]
N = int(float(sys.argv[2]) * 2**20) if len(sys.argv) > 2 else 256 * 2**20
os.makedirs(out, exist_ok=True)


def adam(scalars, device_in, host_in):
  (count,), (g,), (m, v) = scalars, device_in, host_in
  m = 0.9 * m + 0.1 * g
  v = 0.999 * v + 0.001 * g * g
  d = (m / (1 - 0.9 ** count)) / (jnp.sqrt(v / (1 - 0.999 ** count)) + 1e-8)
  return (d,), (m, v)


def split(x, count):
  return x.reshape(count, x.size // count)


def piece(x, i):
  return jax.lax.dynamic_index_in_dim(x, i, keepdims=False)


def put(x, value, i):
  return jax.lax.dynamic_update_index_in_dim(x, value, i, 0)


def double_buffered(scalars, g, host, chunk_bytes, ordered):
  """Fetches piece i + 1 while piece i updates; ``ordered``: the fetch before the write-back."""
  count = streaming.num_chunks(g.size, 8, chunk_bytes)
  gs, hs = split(g, count), tuple(split(to_host(x), count) for x in host)
  fetch = lambda hs, i: to_device(tuple(piece(x, i) for x in hs))

  def body(i, carry):
    gs, hs, fetched = carry
    following = fetch(hs, jnp.minimum(i + 1, count - 1))
    if ordered:
      following, hs = jax.lax.optimization_barrier((following, hs))
    (d,), new = adam(scalars, (piece(gs, i),), fetched)
    new = to_host(tuple(new))
    return put(gs, d, i), tuple(put(x, n, i) for x, n in zip(hs, new)), following

  gs, hs, _ = jax.lax.fori_loop(0, count, body, (gs, hs, fetch(hs, 0)))
  return (gs.reshape(g.shape),), tuple(to_host(x.reshape(g.shape)) for x in hs)


def pingpong_variant(scalars, g, host, spare, chunk_bytes):
  """Reads pieces from one host buffer, writes them into another: no read/write hazard."""
  count = streaming.num_chunks(g.size, 8, chunk_bytes)
  gs = split(g, count)
  src = tuple(split(to_host(x), count) for x in host)
  dst = tuple(split(to_host(x), count) for x in spare)
  fetch = lambda i: to_device(tuple(piece(x, i) for x in src))

  def body(i, carry):
    gs, dst, fetched = carry
    following = fetch(jnp.minimum(i + 1, count - 1))
    (d,), new = adam(scalars, (piece(gs, i),), fetched)
    new = to_host(tuple(new))
    return put(gs, d, i), tuple(put(x, n, i) for x, n in zip(dst, new)), following

  gs, dst, _ = jax.lax.fori_loop(0, count, body, (gs, dst, fetch(0)))
  return (gs.reshape(g.shape),), tuple(to_host(x.reshape(g.shape)) for x in dst)


host_sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
mk = lambda seed: jax.device_put(np.random.default_rng(seed).random(N, np.float32), host_sharding)
g0 = jax.device_put(np.random.default_rng(9).random(N, np.float32) - 0.5, jax.devices()[0])
scal = (jnp.asarray(3.0),)
outs = ((host_sharding, host_sharding), (g0.sharding,))
summary = []
for chunk_mib in (16, 64):
  cb = chunk_mib * 2**20
  variants = {
      "serial": (lambda s, g, h: streaming.run_streamed(adam, s, (g,), h, chunk_bytes=cb), 2),
      "unordered": (lambda s, g, h: double_buffered(s, g, h, cb, ordered=False), 2),
      "ordered": (lambda s, g, h: double_buffered(s, g, h, cb, ordered=True), 2),
      "pingpong": (lambda s, g, h, sp: pingpong_variant(s, g, h, sp, cb), 3),
  }
  for name, (fn, nargs) in variants.items():
    if name == "unordered" and os.environ.get("SKIP_UNORDERED"):  # Seconds a call on a GPU.
      continue
    if nargs == 2:
      jf = jax.jit(lambda s, g, h, fn=fn: fn(s, g, h)[::-1], donate_argnums=(2,), out_shardings=outs)
    else:
      jf = jax.jit(lambda s, g, h, sp, fn=fn: fn(s, g, h, sp)[::-1], donate_argnums=(3,),
                   out_shardings=outs)
    host = (mk(1), mk(2))
    spare = (mk(3), mk(4))
    args = (scal, g0, host) + ((spare,) if nargs == 3 else ())
    t0 = time.perf_counter()
    compiled = jf.lower(*args).compile()
    tc = time.perf_counter() - t0
    txt = compiled.as_text()
    with open(f"{out}/{name}_{chunk_mib}.hlo.txt", "w") as f:
      f.write(txt)
    ma = compiled.memory_analysis()
    # Whole host buffers copied (the unordered loop's cost), as tests/test_gpu.py looks for them.
    host_copies = len(re.findall(r"= f32\[\d+,\d+\]\{1,0:S\(5\)\} copy\(", txt))
    times = []
    for it in range(6):
      host = (mk(1), mk(2))
      spare = (mk(3), mk(4))
      args = (scal, g0, host) + ((spare,) if nargs == 3 else ())
      jax.block_until_ready(args)
      t0 = time.perf_counter()
      h, d = jf(*args)
      jax.block_until_ready((d, h))
      times.append(time.perf_counter() - t0)
      if time.perf_counter() - t0 > 20:
        break
    check = float(jnp.max(jnp.abs(to_device(h[1]) - 0.999 * to_device(mk(2)) - 0.001 * g0 * g0)))
    kinds = [getattr(x.sharding, "memory_kind", None) for x in (*d, *h)]
    line = (f"{name:10s} chunk {chunk_mib:3d} MiB: median {statistics.median(times)*1e3:8.2f} ms "
            f"min {min(times)*1e3:8.2f} ms (n={len(times)}) compile {tc:.1f}s temp "
            f"{ma.temp_size_in_bytes/2**20:.0f} MiB err {check:.2e} kinds {kinds} "
            f"host copies {host_copies} "
            f"copy-start {txt.count('copy-start(')} dus {txt.count('dynamic-update-slice(')} "
            f"GB/s(moments both ways) {2*2*4*N/statistics.median(times)/1e9:.1f}")
    print(line, flush=True)
    summary.append(line)
with open(f"{out}/summary.txt", "w") as f:
  f.write("\n".join(summary) + "\n")
