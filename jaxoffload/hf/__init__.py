"""Hugging Face Llama checkpoints in and out: ``load_checkpoint`` and ``save_checkpoint``.

``config`` maps a ``config.json`` to a ``LlamaConfig``; ``tensor_files`` reads
safetensors files at the page cache's speed.
"""

from jaxoffload.hf.checkpoint import load_checkpoint, save_checkpoint

__all__ = ["load_checkpoint", "save_checkpoint"]
