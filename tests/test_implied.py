"""What a config's keys imply (``train.implied``), computed once into ``Setup.implied``."""

import pytest

from jaxoffload.train import load_config, resolve
from jaxoffload.train.implied import implied


@pytest.mark.parametrize("overrides, field, want", [
    (["train.global_batch_size=8", "train.micro_batch_size=2"], "micro_batches", 4),
    (["train.global_batch_size=8", "train.micro_batch_size=8"], "micro_batches", 1),
    (["optimizer.clip_grad=1.0"], "clips_gradients", True),
    (["optimizer.clip_grad=0"], "clips_gradients", False),
    ([], "moment_dtypes", ("float32", "float32")),
    (["optimizer.exp_avg_dtype=bfloat16"], "moment_dtypes", ("bfloat16", "float32")),
    (["model.params_dtype=bfloat16"], "moment_dtypes", ("bfloat16", "bfloat16")),
    ([], "moves_activations", False),
    (["model.cpu_offloading=True", "model.cpu_offloading_num_layers=2",
      "model.cpu_offloading_double_buffering=True"], "moves_activations", True),
    (["optimizer.overlap_cpu_optimizer_d2h_h2d=False"], "host_update_overlaps", False),
    (["train.global_batch_size=8", "train.micro_batch_size=4",
      "optimizer.accumulate_offloaded_grads_on=host"], "host_update_overlaps", False),
    (["train.global_batch_size=8", "train.micro_batch_size=4",
      "optimizer.accumulate_offloaded_grads_on=device"], "host_update_overlaps", True),
])
def test_each_key_implies_its_value(overrides, field, want):
  assert getattr(implied(load_config(None, overrides)), field) == want


def test_the_layer_groups_follow_megatrons_offload_keys():
  groups = implied(load_config(None, ["model.cpu_offloading=True",
                                      "model.cpu_offloading_num_layers=3"])).groups
  assert [(g.start, g.stop, g.placements is not None) for g in groups] == [(0, 3, True),
                                                                           (3, 4, False)]


def test_a_setup_reads_what_its_config_implies():
  config = load_config(None, ["train.micro_batch_size=2", "optimizer.clip_grad=0"])
  setup = resolve(config, with_data=False)
  assert setup.implied == implied(config)
  assert (setup.micro_batches, setup.clips_gradients) == (4, False)
