"""What a training run reports each step: losses, speed, model FLOPs utilisation and memory.

``Monitor`` writes one record per step to a JSONL file and to TensorBoard,
shows a progress line (redrawn in place on a terminal, a line every
``log_interval`` steps otherwise) and a summary at the end; ``Profiler``
traces a window of steps with ``jax.profiler``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import math
import os
import statistics
from typing import Any, Callable, Iterator, Optional, TextIO

import jax
import jax.numpy as jnp

from jaxoffload.nn.model import LlamaConfig
from jaxoffload.train.config import ConfigError

# Dense peak FLOP/s of one chip for 16-bit and for 32-bit matmuls (TF32 on
# NVIDIA GPUs, which XLA uses for float32 at default precision), from the
# vendors' data sheets. Devices not listed get no MFU.
PEAK_FLOPS = {
    "NVIDIA H200": (989e12, 494e12),
    "NVIDIA H100 80GB HBM3": (989e12, 494e12),
    "NVIDIA A100-SXM4-80GB": (312e12, 156e12),
    "TPU v4": (275e12, 275e12),
    "TPU v5 lite": (197e12, 197e12),
    "TPU v5p": (459e12, 459e12),
    "TPU v6 lite": (918e12, 918e12),
}


def flops_per_token(config: LlamaConfig, seq_len: int) -> float:
  """Training FLOPs per token: 6 per matmul weight, plus causal attention's score and value products.

  Example:
    >>> flops_per_token(LlamaConfig(), seq_len=64)
  """
  heads = config.num_attention_heads * config.head_dim
  kv = config.num_query_groups * config.head_dim
  per_layer = (config.hidden_size * (heads + 2 * kv) + heads * config.hidden_size
               + 3 * config.hidden_size * config.intermediate_size)
  matmul_weights = config.num_layers * per_layer + config.vocab_size * config.hidden_size
  # Forward: q.k and p.v cost 2 * seq_len * heads each, halved by the causal mask.
  attention = config.num_layers * 2 * seq_len * heads
  return 6.0 * matmul_weights + 3.0 * attention


def peak_flops(device: jax.Device, dtype) -> Optional[float]:
  """The device's dense peak FLOP/s for matmuls in ``dtype``; None when unknown (CPUs)."""
  peaks = PEAK_FLOPS.get(device.device_kind)
  if peaks is None:
    return None
  return peaks[0] if jnp.dtype(dtype).itemsize <= 2 else peaks[1]


@dataclasses.dataclass
class StepRecord:
  """One step's figures, as written to the JSONL file and TensorBoard."""

  step: int
  loss: float
  step_s: float
  tokens_per_s: float
  mfu: Optional[float]  # Model FLOPs utilisation in [0, 1]; None where the peak is unknown.
  learning_rate: float  # The rate this step's update used.
  grad_norm: float  # The gradients' global norm, before clipping.
  peak_device_bytes: Optional[int]  # Since the process started; None on CPU.
  pinned_host_bytes: int  # Offloaded training state plus the step's host temporaries.
  host_rss_bytes: Optional[int]  # The process's resident host memory; None where unknown.
  eval_loss: Optional[float] = None  # Held-out loss after this step, where evaluated.
  eval_perplexity: Optional[float] = None


def open_jsonl(path: str) -> TextIO:
  """``logging.jsonl``'s file, opened to append to, its folder made where missing, and held
  by this run alone (an exclusive ``flock`` until it is closed).

  Raises:
    ConfigError: naming the path, where it cannot be written or another run writes it.
  """
  with _writable("logging.jsonl", path):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    jsonl = open(path, "a")
  try:
    fcntl.flock(jsonl.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    jsonl.close()
    raise ConfigError(f"logging.jsonl {path!r} is being written by another run: give this "
                      f"run another logging.jsonl") from None
  return jsonl


def make_folder(key: str, path: str) -> None:
  """Makes ``key``'s folder ``path`` where missing.

  Raises:
    ConfigError: naming the key and the path, where it cannot be made.
  """
  with _writable(key, path):
    os.makedirs(path, exist_ok=True)


@contextlib.contextmanager
def _writable(key: str, path: str) -> Iterator[None]:
  """An ``OSError`` inside as a one-line ``ConfigError`` naming the key and the path."""
  try:
    yield
  except OSError as error:
    raise ConfigError(f"{key}={path}: cannot be written ({error.strerror}: "
                      f"{error.filename})") from None


class TensorBoard:
  """Each record's figures as TensorBoard scalars, through tensorboardX's event-file writer.

  Raises:
    ConfigError: when tensorboardX is not installed, or the directory cannot be written.
  """

  def __init__(self, directory: str):
    try:
      from tensorboardX import SummaryWriter
    except ImportError:
      raise ConfigError("logging.tensorboard_dir needs tensorboardX: "
                        "pip install 'jaxoffload[metrics]'") from None
    with _writable("logging.tensorboard_dir", directory):
      self._writer = SummaryWriter(directory)

  def write(self, record: StepRecord) -> None:
    for name, value in dataclasses.asdict(record).items():
      if name != "step" and value is not None:
        self._writer.add_scalar(name, value, record.step)

  def close(self) -> None:
    self._writer.close()


class Profiler:
  """A ``jax.profiler`` trace of ``steps`` steps from step ``start``, written to ``directory``."""

  def __init__(self, directory: Optional[str], start: int, steps: int, log=print):
    self.directory, self.start, self.stop = directory, start, start + steps - 1
    self.log = log

  def before(self, step: int) -> None:
    if self.directory is not None and step == self.start:
      jax.profiler.start_trace(self.directory)

  def after(self, step: int, outputs: Any) -> None:
    if self.directory is not None and step == self.stop:
      jax.block_until_ready(outputs)
      try:
        jax.profiler.stop_trace()
      except jax.errors.JaxRuntimeError as error:  # The run goes on: a trace is not worth it.
        self.log(f"warning: the profile of steps {self.start}-{self.stop} was not written "
                 f"to {self.directory}: {error}")
        return
      self.log(f"profiled steps {self.start}-{self.stop} into {self.directory}")


class Monitor:
  """Per-step records to JSONL and TensorBoard, and a progress line; a summary at the end.

  Example:
    >>> monitor = Monitor(total_steps=100, tokens_per_step=16384, flops_per_token=6.6e9,
    ...                   peak_flops=989e12, pinned_host_bytes=2**30, log=print)
    >>> monitor.record(step=1, loss=10.8, step_s=0.31, learning_rate=3e-4, grad_norm=2.5)
  """

  def __init__(self, *, total_steps: int, tokens_per_step: int, flops_per_token: float,
               peak_flops: Optional[float], pinned_host_bytes: int,
               log: Callable[[str], None] = print, log_interval: int = 0,
               jsonl: Optional[TextIO] = None, tensorboard: Optional[TensorBoard] = None,
               live: bool = False, progress_bar: bool = True,
               peak_device_bytes: Callable[[], Optional[int]] = lambda: None,
               host_rss_bytes: Callable[[], Optional[int]] = lambda: None):
    self.total_steps = total_steps
    self.tokens_per_step = tokens_per_step
    self.flops_per_token = flops_per_token
    self.peak_flops = peak_flops
    self.pinned_host_bytes = pinned_host_bytes
    self.log = log
    self.log_interval = log_interval or max(1, total_steps // 10)
    self.jsonl = jsonl
    self.tensorboard = tensorboard
    self.live = live  # Redraw one line in place (on a terminal) instead of logging lines.
    self.progress_bar = progress_bar
    self.peak_device_bytes = peak_device_bytes
    self.host_rss_bytes = host_rss_bytes
    self.records: list[StepRecord] = []

  def record(self, *, step: int, loss: float, step_s: float, learning_rate: float,
             grad_norm: float, eval_loss: Optional[float] = None) -> StepRecord:
    """Notes a finished step; writes its records and, when due, the progress line."""
    tokens_per_s = self.tokens_per_step / step_s
    mfu = (tokens_per_s * self.flops_per_token / self.peak_flops) if self.peak_flops else None
    record = StepRecord(step, loss, step_s, tokens_per_s, mfu, learning_rate, grad_norm,
                        self.peak_device_bytes(), self.pinned_host_bytes, self.host_rss_bytes(),
                        eval_loss, None if eval_loss is None else _perplexity(eval_loss))
    self.records.append(record)
    if self.jsonl is not None:
      self._write_jsonl(record)
    if self.tensorboard is not None:
      self.tensorboard.write(record)
    due = (len(self.records) == 1 or step % self.log_interval == 0 or step == self.total_steps
           or eval_loss is not None)
    if self.live:
      end = "\n" if step == self.total_steps or eval_loss is not None else ""
      print("\r" + self._line(record), end=end, flush=True)
    elif due:
      self.log(self._line(record))
    return record

  def _write_jsonl(self, record: StepRecord) -> None:
    """Appends ``record`` to the JSONL file; where that fails (a full disk), says so once and
    writes no more: the run is worth more than its log."""
    try:
      self.jsonl.write(json.dumps(dataclasses.asdict(record)) + "\n")
      self.jsonl.flush()
    except OSError as error:
      self.log(f"warning: logging.jsonl {self.jsonl.name!r} could not be written at step "
               f"{record.step} ({error.strerror}); the run goes on without it")
      with contextlib.suppress(OSError):  # Closed even so, its unwritten line let go.
        self.jsonl.close()
      self.jsonl = None

  def close(self) -> None:
    """Closes the JSONL file and the TensorBoard writer."""
    if self.jsonl is not None:
      self.jsonl.close()
    if self.tensorboard is not None:
      self.tensorboard.close()

  def _line(self, r: StepRecord) -> str:
    done = r.step / self.total_steps
    filled = int(20 * done)
    bar = f"[{'#' * filled}{'.' * (20 - filled)}] " if self.progress_bar else ""
    held_out = (f"eval {r.eval_loss:.4f} (ppl {r.eval_perplexity:,.2f})  "
                if r.eval_loss is not None else "")
    return (f"{bar}step {r.step}/{self.total_steps}  loss {r.loss:.4f}  {held_out}"
            f"{r.step_s * 1e3:.1f} ms  {r.tokens_per_s:,.0f} tok/s  "
            + (f"MFU {100 * r.mfu:.1f}%  " if r.mfu is not None else "")
            + _memory(r.peak_device_bytes, r.pinned_host_bytes, r.host_rss_bytes))

  def summary(self) -> str:
    """The run's median step time, tokens/s, MFU, memory and losses, as one line."""
    if not self.records:
      return "no steps run"
    rs = self.records
    median_s = statistics.median(r.step_s for r in rs)
    tokens_per_s = self.tokens_per_step / median_s
    mfu = (f"  MFU {100 * tokens_per_s * self.flops_per_token / self.peak_flops:.1f}%"
           if self.peak_flops else "")
    evaluated = [r for r in rs if r.eval_loss is not None]
    held_out = (f"; eval loss {evaluated[-1].eval_loss:.4f} (ppl "
                f"{evaluated[-1].eval_perplexity:,.2f})" if evaluated else "")
    return (f"{len(rs)} steps: loss {rs[0].loss:.4f} -> {rs[-1].loss:.4f}{held_out}; median "
            f"step {median_s * 1e3:.1f} ms, {tokens_per_s:,.0f} tok/s{mfu}; "
            + _memory(rs[-1].peak_device_bytes, rs[-1].pinned_host_bytes,
                      rs[-1].host_rss_bytes))


def _perplexity(loss: float) -> float:
  return math.exp(loss) if loss < 700 else math.inf


def _memory(peak_device: Optional[int], pinned_host: int, host_rss: Optional[int]) -> str:
  device = f"peak device {_size(peak_device)}  " if peak_device else ""
  rss = f"  host RSS {_size(host_rss)}" if host_rss else ""
  return device + f"pinned host {_size(pinned_host)}" + rss


def _size(num_bytes: int) -> str:
  """Bytes in GiB to two places, or below 0.01 GiB in the largest unit that keeps them
  nonzero (small models offload a few MiB, which GiB would print as 0.00)."""
  for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if num_bytes == 0 or num_bytes >= scale // 100:
      return f"{num_bytes / scale:.2f} {unit}"
  return f"{num_bytes} B"
