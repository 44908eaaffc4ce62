"""The host kernel's rate on fresh zeros against filled arrays, and what autoplace measures.

  PYTHONPATH=. python3 benchmarks/host_kernel_rate.py

Fresh ``np.zeros`` pages are one shared zero page until written: the kernel
reads its gradients from cache there, faster than from the memory of a step.
"""
import time

import numpy as np

from jaxoffload import host_adam, autoplace
def best(n, fill):
  arrays = [np.zeros(n, np.float32) if fill is None else np.full(n, fill, np.float32) for _ in range(4)]
  f = lambda: host_adam.adamw_update(*arrays, learning_rate=0.0, count=1)
  f(); ts = []
  for _ in range(3):
    t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
  return n / min(ts) / 1e9, n / np.median(ts) / 1e9
for n, fill in [(16 << 20, None), (16 << 20, 0.5), (32 << 20, 0.5), (256 << 20, 0.5)]:
  print(f"kernel {n >> 20}M fill {fill}: best / median {best(n, fill)} G params/s", flush=True)
print(autoplace.measure_machine())
