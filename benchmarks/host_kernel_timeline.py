"""Where a host-kernel training step's time goes: dispatch, ``HostAdamW.update``, waiting.

  PYTHONPATH=. python3 benchmarks/host_kernel_timeline.py [--delayed] [--steps 8] \
      [--config configs/llama_1b.yaml] [section.key=value ...]

Runs the trainer's loop by hand with every leaf on the host kernel and prints,
per step, the seconds to dispatch the device step, to return from
``host.update`` and to wait for the loss after it. With ``--delayed`` the
update applies the previous step's gradients, which are ready, so it should
return in the kernel's own time while the device step runs on; an update that
lasts as long as the device step shows something in it waiting for that step.
"""

from __future__ import annotations

import argparse
import time

import jax

from jaxoffload.config import load_config
from jaxoffload.train import build, global_batch


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", default="configs/llama_1b.yaml")
  parser.add_argument("--delayed", action="store_true")
  parser.add_argument("--steps", type=int, default=8)
  parser.add_argument("overrides", nargs="*", metavar="section.key=value")
  args = parser.parse_args()
  config = load_config(args.config, [
      "optimizer.optimizer_cpu_offload=True", "optimizer.optimizer_offload_fraction=1.0",
      "optimizer.optimizer_offload_update_on=host_kernel",
      f"optimizer.delayed_update={args.delayed}", *args.overrides])
  params, state, step, batch_sharding, host = build(config)
  for i in range(args.steps):
    tokens = jax.block_until_ready(global_batch(config, i, batch_sharding))
    start = time.perf_counter()
    params, state, loss, grads, clip_scale = step(params, host.params, state, tokens)
    dispatched = time.perf_counter()
    host.update(grads, clip_scale)
    updated = time.perf_counter()
    jax.block_until_ready(loss)
    done = time.perf_counter()
    print(f"step {i + 1}: dispatch {dispatched - start:.3f} s, update {updated - dispatched:.3f} s, "
          f"then waited {done - updated:.3f} s; total {done - start:.3f} s", flush=True)
  host.finish()


if __name__ == "__main__":
  main()
