"""Mid-M ``y = x @ W`` for NVFP4 weights: a warp-specialized Gluon kernel (Triton 3.6, Hopper wgmma). Lab.

For the rows where neither the decode GEMV (:mod:`pallas_kernels.w4_gluon`, made for M <= 16 and
stretched to 128) nor dequantize + cuBLAS (a transient bf16 W per call) is efficient: M of about 64-256
(batch-64 to batch-256 decode steps). Issue 4 asks 1.8x of bf16 there.

A program owns ``BM`` rows of x, ``BN`` (128) columns of W and one split of K (``KS`` rows, in steps of
64), and adds its float32 partial product into the zeroed output by atomics:

* a producer partition (4 warps) copies each step's ``x [BM, 64]`` by cp.async into a ring of ``S``
  shared buffers (the copies arrive on the step's mbarrier), and the step's codes (32 code rows x
  ``BN``) and raw E4M3 block scales by cp.async into a ring of its own, ``CS - 1`` steps ahead (each
  thread reads back only the words it copied). It decodes them with the decode GEMV's inline PTX
  (:func:`pallas_kernels.w4_gluon._asm` with raw scale bytes, either code order) and stores the
  ``[BN, 64]`` bf16 tile K-major: column ``n``'s k-pairs are ``(4 j, 4 j + 2)`` and
  ``(4 j + 1, 4 j + 3)``, so x comes with bits 0 and 1 of k swapped (:func:`x_in_pair_order`, an XLA
  permutation of x);
* the MMA partition (4 warps: one warpgroup, ``BM / 64`` m64 wgmmas a k16) waits for both buffers,
  runs wgmma with one MMA in flight and releases the previous step's pair (mbarrier).

GPU only (sm_90), launched through :mod:`pallas_kernels.w4_gluon`'s XLA FFI handler; not wired into
:func:`pallas_kernels.quantized_matmul` (docs/benchmarks.md, session 36, has its measurements).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import w4_gluon, w4_triton
from qerl_jax import nvfp4

BLOCK_N = 128     # columns of W a program (the wgmma's N)
STAGES = 4        # ring of (x, decoded W) shared buffers at 128-row tiles (3 at 64 rows)
CODE_STAGES = 4   # the producer's ring of code and scale buffers
SMS = 132         # streaming multiprocessors of the H200 (the split-K choice fills waves of them)
PRODUCER_REGISTERS = 112
_ARG_DTYPES = ("*bf16", "*i32", "*i32", "*fp32", "*i32", "*fp32")  # x (pair order), codes, E4M3 scales, gs, layer, y


def applies(m: int, w, x_dtype) -> bool:
  """Whether :func:`forward` takes ``x [m, K]`` (dtype ``x_dtype``) and ``w``: NVFP4 ``[K, N]`` (or a
  stack), bf16 x, ``K`` a multiple of 64, ``N`` of :data:`BLOCK_N`, an sm_90 GPU and the FFI launcher."""
  if not isinstance(w, nvfp4.NVFP4Tensor) or jnp.dtype(x_dtype) != jnp.bfloat16 or m < 1:
    return False
  k, n = w.shape
  if k % 64 or n % BLOCK_N:
    return False
  return bool(w4_gluon._gpu_devices()) and w4_gluon._wgmma_gpus() and w4_gluon.available() \
      and w4_gluon.launcher() == "ffi"


def x_in_pair_order(x: jax.Array) -> jax.Array:
  """``x [M, K]`` with bits 0 and 1 of k swapped (k = 4 j + 2 a + b -> 4 j + 2 b + a), the order of the
  decoded operand's k-pairs (an XLA permutation, K a multiple of 4)."""
  m, k = x.shape
  return x.reshape(m, k // 4, 2, 2).swapaxes(-1, -2).reshape(m, k)


@functools.lru_cache(maxsize=None)
def _kernel(decode_order: bool):
  """Builds the kernel (imports triton lazily)."""
  from triton.experimental import gluon
  from triton.experimental.gluon import language as ttgl
  from triton.experimental.gluon.language.nvidia import hopper
  from triton.experimental.gluon.language.nvidia.ampere import async_copy
  from triton.experimental.gluon.language.nvidia.hopper import mbarrier

  asm = ttgl.constexpr(w4_gluon._asm(decode_order=decode_order, scale_bytes=True))

  @gluon.jit
  def producer(x_ptr, p_ptr, s_ptr, a_smem, b_smem, a_ready, b_ready, empty, n0, m0, k_row0, s_row0, layer,
               M: ttgl.constexpr, N: ttgl.constexpr, K: ttgl.constexpr, BM: ttgl.constexpr, BN: ttgl.constexpr,
               STEPS: ttgl.constexpr, S: ttgl.constexpr, CS: ttgl.constexpr):
    W: ttgl.constexpr = BN // 4  # code words a row of the tile (4 columns a word)
    NW: ttgl.constexpr = N // 4
    # codes of the even and the odd code rows, each [4 groups of 8 code rows (one block-scale row each), 4 row
    # pairs, W words]: warp g takes group g, lane w word w (128 contiguous bytes a warp and row)
    cl: ttgl.constexpr = ttgl.BlockedLayout([1, 4, 1], [1, 1, 32], [4, 1, 1], [2, 1, 0])
    gg = ttgl.arange(0, 4, layout=ttgl.SliceLayout(1, ttgl.SliceLayout(2, cl)))
    pp = ttgl.arange(0, 4, layout=ttgl.SliceLayout(0, ttgl.SliceLayout(2, cl)))
    ww = ttgl.arange(0, W, layout=ttgl.SliceLayout(0, ttgl.SliceLayout(0, cl)))
    row = ttgl.expand_dims(ttgl.expand_dims(gg * 8, 1) + ttgl.expand_dims(pp * 2, 0), 2)  # [4, 4, 1]: row 2 j
    c_offs = (row + k_row0) * NW + ttgl.expand_dims(ttgl.expand_dims(ww + n0 // 4, 0), 0)
    sl: ttgl.constexpr = ttgl.SliceLayout(1, cl)  # scales [4 groups, W words]
    sg = ttgl.arange(0, 4, layout=ttgl.SliceLayout(1, sl))
    sw = ttgl.arange(0, W, layout=ttgl.SliceLayout(0, sl))
    s_offs = ttgl.expand_dims(sg + s_row0, 1) * NW + ttgl.expand_dims(sw + n0 // 4, 0)
    # x [BM, 64] (pair order): 16 contiguous bytes a copy; rows past M read row M - 1 (never stored)
    xl: ttgl.constexpr = ttgl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    xm = ttgl.arange(0, BM, layout=ttgl.SliceLayout(1, xl))
    xk = ttgl.arange(0, 64, layout=ttgl.SliceLayout(0, xl))
    x_offs = ttgl.expand_dims(ttgl.minimum(xm + m0, M - 1), 1) * K + ttgl.expand_dims(xk + (k_row0 - layer * (K // 2)) * 2, 0)
    rl: ttgl.constexpr = ttgl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
    rl2: ttgl.constexpr = ttgl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    c_smem = ttgl.allocate_shared_memory(ttgl.int32, [2 * CS, 4, 4, W], rl)  # even rows at 2 slot, odd at 2 slot + 1
    s_smem = ttgl.allocate_shared_memory(ttgl.int32, [CS, 4, W], rl2)
    bw_layout: ttgl.constexpr = ttgl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    for j in ttgl.static_range(CS - 1):
      jj = min(j, STEPS - 1)
      async_copy.async_copy_global_to_shared(c_smem.index(2 * j), p_ptr + c_offs + jj * (32 * NW))
      async_copy.async_copy_global_to_shared(c_smem.index(2 * j + 1), p_ptr + c_offs + (jj * 32 + 1) * NW)
      async_copy.async_copy_global_to_shared(s_smem.index(j), s_ptr + s_offs + jj * (4 * NW))
      async_copy.commit_group()
    for i in range(STEPS):
      st = i % S
      mbarrier.wait(empty.index(st), ((i // S) & 1) ^ 1)
      async_copy.async_copy_global_to_shared(a_smem.index(st), x_ptr + x_offs + i * 64)
      async_copy.mbarrier_arrive(a_ready.index(st), increment_count=False)
      nxt = ttgl.minimum(i + CS - 1, STEPS - 1)
      ns = (i + CS - 1) % CS
      async_copy.async_copy_global_to_shared(c_smem.index(2 * ns), p_ptr + c_offs + nxt * (32 * NW))
      async_copy.async_copy_global_to_shared(c_smem.index(2 * ns + 1), p_ptr + c_offs + (nxt * 32 + 1) * NW)
      async_copy.async_copy_global_to_shared(s_smem.index(ns), s_ptr + s_offs + nxt * (4 * NW))
      async_copy.commit_group()
      async_copy.wait_group(CS - 1)  # this thread's copies of step i have landed
      cs = i % CS
      ce = c_smem.index(2 * cs).load(cl)  # code rows 2 j
      co = c_smem.index(2 * cs + 1).load(cl)  # and 2 j + 1
      sc = s_smem.index(cs).load(sl)
      s4 = ttgl.broadcast(ttgl.expand_dims(sc, 1), ce)[0]
      o0, o1, o2, o3, o4, o5, o6, o7 = ttgl.inline_asm_elementwise(
          asm, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r", [ce, co, s4], dtype=(ttgl.int32,) * 8, is_pure=True, pack=1)
      # [g, p, w] x (nibble, column q) -> rows n = 4 w + q, words 8 g + 2 p + nibble of the K-major tile
      lo = ttgl.reshape(ttgl.permute(ttgl.join(ttgl.join(o0, o1), ttgl.join(o2, o3)), [0, 1, 2, 4, 3]), [4, 4, W, 4])
      hi = ttgl.reshape(ttgl.permute(ttgl.join(ttgl.join(o4, o5), ttgl.join(o6, o7)), [0, 1, 2, 4, 3]), [4, 4, W, 4])
      t = ttgl.permute(ttgl.join(lo, hi), [2, 3, 0, 1, 4])  # [w, q, g, p, nibble]
      b_smem.index(st)._reinterpret(ttgl.int32, [BN, 32], bw_layout).store(ttgl.reshape(t, [BN, 32]))
      hopper.fence_async_shared()
      mbarrier.arrive(b_ready.index(st), count=1)

  @gluon.jit
  def mma_loop(a_smem, b_smem, a_ready, b_ready, empty, BM: ttgl.constexpr, BN: ttgl.constexpr,
               STEPS: ttgl.constexpr, S: ttgl.constexpr):
    mma: ttgl.constexpr = ttgl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    acc = ttgl.zeros([BM, BN], ttgl.float32, layout=mma)
    for i in range(STEPS):
      st = i % S
      ph = (i // S) & 1
      mbarrier.wait(a_ready.index(st), ph)
      mbarrier.wait(b_ready.index(st), ph)
      hopper.fence_async_shared()
      acc = hopper.warpgroup_mma(a_smem.index(st), b_smem.index(st).permute((1, 0)), acc, is_async=True)
      acc = hopper.warpgroup_mma_wait(1, deps=[acc])
      mbarrier.arrive(empty.index((i + S - 1) % S), count=1, pred=i > 0)
    acc = hopper.warpgroup_mma_wait(0, deps=[acc])
    return (acc,)

  @gluon.jit
  def w4a16_ws(x_ptr, p_ptr, s_ptr, gs_ptr, idx_ptr, o_ptr, M: ttgl.constexpr, N: ttgl.constexpr,
               K: ttgl.constexpr, L: ttgl.constexpr, BM: ttgl.constexpr, BN: ttgl.constexpr, KS: ttgl.constexpr,
               S: ttgl.constexpr, CS: ttgl.constexpr, PR: ttgl.constexpr):
    pid_n = ttgl.program_id(0)
    pid_m = ttgl.program_id(1)
    pid_s = ttgl.program_id(2)
    layer = ttgl.minimum(ttgl.maximum(ttgl.load(idx_ptr), 0), L - 1)
    gs = ttgl.load(gs_ptr + layer)
    STEPS: ttgl.constexpr = KS // 64
    a_layout: ttgl.constexpr = ttgl.NVMMASharedLayout.get_default_for([BM, 64], ttgl.bfloat16)
    b_layout: ttgl.constexpr = ttgl.NVMMASharedLayout.get_default_for([BN, 64], ttgl.bfloat16)
    a_smem = ttgl.allocate_shared_memory(ttgl.bfloat16, [S, BM, 64], a_layout)
    b_smem = ttgl.allocate_shared_memory(ttgl.bfloat16, [S, BN, 64], b_layout)
    a_ready = ttgl.allocate_shared_memory(ttgl.int64, [S, 1], mbarrier.MBarrierLayout())
    b_ready = ttgl.allocate_shared_memory(ttgl.int64, [S, 1], mbarrier.MBarrierLayout())
    empty = ttgl.allocate_shared_memory(ttgl.int64, [S, 1], mbarrier.MBarrierLayout())
    for j in ttgl.static_range(S):
      mbarrier.init(a_ready.index(j), count=128)  # every producer thread's copies (cp.async, no increment)
      mbarrier.init(b_ready.index(j), count=1)
      mbarrier.init(empty.index(j), count=1)
    n0 = pid_n * BN
    k_row0 = layer * (K // 2) + pid_s * (KS // 2)
    s_row0 = layer * (K // 16) + pid_s * (KS // 16)
    acc = ttgl.warp_specialize(
        [(mma_loop, (a_smem, b_smem, a_ready, b_ready, empty, BM, BN, STEPS, S)),
         (producer, (x_ptr, p_ptr, s_ptr, a_smem, b_smem, a_ready, b_ready, empty, n0, pid_m * BM, k_row0, s_row0,
                     layer, M, N, K, BM, BN, STEPS, S, CS))],
        [4], [PR])[0]
    out = acc * (256.0 / gs)  # 2**8 undoes the decode's 2**-8
    st: ttgl.constexpr = ttgl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])
    out = ttgl.convert_layout(out, st)
    rows = ttgl.arange(0, BM, layout=ttgl.SliceLayout(1, st)) + pid_m * BM
    cols = ttgl.arange(0, BN, layout=ttgl.SliceLayout(0, st)) + n0
    mask = ttgl.expand_dims(rows < M, 1) & ttgl.expand_dims(cols >= 0, 0)
    ttgl.atomic_add(o_ptr + ttgl.expand_dims(rows, 1) * N + ttgl.expand_dims(cols, 0), out, mask=mask, sem="relaxed")

  return w4a16_ws


def _splits(m_tiles: int, k: int, n: int, per_sm: int) -> int:
  """Split-K parts: the fewest (a divisor of K's steps of 64, each part at least 4 steps) whose programs fill
  at least 85% of their last wave of :data:`SMS` x ``per_sm`` slots (fewer parts, less float32 atomic
  traffic), else the best filling."""
  steps, tiles, slots = k // 64, m_tiles * (n // BLOCK_N), SMS * per_sm
  best, best_fill = 1, 0.0
  for s in range(1, steps + 1):
    if steps % s or steps // s < 4:
      continue
    programs = tiles * s
    fill = programs / (-(-programs // slots) * slots)
    if fill >= 0.85:
      return s
    if fill > best_fill + 1e-9:
      best, best_fill = s, fill
  return best


def _build(m: int, k: int, n: int) -> tuple[int, int, int, int]:
  """``(BM, splits, register cap, stages)`` for ``x [m, k]`` and a ``[k, n]`` weight: 64-row tiles at M <= 64
  (two programs an SM: 3 stages, 128 registers), else 128-row tiles (one an SM)."""
  if m <= 64:
    return 64, _splits(1, k, n, 2), 128, 3
  bm = 128
  return bm, _splits(-(-m // bm), k, n, 1), 200, STAGES


@functools.lru_cache(maxsize=None)
def _compiled(meta: tuple, decode_order: bool, cap: int):
  return w4_gluon._load(w4_gluon._compile_gluon(_kernel(decode_order), _ARG_DTYPES, dict(meta),
                                                w4_gluon._target_cc(), num_warps=4, maxnreg=cap))


def forward(x: jax.Array, w: nvfp4.NVFP4Tensor, *, out_dtype=None, index=None) -> jax.Array:
  """``x @ W`` by the warp-specialized kernel (GPU only).

  Args:
    x: bf16 ``[M, K]``.
    w: :class:`~qerl_jax.nvfp4.NVFP4Tensor` ``[K, N]`` (either code order), or with ``index`` a stack
      ``[L, K, N]``.
    out_dtype: output dtype (default bf16); accumulation is float32.
    index: int32 scalar (may be traced): layer of the stack, clamped to ``[0, L)`` in the kernel.

  Returns:
    ``[M, N]`` in ``out_dtype``.

  Raises:
    ValueError: a shape :func:`applies` rejects, or ``index`` with an unstacked weight (or none with a stack).
  """
  m, k = x.shape
  if not applies(m, w, x.dtype) or w.shape[0] != k:
    raise ValueError(f"w4_gluon_ws.forward: no kernel for x {x.dtype}{list(x.shape)} and weight "
                     f"{type(w).__name__} {list(getattr(w, 'shape', ()))} (needs an sm_90 GPU with the FFI "
                     f"launcher, bf16 x, NVFP4, K % 64 == 0, N % {BLOCK_N} == 0)")
  if (index is None) != (w.packed.ndim == 2):
    raise ValueError(f"w4_gluon_ws.forward: index={index!r} with packed codes of shape {w.packed.shape}")
  n = w.shape[1]
  bm, splits, cap, stages = _build(m, k, n)
  m_tiles = -(-m // bm)
  layers = 1 if index is None else w.packed.shape[0]
  meta = dict(M=m, N=n, K=k, L=layers, BM=bm, BN=BLOCK_N, KS=k // splits, S=stages, CS=CODE_STAGES,
              PR=PRODUCER_REGISTERS)
  codes, scales, gs, idx = w4_triton._layer_operands(w, w4_triton._format_of(w), index)
  ptx, name, shared = _compiled(tuple(meta.items()), w.code_order == "decode", cap)
  y = jax.ffi.ffi_call(w4_gluon._FFI_TARGET, jax.ShapeDtypeStruct((m, n), jnp.float32))(
      x_in_pair_order(x), codes, scales, gs, idx,
      **w4_gluon._launch_attrs(ptx, name, (n // BLOCK_N, m_tiles, splits), shared, threads=256,
                               zero_results=True))
  return y.astype(out_dtype or x.dtype)
