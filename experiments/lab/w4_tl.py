"""Lab: a plain Triton W4A16 kernel (for experiments/lab/triton_lab.py; not part of the library).

Same packed layout as qerl_jax.nvfp4 (codes uint8 [K/2, N], E4M3 block scales as uint8 [K/16, N],
1/global scale float32 [1]). E2M1 codes are decoded with the float16 bit trick (e2m1 * 2**-14).
"""

import triton
import triton.language as tl


@triton.jit
def _nibbles_f16(p):
  """uint8 [R, C] -> (low, high) float16 of e2m1 * 2**-14 (exact; code 1 is a float16 subnormal)."""
  p = p.to(tl.uint16)
  lo = ((p & 7) << 9) | ((p & 8) << 12)
  hi = ((p & 0x70) << 5) | ((p & 0x80) << 8)
  return lo.to(tl.float16, bitcast=True), hi.to(tl.float16, bitcast=True)


@triton.jit
def w4_fwd_kernel(x_ptr, p_ptr, s_ptr, igs_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr,
                  GEMV: tl.constexpr, SCALE_GATHER: tl.constexpr, STEPS: tl.constexpr, UNROLL: tl.constexpr):
  """y[M, N] (+)= x[M, K] @ W[K, N]; W as packed uint8 [K/2, N], E4M3 scales (as uint8) [K/16, N].

  SPLIT_K > 1: programs along axis 1 each take STEPS steps of BK and atomically add float32.
  GEMV: BM == 1 path without tensor cores (elementwise FMAs, reduced once at the end).
  """
  pid_n = tl.program_id(0)
  pid_k = tl.program_id(1)
  pid_m = tl.program_id(2)
  offs_n = pid_n * BN + tl.arange(0, BN)
  n_mask = offs_n < N
  offs_m = pid_m * BM + tl.arange(0, BM)
  m_mask = offs_m < M
  rows = tl.arange(0, BK // 2)
  if GEMV:
    acc2 = tl.zeros((BK // 2, BN), tl.float32)
  else:
    acc = tl.zeros((BM, BN), tl.float32)
  k_begin = pid_k * STEPS * BK
  for i in tl.range(0, STEPS, loop_unroll_factor=UNROLL):
    kb = k_begin + i * BK
    kp = kb // 2 + rows
    kp_mask = kp < K // 2
    p = tl.load(p_ptr + kp[:, None] * N + offs_n[None, :], mask=kp_mask[:, None] & n_mask[None, :], other=0)
    if SCALE_GATHER:
      s = tl.load(s_ptr + (kp // 8)[:, None] * N + offs_n[None, :], mask=kp_mask[:, None] & n_mask[None, :], other=0)
      s = s.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
      ks = kb // 16 + tl.arange(0, BK // 16)
      s = tl.load(s_ptr + ks[:, None] * N + offs_n[None, :], mask=(ks < K // 16)[:, None] & n_mask[None, :], other=0)
      s = s.to(tl.float8e4nv, bitcast=True).to(tl.float32)
      s = tl.reshape(tl.broadcast_to(s[:, None, :], (BK // 16, 8, BN)), (BK // 2, BN))
    lo, hi = _nibbles_f16(p)
    if GEMV:
      xe = tl.load(x_ptr + 2 * kp, mask=kp_mask, other=0.0).to(tl.float32)
      xo = tl.load(x_ptr + 2 * kp + 1, mask=kp_mask, other=0.0).to(tl.float32)
      acc2 += s * (xe[:, None] * lo.to(tl.float32) + xo[:, None] * hi.to(tl.float32))
    else:
      w_lo = (lo.to(tl.float32) * s).to(tl.bfloat16)
      w_hi = (hi.to(tl.float32) * s).to(tl.bfloat16)
      xm = m_mask[:, None] & kp_mask[None, :]
      xe = tl.load(x_ptr + offs_m[:, None] * stride_xm + 2 * kp[None, :], mask=xm, other=0.0)
      xo = tl.load(x_ptr + offs_m[:, None] * stride_xm + 2 * kp[None, :] + 1, mask=xm, other=0.0)
      acc = tl.dot(xe, w_lo, acc)
      acc = tl.dot(xo, w_hi, acc)
  igs = tl.load(igs_ptr) * 16384.0
  if GEMV:
    out = tl.sum(acc2, axis=0) * igs
    if SPLIT_K > 1:
      tl.atomic_add(y_ptr + offs_n, out, mask=n_mask, sem="relaxed")
    else:
      tl.store(y_ptr + offs_n, out.to(y_ptr.dtype.element_ty), mask=n_mask)
  else:
    out = acc * igs
    ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    if SPLIT_K > 1:
      tl.atomic_add(ptrs, out, mask=m_mask[:, None] & n_mask[None, :], sem="relaxed")
    else:
      tl.store(ptrs, out.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])
