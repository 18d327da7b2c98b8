"""Fused 4-bit x bf16 matmul kernels on the Pallas Triton backend (W4A16).

Two kernels share one dequantize-in-registers step:

* ``forward``: ``y[M, N] = x[M, K] @ W[K, N]``;
* ``dx``: ``dx[M, K] = dy[M, N] @ W[K, N]^T`` (the backward for ``x``).

Each program owns one output tile and walks the contraction axis in steps of
``block_k`` (forward: K; dx: N). A step loads the packed weight tile
``uint8 [block_k/2, block_n]`` (forward) once, splits each byte into its two
4-bit codes, decodes them to values in registers and feeds two tensor-core dots:
byte row ``j`` holds K rows ``2j`` (low nibble) and ``2j+1`` (high nibble), so
``x @ W = x[:, 0::2] @ W_low + x[:, 1::2] @ W_high``. ``x`` is viewed as
``[M, K/2, 2]`` (a free reshape) to read its even and odd columns. No bf16 copy
of ``W`` is ever written to HBM.

Small M (decode) is covered by the same kernels with a 16-row tile and a split
of the contraction axis over ``splits`` programs (split-K), whose float32
partial sums XLA adds; large M uses 64-128-row tiles and no split.

Value decoding:

* NVFP4 (E2M1 codes, OCP MX v1.0): the 3 magnitude bits of a code placed at bit
  9 of a float16 (sign at bit 15) give ``e2m1(code) * 2**-14`` exactly (code 1,
  0.5, lands on a float16 subnormal); the ``2**14`` is folded into the E4M3
  block scale, and ``1 / global_scale`` is applied to the float32 accumulator.
  ``e2m1 * e4m3`` has at most 6 significant bits, so the bf16 weight fed to the
  tensor cores is exact.
* NF4 (QLoRA, Dettmers et al. 2023): a 4-level select tree over the 16 levels,
  times the float32 absmax of each 64-row block.

All refs are whole arrays; tiles are read with masked loads, so any M, any N
and any K that is a multiple of the format's block size work; tails are masked
(zeros are loaded for x/dy and weights outside the array).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from qerl_jax import nf4, nvfp4

_EVEN = np.int32(0)  # index of the even / odd K row in x viewed as [M, K/2, 2]
_ODD = np.int32(1)


@dataclasses.dataclass(frozen=True)
class TileConfig:
  """Tile sizes and launch parameters of one kernel call.

  Attributes:
    block_m: rows of x (or dy) per program; a power of 2, at least 16.
    block_n: output columns per program (forward) or contraction step (dx).
    block_k: contraction step (forward) or output columns per program (dx), in
      logical K rows; a power of 2 and a multiple of the format's block size.
    splits: programs sharing one output tile along the contraction axis; when
      above 1 the kernel writes float32 partial sums that XLA adds.
    num_warps, num_stages: Triton launch parameters.
    split_x: how the even/odd K columns of x (forward) or dx (dx kernel) are
      separated: ``"registers"`` loads/stores contiguous rows and splits/joins
      them in registers; ``"strided"`` reads/writes them with stride-2 accesses.
    decode: NVFP4 code decoding: ``"bits"`` (float16 bit trick in jnp ops),
      ``"asm"`` (inline PTX: 4 codes per instruction group, bf16x2 FMAs) or
      ``"e4m3"`` (forward only: inline PTX through Hopper's E4M3 -> float16
      conversion, float16 tensor-core operands; experimental, not in the tuned
      table). The inline-PTX modes are GPU only; interpret mode falls back to
      ``"bits"``.
    unroll: unroll the contraction loop at trace time (a Python loop), so the
      compiler can issue every step's loads before the first use.
    prefetch: forward kernel only: load step i+1's tiles (carried in registers)
      before decoding and multiplying step i's.
    stage: forward kernel only: where the decoded weight tile changes to the
      tensor-core operand layout. ``"codes"``: Triton moves that conversion onto
      the packed codes (shared memory read back one byte at a time, decode in
      the operand layout); ``"decoded"``: a select on the decoded bf16 tile
      keeps the conversion after the decode (each thread decodes the bytes it
      loaded, vector stores to shared memory, ``ldmatrix`` reads). Measured
      slower at M <= 32 and in a batch-64 rollout, so not in the tuned table
      (docs/benchmarks.md, session 6).
  """
  block_m: int = 16
  block_n: int = 128
  block_k: int = 128
  splits: int = 1
  num_warps: int = 4
  num_stages: int = 3
  split_x: str = "registers"
  decode: str = "bits"
  unroll: bool = False
  prefetch: bool = False
  stage: str = "codes"


@dataclasses.dataclass(frozen=True)
class _Format:
  group: int          # rows of K per block scale
  nvfp4: bool


def _format_of(w) -> _Format:
  if isinstance(w, nvfp4.NVFP4Tensor):
    return _Format(nvfp4.BLOCK_SIZE, True)
  if isinstance(w, nf4.NF4Tensor):
    return _Format(nf4.BLOCK_SIZE, False)
  raise TypeError(f"expected an NVFP4Tensor or NF4Tensor, got {type(w).__name__}")


def _global_scales(w, num: int) -> jax.Array:
  """The NVFP4 global scales as float32 ``[num]`` (one per stacked layer; ones for NF4). The
  kernels take the layer's reciprocal themselves, so a call adds no XLA op."""
  if isinstance(w, nvfp4.NVFP4Tensor):
    return w.global_scale.astype(jnp.float32).reshape(num)
  return jnp.ones((1,), jnp.float32)


# ----------------------------------------------------------------------------- decoding


_NF4 = [float(v) for v in nf4.NF4_CODEBOOK]


def _decode_nf4(codes):
  """uint8 codes in [0, 16) -> float32 NF4 levels, by a select tree on the 4 bits."""
  bits = [(codes & (1 << b)) != 0 for b in range(4)]
  level = [jnp.where(bits[0], _NF4[2 * i + 1], _NF4[2 * i]) for i in range(8)]
  for b in (1, 2, 3):
    level = [jnp.where(bits[b], level[2 * i + 1], level[2 * i]) for i in range(len(level) // 2)]
  return level[0]


# E2M1 -> bf16 by bit placement, 4 packed bytes per asm instance: the chosen
# nibble of each byte goes to bf16 bits 15 (sign) and 8..6 (2 exponent bits, 1
# mantissa bit), giving e2m1 * 2**-126 exactly (code 1 is a bf16 subnormal); one
# bf16x2 multiply by the block scale pre-multiplied by 2**118 (adding -0.0)
# finishes it, so the decoded value is e2m1 * scale * 2**-8, exact in bf16
# (at most 6 significant bits, smallest magnitude 2**-18), and the caller
# multiplies the float32 accumulator by 2**8 (_ASM_GAIN). 448 * 2**118 < 2**127
# stays below bf16's largest finite value.
# $0,$1: 4 bf16 values; $2: 4 packed bytes; $3,$4: 4 bf16 scales (times 2**118).
# One call per nibble (Pallas' lowering takes one result per inline-asm op).
def _e2m1_asm(shift_mag: int, shift_sign: int) -> str:
  lines = ["{", ".reg .b32 t0, t1, a, b, z, nz;", "mov.b32 z, 0;",
           "mov.b32 nz, 0x80008000;", "prmt.b32 t0, $2, z, 0x4140;", "prmt.b32 t1, $2, z, 0x4342;"]
  for t, out, sc in (("t0", "$0", "$3"), ("t1", "$1", "$4")):
    lines += [f"shl.b32 a, {t}, {shift_mag};", "and.b32 a, a, 0x01C001C0;",
              f"shl.b32 b, {t}, {shift_sign};", "and.b32 b, b, 0x80008000;", "or.b32 a, a, b;",
              f"fma.rn.bf16x2 {out}, a, {sc}, nz;"]
  return "\n".join(lines + ["}"])


_ASM_SCALE_BIAS = 2.0 ** 118  # folded into the block scale before the asm decode
_ASM_GAIN = 2.0 ** 8          # 2**126 / 2**118: multiplies the accumulator afterwards


def _uses_asm(fmt, decode: str, dtype) -> bool:
  return fmt.nvfp4 and decode == "asm" and jnp.dtype(dtype) == jnp.bfloat16


def _uses_e4m3(fmt, decode: str, dtype) -> bool:
  """The float16 E4M3-conversion decode applies: NVFP4, ``decode="e4m3"``, and ``x`` already
  converted to float16 by :func:`_run` (scaled by ``_F16_X_SCALE``)."""
  return fmt.nvfp4 and decode == "e4m3" and jnp.dtype(dtype) == jnp.float16


def _accumulator_gain(fmt, decode: str, dtype) -> float:
  """What the float32 accumulator is multiplied by (besides 1 / global scale) to undo the decode's
  bias: ``_ASM_GAIN`` for the asm decode, ``1 / _F16_X_SCALE`` for e4m3 (x was pre-scaled), else 1."""
  if _uses_asm(fmt, decode, dtype):
    return _ASM_GAIN
  if _uses_e4m3(fmt, decode, dtype):
    return 1.0 / _F16_X_SCALE
  return 1.0


def _asm_scales(s):
  """E4M3 block scales -> bf16 times 2**118 (exact), the scale operand of the asm decode."""
  return (s.astype(jnp.float32) * _ASM_SCALE_BIAS).astype(jnp.bfloat16)


_E2M1_ASM_LO = _e2m1_asm(6, 12)
_E2M1_ASM_HI = _e2m1_asm(2, 8)


# E2M1 -> float16 through Hopper's FP8 conversion (``decode="e4m3"``), 4 packed bytes per asm
# instance: a code's magnitude bits at bits 4..2 of a byte and its sign at bit 7 make the E4M3
# byte of e2m1(code) * 2**-6, exactly (code 1, 0.5, lands on an E4M3 subnormal);
# ``cvt.rn.f16x2.e4m3x2`` turns two such bytes into two float16 values (sm_89 and newer), and
# one f16x2 multiply by the block scale times 2**6 finishes them: e2m1 * scale, exact in float16
# (at most 6 significant bits, between 2**-10 and 6 * 448). About 15 instructions per 8 values
# against 28 for the bf16 bit placement above. x is fed to the tensor cores as float16 times
# _F16_X_SCALE.
def _e4m3_asm(low_nibble: bool) -> str:
  if low_nibble:  # magnitude bits 2..0 -> 4..2, sign bit 3 -> 7
    body = ["shl.b32 a, $2, 2;", "and.b32 a, a, 0x1C1C1C1C;", "shl.b32 b, $2, 4;", "and.b32 b, b, 0x80808080;"]
  else:           # magnitude bits 6..4 -> 4..2, sign bit 7 stays
    body = ["shr.b32 a, $2, 2;", "and.b32 a, a, 0x1C1C1C1C;", "and.b32 b, $2, 0x80808080;"]
  return "\n".join(["{", ".reg .b32 a, b, e;", ".reg .b16 e0, e1;", *body, "or.b32 e, a, b;",
                    "mov.b32 {e0, e1}, e;", "cvt.rn.f16x2.e4m3x2 $0, e0;", "cvt.rn.f16x2.e4m3x2 $1, e1;",
                    "mul.rn.f16x2 $0, $0, $3;", "mul.rn.f16x2 $1, $1, $4;", "}"])


_E4M3_ASM_LO = _e4m3_asm(True)
_E4M3_ASM_HI = _e4m3_asm(False)
# With decode="e4m3" the tensor cores multiply float16 operands. x (bf16) is scaled by 2**-4
# before its conversion, so values up to 65504 * 16 (about 1e6) stay finite; the accumulator is
# multiplied back by 2**4. Values below 2**-10 in magnitude lose relative precision as float16
# subnormals (their absolute error stays below 2**-28).
_F16_X_SCALE = 2.0 ** -4


_BITS_GAIN = 16384.0  # 2**14: what _e2m1_bits' values lack


def _e2m1_bits(p):
  """Packed uint8 codes -> (low, high) nibbles as float32 ``e2m1 * 2**-14``, exactly: the code's sign
  and magnitude bits placed in a float16 (its exponent bias is 14 more than E2M1's). Multiply by
  ``_BITS_GAIN`` (folded into the scale) for the values."""
  p16 = p.astype(jnp.uint16)
  lo = lax.bitcast_convert_type(((p16 & 7) << 9) | ((p16 & 8) << 12), jnp.float16).astype(jnp.float32)
  hi = lax.bitcast_convert_type(((p16 & 0x70) << 5) | ((p16 & 0x80) << 8), jnp.float16).astype(jnp.float32)
  return lo, hi


def _decode_tile(p, s, fmt: _Format, dtype, *, decode: str = "bits", multiplier=None):
  """Packed uint8 [R, C] and block scales [R*2/group, C] -> (low, high) values [R, C] in dtype.

  The scale here excludes the global scale (applied to the accumulator) unless
  ``multiplier`` (a float32 scalar) is given, which multiplies every value. With
  the inline-PTX decode (``_uses_asm``) the values are ``1 / _ASM_GAIN`` of the true
  ones; the caller multiplies its accumulator by ``_ASM_GAIN``.
  """
  rows, cols = p.shape
  rep = fmt.group // 2  # packed rows per block scale

  def asm_pair(scales, asms, out_dtype):
    """Both nibbles by inline PTX: 4 packed bytes and 4 of the (row-broadcast) scales per instance."""
    scales = jnp.broadcast_to(scales[:, None, :], (scales.shape[0], rep, cols)).reshape(rows, cols)
    return tuple(plgpu.elementwise_inline_asm(
        asm, args=[p, scales], constraints="=r,=r,r,r,r", pack=4,
        result_shape_dtypes=[jax.ShapeDtypeStruct(p.shape, out_dtype)])[0] for asm in asms)

  if multiplier is None and _uses_e4m3(fmt, decode, dtype):
    # 2**6 undoes the E4M3 bytes' 2**-6
    return asm_pair((s.astype(jnp.float32) * 64.0).astype(jnp.float16), (_E4M3_ASM_LO, _E4M3_ASM_HI),
                    jnp.float16)
  if multiplier is None and _uses_asm(fmt, decode, dtype):
    # else already converted by _asm_scales (a prefetched step)
    scales = s if s.dtype == jnp.bfloat16 else _asm_scales(s)
    return asm_pair(scales, (_E2M1_ASM_LO, _E2M1_ASM_HI), jnp.bfloat16)
  s = s.astype(jnp.float32)
  if multiplier is not None:
    s = s * multiplier
  s = jnp.broadcast_to(s[:, None, :], (s.shape[0], rep, cols)).reshape(rows, cols)
  if fmt.nvfp4:
    s = s * _BITS_GAIN
    lo, hi = _e2m1_bits(p)
  else:
    lo = _decode_nf4(p & 0xF)
    hi = _decode_nf4(p >> 4)
  return (lo * s).astype(dtype), (hi * s).astype(dtype)


# ----------------------------------------------------------------------------- kernels


def _fwd_load(x_ref, p_ref, s_ref, *, m0, bm, m_mask, n0, bn, n_mask, kb, bk, k, fmt: _Format,
              split_x: str, prow=0, srow=0, valid=None, asm=False):
  """Loads one K step of the fused forward: ``x_even, x_odd`` ``[bm, bk/2]``, codes ``[bk/2, bn]``
  and block scales ``[bk/group, bn]`` (already :func:`_asm_scales` when ``asm``, so that a
  prefetched step carries the converted scales); ``valid`` (a traced bool) masks the whole
  step off."""
  kp0 = kb // 2
  kp_mask = (kp0 + jnp.arange(bk // 2)) < k // 2
  ks_mask = (kb // fmt.group + jnp.arange(bk // fmt.group)) < k // fmt.group
  xk_mask = (kb + jnp.arange(bk)) < k
  if valid is not None:
    kp_mask, ks_mask, xk_mask = kp_mask & valid, ks_mask & valid, xk_mask & valid
  if split_x == "registers":
    x = plgpu.load(x_ref.at[pl.ds(m0, bm), pl.ds(kb, bk)], mask=m_mask[:, None] & xk_mask[None, :], other=0.0)
    x_even, x_odd = lax.unstack(x.reshape(bm, bk // 2, 2), axis=2)
  else:
    xm = m_mask[:, None] & kp_mask[None, :]
    x_even = plgpu.load(x_ref.at[pl.ds(m0, bm), pl.ds(kp0, bk // 2), _EVEN], mask=xm, other=0.0)
    x_odd = plgpu.load(x_ref.at[pl.ds(m0, bm), pl.ds(kp0, bk // 2), _ODD], mask=xm, other=0.0)
  p = plgpu.load(p_ref.at[pl.ds(prow + kp0, bk // 2), pl.ds(n0, bn)],
                 mask=kp_mask[:, None] & n_mask[None, :], other=0)
  s = plgpu.load(s_ref.at[pl.ds(srow + kb // fmt.group, bk // fmt.group), pl.ds(n0, bn)],
                 mask=ks_mask[:, None] & n_mask[None, :], other=0.0)
  return x_even, x_odd, p, (_asm_scales(s) if asm else s)


def _clamped_layer(idx_ref, num_layers: int):
  """The layer index ``idx_ref[0]`` clamped to ``[0, num_layers)`` (negative values give layer 0)."""
  return jnp.minimum(jnp.maximum(idx_ref[0], 0), num_layers - 1)


def _layer_rows(p_ref, gs_ref, idx_ref, k: int, fmt: _Format):
  """``(first codes row, first scales row, 1 / global scale)`` of layer ``idx_ref[0]`` (clamped to
  the stack) in the folded codes (``layer * K/2``) and scales (``layer * K/group``)."""
  layer = _clamped_layer(idx_ref, p_ref.shape[0] // (k // 2))
  gs = gs_ref[layer] if gs_ref.shape[0] > 1 else gs_ref[0]
  return layer * (k // 2), layer * (k // fmt.group), 1.0 / gs


_LORA_CHUNK = 16  # rank rows per LoRA epilogue product


def _loop(steps, body, init, unroll):
  if not unroll:
    return lax.fori_loop(0, steps, body, init)
  carry = init
  for i in range(steps):
    carry = body(i, carry)
  return carry


def _fwd_kernel(x_ref, p_ref, s_ref, gs_ref, idx_ref, *refs, m, k, n, cfg: TileConfig,
                fmt: _Format, steps: int, lora_rank: int = 0, lora_scale: float = 1.0):
  # refs: (xa, b) when lora_rank > 0, then the poisoned buffer aliased to the output when given,
  # then the output.
  o_ref = refs[-1]
  bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
  pid_n, pid_s, pid_m = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  m0 = pid_m * bm
  n0 = pid_n * bn
  m_mask = (m0 + jnp.arange(bm)) < m
  n_mask = (n0 + jnp.arange(bn)) < n
  k_begin = pid_s * (steps * bk)
  prow, srow, igs = _layer_rows(p_ref, gs_ref, idx_ref, k, fmt)
  asm = _uses_asm(fmt, cfg.decode, x_ref.dtype)
  load = functools.partial(_fwd_load, x_ref, p_ref, s_ref, m0=m0, bm=bm, m_mask=m_mask, n0=n0, bn=bn,
                           n_mask=n_mask, bk=bk, k=k, fmt=fmt, split_x=cfg.split_x, prow=prow, srow=srow,
                           asm=asm)

  def multiply(acc, x_even, x_odd, p, s):
    """Decodes one step's codes and adds its two tensor-core products to the accumulator."""
    w_lo, w_hi = _decode_tile(p, s, fmt, x_even.dtype, decode=cfg.decode)
    if cfg.stage == "decoded":  # Triton does not move an operand's layout conversion above a select
      w_lo, w_hi = (jnp.where(n_mask[None, :], w, jnp.zeros_like(w)) for w in (w_lo, w_hi))
    acc += jnp.dot(x_even, w_lo, preferred_element_type=jnp.float32)
    return acc + jnp.dot(x_odd, w_hi, preferred_element_type=jnp.float32)

  def body(i, acc):
    return multiply(acc, *load(kb=k_begin + i * bk))

  def prefetch_body(i, carry):
    # Issue step i+1's loads before step i's decode and dots use the tiles loaded
    # one iteration earlier, so memory latency overlaps compute.
    nxt = load(kb=k_begin + (i + 1) * bk, valid=i + 1 < steps)
    return (multiply(*carry), *nxt)

  zeros = jnp.zeros((bm, bn), jnp.float32)
  if cfg.prefetch:
    acc = _loop(steps, prefetch_body, (zeros, *load(kb=k_begin)), cfg.unroll)[0]
  else:
    acc = _loop(steps, body, zeros, cfg.unroll)
  acc = acc * (igs * _accumulator_gain(fmt, cfg.decode, x_ref.dtype))
  if lora_rank:  # LoRA epilogue: + scale * xa[m-tile] @ B[:, n-tile], spread over the splits
    xa_ref, b_ref = refs[0], refs[1]  # b: [R, N], or a stack folded to [L * R, N] (layer idx_ref[0])
    b_layers = b_ref.shape[0] // lora_rank
    brow = 0 if b_layers == 1 else _clamped_layer(idx_ref, b_layers) * lora_rank
    # The rank is cut into chunks of 16 (the smallest tensor-core K) dealt round-robin to the split-K
    # programs, whose partial sums XLA adds anyway: no split carries the whole product (one that did
    # set the kernel's tail: 9.6 -> 12.9 us for the 7B q/k/v at M = 8, rank 96).
    chunks = -(-lora_rank // _LORA_CHUNK)
    for j in range(-(-chunks // cfg.splits)):
      r0 = (pid_s + j * cfg.splits) * _LORA_CHUNK
      r_mask = (r0 + jnp.arange(_LORA_CHUNK)) < lora_rank  # all off past the last chunk
      xa = plgpu.load(xa_ref.at[pl.ds(m0, bm), pl.ds(r0, _LORA_CHUNK)], mask=m_mask[:, None] & r_mask[None, :],
                      other=0.0)
      bt = plgpu.load(b_ref.at[pl.ds(brow + r0, _LORA_CHUNK), pl.ds(n0, bn)],
                      mask=r_mask[:, None] & n_mask[None, :], other=0.0)
      acc += lora_scale * jnp.dot(xa, bt, preferred_element_type=jnp.float32)
  out_mask = m_mask[:, None] & n_mask[None, :]
  if cfg.splits == 1:
    plgpu.store(o_ref.at[pl.ds(m0, bm), pl.ds(n0, bn)], acc.astype(o_ref.dtype), mask=out_mask)
  else:
    plgpu.store(o_ref.at[pid_s, pl.ds(m0, bm), pl.ds(n0, bn)], acc, mask=out_mask)


def _dx_kernel(dy_ref, p_ref, s_ref, gs_ref, idx_ref, *refs, m, k, n, cfg: TileConfig,
               fmt: _Format, steps: int):
  o_ref = refs[-1]
  bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
  pid_k, pid_s, pid_m = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  m0 = pid_m * bm
  kp0 = pid_k * (bk // 2)
  m_mask = (m0 + jnp.arange(bm)) < m
  kp_mask = (kp0 + jnp.arange(bk // 2)) < k // 2
  ks_mask = (pid_k * (bk // fmt.group) + jnp.arange(bk // fmt.group)) < k // fmt.group
  n_begin = pid_s * (steps * bn)
  prow, srow, igs = _layer_rows(p_ref, gs_ref, idx_ref, k, fmt)
  dims = (((1,), (1,)), ((), ()))  # contract dy's N with the weight tile's N

  def body(i, carry):
    acc_e, acc_o = carry
    n0 = n_begin + i * bn
    n_mask = (n0 + jnp.arange(bn)) < n
    dy = plgpu.load(dy_ref.at[pl.ds(m0, bm), pl.ds(n0, bn)],
                    mask=m_mask[:, None] & n_mask[None, :], other=0.0)
    p = plgpu.load(p_ref.at[pl.ds(prow + kp0, bk // 2), pl.ds(n0, bn)],
                   mask=kp_mask[:, None] & n_mask[None, :], other=0)
    s = plgpu.load(s_ref.at[pl.ds(srow + pid_k * (bk // fmt.group), bk // fmt.group), pl.ds(n0, bn)],
                   mask=ks_mask[:, None] & n_mask[None, :], other=0.0)
    w_lo, w_hi = _decode_tile(p, s, fmt, dy.dtype, decode=cfg.decode)
    acc_e += lax.dot_general(dy, w_lo, dims, preferred_element_type=jnp.float32)
    acc_o += lax.dot_general(dy, w_hi, dims, preferred_element_type=jnp.float32)
    return acc_e, acc_o

  zeros = jnp.zeros((bm, bk // 2), jnp.float32)
  acc_e, acc_o = _loop(steps, body, (zeros, zeros), cfg.unroll)
  igs = igs * _accumulator_gain(fmt, cfg.decode, dy_ref.dtype)
  out_mask = m_mask[:, None] & kp_mask[None, :]
  lead = () if cfg.splits == 1 else (pid_s,)  # split partials: o_ref is [splits, M, ...]
  acc_e = (acc_e * igs).astype(o_ref.dtype)
  acc_o = (acc_o * igs).astype(o_ref.dtype)
  if cfg.split_x == "registers":  # [M, K]: interleave in registers, store whole rows
    full_mask = m_mask[:, None] & ((pid_k * bk + jnp.arange(bk)) < k)[None, :]
    out = jnp.stack([acc_e, acc_o], axis=-1).reshape(bm, bk)
    plgpu.store(o_ref.at[(*lead, pl.ds(m0, bm), pl.ds(pid_k * bk, bk))], out, mask=full_mask)
  else:  # [M, K/2, 2]
    plgpu.store(o_ref.at[(*lead, pl.ds(m0, bm), pl.ds(kp0, bk // 2), _EVEN)], acc_e, mask=out_mask)
    plgpu.store(o_ref.at[(*lead, pl.ds(m0, bm), pl.ds(kp0, bk // 2), _ODD)], acc_o, mask=out_mask)


# ----------------------------------------------------------------------------- configs


# Per kind and M bucket (largest M it covers; None: any larger M):
# (block_m, block_n, block_k, num_warps, num_stages, target_programs, split_x, decode[, prefetch[, stage]]).
# target_programs > 0 turns on split-K (split-N for dx) until about that many
# programs run; 0 never splits. Chosen by `experiments/bench_kernels.py --sweep`
# on an H200 (see docs/benchmarks.md); the M <= 32 rows were then changed to
# block_k 128, twice the programs and prefetch, which measured 9-27% less device
# time on 3 of 4 7B shapes at M = 1, 8, 32 (docs/benchmarks.md, "session 2"). Session 3 (after the
# asm decode's scale fold): experiments/lab/sweep_small_m.py picked block_k 64, about 1056 programs,
# no prefetch for M <= 32 (summed over the four 7B shapes at M = 8: 94.1 -> 82.8 us; M = 32: 125.6 ->
# 117.7 us) and block_n 64 with prefetch for M <= 64, where the fused kernel now runs instead of
# dequantize + cuBLAS (151 vs 255 us at M = 64, experiments/lab/fused_mid_m.py). Session 6
# (experiments/lab/time_stage.py): stage="decoded" took 148.0 vs 150.9 us at M = 64 alone (summed
# over the four 7B shapes) but 10-30% longer at M <= 32, and in a batch-64 rollout the fused
# gate/up kernel took 93.2 instead of 90.1 us with it, so no bucket uses it.
TUNED: dict = {
    ("fwd", 16): (16, 128, 64, 4, 3, 1056, "registers", "asm", False),
    ("fwd", 32): (32, 128, 64, 4, 3, 1056, "registers", "asm", False),
    ("fwd", 64): (64, 64, 128, 4, 3, 1056, "registers", "asm", True),
    ("fwd", 128): (64, 128, 128, 4, 3, 264, "registers", "bits"),
    ("fwd", 256): (128, 128, 128, 8, 3, 0, "registers", "bits"),
    ("fwd", None): (128, 128, 64, 4, 4, 0, "registers", "bits"),
    ("dx", 64): (32, 128, 128, 4, 4, 264, "registers", "asm"),
    ("dx", None): (128, 64, 128, 4, 4, 0, "registers", "bits"),
}


def default_config(m: int, k: int, n: int, *, kind: str = "fwd", group: int = 16,
                   table: dict | None = None) -> TileConfig:
  """Tile sizes for an ``[m, k] x [k, n]`` problem, from the tuned table.

  Args:
    m, k, n: the logical matmul sizes (for ``kind="dx"``: dy is ``[m, n]``,
      dx is ``[m, k]``).
    kind: ``"fwd"`` or ``"dx"``.
    group: the format's block-scale group size (16 NVFP4, 64 NF4); block_k is
      raised to a multiple of it.
    table: a table shaped like :data:`TUNED` (default :data:`TUNED`).

  Returns:
    a :class:`TileConfig`; ``splits`` is set so that about ``target_programs``
    programs run, at most 32, each with at least two contraction steps, and the
    float32 partials (written and read once) stay under half the 4-bit
    weight's bytes.
  """
  table = TUNED if table is None else table
  buckets = sorted((b for (kd, b) in table if kd == kind and b is not None))
  bucket = next((b for b in buckets if m <= b), None)
  bm, bn, bk, warps, stages, target, split_x, decode, *rest = table[(kind, bucket)]
  prefetch = bool(rest[0]) if rest else False
  stage = rest[1] if len(rest) > 1 else "codes"
  bk = max(bk, group)
  if kind == "fwd":
    out_tiles = -(-m // bm) * -(-n // bn)
    contraction, step, n_out = k, bk, n
  else:
    out_tiles = -(-m // bm) * -(-k // bk)
    contraction, step, n_out = n, bn, k
  splits = 1
  if target and out_tiles < target:
    # Above M = 64, cap the float32 partials' traffic (written and read back) at half the weight's
    # bytes; at M <= 64 the sweeps measured the uncapped split counts (partials are small there).
    max_by_bytes = int((k * n / 2) * 0.5 / (m * n_out * 8)) if m > 64 else 32
    splits = max(1, min(-(-target // out_tiles), contraction // (2 * step), max_by_bytes, 32))
  return TileConfig(bm, bn, bk, splits, warps, stages, split_x, decode, prefetch=prefetch and kind == "fwd",
                    stage=stage if kind == "fwd" else "codes")


# ----------------------------------------------------------------------------- calls


def _check_stacking(w, index, what: str):
  """One ``[K, N]`` matrix without ``index``, a stack ``[L, K, N]`` with it; else ValueError."""
  if w.packed.ndim != (2 if index is None else 3):
    need = "one [K, N] matrix" if index is None else "a stack [L, K, N] (index given)"
    raise ValueError(f"{what} needs {need}, got packed shape {w.packed.shape}")


def _check(x, w, fmt: _Format, cfg: TileConfig, index=None):
  _check_stacking(w, index, "kernel path")
  for name in ("block_m", "block_n", "block_k"):
    v = getattr(cfg, name)
    if v & (v - 1) or v < 16:
      raise ValueError(f"TileConfig.{name} must be a power of 2 >= 16, got {v}")
  if cfg.block_k % fmt.group:
    raise ValueError(f"TileConfig.block_k={cfg.block_k} must be a multiple of the block size {fmt.group}")
  if cfg.decode not in ("bits", "asm", "e4m3"):
    raise ValueError(f"TileConfig.decode must be 'bits', 'asm' or 'e4m3', got {cfg.decode!r}")
  if cfg.stage not in ("codes", "decoded"):
    raise ValueError(f"TileConfig.stage must be 'codes' or 'decoded', got {cfg.stage!r}")
  if x.ndim != 2:
    raise ValueError(f"expected a 2-D operand, got shape {x.shape}")


def _call(kernel, grid, out_shape, num_warps, num_stages, interpret, name, poison, *args):
  """``pl.pallas_call`` of ``kernel`` on ``args`` (the backend's deprecation warning silenced); with
  ``poison`` the output starts NaN-filled, so that unwritten elements show."""
  aliases = {}
  if poison:  # start from a NaN-filled output buffer so that unwritten elements show
    args = args + (jnp.full(out_shape.shape, jnp.nan, out_shape.dtype),)
    aliases = {len(args) - 1: 0}
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=name,
        input_output_aliases=aliases,
    )(*args)


def forward(x: jax.Array, w, *, out_dtype=None, config: TileConfig | None = None,
            interpret: bool = False, poison_output: bool = False, index=None, lora=None) -> jax.Array:
  """``x @ W`` (``+ scale * xa @ B`` with ``lora``) by the fused kernel.

  Args:
    x: bf16 (or float16) ``[M, K]``.
    w: NVFP4Tensor or NF4Tensor ``[K, N]`` without leading dims, or a stack
      ``[L, K, N]`` (one leading dim) when ``index`` is given.
    out_dtype: output dtype (default ``x.dtype``); accumulation is float32.
    config: tile sizes (default :func:`default_config`).
    interpret: run in Pallas interpret mode (CPU tests).
    poison_output: fill the output buffer with NaN before the kernel runs
      (tests: an element the kernel misses stays NaN).
    index: optional int32 scalar: multiply by layer ``index`` of a stacked
      ``w`` read in place (no slice of the stack is copied; used inside the
      decoder's layer scan). Out-of-range values are clamped to [0, L).
    lora: optional ``(xa, b, scale)``: the LoRA down-projection ``xa = x @ A``
      ``[M, R]``, the up-projection ``b`` ``[R, N]`` (both in x's dtype; with
      ``index``, ``b`` may be a stack ``[L, R, N]`` read in place at layer
      ``index``, clamped) and a static float ``scale``; the kernel's epilogue
      adds ``scale * xa @ b`` to each output tile (LoRA, Hu et al. 2021), after
      the weight scales.

  Returns:
    ``[M, N]`` in ``out_dtype``.

  Raises:
    TypeError: unsupported weight type. ValueError: shape mismatch or bad config.
  """
  return _run("fwd", x, w, out_dtype, config, interpret, poison_output, index, lora)


def dx(dy: jax.Array, w, *, out_dtype=None, config: TileConfig | None = None,
       interpret: bool = False, poison_output: bool = False, index=None) -> jax.Array:
  """``dy @ W^T`` by the fused kernel (the gradient of ``x @ W`` for ``x``).

  Args:
    dy: bf16 (or float16) ``[M, N]``.
    w: NVFP4Tensor or NF4Tensor ``[K, N]`` without leading dims, or a stack
      ``[L, K, N]`` when ``index`` is given.
    out_dtype: output dtype (default ``dy.dtype``); accumulation is float32.
    config: tile sizes (default :func:`default_config` with ``kind="dx"``).
    interpret: run in Pallas interpret mode (CPU tests).
    poison_output: fill the output buffer with NaN before the kernel runs
      (tests: an element the kernel misses stays NaN).
    index: optional int32 scalar: layer of a stacked ``w`` (see :func:`forward`).

  Returns:
    ``[M, K]`` in ``out_dtype``.

  Raises:
    TypeError: unsupported weight type. ValueError: shape mismatch or bad config.
  """
  return _run("dx", dy, w, out_dtype, config, interpret, poison_output, index)


def _layer_operands(w, fmt: _Format, index):
  """Codes and block scales (2-D, layers folded into rows: free reshapes), the global scales
  (float32 ``[L]`` or ``[1]``) and the layer ``[1]`` (int32, clamped in the kernel): no XLA
  arithmetic per call (a decode step calls this 4-7 times per layer)."""
  k, n = w.shape
  if index is None:
    return w.packed, w.block_scale, _global_scales(w, 1), jnp.zeros((1,), jnp.int32)
  num = w.packed.shape[0]
  return (w.packed.reshape(num * (k // 2), n), w.block_scale.reshape(num * (k // fmt.group), n),
          _global_scales(w, num), jnp.asarray(index, jnp.int32).reshape(1))


def clamp_layer(index, num_layers: int) -> jax.Array:
  """``index`` (int32 scalar or one-element array, traced or not) clamped to ``[0, num_layers)`` as the
  kernels clamp it (``lax.dynamic_index_in_dim`` alone would wrap a negative index to the end)."""
  return jnp.clip(jnp.asarray(index, jnp.int32).reshape(()), 0, num_layers - 1)


def layer_slice(stack, index):
  """Layer ``index`` (clamped, :func:`clamp_layer`) of ``stack``: an array or a pytree (a stacked
  4-bit tensor) whose every leaf has the layer as its leading dim. An XLA dynamic slice (a copy on a
  GPU, where the kernels read a layer in place instead)."""
  layer = clamp_layer(index, jax.tree.leaves(stack)[0].shape[0])
  return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, layer, 0, keepdims=False), stack)


def _standard_codes(w, index):
  """``(w, index)`` with NVFP4 codes in the standard order these kernels read. A weight in
  :func:`qerl_jax.nvfp4.to_decode_order`'s order is converted by XLA (one pass over its codes); of a
  stack with ``index``, only that layer (clamped, as the kernels clamp it), which is then read as one
  matrix (``index`` None)."""
  if not (isinstance(w, nvfp4.NVFP4Tensor) and w.code_order == "decode"):
    return w, index
  if index is not None and w.packed.ndim == 3:
    w, index = layer_slice(w, index), None
  return nvfp4.to_standard_order(w), index


def _run(kind, a, w, out_dtype, config, interpret, poison_output, index=None, lora=None):
  """Shared launch of the fused kernels; ``a`` is x ``[M, K]`` (fwd) or dy ``[M, N]`` (dx)."""
  fwd = kind == "fwd"
  layer = index
  w, index = _standard_codes(w, index)
  if lora is not None and index is None and layer is not None and lora[1].ndim == 3:  # that layer of b too
    xa, b, scale = lora
    lora = (xa, layer_slice(b, layer), scale)
  fmt = _format_of(w)
  k, n = w.shape
  m = a.shape[0]
  if a.shape[-1] != (k if fwd else n):
    name, dim = ("x", "K") if fwd else ("dy", "N")
    raise ValueError(f"{kind}: {name} has {dim}={a.shape[-1]} (shape {a.shape}) but the weight is [{k}, {n}]")
  cfg = config or default_config(m, k, n, kind=kind, group=fmt.group)
  _check(a, w, fmt, cfg, index)
  if cfg.decode == "e4m3" and not fwd:
    raise ValueError("TileConfig.decode='e4m3' is for the forward kernel only; use 'asm' or 'bits' for dx")
  out_dtype = jnp.dtype(out_dtype or a.dtype)
  if cfg.decode == "e4m3" and not interpret and fmt.nvfp4 and a.dtype == jnp.bfloat16:
    a = (a.astype(jnp.float32) * _F16_X_SCALE).astype(jnp.float16)  # float16 tensor-core operands
  if interpret:
    cfg = dataclasses.replace(cfg, decode="bits")
  contraction, step = (k, cfg.block_k) if fwd else (n, cfg.block_n)
  total_steps = -(-contraction // step)
  steps = -(-total_steps // cfg.splits)
  splits = -(-total_steps // steps)
  cfg = dataclasses.replace(cfg, splits=splits)
  registers = cfg.split_x == "registers"
  if fwd:
    grid = (-(-n // cfg.block_n), splits, -(-m // cfg.block_m))
    tail = (n,)
    operand = a if registers else a.reshape(m, k // 2, 2)
  else:
    grid = (-(-k // cfg.block_k), splits, -(-m // cfg.block_m))
    tail = (k,) if registers else (k // 2, 2)
    operand = a
  if splits == 1:
    out_shape = jax.ShapeDtypeStruct((m, *tail), out_dtype)
  else:
    out_shape = jax.ShapeDtypeStruct((splits, m, *tail), jnp.float32)
  extra, lora_kw = (), {}
  if lora is not None:
    xa, b, scale = lora
    b_ok = b.ndim == 2 or (b.ndim == 3 and index is not None)
    if not fwd or xa.ndim != 2 or not b_ok or xa.shape[0] != m or b.shape[-2:] != (xa.shape[1], n):
      raise ValueError(f"{kind}: lora must be (xa [M={m}, R], b [R, N={n}] or with index [L, R, N], scale) for "
                       f"the forward kernel; got xa {getattr(xa, 'shape', None)}, b {getattr(b, 'shape', None)}")
    b = b.reshape(-1, n)  # a stack [L, R, N] folds to [L * R, N] (free); the kernel offsets by layer * R
    extra = (xa.astype(jnp.bfloat16), b.astype(jnp.bfloat16))  # bf16 x bf16 -> float32 in the epilogue
    lora_kw = dict(lora_rank=int(xa.shape[1]), lora_scale=float(scale))
  kernel = functools.partial(_fwd_kernel if fwd else _dx_kernel, m=m, k=k, n=n, cfg=cfg, fmt=fmt,
                             steps=steps, **lora_kw)
  out = _call(kernel, grid, out_shape, cfg.num_warps, cfg.num_stages, interpret, f"w4a16_{kind}", poison_output,
              operand, *_layer_operands(w, fmt, index), *extra)
  if splits > 1:
    out = out.sum(axis=0).astype(out_dtype)
  return out.reshape(m, n if fwd else k)


# ----------------------------------------------------------------------------- dequantize


def _dequant_kernel(p_ref, s_ref, gs_ref, idx_ref, o_ref, *, k, n, bkp, bn, fmt: _Format):
  pid_k, pid_n = pl.program_id(0), pl.program_id(1)
  prow, srow, igs = _layer_rows(p_ref, gs_ref, idx_ref, k, fmt)
  kp0, n0 = pid_k * bkp, pid_n * bn
  kp_mask = (kp0 + jnp.arange(bkp)) < k // 2
  ks_mask = (pid_k * (2 * bkp // fmt.group) + jnp.arange(2 * bkp // fmt.group)) < k // fmt.group
  n_mask = (n0 + jnp.arange(bn)) < n
  p = plgpu.load(p_ref.at[pl.ds(prow + kp0, bkp), pl.ds(n0, bn)], mask=kp_mask[:, None] & n_mask[None, :], other=0)
  s = plgpu.load(s_ref.at[pl.ds(srow + pid_k * (2 * bkp // fmt.group), 2 * bkp // fmt.group), pl.ds(n0, bn)],
                 mask=ks_mask[:, None] & n_mask[None, :], other=0.0)
  lo, hi = _decode_tile(p, s, fmt, o_ref.dtype, multiplier=igs)
  mask = kp_mask[:, None] & n_mask[None, :]
  plgpu.store(o_ref.at[pl.ds(kp0, bkp), _EVEN, pl.ds(n0, bn)], lo, mask=mask)
  plgpu.store(o_ref.at[pl.ds(kp0, bkp), _ODD, pl.ds(n0, bn)], hi, mask=mask)


# (block_k2, block_n, num_warps) of the dequantize kernel, tuned on an H200.
DEQUANT_CONFIG = (32, 256, 4)
# the same for codes in decode order, read in place (experiments/lab/dequant_sweep.py, session 31: 52.1 µs at the 7B
# gate matrix and 108.9 at the 32B down against 56-59 and 117-123 with DEQUANT_CONFIG; bit-exact, 18 configs)
DEQUANT_DECODE_ORDER_CONFIG = (16, 256, 8)


_STANDARD_OF_DECODE = np.argsort(nvfp4.DECODE_ORDER_BITS)  # decode-order block word bit -> standard bit
# Dequantize a decode-order weight in place (:func:`_dequant_decode_order_kernel`) instead of
# converting its layer's codes back with XLA first (about 0.7 TB/s), which made a 7B M = 2048 forward
# 18-22% slower. Read in place it is as fast as the standard order's kernel: M = 2048 forward and dx
# within -2.2% .. +0.5% of the standard order, 7B shapes (docs/benchmarks.md, session 17). False
# restores the conversion.
DEQUANT_DECODE_ORDER_IN_PLACE = True


def _dequant_decode_order_kernel(p_ref, s_ref, gs_ref, idx_ref, o_ref, *, k, n, bkp, bn):
  """:func:`_dequant_kernel` for NVFP4 codes in decode order (``nvfp4.to_decode_order``), read in
  place. ``p_ref`` is the codes viewed as ``[L*K/4, 2, N/2, 2]`` (a free reshape: code-row pair, its
  parity, column pair, its parity), so four byte loads give each block's word (code rows 2i, 2i+1 x
  columns 2c, 2c+1); the word is put back into the standard bit order in registers. ``s_ref`` is the scales ``[L*K/16, N/2, 2]``;
  ``o_ref`` is ``[K/4, 2, 2, N/2, 2]`` = ``[K, N]`` (code row parity, nibble, column pair, column parity)."""
  pid_k, pid_n = pl.program_id(0), pl.program_id(1)
  layer = _clamped_layer(idx_ref, p_ref.shape[0] // (k // 4))
  igs = 1.0 / (gs_ref[layer] if gs_ref.shape[0] > 1 else gs_ref[0])
  hr, hc = bkp // 2, bn // 2  # block rows (code-row pairs) and block columns (column pairs) of the tile
  i0, j0 = pid_k * hr, pid_n * hc
  row_mask = (i0 + jnp.arange(hr)) < k // 4
  col_mask = (j0 + jnp.arange(hc)) < n // 2
  mask = row_mask[:, None] & col_mask[None, :]
  prow = layer * (k // 4) + i0
  word = jnp.zeros((hr, hc), jnp.uint32)
  for r in (0, 1):
    for c in (0, 1):  # byte 2r + c of the block word
      byte = plgpu.load(p_ref.at[pl.ds(prow, hr), np.int32(r), pl.ds(j0, hc), np.int32(c)], mask=mask, other=0)
      word = word | (byte.astype(jnp.uint32) << (8 * (2 * r + c)))
  std = nvfp4.permute_word_bits(word, _STANDARD_OF_DECODE)
  ns = hr // 4  # scale rows of the tile: 4 code-row pairs (16 rows of K) a block scale
  srow = layer * (k // 16) + pid_k * ns
  s_mask = ((pid_k * ns + jnp.arange(ns)) < k // 16)[:, None] & col_mask[None, :]
  scales = []
  for c in (0, 1):
    s = plgpu.load(s_ref.at[pl.ds(srow, ns), pl.ds(j0, hc), np.int32(c)], mask=s_mask, other=0.0)
    s = s.astype(jnp.float32) * igs * _BITS_GAIN
    scales.append(jnp.broadcast_to(s[:, None, :], (ns, 4, hc)).reshape(hr, hc))
  for r in (0, 1):
    vals = {_EVEN: [], _ODD: []}
    for c in (0, 1):
      lo, hi = _e2m1_bits((std >> (8 * (2 * r + c))) & 0xFF)
      vals[_EVEN].append((lo * scales[c]).astype(o_ref.dtype))
      vals[_ODD].append((hi * scales[c]).astype(o_ref.dtype))
    for nib, (v0, v1) in vals.items():  # columns 2c, 2c + 1 side by side: one contiguous store
      plgpu.store(o_ref.at[pl.ds(i0, hr), np.int32(r), nib, pl.ds(j0, hc), :], jnp.stack([v0, v1], axis=-1),
                  mask=mask[:, :, None])


def dequantize(w, dtype=jnp.bfloat16, *, block_k2: int | None = None, block_n: int | None = None,
               num_warps: int | None = None, interpret: bool = False, index=None) -> jax.Array:
  """Dequantizes a 4-bit weight to ``dtype`` ``[K, N]`` in one pass (a Pallas kernel).

  Reads the packed codes and scales once and writes the dense weight once; the
  large-M path feeds the result to XLA's (cuBLAS) matmul. Values equal
  :func:`qerl_jax.nvfp4.dequantize` / :func:`qerl_jax.nf4.dequantize` up to the
  final rounding to ``dtype`` (``e2m1 * (s * 2**14 * (1/gs))`` vs
  ``e2m1 * (s / gs)`` in float32).

  Args:
    w: NVFP4Tensor or NF4Tensor ``[K, N]`` without leading dims.
    dtype: output dtype (bf16 or float32).
    block_k2: packed rows (K/2) per program; a power of 2 and a multiple of
      group/2 (default from :data:`DEQUANT_CONFIG`, or :data:`DEQUANT_DECODE_ORDER_CONFIG` for codes in
      decode order read in place).
    block_n: columns per program (power of 2).
    num_warps: Triton launch parameter.
    interpret: Pallas interpret mode (CPU tests).
    index: optional int32 scalar: dequantize layer ``index`` of a stacked
      ``w`` ``[L, K, N]`` in place (see :func:`forward`).

  Raises:
    TypeError: unsupported weight type. ValueError: stacked weight without
      ``index`` (or an index for an unstacked one).
  """
  fmt = _format_of(w)
  _check_stacking(w, index, "dequantize kernel")
  k, n = w.shape
  in_place = getattr(w, "code_order", "standard") == "decode" and DEQUANT_DECODE_ORDER_IN_PLACE
  config = DEQUANT_DECODE_ORDER_CONFIG if in_place else DEQUANT_CONFIG
  block_k2 = block_k2 or config[0]
  block_n = block_n or config[1]
  num_warps = num_warps or config[2]
  bkp = max(block_k2, fmt.group // 2)
  if in_place:  # read in place, no conversion pass
    return _dequantize_decode_order(w, dtype, max(bkp, 16), block_n, num_warps, interpret, index)
  if getattr(w, "code_order", "standard") == "decode":
    w, index = _standard_codes(w, index)
  kernel = functools.partial(_dequant_kernel, k=k, n=n, bkp=bkp, bn=block_n, fmt=fmt)
  out = _call(kernel, (-(-(k // 2) // bkp), -(-n // block_n)), jax.ShapeDtypeStruct((k // 2, 2, n), dtype),
              num_warps, 1, interpret, "w4_dequantize", False, *_layer_operands(w, fmt, index))
  return out.reshape(k, n)


def _dequantize_decode_order(w, dtype, bkp: int, bn: int, num_warps: int, interpret: bool, index):
  """:func:`dequantize` of a decode-order NVFP4 weight: the codes and scales viewed as code-row and
  column pairs (free reshapes, no copy: a uint16 bitcast would be one in XLA),
  :func:`_dequant_decode_order_kernel`."""
  k, n = w.shape
  packed, scales, gs, idx = _layer_operands(w, _format_of(w), index)
  rows = packed.shape[0]
  pairs = packed.reshape(rows // 2, 2, n // 2, 2)  # [L*K/4, 2, N/2, 2]
  kernel = functools.partial(_dequant_decode_order_kernel, k=k, n=n, bkp=bkp, bn=bn)
  out = _call(kernel, (-(-(k // 4) // (bkp // 2)), -(-(n // 2) // (bn // 2))),
              jax.ShapeDtypeStruct((k // 4, 2, 2, n // 2, 2), dtype), num_warps, 1, interpret,
              "w4_dequantize_decode_order", False, pairs, scales.reshape(scales.shape[0], n // 2, 2), gs, idx)
  return out.reshape(k, n)
