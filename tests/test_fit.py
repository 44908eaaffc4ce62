"""The search for the fastest setting that fits (``jaxoffload.plan.fit``): what it compiles
and prunes, its budgets, and ``optimizer_offload_fraction=auto`` through ``plan.choose``."""

import dataclasses

import jax
import pytest

from jaxoffload import plan
from jaxoffload.host import pricing
from jaxoffload.plan import compiling, fit, search
from jaxoffload.plan.compiling import Peaks
from jaxoffload.plan.ladder import HOST_HEADROOM, Budgets, Candidate, Ladder, offload_overrides
from jaxoffload.train import load_config, resolve, train
from jaxoffload.train.step import CompiledStep, Trainer, resident_device_bytes
from tests.planning import CALIBRATION, MACHINE, TEMPORARIES, compiled_as_resident  # noqa: F401


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


def test_compiling_ahead_on_several_threads_changes_only_when_steps_compile(
    compiled_as_resident, monkeypatch):
  config = load_config(None, ["train.global_batch_size=4", "train.micro_batch_size=4"])
  state = resident_device_bytes(Trainer.from_shapes(resolve(config)))
  budgets = plan.Budgets(device=int((state * 0.7 + TEMPORARIES) / 0.95), host=10**12)
  outcomes, asked = [], {1: [], 3: []}
  ask = Peaks.ask
  monkeypatch.setattr(Peaks, "ask", lambda self, setup: (
      asked[self.workers].append(setup.config), ask(self, setup))[1])
  for threads in asked:
    monkeypatch.setattr(compiling, "workers", lambda: threads)
    outcomes.append(plan.plan(config, budgets, machine=MACHINE, calibration=CALIBRATION,
                              log=lambda _: None))
  # Equal but for the host bytes, which count what the process holds at each search.
  same = lambda rows: [dataclasses.replace(row, host_bytes=0) for row in rows]
  assert same([outcomes[0][0]]) == same([outcomes[1][0]])
  assert same(outcomes[0][1]) == same(outcomes[1][1])
  # With three threads, steps were asked for ahead of being judged: every step judged with
  # one, and more.
  assert set(asked[1]) <= set(asked[3]) and len(asked[3]) > len(asked[1])


def test_both_placements_are_tried_where_the_state_alone_fits_but_the_step_does_not(
    monkeypatch):
  # Temporaries a tenth of the whole state: without offload its state fits the budget's
  # headroom, its compiled step does not, and the placements then differ.
  config = load_config(None, ["train.global_batch_size=4", "train.micro_batch_size=4"])
  whole = resident_device_bytes(Trainer.from_shapes(resolve(config)))
  monkeypatch.setattr(Trainer, "compile", lambda self, tokens, **_: CompiledStep(
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
  monkeypatch.setattr(Trainer, "compile", lambda self, tokens, **_: CompiledStep(
      (), resident_device_bytes(self) + TEMPORARIES + (
          0 if self.setup.sums_on_host else 4 * elements), 0))
  all_on_host = resident_device_bytes(Trainer.from_shapes(resolve(load_config(None, [
      "train.global_batch_size=16", "train.micro_batch_size=4", *offload_overrides(
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
  monkeypatch.setattr(Trainer, "compile", lambda self, t, **options: compiled.append(1) or real(
      self, t, **options))
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
  # The device holds the parameters alone: only every moment offloaded fits it. (The host
  # kernel's placement named: auto's choice would follow a live probe of this machine.)
  offloaded = resolve(load_config(None, ["optimizer.optimizer_cpu_offload=True",
                                         "optimizer.optimizer_offload_fraction=1.0",
                                         "optimizer.optimizer_offload_update_on=host_kernel"]))
  device = int((resident_device_bytes(Trainer.from_shapes(offloaded)) + TEMPORARIES) / 0.95) + 1
  search_ = lambda host, compact: plan.plan(config, plan.Budgets(device=device, host=host),
                                            explore=False, compact=compact, machine=MACHINE)
  exact, _ = search_(10**12, False)
  assert (exact.fraction, exact.moments) == (1.0, "float32")
  # A host a byte short of that: float32 moments fit nowhere; bfloat16 ones do.
  host = int(exact.host_bytes / (1 - HOST_HEADROOM)) - 1
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
  monkeypatch.setattr(pricing, "measure_machine", lambda **_: MACHINE)
  logged = []
  config, chosen = plan.choose(load_config(None, overrides))
  losses = train(config, log=logged.append, choices=chosen)
  chose, = [line for line in logged if line.startswith("optimizer_offload_fraction=auto chose")]
  fraction = float(chose.split()[2])
  assert 0 < fraction < 1 and len(losses) == 2
  # The least layer-sized step that fits: it does, the one below does not.
  peak = lambda f: TEMPORARIES + resident_device_bytes(Trainer.from_shapes(resolve(load_config(
      None, overrides[:1] + [f"optimizer.optimizer_offload_fraction={f}"] + overrides[2:]))))
  assert peak(fraction) <= 0.95 * budgets.device < peak(fraction - 1 / 4)


def test_without_a_device_budget_nothing_is_compiled_and_the_host_decides(monkeypatch):
  monkeypatch.setattr(Trainer, "compile", lambda self, tokens, **_: pytest.fail("compiled"))
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


def test_a_combination_the_rules_refuse_at_every_fraction_is_a_row_that_says_why():
  # A micro-batch the global batch of 8 does not divide into.
  ladder = Ladder(load_config(None), "as configured", ["train.micro_batch_size=3"],
                      ("device", None), MACHINE, None, 0)
  row = ladder.least_fitting(Budgets(None, 10**12))
  assert row.verdict.startswith("refused: train.global_batch_size")
  best, rows = fit.search([ladder], Budgets(None, 10**12))
  assert best is None and [r.verdict for r in rows] == [row.verdict]


class _FakeLadder:
  """A ladder whose bounds and fit are given: its least offload's time, the bound once its
  most offload's peak is predicted, and the time of the fit it verifies."""

  def __init__(self, name, least_s, predicted_s, fit_s, calls):
    self.name, self.place, self.calls = name, ("host_kernel", None), calls
    self.times = least_s, predicted_s, fit_s

  def row(self, step_s, verdict=""):
    return Candidate(self.name, 4, 0.5, "host_kernel", "-", "float32", 0.5, None, 0,
                         step_s, (self.name,), verdict)

  def least_fitting(self, budgets):
    return self.row(self.times[0])

  def predict(self, budgets, device_bytes):
    self.calls.append((self.name, "most offload"))
    return self.row(self.times[1])

  def time_bound(self):
    return self.times[1]

  def verify(self, budgets, device_bytes):
    self.calls.append((self.name, "fit"))
    return self.row(self.times[2], "fits")

  def ask_ahead(self, peaks, *, predicted):  # Compiles nothing: its judgements are given.
    pass


def test_the_search_compiles_best_first_by_bounds_that_tighten_as_it_compiles():
  calls = []
  ladders = [_FakeLadder("a", 1.0, 3.0, 3.0, calls), _FakeLadder("b", 2.0, 4.0, 4.0, calls),
             _FakeLadder("c", 5.0, 6.0, 6.0, calls),
             # The pick's setting again (as without offload, where placements are one
             # setting), pruned: its row is the pick's.
             _FakeLadder("a", 3.0, 3.0, 3.0, calls)]
  best, rows = fit.search(ladders, Budgets(device=10**9, host=10**12))
  # b's most offload predicts a fit slower than a's verified one: never compiled there;
  # c's least offload is slower already: never compiled at all.
  assert calls == [("a", "most offload"), ("b", "most offload"), ("a", "fit")]
  assert best.activations == "a" and len(rows) == 3
  assert {r.activations: r.verdict for r in rows} == {
      "a": "fits", "b": "its peak predicted: slower than the pick",
      "c": "not compiled: slower than the pick"}
