"""A decode step's layer end, the residual add and the next RMSNorm, as one Gluon kernel.

A decoder layer ends with ``h = h + y`` (``y`` the down-projection) and the next layer starts with
``x = RMSNorm(h) * (w + noise)`` (its input norm; after the last layer, the final norm). In a decode step of
a few rows XLA runs them as one small fusion a layer (2.2 µs at batch 8 on an H200, 7B shape), and the next
layer's four W4A16 kernels then need their float32 accumulator zeroed: a memset node (1.3 µs;
docs/benchmarks.md, session 22's profile). :func:`residual_rms_norm` does all three in one launch: programs
``0 .. B - 1`` take a row each, reading ``y`` in place from the float32 region where the W4A16 kernel wrote
it (:func:`pallas_kernels.quantized_matmul_into`) and the norm weight and AQN noise from ``[L, D]`` stacks at
the layer index; the other programs zero a new float32 buffer for the next layer's projections.

Numerics are those of :func:`reference`: ``y`` rounded to the compute dtype, the add rounded, the statistics
in float32 (Zhang & Sennrich 2019), the normalized value rounded before the weight (+ noise, QeRL Sec. 3.3)
multiplies it, as :func:`qerl_jax.models.layers.rms_norm`.

Session 22 measured a first version (the o residual and the post-attention norm, weight loads after the
reduction) at 2.5-2.6 µs against XLA's 1.4-1.8 and removed it. This version issues every load first and sits
at the layer end, where it also replaces the memset; the decoder uses it there and at the post-attention norm
(``decoder.FUSED_LAYER_END`` and ``FUSED_POST_ATTENTION``, on since session 23: 3.4 and 2.8 µs a layer on an
H200 at batch 8 with 4 warps, a decode step 2.30 -> 2.27 ms at 2048 new tokens; with 16 warps since session 24,
2.23 ms; docs/kernels.md). GPU only (the Gluon FFI launcher of :mod:`pallas_kernels.w4_gluon`); :func:`applies`
says when.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import w4_gluon

MAX_DIM = 16384  # hidden sizes taken (one program holds a row, padded to a power of 2)
WARPS = 16  # warps a program: a batch-8 decode step 2.279 ms at 4, 2.240 at 8, 2.226 at 16 (H200, session 24)
ZERO_CHUNK = 2048  # float32 elements a zeroing program writes (4 a thread at 16 warps; 8192 and 512: no gain)


def reference(h: jax.Array, y: jax.Array, weight: jax.Array, eps: float, noise=None):
  """The XLA formula :func:`residual_rms_norm` computes: ``h + y`` (``y`` float32, rounded to ``h``'s dtype
  first), then RMSNorm of the sum (Zhang & Sennrich 2019) by ``weight (+ noise)`` (QeRL Sec. 3.3).

  Args:
    h: ``[B, D]`` residual stream (bf16). y: float32 ``[B, D]``. weight: ``[D]``. noise: optional float32 ``[D]``.
    eps: the norm's epsilon.

  Returns:
    ``(h + y, x)``, both ``[B, D]`` in ``h``'s dtype.
  """
  from qerl_jax.models import layers  # (lazily: the decoder imports this module)
  h = h + y.astype(h.dtype)
  return h, layers.rms_norm(h, weight, eps, noise)


def available() -> bool:
  """Whether the kernel can run here: JAX's default backend is a GPU, with the Gluon kernel's FFI launcher
  (:func:`w4_gluon.available`)."""
  return jax.default_backend() in ("gpu", "cuda") and w4_gluon.available() and w4_gluon.launcher() == "ffi"


def applies(h, weight, noise=None) -> bool:
  """Whether :func:`residual_rms_norm` takes ``h`` (bf16 ``[B, D]``, ``D <= MAX_DIM``), ``weight`` (a bf16 or
  float32 stack ``[L, D]``) and ``noise`` (None or float32 ``[L, D]``) here (:func:`available`)."""
  if h.ndim != 2 or h.dtype != jnp.bfloat16 or not 1 <= h.shape[1] <= MAX_DIM:
    return False
  if weight.ndim != 2 or weight.shape[1] != h.shape[1] or weight.dtype not in (jnp.bfloat16, jnp.float32):
    return False
  if noise is not None and (noise.shape != weight.shape or noise.dtype != jnp.float32):
    return False
  return available()


def _kernel():
  """The Gluon kernel (imports triton lazily): program ``b < B`` adds row ``b`` of the region to ``h``'s,
  stores the sum and its RMSNorm by the layer's weight (+ noise); program ``B + z`` zeroes elements
  ``z * ZC .. z * ZC + ZC - 1`` of the new buffer."""
  from triton.experimental import gluon
  from triton.experimental.gluon import language as ttgl

  gdc = w4_gluon._gdc()  # (PDL: pallas_kernels.decode_chain)

  @gluon.jit
  def residual_rms_norm_rows(h_ptr, y_ptr, w_ptr, n_ptr, idx_ptr, ho_ptr, x_ptr, z_ptr, B: ttgl.constexpr,
                             D: ttgl.constexpr, DP: ttgl.constexpr, L: ttgl.constexpr, Y_OFF: ttgl.constexpr,
                             EPS: ttgl.constexpr, NOISE: ttgl.constexpr, ZS: ttgl.constexpr, ZC: ttgl.constexpr,
                             WARPS: ttgl.constexpr, GDC: ttgl.constexpr = 0):
    # GDC (PDL, pallas_kernels.decode_chain): the layer's weight and noise loaded before griddepcontrol.wait, h
    # and y after it (unset: None, the library's build)
    pid = ttgl.program_id(0)
    if pid < B:
      lay: ttgl.constexpr = ttgl.BlockedLayout([DP // (32 * WARPS)], [32], [WARPS], [0])
      layer = ttgl.minimum(ttgl.maximum(ttgl.load(idx_ptr), 0), L - 1)
      d = ttgl.arange(0, DP, layout=lay)
      m = d < D
      if GDC:
        w = ttgl.load(w_ptr + layer * D + d, mask=m, other=0.0).to(ttgl.float32)
        if NOISE:
          w = w + ttgl.load(n_ptr + layer * D + d, mask=m, other=0.0)
        gdc(GDC)
        h = ttgl.load(h_ptr + pid * D + d, mask=m, other=0.0).to(ttgl.float32)
        y = ttgl.load(y_ptr + Y_OFF + pid * D + d, mask=m, other=0.0).to(ttgl.bfloat16).to(ttgl.float32)
      else:
        # every load first: one round trip to memory before the reduction
        h = ttgl.load(h_ptr + pid * D + d, mask=m, other=0.0).to(ttgl.float32)
        y = ttgl.load(y_ptr + Y_OFF + pid * D + d, mask=m, other=0.0).to(ttgl.bfloat16).to(ttgl.float32)
        w = ttgl.load(w_ptr + layer * D + d, mask=m, other=0.0).to(ttgl.float32)
        if NOISE:
          w = w + ttgl.load(n_ptr + layer * D + d, mask=m, other=0.0)
      hn = (h + y).to(ttgl.bfloat16)
      ttgl.store(ho_ptr + pid * D + d, hn, mask=m)
      hf = hn.to(ttgl.float32)
      var = ttgl.sum(hf * hf, axis=0) / D
      normed = (hf * ttgl.rsqrt(var + EPS)).to(ttgl.bfloat16).to(ttgl.float32)
      ttgl.store(x_ptr + pid * D + d, (w * normed).to(ttgl.bfloat16), mask=m)
    else:
      zl: ttgl.constexpr = ttgl.BlockedLayout([ZC // (32 * WARPS)], [32], [WARPS], [0])
      z = (pid - B) * ZC + ttgl.arange(0, ZC, layout=zl)
      if GDC:
        gdc(GDC)
      ttgl.store(z_ptr + z, ttgl.zeros([ZC], ttgl.float32, layout=zl), mask=z < ZS)

  return residual_rms_norm_rows


@functools.lru_cache(maxsize=None)
def _compiled(meta: tuple, weight_dtype: str):
  """``(ptx, kernel name, shared bytes)`` for the constexprs ``meta`` and the weight's pointer dtype."""
  arg_dtypes = ("*bf16", "*fp32", weight_dtype, "*fp32", "*i32", "*bf16", "*bf16", "*fp32")
  return w4_gluon._load(w4_gluon._compile_gluon(_kernel(), arg_dtypes, dict(meta), w4_gluon._target_cc(),
                                                num_warps=WARPS))


def _meta(b: int, d: int, layers: int, y_offset: int, eps: float, noise: bool, zero_size: int) -> dict:
  """The kernel's constexprs."""
  return dict(B=b, D=d, DP=max(32 * WARPS, 1 << (d - 1).bit_length()), L=layers, Y_OFF=y_offset, EPS=float(eps),
              NOISE=int(noise), ZS=zero_size, ZC=ZERO_CHUNK, WARPS=WARPS)


def residual_rms_norm(h: jax.Array, acc: jax.Array, y_offset: int, weight: jax.Array, index, eps: float,
                      noise: jax.Array | None = None, *, zero_size: int = 0) -> tuple[jax.Array, ...]:
  """``h + y``, its RMSNorm, and optionally a zeroed float32 buffer, in one kernel launch (GPU only).

  Args:
    h: bf16 ``[B, D]``, the residual stream.
    acc: float32 1-D buffer whose elements ``[y_offset, y_offset + B * D)`` hold ``y`` ``[B, D]`` row-major
      (a decode step's accumulator region, :func:`pallas_kernels.quantized_matmul_into`, or any float32 array
      flattened).
    y_offset: static int, elements.
    weight: the norm weights' stack ``[L, D]`` (bf16 or float32), read at layer ``index``.
    index: int32 scalar (may be traced), clamped to ``[0, L)``.
    eps: the norm's epsilon (compiled in).
    noise: optional float32 ``[L, D]``: AQN noise added to the weight (QeRL Sec. 3.3), read at ``index``.
    zero_size: static int; > 0 also returns a float32 ``[zero_size]`` buffer of zeros, written by the same
      launch (the next layer's accumulator, :class:`qerl_jax.models.layers.Accumulator`).

  Returns:
    ``(h_new, x)``, both bf16 ``[B, D]``: ``h + y`` and ``RMSNorm(h + y) * (weight + noise)``, rounded as
    :func:`reference` (up to the float32 sum's order and the hardware rsqrt); with ``zero_size``
    ``(h_new, x, zeros)``.

  Raises:
    ValueError: :func:`applies` is False, ``acc`` is not a 1-D float32 buffer, the region does not fit, or
      ``zero_size`` is negative.
  """
  if not applies(h, weight, noise):
    raise ValueError(f"residual_rms_norm: no kernel for h {h.dtype}{list(h.shape)}, weight {weight.dtype}"
                     f"{list(weight.shape)}, noise {None if noise is None else list(noise.shape)} here "
                     f"(needs a GPU with the Gluon FFI launcher, bf16 h [B, D <= {MAX_DIM}], a [L, D] weight stack)")
  b, d = h.shape
  y_offset, zero_size = int(y_offset), int(zero_size)
  if acc.ndim != 1 or acc.dtype != jnp.float32:
    raise ValueError(f"residual_rms_norm: acc must be a 1-D float32 buffer, got {acc.dtype}{list(acc.shape)}")
  if y_offset < 0 or y_offset + b * d > acc.shape[0]:
    raise ValueError(f"residual_rms_norm: region [{y_offset}, {y_offset + b * d}) outside a buffer of "
                     f"{acc.shape[0]} elements")
  if zero_size < 0:
    raise ValueError(f"residual_rms_norm: zero_size must be >= 0, got {zero_size}")
  meta = _meta(b, d, weight.shape[0], y_offset, eps, noise is not None, zero_size)
  ptx, name, shared = _compiled(tuple(meta.items()), "*bf16" if weight.dtype == jnp.bfloat16 else "*fp32")
  layer = jnp.asarray(index, jnp.int32).reshape(1)
  out = jax.ShapeDtypeStruct((b, d), jnp.bfloat16)
  zeros = jax.ShapeDtypeStruct((max(zero_size, 1),), jnp.float32)
  grid = (b + -(-zero_size // ZERO_CHUNK), 1, 1)
  h_new, x, z = jax.ffi.ffi_call(w4_gluon._FFI_TARGET, (out, out, zeros))(
      h, acc, weight, jnp.zeros((1,), jnp.float32) if noise is None else noise, layer,
      **w4_gluon._launch_attrs(ptx, name, grid, shared, threads=32 * WARPS))
  return (h_new, x, z) if zero_size else (h_new, x)


__all__ = ["MAX_DIM", "ZERO_CHUNK", "applies", "available", "reference", "residual_rms_norm"]
