"""Time and memory of one jitted offload_adamw step on a ~1.1B-parameter Llama-shaped tree.

Each (offload fraction, update placement) runs in a fresh process, so its peak
device memory is its own. Writes JSON and a markdown table.

  python benchmarks/optimizer_step.py --out benchmarks/runs/optimizer_step
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from common import median, metadata, run_children, time_steps, write_report

# (vocab, hidden, intermediate, layers, kv heads x head dim). TinyLlama-1.1B, and a
# miniature of it for a smoke test on a CPU.
SIZES = {"tinyllama": (32000, 2048, 5632, 22, 256), "miniature": (256, 64, 176, 4, 32)}


def llama_shapes(layout: str, size: str = "tinyllama") -> dict:
  """Parameter shapes of the model, layers stacked on axis 0 or one subtree per layer."""
  vocab, hidden, inter, layers_count, kv_dim = SIZES[size]
  layer = {"q": (hidden, hidden), "k": (hidden, kv_dim), "v": (hidden, kv_dim), "o": (hidden, hidden),
           "gate": (hidden, inter), "up": (hidden, inter), "down": (inter, hidden),
           "attn_norm": (hidden,), "mlp_norm": (hidden,)}
  if layout == "stacked":
    layers = {name: (layers_count, *shape) for name, shape in layer.items()}
  else:
    layers = {f"{i:02d}": dict(layer) for i in range(layers_count)}
  return {"embed": (vocab, hidden), "layers": layers, "final_norm": (hidden,),
          "lm_head": (hidden, vocab)}


def optimizer(fraction: float, update_on: str, chunk_mib: int, baseline: bool):
  """offload_adamw with this run's streaming chunk size; plain optax.adamw for the baseline."""
  import optax

  import jaxoffload

  if baseline:
    return optax.adamw(1e-4)
  return optax.chain(
      jaxoffload.scale_by_offloaded_adam(offload_fraction=fraction, update_on=update_on,
                                         chunk_bytes=chunk_mib * 2**20),
      optax.add_decayed_weights(1e-4), optax.scale_by_learning_rate(1e-4))


def measure(fraction: float, update_on: str, layout: str, size: str, steps: int,
            chunk_mib: int) -> dict:
  """Builds params, gradients and state on the default device; times the donated step."""
  import jax
  import jax.numpy as jnp
  import optax

  import jaxoffload

  shapes = llama_shapes(layout, size)
  is_shape = lambda x: isinstance(x, tuple)

  @jax.jit
  def make(key):
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=is_shape)
    keys = jax.random.split(key, len(leaves))
    return treedef.unflatten([0.02 * jax.random.normal(k, s, jnp.float32) for k, s in zip(keys, leaves)])

  params = make(jax.random.PRNGKey(0))
  baseline = fraction == 0.0 and update_on == "device"
  opt = optimizer(fraction, update_on, chunk_mib, baseline)
  state = opt.init(params)
  plan = None if baseline else jaxoffload.find_offload_plan(state)

  def step(params, state):
    # Stands in for a backward pass: gradients materialised in device memory,
    # dead once the update has read them.
    grads = jax.lax.optimization_barrier(jax.tree.map(lambda p: 1e-2 * jnp.sin(p), params))
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  shardings = jax.tree.map(lambda x: x.sharding, (params, state))
  jitted = jax.jit(step, donate_argnums=(0, 1), out_shardings=shardings)
  compiled = jitted.lower(params, state).compile()
  analysis = compiled.memory_analysis()
  carry = [params, state]

  def run_step():
    carry[:] = jitted(*carry)
    return carry

  times = time_steps(run_step, steps)
  params, state = carry
  n_params = sum(x.size for x in jax.tree.leaves(params))
  offloaded = plan.offloaded_elements if plan else 0
  step_s = median(times)
  return {
      "fraction_asked": fraction,
      "fraction_achieved": offloaded / n_params,
      "update_on": update_on if plan else "optax.adamw",
      "params": n_params,
      "offloaded_moment_bytes": 2 * 4 * offloaded,
      "step_s_median": step_s,
      "step_s_all": times,
      "peak_device_bytes": jaxoffload.peak_device_bytes(),
      "state_bytes_by_kind": jaxoffload.bytes_by_memory_kind(state),
      "xla_temp_bytes": getattr(analysis, "temp_size_in_bytes", None),
      "xla_argument_bytes": getattr(analysis, "argument_size_in_bytes", None),
      "xla_host_temp_bytes": getattr(analysis, "host_temp_size_in_bytes", None),
      "offloaded_params_per_s": offloaded / step_s if offloaded else None,
  }


TORCH_PARAMS = 128 * 2**20


def torch_fused_adamw_rate(n: int = TORCH_PARAMS, steps: int = 5) -> float | None:
  """torch's fused CPU AdamW over ``n`` parameters, per second, for comparison; None without
  torch."""
  try:
    import torch
  except ImportError:
    return None
  p = torch.nn.Parameter(torch.randn(n))
  p.grad = torch.randn(n)
  opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
  opt.step()
  start = time.perf_counter()
  for _ in range(steps):
    opt.step()
  return n * steps / (time.perf_counter() - start)


def markdown(results: list[dict], meta: dict) -> str:
  base = next(r for r in results if r["update_on"] == "optax.adamw")
  lines = [
      f"# One optimizer step, {meta['params'] / 1e9:.2f}B fp32 parameters ({meta['layout']} layers)",
      "",
      f"Device: {meta['device']}; JAX {meta['jax']}; {meta['host_cores']} host cores; {meta['date']}.",
      f"Command: `{meta['command']}`",
      "",
      "| update on | fraction asked | achieved | step (s) | ratio | peak device (GiB) | saved (GiB) | "
      "offloaded moments (GiB) | saved / offloaded | offloaded params/s (G) |",
      "|---|---|---|---|---|---|---|---|---|---|",
  ]
  gib = 2**30
  for r in results:
    saved = (base["peak_device_bytes"] - r["peak_device_bytes"]) if r["peak_device_bytes"] else None
    off = r["offloaded_moment_bytes"]
    lines.append(
        f"| {r['update_on']} | {r['fraction_asked']} | {r['fraction_achieved']:.3f} | "
        f"{r['step_s_median']:.4f} | {r['step_s_median'] / base['step_s_median']:.2f} | "
        f"{(r['peak_device_bytes'] or 0) / gib:.2f} | {(saved or 0) / gib:.2f} | {off / gib:.2f} | "
        f"{(saved / off if off and saved is not None else float('nan')):.3f} | "
        f"{(r['offloaded_params_per_s'] or 0) / 1e9:.2f} |")
  if meta.get("torch_fused_adamw_params_per_s"):
    lines += ["", f"torch fused CPU AdamW on the same host: "
              f"{meta['torch_fused_adamw_params_per_s'] / 1e9:.2f} G params/s "
              f"({meta['torch_params']:,} fp32 params)."]
  return "\n".join(lines) + "\n"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--fractions", default="0,0.25,0.5,1.0")
  parser.add_argument("--modes", default="host,device")
  parser.add_argument("--layout", choices=["stacked", "per-layer"], default="stacked")
  parser.add_argument("--size", choices=sorted(SIZES), default="tinyllama")
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--chunk-mib", type=int, default=16, help="update_on=device streaming chunk")
  parser.add_argument("--out", default="benchmarks/runs/optimizer_step")
  parser.add_argument("--child", nargs=2, metavar=("FRACTION", "MODE"), help=argparse.SUPPRESS)
  args = parser.parse_args()

  if args.child:
    print(json.dumps(measure(float(args.child[0]), args.child[1], args.layout, args.size,
                             args.steps, args.chunk_mib)))
    return

  settings = [("0.0", "device")] + [(f, m) for m in args.modes.split(",")
                                    for f in args.fractions.split(",") if float(f) > 0]
  results = run_children(__file__, settings, ["--layout", args.layout, "--size", args.size,
                                              "--steps", str(args.steps),
                                              "--chunk-mib", str(args.chunk_mib)])
  # As many parameters as the model, at most 128M.
  torch_params = min(results[0]["params"], TORCH_PARAMS)
  meta = {**metadata(sys.argv), "layout": args.layout, "params": results[0]["params"],
          "torch_params": torch_params,
          "torch_fused_adamw_params_per_s": torch_fused_adamw_rate(torch_params)}
  write_report(args.out, meta, results, markdown(results, meta))


if __name__ == "__main__":
  main()
