"""Tests for qerl_jax.sampling: filters on hand-made distributions, end-of-sequence masks, buckets."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qerl_jax import sampling
from qerl_jax.sampling import SamplingConfig


def _log_softmax64(x):
  x = np.asarray(x, np.float64)
  m = x.max(-1, keepdims=True)
  return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


# A hand-made distribution, deliberately not in sorted order.
PROBS = np.array([0.15, 0.05, 0.5, 0.1, 0.2])
LOGITS = np.log(PROBS).astype(np.float32)


def _renormalised(keep):
  p = np.where(keep, PROBS, 0.0)
  with np.errstate(divide="ignore"):
    return np.log(p / p.sum())


@pytest.mark.parametrize("top_p, kept", [
    (0.45, [2]),  # 0.5 alone reaches 0.45
    (0.6, [2, 4]),  # 0.5 < 0.6, so 0.2 is needed
    (0.75, [2, 4, 0]),  # 0.5 + 0.2 = 0.7 < 0.75, so 0.15 is needed
    (0.9, [2, 4, 0, 3]),  # 0.85 < 0.9
    (1.0, [0, 1, 2, 3, 4]),
])
def test_top_p_keeps_smallest_set_reaching_p(top_p, kept):
  lp = np.asarray(sampling.sampling_logprobs(jnp.asarray(LOGITS), temperature=1.0, top_p=top_p))
  keep = np.zeros(5, bool)
  keep[kept] = True
  np.testing.assert_array_equal(np.isfinite(lp), keep)
  np.testing.assert_allclose(lp[keep], _renormalised(keep)[keep], atol=1e-6)


def test_top_k_then_top_p_and_temperature():
  # top-k 3 keeps {0.5, 0.2, 0.15}; temperature 0.5 squares and renormalises.
  lp = np.asarray(sampling.sampling_logprobs(jnp.asarray(LOGITS), temperature=0.5, top_k=3))
  keep = np.array([1, 0, 1, 0, 1], bool)
  q = np.where(keep, PROBS**2, 0.0)
  np.testing.assert_array_equal(np.isfinite(lp), keep)
  np.testing.assert_allclose(lp[keep], np.log(q[keep] / q.sum()), atol=1e-6)
  # top-k 3 then top-p 0.75 over the renormalised top-3 at T=1: {0.5/0.85, 0.2/0.85} = 0.82 >= 0.75.
  lp2 = np.asarray(sampling.sampling_logprobs(jnp.asarray(LOGITS), temperature=1.0, top_k=3, top_p=0.75))
  np.testing.assert_array_equal(np.isfinite(lp2), [False, False, True, False, True])


def test_temperature_matches_float64():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(3, 11)).astype(np.float32) * 3
  for t in (0.3, 1.0, 1.7):
    lp = sampling.sampling_logprobs(jnp.asarray(logits), temperature=t)
    np.testing.assert_allclose(np.asarray(lp), _log_softmax64(logits / t), atol=1e-5)


def test_sample_tokens_greedy_top_k1_and_frequencies():
  rng = np.random.default_rng(1)
  logits = jnp.asarray(rng.normal(size=(4, 50)).astype(np.float32))
  tok, slp, plp = sampling.sample_tokens(jax.random.key(0), logits, temperature=0.0)
  np.testing.assert_array_equal(np.asarray(tok), np.argmax(np.asarray(logits), -1))
  np.testing.assert_array_equal(np.asarray(slp), 0.0)
  ref = _log_softmax64(np.asarray(logits))
  np.testing.assert_allclose(np.asarray(plp), ref[np.arange(4), np.asarray(tok)], atol=1e-6)
  keys = jax.random.split(jax.random.key(3), 4)
  tok1, slp1, _ = sampling.sample_tokens(keys, logits, temperature=1.3, top_k=1)
  np.testing.assert_array_equal(np.asarray(tok1), np.asarray(tok))
  np.testing.assert_allclose(np.asarray(slp1), 0.0, atol=1e-6)

  # Empirical frequencies of 4000 per-row draws from the top-p 0.75 set {0.5, 0.2, 0.15} / 0.85.
  n = 4000
  keys = jax.random.split(jax.random.key(7), n)
  toks, slp, plp = sampling.sample_tokens(keys, jnp.broadcast_to(jnp.asarray(LOGITS), (n, 5)), temperature=1.0, top_p=0.75)
  counts = np.bincount(np.asarray(toks), minlength=5) / n
  np.testing.assert_allclose(counts, [0.15 / 0.85, 0, 0.5 / 0.85, 0, 0.2 / 0.85], atol=0.03)
  np.testing.assert_allclose(np.asarray(slp), np.log(PROBS[np.asarray(toks)] / 0.85), atol=1e-5)
  np.testing.assert_allclose(np.asarray(plp), np.log(PROBS[np.asarray(toks)]), atol=1e-5)


def test_sample_tokens_fixed_key_reproducible():
  logits = jnp.asarray(np.random.default_rng(2).normal(size=(8, 100)).astype(np.float32))
  a = sampling.sample_tokens(jax.random.key(5), logits, temperature=0.9, top_p=0.9)
  b = sampling.sample_tokens(jax.random.key(5), logits, temperature=0.9, top_p=0.9)
  c = sampling.sample_tokens(jax.random.key(6), logits, temperature=0.9, top_p=0.9)
  np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(b[0]))
  assert not np.array_equal(np.asarray(a[0]), np.asarray(c[0]))


def test_forbid_tokens():
  logits = jnp.zeros((2, 6))
  out = np.asarray(sampling.forbid_tokens(logits, (1, 4, 99), jnp.array([True, False])))
  assert np.isneginf(out[0, [1, 4]]).all() and np.isfinite(out[0, [0, 2, 3, 5]]).all()
  assert np.isfinite(out[1]).all()


def test_completion_mask_end_at_2_of_5_and_truncated():
  eos, pad = (7, 9), 9  # pad id is also an end id, as in Qwen
  tokens = np.array([
      [3, 4, 7, 5, 6],  # ends at position 2
      [3, 4, 5, 6, 1],  # never ends
      [9, 9, 9, 9, 9],  # ends at position 0 on the pad/eos id
  ])
  out, mask, lengths, finished = sampling.completion_mask(jnp.asarray(tokens), eos, pad)
  np.testing.assert_array_equal(np.asarray(mask), [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
  np.testing.assert_array_equal(np.asarray(out), [[3, 4, 7, 9, 9], [3, 4, 5, 6, 1], [9, 9, 9, 9, 9]])
  np.testing.assert_array_equal(np.asarray(lengths), [3, 5, 1])
  np.testing.assert_array_equal(np.asarray(finished), [True, False, True])


def test_buckets_and_padding():
  assert [sampling.bucket(n) for n in (1, 2, 3, 5, 64, 65)] == [1, 2, 4, 8, 64, 128]
  assert sampling.bucket(3, minimum=16) == 16
  with pytest.raises(ValueError):
    sampling.bucket(0)
  toks = np.array([[0, 5, 6], [1, 2, 3]])
  mask = np.array([[0, 1, 1], [1, 1, 1]])
  pt, pm = sampling.pad_prompts(toks, mask, 4, 5, pad_id=9)
  np.testing.assert_array_equal(pt, [[9, 9, 0, 5, 6], [9, 9, 1, 2, 3], [9] * 5, [9] * 5])
  np.testing.assert_array_equal(pm, [[0, 0, 0, 1, 1], [0, 0, 1, 1, 1], [0, 0, 0, 0, 1], [0, 0, 0, 0, 1]])
  np.testing.assert_array_equal(np.asarray(sampling.positions_from_mask(jnp.asarray(pm[:2]))),
                                [[0, 0, 0, 0, 1], [0, 0, 0, 1, 2]])


def test_validation_errors():
  ok = np.ones((2, 3), np.int32)
  with pytest.raises(ValueError, match="not left-padded"):
    sampling.validate_prompts(ok, np.array([[1, 1, 0], [1, 1, 1]]))
  with pytest.raises(ValueError, match="no tokens"):
    sampling.validate_prompts(ok, np.array([[0, 0, 0], [1, 1, 1]]))
  with pytest.raises(ValueError, match="shape"):
    sampling.validate_prompts(ok, np.ones((2, 4)))
  with pytest.raises(ValueError, match="eos_token_ids"):
    SamplingConfig(max_new_tokens=4, eos_token_ids=(), pad_id=0)
  with pytest.raises(ValueError, match="top_p"):
    SamplingConfig(max_new_tokens=4, eos_token_ids=(1,), pad_id=0, top_p=0.0)
  with pytest.raises(ValueError, match="temperature"):
    SamplingConfig(max_new_tokens=4, eos_token_ids=(1,), pad_id=0, temperature=-1.0)
  with pytest.raises(ValueError, match="min_new_tokens"):
    SamplingConfig(max_new_tokens=4, eos_token_ids=(1,), pad_id=0, min_new_tokens=5)
  cfg = SamplingConfig(max_new_tokens=4, eos_token_ids=[1, 2], stop_token_ids=[2, 3], pad_id=0)
  assert cfg.end_ids == (1, 2, 3) and hash(cfg) == hash(SamplingConfig(max_new_tokens=4, eos_token_ids=(1, 2),
                                                                          stop_token_ids=(2, 3), pad_id=0))
