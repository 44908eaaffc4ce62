"""The settings ``python -m jaxoffload.bench`` runs, one trainer run each, and their comparison."""

from __future__ import annotations

import statistics
import sys
from typing import Optional

import jax

from jaxoffload.memory import offloaded_activation_bytes, peak_host_rss_bytes
from jaxoffload.train import launch, load_config, run

FRACTIONS = (0.25, 0.5, 1.0)
NOISE_FLOOR = "baseline again"
BF16_TRANSFERS_NOTE = ("note: the host kernel's bf16 transfers settings are left out: they need "
                       "model.dtype=bfloat16 (the model multiplies in float32 here)")


def default_settings(num_layers: int, bfloat16_compute: bool, scan_layers: bool
                     ) -> dict[str, list[str]]:
  """Setting name -> trainer overrides; the baseline first (and again as a program per
  layer, and as one program with its layers' loop unrolled, or kept where the config
  unrolls it: ``scan_layers``), then each fraction with every other key at its default
  (auto placement and transfers), then each placement named.
  bfloat16 transfers of the host kernel's weights and gradients are priced only for a model
  that computes in bfloat16 (``BF16_TRANSFERS_NOTE``)."""
  optimizer = lambda f, place: ["optimizer.optimizer_cpu_offload=True",
                                f"optimizer.optimizer_offload_fraction={f}",
                                f"optimizer.optimizer_offload_update_on={place}"]
  activations = lambda n: ["model.cpu_offloading=True", f"model.cpu_offloading_num_layers={n}"]
  # The baseline twice: their loss and time differences are the noise floor
  # (nondeterministic kernels, clocks) that every other setting's are read against.
  settings = {"baseline": [], NOISE_FLOOR: []}
  # The same step as a program per layer, as the host kernel's overlap and moved
  # activations run it: which of the two ways is the faster baseline.
  settings["baseline as a program per layer"] = ["train.per_layer_step=True"]
  # One program still, the other way: its layers' loop unrolled (or kept), which decides
  # how much a program per layer saves.
  settings[f"baseline with its layers {'unrolled' if scan_layers else 'scanned'}"] = [
      f"model.scan_layers={not scan_layers}"]
  for f in FRACTIONS:
    settings[f"optimizer {f} default"] = optimizer(f, "auto")[:2]
  for f in FRACTIONS:
    settings[f"optimizer {f} device"] = optimizer(f, "device")
  for f in FRACTIONS:
    settings[f"optimizer {f} device overlap"] = (
        optimizer(f, "device") + ["optimizer.overlap_cpu_optimizer_d2h_h2d=True"])
  for n in sorted({max(num_layers // 2, 1), num_layers - 1}):
    settings[f"activations {n} layers"] = activations(n)
    settings[f"activations {n} layers moved by the trainer"] = activations(n) + [
        "model.cpu_offloading_double_buffering=True"]
  settings[f"optimizer 0.5 device + activations {num_layers - 1} layers"] = (
      optimizer(0.5, "device") + activations(num_layers - 1))
  # The transfers named: under bfloat16 compute the default would halve them.
  kernel = lambda f, wire: optimizer(f, "host_kernel") + [
      f"optimizer.offload_transfer_dtype={wire}"]
  for f in FRACTIONS:
    settings[f"optimizer {f} host_kernel"] = kernel(f, "float32")
  # The host kernel overlaps the next forward pass by default; "no overlap" runs one program.
  one_program = ["optimizer.overlap_cpu_optimizer_d2h_h2d=False"]
  for f in FRACTIONS:
    settings[f"optimizer {f} host_kernel no overlap"] = kernel(f, "float32") + one_program
  if bfloat16_compute:
    for f in FRACTIONS:
      settings[f"optimizer {f} host_kernel bf16 transfers"] = kernel(f, "bfloat16")
    for f in FRACTIONS:
      settings[f"optimizer {f} host_kernel bf16 transfers no overlap"] = (
          kernel(f, "bfloat16") + one_program)
  # The slowest last, so that a run cut short has the rest.
  for f in FRACTIONS:
    settings[f"optimizer {f} host"] = optimizer(f, "host")
  return settings


def measure(config_path: Optional[str], overrides: list[str]) -> dict:
  """One setting's figures, from a trainer run in this process."""
  config = load_config(config_path, overrides)
  launch.size_pinned_pool(config)  # As the trainer's command does, before JAX starts.
  launch.keep_compiled(config)
  result = run(config, log=lambda line: print(line, file=sys.stderr))
  times = [r.step_s for r in result.records]
  last = result.records[-1]
  return {
      "step_s": times, "step_s_median": statistics.median(times),
      "step_s_min": min(times), "step_s_max": max(times),
      "tokens_per_s": statistics.median(r.tokens_per_s for r in result.records),
      "mfu": statistics.median(r.mfu for r in result.records) if last.mfu is not None else None,
      "losses": result.losses,
      "peak_device_bytes": last.peak_device_bytes,
      "compiled_device_bytes": result.compiled_device_bytes,
      "compiled_host_temp_bytes": result.compiled_host_temp_bytes,
      "offloaded_state_bytes": result.offloaded_state_bytes,
      # What the activation offload moves to the host in one forward pass, by arithmetic.
      "offloaded_activation_bytes": offloaded_activation_bytes(
          result.setup.model, result.setup.groups, config.train.micro_batch_size,
          config.model.seq_length),
      "pinned_host_bytes": last.pinned_host_bytes,
      "peak_host_rss_bytes": peak_host_rss_bytes(),
      # What each auto setting chose and why (optimizer_offload_update_on=auto's prices).
      "choices": list(result.setup.choices),
      "device": jax.devices()[0].device_kind, "device_count": jax.device_count(),
      "jax": jax.__version__,
  }


def compare(results: list[dict]) -> None:
  """Adds each setting's ratios and loss difference against the first (the baseline)."""
  base = results[0]
  base_bytes = base["peak_device_bytes"] or base["compiled_device_bytes"]
  for r in results:
    r["step_ratio"] = r["step_s_median"] / base["step_s_median"]
    r["device_bytes"] = r["peak_device_bytes"] or r["compiled_device_bytes"]
    r["memory_ratio"] = r["device_bytes"] / base_bytes
    # What the arithmetic says leaves the device: offloaded state and activations.
    # Offloaded layers also recompute what they do not offload, so their
    # measured saving can pass the prediction.
    r["predicted_saving_bytes"] = r["offloaded_state_bytes"] + r["offloaded_activation_bytes"]
    r["measured_saving_bytes"] = base_bytes - r["device_bytes"]
    r["max_abs_loss_diff"] = max(abs(a - b) for a, b in zip(r["losses"], base["losses"]))
