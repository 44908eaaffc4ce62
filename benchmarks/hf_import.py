"""A Hugging Face checkpoint through the trainer: import into its placements, fine-tune, export.

  python benchmarks/hf_import.py --shape llama3-8b --dir /tmp/llama8b --out OUT/hf_import \
      --config configs/llama_8b_offload.yaml train.train_iters=3

Writes a checkpoint of the shape with random bfloat16 weights, sharded as
``save_pretrained`` shards it, in a first process; then, in a fresh one, the
trainer imports it (``model.hf_checkpoint``) straight into the config's
placements, trains the steps with its offload settings, and exports the
weights with ``jaxoffload.hf.checkpoint.save_checkpoint``. Reports the import's seconds
and the process's peak host RSS after it against the checkpoint's bytes and
the offloaded state's, each step's time, and the export's seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

from common import metadata, run_children, write_report

SHAPES = {
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      rope_theta=500000.0, max_position_embeddings=131072,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 8192}),
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0,
                 max_position_embeddings=2048),
}


def make(shape: str, directory: str) -> dict:
  """Writes the checkpoint, each tensor cut from one pool of random values (writing, not
  drawing random numbers, is what a real checkpoint's size costs)."""
  import ml_dtypes
  import numpy as np
  from safetensors.numpy import save_file

  from jaxoffload.hf.checkpoint import INDEX_FILE, MAX_SHARD_BYTES, tensor_shapes
  from jaxoffload.hf.config import read_config

  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump({"model_type": "llama", "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
               **SHAPES[shape]}, f)
  pool = (0.02 * np.random.default_rng(0).standard_normal(2**26, np.float32)).astype(
      ml_dtypes.bfloat16)
  start, shards, shard, size, total = time.perf_counter(), [], {}, 0, 0
  for i, (name, tensor_shape) in enumerate(tensor_shapes(read_config(directory)).items()):
    # A copy: np.resize returns a view of a larger array, which the shard would keep alive.
    tensor = np.resize(np.roll(pool, i), tensor_shape).copy()
    if size and size + tensor.nbytes > MAX_SHARD_BYTES:
      shards.append(shard)
      shard, size = {}, 0
    shard[name], size, total = tensor, size + tensor.nbytes, total + tensor.nbytes
  shards.append(shard)
  weight_map = {}
  for k, tensors in enumerate(shards):
    file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
    save_file(tensors, os.path.join(directory, file), metadata={"format": "pt"})
    weight_map.update({name: file for name in tensors})
  with open(os.path.join(directory, INDEX_FILE), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
  return {"checkpoint_bytes": total, "make_s": time.perf_counter() - start}


STAGES: list[str] = []


def stage(name: str) -> None:
  """One line per stage with the host memory then, on stderr (to see where a killed run
  ended) and in the result."""
  import jax

  from jaxoffload.memory import bytes_by_memory_kind, host_rss_bytes, peak_host_rss_bytes

  pinned = bytes_by_memory_kind(jax.live_arrays()).get("pinned_host", 0)
  with open("/proc/self/status") as f:  # Anonymous, file-backed (mapped checkpoints), shared.
    kinds = [" ".join(line.split()[:2]) for line in f if line.startswith(("RssAnon", "RssFile",
                                                                          "RssShmem"))]
  STAGES.append(f"{name}: host RSS {host_rss_bytes() / 2**30:.1f} GiB ({', '.join(kinds)} kB), "
                f"peak {peak_host_rss_bytes() / 2**30:.1f} GiB, live pinned_host arrays "
                f"{pinned / 2**30:.1f} GiB")
  print(STAGES[-1], file=sys.stderr, flush=True)


def fine_tune(directory: str, config_path: str, overrides: list[str], export_dir: str) -> dict:
  import jax

  import jaxoffload
  from jaxoffload import hf
  from jaxoffload.memory import host_rss_bytes, peak_host_rss_bytes
  from jaxoffload.train import Trainer, host_memory, launch, load_config, resolve, weights

  config = load_config(config_path, [f"model.hf_checkpoint={directory}", *overrides])
  launch.size_pinned_pool(config)  # As the trainer's command does, before JAX starts.
  setup = resolve(config)
  predicted_rss = host_rss_bytes() + host_memory.check(setup).total
  stage(f"resolved; the guard predicts a peak of {predicted_rss / 2**30:.1f} GiB before export")
  start = time.perf_counter()
  params = jax.block_until_ready(weights.initial(setup))
  import_s, import_rss = time.perf_counter() - start, peak_host_rss_bytes()
  stage(f"imported in {import_s:.1f} s")
  trainer = Trainer(setup, params)
  del params
  stage("optimizer state placed")
  start = time.perf_counter()
  trainer.compile(setup.global_batch(0))
  compile_s, losses, step_s = time.perf_counter() - start, [], []
  stage(f"compiled in {compile_s:.1f} s")
  for i in range(config.train.train_iters):
    start = time.perf_counter()
    losses.append(float(trainer.step(setup.global_batch(i))[0].addressable_data(0)))
    step_s.append(time.perf_counter() - start)
    stage(f"step {i + 1}: loss {losses[-1]:.4f} in {step_s[-1]:.2f} s")
  trained_rss = peak_host_rss_bytes()
  start = time.perf_counter()
  hf.save_checkpoint(export_dir, setup.model, trainer.checkpoint()["params"], dtype="bfloat16")
  export_s = time.perf_counter() - start
  stage(f"exported in {export_s:.1f} s")
  return {"import_s": import_s, "peak_rss_after_import": import_rss, "compile_s": compile_s,
          "losses": losses, "step_s": step_s, "export_s": export_s,
          "peak_rss": peak_host_rss_bytes(), "predicted_peak_rss": predicted_rss,
          "peak_rss_before_export": trained_rss, "stages": STAGES,
          "offloaded_state_bytes": jaxoffload.bytes_by_memory_kind(
              (trainer.params, trainer.opt_state)).get("pinned_host", 0)}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
  parser.add_argument("--dir", default="/tmp/hf_import_checkpoint",
                      help="where the checkpoint is written (and its export, DIR_export)")
  parser.add_argument("--config", help="the trainer config whose placements it imports into")
  parser.add_argument("--out", default="benchmarks/runs/hf_import")
  parser.add_argument("--child", nargs=1, choices=("make", "fine_tune"), help=argparse.SUPPRESS)
  parser.add_argument("overrides", nargs="*", metavar="section.key=value")
  args = parser.parse_args()
  if args.child == ["make"]:
    print(json.dumps(make(args.shape, args.dir)))
    return
  if args.child == ["fine_tune"]:
    print(json.dumps(fine_tune(args.dir, args.config, args.overrides, args.dir + "_export")))
    return
  shutil.rmtree(args.dir, ignore_errors=True)
  shutil.rmtree(args.dir + "_export", ignore_errors=True)
  common = ["--shape", args.shape, "--dir", args.dir] + (["--config", args.config]
                                                          if args.config else [])
  made, tuned = run_children(__file__, [("make",), ("fine_tune",)], common + args.overrides)
  result = {**made, **tuned, "shape": args.shape}
  gib = 2**30
  table = "\n".join([
      f"# {args.shape} checkpoint through the trainer", "", f"Command: `{metadata(sys.argv)['command']}`",
      "", "| checkpoint (GiB) | import (s) | peak RSS after import (GiB) | pinned host state (GiB) "
      "| compile (s) | median step (s) | peak RSS before export, predicted / measured (GiB) "
      "| export (s) | peak RSS (GiB) |", "|---|---|---|---|---|---|---|---|---|",
      f"| {made['checkpoint_bytes'] / gib:.2f} | {tuned['import_s']:.1f} "
      f"| {tuned['peak_rss_after_import'] / gib:.2f} | {tuned['offloaded_state_bytes'] / gib:.2f} "
      f"| {tuned['compile_s']:.1f} | {sorted(tuned['step_s'])[len(tuned['step_s']) // 2]:.2f} "
      f"| {tuned['predicted_peak_rss'] / gib:.1f} / {tuned['peak_rss_before_export'] / gib:.1f} "
      f"| {tuned['export_s']:.1f} | {tuned['peak_rss'] / gib:.2f} |", "",
      "Host memory by stage:", "", *(f"- {line}" for line in tuned["stages"]), ""])
  write_report(args.out, {**metadata(sys.argv), "shape": args.shape}, [result], table)


if __name__ == "__main__":
  main()
