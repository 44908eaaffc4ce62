"""The planner: its step-time model, the search's pruning and pick, the CLI and auto offload.

On a CPU, XLA's memory analysis counts host buffers as device memory, so the
tests that need the device's peak to fall with offload stand in for the
compiler with the state's own device bytes plus a fixed temporary.
"""

import ast
import dataclasses
import os
import pathlib

import jax
import pytest

import jaxoffload.train
from jaxoffload import autoplace, plan
from jaxoffload.plan import search, timing, xla_logs
from jaxoffload.memory import offloaded_activation_bytes
from jaxoffload.plan.__main__ import main as plan_main
from jaxoffload.train import fit, host_memory, load_config, resolve, step_time, train
from jaxoffload.train.__main__ import main as train_main
from jaxoffload.train.config import ConfigError
from jaxoffload.train.loading import override
from jaxoffload.train.step import CompiledStep, Trainer, resident_device_bytes

MACHINE = autoplace.Machine(host_to_device=50e9, device_to_host=50e9, kernel_rate=5e9,
                            kernel_threads=16, sum_rate=10e9)
# Recomputing costs more than saving, and more in full than in part; offloading q/k/v costs
# more still.
CALIBRATION = step_time.Calibration(
    micro_batch_size=8, fixed_s=0.010, overhead=0.25, device_bandwidth=1e12,
    layer_s={"save": 0.004, "selective": 0.0045, "recompute": 0.005, "offload qkv": 0.006,
             "offload qkv + weights": 0.008})
TEMPORARIES = 10**6


@pytest.fixture
def compiled_as_resident(monkeypatch):
  """The compiled step's device peak: what the state holds on the device, and 1 MB more."""
  def compile(self, tokens):
    return CompiledStep((), resident_device_bytes(self) + TEMPORARIES, 0)

  monkeypatch.setattr(Trainer, "compile", compile)


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
  added = autoplace.choose(MACHINE, offloaded_elements=host, moment_bytes_per_element=8,
                           transfer_bytes_per_element=4).predicted_s["host_kernel"]
  # The second micro-batch's copies of the host kernel's leaves, and the last sum.
  summing = host * 4 / 50e9 * 2 + host / 10e9
  assert step_time.predict_s(setup, c, MACHINE) == pytest.approx(compute + adam + added + summing)
  assert step_time.predict_s(setup, None, MACHINE) == pytest.approx(added + summing)


def test_a_moved_layer_costs_a_saved_layer_and_what_of_its_copies_its_neighbours_leave_bare():
  setup = resolve(load_config(None, ["model.cpu_offloading=True",
                                     "model.cpu_offloading_num_layers=3",
                                     "model.cpu_offloading_double_buffering=True"]))
  c = CALIBRATION  # At the config's micro-batch of 8.
  adam = sum(x.size for x in jax.tree.leaves(setup.param_shapes)) * 28 / c.device_bandwidth
  saved = c.fixed_s + 4 * c.layer_s["save"]
  # This small a layer's copies hide under its neighbours' compute...
  assert step_time.predict_s(setup, c, MACHINE) == pytest.approx(saved + adam)
  # ... and on a link where the copy out takes 2 ms and the copy back 4 ms, a third and
  # two thirds of the 4 ms layer hide them in part: 2 ms a layer bare, over 3 layers.
  each = offloaded_activation_bytes(setup.model, setup.groups, 8, setup.model.seq_length) / 3
  slow = dataclasses.replace(MACHINE, device_to_host=each / 0.002, host_to_device=each / 0.004)
  assert step_time.predict_s(setup, c, slow) == pytest.approx(saved + adam + 3 * 0.002)


def test_the_search_stops_once_the_pick_beats_every_bound(compiled_as_resident):
  config = load_config(None, ["train.global_batch_size=4", "train.micro_batch_size=4"])
  state = resident_device_bytes(Trainer.from_shapes(resolve(config)))
  # No room for the whole state on the device: some offload is needed.
  budgets = plan.Budgets(device=int((state * 0.7 + TEMPORARIES) / 0.95), host=10**12)
  pick, rows = plan.plan(config, budgets, machine=MACHINE, calibration=CALIBRATION, log=print)
  fits = [r for r in rows if r.verdict == "fits"]
  assert pick in fits and pick.fraction > 0
  assert pick.step_s == min(r.step_s for r in rows if r.verdict in ("fits", ""))
  assert pick.device_bytes <= 0.95 * budgets.device
  # Save everything is the fastest activation setting in CALIBRATION.
  assert pick.activations == "save everything"
  pruned = [row for row in rows if row.verdict == "not compiled: slower than the pick"]
  assert pruned and all(row.device_bytes is None and row.step_s >= pick.step_s
                        for row in pruned)
  # The least offload of the pick's ladder that fits: one layer-sized step less does not.
  less = dataclasses.replace(config.optimizer, optimizer_cpu_offload=True,
                             optimizer_offload_fraction=pick.fraction - 1 / 4,
                             optimizer_offload_update_on=pick.update_on)
  fewer = resolve(dataclasses.replace(config, optimizer=less))
  assert resident_device_bytes(Trainer.from_shapes(fewer)) + TEMPORARIES > 0.95 * budgets.device
  lines = plan.table(rows, pick)
  assert lines[0].startswith(
      "| activations | micro-batch | update on | gradient sums | moments | offload (achieved) |")
  assert sum("(pick)" in line for line in lines) == 1


def test_both_placements_are_tried_where_the_state_alone_fits_but_the_step_does_not(
    monkeypatch):
  # Temporaries a tenth of the whole state: without offload its state fits the budget's
  # headroom, its compiled step does not, and the placements then differ.
  config = load_config(None, ["train.global_batch_size=4", "train.micro_batch_size=4"])
  whole = resident_device_bytes(Trainer.from_shapes(resolve(config)))
  monkeypatch.setattr(Trainer, "compile", lambda self, tokens: CompiledStep(
      (), resident_device_bytes(self) + whole // 10, 0))
  budgets = plan.Budgets(device=int(whole * 1.1), host=10**12)
  # A host kernel far faster than the links: its step is the faster one.
  machine = dataclasses.replace(MACHINE, kernel_rate=1e15, sum_rate=1e15)
  pick, rows = plan.plan(config, budgets, machine=machine, calibration=CALIBRATION, log=print)
  compiled = [r for r in rows if r.device_bytes is not None]
  assert pick.update_on == "host_kernel"
  assert any(r.update_on == "device" and r.fraction > 0 for r in compiled)
  assert all(r.fraction > 0 for r in compiled if r.verdict == "fits")
  assert pick.step_s == min(r.step_s for r in compiled if r.verdict == "fits")


def test_the_host_kernel_sums_on_the_host_where_the_device_cannot_hold_the_sums(monkeypatch):
  # Summed on the device, a step's gradients take 4 bytes an element more.
  config = load_config(None, ["train.global_batch_size=16", "train.micro_batch_size=4"])
  elements = sum(x.size for x in jax.tree.leaves(resolve(config).param_shapes))
  monkeypatch.setattr(Trainer, "compile", lambda self, tokens: CompiledStep(
      (), resident_device_bytes(self) + TEMPORARIES + (
          0 if self.setup.sums_on_host else 4 * elements), 0))
  all_on_host = resident_device_bytes(Trainer.from_shapes(resolve(load_config(None, [
      "train.global_batch_size=16", "train.micro_batch_size=4", *fit.offload_overrides(
          1.0, "host_kernel", "host")]))))
  budgets = plan.Budgets(device=int((all_on_host + TEMPORARIES + 2 * elements) / 0.95),
                         host=10**12)
  pick, rows = plan.plan(config, budgets, machine=MACHINE, calibration=CALIBRATION, log=print)
  assert (pick.update_on, pick.grad_sums) == ("host_kernel", "host")
  summed_on_device = [r for r in rows if r.update_on == "host_kernel" and r.grad_sums == "device"]
  assert summed_on_device and all(r.verdict != "fits" for r in summed_on_device)
  # With room for the sums, one program is the faster setting.
  budgets = plan.Budgets(device=budgets.device + 4 * elements, host=10**12)
  pick, _ = plan.plan(config, budgets, machine=MACHINE, calibration=CALIBRATION, log=print)
  assert pick.grad_sums == "device"


def test_settings_whose_state_alone_cannot_fit_are_never_compiled(compiled_as_resident,
                                                                  monkeypatch):
  compiled = []
  real = Trainer.compile
  monkeypatch.setattr(Trainer, "compile", lambda self, t: compiled.append(1) or real(self, t))
  config = load_config(None, [])
  pick, rows = plan.plan(config, plan.Budgets(device=1, host=10**12), machine=MACHINE,
                         calibration=CALIBRATION, log=print)
  assert pick is None and not compiled
  assert {r.verdict for r in rows} == {"no: device (its state alone)"}


def test_host_memory_bounds_the_offload(compiled_as_resident):
  config = load_config(None, [])
  pick, rows = plan.plan(config, plan.Budgets(device=None, host=1), explore=False,
                         machine=MACHINE, log=print)
  assert pick is None and rows and all(r.verdict == "no: host" for r in rows)


def test_where_no_float32_state_fits_the_planner_proposes_compact_moments(compiled_as_resident,
                                                                           monkeypatch):
  monkeypatch.setattr(search, "host_rss_bytes", lambda: 10**9)  # What the process holds: fixed.
  config = load_config(None, ["optimizer.optimizer_cpu_offload=True"])
  # The device holds the parameters alone: only every moment offloaded fits it.
  offloaded = resolve(load_config(None, ["optimizer.optimizer_cpu_offload=True",
                                         "optimizer.optimizer_offload_fraction=1.0"]))
  device = int((resident_device_bytes(Trainer.from_shapes(offloaded)) + TEMPORARIES) / 0.95) + 1
  search_ = lambda host, compact: plan.plan(config, plan.Budgets(device=device, host=host),
                                            explore=False, compact=compact, machine=MACHINE)
  exact, _ = search_(10**12, False)
  assert (exact.fraction, exact.moments) == (1.0, "float32")
  # A host a byte short of that: float32 moments fit nowhere; bfloat16 ones do.
  host = int(exact.host_bytes / (1 - fit.HOST_HEADROOM)) - 1
  assert search_(host, False)[0] is None
  pick, rows = search_(host, True)
  assert pick.moments == "bfloat16" and pick.host_bytes < exact.host_bytes
  assert {"optimizer.exp_avg_dtype=bfloat16", "optimizer.exp_avg_sq_dtype=bfloat16"} <= set(
      pick.overrides)
  assert {(r.moments, r.verdict) for r in rows} >= {("float32", "no: host"), ("bfloat16", "fits")}


def test_auto_offload_trains_with_the_least_fraction_that_fits(compiled_as_resident, monkeypatch):
  overrides = ["optimizer.optimizer_cpu_offload=True", "optimizer.optimizer_offload_fraction=auto",
               "optimizer.optimizer_offload_update_on=device", "train.train_iters=2"]
  state = resident_device_bytes(Trainer.from_shapes(resolve(load_config(None, [
      "optimizer.optimizer_cpu_offload=False"]))))
  budgets = plan.Budgets(device=int((state * 0.6 + TEMPORARIES) / 0.95), host=10**12)
  monkeypatch.setattr(fit, "budgets_of", lambda config, device_memory=None: budgets)
  monkeypatch.setattr(autoplace, "measure_machine", lambda **_: MACHINE)
  logged = []
  losses = train(load_config(None, overrides), log=logged.append)
  chose, = [line for line in logged if line.startswith("optimizer_offload_fraction=auto chose")]
  fraction = float(chose.split()[2])
  assert 0 < fraction < 1 and len(losses) == 2
  # The least layer-sized step that fits: it does, the one below does not.
  peak = lambda f: TEMPORARIES + resident_device_bytes(Trainer.from_shapes(resolve(load_config(
      None, overrides[:1] + [f"optimizer.optimizer_offload_fraction={f}"] + overrides[2:]))))
  assert peak(fraction) <= 0.95 * budgets.device < peak(fraction - 1 / 4)


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

  monkeypatch.setattr(timing, "_fwd_bwd_s", fwd_bwd_s)
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
  kinds = set()
  inputs = timing._inputs

  def recorded(setup):
    params, tokens = inputs(setup)
    kinds.update(x.sharding.memory_kind for x in jax.tree.leaves(params))
    return params, tokens

  monkeypatch.setattr(timing, "_inputs", recorded)
  assert timing._fwd_bwd_s(config, timing._rest_layers("save", 1)) > 0
  assert kinds == {"device"}


def test_on_a_cpu_and_where_the_rules_refuse_them_no_offload_setting_is_offered():
  config = load_config(None, [])
  offload = lambda settings: [name for name in settings if name.startswith("offload")]
  assert offload(plan.activation_settings(config, backend="gpu")) == [
      "offload qkv, 3 layers", "offload qkv and weights, 3 layers",
      "offload qkv, 3 layers, moved by the trainer",
      "offload all, 3 layers, moved by the trainer"]
  # Activation offload frees no memory on the cpu backend.
  assert not offload(plan.activation_settings(config, backend="cpu"))
  # The rules refuse activation offload with CUDA graphs: never calibrated nor searched.
  graphs = load_config(None, ["model.cuda_graph_impl=local"])
  with pytest.raises(ConfigError, match="CUDA graphs"):
    override(graphs, plan.activation_settings(config, backend="gpu")["offload qkv, 3 layers"])
  assert list(plan.activation_settings(graphs, backend="gpu")) == [
      "save everything", "recompute selectively", "recompute every layer"]


def test_without_a_device_budget_nothing_is_compiled_and_the_host_decides(monkeypatch):
  monkeypatch.setattr(Trainer, "compile", lambda self, tokens: pytest.fail("compiled"))
  monkeypatch.setattr(search, "host_rss_bytes", lambda: 10**9)
  config = load_config(None, ["train.global_batch_size=4", "train.micro_batch_size=4"])
  pick, rows = plan.plan(config, plan.Budgets(device=None, host=10**12), machine=MACHINE,
                         calibration=CALIBRATION, log=print)
  assert pick.verdict == "fits" and pick.fraction == 0
  assert all(r.device_bytes is None for r in rows)
  assert all(line.split(" | ")[6] == "-" for line in plan.table(rows, pick)[2:])
  # The least offload is the least host memory: too little host for it, nothing fits.
  pick, rows = plan.plan(config, plan.Budgets(device=None, host=pick.host_bytes),
                         machine=MACHINE, calibration=CALIBRATION, log=print)
  assert pick is None and {r.verdict for r in rows} == {"no: host"}


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
  monkeypatch.setattr(autoplace, "measure_machine", lambda **_: MACHINE)
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


def test_the_planner_explains_its_figures_under_its_header(monkeypatch, capsys):
  monkeypatch.setattr(autoplace, "measure_machine", lambda **_: MACHINE)
  plan_main(["--offload-only"])
  header, host = capsys.readouterr().out.splitlines()[:2]
  assert header.startswith("device budget unknown (on a CPU") and "host budget" in header
  assert host.startswith("host: what this process holds now (") and "JAX runtime" in host


def test_when_nothing_fits_the_planner_says_so_in_one_line(monkeypatch, capsys):
  monkeypatch.setattr(autoplace, "measure_machine", lambda **_: MACHINE)
  with pytest.raises(SystemExit) as stop:
    plan_main(["--offload-only", "train.host_memory_limit=1MB"])
  assert stop.value.code == 2
  err = capsys.readouterr().err
  assert err.startswith("error: no candidate fits this machine: ") and err.count("\n") == 1


def test_the_trainer_imports_nothing_of_the_planner():
  # The planner builds on the trainer; the trainer's auto fraction runs jaxoffload.train.fit.
  # Every import statement, those inside functions too, of every module of the trainer.
  imported = {}
  for path in pathlib.Path(jaxoffload.train.__path__[0]).glob("*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ImportFrom):
        names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
      elif isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      else:
        continue
      imported[path.name] = imported.get(path.name, []) + names
  assert len(imported) > 20
  # ("from jaxoffload import plan" counts as jaxoffload.plan.)
  planner = {file: [n for n in names if n == "jaxoffload.plan" or n.startswith("jaxoffload.plan.")]
             for file, names in imported.items()}
  assert {file: names for file, names in planner.items() if names} == {}


def test_a_combination_the_rules_refuse_at_every_fraction_is_a_row_that_says_why():
  # A micro-batch the global batch of 8 does not divide into.
  ladder = fit.Ladder(load_config(None), "as configured", ["train.micro_batch_size=3"],
                      ("device", None), MACHINE, None, 0)
  row = ladder.least(fit.Budgets(None, 10**12))
  assert row.verdict.startswith("refused: train.global_batch_size")
  best, rows = fit.search([ladder], fit.Budgets(None, 10**12))
  assert best is None and [r.verdict for r in rows] == [row.verdict]


class _FakeLadder:
  """A ladder whose bounds and fit are given: its least offload's time, the bound once its
  most offload is compiled, and the time of the fit it verifies."""

  def __init__(self, name, least_s, predicted_s, fit_s, calls):
    self.name, self.place, self.calls = name, ("host_kernel", None), calls
    self.times = least_s, predicted_s, fit_s

  def row(self, step_s, verdict=""):
    return fit.Candidate(self.name, 4, 0.5, "host_kernel", "-", "float32", 0.5, None, 0,
                         step_s, (self.name,), verdict)

  def least(self, budgets):
    return self.row(self.times[0])

  def predict(self, budgets, device_bytes):
    self.calls.append((self.name, "most offload"))
    return self.row(self.times[1])

  def bound(self):
    return self.times[1]

  def verify(self, budgets, device_bytes):
    self.calls.append((self.name, "fit"))
    return self.row(self.times[2], "fits")


def test_the_search_compiles_best_first_by_bounds_that_tighten_as_it_compiles():
  calls = []
  ladders = [_FakeLadder("a", 1.0, 3.0, 3.0, calls), _FakeLadder("b", 2.0, 4.0, 4.0, calls),
             _FakeLadder("c", 5.0, 6.0, 6.0, calls),
             # The pick's setting again (as without offload, where placements are one
             # setting), pruned: its row is the pick's.
             _FakeLadder("a", 3.0, 3.0, 3.0, calls)]
  best, rows = fit.search(ladders, fit.Budgets(device=10**9, host=10**12))
  # b's most offload predicts a fit slower than a's verified one: never compiled there;
  # c's least offload is slower already: never compiled at all.
  assert calls == [("a", "most offload"), ("b", "most offload"), ("a", "fit")]
  assert best.activations == "a" and len(rows) == 3
  assert {r.activations: r.verdict for r in rows} == {
      "a": "fits", "b": "compiled at its most offload: predicted slower than the pick",
      "c": "not compiled: slower than the pick"}


def test_a_ladder_whose_offload_the_rules_refuse_says_why_at_its_own_micro_batch():
  config = load_config(None, ["train.global_batch_size=8", "train.micro_batch_size=4",
                              "model.cpu_offloading=True", "model.cpu_offloading_num_layers=2",
                              "model.cpu_offloading_double_buffering=True"])
  ladder = fit.Ladder(config, "moved", ["train.micro_batch_size=2"], ("host_kernel", "host"),
                      MACHINE, None, 0)
  row = ladder.least(fit.Budgets(device=10**12, host=10**12))
  assert row.micro_batch_size == 2
  assert row.verdict.startswith("refused: model.cpu_offloading_double_buffering=True runs the "
                                "model a program per layer: with several micro-batches")


@pytest.mark.parametrize("grows", [False, True], ids=["as-predicted", "mispredicted"])
def test_a_ladder_compiles_its_most_offload_then_where_that_peak_predicts_a_fit(monkeypatch,
                                                                                grows):
  # Temporaries fixed (the prediction holds), or growing with what the device holds.
  peak = lambda resident: resident + TEMPORARIES + (resident if grows else 0)
  compiles = []

  def compile(self, tokens):
    compiles.append(resident_device_bytes(self))
    return CompiledStep((), peak(compiles[-1]), 0)

  monkeypatch.setattr(Trainer, "compile", compile)
  config = load_config(None, ["train.global_batch_size=4", "train.micro_batch_size=4",
                              "model.num_layers=8"])
  ladder = fit.Ladder(config, "as configured", [], ("device", None), MACHINE, None, 0)
  budgets = fit.Budgets(device=int(peak(ladder.resident_bytes(0) * 0.6) / 0.95), host=10**12)
  assert ladder.least(budgets).verdict == ""
  device_bytes = {}
  assert ladder.predict(budgets, device_bytes).verdict == ""  # Predicted, not yet compiled.
  row = ladder.verify(budgets, device_bytes)
  least = next(step for step in range(9)
               if peak(ladder.resident_bytes(step)) <= 0.95 * budgets.device)
  assert 0 < least < 8 and row.verdict == "fits" and row.fraction == least / 8
  # The most offload, the predicted least and the step below it; where the prediction was
  # wrong (its guess does not fit), a bisection above it.
  guess_fits = peak(compiles[1]) <= 0.95 * budgets.device
  assert guess_fits != grows
  assert len(compiles) == 3 if not grows else 3 <= len(compiles) <= 2 + 4
