"""A run's checkpoints: orbax saves (``saves``), the directory a run claims
(``checkpoint_dir``, ``claims``), what a checkpoint ran with (``checkpoint_meta``),
the host kernel's leaves written from the live state (``host_checkpoint``) and trees
read into any setting (``reader``).
"""
