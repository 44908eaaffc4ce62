"""Test setup: an 8-device CPU platform for sharding tests, a compilation cache, the markers.

``slow`` marks what the fast tier (``pytest -m "not slow"``) leaves out; ``gpu``
tests skip without a GPU.
"""

import atexit
import os
import shutil
import tempfile

# Must precede the first jax import: gives the CPU backend 8 devices for mesh tests.
flags = [os.environ.get("XLA_FLAGS"), "--xla_force_host_platform_device_count=8"]
if shutil.which("nvidia-smi") is None:
  # The tests' programs are tiny: compiling them fast matters, running them fast does not.
  # XLA's older elemental emitters compile a CPU program in a fraction of the fusion
  # emitters' time.
  flags += ["--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false"]
else:
  # Resumed runs must match uninterrupted ones bit for bit: no atomics in the reductions
  # and scatters (the embedding's gradient) that a GPU may order differently each run.
  flags.append("--xla_gpu_deterministic_ops=true")
os.environ["XLA_FLAGS"] = " ".join(filter(None, flags))
# Many tests compile the same tiny programs, in this process and in the ones
# they start: XLA's persistent cache compiles each once.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxoffload-tests-")
  atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

# GPU float32 matmuls default to TF32; parity tests compare against float32 math. Set in
# the environment, so that the runs tests start in other processes compute alike.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
  if jax.default_backend() == "gpu":
    return
  skip = pytest.mark.skip(reason="needs a GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
