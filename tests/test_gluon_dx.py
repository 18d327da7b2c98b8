"""Tests of the large-M Gluon dx kernel (pallas_kernels/w4_gluon_dx.py).

Gluon has no interpreter, so the kernel's numerics are tested on the GPU against a float64 numpy
product. On the CPU: its inline-PTX decode (through the small PTX interpreter of test_gluon.py) for
every code, the bf16 block scales it reads, and where the dispatch sends a gradient.
"""

import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import matmul, quantized_matmul, w4_gluon, w4_gluon_dx
from qerl_jax import nvfp4
from tests.test_gluon import _dense64, _rel, _run_ptx, _weight


def test_dx_decode_ptx_by_codebook():
  """The dx decode's PTX gives ``E2M1[code] * scale * 2**-8`` exactly for each nibble of the four
  bytes (columns n, n + 1, n + 8, n + 9 of one code row): low nibbles (K row 2 kp) in ``$0, $1``,
  high nibbles (K row 2 kp + 1) in ``$2, $3``, each register two adjacent columns with their own
  scales, E4M3 scales in and out of the subnormal range."""
  rng = np.random.default_rng(1)
  asm = w4_gluon_dx._asm()
  codebook = np.asarray(nvfp4.E2M1_CODEBOOK, np.float64)
  for trial in range(512):
    # the first trials walk every code through every byte and nibble
    code_bytes = (np.array([(trial * 17 + 16 * i + i) % 256 for i in range(4)]) if trial < 256
                  else rng.integers(0, 256, size=4))
    scale = rng.choice([2.0 ** -9, 0.0625, 0.75, 1.0, 13.0, 448.0], size=4).astype(ml_dtypes.float8_e4m3fn)
    s118 = np.asarray(w4_gluon_dx.block_scales_bf16(
        nvfp4.NVFP4Tensor(packed=jnp.zeros((1, 4), jnp.uint8), block_scale=jnp.asarray(scale[None]),
                          global_scale=jnp.float32(1.0), shape=(2, 4)))).view(np.uint16).astype(np.uint32)[0]
    regs = {"$4": int(sum(int(b) << (8 * i) for i, b in enumerate(code_bytes))),
            "$5": int(s118[0] | (s118[1] << 16)), "$6": int(s118[2] | (s118[3] << 16))}
    regs = _run_ptx(asm, regs)
    for nib in (0, 1):
      for h in (0, 1):  # register: columns (2h, 2h + 1) of the four bytes
        reg = regs[f"${2 * nib + h}"]
        got = np.array([reg & 0xFFFF, reg >> 16], np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)
        cols = [2 * h, 2 * h + 1]
        codes = (code_bytes[cols] >> (4 * nib)) & 0xF
        want = codebook[codes] * scale[cols].astype(np.float64) * 2.0 ** -8
        np.testing.assert_array_equal(got, want, err_msg=f"bytes {code_bytes} nibble {nib} columns {cols}")


def test_block_scales_bf16_of_a_layer():
  """The bf16 scales are E4M3 * 2**118 exactly, of the clamped layer of a stack."""
  wq = _weight(64, 32, 3, layers=3)
  for index, layer in ((1, 1), (7, 2), (-1, 0)):
    got = np.asarray(w4_gluon_dx.block_scales_bf16(wq, jnp.int32(index)), np.float64)
    want = np.asarray(wq.block_scale[layer].astype(jnp.float32), np.float64) * 2.0 ** 118
    assert got.shape == (4, 32)
    np.testing.assert_array_equal(got, want)


def test_dx_kernel_not_applied_off_gpu():
  """Without an sm_90 GPU the kernel applies nowhere and the gradient takes the other paths."""
  if any(d.platform == "gpu" for d in jax.devices()):
    pytest.skip("checks the CPU dispatch")
  wq = _weight(256, 128, 0)
  assert not w4_gluon_dx.applies(512, wq, jnp.bfloat16)
  assert not matmul._use_gluon_dx(jnp.zeros((512, 128), jnp.bfloat16), wq, False)
  with pytest.raises(ValueError, match="no kernel"):
    w4_gluon_dx.dx(jnp.zeros((512, 128), jnp.bfloat16), wq)


def test_dx_kernel_shape_rules():
  """applies() rejects what the kernel cannot take, whatever the machine: K not a multiple of 128,
  N not a multiple of 64, decode-order codes, float32 dy, NF4-like non-NVFP4 weights."""
  assert not w4_gluon_dx.applies(512, _weight(192, 128, 0), jnp.bfloat16)   # K % 128
  assert not w4_gluon_dx.applies(512, _weight(256, 96, 0), jnp.bfloat16)    # N % 64
  assert not w4_gluon_dx.applies(512, _weight(256, 128, 0), jnp.float32)
  assert not w4_gluon_dx.applies(512, jnp.zeros((256, 128), jnp.bfloat16), jnp.bfloat16)


def test_dx_setting_is_checked(monkeypatch):
  """A bad GLUON_DX value is an error naming the setting; the default keeps dequantize + cuBLAS."""
  assert matmul.GLUON_DX == "0" or "QERL_GLUON_DX" in os.environ
  with pytest.raises(ValueError, match="A_STAGES"):
    monkeypatch.setattr(w4_gluon_dx, "A_STAGES", 1)
    w4_gluon_dx._build(512, 256, 128, 1)
  monkeypatch.setattr(w4_gluon_dx, "A_STAGES", 3)
  monkeypatch.setattr(matmul, "GLUON_DX", "yes")
  with pytest.raises(ValueError, match="GLUON_DX"):
    matmul._use_gluon_dx(jnp.zeros((512, 128), jnp.bfloat16), _weight(256, 128, 0), False)


def test_dx_opt_in_wins_over_the_default_dx_build(monkeypatch):
  """Where both apply, kernel_dx takes the opt-in GLUON_DX kernel before the default GLUON_MM_DX build, and the
  default build when the opt-in does not apply (stand-ins that return known arrays; the dispatch only)."""
  dy = jnp.ones((512, 128), jnp.bfloat16)
  wq = _weight(256, 128, 0)
  monkeypatch.setattr(matmul, "_use_gluon_dx", lambda *a: True)
  monkeypatch.setattr(matmul, "_use_gluon_mm_dx", lambda *a: True)
  monkeypatch.setattr(w4_gluon_dx, "dx", lambda dy, w, index=None: jnp.full((dy.shape[0], 256), 2.0, jnp.float32))
  monkeypatch.setattr(matmul.w4_gluon_mm, "dx", lambda dy, w, index=None: jnp.full((dy.shape[0], 256), 3.0,
                                                                                   jnp.float32))
  np.testing.assert_array_equal(np.asarray(matmul.kernel_dx(dy, wq), np.float32), np.full((512, 256), 2.0))
  assert matmul.dx_path(dy, wq) == "gluon_dx"
  monkeypatch.setattr(matmul, "_use_gluon_dx", lambda *a: False)
  np.testing.assert_array_equal(np.asarray(matmul.kernel_dx(dy, wq), np.float32), np.full((512, 256), 3.0))
  assert matmul.dx_path(dy, wq) == "gluon_mm_dx"
  assert matmul.dx_path(dy[:matmul.FUSED_MAX_M["dx"]], wq) == "fused"
  monkeypatch.setattr(matmul, "_use_gluon_mm_dx", lambda *a: False)
  assert matmul.dx_path(dy, wq) == "dequantize+dot"


def test_standard_order_words_undo_the_decode_order():
  """The warp-specialized build's in-register conversion of decode-order codes (its numpy twin, the same masks and
  shifts) gives back the standard-order bytes nvfp4.to_standard_order computes, on random codes."""
  wq = _weight(64, 40, 21)
  wd = nvfp4.to_decode_order(wq)
  words = np.ascontiguousarray(np.asarray(wd.packed)).view(np.uint32)  # [K/2, N/4], 4 columns a word
  s0, s1 = w4_gluon_dx.standard_order_words(words[0::2], words[1::2])
  got = np.empty_like(words)
  got[0::2], got[1::2] = s0, s1
  np.testing.assert_array_equal(got.view(np.uint8), np.asarray(wq.packed))
  assert not np.array_equal(np.asarray(wd.packed), np.asarray(wq.packed))  # the orders differ on these codes


def test_ws_settings_are_checked(monkeypatch):
  """The warp-specialized build's tile and ring settings are validated before a launch is built (no GPU needed)."""
  w4_gluon_dx._ws_check()  # the defaults
  for name, bad in (("WS_BLOCK_M", 64), ("WS_BLOCK_K", 64), ("WS_STAGES", 1), ("WS_CODE_STAGES", 1)):
    with monkeypatch.context() as mp:
      mp.setattr(w4_gluon_dx, name, bad)
      with pytest.raises(ValueError, match=name):
        w4_gluon_dx._ws_check()
  assert w4_gluon_dx._ws_regs() == (168, 128)  # 12 warps share 65536 registers; the producer gets 128


# ----------------------------------------------------------------------------- GPU


def _skip_without_kernel():
  if not (w4_gluon._wgmma_gpus() and w4_gluon.available() and w4_gluon.launcher() == "ffi"):
    pytest.skip("the dx kernel needs an sm_90 GPU and the FFI launcher")


@pytest.mark.gpu
@pytest.mark.parametrize("ws", [0, 1])
@pytest.mark.parametrize("m,k,n", [
    (2048, 3584, 4608),   # 7B q/k/v
    (300, 18944, 3584),   # 7B down, ragged M (two M tiles, the second with 44 rows)
    (1000, 3584, 3584),   # 7B o
    (257, 1152, 768),     # one row in the last M tile
    (129, 1280, 768),     # 129 rows of one 256-row tile (the warp-specialized build)
    (64, 128, 64),        # one program, one step
    (64, 256, 64),        # one step, two 128-row K tiles (the warp-specialized build)
    (200, 512, 320),      # a ring of 4 wrapped once (5 steps)
])
def test_gpu_dx_matches_float64(m, k, n, ws, monkeypatch):
  """dx = dy @ W^T against float64 (bf16 output: relative error at bf16 rounding), every row written
  and finite; ``ws``: the warp-specialized build (``WS``) or session 17's."""
  _skip_without_kernel()
  monkeypatch.setattr(w4_gluon_dx, "WS", ws)
  wq = _weight(k, n, m + k)
  dy = jnp.asarray(np.random.default_rng(n).standard_normal((m, n)) * 2.0, jnp.bfloat16)
  got = jax.jit(w4_gluon_dx.dx)(dy, wq)
  assert got.shape == (m, k) and got.dtype == jnp.bfloat16 and bool(jnp.isfinite(got).all())
  want = np.asarray(dy, np.float64) @ _dense64(wq).T
  assert _rel(got, want) < 4e-3
  row_err = np.linalg.norm(np.asarray(got, np.float64) - want, axis=1) / np.linalg.norm(want, axis=1)
  assert row_err.max() < 1e-2  # no row (the last M tile's included) left unwritten or misplaced


@pytest.mark.gpu
@pytest.mark.parametrize("ws,k", [(0, 1152), (1, 1280)])
def test_gpu_dx_reads_a_stacked_layer(ws, k, monkeypatch):
  """With ``index`` the kernel reads that layer of a stack in place (clamped like the other kernels)."""
  _skip_without_kernel()
  monkeypatch.setattr(w4_gluon_dx, "WS", ws)
  wq = _weight(k, 768, 5, layers=3)
  dy = jnp.asarray(np.random.default_rng(6).standard_normal((512, 768)), jnp.bfloat16)
  f = jax.jit(lambda dy, w, i: w4_gluon_dx.dx(dy, w, index=i))
  for index, layer in ((0, 0), (2, 2), (5, 2)):
    want = np.asarray(dy, np.float64) @ _dense64(jax.tree.map(lambda a: a[layer], wq)).T
    assert _rel(f(dy, wq, jnp.int32(index)), want) < 4e-3


@pytest.mark.gpu
@pytest.mark.parametrize("ws", [0, 1])
def test_gpu_dx_reads_a_decode_order_layer(ws, monkeypatch):
  """A decode-order stack (the GPU default of the trainer's ``code_order="auto"``) gives the same dx as its
  standard-order values: the layer is converted first, then either build runs."""
  _skip_without_kernel()
  monkeypatch.setattr(w4_gluon_dx, "WS", ws)
  wq = _weight(1280, 768, 11, layers=3)
  wd = nvfp4.to_decode_order(wq)
  dy = jnp.asarray(np.random.default_rng(12).standard_normal((300, 768)), jnp.bfloat16)
  assert w4_gluon_dx.applies(300, wd, jnp.bfloat16)
  got = jax.jit(lambda dy, w, i: w4_gluon_dx.dx(dy, w, index=i))(dy, wd, jnp.int32(1))
  want = np.asarray(dy, np.float64) @ _dense64(jax.tree.map(lambda a: a[1], wq)).T
  assert _rel(got, want) < 4e-3


@pytest.mark.gpu
def test_gpu_gradient_takes_the_dx_kernel(monkeypatch):
  """With GLUON_DX = "1", quantized_matmul's gradient at M = 512 goes through the kernel (counted) and
  equals the default dequantize + cuBLAS path's (GLUON_DX = "0") to bf16 rounding."""
  _skip_without_kernel()
  monkeypatch.setattr(matmul, "GLUON_DX", "1")
  calls = []
  original = w4_gluon_dx.dx
  monkeypatch.setattr(w4_gluon_dx, "dx", lambda *a, **kw: calls.append(1) or original(*a, **kw))
  wq = _weight(1152, 768, 8)
  x = jnp.asarray(np.random.default_rng(9).standard_normal((512, 1152)), jnp.bfloat16)
  loss = lambda x: jnp.sum(quantized_matmul(x, wq).astype(jnp.float32) ** 2)
  g = jax.grad(loss)(x)
  assert calls
  monkeypatch.setattr(matmul, "GLUON_DX", "0")
  g_ref = jax.grad(loss)(x)
  assert _rel(g, g_ref) < 4e-3
