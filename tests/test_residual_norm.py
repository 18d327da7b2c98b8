"""Tests of the fused layer end (residual add, RMSNorm and a zeroed buffer): pallas_kernels/residual_norm.py.

The kernel runs only on an NVIDIA GPU: there it is checked against float64 numpy. On the CPU the tests
check its XLA formula against the decoder's (they must agree bit for bit) and against float64, what it
accepts, and that it compiles for sm_90 and lowers to the FFI launcher.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import residual_norm, w4_gluon
from qerl_jax.models import layers


def _bf16(a):
  return np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64)


def _case(b, d, layers_=3, seed=0, weight_dtype=jnp.bfloat16):
  rng = np.random.default_rng(seed)
  h = jnp.asarray(rng.standard_normal((b, d)) * 2.0, jnp.bfloat16)
  y = jnp.asarray(rng.standard_normal((b, d)) * 0.5, jnp.float32)
  w = jnp.asarray(1.0 + 0.1 * rng.standard_normal((layers_, d)), weight_dtype)
  noise = jnp.asarray(0.02 * rng.standard_normal((layers_, d)), jnp.float32)
  return h, y, w, noise


def _float64(h, y, w_row, eps, noise_row=None):
  """float64 numpy: the add of bf16 values rounded to bf16; the normalized value rounded to bf16 before the
  weight (+ noise) multiplies it; the product rounded to bf16."""
  hn = _bf16(np.asarray(h, np.float64) + _bf16(y))
  normed = _bf16(hn / np.sqrt(np.mean(hn * hn, axis=-1, keepdims=True) + eps))
  w = np.asarray(w_row, np.float64) + (0.0 if noise_row is None else np.asarray(noise_row, np.float64))
  return hn, w * normed


def test_reference_is_the_decoders_formula_and_float64():
  """reference(h, y, w, eps, noise) is, bit for bit, h + y rounded then layers.rms_norm (what the decoder runs
  without the kernel), and agrees with float64 to bf16 rounding."""
  h, y, w, noise = _case(5, 96)
  hn, x = residual_norm.reference(h, y, w[1], 1e-6, noise[1])
  h_dec = h + y.astype(jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(hn), np.asarray(h_dec))
  np.testing.assert_array_equal(np.asarray(x), np.asarray(layers.rms_norm(h_dec, w[1], 1e-6, noise[1])))
  hn64, x64 = _float64(h, y, w[1], 1e-6, noise[1])
  np.testing.assert_array_equal(np.asarray(hn, np.float64), hn64)
  assert np.abs(np.asarray(x, np.float64) - x64).max() <= 2 ** -7 * np.abs(x64).max()


def test_applies_and_errors(monkeypatch):
  """What it takes: bf16 h [B, D <= MAX_DIM], a bf16 or float32 [L, D] weight stack, float32 noise of the
  same shape, on a GPU with the FFI launcher; anything else is refused with a ValueError naming it."""
  sds = jax.ShapeDtypeStruct
  h, w, n = sds((8, 3584), jnp.bfloat16), sds((28, 3584), jnp.bfloat16), sds((28, 3584), jnp.float32)
  monkeypatch.setattr(residual_norm, "available", lambda: True)
  assert residual_norm.applies(h, w, n) and residual_norm.applies(h, n) and residual_norm.applies(h, w)
  bad = [(sds((8, 3584), jnp.float32), w, None), (h, sds((3584,), jnp.bfloat16), None),
         (h, sds((28, 3583), jnp.bfloat16), None), (h, w, sds((28, 3584), jnp.bfloat16)),
         (h, sds((28, 3584), jnp.float16), None), (sds((8, 20000), jnp.bfloat16), sds((2, 20000), jnp.bfloat16), None)]
  assert not any(residual_norm.applies(*c) for c in bad)
  acc = sds((100_000,), jnp.float32)
  with pytest.raises(ValueError, match="outside a buffer"):
    jax.eval_shape(lambda h, a, w: residual_norm.residual_rms_norm(h, a, 100_000 - 10, w, 0, 1e-6), h, acc, w)
  with pytest.raises(ValueError, match="1-D float32"):
    jax.eval_shape(lambda h, a, w: residual_norm.residual_rms_norm(h, a, 0, w, 0, 1e-6), h,
                   sds((100_000,), jnp.bfloat16), w)
  monkeypatch.setattr(residual_norm, "available", lambda: False)
  assert not residual_norm.applies(h, w, n)
  with pytest.raises(ValueError, match="no kernel"):
    jax.eval_shape(lambda h, a, w: residual_norm.residual_rms_norm(h, a, 0, w, 0, 1e-6), h, acc, w)


def test_compiles_for_sm90_and_lowers_to_the_ffi_launcher(monkeypatch):
  """With triton and a C++ compiler present: the kernel compiles for sm_90 (no spilled registers at the 7B
  and 32B widths; every load before the reduction's barriers) and the call lowers to the launcher with one
  program a row plus one per ZERO_CHUNK elements of the zeroed buffer, and three results."""
  pytest.importorskip("triton.experimental.gluon")
  monkeypatch.delenv("QERL_GLUON_LAUNCH", raising=False)
  if w4_gluon.launcher() != "ffi":
    pytest.skip("no C++ compiler for the FFI launcher")
  monkeypatch.setattr(residual_norm, "available", lambda: True)
  sds = jax.ShapeDtypeStruct
  for d in (3584, 5120):
    size = 8 * (4608 + 3584 + 37888 + d)
    fn = lambda h, a, w, n: residual_norm.residual_rms_norm(h, a, size - 8 * d, w, 3, 1e-6, n, zero_size=size)
    args = (sds((8, d), jnp.bfloat16), sds((size,), jnp.float32), sds((28, d), jnp.float32), sds((28, d), jnp.float32))
    h_new, x, z = jax.eval_shape(fn, *args)
    assert (h_new.shape, x.shape, z.shape, z.dtype) == ((8, d), (8, d), (size,), jnp.float32)
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "qerl_gluon_launch" in text and "rsqrt.approx" in text
    assert f"grid_x = {8 + -(-size // residual_norm.ZERO_CHUNK)}" in text
    ptx = residual_norm._compiled(tuple(residual_norm._meta(8, d, 28, size - 8 * d, 1e-6, True, size).items()),
                                  "*fp32")[0]
    assert ".local" not in ptx  # no spills
    assert ptx.count("ld.global", ptx.index("bar.sync")) == 0  # every load is issued before the reduction
  assert len(jax.eval_shape(lambda h, a, w: residual_norm.residual_rms_norm(h, a, 0, w, 0, 1e-6), args[0],
                            args[1], args[2])) == 2  # no zeroed buffer asked: two results


@pytest.mark.gpu
@pytest.mark.parametrize("b,d,noise,weight_dtype,zero_size", [(8, 3584, True, jnp.float32, 8 * 49664),
                                                              (1, 3584, False, jnp.bfloat16, 0),
                                                              (3, 5120, True, jnp.float32, 5000),
                                                              (16, 1000, True, jnp.bfloat16, 2048),
                                                              (5, 64, False, jnp.float32, 1)])
def test_gpu_matches_float64(b, d, noise, weight_dtype, zero_size):
  """On the GPU, against float64 numpy: h + y (y read at an offset of a buffer whose other elements are
  NaN) bit for bit, the normed x to bf16 rounding (the kernel's rsqrt is the hardware's), and the zeroed
  buffer all zeros (sizes that are and are not multiples of ZERO_CHUNK); D not a power of 2 (1000: masked
  lanes) and layer 2 of a 3-layer stack."""
  if not residual_norm.available():
    pytest.skip("needs a GPU with the Gluon FFI launcher")
  h, y, w, nz = _case(b, d, seed=b + d, weight_dtype=weight_dtype)
  off = 40
  acc = jnp.full((off + b * d + 24,), jnp.nan, jnp.float32).at[off:off + b * d].set(y.reshape(-1))
  run = jax.jit(lambda h, a, w, n: residual_norm.residual_rms_norm(h, a, off, w, jnp.int32(2), 1e-6, n,
                                                                   zero_size=zero_size))
  out = run(h, acc, w, nz if noise else None)
  hn, x = out[:2]
  if zero_size:
    z = np.asarray(out[2])
    assert z.shape == (zero_size,) and (z == 0).all()
  hn64, x64 = _float64(h, y, w[2], 1e-6, nz[2] if noise else None)
  np.testing.assert_array_equal(np.asarray(hn, np.float64), hn64)
  x = np.asarray(x, np.float64)
  assert np.isfinite(x).all()
  assert np.abs(x - x64).max() <= 2 ** -7 * np.abs(x64).max()
  assert np.linalg.norm(x - x64) / np.linalg.norm(x64) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("with_lora,post_attention", [(False, False), (True, False), (False, True), (True, True),
                                                     ("norms", True)])
def test_gpu_decode_steps_with_the_fused_layer_end_match_xla(monkeypatch, with_lora, post_attention):
  """A decode step of a small NVFP4 model with AQN noise on its norms: with each layer ending in the fused kernel
  (decoder.FUSED_LAYER_END) the logits equal XLA's residual add, norm and memset (the setting off) up to the
  kernel's rsqrt and the atomics' order, and the kernel ran with the next-norm stacks and a buffer of the
  accumulator's size. With a LoRA adapter (its up-projection added by the 4-bit kernel), the same; with
  FUSED_POST_ATTENTION too, the same, and the kernel also ran once a layer trace without a buffer. With
  ``"norms"`` the adapter also trains the norms (LoRAConfig.train_norms, as the shipped recipes do; moved off the
  base's): the fused kernels read those stacks, with the same logits."""
  from qerl_jax import lora as lora_lib
  from qerl_jax import models
  from qerl_jax.models import decoder
  from tests._model_utils import decode_all, left_padded_batch
  if not residual_norm.available():
    pytest.skip("needs a GPU with the Gluon FFI launcher")
  cfg = models.ModelConfig(vocab_size=97, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=64, attention_bias=True, dtype="bfloat16")
  base = models.quantize_base(models.fuse_projections(
      models.init_params(cfg, jax.random.key(0), dtype=jnp.bfloat16, std=0.1)), "nvfp4")
  noise = {n: 0.05 * jax.random.normal(jax.random.key(i), (cfg.num_layers, cfg.hidden_size))
           for i, n in enumerate(("input_norm", "post_attn_norm"))}
  kw = dict(norm_noise=noise)
  if with_lora:
    c = lora_lib.LoRAConfig(r=16, lora_alpha=32.0, target_modules=("q", "v", "o", "up", "down"),
                            train_norms=with_lora == "norms")
    ad = lora_lib.init_lora(jax.random.key(5), cfg, c, base=base if c.train_norms else None)
    ad = jax.tree.map(lambda a: a + 0.05 * jax.random.normal(jax.random.key(a.size), a.shape, a.dtype), ad)
    kw.update(lora=models.fuse_adapter(ad, cfg, dtype=jnp.bfloat16), lora_cfg=c)
  tokens, mask = (jnp.asarray(a) for a in left_padded_batch(cfg.vocab_size, seed=5))
  calls = []
  real = residual_norm.residual_rms_norm
  monkeypatch.setattr(residual_norm, "residual_rms_norm",
                      lambda *a, **k: calls.append((a[3].shape, k.get("zero_size"))) or real(*a, **k))
  # The separate fused calls, not the chained layer (PDL_CHAIN, on by default since session 60, takes a rollout
  # without LoRA past these calls; tests/test_decode_chain.py checks it against them).
  monkeypatch.setattr(decoder, "PDL_CHAIN", 0)
  monkeypatch.setattr(decoder, "FUSED_LAYER_END", 0)
  by_xla, _ = decode_all(cfg, base, tokens, mask, n_prefill=6, cache_dtype=jnp.bfloat16, **kw)
  assert not calls
  monkeypatch.setattr(decoder, "FUSED_LAYER_END", 1)
  monkeypatch.setattr(decoder, "FUSED_POST_ATTENTION", int(post_attention))
  fused, _ = decode_all(cfg, base, tokens, mask, n_prefill=6, cache_dtype=jnp.bfloat16, **kw)
  b = tokens.shape[0]
  ends = [c for c in calls if c[1]]
  assert ends and all(c == ((cfg.num_layers, cfg.hidden_size), b * (512 + 256 + 1024 + 256)) for c in ends)
  assert len(calls) - len(ends) == (len(ends) if post_attention else 0)
  rows = np.asarray(mask).astype(bool)
  a, p = np.asarray(fused, np.float32)[rows], np.asarray(by_xla, np.float32)[rows]
  assert np.isfinite(a).all() and np.abs(a - p).max() < 2e-2 * np.abs(p).max()
