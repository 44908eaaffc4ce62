"""Memory and time of one training step's forward and backward pass, per activation placement.

Each mode runs in a fresh process. A mode is ``save``, ``recompute``, or
``offload:N:PRESET`` (the first N layers offload the activations
``remat.OFFLOAD_PRESETS[PRESET]`` names and recompute their others, the rest
save everything). Reports XLA's compiled memory estimate, measured
peak device memory, the activation bytes the arithmetic says offload moves,
and the median step time.

  python benchmarks/activation_offload.py --out benchmarks/runs/activation_offload
  python benchmarks/activation_offload.py --size miniature --seq 64 --steps 2  # On a CPU.
"""

from __future__ import annotations

import argparse
import json
import sys

from common import median, metadata, run_children, time_steps, write_report

SIZES = {
    # TinyLlama-1.1B.
    "tinyllama": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_layers=22,
                      num_attention_heads=32, num_query_groups=4),
    "miniature": dict(vocab_size=256, hidden_size=64, intermediate_size=176, num_layers=4,
                      num_attention_heads=4, num_query_groups=2),
}


def default_modes(num_layers: int) -> str:
  """Megatron's two settings of interest (half, all but two) and every preset on every layer."""
  from jaxoffload.nn import remat

  modes = (["save", "recompute", f"offload:{num_layers // 2}:all",
                   f"offload:{num_layers - 2}:all"]
           + [f"offload:all:{preset}" for preset in remat.OFFLOAD_PRESETS])
  return ",".join(dict.fromkeys(modes))


def groups_for(mode: str, num_layers: int):
  """The layer groups of a mode; ``offload:all:PRESET`` offloads every layer."""
  from jaxoffload.nn import remat

  if mode == "save":
    return remat.layer_groups(num_layers)
  if mode == "recompute":
    return remat.layer_groups(num_layers, base_placements=remat.RECOMPUTE_ALL)
  _, n, preset = mode.split(":")
  n = num_layers if n == "all" else int(n)
  groups = (remat.LayerGroup(0, n, remat.offload_preset(preset)),
            remat.LayerGroup(n, num_layers, remat.SAVE_EVERYTHING))
  return tuple(g for g in groups if g.stop > g.start)


def measure(mode: str, size: str, batch: int, seq: int, steps: int) -> dict:
  import jax

  import jaxoffload
  from jaxoffload.memory import offloaded_activation_bytes
  from jaxoffload.nn.model import Llama, LlamaConfig, next_token_loss
  from jaxoffload.nn.params import init_params, regroup

  config = LlamaConfig(**SIZES[size], seq_length=seq, dtype="bfloat16")
  groups = groups_for(mode, config.num_layers)
  model = Llama(config, groups)
  tokens = jax.random.randint(jax.random.PRNGKey(1), (batch, seq), 0, config.vocab_size)
  # Initialised as one stack, then cut at this mode's groups: every mode starts
  # from the same weights, so their losses must agree.
  one_stack = Llama(config, groups_for("save", config.num_layers))
  params = regroup(init_params(one_stack, jax.random.PRNGKey(0), tokens), groups)

  def loss(params, tokens):
    return next_token_loss(model.apply({"params": params}, tokens), tokens)

  step = jax.jit(jax.value_and_grad(loss))
  compiled = step.lower(params, tokens).compile()
  analysis = compiled.memory_analysis()
  losses = []

  def run_step():
    value, grads = step(params, tokens)
    losses.append(value)
    return grads

  times = time_steps(run_step, steps)
  offloaded = offloaded_activation_bytes(config, groups, batch, seq)
  return {
      "mode": mode, "step_s_median": median(times), "step_s_all": times,
      "loss": float(losses[-1]), "peak_device_bytes": jaxoffload.peak_device_bytes(),
      "xla_temp_bytes": getattr(analysis, "temp_size_in_bytes", None),
      "xla_host_temp_bytes": getattr(analysis, "host_temp_size_in_bytes", None),
      "predicted_offloaded_bytes": offloaded,
      "params": sum(x.size for x in jax.tree.leaves(params)),
      # Whether XLA runs attention in cuDNN's fused kernel (else it saves the score matrix).
      "cudnn_attention": "cudnn" in compiled.as_text().lower(),
  }


def markdown(results: list[dict], meta: dict) -> str:
  gib = 2**30
  base = next((r for r in results if r["mode"] == "save"), results[0])
  recompute = next((r for r in results if r["mode"] == "recompute"), base)
  lines = [
      f"# Forward and backward, {meta['size']} at {meta['batch']} x {meta['seq']} tokens, bf16 compute",
      "",
      f"Device: {meta['device']}; JAX {meta['jax']}; {meta['date']}.",
      f"Command: `{meta['command']}`",
      "",
      "| mode | step (s) | vs save | vs recompute | peak device (GiB) | XLA temp (GiB) | predicted offload (GiB) | "
      "XLA host (GiB) | peak saved / offloaded | loss |",
      "|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in results:
    peak, base_peak = r["peak_device_bytes"], base["peak_device_bytes"]
    saved = (base_peak - peak) / r["predicted_offloaded_bytes"] if (
        peak and base_peak and r["predicted_offloaded_bytes"]) else float("nan")
    lines.append(
        f"| {r['mode']} | {r['step_s_median']:.4f} | {r['step_s_median'] / base['step_s_median']:.2f} "
        f"| {r['step_s_median'] / recompute['step_s_median']:.2f} "
        f"| {(peak or 0) / gib:.2f} | {(r['xla_temp_bytes'] or 0) / gib:.2f} "
        f"| {r['predicted_offloaded_bytes'] / gib:.2f} | {(r['xla_host_temp_bytes'] or 0) / gib:.2f} "
        f"| {saved:.2f} | {r['loss']:.6f} |")
  return "\n".join(lines) + "\n"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--modes", help="comma-separated; default: see default_modes")
  parser.add_argument("--size", choices=sorted(SIZES), default="tinyllama")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq", type=int, default=2048)
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--out", default="benchmarks/runs/activation_offload")
  parser.add_argument("--child", nargs=1, metavar="MODE", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    print(json.dumps(measure(args.child[0], args.size, args.batch, args.seq, args.steps)))
    return
  modes = args.modes or default_modes(SIZES[args.size]["num_layers"])
  results = run_children(__file__, [(m,) for m in modes.split(",")],
                         ["--size", args.size, "--batch", str(args.batch), "--seq", str(args.seq),
                          "--steps", str(args.steps)])
  meta = {**metadata(sys.argv), "size": args.size, "batch": args.batch, "seq": args.seq}
  write_report(args.out, meta, results, markdown(results, meta))


if __name__ == "__main__":
  main()
