"""The benchmark runner, ``python -m jaxoffload.bench``: every offload setting of a config, priced."""
