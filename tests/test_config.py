"""Configuration: YAML and overrides, key and type checks, and the reference system's rules."""

import dataclasses
import glob
import re

import jax
import numpy as np
import pytest

from jaxoffload.nn import remat
from jaxoffload.train import ConfigError, advice, implied, load_config, reference, train
from jaxoffload.train.loading import config_from_dict, parse_override
from jaxoffload.train.resolve import abstract_setup
from jaxoffload.train.run_config import MeshConfig


def test_yaml_and_overrides_make_typed_values():
  config = load_config("configs/tiny.yaml", ["optimizer.optimizer_cpu_offload=True",
                                             "optimizer.optimizer_offload_fraction=0.5",
                                             "optimizer.lr=3e-4", "train.train_iters=20"])
  assert config.model.num_layers == 4
  assert config.optimizer.optimizer_cpu_offload is True
  assert config.optimizer.optimizer_offload_fraction == 0.5
  assert config.optimizer.lr == pytest.approx(3e-4)
  assert config.train.train_iters == 20


def test_llama_1b_is_tinyllamas_shape():
  model = load_config("configs/llama_1b.yaml").model
  assert (model.vocab_size, model.hidden_size, model.intermediate_size, model.num_layers,
          model.num_attention_heads, model.num_query_groups, model.seq_length) == (
              32000, 2048, 5632, 22, 32, 4, 2048)


@pytest.mark.parametrize("overrides, message", [
    (["model.cpu_offloading=True", "model.cpu_offloading_num_layers=1",
      "model.pipeline_model_parallel_size=2"],
     "^Currently there is no support for Pipeline parallelism with CPU offloading$"),
    (["model.cpu_offloading=True", "model.cpu_offloading_num_layers=1",
      "model.recompute_granularity=full"],
     "^CPU offloading does not work when activation recomputation is enabled$"),
    (["model.cpu_offloading=True", "model.cuda_graph_impl=local"],
     r"^CUDA graphs not supported with CPU offloading\.$"),
    (["model.cpu_offloading=True", "model.fine_grained_activation_offloading=True"],
     r"^fine_grained_activation_offloading cannot be enabled with cpu_offloading\.$"),
    (["model.cpu_offloading=True", "model.cpu_offloading_num_layers=4"],
     r"cpu_offloading_num_layers must be in \[0, num_layers - 1\] = \[0, 3\], got 4"),
    (["optimizer.optimizer_offload_fraction=1.5"],
     r"optimizer.optimizer_offload_fraction must be in \[0.0, 1.0\] or auto, got 1.5"),
    (["train.global_batch_size=8", "train.micro_batch_size=3"],
     r"train.global_batch_size \(8\) must be a multiple of train.micro_batch_size \(3\)"),
    (["model.dtype=float16"], r"model.dtype must be one of \['float32', 'bfloat16'\], got 'float16'"),
    (["model.cpu_offloading_policy=qkvo"],
     r"model.cpu_offloading_policy must be one of \['all', 'qkv', .*\], got 'qkvo'"),
    (["model.attention_implementation=flash"],
     r"model.attention_implementation must be one of \[None, 'xla', 'cudnn'\], got 'flash'"),
    (["model.cpu_offloading=True", "model.cpu_offloading_num_layers=1",
      "model.cpu_offloading_double_buffering=True", "optimizer.optimizer_cpu_offload=True",
      "optimizer.optimizer_offload_fraction=0.5", "optimizer.overlap_cpu_optimizer_d2h_h2d=False"],
     r"a program per layer: optimizer.overlap_cpu_optimizer_d2h_h2d=False runs the host "
     r"kernel's update after one program: leave it null$"),
    (["model.cpu_offloading=True", "model.cpu_offloading_num_layers=1",
      "model.cpu_offloading_double_buffering=True", "optimizer.optimizer_cpu_offload=True",
      "optimizer.optimizer_offload_fraction=0.5", "train.micro_batch_size=4"],
     r"a program per layer: with several micro-batches it sums every gradient on the device: "
     r"optimizer.accumulate_offloaded_grads_on must be 'device', got 'host'$"),
    (["optimizer.use_torch_optimizer_for_cpu_offload=True"],
     r"jaxoffload has no torch optimizer; .* optimizer.optimizer_offload_update_on"),
    (["optimizer.use_distributed_optimizer=True", "mesh.data=2"],
     r"optimizer.use_distributed_optimizer=True with mesh.data=2: shard the optimizer state "
     r"with mesh.fsdp=2 instead"),
    (["logging.log_interval=-1"], r"logging.log_interval must be at least 0, got -1"),
    (["train.compilation_cache_dir=''"],
     r"^train.compilation_cache_dir must name a directory or be null, got ''$"),
    (["optimizer.overlap_cpu_optimizer_d2h_h2d=True", "optimizer.optimizer_offload_update_on=host"],
     "optimizer.overlap_cpu_optimizer_d2h_h2d=True overlaps the update with the device's work: "
     "it needs optimizer.optimizer_offload_update_on=device, host_kernel or auto, got 'host'"),
    (["optimizer.overlap_cpu_optimizer_d2h_h2d=True",
      "optimizer.optimizer_offload_update_on=host_kernel", "train.micro_batch_size=4"],
     "optimizer.overlap_cpu_optimizer_d2h_h2d=True with the host kernel: with several "
     "micro-batches it sums every gradient on the device: "
     "optimizer.accumulate_offloaded_grads_on must be 'device', got 'host'"),
])
def test_reference_rules_refuse_with_its_wording(overrides, message):
  with pytest.raises(ConfigError, match=message):
    load_config("configs/tiny.yaml", overrides)


def test_unknown_key_names_the_closest_valid_one():
  with pytest.raises(ConfigError, match=r"unknown config key 'optimizer.optimizer_offload_fractoin'; "
                                        r"did you mean 'optimizer.optimizer_offload_fraction'\?"):
    load_config(None, ["optimizer.optimizer_offload_fractoin=0.5"])
  with pytest.raises(ConfigError, match=r"unknown config key 'optimiser.lr'; did you mean 'optimizer.'"):
    load_config(None, ["optimiser.lr=0.1"])


def test_a_removed_key_is_refused_saying_why(tmp_path):
  why = ("a one-step-delayed host update is not Adam's; the exact host kernel overlaps the "
         "next step's forward pass instead (docs/performance.md#optimizer-offload)")
  with pytest.raises(ConfigError, match=re.escape(f"optimizer.delayed_update was removed: {why}")):
    load_config(None, ["optimizer.delayed_update=True"])
  old = tmp_path / "old.yaml"
  old.write_text("optimizer:\n  delayed_update_after: 40\n")
  with pytest.raises(ConfigError, match=r"^optimizer.delayed_update_after was removed: "):
    load_config(str(old))
  # A checkpoint's saved config names every key it had: the removed ones are left out.
  saved = dataclasses.asdict(load_config(None, ["train.train_iters=3"]))
  saved["optimizer"].update(delayed_update=False, delayed_update_after=0)
  assert config_from_dict(saved).train.train_iters == 3


@pytest.mark.parametrize("override, message", [
    ("train.train_iters=ten", r"train.train_iters must be int, got 'ten' \(str\)"),
    ("model.cpu_offloading=yes please", r"model.cpu_offloading must be bool, got 'yes please'"),
    ("train.train_iters=2.5", r"train.train_iters must be int, got 2.5 \(float\)"),
    ("model.recompute_granularity=3", r"model.recompute_granularity must be str or null, got 3"),
])
def test_wrong_type_names_the_key_and_the_type(override, message):
  with pytest.raises(ConfigError, match=message):
    load_config(None, [override])


def test_bad_override_and_bad_file_are_refused(tmp_path):
  with pytest.raises(ConfigError, match="must look like section.key=value"):
    parse_override("optimizer.lr")
  missing = tmp_path / "missing.yaml"
  with pytest.raises(ConfigError, match="cannot read config file"):
    load_config(str(missing))
  nested = tmp_path / "nested.yaml"
  nested.write_text("model:\n  num_layers:\n    deep: 1\n")
  with pytest.raises(ConfigError, match="config key 'model.num_layers' takes a value, not a mapping"):
    load_config(str(nested))


def test_offload_policy_picks_what_offloaded_layers_send_to_host():
  config = load_config("configs/tiny.yaml", ["model.cpu_offloading=True",
                                              "model.cpu_offloading_num_layers=2",
                                              "model.cpu_offloading_policy=residual"])
  offloaded, rest = implied.layer_groups(config)
  assert offloaded.placements == remat.offload_preset("residual") and rest.placements is None
  default = implied.layer_groups(load_config("configs/tiny.yaml", ["model.cpu_offloading=True",
                                                       "model.cpu_offloading_num_layers=2"]))
  assert default[0].placements == remat.offload_preset(remat.DEFAULT_OFFLOAD_PRESET)


def test_a_config_file_starts_from_its_base_config(tmp_path):
  (tmp_path / "base.yaml").write_text("model:\n  num_layers: 6\n  hidden_size: 32\n")
  (tmp_path / "offload.yaml").write_text(
      "base_config: base.yaml\nmodel:\n  num_layers: 8\n  cpu_offloading: true\n")
  config = load_config(str(tmp_path / "offload.yaml"), ["model.cpu_offloading_num_layers=7"])
  assert (config.model.num_layers, config.model.hidden_size) == (8, 32)
  assert config.model.cpu_offloading and config.model.cpu_offloading_num_layers == 7


def test_config_files_including_each_other_are_refused(tmp_path):
  (tmp_path / "a.yaml").write_text("base_config: b.yaml\n")
  (tmp_path / "b.yaml").write_text("base_config: a.yaml\n")
  with pytest.raises(ConfigError, match=r"config files include each other: .*a.yaml -> .*b.yaml"):
    load_config(str(tmp_path / "a.yaml"))


def test_distributed_optimizer_on_fsdp_alone_is_accepted():
  config = load_config(None, ["optimizer.use_distributed_optimizer=True", "mesh.fsdp=2"])
  assert config.optimizer.use_distributed_optimizer


@pytest.mark.parametrize("path", sorted(glob.glob("configs/*.yaml")))
def test_every_shipped_config_loads(path):
  assert load_config(path).train.train_iters >= 1


# Every shipped config's offload settings and layer count, at a tiny width; its layers looped,
# since unrolling 22 layers takes the longest compiles of the suite (the unrolled step with
# offload is test_train's).
TINY_WIDTH = ["model.scan_layers=True", "model.vocab_size=256", "model.hidden_size=64",
              "model.intermediate_size=176", "model.num_attention_heads=8",
              "model.num_query_groups=4", "model.seq_length=32", "train.global_batch_size=2",
              "train.micro_batch_size=2", "train.train_iters=2", "optimizer.lr_warmup_iters=1",
              "logging.progress_bar=False"]


@pytest.mark.slow
@pytest.mark.parametrize("path", sorted(glob.glob("configs/*.yaml")))
def test_every_shipped_config_trains_at_a_tiny_width(path):
  losses = train(load_config(path, TINY_WIDTH), log=lambda _: None)
  assert len(losses) == 2 and all(np.isfinite(losses))


# The shipped configs a CPU trains at their own size in seconds; the others' curves are
# measured on a GPU (benchmarks/config_losses.py, docs/performance.md#shipped-configs).
CPU_SIZED = ["configs/tiny.yaml"]


@pytest.mark.slow
@pytest.mark.parametrize("path", CPU_SIZED)
def test_a_config_trained_for_its_own_steps_ends_lower_and_falls_over_its_last_ten(path):
  config = load_config(path)
  losses = train(config, log=lambda _: None)
  assert len(losses) == config.train.train_iters
  slope = np.polyfit(np.arange(10), losses[-10:], 1)[0]
  assert losses[-1] < losses[0] and slope < 0, losses


@pytest.mark.parametrize("overrides, message", [
    (["optimizer.accumulate_offloaded_grads_on=cpu"],
     "optimizer.accumulate_offloaded_grads_on must be one of ['host', 'device'], got 'cpu'"),
    (["optimizer.grad_accum_dtype=float16"],
     "optimizer.grad_accum_dtype must be one of [None, 'float32', 'bfloat16'], got 'float16'"),
    (["optimizer.main_params_dtype=bfloat16"],
     "optimizer.main_params_dtype=bfloat16 with model.params_dtype=float32: jaxoffload keeps no "
     "second copy of the parameters; set both to float32 (the model computes in model.dtype) "
     "or both to bfloat16 (updates rounded stochastically)"),
    (["optimizer.offload_transfer_dtype=float16"],
     "optimizer.offload_transfer_dtype must be one of ['float32', 'bfloat16', 'auto'], got "
     "'float16'"),
    (["optimizer.offload_transfer_dtype=bfloat16", "model.dtype=bfloat16",
      "optimizer.optimizer_offload_update_on=device"],
     "optimizer.offload_transfer_dtype=bfloat16 needs optimizer.optimizer_offload_update_on="
     "host_kernel (or auto), got 'device'"),
    (["optimizer.offload_weight_copies=False"],
     "optimizer.offload_weight_copies was removed: the host kernel keeps no bfloat16 copies of "
     "float32 weights: with bfloat16 transfers it keeps each master as the bfloat16 weight the "
     "device reads plus its 16-bit remainder (optimizer.store_param_remainders"),
    (["optimizer.optimizer_offload_update_on=fastest"],
     "optimizer.optimizer_offload_update_on must be one of ['host', 'device', 'host_kernel', "
     "'auto'], got 'fastest'"),
    (["optimizer.optimizer_cpu_offload=True", "optimizer.optimizer_offload_update_on=host_kernel",
      "optimizer.offload_transfer_dtype=bfloat16"],
     "model.dtype is 'float32', so none would be"),
    (["optimizer.exp_avg_sq_dtype=float16"],
     "optimizer.exp_avg_sq_dtype must be one of [None, 'float32', 'bfloat16', 'int8'], got "
     "'float16'"),
    (["optimizer.optimizer_cpu_offload=True", "optimizer.optimizer_offload_fraction=0.5",
      "optimizer.optimizer_offload_update_on=device", "optimizer.exp_avg_dtype=int8"],
     "optimizer.exp_avg_dtype=int8 (8-bit blocks) updates where the blocks live, not streamed "
     "through the device: set optimizer.optimizer_offload_update_on to host_kernel, host or "
     "auto, got 'device'"),
])
def test_host_kernel_settings_are_checked(overrides, message):
  with pytest.raises(ConfigError, match=re.escape(message)):
    load_config(None, overrides)


@pytest.mark.parametrize("overrides, message", [
    (["optimizer.optimizer_offload_fraction=0.5"],
     "optimizer.optimizer_offload_fraction=0.5 needs optimizer.optimizer_cpu_offload=True; "
     "without it the fraction must be 0.0"),
    (["optimizer.optimizer_cpu_offload=False", "optimizer.optimizer_offload_fraction=1.0"],
     "optimizer.optimizer_offload_fraction=1.0 needs optimizer.optimizer_cpu_offload=True; "
     "without it the fraction must be 0.0"),
    (["model.cpu_offloading_num_layers=2"],
     "model.cpu_offloading_num_layers=2 needs model.cpu_offloading=True; without it the count "
     "must be 0"),
    (["model.cpu_offloading_num_layers=9"],
     "model.cpu_offloading_num_layers=9 needs model.cpu_offloading=True; without it the count "
     "must be 0"),
    (["model.cpu_offloading=True", "model.cpu_offloading_num_layers=9"],
     "cpu_offloading_num_layers must be in [0, num_layers - 1] = [0, 3], got 9"),
])
def test_a_key_without_its_switch_is_refused(overrides, message):
  with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
    load_config("configs/tiny.yaml", overrides)


def test_the_defaults_beside_a_switch_turned_off_are_accepted():
  # As the planner's settings without offload name them.
  config = load_config("configs/tiny.yaml", [
      "optimizer.optimizer_cpu_offload=False", "optimizer.optimizer_offload_fraction=0.0",
      "model.cpu_offloading=False", "model.cpu_offloading_num_layers=0"])
  assert not config.optimizer.optimizer_cpu_offload and not config.model.cpu_offloading


ACTIVATIONS_NOTE = ("note: model.cpu_offloading=True frees no memory on the cpu backend: its "
                    "offloaded activations stay in the same memory")
WEIGHTS_NOTE = ("note: model.cpu_offloading_weights=True frees no memory on the cpu backend: "
                "its offloaded weights stay in the same memory")
OFFLOAD = ["model.cpu_offloading=True", "model.cpu_offloading_num_layers=2"]


@pytest.mark.parametrize("overrides, backend, lines", [
    (OFFLOAD, "cpu", [ACTIVATIONS_NOTE]),
    ([*OFFLOAD, "model.cpu_offloading_weights=True"], "cpu", [ACTIVATIONS_NOTE, WEIGHTS_NOTE]),
    ([*OFFLOAD, "model.cpu_offloading_activations=False", "model.cpu_offloading_weights=True"],
     "cpu", [WEIGHTS_NOTE]),
    (["model.cuda_graph_impl=local"], "cpu",
     ["note: model.cuda_graph_impl=local does nothing on the cpu backend: it has no CUDA graphs"]),
    (["model.cuda_graph_impl=transformer_engine"], "cpu",
     ["note: model.cuda_graph_impl=transformer_engine does nothing on the cpu backend: it has no "
      "CUDA graphs"]),
    ([*OFFLOAD, "model.cpu_offloading_weights=True"], "gpu", []),
    (["model.cuda_graph_impl=local"], "gpu", []),
    ([], "cpu", []),
])
def test_what_does_nothing_on_a_cpu_is_noted(overrides, backend, lines):
  assert advice.warnings(load_config("configs/tiny.yaml", overrides), backend) == lines


CUDNN_ON_CPU = ("model.attention_implementation=cudnn needs a GPU; on the cpu backend it must be "
                "one of [None, 'xla']")


def test_cudnn_attention_is_refused_off_a_gpu():
  config = load_config("configs/tiny.yaml", ["model.attention_implementation=cudnn"])
  with pytest.raises(ConfigError, match=f"^{re.escape(CUDNN_ON_CPU)}$"):
    advice.check_backend(config, "cpu")
  advice.check_backend(config, "gpu")


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the run's own backend is a CPU")
def test_a_run_with_cudnn_attention_on_a_cpu_stops_before_it_compiles():
  config = load_config("configs/tiny.yaml", ["model.attention_implementation=cudnn",
                                             "train.train_iters=1"])
  logged = []
  with pytest.raises(ConfigError, match=f"^{re.escape(CUDNN_ON_CPU)}$"):
    train(config, log=logged.append)
  assert logged == []


def test_the_config_reference_is_generated_from_the_schema():
  with open("docs/config.md") as f:
    assert f.read() == reference.reference(), (
        "docs/config.md is stale: python -m jaxoffload.train.reference > docs/config.md")


def test_a_key_without_documentation_is_refused():
  @dataclasses.dataclass(frozen=True)
  class Section:
    """``section.*``: two keys.

    Attributes:
      documented: a key with its meaning.
    """

    documented: int = 0
    undocumented: int = 1

  with pytest.raises(ValueError, match="Section.undocumented has no entry"):
    reference.section("section", Section)


@pytest.mark.parametrize("override, message", [
    ("model.seq_length=0", "model.seq_length must be at least 2, got 0"),
    ("model.num_layers=0", "model.num_layers must be at least 1, got 0"),
    ("model.vocab_size=1", "model.vocab_size must be at least 2, got 1"),
    ("model.hidden_size=66", "model.hidden_size (66) must be a multiple of "
                             "model.num_attention_heads (4), or set model.kv_channels"),
    ("model.kv_channels=7", "each attention head must be an even number of channels wide, got 7"),
    ("model.max_position_embeddings=32", "model.seq_length (64) is longer than "
                                         "model.max_position_embeddings (32)"),
    ("model.num_query_groups=3", "model.num_attention_heads (4) must be a multiple of "
                                 "model.num_query_groups (3)"),
    ("optimizer.lr=0", "optimizer.lr must be > 0 and optimizer.min_lr in [0, lr], got lr=0.0"),
    ("optimizer.adam_beta2=1.0", "optimizer.adam_beta2 must be in [0, 1), got 1.0"),
    ("optimizer.weight_decay=-0.1", "optimizer.weight_decay must be at least 0, got -0.1"),
    ("mesh.fsdp=0", "mesh.fsdp must be at least 1, got 0"),
    ("optimizer.clip_grad=.nan", "optimizer.clip_grad must be >= 0 (0: no clipping), got nan"),
    ("optimizer.adam_eps=0", "optimizer.adam_eps must be > 0, got 0.0"),
])
def test_sizes_and_ranges_are_checked_at_load(override, message):
  with pytest.raises(ConfigError, match=re.escape(message)):
    load_config(None, [override])


def test_a_mesh_that_cannot_shard_the_weights_evenly_is_refused_naming_the_sizes():
  with pytest.raises(ConfigError, match=re.escape(
      "mesh.tensor=3 must divide model.vocab_size (256), model.intermediate_size (176), "
      "model.num_attention_heads x model.kv_channels (4 x 16), model.num_query_groups x "
      "model.kv_channels (2 x 16): it shards those weights' axes")):
    load_config(None, ["mesh.tensor=3"])


@pytest.mark.parametrize("fsdp, tensor, overrides", [
    (3, 1, []), (2, 2, []), (1, 4, ["model.num_query_groups=1"]), (1, 4, []),
    (1, 2, ["model.intermediate_size=174"]), (8, 1, ["model.hidden_size=72"])])
def test_the_mesh_rule_refuses_exactly_the_meshes_that_cannot_shard_the_weights(
    fsdp, tensor, overrides):
  # Against the shardings themselves (sharding.LOGICAL_RULES), reckoned without the rule.
  config = load_config(None, overrides)
  setup = abstract_setup(dataclasses.replace(config, mesh=MeshConfig(fsdp=fsdp, tensor=tensor)))
  try:
    jax.tree.map(lambda s, x: s.shard_shape(x.shape), setup.param_shardings,
                 setup.param_shapes)
    divides = True
  except ValueError:
    divides = False
  mesh = [f"mesh.fsdp={fsdp}", f"mesh.tensor={tensor}"]
  if divides:
    load_config(None, overrides + mesh)
  else:
    with pytest.raises(ConfigError, match=r"^mesh\.(fsdp|tensor)=\d must divide "):
      load_config(None, overrides + mesh)


@pytest.mark.parametrize("overrides, line", [
    (["model.cpu_offloading_weights=True"],
     "note: model.cpu_offloading_weights=True does nothing without model.cpu_offloading=True"),
    (["model.cpu_offloading_activations=False"],
     "note: model.cpu_offloading_activations=False does nothing without "
     "model.cpu_offloading=True"),
    (["optimizer.optimizer_offload_update_on=host_kernel"],
     "note: optimizer.optimizer_offload_update_on=host_kernel does nothing without "
     "optimizer.optimizer_cpu_offload=True"),
    (["optimizer.accumulate_offloaded_grads_on=device"],
     "note: optimizer.accumulate_offloaded_grads_on=device does nothing without "
     "optimizer.optimizer_cpu_offload=True"),
])
def test_a_key_whose_switch_is_off_is_noted_on_every_backend(overrides, line):
  config = load_config("configs/tiny.yaml", overrides)
  assert advice.warnings(config, "gpu") == [line]
  assert line in advice.warnings(config, "cpu")
  switched_on = load_config("configs/tiny.yaml", overrides + [
      "model.cpu_offloading=True", "model.cpu_offloading_num_layers=1",
      "optimizer.optimizer_cpu_offload=True", "optimizer.optimizer_offload_fraction=0.5"])
  assert advice.warnings(switched_on, "gpu") == []
