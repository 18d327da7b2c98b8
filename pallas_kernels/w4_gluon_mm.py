"""Large-M forward ``y = x @ W (+ addend)`` for NVFP4 weights in Gluon (Triton 3.6, Hopper wgmma), no bf16 W in HBM.

The prefill and training forward of the model's linears (M = batch x sequence, in the thousands):
``y [M, N] = x [M, K] @ W`` for bf16 ``x`` and an NVFP4 ``W`` ``[K, N]`` (or layer ``index`` of a stack
``[L, K, N]``, read in place), float32 accumulation, bf16 output. Dequantize + cuBLAS
(:func:`pallas_kernels.w4_triton.dequantize`, then one GEMM) writes a transient bf16 copy of ``W`` per call; this
kernel reads the 4-bit codes once per tile and decodes them in registers, where they are wgmma's A operand (the
structure of CUTLASS's Hopper mixed-input GEMM, which session 45 measured at 0.92-0.94x of bf16 with int4 weights).
:func:`pallas_kernels.matmul.kernel_forward` sends bf16 products at ``64 < M <= MAX_M`` here where :func:`pays`
(``matmul.GLUON_MM``). On an H100 (session 46, 7B shapes summed) it runs at 0.95x of bf16 at M = 2048, where
dequantize + cuBLAS is at 0.84x (docs/kernels.md, "Large-M forward"; docs/benchmarks.md, "Session 46").

It computes ``y^T [N, M] = W^T [N, K] @ x^T [K, M]`` (swap-AB): a tile is ``BN`` (128) rows of ``W^T`` (columns of
``W``, two warpgroups of 64) by ``BM`` (256) rows of ``x``, over K in steps of 64. With :data:`PERSISTENT` one
program runs an SM and walks the tiles, the rows of ``x`` fastest (the programs sharing a weight tile run together).

* A **producer** warp (Triton pads it to a warpgroup: 384 threads) copies each step's ``x [BM, 64]`` (128-byte
  swizzle; rows past M arrive as zeros), codes ``[32 code rows, BN]`` (128-byte swizzle) and E4M3 block scales
  ``[4, BN]`` by TMA into a ring of :data:`STAGES` stages, one mbarrier each.
* The **MMA partition** (8 warps) waits for a stage, reads the codes as 16-bit column pairs (``ldmatrix``) and the
  scales in the layout of wgmma's register A operand (``k_width`` 2: a thread's register pair is one code byte, the
  nibbles ``k, k + 1``), decodes them with inline PTX (:func:`_asm2`, or :func:`_asm_decode_order` for
  :func:`qerl_jax.nvfp4.to_decode_order`'s codes, read in place: E2M1 by bit placement, ``e2m1 * 2**-126``, times
  the block scale as bf16 ``scale * 2**118``: exact) and runs ``m64 n256 k16`` wgmmas with ``x`` from shared memory
  (K-major), one step's left in flight while the next decodes (steps in pairs, with two operand values, so an
  in-flight wgmma's registers are never the next decode's). The operand rows are the columns of ``W`` relabelled
  so that a thread's two rows ``g, g + 8`` are adjacent columns; the store undoes it.
* The **epilogue** multiplies by ``2**8 / global scale``, adds the optional bf16 ``addend`` in float32 and rounds
  once to bf16 (cuBLAS's ``C`` with ``beta = 1``), while the producer already fills the ring for the next tile.
* **Split-K** (:data:`MAX_SPLITS`, 8 by default since session 47): a shape whose tiles leave SMs idle (fewer tiles
  than SMs, as the 7B q/k/v, o and down projections at M = 256: 36, 28, 28 tiles on 132 SMs; or a last round that
  fills few SMs, as the 7B q/k/v at M = 2048: 288 tiles, 2.18 rounds) splits the tiles of its last, partial round
  (or all of them) into ``SK`` units along K (:func:`plan_for`). Each unit adds its float32 part into float32 tail
  columns that XLA zeroed (``atom.global.add.v2.f32``), and XLA adds the addend and rounds them to bf16 into the
  output once; the whole tiles before them store bf16 as above.

GPU only (sm_90), launched through :mod:`pallas_kernels.w4_gluon`'s XLA FFI handler (its TMA spec's extended form:
two-byte elements and the swizzle).
"""

from __future__ import annotations

import functools
import os
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import w4_gluon, w4_triton
from qerl_jax import nvfp4


def _env_int(name: str, default: int) -> int:
  """The integer in environment variable ``name`` (``default`` when unset).

  Raises:
    ValueError: the variable holds something other than a non-negative integer.
  """
  value = os.environ.get(name, str(default))
  if not value.isdigit():
    raise ValueError(f"{name}={value!r}; expected a non-negative integer")
  return int(value)


BLOCK_N = 128   # columns of W a program: the two warpgroups' m64 wgmma rows
BLOCK_M = 256   # rows of x a program: the wgmma's N
SMALL_M_MAX = 128  # M <= this takes a narrow tile of 64 rows of x (M <= 64: m64 n64 wgmmas) or 128 (m64 n128), where
                   # the 256-row tile multiplies more zero rows than rows of x. matmul's dispatch sends bf16 products of
                   # NARROW_MIN_M < M <= this here instead of to the decode GEMV (w4_gluon; a decode step's accumulated
                   # projections excepted). H100, session 47, 7B shapes summed, decode-order codes: M = 64 1.39x of
                   # bf16 against the GEMV's 1.09x, M = 128 1.15x against 0.76x (32B: 1.60x / 1.13x, 1.26x / 0.68x).
                   # 0: off
NARROW_MIN_M = 32  # at M <= this the decode GEMV stays: M = 32 1.65x of bf16 against the narrow tile's 1.47x (7B, H100)
NARROW_SMALL_WEIGHTS = 1 << 24  # (session 50) at NARROW_MIN_M < M <= 64 weights of at most this many values (K x N:
                                # the 7B q/k/v, 16.5M, and o, 12.8M) stay on the decode GEMV where it runs. Measured
                                # at M = 64, decode-order codes, lab harness: q/k/v 12.3 against the narrow tile's
                                # 13.3 us (H200, session 49), 12.9 against 14.0 (H100, session 50); o 12.2-12.4
                                # against 12.8-13.0 (H100, sessions 49-50). 0: off
NARROW_SMALL_MAX_M = 64  # the rows up to which NARROW_SMALL_WEIGHTS applies (the 64-row narrow tile's)
NARROW_SMALL_WIDE_MAX_M = 0  # lab (session 56): at 64 < M <= this, weights of at most NARROW_SMALL_WEIGHTS values
                             # take the 128-row narrow tile (past SMALL_M_MAX too) instead of the 256-row one: twice
                             # the tiles, where the 256-row ones leave SMs idle. H100, 256: the kernels alone faster
                             # (lab harness, 7B summed at M = 256 211.6 -> 206.8 us; q/k/v 30.1 -> 26.2, o 22.1 ->
                             # 21.4; bench_kernels with every weight narrow: q/k/v 25.6 against 30.4, o 21.3 against
                             # 22.1, gate/up and down slower), but batch-256 decode steps no faster (10.393 / 10.385 /
                             # 10.368 ms against 10.362 / 10.327 / 10.368 off), hence off. 0: off. (Session 57's
                             # profile: in a rollout the 7B q/k/v ran on dequantize + cuBLAS, never here; since
                             # session 58 decoder.FUSED_ATTENTION_BF16_QKV sends them here, and batch-256 steps
                             # with 256 took 10.120 / 10.151 ms against 10.162 / 10.139 at 0: still no gain.)
SMALL_WEIGHT_ROWS = 128  # lab (session 56): the row tile of those small weights, 128 or 64 (m64 n64 wgmmas,
                         # NARROW_PER_SM programs an SM). 64: q/k/v faster at M = 192 (21.4 against 26.3 us), slower at
                         # 128 and 256 (21.8 / 29.4 against 19.0 / 26.2), a batch-128 step 6.236 against 6.169 ms
STEP_K = 64     # contraction a step (4 wgmma k16 blocks; 4 NVFP4 blocks)
STAGES = 4      # the shared-memory ring (x 32 KB + codes 4 KB + scales 0.5 KB a stage)
SMALL_STAGES = 8  # the narrow tiles' ring (x 8 or 16 KB a stage: up to 16 or 10 stages fit). At small M the weight
                  # stream is the bytes: 8 stages against 4, 7B gate/up at M = 8 51.8 against 60.4 us, M = 64 55.4
                  # against 58.8 (H100, session 47); 16 no faster than 8 (M = 32, 64)
LOAD_REGS = 40  # registers a thread of the one-warp TMA producer partition (setmaxnreg)
DECODE = 2      # the decode's PTX: 2 (_asm2, 16-bit column pairs in), 3 (the same, its shift on the FMA pipe) or 1
                # (_asm, bytes in; session 46's first build); lab: 4 or 5 forces the paired decode below at every M.
                # Under 2 or 3, decode-order codes take NARROW_DECODE / WIDE_DECODE
# The paired decode (session 53; _asm_decode_order_paired) of decode-order codes: the GEMV's nibble pairing, one mask
# or shift-and-mask isolating a nibble of code rows r and r + 4 at once. 4: wgmma then sees K rows 2t + 1 and 2t + 8
# of each 16 swapped, which XLA undoes on x first (x_in_nibble_pair_order; main loop 360 -> 256 SASS instructions);
# 5: four prmt pair the registers back by K row in the kernel, x read as it is (288 instructions); 2 (or 3): unpaired.
NARROW_DECODE = 4  # the narrow tiles' (M <= SMALL_M_MAX). H200, 7B q/k/v + o + gate/up + down summed: M = 64 1.122x of
                   # bf16 against 1.063x unpaired, M = 128 0.965x against 0.901x; decode steps at batch 64 / 128
                   # 4.831 / 7.095 ms against 5.010 / 7.316. H100: 5 is faster on q/k/v, o and down (31.9 against
                   # 32.7 us at M = 64) but slower on the fused gate/up (52.8 against 51.1), and a batch-64 step took
                   # 4.332 / 4.314 ms with 5 against 4.252 / 4.285 with 4
WIDE_DECODE = 5  # the wide tiles' (M > SMALL_M_MAX; 4 is not taken there: x's permute is a pass over [M, K]). H100,
                 # M = 2048, 7B summed: 1.003x of bf16 against 0.988x unpaired (one run; with 4 0.989x, and on the H200
                 # 0.945x against 0.985x). Session 54 (H100): ahead by 2.5-4.3% at M = 256 / 2048 / 4096, 7B and 32B
NARROW_REPAIR_MAX_N = 8192  # narrow tiles of weights with at most this many columns (the 7B and 32B q/k/v, o and
                            # down; not the fused gate/up) take the repaired form (5: x read as it is) instead of
                            # NARROW_DECODE, so that no permute of x runs for them: in a decode step each is its own
                            # XLA kernel (1.8 / 1.8 / 4.0 us a layer after the input norm, attention and SwiGLU at
                            # batch 128, H100 profile, session 54). Session 55 (H100): 7B summed 1.526x -> 1.564x of
                            # bf16 at M = 64, 1.321x -> 1.356x at 128 (with TAIL_MEMSET); batch-64 / 128 steps 4.456 /
                            # 6.313 -> 4.440 / 6.250 ms and 4.461 / 6.280 -> 4.434 / 6.236. 0: every narrow tile takes
                            # NARROW_DECODE
PAIRED_X_PERMUTE = 1  # lab (session 52): 0 has forward take x already in DECODE 4's K order (a timing probe of the
                      # kernel alone: the caller permutes, as a producer kernel would write it)
TAIL_MEMSET = 1  # the FFI launcher zeroes the split-K tail's float32 columns (a memset node, zero_results bit 1).
                 # 0: XLA makes them, one zero buffer for the whole unrolled decode step copied into each call's
                 # aliased operand (a batch-128 step's H100 profile, session 54: 3 memcpy128 kernels a layer, 3.5 us
                 # each, o, down and gate/up's tail). Session 55 (H100): batch-64 / 128 decode steps 4.472 / 6.348 ->
                 # 4.456 / 6.313 ms and 4.477 / 6.339 -> 4.461 / 6.280 (two alternating runs); the kernels alone
                 # (7B summed) 1.493x -> 1.526x of bf16 at M = 64, unchanged at M = 256 and 2048
# The dispatch's cost model (pays): this kernel's time is rounds x steps x STEP_US, a round being one tile on every
# SM and a step 64 of K; dequantize + cuBLAS takes DEQUANT_US_PER_MILLION microseconds a million weights plus a bf16
# GEMM of GEMM_FIXED_US plus the larger of its FLOPs at BF16_TFLOPS and its weight's bytes at HBM_TBPS. Fitted to
# session 46's H100 runs (bench_kernels.py, 7B and 32B shapes, M = 256-2048: the kernel's step 0.63-0.70 us, the
# dequantize 0.95-1.03 us a million weights, cuBLAS's small-M GEMMs 20-40 us above their FLOPs or bytes): it picks
# the faster path in 21 of 24 rows, and the three misses cost 4-12%. An H200 reads HBM faster, which favours
# dequantize + cuBLAS a little.
STEP_US = 0.69
SMALL_STEP_US = {128: 0.45, 64: 0.35}  # the narrow tiles' steps: guesses made before any GPU run (the wgmmas a half or
                                       # a quarter of STEP_US's); session 47's rows give about 0.4-0.5 us on the large
                                       # matrices. Only plan_for reads them: the narrow dispatch skips pays
DEQUANT_US_PER_MILLION = 1.0
GEMM_FIXED_US = 30.0
BF16_TFLOPS = 800.0
HBM_TBPS = 3.0
PROBE = 0       # lab (wrong results): 1 skips the shared loads and the decode (a constant operand); 2 masks every store
                # off, after which the compiler may drop the MMAs too (read it as a decode-and-copies-only probe);
                # 3 copies no x into the ring and 4 no codes or block scales (the stages keep what they held)
PERSISTENT = 1  # 1: one program an SM walking the tiles (the producer runs into the next tile during a store)
IN_FLIGHT = 1   # wgmmas left in flight past each step (1: the next step's decode overlaps it; 0: wait for it)
RELEASE_PAIRS = 0  # lab (session 48): 1 releases the ring's stages in pairs (one mbarrier arrive, and the MMA warps'
                   # two barriers around it, every other step) where the ring and every unit's steps are even, with
                   # IN_FLIGHT 1 (the kernel's IF 2)
WAIT_SYNC = 0  # (session 49) 0 deletes from the PTX the barrier across the 8 MMA warps (bar.sync 0, 256) that
               # Triton's shared-memory analysis puts before each wait on a ring stage's ready barrier (it does so
               # before every mbarrier operation of a multi-warp partition). Only the barrier before the release
               # (mbarrier.arrive by one thread) orders anything: both warpgroups' wgmmas must have read the stage.
               # Half the MMA warps' barriers a step (narrow tiles: two a step; session 48's offline SASS)
WARPGROUP_RELEASE = 1  # (session 49) 1 releases a ring stage by one arrive from each of the two MMA warpgroups
                       # (its empty barrier's count 2; the PTX's arrive by thread 0 after a barrier across both
                       # warpgroups rewritten to one by threads 0 and 128, with no barrier), as CUTLASS's sm90 pipelines
                       # do: a warpgroup's wgmma wait retires its reads of the stage. With WAIT_SYNC 0, no barrier a step
PREFETCH_CODES = 0  # lab (session 49): 1 loads each step's codes and block scales from shared memory a step ahead of
                    # their decode (the kernel's PF), in the forward with IN_FLIGHT 1 and DECODE 2 or 3, on the narrow
                    # tiles only: session 49 found their step bound by the decode's latency, not its issue slots.
                    # Session 50 (H100, 7B summed): slower, 1.382x / 1.185x of bf16 at M = 64 / 128 against 1.433x / 1.199x
# Split-K: up to this many K splits a tile of the last, partial round of tiles (or of every tile), chosen by the cost
# model (plan_for), their float32 parts added by atomics into zeroed tail columns that XLA rounds to bf16; for shapes
# whose tiles leave SMs idle (7B down at M = 256: 28 tiles on 132 SMs, 0.31x of bf16 unsplit). H100, session 47, 7B
# shapes summed (8 against 1): M = 256 0.87x of bf16 against 0.50x, 512 0.87x / 0.72x, 1024 0.946x / 0.922x, 2048
# 0.953x / 0.939x, 4096 0.933x / 0.908x; 32B M = 256-2048 0.93-0.98x against 0.67-0.91x. 1: off (also under a fixed
# summation order, QERL_GLUON_DETERMINISTIC=1). QERL_GLUON_MM_MAX_SPLITS in the environment sets it at import.
MAX_SPLITS = _env_int("QERL_GLUON_MM_MAX_SPLITS", 8)
NARROW_PER_SM = 1  # lab (session 48): programs an SM for the 64-row narrow tiles (2: twice the warps a scheduler to
                   # hide the decode's latency, at half the registers a thread and ring of SMALL_STAGES // 2)
RASTER_GROUP = 0  # lab (session 47; GPU-tested, not timed): > 0 walks the whole tiles in groups of this many x row
                  # tiles (the row tiles fastest within a group), so that the tiles running at once share fewer rows
                  # of x: at M = 8192 x [8192, 3584] (58 MB) outgrows the L2 and the default order (row tiles
                  # fastest over all of M) reads all of it again for every few column tiles. 0: that default order
MAX_M = 4096    # the most rows matmul.kernel_forward sends here (GLUON_MM): at M = 8192 dequantize + cuBLAS was
                # faster (0.955x of bf16 against 0.90x, 7B shapes summed, H100, session 46); at M = 2048 this kernel
                # (0.95x against 0.84x)
# The TMA descriptors (the launcher's extended spec, gluon_launch.cc): (operand, element type, box, element bytes,
# swizzle): x [M, K] in boxes of [BM, 64] (128-byte swizzle, wgmma's B operand), codes [L K / 2, N] in [32, BN]
# (128-byte swizzle: a thread's 2-byte loads of 4 code rows hit 4 banks), block scales [L K / 16, N] in [4, BN];
# the dx build's: dy [M, N] in [BM, 64] (swizzled as x), codes in [BN / 2, 64] (64-byte swizzle), block scales in
# [BN / 16, 64]
_SWIZZLE_BYTES = {0: 0, 2: 64, 3: 128}


def _boxes(bm: int = BLOCK_M, dx: bool = False) -> tuple:
  """The TMA descriptors' ``(operand, element type, box, element bytes, swizzle)`` for ``bm`` rows of x (dy) a tile,
  the forward's or the dx build's."""
  if dx:
    return ((0, "bf16", (bm, 64), 2, 3), (1, "u8", (BLOCK_N // 2, 64), 1, 2), (2, "u8", (BLOCK_N // 16, 64), 1, 0))
  return ((0, "bf16", (bm, 64), 2, 3), (1, "u8", (32, BLOCK_N), 1, 3), (2, "u8", (4, BLOCK_N), 1, 0))


def _descriptor_types(boxes) -> tuple[str, ...]:
  """The kernel signature's types of the TMA descriptors ``boxes`` (Triton's host tensor descriptors)."""
  return tuple(f"tensordesc<{t}[{r}, {c}],NVMMASharedLayout(swizzle_byte_width={_SWIZZLE_BYTES[sw]}, "
               f"element_bitwidth={8 * eb}, rank=2)>" for _, t, (r, c), eb, sw in boxes)


# descriptors, then x (dy), codes, block scales (E4M3 bytes), global scales, layer, addend (read with AD = 1), the
# zeroed split-tail operand (aliased to the last result; the kernel uses the result's pointer), then the results: out
# (bf16) and the split tail's float32 columns
_POINTERS = ("*bf16", "*u8", "*u8", "*fp32", "*i32", "*bf16", "*fp32", "*bf16", "*fp32")
# 8 MMA warps and the producer warp, which Triton pads to a warpgroup (setmaxnreg works on warpgroups): the
# kernel takes 384 threads (its .reqntid), and the launch cap must let 384 threads fit an SM's registers
_THREADS = 32 * 12


def applies(m: int, w, x_dtype) -> bool:
  """Whether :func:`forward` takes ``x [m, K]`` (dtype ``x_dtype``) times ``w``: an NVFP4 ``[K, N]`` weight
  (or stack) in either code order, bf16 ``x``, ``m >= 1``, ``K`` a multiple of 64, ``N`` a multiple of 128, and
  :func:`pallas_kernels.w4_gluon.large_m_ready` (every visible GPU sm_90, the FFI launcher)."""
  if not isinstance(w, nvfp4.NVFP4Tensor) or jnp.dtype(x_dtype) != jnp.bfloat16:
    return False
  k, n = w.shape
  if m < 1 or k % STEP_K or n % BLOCK_N:
    return False
  return w4_gluon.large_m_ready()


# The forward's decode PTXs all open with these lines: ``z`` = 0, ``nz`` = bf16x2 -0.0 (the FMA's addend), and
# ``s0`` / ``s1`` = the E4M3 block scale of column n / n + 1 (``$5`` bytes 0, 1) as bf16 ``scale * 2**118`` in both
# halves (float16 bits shifted right by 3 plus 230 on the exponent; :func:`_asm`). The PTX declares ``sl`` (b16) and
# ``z, nz, sp, s0, s1`` (b32).
_SCALES_PTX = ("mov.b32 z, 0;", "mov.b32 nz, 0x80008000;",
               "cvt.u16.u32 sl, $5;", "cvt.rn.f16x2.e4m3x2 sp, sl;", "shr.b32 sp, sp, 3;", "add.u32 sp, sp, 0x73007300;",
               "prmt.b32 s0, sp, z, 0x1010;", "prmt.b32 s1, sp, z, 0x3232;")


def _asm() -> str:
  """Inline PTX for four code bytes ``$4`` = (column n, code row r), (n + 1, r), (n, r + 4), (n + 1, r + 4)
  and their E4M3 block scales ``$5`` (bytes 0, 1: columns n, n + 1; one NVFP4 block holds rows r and r + 4)
  -> four registers of wgmma's A operand, each a code byte's two values (low nibble: K row 2 r, in the low
  half; high nibble: 2 r + 1): ``$0`` column n, row r; ``$1`` column n, row r + 4; ``$2`` column n + 1, row r;
  ``$3`` column n + 1, row r + 4. Each value is bf16 ``e2m1 * scale * 2**-8`` (exact).

  A byte ``b`` of ``u = b | b' << 8`` goes to ``w = u | u << 12`` (its low nibble at bits 0-3, its high
  nibble at 16-19; ``b'`` lands only on bits the masks drop), then one shift and mask put the magnitudes
  on bits 6-8 of each half and another the signs on bit 15 (``e2m1 * 2**-126``), and one bf16x2 multiply
  by the column's scale in both halves finishes it. The scales: ``cvt.rn.f16x2.e4m3x2`` (exact), float16
  bits shifted right by 3 plus 230 on the exponent = bf16 ``scale * 2**118`` (as
  :data:`pallas_kernels.w4_gluon._SCALE_F16_ASM`)."""
  lines = ["{", ".reg .b16 sl;", ".reg .b32 u, w, m, t, z, nz, sp, s0, s1;",
           *_SCALES_PTX]
  for p, sel in ((0, "0x4410"), (1, "0x4432")):  # bytes (n, r), (n + 1, r) then (n, r + 4), (n + 1, r + 4)
    lines.append(f"prmt.b32 u, $4, z, {sel};")
    for col, out, make in ((0, p, ["shl.b32 w, u, 12;", "or.b32 w, w, u;"]),
                           (1, 2 + p, ["shr.b32 w, u, 8;", "shl.b32 t, u, 4;", "or.b32 w, w, t;"])):
      lines += make
      lines += ["shl.b32 m, w, 6;", "and.b32 m, m, 0x01C001C0;", "shl.b32 t, w, 12;", "and.b32 t, t, 0x80008000;",
                "or.b32 m, m, t;", f"fma.rn.bf16x2 ${out}, m, s{col}, nz;"]
  return "\n".join(lines + ["}"])


def _asm2(shift_on_fma: bool = False) -> str:
  """:func:`_asm`'s inputs and outputs (``DECODE`` 2, the default), in about half the instructions: each code
  byte ``x`` is isolated by one ``prmt`` and placed by one multiply as ``x << 12 | x << 24`` (no bits overlap,
  so no carries), which puts the low nibble's sign on bit 15 and the high nibble's on bit 31; the magnitudes
  are the same word shifted right by 6 (bits 6-8 and 22-24), merged under two masks, then one bf16x2 multiply
  by the column's scale. About 6 instructions a register of two weights, half of them off the ALU pipe.
  ``shift_on_fma`` (``DECODE`` 3): the shift as ``mul.hi`` by 2**26, moving it from the ALU pipe to the FMA pipe."""
  lines = ["{", ".reg .b16 sl;", ".reg .b32 x, v, h, z, nz, sp, s0, s1;",
           *_SCALES_PTX]
  for out, byte, col in ((0, 0, 0), (1, 2, 0), (2, 1, 1), (3, 3, 1)):
    lines += [f"prmt.b32 x, $4, z, 0x444{byte};", "mul.lo.u32 v, x, 0x01001000;",
              "mul.hi.u32 h, v, 0x04000000;" if shift_on_fma else "shr.b32 h, v, 6;",
              "and.b32 h, h, 0x01C001C0;", "and.b32 v, v, 0x80008000;", "or.b32 v, v, h;",
              f"fma.rn.bf16x2 ${out}, v, s{col}, nz;"]
  return "\n".join(lines + ["}"])


def _asm_decode_order() -> str:
  """:func:`_asm2` for codes in :func:`qerl_jax.nvfp4.to_decode_order`'s order. That order moves bits only inside
  each code row's 16-bit pair of columns (n, n + 1), so a thread needs nothing from its neighbours: the low nibble
  of column n already sits on bf16's magnitude and sign bits (6-8, 15), its high nibble moves by one shift (19),
  column n + 1's low nibble by one (6) and its high nibble in three pieces (8, 13, 18). About 5.5 instructions a
  register of two weights, with no isolating ``prmt`` or multiply."""
  lines = ["{", ".reg .b16 sl;", ".reg .b32 u, v, t, z, nz, sp, s0, s1;",
           *_SCALES_PTX]
  for h, sel in ((0, "0x4410"), (1, "0x4432")):  # code row r, then r + 4
    lines += [f"prmt.b32 u, $4, z, {sel};",
              # column n
              "and.b32 v, u, 0x81C0;", "shl.b32 t, u, 19;", "and.b32 t, t, 0x81C00000;", "or.b32 v, v, t;",
              f"fma.rn.bf16x2 ${h}, v, s0, nz;",
              # column n + 1
              "shl.b32 v, u, 6;", "and.b32 v, v, 0x81C0;"]
    for sh, mask in ((8, "0x00400000"), (13, "0x01800000"), (18, "0x80000000")):
      lines += [f"shl.b32 t, u, {sh};", f"and.b32 t, t, {mask};", "or.b32 v, v, t;"]
    lines.append(f"fma.rn.bf16x2 ${2 + h}, v, s1, nz;")
  return "\n".join(lines + ["}"])


def _asm_decode_order_paired(repair: bool = True) -> str:
  """:func:`_asm_decode_order`'s inputs for the paired decode (:data:`NARROW_DECODE`, :data:`WIDE_DECODE`): ``$4`` holds
  code row ``r``'s 16-bit column pair (columns n, n + 1, in :func:`qerl_jax.nvfp4.to_decode_order`'s order) in its low
  half and row ``r + 4``'s in its high half. Each nibble is decoded with its partner of the other row, as the decode
  GEMV pairs them (:mod:`pallas_kernels.w4_gluon`): the decode order puts column n's low nibbles of both rows (K rows
  ``2 r``, ``2 r + 8``) on the same bits of the two halves, so one mask isolates both; its high nibbles (``2 r + 1``,
  ``2 r + 9``) and column n + 1's low ones take a shift and a mask (3 and 6), column n + 1's high ones three shifted
  pieces: 11 integer instructions for the 4 registers' bits, against about 30 in :func:`_asm_decode_order`.

  ``repair`` (``DECODE`` 5, the wide tiles' default): one ``prmt`` a register then pairs the halves back by K row, so
  the outputs are :func:`_asm_decode_order`'s (``$0``: column n, K rows ``2 r, 2 r + 1``; ``$1``:
  ``2 r + 8, 2 r + 9``; ``$2, $3`` the same for column n + 1) and ``x`` is read as it is: 15 integer instructions.
  Without it (``DECODE`` 4, session 52, the narrow tiles' default) ``$0`` holds column n's K rows ``2 r, 2 r + 8``,
  ``$1`` ``2 r + 1, 2 r + 9`` (``$2, $3`` column n + 1), so wgmma sees K rows ``2 r + 1`` and ``2 r + 8`` of each
  16-row block swapped, which :func:`x_in_nibble_pair_order` undoes on ``x``. Each half is bf16
  ``e2m1 * scale * 2**-8``, column n's scale (``$5`` byte 0) on ``$0, $1``."""
  lines = ["{", ".reg .b16 sl;", ".reg .b32 a, b, c, v, t, z, nz, sp, s0, s1;",
           *_SCALES_PTX,
           # column n, low nibbles (K rows 2 r, 2 r + 8): bits (6, 7, 8, 15) of each half already
           "and.b32 a, $4, 0x81C081C0;",
           # column n, high nibbles (2 r + 1, 2 r + 9): (3, 4, 5, 12) by 3
           "shl.b32 b, $4, 3;", "and.b32 b, b, 0x81C081C0;",
           # column n + 1, low nibbles: (0, 1, 2, 9) by 6
           "shl.b32 c, $4, 6;", "and.b32 c, c, 0x81C081C0;",
           # column n + 1, high nibbles: m 14 -> 6, e0 e1 10 11 -> 7 8, sign 13 -> 15
           "shr.b32 v, $4, 8;", "and.b32 v, v, 0x00400040;",
           "shr.b32 t, $4, 3;", "and.b32 t, t, 0x01800180;", "or.b32 v, v, t;",
           "shl.b32 t, $4, 2;", "and.b32 t, t, 0x80008000;", "or.b32 v, v, t;"]
  if repair:  # (low, high) halves by K row: the low halves of a nibble pair, then the high halves
    lines += ["prmt.b32 t, a, b, 0x5410;", "fma.rn.bf16x2 $0, t, s0, nz;",
              "prmt.b32 t, a, b, 0x7632;", "fma.rn.bf16x2 $1, t, s0, nz;",
              "prmt.b32 t, c, v, 0x5410;", "fma.rn.bf16x2 $2, t, s1, nz;",
              "prmt.b32 t, c, v, 0x7632;", "fma.rn.bf16x2 $3, t, s1, nz;"]
  else:
    lines += ["fma.rn.bf16x2 $0, a, s0, nz;", "fma.rn.bf16x2 $1, b, s0, nz;",
              "fma.rn.bf16x2 $2, c, s1, nz;", "fma.rn.bf16x2 $3, v, s1, nz;"]
  return "\n".join(lines + ["}"])


def x_in_nibble_pair_order(x: jax.Array) -> jax.Array:
  """``x`` ``[M, K]`` (K a multiple of 16) with K rows ``16 c + 8 a + 2 t + b`` and ``16 c + 8 b + 2 t + a`` swapped
  (a, b in {0, 1}, t in 0..3: within each 16-row block, rows 1 and 8, 3 and 10, 5 and 12, 7 and 14): the operand
  order of the paired decode without its repair (``DECODE`` 4, :func:`_asm_decode_order_paired`). Its own inverse.
  Same shape and dtype."""
  m, k = x.shape
  # as uint32 pairs of bf16 (t's two rows 2 t, 2 t + 1 of each half a): the new half 0 takes the low element of both
  # halves' words, half 1 the high ones. An elementwise fusion for XLA (session 52: the same permutation as a 5-D
  # transpose of size-2 axes ran as a slow transpose kernel, up to 20 us for a 64 x 18944 x)
  w = jax.lax.bitcast_convert_type(x.reshape(m, k // 16, 2, 4, 2), jnp.uint32)  # [m, k / 16, 2 (a), 4 (t)]
  w0, w1 = w[:, :, 0], w[:, :, 1]
  lo = (w0 & jnp.uint32(0xFFFF)) | (w1 << 16)
  hi = (w0 >> 16) | (w1 & jnp.uint32(0xFFFF0000))
  return jax.lax.bitcast_convert_type(jnp.stack([lo, hi], axis=2), x.dtype).reshape(m, k)


def takes_nibble_pair_x(meta: dict) -> bool:
  """Whether the build for ``meta`` (:func:`meta_for`) reads ``x`` in :func:`x_in_nibble_pair_order`: the paired
  decode without its repair (``DV`` 4) of decode-order codes (``DO``); :func:`forward` permutes x there."""
  return meta["DV"] == 4 and bool(meta["DO"])


def _asm_dx(decode_order: bool = False) -> str:
  """Inline PTX of the dx build (:func:`dx`, ``W`` as wgmma's operand with N as the contraction): code bytes ``$4`` =
  (column n, code row r), (n + 1, r), (n + 8, r), (n + 9, r) and their E4M3 block scales ``$5`` (the same four
  columns) -> ``$0``: K row ``2 r`` (the low nibbles) of columns (n, n + 1), ``$1``: the same of (n + 8, n + 9),
  ``$2, $3``: K row ``2 r + 1`` (the high nibbles). Each register pairs two columns of one K row, as wgmma's A
  operand pairs two contraction indices; each half is bf16 ``e2m1 * scale * 2**-8`` with its own column's scale.

  A column pair's bytes go to bytes 0 and 2 of a word (one ``prmt``), so both low nibbles sit at bits 0-3 of their
  halves and both high nibbles at 4-7: one shift and mask places the magnitudes (bits 6-8, 22-24), another the signs
  (15, 31), and one bf16x2 multiply by the pair's scales (``cvt.rn.f16x2.e4m3x2`` of their two E4M3 bytes, shifted:
  already one scale a half) finishes it. ``decode_order``: the codes as :func:`qerl_jax.nvfp4.to_decode_order`
  stores them (bits moved only inside each 16-bit column pair): column n's low nibble is already in place, column
  n + 1's moves by one shift (22), column n's high nibble by one (3) and column n + 1's in three pieces."""
  lines = ["{", ".reg .b16 sl;", ".reg .b32 u, p, v, t, z, nz, sp, sw;", "mov.b32 z, 0;", "mov.b32 nz, 0x80008000;"]
  for h in (0, 1):  # columns (n, n + 1), then (n + 8, n + 9)
    lines += ["mov.b32 sw, $5;" if h == 0 else "shr.b32 sw, $5, 16;", "cvt.u16.u32 sl, sw;",
              "cvt.rn.f16x2.e4m3x2 sp, sl;", "shr.b32 sp, sp, 3;", "add.u32 sp, sp, 0x73007300;"]
    if decode_order:
      lines += ["mov.b32 u, $4;" if h == 0 else "shr.b32 u, $4, 16;",
                # K row 2 r: column n's low nibble in place (6-8, 15), column n + 1's from (0-2, 9) by 22
                "and.b32 v, u, 0x81C0;", "shl.b32 t, u, 22;", "and.b32 t, t, 0x81C00000;", "or.b32 v, v, t;",
                f"fma.rn.bf16x2 ${h}, v, sp, nz;",
                # K row 2 r + 1: column n's high nibble from (3-5, 12) by 3, column n + 1's from (14, 10, 11, 13)
                "shl.b32 v, u, 3;", "and.b32 v, v, 0x81C0;"]
      for sh, mask in ((8, "0x00400000"), (13, "0x01800000"), (18, "0x80000000")):
        lines += [f"shl.b32 t, u, {sh};", f"and.b32 t, t, {mask};", "or.b32 v, v, t;"]
      lines.append(f"fma.rn.bf16x2 ${2 + h}, v, sp, nz;")
      continue
    lines.append(f"prmt.b32 p, $4, z, {'0x4140' if h == 0 else '0x4342'};")  # [b_n, 0, b_n+1, 0]
    for out, mag, sign in ((h, 6, 12), (2 + h, 2, 8)):  # low nibbles (K row 2 r), high nibbles (2 r + 1)
      lines += [f"shl.b32 v, p, {mag};", "and.b32 v, v, 0x01C001C0;", f"shl.b32 t, p, {sign};",
                "and.b32 t, t, 0x80008000;", "or.b32 v, v, t;", f"fma.rn.bf16x2 ${out}, v, sp, nz;"]
  return "\n".join(lines + ["}"])


def decode_reference(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
  """:func:`_asm`'s arithmetic in numpy, for tests: code bytes (uint8 ``[4]`` as above) and E4M3 scale bytes
  (uint8 ``[2]``: columns n, n + 1) -> the four output registers as float32 pairs ``[4, 2]`` (low, high half),
  i.e. ``e2m1 * scale * 2**-8``."""
  import ml_dtypes
  lut = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)
  s = np.asarray(scales, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32) * 2.0 ** -8
  out = np.zeros((4, 2), np.float32)
  for reg, (byte, col) in enumerate(((0, 0), (2, 0), (1, 1), (3, 1))):
    b = int(codes[byte])
    out[reg] = lut[b & 15] * s[col], lut[b >> 4] * s[col]
  return out


@functools.lru_cache(maxsize=None)
def _kernel():
  """Builds the Gluon kernel (imports triton lazily: CPU installs need not have it)."""
  from triton.experimental import gluon
  from triton.experimental.gluon import language as ttgl
  from triton.experimental.gluon.language.nvidia import hopper
  from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma as hopper_tma

  asm = ttgl.constexpr(_asm())
  asm2 = ttgl.constexpr(_asm2())
  asm3 = ttgl.constexpr(_asm2(shift_on_fma=True))
  asm_do = ttgl.constexpr(_asm_decode_order())
  asm_dop = ttgl.constexpr(_asm_decode_order_paired(repair=False))
  asm_dopr = ttgl.constexpr(_asm_decode_order_paired())
  asm_dx = ttgl.constexpr(_asm_dx())
  asm_dx_do = ttgl.constexpr(_asm_dx(decode_order=True))
  # DECODE 2: the codes as 16-bit pairs of columns (n, n + 1), [4 blocks, 8 code rows, BN / 2 pairs]: registers r2 b0
  # b1; lanes r0 r1 p0 p1 p2; warps p3 p4 p5 (p = n / 2): the same threads and bytes as code_layout
  pair_layout = ttgl.constexpr(ttgl.DistributedLinearLayout(
      reg_bases=[[0, 4, 0], [1, 0, 0], [2, 0, 0]],
      lane_bases=[[0, 1, 0], [0, 2, 0], [0, 0, 1], [0, 0, 2], [0, 0, 4]],
      warp_bases=[[0, 0, 8], [0, 0, 16], [0, 0, 32]], block_bases=[], shape=[4, 8, 64]))
  pair_layout_2d = ttgl.constexpr(ttgl.DistributedLinearLayout(
      reg_bases=[[4, 0], [8, 0], [16, 0]], lane_bases=[[1, 0], [2, 0], [0, 1], [0, 2], [0, 4]],
      warp_bases=[[0, 8], [0, 16], [0, 32]], block_bases=[], shape=[32, 64]))
  # A step's codes as [4 blocks, 8 code rows, BN columns] (code row 8 b + r holds K rows 16 b + 2 r, + 1):
  # registers n0 r2 b0 b1; lanes r0 r1 n1 n2 n3; warps n4 n5 n6. Relabelled (decode below), this is wgmma's
  # A operand: lanes r0 r1 are its k1 k2, register r2 its k3 (rows 8-15 of a k16 block), the blocks its k
  # steps; a thread's operand rows g, g + 8 are columns n, n + 1.
  code_layout = ttgl.constexpr(ttgl.DistributedLinearLayout(
      reg_bases=[[0, 0, 1], [0, 4, 0], [1, 0, 0], [2, 0, 0]],
      lane_bases=[[0, 1, 0], [0, 2, 0], [0, 0, 2], [0, 0, 4], [0, 0, 8]],
      warp_bases=[[0, 0, 16], [0, 0, 32], [0, 0, 64]], block_bases=[], shape=[4, 8, 128]))

  # the accumulator [BN columns, BM rows of x] after the row relabelling, with column bit n0 as the first register
  # bit: an m64 wgmma's rows g, g + 8 (lanes g) are columns 2 g', 2 g' + 1 (see decode)
  # the same as loaded from a stage's [32 code rows, BN] TMA box
  code_layout_2d = ttgl.constexpr(ttgl.DistributedLinearLayout(
      reg_bases=[[0, 1], [4, 0], [8, 0], [16, 0]], lane_bases=[[1, 0], [2, 0], [0, 2], [0, 4], [0, 8]],
      warp_bases=[[0, 16], [0, 32], [0, 64]], block_bases=[], shape=[32, 128]))
  c16_shared = ttgl.constexpr(ttgl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
  # the dx build (DX): a stage's codes [64 code rows (128 K rows: the tile's outputs), 64 columns (the contraction)]
  # with the 64-byte swizzle, read as 16-bit column pairs [8 blocks, 8 code rows, 32 pairs]: registers p2 p3 p4; lanes
  # p0 p1 r0 r1 r2; warps b0 b1 b2 (p = n / 2): wgmma's A operand with rows (K) and the contraction (N) relabelled
  c16_shared_dx = ttgl.constexpr(ttgl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2))
  dx_pair_layout = ttgl.constexpr(ttgl.DistributedLinearLayout(
      reg_bases=[[0, 0, 4], [0, 0, 8], [0, 0, 16]],
      lane_bases=[[0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
      warp_bases=[[1, 0, 0], [2, 0, 0], [4, 0, 0]], block_bases=[], shape=[8, 8, 32]))
  dx_pair_layout_2d = ttgl.constexpr(ttgl.DistributedLinearLayout(
      reg_bases=[[0, 4], [0, 8], [0, 16]], lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]],
      warp_bases=[[8, 0], [16, 0], [32, 0]], block_bases=[], shape=[64, 32]))
  s16_shared = ttgl.constexpr(ttgl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2))
  def store_layout_for(bm):  # the accumulator [BN, bm] with column bit n0 first in a thread's registers
    return ttgl.constexpr(ttgl.DistributedLinearLayout(
        reg_bases=[[1, 0], [0, 1]] + [[0, r] for r in (8, 16, 32, 64, 128) if r < bm],
        lane_bases=[[0, 2], [0, 4], [2, 0], [4, 0], [8, 0]],
        warp_bases=[[16, 0], [32, 0], [64, 0]], block_bases=[], shape=[128, bm]))
  store_layout = store_layout_for(256)
  store_layout_128 = store_layout_for(128)  # the narrow tiles' (SMALL_M_MAX)
  store_layout_64 = store_layout_for(64)

  @gluon.jit
  def decode(c, s):
    """codes [4, 8, BN] (uint8) and block scales [4, BN] (E4M3 bytes) -> A [BN operand rows, 64 k] bf16.

    Operand row ``(r6 .. r0)`` is column ``(n6 n5 n4 n0 n3 n2 n1)`` of the tile."""
    sb = ttgl.broadcast(ttgl.expand_dims(s, 1), c)[0]
    oa, ob = ttgl.inline_asm_elementwise(asm, "=r,=r,=r,=r,r,r", [c, sb], dtype=(ttgl.bfloat16, ttgl.bfloat16),
                                         is_pure=True, pack=4)
    # oa[b, r, n] is the value (column n with n0 = 0, K row 16 b + 2 r + n0); ob the same for the column with
    # n0 = 1: join them on a last axis q = that column's n0
    x = ttgl.reshape(ttgl.join(oa, ob), [2] * 13)  # [b1 b0 r2 r1 r0 | n6 n5 n4 n3 n2 n1 n0 (the nibble) | q]
    # -> A [r6 .. r0 = n6 n5 n4 q n3 n2 n1 | k5 .. k0 = b1 b0 r2 r1 r0 nibble]
    return ttgl.reshape(ttgl.permute(x, [5, 6, 7, 12, 8, 9, 10, 0, 1, 2, 3, 4, 11]), [128, 64])

  @gluon.jit
  def decode2(c, s, DV: ttgl.constexpr, DO: ttgl.constexpr):
    """codes [4, 8, BN / 2] (uint16 column pairs) and block scales [4, BN / 2] (uint16 pairs of E4M3 bytes) -> A
    [BN operand rows, 64 k] bf16, as :func:`decode` (:func:`_asm2`)."""
    sb = ttgl.broadcast(ttgl.expand_dims(s, 1), c)[0]
    o0, o1, o2, o3 = ttgl.inline_asm_elementwise(
        asm_dopr if (DO and DV == 5) else asm_dop if (DO and DV == 4) else asm_do if DO else asm3 if DV == 3 else asm2,
        "=r,=r,=r,=r,r,r", [c, sb], dtype=(ttgl.bfloat16, ttgl.bfloat16, ttgl.bfloat16, ttgl.bfloat16),
        is_pure=True, pack=2)
    # element [b, r, p] of o0 (o1) is, for r2 = 0, the low nibble and for r2 = 1 the high nibble of column 2p, code
    # row 8 b + (r with r2 = 0) (+ 4 for o1); o2 and o3 the same for column 2p + 1
    x = ttgl.reshape(ttgl.join(ttgl.join(o0, o1), ttgl.join(o2, o3)), [2] * 13)
    # [b1 b0 nibble r1 r0 | p5 .. p0 | k3 (o1) | n0 (o2, o3)] -> A [n6 n5 n4 n0 n3 n2 n1 | b1 b0 k3 r1 r0 nibble]
    return ttgl.reshape(ttgl.permute(x, [5, 6, 7, 12, 8, 9, 10, 0, 1, 11, 3, 4, 2]), [128, 64])

  @gluon.jit
  def decode_dx(c, s, DO: ttgl.constexpr):
    """The dx build's codes [8 blocks, 8 code rows, 32 column pairs] (uint16) and block scales [8, 32] (uint16 pairs
    of E4M3 bytes) -> A [128 K rows, 64 columns of N] bf16 (:func:`_asm_dx`). Operand row ``(r6 .. r0)`` is K row
    ``(r6 r5 r4 r2 r1 r0 r3)`` of the tile (r3: the nibble), as :func:`decode`'s columns."""
    sb = ttgl.broadcast(ttgl.expand_dims(s, 1), c)[0]
    o0, o1, o2, o3 = ttgl.inline_asm_elementwise(
        asm_dx_do if DO else asm_dx, "=r,=r,=r,=r,r,r", [c, sb],
        dtype=(ttgl.bfloat16, ttgl.bfloat16, ttgl.bfloat16, ttgl.bfloat16), is_pure=True, pack=2)
    # element [b, i, p] of o0 is, for p2 = 0, column 2p and for p2 = 1 column 2p + 1 (so p2 is n0), of K row
    # 2 (8 b + i) (the low nibbles); o1 the same 8 columns on (qa, n3); o2, o3 the high nibbles (qb, the K row's parity)
    x = ttgl.reshape(ttgl.join(ttgl.join(o0, o1), ttgl.join(o2, o3)), [2] * 13)
    # [b2 b1 b0 | i2 i1 i0 | p4 p3 p2 p1 p0 | qa | qb] -> A [b2 b1 b0 qb i2 i1 i0 | p4 p3 qa p1 p0 p2]
    return ttgl.reshape(ttgl.permute(x, [0, 1, 2, 12, 3, 4, 5, 6, 7, 11, 9, 10, 8]), [128, 64])

  @gluon.jit
  def tile_of(t, MT: ttgl.constexpr, NTF: ttgl.constexpr, G: ttgl.constexpr):
    """(row tile, column tile) of whole tile ``t`` of the first ``NTF`` column tiles: x row tiles fastest, or with
    G > 0 in groups of G row tiles (the last group may be smaller), the row tiles fastest within a group."""
    ttgl.static_assert(MT > 0)  # (also names ttgl in the body, which the signature's annotations need)
    if G == 0:
      mt = t % MT
      nt = t // MT
    else:
      first = t // (G * NTF) * G
      rows = ttgl.minimum(MT - first, G)
      within = t % (G * NTF)
      mt = first + within % rows
      nt = within // rows
    return mt, nt

  @gluon.jit
  def produce_unit(xd, cd, sd, x_smem, c_smem, s_smem, ready, empty, c_row0, s_row0, m0, n0, k0, g,
                   BM: ttgl.constexpr, BN: ttgl.constexpr, S: ttgl.constexpr, NS: ttgl.constexpr, DX: ttgl.constexpr,
                   PR: ttgl.constexpr, IF: ttgl.constexpr):
    """Copies a unit's NS steps from step k0 (x rows m0.., weight columns n0..) into the ring; returns the next g.
    PROBE 3 (lab) copies no x, PROBE 4 no codes or block scales: the stage keeps what it held. IF 2: the MMA
    partition releases stages in pairs on the even stage's barrier, so only an even stage waits."""
    ttgl.static_assert(NS > 0)  # (also names ttgl in the body, which the signature's annotations need)
    XB: ttgl.constexpr = 0 if PR == 3 else BM * 64 * 2  # a stage's x bytes
    WB: ttgl.constexpr = 0 if PR == 4 else 36 * BN  # its codes and block scales
    for j in range(NS):
      i = k0 + j
      st = g % S
      if IF != 2 or st % 2 == 0:
        mbarrier.wait(empty.index(st), ((g // S) & 1) ^ 1)
      mbarrier.expect(ready.index(st), XB + WB)  # (one probe at a time: never 0 bytes)
      if XB > 0:
        hopper_tma.async_copy_global_to_shared(xd, [m0, i * 64], ready.index(st), x_smem.index(st))
      if WB > 0:
        if DX:
          hopper_tma.async_copy_global_to_shared(cd, [c_row0 + n0 // 2, i * 64], ready.index(st), c_smem.index(st))
          hopper_tma.async_copy_global_to_shared(sd, [s_row0 + n0 // 16, i * 64], ready.index(st), s_smem.index(st))
        else:
          hopper_tma.async_copy_global_to_shared(cd, [c_row0 + i * 32, n0], ready.index(st), c_smem.index(st))
          hopper_tma.async_copy_global_to_shared(sd, [s_row0 + i * 4, n0], ready.index(st), s_smem.index(st))
      g += 1
    return g

  @gluon.jit
  def producer(xd, cd, sd, x_smem, c_smem, s_smem, ready, empty, layer, M: ttgl.constexpr, N: ttgl.constexpr,
               K: ttgl.constexpr, BM: ttgl.constexpr, BN: ttgl.constexpr, S: ttgl.constexpr, NP: ttgl.constexpr,
               DX: ttgl.constexpr, FT: ttgl.constexpr, SK: ttgl.constexpr, G: ttgl.constexpr, PR: ttgl.constexpr,
               IF: ttgl.constexpr):
    """One warp: each step's x [BM, 64] (rows past M arrive as zeros), codes and block scales by TMA into stage
    g % S of the ring once the MMA partition has released it, over this program's units: first whole tiles of the
    first FT (:func:`tile_of`), then the tail's split units (SK a tile, x row tiles fastest). N is the output's columns and K the
    contraction: the forward's codes [32 code rows (K), BN] and scales [4, BN]; the dx build's (DX) codes [BN / 2
    code rows (its outputs), 64] and scales [BN / 16, 64]."""
    STEPS: ttgl.constexpr = K // 64
    MT: ttgl.constexpr = (M + BM - 1) // BM
    TU: ttgl.constexpr = (MT * (N // BN) - FT) * SK  # tail units
    KW: ttgl.constexpr = N if DX else K  # the weight's K (rows of W)
    c_row0 = layer * (KW // 2)
    s_row0 = layer * (KW // 16)
    pid = ttgl.program_id(0)
    g = 0
    for t in range(pid, FT, NP):  # (FT = 0: no iteration)
      mt, nt = tile_of(t, MT, FT // MT, G)
      g = produce_unit(xd, cd, sd, x_smem, c_smem, s_smem, ready, empty, c_row0, s_row0, mt * BM, nt * BN, 0, g, BM,
                       BN, S, STEPS, DX, PR, IF)
    if TU > 0:  # (constexpr: a build without a tail has no tail loop)
      for v in range((pid + NP - FT % NP) % NP, TU, NP):
        g = produce_unit(xd, cd, sd, x_smem, c_smem, s_smem, ready, empty, c_row0, s_row0, (v % MT) * BM,
                         (FT // MT + v // MT // SK) * BN, ((v // MT) % SK) * (STEPS // SK), g, BM, BN, S,
                         STEPS // SK, DX, PR, IF)

  @gluon.jit
  def load_codes(c_smem, s_smem, ready, g, S: ttgl.constexpr, BN: ttgl.constexpr, PF: ttgl.constexpr):
    """With PF: waits for stage ``g % S`` and returns its codes and block scales in :func:`decode2`'s layouts;
    without: nothing (two zeros)."""
    if PF:
      st = g % S
      mbarrier.wait(ready.index(st), (g // S) & 1)
      cw = c_smem.index(st)._reinterpret(ttgl.uint16, [32, BN // 2], c16_shared)
      sw = s_smem.index(st)._reinterpret(ttgl.uint16, [4, BN // 2], s16_shared)
      c = ttgl.convert_layout(ttgl.reshape(cw.load(pair_layout_2d), [4, 8, BN // 2]), pair_layout,
                              assert_trivial=True)
      sc = sw.load(ttgl.SliceLayout(1, pair_layout))
    else:
      c = 0
      sc = 0
    return c, sc

  @gluon.jit
  def operand(c_smem, s_smem, ready, g, nxt, c, sc, S: ttgl.constexpr, BN: ttgl.constexpr, DV: ttgl.constexpr,
              DO: ttgl.constexpr, DX: ttgl.constexpr, PF: ttgl.constexpr):
    """Step g's decoded operand ``[BN, 64]`` and the codes for the next call. Without PF: loaded and decoded here
    (``c``, ``sc`` pass through). With PF (the lab setting PREFETCH_CODES): decoded from ``c``, ``sc`` (step g's,
    loaded by the previous call) after step ``nxt``'s loads are issued, so that their latency overlaps this decode
    and its wgmma. The caller passes ``nxt = g`` past a unit's last step: the current stage is ready and not yet
    released, where the next may never be filled."""
    ttgl.static_assert(S > 0)  # (also names ttgl in the body, which the signature's annotations need)
    if PF:
      cn, scn = load_codes(c_smem, s_smem, ready, nxt, S, BN, PF)
      a = decode2(c, sc, DV, DO)
    else:
      cn = c
      scn = sc
      a = load_decode(c_smem, s_smem, ready, g, S, BN, DV, DO, DX)
    return a, cn, scn

  @gluon.jit
  def load_decode(c_smem, s_smem, ready, g, S: ttgl.constexpr, BN: ttgl.constexpr, DV: ttgl.constexpr,
                  DO: ttgl.constexpr, DX: ttgl.constexpr):
    """Waits for stage ``g % S`` and returns its decoded operand ``[BN, 64]`` (:func:`decode`'s layout)."""
    st = g % S
    mbarrier.wait(ready.index(st), (g // S) & 1)
    if DX and DV != 0:
      cw = c_smem.index(st)._reinterpret(ttgl.uint16, [64, 32], c16_shared_dx)
      sw = s_smem.index(st)._reinterpret(ttgl.uint16, [8, 32], s16_shared)
      c = ttgl.convert_layout(ttgl.reshape(cw.load(dx_pair_layout_2d), [8, 8, 32]), dx_pair_layout,
                              assert_trivial=True)
      a = decode_dx(c, sw.load(ttgl.SliceLayout(1, dx_pair_layout)), DO)
    elif DV == 0:  # PROBE 1 (lab, wrong results): no shared loads, no decode
      a = ttgl.full([BN, 64], 1.0, ttgl.bfloat16, layout=ttgl.DotOperandLayout(
          0, ttgl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, 256, 16]), 2))
    elif DV >= 2:
      cw = c_smem.index(st)._reinterpret(ttgl.uint16, [32, BN // 2], c16_shared)
      sw = s_smem.index(st)._reinterpret(ttgl.uint16, [4, BN // 2], s16_shared)
      c = ttgl.convert_layout(ttgl.reshape(cw.load(pair_layout_2d), [4, 8, BN // 2]), pair_layout,
                              assert_trivial=True)
      a = decode2(c, sw.load(ttgl.SliceLayout(1, pair_layout)), DV, DO)
    else:
      c = ttgl.convert_layout(ttgl.reshape(c_smem.index(st).load(code_layout_2d), [4, 8, BN]), code_layout,
                              assert_trivial=True)
      a = decode(c, s_smem.index(st).load(ttgl.SliceLayout(1, code_layout)))
    return a

  @gluon.jit
  def mma_unit(x_smem, c_smem, s_smem, ready, empty, g, BM: ttgl.constexpr, BN: ttgl.constexpr, S: ttgl.constexpr,
               IF: ttgl.constexpr, NS: ttgl.constexpr, DV: ttgl.constexpr, DO: ttgl.constexpr, DX: ttgl.constexpr,
               PF: ttgl.constexpr):
    """A unit's NS steps: each step's decode and wgmmas (IF 1: one step's left in flight while the next decodes),
    releasing each stage once its wgmma retired (IF 2: as 1, but each pair of stages 2p, 2p + 1 at once, on stage
    2p's barrier: NS even and S even). Returns (the accumulator [BN, BM] in wgmma's layout, the next g)."""
    mma: ttgl.constexpr = ttgl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, BM, 16])
    a_layout: ttgl.constexpr = ttgl.DotOperandLayout(0, mma, 2)
    acc = ttgl.zeros([BN, BM], ttgl.float32, layout=mma)
    if IF >= 1:
      # Steps in pairs, each with its own operand value (a0, a1): an asynchronous wgmma reads its A registers
      # until it retires, so the next step's decode must write other registers. Passing the in-flight step's
      # operand through the wait keeps it (and its registers) live until its wgmma has retired; a single
      # loop-carried operand would be copied at the back edge and its registers handed to the next decode
      # (session 46 measured relative errors of 0.2 that way).
      # PF: each step's codes and block scales come from the shared loads issued a step earlier (operand).
      a1 = ttgl.zeros([BN, 64], ttgl.bfloat16, layout=a_layout)
      c, sc = load_codes(c_smem, s_smem, ready, g, S, BN, PF)
      for j in range(NS // 2):
        a0, c, sc = operand(c_smem, s_smem, ready, g, g + 1, c, sc, S, BN, DV, DO, DX, PF)  # (2j + 1 < NS)
        a0 = ttgl.convert_layout(a0, a_layout)
        acc = hopper.warpgroup_mma(a0, x_smem.index(g % S).permute((1, 0)), acc, is_async=True)
        acc, a1 = hopper.warpgroup_mma_wait(1, deps=[acc, a1])  # step 2j - 1 retired: its stage is free
        # IF 2 (g even): steps g - 2 and g - 1 retired, the pair of stages from (g - 2) % S
        mbarrier.arrive(empty.index((g + S - IF) % S), count=1, pred=j > 0)
        g += 1
        a1, c, sc = operand(c_smem, s_smem, ready, g, g + (2 * j + 2 < NS).to(ttgl.int32), c, sc, S, BN, DV, DO, DX,
                            PF)
        a1 = ttgl.convert_layout(a1, a_layout)
        acc = hopper.warpgroup_mma(a1, x_smem.index(g % S).permute((1, 0)), acc, is_async=True)
        acc, a0 = hopper.warpgroup_mma_wait(1, deps=[acc, a0])  # step 2j retired
        if IF == 1:
          mbarrier.arrive(empty.index((g + S - 1) % S), count=1)
        g += 1
      if NS % 2 == 1:  # the last, odd step
        a0, c, sc = operand(c_smem, s_smem, ready, g, g, c, sc, S, BN, DV, DO, DX, PF)
        a0 = ttgl.convert_layout(a0, a_layout)
        acc = hopper.warpgroup_mma(a0, x_smem.index(g % S).permute((1, 0)), acc, is_async=True)
        acc, a1 = hopper.warpgroup_mma_wait(1, deps=[acc, a1])
        mbarrier.arrive(empty.index((g + S - 1) % S), count=1, pred=NS > 1)
        g += 1
        acc, a0 = hopper.warpgroup_mma_wait(0, deps=[acc, a0])
      else:
        acc, a1 = hopper.warpgroup_mma_wait(0, deps=[acc, a1])
      mbarrier.arrive(empty.index((g + S - IF) % S), count=1)  # (IF 2: the last pair's first stage)
    else:
      for i in range(NS):
        a = ttgl.convert_layout(load_decode(c_smem, s_smem, ready, g, S, BN, DV, DO, DX), a_layout)
        acc = hopper.warpgroup_mma(a, x_smem.index(g % S).permute((1, 0)), acc, is_async=True)
        acc = hopper.warpgroup_mma_wait(0, deps=[acc])
        mbarrier.arrive(empty.index(g % S), count=1)
        g += 1
    return acc, g

  @gluon.jit
  def store_unit(acc, scale, c_ptr, o_ptr, w_ptr, m0, n0, M: ttgl.constexpr, N: ttgl.constexpr,
                 BM: ttgl.constexpr, BN: ttgl.constexpr, PR: ttgl.constexpr, AD: ttgl.constexpr, TAIL: ttgl.constexpr,
                 TN0: ttgl.constexpr):
    """A unit's epilogue for x rows m0.. and columns n0..: a whole tile rounds once to bf16 into o_ptr ([M, N]); a
    tail unit (TAIL) adds its float32 part into w_ptr ([M, N - TN0], the zeroed tail columns from TN0) by atomics."""
    # operand rows (n6 n5 n4 n0 n3 n2 n1) -> columns: a relabelling, no data moves
    acc = ttgl.reshape(ttgl.permute(ttgl.reshape(acc, [2] * 7 + [BM]), [0, 1, 2, 4, 5, 6, 3, 7]), [BN, BM])
    # the same values with column bit n0 first in each thread's registers: the stores take column pairs (4 bytes)
    st_layout: ttgl.constexpr = store_layout if BM == 256 else store_layout_128 if BM == 128 else store_layout_64
    out = ttgl.convert_layout(acc * scale, st_layout, assert_trivial=True)
    cols = ttgl.arange(0, BN, layout=ttgl.SliceLayout(1, st_layout)) + n0
    rows = ttgl.arange(0, BM, layout=ttgl.SliceLayout(0, st_layout)) + m0
    mask = ttgl.expand_dims(rows < (0 if PR == 2 else M), 0) & ttgl.expand_dims(cols >= 0, 1)
    offs = ttgl.expand_dims(rows, 0) * N + ttgl.expand_dims(cols, 1)
    if TAIL:  # (XLA adds the addend when it rounds the tail: loading it here too made ptxas spill)
      ttgl.atomic_add(w_ptr + ttgl.expand_dims(rows, 0) * (N - TN0) + ttgl.expand_dims(cols - TN0, 1), out,
                      mask=mask, sem="relaxed")
    else:
      if AD:  # the addend, in float32 before the one rounding (as cuBLAS's C with beta = 1)
        out = out + ttgl.load(c_ptr + offs, mask=mask, other=0.0).to(ttgl.float32)
      ttgl.store(o_ptr + offs, out.to(ttgl.bfloat16), mask=mask)

  @gluon.jit
  def mma_loop(x_smem, c_smem, s_smem, ready, empty, c_ptr, o_ptr, w_ptr, scale, M: ttgl.constexpr,
               N: ttgl.constexpr, K: ttgl.constexpr, BM: ttgl.constexpr, BN: ttgl.constexpr, S: ttgl.constexpr,
               IF: ttgl.constexpr, NP: ttgl.constexpr, DV: ttgl.constexpr, PR: ttgl.constexpr, DO: ttgl.constexpr,
               AD: ttgl.constexpr, DX: ttgl.constexpr, FT: ttgl.constexpr, SK: ttgl.constexpr, G: ttgl.constexpr,
               PF: ttgl.constexpr):
    """8 warps: this program's units as the producer walks them (whole tiles of the first FT, then the tail's split
    units), each unit's MMAs then its epilogue (while the producer already fills the ring for the next unit)."""
    STEPS: ttgl.constexpr = K // 64
    MT: ttgl.constexpr = (M + BM - 1) // BM
    TU: ttgl.constexpr = (MT * (N // BN) - FT) * SK
    TN0: ttgl.constexpr = FT // MT * BN  # the tail's first column
    pid = ttgl.program_id(0)
    g = 0
    for t in range(pid, FT, NP):
      acc, g = mma_unit(x_smem, c_smem, s_smem, ready, empty, g, BM, BN, S, IF, STEPS, DV, DO, DX, PF)
      mt, nt = tile_of(t, MT, FT // MT, G)
      store_unit(acc, scale, c_ptr, o_ptr, w_ptr, mt * BM, nt * BN, M, N, BM, BN, PR, AD, False, TN0)
    if TU > 0:
      for v in range((pid + NP - FT % NP) % NP, TU, NP):
        acc, g = mma_unit(x_smem, c_smem, s_smem, ready, empty, g, BM, BN, S, IF, STEPS // SK, DV, DO, DX, PF)
        store_unit(acc, scale, c_ptr, o_ptr, w_ptr, (v % MT) * BM, (FT // MT + v // MT // SK) * BN, M, N, BM, BN,
                   PR, AD, True, TN0)
    return (g,)

  @gluon.jit
  def w4a16_mm(xd, cd, sd, x_ptr, p_ptr, s_ptr, gs_ptr, idx_ptr, c_ptr, z_ptr, o_ptr, w_ptr, M: ttgl.constexpr,
               N: ttgl.constexpr, K: ttgl.constexpr, L: ttgl.constexpr, BM: ttgl.constexpr, BN: ttgl.constexpr,
               S: ttgl.constexpr, DR: ttgl.constexpr, IF: ttgl.constexpr, NP: ttgl.constexpr, DV: ttgl.constexpr,
               PR: ttgl.constexpr, DO: ttgl.constexpr, AD: ttgl.constexpr, DX: ttgl.constexpr, FT: ttgl.constexpr,
               SK: ttgl.constexpr, G: ttgl.constexpr, WR: ttgl.constexpr, PF: ttgl.constexpr):
    layer = ttgl.minimum(ttgl.maximum(ttgl.load(idx_ptr), 0), L - 1)
    scale = 256.0 / ttgl.load(gs_ptr + layer)  # 2**8 undoes the decode's 2**-8
    x_smem = ttgl.allocate_shared_memory(ttgl.bfloat16, [S, BM, 64], xd.layout)
    if DX:
      c_smem = ttgl.allocate_shared_memory(ttgl.uint8, [S, BN // 2, 64], cd.layout)
      s_smem = ttgl.allocate_shared_memory(ttgl.uint8, [S, BN // 16, 64], sd.layout)
    else:
      c_smem = ttgl.allocate_shared_memory(ttgl.uint8, [S, 32, BN], cd.layout)
      s_smem = ttgl.allocate_shared_memory(ttgl.uint8, [S, 4, BN], sd.layout)
    ready = ttgl.allocate_shared_memory(ttgl.int64, [S, 1], mbarrier.MBarrierLayout())
    empty = ttgl.allocate_shared_memory(ttgl.int64, [S, 1], mbarrier.MBarrierLayout())
    for j in ttgl.static_range(S):
      mbarrier.init(ready.index(j), count=1)
      mbarrier.init(empty.index(j), count=1 + WR)  # WR 1: each warpgroup's first thread arrives (ptx_for)
    hopper.fence_async_shared()
    ttgl.warp_specialize(
        [(mma_loop, (x_smem, c_smem, s_smem, ready, empty, c_ptr, o_ptr, w_ptr, scale, M, N, K, BM, BN, S, IF, NP,
                       0 if PR == 1 else DV, PR, DO, AD, DX, FT, SK, G, PF)),
         (producer, (xd, cd, sd, x_smem, c_smem, s_smem, ready, empty, layer, M, N, K, BM, BN, S, NP, DX, FT, SK,
                     G, PR, IF))],
        [1], [DR])

  return w4a16_mm


def _regs(per_sm: int = 1) -> int:
  """The launch register cap: ``per_sm`` programs of 12 warps share an SM's 65536 registers (setmaxnreg then moves
  them)."""
  return (65536 // (_THREADS * per_sm)) // 8 * 8


def _sm_count() -> int:
  """The fewest SMs of the visible GPUs (``core_count``), or 132 (an H100's or H200's) where none says."""
  sms = [getattr(d, "core_count", 0) for d in w4_gluon._gpu_devices()]
  return min(sms) if sms and min(sms) > 0 else 132


def block_m(m: int, weights: int | None = None) -> int:
  """The rows of x a tile takes for ``x [m, K]`` against a weight of ``weights`` values (``K x N``; ``None``: a large
  one): :data:`SMALL_WEIGHT_ROWS` (128) where ``64 < m <=`` :data:`NARROW_SMALL_WIDE_MAX_M` and ``weights <=``
  :data:`NARROW_SMALL_WEIGHTS`; else where ``m <= SMALL_M_MAX`` a narrow tile of 64 rows (``m <= 64``) or 128; else
  :data:`BLOCK_M`."""
  if m <= 64:
    return 64 if m <= SMALL_M_MAX else BLOCK_M
  if weights is not None and m <= NARROW_SMALL_WIDE_MAX_M and weights <= NARROW_SMALL_WEIGHTS:
    return SMALL_WEIGHT_ROWS
  return 128 if m <= SMALL_M_MAX else BLOCK_M


class Plan(NamedTuple):
  """How the tiles of one product are split: the first ``full`` tiles (x row tiles fastest) run whole, each rounded
  once to bf16; each later tile (the tail) runs as ``splits`` units of ``K / 64 / splits`` steps whose float32 parts
  are added by atomics into zeroed tail columns that XLA rounds to bf16. ``full`` is a multiple of the row tiles,
  so the tail is whole columns."""
  full: int
  splits: int


def _tiles(m: int, k: int, n: int) -> tuple[int, int]:
  """(row tiles, all tiles) of the ``[m, n]`` output of ``x [m, k] @ W [k, n]``."""
  mt = -(-m // block_m(m, k * n))
  return mt, mt * (n // BLOCK_N)


def whole_tile(t: int, row_tiles: int, col_tiles: int, group: int) -> tuple[int, int]:
  """(row tile, column tile) of whole tile ``t`` of ``row_tiles x col_tiles``, as the kernel walks them (its
  ``tile_of``, line for line): x row tiles fastest, or with ``group`` > 0 (:data:`RASTER_GROUP`) in groups of that
  many row tiles (the last may be smaller), the row tiles fastest within a group."""
  if group == 0:
    return t % row_tiles, t // row_tiles
  first = t // (group * col_tiles) * group
  rows = min(row_tiles - first, group)
  within = t % (group * col_tiles)
  return first + within % rows, within // rows


def _tail_cols(n: int, full: int, row_tiles: int) -> int:
  """Output columns of the split tail: those after the ``full`` whole tiles (whole columns of ``row_tiles`` tiles)."""
  return n - full // row_tiles * BLOCK_N


def _programs(m: int, k: int, n: int, plan: Plan) -> int:
  """The grid: one program per unit (a whole tile, or a split of a tail tile), or with :data:`PERSISTENT` at most
  one per SM (:func:`_sm_count`)."""
  tiles = _tiles(m, k, n)[1]
  units = plan.full + (tiles - plan.full) * plan.splits
  return max(1, min(units, _sm_count() * _per_sm(block_m(m, k * n)))) if PERSISTENT else units


def _per_sm(bm: int) -> int:
  """Persistent programs an SM for tiles of ``bm`` rows of x: :data:`NARROW_PER_SM` for the 64-row tiles, else 1."""
  return NARROW_PER_SM if bm == 64 else 1


def _plan_us(m: int, k: int, n: int, plan: Plan, sms: int) -> float:
  """This kernel's modelled microseconds for ``x [m, k] @ W [k, n]`` run as ``plan`` on ``sms`` SMs: the busiest
  program's steps (its whole tiles and tail units as the persistent walk deals them out) times :data:`STEP_US` (the
  narrow tiles' :data:`SMALL_STEP_US`), plus the tail's float32 traffic (XLA's zeroing, every split's atomic add, the
  rounding pass) at :data:`HBM_TBPS`."""
  mt, tiles = _tiles(m, k, n)
  steps = k // STEP_K
  tail = (tiles - plan.full) * plan.splits
  programs = max(1, min(plan.full + tail, sms))
  busiest = max(len(range(p, plan.full, programs)) * steps
                + len(range((p - plan.full) % programs, tail, programs)) * (steps // plan.splits)
                for p in range(programs))
  bm = block_m(m, k * n)
  us = busiest * (STEP_US if bm == BLOCK_M else SMALL_STEP_US[bm])
  if tail:
    us += m * _tail_cols(n, plan.full, mt) * (4.0 * (plan.splits + 2) + 2.0) / (HBM_TBPS * 1e6)
  return us


def plan_for(m: int, k: int, n: int, sms: int | None = None) -> Plan:
  """The split of ``x [m, k] @ W [k, n]`` with the least modelled time (:func:`_plan_us`; ties to no split, then to
  fewer splits): every tile whole; or the whole rounds of tiles whole and the last, partial round split; or every
  tile split; splits dividing the ``k / 64`` steps, at most :data:`MAX_SPLITS`. Every tile whole where the parts
  must be summed in a fixed order (:func:`pallas_kernels.w4_gluon.atomic_split_k`: atomics add them in whatever
  order they arrive).

  Raises:
    ValueError: ``QERL_GLUON_DETERMINISTIC`` malformed, or :data:`MAX_SPLITS` below 1.
  """
  if MAX_SPLITS < 1:
    raise ValueError(f"w4_gluon_mm: MAX_SPLITS={MAX_SPLITS}; expected at least 1 (1: no split-K)")
  mt, tiles = _tiles(m, k, n)
  whole = Plan(tiles, 1)
  if MAX_SPLITS == 1 or not w4_gluon.atomic_split_k():
    return whole
  sms = _sm_count() if sms is None else sms
  steps = k // STEP_K
  rounds_full = tiles // sms * sms // mt * mt  # whole rounds of tiles, cut to whole columns
  plans = [whole] + [Plan(full, s) for s in range(2, min(MAX_SPLITS, steps) + 1) if steps % s == 0
                     for full in sorted({0, rounds_full}) if full < tiles]
  return min(plans, key=lambda p: (_plan_us(m, k, n, p, sms), p.splits))


def predicted_us(m: int, k: int, n: int, sms: int | None = None) -> tuple[float, float]:
  """(this kernel, dequantize + cuBLAS): the modelled microseconds of ``x [m, k] @ W [k, n]`` on ``sms`` SMs (default:
  the first GPU's, else 132) with :data:`STEP_US`, :data:`DEQUANT_US_PER_MILLION`, :data:`BF16_TFLOPS` and
  :data:`HBM_TBPS`. The kernel's rounds count its units over the SMs, so a shape with few tiles (a long K and a
  narrow N at small M, such as the 7B down projection at M = 256: 28 tiles) pays for its idle SMs unless it is split
  along K (:func:`plan_for`)."""
  if sms is None:
    sms = _sm_count()
  fused = _plan_us(m, k, n, plan_for(m, k, n, sms), sms)
  gemm = max(2.0 * m * k * n / (BF16_TFLOPS * 1e6), 2.0 * k * n / (HBM_TBPS * 1e6))
  return fused, GEMM_FIXED_US + gemm + k * n * 1e-6 * DEQUANT_US_PER_MILLION


def narrow_takes(m: int, k: int, n: int, gemv_runs: bool) -> bool:
  """Whether matmul's dispatch sends a bf16 product ``x [m, k] @ W [k, n]`` to the narrow tiles instead of the decode
  GEMV: ``NARROW_MIN_M < m <= SMALL_M_MAX``, except that a weight of at most :data:`NARROW_SMALL_WEIGHTS` values stays
  on the GEMV at ``m <= NARROW_SMALL_MAX_M`` when the GEMV runs it (``gemv_runs``)."""
  if not NARROW_MIN_M < m <= SMALL_M_MAX:
    return False
  return not (gemv_runs and m <= NARROW_SMALL_MAX_M and k * n <= NARROW_SMALL_WEIGHTS)


def pays(m: int, k: int, n: int) -> bool:
  """Whether :func:`predicted_us` has this kernel no slower than dequantize + cuBLAS for ``x [m, k] @ W [k, n]``."""
  fused, dense = predicted_us(m, k, n)
  return fused <= dense


def _tma_specs(operands, boxes) -> np.ndarray:
  """The launcher's ``tma`` attribute in its extended form: ``-count``, then per descriptor ``operand, rows,
  columns, box rows, box columns, L2 promotion, element bytes, swizzle``."""
  specs = [[i, *operands[i].shape, *box, w4_gluon.TMA_L2_PROMOTION, eb, sw] for i, _, box, eb, sw in boxes]
  return np.array([-len(specs)] + [v for spec in specs for v in spec], np.int64)


def meta_for(m: int, k: int, n: int, layers: int, decode_order: bool = False, addend: bool = False,
             dx: bool = False, plan: Plan | None = None) -> dict:
  """The kernel's constexprs for ``x [m, k]`` and a ``[k, n]`` weight (of a stack of ``layers``) whose codes are in
  the decode order (:func:`qerl_jax.nvfp4.to_decode_order`) or not, with a bf16 ``[m, n]`` addend or not; with
  ``dx``, the dx build for ``dy [m, k]`` against a ``[n, k]`` weight (``k`` is then the weight's N, the contraction,
  and ``n`` its K, the output's columns). ``plan``: the split (:class:`Plan`; default :func:`plan_for`), as ``FT``
  (whole tiles) and ``SK`` (the tail's splits).

  Raises:
    ValueError: settings the kernel cannot take (:data:`STAGES` or :data:`SMALL_STAGES` < 2, :data:`IN_FLIGHT` not 0
      or 1, :data:`MAX_SPLITS` below 1, :data:`RASTER_GROUP` below 0, :data:`NARROW_PER_SM` not 1 or 2,
      :data:`WAIT_SYNC`, :data:`WARPGROUP_RELEASE`, :data:`PREFETCH_CODES` or :data:`TAIL_MEMSET` not 0 or 1,
      :data:`NARROW_REPAIR_MAX_N` below 0, :data:`DECODE` not 1-5, :data:`NARROW_DECODE` or :data:`WIDE_DECODE` not
      2-5, :data:`SMALL_WEIGHT_ROWS` not 64 or 128), or a ``plan`` whose splits do not divide the ``k / 64`` steps
      or whose whole tiles are not whole columns.
  """
  if (min(STAGES, SMALL_STAGES) < 2 or IN_FLIGHT not in (0, 1) or RASTER_GROUP < 0 or NARROW_PER_SM not in (1, 2)
      or WAIT_SYNC not in (0, 1) or WARPGROUP_RELEASE not in (0, 1) or PREFETCH_CODES not in (0, 1)
      or TAIL_MEMSET not in (0, 1) or NARROW_REPAIR_MAX_N < 0 or DECODE not in (1, 2, 3, 4, 5)
      or NARROW_DECODE not in (2, 3, 4, 5) or WIDE_DECODE not in (2, 3, 4, 5) or SMALL_WEIGHT_ROWS not in (64, 128)):
    raise ValueError(f"w4_gluon_mm: STAGES={STAGES}, SMALL_STAGES={SMALL_STAGES} (>= 2), IN_FLIGHT={IN_FLIGHT} (0 or 1), "
                     f"RASTER_GROUP={RASTER_GROUP} (>= 0), NARROW_PER_SM={NARROW_PER_SM} (1 or 2), "
                     f"WAIT_SYNC={WAIT_SYNC}, WARPGROUP_RELEASE={WARPGROUP_RELEASE}, PREFETCH_CODES={PREFETCH_CODES} "
                     f"and TAIL_MEMSET={TAIL_MEMSET} (0 or 1), NARROW_REPAIR_MAX_N={NARROW_REPAIR_MAX_N} (>= 0), "
                     f"DECODE={DECODE} (1-5), NARROW_DECODE={NARROW_DECODE} "
                     f"and WIDE_DECODE={WIDE_DECODE} (2-5), SMALL_WEIGHT_ROWS={SMALL_WEIGHT_ROWS} (64 or 128) "
                     f"are not all supported")
  plan = plan_for(m, k, n) if plan is None else Plan(*plan)
  mt, tiles = _tiles(m, k, n)
  if plan.splits < 1 or (k // STEP_K) % plan.splits or not 0 <= plan.full <= tiles or plan.full % mt:
    raise ValueError(f"w4_gluon_mm: plan {tuple(plan)} needs splits dividing the {k // STEP_K} steps (K = {k}) and "
                     f"0..{tiles} whole tiles in multiples of the {mt} row tiles")
  if plan.full < tiles and plan.splits == 1:
    plan = Plan(tiles, 1)  # an unsplit tail is whole tiles
  bm = block_m(m, k * n)
  pp = _per_sm(bm)
  stages = STAGES if bm == BLOCK_M else max(2, SMALL_STAGES // pp)
  steps = k // STEP_K
  pairs = RELEASE_PAIRS and IN_FLIGHT == 1 and stages % 2 == 0 and steps % 2 == 0 and (
      plan.full == tiles or (steps // plan.splits) % 2 == 0)
  dv = DECODE
  if DECODE in (2, 3) and decode_order and not dx:
    dv = WIDE_DECODE if bm == BLOCK_M else 5 if n <= NARROW_REPAIR_MAX_N else NARROW_DECODE
  return dict(M=m, N=n, K=k, L=layers, BM=bm, BN=BLOCK_N, S=stages,
              DR=LOAD_REGS, IF=2 if pairs else IN_FLIGHT, DV=dv, PP=pp, WS=WAIT_SYNC, WR=WARPGROUP_RELEASE,
              PF=int(bool(PREFETCH_CODES) and not pairs and IN_FLIGHT == 1 and dv >= 2 and PROBE != 1 and not dx
                     and bm < BLOCK_M),
              PR=PROBE, NP=_programs(m, k, n, plan), DO=int(decode_order), AD=int(addend), DX=int(dx), FT=plan.full,
              SK=plan.splits, G=RASTER_GROUP if 0 < RASTER_GROUP < mt else 0)


@functools.lru_cache(maxsize=None)
def _compiled(meta: tuple):
  """``(ptx, kernel name, shared bytes)`` of the kernel for the constexprs ``meta``, loaded on every GPU."""
  meta = dict(meta)
  compiled = compile_for(meta, w4_gluon._target_cc())
  return w4_gluon._load(compiled, ptx=ptx_for(compiled, meta))


def compile_for(meta: dict, cc: int = 90):
  """``triton.compile`` of the kernel for ``meta`` (:func:`meta_for`) and ``sm_{cc}`` (no GPU needed)."""
  arg_dtypes = _descriptor_types(_boxes(meta["BM"], bool(meta.get("DX")))) + _POINTERS
  # PP: programs an SM, the register cap's divisor; WS: a rewrite of the PTX (ptx_for); neither is a constexpr
  constexprs = {k: v for k, v in meta.items() if k not in ("PP", "WS")}
  return w4_gluon._compile_gluon(_kernel(), arg_dtypes, constexprs, cc, num_warps=8, maxnreg=_regs(meta.get("PP", 1)))


def ptx_for(compiled, meta: dict) -> str:
  """The PTX the launcher loads for ``compiled`` (:func:`compile_for` of ``meta``): Triton's; with ``WS`` 0
  (:data:`WAIT_SYNC`) without the MMA warps' barrier before each wait on a ready barrier (:func:`without_wait_barriers`);
  with ``WR`` 1 (:data:`WARPGROUP_RELEASE`) with each stage released by both warpgroups (:func:`warpgroup_releases`).

  Raises:
    RuntimeError: a rewrite that found nothing to rewrite (Triton's output changed).
  """
  ptx = compiled.asm["ptx"]
  if not meta.get("WS", 1):
    ptx, dropped = without_wait_barriers(ptx)
    if not dropped:
      raise RuntimeError("w4_gluon_mm: WAIT_SYNC=0 found no barrier before an mbarrier wait in the PTX")
  if meta.get("WR", 0):
    ptx, rewritten = warpgroup_releases(ptx)
    if not rewritten:
      raise RuntimeError("w4_gluon_mm: WARPGROUP_RELEASE=1 found no release in the PTX")
  return ptx


_MMA_BARRIER = "bar.sync 0, 256;"  # the 8 MMA warps' barrier (Triton writes "bar.sync \t0, 256;")
_ALU = re.compile(r"(mov|add|sub|mul|mad|shl|shr|and|or|xor|not|min|max|bfe|cvt|setp|selp)\.")  # no memory, no branch


def _after_mma_barriers(lines: list[str], labels: bool):
  """For each of the MMA warps' barriers in ``lines``: ``(its line, the next instruction's line, the register
  arithmetic lines between)``. Comments, ``.loc``, braces and ``.reg`` are skipped; labels too if ``labels`` (a
  branch into the gap would bypass the barrier: only a rewrite that needs no barrier may skip one)."""
  code = [i for i, l in enumerate(lines) if l.strip() and not l.strip().startswith(("//", ".loc", "{", ".reg"))]
  for c, i in enumerate(code):
    if " ".join(lines[i].split()) != _MMA_BARRIER:
      continue
    between = []
    for j in code[c + 1:]:
      t = lines[j].strip()
      if _ALU.match(t) or (labels and t.endswith(":")):
        between.append(j)
        continue
      yield i, j, between
      break


def warpgroup_releases(ptx: str) -> tuple[str, int]:
  """``ptx`` with each release of a ring stage by the MMA warps rewritten: Triton writes ``bar.sync 0, 256``, maybe
  some register arithmetic, then ``@P mbarrier.arrive`` with ``P`` thread 0's predicate (``(tid & 255) == 0``),
  possibly ANDed with the caller's ``pred`` first; this makes it an arrive by threads 0 and 128 (each warpgroup's
  first, ``(tid & 127) == 0``) under the same caller's predicate, with no barrier (a release whose predicate is a
  constant false only loses its barrier). The kernel's empty barriers then count 2 (``WR``). Returns the PTX and how
  many releases were rewritten.

  Raises:
    RuntimeError: an arrive of the MMA warps in another form, or a thread-0 predicate not defined as above (the
      rewrite would be wrong: Triton's output changed).
  """
  lines = ptx.split("\n")
  tid_mod_256 = set(re.findall(r"and\.b32\s+(%r\d+), %r\d+, 255;", ptx))
  thread0 = {p for p, r in re.findall(r"setp\.eq\.b32\s+(%p\d+), (%r\d+), 0;", ptx) if r in tid_mod_256}
  out, n = list(lines), 0
  for bar, at, between in _after_mma_barriers(lines, labels=False):
    arrive = re.fullmatch(r"@(%p\d+) mbarrier\.arrive\.shared::cta\.b64 _, \[(%r\d+)\];", " ".join(lines[at].split()))
    if arrive is None:
      continue  # a barrier before something else (a wait, or the barriers' init)
    pred, caller = arrive.group(1), None
    between = [" ".join(lines[j].split()) for j in between]
    if f"mov.pred {pred}, 0;" in between:  # a release that never runs (the caller's pred a constant false:
      out[bar] = ""                         # a one-step split unit), kept as dead as it was
      n += 1
      continue
    for t in between:
      pair = re.fullmatch(r"and\.pred (%p\d+), (%p\d+), (%p\d+);", t)
      if pair and pair.group(1) == pred:
        pred, caller = pair.group(2), pair.group(3)
    if pred not in thread0:
      raise RuntimeError(f"w4_gluon_mm: a release of the MMA warps in an unknown form: {lines[at].strip()}")
    out[bar] = ""
    both = "\n\tand.pred \twg_lead, wg_lead, " + caller + ";" if caller else ""
    out[at] = ("\t{\n\t.reg .pred wg_lead;\n\t.reg .b32 wg_tid;\n\tmov.u32 \twg_tid, %tid.x;\n"
               "\tand.b32 \twg_tid, wg_tid, 127;\n\tsetp.eq.b32 \twg_lead, wg_tid, 0;" + both +
               f"\n\t@wg_lead mbarrier.arrive.shared::cta.b64 _, [{arrive.group(2)}];\n\t}}")
    n += 1
  if n != len(re.findall(r"mbarrier\.arrive\.shared::cta\.b64 _,", ptx)):
    raise RuntimeError("w4_gluon_mm: an mbarrier arrive of the MMA warps without the barrier before it")
  return "\n".join(out), n


def without_wait_barriers(ptx: str) -> tuple[str, int]:
  """``ptx`` without each ``bar.sync 0, 256`` (the 8 MMA warps) whose next instruction, past register arithmetic,
  labels, comments, ``.loc``, braces and ``.reg``, is an ``mbarrier.try_wait``; returns it and how many were dropped.

  Waiting on an mbarrier neither reads nor writes data of other threads, so the barrier before it orders nothing:
  the stage's bytes come by TMA under that mbarrier's transaction count. Barriers before an arrive stay."""
  lines = ptx.split("\n")
  drop = {bar for bar, at, _ in _after_mma_barriers(lines, labels=True)
          if lines[at].strip().startswith("mbarrier.try_wait")}
  return "\n".join(l for i, l in enumerate(lines) if i not in drop), len(drop)


def forward(x: jax.Array, w: nvfp4.NVFP4Tensor, *, index=None, addend: jax.Array | None = None) -> jax.Array:
  """``x @ W (+ addend)`` by the large-M Gluon kernel (GPU only; no VJP: :mod:`pallas_kernels.matmul` calls it).

  Args:
    x: bf16 ``[M, K]``.
    w: :class:`~qerl_jax.nvfp4.NVFP4Tensor` ``[K, N]`` in either code order (read in place), or with ``index`` a
      stack ``[L, K, N]``. Decode-order codes take the paired decode (:func:`_asm_decode_order_paired`,
      :data:`NARROW_DECODE` and :data:`WIDE_DECODE`); where its form is ``DECODE`` 4 (the narrow tiles'), ``x``'s K
      rows are first permuted by :func:`x_in_nibble_pair_order`, one elementwise XLA op.
    index: int32 scalar (may be traced): layer of the stack, clamped to ``[0, L)``.
    addend: optional bf16 ``[M, N]`` added to the float32 product before its one rounding to bf16 (as cuBLAS's
      ``C`` with ``beta = 1``: the model's bias plus LoRA delta on its bf16 route, ``layers.BF16_EPILOGUE``).

  Returns:
    bf16 ``[M, N]``, accumulated in float32.

  Raises:
    ValueError: a shape or weight :func:`applies` rejects, an x/weight K mismatch, an addend that is not bf16
      ``[M, N]``, or ``index`` given with an unstacked weight (or missing with a stack).
    RuntimeError: the compiled kernel failed to load on a GPU.
  """
  m, k = x.shape
  if not applies(m, w, x.dtype) or w.shape[0] != k:
    raise ValueError(f"w4_gluon_mm.forward: no kernel for x {x.dtype}{list(x.shape)} and weight "
                     f"{type(w).__name__} {list(getattr(w, 'shape', ()))} (needs an sm_90 GPU with the FFI launcher, "
                     f"bf16 x, NVFP4, K % {STEP_K} == 0, N % {BLOCK_N} == 0)")
  if (index is None) != (w.packed.ndim == 2):
    raise ValueError(f"w4_gluon_mm.forward: index={index!r} with packed codes of shape {w.packed.shape}")
  if DECODE == 1:  # (the first build's PTX reads the standard order: the layer is converted by XLA first)
    w, index = w4_triton._standard_codes(w, index)
  n = w.shape[1]
  if addend is not None and (addend.shape != (m, n) or addend.dtype != jnp.bfloat16):
    raise ValueError(f"w4_gluon_mm.forward: addend {addend.dtype}{list(addend.shape)}; expected bfloat16{[m, n]}")
  layers = 1 if index is None else w.packed.shape[0]
  meta = meta_for(m, k, n, layers, w.code_order == "decode", addend is not None)
  if takes_nibble_pair_x(meta) and PAIRED_X_PERMUTE:
    x = x_in_nibble_pair_order(x)
  return _launch(x, w, index, meta, n, addend)


def dx_applies(m: int, w, dy_dtype) -> bool:
  """Whether :func:`dx` takes ``dy [m, N]`` (dtype ``dy_dtype``) against ``w``: an NVFP4 ``[K, N]`` weight (or stack)
  in either code order, bf16 ``dy``, ``m >= 1``, ``K`` a multiple of 128 (the tile's outputs), ``N`` a multiple of
  64 (a step), and :func:`pallas_kernels.w4_gluon.large_m_ready`."""
  if not isinstance(w, nvfp4.NVFP4Tensor) or jnp.dtype(dy_dtype) != jnp.bfloat16:
    return False
  k, n = w.shape
  return m >= 1 and k % BLOCK_N == 0 and n % STEP_K == 0 and w4_gluon.large_m_ready()


def dx(dy: jax.Array, w: nvfp4.NVFP4Tensor, *, index=None) -> jax.Array:
  """``dy @ W^T`` by the same kernel with ``W`` as the operand the other way round (session 46; GPU-tested since
  session 47; the default of :func:`pallas_kernels.matmul.kernel_dx` at 32 < M <= :data:`MAX_M` since session 49,
  :data:`pallas_kernels.matmul.GLUON_MM_DX`: on the H200 the 7B shapes at M = 2048 ran at 0.924x of bf16).

  ``dx^T [K, M] = W [K, N] @ dy^T [N, M]``: a tile is 128 rows of K (64 code rows, whose two nibbles are the
  operand's rows ``g, g + 8``) by 256 rows of ``dy``, over N in steps of 64; a thread's register pair is two adjacent
  columns of one K row (:func:`_asm_dx`), each with its own E4M3 block scale.

  Args:
    dy: bf16 ``[M, N]``.
    w: :class:`~qerl_jax.nvfp4.NVFP4Tensor` ``[K, N]`` in either code order (read in place), or with ``index`` a
      stack ``[L, K, N]``.
    index: int32 scalar (may be traced): layer of the stack, clamped to ``[0, L)``.

  Returns:
    bf16 ``[M, K]``, accumulated in float32.

  Raises:
    ValueError: a shape or weight :func:`dx_applies` rejects, a dy/weight N mismatch, or ``index`` given with an
      unstacked weight (or missing with a stack).
    RuntimeError: the compiled kernel failed to load on a GPU.
  """
  m, n = dy.shape
  if not dx_applies(m, w, dy.dtype) or w.shape[1] != n:
    raise ValueError(f"w4_gluon_mm.dx: no kernel for dy {dy.dtype}{list(dy.shape)} and weight {type(w).__name__} "
                     f"{list(getattr(w, 'shape', ()))} (needs an sm_90 GPU with the FFI launcher, bf16 dy, NVFP4, "
                     f"K % {BLOCK_N} == 0, N % {STEP_K} == 0)")
  if (index is None) != (w.packed.ndim == 2):
    raise ValueError(f"w4_gluon_mm.dx: index={index!r} with packed codes of shape {w.packed.shape}")
  k = w.shape[0]
  layers = 1 if index is None else w.packed.shape[0]
  meta = meta_for(m, n, k, layers, w.code_order == "decode", dx=True)
  return _launch(dy, w, index, meta, k)


def _launch(a, w, index, meta: dict, out_cols: int, addend=None) -> jax.Array:
  """The FFI call of the kernel built for ``meta`` on activations ``a`` (x or dy, bf16 ``[M, *]``) and ``w`` (layer
  ``index``), with the TMA descriptors of ``meta``'s build (:func:`_boxes`): bf16 ``[M, out_cols]``."""
  boxes = _boxes(meta["BM"], bool(meta["DX"]))
  codes, scales, gs, idx = w4_triton._layer_operands(w, w4_triton._format_of(w), index)
  ptx, name, shared = _compiled(tuple(meta.items()))
  operands = (a, codes, scales, gs, idx, jnp.zeros((1,), jnp.bfloat16) if addend is None else addend)
  m = a.shape[0]
  tail_cols = _tail_cols(out_cols, meta["FT"], -(-m // meta["BM"]))
  memset = bool(TAIL_MEMSET and tail_cols)
  # the tail's float32 columns, the second result (a placeholder without a tail): zeroed by XLA and aliased to the
  # kernel's operand after the addend, or with TAIL_MEMSET by the launcher (that operand then a placeholder the
  # kernel never reads); the first result is the whole tiles' bf16 output (a placeholder when every tile is split)
  tail_shape = (m, tail_cols) if tail_cols else (1,)
  zeros = jnp.zeros((1,) if memset else tail_shape, jnp.float32)
  out_shapes = (jax.ShapeDtypeStruct((m, out_cols) if meta["FT"] else (1,), jnp.bfloat16),
                jax.ShapeDtypeStruct(tail_shape, jnp.float32))
  # (without a tail the placeholders are neither aliased nor written: no zeroing kernel runs)
  aliases = {6: 1} if tail_cols and not memset else None
  y, tail = jax.ffi.ffi_call(w4_gluon._FFI_TARGET, out_shapes, input_output_aliases=aliases)(
      *operands, zeros, **w4_gluon._launch_attrs(ptx, name, (meta["NP"], 1, 1), shared, threads=_THREADS,
                                                 zero_results=2 if memset else 0,
                                                 tma=_tma_specs(operands, boxes)))
  if not tail_cols:
    return y
  if addend is not None:  # the tail's addend, in float32 before its one rounding
    tail = tail + addend[:, out_cols - tail_cols:].astype(jnp.float32)
  if not meta["FT"]:
    return tail.astype(jnp.bfloat16)
  return jax.lax.dynamic_update_slice(y, tail.astype(jnp.bfloat16), (0, out_cols - tail_cols))
