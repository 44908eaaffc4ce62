"""The Flax Llama and its placement: ``model``, its per-piece loss (``layered``),
activation remat policies (``remat``), parameters (``params``) and shardings
(``sharding``).
"""
