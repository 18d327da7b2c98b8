"""Tiny random Hugging Face checkpoints for the model / hf tests (built with transformers itself)."""

from __future__ import annotations

import numpy as np

TINY = dict(vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)


def make_hf_model(arch: str, *, tied: bool = False, seed: int = 0, **overrides):
  """A float32 transformers model with random weights (biases and norms randomised too).

  Skips the calling test when PyTorch is absent (a dev extra: ``pip install -e ".[dev]"``)."""
  import pytest
  torch = pytest.importorskip("torch", reason="PyTorch (a dev extra) builds the reference checkpoints")
  import transformers as tf
  kw = dict(TINY, tie_word_embeddings=tied, rms_norm_eps=1e-5, **overrides)
  if arch == "qwen2":
    cfg = tf.Qwen2Config(rope_theta=10000.0 * 3, **kw)
    cls = tf.Qwen2ForCausalLM
  elif arch == "qwen3":
    cfg = tf.Qwen3Config(head_dim=16, rope_theta=1e6, **kw)
    cls = tf.Qwen3ForCausalLM
  elif arch == "llama":
    cfg = tf.LlamaConfig(rope_theta=500000.0, max_position_embeddings=4096,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                         **kw)
    cls = tf.LlamaForCausalLM
  else:
    raise ValueError(arch)
  torch.manual_seed(seed)
  model = cls(cfg).float().eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(1.0 + 0.1 * torch.randn_like(p))
      elif name.endswith("bias"):
        p.copy_(0.1 * torch.randn_like(p))
      else:
        p.copy_(0.08 * torch.randn_like(p))
  return model


def left_padded_batch(vocab: int, seed: int = 0):
  """tokens int32 [3, 12] and mask [3, 12]: rows with 0, 3 and 7 left pads."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, vocab, size=(3, 12)).astype(np.int32)
  mask = np.ones((3, 12), np.int32)
  mask[1, :3] = 0
  mask[2, :7] = 0
  tokens[mask == 0] = 0
  return tokens, mask


def torch_logits(model, tokens, mask):
  import torch
  pos = np.maximum(np.cumsum(mask, -1) - 1, 0)
  with torch.no_grad():
    out = model(input_ids=torch.tensor(tokens, dtype=torch.long),
                attention_mask=torch.tensor(mask, dtype=torch.long),
                position_ids=torch.tensor(pos, dtype=torch.long))
  return out.logits.float().numpy()


def decode_all(cfg, base, tokens, mask, n_prefill, cache_dtype=None, compiler_options=None, **kw):
  """Prefill ``n_prefill`` tokens into a KV cache, then decode the rest one at a time.

  ``compiler_options`` go to ``jax.jit`` (e.g. ``{"xla_allow_excess_precision": False}``: every bf16 value
  rounded where the program says, so that two structurally different programs can agree bit for bit).

  Returns (logits ``[B, T, V]`` of every position, the final cache); ``kw`` goes to ``models.forward``.
  """
  import jax
  import jax.numpy as jnp
  from qerl_jax import models
  b, t = tokens.shape
  pos = models.positions_from_mask(mask)
  cache = models.init_cache(cfg, b, t + 3, dtype=cache_dtype or jnp.float32)
  step = jax.jit(lambda c, tok, p, mk: models.forward(cfg, base, tok, p, attn_mask=mk, cache=c, **kw),
                 compiler_options=compiler_options)
  out, cache = step(cache, tokens[:, :n_prefill], pos[:, :n_prefill], mask[:, :n_prefill])
  outs = [out]
  for i in range(n_prefill, t):
    out, cache = step(cache, tokens[:, i:i + 1], pos[:, i:i + 1], mask[:, i:i + 1])
    outs.append(out)
  assert int(cache["index"]) == t
  return jnp.concatenate(outs, axis=1), cache


def assert_same_as_on_cpu(actual, desired):
  """``actual == desired`` bit for bit when JAX runs on the CPU (as in CI). On a GPU two XLA programs
  that round the same values to bf16 may differ by one bf16 step (2**-8 relative): XLA's excess
  precision keeps float32 where one of them would round, and fuses them differently. There the
  arrays must agree to that step, relative to the largest magnitude."""
  import jax
  actual, desired = np.asarray(actual, np.float64), np.asarray(desired, np.float64)
  if jax.default_backend() == "cpu":
    np.testing.assert_array_equal(actual, desired)
  else:
    np.testing.assert_allclose(actual, desired, rtol=2.0 ** -7, atol=2.0 ** -7 * np.abs(desired).max())
