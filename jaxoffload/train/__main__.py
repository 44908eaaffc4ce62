"""Train the Llama model with any combination of offloads: ``python -m jaxoffload.train``.

  python -m jaxoffload.train [--config configs/NAME.yaml] [section.key=value ...]

With no arguments it trains the tiny default model on synthetic tokens, on
whatever backend JAX finds, CPU included, and prints the loss as it falls.

examples:
  python -m jaxoffload.train data.dataset=text train.train_iters=200
  python -m jaxoffload.train --config configs/llama_1b_optimizer_offload.yaml
  python -m jaxoffload.train --config configs/llama_1b.yaml \\
      optimizer.optimizer_cpu_offload=True optimizer.optimizer_offload_fraction=0.5 \\
      model.cpu_offloading=True model.cpu_offloading_num_layers=11 logging.jsonl=steps.jsonl

Every key, its default and the reference's rules: docs/config.md. Configs for
each offload mode: configs/. What each costs: docs/performance.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Optional

import jax

from jaxoffload import plan
from jaxoffload.train import advice, host_memory, launch, levers, stopping
from jaxoffload.train.config import ConfigError
from jaxoffload.train.loading import load_config
from jaxoffload.train.loop import train
from jaxoffload.train.resolve import resolve


def main(argv: Optional[list[str]] = None) -> None:
  parser = argparse.ArgumentParser(
      prog="python -m jaxoffload.train", description=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config",
                      help="a YAML file of sections (model, optimizer, train, data, logging, "
                           "mesh, distributed, checkpoint)")
  parser.add_argument("overrides", nargs="*", metavar="section.key=value")
  args = parser.parse_args(argv)
  config = None
  try:
    config = load_config(args.config, args.overrides)
    launch.set_xla_flags(config)
    launch.keep_compiled(config)
    launch.size_pinned_pool(config)
    launch.start_processes(config)
    config, chosen = plan.choose(config)
    train(config, choices=chosen)
  except ConfigError as error:
    _exit(f"error: {error}", 2)
  except FloatingPointError as error:
    _exit(f"error: {error}", 1)
  except stopping.Stopped as stopped:  # The shell's status for a process a signal ended.
    _exit(str(stopped), 128 + stopped.signum)
  except IndexError as error:
    if XLA_LOOKUP_ERROR not in str(error):
      raise
    _exit(f"error: XLA failed running the step: {str(error).splitlines()[0]}; it has failed so "
          f"with host offload inside one program on some GPUs, where a program per layer "
          f"(model.cpu_offloading_double_buffering=True, or train.per_layer_step=True) ran", 1)
  except jax.errors.JaxRuntimeError as error:
    if "RESOURCE_EXHAUSTED" not in str(error):
      raise
    if PINNED_POOL_ERROR in str(error):
      _exit(_pinned_pool_message(str(error)), 1)
    profile = _memory_profile(config)
    resolved = getattr(error, "resolved_config", config)
    named = _device_levers(resolved) if resolved is not None else []
    hint = (f"lower it with {'; '.join(named)} (docs/config.md)" if named else
            "every setting that lowers device memory is at its limit: a smaller model or "
            "model.seq_length, or more devices (mesh.fsdp)")
    _exit(f"error: out of device memory: {str(error).splitlines()[0]}; {hint}; what the device "
          f"held: {profile}", 1)


# What XLA's runtime raises, on some GPUs, running a step whose one program offloads to
# the host (experiments/performance_history.md).
XLA_LOOKUP_ERROR = "raw_hash_map<>::at"

# How XLA names its pinned host pool when that runs out.
PINNED_POOL_ERROR = "xla_gpu_host_bfc"


def _pinned_pool_message(error: str) -> str:
  """The line for XLA's pinned pool running out: its limit, and how to raise it."""
  variable = host_memory.PINNED_POOL_VARIABLE
  limit = os.environ.get(variable, str(host_memory.DEFAULT_PINNED_POOL_GIB))
  by = " (the trainer's size)" if launch.sized_pinned_pool_gib is not None else ""
  return (f"error: out of XLA's pinned host memory: {error.splitlines()[0]}; each GPU's pool "
          f"stops at {variable}={limit} GiB{by}: start again with {variable} set higher, "
          f"within the host's free memory")


def _device_levers(config) -> list[str]:
  """``advice.device_memory_levers`` of ``config``, each with what it frees where the
  arithmetic can be done (``levers.device_figures``)."""
  named = advice.device_memory_levers(config)
  try:
    return levers.device_figures(resolve(config), named)
  except Exception:  # The advice never hides the out-of-memory error.
    return named


def _memory_profile(config) -> str:
  """Writes the device memory profile (pprof) into the run's checkpoint directory, else
  beside its JSONL log, else (where neither is set or can be written) into a new temporary
  directory, never the current one; returns its path."""
  directories = []
  if config is not None and (config.checkpoint.dir or config.logging.jsonl):
    directories.append(config.checkpoint.dir
                       or os.path.dirname(os.path.abspath(config.logging.jsonl)))
  for directory in directories + [None]:
    try:
      directory = directory or tempfile.mkdtemp(prefix="jaxoffload-")
      os.makedirs(directory, exist_ok=True)
      path = os.path.join(os.path.abspath(directory), f"device_memory_{os.getpid()}.prof")
      jax.profiler.save_device_memory_profile(path)
      return path
    except OSError as error:  # Read-only, full, or a file: the next place will do.
      reason = error.strerror
  return f"none written ({reason})"


def _exit(message: str, status: int) -> None:
  print(message, file=sys.stderr)
  raise SystemExit(status) from None


if __name__ == "__main__":
  main()
