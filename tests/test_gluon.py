"""Tests of the Gluon decode GEMV (pallas_kernels/w4_gluon.py).

The kernel runs only on an NVIDIA GPU (no interpreter for Gluon): its numerics are tested there
against a float64 numpy product of the dequantized weight. On CPU the tests cover what decides
where it runs (shape support, the split rule worked by hand) and that ``quantized_matmul`` never
picks it without a GPU.
"""

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import matmul, quantized_matmul, reference_matmul, w4_gluon
from qerl_jax import nf4, nvfp4


def _rel(a, b):
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _weight(k, n, seed, layers=None):
  shape = (k, n) if layers is None else (layers, k, n)
  return nvfp4.quantize(np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 0.05)


def _act(m, k, seed):
  return jnp.asarray(np.random.default_rng(seed).standard_normal((m, k)) * 3.0, jnp.bfloat16)


@pytest.mark.parametrize("k,n,splits", [
    (3584, 4608, 28),    # 7B q/k/v: 56 steps, 18 tiles; 28 splits -> 504 programs (2 steps each)
    (3584, 3584, 28),    # 7B o: 14 tiles; 28 -> 392 (|392 - 512| < |784 - 512| for 56 splits)
    (3584, 37888, 7),    # 7B gate/up fused: 148 tiles; at most 8 steps -> 7 splits, 1036 programs
    (18944, 3584, 37),   # 7B down: 296 steps = 8 x 37; 37 splits -> 518 programs
    (64, 256, 1),        # one step, one tile
])
def test_split_rule_by_hand(k, n, splits):
  assert w4_gluon._splits(k, n) == splits


@pytest.mark.parametrize("k,n,splits", [
    (3584, 4608, 14),    # q/k/v: 18 tiles x 14 = 252 programs, nearest 256
    (3584, 3584, 14),    # o: 14 x 14 = 196 (|196 - 256| < |392 - 256|)
    (3584, 37888, 7),    # gate/up: at most 8 steps, so 7 splits is the fewest (1036 programs)
    (18944, 3584, 37),   # down: 296 steps; 37 splits (518 programs) is the fewest with <= 8 steps
])
def test_split_rule_of_the_wgmma_builds_by_hand(k, n, splits):
  assert w4_gluon._splits(k, n, w4_gluon.WG_TARGET_PROGRAMS) == splits


@pytest.mark.parametrize("k,n,splits", [
    (3584, 4608, 7),     # q/k/v: 36 tiles of 128 columns x 7 = 252 programs, nearest 256
    (3584, 3584, 8),     # o: 28 x 8 = 224 (|224 - 256| < |196 - 256|)
    (3584, 37888, 7),    # gate/up: 296 x 7 = 2072, the fewest splits with at most 8 steps
    (18944, 3584, 37),   # down: 28 x 37 = 1036; 37 is the fewest with <= 8 of the 296 steps
])
def test_split_rule_of_the_narrow_wgmma_builds_by_hand(k, n, splits):
  build = w4_gluon._build(64, k, n, 1)
  assert build.narrow and build.block_n == 128 and build.splits == splits
  assert build.grid == (n // 128, splits, 1) and build.meta["STEPS"] * splits * 64 == k


def test_split_rule_with_more_steps_a_program(monkeypatch):
  """NARROW_MAX_STEPS = 28 (a lab setting): the 7B gate/up matrix at M = 64 takes 2 splits of 28 steps
  (296 tiles x 2 = 592 programs; 1 split would need 56 steps), the others keep their splits."""
  monkeypatch.setattr(w4_gluon, "NARROW_MAX_STEPS", 28)
  assert [w4_gluon._build(64, k, n, 1).splits for k, n in [(3584, 37888), (3584, 4608), (18944, 3584)]] == [2, 7, 37]
  assert w4_gluon._build(64, 3584, 37888, 1).meta["STEPS"] == 28
  assert w4_gluon._build(8, 3584, 37888, 1).splits == 7  # the mma.sync builds keep MAX_STEPS


def test_one_split_stores_instead_of_adding():
  """K = 64 is one step, so one split: nothing to add, so no atomics (and no memset of the output);
  K = 128 at one column tile takes 2 splits (the program count nearer the target), added by atomics."""
  one = w4_gluon._build(8, 64, 256, 1)
  assert one.splits == 1 and not one.meta["ATOMIC"]
  two = w4_gluon._build(8, 128, 256, 1)
  assert two.splits == 2 and two.meta["ATOMIC"] == w4_gluon.atomic_split_k()


def test_evict_first_hint_only_on_the_mma_sync_builds(monkeypatch):
  """The weight stream's evict-first hint (LH = 1) is in the builds of M <= 16 (MB 8 and 16) and not in the
  wgmma builds (measured slower there, session 20); LOAD_HINTS = 0 leaves it out everywhere, so that
  those builds share the compile cache key of the builds before the setting existed."""
  assert [w4_gluon._build(m, 3584, 4608, 1).meta.get("LH") for m in (1, 8, 16, 17, 64, 128)] == [1, 1, 1, None,
                                                                                                None, None]
  monkeypatch.setattr(w4_gluon, "LOAD_HINTS", 0)
  assert "LH" not in w4_gluon._build(8, 3584, 4608, 1).meta


def test_inline_ptx_code_loads_only_on_small_mma_sync_builds(monkeypatch):
  """The L2::256B code loads (LA = LOAD_ASM = 2) are in the M <= 16 builds of weights of at most 2**25 values
  (the 7B q/k/v 3584 x 4608 and o 3584 x 3584), not in gate/up (3584 x 37888), down (18944 x 3584) or the
  wgmma builds; LOAD_ASM = 0 leaves the key out."""
  la = lambda m, k, n: w4_gluon._build(m, k, n, 1).meta.get("LA")
  assert [la(8, 3584, 4608), la(1, 3584, 3584), la(16, 3584, 4608)] == [2, 2, 2]
  assert [la(8, 3584, 37888), la(8, 18944, 3584), la(17, 3584, 4608), la(64, 3584, 3584)] == [None] * 4
  monkeypatch.setattr(w4_gluon, "LOAD_ASM", 0)
  assert la(8, 3584, 4608) is None


def test_small_matrix_settings_only_where_asked(monkeypatch):
  """SMALL_TARGET_PROGRAMS and SMALL_MAX_REGISTERS (lab) change the split and register cap of the M <= 16 builds of
  weights of at most LOAD_ASM_MAX_WEIGHTS values (the 7B q/k/v 3584 x 4608: 18 column tiles, 56 K steps; o 3584 x
  3584: 14 tiles) and of nothing else; by hand: 1024 programs -> 56 splits of 1 step (1008 and 784 programs)."""
  build = lambda m, k, n: w4_gluon._build(m, k, n, 28)
  assert [(build(8, k, n).splits, build(8, k, n).maxnreg) for k, n in ((3584, 4608), (3584, 3584))] == [(28, 128)] * 2
  monkeypatch.setattr(w4_gluon, "SMALL_TARGET_PROGRAMS", 1024)
  monkeypatch.setattr(w4_gluon, "SMALL_MAX_REGISTERS", 64)
  for m, k, n in ((8, 3584, 4608), (16, 3584, 3584), (1, 3584, 4608)):
    b = build(m, k, n)
    assert (b.splits, b.meta["STEPS"], b.maxnreg) == (56, 1, 64)
  for m, k, n, splits in ((8, 3584, 37888, 7), (8, 18944, 3584, 37), (32, 3584, 4608, 14)):
    b = build(m, k, n)  # gate/up, down (more values) and a wgmma build keep theirs
    assert b.splits == splits and b.maxnreg != 64


def test_eight_warp_mma_sync_builds_only_where_asked(monkeypatch):
  """MMA_WARPS = 8 (lab) gives the M <= 16 builds of weights over MMA_WARPS_MIN_WEIGHTS values (the 7B gate/up
  3584 x 37888 and down 18944 x 3584) 8 warps and MMA8_MAX_REGISTERS, without the 8-byte inline-PTX loads; q/k/v,
  o and the wgmma builds keep theirs; the default (4) changes nothing; MMA8_TARGET_PROGRAMS moves their split."""
  b = w4_gluon._build(8, 3584, 37888, 1)
  assert (b.w8, b.warps, b.maxnreg, b.splits) == (False, 4, 128, 7)
  monkeypatch.setattr(w4_gluon, "MMA_WARPS", 8)
  monkeypatch.setattr(w4_gluon, "MMA8_MAX_REGISTERS", 80)
  for m, k, n in ((8, 3584, 37888), (1, 18944, 3584), (16, 3584, 37888)):
    b = w4_gluon._build(m, k, n, 1)
    assert (b.w8, b.warps, b.maxnreg, b.wg) == (True, 8, 80, False) and "LA" not in b.meta
  for m, k, n in ((8, 3584, 4608), (8, 3584, 3584), (32, 3584, 37888)):
    b = w4_gluon._build(m, k, n, 1)
    assert not b.w8 and b.warps == (8 if m > 16 else 4)
  assert w4_gluon._build(8, 3584, 4608, 1).meta["LA"] == 2
  # 148 column tiles x 8 splits (7 steps each) = 1184 programs is nearest 1188 among 56 steps' divisors
  monkeypatch.setattr(w4_gluon, "MMA8_TARGET_PROGRAMS", 1188)
  assert w4_gluon._build(8, 3584, 37888, 1).splits == 8 and w4_gluon._build(8, 3584, 4608, 1).splits == 28


def test_scale_pairs_rule_by_hand(monkeypatch):
  """DO bit 1 (block scales paired once a block): by default (SCALE_PAIRS = 2) in the wgmma builds only; 1 every
  build; 0 none. Bit 0 is the decode code order."""
  do = lambda m, order: w4_gluon._build(m, 3584, 37888, 28, order).meta.get("DO", 0)
  assert [do(m, False) for m in (1, 8, 16, 17, 64, 128)] == [0, 0, 0, 2, 2, 2]
  assert [do(m, True) for m in (8, 16, 32, 128)] == [1, 1, 3, 3]
  monkeypatch.setattr(w4_gluon, "SCALE_PAIRS", 1)
  assert [do(m, False) for m in (8, 64)] == [2, 2]
  monkeypatch.setattr(w4_gluon, "SCALE_PAIRS", 0)
  assert [do(m, True) for m in (8, 64)] == [1, 1] and do(64, False) == 0


def test_row_block_by_hand():
  """mma.sync builds of 8 and 16 rows up to M = 16, the wgmma builds of 32 and 64 rows above."""
  assert [w4_gluon._row_block(m) for m in (1, 8, 9, 16, 17, 32, 33, 64, 65, 128)] == [8, 8, 16, 16, 32, 32, 64, 64,
                                                                                    128, 128]
  assert [w4_gluon._warps(w4_gluon._use_wgmma(m)) for m in (8, 16, 17, 64)] == [4, 4, 8, 8]


def test_applies_only_to_shapes_it_takes():
  w = _weight(128, 512, 0)
  assert w4_gluon.applies(1, w, jnp.bfloat16) and w4_gluon.applies(16, w, jnp.bfloat16)
  assert w4_gluon.applies(64, w, jnp.bfloat16) and w4_gluon.applies(128, w, jnp.bfloat16)
  assert not w4_gluon.applies(129, w, jnp.bfloat16)      # M > 128: dequantize + cuBLAS
  assert not w4_gluon.applies(8, w, jnp.float32)          # x must be bf16
  assert not w4_gluon.applies(8, _weight(128, 200, 0), jnp.bfloat16)   # N % 256
  assert not w4_gluon.applies(8, _weight(96, 256, 0), jnp.bfloat16)    # K % 64
  assert not w4_gluon.applies(8, nf4.quantize(np.ones((128, 512), np.float32)), jnp.bfloat16)


def test_atomic_split_k_setting(monkeypatch):
  monkeypatch.delenv("QERL_GLUON_DETERMINISTIC", raising=False)
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=false")
  assert w4_gluon.atomic_split_k()
  monkeypatch.setenv("QERL_GLUON_DETERMINISTIC", "1")
  assert not w4_gluon.atomic_split_k()
  monkeypatch.setenv("QERL_GLUON_DETERMINISTIC", "0")
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=true")  # XLA's own request counts too
  assert not w4_gluon.atomic_split_k()
  monkeypatch.setenv("QERL_GLUON_DETERMINISTIC", "yes")
  with pytest.raises(ValueError, match="QERL_GLUON_DETERMINISTIC"):
    w4_gluon.atomic_split_k()


def test_forward_rejects_what_it_does_not_take():
  with pytest.raises(ValueError, match="no kernel"):
    w4_gluon.forward(_act(129, 128, 0), _weight(128, 512, 0))


def test_auto_backend_on_cpu_is_the_reference():
  if any(d.platform == "gpu" for d in jax.devices()):
    pytest.skip("checks the CPU dispatch")
  w = _weight(128, 512, 1)
  x = _act(4, 128, 2)
  np.testing.assert_array_equal(np.asarray(quantized_matmul(x, w)), np.asarray(reference_matmul(x, w)))


# ----------------------------------------------------------------------------- GPU


def _dense64(wq):
  return np.asarray(nvfp4.dequantize(wq, jnp.float32), np.float64)


@pytest.mark.gpu
@pytest.mark.parametrize("mma_atomic", [False, True])
@pytest.mark.parametrize("m", [1, 3, 8, 9, 16])
@pytest.mark.parametrize("k,n", [(3584, 4608), (18944, 3584), (1088, 768), (64, 256)])
def test_gpu_gluon_matches_float64(m, k, n, mma_atomic, monkeypatch):
  monkeypatch.setattr(w4_gluon, "MMA_ATOMIC", mma_atomic)  # float32 partials, or atomics (the default)
  _check_forward_against_float64(m, k, n)


def _check_stack_layer_against_float64(m, k, n, weight_seed, act_seed, decode_order=True):
  """forward at layer 1 of a 2-layer stack (codes in decode order unless ``decode_order`` is False), jitted, against
  float64."""
  wq = _weight(k, n, weight_seed, layers=2)
  x = _act(m, k, act_seed)
  y = jax.jit(lambda x, w: w4_gluon.forward(x, w, out_dtype=jnp.float32, index=jnp.int32(1)))(
      x, nvfp4.to_decode_order(wq) if decode_order else wq)
  assert bool(jnp.isfinite(y).all())
  assert _rel(y, np.asarray(x, np.float64) @ _dense64(matmul.layer_of(wq, 1))) < 1e-4


def _check_forward_against_float64(m, k, n):
  wq = _weight(k, n, m + k)
  x = _act(m, k, n)
  y = w4_gluon.forward(x, wq, out_dtype=jnp.float32)
  assert y.shape == (m, n) and bool(jnp.isfinite(y).all())
  # exact E2M1 x E4M3 values, bf16 products, float32 accumulation in a different order
  assert _rel(y, np.asarray(x, np.float64) @ _dense64(wq)) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("cap", [128, 80, 64])
@pytest.mark.parametrize("m", [1, 3, 8, 9, 16])
@pytest.mark.parametrize("k,n", [(3584, 4608), (1088, 768), (64, 256)])
def test_gpu_gluon_eight_warp_build_matches_float64(m, k, n, cap, monkeypatch):
  """MMA_WARPS = 8 (lab): the mma.sync builds with 8 warps (column bit n2 on a warp), every weight
  (MMA_WARPS_MIN_WEIGHTS = 0), register caps 128 / 80 / 64 (64 spills at MB = 16), ragged M, against float64;
  also in decode order at layer 1 of a stack."""
  monkeypatch.setattr(w4_gluon, "MMA_WARPS", 8)
  monkeypatch.setattr(w4_gluon, "MMA_WARPS_MIN_WEIGHTS", 0)
  monkeypatch.setattr(w4_gluon, "MMA8_MAX_REGISTERS", cap)
  assert w4_gluon._build(m, k, n, 1).warps == 8
  _check_forward_against_float64(m, k, n)
  _check_stack_layer_against_float64(m, k, n, m + 5 * k, 3 * m + n)


@pytest.mark.gpu
@pytest.mark.parametrize("code_order", ["standard", "decode"])
@pytest.mark.parametrize("m", [1, 3, 8, 16, 17, 32, 40, 64, 100, 128])
@pytest.mark.parametrize("k,n", [(3584, 4608), (1088, 768)])
def test_gpu_gluon_scale_pairs_match_float64(m, k, n, code_order, monkeypatch):
  """SCALE_PAIRS = 1 (every build; the default 2 pairs in the wgmma builds only): the block scales paired into
  both bf16 halves once a block (cvt.rn.bf16x2.f32) in the mma.sync, wgmma, narrow and x-ring builds, both code
  orders, a stack read at layer 1, against float64."""
  if m > 16:
    _skip_without_wgmma()
  monkeypatch.setattr(w4_gluon, "SCALE_PAIRS", 1)
  assert w4_gluon._build(m, k, n, 2, code_order == "decode").meta["DO"] == (3 if code_order == "decode" else 2)
  monkeypatch.setattr(w4_gluon, "SCALE_PAIRS", 2)  # the wgmma builds only
  assert w4_gluon._build(m, k, n, 2, code_order == "decode").meta.get("DO", 0) == (
      (2 if m > 16 else 0) + (code_order == "decode"))
  monkeypatch.setattr(w4_gluon, "SCALE_PAIRS", 1)
  _check_stack_layer_against_float64(m, k, n, m + 3 * k, 5 * m + n, code_order == "decode")


@pytest.mark.gpu
@pytest.mark.parametrize("code_order", ["standard", "decode"])
@pytest.mark.parametrize("m", [1, 3, 8, 9, 16])
@pytest.mark.parametrize("k,n", [(3584, 4608), (18944, 3584), (1088, 768)])
def test_gpu_gluon_scale_bytes_match_float64(m, k, n, code_order, monkeypatch):
  """SCALE_BYTES = 1 (lab): the mma.sync builds' decode takes the block scales as raw E4M3 bytes (bit placement
  and two multiplies in its PTX), both code orders, ragged M, a stack read at layer 1, against float64."""
  monkeypatch.setattr(w4_gluon, "SCALE_BYTES", 1)
  assert w4_gluon._build(m, k, n, 2, code_order == "decode").meta["DO"] == 4 + (code_order == "decode")
  _check_stack_layer_against_float64(m, k, n, m + 3 * k, 5 * m + n, code_order == "decode")


@pytest.mark.gpu
@pytest.mark.parametrize("code_order", ["standard", "decode"])
@pytest.mark.parametrize("m", [1, 3, 8, 9, 16])
@pytest.mark.parametrize("k,n", [(3584, 4608), (18944, 3584), (1088, 768)])
def test_gpu_gluon_scale_f16_matches_float64(m, k, n, code_order, monkeypatch):
  """SCALE_F16 = 1 (lab): the mma.sync builds convert block scales through float16 bits (_SCALE_F16_ASM), both code
  orders, ragged M, a stack read at layer 1, against float64; and a weight whose blocks take every positive finite
  E4M3 scale (0x01-0x7e, subnormals included) in shuffled order, so a misplaced scale or byte shows."""
  monkeypatch.setattr(w4_gluon, "SCALE_F16", 1)
  assert w4_gluon._build(m, k, n, 2, code_order == "decode").meta["DO"] == 8 + (code_order == "decode")
  _check_stack_layer_against_float64(m, k, n, m + 9 * k, 7 * m + n, code_order == "decode")
  rng = np.random.default_rng(m + k + n)
  scales = (rng.permutation((k // 16) * n) % 126 + 1).astype(np.uint8).reshape(k // 16, n)
  wq = nvfp4.NVFP4Tensor(jnp.asarray(rng.integers(0, 256, (k // 2, n), dtype=np.uint8)),
                         jnp.asarray(scales.view(ml_dtypes.float8_e4m3fn)), jnp.float32(0.75), (k, n))
  x = _act(m, k, n + 1)
  y = w4_gluon.forward(x, nvfp4.to_decode_order(wq) if code_order == "decode" else wq, out_dtype=jnp.float32)
  assert bool(jnp.isfinite(y).all()) and _rel(y, np.asarray(x, np.float64) @ _dense64(wq)) < 1e-4


def test_scale_f16_bits_are_the_scale_times_2_to_118():
  """SCALE_F16's bit arithmetic (float16 bits >> 3, + 0x7300) gives bf16 ``scale * 2**118`` exactly for every
  positive finite E4M3 byte, subnormals included (0x01-0x07 are 2**-9 .. 7 * 2**-9; 0x7e is 448)."""
  codes = np.arange(1, 127, dtype=np.uint8)
  got = w4_gluon.scale_f16_bits(codes).view(ml_dtypes.bfloat16).astype(np.float64)
  want = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64) * 2.0 ** 118
  np.testing.assert_array_equal(got, want)
  assert want[0] == 2.0 ** (118 - 9) and want[-1] == 448 * 2.0 ** 118


@pytest.mark.gpu
@pytest.mark.parametrize("stages", [1, 2, 3, 8])
@pytest.mark.parametrize("m", [1, 3, 8, 9, 16])
@pytest.mark.parametrize("k,n", [(3584, 4608), (18944, 3584), (1088, 768), (64, 256)])
def test_gpu_gluon_tma_build_matches_float64(m, k, n, stages, monkeypatch):
  """TMA_STAGES (lab): the M <= 16 builds with codes and scales copied by TMA into 1, 2, 3 or 8 shared buffers
  (8 steps a program at K = 18944: buffers refilled; one step at K = 64), ragged M, against float64; and in decode
  order at layer 1 of a stack."""
  monkeypatch.setattr(w4_gluon, "TMA_STAGES", stages)
  assert w4_gluon._build(m, k, n, 1).meta["TS"] == stages
  _check_forward_against_float64(m, k, n)
  _check_stack_layer_against_float64(m, k, n, m + 7 * k, 5 * m + n)


@pytest.mark.gpu
@pytest.mark.parametrize("stages", [1, 2, 4])
@pytest.mark.parametrize("m", [1, 3, 5, 8])
@pytest.mark.parametrize("k,n", [(3584, 4608), (18944, 3584), (1088, 768), (64, 256)])
def test_gpu_gluon_warp_specialized_build_matches_float64(m, k, n, stages, monkeypatch):
  """WS_STAGES (lab): the M <= 8 builds (WS_MAX_M; M 9-16 raced in session 55 and are refused) with a loader warp
  copying codes and scales by TMA into 1, 2 or 4 buffers that the compute warps release (8 steps a program at
  K = 18944: every buffer refilled; one step at K = 64), ragged M, against float64; and in decode order at layer 1
  of a stack."""
  monkeypatch.setattr(w4_gluon, "WS_STAGES", stages)
  build = w4_gluon._build(m, k, n, 1)
  assert build.meta["TS"] == stages and build.meta["WS"] == 1 and build.threads == 256
  _check_forward_against_float64(m, k, n)
  _check_stack_layer_against_float64(m, k, n, m + 5 * k, 3 * m + n)


def _skip_without_wgmma():
  if not w4_gluon._wgmma_gpus():
    pytest.skip("the wgmma builds (M > 16) are for sm_90")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [17, 32, 40, 64, 100, 128])
@pytest.mark.parametrize("k,n", [(3584, 4608), (18944, 3584), (1088, 768), (64, 256)])
def test_gpu_gluon_wgmma_build_matches_float64(m, k, n):
  """17 <= M <= 128: the wgmma builds (8 warps, x through shared memory, split-K summed by float32
  atomics into a zeroed output; narrow at M > 32), ragged M included."""
  _skip_without_wgmma()
  _check_forward_against_float64(m, k, n)


@pytest.mark.gpu
@pytest.mark.parametrize("stages,wg_async", [(2, 0), (4, 0), (4, 1), (3, 1)])
@pytest.mark.parametrize("m", [17, 40, 100, 128])
@pytest.mark.parametrize("k,n", [(3584, 4608), (1088, 768)])
def test_gpu_gluon_x_ring_matches_float64(m, k, n, stages, wg_async, monkeypatch):
  """X_STAGES: x permuted to the operand's k order by XLA and copied by cp.async into a ring of
  shared buffers (rows past M read row M - 1, never stored), ragged M included; with WG_ASYNC the
  wgmma of step i runs while step i + 1 decodes (its register operand must survive until the wait)."""
  _skip_without_wgmma()
  monkeypatch.setattr(w4_gluon, "X_STAGES", stages)
  monkeypatch.setattr(w4_gluon, "X_RING_MIN_MB", 32)  # every wgmma build (the default: MB = 128 only)
  monkeypatch.setattr(w4_gluon, "WG_ASYNC", wg_async)
  _check_forward_against_float64(m, k, n)


def test_x_slot_order_is_the_kernels_operand_order():
  """x_in_slot_order equals the kernel's in-register relabelling (x_slots), worked by hand on the
  k index: the k-pair swap (bits 0, 1), then wgmma's k_width-2 relabelling (bits 1-4 as 3, 4, 1, 2);
  for the narrow build its own order, s5 .. s0 = k5 k2 k0 k4 k3 k1; both the same permutation."""
  k = np.arange(64)
  wide = k.reshape(16, 2, 2).transpose(0, 2, 1).reshape(64)
  wide = wide.reshape([2] * 6).transpose(0, 3, 4, 1, 2, 5).reshape(64)
  narrow = k.reshape([2] * 6).transpose(0, 3, 5, 1, 2, 4).reshape(64)
  bits = [(narrow >> b) & 1 for b in range(6)]  # slot s holds k = narrow[s]; s5 .. s0 = k5 k2 k0 k4 k3 k1
  s = np.arange(64)
  assert all(np.array_equal(bits[kb], (s >> sb) & 1) for sb, kb in enumerate([1, 3, 4, 0, 2, 5]))
  np.testing.assert_array_equal(wide, narrow)
  x = jnp.arange(2 * 128, dtype=jnp.float32).reshape(2, 128)
  y = np.asarray(w4_gluon.x_in_slot_order(x))
  np.testing.assert_array_equal(y, np.asarray(x).reshape(2, 2, 64)[:, :, narrow].reshape(2, 128))


@pytest.mark.gpu
def test_gpu_gluon_deterministic_wgmma_build_is_repeatable(monkeypatch):
  """QERL_GLUON_DETERMINISTIC=1: partials summed by XLA, so two runs agree bit for bit."""
  _skip_without_wgmma()
  monkeypatch.setenv("QERL_GLUON_DETERMINISTIC", "1")
  wq = _weight(18944, 3584, 3)
  x = _act(40, 18944, 4)
  y1 = w4_gluon.forward(x, wq, out_dtype=jnp.float32)
  y2 = w4_gluon.forward(x, wq, out_dtype=jnp.float32)
  np.testing.assert_array_equal(np.asarray(y1), np.asarray(y2))
  assert _rel(y1, np.asarray(x, np.float64) @ _dense64(wq)) < 1e-4


@pytest.mark.gpu
def test_gpu_gluon_reads_the_clamped_layer_of_a_stack():
  layers, k, n = 3, 1024, 512
  wq = _weight(k, n, 5, layers=layers)
  x = _act(8, k, 6)
  f = jax.jit(lambda x, i: w4_gluon.forward(x, wq, out_dtype=jnp.float32, index=i))
  for i, want in ((1, 1), (2, 2), (-1, 0), (7, 2)):
    y = f(x, jnp.int32(i))
    assert _rel(y, np.asarray(x, np.float64) @ _dense64(matmul.layer_of(wq, want))) < 1e-4, i


@pytest.mark.gpu
def test_gpu_quantized_matmul_routes_decode_to_gluon_with_its_gradient(monkeypatch):
  if not w4_gluon.available():
    pytest.skip("jax-triton is not installed")
  monkeypatch.setattr(matmul, "GLUON", "1")
  k, n = 3584, 4608
  wq = _weight(k, n, 7)
  x = _act(8, k, 8)
  dy = _act(8, n, 9)
  y = quantized_matmul(x, wq, out_dtype=jnp.float32)
  assert _rel(y, np.asarray(x, np.float64) @ _dense64(wq)) < 1e-4
  target = "qerl_gluon_launch" if w4_gluon.launcher() == "ffi" else "triton_kernel_call"
  assert target in jax.jit(lambda x: quantized_matmul(x, wq)).lower(x).as_text()
  g = jax.grad(lambda x: jnp.sum(quantized_matmul(x, wq).astype(jnp.float32) * dy.astype(jnp.float32)))(x)
  assert _rel(g, np.asarray(dy, np.float64) @ _dense64(wq).T) < 1e-2


@pytest.mark.gpu
def test_gpu_gluon_with_a_lora_delta_from_xla(monkeypatch):
  if not w4_gluon.available():
    pytest.skip("no launch path for the Gluon kernel")
  monkeypatch.setattr(matmul, "GLUON", "1")
  monkeypatch.setattr(matmul, "GLUON_LORA", "1")
  layers, k, n, r = 2, 1024, 512, 16
  wq = _weight(k, n, 11, layers=layers)
  x = _act(8, k, 12)
  xa = _act(8, r, 13)
  b = jnp.asarray(np.random.default_rng(14).standard_normal((layers, r, n)) * 0.1, jnp.bfloat16)
  y = quantized_matmul(x, wq, index=jnp.int32(1), lora=(xa, b, 0.5), out_dtype=jnp.float32)
  want = (np.asarray(x, np.float64) @ _dense64(matmul.layer_of(wq, 1))
          + 0.5 * np.asarray(xa, np.float64) @ np.asarray(b[1], np.float64))
  assert _rel(y, want) < 1e-4


def _ffi_lowering_case(monkeypatch):
  """``(k, n, stack, x, i)``: the 7B q/k/v shape as abstract values (a 3-layer NVFP4 stack, x [8, K],
  a layer index) for lowering the FFI path for CUDA on any machine; skips without triton's Gluon or a
  C++ compiler for the launcher."""
  pytest.importorskip("triton.experimental.gluon")
  monkeypatch.delenv("QERL_GLUON_LAUNCH", raising=False)
  if w4_gluon.launcher() != "ffi":
    pytest.skip("no C++ compiler for the FFI launcher")
  k, n = 3584, 4608
  stack = jax.eval_shape(lambda: nvfp4.quantize(jnp.ones((3, k, n), jnp.float32)))
  return k, n, stack, jax.ShapeDtypeStruct((8, k), jnp.bfloat16), jax.ShapeDtypeStruct((), jnp.int32)


def test_pdl_probe_builds_wait_after_their_first_weight_loads():
  """The lab's PDL builds (constexpr ``GDC``, experiments/lab/pdl_probe.py), compiled for sm_90 on the CPU: the
  library's build has no grid dependency control; ``GDC`` = 1 waits before its loads (only the layer index and
  the global scale come first); 2 issues step 0's code and scale loads before ``griddepcontrol.wait`` and
  10 step 1's too, while every x load comes after it; 4 adds ``launch_dependents`` before the wait. The PDL
  launch attribute is Triton's ``launch_pdl`` option."""
  pytest.importorskip("triton.experimental.gluon")
  b = w4_gluon._build(8, 18944, 3584, 4, decode_order=True)  # STEPS 8, codes and scales with evict_first
  fn = w4_gluon._kernel(b.wg, b.narrow_n, False, b.w8, False)

  def ptx(gdc):
    meta = dict(b.meta, **({"GDC": gdc} if gdc else {}))
    c = w4_gluon._compile_gluon(fn, w4_gluon._ARG_DTYPES, meta, 90, num_warps=b.warps, maxnreg=b.maxnreg,
                                options={"launch_pdl": bool(gdc)})
    assert c.metadata.launch_pdl == bool(gdc)
    return c.asm["ptx"]

  def before_wait(text):
    head = text[:text.index("griddepcontrol.wait")]
    weights = len(re.findall(r"ld\.global\.L1::evict_first", head))
    x = head.count("ld.global.v4.b32")  # x: 16 bytes a load, 2 a step
    return weights, x, "griddepcontrol.launch_dependents" in head

  base = ptx(0)
  assert "griddepcontrol" not in base
  # a program's step: 32 code rows (8 bytes a thread and row, 8 loads) and 4 scale rows (2 loads)
  assert before_wait(ptx(1)) == (0, 0, False)
  assert before_wait(ptx(2)) == (10, 0, False)
  assert before_wait(ptx(10)) == (20, 0, False)
  assert before_wait(ptx(6)) == (10, 0, True)
  assert base.count("ld.global.v4.b32") == 16 and base.count("ld.global.L1::evict_first") == 80  # 8 steps
  assert ptx(2).count("ld.global") == base.count("ld.global")  # the same loads, moved


def test_ffi_path_lowers_for_cuda_without_a_gpu(monkeypatch):
  """With triton and a C++ compiler present, the kernel compiles for sm_90 and the call lowers to the
  command-buffer-compatible FFI target with the kernel's PTX and launch geometry as attributes."""
  k, n, stack, x, i = _ffi_lowering_case(monkeypatch)
  text = jax.jit(lambda x, w, i: w4_gluon.forward(x, w, index=i)).trace(x, stack, i).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "qerl_gluon_launch" in text and ".entry w4a16_gemv" in text and re.search(r'key = "[0-9a-f]{32}"', text)
  first = text
  # 4608 / 256 column tiles, 28 splits (test_split_rule_by_hand), 4 warps
  assert "grid_x = 18" in text and "grid_y = 28" in text and "threads = 128" in text
  x64 = jax.ShapeDtypeStruct((64, k), jnp.bfloat16)  # a narrow wgmma build: 8 warps, 128 columns, 7 splits
  text = jax.jit(lambda x, w, i: w4_gluon.forward(x, w, index=i)).trace(x64, stack, i).lower(
      lowering_platforms=("cuda",)).as_text()
  assert ".entry w4a16_gemv" in text and "wgmma.mma_async" in text and "threads = 256" in text
  text_wg = text
  assert "grid_x = 36" in text and "grid_y = 7" in text
  x128 = jax.ShapeDtypeStruct((128, k), jnp.bfloat16)  # MB = 128: x by cp.async (16 bytes), 128 registers
  ring = jax.jit(lambda x, w, i: w4_gluon.forward(x, w, index=i)).trace(x128, stack, i).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "wgmma.mma_async" in ring and "cp.async.cg.shared.global" in ring and ".maxnreg 128" in ring
  assert "threads = 256" in ring and "grid_x = 36" in ring and "transpose" in ring  # x_in_slot_order
  assert "cp.async" not in text_wg  # MB = 64 keeps x in registers
  assert "wgmma.wait_group.sync.aligned 1" not in ring  # the default MMA is synchronous
  monkeypatch.setattr(w4_gluon, "WG_ASYNC", 1)  # lab: MB = 64 with the ring and an asynchronous MMA
  monkeypatch.setattr(w4_gluon, "X_RING_MIN_MB", 64)
  wa = jax.jit(lambda x, w, i: w4_gluon.forward(x, w, index=i)).trace(x64, stack, i).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "wgmma.wait_group.sync.aligned 1" in wa and "cp.async.cg.shared.global" in wa and ".maxnreg 128" in wa
  monkeypatch.setattr(w4_gluon, "WG_ASYNC", 0)
  monkeypatch.setattr(w4_gluon, "X_RING_MIN_MB", 128)
  monkeypatch.setattr(w4_gluon, "NARROW_BLOCK_N", 256)  # the lab's narrow build of 256 columns: 16 warps
  n16 = jax.jit(lambda x, w, i: w4_gluon.forward(x, w, index=i)).trace(x64, stack, i).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "wgmma.mma_async" in n16 and "threads = 512" in n16 and "grid_x = 18" in n16 and ".maxnreg 128" in n16
  monkeypatch.setattr(w4_gluon, "NARROW_BLOCK_N", 128)
  monkeypatch.setattr(w4_gluon, "NARROW_MIN_MB", 128)  # 256 columns a program (the rule above: 14 splits)
  wide = jax.jit(lambda x, w, i: w4_gluon.forward(x, w, index=i)).trace(x64, stack, i).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "wgmma.mma_async" in wide and "grid_x = 18" in wide and "grid_y = 14" in wide
  monkeypatch.setattr(w4_gluon, "NARROW_MIN_MB", 64)
  # the split-K parts are added by atomics into the output, which the launcher zeroes first
  assert "atom.global.gpu.relaxed.add.v4.f32" in text and "zero_results = 1" in text
  assert "output_operand_aliases" not in text
  monkeypatch.setenv("QERL_GLUON_DETERMINISTIC", "1")  # partials [7, 64, 4608] summed by XLA instead
  text = jax.jit(lambda x, w, i: w4_gluon.forward(x, w, index=i)).trace(x64, stack, i).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "wgmma.mma_async" in text and "atom.global" not in text and "output_operand_aliases" not in text
  assert "tensor<7x64x4608xf32>" in text and "zero_results = 0" in text
  monkeypatch.delenv("QERL_GLUON_DETERMINISTIC")
  # the mma.sync builds add by atomics too (first lowering above: M = 8); MMA_ATOMIC=False stores partials
  assert "mma.sync" in first and "atom.global.gpu.relaxed.add" in first and "zero_results = 1" in first
  monkeypatch.setattr(w4_gluon, "MMA_ATOMIC", False)
  text = jax.jit(lambda x, w, i: w4_gluon.forward(x, w, index=i)).trace(x, stack, i).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "mma.sync" in text and "atom.global" not in text and "tensor<28x8x4608xf32>" in text
  x16 = jax.ShapeDtypeStruct((16, k), jnp.bfloat16)  # MB = 16: capped at 128 registers, as MB = 8
  text = jax.jit(lambda x, w, i: w4_gluon.forward(x, w, index=i)).trace(x16, stack, i).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "mma.sync" in text and ".maxnreg 128" in text and ".maxnreg 128" in first
  assert ".maxnreg 128" in text_wg and ".maxnreg" not in wide  # narrow wgmma builds capped at 128, wide ones not


def test_eight_warp_build_lowers_for_cuda_without_a_gpu(monkeypatch):
  """MMA_WARPS = 8 (lab): the call lowers with 256 threads, mma.sync, the 8-warp register cap and 4-byte code loads
  (each thread 4 contiguous bytes a row); the default build takes 8-byte loads."""
  k, n, stack, x, i = _ffi_lowering_case(monkeypatch)
  lower = lambda: jax.jit(lambda x, w, i: w4_gluon.forward(x, w, index=i)).trace(x, stack, i).lower(
      lowering_platforms=("cuda",)).as_text()
  monkeypatch.setattr(w4_gluon, "LOAD_ASM", 0)  # Triton's own loads in both, so that their widths compare
  four = lower()
  monkeypatch.setattr(w4_gluon, "MMA_WARPS", 8)
  monkeypatch.setattr(w4_gluon, "MMA_WARPS_MIN_WEIGHTS", 0)
  monkeypatch.setattr(w4_gluon, "MMA8_MAX_REGISTERS", 80)
  eight = lower()
  assert "threads = 128" in four and "threads = 256" in eight and "grid_x = 18" in eight and "grid_y = 28" in eight
  assert "mma.sync" in eight and ".maxnreg 80" in eight and ".maxnreg 128" in four
  # the weight stream's evict-first loads (the codes; the block scales are 4 bytes in both)
  assert "ld.global.L1::evict_first.L2::cache_hint.v2.b32" in four
  assert "ld.global.L1::evict_first.L2::cache_hint.b32" in eight and ".cache_hint.v2.b32" not in eight


def test_tma_build_lowers_for_cuda_without_a_gpu(monkeypatch):
  """TMA_STAGES (lab): the M <= 16 build takes two TMA descriptors first (the 128-byte CUtensorMap parameters),
  copies the codes and scales by cp.async.bulk.tensor into shared memory, and the call carries their specs (by
  hand: codes [3 x 1792, 4608] in boxes of 32 x 256, scales [3 x 224, 4608] in boxes of 4 x 256); the default
  build has none and loads the codes to registers."""
  k, n, stack, x, i = _ffi_lowering_case(monkeypatch)
  lower = lambda: jax.jit(lambda x, w, i: w4_gluon.forward(x, w, index=i)).trace(x, stack, i).lower(
      lowering_platforms=("cuda",)).as_text()
  plain = lower()
  assert "cp.async.bulk.tensor" not in plain and "tma = dense<0> : tensor<1xi64>" in plain
  monkeypatch.setattr(w4_gluon, "TMA_STAGES", 3)
  build = w4_gluon._build(8, k, n, 3)
  assert build.meta["TS"] == 3 and "LA" not in build.meta and "LH" not in build.meta
  assert w4_gluon._build(32, k, n, 3).wg and "TS" not in w4_gluon._build(32, k, n, 3).meta  # mma.sync builds only
  text = lower()
  assert ".entry w4a16_gemv_tma" in text and "cp.async.bulk.tensor.2d.shared::cluster.global" in text
  assert ".param .align 64 .b8 w4a16_gemv_tma_param_0[128]" in text and "mbarrier.try_wait" in text
  rows_c, rows_s, l2 = 3 * k // 2, 3 * k // 16, w4_gluon.TMA_L2_PROMOTION
  assert f"tma = dense<[2, 1, {rows_c}, {n}, 32, 256, {l2}, 2, {rows_s}, {n}, 4, 256, {l2}]> : tensor<13xi64>" in text
  assert "grid_x = 18" in text and "grid_y = 28" in text and "threads = 128" in text
  # a decode step's call with a LoRA term (forward_into's lora): the TMA entry of the LoRA kernel, same descriptors
  xa = jax.ShapeDtypeStruct((8, 32), jnp.bfloat16)
  b = jax.ShapeDtypeStruct((3, 32, n), jnp.bfloat16)
  lora = jax.jit(lambda x, w, i, xa, b: w4_gluon.forward_into(x, w, None, 0, index=i, size=8 * n, lora=(xa, b, 2.0))[0]
                 ).trace(x, stack, i, xa, b).lower(lowering_platforms=("cuda",)).as_text()
  assert ".entry w4a16_gemv_lora_tma" in lora and "cp.async.bulk.tensor.2d.shared::cluster.global" in lora
  assert f"tma = dense<[2, 1, {rows_c}, {n}, 32, 256, {l2}, 2, {rows_s}, {n}, 4, 256, {l2}]>" in lora


def test_warp_specialized_build_lowers_for_cuda_without_a_gpu(monkeypatch):
  """WS_STAGES (lab): the M <= 16 build takes the TMA entry, launches two warpgroups (256 threads: 4 compute warps,
  the loader warp's group) at WS_MAX_REGISTERS a thread, and hands registers between them (setmaxnreg); the wgmma
  builds do not take it."""
  k, n, stack, x, i = _ffi_lowering_case(monkeypatch)
  monkeypatch.setattr(w4_gluon, "WS_STAGES", 2)
  build = w4_gluon._build(8, k, n, 3)
  assert build.meta["TS"] == 2 and build.meta["WS"] == 1 and build.maxnreg == w4_gluon.WS_MAX_REGISTERS == 64
  assert "WS" not in w4_gluon._build(32, k, n, 3).meta
  text = jax.jit(lambda x, w, i: w4_gluon.forward(x, w, index=i)).trace(x, stack, i).lower(
      lowering_platforms=("cuda",)).as_text()
  assert ".entry w4a16_gemv_tma" in text and "cp.async.bulk.tensor.2d.shared::cluster.global" in text
  assert "threads = 256" in text and ".reqntid 256" in text and ".maxnreg 64" in text
  # (the PTX inside the MLIR text writes its tabs as \09)
  assert "setmaxnreg.dec.sync.aligned.u32 \\0924;" in text and "setmaxnreg.inc.sync.aligned.u32 \\09104;" in text


def test_warp_specialized_settings_only_where_asked(monkeypatch):
  """WS_SMALL 0 keeps the 7B q/k/v (a small matrix) on the register-load build while gate/up takes the loader warp;
  WS_PROBE reaches the build as its constexpr; M 9-16 (over WS_MAX_M) and a register cap under 64 are refused by
  name."""
  monkeypatch.setattr(w4_gluon, "WS_STAGES", 3)
  monkeypatch.setattr(w4_gluon, "WS_SMALL", 0)
  assert "WS" not in w4_gluon._build(8, 3584, 4608, 28).meta and "LA" in w4_gluon._build(8, 3584, 4608, 28).meta
  big = w4_gluon._build(8, 3584, 37888, 28)
  assert big.meta["WS"] == 1 and big.meta["TS"] == 3 and big.threads == 256 and "WSP" not in big.meta
  monkeypatch.setattr(w4_gluon, "WS_PROBE", 2)
  assert w4_gluon._build(8, 3584, 37888, 28).meta["WSP"] == 2
  for m in (9, 16):  # 16-row x tiles: the race of session 55, refused by name
    with pytest.raises(ValueError, match=f"WS_STAGES=3 at M = {m}"):
      w4_gluon._build(m, 3584, 37888, 28)
  assert "WS" not in w4_gluon._build(17, 3584, 37888, 28).meta  # the wgmma builds never take it
  monkeypatch.setattr(w4_gluon, "WS_MAX_REGISTERS", 48)
  with pytest.raises(ValueError, match="WS_MAX_REGISTERS=48"):
    w4_gluon._build(8, 3584, 37888, 28)
  monkeypatch.setattr(w4_gluon, "WS_STAGES", 0)
  assert w4_gluon._build(8, 3584, 37888, 28).threads == 128  # off: the cap does not matter


def test_l2_probe_only_where_asked(monkeypatch):
  """L2_PROBE (lab probe): the register-load builds (mma.sync and wgmma) take it as their constexpr LP; off, no build
  has it (so their PTX is the library's)."""
  assert all("LP" not in w4_gluon._build(m, 3584, 18944, 28).meta for m in (1, 8, 64))
  monkeypatch.setattr(w4_gluon, "L2_PROBE", 1)
  assert all(w4_gluon._build(m, 3584, 18944, 28).meta["LP"] == 1 for m in (1, 8, 64))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [8, 64])
def test_gpu_l2_probe_reads_split_0_rows_in_every_split(m, monkeypatch):
  """L2_PROBE = 1 computes, for every split s of K, x[:, split s] @ W[split 0's rows] (so that its stream is
  L2-resident): checked against that product in float64, which differs from x @ W."""
  if m > 16:
    _skip_without_wgmma()
  k, n = 3584, 4608
  monkeypatch.setattr(w4_gluon, "L2_PROBE", 1)
  build = w4_gluon._build(m, k, n, 1)
  steps = build.meta["STEPS"] * w4_gluon.BLOCK_K
  wq = _weight(k, n, 7)
  x = _act(m, k, 8)
  y = w4_gluon.forward(x, wq, out_dtype=jnp.float32)
  w64, x64 = _dense64(wq), np.asarray(x, np.float64)
  want = sum(x64[:, s * steps:(s + 1) * steps] @ w64[:steps] for s in range(build.splits))
  assert build.splits > 1 and _rel(y, want) < 1e-4 and _rel(y, x64 @ w64) > 0.1


def test_decode_order_lowers_its_own_decode(monkeypatch):
  """A weight in nvfp4.to_decode_order's order lowers to a kernel with the decode-order PTX (its masks
  in the PTX, at M = 8 (mma.sync) and 64 (narrow wgmma)), another build than the standard order's."""
  k, n, stack, x, i = _ffi_lowering_case(monkeypatch)
  decode = jax.eval_shape(nvfp4.to_decode_order, stack)
  assert decode.code_order == "decode"
  for m in (8, 64):
    xm = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    lower = lambda w: jax.jit(lambda x, w, i: w4_gluon.forward(x, w, index=i)).trace(xm, w, i).lower(
        lowering_platforms=("cuda",)).as_text()
    text, std = lower(decode), lower(stack)
    assert ".entry w4a16_gemv" in text and "0x01800180" in text and "0x00400040" in text
    assert "0x01800180" not in std and re.search(r'key = "([0-9a-f]{32})"', text).group(1) != re.search(
        r'key = "([0-9a-f]{32})"', std).group(1)


def _gemv_then_norm_chain(x, w, index, h, norm_w, noise, pdl: bool):
  """(lab) The decode GEMV of ``x`` by layer ``index`` of ``w`` into a zeroed float32 ``y``, then the residual-norm
  kernel on ``h + y``, both launched by one :func:`w4_gluon.chain_call`; with ``pdl`` the GDC builds (GEMV: first
  weights before the wait, early release; norm: weight and noise before the wait, early release) and the norm
  launched with PDL. Returns ``(y, h + y, RMSNorm(h + y) * (w + noise))``."""
  from pallas_kernels import residual_norm, w4_triton
  m, (k, n), layers = x.shape[0], w.shape, w.packed.shape[0]
  b = w4_gluon._build(m, k, n, layers, w.code_order == "decode")
  meta = dict(b.meta, **({"GDC": 6} if pdl else {}))
  gemv = w4_gluon._compiled(tuple(meta.items()), b.wg, b.narrow_n, b.maxnreg, b.w8)
  nmeta = dict(residual_norm._meta(m, n, norm_w.shape[0], 0, 1e-6, True, 0), **({"GDC": 5} if pdl else {}))
  norm = residual_norm._compiled(tuple(nmeta.items()), "*bf16" if norm_w.dtype == jnp.bfloat16 else "*fp32")
  codes, scales, gs, layer = w4_triton._layer_operands(w, w4_triton._format_of(w), index)
  operands = (x, codes, scales, gs, layer, h, norm_w, noise)  # buffers 0-7; results 8 (y), 9 (h + y), 10 (x)
  launches = [w4_gluon.ChainLaunch(*gemv, b.grid, b.threads, tuple((i, 0) for i in (0, 1, 2, 3, 4, 8, 8))),
              w4_gluon.ChainLaunch(*norm, (m, 1, 1), 32 * residual_norm.WARPS,
                                   tuple((i, 0) for i in (5, 8, 6, 7, 4, 9, 10, 8)), pdl=pdl)]
  out = (jax.ShapeDtypeStruct((m * n,), jnp.float32), jax.ShapeDtypeStruct((m, n), jnp.bfloat16),
         jax.ShapeDtypeStruct((m, n), jnp.bfloat16))
  y, h_new, x_new = w4_gluon.chain_call(launches, operands, out, zero_results=1)
  return y.reshape(m, n), h_new, x_new


def test_chain_call_lowers_two_kernels_into_one_ffi_call(monkeypatch):
  """(lab) chain_call: one qerl_gluon_chain custom call carrying both kernels' PTX (the GDC builds, with
  griddepcontrol), their launch geometry with the PDL flag on the second only, and each kernel's parameters as
  (buffer, offset) pairs over operands then results; bad requests are refused before lowering."""
  k, n, stack, x, i = _ffi_lowering_case(monkeypatch)  # 8 x 3584 by a 3-layer stack of 3584 x 4608
  h = jax.ShapeDtypeStruct((8, n), jnp.bfloat16)
  norm_w = jax.ShapeDtypeStruct((3, n), jnp.bfloat16)
  noise = jax.ShapeDtypeStruct((3, n), jnp.float32)
  fn = lambda x, w, i, h, nw, nz: _gemv_then_norm_chain(x, w, i, h, nw, nz, pdl=True)
  text = jax.jit(fn).trace(x, stack, i, h, norm_w, noise).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("qerl_gluon_chain") == 1 and "qerl_gluon_launch" not in text
  assert ".entry w4a16_gemv" in text and ".entry residual_rms_norm_rows" in text
  assert text.count("griddepcontrol.wait") >= 3  # the GEMV's one, the norm's two (row and zeroing programs)
  launch = re.search(r"launch = dense<\[([0-9, ]+)\]>", text).group(1).replace(" ", "")
  # GEMV: 4608 / 256 column tiles x 28 splits, 128 threads, no PDL; norm: 8 row programs of 16 warps, PDL
  assert re.fullmatch(r"18,28,1,128,\d+,0,8,1,1,512,\d+,1", launch), launch
  params = re.search(r"params = dense<\[([0-9, ]+)\]>", text).group(1).replace(" ", "")
  assert params == "7,0,0,1,0,2,0,3,0,4,0,8,0,8,0,8,5,0,8,0,6,0,7,0,4,0,9,0,10,0,8,0"
  assert "zero_results = 1" in text
  off = jax.jit(lambda x, w, i, h, nw, nz: _gemv_then_norm_chain(x, w, i, h, nw, nz, pdl=False)).trace(
      x, stack, i, h, norm_w, noise).lower(lowering_platforms=("cuda",)).as_text()
  assert "griddepcontrol" not in off and re.search(r"launch = dense<\[[0-9, ]+, 0\]>", off)
  ok = w4_gluon.ChainLaunch("ptx", "k", 0, (1, 1, 1), 32, ((0, 0),))
  with pytest.raises(ValueError, match="no kernel"):
    w4_gluon.chain_call([], (), ())
  with pytest.raises(ValueError, match="names buffers \\[2\\]"):
    w4_gluon.chain_call([ok._replace(params=((2, 0),))], (jnp.zeros(4),), (jax.ShapeDtypeStruct((4,), jnp.float32),))
  with pytest.raises(ValueError, match="field separator"):
    w4_gluon.chain_call([ok._replace(name="a\x1eb")], (jnp.zeros(4),), ())


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [False, True])
def test_chain_call_runs_the_gemv_then_the_norm_as_the_separate_calls(pdl):
  """(lab, prepared in session 59) One FFI call launching the decode GEMV (M = 8, layer 1 of a 2-layer 7B-o-sized
  stack in decode order) and the residual-norm kernel on its product, with and without PDL between them: the same
  product as forward_into's kernel (float32 atomics: 1e-5 relative) and the same h + y and norm as
  residual_rms_norm on that product (bit for bit, both read the same y)."""
  from pallas_kernels import residual_norm
  if not (w4_gluon.available() and w4_gluon.launcher() == "ffi"):
    pytest.skip("the Gluon FFI launcher is not available")
  m, k, n = 8, 3584, 3584
  keys = jax.random.split(jax.random.key(59), 5)
  w = nvfp4.to_decode_order(nvfp4.quantize(jax.random.normal(keys[0], (2, k, n), jnp.float32) * 0.05))
  x = jax.random.normal(keys[1], (m, k), jnp.float32).astype(jnp.bfloat16)
  h = jax.random.normal(keys[2], (m, n), jnp.float32).astype(jnp.bfloat16)
  norm_w = (1.0 + 0.1 * jax.random.normal(keys[3], (2, n), jnp.float32)).astype(jnp.bfloat16)
  noise = 0.01 * jax.random.normal(keys[4], (2, n), jnp.float32)
  y, h_new, x_new = jax.jit(lambda *a: _gemv_then_norm_chain(*a, pdl=pdl))(x, w, 1, h, norm_w, noise)
  want_y = w4_gluon.forward(x, w, out_dtype=jnp.float32, index=1)
  np.testing.assert_allclose(np.asarray(y), np.asarray(want_y), rtol=1e-5, atol=1e-5 * float(jnp.abs(want_y).max()))
  want_h, want_x = residual_norm.residual_rms_norm(h, y.reshape(-1), 0, norm_w, 1, 1e-6, noise)
  np.testing.assert_array_equal(np.asarray(h_new.astype(jnp.float32)), np.asarray(want_h.astype(jnp.float32)))
  np.testing.assert_array_equal(np.asarray(x_new.astype(jnp.float32)), np.asarray(want_x.astype(jnp.float32)))


def test_forward_into_lowers_to_an_aliased_region_without_a_memset(monkeypatch):
  """forward_into: the FFI call aliases the float32 buffer to its result, asks for no memset and
  passes the region's byte offset; y is the region read back. Bad buffers and regions are refused."""
  monkeypatch.delenv("QERL_GLUON_DETERMINISTIC", raising=False)
  k, n, stack, x, i = _ffi_lowering_case(monkeypatch)
  acc = jax.ShapeDtypeStruct((8 * n + 1000,), jnp.float32)
  fn = lambda x, w, i, acc: w4_gluon.forward_into(x, w, acc, 1000, index=i)
  y, acc_out = jax.eval_shape(fn, x, stack, i, acc)
  assert (y.shape, y.dtype, acc_out.shape) == ((8, n), jnp.float32, acc.shape)
  text = jax.jit(fn).trace(x, stack, i, acc).lower(lowering_platforms=("cuda",)).as_text()
  assert "qerl_gluon_launch" in text and "atom.global.gpu.relaxed.add" in text
  assert "zero_results = 0" in text and "out_offset = 4000" in text and "output_operand_aliases" in text
  assert w4_gluon.into_applies(x, stack, 0) and not w4_gluon.into_applies(x, stack)  # a stack needs index
  x32 = jax.ShapeDtypeStruct((32, k), jnp.bfloat16)  # the wgmma build (the decoder's batch 17-32)
  wg = jax.jit(lambda x, w, i, acc: w4_gluon.forward_into(x, w, acc, 0, index=i)).trace(
      x32, stack, i, jax.ShapeDtypeStruct((32 * n,), jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()
  assert "wgmma.mma_async" in wg and "atom.global" in wg and "zero_results = 0" in wg and "out_offset = 0" in wg
  new = jax.jit(lambda x, w, i: w4_gluon.forward_into(x, w, None, 1000, index=i, size=acc.shape[0])).trace(
      x, stack, i).lower(lowering_platforms=("cuda",)).as_text()  # a new buffer: the launcher zeroes it
  assert "zero_results = 1" in new and "out_offset = 4000" in new and "output_operand_aliases" not in new
  with pytest.raises(ValueError, match="needs its size"):
    jax.eval_shape(lambda x, w, i: w4_gluon.forward_into(x, w, None, 0, index=i), x, stack, i)
  with pytest.raises(ValueError, match="does not fit"):
    jax.eval_shape(lambda x, w, i, acc: w4_gluon.forward_into(x, w, acc, 1001, index=i), x, stack, i, acc)
  with pytest.raises(ValueError, match="1-D float32"):
    jax.eval_shape(fn, x, stack, i, jax.ShapeDtypeStruct(acc.shape, jnp.bfloat16))
  monkeypatch.setenv("QERL_GLUON_DETERMINISTIC", "1")  # fixed-order partials need their own buffer
  assert not w4_gluon.into_applies(x, stack, 0)
  with pytest.raises(ValueError, match="no accumulating kernel"):  # (a new function: eval_shape caches by it)
    jax.eval_shape(lambda x, w, i, acc: w4_gluon.forward_into(x, w, acc, 0, index=i), x, stack, i, acc)


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(8, 3584, 4608), (3, 1088, 768), (32, 3584, 4608), (64, 3584, 3584),
                                   (5, 64, 256)])
def test_gpu_forward_into_fills_its_region_only(m, k, n):
  """forward_into against float64 in a region of a buffer whose other elements are NaN: they stay
  NaN (bit for bit), and the region equals x @ W. M = 32: the wgmma build; 64: the narrow one;
  (5, 64, 256): one split, which stores."""
  if not w4_gluon.available() or w4_gluon.launcher() != "ffi":
    pytest.skip("needs the Gluon kernel's FFI launcher")
  if m > 16:
    _skip_without_wgmma()
  wq = _weight(k, n, 3 * m + k, layers=2)
  x = _act(m, k, m + n)
  off = 136
  want = np.asarray(x, np.float64) @ _dense64(matmul.layer_of(wq, 1))
  acc = jnp.full((off + m * n + 50,), jnp.nan, jnp.float32).at[off:off + m * n].set(0.0)
  y, out = jax.jit(lambda x, w, acc: w4_gluon.forward_into(x, w, acc, off, index=jnp.int32(1)))(x, wq, acc)
  out = np.asarray(out)
  assert np.isnan(out[:off]).all() and np.isnan(out[off + m * n:]).all()
  np.testing.assert_array_equal(out[off:off + m * n].reshape(m, n), np.asarray(y))
  assert _rel(y, want) < 1e-4
  # a new buffer: zeroed by the launcher, the region written
  y, out = jax.jit(lambda x, w: w4_gluon.forward_into(x, w, None, off, index=jnp.int32(1), size=acc.shape[0]))(x, wq)
  out = np.asarray(out)
  assert (out[:off] == 0).all() and (out[off + m * n:] == 0).all() and _rel(y, want) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3, 8, 16, 17, 32, 40, 64, 100, 128])
@pytest.mark.parametrize("k,n", [(3584, 4608), (1088, 768)])
def test_gpu_gluon_decode_order_matches_float64(m, k, n, monkeypatch):
  """Codes in nvfp4.to_decode_order's order (the cheaper E2M1 decode), every build (mma.sync, wgmma,
  narrow, the x ring), a stack read at layer 1: against float64, and with a fixed summation order
  (QERL_GLUON_DETERMINISTIC=1) bit for bit equal to the standard order."""
  if m > 16:
    _skip_without_wgmma()
  wq = _weight(k, n, m + 7 * k, layers=2)
  wd = nvfp4.to_decode_order(wq)
  x = _act(m, k, m + n)
  run = jax.jit(lambda x, w: w4_gluon.forward(x, w, out_dtype=jnp.float32, index=jnp.int32(1)))
  y = run(x, wd)
  assert bool(jnp.isfinite(y).all())
  assert _rel(y, np.asarray(x, np.float64) @ _dense64(matmul.layer_of(wq, 1))) < 1e-4
  monkeypatch.setenv("QERL_GLUON_DETERMINISTIC", "1")
  run = jax.jit(lambda x, w: w4_gluon.forward(x, w, out_dtype=jnp.float32, index=jnp.int32(1)))
  np.testing.assert_array_equal(np.asarray(run(x, wd)), np.asarray(run(x, wq)))


@pytest.mark.gpu
@pytest.mark.parametrize("k,n", [(3584, 4608), (18944, 3584), (1088, 768)])
def test_gpu_dequantize_reads_decode_order_in_place(k, n, monkeypatch):
  """The in-place dequantize of decode-order codes (w4_triton.DEQUANT_DECODE_ORDER_IN_PLACE, the default),
  compiled for the GPU, gives the standard order's dense weight bit for bit at each layer of a stack."""
  from pallas_kernels import w4_triton
  monkeypatch.setattr(w4_triton, "DEQUANT_DECODE_ORDER_IN_PLACE", True)
  wq = _weight(k, n, k + n, layers=2)
  wd = nvfp4.to_decode_order(wq)
  f = jax.jit(lambda w, i: w4_triton.dequantize(w, index=i))
  for i in (0, 1):
    np.testing.assert_array_equal(np.asarray(f(wd, jnp.int32(i)), np.float32), np.asarray(f(wq, jnp.int32(i)), np.float32))


@pytest.mark.gpu
def test_gpu_decode_order_on_every_kernel_path_equals_the_standard_order(monkeypatch):
  """A decode-order weight through quantized_matmul on the other paths (the Pallas fused kernel with
  the Gluon kernel off, dequantize + cuBLAS at M = 200, the dx kernels of the gradient at M = 8 and
  64, forward_into) gives the standard order's result: the Pallas paths convert the codes back first,
  the dequantize kernel reads them in place."""
  import pallas_kernels
  k, n = 1088, 768
  wq = _weight(k, n, 11, layers=3)
  wd = nvfp4.to_decode_order(wq)
  for m in (8, 40, 200):
    x = _act(m, k, m)
    f = jax.jit(lambda x, w: pallas_kernels.quantized_matmul(x, w, index=jnp.int32(2)))
    g = jax.jit(jax.grad(lambda x, w: jnp.sum(pallas_kernels.quantized_matmul(x, w, index=jnp.int32(2))
                                              .astype(jnp.float32) ** 2)))
    if m > w4_gluon.MAX_M:  # dequantize + cuBLAS (the Gluon kernel's atomics are not bitwise repeatable)
      np.testing.assert_array_equal(np.asarray(f(x, wd)), np.asarray(f(x, wq)))
    np.testing.assert_allclose(np.asarray(g(x, wd), np.float32), np.asarray(g(x, wq), np.float32), rtol=2e-2,
                               atol=1e-2 * float(jnp.max(jnp.abs(g(x, wq).astype(jnp.float32)))))
  monkeypatch.setattr(matmul, "GLUON", "0")  # the Pallas fused kernel at M = 8 and 40
  for m in (8, 40):
    x = _act(m, k, m)
    f = jax.jit(lambda x, w: pallas_kernels.quantized_matmul(x, w, index=jnp.int32(2)))
    np.testing.assert_array_equal(np.asarray(f(x, wd)), np.asarray(f(x, wq)))
    dx = jax.jit(lambda dy, w: matmul.kernel_dx(dy, w, index=jnp.int32(2)))
    dy = _act(m, n, m + 1)
    np.testing.assert_array_equal(np.asarray(dx(dy, wd)), np.asarray(dx(dy, wq)))


@pytest.mark.gpu
def test_gpu_decode_steps_into_one_buffer_a_layer_match_the_plain_path(monkeypatch):
  """A model whose projections the Gluon kernel takes (K % 64 == 0, N % 256 == 0), NVFP4, fused
  q/k/v and gate/up with a bias: decoding with the layer's projections in one zeroed buffer
  (decoder.ACCUMULATE_DECODE) gives the plain path's logits (each kernel its own memset), up to the
  order of the atomics' float32 additions."""
  import pallas_kernels
  from qerl_jax import models
  from qerl_jax.models import decoder
  from tests._model_utils import decode_all, left_padded_batch
  if not w4_gluon.available() or w4_gluon.launcher() != "ffi":
    pytest.skip("needs the Gluon kernel's FFI launcher")
  cfg = models.ModelConfig(vocab_size=97, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=64, attention_bias=True, dtype="bfloat16")
  base = models.quantize_base(models.fuse_projections(
      models.init_params(cfg, jax.random.key(0), dtype=jnp.bfloat16, std=0.1)), "nvfp4")
  tokens, mask = (jnp.asarray(a) for a in left_padded_batch(cfg.vocab_size, seed=5))
  calls = []
  real = pallas_kernels.quantized_matmul_into
  monkeypatch.setattr(pallas_kernels, "quantized_matmul_into", lambda *a, **k: calls.append(a[3]) or real(*a, **k))
  # the layer's four separate calls, not the chained layer (PDL_CHAIN, on by default since session 60, runs o, gate/up
  # and down of a rollout without LoRA inside one call; tests/test_decode_chain.py checks it against these)
  monkeypatch.setattr(decoder, "PDL_CHAIN", 0)
  monkeypatch.setattr(decoder, "ACCUMULATE_DECODE", False)
  plain, _ = decode_all(cfg, base, tokens, mask, n_prefill=6, cache_dtype=jnp.bfloat16)
  assert not calls
  monkeypatch.setattr(decoder, "ACCUMULATE_DECODE", True)
  into, _ = decode_all(cfg, base, tokens, mask, n_prefill=6, cache_dtype=jnp.bfloat16)
  b = tokens.shape[0]
  assert calls == [0, b * 512, b * (512 + 256), b * (512 + 256 + 1024)]  # q/k/v, o, gate/up, down
  real_rows = np.asarray(mask).astype(bool)
  a, p = np.asarray(into, np.float32)[real_rows], np.asarray(plain, np.float32)[real_rows]
  assert np.isfinite(a).all() and np.abs(a - p).max() < 2e-2 * np.abs(p).max()
  # the base in the decode kernel's code order (models.to_decode_order): prefill converts back, the
  # decode steps read it in place; same logits up to the atomics' order
  ordered, _ = decode_all(cfg, models.to_decode_order(base), tokens, mask, n_prefill=6, cache_dtype=jnp.bfloat16)
  o = np.asarray(ordered, np.float32)[real_rows]
  assert np.isfinite(o).all() and np.abs(o - p).max() < 2e-2 * np.abs(p).max()
  # a fused bf16 adapter (rank 16 on q, v, o, up, down): its up-projection added in the kernel
  # (w4_gluon.LORA_IN_KERNEL) or by XLA gives the same logits, and the kernel took all four projections
  from qerl_jax import lora as lora_lib
  c = lora_lib.LoRAConfig(r=16, lora_alpha=32.0, target_modules=("q", "v", "o", "up", "down"))
  ad = lora_lib.init_lora(jax.random.key(5), cfg, c)
  ad = jax.tree.map(lambda a: a + 0.05 * jax.random.normal(jax.random.key(a.size), a.shape, a.dtype), ad)
  kw = dict(lora=models.fuse_adapter(ad, cfg, dtype=jnp.bfloat16), lora_cfg=c)
  with_lora = []
  real_into = w4_gluon.forward_into
  monkeypatch.setattr(w4_gluon, "forward_into", lambda *a, **k: with_lora.append(k.get("lora") is not None)
                      or real_into(*a, **k))
  monkeypatch.setattr(w4_gluon, "LORA_IN_KERNEL", False)
  monkeypatch.setattr(w4_gluon, "LORA_XA", 0)
  by_xla, _ = decode_all(cfg, base, tokens, mask, n_prefill=6, cache_dtype=jnp.bfloat16, **kw)
  assert with_lora == [False] * 4
  monkeypatch.setattr(w4_gluon, "LORA_IN_KERNEL", True)
  in_kernel, _ = decode_all(cfg, base, tokens, mask, n_prefill=6, cache_dtype=jnp.bfloat16, **kw)
  assert with_lora[4:] == [True] * 4
  a, p = np.asarray(in_kernel, np.float32)[real_rows], np.asarray(by_xla, np.float32)[real_rows]
  assert np.isfinite(a).all() and np.abs(a - p).max() < 2e-2 * np.abs(p).max()
  # and with x @ A by lora_xa too (w4_gluon.LORA_XA, the default; off above): the same logits
  monkeypatch.setattr(w4_gluon, "LORA_XA", 1)
  xa_kernel, _ = decode_all(cfg, base, tokens, mask, n_prefill=6, cache_dtype=jnp.bfloat16, **kw)
  a = np.asarray(xa_kernel, np.float32)[real_rows]
  assert np.isfinite(a).all() and np.abs(a - p).max() < 2e-2 * np.abs(p).max()


@pytest.mark.gpu
@pytest.mark.parametrize("m,r,stacked", [(1, 16, True), (3, 32, True), (8, 32, False), (16, 64, True), (8, 48, True),
                                         (32, 32, True), (40, 64, True)])
def test_gpu_forward_into_with_a_lora_term_matches_float64(m, r, stacked, monkeypatch):
  """forward_into(lora=(x @ A, B, scale)) writes x @ W + scale (x @ A) @ B into its region: float64
  reference on the bf16 factors, B a stack read at the layer index or one matrix; ranks 16-64 (48: three
  splits add one 16-rank chunk each); the rest of the buffer stays zero. M = 32 and 40: the wgmma builds
  (the full and the narrow one) with LORA_IN_KERNEL_WG."""
  if not w4_gluon.available() or w4_gluon.launcher() != "ffi":
    pytest.skip("needs the Gluon kernel's FFI launcher")
  if m > 16:
    _skip_without_wgmma()
    monkeypatch.setattr(w4_gluon, "LORA_IN_KERNEL_WG", 1)
  k, n, layers, off = 1088, 768, 3, 40
  wq = _weight(k, n, 11 * m + r, layers=layers if stacked else None)
  x = _act(m, k, m + r)
  rng = np.random.default_rng(r)
  xa = jnp.asarray(rng.standard_normal((m, r)), jnp.bfloat16)
  b = jnp.asarray(rng.standard_normal((layers, r, n) if stacked else (r, n)) * 0.1, jnp.bfloat16)
  index = jnp.int32(2) if stacked else None
  w64 = _dense64(matmul.layer_of(wq, 2) if stacked else wq)
  b64 = np.asarray(b[2] if stacked else b, np.float64)
  want = np.asarray(x, np.float64) @ w64 + 0.75 * np.asarray(xa, np.float64) @ b64
  assert w4_gluon.lora_into_applies(x, wq, index, (xa, b, 0.75))
  run = jax.jit(lambda x, w, xa, b: w4_gluon.forward_into(x, w, None, off, index=index, size=off + m * n + 8,
                                                          lora=(xa, b, 0.75)))
  y, out = run(x, wq, xa, b)
  out = np.asarray(out)
  assert np.isfinite(out).all() and (out[:off] == 0).all() and (out[off + m * n:] == 0).all()
  assert _rel(y, want) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,r,stacked", [(1, 3584, 32, True), (8, 1088, 96, True), (16, 18944, 64, False),
                                           (3, 1000, 8, True), (8, 3584, 128, False)])
@pytest.mark.parametrize("parts_max", [32, 64, 128])
def test_gpu_lora_xa_partials_sum_to_float64(monkeypatch, m, k, r, stacked, parts_max):
  """lora_xa's float32 partial products sum to x @ A (float64 on the bf16 inputs), A a stack read at the
  layer index or one matrix; K not a multiple of 64 (1000: the last step masked), R not a power of 2
  (96, 8: rows past R masked); at most XA_MAX_PARTS parts (the default 128 since session 25, 32 before it, and 64)."""
  monkeypatch.setattr(w4_gluon, "XA_MAX_PARTS", parts_max)
  if not w4_gluon.lora_xa_applies(jnp.zeros((m, k), jnp.bfloat16), jnp.zeros((3, k, r) if stacked else (k, r),
                                                                                     jnp.bfloat16),
                                  0 if stacked else None):
    pytest.skip("needs the Gluon kernel's FFI launcher")
  rng = np.random.default_rng(m + k + r)
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  a = jnp.asarray(rng.standard_normal((3, k, r) if stacked else (k, r)) * 0.05, jnp.bfloat16)
  parts = jax.jit(lambda x, a: w4_gluon.lora_xa(x, a, jnp.int32(1) if stacked else None))(x, a)
  assert parts.shape == w4_gluon.lora_xa_shape(x, a) and parts.shape[0] <= w4_gluon.XA_MAX_PARTS
  want = np.asarray(x, np.float64) @ np.asarray(a[1] if stacked else a, np.float64)
  got = np.asarray(parts, np.float64).sum(0)
  assert np.isfinite(got).all() and _rel(got, want) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("m,r", [(1, 32), (8, 96), (16, 64)])
@pytest.mark.parametrize("parts_max", [32, 64, 128])
def test_gpu_forward_into_with_lora_xa_partials_matches_float64(monkeypatch, m, r, parts_max):
  """forward_into(lora=(lora_xa(x, A), B, scale)): the kernel sums the partials (28 of them with XA_MAX_PARTS
  32, 56 with 64 and 128 (the default)), rounds x @ A to bf16 and adds scale (x @ A) @ B; float64 reference with
  x @ A rounded to bf16 the same way."""
  monkeypatch.setattr(w4_gluon, "XA_MAX_PARTS", parts_max)
  if not w4_gluon.available() or w4_gluon.launcher() != "ffi":
    pytest.skip("needs the Gluon kernel's FFI launcher")
  k, n, layers = 3584, 768, 2
  wq = _weight(k, n, 3 * m + r, layers=layers)
  x = _act(m, k, m + r)
  rng = np.random.default_rng(r)
  a = jnp.asarray(rng.standard_normal((layers, k, r)) * 0.02, jnp.bfloat16)
  b = jnp.asarray(rng.standard_normal((layers, r, n)) * 0.1, jnp.bfloat16)
  index = jnp.int32(1)

  def run(x, w, a, b):
    parts = w4_gluon.lora_xa(x, a, index)
    return w4_gluon.forward_into(x, w, None, 0, index=index, size=m * n, lora=(parts, b, 0.5))[0]

  xa = (np.asarray(x, np.float64) @ np.asarray(a[1], np.float64)).astype(np.float32)
  xa = np.asarray(jnp.asarray(xa, jnp.bfloat16), np.float64)
  want = np.asarray(x, np.float64) @ _dense64(matmul.layer_of(wq, 1)) + 0.5 * xa @ np.asarray(b[1], np.float64)
  y = jax.jit(run)(x, wq, a, b)
  assert bool(jnp.isfinite(y).all()) and _rel(y, want) < 1e-3


def test_lora_xa_meta_by_hand(monkeypatch):
  """lora_xa's launch: K steps of 64 over at most XA_MAX_PARTS (128) parts, R padded to a power of 2 of at least
  16 with one warp per 16 rows up to 4. 7B q/k/v adapter (K 3584 = 56 steps, R 96): 56 parts of 1 step, RP 128,
  4 warps; down (K 18944 = 296 steps, R 32): 3 steps a part (ceil(296 / 128)), 99 parts (ceil(296 / 3)), 2 warps;
  K 1000 = 16 steps (the last partial): 16 parts of 1; R 8: RP 16, 1 warp. With 32 parts at most (the default
  before session 25): 28 parts of 2 steps, and down's 30 parts of 10."""
  meta = lambda m, k, r: {key: w4_gluon._xa_meta(m, k, r, 28)[key] for key in ("S", "STEPS", "RP", "WARPS", "MB")}
  assert meta(8, 3584, 96) == dict(S=56, STEPS=1, RP=128, WARPS=4, MB=8)
  assert meta(8, 18944, 32) == dict(S=99, STEPS=3, RP=32, WARPS=2, MB=8)
  assert meta(3, 1000, 8) == dict(S=16, STEPS=1, RP=16, WARPS=1, MB=8)
  assert meta(16, 3584, 64) == dict(S=56, STEPS=1, RP=64, WARPS=4, MB=16)
  assert w4_gluon.lora_xa_shape(jax.ShapeDtypeStruct((8, 18944), jnp.bfloat16),
                                jax.ShapeDtypeStruct((28, 18944, 32), jnp.bfloat16)) == (99, 8, 32)
  monkeypatch.setattr(w4_gluon, "XA_MAX_PARTS", 32)
  assert meta(8, 3584, 96)["S"] == 28 and meta(8, 18944, 32) == dict(S=30, STEPS=10, RP=32, WARPS=2, MB=8)


def test_lora_into_applies_by_hand(monkeypatch):
  """The LoRA epilogue's conditions, with into_applies granted (no GPU needed): bf16 factors of the
  right shapes, R a multiple of 16 with at most 16 ranks a split (7B q/k/v at M = 8: 28 splits, so
  R <= 448), an mma.sync build (M <= 16; a wgmma build with LORA_IN_KERNEL_WG, on by default), a Python scale, and
  LORA_IN_KERNEL."""
  import types
  monkeypatch.setattr(w4_gluon, "into_applies", lambda x, w, index=None: True)
  w = types.SimpleNamespace(packed=np.zeros((28, 1792, 4608), np.uint8), shape=(3584, 4608), code_order="decode")
  sds = jax.ShapeDtypeStruct
  x = sds((8, 3584), jnp.bfloat16)
  ok = (sds((8, 32), jnp.bfloat16), sds((28, 32, 4608), jnp.bfloat16), 2.0)
  assert w4_gluon.lora_into_applies(x, w, 0, ok)
  assert w4_gluon.lora_into_applies(x, w, 0, (sds((8, 448), jnp.bfloat16), sds((28, 448, 4608), jnp.bfloat16), 1))
  bad = [(sds((8, 464), jnp.bfloat16), sds((28, 464, 4608), jnp.bfloat16), 2.0),  # 29 chunks > 28 splits
         (sds((8, 24), jnp.bfloat16), sds((28, 24, 4608), jnp.bfloat16), 2.0),   # not a multiple of 16
         (sds((8, 32), jnp.float32), ok[1], 2.0), (ok[0], sds((28, 32, 4608), jnp.float32), 2.0),
         (ok[0], sds((32, 4608), jnp.bfloat16), 2.0),  # one matrix for a stacked weight
         (ok[0], ok[1], jnp.float32(2.0)), (sds((7, 32), jnp.bfloat16), ok[1], 2.0)]
  assert not any(w4_gluon.lora_into_applies(x, w, 0, lo) for lo in bad)
  wg = (sds((32, 3584), jnp.bfloat16), w, 0, (sds((32, 32), jnp.bfloat16), *ok[1:]))
  assert w4_gluon.lora_into_applies(*wg)  # M = 32: a wgmma build (LORA_IN_KERNEL_WG, the default)
  monkeypatch.setattr(w4_gluon, "LORA_IN_KERNEL_WG", 0)
  assert not w4_gluon.lora_into_applies(*wg)
  # lora_xa's float32 partial products [S, M, R], S <= XA_MAX_PARTS (128)
  assert w4_gluon.XA_MAX_PARTS == 128
  assert w4_gluon.lora_into_applies(x, w, 0, (sds((99, 8, 32), jnp.float32), *ok[1:]))
  assert not w4_gluon.lora_into_applies(x, w, 0, (sds((129, 8, 32), jnp.float32), *ok[1:]))
  assert not w4_gluon.lora_into_applies(x, w, 0, (sds((28, 8, 32), jnp.bfloat16), *ok[1:]))
  monkeypatch.setattr(w4_gluon, "LORA_IN_KERNEL", False)
  assert not w4_gluon.lora_into_applies(x, w, 0, ok)


def test_ffi_launcher_builds_and_reports_a_missing_driver(tmp_path, monkeypatch):
  """gluon_launch.cc compiles with the system C++ compiler into $QERL_CACHE_DIR (atomically, once:
  a second call returns the same file), exports the FFI handler and the preload entry, and the
  preload reports -1 (not a crash) where libcuda.so.1 is absent."""
  import ctypes
  import shutil

  if shutil.which("c++") is None and shutil.which("g++") is None:
    pytest.skip("no C++ compiler")
  monkeypatch.setenv("QERL_CACHE_DIR", str(tmp_path))
  monkeypatch.delenv("QERL_GLUON_LAUNCHER", raising=False)
  path = w4_gluon._build_ffi_library()
  assert path is not None and path.startswith(str(tmp_path))
  assert w4_gluon._build_ffi_library() == path and len(list(tmp_path.iterdir())) == 1  # no temp file left
  lib = ctypes.CDLL(path)
  assert hasattr(lib, "QerlGluonLaunch")
  lib.qerl_gluon_preload.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int,
                                     ctypes.c_longlong]
  try:
    ctypes.CDLL("libcuda.so.1")
  except OSError:
    assert lib.qerl_gluon_preload(b"key", b".version 8.0", b"k", 0, 0) == -1
  monkeypatch.setenv("QERL_GLUON_LAUNCHER", str(tmp_path / "prebuilt.so"))
  with pytest.warns(UserWarning, match="does not exist"):
    assert w4_gluon._build_ffi_library() is None
  (tmp_path / "prebuilt.so").write_bytes(b"")
  assert w4_gluon._build_ffi_library() == str(tmp_path / "prebuilt.so")  # a prebuilt library wins


def test_ffi_launcher_decodes_a_base64_cubin_image(tmp_path, monkeypatch):
  """The launcher loads a kernel given as "cubin:" and base64 (lab builds from elsewhere) by its own decoder: the
  bytes of random images of every length mod 3 equal Python's base64 decoding; a buffer too small gives -1."""
  import base64
  import ctypes
  import shutil

  if shutil.which("c++") is None and shutil.which("g++") is None:
    pytest.skip("no C++ compiler")
  monkeypatch.setenv("QERL_CACHE_DIR", str(tmp_path))
  monkeypatch.delenv("QERL_GLUON_LAUNCHER", raising=False)
  lib = ctypes.CDLL(w4_gluon._build_ffi_library())
  lib.qerl_gluon_base64_decode.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_longlong]
  lib.qerl_gluon_base64_decode.restype = ctypes.c_longlong
  rng = np.random.default_rng(0)
  for n in (0, 1, 2, 3, 4, 5, 255, 4097):
    data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
    out = ctypes.create_string_buffer(n + 1)
    assert lib.qerl_gluon_base64_decode(base64.b64encode(data), out, n + 1) == n
    assert out.raw[:n] == data
  assert lib.qerl_gluon_base64_decode(base64.b64encode(b"\x7fELF"), ctypes.create_string_buffer(3), 3) == -1


def test_failed_launcher_build_warns_and_leaves_nothing(tmp_path, monkeypatch):
  import shutil

  if shutil.which("c++") is None and shutil.which("g++") is None:
    pytest.skip("no C++ compiler")
  monkeypatch.setenv("QERL_CACHE_DIR", str(tmp_path))
  monkeypatch.delenv("QERL_GLUON_LAUNCHER", raising=False)
  monkeypatch.setattr(w4_gluon.jax.ffi, "include_dir", lambda: str(tmp_path / "no-headers"))  # ffi.h not found
  with pytest.warns(UserWarning, match="build"):
    assert w4_gluon._build_ffi_library() is None
  assert list(tmp_path.iterdir()) == []


def test_bad_settings_raise(monkeypatch):
  x = _act(8, 128, 0)
  w = _weight(128, 512, 0)
  monkeypatch.setattr(matmul, "GLUON", "yes")
  with pytest.raises(ValueError, match="GLUON"):
    matmul._use_gluon(x, w, False, None)
  monkeypatch.setattr(matmul, "GLUON", "auto")
  monkeypatch.setattr(matmul, "GLUON_LORA", "true")
  with pytest.raises(ValueError, match="GLUON_LORA"):
    matmul._use_gluon(x, w, False, None)
  monkeypatch.setenv("QERL_GLUON_LAUNCH", "triton")
  with pytest.raises(ValueError, match="QERL_GLUON_LAUNCH"):
    w4_gluon.requested_launcher()
  monkeypatch.setattr(w4_gluon, "SCALE_PAIRS", 3)
  with pytest.raises(ValueError, match="SCALE_PAIRS=3"):
    w4_gluon._build(8, 128, 512, 1)
  monkeypatch.setattr(w4_gluon, "SCALE_PAIRS", 2)
  monkeypatch.setattr(w4_gluon, "MMA_WARPS", 16)
  with pytest.raises(ValueError, match="MMA_WARPS=16"):
    w4_gluon._build(8, 128, 512, 1)


def test_module_key_tells_kernels_apart():
  """The launcher caches modules by this key, so kernels that share a name (every build is
  ``w4a16_gemv``) but not their PTX must get different keys, and a kernel must keep its key."""
  a = w4_gluon._module_key(".version 8.0\n// build A", "w4a16_gemv")
  assert len(a) == 32 and int(a, 16) >= 0
  assert a == w4_gluon._module_key(".version 8.0\n// build A", "w4a16_gemv")
  assert a != w4_gluon._module_key(".version 8.0\n// build B", "w4a16_gemv")
  assert a != w4_gluon._module_key(".version 8.0\n// build A", "other")
  assert w4_gluon._launch_attrs(".version 8.0\n// build A", "w4a16_gemv", (1, 1, 1), 0)["key"] == a


def test_ffi_handler_takes_as_many_attributes_as_forward_passes(tmp_path, monkeypatch):
  """Registered for the CPU, the handler accepts the attribute set forward() passes (it fails only on
  the missing GPU stream, binding 0) and rejects a call with fewer attributes. XLA's CPU decoding
  stops at the stream, so this catches an attribute added or dropped on one side only, not a
  renamed or retyped one (those need the GPU tests)."""
  import ctypes
  import shutil

  if shutil.which("c++") is None and shutil.which("g++") is None:
    pytest.skip("no C++ compiler")
  if any(d.platform == "gpu" for d in jax.devices()):
    pytest.skip("checks the binding on the CPU")
  monkeypatch.setenv("QERL_CACHE_DIR", str(tmp_path))
  monkeypatch.delenv("QERL_GLUON_LAUNCHER", raising=False)
  lib = ctypes.CDLL(w4_gluon._build_ffi_library())
  jax.ffi.register_ffi_target("qerl_gluon_launch_binding_test", jax.ffi.pycapsule(lib.QerlGluonLaunch), platform="cpu")
  call = jax.ffi.ffi_call("qerl_gluon_launch_binding_test", jax.ShapeDtypeStruct((4,), jnp.float32))
  x = jnp.ones((4,), jnp.float32)
  with pytest.raises(Exception) as err:
    jax.block_until_ready(call(x, x, **w4_gluon._launch_attrs(".version 8.0", "k", (3, 2, 1), 0)))
  assert "bad operands at: 0" in str(err.value) and "stream" in str(err.value)  # index 0: the stream only
  with pytest.raises(Exception, match="attributes"):
    jax.block_until_ready(call(x, ptx="p", name="k"))


def _run_ptx(asm, regs):
  """Executes the decode's inline PTX (``mov``, ``prmt`` default mode, ``shl``/``shr``/``and``/``or``
  on b32, ``add.u32``, ``mul.lo.u32``, ``mul.hi.u32``, ``cvt.u16.u32``, ``cvt.rn.f16x2.e4m3x2``, ``fma.rn.bf16x2``) on uint32 register values
  ``regs`` (``$0..$11`` and scratch)."""
  import ml_dtypes

  def bf16x2(v):
    return np.array([v & 0xFFFF, v >> 16], np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)

  def val(tok):
    return int(tok, 16) if tok.startswith("0x") else int(tok) if tok.isdigit() else regs[tok]

  for line in asm.replace("{", "").replace("}", "").split(";"):
    parts = line.replace(",", " ").split()
    if not parts or parts[0] == ".reg":
      continue
    op, dst, *src = parts
    a = [val(t) for t in src]
    if op == "mov.b32":
      out = a[0]
    elif op == "prmt.b32":  # byte i of the result: byte (selector nibble i) of [a0 a1 a2 a3 b0 b1 b2 b3]
      pool = [(a[0] >> (8 * i)) & 0xFF for i in range(4)] + [(a[1] >> (8 * i)) & 0xFF for i in range(4)]
      sel = [(a[2] >> (4 * i)) & 0xF for i in range(4)]
      assert all(s < 8 for s in sel), "sign-replicate mode is not used"
      out = sum(pool[s] << (8 * i) for i, s in enumerate(sel))
    elif op in ("shl.b32", "shr.b32"):
      out = (a[0] << a[1]) if op == "shl.b32" else (a[0] >> a[1])
    elif op == "and.b32":
      out = a[0] & a[1]
    elif op == "or.b32":
      out = a[0] | a[1]
    elif op == "add.u32":
      out = a[0] + a[1]
    elif op == "mul.lo.u32":
      out = a[0] * a[1]
    elif op == "mul.hi.u32":
      out = (a[0] * a[1]) >> 32
    elif op == "cvt.u16.u32":  # the low 16 bits
      out = a[0] & 0xFFFF
    elif op == "cvt.rn.f16x2.e4m3x2":  # E4M3 bytes 0, 1 -> float16 halves (exact)
      f16 = np.array([a[0] & 0xFF, (a[0] >> 8) & 0xFF], np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float16)
      out = int(f16.view(np.uint16)[0]) | (int(f16.view(np.uint16)[1]) << 16)
    elif op == "fma.rn.bf16x2":  # products of two bf16 are exact in float32; one rounding to bf16
      r = (bf16x2(a[0]) * bf16x2(a[1]) + bf16x2(a[2])).astype(ml_dtypes.bfloat16).view(np.uint16).astype(np.uint32)
      out = int(r[0]) | (int(r[1]) << 16)
    else:
      raise AssertionError(f"unexpected instruction {op}")
    regs[dst] = out & 0xFFFFFFFF
  return regs


def test_resolve_code_order(monkeypatch):
  """"auto" is the decode order exactly where decode_order_applies() (never on a CPU); the explicit
  orders pass through; anything else is an error naming the value."""
  assert matmul.resolve_code_order("standard") == "standard" and matmul.resolve_code_order("decode") == "decode"
  if not any(d.platform == "gpu" for d in jax.devices()):
    assert matmul.resolve_code_order("auto") == "standard"
  monkeypatch.setattr(matmul, "decode_order_applies", lambda: True)
  assert matmul.resolve_code_order("auto") == "decode"
  monkeypatch.setattr(matmul, "decode_order_applies", lambda: False)
  assert matmul.resolve_code_order("auto") == "standard"
  with pytest.raises(ValueError, match="'rollout'"):
    matmul.resolve_code_order("rollout")


@pytest.mark.parametrize("scales", ["bf16", "pairs", "bytes"])
@pytest.mark.parametrize("code_order", ["standard", "decode"])
def test_decode_ptx_by_codebook(code_order, scales):
  """The decode's inline PTX, executed by a small interpreter, gives exactly
  ``E2M1[code] * scale * 2**-8`` for every code of both rows and all four columns, with E4M3 block
  scales in and out of the subnormal range (the kernel's ``s * 2**118`` in bf16 as input); for
  ``code_order="decode"`` the PTX reads the two code rows as ``nvfp4.to_decode_order`` stores them
  and must give the same registers. ``scales``: ``"bf16"`` two scales a register; ``"pairs"`` (SCALE_PAIRS) each in
  both halves of its own register; ``"bytes"`` (SCALE_BYTES) the four as raw E4M3 bytes in one register."""
  import ml_dtypes

  rng = np.random.default_rng(0)
  asm = w4_gluon._asm(decode_order=code_order == "decode", scale_pairs=scales == "pairs",
                      scale_bytes=scales == "bytes")
  for trial in range(256):
    rows = rng.integers(0, 256, size=(2, 4)) if trial else np.array([[0x0F, 0xF0, 0x88, 0x77], [0x19, 0x2A, 0x3B, 0xFF]])
    scale = rng.choice([2.0 ** -9, 0.0625, 0.75, 1.0, 13.0, 448.0], size=4).astype(ml_dtypes.float8_e4m3fn)
    s118 = (scale.astype(np.float32) * np.float32(2.0 ** 118)).astype(ml_dtypes.bfloat16).view(np.uint16).astype(np.uint32)
    stored = rows
    if code_order == "decode":  # two code rows x four columns as the weight stores them
      stored = np.asarray(nvfp4._permute_block_bits(jnp.asarray(rows, jnp.uint8), nvfp4.DECODE_ORDER_BITS))
    regs = {"$8": int(sum(int(b) << (8 * i) for i, b in enumerate(stored[0]))),
            "$9": int(sum(int(b) << (8 * i) for i, b in enumerate(stored[1]))),
            "$10": int(s118[0] | (s118[1] << 16)), "$11": int(s118[2] | (s118[3] << 16))}
    if scales == "bytes":
      regs["$10"] = int(sum(int(b) << (8 * q) for q, b in enumerate(scale.view(np.uint8))))
      del regs["$11"]
    elif scales == "pairs":  # what the kernel's cvt.rn.bf16x2.f32 of each scale gives
      regs.update({f"${10 + q}": int(s118[q] | (s118[q] << 16)) for q in range(4)})
    regs = _run_ptx(asm, regs)
    for q in range(4):
      for nib, reg in ((0, f"${q}"), (1, f"${4 + q}")):
        got = np.array([regs[reg] & 0xFFFF, regs[reg] >> 16], np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)
        codes = (rows[:, q] >> (4 * nib)) & 0xF
        want = nvfp4.E2M1_CODEBOOK[codes].astype(np.float64) * float(scale[q].astype(np.float64)) * 2.0 ** -8
        np.testing.assert_array_equal(got, want, err_msg=f"column {q} nibble {nib} codes {codes}")
