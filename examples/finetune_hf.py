"""Fine-tune a Hugging Face Llama checkpoint on text with optimizer offload on, then export it.

  python examples/finetune_hf.py [CHECKPOINT_DIR] [TEXT] [OUT_DIR]

CHECKPOINT_DIR is what transformers' ``save_pretrained`` writes (config.json,
safetensors, tokenizer.json); TEXT a text or JSONL file, a directory or a glob.
By default: the tiny checkpoint the tests ship, the text jaxoffload ships, and
a new directory in the system's temporary directory, named on the last line
printed. The run keeps half of Adam's state in host memory, evaluates on a
held-out slice of the text, checkpoints in OUT_DIR/run, and writes OUT_DIR/hf,
which transformers' ``from_pretrained`` reads.
"""

import os
import sys
import tempfile

from jaxoffload.train import load_config, run
from jaxoffload.train.export import export

TINY = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "tiny_llama")


def main(checkpoint: str = TINY, text: str | None = None, out: str | None = None,
         steps: int = 30):
  # Not the working directory: run from a clone, the example would leave its files there.
  out = out or tempfile.mkdtemp(prefix="finetuned-")
  overrides = [
      f"model.hf_checkpoint={checkpoint}", "model.seq_length=64",
      "data.dataset=text", *([f"data.path={text}"] if text else []),
      "train.global_batch_size=8", "train.micro_batch_size=4", f"train.train_iters={steps}",
      "optimizer.lr=3e-3", "optimizer.lr_warmup_iters=5",
      "optimizer.optimizer_cpu_offload=True", "optimizer.optimizer_offload_fraction=0.5",
      f"eval.interval={steps // 3}", f"checkpoint.dir={out}/run", "logging.progress_bar=False",
  ]
  result = run(load_config(None, overrides))
  print("exported", ", ".join(export(f"{out}/run", f"{out}/hf")), f"to {out}/hf")
  return result


if __name__ == "__main__":
  main(*sys.argv[1:])
