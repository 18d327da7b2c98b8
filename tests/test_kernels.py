"""Tests of the 4-bit x bf16 matmul kernels (pallas_kernels/).

On CPU every kernel runs in Pallas interpret mode on small, ragged shapes
(M = 1, 3, 17, 40, 100; N not a multiple of the tile; K a multiple of 16 but
not of the tile) and is compared with a float64 numpy product of the
dequantized weight and with the XLA reference; outputs start NaN-poisoned so
an unwritten element fails. GPU tests (marked ``gpu``) run the compiled
kernels at model shapes.
"""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import matmul, quantized_matmul, reference_matmul, w4_triton
from qerl_jax import nf4, nvfp4

SMALL = w4_triton.TileConfig(block_m=16, block_n=32, block_k=64, splits=1, num_warps=4, num_stages=2)
SMALL_SPLIT = w4_triton.TileConfig(block_m=16, block_n=32, block_k=64, splits=2, num_warps=4, num_stages=2)


def _rel(a, b):
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _weight(fmt, k, n, seed):
  w = np.random.default_rng(seed).standard_normal((k, n)).astype(np.float32) * 0.05
  return (nvfp4 if fmt == "nvfp4" else nf4).quantize(w)


def _dense64(wq):
  mod = nvfp4 if isinstance(wq, nvfp4.NVFP4Tensor) else nf4
  return np.asarray(mod.dequantize(wq, jnp.float32), np.float64)


def _act(shape, seed):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.bfloat16)


@pytest.mark.parametrize("m,k,n,cfg", [
    (1, 160, 40, SMALL),        # K=160: a multiple of 16, not of block_k=64; N=40 not of 32
    (3, 96, 72, SMALL_SPLIT),   # split-K partial sums
    (17, 160, 40, SMALL),       # M spans two row tiles
    (17, 96, 72, dataclasses.replace(SMALL_SPLIT, stage="decoded", prefetch=True)),  # stage="decoded"
])
def test_fused_forward_nvfp4_matches_float64(m, k, n, cfg):
  wq = _weight("nvfp4", k, n, m)
  x = _act((m, k), m + 1)
  y = w4_triton.forward(x, wq, config=cfg, interpret=True, poison_output=True, out_dtype=jnp.float32)
  assert not np.isnan(np.asarray(y)).any()
  want = np.asarray(x, np.float64) @ _dense64(wq)
  # bf16 products of exact E2M1 x E4M3 values with float32 accumulation: far under 1e-2
  assert _rel(y, want) < 1e-4
  assert _rel(y, reference_matmul(x, wq, out_dtype=jnp.float32)) < 1e-2


@pytest.mark.parametrize("m,k,n,cfg", [(3, 160, 40, SMALL), (17, 96, 72, SMALL_SPLIT)])
def test_fused_dx_nvfp4_matches_float64(m, k, n, cfg):
  wq = _weight("nvfp4", k, n, 10 + m)
  dy = _act((m, n), m)
  g = w4_triton.dx(dy, wq, config=cfg, interpret=True, poison_output=True, out_dtype=jnp.float32)
  assert g.shape == (m, k)
  assert not np.isnan(np.asarray(g)).any()
  assert _rel(g, np.asarray(dy, np.float64) @ _dense64(wq).T) < 1e-4


def test_fused_strided_split_matches_registers():
  wq = _weight("nvfp4", 96, 40, 3)
  x = _act((5, 96), 4)
  cfg = w4_triton.TileConfig(16, 32, 64, 1, 4, 2, split_x="strided")
  y = w4_triton.forward(x, wq, config=cfg, interpret=True, poison_output=True, out_dtype=jnp.float32)
  assert _rel(y, np.asarray(x, np.float64) @ _dense64(wq)) < 1e-4


def test_nf4_forward_and_dx():
  wq = _weight("nf4", 192, 40, 7)
  x = _act((3, 192), 8)
  y = w4_triton.forward(x, wq, config=SMALL, interpret=True, poison_output=True, out_dtype=jnp.float32)
  dense = _dense64(wq)
  # NF4 levels are not exact in bf16: the kernel rounds the weight like the reference does
  assert _rel(y, np.asarray(x, np.float64) @ dense) < 1e-2
  assert _rel(y, reference_matmul(x, wq, out_dtype=jnp.float32)) < 1e-4
  dy = _act((3, 40), 9)
  g = w4_triton.dx(dy, wq, config=SMALL, interpret=True, poison_output=True, out_dtype=jnp.float32)
  assert _rel(g, np.asarray(dy, np.float64) @ dense.T) < 1e-2


@pytest.mark.parametrize("fmt,k,n", [("nvfp4", 160, 200), ("nf4", 192, 72)])
def test_dequantize_kernel_bit_exact(fmt, k, n):
  wq = _weight(fmt, k, n, 11)
  mod = nvfp4 if fmt == "nvfp4" else nf4
  got = w4_triton.dequantize(wq, jnp.bfloat16, block_k2=32, block_n=64, interpret=True)
  np.testing.assert_array_equal(np.asarray(got, np.float32),
                                np.asarray(mod.dequantize(wq, jnp.bfloat16), np.float32))


def _nvfp4_dense_np(w):
  """float64 dense weight from an NVFP4 tensor's bytes (standard code order), written from the format's
  definition: code row 2j in the low nibble, E2M1 sign bit 3, magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6},
  times the E4M3 block scale of 16 rows, divided by the global scale."""
  p = np.asarray(w.packed)
  codes = np.stack([p & 15, p >> 4], axis=-2).reshape(*p.shape[:-2], 2 * p.shape[-2], p.shape[-1])
  v = np.array([0, .5, 1, 1.5, 2, 3, 4, 6])[codes & 7] * np.where(codes & 8, -1.0, 1.0)
  s = np.repeat(np.asarray(w.block_scale.astype(jnp.float32), np.float64), 16, axis=-2)
  return v * s / np.asarray(w.global_scale, np.float64)[..., None, None]


@pytest.mark.parametrize("order", ["standard", "decode"])
def test_public_dequantize_of_a_stack(order):
  """pallas_kernels.dequantize (what SamplingConfig.dequantize_min_rows runs once a rollout): a stack
  [L, K, N] through the kernel, one layer a launch (interpret mode), and through the reference; bf16
  values bit for bit nvfp4.dequantize's, within bf16 rounding of a float64 decode of the bytes; bad
  input raises."""
  w = nvfp4.quantize(np.random.default_rng(5).standard_normal((3, 96, 72)).astype(np.float32) * 0.05)
  wd = w if order == "standard" else nvfp4.to_decode_order(w)
  want = _nvfp4_dense_np(w)
  for backend in ("interpret", "reference"):
    got = pallas_kernels.dequantize(wd, jnp.bfloat16, backend=backend)
    assert got.shape == (3, 96, 72) and got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(nvfp4.dequantize(w, jnp.bfloat16), np.float32))
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2 ** -8, atol=0)
  one = pallas_kernels.dequantize(jax.tree.map(lambda a: a[1], wd), jnp.float32, backend="interpret")
  np.testing.assert_allclose(np.asarray(one, np.float64), want[1], rtol=1e-6, atol=0)
  nf = nf4.quantize(np.random.default_rng(6).standard_normal((2, 128, 40)).astype(np.float32))
  np.testing.assert_array_equal(np.asarray(pallas_kernels.dequantize(nf, backend="interpret"), np.float32),
                                np.asarray(nf4.dequantize(nf, jnp.bfloat16), np.float32))
  with pytest.raises(ValueError, match="unknown backend"):
    pallas_kernels.dequantize(w, backend="cuda")
  with pytest.raises(TypeError, match="NVFP4Tensor or NF4Tensor"):
    pallas_kernels.dequantize(jnp.zeros((16, 16)))
  with pytest.raises(ValueError, match=r"stack \[L, K, N\]"):
    pallas_kernels.dequantize(jax.tree.map(lambda a: a[None], w))


@pytest.mark.parametrize("m", [3, 72])  # fused path, then dequantize + dot path
def test_quantized_matmul_and_grad_match_reference(m):
  assert (m <= matmul.FUSED_MAX_M["fwd"]) == (m == 3)
  k, n = 160, 72
  wq = _weight("nvfp4", k, n, m)
  x = _act((m, k), 2 * m)
  ct = jnp.asarray(np.random.default_rng(m).standard_normal((m, n)), jnp.float32)
  y = quantized_matmul(x, wq, backend="interpret")
  assert y.dtype == jnp.bfloat16 and y.shape == (m, n)
  assert _rel(y, np.asarray(x, np.float64) @ _dense64(wq)) < 1e-2

  def loss(x, backend):
    return jnp.sum(quantized_matmul(x, wq, backend=backend).astype(jnp.float32) * ct)

  g = jax.grad(loss)(x, "interpret")
  g_ref = jax.grad(loss)(x, "reference")
  assert g.dtype == jnp.bfloat16
  assert _rel(g, g_ref) < 1e-2
  assert _rel(g, np.asarray(ct, np.float64) @ _dense64(wq).T) < 1e-2


@pytest.mark.parametrize("m", [3, 17, 70])
def test_lora_epilogue_matches_float64_and_its_gradients(m):
  """quantized_matmul(lora=(xa, b, scale)) = x @ W + scale * xa @ b: in the fused kernel's epilogue
  (M <= 64, incl. split-K and two row tiles) and after dequantize + dot (M = 70); gradients for x,
  xa and b equal the reference backend's and the float64 ones."""
  k, n, r, scale = 160, 72, 24, 0.5
  wq = _weight("nvfp4", k, n, m)
  x = _act((1, m, k), 2 * m)  # a leading dim: xa carries it too
  xa, b = _act((1, m, r), 5), _act((r, n), 6)
  want = (np.asarray(x, np.float64) @ _dense64(wq) + scale * np.asarray(xa, np.float64) @ np.asarray(b, np.float64))
  for backend in ("interpret", "reference"):
    y = quantized_matmul(x, wq, backend=backend, out_dtype=jnp.float32, lora=(xa, b, scale))
    assert y.shape == (1, m, n) and _rel(y, want) < 1e-2, backend
  if m <= matmul.FUSED_MAX_M["fwd"]:  # the epilogue writes every element (NaN-poisoned output)
    # rank 24 = two chunks of 16: 3 splits (one without a chunk), 1 split (both chunks in one program)
    for splits in (3, 1):
      cfg = w4_triton.TileConfig(16, 32, 32, splits)
      y = w4_triton.forward(x[0], wq, out_dtype=jnp.float32, config=cfg, interpret=True, poison_output=True,
                            lora=(xa[0], b, scale))
      assert not bool(jnp.isnan(y).any()) and _rel(y, want[0]) < 1e-2, splits
    # rank 40 = three chunks over 2 splits (split 0 takes chunks 0 and 2)
    xa40, b40 = _act((m, 40), 7), _act((40, n), 8)
    y = w4_triton.forward(x[0], wq, out_dtype=jnp.float32, config=w4_triton.TileConfig(16, 32, 32, 2),
                          interpret=True, poison_output=True, lora=(xa40, b40, scale))
    want40 = (np.asarray(x[0], np.float64) @ _dense64(wq)
              + scale * np.asarray(xa40, np.float64) @ np.asarray(b40, np.float64))
    assert not bool(jnp.isnan(y).any()) and _rel(y, want40) < 1e-2
  ct = jnp.asarray(np.random.default_rng(m).standard_normal((1, m, n)), jnp.float32)

  def loss(x, xa, b, backend):
    return jnp.sum(quantized_matmul(x, wq, backend=backend, out_dtype=jnp.float32, lora=(xa, b, scale)) * ct)

  got = jax.grad(loss, argnums=(0, 1, 2))(x, xa, b, "interpret")
  ref = jax.grad(loss, argnums=(0, 1, 2))(x, xa, b, "reference")
  ct64 = np.asarray(ct, np.float64)[0]
  want_g = (ct64 @ _dense64(wq).T, scale * ct64 @ np.asarray(b, np.float64).T,
            scale * np.asarray(xa, np.float64)[0].T @ ct64)
  for g, gr, w64 in zip(got, ref, want_g):
    assert _rel(g, gr) < 1e-2 and _rel(np.asarray(g, np.float64).reshape(w64.shape), w64) < 1e-2
  with pytest.raises(ValueError, match="lora needs xa"):
    quantized_matmul(x, wq, backend="interpret", lora=(xa, b[:, :10], scale))


@pytest.mark.parametrize("m", [3, 70])
def test_lora_epilogue_reads_a_stacked_b_at_the_layer_index(m):
  """lora=(xa, b [L, R, N], scale) with index: the epilogue (M = 3) and the dequantize + dot path
  (M = 70) use layer `index` of b (clamped like the weight), equal to float64; the gradient for the
  stacked b is the layer's cotangent at that layer and zero elsewhere."""
  k, n, r, scale = 160, 72, 24, 0.5
  rng = np.random.default_rng(m)
  w = rng.standard_normal((3, k, n)).astype(np.float32) * np.array([0.02, 0.05, 0.1], np.float32)[:, None, None]
  wq = nvfp4.quantize(w)
  dense = np.asarray(nvfp4.dequantize(wq, jnp.float32), np.float64)
  x, xa = _act((m, k), 3), _act((m, r), 4)
  bs = jnp.stack([_act((r, n), 10 + i) for i in range(3)])
  b64 = np.asarray(bs, np.float64)
  f = jax.jit(lambda x, xa, b, i: quantized_matmul(x, wq, backend="interpret", out_dtype=jnp.float32, index=i,
                                                     lora=(xa, b, scale)))
  for i, layer in ((1, 1), (0, 0), (9, 2), (-4, 0), (-1, 0)):
    want = np.asarray(x, np.float64) @ dense[layer] + scale * np.asarray(xa, np.float64) @ b64[layer]
    assert _rel(f(x, xa, bs, jnp.int32(i)), want) < 1e-2, i
    ref = quantized_matmul(x, wq, backend="reference", out_dtype=jnp.float32, index=jnp.int32(i), lora=(xa, bs, scale))
    assert _rel(ref, want) < 1e-2, i
  ct = np.random.default_rng(1).standard_normal((m, n))
  loss = lambda b: jnp.sum(f(x, xa, b, jnp.int32(2)) * jnp.asarray(ct, jnp.float32))
  db = np.asarray(jax.grad(loss)(bs), np.float64)
  assert _rel(db[2], scale * np.asarray(xa, np.float64).T @ ct) < 1e-2
  assert not db[:2].any()
  # a negative index reads and differentiates layer 0, on both backends
  for backend in ("interpret", "reference"):
    neg = lambda b: jnp.sum(quantized_matmul(x, wq, backend=backend, out_dtype=jnp.float32, index=jnp.int32(-1),
                                             lora=(xa, b, scale)) * jnp.asarray(ct, jnp.float32))
    db = np.asarray(jax.grad(neg)(bs), np.float64)
    assert _rel(db[0], scale * np.asarray(xa, np.float64).T @ ct) < 1e-2 and not db[1:].any(), backend
  with pytest.raises(ValueError, match="lora needs xa"):  # a stacked b needs the index
    quantized_matmul(x, nvfp4.quantize(w[0]), backend="interpret", lora=(xa, bs, scale))


def test_leading_dims_and_out_dtype():
  wq = _weight("nvfp4", 96, 40, 5)
  x = _act((2, 3, 96), 6)
  y = quantized_matmul(x, wq, backend="interpret", out_dtype=jnp.float32)
  assert y.shape == (2, 3, 40) and y.dtype == jnp.float32
  want = np.asarray(x, np.float64).reshape(6, 96) @ _dense64(wq)
  assert _rel(np.asarray(y).reshape(6, 40), want) < 1e-4


def test_auto_on_cpu_is_reference():
  if jax.default_backend() != "cpu":
    pytest.skip("CPU dispatch only")
  wq = _weight("nvfp4", 96, 40, 1)
  x = _act((4, 96), 2)
  np.testing.assert_array_equal(np.asarray(quantized_matmul(x, wq), np.float32),
                                np.asarray(reference_matmul(x, wq), np.float32))


def test_bad_inputs_raise():
  wq = _weight("nvfp4", 96, 40, 1)
  with pytest.raises(ValueError, match="unknown backend"):
    quantized_matmul(_act((2, 96), 0), wq, backend="cuda")
  with pytest.raises(ValueError, match="K=64"):
    quantized_matmul(_act((2, 64), 0), wq)
  with pytest.raises(ValueError, match="bf16"):
    quantized_matmul(jnp.ones((2, 96), jnp.float32), wq, backend="interpret")
  with pytest.raises(TypeError, match="NVFP4Tensor or NF4Tensor"):
    quantized_matmul(_act((2, 96), 0), jnp.ones((96, 40)))
  with pytest.raises(ValueError, match="block_k"):
    w4_triton.forward(_act((2, 96), 0), wq, config=w4_triton.TileConfig(16, 32, 48), interpret=True)
  with pytest.raises(ValueError, match="decode must be"):
    w4_triton.forward(_act((2, 96), 0), wq, config=w4_triton.TileConfig(decode="fp4"), interpret=True)
  with pytest.raises(ValueError, match="stage must be"):
    w4_triton.forward(_act((2, 96), 0), wq, config=w4_triton.TileConfig(stage="smem"), interpret=True)
  with pytest.raises(ValueError, match="forward kernel only"):
    w4_triton.dx(_act((2, 40), 0), wq, config=w4_triton.TileConfig(decode="e4m3"), interpret=True)


@pytest.mark.parametrize("m,k,n,kind", [(1, 3584, 18944, "fwd"), (8, 18944, 3584, "fwd"),
                                        (256, 5120, 7168, "fwd"), (4096, 3584, 4608, "dx")])
def test_default_config_is_valid(m, k, n, kind):
  cfg = w4_triton.default_config(m, k, n, kind=kind)
  for v in (cfg.block_m, cfg.block_n, cfg.block_k):
    assert v >= 16 and v & (v - 1) == 0
  assert cfg.block_k % 16 == 0 and 1 <= cfg.splits <= 32
  if m >= 2048:
    assert cfg.splits == 1


@pytest.mark.parametrize("fmt,m", [("nvfp4", 3), ("nvfp4", 72), ("nf4", 5)])
def test_stacked_index_reads_the_right_layer(fmt, m):
  # A stack of 3 different layers; index traced under jit: the kernels read layer i in place.
  k, n = (160, 40) if fmt == "nvfp4" else (128, 40)
  rng = np.random.default_rng(m)
  w = rng.standard_normal((3, k, n)).astype(np.float32) * np.array([0.02, 0.05, 0.1], np.float32)[:, None, None]
  wq = (nvfp4 if fmt == "nvfp4" else nf4).quantize(w)
  x = _act((m, k), 7)
  dy = np.random.default_rng(8).standard_normal((m, n))
  f = jax.jit(lambda x, i: quantized_matmul(x, wq, out_dtype=jnp.float32, backend="interpret", index=i))
  g = jax.jit(jax.grad(lambda x, i: jnp.sum(quantized_matmul(x, wq, out_dtype=jnp.float32, backend="interpret",
                                                             index=i) * jnp.asarray(dy, jnp.float32))))
  dense = np.asarray((nvfp4 if fmt == "nvfp4" else nf4).dequantize(wq, jnp.float32), np.float64)
  # NVFP4 fused kernel (M <= 64): exact bf16 weights, so float32-accumulation error
  # only; M > 64 dequantizes W times 1/global scale to bf16 (rounded) first, and NF4
  # levels times the absmax are rounded to bf16 too. A wrong layer is off by O(1).
  tol = 1e-4 if (fmt == "nvfp4" and m <= matmul.FUSED_MAX_M["fwd"]) else 1e-2
  for i in (2, 0, 1):
    want = np.asarray(x, np.float64) @ dense[i]
    assert _rel(f(x, jnp.int32(i)), want) < tol
    # dx = dy @ W_i^T goes through the fused dx kernel (bf16 dy, bf16 output): bf16 rounding only
    assert _rel(g(x, jnp.int32(i)), dy @ dense[i].T) < 1e-2
  # an out-of-range layer is clamped to the stack (as lax.dynamic_index_in_dim), inside the kernels
  assert _rel(f(x, jnp.int32(7)), np.asarray(x, np.float64) @ dense[2]) < tol
  assert _rel(f(x, jnp.int32(-3)), np.asarray(x, np.float64) @ dense[0]) < tol
  # -1 too: the reference clamps like the kernels (a bare dynamic slice would wrap it to layer 2)
  assert _rel(f(x, jnp.int32(-1)), np.asarray(x, np.float64) @ dense[0]) < tol
  ref_neg = quantized_matmul(x, wq, out_dtype=jnp.float32, backend="reference", index=jnp.int32(-1))
  assert _rel(ref_neg, np.asarray(x, np.float64) @ dense[0]) < 1e-2
  ref = quantized_matmul(x, wq, out_dtype=jnp.float32, backend="reference", index=jnp.int32(1))
  # the reference dequantizes to x's dtype (bf16): W is rounded, hence 1e-2
  assert _rel(ref, np.asarray(x, np.float64) @ dense[1]) < 1e-2


def test_stacked_index_errors():
  wq = nvfp4.quantize(np.ones((32, 16), np.float32))
  with pytest.raises(ValueError, match="not a stack"):
    quantized_matmul(_act((2, 32), 0), wq, index=0)
  stack = nvfp4.quantize(np.ones((2, 32, 16), np.float32))
  with pytest.raises(ValueError, match=r"one \[K, N\] matrix, got packed shape \(2, 16, 16\)"):
    w4_triton.forward(_act((2, 32), 0), stack, interpret=True)
  # an adversarial probe: index 1.7 read layer 1, an index of shape [2] failed in a reshape, an int8 out_dtype
  # truncated, a NaN LoRA scale gave NaN outputs without a word
  with pytest.raises(TypeError, match="index must be an integer scalar, got float32 of shape"):
    quantized_matmul(_act((2, 32), 0), stack, index=jnp.float32(1.7))
  with pytest.raises(TypeError, match=r"index must be an integer scalar, got int32 of shape \(2,\)"):
    quantized_matmul(_act((2, 32), 0), stack, index=jnp.array([0, 1], jnp.int32))
  with pytest.raises(ValueError, match="out_dtype must be a floating dtype, got int8"):
    quantized_matmul(_act((2, 32), 0), wq, out_dtype=jnp.int8)
  xa, b = jnp.ones((2, 4), jnp.bfloat16), jnp.ones((4, 16), jnp.bfloat16)
  with pytest.raises(ValueError, match="the lora scale must be finite, got nan"):
    quantized_matmul(_act((2, 32), 0), wq, lora=(xa, b, float("nan")))
  y = quantized_matmul(_act((2, 32), 0), stack, index=1, out_dtype=jnp.float32)  # a Python int is fine
  np.testing.assert_allclose(np.asarray(y), np.asarray(quantized_matmul(_act((2, 32), 0), wq, out_dtype=jnp.float32)))


@pytest.mark.parametrize("backend", ["reference", "interpret"])
def test_no_rows_give_an_empty_product_and_gradient(backend):
  # M = 0 (x [0, K] or [2, 0, K]): an empty [..., N] result and an empty dx; the kernel path used to
  # fail choosing its tiles (a ZeroDivisionError in default_config).
  wq = _weight("nvfp4", 96, 40, 3)
  for shape in ((0, 96), (2, 0, 96)):
    x = jnp.zeros(shape, jnp.bfloat16)
    y = quantized_matmul(x, wq, backend=backend, out_dtype=jnp.float32)
    assert y.shape == (*shape[:-1], 40) and y.dtype == jnp.float32
    g = jax.grad(lambda x: jnp.sum(quantized_matmul(x, wq, backend=backend, out_dtype=jnp.float32)))(x)
    assert g.shape == shape and g.dtype == jnp.bfloat16
  xa, b = jnp.zeros((0, 16), jnp.bfloat16), jnp.ones((16, 40), jnp.bfloat16)
  y = quantized_matmul(jnp.zeros((0, 96), jnp.bfloat16), wq, backend=backend, lora=(xa, b, 2.0))
  assert y.shape == (0, 40) and y.dtype == jnp.bfloat16


@pytest.mark.parametrize("fmt", ["nvfp4", "nf4"])
def test_reference_gives_the_frozen_weight_a_zero_cotangent(fmt):
  # The docstring: W is frozen and gets a zero cotangent. The kernel path's custom_vjp always did;
  # the reference path (every CPU call) used to differentiate through the dequantize and gave the
  # block and global scales nonzero cotangents.
  k, n = 128, 40
  wq = _weight(fmt, k, n, 4)
  x = _act((5, k), 5)
  dy = np.random.default_rng(6).standard_normal((5, n))

  def loss(x, w):
    return jnp.sum(quantized_matmul(x, w, backend="reference", out_dtype=jnp.float32) * jnp.asarray(dy, jnp.float32))

  gx, gw = jax.grad(loss, argnums=(0, 1), allow_int=True)(x, wq)
  assert _rel(gx, dy @ _dense64(wq).T) < 1e-2
  for leaf in jax.tree.leaves(gw):
    if leaf.dtype != jax.dtypes.float0:
      assert not np.asarray(leaf, np.float32).any(), leaf.dtype


def test_non_float_or_scalar_x_raises():
  wq = _weight("nvfp4", 96, 40, 1)
  # an integer x used to dequantize W to int32 (every |w| < 1 truncated to 0) and return garbage
  with pytest.raises(ValueError, match=r"float array \[\.\.\., K=96\]; got int32\[2, 96\]"):
    quantized_matmul(jnp.ones((2, 96), jnp.int32), wq)
  with pytest.raises(ValueError, match="float array"):
    reference_matmul(jnp.ones((2, 96), jnp.int32), wq)
  with pytest.raises(ValueError, match=r"got bfloat16\[\]"):  # used to be an IndexError
    quantized_matmul(jnp.ones((), jnp.bfloat16), wq)


def test_stack_without_index_multiplies_every_layer_and_refuses_lora():
  # A stack [L, K, N] without index goes through the reference: x times every layer, [..., L, N].
  rng = np.random.default_rng(9)
  stack = nvfp4.quantize(rng.standard_normal((3, 64, 32)).astype(np.float32))
  x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
  y = quantized_matmul(x, stack)
  want = np.einsum("mk,lkn->mln", np.asarray(x, np.float64), _dense64(stack))
  assert y.shape == (3, 3, 32) and _rel(y, want) < 1e-5
  # with an adapter the [M, N] delta does not line up with [M, L, N]: at M == L it was added to the
  # wrong layers silently, else a broadcasting error
  xa, b = jnp.ones((3, 4), jnp.float32), jnp.ones((4, 32), jnp.float32)
  with pytest.raises(ValueError, match=r"lora needs a \[K, N\] weight, or a stack \[L, K, N\] with index"):
    quantized_matmul(x, stack, lora=(xa, b, 1.0))


@pytest.mark.parametrize("unroll,prefetch,splits", [(True, False, 1), (False, True, 1), (True, True, 2),
                                                    (False, True, 3)])
def test_unrolled_and_prefetching_loops_match_float64(unroll, prefetch, splits):
  # K = 224: 4 steps of 64 (the last one ragged); splits=3 becomes 2 programs of 2 steps, and
  # each program's prefetch of the step past its range is masked off.
  import dataclasses
  wq = _weight("nvfp4", 224, 40, 3)
  x = _act((5, 224), 4)
  cfg = dataclasses.replace(SMALL, unroll=unroll, prefetch=prefetch, splits=splits)
  y = w4_triton.forward(x, wq, config=cfg, interpret=True, poison_output=True, out_dtype=jnp.float32)
  assert _rel(y, np.asarray(x, np.float64) @ _dense64(wq)) < 1e-4


def test_large_m_gemm_writes_bf16_itself():
  """The large-M path (dequantize, then XLA's GEMM) asks the GEMM for a bf16 result when the output is bf16 (cuBLAS
  accumulates in float32 and rounds once; no float32 [M, N] and conversion pass), forward and dx; a float32 output
  and interpret mode keep the float32 product."""
  from pallas_kernels import matmul
  wq = jax.eval_shape(lambda: nvfp4.quantize(jnp.ones((256, 192), jnp.float32)))
  x, dy = jax.ShapeDtypeStruct((128, 256), jnp.bfloat16), jax.ShapeDtypeStruct((128, 192), jnp.bfloat16)

  def dots(fn, *args):
    eqns = jax.make_jaxpr(fn)(*args).jaxpr.eqns
    return [str(e.params["preferred_element_type"]) for e in eqns if e.primitive.name == "dot_general"]

  assert dots(lambda x, w: matmul.kernel_forward(x, w), x, wq) == ["bfloat16"]
  assert dots(lambda d, w: matmul.kernel_dx(d, w), dy, wq) == ["bfloat16"]
  assert dots(lambda x, w: matmul.kernel_forward(x, w, out_dtype=jnp.float32), x, wq) == ["float32"]
  assert dots(lambda x, w: matmul.kernel_forward(x, w, interpret=True), x, wq) == ["float32"]
  assert dots(lambda d, w: matmul.kernel_dx(d, w, interpret=True), dy, wq) == ["float32"]


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 17, 64, 2048])
@pytest.mark.parametrize("k,n", [(3584, 4608), (18944, 3584), (1040, 200)])
def test_gpu_kernels_match_reference(m, k, n):
  key = jax.random.PRNGKey(m + k)
  wq = nvfp4.quantize(jax.random.normal(key, (k, n), jnp.float32) * 0.02)
  x = jax.random.normal(jax.random.PRNGKey(1), (m, k), jnp.float32).astype(jnp.bfloat16)
  dy = jax.random.normal(jax.random.PRNGKey(2), (m, n), jnp.float32).astype(jnp.bfloat16)
  ref = reference_matmul(x, wq)
  y = quantized_matmul(x, wq, backend="pallas")
  assert not bool(jnp.isnan(y).any())
  assert _rel(y, ref) < 1e-2
  y_fused = w4_triton.forward(x, wq, poison_output=True)
  assert not bool(jnp.isnan(y_fused).any()) and _rel(y_fused, ref) < 1e-2
  g_fused = w4_triton.dx(dy, wq, poison_output=True)
  g_ref = jnp.dot(dy, nvfp4.dequantize(wq, jnp.bfloat16).T, preferred_element_type=jnp.float32)
  assert not bool(jnp.isnan(g_fused).any()) and _rel(g_fused, g_ref) < 1e-2
  g = jax.grad(lambda x: jnp.sum(quantized_matmul(x, wq, backend="pallas").astype(jnp.float32) * dy))(x)
  assert _rel(g, g_ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("m", [8, 64])
def test_gpu_stacked_index_matches_reference(m):
  k, n = 3584, 4608
  w = jax.random.normal(jax.random.PRNGKey(m), (3, k, n), jnp.float32) * 0.02
  wq = nvfp4.quantize(w)
  x = jax.random.normal(jax.random.PRNGKey(1), (m, k), jnp.float32).astype(jnp.bfloat16)
  f = jax.jit(lambda x, i: quantized_matmul(x, wq, backend="pallas", index=i))
  for i in (2, 0):
    y = f(x, jnp.int32(i))
    ref = reference_matmul(x, matmul.layer_of(wq, i))
    assert not bool(jnp.isnan(y).any()) and _rel(y, ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 17, 64])
@pytest.mark.parametrize("k,n", [(3584, 4608), (1040, 200)])
def test_gpu_e4m3_decode_matches_reference(m, k, n):
  """decode="e4m3" (float16 operands via Hopper's E4M3 conversion) on a NaN-poisoned output,
  with activations large enough that the 2**-4 pre-scale matters."""
  wq = nvfp4.quantize(jax.random.normal(jax.random.PRNGKey(m + n), (k, n), jnp.float32) * 0.02)
  x = (30 * jax.random.normal(jax.random.PRNGKey(3), (m, k), jnp.float32)).astype(jnp.bfloat16)
  cfg = dataclasses.replace(w4_triton.default_config(m, k, n), decode="e4m3")
  y = w4_triton.forward(x, wq, config=cfg, poison_output=True, out_dtype=jnp.float32)
  assert not bool(jnp.isnan(y).any()) and _rel(y, reference_matmul(x, wq, out_dtype=jnp.float32)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 17, 64, 100])
def test_gpu_lora_epilogue_matches_reference(m):
  """quantized_matmul(lora=...) on the GPU kernel path (on sm_90 the Gluon kernel plus an XLA delta up
  to M = 128; the Pallas epilogue for M <= 64 where Gluon is off) against the reference backend,
  values and gradients for x, xa and b, at the 7B fused q/k/v shape with rank 96."""
  k, n, r, scale = 3584, 4608, 96, 0.5
  wq = nvfp4.quantize(jax.random.normal(jax.random.PRNGKey(m), (k, n), jnp.float32) * 0.02)
  x = jax.random.normal(jax.random.PRNGKey(1), (m, k), jnp.float32).astype(jnp.bfloat16)
  xa = jax.random.normal(jax.random.PRNGKey(2), (m, r), jnp.float32).astype(jnp.bfloat16)
  b = (0.1 * jax.random.normal(jax.random.PRNGKey(3), (r, n), jnp.float32)).astype(jnp.bfloat16)
  ct = jax.random.normal(jax.random.PRNGKey(4), (m, n), jnp.float32)

  def loss(x, xa, b, backend):
    y = quantized_matmul(x, wq, backend=backend, out_dtype=jnp.float32, lora=(xa, b, scale))
    return jnp.sum(y * ct), y

  (_, y), g = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(x, xa, b, "pallas")
  (_, y_ref), g_ref = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(x, xa, b, "reference")
  assert not bool(jnp.isnan(y).any()) and _rel(y, y_ref) < 1e-2
  for a, c in zip(g, g_ref):
    assert _rel(a, c) < 1e-2


@pytest.mark.gpu
def test_gpu_lora_epilogue_with_a_stacked_b_matches_reference():
  """The epilogue reading layer `index` of a stacked b [L, R, N] in place (a decode step's layer
  scan) against the reference, at the 7B gate/up shape (fused: N = 37888) with rank 64, M = 8."""
  k, n, r, scale = 3584, 37888, 64, 0.5
  wq = nvfp4.quantize(jax.random.normal(jax.random.PRNGKey(0), (2, k, n), jnp.float32) * 0.02)
  x = jax.random.normal(jax.random.PRNGKey(1), (8, k), jnp.float32).astype(jnp.bfloat16)
  xa = jax.random.normal(jax.random.PRNGKey(2), (8, r), jnp.float32).astype(jnp.bfloat16)
  bs = (0.1 * jax.random.normal(jax.random.PRNGKey(3), (2, r, n), jnp.float32)).astype(jnp.bfloat16)
  f = jax.jit(lambda i, backend: quantized_matmul(x, wq, backend=backend, out_dtype=jnp.float32, index=i,
                                                  lora=(xa, bs, scale)), static_argnums=1)
  for i in (1, 0):
    y, y_ref = f(jnp.int32(i), "pallas"), f(jnp.int32(i), "reference")
    assert not bool(jnp.isnan(y).any()) and _rel(y, y_ref) < 1e-2, i


def test_kernels_lower_for_cuda_without_a_gpu(monkeypatch):
  """Every kernel lowers through Pallas' Triton lowering for CUDA (no GPU needed): catches lowering
  errors that interpret mode cannot, e.g. an op the Triton lowering rejects. jax >= 0.11 asks the
  GPU for its compute capability while lowering; here it is told sm_90."""
  try:
    from jax._src.pallas.triton import pallas_call_registration as reg
  except ImportError:
    pytest.skip("this jax has no Pallas Triton lowering module to check")
  if hasattr(reg, "gpu_info_lib"):
    import types
    monkeypatch.setattr(reg.gpu_info_lib, "get_gpu_info", lambda: types.SimpleNamespace(compute_capability=90))
  from pallas_kernels import decode_attention as da
  sd = jax.ShapeDtypeStruct
  k, n = 256, 192
  stack = jax.eval_shape(lambda: nvfp4.quantize(jnp.ones((3, k, n), jnp.float32)))
  one = jax.eval_shape(lambda: nvfp4.quantize(jnp.ones((k, n), jnp.float32)))
  i = sd((), jnp.int32)
  bf = lambda *s: sd(s, jnp.bfloat16)
  e4m3 = dataclasses.replace(w4_triton.default_config(8, k, n), decode="e4m3")
  cases = {
      "forward": (lambda x, w, i: w4_triton.forward(x, w, index=i), bf(8, k), stack, i),
      "forward M=64": (lambda x, w, i: w4_triton.forward(x, w, index=i), bf(64, k), stack, i),
      "forward lora": (lambda x, w, a, b: w4_triton.forward(x, w, lora=(a, b, 0.5)), bf(8, k), one, bf(8, 24),
                       bf(24, n)),
      "forward stacked lora": (lambda x, w, a, b, i: w4_triton.forward(x, w, index=i, lora=(a, b, 0.5)), bf(8, k),
                               stack, bf(8, 24), bf(3, 24, n), i),
      "forward e4m3": (lambda x, w: w4_triton.forward(x, w, config=e4m3), bf(8, k), one),
      "dx": (lambda dy, w, i: w4_triton.dx(dy, w, index=i), bf(8, n), stack, i),
      "dequantize": (lambda w, i: w4_triton.dequantize(w, index=i), stack, i),
      "decode attention": (lambda q, kc, vc, l, m, t: da.decode_attention(q, kc, vc, l, m, t, backend="pallas"),
                           bf(2, 14, 64), bf(3, 2, 80, 2, 64), bf(3, 2, 80, 2, 64), i, sd((2, 80), jnp.bool_), i),
      "decode attention append": (
          lambda y, bias, kc, vc, l, m, t, cos, sin: da.decode_attention_append(
              y, bias, kc, vc, l, m, t, cos, sin, num_heads=14, backend="pallas"),
          sd((2, 18 * 64), jnp.float32), bf(18 * 64), bf(3, 2, 80, 2, 64), bf(3, 2, 80, 2, 64), i,
          sd((2, 80), jnp.int8), i, sd((2, 32), jnp.float32), sd((2, 32), jnp.float32)),
  }
  for name, (fn, *args) in cases.items():
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in lowered.lower(), name  # the kernel is in the module as a Triton custom call


def test_decode_order_weights_on_the_pallas_kernels_equal_the_standard_order():
  """A weight in nvfp4.to_decode_order's order (the Gluon kernel's) through the interpret-mode Pallas
  kernels: forward (with a stacked LoRA factor at a clamped layer) and dx convert the layer's codes
  back, the dequantize kernel reads them in place; all give the standard order's results bit for bit."""
  k, n, m, r = 160, 72, 5, 8
  wq = nvfp4.quantize(np.random.default_rng(3).standard_normal((3, k, n)).astype(np.float32) * 0.05)
  wd = nvfp4.to_decode_order(wq)
  x, dy, xa = _act((m, k), 1), _act((m, n), 2), _act((m, r), 3)
  bs = jnp.stack([_act((r, n), 10 + i) for i in range(3)])
  for i in (1, 7):  # 7 is clamped to the last layer
    idx = jnp.int32(i)
    for fn in (lambda w: w4_triton.forward(x, w, config=SMALL, interpret=True, index=idx, lora=(xa, bs, 0.5)),
               lambda w: w4_triton.dx(dy, w, config=SMALL, interpret=True, index=idx),
               lambda w: w4_triton.dequantize(w, interpret=True, index=idx)):
      np.testing.assert_array_equal(np.asarray(fn(wd), np.float32), np.asarray(fn(wq), np.float32))
  y = quantized_matmul(x, wd, backend="interpret", out_dtype=jnp.float32, index=jnp.int32(2))
  want = np.asarray(x, np.float64) @ _dense64(jax.tree.map(lambda a: a[2], wq))
  assert _rel(y, want) < 1e-4
  np.testing.assert_array_equal(np.asarray(reference_matmul(x, jax.tree.map(lambda a: a[0], wd))),
                                np.asarray(reference_matmul(x, jax.tree.map(lambda a: a[0], wq))))


@pytest.mark.parametrize("l,k,n,block_k2,block_n", [(3, 160, 72, None, None), (2, 64, 300, 8, 32), (1, 48, 10, 16, 64)])
def test_dequantize_reads_decode_order_in_place(l, k, n, block_k2, block_n, monkeypatch):
  """w4_triton.DEQUANT_DECODE_ORDER_IN_PLACE (the default, pinned here): the dequantize kernel reads
  decode-order codes in place (byte views of each block's two code rows) and gives the standard order's dense weight bit
  for bit, at every layer of a stack, with ragged K/4 and N/2 against the tiles."""
  monkeypatch.setattr(w4_triton, "DEQUANT_DECODE_ORDER_IN_PLACE", True)
  w = nvfp4.quantize(np.random.default_rng(k + n).standard_normal((l, k, n)).astype(np.float32) * 0.05)
  wd = nvfp4.to_decode_order(w)
  for i in range(l):
    kw = dict(interpret=True, index=jnp.int32(i), block_k2=block_k2, block_n=block_n)
    got = np.asarray(w4_triton.dequantize(wd, **kw), np.float32)
    np.testing.assert_array_equal(got, np.asarray(w4_triton.dequantize(w, **kw), np.float32))
    np.testing.assert_array_equal(got, np.asarray(nvfp4.dequantize(jax.tree.map(lambda a: a[i], w), jnp.bfloat16),
                                                  np.float32))


@pytest.mark.parametrize("backend", ["reference", "interpret"])
def test_addend_is_added_before_the_one_rounding(backend):
  """``quantized_matmul(..., addend=c)`` is bf16(x @ W + c) with the sum in float32 (the bf16 route's bias plus
  LoRA delta): against a float64 product on every backend, for the large-M shape (M = 96 > FUSED_MAX_M, the
  dequantize path in interpret mode) and a small one; its cotangents are dx of the plain product and dy itself."""
  wq = _weight("nvfp4", 128, 192, 0)
  for m in (5, 96):
    x = _act((m, 128), 1)
    c = _act((m, 192), 2) * 0.25
    y = quantized_matmul(x, wq, backend=backend, addend=c)
    want = np.asarray(x, np.float64) @ _dense64(wq) + np.asarray(c, np.float64)
    assert y.dtype == jnp.bfloat16 and _rel(y, want) < 4e-3
    dy = _act((m, 192), 3)
    f = lambda x, c: jnp.sum(quantized_matmul(x, wq, backend=backend, addend=c).astype(jnp.float32) * dy)
    gx, gc = jax.grad(f, argnums=(0, 1))(x, c)
    gx_plain = jax.grad(lambda x: jnp.sum(quantized_matmul(x, wq, backend=backend).astype(jnp.float32) * dy))(x)
    np.testing.assert_array_equal(np.asarray(gc, np.float32), np.asarray(dy.astype(jnp.bfloat16), np.float32))
    np.testing.assert_array_equal(np.asarray(gx, np.float32), np.asarray(gx_plain, np.float32))


def test_addend_errors_name_the_problem():
  """An addend of the wrong shape or an integer dtype, or together with lora, is refused by name."""
  wq = _weight("nvfp4", 128, 192, 0)
  x = _act((4, 128), 1)
  with pytest.raises(ValueError, match="addend must be a float array"):
    quantized_matmul(x, wq, addend=jnp.zeros((4, 191), jnp.bfloat16))
  with pytest.raises(ValueError, match="addend must be a float array"):
    quantized_matmul(x, wq, addend=jnp.zeros((4, 192), jnp.int32))
  with pytest.raises(ValueError, match="addend and lora"):
    quantized_matmul(x, wq, addend=jnp.zeros((4, 192), jnp.bfloat16),
                     lora=(jnp.zeros((4, 8), jnp.bfloat16), jnp.zeros((8, 192), jnp.bfloat16), 1.0))


def test_large_m_gluon_forward_dispatch(monkeypatch):
  """kernel_forward sends a bf16 product to the large-M Gluon forward for FUSED_MAX_M < M <= MAX_M where the
  decode GEMV does not run, without lora, with GLUON_MM "auto" (with the kernel's own checks faked true: no GPU
  here), and by default the narrow tiles' 32 < M <= 128 from the decode GEMV (which keeps the smallest weights at
  M <= 64 where it runs); a float32 result, a LoRA term,
  GLUON_MM = "0" and M = 8192 keep dequantize + cuBLAS; a bad setting is refused by name."""
  from pallas_kernels import w4_gluon, w4_gluon_mm
  monkeypatch.setattr(w4_gluon_mm, "applies", lambda m, w, dt: True)
  monkeypatch.setattr(matmul, "gluon_enabled", lambda: True)
  monkeypatch.setattr(w4_gluon, "applies", lambda m, w, dt: m <= 128)
  wq = _weight("nvfp4", 128, 256, 0)
  use = lambda m, **kw: matmul._use_gluon_mm(jax.ShapeDtypeStruct((m, 128), jnp.bfloat16), wq,
                                             kw.get("out", jnp.bfloat16), False, kw.get("lora"))
  # by default the narrow tiles take 32 < M <= 128 from the decode GEMV, which keeps M <= 32, and M <= 64 for a
  # weight of at most NARROW_SMALL_WEIGHTS values (this one: 128 x 256)
  ms = (1, 32, 33, 64, 65, 128, 129, 2048, 4096, 4097, 8192)
  assert [m for m in ms if use(m)] == [65, 128, 129, 2048, 4096]
  path = lambda m: matmul.forward_path(jax.ShapeDtypeStruct((m, 128), jnp.bfloat16), wq)  # the same, named
  assert [path(m) for m in (1, 64, 65, 4096, 4097)] == ["gluon", "gluon", "gluon_mm", "gluon_mm", "dequantize+dot"]
  assert matmul.forward_path(jax.ShapeDtypeStruct((65, 128), jnp.bfloat16), wq, out_dtype=jnp.float32) == "gluon"
  monkeypatch.setattr(w4_gluon_mm, "NARROW_SMALL_WEIGHTS", 128 * 256 - 1)  # one value fewer: the narrow tiles take it
  assert [m for m in ms if use(m)] == [33, 64, 65, 128, 129, 2048, 4096]
  monkeypatch.setattr(w4_gluon_mm, "NARROW_SMALL_WEIGHTS", 0)
  assert not use(64, out=jnp.float32) and not use(64, lora=(None, None, 1.0))
  monkeypatch.setattr(w4_gluon_mm, "SMALL_M_MAX", 0)  # without them: the GEMV to 128, then this kernel
  assert [m for m in (64, 65, 128, 129, 2048, 4096, 4097, 8192) if use(m)] == [129, 2048, 4096]
  monkeypatch.setattr(w4_gluon, "applies", lambda m, w, dt: False)  # no decode GEMV (e.g. N % 256 != 0)
  assert use(65) and not use(64)
  monkeypatch.setattr(w4_gluon_mm, "SMALL_M_MAX", 128)  # nor does the small weight stay off the narrow tiles then
  monkeypatch.setattr(w4_gluon_mm, "NARROW_SMALL_WEIGHTS", 1 << 24)
  assert use(33) and use(64)
  assert not use(2048, out=jnp.float32) and not use(2048, lora=(None, None, 1.0))
  monkeypatch.setattr(matmul, "GLUON_MM", "0")
  assert not use(2048)
  monkeypatch.setattr(matmul, "GLUON_MM", "1")
  with pytest.raises(ValueError, match="GLUON_MM"):
    use(2048)


def test_addend_takes_the_route_forward_path_names(monkeypatch):
  """kernel_forward with an addend: a bf16 addend goes into the large-M Gluon forward's epilogue where forward_path
  names that kernel; a float32 addend there, and any addend at a GEMV-sized M, is added in float32 to the float32
  result of the path forward_path names for it, then rounded once; past the GEMVs' rows, dequantize + dot. The
  kernels are stand-ins (no GPU here) whose products are known, so each route's value is checked by hand."""
  from pallas_kernels import w4_gluon, w4_gluon_mm
  monkeypatch.setattr(w4_gluon_mm, "applies", lambda m, w, dt: True)
  monkeypatch.setattr(matmul, "gluon_enabled", lambda: True)
  monkeypatch.setattr(w4_gluon, "applies", lambda m, w, dt: m <= 128)
  calls = []
  def mm(x, w, *, index=None, addend=None):
    calls.append(("gluon_mm", None if addend is None else addend.dtype))
    return (jnp.full((x.shape[0], w.shape[1]), 2.0, jnp.float32) + addend.astype(jnp.float32)).astype(jnp.bfloat16)
  def gemv(x, w, *, out_dtype=None, index=None):
    calls.append(("gluon", jnp.dtype(out_dtype)))
    return jnp.full((x.shape[0], w.shape[1]), 1.0 + 2.0 ** -8, out_dtype)  # a tie in bf16: rounded alone, 1.0
  monkeypatch.setattr(w4_gluon_mm, "forward", mm)
  monkeypatch.setattr(w4_gluon, "forward", gemv)
  monkeypatch.setattr(w4_triton, "dequantize", lambda w, dtype, **kw: jnp.ones(w.shape, dtype))
  wq = _weight("nvfp4", 128, 256, 0)
  add = lambda m, dt: jnp.full((m, 256), 2.0 ** -9, dt)
  y = matmul.kernel_forward(jnp.ones((65, 128), jnp.bfloat16), wq, addend=add(65, jnp.bfloat16))
  assert calls.pop() == ("gluon_mm", jnp.dtype(jnp.bfloat16)) and float(y[0, 0]) == 2.0
  # a float32 addend at the same M: the float32 GEMV product + addend = 1 + 3 * 2**-9, rounded once to bf16 is
  # 1 + 2**-7 (rounding the product first would give 1.0, and 1.0 again after the add)
  f32, bf16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)
  y = matmul.kernel_forward(jnp.ones((65, 128), jnp.bfloat16), wq, addend=add(65, jnp.float32))
  assert calls.pop() == ("gluon", f32) and y.dtype == bf16 and float(y[0, 0]) == 1.0 + 2.0 ** -7
  y = matmul.kernel_forward(jnp.ones((8, 128), jnp.bfloat16), wq, addend=add(8, jnp.bfloat16))
  assert calls.pop() == ("gluon", f32) and float(y[0, 0]) == 1.0 + 2.0 ** -7
  # past the GEMVs (M = 4097 > MAX_M): dequantize + dot, 128 ones summed, plus the addend
  y = matmul.kernel_forward(jnp.ones((4097, 128), jnp.bfloat16), wq, addend=add(4097, jnp.bfloat16))
  assert not calls and float(y[0, 0]) == 128.0


def test_model_narrow_route_is_on_by_default(monkeypatch):
  """dense_path_applies (the model's bf16 route) holds past 128 rows, or up to 128 where the decode GEMV does not
  run; with GLUON_MM_NARROW_MODEL = "1" (the default) also where the narrow tiles take the bf16 product (32 < M <= 128, the
  smallest weights at M <= 64 left to the GEMV). Kernel checks faked true (no GPU here)."""
  from pallas_kernels import w4_gluon, w4_gluon_mm
  monkeypatch.setattr(matmul, "_on_gpu", lambda: True)
  monkeypatch.setattr(w4_gluon_mm, "applies", lambda m, w, dt: True)
  monkeypatch.setattr(matmul, "gluon_enabled", lambda: True)
  monkeypatch.setattr(w4_gluon, "applies", lambda m, w, dt: m <= 128)
  wq = _weight("nvfp4", 128, 256, 0)  # 32768 values: at most NARROW_SMALL_WEIGHTS
  dense = lambda m: matmul.dense_path_applies(jax.ShapeDtypeStruct((m, 128), jnp.bfloat16), wq)
  ms = (16, 32, 33, 64, 65, 128, 129, 4096)
  assert matmul.GLUON_MM_NARROW_MODEL == "1" or "QERL_GLUON_MM_NARROW_MODEL" in os.environ
  monkeypatch.setattr(matmul, "GLUON_MM_NARROW_MODEL", "0")
  assert [m for m in ms if dense(m)] == [129, 4096]
  monkeypatch.setattr(matmul, "GLUON_MM_NARROW_MODEL", "1")
  assert [m for m in ms if dense(m)] == [65, 128, 129, 4096]
  monkeypatch.setattr(w4_gluon_mm, "NARROW_SMALL_WEIGHTS", 0)
  assert [m for m in ms if dense(m)] == [33, 64, 65, 128, 129, 4096]
  assert not matmul.dense_path_applies(jax.ShapeDtypeStruct((64, 128), jnp.float32), wq)  # a float32 x: no route
  monkeypatch.setattr(matmul, "GLUON_MM", "0")  # the large-M forward off: the GEMV's float32 route again
  assert [m for m in ms if dense(m)] == [129, 4096]
  monkeypatch.setattr(matmul, "GLUON_MM_NARROW_MODEL", "yes")
  with pytest.raises(ValueError, match="GLUON_MM_NARROW_MODEL"):
    dense(64)
