"""The device guard before the first step: a compiled peak above what a device may use
(``train.device_memory_limit`` standing for a smaller GPU) is refused in one line naming the
settings that fit, each compiled to check it."""

import re

import pytest

from jaxoffload import plan
from jaxoffload.host import pricing
from jaxoffload.plan import fit, search
from jaxoffload.train import load_config, resolve, run, train
from jaxoffload.train.__main__ import main
from jaxoffload.train.config import ConfigError
from jaxoffload.train.device_memory import capacity
from jaxoffload.train.step import Trainer, resident_device_bytes
from tests.planning import CALIBRATION, MACHINE

BASE = ["train.train_iters=1", "train.global_batch_size=8", "train.micro_batch_size=8",
        "logging.progress_bar=False"]


def compiled_peak(overrides: list[str]) -> int:
  setup = resolve(load_config(None, overrides), with_data=False)
  return Trainer.from_shapes(setup).compile(setup.batch_shape).device_bytes


def test_a_step_above_the_limit_is_refused_before_it_runs_naming_settings_that_fit():
  peak = compiled_peak(BASE)
  limit = peak - 1  # Above every floor the arithmetic knows, below the compiled step.
  steps = []
  with pytest.raises(ConfigError) as refused:
    train(load_config(None, [*BASE, f"train.device_memory_limit={limit}"]),
          log=steps.append)
  line = str(refused.value)
  assert "\n" not in line and not any(s.startswith("step ") for s in steps)
  assert re.match(r"device memory: the compiled step needs [\d.]+ MB on one device \(XLA's "
                  rf"memory analysis\) but it has [\d.]+ MB \(train.device_memory_limit="
                  rf"{limit}\); it fits with ", line)
  settings = [s.split(" (")[0].split() for s in line.split("it fits with ")[1].split("; or ")]
  assert settings
  peaks = [compiled_peak([*BASE, *setting]) for setting in settings]
  # Each fits, the lowest peak first; the first one trains under the limit.
  assert max(peaks) <= limit and peaks == sorted(peaks)
  losses = train(load_config(None, [*BASE, *settings[0], f"train.device_memory_limit={limit}"]),
                 log=lambda _: None)
  assert len(losses) == 1


def test_when_no_one_setting_fits_the_line_says_so(capsys):
  limit = compiled_peak([*BASE, "model.recompute_granularity=full"]) // 2
  with pytest.raises(SystemExit) as exit_:
    main([*BASE, f"train.device_memory_limit={limit}"])
  err = capsys.readouterr().err
  assert exit_.value.code == 2 and err.count("\n") == 1
  assert err.startswith("error: device memory: ") and "no one setting fits: combine them" in err


@pytest.mark.parametrize("limit, refused", [("0", r"at least 1"), ("lots", r"lots")])
def test_a_limit_that_is_no_size_is_refused(limit, refused):
  with pytest.raises(ConfigError, match=rf"train.device_memory_limit.*{refused}"):
    load_config(None, [f"train.device_memory_limit={limit}"])


def test_the_limit_is_each_devices_capacity_and_the_planners_budget():
  config = load_config(None, ["train.device_memory_limit=24GB"])
  assert capacity(config) == (24 * 10**9, "train.device_memory_limit=24GB")
  assert fit.budgets_of(config).device == 24 * 10**9


@pytest.mark.slow
def test_the_fit_mode_trains_the_pick_it_names_under_the_limit(monkeypatch, capsys):
  monkeypatch.setattr(pricing, "measure_machine", lambda **_: MACHINE)
  monkeypatch.setattr(search, "calibrate", lambda configs, log: CALIBRATION)
  limit = compiled_peak([*BASE, "train.micro_batch_size=4"])
  logged = []
  config, chosen = plan.choose(load_config(None, [*BASE, "train.fit=auto",
                                                  f"train.device_memory_limit={limit}"]))
  line, = chosen
  assert line.startswith("train.fit=auto chose ")
  picked = line.split("a step): ")[1].split()
  peak = float(re.search(r"device peak ([\d.]+) MB", line).group(1)) * 10**6
  # The pick fits, as its own compile says; and the run trains it, its compiled step under
  # the limit (the guard would refuse it otherwise).
  assert compiled_peak([*BASE, *picked]) <= limit
  assert compiled_peak([*BASE, *picked]) == pytest.approx(peak, rel=0.05)
  run_ = run(config, log=logged.append, choices=chosen)
  assert line in logged and len(run_.losses) == 1 and run_.compiled_device_bytes <= limit


def test_the_evaluation_is_compiled_ahead_and_its_peak_counts_the_state_beside_it():
  setup = resolve(load_config(None, [*BASE, "eval.interval=1"]))
  trainer = Trainer(setup, None)
  tokens = setup.eval_batch(0)
  jitted = float(trainer.evaluate(tokens).addressable_data(0))
  peak = trainer.compile_evaluation(tokens)
  assert float(trainer.evaluate(tokens).addressable_data(0)) == jitted
  # Its program holds the parameters; the optimizer state stays beside it.
  assert peak > resident_device_bytes(trainer)
