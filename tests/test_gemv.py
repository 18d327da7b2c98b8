"""Tests of the split-K GEMV for decode-size M (pallas_kernels/w4_gemv.py).

On CPU the kernel runs in Pallas interpret mode on ragged shapes (M = 1, 3, 17;
N not a multiple of the column tile; K a multiple of 16 but not of the K step)
in all three modes and both split-K reductions, and is compared with a float64
numpy product of a weight decoded in numpy from the packed E2M1 codes and E4M3
scales (independent of qerl_jax.nvfp4.dequantize) and with the XLA reference.
The partials variant writes into a NaN-poisoned buffer, so an element the
kernel never writes fails.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import reference_matmul, w4_gemv
from qerl_jax import nf4, nvfp4

# E2M1 magnitudes of codes 0..7 (OCP MX v1.0, table of FP4 values); bit 3 is the sign.
_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _nvfp4_dense64(wq):
  """Packed uint8 [K/2, N] + E4M3 [K/16, N] + global scale -> float64 [K, N], in numpy."""
  p = np.asarray(wq.packed)
  codes = np.stack([p & 0xF, p >> 4], axis=1).reshape(2 * p.shape[0], p.shape[1])
  vals = _E2M1[codes & 7] * np.where(codes & 8, -1.0, 1.0)
  s = np.asarray(wq.block_scale.astype(jnp.float32), np.float64)
  return vals * np.repeat(s, 16, axis=0) / float(wq.global_scale)


def _case(m, k, n, seed, fmt=nvfp4):
  rng = np.random.default_rng(seed)
  wq = fmt.quantize(rng.standard_normal((k, n)).astype(np.float32) * 0.05)
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  return x, wq


C = w4_gemv.GemvConfig
# block_n 64 / block_k 64 with K = 1040 (= 16 * 65, not a multiple of 64) and N = 200 (not of 64);
# target_programs 16 makes the 4 column tiles split K 4 ways.
CONFIGS = {
    "fma_atomic": C(64, 64, 16, 4, 2, "fma", "atomic"),
    "fma_partials": C(64, 64, 16, 4, 2, "fma", "partials"),
    "defer_atomic": C(64, 64, 16, 4, 2, "fma_defer", "atomic"),
    "dot_atomic": C(64, 64, 16, 4, 2, "dot", "atomic"),
    "dot_nosplit": C(64, 64, 0, 4, 2, "dot", "atomic"),
}


@pytest.mark.parametrize("m,name", [(1, "fma_atomic"), (3, "fma_partials"), (1, "defer_atomic"),
                                    (3, "dot_atomic"), (17, "dot_atomic"), (17, "dot_nosplit"),
                                    (17, "fma_partials")])
def test_gemv_nvfp4_matches_float64(m, name):
  k, n = 1040, 200
  x, wq = _case(m, k, n, seed=m)
  cfg = CONFIGS[name]
  want = np.asarray(x, np.float64) @ _nvfp4_dense64(wq)
  y32 = w4_gemv.gemv(x, wq, config=cfg, out_dtype=jnp.float32, interpret=True)
  assert y32.shape == (m, n) and y32.dtype == jnp.float32
  assert not np.isnan(np.asarray(y32)).any()
  # exact bf16 weights (E2M1 x E4M3 has <= 6 significant bits), float32 accumulation
  assert _rel(y32, want) < 1e-4
  y = w4_gemv.gemv(x, wq, config=cfg, interpret=True, poison_output=True)  # bf16 out, NaN-poisoned
  assert y.dtype == jnp.bfloat16
  assert not np.isnan(np.asarray(y, np.float32)).any()
  assert _rel(y, want) < 1e-2
  assert _rel(y, reference_matmul(x, wq)) < 1e-2


def test_gemv_nf4_matches_reference():
  x, wq = _case(3, 192, 72, seed=5, fmt=nf4)
  cfg = C(64, 64, 8, 4, 2, "fma", "atomic")
  y = w4_gemv.gemv(x, wq, config=cfg, out_dtype=jnp.float32, interpret=True)
  want = np.asarray(x, np.float64) @ np.asarray(nf4.dequantize(wq, jnp.float32), np.float64)
  assert not np.isnan(np.asarray(y)).any()
  assert 1e-6 < _rel(y, want) < 1e-2  # NF4 levels x absmax are rounded to bf16 in the kernel


def test_default_config_buckets():
  assert w4_gemv.default_config(1).mode == "fma"
  assert w4_gemv.default_config(8).mode == "dot"
  assert w4_gemv.default_config(32).mode == "dot"
  assert w4_gemv.default_config(500) == w4_gemv.default_config(32)


def test_gemv_bad_inputs_raise():
  x, wq = _case(2, 64, 32, seed=1)
  with pytest.raises(ValueError, match="K=48"):
    w4_gemv.gemv(x[:, :48], wq, interpret=True)
  with pytest.raises(ValueError, match="2-D"):
    w4_gemv.gemv(x[None], wq, interpret=True)
  with pytest.raises(ValueError, match="power of 2"):
    w4_gemv.gemv(x, wq, config=C(block_n=48), interpret=True)
  with pytest.raises(ValueError, match="mode/reduce"):
    w4_gemv.gemv(x, wq, config=C(mode="simd"), interpret=True)
  with pytest.raises(TypeError, match="NVFP4Tensor"):
    w4_gemv.gemv(x, np.zeros((64, 32)), interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 17, 32])
@pytest.mark.parametrize("k,n", [(3584, 4608), (1040, 200)])
def test_gpu_gemv_matches_reference(m, k, n):
  x, wq = _case(m, k, n, seed=m + k)
  ref = reference_matmul(x, wq)
  for poison in (False, True):  # atomic split-K; partials into a NaN-poisoned buffer
    y = w4_gemv.gemv(x, wq, poison_output=poison)
    assert not np.isnan(np.asarray(y, np.float32)).any()
    assert _rel(y, ref) < 1e-2
