"""The host-memory guard: its arithmetic against what the trainer allocates, and its refusal."""

import os
import subprocess
import sys

import jax
import pytest

from jaxoffload.memory import _read_keyed, host_rss_bytes, parse_bytes, size
from jaxoffload.train import Trainer, load_config, resolve
from jaxoffload.train.checkpoints import host_checkpoint
from jaxoffload.train.config import ConfigError
from jaxoffload.train.host_memory import available, check, needed
from jaxoffload.train.loading import override
from jaxoffload.train.per_layer.offloaded_layers import offloaded_group_bytes
from jaxoffload.train.resolve import resolve_like

OFFLOAD = ["optimizer.optimizer_cpu_offload=True", "optimizer.optimizer_offload_fraction=1.0",
           "optimizer.optimizer_offload_update_on=device"]
MESH = ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]


def test_sizes_read_as_bytes():
  assert parse_bytes(123) == 123
  assert parse_bytes("64GB") == 64 * 10**9
  assert parse_bytes("1.5 GiB") == 3 * 2**29
  assert parse_bytes("8e9") == 8 * 10**9
  with pytest.raises(ValueError, match="'lots' is not a size"):
    parse_bytes("lots")
  with pytest.raises(ConfigError, match="^train.host_memory_limit: '64 parsecs' is not a size"):
    load_config(None, ["train.host_memory_limit=64 parsecs"])
  with pytest.raises(ConfigError, match="train.host_memory_limit must be at least 1, got 0"):
    load_config(None, ["train.host_memory_limit=0"])


def shard_bytes(tree, kind):
  """What the buffers in ``kind`` memory really hold: every device's shard (of arrays, not
  scalars)."""
  return sum(shard.data.nbytes for leaf in jax.tree.leaves(tree)
             if isinstance(leaf, jax.Array) and leaf.ndim and leaf.sharding.memory_kind == kind
             for shard in leaf.addressable_shards)


pinned_shard_bytes = lambda tree: shard_bytes(tree, "pinned_host")


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (the CPU backend has them in CI)")
def test_the_arithmetic_counts_every_shard_the_trainer_places_in_host_memory():
  setup = resolve(load_config(None, OFFLOAD + MESH + [
      "optimizer.optimizer_offload_fraction=0.5", "checkpoint.dir=/nonexistent/run",
      "model.cpu_offloading=True", "model.cpu_offloading_num_layers=1",
      "model.cpu_offloading_activations=False", "model.cpu_offloading_weights=True",
      "optimizer.exp_avg_dtype=bfloat16", "optimizer.exp_avg_sq_dtype=bfloat16"]))
  trainer = Trainer(setup)
  need = needed(setup)
  assert {x.dtype.name for x in jax.tree.leaves(trainer.opt_state) if x.ndim} == {"bfloat16"}
  assert need.held["optimizer state"] == pinned_shard_bytes(trainer.opt_state) > 0
  # Offloaded weights, and their new values as they arrive in host memory.
  assert need.held["offloaded weights"] == 2 * pinned_shard_bytes(trainer.params)
  # A save takes about the checkpoint's bytes of host memory: every shard it holds.
  saved = trainer.checkpoint()
  assert need.transient["saving a checkpoint"] == sum(
      shard_bytes(saved, kind) for kind in ("device", "pinned_host")) > 0


def test_weights_updated_a_layer_at_a_time_hold_nothing_beside_their_stack():
  weights = ["model.cpu_offloading=True", "model.cpu_offloading_num_layers=2",
             "model.cpu_offloading_activations=False", "model.cpu_offloading_weights=True",
             "train.per_layer_step=True"]
  unclipped = resolve(load_config(None, [*weights, "optimizer.clip_grad=0"]))
  stack = pinned_shard_bytes(Trainer(unclipped).params)
  assert unclipped.weights_updated_by_layer == {"layers_0_2"}
  assert needed(unclipped).held["offloaded weights"] == stack  # Written into it in place.
  assert offloaded_group_bytes(unclipped)[1] == 0  # Nothing crosses whole for the update.
  # Clipped, the update needs the global norm first: the whole group over and back.
  clipped = resolve_like(unclipped, override(unclipped.config, ["optimizer.clip_grad=1"]))
  assert clipped.weights_updated_by_layer == set()
  assert needed(clipped).held["offloaded weights"] == 2 * stack
  assert offloaded_group_bytes(clipped)[1] == stack


@pytest.mark.slow
@pytest.mark.parametrize("micro_batches, moments, remainders", [
    (1, "float32", True), (2, "float32", True), (1, "bfloat16", True), (1, "float32", False),
    (1, "int8", True)])
def test_the_host_kernel_arithmetic_is_what_it_allocates(micro_batches, moments, remainders):
  setup = resolve(load_config(None, [
      "optimizer.optimizer_cpu_offload=True",
      f"optimizer.optimizer_offload_fraction={1.0 if moments == 'int8' else 0.5}",
      "optimizer.optimizer_offload_update_on=host_kernel", "model.dtype=bfloat16",
      "optimizer.offload_transfer_dtype=bfloat16", f"train.micro_batch_size={8 // micro_batches}",
      "checkpoint.dir=/nonexistent/run", f"optimizer.exp_avg_dtype={moments}",
      f"optimizer.exp_avg_sq_dtype={moments}",
      f"optimizer.store_param_remainders={remainders}"]))
  trainer = Trainer(setup)
  trainer.step(setup.global_batch(0))
  # A save copies the checkpoint's bytes, the host kernel's float32 weights and moments more.
  saved = trainer.checkpoint()
  everything = sum(shard_bytes(saved, kind) for kind in ("device", "pinned_host"))
  host_kernel = sum(shard_bytes(trainer.host.checkpoint(copy=False)[name], kind)
                    for name in ("params", "mu", "nu") for kind in ("device", "pinned_host"))
  tokens = setup.global_batch(1)
  if micro_batches == 1:
    host_grads = trainer.programs.step(trainer.params, trainer.host_params, trainer.opt_state, tokens)[4]
  else:
    host_grads = trainer.programs.micro_step(trainer.params, trainer.host_params, trainer.programs.zero_sums(),
                                     tokens, 0, 0)[1]
  need = needed(setup)
  host = trainer.host
  # The moments, and the float32 sums of the micro-batches' gradients.
  sums = (micro_batches > 1) * host.weight_bytes
  assert need.held["host kernel moments and sums"] == host.moment_bytes + sums
  assert host.unpinned_bytes == host.moment_bytes + host.state.remainder_bytes + sums
  per_element = {"float32": 8, "bfloat16": 4, "int8": 2}[moments]
  assert 0 <= host.moment_bytes - host.weight_bytes * per_element / 4 < 0.05 * host.moment_bytes
  # A float32 master an element, split or whole, and one step's gradients, or two
  # micro-batches' in flight.
  assert need.held["host kernel weights"] == host.weight_bytes
  assert host.state.remainder_bytes == (host.weight_bytes - host.pinned_bytes if remainders
                                        else 0)
  assert need.held["host kernel gradients"] == micro_batches * sum(g.nbytes for g in host_grads)
  assert need.pinned == host.pinned_bytes + need.held["host kernel gradients"]
  assert need.held["optimizer state"] == 0
  # The host kernel's leaves are written a piece at a time, from the live state.
  assert need.transient["saving a checkpoint"] == int(
      everything - host_kernel + host_checkpoint.SAVE_BYTES)


def test_an_unclipped_overlapped_update_holds_a_bounded_share_of_its_gradients(monkeypatch):
  from jaxoffload.train import host_memory
  options = ["optimizer.optimizer_cpu_offload=True", "optimizer.optimizer_offload_fraction=1.0",
             "optimizer.optimizer_offload_update_on=host_kernel"]
  clipped = needed(resolve(load_config(None, options)))
  monkeypatch.setattr(host_memory, "GRADIENT_BYTES_AHEAD", 0)
  setup = resolve(load_config(None, options + ["optimizer.clip_grad=0"]))
  unclipped = needed(setup)
  # Clipped, every gradient waits for the norm; unclipped, the head's and the embedding's
  # and one layer's at a time (the 4 layers' stacks hold the rest).
  whole = sum(x.size * 4 for x in jax.tree.leaves(setup.param_shapes))
  layers = sum(x.size * 4 for path, x in jax.tree_util.tree_flatten_with_path(
      setup.param_shapes)[0] if path[0].key.startswith("layers"))
  assert clipped.held["host kernel gradients"] == whole
  assert unclipped.held["host kernel gradients"] == whole - layers + layers // 4
  assert clipped.pinned - unclipped.pinned == layers - layers // 4


@pytest.mark.slow
def test_a_run_that_cannot_fit_is_refused_in_one_line_before_it_allocates():
  result = subprocess.run(
      [sys.executable, "-m", "jaxoffload.train", "--config", "configs/llama_8b_offload.yaml",
       "optimizer.optimizer_offload_fraction=1.0", "optimizer.optimizer_offload_update_on=device",
       "train.host_memory_limit=16GB"],
      capture_output=True, text=True, timeout=120, check=False)
  assert result.returncode == 2, result.stderr
  line, = [l for l in result.stderr.splitlines() if l.strip()]
  # The 8B shape's float32 moments, whole: 2 x 8.03e9 x 4 bytes.
  assert line.startswith("error: host memory: this run needs about ")
  assert "optimizer state 64.2 GB" in line
  assert "left under train.host_memory_limit=16.0 GB" in line
  assert "lower it with optimizer.optimizer_offload_fraction" in line
  assert line.endswith(", or raise train.host_memory_limit")


def test_a_run_that_nothing_but_the_limit_could_fit_is_told_to_raise_it():
  # The tiny model's only large part is the JAX runtime's reserve, which no key lowers.
  with pytest.raises(ConfigError, match=r"is left under train\.host_memory_limit=1 MB with "
                                        r"the .* this process holds; raise "
                                        r"train\.host_memory_limit$"):
    check(resolve(load_config(None, ["train.host_memory_limit=1MB"])))


def test_the_budget_is_the_limit_less_what_the_process_holds_else_the_machines(tmp_path):
  held = host_rss_bytes()
  have, source = available(10**12)
  assert held <= 10**12 - have <= 2 * held  # RSS read twice: the second may have grown.
  assert source.startswith("left under train.host_memory_limit=1.0 TB with the ")
  have, source = available(None)
  assert 0 < have and ("MemAvailable" in source or "cgroup" in source)
  meminfo = tmp_path / "meminfo"
  meminfo.write_text("MemTotal:  1000 kB\nMemAvailable:   512 kB\nHugePages_Total:       0\n")
  assert _read_keyed(str(meminfo)) == {"MemTotal": 1000, "MemAvailable": 512,
                                       "HugePages_Total": 0}


@pytest.mark.parametrize("settings, lowered_by", [
    ([], "optimizer.exp_avg_sq_dtype=bfloat16$"),
    (["optimizer.optimizer_offload_update_on=host_kernel",
      "optimizer.offload_transfer_dtype=float32"],
     "optimizer.offload_transfer_dtype=bfloat16$"),
    (["optimizer.optimizer_offload_update_on=host_kernel",
      "optimizer.offload_transfer_dtype=bfloat16"],
     r"optimizer.optimizer_offload_fraction, model.params_dtype=bfloat16 \(bfloat16 masters\)$")])
def test_a_run_pinning_more_than_xlas_pinned_pool_gives_is_refused(monkeypatch, settings,
                                                                   lowered_by):
  # On a GPU, XLA's pinned pool stops at XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB (64 GiB unset):
  # a step that needs more would fail mid-run. The keys named are those that lower what this
  # run pins, none already at its limit.
  from jaxoffload.train import host_memory
  setup = resolve(load_config(None, OFFLOAD + settings + ["model.dtype=bfloat16"]))
  assert 0 < needed(setup).pinned < 2**30  # So the pool it needs rounds up to 1 GiB.
  monkeypatch.setattr(host_memory, "pinned_pool_limit", lambda: 1000)
  with pytest.raises(ConfigError, match=(
      r"^host memory: this run pins about .* of host memory per GPU, more than XLA's pinned "
      r"pool gives \(0 MB, XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB\); set "
      r"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=1 or more before starting, or lower the pinned "
      rf"bytes with .*{lowered_by}")):
    host_memory.check(setup)


GiB, MiB = 2**30, 2**20


def test_a_gpu_pinned_pool_grows_by_doubling_regions_up_to_its_limit():
  from jaxoffload.train.host_memory import pinned_pool_bytes

  # Regions of 2, 4, ... MiB: k of them hold 2 MiB * (2**k - 1). The pool adds them until
  # it holds the arrays and an eighth more, the last one cut at the limit.
  regions = lambda wanted: next(2 * MiB * (2**k - 1) for k in range(1, 64)
                                if 2 * MiB * (2**k - 1) >= wanted)
  assert pinned_pool_bytes(17 * GiB, 64 * GiB) == regions(17 * GiB * 9 / 8) == 32 * GiB - 2 * MiB
  assert pinned_pool_bytes(44 * GiB, 64 * GiB) == regions(44 * GiB * 9 / 8) == 64 * GiB - 2 * MiB
  assert pinned_pool_bytes(44 * GiB, 50 * GiB) == 50 * GiB  # The last region is cut.
  assert pinned_pool_bytes(100 * MiB, 64 * GiB) == regions(100 * MiB * 9 / 8) == 126 * MiB
  # Each device's pool holds its share.
  assert pinned_pool_bytes(34 * GiB, 64 * GiB, devices=2) == 2 * (32 * GiB - 2 * MiB)
  # Without a GPU's pool: the arrays and an eighth.
  assert pinned_pool_bytes(8 * GiB, None) == 9 * GiB
  assert pinned_pool_bytes(0, 64 * GiB) == 0


def test_the_guard_counts_a_gpus_whole_pinned_pool(monkeypatch):
  from jaxoffload.train import host_memory
  setup = resolve(load_config(None, OFFLOAD))
  arrays = needed(setup).pinned
  monkeypatch.setattr(host_memory, "pinned_pool_limit", lambda: 64 * GiB)
  need = needed(setup)
  assert need.pinned == arrays == need.held["optimizer state"] > 0
  assert arrays + need.held["pinned allocator overhead"] == host_memory.pinned_pool_bytes(
      arrays, 64 * GiB, jax.local_device_count())


def test_the_pool_limit_that_holds_the_pinned_arrays_is_advised_where_it_saves(monkeypatch):
  from jaxoffload.train import host_memory
  monkeypatch.setattr(host_memory, "pinned_pool_limit", lambda: 64 * GiB)
  n = jax.local_device_count()  # Each device's pool holds its share.
  advice = lambda pinned: host_memory.pool_limit_advice(host_memory.HostBytes({}, {}, n * pinned))
  # 49.5 GiB of arrays with an eighth for fragmentation: a 50 GiB pool, not 64 GiB.
  assert advice(44 * GiB) == (
      f"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=50 before starting (XLA's pinned pool then holds "
      f"{host_memory.size(n * 50 * GiB)}, not {host_memory.size(n * (64 * GiB - 2 * MiB))})")
  # A pool of 32 GiB for 17 GiB: 20 GiB holds it with a little to spare.
  assert advice(17 * GiB).startswith("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=20 ")
  # 33.75 GiB wanted: the regions reach 64 GiB, where 34 would do.
  assert advice(30 * GiB).startswith("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=34 ")
  assert advice(28 * GiB - 2 * MiB) == ""  # 31.5 GiB: the 32 GiB of regions hold it.
  monkeypatch.setattr(host_memory, "pinned_pool_limit", lambda: None)
  assert advice(44 * GiB) == ""


def test_a_refusal_names_the_pool_limit_where_the_pinned_pool_is_a_large_part(monkeypatch):
  from jaxoffload.train import host_memory

  # A GPU's pool far past its arrays: 44 GiB of them spread over this process's devices.
  monkeypatch.setattr(host_memory, "pinned_pool_limit", lambda: 64 * GiB)
  pinned = 44 * GiB
  overhead = host_memory.pinned_pool_bytes(pinned, 64 * GiB, jax.local_device_count()) - pinned
  monkeypatch.setattr(host_memory, "needed", lambda setup: host_memory.HostBytes(
      {"optimizer state": pinned, "pinned allocator overhead": overhead}, {}, pinned))
  setup = resolve(load_config(None, ["train.host_memory_limit=10GB"]))
  advice = host_memory.pool_limit_advice(host_memory.needed(setup))
  assert advice.startswith("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=")
  with pytest.raises(ConfigError, match="lower it with optimizer.exp_avg_dtype=int8"
                                        ".*, XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB="):
    host_memory.check(setup)


def test_the_trainer_sizes_the_pinned_pool_before_the_backend_starts():
  # In a fresh process: the sizing must start no backend, whose pool takes its size then.
  code = """
import math, os
from jax._src import xla_bridge
from jaxoffload.train import launch, load_config
from jaxoffload.train.host_memory import largest_pinned_array, pinned_per_device
from jaxoffload.train.resolve import abstract_setup
config = load_config("configs/llama_13b_offload.yaml", ["optimizer.clip_grad=0"])
gib = launch.size_pinned_pool(config)
assert not xla_bridge._backends, "a backend started"
setup = abstract_setup(config)
pinned = pinned_per_device(setup)
# Room for one more of the largest array: a stack's bfloat16 MLP weights, 40 x 5120 x 13824.
assert largest_pinned_array(setup) == 40 * 5120 * 13824 * 2
assert gib == math.ceil((1.125 * pinned + 40 * 5120 * 13824 * 2) / 2**30), (gib, pinned)
assert os.environ["XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"] == str(gib)
# A limit the user set stands.
assert launch.size_pinned_pool(config) is None
# An auto placement: the larger pool of the two it may choose.
del os.environ["XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"]
auto = load_config("configs/llama_8b_offload.yaml", ["optimizer.optimizer_offload_fraction=1.0",
                                                      "optimizer.optimizer_offload_update_on=auto"])
pools = {}
for place in ("device", "host_kernel"):
  placed = abstract_setup(load_config("configs/llama_8b_offload.yaml", [
      "optimizer.optimizer_offload_fraction=1.0", f"optimizer.optimizer_offload_update_on={place}"]))
  pools[place] = 1.125 * pinned_per_device(placed) + largest_pinned_array(placed)
assert pools["host_kernel"] != pools["device"]
assert launch.size_pinned_pool(auto) == math.ceil(max(pools.values()) / 2**30)
assert not xla_bridge._backends, "a backend started"
print(gib, pinned)
"""
  env = {k: v for k, v in os.environ.items() if k != "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"}
  done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                        timeout=120, check=False)
  assert done.returncode == 0, done.stderr[-2000:]
  gib, pinned = done.stdout.split()
  # The 13B shape's bfloat16 weights and a bounded share of its gradients: 26 GB and more.
  assert 26e9 < int(pinned) < 30e9 and int(gib) == 36


def test_a_refusal_names_each_lever_once_and_none_at_its_limit():
  # The fraction lowers three parts; the moments are 8-bit and the transfers bfloat16 already.
  setup = resolve(load_config("configs/llama_1b.yaml", [
      "data.dataset=synthetic", "optimizer.optimizer_cpu_offload=True",
      "optimizer.optimizer_offload_fraction=1.0", "optimizer.optimizer_offload_update_on=host_kernel",
      "model.dtype=bfloat16", "optimizer.exp_avg_dtype=int8", "optimizer.exp_avg_sq_dtype=int8",
      "train.micro_batch_size=4", "train.host_memory_limit=5GB"]))
  with pytest.raises(ConfigError) as refused:
    check(setup)
  levers = str(refused.value).split("; lower it with ")[1].split(", or raise ")[0]
  # Each with what the run would need once it is set: the guard's own arithmetic.
  need = lambda setting: needed(resolve_like(setup, override(setup.config, [setting]))).total
  half, summed_on_device, bf16_masters = (need(setting) for setting in (
      "optimizer.optimizer_offload_fraction=0.5", "optimizer.accumulate_offloaded_grads_on=device",
      "model.params_dtype=bfloat16"))
  assert levers == (
      f"optimizer.optimizer_offload_fraction=0.5 (needs {size(half)}), "
      f"optimizer.accumulate_offloaded_grads_on=device (needs {size(summed_on_device)}), "
      f"model.params_dtype=bfloat16 (bfloat16 masters; needs {size(bf16_masters)})")
  assert max(half, summed_on_device, bf16_masters) < needed(setup).total
