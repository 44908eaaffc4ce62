"""The planner: its step-time model and calibration, the settings it tries, its CLI and
output (its search: test_fit.py)."""

import dataclasses
import os
import re

import jax
import pytest

from jaxoffload import plan
from jaxoffload.host import pricing
from jaxoffload.memory import host_rss_bytes, offloaded_activation_bytes
from jaxoffload.plan import search, step_time, timing, xla_logs
from jaxoffload.plan.__main__ import main as plan_main
from jaxoffload.train import host_memory, load_config, resolve
from jaxoffload.train.__main__ import main as train_main
from jaxoffload.train.config import ConfigError
from jaxoffload.train.loading import override
from jaxoffload.train.step import CompiledStep, Trainer, resident_device_bytes
from tests.planning import CALIBRATION, MACHINE, TEMPORARIES


def test_a_step_is_predicted_as_the_sum_of_its_parts():
  config = load_config(None, ["optimizer.optimizer_cpu_offload=True",
                              "optimizer.optimizer_offload_fraction=0.5",
                              "optimizer.optimizer_offload_update_on=host_kernel",
                              "model.cpu_offloading=True", "model.cpu_offloading_num_layers=1",
                              "train.micro_batch_size=4"])
  setup = resolve(config)
  c = CALIBRATION
  # Half the micro-batch: three quarters of the time shrink by half.
  compute = 2 * (0.75 * 0.5 + 0.25) * (c.fixed_s + 1 * 0.006 + 3 * 0.004)
  sizes = [x.size for x in jax.tree.leaves(setup.param_shapes)]
  host = sum(n for n, off in zip(sizes, setup.offload.offloaded) if off)
  adam = (sum(sizes) - host) * 28 / c.device_bandwidth
  added = pricing.choose(MACHINE, offloaded_elements=host, moment_bytes_per_element=8,
                           transfer_bytes_per_element=4).predicted_s["host_kernel"]
  # The second micro-batch's copies of the host kernel's leaves, and the last sum.
  summing = host * 4 / 50e9 * 2 + host / 10e9
  assert step_time.predict_s(setup, c, MACHINE) == pytest.approx(compute + adam + added + summing)
  assert step_time.predict_s(setup, None, MACHINE) == pytest.approx(added + summing)


def test_a_moved_layer_costs_a_saved_layer_and_the_copies_back_it_waits_for():
  setup = resolve(load_config(None, ["model.cpu_offloading=True",
                                     "model.cpu_offloading_num_layers=3",
                                     "model.cpu_offloading_double_buffering=True"]))
  c = CALIBRATION  # At the config's micro-batch of 8: a saved layer's 4 ms.
  adam = sum(x.size for x in jax.tree.leaves(setup.param_shapes)) * 28 / c.device_bandwidth
  saved = c.fixed_s + 4 * c.layer_s["save"]
  each = offloaded_activation_bytes(setup.model, setup.groups, 8, setup.model.seq_length) / 3
  link = lambda out_s, back_s: dataclasses.replace(MACHINE, device_to_host=each / out_s,
                                                   host_to_device=each / back_s)
  # This small a layer's copies hide under its neighbours' compute.
  assert step_time.predict_s(setup, c, MACHINE) == pytest.approx(saved + adam)
  assert step_time.moved_copies(setup, c, MACHINE).held_bytes == 0
  # Copies out of 8 ms each end 9.3, 17.3 and 25.3 ms into the micro-batch; its backward
  # pass reaches the moved layers at 18 ms (their forward passes' 4 ms, then the fourth
  # layer's and the head's 14), layer 2's ending at 20.7 and layer 1's at 23.3. Python,
  # two programs ahead of the device, chooses for each layer as the device starts the
  # backward pass three layers above it (those above the moved ones taken as saved layers
  # ending at 18 ms): for layer 2 at 10 ms, layer 1 at 12.7 and layer 0 at 15.3. Layers 2
  # and 1 are read in place; layer 0 comes back in 12 ms, by 27.3 ms, for which its
  # backward pass waits 4 ms.
  slow = link(0.008, 0.012)
  assert step_time.moved_copies(setup, c, slow).wait_s == pytest.approx(0.004)
  assert step_time.predict_s(setup, c, slow) == pytest.approx(saved + adam + 0.004)
  # Where no copy out has ended by then, every layer reads its original: nothing waits, and
  # the device holds all three layers', one beyond the two a compiled step counts.
  stuck = step_time.moved_copies(setup, c, link(1.0, 1.0))
  assert (stuck.wait_s, stuck.held_bytes) == (pytest.approx(0.0), int(each))
  # With no layer offloaded there is nothing to move.
  unmoved = resolve(load_config(None, ["model.cpu_offloading=True",
                                       "model.cpu_offloading_double_buffering=True"]))
  assert step_time.predict_s(unmoved, c, slow) == pytest.approx(saved + adam)
  assert step_time.moved_copies(unmoved, c, slow) is None


def test_weights_in_pinned_host_cross_the_link_for_each_program_and_the_update():
  moved = ["model.cpu_offloading=True", "model.cpu_offloading_num_layers=3",
           "model.cpu_offloading_double_buffering=True"]
  without, setup = (resolve(load_config(None, [*moved, *weights]))
                    for weights in ([], ["model.cpu_offloading_weights=True"]))
  group = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(setup.param_shapes["layers_0_3"]))
  added = lambda setup, without, machine: step_time.predict_s(setup, CALIBRATION, machine) - (
      step_time.predict_s(without, CALIBRATION, machine))
  # At 50 GB/s each layer comes over beside the program before; only the first layer's
  # forward program waits for its own. The device optimizer's update brings the group over
  # and back.
  assert added(setup, without, MACHINE) == pytest.approx((2 + 1 / 3) * group / 50e9)
  # A link to the device on which a layer's weights take 4 ms, a saved layer's forward and
  # backward time (forward 1.33 ms, backward 2.67), and copies out that end at once. Forward,
  # the device waits for each layer: they arrive 4, 8 and 12 ms in, sent as Python dispatches
  # (two programs ahead of the device). Backward (from 27.3 ms: the fourth layer and the
  # head take 14), the copies back start as Python reaches the layer three programs above
  # (19.3 ms for layer 2) and each layer's weights follow its activations (a = 5.67 ms each):
  # the link runs from 19.3 ms for 3 (a + 4) ms, and layer 0's backward program ends at
  # 51.0 ms, against 29.7 ms without the weights (forward at 4 ms, from 18 ms, its link from
  # 10 ms): 21.3 ms more, and the update's 12 ms over.
  slow = dataclasses.replace(MACHINE, host_to_device=group / 3 / 0.004, device_to_host=1e15)
  assert added(setup, without, slow) == pytest.approx(0.021333 + 0.012, abs=2e-6)
  # In one program the calibrated layers' times hold their fetches; the update's two
  # crossings are added.
  without, setup = (resolve(load_config(None, [*moved[:2], *weights]))
                    for weights in ([], ["model.cpu_offloading_weights=True"]))
  layers = 3 * (CALIBRATION.layer_s["offload qkv + weights"] - CALIBRATION.layer_s["offload qkv"])
  assert added(setup, without, MACHINE) == pytest.approx(layers + 2 * group / 50e9)


def test_auto_offload_needs_the_master_switch():
  with pytest.raises(ConfigError, match="optimizer.optimizer_offload_fraction=auto picks how "
                                        "much to offload: it needs optimizer.optimizer_cpu_"
                                        "offload=True"):
    load_config(None, ["optimizer.optimizer_offload_fraction=auto"])


@pytest.mark.slow
def test_the_calibration_times_every_activation_setting():
  config = load_config(None, [])
  settings = plan.activation_settings(config, backend="gpu")
  calibration = plan.calibrate([override(config, o) for o in settings.values()],
                               log=lambda _: None)
  assert set(calibration.layer_s) == {"save", "selective", "recompute", "offload qkv",
                                      "offload qkv + weights"}
  assert calibration.micro_batch_size == 8 and 0 <= calibration.overhead <= 1
  assert calibration.device_bandwidth > 0 and calibration.fixed_s >= 0


def test_the_calibration_times_each_setting_but_saving_at_one_depth(monkeypatch):
  # A device whose pass takes a fixed part and each layer's time, a quarter of it not
  # shrinking with the micro-batch: the calibration finds each part back.
  layer_s = {"save": 0.004, "selective": 0.005, "recompute": 0.006, "offload qkv": 0.007,
             "offload qkv + weights": 0.009}
  depths = []

  def fwd_bwd_s(config, overrides):
    small = override(config, overrides)
    depths.append(small.model.num_layers)
    share = 0.25 + 0.75 * small.train.micro_batch_size / 8
    return share * (0.010 + sum(n * layer_s[mode]
                                for mode, n in step_time.layer_modes(small).items()))

  monkeypatch.setattr(timing, "_fwd_bwd_seconds",
                      lambda programs: [fwd_bwd_s(*program) for program in programs])
  monkeypatch.setattr(timing, "_device_bandwidth", lambda: 1e12)
  config = load_config(None, [])
  settings = plan.activation_settings(config, backend="gpu")
  calibration = plan.calibrate([override(config, o) for o in settings.values()],
                               log=lambda _: None)
  assert calibration.layer_s == pytest.approx(layer_s)
  assert calibration.fixed_s == pytest.approx(0.010)
  assert calibration.overhead == pytest.approx(0.25)
  # Saving at 1 and 2 layers and 2 at half the size; each other setting once (offloaded: one
  # layer and a saved one after it).
  assert sorted(depths) == [1, 1, 1, 2, 2, 2, 2]


def test_the_calibration_times_the_model_with_its_weights_on_the_device(monkeypatch):
  # With the host kernel the config's weights live in host memory, where the plain model's
  # embedding lookup cannot read them.
  config = load_config(None, [
      "optimizer.optimizer_cpu_offload=True", "optimizer.optimizer_offload_fraction=1.0",
      "optimizer.optimizer_offload_update_on=host_kernel", "model.dtype=bfloat16",
      "optimizer.offload_transfer_dtype=bfloat16"])
  assert {s.memory_kind for s in jax.tree.leaves(resolve(config).param_shardings)} == {
      "pinned_host"}
  read = []
  inputs = timing._inputs

  def recorded(setup, filled):
    (params, tokens), read_now = inputs(setup, filled)
    read.append(jax.tree.leaves(params))
    return (params, tokens), read_now

  monkeypatch.setattr(timing, "_inputs", recorded)
  seconds = timing._fwd_bwd_seconds([(config, timing._rest_layers("save", n)) for n in (1, 2)])
  assert len(seconds) == 2 and min(seconds) > 0
  assert {x.sharding.memory_kind for leaves in read for x in leaves} == {"device"}
  # Where their shapes agree (the embedding, the last norm and the head, not the stacked
  # layers), the two-layer model reads the one-layer model's arrays: none is filled twice.
  one, two = read
  assert [a is b for a, b in zip(one, two)] == [a.shape == b.shape for a, b in zip(one, two)]
  assert any(a is b for a, b in zip(one, two)) and not all(a is b for a, b in zip(one, two))


def test_on_a_cpu_and_where_the_rules_refuse_them_no_offload_setting_is_offered():
  config = load_config(None, [])
  offload = lambda settings: [name for name in settings if name.startswith("offload")]
  assert offload(plan.activation_settings(config, backend="gpu")) == [
      "offload qkv, 3 layers", "offload qkv and weights, 3 layers",
      "offload qkv, 3 layers, moved by the trainer",
      "offload all, 3 layers, moved by the trainer",
      "offload qkv, 1 layer", "offload qkv and weights, 1 layer",
      "offload qkv, 2 layers", "offload qkv and weights, 2 layers"]
  # Activation offload frees no memory on the cpu backend.
  assert not offload(plan.activation_settings(config, backend="cpu"))
  # The rules refuse activation offload with CUDA graphs: never calibrated nor searched.
  graphs = load_config(None, ["model.cuda_graph_impl=local"])
  with pytest.raises(ConfigError, match="CUDA graphs"):
    override(graphs, plan.activation_settings(config, backend="gpu")["offload qkv, 3 layers"])
  assert list(plan.activation_settings(graphs, backend="gpu")) == [
      "save everything", "recompute selectively", "recompute every layer"]


def test_xla_offloads_are_also_tried_on_fewer_layers_the_rest_saved():
  depths = lambda layers: [int(name.split(", ")[1].split()[0]) for name in
                           plan.activation_settings(load_config(None, [
                               f"model.num_layers={layers}"]), backend="gpu")
                           if name.startswith("offload qkv and weights")]
  assert depths(4) == [3, 1, 2]
  assert depths(32) == [31, 8, 16, 23]
  assert depths(2) == [1]


def test_where_an_offloaded_layer_costs_more_than_a_saved_one_the_fewest_that_fit_are_picked(
    monkeypatch):
  # Per layer at a micro-batch of 4: saved activations of 4 units, selective 3, recomputed
  # half of one, an offloaded layer's 1 (what stays on the device); room for 13.5 units. The
  # layers the trainer moves keep their originals: their copies cross too slow a link to end
  # before the backward pass reads them.
  unit = 100 * 2**20
  held = {"save": 4, "selective": 3, "recompute": 0.5,
          "offload qkv + moved by the trainer": 4, "offload all + moved by the trainer": 4}

  def compile(self, tokens, **_):
    config = self.setup.config
    activations = sum(n * held.get(mode, 1) for mode, n in step_time.layer_modes(config).items())
    return CompiledStep((), resident_device_bytes(self) + TEMPORARIES + int(
        unit * activations * config.train.micro_batch_size / 4), 0)

  monkeypatch.setattr(Trainer, "compile", compile)
  activation_settings = search.activation_settings
  monkeypatch.setattr(search, "activation_settings",
                      lambda config: activation_settings(config, backend="gpu"))
  calibration = dataclasses.replace(CALIBRATION, layer_s={
      "save": 0.004, "selective": 0.006, "recompute": 0.008, "offload qkv": 0.005,
      "offload qkv + weights": 0.009})
  slow = dataclasses.replace(MACHINE, host_to_device=10e6, device_to_host=10e6)
  config = load_config(None, ["train.global_batch_size=4", "train.micro_batch_size=4"])
  state = resident_device_bytes(Trainer.from_shapes(resolve(config)))
  budgets = plan.Budgets(device=int((state + TEMPORARIES + 13.5 * unit) / 0.95), host=10**12)
  pick, rows = plan.plan(config, budgets, machine=slow, calibration=calibration,
                         log=lambda _: None)
  # One offloaded layer and three saved: 13 units, and 10 + 5 + 3 x 4 ms at 0.625 of the
  # calibrated micro-batch's time (and the device's AdamW, microseconds).
  assert (pick.activations, pick.micro_batch_size, pick.fraction) == ("offload qkv, 1 layer",
                                                                      4, 0.0)
  assert pick.step_s == pytest.approx(0.625 * 0.027, rel=1e-3)
  assert pick.device_bytes == state + TEMPORARIES + 13 * unit
  by_name = {(r.activations, r.micro_batch_size): r for r in rows if r.fraction == 0}
  # Offloading more layers fits too, but each costs more than the saved layer it replaces.
  assert by_name["offload qkv, 3 layers", 4].step_s == pytest.approx(0.625 * 0.029, rel=1e-3)
  # Saving every layer needs 16 units, even with the whole optimizer state offloaded: its
  # peak predicted so, the step below the most offload is slower than the pick, and the
  # model is never compiled whole to confirm it.
  saved = [r for r in rows if r.activations == "save everything" and r.micro_batch_size == 4]
  assert saved and {(r.verdict, r.device_bytes) for r in saved} == {
      ("its peak predicted: slower than the pick", None)}


def test_the_host_column_is_explained_by_what_it_counts(monkeypatch):
  monkeypatch.setattr(search, "host_rss_bytes", lambda: 10**9)
  logged = []
  config = load_config(None, [])
  pick, _ = plan.plan(config, plan.Budgets(device=None, host=10**12), explore=False,
                      machine=MACHINE, log=logged.append)
  assert logged[0] == search.host_column(10**9)
  assert "this process holds now (1.0 GB)" in logged[0]
  assert f"JAX runtime's reserve ({host_memory.size(host_memory.RUNTIME_BYTES)}" in logged[0]
  # The column is those two and the run's own.
  needed = host_memory.needed(resolve(config))
  assert needed.held["JAX runtime"] == host_memory.RUNTIME_BYTES
  assert pick.host_bytes == 10**9 + needed.total


def test_xla_log_lines_are_kept_out_of_the_output(capfd):
  with xla_logs.dropped():
    os.write(2, b"E0207 18:44:44.481770 1957515 gpu_hlo_schedule.cc:815] The byte size of "
                b"input/output arguments exceeds the base limit.\n")
    os.write(2, b"a line of our own\n")
    os.write(2, b"W0207 18:44:45.000001 1957516 hlo_rematerialization.cc:3204] Can't reduce "
                b"memory use below 1GiB by rematerialization\n"
                b"WARNING: All log messages before absl::InitializeLog() is called are written "
                b"to STDERR\n")
    os.write(2, b"E0207 is not a log line\nno newline")
    assert capfd.readouterr().err == ""  # Held until the compiles are done.
  assert capfd.readouterr().err == "a line of our own\nE0207 is not a log line\nno newline"


@pytest.mark.slow
def test_the_planner_prints_a_command_that_trains(monkeypatch, capsys):
  monkeypatch.setattr(pricing, "measure_machine", lambda **_: MACHINE)
  monkeypatch.setattr(timing, "calibrate", lambda configs, log: CALIBRATION)
  monkeypatch.setattr(search, "calibrate", lambda configs, log: CALIBRATION)
  plan_main(["train.train_iters=2"])
  out = capsys.readouterr().out
  assert ("| activations | micro-batch | update on | gradient sums | moments | offload (achieved) |"
          in out)
  command = out.strip().splitlines()[-1].split()
  assert command[:3] == ["python", "-m", "jaxoffload.train"]
  train_main(command[3:])
  assert "2 steps: loss" in capsys.readouterr().out


@pytest.mark.skipif(jax.default_backend() != "cpu",
                    reason="the refusal guards the host's memory where a CPU computes")
def test_a_calibration_the_hosts_memory_cannot_hold_is_refused_before_it_runs(monkeypatch,
                                                                             capsys):
  # On a CPU the kernel would kill the process: here it would have 1 MB beside the runtime,
  # and the first model needs far more (its long sequences), whatever the process frees
  # meanwhile.
  monkeypatch.setattr(pricing, "measure_machine", lambda **_: MACHINE)
  limit = (host_rss_bytes() or 0) + host_memory.RUNTIME_BYTES + 2**20
  with pytest.raises(SystemExit) as stop:
    plan_main([f"train.host_memory_limit={limit}", "model.seq_length=512"])
  assert stop.value.code == 2
  assert re.fullmatch(
      r"error: the planner's calibration, a 1-layer model at micro-batch 8, needs \d{3,} MB on "
      r"this CPU beside the JAX runtime's 4.3 GB, more than the [\d.]+ [MG]B left under "
      r"train.host_memory_limit=[\d.]+ GB with the [\d.]+ [MG]B this process holds: plan on "
      r"the accelerator the run trains on, or with --offload-only \(no calibration\)\n",
      capsys.readouterr().err)


def test_the_planner_explains_its_figures_under_its_header(monkeypatch, capsys):
  monkeypatch.setattr(pricing, "measure_machine", lambda **_: MACHINE)
  plan_main(["--offload-only"])
  header, host = capsys.readouterr().out.splitlines()[:2]
  assert header.startswith("device budget unknown (on a CPU") and "host budget" in header
  assert host.startswith("host: what this process holds now (") and "JAX runtime" in host


def test_when_nothing_fits_the_planner_says_so_in_one_line(monkeypatch, capsys):
  monkeypatch.setattr(pricing, "measure_machine", lambda **_: MACHINE)
  with pytest.raises(SystemExit) as stop:
    plan_main(["--offload-only", "train.host_memory_limit=1MB"])
  assert stop.value.code == 2
  err = capsys.readouterr().err
  assert err.startswith("error: no candidate fits this machine: ") and err.count("\n") == 1
