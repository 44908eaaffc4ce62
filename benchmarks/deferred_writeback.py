"""An experiment: write the offloaded moments back during the next step's forward pass.

  PYTHONPATH=. python3 benchmarks/deferred_writeback.py --config configs/llama_1b.yaml \
      --steps 10 --fractions 0.25,0.5,1.0 --out docs/benchmarks/deferred_writeback_h200

The device placement (``optimizer_offload_update_on=device``) copies the
offloaded moments in and out after the backward pass, one direction at a time,
with no compute to hide under (0.083 s a step at fraction 0.25 on the H200).
Global-norm clipping keeps the update itself after the backward pass, but the
copy out need not end the step: here a step ends with the updated moments
still on the device, and the next step starts by copying them to host memory,
which XLA may overlap with its forward pass, and brings them back once its
gradients exist. The hope was that the moments would leave device memory
before the peak. Measured on the H200 (docs/benchmarks/h200_report.md): the
copy out hides (1.19x at 0.25 against 1.32x), but the moments enter the program
in device memory and stay allocated until it ends, so nothing is saved at 0.25;
not adopted.

Each setting runs in a fresh process and reports its median step time, its
peak device memory and its losses; the same arithmetic as the baseline (plain
optax), so the losses should agree to the GPU's run-to-run noise. Not part of
the library.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import jax
import numpy as np
import optax

from common import median, metadata, run_children, time_steps, write_report
from jaxoffload import peak_device_bytes
from jaxoffload._compat import to_device, to_host
from jaxoffload.config import load_config
from jaxoffload.model import Llama, next_token_loss
from jaxoffload.placement import plan_offload
from jaxoffload.train import build, global_batch, llama_config, optimizer, validate


def deferred_step(model: Llama, opt: optax.GradientTransformation, offloaded: list[bool],
                  ordered: bool = True):
  """A train step whose offloaded Adam moments leave for the host at its start and come
  back after its backward pass (``offloaded``: one bool per parameter leaf; ``ordered=False``
  lets XLA's scheduler place the copy back)."""

  def moments(state):
    adam = state[1][0]  # optax.chain(clip_by_global_norm, adamw): adamw's ScaleByAdamState.
    return adam.mu, adam.nu

  def with_moments(state, mu, nu):
    adam = state[1][0]._replace(mu=mu, nu=nu)
    return (state[0], (adam, *state[1][1:]))

  def move(tree, to):
    leaves, treedef = jax.tree.flatten(tree)
    return treedef.unflatten([to(x) if o else x for x, o in zip(leaves, offloaded)])

  def step(params, state, tokens):
    on_host = tuple(move(m, to_host) for m in moments(state))
    loss, grads = jax.value_and_grad(
        lambda p: next_token_loss(model.apply({"params": p}, tokens), tokens))(params)
    # Back only once the gradients exist, so not at the forward pass's peak.
    if ordered:
      on_host, grads = jax.lax.optimization_barrier((on_host, grads))
    state = with_moments(state, *(move(m, to_device) for m in on_host))
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  return step


def child(args) -> dict:
  config = load_config(args.config, [f"train.train_iters={args.steps + 1}"])
  params, state, baseline_step, batch_sharding, _ = build(config)
  if args.setting == "baseline":
    step = baseline_step
  else:
    model = Llama(llama_config(config), validate(config))
    fraction, _, order = args.setting.partition(":")
    offloaded = list(plan_offload(params, offload_fraction=float(fraction)).offloaded)
    shardings = jax.tree.map(lambda x: x.sharding, (params, state))
    step = jax.jit(deferred_step(model, optimizer(config), offloaded, ordered=order != "unordered"),
                   donate_argnums=(0, 1),
                   out_shardings=(*shardings, None))
  # Lines of the compiled program that touch host memory: 0 would mean XLA
  # dropped the round trip and kept the moments on the device.
  program = step.lower(params, state, global_batch(config, 0, batch_sharding)).compile().as_text()
  if args.dump:
    with open(f"{args.dump}/{args.setting}.hlo.txt", "w") as f:
      f.write(program)
  host_lines = sum("S(5)" in line for line in program.splitlines())
  losses, index = [], itertools.count()

  def one_step():
    nonlocal params, state
    params, state, loss = step(params, state, global_batch(config, next(index), batch_sharding))
    losses.append(loss)
    return loss

  times = time_steps(one_step, args.steps)
  return {"setting": args.setting, "step_s": median(times), "times": times,
          "peak_device_gib": (peak_device_bytes() or 0) / 2**30, "host_memory_lines": host_lines,
          "losses": [float(x) for x in losses]}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config")
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--fractions", default="0.25,0.5,1.0")
  parser.add_argument("--out", default="docs/benchmarks/deferred_writeback")
  parser.add_argument("--unordered", action="store_true",
                      help="also run each fraction with the copy back left to XLA's scheduler "
                           "(setting FRACTION:unordered)")
  parser.add_argument("--dump", metavar="DIR",
                      help="also write each setting's compiled program to DIR (to see where "
                           "XLA placed the copies)")
  parser.add_argument("--child", dest="setting", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.setting:
    print(json.dumps(child(args)))
    return
  common = (["--steps", str(args.steps)] + (["--config", args.config] if args.config else [])
            + (["--dump", args.dump] if args.dump else []))
  if args.dump:
    os.makedirs(args.dump, exist_ok=True)
  fractions = args.fractions.split(",")
  settings = ["baseline"] + fractions + ([f + ":unordered" for f in fractions]
                                         if args.unordered else [])
  results = run_children(__file__, [[s] for s in settings], common)
  base = results[0]
  meta = metadata(sys.argv)
  lines = [f"# Deferred write-back of offloaded moments, {args.steps} steps",
           "", f"Device: {meta['device']}; JAX {meta['jax']}; {meta['date']}.",
           f"Command: `{meta['command']}`", "",
           "| setting | step (s) | vs baseline | peak device (GiB) | max loss diff "
           "| program lines in host memory |",
           "|---|---|---|---|---|---|"]
  for r in results:
    gap = float(np.max(np.abs(np.array(r["losses"]) - np.array(base["losses"]))))
    r["max_loss_diff"] = gap
    lines.append(f"| {r['setting']} | {r['step_s']:.4f} | {r['step_s'] / base['step_s']:.2f}x "
                 f"| {r['peak_device_gib']:.2f} | {gap:.2e} | {r['host_memory_lines']} |")
  write_report(args.out, meta, results, "\n".join(lines) + "\n")


if __name__ == "__main__":
  main()
