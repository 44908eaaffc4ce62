"""The host kernel: AdamW on the host's cores, overlapped with the device's steps.

``host_adamw`` defines ``HostAdamW``; ``adam`` and ``kernels`` are its numba AdamW;
``kernel_state`` holds its weights, masters and moments shard by shard,
``numpy_views`` sees JAX's host arrays as numpy; ``held_update`` and ``held_steps``
apply a step's update a piece at a time; ``pricing`` measures this machine and
prices where offloaded state updates.
"""
