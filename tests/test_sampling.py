"""Tests for qerl_jax.sampling: filters on hand-made distributions, end-of-sequence masks, buckets."""

import re

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


def test_top_p_after_top_k_measures_the_mass_over_the_tied_top_k_set():
  """HF's and vLLM's top-k keep every logit tied with the k-th, and top-p then takes its softmax over that set.
  Logits [2, 1, 1, 1, 0], k = 2: the top-k set is {0, 1, 2, 3} (probabilities .475, .175 x 3); token 0 alone
  holds .475 < .6, so top-p 0.6 needs a second token (and keeps its ties). The mass was taken over the k values
  lax.top_k returns, .731 for token 0, and top-p kept token 0 alone."""
  x = np.array([2.0, 1, 1, 1, 0])
  lp = np.asarray(sampling.sampling_logprobs(jnp.asarray(x, jnp.float32), temperature=1.0, top_k=2, top_p=0.6))
  keep = np.array([True, True, True, True, False])
  np.testing.assert_array_equal(np.isfinite(lp), keep)
  np.testing.assert_allclose(lp[keep], x[keep] - np.log(np.exp(x[keep]).sum()), atol=1e-6)
  # p = 0.45: token 0's .475 reaches it alone
  lp = np.asarray(sampling.sampling_logprobs(jnp.asarray(x, jnp.float32), temperature=1.0, top_k=2, top_p=0.45))
  np.testing.assert_array_equal(np.isfinite(lp), [True, False, False, False, False])


def test_temperature_matches_float64():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(3, 11)).astype(np.float32) * 3
  for t in (0.3, 1.0, 1.7):
    lp = sampling.sampling_logprobs(jnp.asarray(logits), temperature=t)
    np.testing.assert_allclose(np.asarray(lp), _log_softmax64(logits / t), atol=1e-5)


def test_tiny_temperature_is_finite():
  """At temperature 1e-37, logits / T overflowed float32 to inf (100 / 1e-37) and log_softmax gave NaN
  (inf - inf). The distribution is then a point mass on the largest logit: log-prob 0 there, -inf or a huge
  negative number elsewhere (hand-worked), and sampling returns that token with log-prob 0. A temperature
  below float32's smallest normal number (it would flush to 0) is rejected."""
  logits = jnp.asarray([[2.0, 100.0, -5.0, 99.5], [-1.0, -3.0, 0.5, 0.25]], jnp.float32)
  lp = np.asarray(sampling.sampling_logprobs(logits, temperature=1e-37))
  assert not np.isnan(lp).any()
  np.testing.assert_array_equal(np.argmax(lp, axis=-1), [1, 2])
  np.testing.assert_array_equal(lp[[0, 1], [1, 2]], [0.0, 0.0])
  assert (np.delete(lp[0], 1) < -1e30).all() and (np.delete(lp[1], 2) < -1e30).all()
  tok, slp, _ = sampling.sample_tokens(jax.random.key(0), logits, temperature=1e-37)
  np.testing.assert_array_equal(np.asarray(tok), [1, 2])
  np.testing.assert_array_equal(np.asarray(slp), [0.0, 0.0])
  with pytest.raises(ValueError, match="temperature"):
    sampling.sampling_logprobs(logits, temperature=1e-39)
  with pytest.raises(ValueError, match="temperature"):
    SamplingConfig(max_new_tokens=4, eos_token_ids=(1,), pad_id=0, temperature=1e-39)


_sample = jax.jit(sampling.sample_tokens, static_argnames=("temperature", "top_k", "top_p"))


@pytest.mark.parametrize("inverse_cdf", [1, 0])
def test_sample_tokens_greedy_top_k1_and_frequencies(inverse_cdf, monkeypatch):
  monkeypatch.setattr(sampling, "INVERSE_CDF", inverse_cdf)  # read at trace time: a fresh jit below
  _sample = jax.jit(sampling.sample_tokens, static_argnames=("temperature", "top_k", "top_p"))
  rng = np.random.default_rng(1)
  logits = jnp.asarray(rng.normal(size=(4, 50)).astype(np.float32))
  tok, slp, plp = _sample(jax.random.key(0), logits, temperature=0.0)
  np.testing.assert_array_equal(np.asarray(tok), np.argmax(np.asarray(logits), -1))
  np.testing.assert_array_equal(np.asarray(slp), 0.0)
  ref = _log_softmax64(np.asarray(logits))
  np.testing.assert_allclose(np.asarray(plp), ref[np.arange(4), np.asarray(tok)], atol=1e-6)
  keys = jax.random.split(jax.random.key(3), 4)
  tok1, slp1, _ = _sample(keys, logits, temperature=1.3, top_k=1)
  np.testing.assert_array_equal(np.asarray(tok1), np.asarray(tok))
  np.testing.assert_allclose(np.asarray(slp1), 0.0, atol=1e-6)

  # Empirical frequencies of 4000 per-row draws at temperature 1, unfiltered (sampling = policy distribution).
  n = 4000
  keys = jax.random.split(jax.random.key(9), n)
  toks, slp, plp = _sample(keys, jnp.broadcast_to(jnp.asarray(LOGITS), (n, 5)), temperature=1.0)
  np.testing.assert_allclose(np.bincount(np.asarray(toks), minlength=5) / n, PROBS, atol=0.03)
  np.testing.assert_allclose(np.asarray(slp), np.log(PROBS[np.asarray(toks)]), atol=1e-5)
  np.testing.assert_allclose(np.asarray(plp), np.asarray(slp), atol=1e-6)

  # Empirical frequencies of 4000 per-row draws from the top-p 0.75 set {0.5, 0.2, 0.15} / 0.85.
  keys = jax.random.split(jax.random.key(7), n)
  toks, slp, plp = _sample(keys, jnp.broadcast_to(jnp.asarray(LOGITS), (n, 5)), temperature=1.0, top_p=0.75)
  counts = np.bincount(np.asarray(toks), minlength=5) / n
  np.testing.assert_allclose(counts, [0.15 / 0.85, 0, 0.5 / 0.85, 0, 0.2 / 0.85], atol=0.03)
  np.testing.assert_allclose(np.asarray(slp), np.log(PROBS[np.asarray(toks)] / 0.85), atol=1e-5)
  np.testing.assert_allclose(np.asarray(plp), np.log(PROBS[np.asarray(toks)]), atol=1e-5)


# Weights over 23 tokens with zeros inside and at the end, and mass on both sides of chunk edges (4 chunks of 6,
# one padded slot).
DRAW_P = np.array([0, 0.1, 0, 0, 0, 0.05, 0.2, 0, 0, 0, 0, 0.15, 0, 0.3, 0, 0, 0, 0, 0.12, 0.08, 0, 0, 0])


@pytest.mark.parametrize("batched_keys", [True, False])
def test_draw_by_inverse_cdf_frequencies_and_lse(batched_keys):
  """20000 draws from DRAW_P / 2 (unnormalised: every weight halved, so lse = log 0.5): frequencies within 4 standard
  deviations (at most 0.0035 here, so 0.015), zero-weight tokens never drawn, lse against float64."""
  assert sampling._draw_chunks(23) == 4  # sqrt(23) -> 4 chunks of ceil(23 / 4) = 6
  n = 20000
  with np.errstate(divide="ignore"):
    logw = jnp.asarray(np.log(DRAW_P / 2), jnp.float32)
  key = jax.random.split(jax.random.key(11), n) if batched_keys else jax.random.key(11)
  tok, lse = jax.jit(sampling.draw_by_inverse_cdf)(key, jnp.broadcast_to(logw, (n, 23)))
  assert tok.dtype == jnp.int32 and tok.shape == (n,) and lse.shape == (n,)
  counts = np.bincount(np.asarray(tok), minlength=23)
  assert counts.size == 23 and counts[DRAW_P == 0].sum() == 0
  np.testing.assert_allclose(counts / n, DRAW_P, atol=0.015)
  np.testing.assert_allclose(np.asarray(lse), np.log(0.5), atol=1e-6)


def test_draw_by_inverse_cdf_edges(monkeypatch):
  """A row of -inf draws token 0 with lse -inf (no NaN); u just below 1, whose product with the total can round up
  to the total, draws the last token with weight (19), not a later zero or the padded slot;
  u = 0 draws the first token with weight (1); a leading batch shape is kept."""
  with np.errstate(divide="ignore"):
    logw = jnp.asarray(np.log(DRAW_P), jnp.float32)
  tok, lse = sampling.draw_by_inverse_cdf(jax.random.key(0), jnp.full((2, 3, 23), -jnp.inf))
  assert tok.shape == (2, 3) and (np.asarray(tok) == 0).all() and np.isneginf(np.asarray(lse)).all()
  for u, want in ((np.float32(1) - np.float32(2.0 ** -24), 19), (np.float32(0), 1)):
    monkeypatch.setattr(sampling.jax.random, "uniform", lambda key, shape=(), dtype=jnp.float32, u=u: jnp.full(shape, u, dtype))
    tok, _ = sampling.draw_by_inverse_cdf(jax.random.key(0), logw[None])
    assert int(tok[0]) == want


def test_sample_tokens_fixed_key_reproducible():
  logits = jnp.asarray(np.random.default_rng(2).normal(size=(8, 100)).astype(np.float32))
  a = _sample(jax.random.key(5), logits, temperature=0.9, top_p=0.9)
  b = _sample(jax.random.key(5), logits, temperature=0.9, top_p=0.9)
  c = _sample(jax.random.key(6), logits, temperature=0.9, top_p=0.9)
  np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(b[0]))
  assert not np.array_equal(np.asarray(a[0]), np.asarray(c[0]))
  raw = _sample(jax.random.split(jax.random.PRNGKey(5), 8), logits, temperature=0.9, top_p=0.9)  # raw uint32 keys
  assert raw[0].shape == (8,) and np.isfinite(np.asarray(raw[1])).all()


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


def test_validation_errors():
  ok = np.ones((2, 3), np.int32)
  with pytest.raises(ValueError, match="not left-padded"):
    sampling.validate_prompts(ok, np.array([[1, 1, 0], [1, 1, 1]]))
  with pytest.raises(ValueError, match="not left-padded"):
    sampling.validate_prompts(ok, np.array([[True, True, False], [True, True, True]]))
  with pytest.raises(ValueError, match="no tokens"):
    sampling.validate_prompts(ok, np.array([[0, 0, 0], [1, 1, 1]]))
  with pytest.raises(ValueError, match="shape"):
    sampling.validate_prompts(ok, np.ones((2, 4)))
  with pytest.raises(ValueError, match="no prompts"):  # used to surface as "bucket: size must be >= 1"
    sampling.validate_prompts(np.ones((0, 3), np.int32), np.ones((0, 3), np.int32))
  # ids beyond the embedding table read NaN (600 of 512: NaN log-probs), negative ones wrap around; padding too
  bad = np.array([[3, 4, 5], [7, 600, 2]], np.int32)
  with pytest.raises(ValueError, match=r"1 id\(s\) outside \[0, 512\) \(the vocabulary\), e.g. 600 at row 1, column 1"):
    sampling.validate_prompts(bad, np.ones((2, 3)), vocab_size=512)
  with pytest.raises(ValueError, match=r"e.g. -1 at row 0, column 0 \(padding included\)"):
    sampling.validate_prompts(np.array([[-1, 4, 5]]), np.array([[0, 1, 1]]), vocab_size=512)
  sampling.validate_prompts(bad, np.ones((2, 3)))  # without vocab_size only shapes and the mask are checked
  with pytest.raises(TypeError, match="must hold integer token ids, got dtype float32"):  # 5.7 became 5
    sampling.validate_prompts(np.full((1, 3), 5.7, np.float32), np.ones((1, 3)))
  with pytest.raises(TypeError, match="must be arrays, got list"):
    sampling.validate_prompts([[1, 2]], np.ones((1, 2)))
  with pytest.raises(ValueError, match="eos_token_ids"):
    SamplingConfig(max_new_tokens=4, eos_token_ids=(), pad_id=0)
  with pytest.raises(ValueError, match="top_p"):
    SamplingConfig(max_new_tokens=4, eos_token_ids=(1,), pad_id=0, top_p=0.0)
  with pytest.raises(ValueError, match="temperature"):
    SamplingConfig(max_new_tokens=4, eos_token_ids=(1,), pad_id=0, temperature=-1.0)
  with pytest.raises(ValueError, match="min_new_tokens"):
    SamplingConfig(max_new_tokens=4, eos_token_ids=(1,), pad_id=0, min_new_tokens=5)
  with pytest.raises(TypeError, match="unroll_decode"):
    SamplingConfig(max_new_tokens=4, eos_token_ids=(1,), pad_id=0, unroll_decode="yes")
  cfg = SamplingConfig(max_new_tokens=4, eos_token_ids=[1, 2], stop_token_ids=[2, 3], pad_id=0)
  assert cfg.end_ids == (1, 2, 3) and hash(cfg) == hash(SamplingConfig(max_new_tokens=4, eos_token_ids=(1, 2),
                                                                          stop_token_ids=(2, 3), pad_id=0))


@pytest.mark.parametrize("field, value", [
    ("pad_id", None), ("pad_id", -1), ("pad_id", 1.5), ("pad_id", "0"),
    ("eos_token_ids", (1.7,)), ("eos_token_ids", ("151645",)), ("eos_token_ids", (-5,)), ("stop_token_ids", (2, -1)),
    ("min_new_tokens", None), ("min_new_tokens", 1.5), ("max_new_tokens", True),
    ("top_p", None), ("top_p", "0.9"), ("top_p", jnp.float32(0.5)),
    ("cache_dtype", "float33"), ("cache_dtype", jnp.int8),
])
def test_config_rejects_bad_values_naming_the_field(field, value):
  """Each bad value raises a ValueError that names its field (not a bare TypeError from a comparison, and not a
  silent truncation: eos id 1.7 used to become 1, pad_id=None failed only inside the jit-compiled call)."""
  kw = dict(max_new_tokens=4, eos_token_ids=(1,), pad_id=0)
  with pytest.raises(ValueError, match=f"SamplingConfig.{field}"):
    SamplingConfig(**{**kw, field: value})


def test_config_early_stop_must_be_bool_and_numpy_scalars_are_accepted():
  """early_stop="no" used to be accepted (truthy: early stopping on); numpy scalars for temperature / top_p are
  plain numbers (temperature np.float32(0.7) used to be rejected as not "a finite float >= 0"), stored as floats."""
  kw = dict(max_new_tokens=4, eos_token_ids=(1,), pad_id=0)
  with pytest.raises(TypeError, match="early_stop"):
    SamplingConfig(**kw, early_stop="no")
  cfg = SamplingConfig(max_new_tokens=4, eos_token_ids=np.array([3, 4]), pad_id=np.int64(0),
                       temperature=np.float32(0.5), top_p=np.float64(0.25))
  assert type(cfg.temperature) is float and cfg.temperature == 0.5 and type(cfg.top_p) is float and cfg.top_p == 0.25
  assert cfg == SamplingConfig(max_new_tokens=4, eos_token_ids=(3, 4), pad_id=0, temperature=0.5, top_p=0.25)


# ----------------------------------------------------------------------------
# generate() against transformers (tiny random Qwen2 checkpoint, float32).
# ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
  """(hf_model, cfg_model, base): a random float32 Qwen2 (tests/_model_utils), converted to our tree."""
  pytest.importorskip("torch")
  from qerl_jax import hf, models
  from tests._model_utils import make_hf_model
  model = make_hf_model("qwen2")
  cfg = models.ModelConfig.from_hf(model.config.to_dict(), dtype="float32")
  return model, cfg, hf.base_from_state_dict(cfg, model.state_dict())


def test_generate_refuses_ids_outside_the_vocabulary(tiny):
  """pad_id = V was accepted and turned every row of the batch to NaN log-probs (the bucket's padding reads the
  pad id's embedding, out of the table)."""
  _, cfg, base = tiny
  tokens, mask = np.array([[0, 5, 6], [4, 5, 6]], np.int32), np.array([[0, 1, 1], [1, 1, 1]], np.int32)
  key = jax.random.PRNGKey(0)
  sc = SamplingConfig(max_new_tokens=2, eos_token_ids=(2,), pad_id=cfg.vocab_size)
  with pytest.raises(ValueError, match=re.escape(f"SamplingConfig.pad_id={cfg.vocab_size} is outside [0, "
                                                 f"{cfg.vocab_size}) (the vocabulary)")):
    sampling.generate(cfg, base, tokens, mask, key, sc)
  # an end id outside the vocabulary is allowed: it never ends a row (the benchmarks' fixed-length decoding)
  ro = sampling.generate(cfg, base, tokens, mask, key, SamplingConfig(max_new_tokens=3, eos_token_ids=(
      cfg.vocab_size + 3,), pad_id=0, temperature=0.0))
  assert np.asarray(ro.lengths).tolist() == [3, 3] and not np.asarray(ro.finished).any()
  assert np.isfinite(np.asarray(ro.logprobs)).all()
  with pytest.raises(ValueError, match=f"outside \\[0, {cfg.vocab_size}\\)"):
    sampling.generate(cfg, base, tokens + cfg.vocab_size, mask, key,
                      SamplingConfig(max_new_tokens=2, eos_token_ids=(2,), pad_id=0))
  # AQN noise: NaN made every log-prob NaN, a wrong shape failed deep in the layer scan
  sc = SamplingConfig(max_new_tokens=2, eos_token_ids=(2,), pad_id=0)
  shape = (cfg.num_layers, cfg.hidden_size)
  noise = {"input_norm": np.zeros(shape, np.float32), "post_attn_norm": np.zeros(shape, np.float32)}
  with pytest.raises(ValueError, match=re.escape(f"norm_noise['post_attn_norm'] has shape (2, 3); expected [L, D] = "
                                                 f"{shape}")):
    sampling.generate(cfg, base, tokens, mask, key, sc, norm_noise={**noise, "post_attn_norm": np.zeros((2, 3))})
  nan = noise["input_norm"].copy()
  nan[0, 1] = np.nan
  with pytest.raises(ValueError, match=re.escape("norm_noise['input_norm'] holds NaN or infinite values")):
    sampling.generate(cfg, base, tokens, mask, key, sc, norm_noise={**noise, "input_norm": nan})
  from qerl_jax import models
  with pytest.raises(ValueError, match="init_cache: batch must be an integer >= 1, got -1"):
    models.init_cache(cfg, -1, 8)
  cache = models.init_cache(cfg, 3, 8, dtype=jnp.float32)
  with pytest.raises(ValueError, match="tokens have 2 rows but the KV cache holds 3"):
    models.forward(cfg, base, jnp.asarray(tokens), jnp.zeros((2, 3), jnp.int32), cache=cache)


def _prompts():
  """Three left-padded prompts of lengths 5, 9, 3 in a [3, 9] batch."""
  rng = np.random.default_rng(0)
  lengths = [5, 9, 3]
  tokens = np.zeros((3, 9), np.int32)
  mask = np.zeros((3, 9), np.int32)
  for i, n in enumerate(lengths):
    tokens[i, 9 - n:] = rng.integers(3, 160, size=n)
    mask[i, 9 - n:] = 1
  return tokens, mask


def _hf_greedy(model, tokens, mask, max_new, eos, pad, min_new=0):
  """transformers' greedy ``generate`` (PyTorch float32): int [B, max_new] completions, pad after the end."""
  import torch
  with torch.no_grad():
    out = model.generate(input_ids=torch.tensor(tokens, dtype=torch.long),
                         attention_mask=torch.tensor(mask, dtype=torch.long), do_sample=False,
                         max_new_tokens=max_new, min_new_tokens=min_new, eos_token_id=list(eos), pad_token_id=pad,
                         temperature=None, top_p=None, top_k=None)
  out = out[:, tokens.shape[1]:].numpy()
  full = np.full((tokens.shape[0], max_new), pad, np.int32)
  full[:, :out.shape[1]] = out
  return full


MAX_NEW = 12
PAD = 1  # also an end id, as in Qwen (pad <|endoftext|> is one of the eos ids)


@pytest.fixture(scope="module")
def greedy_case(tiny):
  """(tokens, mask, eos, r, hf_completions): an end id that row r first emits at completion position 2."""
  model, _, _ = tiny
  tokens, mask = _prompts()
  free = _hf_greedy(model, tokens, mask, MAX_NEW, eos=[159], pad=0)
  r = next(i for i in range(3) if free[i, 2] not in free[i, :2])  # StopIteration: pick other prompts
  eos = (int(free[r, 2]), PAD)
  return tokens, mask, eos, r, _hf_greedy(model, tokens, mask, MAX_NEW, eos=eos, pad=PAD)


def test_greedy_matches_transformers_and_unbatched(tiny, greedy_case):
  _, cfg, base = tiny
  tokens, mask, eos, r, ref = greedy_case
  config = SamplingConfig(max_new_tokens=MAX_NEW, eos_token_ids=eos, pad_id=PAD, temperature=0.0,
                          cache_dtype=jnp.float32)
  ro = sampling.generate(cfg, base, tokens, mask, jax.random.key(0), config)
  got = np.asarray(ro.tokens)
  np.testing.assert_array_equal(got, ref)
  # Independent mask: up to and including the first end token of the reference.
  is_end = np.isin(ref, eos)
  first = np.where(is_end.any(1), is_end.argmax(1), MAX_NEW)
  want_mask = (np.arange(MAX_NEW)[None] <= first[:, None]).astype(np.int32)
  np.testing.assert_array_equal(np.asarray(ro.mask), want_mask)
  assert ro.mask[r].tolist() == [1, 1, 1] + [0] * (MAX_NEW - 3) and bool(ro.finished[r])
  assert ro.tokens[r, 3:].tolist() == [PAD] * (MAX_NEW - 3)
  assert (~np.asarray(ro.finished)).any(), "want a truncated row too"  # rows that never emit an end id
  np.testing.assert_array_equal(np.asarray(ro.finished), is_end.any(1))
  np.testing.assert_array_equal(np.asarray(ro.truncated), ~is_end.any(1))
  np.testing.assert_array_equal(np.asarray(ro.lengths), want_mask.sum(1))
  np.testing.assert_array_equal(np.asarray(ro.logprobs), 0.0)  # greedy samples from a point mass
  assert ro.metrics["bucket_batch"] == 4 and ro.metrics["bucket_prompt_len"] == 16
  # KV cache: 2 (k, v) * L 2 * rows 4 * slots (16 + 12) * Hkv 2 * hd 16 * 4 bytes + the bool slot mask.
  assert ro.metrics["kv_cache_bytes"] == 2 * 2 * 4 * 28 * 2 * 16 * 4 + 4 * 28
  # Each row alone (no padding at all) generates the same tokens.
  for i in range(3):
    row = tokens[i:i + 1, mask[i] > 0]
    alone = sampling.generate(cfg, base, row, np.ones_like(row), jax.random.key(0), config)
    np.testing.assert_array_equal(np.asarray(alone.tokens[0]), got[i])
    if i == r:  # alone, row r ends at completion position 2: the while loop stops after 2 decode steps
      assert int(alone.metrics["decode_steps"]) == 2
  assert int(ro.metrics["decode_steps"]) == MAX_NEW - 1  # a truncated row keeps the batch decoding


def test_top_k1_groups_and_min_new_tokens_match_greedy(tiny, greedy_case):
  """top-k 1 at temperature 0.8 is greedy; G=2 rows share a prefill; min_new_tokens as transformers;
  decoding in 3 phases of growing KV cache, with the decode step's layer loop unrolled, changes nothing."""
  model, cfg, base = tiny
  tokens, mask, eos, _, _ = greedy_case
  ref = _hf_greedy(model, tokens, mask, MAX_NEW, eos=eos, pad=PAD, min_new=4)
  config = SamplingConfig(max_new_tokens=MAX_NEW, eos_token_ids=eos, pad_id=PAD, temperature=0.8, top_k=1,
                          min_new_tokens=4, num_generations=2, cache_dtype=jnp.float32, kv_phases=3,
                          unroll_decode=True)
  assert config.phase_ends() == (4, 8, 12)
  ro = sampling.generate(cfg, base, tokens, mask, jax.random.key(1), config)  # 3 decode phases, growing cache
  np.testing.assert_array_equal(np.asarray(ro.tokens), np.repeat(ref, 2, axis=0))
  np.testing.assert_array_equal(np.asarray(ro.prompt_tokens), np.repeat(tokens, 2, axis=0))
  assert (np.asarray(ro.lengths) >= 4).all()


def _small_model():
  """(cfg, base): a random float32 model small enough for CPU tests (no PyTorch needed)."""
  from qerl_jax import models
  cfg = models.ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=16, dtype="float32")
  return cfg, models.init_params(cfg, jax.random.key(0), dtype=jnp.float32, std=0.2)


def _full_forward_logprobs64(cfg, base, ro, prompt_len, temperature=1.0):
  """float64 ``[N, T]``: log_softmax (numpy, float64) of one full forward's logits over prompt + completion,
  divided by ``temperature``, at each completion token, 0 where the completion mask is 0."""
  from qerl_jax import models
  seq = jnp.concatenate([ro.prompt_tokens, ro.tokens], axis=1)
  seq_mask = jnp.concatenate([ro.prompt_mask, ro.mask], axis=1)
  logits, _ = models.forward(cfg, base, seq, models.positions_from_mask(seq_mask), attn_mask=seq_mask)
  logp = _log_softmax64(np.asarray(logits[:, :-1], np.float64) / temperature)  # predicts seq[:, 1:]
  full = np.take_along_axis(logp, np.asarray(seq)[:, 1:, None], axis=-1)[..., 0]
  return full[:, prompt_len - 1:] * np.asarray(ro.mask)


@pytest.mark.parametrize("temperature", [1.0, 0.0, 0.7])
def test_policy_logprobs_are_the_raw_policy_before_min_new_tokens(temperature):
  """policy_logprobs (the trainer's old log-probs) equal one full forward's log_softmax at the sampling
  temperature (1 for greedy) also while min_new_tokens forbids the end ids: they are the policy's, not
  renormalised over the allowed tokens. A third of the vocabulary are end ids, so the renormalisation would
  be visible (about 0.5 nats)."""
  cfg, base = _small_model()
  tokens = np.array([[0, 5, 7, 9], [3, 4, 8, 2], [0, 0, 0, 11]], np.int32)
  mask = np.array([[0, 1, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1]], np.int32)
  config = SamplingConfig(max_new_tokens=8, eos_token_ids=tuple(range(0, 97, 3)), pad_id=0, min_new_tokens=4,
                          temperature=temperature, num_generations=2, cache_dtype=jnp.float32)
  ro = sampling.generate(cfg, base, tokens, mask, jax.random.key(1), config)
  assert (np.asarray(ro.lengths) >= 4).all()
  want = _full_forward_logprobs64(cfg, base, ro, tokens.shape[1], temperature or 1.0)
  np.testing.assert_allclose(np.asarray(ro.policy_logprobs), want, atol=1e-4)
  if temperature == 0.7:  # (and not the temperature-1 values: the test can tell them apart)
    assert np.abs(want - _full_forward_logprobs64(cfg, base, ro, tokens.shape[1])).max() > 0.05


def _lora_and_noise(cfg, key):
  """Adapters on q, v, up and down (k, o and gate without), rank 4 except v (2); AQN-style noise."""
  k = jax.random.split(key, 9)
  L, D, r, I = cfg.num_layers, cfg.hidden_size, 4, cfg.intermediate_size
  ad = lambda ka, kb, k_in, rank, n: {"a": 0.2 * jax.random.normal(ka, (L, k_in, rank)),
                                      "b": 0.2 * jax.random.normal(kb, (L, rank, n))}
  lora = {"layers": {
      "attn": {"q": ad(k[0], k[1], D, r, cfg.q_dim), "v": ad(k[5], k[6], D, 2, cfg.kv_dim)},
      "mlp": {"down": ad(k[2], k[3], I, r, D), "up": ad(k[7], k[8], D, r, I)}}}
  noise = {"input_norm": 0.05 * jax.random.normal(k[4], (L, D)), "post_attn_norm": jnp.full((L, D), -0.02)}
  return lora, noise


@pytest.mark.parametrize("fused, unroll", [(False, False), (True, False), (True, True)])
def test_logprobs_equal_full_forward_with_lora_and_noise(tiny, fused, unroll):
  """At temperature 1 the returned log-probs equal one full forward over prompt + completion (float32).

  With a fused base the sampler runs the regrouped adapter (models.fuse_adapter); the reference
  forward uses the per-part tree on the unfused base, as the trainer does. ``unroll``: the decode
  step's layer loop unrolled (SamplingConfig.unroll_decode)."""
  from qerl_jax import models
  _, cfg, base = tiny
  ref_base = base
  if fused:
    base = models.fuse_projections(base)
  tokens, mask = _prompts()
  lora, noise = _lora_and_noise(cfg, jax.random.key(3))
  config = SamplingConfig(max_new_tokens=MAX_NEW, eos_token_ids=(2, 3), pad_id=PAD, temperature=1.0,
                          num_generations=2, cache_dtype=jnp.float32, unroll_decode=unroll)
  kw = dict(lora=lora, lora_cfg=2.0, norm_noise=noise)
  ro = sampling.generate(cfg, base, tokens, mask, jax.random.key(4), config, **kw)
  seq = jnp.concatenate([ro.prompt_tokens, ro.tokens], axis=1)
  seq_mask = jnp.concatenate([ro.prompt_mask, ro.mask], axis=1)
  pos = models.positions_from_mask(seq_mask)
  full_forward = jax.jit(lambda b, s, p, m, l, n: models.forward(cfg, b, s, p, attn_mask=m, lora=l, lora_cfg=2.0,
                                                                 norm_noise=n))
  logits, _ = full_forward(ref_base, seq, pos, seq_mask, lora, noise)
  logp = np.asarray(jax.nn.log_softmax(logits[:, :-1], axis=-1))  # predicts seq[:, 1:]
  full = np.take_along_axis(logp, np.asarray(seq)[:, 1:, None], axis=-1)[..., 0]
  want = full[:, tokens.shape[1] - 1:] * np.asarray(ro.mask)
  np.testing.assert_allclose(np.asarray(ro.logprobs), want, atol=1e-4)
  np.testing.assert_allclose(np.asarray(ro.policy_logprobs), want, atol=1e-4)
  assert np.asarray(ro.mask).sum() > 10 and (want < -1e-3).any()  # something non-trivial was sampled
  # Fixed key: reproducible; another key: different samples.
  again = sampling.generate(cfg, base, tokens, mask, jax.random.key(4), config, **kw)
  np.testing.assert_array_equal(np.asarray(again.tokens), np.asarray(ro.tokens))
  other = sampling.generate(cfg, base, tokens, mask, jax.random.key(5), config, **kw)
  assert not np.array_equal(np.asarray(other.tokens), np.asarray(ro.tokens))


def test_generate_reads_a_decode_order_base_as_the_standard_one():
  """A base whose NVFP4 codes are in the decode kernel's order (models.to_decode_order, what the
  trainer's model.code_order="rollout" hands the sampler on a GPU) samples exactly what the standard
  base samples: same tokens and log-probabilities (greedy and with a fixed key)."""
  from qerl_jax import models
  cfg = models.ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=16, dtype="float32")
  base = models.quantize_base(models.init_params(cfg, jax.random.key(0), dtype=jnp.float32, std=0.2), "nvfp4")
  ordered = models.to_decode_order(base)
  assert ordered["layers"]["mlp"]["down"].code_order == "decode"
  tokens = jnp.asarray([[0, 5, 7, 9], [3, 4, 8, 2]], jnp.int32)
  mask = jnp.asarray([[0, 1, 1, 1], [1, 1, 1, 1]], jnp.int32)
  for temperature in (0.0, 1.0):
    config = SamplingConfig(max_new_tokens=6, eos_token_ids=(96,), pad_id=96, temperature=temperature)
    a = sampling.generate(cfg, base, tokens, mask, jax.random.key(3), config)
    b = sampling.generate(cfg, ordered, tokens, mask, jax.random.key(3), config)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    np.testing.assert_array_equal(np.asarray(a.logprobs), np.asarray(b.logprobs))


@pytest.mark.slow
def test_dequantize_min_rows_samples_from_a_dense_copy_of_the_base():
  """SamplingConfig.dequantize_min_rows: at or above the threshold (decode rows = batch bucket x G) the
  rollout runs on a dense copy of the 4-bit base, and samples what the same base dequantized beforehand
  (models.dequantize_base, XLA) samples: same tokens and log-probabilities; the copy's bytes are
  reported (hand count below); below the threshold, or at 0, no copy is made."""
  from qerl_jax import models
  cfg = models.ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=16, dtype="float32")
  base = models.quantize_base(models.init_params(cfg, jax.random.key(0), dtype=jnp.float32, std=0.2), "nvfp4")
  dense = models.dequantize_base(base, jnp.float32)
  tokens = jnp.asarray([[0, 5, 7, 9], [3, 4, 8, 2]], jnp.int32)
  mask = jnp.asarray([[0, 1, 1, 1], [1, 1, 1, 1]], jnp.int32)
  # per layer: q 64x64, k 64x32, v 64x32, o 64x64, gate 64x128, up 64x128, down 128x64 float32 weights
  copy_bytes = 2 * (4096 + 2048 + 2048 + 4096 + 8192 + 8192 + 8192) * 4
  for temperature in (0.0, 1.0):
    kw = dict(max_new_tokens=6, eos_token_ids=(96,), pad_id=96, temperature=temperature, num_generations=2)
    want = sampling.generate(cfg, dense, tokens, mask, jax.random.key(3), SamplingConfig(**kw))
    assert want.metrics["dequantized_base_bytes"] == 0
    for rows, copied in ((4, True), (5, False), (0, False)):  # 2 prompts x G 2 = 4 decode rows
      ro = sampling.generate(cfg, base, tokens, mask, jax.random.key(3), SamplingConfig(**kw, dequantize_min_rows=rows))
      assert ro.metrics["dequantized_base_bytes"] == (copy_bytes if copied else 0)
      np.testing.assert_array_equal(np.asarray(ro.tokens), np.asarray(want.tokens))
      # (on a GPU the copy's Pallas kernel multiplies by 1 / global scale where XLA's dequantize divides:
      # a weight may come out one float32 ulp apart; measured up to 2.8e-6 relative in a log-probability)
      rtol = 0 if jax.default_backend() == "cpu" else 1e-5
      np.testing.assert_allclose(np.asarray(ro.logprobs), np.asarray(want.logprobs), rtol=rtol, atol=1e-6)
  fused = models.quantize_base(models.fuse_projections(
      models.init_params(cfg, jax.random.key(0), dtype=jnp.float32, std=0.2)), "nvfp4")
  ro = sampling.generate(cfg, fused, tokens, mask, jax.random.key(3),
                         SamplingConfig(max_new_tokens=6, eos_token_ids=(96,), pad_id=96, temperature=0.0,
                                        dequantize_min_rows=1))
  assert ro.metrics["dequantized_base_bytes"] == copy_bytes  # fused q/k/v and gate/up: the same weights
  with pytest.raises(ValueError, match="dequantize_min_rows"):
    SamplingConfig(max_new_tokens=4, eos_token_ids=(1,), pad_id=0, dequantize_min_rows=-1)


def test_dequantize_max_weights_copies_only_the_small_linears():
  """SamplingConfig.dequantize_max_weights: with dequantize_min_rows met, only the linears of at most that many
  weights a layer (K x N) are copied; the rollout samples what the mixed base models.dequantize_base(max_weights=)
  makes samples, and the copy's bytes count only those linears (hand count below). Unfused: q (64 x 64) and o
  (64 x 64) at 4096, k and v too; fused: q/k/v (64 x 128) and down (128 x 64) at 8192, not gate/up (64 x 256)."""
  from qerl_jax import models
  cfg = models.ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=16, dtype="float32")
  params = models.init_params(cfg, jax.random.key(0), dtype=jnp.float32, std=0.2)
  tokens = jnp.asarray([[0, 5, 7, 9], [3, 4, 8, 2]], jnp.int32)
  mask = jnp.asarray([[0, 1, 1, 1], [1, 1, 1, 1]], jnp.int32)
  kw = dict(max_new_tokens=6, eos_token_ids=(96,), pad_id=96, temperature=1.0, num_generations=2)
  for fuse, limit, copied_names, copied_elements in (
      (False, 4096, {"q", "k", "v", "o"}, 4096 + 2048 + 2048 + 4096),
      (True, 8192, {"qkv", "o", "down"}, 8192 + 4096 + 8192)):
    base = models.quantize_base(models.fuse_projections(params) if fuse else params, "nvfp4")
    mixed = models.dequantize_base(base, jnp.float32, max_weights=limit)
    lay = mixed["layers"]
    linears = {"q", "k", "v", "o", "qkv", "gate", "up", "gate_up", "down"}
    dense_names = {n for g in ("attn", "mlp") for n, w in lay[g].items() if n in linears and not models.is_quantized(w)}
    assert dense_names == copied_names, fuse
    want = sampling.generate(cfg, mixed, tokens, mask, jax.random.key(3), SamplingConfig(**kw))
    ro = sampling.generate(cfg, base, tokens, mask, jax.random.key(3),
                           SamplingConfig(**kw, dequantize_min_rows=4, dequantize_max_weights=limit))
    assert ro.metrics["dequantized_base_bytes"] == 2 * copied_elements * 4  # 2 layers, float32
    np.testing.assert_array_equal(np.asarray(ro.tokens), np.asarray(want.tokens))
    rtol = 0 if jax.default_backend() == "cpu" else 1e-5  # (the GPU copy's kernel: see the test above)
    np.testing.assert_allclose(np.asarray(ro.logprobs), np.asarray(want.logprobs), rtol=rtol, atol=1e-6)
  with pytest.raises(ValueError, match="dequantize_max_weights"):
    SamplingConfig(max_new_tokens=4, eos_token_ids=(1,), pad_id=0, dequantize_max_weights=-1)
  with pytest.raises(ValueError, match="max_weights=-1"):
    models.dequantize_base(base, jnp.float32, max_weights=-1)


@pytest.mark.gpu
def test_gpu_dequantize_max_weights_runs_a_mixed_base():
  """On a GPU (bf16 model, fused NVFP4 base in decode order): dequantize_max_weights copies q/k/v, o and down
  (at most 256 x 512 weights) and leaves gate/up 4-bit, so one decode step mixes cuBLAS products with the 4-bit
  kernels (at 4 rows: the decode GEMV into the layer's shared buffer). It samples what the same mixed base made
  beforehand by XLA samples: the first token of every row equal, the log-probabilities equal within float32
  atomics' order (the 4-bit split-K parts) until a row diverges, and the copy's bytes those three linears'."""
  from qerl_jax import models
  cfg = models.ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=64, dtype="bfloat16")
  base = models.to_decode_order(models.quantize_base(models.fuse_projections(
      models.init_params(cfg, jax.random.key(0), dtype=jnp.float32, std=0.05)), "nvfp4"))
  limit = 256 * 512
  mixed = models.dequantize_base(base, jnp.bfloat16, max_weights=limit)  # XLA
  mlp = mixed["layers"]["mlp"]
  assert models.is_quantized(mlp["gate_up"]) and not models.is_quantized(mlp["down"])
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 500, (4, 12)), jnp.int32)
  mask = jnp.ones((4, 12), jnp.int32)
  kw = dict(max_new_tokens=16, eos_token_ids=(511,), pad_id=511, temperature=1.0)
  want = sampling.generate(cfg, mixed, tokens, mask, jax.random.key(3), SamplingConfig(**kw))
  got = sampling.generate(cfg, base, tokens, mask, jax.random.key(3),
                          SamplingConfig(**kw, dequantize_min_rows=4, dequantize_max_weights=limit))
  assert got.metrics["dequantized_base_bytes"] == 2 * 2 * (256 * 512 + 256 * 256 + 512 * 256)
  same = np.cumprod(np.asarray(got.tokens) == np.asarray(want.tokens), axis=1).astype(bool)
  assert same[:, 0].all()
  np.testing.assert_allclose(np.asarray(got.logprobs)[same], np.asarray(want.logprobs)[same], atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [160, 256])
def test_gpu_bf16_qkv_route_samples_as_the_dense_base(monkeypatch, rows):
  """On a GPU (bf16 model with q/k/v biases, fused NVFP4 base in decode order) a batch of 256 prompts, or of 160
  padded to 256 rows (generate's power-of-two bucket, so 96 rows of padding), decodes 256 rows: no shared buffer,
  past the decode GEMV's 128 rows, and the q/k/v weight on the large-M route (the Gluon GEMM), so
  decoder.FUSED_ATTENTION_BF16_QKV takes q/k/v in bf16 with the bias in the GEMM's epilogue and the append kernel
  gets none. The rollout samples what the same base dequantized by XLA samples (the first token of
  every row, the log-probabilities within 4-bit and bf16 rounding until a row diverges), as the float32 route
  does."""
  from pallas_kernels import decode_attention as da
  from qerl_jax import models
  from qerl_jax.models import decoder
  cfg = models.ModelConfig(vocab_size=512, hidden_size=512, intermediate_size=1024, num_layers=2, num_heads=8,
                           num_kv_heads=2, head_dim=64, attention_bias=True, dtype="bfloat16")
  params = models.init_params(cfg, jax.random.key(0), dtype=jnp.float32, std=0.05)
  params["layers"]["attn"]["q_bias"] = 0.5 * jax.random.normal(jax.random.key(9),
                                                               params["layers"]["attn"]["q_bias"].shape)
  base = models.to_decode_order(models.quantize_base(models.fuse_projections(params), "nvfp4"))
  dense = models.dequantize_base(base, jnp.bfloat16)  # XLA, from the standard order
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 500, (rows, 12)), jnp.int32)
  mask = jnp.ones((rows, 12), jnp.int32)
  kw = dict(max_new_tokens=8, eos_token_ids=(511,), pad_id=511, temperature=1.0)
  want = sampling.generate(cfg, dense, tokens, mask, jax.random.key(3), SamplingConfig(**kw))
  biases = []
  real_append = da.decode_attention_append
  monkeypatch.setattr(da, "decode_attention_append",
                      lambda *a, **k: biases.append(a[1] is not None) or real_append(*a, **k))
  rollouts = []
  for route in (1, 0):
    biases.clear()
    monkeypatch.setattr(decoder, "FUSED_ATTENTION_BF16_QKV", route)
    jax.clear_caches()  # the setting is read at trace time; generate's jit would reuse the other route's program
    got = sampling.generate(cfg, base, tokens, mask, jax.random.key(3), SamplingConfig(**kw))
    assert biases and all(b == (not route) for b in biases)
    lp, lpd = np.asarray(got.logprobs), np.asarray(want.logprobs)
    assert np.isfinite(lp).all()
    same = np.cumprod(np.asarray(got.tokens) == np.asarray(want.tokens), axis=1).astype(bool)
    assert same[:, 0].mean() > 0.95  # 4-bit products against dense ones: a rare first-token flip
    np.testing.assert_allclose(lp[same], lpd[same], atol=0.1)
    rollouts.append(got)
  # the two routes: the same 4-bit products, but the bias rounded to bf16 and q/k/v's sums in another order. A
  # CPU run of this body (the append kernel interpreted, the q/k/v weight put on the large-M path) had the routes
  # within 0.048 (mean 0.008) on 96% of the tokens; without the bias on the bf16 route they were 1.8 (mean 0.30) apart
  # and agreed on 38%
  same = np.cumprod(np.asarray(rollouts[0].tokens) == np.asarray(rollouts[1].tokens), axis=1).astype(bool)
  diff = np.abs(np.asarray(rollouts[0].logprobs) - np.asarray(rollouts[1].logprobs))[same]
  assert same[:, 0].all() and same.mean() > 0.8
  assert diff.max() < 0.1 and diff.mean() < 0.03, (diff.max(), diff.mean())


@pytest.mark.gpu
def test_gpu_dequantize_min_rows_equals_sampling_a_predequantized_bf16_base():
  """On a GPU (bf16 model, fused NVFP4 base in the decode kernel's code order, as the trainer stores it):
  the rollout's dense copy comes from the Pallas dequantize kernel, one launch per layer, and sampling on
  it equals sampling on the same base dequantized beforehand by XLA, token for token and log-probability
  for log-probability (the kernel's bf16 values are nvfp4.dequantize's bit for bit). Without the copy the
  4-bit kernels run and the log-probabilities differ from it, but within bf16 rounding."""
  from qerl_jax import models
  cfg = models.ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=64, dtype="bfloat16")
  base = models.to_decode_order(models.quantize_base(models.fuse_projections(
      models.init_params(cfg, jax.random.key(0), dtype=jnp.float32, std=0.05)), "nvfp4"))
  dense = models.dequantize_base(base, jnp.bfloat16)  # XLA, from the standard order
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 500, (4, 12)), jnp.int32)
  mask = jnp.ones((4, 12), jnp.int32)
  kw = dict(max_new_tokens=16, eos_token_ids=(511,), pad_id=511, temperature=1.0)
  want = sampling.generate(cfg, dense, tokens, mask, jax.random.key(3), SamplingConfig(**kw))
  got = sampling.generate(cfg, base, tokens, mask, jax.random.key(3), SamplingConfig(**kw, dequantize_min_rows=4))
  assert got.metrics["dequantized_base_bytes"] == 2 * 2 * (256 * 512 + 256 * 256 + 256 * 1024 + 512 * 256)
  np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
  np.testing.assert_array_equal(np.asarray(got.logprobs), np.asarray(want.logprobs))
  four_bit = sampling.generate(cfg, base, tokens, mask, jax.random.key(3), SamplingConfig(**kw))
  assert four_bit.metrics["dequantized_base_bytes"] == 0
  lp4, lpd = np.asarray(four_bit.logprobs), np.asarray(want.logprobs)
  same = np.cumprod(np.asarray(four_bit.tokens) == np.asarray(want.tokens), axis=1).astype(bool)  # before a row diverges
  np.testing.assert_allclose(lp4[same], lpd[same], atol=0.1)
