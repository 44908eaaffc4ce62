"""The trainer: the default run, its error exits, and equal losses whatever is offloaded."""

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxoffload.model import group_name
from jaxoffload.placement import leaf_path
from jaxoffload.train import Trainer, advice, load_config, resolve, run, train, weights
from jaxoffload.train import optimizer as train_optimizer
from jaxoffload.train.__main__ import main
from jaxoffload.train.launch import COMMAND_BUFFER_FLAG, set_xla_flags
from tests.helpers import max_rel_diff

STEPS = 5
QUIET = lambda _: None
HOST_KERNEL = ["optimizer.optimizer_cpu_offload=True", "optimizer.optimizer_offload_fraction=0.5",
               "optimizer.optimizer_offload_update_on=host_kernel"]
MOVED = ["model.cpu_offloading=True", "model.cpu_offloading_num_layers=2",
         "model.cpu_offloading_double_buffering=True"]


def run_cli(*args):
  return subprocess.run([sys.executable, "-m", "jaxoffload.train", *args],
                        capture_output=True, text=True, timeout=600, check=False)


@pytest.mark.slow
def test_default_run_trains_and_the_loss_falls():
  result = run_cli("train.train_iters=30")
  assert result.returncode == 0, result.stderr
  first, last = re.search(r"30 steps: loss ([\d.]+) -> ([\d.]+);", result.stdout).groups()
  assert float(last) < 0.8 * float(first)


def test_a_config_error_exits_2_with_one_line_and_no_traceback():
  result = run_cli("model.cpu_offloading=True", "model.recompute_granularity=full")
  assert result.returncode == 2
  assert result.stderr == ("error: CPU offloading does not work when activation recomputation "
                           "is enabled\n")
  assert result.stdout == ""


@pytest.mark.parametrize("args, message", [
    (["model.cpu_offloading=True", "model.pipeline_model_parallel_size=2"],
     "error: Currently there is no support for Pipeline parallelism with CPU offloading\n"),
    (["model.cpu_offloading=True", "model.cuda_graph_impl=transformer_engine"],
     "error: CUDA graphs not supported with CPU offloading.\n"),
    (["model.cpu_offloading=True", "model.fine_grained_activation_offloading=True"],
     "error: fine_grained_activation_offloading cannot be enabled with cpu_offloading.\n"),
    (["model.cpu_offloading=True", "model.cpu_offloading_num_layers=4"],
     "error: cpu_offloading_num_layers must be in [0, num_layers - 1] = [0, 3], got 4\n"),
    (["optimizer.optimizer_offload_fraction=-0.1"],
     "error: optimizer.optimizer_offload_fraction must be in [0.0, 1.0] or auto, got -0.1\n"),
    (["optimizer.optimizer_offload_fractoin=0.5"],
     "error: unknown config key 'optimizer.optimizer_offload_fractoin'; "
     "did you mean 'optimizer.optimizer_offload_fraction'?\n"),
    (["train.train_iters=ten"], "error: train.train_iters must be int, got 'ten' (str)\n"),
    (["data.dataset=text", "data.path=/nonexistent/corpus.txt"],
     "error: data.path '/nonexistent/corpus.txt' names no file\n"),
    (["model.hf_checkpoint=/nonexistent"],
     "error: /nonexistent/config.json: cannot be read (No such file or directory)\n"),
])
def test_config_errors_exit_2_with_one_line(args, message, capsys):
  with pytest.raises(SystemExit) as exit_:
    main(args)
  assert exit_.value.code == 2
  out, err = capsys.readouterr()
  assert (out, err) == ("", message)


@pytest.fixture(scope="module")
def baseline_losses():
  return train(load_config(None, [f"train.train_iters={STEPS}"]), log=QUIET)


SLOW = pytest.mark.slow


@pytest.mark.parametrize("overrides", [
    pytest.param(["optimizer.optimizer_cpu_offload=True", "optimizer.optimizer_offload_fraction=0.5",
                  "optimizer.optimizer_offload_update_on=host"], marks=SLOW, id="optimizer-host"),
    pytest.param(["optimizer.optimizer_cpu_offload=True", "optimizer.optimizer_offload_fraction=0.5",
                  "optimizer.optimizer_offload_update_on=device"], id="optimizer-device"),
    pytest.param(["optimizer.optimizer_cpu_offload=True", "optimizer.optimizer_offload_fraction=0.5",
                  "optimizer.optimizer_offload_update_on=device",
                  "optimizer.overlap_cpu_optimizer_d2h_h2d=True"], marks=SLOW,
                 id="optimizer-device-overlap"),
    pytest.param(["model.cpu_offloading=True", "model.cpu_offloading_num_layers=2"], marks=SLOW,
                 id="activations"),
    # The trainer moving them, a program per layer; with micro-batches; beside the host kernel.
    pytest.param(MOVED, id="activations-moved"),
    pytest.param([*MOVED, "train.micro_batch_size=4"], marks=SLOW,
                 id="activations-moved-accumulation"),
    pytest.param([*MOVED, *HOST_KERNEL, "mesh.fsdp=2", "mesh.tensor=2"], marks=SLOW,
                 id="activations-moved-host-kernel-sharded"),
    pytest.param(["model.cpu_offloading=True", "model.cpu_offloading_num_layers=3",
                  "model.cpu_offloading_weights=True", "optimizer.optimizer_cpu_offload=True",
                  "optimizer.optimizer_offload_fraction=1.0",
                  "optimizer.optimizer_offload_update_on=device"], marks=SLOW,
                 id="weights-and-optimizer"),
    pytest.param(["train.micro_batch_size=4"], marks=SLOW, id="accumulation"),
    # A program per layer where nothing needs it: without offload, beside the streamed update.
    pytest.param(["train.per_layer_step=True", "train.micro_batch_size=4"], marks=SLOW,
                 id="per-layer-accumulation"),
    pytest.param(["train.per_layer_step=True", *HOST_KERNEL[:2],
                  "optimizer.optimizer_offload_update_on=device"], marks=SLOW,
                 id="per-layer-optimizer-device"),
    pytest.param([*HOST_KERNEL, "train.micro_batch_size=4"], marks=SLOW, id="host-kernel"),
    # By default a program per layer, the host updating each before the next step reads it;
    # or one program, the host updating after it.
    pytest.param(HOST_KERNEL, id="host-kernel-overlapped"),
    pytest.param([*HOST_KERNEL, "optimizer.overlap_cpu_optimizer_d2h_h2d=False"], marks=SLOW,
                 id="host-kernel-one-program"),
    # Each shard of a layer's gradients meets the shard of weights it updates.
    pytest.param([*HOST_KERNEL, "mesh.fsdp=2", "mesh.tensor=2"], marks=SLOW,
                 id="host-kernel-overlapped-sharded"),
    # A group of one layer is still a stack: its device leaves' gradients are stacked.
    pytest.param([*HOST_KERNEL, "model.cpu_offloading=True", "model.cpu_offloading_num_layers=1"],
                 marks=SLOW, id="host-kernel-overlapped-one-layer-group"),
    pytest.param([*HOST_KERNEL[:1], "optimizer.optimizer_offload_fraction=1.0", *HOST_KERNEL[2:],
                  "optimizer.overlap_cpu_optimizer_d2h_h2d=True",
                  "model.cpu_offloading=True", "model.cpu_offloading_num_layers=2"],
                 marks=SLOW, id="host-kernel-all-overlapped-activations"),
    pytest.param([*HOST_KERNEL, "train.micro_batch_size=4",
                  "optimizer.accumulate_offloaded_grads_on=device",
                  "optimizer.overlap_cpu_optimizer_d2h_h2d=False"], marks=SLOW,
                 id="host-kernel-summing-on-the-device"),
    # Two micro-batches: the first adds, the last sends; four: one in the middle too.
    pytest.param([*HOST_KERNEL, "train.micro_batch_size=4",
                  "optimizer.accumulate_offloaded_grads_on=device"], marks=SLOW,
                 id="host-kernel-overlapped-accumulation"),
    pytest.param([*HOST_KERNEL[:1], "optimizer.optimizer_offload_fraction=1.0", *HOST_KERNEL[2:],
                  "train.micro_batch_size=2", "optimizer.accumulate_offloaded_grads_on=device",
                  "optimizer.clip_grad=0"], marks=SLOW,
                 id="host-kernel-all-overlapped-accumulation-unclipped"),
    pytest.param([*HOST_KERNEL, "train.micro_batch_size=4",
                  "optimizer.accumulate_offloaded_grads_on=device", "mesh.fsdp=2", "mesh.tensor=2"],
                 marks=SLOW, id="host-kernel-overlapped-accumulation-sharded"),
    pytest.param(["model.cpu_offloading=True", "model.cpu_offloading_num_layers=3",
                  "model.cpu_offloading_weights=True", *HOST_KERNEL[:1],
                  "optimizer.optimizer_offload_fraction=1.0", *HOST_KERNEL[2:]], marks=SLOW,
                 id="host-kernel-and-weights"),
    # Weights offload beside the host kernel's leaves, each summing its micro-batches.
    pytest.param(["model.cpu_offloading=True", "model.cpu_offloading_num_layers=2",
                  "model.cpu_offloading_weights=True", *HOST_KERNEL, "train.micro_batch_size=4"],
                 marks=SLOW, id="host-kernel-half-and-weights-accumulation"),
    # Activation, weight and host-kernel optimizer offload at once, with accumulation.
    pytest.param(["model.cpu_offloading=True", "model.cpu_offloading_num_layers=3",
                  "model.cpu_offloading_weights=True", *HOST_KERNEL[:1],
                  "optimizer.optimizer_offload_fraction=1.0", *HOST_KERNEL[2:],
                  "train.micro_batch_size=4"], marks=SLOW,
                 id="host-kernel-weights-activations-accumulation"),
])
def test_losses_equal_the_baseline(overrides, baseline_losses):
  losses = train(load_config(None, [f"train.train_iters={STEPS}", *overrides]), log=QUIET)
  assert baseline_losses[-1] < baseline_losses[0]
  np.testing.assert_allclose(losses, baseline_losses, rtol=1e-5)


@pytest.mark.parametrize("overrides", [
    pytest.param(HOST_KERNEL, id="overlapped"),
    pytest.param([*HOST_KERNEL, "optimizer.overlap_cpu_optimizer_d2h_h2d=False"], marks=SLOW,
                 id="one-program"),
])
def test_unclipped_host_kernel_losses_equal_the_unclipped_baseline(overrides):
  # Unclipped, the overlapped step's host update starts during the backward pass.
  unclipped = [f"train.train_iters={STEPS}", "optimizer.clip_grad=0"]
  whole_model = train(load_config(None, unclipped), log=QUIET)
  np.testing.assert_allclose(train(load_config(None, [*unclipped, *overrides]), log=QUIET),
                             whole_model, rtol=1e-5)


# The tiny model's gradient norms over 8 steps: 0.81 0.74 0.79 0.91 0.86 1.1 1.38 1.42 (the
# same over micro-batches, whose mean is the batch's gradient). At clip_grad=1, steps 2-6
# start early, after an unclipped step, and step 6 clips.
@SLOW
@pytest.mark.parametrize("clip_grad, speculated, undone", [(1e6, 7, 0), (1.0, 5, 1)])
@pytest.mark.parametrize("micro_batches", [
    pytest.param([], id="one-micro-batch"),
    pytest.param(["train.micro_batch_size=4", "optimizer.accumulate_offloaded_grads_on=device"],
                 id="two-micro-batches")])
def test_updates_started_before_their_clipping_equal_those_started_after_it(
    clip_grad, speculated, undone, micro_batches):
  def run(speculate):
    setup = resolve(load_config(None, [
        *HOST_KERNEL[:1], "optimizer.optimizer_offload_fraction=1.0", *HOST_KERNEL[2:],
        f"optimizer.clip_grad={clip_grad}", f"optimizer.speculate_cpu_optimizer_step={speculate}",
        *micro_batches]))
    assert setup.overlaps_host_update
    trainer = Trainer(setup, weights.initial(setup))
    norms = [float(trainer.step(setup.global_batch(step))[1]) for step in range(8)]
    trainer.host.finish()
    np.testing.assert_array_equal(np.array(norms) > 1.0, np.arange(8) >= 5)
    assert (trainer.host.speculated, trainer.host.undone) == (
        (speculated, undone) if speculate else (0, 0))
    return trainer.host.snapshot()

  plain, started_early = run(False), run(True)
  if undone:  # Taken back and applied clipped: a few float32 roundings apart.
    assert 0 < max_rel_diff(started_early, plain) <= 1e-6
  else:
    assert all(np.array_equal(a, b) for a, b in zip(started_early, plain))


@SLOW
def test_clip_grad_zero_turns_clipping_off():
  def first_moments(clip_grad):
    setup = resolve(load_config(None, [f"optimizer.clip_grad={clip_grad}"]))
    params = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), setup.param_shapes)
    transform = train_optimizer.optimizer(setup)
    grads = jax.tree.map(lambda p: jnp.full_like(p, 3.0), params)  # A norm far above 1.
    _, state = transform.update(grads, transform.init(params), params)
    return jax.tree.leaves(optax.tree.get(state, "mu"))

  b1 = load_config(None, []).optimizer.adam_beta1
  assert all(np.allclose(mu, (1 - b1) * 3.0, rtol=1e-6) for mu in first_moments(0))
  assert all(np.all(mu < 1e-3) for mu in first_moments(1.0))


def test_the_host_kernel_overlaps_the_next_forward_pass_wherever_it_can():
  trainer = lambda *more: Trainer.from_shapes(resolve(load_config(None, [*HOST_KERNEL, *more])))
  assert trainer().overlapped is not None
  assert trainer("optimizer.overlap_cpu_optimizer_d2h_h2d=False").overlapped is None
  assert trainer("train.micro_batch_size=4").overlapped is None  # A program per micro-batch.
  assert trainer("train.micro_batch_size=4",
                 "optimizer.accumulate_offloaded_grads_on=device").overlapped is not None


def test_the_step_runs_a_program_per_layer_without_offload_only_where_asked():
  trainer = lambda *more: Trainer.from_shapes(resolve(load_config(None, list(more))))
  assert trainer().overlapped is None
  assert trainer("train.per_layer_step=True").overlapped is not None


@SLOW
@pytest.mark.parametrize("micro_batches", [
    pytest.param([], id="one-micro-batch"),
    pytest.param(["train.micro_batch_size=4", "optimizer.accumulate_offloaded_grads_on=device"],
                 id="two-micro-batches")])
def test_an_overlapped_update_of_a_shared_embedding_sums_both_its_gradients(micro_batches):
  shared = [f"train.train_iters={STEPS}", "model.share_embeddings_and_output_weights=True",
            *micro_batches]
  whole_model = train(load_config(None, shared), log=QUIET)
  overlapped = train(load_config(None, [*shared, *HOST_KERNEL[:1],
                                        "optimizer.optimizer_offload_fraction=1.0",
                                        *HOST_KERNEL[2:],
                                        "optimizer.overlap_cpu_optimizer_d2h_h2d=True"]),
                     log=QUIET)
  assert whole_model[-1] < whole_model[0]
  np.testing.assert_allclose(overlapped, whole_model, rtol=1e-5)


@pytest.mark.parametrize("overrides", [
    pytest.param([], marks=SLOW, id="no-offload"),
    pytest.param([*HOST_KERNEL, "optimizer.accumulate_offloaded_grads_on=device",
                  "optimizer.overlap_cpu_optimizer_d2h_h2d=False"], marks=SLOW,
                 id="host-kernel-one-program"),
    pytest.param([*HOST_KERNEL, "optimizer.accumulate_offloaded_grads_on=device"], marks=SLOW,
                 id="host-kernel-overlapped"),
    pytest.param(HOST_KERNEL, marks=SLOW, id="host-kernel-summing-on-the-host"),
])
def test_bfloat16_gradient_sums_halve_their_memory_and_track_float32(overrides):
  runs = {}
  for dtype in ("float32", "bfloat16"):
    config = load_config(None, [f"train.train_iters={STEPS}", "train.micro_batch_size=2",
                                f"optimizer.grad_accum_dtype={dtype}", *overrides])
    setup = resolve(config)
    tokens = setup.global_batch(0)
    trainer = Trainer.from_shapes(setup)
    compiled = trainer.compile(jax.ShapeDtypeStruct(tokens.shape, tokens.dtype,
                                                    sharding=tokens.sharding))
    if setup.overlaps_host_update:  # What a middle micro-batch's programs take and give.
      hlo = "".join(program.as_text().split("\n", 1)[0]
                    for name, program in trainer.overlapped.compiled.items()
                    if name.endswith(" middle"))
    else:
      hlo = "".join(program.as_text() for program in compiled.programs)
    runs[dtype] = compiled.device_bytes, hlo, train(config, log=QUIET)
  # The device sums every leaf but those the host kernel sums in host memory; the overlapped
  # step a layer at a time.
  on_host = setup.offload.offloaded if setup.sums_on_host else ()
  groups = {group_name(g) for g in setup.groups} if setup.overlaps_host_update else set()
  paths, _ = jax.tree_util.tree_flatten_with_path(setup.param_shapes)
  summed = [(path, x) for i, (path, x) in enumerate(paths) if not (on_host and on_host[i])]
  for path, x in summed:  # Carried from one micro-batch to the next in bfloat16.
    shape = x.shape[1:] if path[0].key in groups else x.shape
    assert f"bf16[{','.join(map(str, shape))}]" in runs["bfloat16"][1], shape
  if jax.default_backend() == "cpu":
    # Two bytes an element fewer, less what the compiler's peak hides of them. (A GPU's
    # peak for so small a model falls where no sum is live: in its libraries' workspaces.)
    assert runs["float32"][0] - runs["bfloat16"][0] >= 1.5 * sum(x.size for _, x in summed)
  # Four micro-batches a step: each addition is off by less than a bfloat16 step.
  np.testing.assert_allclose(runs["bfloat16"][2], runs["float32"][2], rtol=1e-4)


@pytest.mark.parametrize("overrides", [
    pytest.param([], marks=SLOW, id="no-offload"),
    pytest.param(["optimizer.optimizer_cpu_offload=True", "optimizer.optimizer_offload_fraction=0.5",
                  "optimizer.optimizer_offload_update_on=device"], marks=SLOW,
                 id="optimizer-offload"),
    pytest.param(["optimizer.optimizer_cpu_offload=True", "optimizer.optimizer_offload_fraction=0.5",
                  "optimizer.optimizer_offload_update_on=host_kernel", "train.micro_batch_size=4"],
                 marks=SLOW, id="host-sums"),
    pytest.param(["optimizer.optimizer_cpu_offload=True", "optimizer.optimizer_offload_fraction=0.5",
                  "optimizer.optimizer_offload_update_on=host_kernel", "train.micro_batch_size=4",
                  "optimizer.accumulate_offloaded_grads_on=device",
                  "optimizer.overlap_cpu_optimizer_d2h_h2d=False"],
                 marks=SLOW, id="device-sums")])
def test_train_step_compiles_once(overrides):
  setup = resolve(load_config(None, overrides))
  trainer = Trainer(setup)
  for i in range(3):
    trainer.step(setup.global_batch(i))
  p = trainer.programs
  used = [p.zero_sums, p.micro_step, p.update_step] if setup.sums_on_host else [p.step]
  assert [program._cache_size() for program in used] == [1] * len(used)


@pytest.mark.slow
@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 devices (the CPU backend has 8 in CI)")
@pytest.mark.parametrize("offload", [[], ["model.cpu_offloading=True",
                                         "model.cpu_offloading_num_layers=2",
                                         "optimizer.optimizer_cpu_offload=True",
                                         "optimizer.optimizer_offload_fraction=0.5",
                                         "optimizer.optimizer_offload_update_on=device"]],
                         ids=["no-offload", "offload"])
def test_fsdp_gathers_weights_never_activations(offload):
  setup = resolve(load_config(None, ["mesh.fsdp=2", "train.global_batch_size=4",
                                     "train.micro_batch_size=4", *offload]))
  hlo = Trainer(setup).compile(setup.global_batch(0)).programs[0].as_text()
  gathered = re.findall(r"= f32\[([\d,]+)\][^ ]* all-gather\(", hlo)
  activation = f"4,{setup.model.seq_length},"
  assert gathered, "the sharded weights must be gathered"
  assert not [shape for shape in gathered if shape.startswith(activation)], gathered


@pytest.mark.slow
def test_nan_loss_stops_with_the_step():
  config = load_config(None, ["train.train_iters=5", "optimizer.lr=1e30", "optimizer.min_lr=1e29",
                              "optimizer.lr_warmup_iters=0"])
  with pytest.raises(FloatingPointError, match=r"loss is nan at step \d; stopping"):
    train(config, log=QUIET)


@pytest.mark.slow
def test_text_data_is_learned_and_every_step_goes_to_jsonl(tmp_path):
  log = tmp_path / "steps.jsonl"
  losses = train(load_config(None, ["data.dataset=text", "train.train_iters=40",
                                    f"logging.jsonl={log}"]), log=QUIET)
  records = [json.loads(line) for line in log.read_text().splitlines()]
  assert [r["step"] for r in records] == list(range(1, 41))
  assert [r["loss"] for r in records] == losses
  assert all(r["tokens_per_s"] > 0 and r["step_s"] > 0 for r in records)
  # Byte-level text starts near uniform guessing (ln 256 = 5.5) and must fall well below it.
  assert losses[0] > 5.0 and np.mean(losses[-5:]) < losses[0] - 1.5


def test_help_shows_examples_and_points_at_the_config_reference(capsys):
  with pytest.raises(SystemExit) as exit_:
    main(["--help"])
  assert exit_.value.code == 0
  out = capsys.readouterr().out
  assert "docs/config.md" in out and "--config configs/llama_1b.yaml" in out


@pytest.mark.slow
def test_cuda_graphs_turn_on_xla_command_buffers_for_the_run():
  result = run_cli("model.cuda_graph_impl=local", "train.train_iters=3")
  assert result.returncode == 0, result.stderr
  assert "warning" not in result.stdout and "3 steps: loss" in result.stdout
  config = load_config(None, ["model.cuda_graph_impl=transformer_engine"])
  with pytest.MonkeyPatch.context() as patch:
    patch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/dump")
    set_xla_flags(config)
    assert os.environ["XLA_FLAGS"] == f"--xla_dump_to=/tmp/dump {COMMAND_BUFFER_FLAG}"


@pytest.mark.slow
def test_bfloat16_transfers_change_no_loss_and_keep_norm_scales_float32():
  # With one micro-batch the model rounds those weights to bfloat16 itself and their
  # gradients come out of bfloat16 matmuls: halving the gradients' copies changes no number
  # where the device reads the float32 weights and rounds them as it does without offload.
  overrides = [f"train.train_iters={STEPS}", "model.dtype=bfloat16", *HOST_KERNEL[:1],
               "optimizer.optimizer_offload_fraction=1.0", *HOST_KERNEL[2:]]
  halved = load_config(None, overrides + ["optimizer.offload_transfer_dtype=bfloat16"])
  rounded_by_device = load_config(None, overrides + [
      "optimizer.offload_transfer_dtype=bfloat16", "optimizer.store_param_remainders=False"])
  float32 = train(load_config(None, overrides + ["optimizer.offload_transfer_dtype=float32"]),
                  log=QUIET)
  assert train(rounded_by_device, log=QUIET) == float32
  # Split masters round ties away from zero, not to even: one weight in 65536, one step.
  np.testing.assert_allclose(train(halved, log=QUIET), float32, rtol=1e-4)
  setup = resolve(halved)
  trainer = Trainer(setup)
  *_, grads, _ = trainer.programs.step(trainer.params, trainer.host_params, trainer.opt_state,
                               setup.global_batch(0))
  paths = jax.tree_util.tree_flatten_with_path(setup.param_shapes)[0]
  norm_scales = [leaf_path(path).endswith("norm/scale") for path, _ in paths]
  assert any(norm_scales) and not all(norm_scales)
  host = trainer.host
  for is_scale, param, grad, kept in zip(norm_scales, host.params, grads, host.weights):
    assert param.dtype == grad.dtype == (jnp.float32 if is_scale else jnp.bfloat16)
    assert kept.dtype == jnp.float32


@pytest.mark.parametrize("overlap", [pytest.param(True, marks=SLOW, id="overlapped"),
                                     pytest.param(False, marks=SLOW, id="one-program")])
def test_split_masters_train_as_float32_weights_in_half_the_pinned_memory(overlap):
  # The device reads the bfloat16 halves of the host's split masters where it read the
  # float32 weights and rounded them itself: the same weights but at ties, half the bytes up.
  overrides = [f"train.train_iters={STEPS}", "model.dtype=bfloat16", *HOST_KERNEL[:1],
               "optimizer.optimizer_offload_fraction=1.0", *HOST_KERNEL[2:],
               "optimizer.offload_transfer_dtype=bfloat16",
               f"optimizer.overlap_cpu_optimizer_d2h_h2d={overlap}"]
  float32 = load_config(None, overrides + ["optimizer.store_param_remainders=False"])
  split = load_config(None, overrides)
  np.testing.assert_allclose(train(split, log=QUIET), train(float32, log=QUIET), rtol=1e-4)
  hosts = [Trainer(resolve(c)).host for c in (float32, split)]
  assert {p.dtype for p in hosts[0].params} == {jnp.dtype(jnp.float32)}
  assert hosts[0].pinned_bytes == hosts[0].weight_bytes == hosts[1].weight_bytes
  # The norm scales stay float32 and whole: the rest pin half their bytes.
  assert hosts[0].pinned_bytes / 2 < hosts[1].pinned_bytes < 0.51 * hosts[0].pinned_bytes
  if overlap:  # The fetched weights are bfloat16 on the device either way.
    tokens = resolve(split).global_batch(0)
    shape = jax.ShapeDtypeStruct(tokens.shape, tokens.dtype, sharding=tokens.sharding)
    compiled = [Trainer.from_shapes(resolve(c)).compile(shape).device_bytes
                for c in (float32, split)]
    assert compiled[0] == compiled[1]


@pytest.mark.slow
def test_host_kernel_step_leaves_what_the_host_reads_in_host_memory():
  # The host then reads the gradients and the clipping factor in place, with no
  # transfer that could queue behind the next device step.
  setup = resolve(load_config(None, [*HOST_KERNEL[:1], "optimizer.optimizer_offload_fraction=1.0",
                                     *HOST_KERNEL[2:]]))
  trainer = Trainer(setup)
  *_, grads, clip_factor = trainer.programs.step(trainer.params, trainer.host_params, trainer.opt_state,
                                         setup.global_batch(0))
  assert {g.sharding.memory_kind for g in grads} == {"pinned_host"}
  assert clip_factor.sharding.memory_kind == "pinned_host"


@pytest.mark.slow
def test_offloaded_state_counts_the_host_kernels_weights_and_moments_once():
  config = load_config(None, ["train.train_iters=2", *HOST_KERNEL[:1],
                              "optimizer.optimizer_offload_fraction=1.0", *HOST_KERNEL[2:]])
  result = run(config, log=QUIET)
  weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(result.setup.param_shapes))
  assert result.offloaded_state_bytes == 3 * weight_bytes


SHARDED = "warning: optimizer offload streamed through the device on a mesh with fsdp="


@pytest.mark.parametrize("overrides, backend, warned", [
    (["mesh.fsdp=2"], "gpu", [SHARDED]),
    (["mesh.tensor=2"], "gpu", [SHARDED]),
    (["mesh.data=2"], "gpu", []),
    (["mesh.fsdp=2"], "cpu", []),
    (["mesh.fsdp=2", "optimizer.optimizer_offload_update_on=host"], "gpu", []),
    (["optimizer.overlap_cpu_optimizer_d2h_h2d=True"], "gpu", []),
    (["optimizer.overlap_cpu_optimizer_d2h_h2d=True", "mesh.fsdp=2"], "gpu", [SHARDED]),
    (HOST_KERNEL, "gpu", []),
])
def test_combinations_that_run_slower_are_warned_about(overrides, backend, warned):
  config = load_config(None, ["optimizer.optimizer_cpu_offload=True",
                              "optimizer.optimizer_offload_fraction=0.5",
                              "optimizer.optimizer_offload_update_on=device", *overrides])
  warnings = advice.warnings(config, backend)
  assert len(warnings) == len(warned)
  for warning, start in zip(warnings, warned):
    assert warning.startswith(start)
  if SHARDED in warned:
    assert "mesh.data avoids it" in warnings[0]


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (the CPU backend has them in CI)")
@pytest.mark.parametrize("overrides", [
    pytest.param(["optimizer.optimizer_cpu_offload=True",
                  "optimizer.optimizer_offload_fraction=0.5",
                  "optimizer.optimizer_offload_update_on=device", "model.cpu_offloading=True",
                  "model.cpu_offloading_num_layers=1", "model.cpu_offloading_activations=False",
                  "model.cpu_offloading_weights=True"], marks=pytest.mark.slow),
    pytest.param(HOST_KERNEL + ["model.dtype=bfloat16",
                                "optimizer.offload_transfer_dtype=bfloat16"],
                 marks=pytest.mark.slow),
    pytest.param(HOST_KERNEL + ["train.global_batch_size=16", "train.micro_batch_size=8"],
                 marks=pytest.mark.slow),
], ids=["offload-and-weights", "host-kernel", "host-kernel-summing-on-host"])
def test_a_trainer_of_shapes_compiles_the_same_step_and_allocates_nothing(overrides):
  setup = resolve(load_config(None, overrides + ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]))
  tokens = setup.global_batch(0)
  before = {id(x) for x in jax.live_arrays()}
  shapes = Trainer.from_shapes(setup)
  planned = shapes.compile(jax.ShapeDtypeStruct(tokens.shape, tokens.dtype,
                                                sharding=tokens.sharding))
  assert not {id(x) for x in jax.live_arrays()} - before
  trainer = Trainer(setup)
  placed = jax.tree.map(lambda x: (x.shape, x.dtype, x.sharding),
                        (trainer.params, trainer.host_params, trainer.opt_state))
  assert placed == jax.tree.map(lambda x: (x.shape, x.dtype, x.sharding),
                                (shapes.params, shapes.host_params, shapes.opt_state))
  real = trainer.compile(tokens)
  assert (planned.device_bytes, planned.host_temp_bytes) == (real.device_bytes,
                                                             real.host_temp_bytes)
  for want, got in zip(planned.programs, real.programs, strict=True):
    for field in ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
                  "temp_size_in_bytes"):
      assert getattr(want.memory_analysis(), field) == getattr(got.memory_analysis(), field)


@pytest.mark.slow
def test_bfloat16_parameters_take_updates_below_half_their_step():
  lr = 1e-7
  setup = resolve(load_config(None, [
      "model.params_dtype=bfloat16", "optimizer.main_params_dtype=bfloat16", f"optimizer.lr={lr}",
      "optimizer.min_lr=0", "optimizer.lr_warmup_iters=0", "optimizer.weight_decay=0"]))
  trainer = Trainer(setup)
  before = np.concatenate([np.asarray(p, np.float32).ravel() for p in trainer.params])
  trainer.step(setup.global_batch(0))
  after = np.concatenate([np.asarray(p, np.float32).ravel() for p in trainer.params])
  # Adam's first update is at most lr in size, and half a bfloat16 step of p exceeds
  # |p| / 2**9: rounded to nearest, none of these parameters would move.
  far = np.abs(before) / 2**9 > lr
  assert (after[far] != before[far]).sum() > 1e-3 * far.sum()


@SLOW
def test_bfloat16_parameters_train_close_to_float32(baseline_losses):
  overrides = [f"train.train_iters={STEPS}", "model.params_dtype=bfloat16",
               "optimizer.main_params_dtype=bfloat16"]
  setup = resolve(load_config(None, overrides))
  trainer = Trainer(setup)
  assert {p.dtype for p in trainer.params} == {jnp.dtype(jnp.bfloat16)}
  losses = train(load_config(None, overrides), log=QUIET)
  # Within bfloat16's rounding of the float32 run's losses.
  np.testing.assert_allclose(losses, baseline_losses, rtol=1e-2)


TWO_MICRO_BATCHES = ["train.micro_batch_size=4", "optimizer.accumulate_offloaded_grads_on=device"]


@SLOW
@pytest.mark.parametrize("micro_batches", [
    pytest.param([], id="one-micro-batch"),
    pytest.param(TWO_MICRO_BATCHES, id="two-micro-batches"),
    pytest.param([*TWO_MICRO_BATCHES, "optimizer.optimizer_offload_fraction=0.3"],
                 id="two-micro-batches-device-leaves")])
def test_the_overlapped_steps_compiled_peak_bounds_what_its_programs_leave_on_the_device(
    micro_batches):
  # Wide layers, so that the host kernel's weights outweigh the activations: a second copy
  # of them kept on the device would pass the estimate.
  setup = resolve(load_config(None, [
      *HOST_KERNEL[:1], "optimizer.optimizer_offload_fraction=1.0", *HOST_KERNEL[2:],
      "model.hidden_size=512", "model.intermediate_size=1408", "model.seq_length=16",
      *micro_batches]))
  tokens = setup.global_batch(0)
  estimate = Trainer.from_shapes(setup).compile(jax.ShapeDtypeStruct(
      tokens.shape, tokens.dtype, sharding=tokens.sharding)).device_bytes
  trainer = Trainer(setup, weights.initial(setup))
  device_bytes = lambda: sum(a.nbytes for a in jax.live_arrays()
                             if not a.is_deleted() and a.sharding.memory_kind == "device")
  before, live = device_bytes(), []

  def measured(program):
    def run(*args):
      out = jax.block_until_ready(program(*args))
      live.append(device_bytes() - before)
      return out
    return run

  pieces = trainer.overlapped.piece
  for name in ("fetch", "forward", "embed_forward", "update"):
    setattr(pieces, name, measured(getattr(pieces, name)))
  for programs in (pieces.head_step, pieces.backward, pieces.embed_backward):
    programs.update({adds: measured(program) for adds, program in programs.items()})
  for step in range(2):
    trainer.step(setup.global_batch(step))
  assert len(live) > 4 * setup.model.num_layers
  # What lives besides the parameters and state the trainer held before the step.
  resident = sum(a.nbytes for a in jax.tree.leaves((trainer.params, trainer.opt_state))
                 if a.sharding.memory_kind == "device")
  assert max(live) <= estimate - resident, (max(live), estimate, resident)
  device_grads = sum(a.nbytes for a in jax.tree.leaves(trainer.params)
                     if a.sharding.memory_kind == "device")
  if setup.offload.fraction < 1:  # The sums' pieces become these: counted once, not beside them.
    assert estimate - resident - max(live) < device_grads, (max(live), estimate, resident)


@pytest.mark.parametrize("recompute, takes_input", [("null", False), ("full", True)])
def test_the_overlapped_step_keeps_a_layers_input_only_where_its_backward_pass_reads_it(
    recompute, takes_input):
  # Saving everything, the backward pass reads what the layer made of its input: a kept input
  # would be a whole activation a layer held for nothing.
  setup = resolve(load_config(None, [*HOST_KERNEL, f"model.recompute_granularity={recompute}"]))
  trainer = Trainer(setup, weights.initial(setup))
  pieces, inputs = trainer.overlapped.piece, []

  def recording(program):
    def run(name, last, device, fetched, index, x, *rest):
      inputs.append(x)
      return program(name, last, device, fetched, index, x, *rest)
    return run

  pieces.backward.update({adds: recording(p) for adds, p in pieces.backward.items()})
  trainer.step(setup.global_batch(0))
  assert len(inputs) == setup.model.num_layers
  assert all((x is not None) == takes_input for x in inputs)


@pytest.mark.slow
def test_an_unclipped_overlapped_step_sends_no_gradient_ahead_of_the_hosts_update(monkeypatch):
  # With no room ahead, each layer's backward program waits until the host has applied
  # every gradient sent before it: the host never holds more than one program's.
  from jaxoffload import held_update
  from jaxoffload.train import overlap
  monkeypatch.setattr(overlap, "GRADIENT_BYTES_AHEAD", 0)
  pending = []
  wait = held_update.HeldUpdate.wait_for_room

  def recorded(self, limit):
    wait(self, limit)
    pending.append(self._pending)

  monkeypatch.setattr(held_update.HeldUpdate, "wait_for_room", recorded)
  config = load_config(None, [f"train.train_iters={STEPS}", *HOST_KERNEL[:1],
                              "optimizer.optimizer_offload_fraction=1.0", *HOST_KERNEL[2:],
                              "optimizer.clip_grad=0"])
  assert resolve(config).overlaps_host_update
  waited = train(config, log=QUIET)
  assert pending == [0] * (STEPS * config.model.num_layers)
  # Waiting changes no number.
  monkeypatch.setattr(held_update.HeldUpdate, "wait_for_room", lambda self, limit: None)
  assert train(config, log=QUIET) == waited


@SLOW
@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (the CPU backend has them in CI)")
def test_moved_activations_leave_for_pinned_host_and_return_a_layer_ahead(monkeypatch):
  from jaxoffload.train import overlap
  original, moves = overlap._placed, []

  def recorded(kept, memory_kind):  # Per call: from where, to where.
    moves.append(({x.sharding.memory_kind for x in kept}, memory_kind))
    return original(kept, memory_kind)

  monkeypatch.setattr(overlap, "_placed", recorded)
  mesh = ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]
  params = {}
  for moved in (False, True):
    setup = resolve(load_config(None, [*MOVED[:2], *mesh,
                                       f"model.cpu_offloading_double_buffering={moved}"]))
    assert setup.runs_per_layer == moved
    trainer = Trainer(setup)
    for i in range(2):
      trainer.step(setup.global_batch(i))
    params[moved] = jax.tree.leaves(trainer.params)
  # The same float32 steps as XLA's offload inside one program.
  assert max_rel_diff(params[True], params[False]) <= 1e-6
  # Per step, layers 0 and 1 leave after their forward programs; going backward, each comes
  # back while the layer above it is popped for its backward program: a layer ahead.
  device, host = {"device"}, {"pinned_host"}
  step = [(device, "pinned_host"), (device, "pinned_host"),
          (host, "device"),  # Popping layer 2 (not moved, as layer 3), layer 1 starts back.
          (device, "device"),  # Layer 1, back already; layer 0 starts back.
          (host, "device"),
          (device, "device")]  # Layer 0.
  assert moves == 2 * step
