"""Run reports: FLOPs per token against a count of the model's weights, MFU, and the JSONL record."""

import io
import json

import jax
import jax.numpy as jnp
import pytest

from jaxoffload.model import Llama, LlamaConfig
from jaxoffload.params import init_params
from jaxoffload.train import metrics


@pytest.mark.parametrize("config", [
    LlamaConfig(), LlamaConfig(share_embeddings_and_output_weights=True, num_query_groups=4)])
def test_flops_per_token_counts_every_matmul_weight(config):
  tokens = jnp.zeros((1, 16), jnp.int32)
  params = init_params(Llama(config), jax.random.PRNGKey(0), tokens)
  kernels = sum(x.size for path, x in jax.tree_util.tree_leaves_with_path(params)
                if "kernel" in jax.tree_util.keystr(path))
  head = config.vocab_size * config.hidden_size if config.share_embeddings_and_output_weights else 0
  causal_attention = 6 * config.num_layers * 16 * config.num_attention_heads * config.head_dim
  assert metrics.flops_per_token(config, 16) == 6 * (kernels + head) + causal_attention


def test_records_carry_mfu_and_memory_and_go_to_jsonl():
  out, lines = io.StringIO(), []
  meter = metrics.Monitor(total_steps=4, tokens_per_step=1000, flops_per_token=2e9,
                          peak_flops=1e13, pinned_host_bytes=3 * 2**30, log=lines.append,
                          log_interval=2, jsonl=out, peak_device_bytes=lambda: 5 * 2**30)
  for step, seconds in enumerate([0.5, 0.4, 0.4, 0.4], start=1):
    meter.record(step=step, loss=4.0 / step, step_s=seconds)
  records = [json.loads(line) for line in out.getvalue().splitlines()]
  assert [r["step"] for r in records] == [1, 2, 3, 4]
  assert records[1]["tokens_per_s"] == pytest.approx(2500)
  assert records[1]["mfu"] == pytest.approx(2500 * 2e9 / 1e13)
  assert records[1]["peak_device_bytes"] == 5 * 2**30
  assert records[1]["pinned_host_bytes"] == 3 * 2**30
  assert len(lines) == 3  # Steps 1, 2 and 4.
  assert "MFU 50.0%" in lines[1] and "pinned host 3.00 GiB" in lines[1]
  assert meter.summary().startswith("4 steps: loss 4.0000 -> 1.0000; median step 400.0 ms")


def test_unknown_devices_get_no_mfu():
  assert metrics.peak_flops(jax.devices("cpu")[0], jnp.bfloat16) is None
