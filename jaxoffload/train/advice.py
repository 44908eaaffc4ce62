"""What a checked config costs or cannot do where it runs: refusals for the backend, warnings
and notes to print at start, and the settings an out-of-memory error names.

Pure functions of a ``Config`` and the backend's name (``jax.default_backend()``).
"""

from __future__ import annotations

from jaxoffload.train.config import Config, ConfigError
from jaxoffload.train.implied import micro_batches
from jaxoffload.train.rules import ATTENTION_IMPLEMENTATIONS

# The keys that only shape an offload, by section, and the switch without which they do
# nothing. (The fraction and the layer count are refused instead: rules.)
SWITCHED_KEYS = {
    ("model", "cpu_offloading"): ("cpu_offloading_activations", "cpu_offloading_weights",
                                  "cpu_offloading_policy", "cpu_offloading_double_buffering"),
    ("optimizer", "optimizer_cpu_offload"): (
        "optimizer_offload_update_on", "overlap_cpu_optimizer_d2h_h2d",
        "speculate_cpu_optimizer_step", "offload_transfer_dtype", "store_param_remainders",
        "accumulate_offloaded_grads_on"),
}


def check_backend(config: Config, backend: str) -> None:
  """Raises ``ConfigError`` for a setting ``backend`` cannot run, before anything compiles."""
  m = config.model
  if m.attention_implementation == "cudnn" and backend != "gpu":
    allowed = [a for a in ATTENTION_IMPLEMENTATIONS if a != "cudnn"]
    raise ConfigError(f"model.attention_implementation=cudnn needs a GPU; on the {backend} "
                      f"backend it must be one of {allowed}")


def warnings(config: Config, backend: str) -> list[str]:
  """Lines for the settings that run slowly on ``backend``, or do nothing there or at all."""
  m, o, mesh = config.model, config.optimizer, config.mesh
  lines = switched_off(config)
  if (backend == "gpu" and o.optimizer_cpu_offload and o.optimizer_offload_update_on == "device"
      and max(mesh.fsdp, mesh.tensor) > 1):
    lines.append(
        f"warning: optimizer offload streamed through the device on a mesh with fsdp="
        f"{mesh.fsdp}, tensor={mesh.tensor} ran slowly on GPUs "
        f"(docs/performance.md#several-gpus); mesh.data avoids it.")
  if o.optimizer_cpu_offload and o.optimizer_offload_fraction == 0:
    lines.append("note: optimizer.optimizer_cpu_offload=True with optimizer_offload_fraction=0 "
                 "(its default) offloads no optimizer state: set a fraction up to 1.0, or auto "
                 "for the least that fits")
  if backend == "cpu":
    # XLA's CPU client puts pinned_host arrays in the one memory it has.
    if m.cpu_offloading and m.cpu_offloading_activations:
      lines.append("note: model.cpu_offloading=True frees no memory on the cpu backend: its "
                   "offloaded activations stay in the same memory")
    if m.cpu_offloading and m.cpu_offloading_weights:
      lines.append("note: model.cpu_offloading_weights=True frees no memory on the cpu backend: "
                   "its offloaded weights stay in the same memory")
    if m.cuda_graph_impl != "none":
      lines.append(f"note: model.cuda_graph_impl={m.cuda_graph_impl} does nothing on the cpu "
                   f"backend: it has no CUDA graphs")
  return lines


def unrolled_recompute(config: Config, backend: str, runs_per_layer: bool) -> list[str]:
  """A warning where XLA's unrolled one program takes back the memory that recompute and
  activation offload would free: XLA schedules its recomputation early
  (docs/performance.md#activation-offload); a program per layer keeps them."""
  m = config.model
  inside = m.recompute_granularity is not None or (
      m.cpu_offloading and m.cpu_offloading_activations)
  if m.scan_layers or runs_per_layer or not inside or backend not in ("gpu", "cpu"):
    return []
  return ["warning: model.scan_layers=False with recompute or activation offload in one "
          "program saves no device memory: XLA recomputes the unrolled layers early "
          "(docs/performance.md#activation-offload); scan_layers=True saves it, or "
          "model.cpu_offloading_double_buffering=True moves activations a program per layer"]


def switched_off(config: Config) -> list[str]:
  """A note for each key given a value other than its default whose switch is off."""
  lines = []
  for (section, switch), keys in SWITCHED_KEYS.items():
    values = getattr(config, section)
    if getattr(values, switch):
      continue
    defaults = type(values)()
    for key in keys:
      if getattr(values, key) != getattr(defaults, key):
        lines.append(f"note: {section}.{key}={getattr(values, key)} does nothing without "
                     f"{section}.{switch}=True")
  return lines


def device_memory_levers(config: Config) -> list[str]:
  """The settings that would lower ``config``'s device memory from where it stands, none
  already at its limit, each as ``key=value``s to set and a note: what an out-of-memory
  error names (``levers.device_figures`` adds what each frees)."""
  m, o, t = config.model, config.optimizer, config.train
  levers = []
  if not o.optimizer_cpu_offload:
    levers.append("optimizer.optimizer_cpu_offload=True optimizer.optimizer_offload_fraction=1.0")
  elif o.optimizer_offload_fraction != "auto" and o.optimizer_offload_fraction < 1.0:
    levers.append(f"optimizer.optimizer_offload_fraction=1.0 (now {o.optimizer_offload_fraction})")
  if o.optimizer_cpu_offload and o.optimizer_offload_update_on in ("device", "host"):
    levers.append("optimizer.optimizer_offload_update_on=host_kernel (the device then holds "
                  "no float32 weights or gradients of the offloaded leaves)")
  if t.micro_batch_size > 1:
    smaller = max(n for n in range(1, t.micro_batch_size) if t.global_batch_size % n == 0)
    levers.append(f"train.micro_batch_size={smaller} (now {t.micro_batch_size})")
  if micro_batches(config) > 1 and o.grad_accum_dtype != "bfloat16":
    levers.append("optimizer.grad_accum_dtype=bfloat16")
  if m.recompute_granularity is None and not m.cpu_offloading:
    levers.append("model.recompute_granularity=selective")
  if m.recompute_granularity != "full" and not m.cpu_offloading:
    levers.append("model.recompute_granularity=full")
  if m.cpu_offloading and m.cpu_offloading_num_layers < m.num_layers - 1:
    levers.append(f"model.cpu_offloading_num_layers={m.num_layers - 1} (now "
                  f"{m.cpu_offloading_num_layers})")
  return levers
