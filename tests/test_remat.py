"""Remat policies built from per-name placements: validation, grouping, and unchanged gradients."""

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name

from jaxoffload.nn import remat
from jaxoffload.nn.remat import Placement
from tests.helpers import max_rel_diff


def test_names_left_out_are_recomputed():
  checked = remat.check_placements({"query_proj": "offload", "layer_input": Placement.SAVE})
  assert checked["query_proj"] is Placement.OFFLOAD
  assert checked["layer_input"] is Placement.SAVE
  assert checked["mlp_up"] is Placement.RECOMPUTE
  assert list(checked) == list(remat.ACTIVATION_NAMES)


def test_unknown_name_or_placement_is_refused():
  with pytest.raises(ValueError, match=r"unknown activation names \['qkv'\]; known: \['layer_input'"):
    remat.check_placements({"qkv": "save"})
  with pytest.raises(ValueError, match=r"placement of 'mlp_up' must be one of \['save', 'offload', "
                                       r"'recompute'\], got 'host'"):
    remat.check_placements({"mlp_up": "host"})


def test_a_models_own_names_are_checked_against_that_model():
  checked = remat.check_placements({"hidden": "offload"}, names=("block_input", "hidden"))
  assert checked == {"block_input": Placement.RECOMPUTE, "hidden": Placement.OFFLOAD}
  with pytest.raises(ValueError, match=r"unknown activation names \['query_proj'\]; known: "
                                       r"\['block_input', 'hidden'\]"):
    remat.remat_policy({"query_proj": "offload"}, names=("block_input", "hidden"))


@pytest.mark.parametrize("n, expected", [
    (0, [(0, 4, None)]),
    (1, [(0, 1, "offload"), (1, 4, None)]),
    (3, [(0, 3, "offload"), (3, 4, None)]),
])
def test_first_n_layers_form_the_offloaded_group(n, expected):
  groups = remat.layer_groups(4, offload_num_layers=n)
  got = [(g.start, g.stop, None if g.placements is None else "offload") for g in groups]
  assert got == expected


@pytest.mark.parametrize("n", [-1, 4, 7])
def test_offloaded_layer_count_outside_range_is_refused(n):
  with pytest.raises(ValueError, match=rf"cpu_offloading_num_layers must be in \[0, num_layers - 1\] "
                                       rf"= \[0, 3\], got {n}"):
    remat.layer_groups(4, offload_num_layers=n)


def _stack_loss(groups, weights, x):
  """A scanned stack of tagged tanh layers, one scan per layer group."""

  def layer(h, w):
    h = checkpoint_name(h, "layer_input")
    q = checkpoint_name(jnp.tanh(h @ w), "query_proj")
    return checkpoint_name(jnp.tanh(q @ w.T), "mlp_up") + h, None

  for group in groups:
    x, _ = jax.lax.scan(group.wrap(layer), x, weights[group.start:group.stop])
  return jnp.sum(x ** 2)


@pytest.mark.parametrize("groups", [
    remat.layer_groups(4, base_placements=remat.RECOMPUTE_ALL),
    remat.layer_groups(4, offload_num_layers=1),
    remat.layer_groups(4, offload_num_layers=3),
    remat.layer_groups(4, offload_num_layers=2,
                             offload_placements={"query_proj": "offload", "layer_input": "save"},
                             base_placements={"mlp_up": "save"}),
], ids=["recompute", "offload-1", "offload-3", "mixed"])
def test_gradients_equal_saving_everything(groups):
  weights = jax.random.normal(jax.random.PRNGKey(0), (4, 16, 16)) / 4
  x = jax.random.normal(jax.random.PRNGKey(1), (8, 16))
  want = jax.jit(jax.grad(lambda w: _stack_loss(remat.layer_groups(4), w, x)))(weights)
  got = jax.jit(jax.grad(lambda w: _stack_loss(groups, w, x)))(weights)
  assert max_rel_diff(got, want) <= 1e-5


def test_offload_policy_sends_named_residuals_to_host():
  # Checked on the jaxpr: the CPU backend lowers these host transfers to nothing,
  # since its host and device memory are one; the GPU tests check the memory.
  weights = jnp.ones((2, 16, 16)) / 16
  x = jnp.ones((8, 16))

  def host_values(groups):
    jaxpr = jax.make_jaxpr(jax.grad(lambda w: _stack_loss(groups, w, x)))(weights)
    return str(jaxpr).count("<host>")

  assert host_values(remat.layer_groups(2, offload_num_layers=1)) > 0
  assert host_values(remat.layer_groups(2)) == 0
  assert host_values(remat.layer_groups(2, base_placements=remat.RECOMPUTE_ALL)) == 0


def test_megatron_settings_make_the_expected_groups():
  assert remat.megatron_layer_groups(4) == remat.layer_groups(4)
  full = remat.megatron_layer_groups(4, recompute_granularity="full")
  assert [g.placements for g in full] == [remat.RECOMPUTE_ALL]
  selective = remat.megatron_layer_groups(4, recompute_granularity="selective")
  assert [g.placements for g in selective] == [remat.RECOMPUTE_SELECTIVE]
  groups = remat.megatron_layer_groups(4, cpu_offloading=True, cpu_offloading_num_layers=3,
                                       cpu_offloading_weights=True)
  assert [(g.start, g.stop, g.offload_weights) for g in groups] == [(0, 3, True), (3, 4, False)]
  assert groups[0].placements == remat.offload_preset("qkv") and groups[1].placements is None
  weights_only = remat.megatron_layer_groups(4, cpu_offloading=True, cpu_offloading_num_layers=2,
                                             cpu_offloading_activations=False,
                                             cpu_offloading_weights=True)
  assert weights_only[0].placements is None and weights_only[0].offload_weights


@pytest.mark.parametrize("settings, message", [
    (dict(cpu_offloading=True, cpu_offloading_num_layers=1, recompute_granularity="full"),
     "CPU offloading does not work when activation recomputation is enabled"),
    (dict(cpu_offloading=True, fine_grained_activation_offloading=True),
     "fine_grained_activation_offloading cannot be enabled with cpu_offloading."),
    (dict(cpu_offloading=True, cpu_offloading_num_layers=4),
     r"cpu_offloading_num_layers must be in \[0, num_layers - 1\] = \[0, 3\], got 4"),
    (dict(recompute_granularity="block"),
     r"recompute_granularity must be one of \[None, 'selective', 'full'\], got 'block'"),
])
def test_megatron_rules_refuse_with_the_reference_wording(settings, message):
  with pytest.raises(ValueError, match=message):
    remat.megatron_layer_groups(4, **settings)


def _recompute_temp_bytes(unroll: int) -> tuple[int, int]:
  """XLA's temporary bytes for the gradient of 8 scanned layers, saving everything and
  recomputing everything, with the loop rolled (``unroll=1``) or unrolled (``unroll=8``)."""
  layer = lambda x, w: (jnp.tanh(jnp.tanh(x @ w) @ w), None)
  ws, x = jnp.full((8, 128, 128), 0.01), jnp.ones((1024, 128))

  def temp(body):
    loss = lambda ws, x: jnp.sum(jax.lax.scan(body, x, ws, unroll=unroll)[0])
    return jax.jit(jax.grad(loss)).lower(ws, x).compile().memory_analysis().temp_size_in_bytes

  recomputed = jax.checkpoint(layer, policy=jax.checkpoint_policies.nothing_saveable,
                              prevent_cse=False)
  return temp(layer), temp(recomputed)


def test_recompute_saves_memory_only_where_the_layers_loop():
  # Why an unrolled one program warns (advice.unrolled_recompute): XLA schedules the
  # recomputation of straight-line layers early, keeping what it would free.
  saved, recomputed = _recompute_temp_bytes(unroll=1)
  assert recomputed < saved / 2
  saved, recomputed = _recompute_temp_bytes(unroll=8)
  assert recomputed >= saved


@pytest.mark.parametrize("overrides, backend, warned", [
    (["model.scan_layers=False", "model.recompute_granularity=full"], "gpu", True),
    (["model.scan_layers=False", "model.recompute_granularity=selective"], "cpu", True),
    (["model.scan_layers=False", "model.cpu_offloading=True",
      "model.cpu_offloading_num_layers=2"], "gpu", True),
    (["model.scan_layers=False", "model.recompute_granularity=full"], "tpu", False),
    (["model.scan_layers=True", "model.recompute_granularity=full"], "gpu", False),
    (["model.scan_layers=False", "model.recompute_granularity=null"], "gpu", False),
    # Moved by the trainer: a program per layer recomputes in its backward program.
    (["model.scan_layers=False", "model.cpu_offloading=True", "model.cpu_offloading_num_layers=2",
      "model.cpu_offloading_double_buffering=True"], "gpu", False),
])
def test_an_unrolled_one_program_warns_that_recompute_saves_no_memory(overrides, backend,
                                                                         warned):
  from jaxoffload.train import advice, load_config, resolve
  setup = resolve(load_config(None, overrides))
  lines = advice.unrolled_recompute(setup.config, backend, setup.runs_per_layer)
  assert lines == ([
      "warning: model.scan_layers=False with recompute or activation offload in one program "
      "saves no device memory: XLA recomputes the unrolled layers early "
      "(docs/performance.md#activation-offload); scan_layers=True saves it, or "
      "model.cpu_offloading_double_buffering=True moves activations a program per layer"]
      if warned else [])
