"""The decoder against transformers' PyTorch models, its KV cache, 4-bit linears, LoRA and log-probs."""

import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qerl_jax import hf, models, nvfp4
from tests._model_utils import (assert_same_as_on_cpu, decode_all as _decode_all, left_padded_batch, make_hf_model,
                                torch_logits)

# jit every forward: one compilation per call site is much cheaper than op-by-op dispatch.
fwd = jax.jit(models.forward, static_argnums=(0,),
              static_argnames=("lora_cfg", "remat", "return_hidden"))

TORCH_REASON = "PyTorch (a dev extra) runs the transformers reference"
ARCHS = [("qwen2", False), ("qwen2", True), ("qwen3", False), ("qwen3", True), ("llama", False),
         ("llama", True)]


@functools.lru_cache(maxsize=None)
def _model(arch, tied):
  m = make_hf_model(arch, tied=tied)
  cfg = models.ModelConfig.from_hf(m.config.to_dict(), dtype="float32")
  base = hf.base_from_state_dict(cfg, m.state_dict())
  return m, cfg, base


@pytest.mark.parametrize("arch,tied", ARCHS)
def test_logits_match_transformers_left_padded(arch, tied):
  m, cfg, base = _model(arch, tied)
  tokens, mask = left_padded_batch(cfg.vocab_size)
  ref = torch_logits(m, tokens, mask)
  pos = models.positions_from_mask(jnp.asarray(mask))
  logits, cache = fwd(cfg, base, jnp.asarray(tokens), pos, attn_mask=jnp.asarray(mask))
  assert cache is None
  logits = np.asarray(logits)
  real = mask.astype(bool)
  assert np.abs(logits - ref)[real].max() < 1e-4
  assert (logits.argmax(-1) == ref.argmax(-1))[real].all()


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_logits_match_transformers_far_positions(arch):
  """Positions near 3000 exercise RoPE (and llama3 frequency scaling) beyond the short batch."""
  torch = pytest.importorskip("torch", reason=TORCH_REASON)
  m, cfg, base = _model(arch, False)
  rng = np.random.default_rng(1)
  tokens = rng.integers(0, cfg.vocab_size, (2, 8)).astype(np.int32)
  pos = (np.arange(8)[None] + np.array([[0], [2990]])).astype(np.int32)
  with torch.no_grad():
    ref = m(input_ids=torch.tensor(tokens, dtype=torch.long),
            position_ids=torch.tensor(pos, dtype=torch.long)).logits.numpy()
  logits, _ = fwd(cfg, base, jnp.asarray(tokens), jnp.asarray(pos))
  assert np.abs(np.asarray(logits) - ref).max() < 1e-4


def test_rope_inv_freq_matches_transformers_llama3():
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
  m, cfg, _ = _model("llama", False)
  ref, _ = ROPE_INIT_FUNCTIONS["llama3"](m.config, "cpu")
  ours = models.rope_inv_freq(cfg)
  np.testing.assert_allclose(ours, ref.numpy(), rtol=1e-6)
  plain = 1.0 / (cfg.rope_theta ** (np.arange(0, cfg.head_dim, 2) / cfg.head_dim))
  assert not np.allclose(ours, plain)  # the scaling really changes low frequencies


@pytest.mark.parametrize("name", ["llama-3.2-1b", "qwen3-8b"])
def test_logits_match_transformers_at_long_context_real_rope(fixtures_dir, name):
  """The real RoPE settings (Llama 3.2: theta 5e5, head_dim 64, llama3 scaling from 8192; Qwen3: theta 1e6,
  head_dim 128) at positions up to 120k, on a model shrunk in width and depth only. RoPE angles grow with the
  position, so inverse frequencies 1-2 float32 ulps off transformers' (numpy's float32 power) gave logits
  about 1e-3 off at 120k."""
  torch = pytest.importorskip("torch", reason=TORCH_REASON)
  import transformers as tf
  d = _fixture_config(fixtures_dir, name)
  d.update(vocab_size=200, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, bos_token_id=None, eos_token_id=None)
  hf_cfg = tf.AutoConfig.for_model(d["model_type"], **{k: v for k, v in d.items() if k != "model_type"})
  torch.manual_seed(0)
  m = getattr(tf, d["architectures"][0])(hf_cfg).float().eval()
  with torch.no_grad():
    for p in m.parameters():
      p.copy_(0.08 * torch.randn_like(p) + (1.0 if p.ndim == 1 else 0.0))  # norms near 1
  cfg = models.ModelConfig.from_hf(_fixture_config(fixtures_dir, name), dtype="float32").replace(
      vocab_size=200, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2)
  assert cfg.head_dim == {"llama-3.2-1b": 64, "qwen3-8b": 128}[name]
  base = hf.base_from_state_dict(cfg, m.state_dict())
  tokens = np.random.default_rng(0).integers(0, 200, (3, 6)).astype(np.int32)
  pos = (np.arange(6)[None] + np.array([[0], [20000], [120000]])).astype(np.int32)
  with torch.no_grad():
    ref = m(input_ids=torch.tensor(tokens, dtype=torch.long), position_ids=torch.tensor(pos, dtype=torch.long)).logits
  logits, _ = fwd(cfg, base, jnp.asarray(tokens), jnp.asarray(pos))
  assert np.abs(np.asarray(logits) - ref.numpy()).max() < 1e-4


@pytest.mark.parametrize("name", ["llama-3.2-1b", "llama-3.2-3b", "qwen2.5-7b-base", "qwen3-8b"])
def test_rope_inv_freq_of_real_configs_matches_transformers(fixtures_dir, name):
  """Bit for bit where transformers' float32 pow is correctly rounded (Llama 3.2's 64 and 128 frequencies,
  llama3 scaling included), else within one ulp (its pow's own error)."""
  pytest.importorskip("torch", reason=TORCH_REASON)  # transformers' RoPE initialisers return torch tensors
  import transformers as tf
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
  from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
  d = _fixture_config(fixtures_dir, name)
  hf_cfg = tf.AutoConfig.for_model(d["model_type"], **{k: v for k, v in d.items() if k != "model_type"})
  rope_type = (hf_cfg.rope_parameters or {}).get("rope_type", "default")
  init = (LlamaRotaryEmbedding.compute_default_rope_parameters if rope_type == "default"
          else ROPE_INIT_FUNCTIONS[rope_type])
  ref = init(hf_cfg, "cpu")[0].numpy()
  ours = models.rope_inv_freq(models.ModelConfig.from_hf(d))
  assert ours.dtype == np.float32 and ours.shape == ref.shape
  if name.startswith("llama"):
    np.testing.assert_array_equal(ours, ref)
  else:
    assert (np.abs(ours - ref) <= np.spacing(ref)).all() and (ours != ref).sum() <= 1


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_prefill_then_decode_equals_full_forward(arch):
  _, cfg, base = _model(arch, False)
  tokens, mask = left_padded_batch(cfg.vocab_size, seed=3)
  tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)
  full, _ = fwd(cfg, base, tokens, models.positions_from_mask(mask), attn_mask=mask)
  stepped, cache = _decode_all(cfg, base, tokens, mask, n_prefill=8)
  real = np.asarray(mask).astype(bool)
  assert np.abs(np.asarray(stepped) - np.asarray(full))[real].max() < 1e-5
  np.testing.assert_array_equal(np.asarray(cache["mask"][:, :12]), real)
  assert not np.asarray(cache["mask"][:, 12:]).any()


def test_cache_overrun_raises_outside_jit():
  """A write past the cache's last slot is refused where the index is concrete: dynamic_update_slice would
  clamp it, overwriting earlier slots (slot 2's key replaced by token 3's, and token 3 attending to token 4)."""
  _, cfg, base = _model("qwen2", False)
  tokens = jnp.asarray(left_padded_batch(cfg.vocab_size, seed=8)[0][:1, :5])
  pos = jnp.arange(5, dtype=jnp.int32)[None]
  full, _ = models.forward(cfg, base, tokens, pos)
  for slots in (4, 5):
    cache = models.init_cache(cfg, 1, slots, dtype=jnp.float32)
    _, cache = models.forward(cfg, base, tokens[:, :3], pos[:, :3], cache=cache)
    if slots == 4:
      with pytest.raises(ValueError, match="2 new tokens at cache index 3 overrun the KV cache's 4 slots"):
        models.forward(cfg, base, tokens[:, 3:], pos[:, 3:], cache=cache)
  last, cache = models.forward(cfg, base, tokens[:, 3:], pos[:, 3:], cache=cache)  # fills the 5 slots exactly
  assert int(cache["index"]) == 5
  np.testing.assert_allclose(np.asarray(last), np.asarray(full)[:, 3:], atol=1e-5)


def test_decode_with_lora_noise_and_nvfp4_base_bf16_cache():
  _, cfg, base = _model("llama", False)
  qbase = models.quantize_base(base, "nvfp4")
  lora = _random_lora(cfg, jax.random.key(0))
  noise = _random_noise(cfg, jax.random.key(1))
  tokens, mask = left_padded_batch(cfg.vocab_size, seed=4)
  tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)
  kw = dict(lora=lora, lora_cfg=0.5, norm_noise=noise)
  full, _ = fwd(cfg, qbase, tokens, models.positions_from_mask(mask), attn_mask=mask, **kw)
  stepped, _ = _decode_all(cfg, qbase, tokens, mask, n_prefill=10, cache_dtype=jnp.bfloat16, **kw)
  real = np.asarray(mask).astype(bool)
  err = np.abs(np.asarray(stepped) - np.asarray(full))[real].max()
  assert 0 < err < 0.05  # only the bf16 rounding of cached keys/values differs


@pytest.mark.parametrize("quant", ["nvfp4", "nf4"])
def test_quantized_model_equals_float_model_on_dequantized_weights(quant):
  _, cfg, base = _model("qwen2", False)
  qbase = models.quantize_base(base, quant)
  assert isinstance(qbase["layers"]["attn"]["q"], models.layers.nvfp4.NVFP4Tensor) == (quant == "nvfp4")
  deq = models.dequantize_base(qbase, jnp.float32)
  tokens, mask = left_padded_batch(cfg.vocab_size, seed=5)
  tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)
  pos = models.positions_from_mask(mask)
  lq, _ = fwd(cfg, qbase, tokens, pos, attn_mask=mask)
  ld, _ = fwd(cfg, deq, tokens, pos, attn_mask=mask)
  lf, _ = fwd(cfg, base, tokens, pos, attn_mask=mask)
  np.testing.assert_allclose(np.asarray(lq), np.asarray(ld), atol=2e-5)
  assert np.abs(np.asarray(lq) - np.asarray(lf)).max() > 1e-3  # quantization did change weights


def _random_lora(cfg, key, r=4, targets=models.LINEARS):
  shapes = cfg.linear_shapes()
  lora = {"attn": {}, "mlp": {}}
  for i, (group, name) in enumerate(targets):
    k, n = shapes[(group, name)]
    ka, kb = jax.random.split(jax.random.fold_in(key, i))
    lora[group][name] = {"a": 0.1 * jax.random.normal(ka, (cfg.num_layers, k, r)),
                         "b": 0.1 * jax.random.normal(kb, (cfg.num_layers, r, n))}
  return {"layers": lora}


def _random_noise(cfg, key):
  k1, k2 = jax.random.split(key)
  shape = (cfg.num_layers, cfg.hidden_size)
  return {"input_norm": 0.05 * jax.random.normal(k1, shape),
          "post_attn_norm": 0.05 * jax.random.normal(k2, shape)}


def test_lora_and_norm_noise_equal_merged_float_model():
  """W + s * A @ B and (norm weight + noise) folded into the base give the same logits."""
  _, cfg, base = _model("qwen3", False)
  lora = _random_lora(cfg, jax.random.key(2))
  noise = _random_noise(cfg, jax.random.key(3))
  scale = 2.0
  merged = jax.tree_util.tree_map(lambda x: x, base)
  for group, name in models.LINEARS:
    ab = lora["layers"][group][name]
    merged["layers"][group][name] = base["layers"][group][name] + scale * np.einsum(
        "lkr,lrn->lkn", np.asarray(ab["a"], np.float64), np.asarray(ab["b"], np.float64)).astype(np.float32)
  for nm in ("input_norm", "post_attn_norm"):
    merged["layers"][nm] = base["layers"][nm] + noise[nm]
  tokens, mask = left_padded_batch(cfg.vocab_size, seed=6)
  tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)
  pos = models.positions_from_mask(mask)

  class Cfg:
    scale = 2.0
  a, _ = fwd(cfg, base, tokens, pos, attn_mask=mask, lora=lora, lora_cfg=Cfg(),
                        norm_noise=noise)
  b, _ = fwd(cfg, merged, tokens, pos, attn_mask=mask)
  c, _ = fwd(cfg, base, tokens, pos, attn_mask=mask)
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=5e-5)
  assert np.abs(np.asarray(a) - np.asarray(c)).max() > 1e-2


def test_trainable_norms_in_lora_replace_base_norms():
  _, cfg, base = _model("qwen2", False)
  new_norm = base["layers"]["input_norm"] * 1.5
  tokens = jnp.asarray(left_padded_batch(cfg.vocab_size)[0])
  pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  a, _ = fwd(cfg, base, tokens, pos, lora={"layers": {"input_norm": new_norm}})
  swapped = {**base, "layers": {**base["layers"], "input_norm": new_norm}}
  b, _ = fwd(cfg, swapped, tokens, pos)
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_token_logprobs_and_entropy_match_full_log_softmax():
  _, cfg, base = _model("llama", True)
  tokens, mask = left_padded_batch(cfg.vocab_size, seed=7)
  tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)
  pos = models.positions_from_mask(mask)
  logits, _ = fwd(cfg, base, tokens, pos, attn_mask=mask)
  temp = 0.7
  logp = np.asarray(jax.nn.log_softmax(np.asarray(logits, np.float64) / temp, -1))
  ref_lp = np.take_along_axis(logp[:, :-1], np.asarray(tokens)[:, 1:, None], -1)[..., 0]
  ref_ent = -(np.exp(logp) * logp).sum(-1)[:, :-1]
  lp, ent = jax.jit(lambda b: models.token_logprobs(cfg, b, tokens, pos, attn_mask=mask, chunk_size=5,
                                                    temperature=temp))(base)
  assert lp.shape == ent.shape == tokens.shape
  np.testing.assert_allclose(np.asarray(lp)[:, 1:], ref_lp, atol=2e-5)
  np.testing.assert_allclose(np.asarray(ent)[:, 1:], ref_ent, atol=2e-5)
  assert (np.asarray(lp)[:, 0] == 0).all() and (np.asarray(ent)[:, 0] == 0).all()


def test_token_logprobs_gradient_wrt_lora_matches_unchunked_no_remat():
  """Chunked lm_head, query-chunked attention and remat give the plain forward's value and gradient."""
  _, cfg, base = _model("qwen2", True)
  qbase = models.quantize_base(base, "nvfp4")
  lora = _random_lora(cfg, jax.random.key(4), targets=(("attn", "q"), ("mlp", "down")))
  tokens, mask = left_padded_batch(cfg.vocab_size, seed=8)
  tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)
  pos = models.positions_from_mask(mask)
  weights = mask[:, 1:].astype(jnp.float32)

  def loss_chunked(lo):
    lp, ent = models.token_logprobs(cfg, qbase, tokens, pos, attn_mask=mask, lora=lo, lora_cfg=0.5,
                                    chunk_size=4, remat=True, attn_chunk=5)
    return jnp.sum((lp[:, 1:] + 0.1 * ent[:, 1:]) * weights)

  def loss_plain(lo):
    logits, _ = fwd(cfg, qbase, tokens, pos, attn_mask=mask, lora=lo, lora_cfg=0.5)
    logp = jax.nn.log_softmax(logits, -1)[:, :-1]
    lp = jnp.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
    ent = -jnp.sum(jnp.exp(logp) * logp, -1)
    return jnp.sum((lp + 0.1 * ent) * weights)

  v1, g1 = jax.jit(jax.value_and_grad(loss_chunked))(lora)
  v2, g2 = jax.jit(jax.value_and_grad(loss_plain))(lora)
  np.testing.assert_allclose(float(v1), float(v2), rtol=1e-5)
  for a, b in zip(jax.tree_util.tree_leaves(g1), jax.tree_util.tree_leaves(g2)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-4)
  assert max(float(jnp.abs(x).max()) for x in jax.tree_util.tree_leaves(g1)) > 1e-3


def test_bf16_compute_close_to_float32():
  _, cfg, base = _model("qwen3", False)
  cfg16 = cfg.replace(dtype="bfloat16")
  base16 = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), base)
  tokens, mask = left_padded_batch(cfg.vocab_size, seed=9)
  tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)
  pos = models.positions_from_mask(mask)
  a, _ = fwd(cfg, base, tokens, pos, attn_mask=mask)
  b, _ = fwd(cfg16, base16, tokens, pos, attn_mask=mask)
  assert b.dtype == jnp.float32
  real = np.asarray(mask).astype(bool)
  err = np.abs(np.asarray(a) - np.asarray(b))[real]
  assert 0 < err.max() < 0.1


def test_linear_dispatch_numpy_reference():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(3, 32)).astype(np.float32)
  w = rng.normal(size=(32, 16)).astype(np.float32)
  a = rng.normal(size=(32, 2)).astype(np.float32)
  b = rng.normal(size=(2, 16)).astype(np.float32)
  bias = rng.normal(size=(16,)).astype(np.float32)
  y = models.linear(jnp.asarray(x), jnp.asarray(w), bias=jnp.asarray(bias),
                    lora={"a": jnp.asarray(a), "b": jnp.asarray(b)}, lora_scale=0.25)
  ref = x.astype(np.float64) @ w + bias + 0.25 * (x.astype(np.float64) @ a) @ b
  np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-4)
  q = nvfp4.quantize(w)
  yq = models.linear(jnp.asarray(x), q)
  np.testing.assert_allclose(np.asarray(yq), x.astype(np.float64) @ np.asarray(nvfp4.dequantize(q), np.float64),
                             rtol=1e-5, atol=1e-4)
  with pytest.raises(TypeError, match="unsupported weight type"):
    models.linear(jnp.asarray(x), jnp.zeros((32, 16), jnp.int32))
  with pytest.raises(ValueError, match="K=32"):
    models.linear(jnp.asarray(x), jnp.asarray(w[:16]))


def test_remat_and_init_params_shapes():
  cfg = models.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3,
                           num_heads=4, num_kv_heads=1, head_dim=8, dtype="float32",
                           architecture="Qwen3ForCausalLM", qk_norm=True)
  base = models.init_params(cfg, jax.random.key(0), dtype=jnp.float32)
  assert base["layers"]["attn"]["k"].shape == (3, 32, 8)
  assert base["layers"]["mlp"]["down"].shape == (3, 48, 32)
  assert "lm_head" in base and base["layers"]["attn"]["q_norm"].shape == (3, 8)
  tokens = jnp.arange(10, dtype=jnp.int32).reshape(2, 5)
  pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
  a, _ = fwd(cfg, base, tokens, pos, remat=True)
  b, _ = fwd(cfg, base, tokens, pos, remat=False)
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
  with pytest.raises(ValueError, match="positions"):
    fwd(cfg, base, tokens, pos[:, :3])
  # an id beyond the table read NaN (JAX's gather fills out of bounds), a negative one another token, a float
  # id was truncated: each is refused where the ids are concrete
  with pytest.raises(ValueError, match=r"tokens hold 1 id\(s\) outside \[0, 64\) \(the vocabulary\), e.g. 64"):
    models.forward(cfg, base, tokens.at[1, 2].set(64), pos)
  with pytest.raises(ValueError, match="e.g. -3"):
    models.token_logprobs(cfg, base, tokens.at[0, 0].set(-3), pos)
  with pytest.raises(TypeError, match="tokens must hold integer ids, got dtype float32"):
    fwd(cfg, base, tokens.astype(jnp.float32), pos)  # the dtype is known under jit too
  for tau in (0.0, -1.0, float("nan")):  # 0 gave NaN log-probs, -1 wrong ones
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
      models.token_logprobs(cfg, base, tokens, pos, temperature=tau)
  lp, _ = jax.jit(lambda t: models.token_logprobs(cfg, base, t, pos, temperature=0.5))(tokens)  # traced: unchecked
  ref, _ = models.token_logprobs(cfg, base, tokens, pos, temperature=0.5)
  np.testing.assert_allclose(np.asarray(lp), np.asarray(ref), rtol=1e-5, atol=1e-6)


def test_summarize_lists_formats_and_bytes():
  _, cfg, base = _model("qwen2", False)
  text = models.summarize(models.quantize_base(base, "nvfp4"))
  assert "layers/attn/q" in text and "NVFP4Tensor" in text and "[2, 64, 64]" in text
  assert "embed" in text and "float32 [160, 64]" in text and "total" in text


def test_positions_from_mask():
  mask = jnp.asarray([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
  np.testing.assert_array_equal(np.asarray(models.positions_from_mask(mask)),
                                [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]])


# ----------------------------------------------------------------------------- config

def _fixture_config(fixtures_dir, name):
  return json.loads((fixtures_dir / "configs" / name / "config.json").read_text())


def test_config_from_real_qwen25_7b(fixtures_dir):
  cfg = models.ModelConfig.from_hf(_fixture_config(fixtures_dir, "qwen2.5-7b-base"))
  assert (cfg.architecture, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
          cfg.head_dim, cfg.intermediate_size, cfg.vocab_size) == (
              "Qwen2ForCausalLM", 3584, 28, 28, 4, 128, 18944, 152064)
  assert cfg.attention_bias and not cfg.qk_norm and not cfg.tie_word_embeddings
  assert cfg.rope_theta == 1e6 and cfg.rms_norm_eps == 1e-6 and cfg.rope_scaling is None
  hash(cfg)


def test_config_from_real_qwen3_8b(fixtures_dir):
  cfg = models.ModelConfig.from_hf(_fixture_config(fixtures_dir, "qwen3-8b"))
  assert (cfg.architecture, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
          cfg.head_dim) == ("Qwen3ForCausalLM", 4096, 36, 32, 8, 128)
  assert cfg.qk_norm and not cfg.attention_bias and cfg.rope_theta == 1e6
  assert cfg.q_dim == 4096 and cfg.kv_dim == 1024


def test_config_from_real_llama32(fixtures_dir):
  cfg = models.ModelConfig.from_hf(_fixture_config(fixtures_dir, "llama-3.2-1b"))
  assert cfg.tie_word_embeddings and cfg.rms_norm_eps == 1e-5 and cfg.rope_theta == 500000.0
  sc = cfg.rope_scaling_dict
  assert sc["rope_type"] == "llama3" and sc["factor"] == 32.0
  assert sc["original_max_position_embeddings"] == 8192
  cfg3 = models.ModelConfig.from_hf(_fixture_config(fixtures_dir, "llama-3.2-3b"))
  assert (cfg3.hidden_size, cfg3.num_layers, cfg3.num_kv_heads) == (3072, 28, 8)


def test_config_defaults_and_errors():
  base = dict(architectures=["LlamaForCausalLM"], vocab_size=10, hidden_size=32,
              intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
  cfg = models.ModelConfig.from_hf(base)
  assert cfg.rope_theta == 10000.0 and cfg.num_kv_heads == 4 and cfg.head_dim == 8
  # without head_dim, transformers' defaults: Qwen3Config's 128, hidden / heads for Qwen2 and Llama
  assert models.ModelConfig.from_hf({**base, "architectures": ["Qwen3ForCausalLM"]}).head_dim == 128
  assert models.ModelConfig.from_hf({**base, "architectures": ["Qwen2ForCausalLM"]}).head_dim == 8
  # transformers>=5 layout
  cfg5 = models.ModelConfig.from_hf({**base, "rope_parameters": {"rope_theta": 123.0, "rope_type": "default"}})
  assert cfg5.rope_theta == 123.0 and cfg5.rope_scaling is None
  with pytest.raises(ValueError, match="supported: Qwen2ForCausalLM, Qwen3ForCausalLM, LlamaForCausalLM"):
    models.ModelConfig.from_hf({**base, "architectures": ["GemmaForCausalLM"]})
  with pytest.raises(ValueError, match="yarn"):
    models.ModelConfig.from_hf({**base, "rope_scaling": {"type": "yarn", "factor": 4.0}})
  with pytest.raises(ValueError, match="use_sliding_window"):
    models.ModelConfig.from_hf({**base, "use_sliding_window": True})
  # a llama3 scaling without its frequency factors is refused when read (it was a KeyError at the first forward)
  with pytest.raises(ValueError, match=r"lacks \['low_freq_factor', 'original_max_position_embeddings'\]"):
    models.ModelConfig.from_hf({**base, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                                         "high_freq_factor": 4.0}})
  with pytest.raises(ValueError, match="num_kv_heads"):
    models.ModelConfig.from_hf({**base, "num_key_value_heads": 3})


@pytest.mark.parametrize("fused,lora_kind,in_kernel", [(True, None, False), (True, "fused", False), (True, "fused", True),
                                                      (True, "fused", "xa"), (True, "per_part", False),
                                                      (False, "per_part", False), (True, None, "layer_end"),
                                                      (True, "fused", "layer_end"), (True, None, "post_attention"),
                                                      (True, "fused", "post_attention"),
                                                      (True, "fused_norms", "post_attention")])
def test_decode_step_accumulator_regions(monkeypatch, fused, lora_kind, in_kernel):
  """The decode step's 4-bit projections run into one zeroed buffer a layer (layers.Accumulator),
  each in its own region. The kernel is replaced by an XLA stand-in that adds x @ W into its region
  (so overlapping or unzeroed regions would change the result): the logits equal the plain path's
  exactly, and the regions lie back to back and fill the buffer (the attention kernel reads q/k/v in place
  from the buffer's head unless XLA adds an adapter's delta to it). Which projections take it: the
  fused q/k/v when the fused decode attention runs (no per-part q/k/v adapters), o, the fused
  gate/up without per-part adapters (else unfused gate and up, one region each), and down. With
  ``in_kernel`` the stand-in also takes the adapters' up-projection (``lora=(x @ A, B, scale)``, B the
  layer stack read at the call's index, as the Gluon kernel does): the same logits, and every
  projection with an adapter passes it. With ``"xa"`` (w4_gluon.LORA_XA) x @ A comes as float32 partial
  products from a stand-in of w4_gluon.lora_xa, which gets the adapters' A stacks and the layer index.
  With ``"layer_end"`` (decoder.FUSED_LAYER_END; AQN noise on the norms) each layer ends with a stand-in
  of pallas_kernels.residual_norm.residual_rms_norm: the residual add of the down-projection read from its
  region (or, with an adapter XLA adds, from the product XLA finished), the next input norm (the final norm
  after the last layer) and the next layer's zeroed buffer, which that layer's projections then use: the
  same logits. ``"post_attention"`` (with decoder.FUSED_POST_ATTENTION too) also runs the o residual and the
  post-attention norm as that stand-in, o read from its region (not with an adapter on o that XLA adds).
  ``"fused_norms"``: the adapter also trains the norms (LoRAConfig.train_norms, scales moved off the base's): the
  fused layer ends read the trained stacks, with the same logits."""
  import pallas_kernels
  from pallas_kernels import decode_attention as da
  from pallas_kernels import residual_norm
  from qerl_jax import lora as lora_lib
  from qerl_jax.models import decoder
  cfg = models.ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=16, attention_bias=True, dtype="bfloat16")
  base = models.init_params(cfg, jax.random.key(0), dtype=jnp.bfloat16, std=0.1)
  base = models.quantize_base(models.fuse_projections(base) if fused else base, "nvfp4")
  kw = {}
  if lora_kind:
    norms = lora_kind == "fused_norms"  # (no adapter on o there, so the post-attention kernel reads o's region)
    c = lora_lib.LoRAConfig(r=4, lora_alpha=8.0, target_modules=("q", "v", "up", "down") if norms else
                            ("q", "v", "o", "up", "down"), train_norms=norms)
    lora = lora_lib.init_lora(jax.random.key(5), cfg, c, base=base if c.train_norms else None)
    lora = jax.tree.map(lambda a: a + 0.05 * jax.random.normal(jax.random.key(a.size), a.shape, a.dtype), lora)
    kw = dict(lora=models.fuse_adapter(lora, cfg, dtype=jnp.bfloat16) if lora_kind != "per_part" else lora, lora_cfg=c)
  fused_end = in_kernel in ("layer_end", "post_attention")
  if fused_end:  # AQN noise on the norms (the fused layer end reads the input norm's stack)
    kw["norm_noise"] = {n: 0.05 * jax.random.normal(jax.random.key(i), (cfg.num_layers, cfg.hidden_size))
                        for i, n in enumerate(("input_norm", "post_attn_norm"))}
  tokens, mask = (jnp.asarray(a) for a in left_padded_batch(cfg.vocab_size, seed=5))
  monkeypatch.setattr(da, "auto_backend", lambda dtype: "interpret")  # the fused decode attention (q/k/v)
  end_calls = []  # (y's source size, offset, zero_size) of every fused layer end

  def end_stand_in(h, src, offset, w_next, index, eps, noise_next=None, *, zero_size=0):
    end_calls.append((src.shape[0], offset, zero_size))
    y = src[offset:offset + h.size].reshape(h.shape)
    out = residual_norm.reference(h, y, w_next[index], eps, None if noise_next is None else noise_next[index])
    return (*out, jnp.zeros((zero_size,), jnp.float32)) if zero_size else out

  monkeypatch.setattr(decoder, "FUSED_LAYER_END", int(fused_end))
  monkeypatch.setattr(decoder, "FUSED_POST_ATTENTION", int(in_kernel == "post_attention"))
  monkeypatch.setattr(residual_norm, "available", lambda: True)
  monkeypatch.setattr(residual_norm, "applies", lambda h, w, noise=None: True)
  monkeypatch.setattr(residual_norm, "residual_rms_norm", end_stand_in)
  regions = []  # (buffer size, offset, size) of every call, in trace order

  lora_calls = []  # B's shape of every call that passed an adapter

  def stand_in(x, w, acc, offset, *, index=None, size=None, lora=None):
    y = pallas_kernels.quantized_matmul(x, w, index=index, out_dtype=jnp.float32).reshape(-1)
    if lora is not None:
      xa, b_, scale = lora
      lora_calls.append(b_.shape)
      xa = xa.sum(0).astype(jnp.bfloat16) if xa.ndim == x.ndim + 1 else xa  # lora_xa's partials
      b_ = b_[index] if b_.ndim == 3 else b_
      y = y + scale * jnp.dot(xa, b_, preferred_element_type=jnp.float32).reshape(-1)
    acc = jnp.zeros((size,), jnp.float32) if acc is None else acc  # the first call makes the buffer
    regions.append((acc.shape[0], offset, y.size))
    acc = jax.lax.dynamic_update_slice(acc, acc[offset:offset + y.size] + y, (offset,))
    return acc[offset:offset + y.size].reshape(*x.shape[:-1], w.shape[1]), acc

  monkeypatch.setattr(pallas_kernels, "accumulate_applies", lambda x, w, index=None: x.shape[-1] == w.shape[0])
  monkeypatch.setattr(pallas_kernels, "quantized_matmul_into", stand_in)
  monkeypatch.setattr(pallas_kernels.matmul, "accumulate_lora_applies",
                      lambda x, w, index, lora: in_kernel in (True, "xa"))
  xa_calls = []  # A's shape of every lora_xa call

  def xa_stand_in(x, a, index=None):  # float32 partial products over K ranges of 64 (lora_xa_shape's count)
    xa_calls.append(a.shape)
    a_l = a[index] if a.ndim == 3 else a
    parts = pallas_kernels.w4_gluon.lora_xa_shape(x, a)[0]
    assert parts == -(-x.shape[1] // 64)
    return jnp.stack([jnp.dot(x[:, 64 * p:64 * p + 64], a_l[64 * p:64 * p + 64], preferred_element_type=jnp.float32)
                      for p in range(parts)])

  monkeypatch.setattr(pallas_kernels.w4_gluon, "LORA_XA", int(in_kernel == "xa"))
  monkeypatch.setattr(pallas_kernels.w4_gluon, "lora_xa_applies", lambda x, a, index=None: True)
  monkeypatch.setattr(pallas_kernels.w4_gluon, "lora_xa", xa_stand_in)
  # No excess precision: XLA rounds every bf16 value where the program does, so that the fused layer end
  # (whose residual sum is a bf16 array) and XLA's fusion (which may keep it in float32) agree bit for bit.
  kw["compiler_options"] = {"xla_allow_excess_precision": False}
  monkeypatch.setattr(decoder, "ACCUMULATE_DECODE", False)
  plain, _ = _decode_all(cfg, base, tokens, mask, n_prefill=6, cache_dtype=jnp.bfloat16, **kw)
  assert not regions  # the switch turns it off
  monkeypatch.setattr(decoder, "ACCUMULATE_DECODE", True)
  qkv_ndim = []  # the append kernel reads q/k/v in place from the buffer's head unless an adapter delta is added
  real_append = da.decode_attention_append
  monkeypatch.setattr(da, "decode_attention_append", lambda *a, **k: qkv_ndim.append(a[0].ndim) or real_append(*a, **k))
  into, _ = _decode_all(cfg, base, tokens, mask, n_prefill=6, cache_dtype=jnp.bfloat16, **kw)
  assert qkv_ndim == ([] if lora_kind == "per_part" else
                      [2] if lora_kind in ("fused", "fused_norms") and in_kernel not in (True, "xa") else [1])
  assert_same_as_on_cpu(into, plain)
  b = tokens.shape[0]
  # one trace of the scanned layer body (prefill takes the plain path): the fused q/k/v (when the
  # decode attention kernel takes it), o, gate/up (fused: one call, else two) and down
  per_part = lora_kind == "per_part"
  per_layer = [cfg.q_dim + 2 * cfg.kv_dim] if fused and not per_part else []
  per_layer += [cfg.hidden_size]
  per_layer += [] if fused and per_part else [2 * cfg.intermediate_size] if fused else [cfg.intermediate_size] * 2
  sizes = [b * n for n in per_layer + [cfg.hidden_size]]
  assert [r[2] for r in regions] == sizes, regions
  assert [r[1] for r in regions] == list(np.cumsum([0] + sizes[:-1]))  # back to back from 0
  assert all(r[0] == sum(sizes) for r in regions)  # and they fill the buffer exactly
  # with the adapter in the kernel: q/k/v (q and v adapted), o, gate/up (up adapted) and down, B stacked [L, R, N]
  r = 4
  assert lora_calls == ([(cfg.num_layers, 2 * r, cfg.q_dim + 2 * cfg.kv_dim), (cfg.num_layers, r, cfg.hidden_size),
                         (cfg.num_layers, r, 2 * cfg.intermediate_size), (cfg.num_layers, r, cfg.hidden_size)]
                        if in_kernel in (True, "xa") else [])
  # the fused layer end (one trace of the layer body): y from the down region at the buffer's end, or with XLA's
  # adapter delta from that product (offset 0); the next buffer as large as this one
  total = sum(sizes)
  end = [(b * cfg.hidden_size, 0, total)] if lora_kind else [(total, total - b * cfg.hidden_size, total)]
  # and with FUSED_POST_ATTENTION first the o residual and the post-attention norm, o from its region (the second)
  post = [(total, sizes[0], 0)] if in_kernel == "post_attention" and lora_kind in (None, "fused_norms") else []
  assert end_calls == (post + end if fused_end else [])
  # with LORA_XA, x @ A of those four from their A stacks [L, K, R]
  assert xa_calls == ([(cfg.num_layers, cfg.hidden_size, 2 * r), (cfg.num_layers, cfg.q_dim, r),
                       (cfg.num_layers, cfg.hidden_size, r), (cfg.num_layers, cfg.intermediate_size, r)]
                      if in_kernel == "xa" else [])


@pytest.mark.parametrize("lora_kind", [None, "fused"])
def test_decode_step_bf16_qkv_route(monkeypatch, lora_kind):
  """decoder.FUSED_ATTENTION_BF16_QKV: a fused-attention decode step without an accumulator whose q/k/v weight is on
  the large-M bf16 route takes q/k/v from layers.linear (bias and adapter delta as the GEMM's bf16 addend) and the
  append kernel gets no bias. Without an adapter that is bit for bit the float32 route's q/k/v (the bias is bf16,
  so adding it before or after the one rounding is the same sum); with one, the delta is rounded to bf16 first,
  so the logits agree to bf16 rounding, and they differ from the adapter-free ones by far more than that."""
  from pallas_kernels import decode_attention as da
  from pallas_kernels import matmul
  from qerl_jax import lora as lora_lib
  from qerl_jax.models import decoder
  cfg = models.ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=16, attention_bias=True, dtype="bfloat16")
  base = models.init_params(cfg, jax.random.key(0), dtype=jnp.bfloat16, std=0.1)
  base["layers"]["attn"]["q_bias"] = 0.5 * jax.random.normal(jax.random.key(9), base["layers"]["attn"]["q_bias"].shape,
                                                             jnp.bfloat16)  # a bias that matters
  base = models.quantize_base(models.fuse_projections(base), "nvfp4")
  qkv_n = cfg.q_dim + 2 * cfg.kv_dim
  kw = {"compiler_options": {"xla_allow_excess_precision": False}}
  if lora_kind:
    c = lora_lib.LoRAConfig(r=4, lora_alpha=8.0, target_modules=("q", "v", "o", "up", "down"))
    lora = lora_lib.init_lora(jax.random.key(5), cfg, c)
    lora = jax.tree.map(lambda a: a + 0.2 * jax.random.normal(jax.random.key(a.size), a.shape, a.dtype), lora)
    kw.update(lora=models.fuse_adapter(lora, cfg, dtype=jnp.bfloat16), lora_cfg=c)
  tokens, mask = (jnp.asarray(a) for a in left_padded_batch(cfg.vocab_size, seed=5))
  monkeypatch.setattr(da, "auto_backend", lambda dtype: "interpret")  # the fused decode attention
  monkeypatch.setattr(decoder, "ACCUMULATE_DECODE", False)  # as above ACCUMULATE_MAX_ROWS rows
  monkeypatch.setattr(decoder, "FUSED_ATTENTION_BF16_QKV_MIN_ROWS", 1)  # this batch's few rows as if past the GEMV's
  # the q/k/v weight on the large-M route (as at 256 rows on a GPU), the other weights as they were
  monkeypatch.setattr(matmul, "dense_path_applies", lambda x, w, index=None: w.shape[-1] == qkv_n)
  biases = []  # the bias the append kernel got, each trace
  real_append = da.decode_attention_append
  monkeypatch.setattr(da, "decode_attention_append",
                      lambda *a, **k: biases.append(a[1] is not None) or real_append(*a, **k))
  monkeypatch.setattr(decoder, "FUSED_ATTENTION_BF16_QKV", 0)
  f32_route, _ = _decode_all(cfg, base, tokens, mask, n_prefill=6, cache_dtype=jnp.bfloat16, **kw)
  assert biases and all(biases)
  biases.clear()
  monkeypatch.setattr(decoder, "FUSED_ATTENTION_BF16_QKV", 1)
  bf16_route, _ = _decode_all(cfg, base, tokens, mask, n_prefill=6, cache_dtype=jnp.bfloat16, **kw)
  assert biases and not any(biases)  # the route ran: the bias went into the GEMM's addend
  real = np.asarray(mask, bool)
  got, ref = np.asarray(bf16_route, np.float32)[real], np.asarray(f32_route, np.float32)[real]
  assert np.isfinite(got).all()
  if lora_kind is None:
    np.testing.assert_array_equal(got, ref)
  else:
    scale = np.abs(ref).max()
    assert np.abs(got - ref).max() < 0.03 * scale
    kw.pop("lora"), kw.pop("lora_cfg")
    plain, _ = _decode_all(cfg, base, tokens, mask, n_prefill=6, cache_dtype=jnp.bfloat16, **kw)
    assert np.abs(np.asarray(plain, np.float32)[real] - got).max() > 0.1 * scale  # the adapter's delta is there


def test_bf16_qkv_route_starts_past_the_decode_gemv(monkeypatch):
  """decoder.FUSED_ATTENTION_BF16_QKV applies from FUSED_ATTENTION_BF16_QKV_MIN_ROWS (129) rows, counted over x's
  leading dims, only without an accumulator and only where the weight is on the large-M route; 0 turns it off."""
  from pallas_kernels import w4_gluon
  from qerl_jax.models import decoder, layers
  w = object()
  on_route = {"yes": True}
  monkeypatch.setattr(layers, "bf16_epilogue_applies", lambda x, w_: on_route["yes"])
  x = lambda *shape: jax.ShapeDtypeStruct((*shape, 3584), jnp.bfloat16)
  assert decoder.FUSED_ATTENTION_BF16_QKV == 1 and decoder.FUSED_ATTENTION_BF16_QKV_MIN_ROWS == 129
  assert decoder.FUSED_ATTENTION_BF16_QKV_MIN_ROWS == w4_gluon.MAX_M + 1  # the decode GEMV's rows end at 128
  assert [decoder._bf16_qkv(x(m), w, None) for m in (1, 32, 128, 129, 256)] == [False] * 3 + [True] * 2
  assert decoder._bf16_qkv(x(129, 1), w, None) and not decoder._bf16_qkv(x(64, 2), w, None)
  assert not decoder._bf16_qkv(x(256), w, acc=jnp.zeros(()))
  on_route["yes"] = False
  assert not decoder._bf16_qkv(x(256), w, None)
  on_route["yes"] = True
  monkeypatch.setattr(decoder, "FUSED_ATTENTION_BF16_QKV", 0)
  assert not decoder._bf16_qkv(x(256), w, None)


# ------------------------------------------------------ the large-M bf16 route (layers.BF16_EPILOGUE) ---

def _bf16_dots(fn, *args) -> int:
  """How many dot_general equations of ``fn``'s jaxpr (nested ones included: they print inline) ask for a bf16
  result (the only primitive here with that parameter)."""
  text = str(jax.make_jaxpr(fn)(*args))
  return text.count("preferred_element_type=bfloat16")


@pytest.fixture
def dense_route(monkeypatch):
  """As on a GPU's large-M path: pallas_kernels.matmul.dense_path_applies holds for every 4-bit weight (on CPU the
  4-bit product is then the XLA reference's, rounded to bf16), so the bf16 route of layers.linear runs."""
  from pallas_kernels import matmul
  monkeypatch.setattr(matmul, "dense_path_applies", lambda x, w, index=None: True)


def _rel(got, ref):
  got = np.asarray(got, np.float64)
  return np.linalg.norm(got - ref) / np.linalg.norm(ref)


def test_bf16_route_linear_matches_float64(dense_route, monkeypatch):
  """linear's bf16 route (4-bit product, bias and LoRA delta in the GEMM's bf16 epilogue) against float64 on the
  dequantized weight: every term counts (each one's contribution is far above the tolerance)."""
  from qerl_jax.models import layers
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.normal(size=(4, 24, 64)), jnp.bfloat16)
  q = nvfp4.quantize(jnp.asarray(rng.normal(size=(64, 48)), jnp.float32))
  bias = jnp.asarray(rng.normal(size=(48,)), jnp.bfloat16)
  lora = {"a": jnp.asarray(0.3 * rng.normal(size=(64, 4)), jnp.float32),
          "b": jnp.asarray(rng.normal(size=(4, 48)), jnp.float32)}
  x64, w64 = np.asarray(x, np.float64), np.asarray(nvfp4.dequantize(q), np.float64)
  base = x64 @ w64
  ref = base + np.asarray(bias, np.float64) + 2.0 * (x64 @ np.asarray(lora["a"], np.float64)) @ np.asarray(
      lora["b"], np.float64)
  for term in (base, ref - base):
    assert np.linalg.norm(term) > 0.2 * np.linalg.norm(ref)
  f = jax.jit(lambda x: layers.linear(x, q, bias=bias, lora=lora, lora_scale=2.0))
  y = f(x)
  assert y.dtype == jnp.bfloat16 and y.shape == (4, 24, 48)
  assert np.isfinite(np.asarray(y, np.float32)).all()
  assert _rel(y, ref) < 1e-2  # bf16 rounding (2^-8 relative at most) of x @ A, the delta and the sum
  assert _bf16_dots(f, x) == 1  # the delta's GEMM writes bf16
  monkeypatch.setattr(layers, "BF16_EPILOGUE", False)
  g = jax.jit(lambda x: layers.linear(x, q, bias=bias, lora=lora, lora_scale=2.0))
  assert _bf16_dots(g, x) == 0 and _rel(g(x), ref) < 1e-2
  # no adapter: the product with its bias only
  y0 = layers.linear(x, q, bias=bias)
  assert _rel(y0, base + np.asarray(bias, np.float64)) < 1e-2


@pytest.mark.parametrize("fused", [False, True])
def test_bf16_route_fused_linear_matches_float64(dense_route, fused):
  """fused_linear's bf16 route: per-part adapters (one part without) side by side, or one fused adapter, and the
  fused bias, each part against float64."""
  from qerl_jax.models import layers
  rng = np.random.default_rng(4)
  sizes = (32, 16, 16)
  x = jnp.asarray(rng.normal(size=(80, 64)), jnp.bfloat16)
  w = rng.normal(size=(64, 64))
  q = nvfp4.quantize(jnp.asarray(w, jnp.float32))
  bias = jnp.asarray(rng.normal(size=(64,)), jnp.bfloat16)
  x64 = np.asarray(x, np.float64)
  ref = x64 @ np.asarray(nvfp4.dequantize(q), np.float64) + np.asarray(bias, np.float64)
  if fused:
    ab = {"a": jnp.asarray(0.3 * rng.normal(size=(64, 6)), jnp.float32),
          "b": jnp.asarray(rng.normal(size=(6, 64)), jnp.float32)}
    ref = ref + 0.5 * (x64 @ np.asarray(ab["a"], np.float64)) @ np.asarray(ab["b"], np.float64)
    kw = {"lora": ab}
  else:
    loras = []
    for size in sizes:
      loras.append({"a": jnp.asarray(0.3 * rng.normal(size=(64, 4)), jnp.float32),
                    "b": jnp.asarray(rng.normal(size=(4, size)), jnp.float32)})
    loras[1] = None
    deltas = [np.zeros((80, s)) if l is None else
              0.5 * (x64 @ np.asarray(l["a"], np.float64)) @ np.asarray(l["b"], np.float64)
              for l, s in zip(loras, sizes)]
    ref = ref + np.concatenate(deltas, axis=1)
    kw = {"loras": tuple(loras)}
  parts = layers.fused_linear(x, q, sizes, bias=bias, lora_scale=0.5, **kw)
  # one bf16 delta GEMM for the whole output (per-part adapters as one block-diagonal adapter)
  assert _bf16_dots(lambda x: layers.fused_linear(x, q, sizes, bias=bias, lora_scale=0.5, **kw), x) == 1
  start = 0
  for part, size in zip(parts, sizes):
    assert part.shape == (80, size) and part.dtype == jnp.bfloat16
    assert _rel(part, ref[:, start:start + size]) < 1e-2
    start += size
  with pytest.raises(ValueError, match="add up to 48"):
    layers.fused_linear(x, q, (16, 16, 16), bias=bias, lora_scale=0.5, **kw)
  if not fused:
    with pytest.raises(ValueError, match=re.escape("fused_linear: part 2 has a (64, 4), b (4, 16); expected "
                                                   "a [..., K, r] and b [..., r, 8]")):
      layers.fused_linear(x, q, (32, 24, 8), bias=bias, lora_scale=0.5, **kw)


def test_bf16_route_model_forward_and_lora_gradient(dense_route, monkeypatch):
  """The whole NVFP4 model (bf16, per-part adapters, q/k/v bias) through the bf16 route: its log-probs and the
  adapter's gradient are as close to the float32 model's on the dequantized weights as the float32 route's are."""
  from qerl_jax import lora as L
  from qerl_jax.models import layers
  cfg = models.ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=16, tie_word_embeddings=False, attention_bias=True)
  base = models.quantize_base(models.init_params(cfg, jax.random.key(0), dtype=jnp.bfloat16, std=0.1), "nvfp4")
  c = L.LoRAConfig(r=4, lora_alpha=8)
  adapter = L.init_lora(jax.random.key(1), cfg, c, base)
  adapter = jax.tree.map(lambda t: t + 0.05 * jax.random.normal(jax.random.key(2), t.shape, t.dtype), adapter)
  tokens = jax.random.randint(jax.random.key(3), (3, 24), 0, 96, jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(24, dtype=jnp.int32), (3, 24))

  def run(cfg, base):
    def loss(ad):
      lp, _ = models.token_logprobs(cfg, base, tokens, pos, lora=ad, lora_cfg=c, remat=True)
      return jnp.sum(lp), lp
    (_, lp), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(adapter)
    return np.asarray(lp, np.float64), jax.tree.map(lambda t: np.asarray(t, np.float64), g)

  cfg32 = cfg.replace(dtype="float32")
  lp_ref, g_ref = run(cfg32, models.dequantize_base(base, jnp.float32))
  errs = {}
  for route in (True, False):
    monkeypatch.setattr(layers, "BF16_EPILOGUE", route)
    lp, g = run(cfg, base)
    errs[route] = (_rel(lp, lp_ref), max(_rel(a, b) for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref))))
  for route in (True, False):
    assert errs[route][0] < 2e-2 and errs[route][1] < 6e-2, errs
  assert errs[True][0] < 1.5 * errs[False][0] + 1e-3 and errs[True][1] < 1.5 * errs[False][1] + 1e-2, errs


@pytest.mark.gpu
def test_gpu_narrow_route_linear_matches_float64(monkeypatch):
  """With matmul.GLUON_MM_NARROW_MODEL = "1" the model's linears take the bf16 route at 32 < M <= 128 rows on the
  large-M forward's narrow tiles (bias and adapter delta in its epilogue), against float64: a weight over
  NARROW_SMALL_WEIGHTS values at M = 40, 64, 100, and fused parts with per-part adapters at M = 64. Off ("0")
  the route is not taken there."""
  from pallas_kernels import matmul, w4_gluon_mm
  from qerl_jax.models import layers
  rng = np.random.default_rng(8)
  k, n = 3584, 5120  # 18.4M values: over NARROW_SMALL_WEIGHTS, so the narrow tiles take it from M = 33
  w = jnp.asarray(0.02 * rng.normal(size=(k, n)), jnp.float32)
  q = nvfp4.to_decode_order(nvfp4.quantize(w))
  deq = np.asarray(nvfp4.dequantize(nvfp4.quantize(w)), np.float64)
  bias = jnp.asarray(rng.normal(size=(n,)), jnp.bfloat16)
  lora = {"a": jnp.asarray(0.02 * rng.normal(size=(k, 16)), jnp.float32),
          "b": jnp.asarray(rng.normal(size=(16, n)), jnp.float32)}
  if not w4_gluon_mm.applies(64, q, jnp.bfloat16):
    pytest.skip("the large-M Gluon forward does not apply on this GPU (sm_90 and the FFI launcher)")
  monkeypatch.setattr(matmul, "GLUON_MM_NARROW_MODEL", "0")
  assert not matmul.dense_path_applies(jax.ShapeDtypeStruct((64, k), jnp.bfloat16), q)
  monkeypatch.setattr(matmul, "GLUON_MM_NARROW_MODEL", "1")
  for m in (40, 64, 100):
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
    assert matmul.dense_path_applies(x, q)
    y = jax.jit(lambda x: layers.linear(x, q, bias=bias, lora=lora, lora_scale=2.0))(x)
    x64 = np.asarray(x, np.float64)
    ref = (x64 @ deq + np.asarray(bias, np.float64)
           + 2.0 * (x64 @ np.asarray(lora["a"], np.float64)) @ np.asarray(lora["b"], np.float64))
    assert y.dtype == jnp.bfloat16 and np.isfinite(np.asarray(y, np.float32)).all()
    assert _rel(y, ref) < 1e-2, (m, _rel(y, ref))
  sizes = (2560, 2560)  # gate/up-like halves, an adapter on the first only
  loras = ({"a": lora["a"], "b": lora["b"][:, :2560]}, None)
  parts = jax.jit(lambda x: layers.fused_linear(x, q, sizes, loras=loras, lora_scale=2.0))(x[:64])
  x64 = np.asarray(x[:64], np.float64)
  ref = x64 @ deq
  ref[:, :2560] += 2.0 * (x64 @ np.asarray(lora["a"], np.float64)) @ np.asarray(lora["b"][:, :2560], np.float64)
  for part, lo, hi in zip(parts, (0, 2560), (2560, 5120)):
    assert part.dtype == jnp.bfloat16 and _rel(part, ref[:, lo:hi]) < 1e-2, (lo, _rel(part, ref[:, lo:hi]))


@pytest.mark.gpu
@pytest.mark.parametrize("quant", ["nvfp4", "nf4"])
def test_gpu_bf16_route_linear_matches_float64(quant):
  """On the GPU the bf16 route runs where the large-M path does (more rows than the fused kernel takes, past the
  Gluon GEMV's 128): the dequantized weight's GEMM writes bf16 with the bias and adapter delta added, against
  float64 (7B q/k/v width, ragged rows)."""
  from pallas_kernels import matmul
  from qerl_jax import nf4
  from qerl_jax.models import layers
  rng = np.random.default_rng(5)
  k, n = 3584, 4608
  w = jnp.asarray(0.02 * rng.normal(size=(k, n)), jnp.float32)
  q = nvfp4.quantize(w) if quant == "nvfp4" else nf4.quantize(w)
  deq = nvfp4.dequantize(q) if quant == "nvfp4" else nf4.dequantize(q)
  bias = jnp.asarray(rng.normal(size=(n,)), jnp.bfloat16)
  lora = {"a": jnp.asarray(0.02 * rng.normal(size=(k, 16)), jnp.float32),
          "b": jnp.asarray(rng.normal(size=(16, n)), jnp.float32)}
  assert not matmul.dense_path_applies(jax.ShapeDtypeStruct((8, k), jnp.bfloat16), q)
  assert not matmul.dense_path_applies(jax.ShapeDtypeStruct((300, k), jnp.float32), q)
  for m in (129, 300, 2048):
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
    assert matmul.dense_path_applies(x, q)
    y = jax.jit(lambda x: layers.linear(x, q, bias=bias, lora=lora, lora_scale=2.0))(x)
    x64 = np.asarray(x, np.float64)
    ref = (x64 @ np.asarray(deq, np.float64) + np.asarray(bias, np.float64)
           + 2.0 * (x64 @ np.asarray(lora["a"], np.float64)) @ np.asarray(lora["b"], np.float64))
    assert y.dtype == jnp.bfloat16 and np.isfinite(np.asarray(y, np.float32)).all()
    err = _rel(y, ref)
    assert err < 1e-2, (m, err)
  # q/k/v fused, per-part adapters (k without), at 2048 rows: one block-diagonal delta GEMM
  sizes = (3584, 512, 512)
  loras = ({"a": lora["a"], "b": lora["b"][:, :3584]}, None, {"a": lora["a"][:, :8], "b": lora["b"][:8, 4096:]})
  parts = jax.jit(lambda x: layers.fused_linear(x, q, sizes, bias=bias, loras=loras, lora_scale=2.0))(x)
  delta = np.zeros((x.shape[0], n))
  delta[:, :3584] = 2.0 * (x64 @ np.asarray(lora["a"], np.float64)) @ np.asarray(lora["b"][:, :3584], np.float64)
  delta[:, 4096:] = 2.0 * (x64 @ np.asarray(lora["a"][:, :8], np.float64)) @ np.asarray(lora["b"][:8, 4096:],
                                                                                         np.float64)
  ref = x64 @ np.asarray(deq, np.float64) + np.asarray(bias, np.float64) + delta
  for part, lo, hi in zip(parts, (0, 3584, 4096), (3584, 4096, 4608)):
    err = _rel(part, ref[:, lo:hi])
    assert part.dtype == jnp.bfloat16 and err < 1e-2, (lo, err)


def test_bf16_epilogue_env_flag(monkeypatch):
  from qerl_jax.models import layers
  monkeypatch.setenv("QERL_BF16_EPILOGUE", "0")
  assert layers._env_flag("QERL_BF16_EPILOGUE", "1") is False
  monkeypatch.setenv("QERL_BF16_EPILOGUE", "yes")
  with pytest.raises(ValueError, match="QERL_BF16_EPILOGUE is 'yes'; expected '0' or '1'"):
    layers._env_flag("QERL_BF16_EPILOGUE", "1")
  monkeypatch.delenv("QERL_BF16_EPILOGUE")
  assert layers._env_flag("QERL_BF16_EPILOGUE", "1") is True


@pytest.mark.parametrize("fuse_adapter", [False, True])
def test_bf16_route_prefill_with_cache(dense_route, monkeypatch, fuse_adapter):
  """Prefill against a KV cache (the layer scan reads 4-bit weights and adapter stacks in place, as
  layers.StackedWeight) through the bf16 route, with the trainer's fused projections and either per-part adapters or
  the sampler's fused one: its logits are as close to the float32 model's (dequantized weights, no cache) as the
  float32 route's, and the route ran (bf16 delta GEMMs in the jaxpr)."""
  from qerl_jax import lora as L
  from qerl_jax.models import layers
  cfg = models.ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=16, tie_word_embeddings=False, attention_bias=True)
  dense = models.fuse_projections(models.init_params(cfg, jax.random.key(0), dtype=jnp.bfloat16, std=0.1))
  base = models.quantize_base(dense, "nvfp4")
  c = L.LoRAConfig(r=4, lora_alpha=8)
  adapter = L.init_lora(jax.random.key(1), cfg, c)
  adapter = jax.tree.map(lambda t: t + 0.05 * jax.random.normal(jax.random.key(2), t.shape, t.dtype), adapter)
  run_adapter = models.fuse_adapter(adapter, cfg) if fuse_adapter else adapter
  # in the compute dtype, as the sampler casts it: the b stacks then stay out of the layer scan (StackedWeight)
  run_adapter = jax.tree.map(lambda t: t.astype(jnp.bfloat16), run_adapter)
  tokens = jax.random.randint(jax.random.key(3), (2, 40), 0, 96, jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(40, dtype=jnp.int32), (2, 40))

  def prefill(ad):
    logits, _ = models.forward(cfg, base, tokens, pos, lora=ad, lora_cfg=c, cache=models.init_cache(cfg, 2, 48))
    return logits

  ref, _ = jax.jit(lambda ad: models.forward(cfg.replace(dtype="float32"), models.dequantize_base(base, jnp.float32),
                                             tokens, pos, lora=ad, lora_cfg=c))(adapter)
  ref = np.asarray(ref, np.float64)
  errs = {}
  for route in (True, False):
    monkeypatch.setattr(layers, "BF16_EPILOGUE", route)
    f = jax.jit(lambda ad: prefill(ad))
    errs[route] = _rel(f(run_adapter), ref)
    assert (_bf16_dots(f, run_adapter) > 0) == route
  assert errs[True] < 2e-2 and errs[True] < 1.5 * errs[False] + 1e-3, errs


def _attention_reference_f64(q, k, v, mask):
  """Grouped-query softmax attention in float64 numpy: [B, T, H, hd] from q [B, T, H, hd], k / v [B, S, K, hd] and a
  bool mask [B, T, S]; rows with no allowed slot are left at 0 (their values are unused)."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  b, t, h, hd = q.shape
  g = h // k.shape[2]
  k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
  s = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(hd)
  m = np.asarray(mask)[:, None]
  s = np.where(m, s, -np.inf)
  p = np.exp(s - np.max(np.where(m, s, -1e300), axis=-1, keepdims=True))
  p = np.where(m, p, 0.0)
  p = p / np.maximum(p.sum(-1, keepdims=True), 1e-300)
  return np.einsum("bhts,bshd->bthd", p, v)


def _left_padded_causal(b, t, pads):
  valid = np.ones((b, t), bool)
  for row, n in enumerate(pads):
    valid[row, :n] = False
  causal = np.tril(np.ones((t, t), bool))
  return valid, causal[None] & valid[:, None, :]


def test_fused_attention_route_equals_float64_on_real_rows_and_is_refused_off_a_gpu():
  """The route model.attn_impl="cudnn" takes (jax.nn.dot_product_attention with the mask plus each query's own
  slot), run here by its XLA implementation: real query rows equal a float64 reference, and so do the
  gradients of a loss over them; padding rows stay finite. On a CPU the cuDNN implementation is refused."""
  from qerl_jax.models import layers
  rng = np.random.default_rng(3)
  b, t, h, kh, hd = 3, 9, 4, 2, 16
  q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((b, t, h, hd), (b, t, kh, hd), (b, t, kh, hd)))
  valid, mask = _left_padded_causal(b, t, (0, 3, 8))
  out = layers.self_attention_jax_nn(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask), "xla")
  out = np.asarray(out)
  ref = _attention_reference_f64(q, k, v, mask)
  assert np.isfinite(out).all()
  np.testing.assert_allclose(out[valid], ref[valid], atol=2e-5, rtol=1e-5)
  np.testing.assert_allclose(out[valid], np.asarray(layers.attention(q, k, v, jnp.asarray(mask)))[valid], atol=2e-5)

  w = rng.standard_normal((b, t, h, hd)) * valid[:, :, None, None]
  loss = lambda fn: jax.grad(lambda *a: jnp.sum(fn(*a) * w), argnums=(0, 1, 2))(q, k, v)  # noqa: E731
  g_fused = loss(lambda *a: layers.self_attention_jax_nn(*a, jnp.asarray(mask), "xla"))
  g_plain = loss(lambda *a: layers.attention(*a, jnp.asarray(mask)))
  eps = 1e-6  # float64 central differences of the reference for one element of each input
  for i, (gf, gp) in enumerate(zip(g_fused, g_plain)):
    np.testing.assert_allclose(np.asarray(gf), np.asarray(gp), atol=2e-5, rtol=1e-4)
    args = [np.asarray(a, np.float64) for a in (q, k, v)]
    idx = (1, 5, 1, 3)
    up, dn = [a.copy() for a in args], [a.copy() for a in args]
    up[i][idx] += eps
    dn[i][idx] -= eps
    fd = (np.sum(_attention_reference_f64(*up, mask) * w) - np.sum(_attention_reference_f64(*dn, mask) * w)) / (2 * eps)
    assert abs(float(np.asarray(gf)[idx]) - fd) < 1e-4 * max(1.0, abs(fd)), (i, float(np.asarray(gf)[idx]), fd)

  with pytest.raises(ValueError, match="T == S"):
    layers.self_attention_jax_nn(q, k[:, :5], v[:, :5], jnp.asarray(mask[:, :, :5]), "xla")
  with pytest.raises(ValueError, match="not one of"):
    layers.attention(q, k, v, jnp.asarray(mask), implementation="flash")
  if jax.default_backend() != "gpu":
    with pytest.raises(ValueError, match="needs a GPU backend"):
      layers.attention(q, k, v, jnp.asarray(mask), implementation="cudnn")
    # the config's default "auto" runs the einsums off a GPU: the same numbers as "xla"
    assert layers.resolve_attention_implementation("auto", jnp.bfloat16, 128, 9, 9) == "xla"
    np.testing.assert_array_equal(np.asarray(layers.attention(q, k, v, jnp.asarray(mask), implementation="auto")),
                                  np.asarray(layers.attention(q, k, v, jnp.asarray(mask))))
  with pytest.raises(ValueError, match="'flash' is not one of"):
    layers.resolve_attention_implementation("flash", jnp.bfloat16, 128, 9, 9)
  _, cfg, base = _model("qwen2", True)
  tokens = jnp.zeros((1, 4), jnp.int32)
  with pytest.raises(ValueError, match="attn_impl='flash'"):
    models.forward(cfg, base, tokens, jnp.zeros((1, 4), jnp.int32), attn_impl="flash")


@pytest.mark.gpu
@pytest.mark.parametrize("t", [256, 257])
def test_cudnn_attention_equals_float64_and_xla_gradients_on_the_gpu(t):
  """cuDNN's fused attention (model.attn_impl="cudnn") on bf16 inputs of a training forward's shape (GQA, left
  padding, head_dim 128; an odd length runs padded by one slot): real rows equal a float64 reference to bf16
  rounding, padding rows are finite, and the gradients of a loss over real rows equal the XLA route's."""
  from qerl_jax.models import layers
  rng = np.random.default_rng(4)
  b, h, kh, hd = 2, 8, 2, 128
  q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
             for s in ((b, t, h, hd), (b, t, kh, hd), (b, t, kh, hd)))
  valid, mask = _left_padded_causal(b, t, (0, 77))
  out = np.asarray(jax.jit(lambda *a: layers.attention(*a, jnp.asarray(mask), implementation="cudnn"))(q, k, v),
                   np.float64)
  ref = _attention_reference_f64(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), mask)
  assert np.isfinite(out).all()
  err = np.linalg.norm(out[valid] - ref[valid]) / np.linalg.norm(ref[valid])
  assert err < 1e-2, err
  w = jnp.asarray(rng.standard_normal((b, t, h, hd)) * valid[:, :, None, None], jnp.float32)

  def grads(impl):
    f = lambda *a: jnp.sum(layers.attention(*a, jnp.asarray(mask), implementation=impl).astype(jnp.float32) * w)  # noqa: E731
    return jax.jit(jax.grad(f, argnums=(0, 1, 2)))(q, k, v)

  for gc, gx in zip(grads("cudnn"), grads("xla")):
    gc, gx = np.asarray(gc, np.float64), np.asarray(gx, np.float64)
    assert np.isfinite(gc).all()
    assert np.linalg.norm(gc - gx) / np.linalg.norm(gx) < 2e-2
  # the config's default "auto": cuDNN for this bf16 training forward; the einsums for float32, a decode step
  # (T != S) or a head size cuDNN is not handed
  resolve = layers.resolve_attention_implementation
  assert resolve("auto", jnp.bfloat16, 128, t, t) == "cudnn"
  assert resolve("auto", jnp.float32, 128, t, t) == resolve("auto", jnp.bfloat16, 128, 1, t) == "xla"
  assert resolve("auto", jnp.bfloat16, 80, t, t) == "xla"
  np.testing.assert_array_equal(
      np.asarray(jax.jit(lambda *a: layers.attention(*a, jnp.asarray(mask), implementation="auto"))(q, k, v)),
      np.asarray(jax.jit(lambda *a: layers.attention(*a, jnp.asarray(mask), implementation="cudnn"))(q, k, v)))


def test_cudnn_attention_pads_an_odd_length_that_its_gradient_refuses(monkeypatch):
  """jax.nn.dot_product_attention's cuDNN route refuses the gradient of a masked (biased) attention over an odd
  sequence length (NotImplementedError "Unsupported sequence length"): with "auto" (cuDNN on a GPU) a training
  forward of prompt + completion = 257 tokens raised at the first update. The cuDNN route now pads an odd length
  by one slot that no real query attends. JAX's own check, traced here on the CPU (cuDNN's version lookup
  patched: nothing runs), refuses the unpadded odd lengths and takes the padded ones; the padding's numbers are
  checked against the unpadded attention through the XLA implementation, value and gradient."""
  import types
  fa = pytest.importorskip("jax._src.cudnn.fused_attention_stablehlo")
  from qerl_jax.models import layers
  monkeypatch.setattr(fa, "check_cudnn_version", lambda: 91000)
  b, h, kh, hd = 2, 4, 2, 128
  traced = {}
  for t in (130, 131, 256, 257):
    q, k = jnp.zeros((b, t, h, hd), jnp.bfloat16), jnp.zeros((b, t, kh, hd), jnp.bfloat16)
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    for pad in (False, True):
      loss = lambda q: layers.self_attention_jax_nn(  # noqa: E731
          q, k, k, mask, "cudnn", pad_to_even=pad).astype(jnp.float32).sum()
      try:
        jax.make_jaxpr(jax.grad(loss))(q)
        traced[t, pad] = True
      except NotImplementedError as e:
        assert "sequence length" in str(e)
        traced[t, pad] = False
  assert traced == {(130, False): True, (131, False): False, (256, False): True, (257, False): False,
                    (130, True): True, (131, True): True, (256, True): True, (257, True): True}
  # a GPU of compute capability 9.0, as resolve_attention_implementation sees it: "auto" gives every length to cuDNN
  with monkeypatch.context() as mp:
    mp.setattr(layers.jax, "default_backend", lambda: "gpu")
    mp.setattr(layers.jax, "devices", lambda *a: [types.SimpleNamespace(compute_capability="9.0")])
    assert all(layers.resolve_attention_implementation("auto", jnp.bfloat16, hd, t, t) == "cudnn"
               for t in (130, 131, 256, 257))

  # the padding changes no number on the real rows (float32, the XLA implementation of the same call)
  rng = np.random.default_rng(5)
  t = 7
  q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((b, t, h, 16), (b, t, kh, 16), (b, t, kh, 16)))
  valid, mask = _left_padded_causal(b, t, (0, 2))
  mask = jnp.asarray(mask)
  w = jnp.asarray(rng.standard_normal((b, t, h, 16)) * valid[:, :, None, None], jnp.float32)
  run = lambda pad: jax.value_and_grad(  # noqa: E731
      lambda *a: jnp.sum(layers.self_attention_jax_nn(*a, mask, "xla", pad_to_even=pad) * w), argnums=(0, 1, 2))(q, k, v)
  (v0, g0), (v1, g1) = run(False), run(True)
  np.testing.assert_allclose(float(v1), float(v0), rtol=1e-6)
  np.testing.assert_allclose(float(v0), float(np.sum(_attention_reference_f64(q, k, v, np.asarray(mask))[valid]
                                                     * np.asarray(w)[valid])), rtol=1e-5)
  for a, c in zip(g0, g1):
    np.testing.assert_allclose(np.asarray(c), np.asarray(a), atol=1e-6)


def test_attention_implementations_named_alike_in_the_config_and_the_model():
  from qerl_jax import train_config
  from qerl_jax.models import layers
  assert train_config.ATTENTION_IMPLEMENTATIONS == layers.ATTENTION_IMPLEMENTATIONS == ("xla", "cudnn", "auto")


def test_lora_scale_of_each_accepted_form_and_a_clear_error_otherwise():
  import types
  assert models.lora_scale_of(None) == 1.0 and models.lora_scale_of(0.5) == 0.5
  assert models.lora_scale_of({"scale": 2.0}) == 2.0 and models.lora_scale_of(types.SimpleNamespace(scale=4.0)) == 4.0
  with pytest.raises(TypeError, match="must have a 'scale' key; got keys \\['alpha', 'r'\\]"):
    models.lora_scale_of({"alpha": 32, "r": 16})
  with pytest.raises(TypeError, match="must be None, a float, or have a 'scale'"):
    models.lora_scale_of("0.5")
