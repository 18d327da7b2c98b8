"""NF4 format tests against an independent float64 numpy nearest-level reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qerl_jax import nf4

# The 16 NormalFloat levels as printed in the QLoRA paper, Appendix E (and bitsandbytes).
QLORA_LEVELS = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236328, 1.0]


def ref_quantize(w):
  """Blocks of 64 along K: absmax, then the nearest level of float32(w / absmax) by
  distance in float64 (ties to the lower level). Returns (codes [..., K, N], absmax)."""
  w = np.asarray(w, np.float32)
  *lead, k, n = w.shape
  blocks = w.reshape(*lead, k // 64, 64, n).astype(np.float64)
  absmax = np.abs(blocks).max(axis=-2)
  safe = np.where(absmax > 0, absmax, 1.0)
  normed = (blocks / safe[..., :, None, :]).astype(np.float32).astype(np.float64)
  levels = np.asarray(QLORA_LEVELS, np.float32).astype(np.float64)
  codes = np.argmin(np.abs(normed[..., None] - levels), axis=-1)  # first = lower on a tie
  return codes.reshape(*lead, k, n).astype(np.uint8), absmax


def unpack(packed):
  packed = np.asarray(packed)
  codes = np.stack([packed & 0xF, packed >> 4], axis=-2)
  return codes.reshape(*packed.shape[:-2], -1, packed.shape[-1])


def test_codebook_is_qlora_nf4():
  np.testing.assert_array_equal(nf4.NF4_CODEBOOK, np.asarray(QLORA_LEVELS, np.float32))
  assert nf4.NF4_CODEBOOK[7] == 0.0 and np.all(np.diff(nf4.NF4_CODEBOOK) > 0)


@pytest.mark.parametrize("shape", [(64, 8), (256, 40), (3, 128, 16), (2, 2, 64, 24)])
def test_quantize_matches_nearest_level_reference(shape):
  rng = np.random.default_rng(sum(shape))
  w = (rng.standard_normal(shape) * 10.0 ** rng.uniform(-3, 2, size=(*shape[:-1], 1))).astype(np.float32)
  t = nf4.quantize(w)
  codes, absmax = ref_quantize(w)
  assert t.shape == shape[-2:] and t.packed.dtype == jnp.uint8
  assert t.packed.shape == (*shape[:-2], shape[-2] // 2, shape[-1])
  np.testing.assert_array_equal(np.asarray(t.block_scale, np.float64), absmax)
  np.testing.assert_array_equal(unpack(t.packed), codes)
  lead = shape[:-2]
  deq_ref = (np.asarray(QLORA_LEVELS, np.float32)[codes].astype(np.float64).reshape(*lead, shape[-2] // 64, 64, shape[-1])
             * absmax[..., :, None, :]).reshape(shape)
  np.testing.assert_array_equal(np.asarray(nf4.dequantize(t), np.float64), deq_ref.astype(np.float32))


def test_hand_worked_block():
  # absmax 2: 2 -> level 1.0 (code 15); -2 -> -1 (code 0); 0.15 / 2 = 0.075 -> 0.0796 (code 8);
  # 0.07 / 2 = 0.035 -> 0.0 (code 7, under the midpoint 0.0398); 0 -> code 7.
  col = np.zeros((64, 1), np.float32)
  col[:5, 0] = [2.0, -2.0, 0.15, 0.07, 0.0]
  t = nf4.quantize(col)
  np.testing.assert_array_equal(unpack(t.packed)[:5, 0], [15, 0, 8, 7, 7])
  np.testing.assert_allclose(np.asarray(nf4.dequantize(t))[:5, 0],
                             [2.0, -2.0, 2 * 0.07958029955625534, 0.0, 0.0], rtol=1e-7)
  # the first two codes share byte 0: 15 | 0 << 4
  assert int(t.packed[0, 0]) == 0x0F


def test_zero_block_nan_inf_and_k_checks():
  w = np.ones((128, 4), np.float32)
  w[:64, 1] = 0.0
  deq = np.asarray(nf4.dequantize(nf4.quantize(w)))
  assert np.all(deq[:64, 1] == 0.0) and np.all(np.isfinite(deq))
  assert np.all(np.asarray(nf4.dequantize(nf4.quantize(np.zeros((64, 2), np.float32)))) == 0.0)
  w[70, 3] = np.inf
  with pytest.raises(ValueError, match=r"1 non-finite.*\(70, 3\)"):
    nf4.quantize(w)
  with pytest.raises(ValueError, match=r"\(100, 4\).*pad=True"):
    nf4.quantize(np.ones((100, 4), np.float32))
  t = nf4.quantize(np.ones((100, 4), np.float32), pad=True)
  assert t.shape == (128, 4)
  np.testing.assert_array_equal(np.asarray(nf4.dequantize(t))[100:], 0.0)
  with pytest.raises(TypeError):
    nf4.dequantize(np.ones((64, 4)))


# Measured: relative Frobenius error of NF4 on a 1024 x 1024 standard normal: 0.09196 (seed 0);
# seeds 0-3 at 1024 x 1024 and 4096 x 1024 all fall in 0.0919-0.0921. (NVFP4: 0.0950; both
# store 4.5 bits per weight: NF4 a float32 absmax per 64, NVFP4 an E4M3 scale per 16.)
GAUSSIAN_REL_FROB_NF4 = 0.0920


def test_relative_frobenius_error_on_gaussian():
  w = np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32)
  deq = np.asarray(nf4.dequantize(nf4.quantize(w)), np.float64)
  err = np.linalg.norm(deq - w) / np.linalg.norm(w)
  assert abs(err - GAUSSIAN_REL_FROB_NF4) < 3e-4, err


def test_jit_matches_eager():
  w = jnp.asarray(np.random.default_rng(2).standard_normal((2, 128, 16)), jnp.bfloat16)
  t = nf4.quantize(w)
  tj = jax.jit(nf4.quantize)(w)
  np.testing.assert_array_equal(np.asarray(t.packed), np.asarray(tj.packed))
  np.testing.assert_array_equal(np.asarray(t.block_scale), np.asarray(tj.block_scale))


def test_repr_of_a_tree_map_result_shows_the_leaves():
  """As for NVFP4Tensor: __repr__ read ``packed.shape`` of whatever a tree_map left there."""
  t = nf4.quantize(jax.random.normal(jax.random.PRNGKey(0), (128, 48)))
  assert repr(jax.tree.map(lambda a: a.shape, t)) == "NF4Tensor(packed=(64, 48), block_scale=(2, 48), shape=(128, 48))"
  assert repr(t) == "NF4Tensor(shape=(128, 48), block=64)"
