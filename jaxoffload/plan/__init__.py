"""The fastest setting that fits this machine, found before anything is allocated.

``python -m jaxoffload.plan --config X [overrides]`` tries, for the config's
model and global batch, the optimizer offload (a fraction in layer-sized steps,
updated on the device or by the host kernel), the activation setting (saved,
recomputed in part or in full, offloaded by XLA on all but the last layer or on
fewer, the rest saved, or moved by the trainer, with weights offload) and the
micro-batch size; where nothing fits with the config's Adam moments, it searches
again with bfloat16 moments, then 8-bit ones (``search.COMPACT_MOMENTS``).
Each candidate is judged before anything is allocated:

- device peak: XLA's memory analysis of the step compiled from shapes alone
  (``Trainer.from_shapes``), against the device's memory less a headroom: predicted
  from the step at two shallow depths, then compiled whole where it is predicted to fit
  (``plan.fit.search``); where that memory is unknown (CPUs), nothing is compiled;
- host bytes: the host-memory guard's arithmetic (``train.host_memory``, with the JAX
  runtime's reserve) and what this process holds, against what the machine gives less
  a headroom;
- step time: predicted (``jaxoffload.plan.step_time``) from a short calibration
  of this machine (``jaxoffload.plan.timing``).

It prints every candidate it judged (compiled or not, and why), marks what
fits, and picks the fastest that fits, with the seconds each part of the plan took; XLA's
own log lines are left out.
``train.fit=auto`` has the trainer start with this search's pick, and
``optimizer.optimizer_offload_fraction=auto`` with the same search over the offload alone
(``jaxoffload.plan.fit``, whose ladders and search this one extends): ``choose`` settles both.
``train.device_memory_limit`` sets the device budget below the device's own.
"""

from jaxoffload.plan.choose import choose
from jaxoffload.plan.fit import budgets_of, fastest_offload
from jaxoffload.plan.ladder import Budgets, Candidate
from jaxoffload.plan.search import activation_settings, plan, table
from jaxoffload.plan.step_time import Calibration, predict_s
from jaxoffload.plan.timing import calibrate

__all__ = ["Budgets", "Calibration", "Candidate", "activation_settings", "budgets_of",
           "calibrate", "choose", "fastest_offload", "plan", "predict_s", "table"]
