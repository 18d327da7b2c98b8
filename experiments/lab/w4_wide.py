"""Lab: the small-M W4A16 forward with the codes read as 32-bit words (4 columns of one K-pair row),
to test whether the library kernel loses its time to byte-wise shared-memory reads.

Session 5's SASS of the tuned M = 8 kernel: Triton converts the uint8 code tile to the tensor-core
operand layout through shared memory and reads it back one byte at a time (40 ``LDS.U8`` per thread
and K step, plus ``PRMT`` to pack them). Here the same ``[K/2, N]`` codes are viewed as uint32
``[K/2, N/4]`` (a free reshape + bitcast, N % 4 == 0): each word holds columns ``4c..4c+3`` of one
K-pair row. Byte ``j`` of the words gives a ``[bk/2, bn/4]`` tile for the columns ``j (mod 4)``; the
kernel runs one pair of dots per ``j`` into its own accumulator and stores the four interleaved.
The block scales are read as uint32 words the same way. Decode: ``"asm"`` (one ``prmt`` picks byte
j of two words, then w4_triton's bf16 bit placement and bf16x2 scale multiply: 3.5 instructions per
value as the library's) or ``"bits"`` (w4_triton's jnp bit trick on the extracted bytes; also what
interpret mode runs). Same split-K partial sums. The storage format is unchanged.

Offline SASS (sm_90, M = 8, bk 64): 5.81 instructions per weight value (tuned: 5.83), but the codes
arrive by 16-byte asynchronous copies and 32-bit shared loads (no ``LDS.U8``), and the kernel needs 79
registers a thread against 123 (more resident programs per SM, so more bytes in flight).

  PYTHONPATH=$PWD python3 experiments/lab/w4_wide.py                 # interpret-mode check (CPU)
  PYTHONPATH=$PWD WIDE_TIME=1 python3 experiments/lab/w4_wide.py     # GPU: check + device time
"""
import functools
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import triton as plgpu  # noqa: E402

from pallas_kernels import w4_triton as W  # noqa: E402
from qerl_jax import nvfp4  # noqa: E402


def _wide_asm(j: int, high: bool) -> str:
  """Byte j of two uint32 words ($1, $2) -> its low/high E2M1 code as bf16 * 2**-126 in each half
  (prmt spreads the byte over both bytes of each half, then w4_triton's bit placement), times the
  bf16x2 scale $3 (the block scale * 2**118, as w4_triton's asm decode)."""
  sel = j | (j << 4) | ((4 + j) << 8) | ((4 + j) << 12)
  mag, sign = (2, 8) if high else (6, 12)
  return "\n".join(["{", ".reg .b32 t, a, b, nz;", "mov.b32 nz, 0x80008000;", f"prmt.b32 t, $1, $2, {sel:#06x};",
                    f"shl.b32 a, t, {mag};", "and.b32 a, a, 0x01C001C0;", f"shl.b32 b, t, {sign};",
                    "and.b32 b, b, 0x80008000;", "or.b32 a, a, b;", "fma.rn.bf16x2 $0, a, $3, nz;", "}"])


def _kernel(x_ref, u_ref, s_ref, gs_ref, idx_ref, o_ref, *, m, k, n4, bm, bn4, bk, steps, fmt, asm):
  pid_n, pid_s = pl.program_id(0), pl.program_id(1)
  c0 = pid_n * bn4
  m_mask = jnp.arange(bm) < m
  c_mask = (c0 + jnp.arange(bn4)) < n4
  igs = 1.0 / gs_ref[0]
  rep = fmt.group // 2

  def body(i, accs):
    kb = (pid_s * steps + i) * bk
    kp0 = kb // 2
    kp_mask = (kp0 + jnp.arange(bk // 2)) < k // 2
    ks_mask = (kb // fmt.group + jnp.arange(bk // fmt.group)) < k // fmt.group
    xk_mask = (kb + jnp.arange(bk)) < k
    x = plgpu.load(x_ref.at[pl.ds(0, bm), pl.ds(kb, bk)], mask=m_mask[:, None] & xk_mask[None, :], other=0.0)
    x_even, x_odd = lax.unstack(x.reshape(bm, bk // 2, 2), axis=2)
    u = plgpu.load(u_ref.at[pl.ds(kp0, bk // 2), pl.ds(c0, bn4)], mask=kp_mask[:, None] & c_mask[None, :],
                   other=0)
    # the block scales as uint32 words too: byte j of word (row, c) is column 4c + j's E4M3 scale
    s32 = plgpu.load(s_ref.at[pl.ds(kb // fmt.group, bk // fmt.group), pl.ds(c0, bn4)],
                     mask=ks_mask[:, None] & c_mask[None, :], other=0)
    out = []
    for j in range(4):
      s = lax.bitcast_convert_type(((s32 >> (8 * j)) & 0xFF).astype(jnp.uint8), jnp.float8_e4m3fn)
      if asm:
        sb = W._asm_scales(s)
        sb = jnp.broadcast_to(sb[:, None, :], (sb.shape[0], rep, bn4)).reshape(bk // 2, bn4)
        w_lo, w_hi = (plgpu.elementwise_inline_asm(
            _wide_asm(j, hi), args=[u, sb], constraints="=r,r,r,r", pack=2,
            result_shape_dtypes=[jax.ShapeDtypeStruct(u.shape, jnp.bfloat16)])[0] for hi in (False, True))
      else:
        byte = ((u >> (8 * j)) & 0xFF).astype(jnp.uint8)
        w_lo, w_hi = W._decode_tile(byte, s, fmt, x_even.dtype, decode="bits")
      acc = accs[j] + jnp.dot(x_even, w_lo, preferred_element_type=jnp.float32)
      out.append(acc + jnp.dot(x_odd, w_hi, preferred_element_type=jnp.float32))
    return tuple(out)

  zeros = jnp.zeros((bm, bn4), jnp.float32)
  accs = lax.fori_loop(0, steps, body, (zeros,) * 4)
  for j in range(4):
    plgpu.store(o_ref.at[pid_s, pl.ds(0, bm), pl.ds(c0, bn4), np.int32(j)],
                accs[j] * (igs * (W._ASM_GAIN if asm else 1.0)), mask=m_mask[:, None] & c_mask[None, :])


@functools.partial(jax.jit, static_argnames=("bn", "bk", "splits", "num_warps", "num_stages", "decode",
                                             "interpret"))
def forward(x, w, *, bn=128, bk=64, splits=7, num_warps=4, num_stages=3, decode="asm", interpret=False):
  """``x @ W`` (float32 ``[M, N]``) for ``M <= 64`` bf16 rows, an NVFP4 ``[K, N]`` weight, N % 4 == 0."""
  m, k = x.shape
  n = w.shape[1]
  assert n % 4 == 0 and m <= 64 and isinstance(w, nvfp4.NVFP4Tensor)
  fmt = W._format_of(w)
  bm = max(16, pl.next_power_of_2(m))
  n4, bn4 = n // 4, bn // 4
  total = -(-k // bk)
  steps = -(-total // splits)
  splits = -(-total // steps)
  u = lax.bitcast_convert_type(w.packed.reshape(k // 2, n4, 4), jnp.uint32)  # [K/2, N/4]
  s = lax.bitcast_convert_type(lax.bitcast_convert_type(w.block_scale, jnp.uint8).reshape(k // fmt.group, n4, 4),
                               jnp.uint32)  # [K/16, N/4]
  gs = w.global_scale.astype(jnp.float32).reshape(1)
  kernel = functools.partial(_kernel, m=m, k=k, n4=n4, bm=bm, bn4=bn4, bk=bk, steps=steps, fmt=fmt,
                             asm=decode == "asm" and not interpret)
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")
    parts = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((splits, m, n4, 4), jnp.float32), grid=(-(-n4 // bn4), splits),
        interpret=interpret, compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="w4a16_wide",
    )(x, u, s, gs, jnp.zeros((1,), jnp.int32))
  return parts.sum(0).reshape(m, n)


CASES = [(1, 160, 40, dict(bn=64, bk=32, splits=2)), (8, 1040, 200, dict(bn=64, bk=64, splits=3)),
         (17, 256, 72, dict(bn=64, bk=32, splits=1)), (8, 3584, 4608, {}), (32, 18944, 3584, {})]


def _time():
  from labcommon import time_against_tuned
  ms = [int(v) for v in os.environ.get("WIDE_MS", "8,32").split(",")]
  time_against_tuned({"wide": lambda x, w: forward(x, w),
                      "wide_bk128": lambda x, w: forward(x, w, bk=128, splits=4),
                      "wide_bits": lambda x, w: forward(x, w, decode="bits")}, ms)


if __name__ == "__main__":
  on_gpu = jax.default_backend() in ("gpu", "cuda")
  from labcommon import check_small_m_forward
  check_small_m_forward(forward, CASES, interpret=not on_gpu)
  if on_gpu and os.environ.get("WIDE_TIME"):
    _time()
