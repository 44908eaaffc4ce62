"""How far a one-step delay lowers the largest stable step of momentum, on a quadratic.

  python benchmarks/delay_stability.py --out docs/benchmarks/delay_stability

Adam's first moment is the momentum m_k = b1 m_(k-1) + (1 - b1) g_k and its step
is x_(k+1) = x_k - lr m_k (the second moment, slow with b2 = 0.95, folds into
the curvature). On one direction of curvature h, g = h x, and the iteration is
stable while lr * h stays below a threshold: 2 (1 + b1) / (1 - b1) = 38 for
b1 = 0.9. Training with Adam drives the preconditioned curvature up to that
threshold and holds it there (the edge of stability), so the threshold sets
how sharp a region the optimiser can work in.

The delayed update takes g_k at x_(k-1); weight prediction takes it at
x_(k-1) + c (x_(k-1) - x_(k-2)) (``optimizer.delayed_update_predict_weights``
is c = 1). This script finds each threshold from the eigenvalues of the
linear iteration: no training, numpy only.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from common import metadata, write_report

B1_VALUES = (0.0, 0.5, 0.9)
PREDICTIONS = (1.0, 1.5, 2.0)


def iteration(lr_h: float, b1: float, weights: tuple[float, float, float]) -> np.ndarray:
  """The linear map of (x_k, x_(k-1), x_(k-2), lr m_(k-1)) one step on.

  ``weights`` say where the gradient is taken: at w0 x_k + w1 x_(k-1) + w2 x_(k-2).
  """
  point = np.array([*weights, 0.0])
  momentum = b1 * np.eye(4)[3] + (1 - b1) * lr_h * point  # lr m_k as a row of the map.
  return np.stack([np.eye(4)[0] - momentum, np.eye(4)[0], np.eye(4)[1], momentum])


def threshold(b1: float, weights: tuple[float, float, float], top: float = 100.0) -> float:
  """The largest lr * h below which the iteration is stable, to 1e-4."""
  stable = lambda lr_h: np.max(np.abs(np.linalg.eigvals(iteration(lr_h, b1, weights)))) < 1
  grid = np.arange(1e-3, top, 1e-2)
  first_unstable = next(x for x in grid if not stable(x))
  low, high = first_unstable - 1e-2, first_unstable
  while high - low > 1e-4:
    middle = (low + high) / 2
    low, high = (middle, high) if stable(middle) else (low, middle)
  return low


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", default="docs/benchmarks/delay_stability")
  args = parser.parse_args()
  schemes = {"exact": (1.0, 0.0, 0.0), "delayed": (0.0, 1.0, 0.0)}
  schemes.update({f"delayed, predicted (c = {c:g})": (0.0, 1.0 + c, -c) for c in PREDICTIONS})
  results = [{"scheme": name, **{f"b1={b1:g}": threshold(b1, weights) for b1 in B1_VALUES}}
             for name, weights in schemes.items()]
  meta = metadata(sys.argv)
  lines = ["# Largest stable lr x curvature of Adam's momentum, with and without a one-step delay",
           "", f"{meta['date']}; numpy, no device. Command: `{meta['command']}`", "",
           "| gradient taken at | " + " | ".join(f"b1 = {b1:g}" for b1 in B1_VALUES) + " |",
           "|---|" + "---|" * len(B1_VALUES)]
  for r in results:
    lines.append(f"| {r['scheme']} | "
                 + " | ".join(f"{r[f'b1={b1:g}']:.3f}" for b1 in B1_VALUES) + " |")
  write_report(args.out, meta, results,
               "\n".join(lines) + "\n")


if __name__ == "__main__":
  main()
