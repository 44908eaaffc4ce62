"""Optax transformations whose Adam state lives partly in host memory.

``offloaded_adam`` defines ``scale_by_offloaded_adam`` and ``offload_adamw``;
``offload_plan`` picks the leaves whose state is offloaded; ``streaming`` runs an
update whose state is in host memory; ``blockwise`` stores moments in 8 bits.
"""
