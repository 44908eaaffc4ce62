"""jaxoffload: train JAX models larger than device memory by keeping training state in host memory."""

from jaxoffload.adam import ScaleByOffloadedAdamState, offload_adamw, scale_by_offloaded_adam
from jaxoffload.memory import bytes_by_memory_kind, peak_device_bytes
from jaxoffload.placement import OffloadPlan, find_offload_plan, plan_offload

__all__ = [
    "OffloadPlan",
    "ScaleByOffloadedAdamState",
    "bytes_by_memory_kind",
    "find_offload_plan",
    "offload_adamw",
    "peak_device_bytes",
    "plan_offload",
    "scale_by_offloaded_adam",
]
