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

from jaxoffload.nn.model import group_name
from jaxoffload.optim.offload_plan import leaf_path
from jaxoffload.train import (Trainer, advice, load_config, optimizer as train_optimizer, resolve,
                              run, train)
from jaxoffload.train.__main__ import main
from jaxoffload.train.launch import COMMAND_BUFFER_FLAG, set_xla_flags
from tests.helpers import HOST_KERNEL, QUIET, listed, on_tmpfs

STEPS = 5
MOVED = ["model.cpu_offloading=True", "model.cpu_offloading_num_layers=2",
         "model.cpu_offloading_double_buffering=True"]


def run_cli(*args):
  return subprocess.run([sys.executable, "-m", "jaxoffload.train", *args],
                        capture_output=True, text=True, timeout=600, check=False)


@pytest.mark.slow
def test_default_run_trains_and_the_loss_falls(capsys):
  # The command's main in this process; the command itself runs in the tests below.
  main(["train.train_iters=30"])
  first, last = re.search(r"30 steps: loss ([\d.]+) -> ([\d.]+);",
                          capsys.readouterr().out).groups()
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
    (["train.seed=-1", "data.dataset=text"], "error: train.seed must be at least 0, got -1\n"),
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


def empty_file(directory):
  (directory / "empty.txt").write_text("")
  return ["data.dataset=text", f"data.path={directory / 'empty.txt'}"]


def blank_jsonl(directory):
  (directory / "blank.jsonl").write_text("\n  \n\n")
  return ["data.dataset=text", f"data.path={directory / 'blank.jsonl'}"]


def empty_documents(directory):
  (directory / "empty.jsonl").write_text('{"text": ""}\n')
  return ["data.dataset=text", f"data.path={directory / 'empty.jsonl'}"]


def jsonl_onto_a_directory(directory):
  (directory / "steps.jsonl").mkdir()
  return [f"logging.jsonl={directory / 'steps.jsonl'}"]


def checkpoints_onto_a_file(directory):
  (directory / "run").write_text("keep me")
  return [f"checkpoint.dir={directory / 'run'}"]


# Each a member of a class of faults: empty inputs, shapes no machine holds, outputs onto
# paths that exist as something else.
@pytest.mark.parametrize("make, message", [
    (empty_file, r"data.path '.+/empty.txt' holds no text: no document in its 1 file"),
    (blank_jsonl, r"data.path '.+/blank.jsonl' holds no text: no document in its 1 file"),
    (empty_documents, r"data.path '.+/empty.jsonl' holds no text: no document in its 1 file"),
    # A batch of 25.6 GB of tokens, refused by the host's arithmetic before it is made.
    (lambda _: ["train.global_batch_size=100000000", "train.micro_batch_size=100000000"],
     r"host memory: this run needs about [\d.]+ GB more \(.*a step's batch 51.2 GB\) but "
     r".+; lower it with train.global_batch_size, model.seq_length, or set "
     r"train.host_memory_limit where that figure is wrong"),
    # One micro-batch's layer's attention scores: 12,800 TB, refused by the device's
    # arithmetic before anything compiles.
    (lambda _: ["model.seq_length=10000000"],
     r"device memory: one device needs at least 12,800.0 TB for this step \(its parameters and "
     r"optimizer state \d+ MB, its share of one micro-batch's attention scores 12,800.0 TB\) "
     r"but has .+; lower it with train.micro_batch_size, model.seq_length, more devices "
     r"\(mesh.data, mesh.fsdp\)"),
    # Its float32 logits: 205 GB.
    (lambda _: ["model.vocab_size=100000000"],
     r"device memory: one device needs at least 358.4 GB for this step \(its parameters and "
     r"optimizer state 153.6 GB, its share of one micro-batch's float32 logits 204.8 GB\)"),
    (jsonl_onto_a_directory, r"logging.jsonl=.+/steps.jsonl: cannot be written \(Is a directory"),
    (checkpoints_onto_a_file, r"checkpoint.dir '.+/run' is a file, not a directory"),
], ids=["empty-corpus", "blank-jsonl", "empty-documents", "batch-beyond-the-host",
        "attention-beyond-the-device", "logits-beyond-the-device",
        "jsonl-onto-a-directory", "checkpoints-onto-a-file"])
def test_faults_exit_2_with_one_line_writing_nothing_here(tmp_path, monkeypatch, capsys, make,
                                                          message):
  args = make(tmp_path)
  before = sorted(os.listdir(tmp_path))
  here = tmp_path / "here"
  here.mkdir()
  monkeypatch.chdir(here)
  with pytest.raises(SystemExit) as exit_:
    main(["train.train_iters=2", *args])
  assert exit_.value.code == 2
  out, err = capsys.readouterr()
  assert out == "" and re.fullmatch(f"error: {message}.*\n", err), err
  assert not os.listdir(here) and sorted(os.listdir(tmp_path)) == sorted(before + ["here"])
  if make is checkpoints_onto_a_file:
    assert (tmp_path / "run").read_text() == "keep me"


@pytest.mark.slow
@pytest.mark.parametrize("key, message", [
    ("checkpoint.dir", "checkpoint.dir '{path}' cannot be created: Read-only file system"),
    ("logging.jsonl", "logging.jsonl={path}: cannot be written (Read-only file system: {path})"),
    ("logging.profile_dir",
     "logging.profile_dir={path}: cannot be written (Read-only file system: {path})"),
])
def test_outputs_on_a_read_only_disk_exit_2_with_one_line(tmp_path, key, message):
  (tmp_path / "disk").mkdir()
  path = tmp_path / "disk" / "out"
  done = subprocess.run(on_tmpfs(tmp_path / "disk", "ro", [
      sys.executable, "-m", "jaxoffload.train", "train.train_iters=2", f"{key}={path}"]),
                        capture_output=True, text=True, timeout=300, check=False)
  assert done.returncode == 2
  assert done.stderr == f"error: {message.format(path=path)}\n"
  assert listed(done.stdout) == []


def test_a_full_disk_under_the_jsonl_warns_once_and_the_run_goes_on():
  logged = []
  losses = train(load_config(None, ["train.train_iters=3", "logging.jsonl=/dev/full"]),
                 log=logged.append)
  assert len(losses) == 3
  assert [line for line in logged if "jsonl" in line] == [
      "warning: logging.jsonl '/dev/full' could not be written at step 1 (No space left on "
      "device); the run goes on without it"]


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
    # Weights in pinned_host a program per layer, each layer sent a program ahead and the
    # activations moved, over two micro-batches: the steps compiled first, as a run does.
    pytest.param(["model.cpu_offloading=True", "model.cpu_offloading_num_layers=2",
                  "model.cpu_offloading_weights=True", "model.cpu_offloading_double_buffering=True",
                  "train.micro_batch_size=4"], marks=SLOW, id="weights-moved-accumulation"),
    # Weights in pinned_host a program per layer, the host kernel's (every leaf its own)
    # sent for each program over two micro-batches, its update applied once.
    pytest.param([*HOST_KERNEL[:1], "optimizer.optimizer_offload_fraction=1.0", *HOST_KERNEL[2:],
                  "model.cpu_offloading=True", "model.cpu_offloading_num_layers=2",
                  "model.cpu_offloading_weights=True", "train.micro_batch_size=4",
                  "optimizer.accumulate_offloaded_grads_on=device"], marks=SLOW,
                 id="weights-host-kernel-overlapped-accumulation"),
    pytest.param(["model.cpu_offloading=True", "model.cpu_offloading_num_layers=3",
                  "model.cpu_offloading_weights=True", "optimizer.optimizer_cpu_offload=True",
                  "optimizer.optimizer_offload_fraction=1.0",
                  "optimizer.optimizer_offload_update_on=device"], marks=SLOW,
                 id="weights-and-optimizer"),
    pytest.param(["train.micro_batch_size=4"], marks=SLOW, id="accumulation"),
    # The layers' loop unrolled (as configs/llama_1b.yaml runs): the same stacks, the same
    # numbers, in the group that offloads (XLA's activation and weights offload inside the
    # unrolled program) and in the one that does not.
    pytest.param(["model.scan_layers=False", "model.cpu_offloading=True",
                  "model.cpu_offloading_num_layers=3", "model.cpu_offloading_weights=True"],
                 marks=SLOW, id="layers-unrolled-activations-and-weights"),
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


def test_scan_layers_false_unrolls_the_layers_loop():
  def loops(*overrides):
    setup = resolve(load_config(None, list(overrides)))
    trainer, tokens = Trainer.from_shapes(setup), setup.global_batch(0)
    return trainer.programs.step.lower(trainer.params, trainer.host_params, trainer.opt_state,
                                       tokens).as_text().count("stablehlo.while")

  assert loops() > 0 and loops("model.scan_layers=False") == 0


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
NOTHING_OFFLOADED = ("note: optimizer.optimizer_cpu_offload=True with optimizer_offload_fraction=0 "
                     "(its default) offloads no optimizer state")


@pytest.mark.parametrize("overrides, backend, warned", [
    (["mesh.fsdp=2"], "gpu", [SHARDED]),
    (["mesh.tensor=2"], "gpu", [SHARDED]),
    (["mesh.data=2"], "gpu", []),
    (["mesh.fsdp=2"], "cpu", []),
    (["mesh.fsdp=2", "optimizer.optimizer_offload_update_on=host"], "gpu", []),
    (["optimizer.overlap_cpu_optimizer_d2h_h2d=True"], "gpu", []),
    (["optimizer.overlap_cpu_optimizer_d2h_h2d=True", "mesh.fsdp=2"], "gpu", [SHARDED]),
    (HOST_KERNEL, "gpu", []),
    (["optimizer.optimizer_offload_fraction=0"], "gpu", [NOTHING_OFFLOADED]),
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
