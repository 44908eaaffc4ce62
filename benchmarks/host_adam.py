"""Host AdamW throughput: the numba kernel per thread count and per storage format, against optax.

  python benchmarks/host_adam.py --params 128 --out benchmarks/runs/host_adam

Updates ``--params`` million parameters (with their gradients and moments) in
place; reports the median of ``--repeats`` steps as G params/s: float32 state
on 1 to all threads, then each compact format the trainer offers on all of
them (bfloat16 gradients; a split float32 master, bfloat16 weights; bfloat16
or 8-bit moments), then optax under jax.jit on the CPU. The kernel works on JAX
pinned_host buffers when a GPU is present (through ``host.adam.writable_view``),
else on numpy arrays.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numba
import numpy as np
import optax

from common import median, metadata, time_steps, write_report
from jaxoffload import rounding
from jaxoffload.host import adam

# Compact formats: (the weights, the moments), with bfloat16 gradients.
FORMATS = {"float32 master, float32 moments": ("float32", "float32"),
           "split float32 master, bfloat16 moments": ("split", "bfloat16"),
           "split float32 master, 8-bit moments": ("split", "int8"),
           "bfloat16 weights, 8-bit moments": ("bfloat16", "int8")}


def host_arrays(n: int, count: int) -> tuple[list, list[np.ndarray]]:
  """``count`` float32 arrays of ``n`` elements in host memory, and views the kernel may write.

  The first list owns the memory; keep it alive as long as the views.
  """
  rng = np.random.default_rng(0)
  arrays = [rng.standard_normal(n, dtype=np.float32) for _ in range(count)]
  if jax.default_backend() == "cpu":
    return arrays, arrays
  host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
  owners = jax.block_until_ready([jax.device_put(a, host) for a in arrays])
  return owners, [adam.writable_view(a) for a in owners]


def kernel_rate(n: int, threads: int, repeats: int) -> float:
  numba.set_num_threads(threads)
  owners, (param, grad, mu, nu) = host_arrays(n, 4)
  counter = iter(range(1, repeats + 2))
  update = lambda: adam.adamw_update(param, grad, mu, nu, learning_rate=1e-4,
                                          count=next(counter), weight_decay=0.1)
  rate = n / median(time_steps(update, repeats)) / 1e9
  jax.block_until_ready(owners)  # Holds the memory until the views are done with.
  return rate


def format_rate(n: int, weights: str, moments: str, repeats: int) -> float:
  """The kernel's rate on all threads with weights and moments stored so."""
  numba.set_num_threads(adam.max_threads())
  rng = np.random.default_rng(0)
  master = rng.standard_normal((n // 1024, 1024), dtype=np.float32)
  high, remainder = rounding.split_master(master)
  param = {"float32": master, "split": high.view(ml_dtypes.bfloat16),
           "bfloat16": master.astype(ml_dtypes.bfloat16)}[weights]
  if weights != "split":
    remainder = None
  grad = (0.01 * master).astype(ml_dtypes.bfloat16)
  moment = lambda signed: (adam.CodedMoment.zeros(master.shape, signed=signed)
                           if moments == "int8" else np.zeros(master.shape, moments))
  mu, nu = moment(True), moment(False)
  counter = iter(range(1, repeats + 2))
  update = lambda: adam.adamw_update(param, grad, mu, nu, learning_rate=1e-4,
                                          count=next(counter), weight_decay=0.1,
                                          remainder=remainder)
  return master.size / median(time_steps(update, repeats)) / 1e9


def optax_cpu_rate(n: int, repeats: int) -> float:
  cpu = jax.devices("cpu")[0]
  opt = optax.adamw(1e-4, weight_decay=0.1)
  param = jax.device_put(jnp.ones(n, jnp.float32), cpu)
  grad = jax.device_put(jnp.full(n, 0.5, jnp.float32), cpu)
  state = opt.init(param)

  @jax.jit
  def step(param, state, grad):
    updates, state = opt.update(grad, state, param)
    return optax.apply_updates(param, updates), state

  carry = [param, state]

  def run():
    carry[:] = step(carry[0], carry[1], grad)
    return carry

  return n / median(time_steps(run, repeats)) / 1e9


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--params", type=int, default=128, help="millions of parameters")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--out", default="benchmarks/runs/host_adam")
  args = parser.parse_args()
  n = args.params * 10**6
  most = adam.max_threads()
  counts = sorted({1, 2, 4, 8, most} & set(range(1, most + 1)))
  results = [{"method": f"numba kernel, {t} threads", "g_params_per_s": kernel_rate(n, t, args.repeats)}
             for t in counts]
  results += [{"method": f"numba kernel, {most} threads, bfloat16 gradients, {name}",
               "g_params_per_s": format_rate(n, *stored, args.repeats)}
              for name, stored in FORMATS.items()]
  results.append({"method": "optax.adamw, jax.jit on the CPU backend",
                  "g_params_per_s": optax_cpu_rate(n, args.repeats)})
  meta = {**metadata(sys.argv), "params": n,
          "memory": "pinned_host buffers" if jax.default_backend() != "cpu" else "numpy"}
  lines = [f"# Host AdamW, {n / 1e6:.0f}M parameters, in place",
           "", f"Device: {meta['device']}; {meta['host_cores']} host cores; JAX {meta['jax']}; "
           f"{meta['date']}; kernel memory: {meta['memory']}.", f"Command: `{meta['command']}`", "",
           "| method | G params/s |", "|---|---|"]
  lines += [f"| {r['method']} | {r['g_params_per_s']:.2f} |" for r in results]
  write_report(args.out, meta, results, "\n".join(lines) + "\n")


if __name__ == "__main__":
  main()
