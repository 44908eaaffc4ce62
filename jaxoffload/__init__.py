"""jaxoffload: train JAX models larger than device memory by keeping training state in host memory."""

from jaxoffload.host.host_adamw import HostAdamW
from jaxoffload.memory import bytes_by_memory_kind, peak_device_bytes
from jaxoffload.nn.remat import (ACTIVATION_NAMES, OFFLOAD_PRESETS, LayerGroup, Placement,
                                 layer_groups, megatron_layer_groups, offload_preset, remat_policy)
from jaxoffload.optim.offload_plan import OffloadPlan, find_offload_plan, plan_offload
from jaxoffload.optim.offloaded_adam import (ScaleByOffloadedAdamState, offload_adamw,
                                             scale_by_offloaded_adam)
from jaxoffload.rounding import stochastic_round

__all__ = [
    "ACTIVATION_NAMES",
    "HostAdamW",
    "LayerGroup",
    "OFFLOAD_PRESETS",
    "OffloadPlan",
    "Placement",
    "ScaleByOffloadedAdamState",
    "bytes_by_memory_kind",
    "find_offload_plan",
    "layer_groups",
    "megatron_layer_groups",
    "offload_adamw",
    "offload_preset",
    "peak_device_bytes",
    "plan_offload",
    "remat_policy",
    "scale_by_offloaded_adam",
    "stochastic_round",
]
