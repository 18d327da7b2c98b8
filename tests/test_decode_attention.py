"""Decode attention over a stacked KV cache read in place: interpret-mode kernel vs a float64 numpy product."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import decode_attention as da
from qerl_jax import models
from tests._model_utils import assert_same_as_on_cpu, decode_all, left_padded_batch


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
  # a per-row length (or layer) used to fail reshaping it, as a TypeError that named neither
  for backend in ("reference", "interpret"):
    with pytest.raises(ValueError, match=r"decode_attention: length must be an int32 scalar; got shape \(3,\)"):
      da.decode_attention(q, k, v, 0, mask, jnp.array([10, 12, 9]), backend=backend)
    with pytest.raises(ValueError, match=r"layer must be an int32 scalar; got shape \(2,\)"):
      da.decode_attention(q, k, v, jnp.array([0, 1]), mask, 10, backend=backend)
  # one value, as a one-element array, is still taken: the float64 attention at that layer and length
  out = da.decode_attention(q, k, v, jnp.array([1]), mask, jnp.array([30]), backend="reference")
  assert _rel(out, _np_attention(q, k, v, 1, np.asarray(mask), 30)) < 1e-5


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


# ----------------------------------------------------------------------------- decode_attention_append


def _np_rope(x, pos, inv_freq):
  """float64 "rotate half" RoPE: x [B, N, D], pos [B], inv_freq [D / 2]."""
  ang = np.asarray(pos, np.float64)[:, None] * np.asarray(inv_freq, np.float64)
  cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
  x1, x2 = x[..., :x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
  return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _append_case(seed, *, layers=3, batch=3, slots=70, kv_heads=2, group=7, dim=32):
  rng = np.random.default_rng(seed)
  heads = kv_heads * group
  cache = lambda: jnp.asarray(rng.standard_normal((layers, batch, slots, kv_heads, dim)), jnp.bfloat16)
  k, v = cache(), cache()
  qkv = jnp.asarray(rng.standard_normal((batch, (heads + 2 * kv_heads) * dim)), jnp.float32)
  bias = jnp.asarray(rng.standard_normal(qkv.shape[1]), jnp.bfloat16)
  mask = np.ones((batch, slots), bool)
  mask[0, :5] = False
  mask[-1, :20] = False
  mask[1 % batch, 33] = False
  pos = jnp.asarray(rng.integers(0, 4000, batch), jnp.int32)
  inv_freq = jnp.asarray(1e4 ** -(np.arange(0, dim, 2) / dim), jnp.float32)
  cos, sin = da.rope_cos_sin(pos, inv_freq)
  ang = (np.asarray(pos, np.float32)[:, None] * np.asarray(inv_freq)).astype(np.float64)  # the float32 angle
  np.testing.assert_allclose(np.asarray(cos), np.cos(ang), atol=1e-6)
  np.testing.assert_allclose(np.asarray(sin), np.sin(ang), atol=1e-6)
  return dict(qkv_BxN=qkv, bias_N=bias, k_LxBxSxKxD=k, v_LxBxSxKxD=v, slot_mask_BxS=jnp.asarray(mask),
              cos_BxR=cos, sin_BxR=sin), heads, pos, inv_freq


def _np_append(c, heads, pos, inv_freq, layer, length):
  """float64: the q/k/v split of bf16(qkv + bias), RoPE, the cache write and attention."""
  y = np.asarray((c["qkv_BxN"] + c["bias_N"].astype(jnp.float32)).astype(jnp.bfloat16), np.float64)
  k, v = (np.array(c[n], np.float64) for n in ("k_LxBxSxKxD", "v_LxBxSxKxD"))
  kh, d = k.shape[3], k.shape[4]
  y = y.reshape(y.shape[0], heads + 2 * kh, d)
  q = _np_rope(y[:, :heads], pos, inv_freq)
  k[layer, :, length - 1] = _np_rope(y[:, heads:heads + kh], pos, inv_freq)
  v[layer, :, length - 1] = y[:, heads + kh:]
  return _np_attention(q, k, v, layer, np.asarray(c["slot_mask_BxS"]), length), k, v


@pytest.mark.parametrize("length,layer,splits,block_s", [(41, 1, None, 16), (70, 2, 3, 16), (21, 0, 2, 32),
                                                         (1, 1, 2, 16), (17, 2, 5, 16)])
def test_append_kernel_matches_float64(length, layer, splits, block_s):
  """Bias, bf16 rounding, RoPE, the cache write at slot length - 1 and attention, against float64 numpy;
  the caches the kernel returns equal XLA's dynamic-update-slice bit for bit."""
  c, heads, pos, inv_freq = _append_case(length)
  # the new token's slot is a real token (as in a decode step; rows 0 and 2 start with padding)
  c["slot_mask_BxS"] = c["slot_mask_BxS"].at[:, length - 1].set(True)
  out, kc, vc = da.decode_attention_append(**c, layer=layer, length=length, num_heads=heads, backend="interpret",
                                           block_s=block_s, splits=splits)
  ref_out, ref_k, ref_v = _np_append(c, heads, pos, inv_freq, layer, length)
  assert out.shape == (3, heads, 32) and out.dtype == jnp.bfloat16
  assert np.isfinite(np.asarray(out, np.float32)).all()
  assert _rel(out, ref_out) < 2e-2
  # the cache: only slot length - 1 of `layer` changes, to bf16 of the float64 values
  for got, want, old in ((kc, ref_k, c["k_LxBxSxKxD"]), (vc, ref_v, c["v_LxBxSxKxD"])):
    got = np.asarray(got, np.float64)
    changed = np.argwhere((got != np.asarray(old, np.float64)).any(axis=(1, 3, 4)))
    assert changed.tolist() == [[layer, length - 1]]
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
  xla_out, xla_k, xla_v = da.decode_attention_append(**c, layer=layer, length=length, num_heads=heads,
                                                     backend="reference")
  assert_same_as_on_cpu(kc, xla_k)
  assert_same_as_on_cpu(vc, xla_v)
  assert _rel(xla_out, ref_out) < 2e-2


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("length,splits,slots", [(70, 3, 70), (41, None, 70), (1, 2, 70), (33, 5, 70),
                                                 (190, None, 200), (100, None, 200), (200, 13, 200)])
def test_append_kernel_merges_its_splits_with_sync(length, splits, slots, dynamic):
  """With ``sync`` the kernel's last program per (row, KV head) merges the splits' partials (in chunks of
  MERGE_CHUNK = 8 splits: 200 slots make 13 splits of one block of 16): the output matches float64, the counters
  come back zero (so they serve the next call), and the result equals XLA's combine."""
  block_s = 16
  c, heads, pos, inv_freq = _append_case(length + 100, slots=slots)
  c["slot_mask_BxS"] = c["slot_mask_BxS"].at[:, length - 1].set(True)
  kw = dict(layer=2, length=length, num_heads=heads, backend="interpret", block_s=block_s, splits=splits,
            dynamic_chunks=dynamic)
  out, kc, vc, sync = da.decode_attention_append(**c, **kw, sync=da.new_sync(3, 2))
  ref_out, ref_k, _ = _np_append(c, heads, pos, inv_freq, 2, length)
  assert out.shape == (3, heads, 32) and out.dtype == jnp.bfloat16
  assert _rel(out, ref_out) < 2e-2
  np.testing.assert_array_equal(np.asarray(sync), np.zeros(6, np.int32))
  np.testing.assert_allclose(np.asarray(kc, np.float64), ref_k, rtol=2e-2, atol=2e-2)
  xla_combined, _, _ = da.decode_attention_append(**c, **kw)  # the same partials merged by XLA
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(xla_combined, np.float32), rtol=1e-2, atol=1e-2)


def test_append_kernel_rejects_a_bad_sync():
  c, heads, _, _ = _append_case(3)
  for bad in (jnp.zeros((5,), jnp.int32), jnp.zeros((6,), jnp.float32)):
    with pytest.raises(ValueError, match="sync must be int32"):
      da.decode_attention_append(**c, layer=0, length=10, num_heads=heads, backend="interpret", sync=bad)


def test_append_kernel_other_head_shapes():
  """A group of 3 query heads per KV head and a head dim of 64 (Llama 3.2's shapes), a full cache."""
  c, heads, pos, inv_freq = _append_case(11, layers=2, batch=2, slots=48, kv_heads=4, group=3, dim=64)
  length = 48
  c["slot_mask_BxS"] = c["slot_mask_BxS"].at[:, length - 1].set(True)
  out, kc, _ = da.decode_attention_append(**c, layer=1, length=length, num_heads=heads, backend="interpret",
                                          block_s=16)
  ref_out, ref_k, _ = _np_append(c, heads, pos, inv_freq, 1, length)
  assert out.shape == (2, 12, 64)
  assert _rel(out, ref_out) < 2e-2
  np.testing.assert_allclose(np.asarray(kc, np.float64), ref_k, rtol=2e-2, atol=2e-2)


def test_append_launch_defaults_are_the_module_settings(monkeypatch):
  """With block_s / target_programs left unset, decode_attention_append takes the module's APPEND_* settings
  (what a rollout A/B sets): the grid's split count follows them, the result still matches float64, and a bad
  setting is refused as the argument would be."""
  c, heads, pos, inv_freq = _append_case(41)
  length = 41
  c["slot_mask_BxS"] = c["slot_mask_BxS"].at[:, length - 1].set(True)
  ref_out, _, _ = _np_append(c, heads, pos, inv_freq, 1, length)
  slots = c["k_LxBxSxKxD"].shape[2]

  def grid_of():
    jaxpr = jax.make_jaxpr(lambda c: da.decode_attention_append(**c, layer=1, length=length, num_heads=heads,
                                                                  backend="interpret"))(c)
    (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "pallas_call"]
    return tuple(eqn.params["grid_mapping"].grid)

  b, kh = c["k_LxBxSxKxD"].shape[1], c["k_LxBxSxKxD"].shape[3]
  for block_s, target in ((16, 1), (16, 10_000), (32, 10_000)):
    monkeypatch.setattr(da, "APPEND_BLOCK_S", block_s)
    monkeypatch.setattr(da, "APPEND_TARGET_PROGRAMS", target)
    # splits by hand: 1 program per (row, KV head) at target 1; one block each at a large target
    want = 1 if target == 1 else -(-slots // block_s)
    assert grid_of() == (b, kh, want)
    out, _, _ = da.decode_attention_append(**c, layer=1, length=length, num_heads=heads, backend="interpret")
    assert _rel(out, ref_out) < 2e-2
  monkeypatch.setattr(da, "APPEND_BLOCK_S", 48)
  with pytest.raises(ValueError, match="block_s must be a power of 2"):
    grid_of()


@pytest.mark.parametrize("backend", ["interpret", "reference"])
def test_append_reads_qkv_from_a_buffer_head_and_the_layer_of_a_bias_stack(backend):
  """q/k/v as the head of a 1-D float32 buffer (a decode step's accumulator; NaN after it) and the
  bias as a stack [L, N] (NaN in the other layers) give what the [B, N] array and the layer's bias give,
  bit for bit: neither the rest of the buffer nor the other layers' biases are read."""
  c, heads, pos, inv_freq = _append_case(29, layers=3)
  length, layer = 29, 2
  c["slot_mask_BxS"] = c["slot_mask_BxS"].at[:, length - 1].set(True)
  kw = dict(layer=layer, length=length, num_heads=heads, backend=backend, block_s=16, splits=2)
  want = da.decode_attention_append(**c, **kw)
  b, n = c["qkv_BxN"].shape
  d = c["k_LxBxSxKxD"].shape[-1]
  buf = jnp.concatenate([c["qkv_BxN"].reshape(-1), jnp.full((3 * d,), jnp.nan, jnp.float32)])
  stack = jnp.full((3, n), jnp.nan, c["bias_N"].dtype).at[layer].set(c["bias_N"])
  got = da.decode_attention_append(**{**c, "qkv_BxN": buf, "bias_N": stack}, **kw)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
  with pytest.raises(ValueError, match="1-D qkv buffer"):
    da.decode_attention_append(**{**c, "qkv_BxN": buf[:b * n - d]}, **kw)  # too short
  with pytest.raises(ValueError, match="multiple of hd"):
    da.decode_attention_append(**{**c, "qkv_BxN": buf[:b * n + 1]}, **kw)
  with pytest.raises(ValueError, match="bias must be"):
    da.decode_attention_append(**{**c, "bias_N": stack[:2]}, **kw)


def test_append_reads_no_slot_at_or_after_the_new_one():
  """NaN in the new token's slot (it is written, never read) and beyond ``length`` stay out of the output."""
  c, heads, pos, inv_freq = _append_case(3)
  length = 37
  for name in ("k_LxBxSxKxD", "v_LxBxSxKxD"):
    c[name] = c[name].at[:, :, length - 1:].set(jnp.nan)
  c["slot_mask_BxS"] = c["slot_mask_BxS"].at[:, length - 1:].set(True)
  out, kc, _ = da.decode_attention_append(**c, layer=1, length=length, num_heads=heads, backend="interpret",
                                          block_s=16, splits=2)
  assert np.isfinite(np.asarray(out, np.float32)).all()
  assert np.isfinite(np.asarray(kc[1, :, length - 1], np.float32)).all()  # the written slot
  ref_out, _, _ = _np_append(c, heads, pos, inv_freq, 1, length)
  assert _rel(out, ref_out) < 2e-2


def test_append_errors_name_the_problem():
  c, heads, _, _ = _append_case(0)
  call = lambda **kw: da.decode_attention_append(**{**c, **kw}, layer=0, length=10, num_heads=kw.pop("h", heads))
  with pytest.raises(ValueError, match="qkv must be"):
    call(qkv_BxN=c["qkv_BxN"][:, :-1])
  with pytest.raises(ValueError, match="bias must be"):
    call(bias_N=c["bias_N"][:-1])
  with pytest.raises(ValueError, match="cos and sin must be"):
    call(cos_BxR=c["cos_BxR"][:2])
  with pytest.raises(ValueError, match="cos and sin must be"):
    call(sin_BxR=c["sin_BxR"][:, :3])
  with pytest.raises(ValueError, match="multiple"):
    da.decode_attention_append(**c, layer=0, length=10, num_heads=13)
  with pytest.raises(ValueError, match=r"decode_attention_append: length must be an int32 scalar"):
    da.decode_attention_append(**c, layer=0, length=jnp.array([10, 11, 12]), num_heads=heads, backend="reference")


@pytest.mark.parametrize("quant,with_lora,combine", [(None, False, 0), (None, True, 0), ("nvfp4", False, 0),
                                                     ("nvfp4", True, 0), ("nvfp4", False, 1)])
def test_decoder_decode_steps_through_the_append_kernel(monkeypatch, quant, with_lora, combine):
  """Fused q/k/v with a bias (and a fused adapter; bf16 or NVFP4 base weights), bf16: prefill then decode
  through the append kernel (interpret mode) gives the same logits as decoding through XLA's RoPE, cache
  update and attention. On the NVFP4 base the 4-bit matmul adds the adapter itself (its epilogue) and the
  kernel adds the bias; on the bf16 base XLA adds both. With ``FUSED_ATTENTION_COMBINE`` the kernel also
  merges its splits, on counters carried from layer to layer."""
  from qerl_jax import lora as lora_lib
  from qerl_jax.models import decoder
  monkeypatch.setattr(decoder, "FUSED_ATTENTION_COMBINE", combine)
  syncs = []  # the counters each call got (None without the merge)
  cfg = models.ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=16, attention_bias=True, dtype="bfloat16")
  base = models.fuse_projections(models.init_params(cfg, jax.random.key(0), dtype=jnp.bfloat16, std=0.1))
  if quant:
    base = models.quantize_base(base, quant)
  assert "qkv_bias" in base["layers"]["attn"]
  kw = {}
  if with_lora:
    c = lora_lib.LoRAConfig(r=4, lora_alpha=8.0, target_modules=("q", "v", "o"))
    lora = lora_lib.init_lora(jax.random.key(5), cfg, c)
    lora = jax.tree.map(lambda a: a + 0.05 * jax.random.normal(jax.random.key(a.size), a.shape, a.dtype), lora)
    kw = dict(lora=models.fuse_adapter(lora, cfg, dtype=jnp.bfloat16), lora_cfg=c)
  tokens, mask = (jnp.asarray(a) for a in left_padded_batch(cfg.vocab_size, seed=5))
  calls = []  # whether each call got the bias to add (the second argument)
  real_append = da.decode_attention_append
  # the bias reaches the kernel as the stack [L, N], of which it reads layer li in place
  monkeypatch.setattr(da, "decode_attention_append", lambda *a, **k: calls.append(a[1] is not None)
                      or syncs.append(k.get("sync"))
                      or (a[1] is None or a[1].shape == (cfg.num_layers, 128)) and real_append(*a, **k))
  monkeypatch.setattr(da, "auto_backend", lambda dtype: "reference")  # what the CPU runs (a GPU: the kernel)
  xla, _ = decode_all(cfg, base, tokens, mask, n_prefill=6, cache_dtype=jnp.bfloat16, **kw)
  assert not calls  # with the reference backend the decoder keeps XLA's path
  monkeypatch.setattr(da, "auto_backend", lambda dtype: "interpret")
  fused, _ = decode_all(cfg, base, tokens, mask, n_prefill=6, cache_dtype=jnp.bfloat16, **kw)
  assert calls  # traced once per layer of the jitted decode step
  assert all((sync is not None) == bool(combine) for sync in syncs)
  # the kernel adds the bias unless an adapter delta must follow it in XLA (no 4-bit epilogue)
  assert all(calls) == (not with_lora or quant is not None) and any(calls) == all(calls)
  real = np.asarray(mask).astype(bool)
  diff = np.abs(np.asarray(fused, np.float32) - np.asarray(xla, np.float32))[real]
  scale = np.abs(np.asarray(xla, np.float32))[real].max()
  assert diff.max() < 2e-2 * scale, (diff.max(), scale)


@pytest.mark.gpu
def test_gpu_append_kernel_matches_reference_at_7b_shape():
  """Qwen2.5-7B's heads (28 q, 4 kv, hd 128) at batch 8 and 2304 slots: the Triton kernel against XLA."""
  c, heads, _, _ = _append_case(0, layers=3, batch=8, slots=2304, kv_heads=4, group=7, dim=128)
  for length in (1, 257, 2304):
    args = dict(c, slot_mask_BxS=c["slot_mask_BxS"].at[:, length - 1].set(True))
    out, kc, vc = da.decode_attention_append(**args, layer=2, length=length, num_heads=heads, backend="pallas")
    ref, rk, rv = da.decode_attention_append(**args, layer=2, length=length, num_heads=heads, backend="reference")
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert _rel(out, np.asarray(ref, np.float64)) < 1e-2
    np.testing.assert_array_equal(np.asarray(kc, np.float32), np.asarray(rk, np.float32))
    np.testing.assert_array_equal(np.asarray(vc, np.float32), np.asarray(rv, np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("dynamic", [False, True])
def test_gpu_append_kernel_merges_its_splits_at_7b_shape(dynamic):
  """The splits merged in the kernel (``sync``, the last program of each (row, KV head)) at Qwen2.5-7B's heads,
  batch 8, 2304 slots, over lengths that fill 1 to 12 splits, with the counters carried from call to call."""
  c, heads, _, _ = _append_case(0, layers=3, batch=8, slots=2304, kv_heads=4, group=7, dim=128)
  sync = da.new_sync(8, 4)
  for length in (1, 65, 257, 1304, 2304):
    args = dict(c, slot_mask_BxS=c["slot_mask_BxS"].at[:, length - 1].set(True))
    out, kc, vc, sync = da.decode_attention_append(**args, layer=2, length=length, num_heads=heads,
                                                   backend="pallas", sync=sync, dynamic_chunks=dynamic)
    ref, rk, rv = da.decode_attention_append(**args, layer=2, length=length, num_heads=heads, backend="reference")
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert _rel(out, np.asarray(ref, np.float64)) < 1e-2, length
    np.testing.assert_array_equal(np.asarray(sync), np.zeros(32, np.int32))
    np.testing.assert_array_equal(np.asarray(kc, np.float32), np.asarray(rk, np.float32))
    np.testing.assert_array_equal(np.asarray(vc, np.float32), np.asarray(rv, np.float32))


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


def test_append_kernel_is_not_run_below_its_minimum_head_dim(monkeypatch):
  """Below APPEND_MIN_HEAD_DIM (32) the GPU kernel's output was wrong (session 19 on an H200: relative
  error 0.28-0.84 at head_dim 16): "auto" runs the XLA reference there even where it would pick the
  kernel, and an explicit backend="pallas" is refused with the reason."""
  c, heads, _, _ = _append_case(3, dim=16, group=2)
  monkeypatch.setattr(da, "auto_backend", lambda dtype: "pallas")  # what a GPU picks for bf16
  out, kc, _ = da.decode_attention_append(**c, layer=1, length=9, num_heads=heads, backend="auto")
  ref, rk, _ = da.decode_attention_append(**c, layer=1, length=9, num_heads=heads, backend="reference")
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))
  np.testing.assert_array_equal(np.asarray(kc, np.float32), np.asarray(rk, np.float32))
  with pytest.raises(ValueError, match="head_dim >= 32"):
    da.decode_attention_append(**c, layer=1, length=9, num_heads=heads, backend="pallas")
  assert da.APPEND_MIN_HEAD_DIM == 32


def test_kernel_is_not_run_below_its_minimum_head_dim(monkeypatch):
  """decode_attention's score dot contracts over hd, which a 16-bit tensor-core dot needs to be at least
  16 (MIN_HEAD_DIM): below it "auto" runs the XLA reference even where it would pick the kernel, and an
  explicit backend="pallas" is refused."""
  q, k, v, mask = _case(4, dim=8, group=2)
  args = (jnp.asarray(q, jnp.bfloat16), jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16), 1,
          jnp.asarray(mask), 40)
  monkeypatch.setattr(da, "auto_backend", lambda dtype: "pallas")  # what a GPU picks for bf16
  out = da.decode_attention(*args, backend="auto")
  ref = da.decode_attention(*args, backend="reference")
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))
  with pytest.raises(ValueError, match="head_dim >= 16"):
    da.decode_attention(*args, backend="pallas")
  assert da.MIN_HEAD_DIM == 16


@pytest.mark.parametrize("unroll_max", [32, 2])
def test_combine_merges_splits_as_float64_with_empty_ones(unroll_max, monkeypatch):
  """The splits' partials combined with weights exp(m_i - max m) equal float64 (scores up to about 100
  apart), with an empty split (m = MASKED_SCORE, l = 0) anywhere and a (row, head) whose splits are all
  empty, which gives 0, not NaN; written unrolled over the 5 splits, and as reductions (unroll limit 2)."""
  monkeypatch.setattr(da, "COMBINE_UNROLL_MAX", unroll_max)
  rng = np.random.default_rng(7)
  n, b, kh, g_pad, d, group = 5, 3, 2, 16, 8, 7
  o = rng.standard_normal((n, b, kh, g_pad, d)).astype(np.float32)
  m = (30 * rng.standard_normal((n, b, kh, g_pad))).astype(np.float32)
  l = rng.uniform(0.5, 3.0, (n, b, kh, g_pad)).astype(np.float32)
  for sl in (np.s_[1], np.s_[:, 0, 0]):
    m[sl], l[sl], o[sl] = da.MASKED_SCORE, 0.0, 0.0
  w = np.exp(m.astype(np.float64) - m.max(0))
  den = (w * l).sum(0)
  want = ((w[..., None] * o).sum(0) / np.where(den > 0, den, 1.0)[..., None])[:, :, :group].reshape(b, kh * group, d)
  got = np.asarray(da._combine(jnp.asarray(o), jnp.asarray(m), jnp.asarray(l), group, jnp.float32))
  assert np.isfinite(got).all() and (got[0, :group] == 0).all()
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
