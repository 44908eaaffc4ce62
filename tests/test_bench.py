"""The benchmark runner: its settings, its comparisons, and a whole run on the tiny model."""

import json
import os
import subprocess
import sys

import pytest

from jaxoffload.bench import report, settings
from jaxoffload.bench.__main__ import _matrix, _parser
from jaxoffload.bench.__main__ import main as bench_main
from jaxoffload.train import ConfigError, load_config


@pytest.mark.parametrize("dtype, scan_layers", [("float32", True), ("bfloat16", False)])
def test_default_settings_are_valid_configs_with_the_baseline_first(dtype, scan_layers):
  matrix = settings.default_settings(num_layers=4, bfloat16_compute=dtype == "bfloat16",
                                     scan_layers=scan_layers)
  assert list(matrix)[0] == "baseline" and matrix["baseline"] == []
  # The one program the other way than the config's.
  other = matrix[f"baseline with its layers {'unrolled' if scan_layers else 'scanned'}"]
  assert load_config(None, other).model.scan_layers is not scan_layers
  # --settings takes them comma-separated.
  assert not [name for name in matrix if "," in name]
  assert {"optimizer 0.25 device", "optimizer 1.0 host", "activations 2 layers",
          "activations 3 layers", "optimizer 0.5 device + activations 3 layers"} <= set(matrix)
  halved = {name for name in matrix if "bf16 transfers" in name}
  assert len(halved) == (6 if dtype == "bfloat16" else 0)  # Each fraction, overlapped or not.
  for name, overrides in matrix.items():
    o = load_config(None, [f"model.dtype={dtype}", *overrides]).optimizer
    if name.endswith(" default"):  # The seed's two keys alone.
      assert overrides == ["optimizer.optimizer_cpu_offload=True",
                           f"optimizer.optimizer_offload_fraction={o.optimizer_offload_fraction}"]
      assert (o.optimizer_offload_update_on, o.offload_transfer_dtype) == ("auto", "auto")
    elif "host_kernel" in name:  # Every transfer dtype named, whatever the default.
      assert o.offload_transfer_dtype == ("bfloat16" if "bf16" in name else "float32")
  assert sum(name.endswith(" default") for name in matrix) == 3


def test_a_float32_model_is_told_the_bf16_transfers_settings_are_left_out(capsys):
  _matrix(_parser().parse_args([]), [])
  assert capsys.readouterr().err == settings.BF16_TRANSFERS_NOTE + "\n"
  _matrix(_parser().parse_args([]), ["model.dtype=bfloat16"])
  assert capsys.readouterr().err == ""


def test_comparison_against_the_baseline():
  common = dict(offloaded_state_bytes=0, offloaded_activation_bytes=0, compiled_device_bytes=0)
  results = [
      dict(common, step_s_median=0.2, peak_device_bytes=1000, losses=[3.0, 2.0]),
      dict(common, step_s_median=0.3, peak_device_bytes=600, losses=[3.0, 2.5],
           offloaded_state_bytes=300, offloaded_activation_bytes=50),
  ]
  settings.compare(results)
  assert results[1]["step_ratio"] == pytest.approx(1.5)
  assert results[1]["memory_ratio"] == pytest.approx(0.6)
  assert results[1]["predicted_saving_bytes"] == 350
  assert results[1]["measured_saving_bytes"] == 400
  assert results[1]["max_abs_loss_diff"] == pytest.approx(0.5)


def run_bench(*args):
  done = subprocess.run([sys.executable, "-m", "jaxoffload.bench", *args],
                        capture_output=True, text=True, timeout=900, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  return done.stdout


@pytest.mark.slow
def test_a_run_on_the_tiny_model_writes_json_table_and_plots(tmp_path):
  out = str(tmp_path / "tiny")
  # The first run's parent in this process (its settings each still run in a process of
  # their own); the resumed run is the command.
  bench_main(["--steps", "3", "--out", out, "--settings", "baseline again,optimizer 0.5 device"])
  first = json.loads((tmp_path / "tiny.json").read_text())["results"]
  # A second run resumes: the settings measured stay, the missing one runs.
  auto = ("auto placement=optimizer.optimizer_cpu_offload=True "
          "optimizer.optimizer_offload_fraction=0.5 optimizer.optimizer_offload_update_on=auto")
  printed = run_bench("--steps", "3", "--out", out, "--resume", "--settings",
                      "baseline again,optimizer 0.5 device,activations 2 layers", "--setting", auto)
  assert "resumed 3 settings" in printed
  report = json.loads((tmp_path / "tiny.json").read_text())
  assert [r["step_s"] for r in report["results"][:3]] == [r["step_s"] for r in first]
  names = [r["setting"] for r in report["results"]]
  assert names == ["baseline", "baseline again", "optimizer 0.5 device", "activations 2 layers",
                   "auto placement"]
  # What auto chose, with its prices, as the trainer showed it.
  assert [r["choices"] for r in report["results"][2:4]] == [[], []]
  [chosen] = report["results"][4]["choices"]
  assert chosen.startswith("optimizer_offload_update_on=auto chose ")
  assert report["meta"]["device"] and report["meta"]["jax"] and report["meta"]["steps"] == 3
  for r in report["results"]:
    assert len(r["losses"]) == 3 and len(r["step_s"]) == 3
    assert r["max_abs_loss_diff"] <= 1e-5 * r["losses"][0]
  optimizer = report["results"][2]
  assert optimizer["offloaded_state_bytes"] > 0 and optimizer["pinned_host_bytes"] > 0
  assert report["results"][3]["offloaded_activation_bytes"] > 0
  table = (tmp_path / "tiny.md").read_text()
  assert "| optimizer 0.5 device |" in table and "Largest loss difference" in table
  assert "The baseline run again, the noise floor of nondeterministic kernels: " in table
  assert (tmp_path / "tiny_memory.png").stat().st_size > 0
  assert (tmp_path / "tiny_frontier.png").stat().st_size > 0


def test_resume_refuses_results_of_other_steps(tmp_path):
  (tmp_path / "x.json").write_text(json.dumps({"meta": {"config": "(defaults)", "steps": 10},
                                               "results": []}))
  with pytest.raises(SystemExit) as exit_:
    bench_main(["--resume", "--steps", "3", "--out", str(tmp_path / "x")])
  assert str(exit_.value).endswith("measured (defaults) for 10 steps, not (defaults) for 3")


def test_unknown_setting_names_the_known_ones(tmp_path, capsys):
  with pytest.raises(SystemExit) as exit_:
    bench_main(["--settings", "optimiser 0.5", "--out", str(tmp_path / "x")])
  assert exit_.value.code == 2
  assert capsys.readouterr().err.startswith(
      "error: unknown settings ['optimiser 0.5']; known: ['baseline',")


def test_settings_of_your_own_run_after_the_baseline_and_are_checked():
  own = "bf16 sums=train.micro_batch_size=4 optimizer.grad_accum_dtype=bfloat16"
  args = _parser().parse_args(["--settings", "optimizer 0.5 device", "--setting", own])
  assert _matrix(args, []) == {
      "baseline": [], "optimizer 0.5 device": settings.default_settings(4, False, True)[
          "optimizer 0.5 device"],
      "bf16 sums": ["train.micro_batch_size=4", "optimizer.grad_accum_dtype=bfloat16"]}
  with pytest.raises(ConfigError, match="optimizer.grad_accum_dtype must be one of"):
    _matrix(_parser().parse_args(["--setting", "x=optimizer.grad_accum_dtype=int8"]), [])
  for bad in ("no equals sign", "baseline=train.seed=1", "=train.seed=1"):
    with pytest.raises(ConfigError, match=r"^--setting .*: write NAME=OVERRIDES"):
      _matrix(_parser().parse_args(["--setting", bad]), [])


def test_memory_plot_labels_say_what_each_setting_overlaps(tmp_path):
  matrix = settings.default_settings(num_layers=4, bfloat16_compute=True, scan_layers=True)
  results = [{"setting": name, "overrides": overrides} for name, overrides in matrix.items()]
  labels = {r["setting"]: report.curve_label(r) for r in results}
  assert labels["optimizer 0.5 host_kernel no overlap"] == "update on host_kernel no overlap"
  assert labels["optimizer 0.5 host_kernel bf16 transfers no overlap"] == (
      "update on host_kernel bf16 transfers no overlap")
  assert labels["optimizer 0.5 device overlap"] == "update on device overlapped"
  assert labels["optimizer 0.5 host_kernel"] == "update on host_kernel"
  assert labels["baseline"] is None and labels["activations 2 layers"] is None
  assert labels["optimizer 0.5 device + activations 3 layers"] is None
  # Written in lower case the value means the same to the trainer, and so to the plot.
  assert report.curve_label({"overrides": [
      "optimizer.optimizer_offload_fraction=0.5", "optimizer.optimizer_offload_update_on=device",
      "optimizer.overlap_cpu_optimizer_d2h_h2d=false"]}) == "update on device no overlap"
  # A placement at the config's own fraction (a setting of --setting): no point to place.
  assert report.curve_label({"overrides": [
      "optimizer.optimizer_offload_update_on=host_kernel"]}) is None
  # One point per fraction on each curve: no two settings share a curve at one fraction.
  points = [(label, dict(o.split("=", 1) for o in matrix[name])[
      "optimizer.optimizer_offload_fraction"]) for name, label in labels.items() if label]
  assert len(points) == len(set(points))
  for r in results:
    r.update(device_bytes=2**30, step_ratio=1.0)
  paths = report.plot(str(tmp_path / "all"), results)
  assert all(os.path.getsize(path) > 0 for path in paths)
