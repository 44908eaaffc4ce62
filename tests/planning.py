"""What the planner's tests stand in for: this machine's rates, a calibration, and the compiler.

On a CPU, XLA's memory analysis counts host buffers as device memory, so the tests that need
the device's peak to fall with offload stand in for the compiler with the state's own device
bytes plus a fixed temporary (``compiled_as_resident``).
"""

import pytest

from jaxoffload.host import pricing
from jaxoffload.plan import step_time
from jaxoffload.train.step import CompiledStep, Trainer, resident_device_bytes

MACHINE = pricing.Machine(host_to_device=50e9, device_to_host=50e9, kernel_rate=5e9,
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
  def compile(self, tokens, **_):
    return CompiledStep((), resident_device_bytes(self) + TEMPORARIES, 0)

  monkeypatch.setattr(Trainer, "compile", compile)
