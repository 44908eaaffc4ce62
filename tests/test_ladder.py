"""One setting's ladder of offload fractions (``jaxoffload.plan.ladder``): its verdicts, and
its peaks predicted from shallow versions of the model (``jaxoffload.plan.shallow``)."""

import dataclasses

import pytest

from jaxoffload.memory import offloaded_activation_bytes
from jaxoffload.plan import compiling, fit, search, shallow
from jaxoffload.plan.compiling import Peaks
from jaxoffload.plan.ladder import Budgets, Ladder
from jaxoffload.train import load_config, resolve
from jaxoffload.train.step import CompiledStep, Trainer, resident_device_bytes
from tests.planning import CALIBRATION, MACHINE, TEMPORARIES, compiled_as_resident  # noqa: F401


def test_a_ladder_whose_offload_the_rules_refuse_says_why_at_its_own_micro_batch():
  config = load_config(None, ["train.global_batch_size=8", "train.micro_batch_size=4",
                              "model.cpu_offloading=True", "model.cpu_offloading_num_layers=2",
                              "model.cpu_offloading_double_buffering=True"])
  ladder = Ladder(config, "moved", ["train.micro_batch_size=2"], ("host_kernel", "host"),
                      MACHINE, None, 0)
  row = ladder.least_fitting(Budgets(device=10**12, host=10**12))
  assert row.micro_batch_size == 2
  assert row.verdict.startswith("refused: model.cpu_offloading_double_buffering=True runs the "
                                "model a program per layer: with several micro-batches")


def test_a_moved_ladders_peak_counts_the_originals_the_link_leaves_on_the_device(
    compiled_as_resident):
  config = load_config(None, ["train.global_batch_size=4", "train.micro_batch_size=4",
                              "model.cpu_offloading=True", "model.cpu_offloading_num_layers=3",
                              "model.cpu_offloading_double_buffering=True"])
  budgets = Budgets(device=10**12, host=10**12)
  peaks = []
  # A link fast enough to keep up, and one so slow that no copy out ends in the step.
  for machine in (MACHINE, dataclasses.replace(MACHINE, device_to_host=1.0, host_to_device=1.0)):
    ladder = Ladder(config, "moved", [], ("device", None), machine, CALIBRATION, 0)
    ladder.least_fitting(budgets)
    with Peaks() as compiled:
      ladder.predict(budgets, compiled)
      peaks.append(ladder.verify(budgets, compiled).device_bytes)
  setup = resolve(config)
  each = offloaded_activation_bytes(setup.model, setup.groups, 4, setup.model.seq_length) / 3
  # All three layers' originals held: one beyond the two the compiled step counts.
  assert peaks[1] - peaks[0] == int(each)


@pytest.mark.parametrize("grows", [False, True], ids=["as-predicted", "mispredicted"])
def test_a_ladder_predicts_its_peak_from_two_shallow_depths_then_compiles_where_it_fits(
    monkeypatch, grows):
  # Beside the resident state, activations of 3 MB a layer and fixed temporaries (the line
  # drawn through the shallow depths holds), or temporaries growing with what the device
  # holds too (it does not).
  peak = lambda resident, layers: (resident + 3 * 10**6 * layers + TEMPORARIES
                                   + (resident if grows else 0))
  compiles = []

  def compile(self, tokens, **_):
    compiles.append((self.setup.model.num_layers, resident_device_bytes(self)))
    return CompiledStep((), peak(compiles[-1][1], compiles[-1][0]), 0)

  monkeypatch.setattr(Trainer, "compile", compile)
  monkeypatch.setattr(shallow, "DEEP", 8)  # 8 layers predicted as a deeper model would be.
  config = load_config(None, ["train.global_batch_size=4", "train.micro_batch_size=4",
                              "model.num_layers=8"])
  ladder = Ladder(config, "as configured", [], ("device", None), MACHINE, None, 0)
  budgets = Budgets(device=int(peak(ladder.resident_bytes(0) * 0.6, 8) / 0.95),
                        host=10**12)
  assert ladder.least_fitting(budgets).verdict == ""
  with Peaks(threads=1) as peaks:
    assert ladder.predict(budgets, peaks).verdict == ""  # Predicted, not yet compiled.
    # The most offload at 2 and 4 layers; the whole model not yet.
    assert [layers for layers, _ in compiles] == list(shallow.SHALLOW)
    row = ladder.verify(budgets, peaks)
  least = next(step for step in range(9)
               if peak(ladder.resident_bytes(step), 8) <= 0.95 * budgets.device)
  assert 0 < least < 8 and row.verdict == "fits" and row.fraction == least / 8
  assert row.device_bytes == peak(ladder.resident_bytes(least), 8)
  # Then the whole model where the line predicts the least fit, and the step below it;
  # where the prediction was wrong (its guess does not fit), a bisection above it.
  assert {layers for layers, _ in compiles[2:]} == {8}
  guess_fits = peak(compiles[2][1], 8) <= 0.95 * budgets.device
  assert guess_fits != grows
  assert len(compiles) == 4 if not grows else 4 <= len(compiles) <= 3 + 4


def test_each_phase_of_a_step_is_drawn_to_the_models_depth_on_its_own(monkeypatch):
  # Two phases beside the resident state (say a layer's programs and the update): 3 MB a
  # layer and 1 MB, and 1 MB a layer and 10 MB. The second is the larger at 4 layers,
  # the first from 6 on: a line through the larger of the two would miss the first's slope.
  def compile(self, tokens, **_):
    layers, resident = self.setup.model.num_layers, resident_device_bytes(self)
    phases = resident + 3 * 10**6 * layers + 10**6, resident + 10**6 * layers + 10**7
    return CompiledStep((), max(phases), 0, phases)

  monkeypatch.setattr(Trainer, "compile", compile)
  monkeypatch.setattr(shallow, "DEEP", 8)  # 8 layers predicted as a deeper model would be.
  config = load_config(None, ["train.global_batch_size=4", "train.micro_batch_size=4",
                              "model.num_layers=8"])
  ladder = Ladder(config, "as configured", [], ("device", None), MACHINE, None, 0)
  ladder.least_fitting(Budgets(device=10**12, host=10**12))
  with Peaks(threads=1) as peaks:
    assert ladder.transient_bytes(peaks) == 3 * 10**6 * 8 + 10**6


def test_a_partial_offload_is_drawn_between_none_and_most_offloaded_from_their_compiles(
    monkeypatch):
  # A saved layer holds 3 MB beside the resident state, an offloaded one 1 MB.
  compiled = []

  def compile(self, tokens, **_):
    m = self.setup.config.model
    offloaded = m.cpu_offloading_num_layers if m.cpu_offloading else 0
    compiled.append((m.num_layers, offloaded))
    return CompiledStep((), resident_device_bytes(self) + 3 * 10**6 * (m.num_layers - offloaded)
                        + 10**6 * offloaded + TEMPORARIES, 0)

  monkeypatch.setattr(Trainer, "compile", compile)
  monkeypatch.setattr(shallow, "DEEP", 8)  # 8 layers predicted as a deeper model would be.
  config = load_config(None, ["train.global_batch_size=4", "train.micro_batch_size=4",
                              "model.num_layers=8"])
  settings = search.activation_settings(config, backend="gpu")
  with Peaks(threads=1) as peaks:
    for name, layers in [("offload qkv, 4 layers", 4), ("offload qkv, 7 layers", 7),
                         ("save everything", 0)]:
      ladder = Ladder(config, name, settings[name], ("device", None), MACHINE, None, 0)
      ladder.least_fitting(Budgets(device=10**12, host=10**12))
      want = 3 * 10**6 * (8 - layers) + 10**6 * layers + TEMPORARIES
      assert ladder.transient_bytes(peaks) == want
  # The partial offload's lines are the others' own: each shallow model compiled once.
  assert sorted(compiled) == sorted([(depth, offloaded) for depth in shallow.SHALLOW
                                     for offloaded in (0, depth - 1)])


def _offload(layers, *, weights=False, policy="qkv", moved=False):
  return ["model.cpu_offloading=True", f"model.cpu_offloading_num_layers={layers}",
          f"model.cpu_offloading_weights={weights}", f"model.cpu_offloading_policy={policy}",
          f"model.cpu_offloading_double_buffering={moved}", "model.recompute_granularity=null"]


def test_a_ladder_holds_no_less_where_it_offloads_no_more_at_no_smaller_micro_batch():
  config = load_config(None, ["train.global_batch_size=16", "train.micro_batch_size=4"])
  ladder = lambda overrides, size=4, place=("host_kernel", "device"): Ladder(
      config, "", overrides + [f"train.micro_batch_size={size}"], place, MACHINE, None, 0)
  three = ladder(_offload(3))
  saved = ["model.cpu_offloading=False", "model.recompute_granularity=null"]
  holds_more = [ladder(_offload(1)), ladder(saved), ladder(saved, 8), ladder(_offload(3), 8)]
  assert all(other.holds_no_less(three) for other in holds_more)
  may_hold_less = [
      ladder(_offload(1), 2),  # A smaller micro-batch.
      ladder(_offload(1), 16),  # The whole batch at once: no gradient sums held.
      ladder(_offload(3, weights=True)),  # Its weights offloaded too.
      ladder(_offload(1, policy="all")),  # Another policy.
      ladder(_offload(1, moved=True)),  # Moved by the trainer.
      ladder(saved[:1] + ["model.recompute_granularity=full"]),  # Recomputed.
      ladder(saved, place=("device", None))]  # Another placement.
  assert not any(other.holds_no_less(three) for other in may_hold_less)
  assert three.holds_no_less(ladder(_offload(3, weights=True)))


def test_what_holds_no_less_than_a_setting_that_does_not_fit_is_never_compiled(monkeypatch):
  compiled = []

  def compile(self, tokens, **_):  # Nothing fits the device.
    compiled.append(self.setup.config.model.cpu_offloading_num_layers)
    return CompiledStep((), 10**15, 0)

  monkeypatch.setattr(Trainer, "compile", compile)
  monkeypatch.setattr(compiling, "workers", lambda: 1)  # Nothing compiled ahead.
  config = load_config(None, ["train.global_batch_size=4", "train.micro_batch_size=4"])
  # Offloading is cheapest here: the setting that offloads most is judged first.
  calibration = dataclasses.replace(CALIBRATION, layer_s={
      "save": 0.004, "offload qkv": 0.001})
  ladders = [Ladder(config, name, overrides, ("device", None), MACHINE, calibration, 0)
             for name, overrides in [("three", _offload(3)), ("one", _offload(1)),
                                     ("none", ["model.cpu_offloading=False",
                                               "model.recompute_granularity=null"])]]
  best, rows = fit.search(ladders, Budgets(device=10**12, host=10**15))
  assert best is None and compiled == [3]
  assert {r.activations: r.verdict for r in rows} == {
      "three": "no: device",
      **{name: "not compiled: holds no less than three at micro-batch 4, which does not fit "
               "the device" for name in ("one", "none")}}


def test_a_setting_the_line_rules_out_is_compiled_whole_before_it_is(monkeypatch):
  # The shallow depths hold 50 MB a layer beside their state, the whole model 1 MB: the line
  # predicts no fit at the most offload, the whole model fits.
  def compile(self, tokens, **_):
    layers = self.setup.model.num_layers
    return CompiledStep((), resident_device_bytes(self) + (10**6 if layers == 8 else
                                                           5 * 10**7 * layers), 0)

  monkeypatch.setattr(Trainer, "compile", compile)
  monkeypatch.setattr(shallow, "DEEP", 8)
  config = load_config(None, ["train.global_batch_size=4", "train.micro_batch_size=4",
                              "model.num_layers=8"])
  ladder = Ladder(config, "as configured", [], ("device", None), MACHINE, None, 0)
  budgets = Budgets(device=int((ladder.resident_bytes(0) + 10**6) / 0.95), host=10**12)
  ladder.least_fitting(budgets)
  with Peaks(threads=1) as peaks:
    assert ladder.predict(budgets, peaks).verdict == ""  # A guess, not "no: device".
    row = ladder.verify(budgets, peaks)
  assert row.verdict == "fits" and row.device_bytes == ladder.resident_bytes(
      round(row.fraction * 8)) + 10**6


@pytest.mark.slow
def test_the_line_through_two_shallow_depths_predicts_the_whole_models_compiled_peak(
    monkeypatch):
  # XLA's offload of q/k/v, whose copies need a few layers to take the schedule they keep,
  # with the host kernel's gradients summed on the host; 8 layers predicted as a deeper
  # model would be.
  monkeypatch.setattr(shallow, "DEEP", 8)
  config = load_config(None, ["model.num_layers=8", "train.global_batch_size=8",
                              "train.micro_batch_size=2"])
  setting = "offload qkv, 7 layers"
  overrides = search.activation_settings(config, backend="gpu")[setting]
  ladder = Ladder(config, setting, list(overrides), ("host_kernel", "host"), MACHINE, None, 0)
  assert ladder.least_fitting(Budgets(device=10**12, host=10**13)).verdict == ""
  with Peaks() as peaks:
    predicted = ladder.transient_bytes(peaks)
    compiled = max(peaks.get(ladder.candidate(ladder.steps)[0])) - ladder.resident_bytes(
        ladder.steps)
  assert predicted == pytest.approx(compiled, rel=0.005)
