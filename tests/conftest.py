"""Test setup: an 8-device CPU platform for sharding tests, and the ``gpu`` marker."""

import os

# Must precede the first jax import: gives the CPU backend 8 devices for mesh tests.
os.environ["XLA_FLAGS"] = " ".join(
    filter(None, [os.environ.get("XLA_FLAGS"), "--xla_force_host_platform_device_count=8"]))

import jax  # noqa: E402
import pytest  # noqa: E402

# GPU float32 matmuls default to TF32; parity tests compare against float32 math.
jax.config.update("jax_default_matmul_precision", "highest")


def pytest_configure(config):
  config.addinivalue_line("markers", "gpu: needs a GPU; skipped elsewhere")


def pytest_collection_modifyitems(config, items):
  if jax.default_backend() == "gpu":
    return
  skip = pytest.mark.skip(reason="needs a GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
