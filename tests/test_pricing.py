"""optimizer_offload_update_on=auto: the costs it predicts, the choice, and the trainer's use of it."""

import math
import re

import jax
import numpy as np
import pytest

from jaxoffload.host import pricing
from jaxoffload.train import load_config, metrics, resolve, train
from jaxoffload.train.offload_choice import forward_seconds, price_updates

# A machine like the H200's (docs/performance.md): 54 GB/s each way, the host
# kernel at 4.4 G params/s on 16 threads.
H200 = pricing.Machine(host_to_device=54e9, device_to_host=54e9, kernel_rate=4.4e9,
                         kernel_threads=16)


def test_costs_are_the_copies_and_the_host_work_of_each_placement():
  choice = pricing.choose(H200, offloaded_elements=527_000_000, moment_bytes_per_element=8,
                            transfer_bytes_per_element=4)
  # Device: both moments down and up. Host kernel: weights down, gradients up,
  # then the kernel.
  assert choice.predicted_s["device"] == pytest.approx(2 * 527e6 * 8 / 54e9)
  assert choice.predicted_s["host_kernel"] == pytest.approx(2 * 527e6 * 4 / 54e9 + 527e6 / 4.4e9)
  assert choice.place == "device"


def test_weights_read_in_float32_cost_their_bytes_on_the_way_up_only():
  slow_up = pricing.Machine(host_to_device=20e9, device_to_host=50e9, kernel_rate=4.4e9,
                              kernel_threads=16)
  choice = pricing.choose(slow_up, offloaded_elements=10**9, moment_bytes_per_element=8,
                            transfer_bytes_per_element=2, weight_bytes_per_element=4)
  assert choice.predicted_s["host_kernel"] == pytest.approx(4e9 / 20e9 + 2e9 / 50e9 + 1e9 / 4.4e9)


def test_a_tie_goes_to_the_host_kernel_which_saves_the_weights_too():
  # Every leaf of a 1.1B model with bfloat16 transfers: +0.326 s streamed,
  # +0.331 s on the host kernel.
  choice = pricing.choose(H200, offloaded_elements=1_100_048_384, moment_bytes_per_element=8,
                            transfer_bytes_per_element=2)
  assert choice.predicted_s["device"] < choice.predicted_s["host_kernel"]
  assert choice.place == "host_kernel"


def test_a_slow_link_makes_the_host_kernel_the_faster():
  slow = pricing.Machine(host_to_device=10e9, device_to_host=10e9, kernel_rate=4.4e9,
                           kernel_threads=16)
  choice = pricing.choose(slow, offloaded_elements=10**9, moment_bytes_per_element=8,
                            transfer_bytes_per_element=2)
  assert choice.place == "host_kernel"
  assert str(choice).startswith("optimizer_offload_update_on=auto chose host_kernel: predicted "
                                "+627.3 ms a step (device +1,600.0 ms; copies 10.0 GB/s")


def test_the_host_kernel_counts_every_local_shard():
  one, four = (pricing.choose(H200, offloaded_elements=10**8, moment_bytes_per_element=8,
                                transfer_bytes_per_element=4, local_elements=n * 10**8)
               for n in (1, 4))
  assert four.predicted_s["host_kernel"] - one.predicted_s["host_kernel"] == pytest.approx(
      3 * 10**8 / 4.4e9)


def test_an_overlapped_host_kernel_adds_only_its_time_beyond_the_forward_pass():
  priced = lambda overlap_s: pricing.choose(
      H200, offloaded_elements=10**9, moment_bytes_per_element=8, transfer_bytes_per_element=2,
      overlap_s=overlap_s).predicted_s["host_kernel"]
  link = 2 * 10**9 * 2 / 54e9
  assert priced(0.1) == pytest.approx(link + 10**9 / 4.4e9 - 0.1)
  assert priced(1.0) == pytest.approx(link)  # The whole update hidden: only the copies.


# TinyLlama-1.1B's elements offloaded at fractions 0.25, 0.5 and 1.0 (the leaves'
# achieved shares), and its forward pass of 8 x 2048 tokens at 40% of the H200's peak.
@pytest.mark.parametrize("elements", [277_217_280, 530_579_456, 1_100_048_384])
@pytest.mark.parametrize("transfer_bytes", [2, 4])
def test_the_overlapped_host_kernel_is_chosen_at_every_fraction_of_the_1b(elements,
                                                                          transfer_bytes):
  choice = pricing.choose(H200, offloaded_elements=elements, moment_bytes_per_element=8,
                            transfer_bytes_per_element=transfer_bytes, overlap_s=0.09)
  assert choice.place == "host_kernel"
  assert choice.predicted_s["host_kernel"] < choice.predicted_s["device"]


def test_the_trainer_prices_the_overlap_where_it_overlaps(monkeypatch):
  # The CPU given a peak, so that its forward pass has a price.
  monkeypatch.setitem(metrics.PEAK_FLOPS, jax.devices()[0].device_kind, (989e12, 494e12))
  base = ["optimizer.optimizer_cpu_offload=True", "optimizer.optimizer_offload_fraction=1.0",
          "optimizer.optimizer_offload_update_on=host_kernel", "model.dtype=bfloat16", "train.global_batch_size=4", "train.micro_batch_size=4"]
  setup = resolve(load_config(None, base))
  model = setup.config.model
  # Each device's share of the step's FLOPs, a third of which the forward pass does.
  flops = (4 * model.seq_length * metrics.flops_per_token(setup.model, model.seq_length)
           / jax.device_count())
  forward = forward_seconds(setup.config)
  assert forward == pytest.approx(flops / 3 / (989e12 * 0.4))

  def host_kernel_s(*more):
    setup = resolve(load_config(None, [*base, *more]))
    return price_updates(setup.config, setup.implied, setup.offload, H200, host_kernel=True
                         ).predicted_s["host_kernel"]

  # The tiny model's forward pass is far shorter than its kernel time: all of it is saved.
  assert forward < setup.offload.offloaded_elements / 4.4e9
  for not_overlapped in ("optimizer.overlap_cpu_optimizer_d2h_h2d=False",
                         "train.micro_batch_size=2"):
    assert host_kernel_s(not_overlapped) - host_kernel_s() == pytest.approx(forward)
  # Unclipped, the update starts in the backward pass, twice the forward's work.
  assert host_kernel_s() - host_kernel_s("optimizer.clip_grad=0") == pytest.approx(2 * forward)
  # Of two micro-batches summed on the device, only the first's forward pass hides it.
  summed = ["train.micro_batch_size=2", "optimizer.accumulate_offloaded_grads_on=device"]
  assert host_kernel_s(*summed) - host_kernel_s() == pytest.approx(forward / 2)


@pytest.mark.parametrize("machine, host_kernel", [
    (H200, False),
    (pricing.Machine(54e9, 54e9, kernel_rate=None, kernel_threads=None), True),
])
def test_without_the_host_kernel_only_the_device_is_priced(machine, host_kernel):
  choice = pricing.choose(machine, offloaded_elements=10**9, moment_bytes_per_element=8,
                            transfer_bytes_per_element=4, host_kernel=host_kernel)
  assert list(choice.predicted_s) == ["device"] and choice.place == "device"
  assert "no other candidate" in str(choice)


@pytest.mark.slow
@pytest.mark.parametrize("formats", [
    pricing.KernelFormats(), pricing.KernelFormats("bfloat16", "split", "int8", "int8"),
    pricing.KernelFormats("bfloat16", "bfloat16", "bfloat16", "float32")])
def test_measured_rates_are_finite_and_positive(formats):
  machine = pricing.measure_machine(formats=formats)
  for rate in (machine.host_to_device, machine.device_to_host, machine.kernel_rate):
    assert math.isfinite(rate) and rate > 0
  assert machine.kernel_threads >= 1 and machine.formats == formats
  assert re.search(rf"host kernel [\d.]+ G params/s on \d+ threads \({re.escape(str(formats))}\)",
                   str(machine))


@pytest.mark.slow
def test_the_trainer_shows_the_choice_and_trains_exactly():
  offload = ["train.train_iters=4", "optimizer.optimizer_cpu_offload=True",
             "optimizer.optimizer_offload_fraction=1.0"]
  logged = []
  losses = train(load_config(None, offload + ["optimizer.optimizer_offload_update_on=auto"]),
                 log=logged.append)
  chosen = [line for line in logged if line.startswith("optimizer_offload_update_on=auto chose ")]
  assert len(chosen) == 1
  place = chosen[0].split()[2].rstrip(":")
  assert place in ("device", "host_kernel")
  baseline = train(load_config(None, ["train.train_iters=4"]), log=lambda _: None)
  np.testing.assert_allclose(losses, baseline, rtol=1e-5)


# The link slow and the kernel fast, or the other way round: each placement cheaper once.
KERNEL_CHEAPER = pricing.Machine(host_to_device=5e9, device_to_host=5e9, kernel_rate=1e12,
                                   kernel_threads=16)
STREAM_CHEAPER = pricing.Machine(host_to_device=1e12, device_to_host=1e12, kernel_rate=1e6,
                                   kernel_threads=16)


@pytest.mark.parametrize("machine, place, wire", [
    (KERNEL_CHEAPER, "host_kernel", "bfloat16"), (STREAM_CHEAPER, "device", "float32")])
def test_by_default_the_placement_and_transfer_dtype_are_this_machines_fastest(
    monkeypatch, machine, place, wire):
  probed = []
  monkeypatch.setattr(pricing, "measure_machine",
                      lambda formats: probed.append(formats) or machine)
  config = load_config(None, ["optimizer.optimizer_cpu_offload=True",
                              "optimizer.optimizer_offload_fraction=1.0", "model.dtype=bfloat16"])
  assert (config.optimizer.optimizer_offload_update_on,
          config.optimizer.offload_transfer_dtype) == ("auto", "auto")
  setup = resolve(config)
  o = setup.config.optimizer
  assert (o.optimizer_offload_update_on, o.offload_transfer_dtype) == (place, wire)
  assert [line.split()[2] for line in setup.choices] == [f"{place}:"]
  # The kernel timed on what the run's host kernel would update: bfloat16 gradients, split
  # float32 masters, float32 moments.
  assert probed == [pricing.KernelFormats("bfloat16", "split", "float32", "float32")]
  # Without offload there is nothing to choose, and nothing measured.
  monkeypatch.setattr(pricing, "measure_machine", lambda **_: pytest.fail("measured"))
  plain = resolve(load_config(None, ["model.dtype=bfloat16"]))
  assert plain.choices == () and not plain.host_kernel


def test_float32_compute_keeps_float32_transfers_on_the_host_kernel():
  setup = resolve(load_config(None, ["optimizer.optimizer_cpu_offload=True",
                                     "optimizer.optimizer_offload_fraction=0.5",
                                     "optimizer.optimizer_offload_update_on=host_kernel"]))
  assert setup.config.optimizer.offload_transfer_dtype == "float32"
  assert set(setup.transfer_dtypes) == {np.dtype("float32")}
