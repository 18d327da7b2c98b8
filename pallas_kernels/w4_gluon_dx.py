"""Large-M ``dx = dy @ W^T`` for NVFP4 weights in Gluon (Triton 3.6, Hopper wgmma), no bf16 W in HBM.

The backward of ``y = x @ W`` in the training step (M = batch x sequence, in the thousands):
``dx [M, K] = dy [M, N] @ W^T`` for bf16 ``dy`` and an NVFP4 ``W`` ``[K, N]`` (or layer ``index``
of a stack ``[L, K, N]``, read in place), float32 accumulation, bf16 output. Issue 4 asks for this
without a bf16 copy of ``W`` in HBM; the default path (:func:`pallas_kernels.w4_triton.dequantize`
then cuBLAS) writes one per call (136 MB for a 7B MLP matrix, 283 MB for a 32B one).

**Opt-in** (``pallas_kernels.matmul.GLUON_DX = "1"`` or ``QERL_GLUON_DX=1``): on an H200 it runs at
0.71x / 0.78x of bf16 cuBLAS at M = 2048 / 8192 (7B shapes summed; the warp-specialized build, session
36), where dequantize + cuBLAS runs at 0.93x / 1.04x in the same harness (docs/benchmarks.md, session
36). It is for runs that are short of memory, not of time.

Two builds (:data:`WS` picks):

* **Warp-specialized** (:func:`_ws_kernel`, the default): ``dx [BM, BK] = dy [BM, N] @ W^T`` per
  program with a producer partition (cp.async of dy and of the codes and scales, the E2M1 decode into
  shared memory) and an MMA partition (wgmma, B the decoded tile K-major), synchronised by mbarriers.
* **Session 17's** (``WS = 0``), described next.

The kernel computes ``dx^T [K, M] = W [K, N] @ dy^T [N, M]`` on wgmma (m64 n``BM`` k16, both operands
from shared memory):

* A is the weight: rows are K (128 a program, two warpgroups of 64), the contraction is N. Each thread
  decodes 2-byte pieces (columns ``n, n + 1``) of one code row: the low nibbles give operand row
  ``r`` and the high nibbles row ``r + 8`` (rows relabelled, ``k = 2 kp + nibble``, undone at the
  store), and stores the bf16 tile (``stmatrix``) into a ring of ``A_STAGES`` shared buffers.
  Contraction slots stay in natural order, so ``dy`` needs no permutation.
* values: one inline-PTX block per 4 code bytes, ``e2m1 * 2**-126`` by bit placement (as
  :func:`pallas_kernels.w4_gluon._asm`) times the block scales as bf16 ``scale * 2**118``, two
  columns' scales a register. XLA converts the layer's E4M3 block scales to that bf16 once per call
  (``K/16 x N`` values, 1/16 of the weight's count); the accumulator is multiplied by
  ``2**8 / global scale``.
* B is ``dy`` ``[64 n, BM]``, copied by cp.async ``X_STAGES - 2`` steps ahead into a ring of
  ``X_STAGES`` shared buffers (16 contiguous bytes a copy).
* Each step's wgmma is asynchronous and one stays in flight, so the next step's decode overlaps it.
  (A register operand measured no faster, and an asynchronous wgmma cannot safely keep one past its
  step: the compiler hands its registers to the next decode.)

A program owns 128 rows of K and ``BM`` (256) rows of ``dy`` and runs over all of N in steps of
64 (no split-K: at M >= 2048 there are hundreds of programs). It reads codes in the standard order (a
decode-order layer is converted by XLA first; the warp-specialized build converts them in registers);
:func:`applies` says which shapes it takes. GPU only (sm_90), launched through
:mod:`pallas_kernels.w4_gluon`'s XLA FFI handler.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import w4_gluon, w4_triton
from qerl_jax import nvfp4

BLOCK_K = 128   # rows of K (outputs of dx) a program: two warpgroups of 64
BLOCK_M = 256   # rows of dy a program: the wgmma's N
STEP_N = 64     # contraction (columns of W) a step
X_STAGES = 4    # shared buffers of the dy ring
A_STAGES = 3    # shared buffers of the decoded operand (7B shapes summed: 3 beat 2 by 6-7%, session 17)
MIN_M = 256     # the smallest M the dispatch (pallas_kernels.matmul.kernel_dx) sends here
_SCALE_BIAS = 2.0 ** 118  # folded into the bf16 block scales; the decode gives e2m1 * 2**-126
_ARG_DTYPES = ("*bf16", "*u8", "*bf16", "*fp32", "*i32", "*bf16")  # dy, codes, scales, global scales, layer, dx
# the warp-specialized build reads the codes as 32-bit words and the bf16 block scales as bf16 pairs
_WS_ARG_DTYPES = ("*bf16", "*i32", "*i32", "*fp32", "*i32", "*bf16")
WS = 1            # (session 36) the warp-specialized build (_ws_kernel) where it applies; 0: the session-17 build
                  # (7B shapes summed, M = 2048 / 8192: 0.71x / 0.78x of bf16 against 0.57x / 0.63x)
WS_BLOCK_M = 256  # its rows of dy a program (two MMA warpgroups of 128: two m64 wgmmas each)
WS_BLOCK_K = 128  # its rows of K (outputs) a program: the wgmma's N
WS_STAGES = 4     # its ring of (dy, decoded W) shared buffers
WS_DECODE_WARPS = 4  # warps of its producer partition (cp.async of dy, E2M1 decode into shared memory)
WS_MAXNREG = 0    # its register cap at launch (0: 65536 / threads, rounded down to a multiple of 8)
WS_CODE_STAGES = 4  # its producer's ring of code and block-scale buffers (cp.async, CS - 1 steps ahead)
WS_PROBE = 0      # lab probe (wrong results): 1 skips its decode (the MMAs read stale buffers), 2 its MMAs
WS_DECODE_REGS = 0  # its producer partition's registers (0: derived from the cap)


def applies(m: int, w, dy_dtype) -> bool:
  """Whether :func:`dx` takes ``dy [m, N]`` (dtype ``dy_dtype``) and ``w``: an NVFP4 ``[K, N]``
  weight (or stack) in either code order, bf16 ``dy``, ``m >= 1``, ``K`` a multiple of 128,
  ``N`` a multiple of 64, every visible GPU sm_90 (wgmma) and the FFI launcher available."""
  if not isinstance(w, nvfp4.NVFP4Tensor) or jnp.dtype(dy_dtype) != jnp.bfloat16:
    return False
  k, n = w.shape
  if m < 1 or k % BLOCK_K or n % STEP_N:
    return False
  return w4_gluon.large_m_ready()


def _asm() -> str:
  """Inline PTX: code bytes ``$4`` = (columns n, n + 1, n + 8, n + 9 of one code row), bf16 scales
  ``$5`` (n, n + 1) and ``$6`` (n + 8, n + 9), times 2**118 -> ``$0, $1``: the low nibbles (K row
  2 kp) of columns (n, n + 1) and (n + 8, n + 9); ``$2, $3``: the high nibbles (K row 2 kp + 1). Each
  output is bf16 ``e2m1 * scale * 2**-8`` (exact).

  One ``prmt`` puts each column's byte in the top byte of its 16-bit half, where the high nibble's
  sign is already bit 15: its magnitude moves by one shift and mask; the low nibble's sign and
  magnitude take a shift each. Then one bf16x2 multiply by the two columns' scales."""
  lines = ["{", ".reg .b32 u, m, t, z, nz;", "mov.b32 z, 0;", "mov.b32 nz, 0x80008000;"]
  for h in range(2):  # columns (n, n + 1) from bytes 0, 1; (n + 8, n + 9) from bytes 2, 3
    lines.append(f"prmt.b32 u, $4, z, {'0x1404' if h == 0 else '0x3424'};")
    # high nibble: bits 12-15 of each half; sign in place, magnitude 12-14 -> 6-8
    lines += ["shr.b32 m, u, 6;", "and.b32 m, m, 0x01C001C0;", "and.b32 t, u, 0x80008000;", "or.b32 m, m, t;",
              f"fma.rn.bf16x2 ${2 + h}, m, ${5 + h}, nz;"]
    # low nibble: bits 8-11; magnitude 8-10 -> 6-8, sign 11 -> 15
    lines += ["shr.b32 m, u, 2;", "and.b32 m, m, 0x01C001C0;", "shl.b32 t, u, 4;", "and.b32 t, t, 0x80008000;",
              "or.b32 m, m, t;", f"fma.rn.bf16x2 ${h}, m, ${5 + h}, nz;"]
  return "\n".join(lines + ["}"])


@functools.lru_cache(maxsize=None)
def _kernel():
  """Builds the Gluon kernel (imports triton lazily: CPU installs need not have it)."""
  from triton.experimental import gluon
  from triton.experimental.gluon import language as ttgl
  from triton.experimental.gluon.language.nvidia import hopper
  from triton.experimental.gluon.language.nvidia.ampere import async_copy

  asm = ttgl.constexpr(_asm())
  # codes [64 code rows, 64 columns] of one step: registers n0 n3 n4 n5; lanes n1 n2 kp0 kp1 kp2; warps
  # kp3 kp4 kp5. A thread's 4 packed bytes are columns n, n + 1, n + 8, n + 9 of one code row.
  code_layout = ttgl.constexpr(ttgl.DistributedLinearLayout(
      reg_bases=[[0, 1], [0, 8], [0, 16], [0, 32]], lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
      warp_bases=[[8, 0], [16, 0], [32, 0]], block_bases=[], shape=[64, 64]))

  @gluon.jit
  def decode(c, s):
    """codes [64, 64] (uint8) and bf16 scales [64, 64] (each code byte's) -> A [128 rows, 64]: row
    ``r = 16 kp_hi + 8 nibble + kp_lo`` holds K row ``2 kp + nibble`` (kp = 8 kp_hi + kp_lo)."""
    lo, hi = ttgl.inline_asm_elementwise(asm, "=r,=r,=r,=r,r,r,r", [c, s], dtype=(ttgl.bfloat16, ttgl.bfloat16),
                                         is_pure=True, pack=4)
    j = ttgl.reshape(ttgl.join(lo, hi), [8, 8, 64, 2])  # [kp_hi, kp_lo, n, nibble]
    return ttgl.reshape(ttgl.permute(j, [0, 3, 1, 2]), [128, 64])

  @gluon.jit
  def w4a16_dx(dy_ptr, p_ptr, s_ptr, gs_ptr, idx_ptr, o_ptr, M: ttgl.constexpr, N: ttgl.constexpr,
               K: ttgl.constexpr, L: ttgl.constexpr, BM: ttgl.constexpr, XS: ttgl.constexpr, AS: ttgl.constexpr):
    mma: ttgl.constexpr = ttgl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, BM, 16])
    yl: ttgl.constexpr = ttgl.BlockedLayout([8, 1], [8, 4], [1, 8], [0, 1])  # dy [64 n, BM]: 8 contiguous n a thread
    ys_layout: ttgl.constexpr = ttgl.NVMMASharedLayout.get_default_for([64, BM], ttgl.bfloat16, transposed=True)
    y_smem = ttgl.allocate_shared_memory(ttgl.bfloat16, [XS, 64, BM], ys_layout)
    STEPS: ttgl.constexpr = N // 64
    # steps the copies run ahead: one MMA stays in flight past each step, so the buffer a copy takes must
    # have been read two steps back
    PRE: ttgl.constexpr = XS - 2
    pid_r = ttgl.program_id(0)
    pid_m = ttgl.program_id(1)
    layer = ttgl.minimum(ttgl.maximum(ttgl.load(idx_ptr), 0), L - 1)
    gs = ttgl.load(gs_ptr + layer)
    kp = ttgl.arange(0, 64, layout=ttgl.SliceLayout(1, code_layout))
    nn = ttgl.arange(0, 64, layout=ttgl.SliceLayout(0, code_layout))
    c_offs = ttgl.expand_dims(kp + (layer * (K // 2) + pid_r * 64), 1) * N + ttgl.expand_dims(nn, 0)
    s_offs = ttgl.expand_dims(kp // 8 + pid_r * 8, 1) * N + ttgl.expand_dims(nn, 0)  # the layer's scales
    ny = ttgl.arange(0, 64, layout=ttgl.SliceLayout(1, yl))
    my = ttgl.arange(0, BM, layout=ttgl.SliceLayout(0, yl))
    # rows past M read row M - 1 (their outputs are never stored)
    y_offs = ttgl.expand_dims(ny, 1) + ttgl.expand_dims(ttgl.minimum(my + pid_m * BM, M - 1), 0) * N
    for j in ttgl.static_range(PRE):
      async_copy.async_copy_global_to_shared(y_smem.index(j), dy_ptr + y_offs + min(j, STEPS - 1) * 64)
      async_copy.commit_group()
    acc = ttgl.zeros([128, BM], ttgl.float32, layout=mma)
    c0 = ttgl.load(p_ptr + c_offs)
    s0 = ttgl.load(s_ptr + s_offs)
    # the decoded operand through a ring of AS shared buffers; asynchronous MMAs, one in flight
    as_layout: ttgl.constexpr = ttgl.NVMMASharedLayout.get_default_for([128, 64], ttgl.bfloat16)
    a_smem = ttgl.allocate_shared_memory(ttgl.bfloat16, [AS, 128, 64], as_layout)
    c1 = ttgl.load(p_ptr + c_offs + min(1, STEPS - 1) * 64)
    s1 = ttgl.load(s_ptr + s_offs + min(1, STEPS - 1) * 64)
    for i in range(STEPS):
      nxt = ttgl.minimum(i + 2, STEPS - 1) * 64
      c2 = ttgl.load(p_ptr + c_offs + nxt)
      s2 = ttgl.load(s_ptr + s_offs + nxt)
      # each warpgroup writes and its MMAs read only its own 64 rows; its MMA of step i - AS is retired
      # (the wait below leaves one in flight, and AS >= 2)
      a_smem.index(i % AS).store(decode(c0, s0))
      async_copy.wait_group(PRE - 1)  # this thread's copies of step i have landed
      hopper.fence_async_shared()  # the operand's stores and everyone's copies, visible to the tensor cores
      ttgl.thread_barrier()  # and everyone's MMA of step i - 2 is retired: its dy buffer takes step i + PRE
      async_copy.async_copy_global_to_shared(y_smem.index((i + PRE) % XS),
                                             dy_ptr + y_offs + ttgl.minimum(i + PRE, STEPS - 1) * 64)
      async_copy.commit_group()
      acc = hopper.warpgroup_mma(a_smem.index(i % AS), y_smem.index(i % XS), acc, is_async=True)
      acc = hopper.warpgroup_mma_wait(1, deps=[acc])
      c0 = c1
      s0 = s1
      c1 = c2
      s1 = s2
    acc = hopper.warpgroup_mma_wait(0, deps=[acc])
    async_copy.wait_group(0)
    acc = acc * (256.0 / gs)  # 2**8 undoes the decode's 2**-8
    # rows (kp_hi, nibble, kp_lo) -> K rows 16 kp_hi + 2 kp_lo + nibble: a relabelling, no data moves
    out = ttgl.reshape(ttgl.permute(ttgl.reshape(acc, [8, 2, 8, BM]), [0, 2, 1, 3]), [128, BM]).to(ttgl.bfloat16)
    kk = ttgl.arange(0, 128, layout=ttgl.SliceLayout(1, out.type.layout))
    mo = ttgl.arange(0, BM, layout=ttgl.SliceLayout(0, out.type.layout))
    rows = mo + pid_m * BM
    mask = ttgl.expand_dims(rows < M, 0) & ttgl.expand_dims(kk >= 0, 1)
    ttgl.store(o_ptr + ttgl.expand_dims(rows, 0) * K + ttgl.expand_dims(kk + pid_r * 128, 1), out, mask=mask)

  return w4a16_dx


def _standard_order_steps() -> tuple[tuple[int, int], ...]:
  """``(shift, mask)`` pairs that take a decode-order block word back to the standard order
  (:func:`qerl_jax.nvfp4.bit_moves` of :data:`qerl_jax.nvfp4.DECODE_ORDER_BITS` inverted), masks as signed int32
  values (the kernel's integer type)."""
  return tuple((d, m - (1 << 32) if m >= 1 << 31 else m)
               for d, m in nvfp4.bit_moves(np.argsort(nvfp4.DECODE_ORDER_BITS)))


def standard_order_words(r0: np.ndarray, r1: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """The warp-specialized build's in-register conversion, in numpy (for tests): the uint32 code words of code
  rows ``2 i`` (``r0``) and ``2 i + 1`` (``r1``) of a decode-order weight (4 columns a word) -> the same words in
  the standard order. Each word pair holds two block words (columns ``4 w, 4 w + 1`` and ``4 w + 2, 4 w + 3``),
  each permuted back by :func:`qerl_jax.nvfp4.permute_word_bits` with the kernel's moves."""
  r0, r1 = r0.astype(np.uint32), r1.astype(np.uint32)
  inverse = np.argsort(nvfp4.DECODE_ORDER_BITS)
  lo, hi = (np.asarray(nvfp4.permute_word_bits(jnp.asarray(b), inverse))
            for b in ((r0 & 0xFFFF) | (r1 << 16), (r0 >> 16) | (r1 & 0xFFFF0000)))
  return (lo & 0xFFFF) | (hi << 16), (lo >> 16) | (hi & 0xFFFF0000)


@functools.lru_cache(maxsize=None)
def _ws_kernel():
  """The warp-specialized build (:data:`WS`): ``dx [BM, BK] = dy [BM, N] @ W^T`` per program.

  * A producer partition (:data:`WS_DECODE_WARPS` warps) fills a ring of :data:`WS_STAGES` pairs of
    shared buffers, one pair per 64 columns of N: ``dy [BM, 64]`` by cp.async (the copies arrive on
    ``a_ready`` when they land), and ``W [BK, 64]`` decoded from its codes and stored in the natural
    ``[k, n]`` order (then ``b_ready``). The codes and bf16 block scales come by cp.async into a ring of
    :data:`WS_CODE_STAGES` buffers of its own, ``WS_CODE_STAGES - 1`` steps ahead; the decode is the
    E2M1 bit placement of :func:`_asm` times the scales, on 32-bit words. It refills a pair once the MMA
    partition releases it (``empty``).
  * The default partition (8 warps: two warpgroups of ``BM / 2`` rows, one or two m64 wgmmas each) waits
    for a pair, runs ``acc += dy @ W^T`` on wgmma (B is the stored tile transposed, K-major), keeps one
    MMA in flight and releases the previous step's pair.
  """
  from triton.experimental import gluon
  from triton.experimental.gluon import language as ttgl
  from triton.experimental.gluon.language.nvidia import hopper
  from triton.experimental.gluon.language.nvidia.ampere import async_copy
  from triton.experimental.gluon.language.nvidia.hopper import mbarrier

  asm = ttgl.constexpr(_asm())

  steps = _standard_order_steps()
  INV_D = ttgl.constexpr(tuple(d for d, _ in steps))
  INV_M = ttgl.constexpr(tuple(m for _, m in steps))

  @gluon.jit
  def lsr(x, n: ttgl.constexpr):
    """Logical right shift of int32 ``x`` by ``n``."""
    return (x.to(ttgl.uint32, bitcast=True) >> n).to(ttgl.int32, bitcast=True)

  @gluon.jit
  def unpermute(blk):
    """A decode-order block word -> the standard order (:func:`_standard_order_steps`)."""
    out = blk & 0
    for t in ttgl.static_range(len(INV_D)):
      if INV_D[t] >= 0:
        out = out | ((blk & INV_M[t]) << INV_D[t])
      else:
        out = out | lsr(blk & INV_M[t], -INV_D[t])
    return out

  @gluon.jit
  def to_standard(c):
    """code words [Q, 4, 16] of a decode-order weight (code rows 4 q + r) -> the standard order: rows 4 q + 2 a
    and 4 q + 2 a + 1 make two block words a word (as :func:`standard_order_words`)."""
    q: ttgl.constexpr = c.shape[0]
    r0, r1 = ttgl.split(ttgl.permute(ttgl.reshape(c, [q, 2, 2, 16]), [0, 1, 3, 2]))
    o01 = unpermute((r0 & 0xFFFF) | (r1 << 16))
    o23 = unpermute(lsr(r0, 16) | (r1 & -65536))
    s0 = (o01 & 0xFFFF) | (o23 << 16)
    s1 = lsr(o01, 16) | (o23 & -65536)
    return ttgl.reshape(ttgl.permute(ttgl.join(s0, s1), [0, 1, 3, 2]), [q, 4, 16])

  @gluon.jit
  def decode_half(c, se, so, dst):
    """code words [Q, 4, 16] (code rows 4 q + r, 4 columns a word) and their block scales as bf16 pairs
    ``se`` (columns 4 w, 4 w + 1) and ``so`` (4 w + 2, 4 w + 3), [Q, 16] (one scale row for each quad of
    code rows) -> W rows 8 q + 2 r + nibble, as bf16 pairs, stored into ``dst`` ([8 Q, 32] int32 words)."""
    q: ttgl.constexpr = c.shape[0]
    lo01, lo23, hi01, hi23 = ttgl.inline_asm_elementwise(
        asm, "=r,=r,=r,=r,r,r,r", [c, ttgl.broadcast(ttgl.expand_dims(se, 1), c)[0],
                                  ttgl.broadcast(ttgl.expand_dims(so, 1), c)[0]],
        dtype=(ttgl.int32, ttgl.int32, ttgl.int32, ttgl.int32), is_pure=True, pack=1)
    lo = ttgl.reshape(ttgl.join(lo01, lo23), [q, 4, 32])
    hi = ttgl.reshape(ttgl.join(hi01, hi23), [q, 4, 32])
    dst.store(ttgl.reshape(ttgl.permute(ttgl.join(lo, hi), [0, 1, 3, 2]), [8 * q, 32]))

  @gluon.jit
  def producer(dy_ptr, p_ptr, s_ptr, a_smem, b_smem, a_ready, b_ready, empty, pid_k, pid_m, layer,
               M: ttgl.constexpr, N: ttgl.constexpr, K: ttgl.constexpr, BM: ttgl.constexpr, BK: ttgl.constexpr,
               S: ttgl.constexpr, DW: ttgl.constexpr, CS: ttgl.constexpr, PR: ttgl.constexpr, DO: ttgl.constexpr):
    STEPS: ttgl.constexpr = N // 64
    Q: ttgl.constexpr = 4 * DW  # quads of code rows a chunk (the layout's extent); a step has BK / 2 code rows
    H: ttgl.constexpr = BK // (8 * Q)  # chunks a step (1 or 2)
    NW: ttgl.constexpr = N // 4  # code words a row
    # code words [Q quads, 4 rows, 16 words of 4 columns]: a thread holds 4 consecutive code rows (one
    # block-scale row) x 2 words, so its 4 rows share one load of 8 scales
    cl: ttgl.constexpr = ttgl.BlockedLayout([1, 4, 2], [4, 1, 8], [DW, 1, 1], [2, 1, 0])
    sl: ttgl.constexpr = ttgl.SliceLayout(1, cl)
    cq = ttgl.arange(0, Q, layout=ttgl.SliceLayout(1, ttgl.SliceLayout(2, cl)))
    cr = ttgl.arange(0, 4, layout=ttgl.SliceLayout(0, ttgl.SliceLayout(2, cl)))
    cw = ttgl.arange(0, 16, layout=ttgl.SliceLayout(0, ttgl.SliceLayout(1, cl)))
    kp = ttgl.expand_dims(ttgl.expand_dims(cq * 4, 1) + ttgl.expand_dims(cr, 0), 2)  # [Q, 4, 1]
    c_offs = (kp + (layer * (K // 2) + pid_k * (BK // 2))) * NW + ttgl.expand_dims(ttgl.expand_dims(cw, 0), 1)
    sq = ttgl.arange(0, Q, layout=ttgl.SliceLayout(1, sl))
    sw = ttgl.arange(0, 16, layout=ttgl.SliceLayout(0, sl))
    # code row 4 q + r of the tile is in block-scale row (4 q + r) // 8 = q // 2; bf16 pairs (N / 2 a row)
    s_offs = ttgl.expand_dims(sq // 2 + pid_k * (BK // 16), 1) * (N // 2) + ttgl.expand_dims(sw * 2, 0)
    # dy [BM, 64]: 16 contiguous bytes a copy; rows past M read row M - 1 (their outputs are not stored)
    yl: ttgl.constexpr = ttgl.BlockedLayout([1, 8], [4, 8], [DW, 1], [1, 0])
    ym = ttgl.arange(0, BM, layout=ttgl.SliceLayout(1, yl))
    yn = ttgl.arange(0, 64, layout=ttgl.SliceLayout(0, yl))
    y_offs = ttgl.expand_dims(ttgl.minimum(ym + pid_m * BM, M - 1), 1) * N + ttgl.expand_dims(yn, 0)
    H_C: ttgl.constexpr = 4 * Q * NW  # the second chunk's code rows (words)
    H_S: ttgl.constexpr = (Q // 2) * (N // 2)  # and block-scale rows (bf16 pairs)
    bw_layout: ttgl.constexpr = ttgl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    # codes and block scales by cp.async into a ring of CS shared buffers, CS - 1 steps ahead of their decode;
    # each thread copies exactly the words it reads back, so its own wait_group orders the two
    rl: ttgl.constexpr = ttgl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
    rl2: ttgl.constexpr = ttgl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    c_smem = ttgl.allocate_shared_memory(ttgl.int32, [CS * H, Q, 4, 16], rl)
    e_smem = ttgl.allocate_shared_memory(ttgl.int32, [CS * H, Q, 16], rl2)
    o_smem = ttgl.allocate_shared_memory(ttgl.int32, [CS * H, Q, 16], rl2)
    for j in ttgl.static_range(CS - 1):
      for h in ttgl.static_range(H):
        jj = min(j, STEPS - 1)
        async_copy.async_copy_global_to_shared(c_smem.index(j * H + h), p_ptr + c_offs + h * H_C + jj * 16)
        async_copy.async_copy_global_to_shared(e_smem.index(j * H + h), s_ptr + s_offs + h * H_S + jj * 32)
        async_copy.async_copy_global_to_shared(o_smem.index(j * H + h), s_ptr + s_offs + h * H_S + jj * 32 + 1)
      async_copy.commit_group()
    for i in range(STEPS):
      st = i % S
      mbarrier.wait(empty.index(st), ((i // S) & 1) ^ 1)
      async_copy.async_copy_global_to_shared(a_smem.index(st), dy_ptr + y_offs + i * 64)
      async_copy.mbarrier_arrive(a_ready.index(st), increment_count=False)
      nxt = ttgl.minimum(i + CS - 1, STEPS - 1)
      ns = (i + CS - 1) % CS
      for h in ttgl.static_range(H):
        async_copy.async_copy_global_to_shared(c_smem.index(ns * H + h), p_ptr + c_offs + h * H_C + nxt * 16)
        async_copy.async_copy_global_to_shared(e_smem.index(ns * H + h), s_ptr + s_offs + h * H_S + nxt * 32)
        async_copy.async_copy_global_to_shared(o_smem.index(ns * H + h), s_ptr + s_offs + h * H_S + nxt * 32 + 1)
      async_copy.commit_group()
      async_copy.wait_group(CS - 1)  # this thread's copies of step i have landed
      cs = i % CS
      bw = b_smem.index(st)._reinterpret(ttgl.int32, [BK, 32], bw_layout)
      for h in ttgl.static_range(H):
        c = c_smem.index(cs * H + h).load(cl)
        if DO:
          c = to_standard(c)
        e = e_smem.index(cs * H + h).load(sl)
        o = o_smem.index(cs * H + h).load(sl)
        if PR != 1:
          decode_half(c, e, o, bw.slice(h * 8 * Q, 8 * Q))
      hopper.fence_async_shared()
      mbarrier.arrive(b_ready.index(st), count=1)

  @gluon.jit
  def mma_loop(a_smem, b_smem, a_ready, b_ready, empty, BM: ttgl.constexpr, BK: ttgl.constexpr, N: ttgl.constexpr,
               S: ttgl.constexpr, PR: ttgl.constexpr):
    STEPS: ttgl.constexpr = N // 64
    mma: ttgl.constexpr = ttgl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, BK, 16])
    acc = ttgl.zeros([BM, BK], ttgl.float32, layout=mma)
    for i in range(STEPS):
      st = i % S
      ph = (i // S) & 1
      mbarrier.wait(a_ready.index(st), ph)
      mbarrier.wait(b_ready.index(st), ph)
      hopper.fence_async_shared()  # the copies' generic-proxy writes, before the tensor cores read them
      if PR != 2:
        acc = hopper.warpgroup_mma(a_smem.index(st), b_smem.index(st).permute((1, 0)), acc, is_async=True)
      acc = hopper.warpgroup_mma_wait(1, deps=[acc])
      # step i - 1's MMA is retired in both warpgroups (the arrive waits for the partition): free its pair
      mbarrier.arrive(empty.index((i + S - 1) % S), count=1, pred=i > 0)
    acc = hopper.warpgroup_mma_wait(0, deps=[acc])
    return (acc,)

  @gluon.jit
  def w4a16_dx_ws(dy_ptr, p_ptr, s_ptr, gs_ptr, idx_ptr, o_ptr, M: ttgl.constexpr, N: ttgl.constexpr,
                  K: ttgl.constexpr, L: ttgl.constexpr, BM: ttgl.constexpr, BK: ttgl.constexpr, S: ttgl.constexpr,
                  DW: ttgl.constexpr, DR: ttgl.constexpr, CS: ttgl.constexpr, PR: ttgl.constexpr,
                  DO: ttgl.constexpr):
    pid_k = ttgl.program_id(0)
    pid_m = ttgl.program_id(1)
    layer = ttgl.minimum(ttgl.maximum(ttgl.load(idx_ptr), 0), L - 1)
    gs = ttgl.load(gs_ptr + layer)
    a_layout: ttgl.constexpr = ttgl.NVMMASharedLayout.get_default_for([BM, 64], ttgl.bfloat16)
    b_layout: ttgl.constexpr = ttgl.NVMMASharedLayout.get_default_for([BK, 64], ttgl.bfloat16)
    a_smem = ttgl.allocate_shared_memory(ttgl.bfloat16, [S, BM, 64], a_layout)
    b_smem = ttgl.allocate_shared_memory(ttgl.bfloat16, [S, BK, 64], b_layout)
    a_ready = ttgl.allocate_shared_memory(ttgl.int64, [S, 1], mbarrier.MBarrierLayout())
    b_ready = ttgl.allocate_shared_memory(ttgl.int64, [S, 1], mbarrier.MBarrierLayout())
    empty = ttgl.allocate_shared_memory(ttgl.int64, [S, 1], mbarrier.MBarrierLayout())
    for j in ttgl.static_range(S):
      mbarrier.init(a_ready.index(j), count=DW * 32)  # every producer thread's copies (cp.async, no increment)
      mbarrier.init(b_ready.index(j), count=1)
      mbarrier.init(empty.index(j), count=1)
    acc = ttgl.warp_specialize(
        [(mma_loop, (a_smem, b_smem, a_ready, b_ready, empty, BM, BK, N, S, PR)),
         (producer, (dy_ptr, p_ptr, s_ptr, a_smem, b_smem, a_ready, b_ready, empty, pid_k, pid_m, layer, M, N, K, BM,
                     BK, S, DW, CS, PR, DO))],
        [DW], [DR])[0]
    out = (acc * (256.0 / gs)).to(ttgl.bfloat16)  # 2**8 undoes the decode's 2**-8
    rows = ttgl.arange(0, BM, layout=ttgl.SliceLayout(1, out.type.layout)) + pid_m * BM
    cols = ttgl.arange(0, BK, layout=ttgl.SliceLayout(0, out.type.layout)) + pid_k * BK
    mask = ttgl.expand_dims(rows < M, 1) & ttgl.expand_dims(cols >= 0, 0)
    ttgl.store(o_ptr + ttgl.expand_dims(rows, 1) * K + ttgl.expand_dims(cols, 0), out, mask=mask)

  return w4a16_dx_ws


def ws_applies(m: int, k: int, n: int) -> bool:
  """Whether the warp-specialized build takes ``dy [m, n]`` against a ``[k, n]`` weight (``K`` a multiple
  of :data:`WS_BLOCK_K`), with :data:`WS` on."""
  return bool(WS) and k % WS_BLOCK_K == 0 and n % STEP_N == 0


def _ws_check():
  """Raises ValueError for warp-specialized settings the kernel cannot take: ``WS_BLOCK_M`` 128 or 256,
  ``WS_BLOCK_K`` one or two chunks of ``32 WS_DECODE_WARPS`` rows, rings of at least 2 buffers."""
  chunk = 32 * WS_DECODE_WARPS
  if WS_BLOCK_M not in (128, 256) or WS_BLOCK_K not in (chunk, 2 * chunk) or WS_STAGES < 2 or WS_CODE_STAGES < 2:
    raise ValueError(f"w4_gluon_dx: warp-specialized settings WS_BLOCK_M={WS_BLOCK_M} (128 or 256), "
                     f"WS_BLOCK_K={WS_BLOCK_K} ({chunk} or {2 * chunk} with WS_DECODE_WARPS={WS_DECODE_WARPS}), "
                     f"WS_STAGES={WS_STAGES} and WS_CODE_STAGES={WS_CODE_STAGES} (each >= 2) are not supported")


def _ws_regs() -> tuple[int, int]:
  """(launch cap, producer registers) of the warp-specialized build: ``8 + WS_DECODE_WARPS`` warps share
  the 65536 registers of an SM."""
  threads = 32 * (8 + WS_DECODE_WARPS)
  cap = WS_MAXNREG or (65536 // threads) // 8 * 8
  return cap, WS_DECODE_REGS or max(24, min(cap, 128) // 8 * 8)


class Build(NamedTuple):
  """One launch: the kernel's constexprs and its grid (K / 128 row tiles, M / BM tiles)."""
  meta: dict

  @property
  def grid(self) -> tuple[int, int, int]:
    """The launch grid ``(K / BLOCK_K, ceil(M / BM), 1)``: output column tiles of ``dx`` by row tiles."""
    return self.meta["K"] // BLOCK_K, -(-self.meta["M"] // self.meta["BM"]), 1


def _build(m: int, k: int, n: int, layers: int) -> Build:
  """The launch for ``dy [m, n]`` and a ``[k, n]`` weight (of a stack of ``layers``) under the
  current settings.

  Raises:
    ValueError: ``X_STAGES < 3`` or ``A_STAGES < 2`` (the rings' reuse distances).
  """
  if X_STAGES < 3 or A_STAGES < 2:
    raise ValueError(f"w4_gluon_dx: X_STAGES must be >= 3 and A_STAGES >= 2, got {X_STAGES} and {A_STAGES}")
  return Build(dict(M=m, N=n, K=k, L=layers, BM=BLOCK_M, XS=X_STAGES, AS=A_STAGES))


@functools.lru_cache(maxsize=None)
def _compiled(meta: tuple):
  """``(ptx, kernel name, shared bytes)`` of the kernel for the constexprs ``meta``, loaded on every GPU."""
  return w4_gluon._load(w4_gluon._compile_gluon(_kernel(), _ARG_DTYPES, dict(meta), w4_gluon._target_cc(),
                                                num_warps=8))


@functools.lru_cache(maxsize=None)
def _compiled_ws(meta: tuple, cap: int):
  """``(ptx, kernel name, shared bytes)`` of the warp-specialized build, loaded on every GPU."""
  return w4_gluon._load(w4_gluon._compile_gluon(_ws_kernel(), _WS_ARG_DTYPES, dict(meta), w4_gluon._target_cc(),
                                                num_warps=8, maxnreg=cap))


def block_scales_bf16(w: nvfp4.NVFP4Tensor, index=None) -> jax.Array:
  """The block scales of ``w`` (layer ``index``, clamped, of a stack) as the kernel reads them: bf16
  ``scale * 2**118`` (exact: E4M3 fits bf16's significand), ``[K/16, N]``."""
  s = w.block_scale
  if index is not None and s.ndim == 3:
    s = w4_triton.layer_slice(s, index)
  return (s.astype(jnp.float32) * _SCALE_BIAS).astype(jnp.bfloat16)


def dx(dy: jax.Array, w: nvfp4.NVFP4Tensor, *, index=None) -> jax.Array:
  """``dy @ W^T`` by the large-M Gluon kernel (GPU only; no VJP: :mod:`pallas_kernels.matmul` calls it
  from the backward of ``quantized_matmul``).

  Args:
    dy: bf16 ``[M, N]``.
    w: :class:`~qerl_jax.nvfp4.NVFP4Tensor` ``[K, N]`` in either code order (decode-order codes: the
      warp-specialized build converts them in registers, session 17's gets the layer converted by XLA first), or
      with ``index``
      a stack ``[L, K, N]``.
    index: int32 scalar (may be traced): layer of the stack, clamped to ``[0, L)``.

  Returns:
    bf16 ``[M, K]``, accumulated in float32.

  Raises:
    ValueError: a shape or weight :func:`applies` rejects, a dy/weight N mismatch, or ``index``
      given with an unstacked weight (or missing with a stack).
    RuntimeError: the compiled kernel failed to load on a GPU.
  """
  m, n = dy.shape
  if not applies(m, w, dy.dtype) or w.shape[1] != n:
    raise ValueError(f"w4_gluon_dx.dx: no kernel for dy {dy.dtype}{list(dy.shape)} and weight {type(w).__name__} "
                     f"{list(getattr(w, 'shape', ()))} (needs an sm_90 GPU with the FFI launcher, bf16 dy, NVFP4, "
                     f"K % {BLOCK_K} == 0, N % {STEP_N} == 0)")
  if (index is None) != (w.packed.ndim == 2):
    raise ValueError(f"w4_gluon_dx.dx: index={index!r} with packed codes of shape {w.packed.shape}")
  ws = ws_applies(m, w.shape[0], n)
  if w.code_order == "decode" and not ws:
    # the session-17 build reads the standard order: the layer's codes are converted first (an XLA pass over
    # them, a transient 4-bit copy of the layer; the warp-specialized build converts in registers instead)
    if index is not None:
      w, index = w4_triton.layer_slice(w, index), None
    w = nvfp4.to_standard_order(w)
  k = w.shape[0]
  codes, _, gs, idx = w4_triton._layer_operands(w, w4_triton._format_of(w), index)
  layers = 1 if index is None else w.packed.shape[0]
  if ws:
    _ws_check()
    cap, regs = _ws_regs()
    meta = dict(M=m, N=n, K=k, L=layers, BM=WS_BLOCK_M, BK=WS_BLOCK_K, S=WS_STAGES, DW=WS_DECODE_WARPS, DR=regs,
                CS=WS_CODE_STAGES, PR=WS_PROBE, DO=int(w.code_order == "decode"))
    ptx, name, shared = _compiled_ws(tuple(meta.items()), cap)
    grid, threads = (k // WS_BLOCK_K, -(-m // WS_BLOCK_M), 1), 32 * (8 + WS_DECODE_WARPS)
  else:
    build = _build(m, k, n, layers)
    ptx, name, shared = _compiled(tuple(build.meta.items()))
    grid, threads = build.grid, 256
  return jax.ffi.ffi_call(w4_gluon._FFI_TARGET, jax.ShapeDtypeStruct((m, k), jnp.bfloat16))(
      dy, codes, block_scales_bf16(w, index), gs, idx,
      **w4_gluon._launch_attrs(ptx, name, grid, shared, threads=threads))
