"""Decode attention over a stacked KV cache read in place: interpret-mode kernel vs a float64 numpy product."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import decode_attention as da
from qerl_jax import models
from tests._model_utils import decode_all, left_padded_batch


def _np_attention(q, k, v, layer, mask, length):
  """float64: q [B, H, D], k/v [L, B, S, K, D] -> [B, H, D] over slots s < length with mask[b, s]."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  b, h, d = q.shape
  kh = k.shape[3]
  out = np.zeros((b, h, d))
  for r in range(b):
    valid = np.flatnonzero(np.asarray(mask[r]).astype(bool) & (np.arange(k.shape[2]) < length))
    for head in range(h):
      kv = head // (h // kh)
      sc = k[layer, r, valid, kv] @ q[r, head] / np.sqrt(d)
      p = np.exp(sc - sc.max())
      out[r, head] = (p / p.sum()) @ v[layer, r, valid, kv]
  return out


def _case(seed, *, layers=3, batch=3, slots=70, kv_heads=2, group=7, dim=32):
  rng = np.random.default_rng(seed)
  k = rng.standard_normal((layers, batch, slots, kv_heads, dim)).astype(np.float32)
  v = rng.standard_normal((layers, batch, slots, kv_heads, dim)).astype(np.float32)
  q = rng.standard_normal((batch, kv_heads * group, dim)).astype(np.float32)
  mask = np.ones((batch, slots), bool)
  mask[0, :5] = False   # left padding
  mask[-1, :20] = False
  mask[1 % batch, 33] = False  # a hole
  return q, k, v, mask


def _rel(out, ref):
  out = np.asarray(out, np.float64)
  return np.linalg.norm(out - ref) / np.linalg.norm(ref)


@pytest.mark.parametrize("length,layer,splits,block_s", [(41, 1, None, 16), (70, 2, 3, 16), (21, 0, 2, 32),
                                                         (64, 1, 1, 16), (1 + 20, 2, 5, 16)])
def test_kernel_matches_float64(length, layer, splits, block_s):
  q, k, v, mask = _case(length)
  ref = _np_attention(q, k, v, layer, mask, length)
  args = (jnp.asarray(q, jnp.bfloat16), jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16))
  # the bf16 inputs are what both sides see
  ref16 = _np_attention(*(np.asarray(a, np.float32) for a in args), layer, mask, length)
  out = da.decode_attention(*args, layer, jnp.asarray(mask), length, backend="interpret", block_s=block_s,
                            splits=splits)
  assert out.shape == q.shape and out.dtype == jnp.bfloat16
  assert np.isfinite(np.asarray(out, np.float32)).all()
  assert _rel(out, ref16) < 1e-2
  assert _rel(out, ref) < 2e-2
  xla = da.decode_attention(*args, layer, jnp.asarray(mask), length, backend="reference")
  assert _rel(xla, ref16) < 1e-2


def test_float32_kernel_and_traced_layer_and_length():
  q, k, v, mask = _case(7, group=4)
  f = jax.jit(lambda li, n: da.decode_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), li,
                                                jnp.asarray(mask), n, backend="interpret", block_s=16))
  for layer, length in [(0, 30), (2, 70), (1, 23)]:
    out = f(jnp.int32(layer), jnp.int32(length))
    np.testing.assert_allclose(np.asarray(out), _np_attention(q, k, v, layer, mask, length), rtol=2e-5, atol=2e-5)
  # an out-of-range layer is clamped to the stack (inside the kernel), as lax.dynamic_index_in_dim does
  for layer, clamped in [(5, 2), (-1, 0)]:
    np.testing.assert_allclose(np.asarray(f(jnp.int32(layer), jnp.int32(40))),
                               _np_attention(q, k, v, clamped, mask, 40), rtol=2e-5, atol=2e-5)


def test_slots_at_and_after_length_are_never_read():
  q, k, v, mask = _case(3)
  length = 37
  k[:, :, length:] = np.nan
  v[:, :, length:] = np.nan
  mask[:, length:] = True  # even when marked valid: the length bound alone excludes them
  out = da.decode_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), 1, jnp.asarray(mask), length,
                            backend="interpret", block_s=16, splits=2)
  assert np.isfinite(np.asarray(out)).all()
  np.testing.assert_allclose(np.asarray(out), _np_attention(q, k, v, 1, mask, length), rtol=2e-5, atol=2e-5)


def test_errors_name_the_problem():
  q, k, v, mask = (jnp.asarray(a) for a in _case(0))
  with pytest.raises(ValueError, match="backend"):
    da.decode_attention(q, k, v, 0, mask, 10, backend="cuda")
  with pytest.raises(ValueError, match="multiple"):
    da.decode_attention(q[:, :13], k, v, 0, mask, 10)
  with pytest.raises(ValueError, match="slot_mask"):
    da.decode_attention(q, k, v, 0, mask[:, :10], 10)
  with pytest.raises(ValueError, match="block_s"):
    da.decode_attention(q, k, v, 0, mask, 10, block_s=24)
  with pytest.raises(ValueError, match=r"\[L, B, S, Hkv, hd\]"):
    da.decode_attention(q, k[0], v[0], 0, mask, 10)


def test_decoder_decode_steps_through_the_kernel(monkeypatch):
  """Prefill, then decode one token at a time with the kernel (interpret mode) == one full forward."""
  monkeypatch.setattr(da, "auto_backend", lambda dtype: "interpret")
  cfg = models.ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=16, dtype="float32")
  base = models.init_params(cfg, jax.random.key(0), dtype=jnp.float32, std=0.1)
  tokens, mask = (jnp.asarray(a) for a in left_padded_batch(cfg.vocab_size, seed=5))
  full, _ = models.forward(cfg, base, tokens, models.positions_from_mask(mask), attn_mask=mask)
  stepped, _ = decode_all(cfg, base, tokens, mask, n_prefill=6)
  real = np.asarray(mask).astype(bool)
  assert np.abs(np.asarray(stepped) - np.asarray(full))[real].max() < 1e-4


@pytest.mark.gpu
def test_gpu_kernel_matches_reference_at_7b_shape():
  rng = np.random.default_rng(0)
  layers, b, s, kh, g, d = 3, 8, 2304, 4, 7, 128
  k = jnp.asarray(rng.standard_normal((layers, b, s, kh, d)), jnp.bfloat16)
  v = jnp.asarray(rng.standard_normal((layers, b, s, kh, d)), jnp.bfloat16)
  q = jnp.asarray(rng.standard_normal((b, kh * g, d)), jnp.bfloat16)
  mask = np.ones((b, s), bool)
  mask[1, :100] = False
  for length in (1, 257, 1000, s):
    out = da.decode_attention(q, k, v, 2, jnp.asarray(mask), length, backend="pallas")
    ref = da.reference(q, k, v, 2, jnp.asarray(mask), length)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert _rel(out, np.asarray(ref, np.float64)) < 1e-2
