"""Decode-size W4A16 GEMV for NVFP4 weights in Gluon (Triton 3.6), launched by its own XLA FFI handler.

``forward(x, w)`` computes ``x @ W`` for bf16 ``x`` ``[M, K]`` with ``M <= 128`` and an NVFP4
``W`` ``[K, N]`` (or layer ``index`` of a stack ``[L, K, N]``, read in place), float32
accumulation. It is the decode path of :func:`pallas_kernels.matmul.quantized_matmul` on a GPU.
On an H200 against bf16 cuBLAS (the launchers' XLA flags), summed over the Qwen2.5-7B shapes, it is
2.52x / 2.48x / 1.98x / 1.71x / 1.09x faster at M = 1 / 8 / 16 / 32 / 64 with the codes in decode order
(2.45x / 2.33x / 1.96x / 1.61x / 1.17x in the standard order), each time including the memset of its
output, and 0.86x at M = 128, where it replaced dequantize + cuBLAS (0.46x) (docs/benchmarks.md,
sessions 11, 12 and 16); against XLA's Triton GEMM, which is faster than cuBLAS on the small q/k/v and
o matrices, about 1.7x at M <= 8 and 1.0x at M = 64 (standard order).

A weight in :func:`qerl_jax.nvfp4.to_decode_order`'s code order runs the ``DO`` build of each
kernel, whose E2M1 decode takes about a third fewer integer instructions (:func:`_asm`).

Three builds of one kernel source (:func:`_kernel`): M <= 16 uses mma.sync with 4 warps, x held in
registers by every warp, capped at 128 registers a thread (:func:`_register_cap`). M = 17-32
(sm_90; MB = 32) uses Hopper's wgmma with 8 warps (two warpgroups of 128 rows; the column bit
n2 moves from the registers to the warps, which halves each thread's registers):
the weight operand comes from registers as before, and x is stored to shared memory once per step,
where the tensor cores read it for all 256 rows. wgmma wants the operand's k pairs at ``k_width`` 2,
a register relabelling of the same decode; x is stored in the matching k order. M = 33-128 (MB = 64
or 128) uses the *narrow* wgmma build: 128 columns a program, each warpgroup one m64 wgmma of 64
rows, so a thread holds half the accumulator (at MB = 64 123 registers instead of 159, and two
programs share an SM); each thread loads 2 contiguous bytes a code row. At MB = 128 x does not
pass through registers: XLA permutes it to the operand's k order (:func:`x_in_slot_order`) and
cp.async copies it 3 steps ahead into a ring of 4 shared buffers (``X_STAGES``), which frees the
registers of x (164 -> 128, two programs an SM instead of one; Nsight Compute had found one program an
SM stalled on global loads 56% of the time). All builds add
their split-K parts with float32 atomics into a zeroed output (float32 partials would cost as many
bytes as the weight at M = 64), unless :func:`atomic_split_k` asks for a fixed summation order. The
FFI launcher zeroes that output with a memset on XLA's stream; the jax-triton path aliases it to an
XLA-zeroed operand.

Why Gluon: Gluon lets the kernel name the register layout of every tensor, which Pallas does not.
The Pallas kernel loads the codes through shared memory and gathers them byte by byte into the
tensor-core operand (Nsight Compute: L1/shared-memory pipe 74% busy at M = 8). Here each thread
loads exactly the bytes its MMA fragments need, 8 contiguous bytes per code row, straight into
registers; no shared memory is used in the main loop. The M <= 16 builds load the weight stream
evict-first (``LOAD_HINTS``), so that it does not push out of the L2 what a decode step reads again.

The kernel computes ``(x W)^T = W^T x^T`` (swap-AB): the weight is the MMA's A operand (rows are
output columns), the batch is the MMA's N (8 or 16). Three relabelings make the stored
``[K/2, N]`` codes (NVFP4, :mod:`qerl_jax.nvfp4`) land in the operand registers without moving
data between threads:

* rows: A's row ``r`` is output column ``n = nu(r)``, a fixed bit permutation chosen so that a
  thread's rows are 8 consecutive columns (one 8-byte load per code row);
* K: an MMA register holds two consecutive k slots of one row. The decode puts the low nibbles of
  code rows ``2j`` and ``2j + 1`` (k = 4j and 4j + 2) in one register and their high nibbles
  (k = 4j + 1, 4j + 3) in the next, so slot ``s`` holds ``k = s`` with bits 0 and 1 swapped; ``x``
  is loaded with the same swap (a register permutation inside each thread's 8 contiguous k);
* values: one inline-PTX block turns 2 x 4 code bytes and 4 block scales into 16 bf16 values by
  bit placement (as ``w4_triton``'s asm decode: ``e2m1 * scale * 2**-8``, exact; the accumulator is
  multiplied by ``2**8 / global scale``).

Each program owns 256 output columns (the narrow build 128) and ``STEPS`` contraction steps of 64 (split-K; with a fixed
summation order, float32 partials ``[S, M, N]`` summed by XLA). The step loop is unrolled and each
step's loads are issued one step ahead of their use. Shapes the kernel does not take (N not a
multiple of 256, K not a multiple of 64, M > 128, M > 16 off sm_90, NF4) go to the Pallas kernels;
:func:`applies` says which.

Needs ``triton`` 3.6 (``pip install -e ".[gluon]"``), an sm_80 or newer GPU (measured on sm_90),
and for the default launch path a C++17 compiler on PATH. Two launch paths, chosen by
:func:`launcher`:

* ``"ffi"`` (preferred): ``triton.compile`` gives the PTX, and a small XLA FFI handler
  (``pallas_kernels/gluon_launch.cc``, built with the system C++ compiler on first use and cached
  under ``$QERL_CACHE_DIR`` or ``~/.cache/qerl_jax``; ``QERL_GLUON_LAUNCHER`` may name a prebuilt
  library) launches it on XLA's stream. The handler is marked command-buffer compatible, so XLA can
  capture it in a decode step's CUDA graph.
* ``"jax_triton"``: ``jax_triton.triton_call``. jax-triton 0.3.1 compiles Triton-language kernels
  only, so :func:`_install` teaches its kernel cache to compile a Gluon kernel. Its legacy custom
  call is launched outside XLA's command buffers: a batch-8 rollout ran slower with it than with the
  Pallas kernel (docs/benchmarks.md, session 7).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import w4_triton
from qerl_jax import nvfp4

BLOCK_N = 256   # output columns per program
BLOCK_K = 64    # contraction per unrolled step
MAX_STEPS = 8   # unrolled steps per program (14 measured slower: more registers, fewer programs)
MAX_M = 128     # rows taken: M <= 16 by mma.sync (MB = 8, 16), 17-128 by wgmma (MB = 32, 64, 128; sm_90 only)
TARGET_PROGRAMS = 512  # measured best for the 7B shapes at M = 1-8 (docs/benchmarks.md, session 7)
WG_TARGET_PROGRAMS = 256  # the wgmma builds' split-K target: best of 256 / 512 / 1024 at M = 32, 64 (session 8)
NARROW_MIN_MB = 64  # wgmma builds of at least this MB (64, 128) take 128 columns a program (half the accumulator a thread)
NARROW_TARGET_PROGRAMS = 256  # their split-K target
NARROW_BLOCK_N = 128  # their columns a program at MB <= 64 (lab: 256, 16 warps; MB = 128 always takes 128)
NARROW_MAX_STEPS = 8  # lab: more K steps a program for them (fewer splits, less float32 atomic output traffic)
X_STAGES = 4  # wgmma builds of MB >= X_RING_MIN_MB copy x by cp.async into a ring of this many shared buffers
             # (0: off; else x is loaded to registers one step ahead and stored to shared memory each step)
X_RING_MIN_MB = 128  # MB = 128: 151.9 against 207.8 µs (7B shapes summed); M = 32, 64: no gain (session 12)
WG_ASYNC = 0  # lab (session 13): 1 issues the x-ring builds' wgmma asynchronously (step i + 1 decodes while step
              # i's MMA runs; the copies run one step less ahead); needs X_STAGES >= 3. Offline SASS: with the ring
              # at MB = 64 (X_RING_MIN_MB = 64) 120 registers, the HGMMAs pipelined (wait 1); at MB = 128 the cap
              # of 128 registers makes ptxas serialize them (160 uncapped). Not yet measured on the GPU.
MMA_MAX_REGISTERS = 128  # the mma.sync builds' register cap (M <= 16): 128 lets 4 programs of 128 threads share
  # an SM. 96 (5 programs) and 80 (6) spill and were slower (session 20: 51.6 and 62.5 against 50.0 µs summed over
  # the 7B shapes at M = 1; a batch-8 decode step 2.60 against 2.29 ms at 96).
LOAD_HINTS = 1  # cache hints on the code and block-scale loads of builds with MB <= LOAD_HINTS_MAX_MB (read once a call):
  # 0 none, 1 evict_first (the default; Triton's L1::evict_first plus an L2 evict_first policy), 2 .cg (L2 only;
  # ptxas refuses .cg with evict_first). Session 20 (H200, 7B shapes): alone, no change at M = 1-16 (50.1 against
  # 50.2 µs summed at M = 1) and 1-3% slower at M = 32 and 64; in a rollout, 512 new tokens, evict_first made a
  # batch-8 decode step 2.26-2.27 against 2.29-2.31 ms and a batch-16 step 2.72 against 2.79 (two alternations
  # each; .cg 2.30 at batch 8): the weight stream no longer pushes out of the L2 what the step reads again
  # (docs/benchmarks.md "Session 20")
LOAD_HINTS_MAX_MB = 16  # the mma.sync builds (M <= 16) only: on the wgmma builds a batch-32 / 64 step took 3.54 / 5.48
  # against 3.47 / 5.33 ms with the hint
LOAD_ASM = 2  # M <= 16 builds of weights up to LOAD_ASM_MAX_WEIGHTS values: the codes loaded by inline PTX that asks
  # the L2 for 256 bytes a miss: 1 ld.global.L2::256B, 2 (default) the read-only path (.nc.L1::no_allocate),
  # 3 with L1::evict_first; 0 Triton's loads. Measured (7B, M = 8, µs): q/k/v 8.4 -> 7.8 and o 7.5 -> 6.9 with 2,
  # but gate 18.1 -> 18.5 and down 17.5 -> 18.3 (session 20), hence the size limit. With it, a decode step
  # (512 new tokens, two alternations; session 21): batch 8 2.26 / 2.25 against 2.27 / 2.26 ms, batch 16
  # 2.70 / 2.70 against 2.73 / 2.71.
LOAD_ASM_MAX_WEIGHTS = 1 << 25  # LOAD_ASM only for weights of at most this many values (K x N): the 7B q/k/v (16.5M)
  # and o (12.8M), not gate/up (136M) or down (68M)
LORA_IN_KERNEL = True  # forward_into(lora=...) adds a LoRA adapter's (x @ A) @ B in the mma.sync builds' epilogue
  # (lora_into_applies) instead of leaving it to an XLA GEMM (decode steps; the wgmma builds with
  # LORA_IN_KERNEL_WG); False: XLA
LORA_IN_KERNEL_WG = 1  # the wgmma builds (M 17-128, sm_90) add the LoRA up-projection too (the same mma.sync
  # epilogue); 0: XLA adds it there. LoRA rank 32 + AQN, batch 32: a decode step 4.41 against 4.48 ms (session 22)
LORA_XA = 1  # a decode step computes a LoRA adapter's x @ A by lora_xa (one kernel, float32 partials that the LoRA
  # epilogue sums) instead of XLA's split GEMM and sum, and the decoder reads the adapters' A stacks in place
  # (qerl_jax.models.decoder); 0: XLA. LoRA rank 32 + AQN, two alternations (session 22): batch 8 2.79 / 2.80
  # against 2.82 / 2.81 ms a step, batch 16 3.32 / 3.32 against 3.32 / 3.31. Read at trace time.
MMA_WARPS = 4  # lab (session 26): 8 runs the mma.sync builds (M <= 16) of weights over MMA_WARPS_MIN_WEIGHTS values
  # with 8 warps a program: column bit n2 moves from the registers to a warp (as in the wgmma builds), so a thread
  # holds half the codes of a step (4 contiguous bytes a row) and needs fewer registers; under MMA8_MAX_REGISTERS
  # more warps share an SM. Measured slower (H200; docs/benchmarks.md "Session 26"): 7B gate at M = 8 18.1 us with
  # 4 warps, 19.3 / 19.8 / 20.8 with 8 at caps 128 / 80 / 64; a batch-8 decode step 2.08-2.10 ms against 2.20-2.21
  # (cap 80) and 2.51 (cap 64). More resident warps do not pay for narrower loads and x loaded by twice the warps.
  # FFI launcher only (jax-triton compiles it uncapped).
MMA_WARPS_MIN_WEIGHTS = 1 << 25  # MMA_WARPS only for weights of more values (K x N) than this: the 7B gate/up and
  # down, not q/k/v and o (whose LOAD_ASM loads take 8 bytes a thread and row)
MMA8_MAX_REGISTERS = 128  # the 8-warp mma.sync builds' register cap: 128 fits 2 programs an SM, 80 fits 3, 64 fits 4
MMA8_TARGET_PROGRAMS = 0  # their split-K target (0: TARGET_PROGRAMS)
SMALL_TARGET_PROGRAMS = 0  # lab (session 29): the split-K target of the mma.sync builds (M <= 16) of weights of at most
  # LOAD_ASM_MAX_WEIGHTS values (the 7B q/k/v and o: 28 splits of 2 steps at 512); 0: TARGET_PROGRAMS. 1024 (56 splits
  # of 1 step, 78 registers, 6 programs an SM) was slower on the H200: M = 8 q/k/v 9.2 against 7.8 µs, o 7.7 against
  # 7.0; a batch-8 decode step 2.146 against 2.083-2.101 ms (docs/benchmarks.md "Session 29")
SMALL_MAX_REGISTERS = 0  # lab (session 29): the register cap of those builds (0: MMA_MAX_REGISTERS). Offline (sm_90, M = 8,
  # decode order): 2 steps take 110 registers (4 programs an SM), 96 without spills (5); 1 step 78 (6), 64 without
  # spills (8). Measured: 96 the same at M = 8 (q/k/v 7.8, o 7.0 µs; batch-8 step 2.098 ms) and slower at M = 16
  # (spills: q/k/v 11.0 against 9.8; batch-16 step 2.735 against 2.558-2.566); 1 step at 64, 2.141 ms at batch 8
SCALE_PAIRS = 2  # (session 26) where each block scale is paired into both bf16 halves of a register once a block
  # (cvt.rn.bf16x2.f32) instead of by four prmt in every decode block of 16 weights: 2 (default) the wgmma builds
  # (M > 16), 1 every build, 0 none. SASS (7B gate/up): M = 8 3256 -> 3192 instructions a thread, M = 32
  # 1976 -> 1896. Measured on the H200 (docs/benchmarks.md "Session 26"): harness 0.6-1.8% faster summed over the
  # 7B shapes at M = 1-64; base decode step at 512 new tokens, batch 64 5.190 / 5.187 ms against 5.253, batch 32
  # 3.332 / 3.359 against 3.336 (with 2); at batch 8 2.094-2.099 against 2.081-2.098 and at batch 16 2.646-2.656
  # against 2.563 (with 1: the M = 16 build spills 8 registers instead of 6), hence 2
SCALE_F16 = 0  # lab (session 30): 1 converts the block scales of the builds without SCALE_PAIRS or SCALE_BYTES (the
  # mma.sync builds, M <= 16) by cvt to float16 and two integer operations a register (_SCALE_F16_ASM), instead of
  # float16 -> float32, a float32 multiply and a pack to bf16: about 2 instead of 6 instructions a pair of scales, for
  # a kernel that is bound by its compute warps (WS_PROBE). Offline sm_90: 3256 -> 3000 instructions a thread at M = 8.
  # Measured (session 30; its 30 GPU tests pass): harness M = 8 50.6 against 50.4 µs, M = 16 58.7 against 60.5; a
  # batch-8 step 2.061-2.083 ms against 2.073-2.106, batch 16 unchanged (2.579-2.586 against 2.560-2.581). Off: within
  # noise, and zero, negative and NaN scales are outside its arithmetic
SCALE_BYTES = 0  # lab (session 28): 1 gives the decode's inline PTX the block scales of builds without SCALE_PAIRS as
  # raw E4M3 bytes, made into bf16 scale * 2**118 pairs by bit placement and two multiplies (_asm's scale_bytes)
  # instead of the kernel's float32 conversion. Offline sm_90 SASS: M = 8 the same 3256 instructions a thread (384 of the
  # conversion become FMA-pipe ones), M = 16 3640 -> 3592. Measured on the H200 (session 29; its 30 GPU tests pass):
  # harness 2% faster at M = 1 and 8 (7B shapes summed, 48.1 / 49.6 against 49.0 / 50.6 µs), but no faster in a rollout
  # (batch-8 step 2.098 / 2.092 against 2.074 / 2.099 ms) and slower at batch 16 (2.650 / 2.652 against 2.563 / 2.560)
TMA_STAGES = 0  # lab (session 27): > 0 runs the mma.sync builds (M <= 16) with the codes and block scales copied by TMA
  # (host descriptors that the FFI launcher encodes) into this many shared buffers, one mbarrier each, refilled that
  # many steps ahead, instead of loaded to registers one step ahead (LOAD_ASM, LOAD_HINTS then do not apply). Measured
  # slower on the H200 (7B shapes summed, M = 1 / 8: 48.9 / 50.4 µs by default, 51.1 / 53.4 with 1 buffer, 51.8 / 55.2
  # with 4, 60.0 / 63.3 with 8; more programs or unrefilled buffers 51.3-57.2; docs/benchmarks.md "Session 27")
WS_STAGES = 0  # lab (session 30): > 0 runs the mma.sync builds (M <= 16) warp-specialized: one loader warp copies the
  # codes and block scales by TMA (TMA_STAGES' descriptors) into this many shared buffers, each with a "ready" and an
  # "empty" mbarrier, while the 4 compute warps decode and multiply; they hold no prefetched step in registers and
  # meet a block-wide barrier only in the epilogue (TMA_STAGES' builds lost to theirs: docs/benchmarks.md, session 27).
  # Measured slower on the H200 (session 30; its 60 GPU tests pass): 7B shapes summed, M = 1 / 8, 51.5-52.6 /
  # 53.0-53.6 µs against 49.1 / 50.4 with 1-4 buffers; a batch-8 rollout step 2.36 ms (4 buffers, large matrices only)
  # against 2.09-2.11. With the weight L2-resident (WS_PROBE 1) the compute warps alone take as long as the whole
  # kernel (gate 17.0-17.5 µs), while the loader alone takes 12.5-14: the decode GEMV is bound by its compute warps
WS_MAX_REGISTERS = 64  # the warp-specialized builds' register cap at launch: 2 warpgroups of 64 (the loader's warpgroup
  # gives its registers back: 24 a thread), so the compute warps get up to 104 and 4 programs share an SM. At least
  # 64: 48 (5 programs an SM, 72 registers a compute thread) was slower (56.0 / 57.9 µs) and, with 4 buffers and 4 steps
  # a program, wrong (relative error 0.5 on the H200; not investigated), so _build refuses caps under 64
WS_MAX_M = 8  # the most rows WS_STAGES builds take: at M = 16 (16-row x tiles) the GPU test against float64 failed
  # in 3 of its 15 cases at K = 18944, N = 3584 (5 runs x 1, 2, 4 buffers) on an H100 (session 55; relative error
  # 3e-3-5e-3 in a 2-layer stack, with 1 and with 2 buffers, never at M <= 8), a race not found: _build refuses M 9-16
WS_SMALL = 1  # WS_STAGES applies to the builds of _small_mma_sync (the 7B q/k/v and o) too; 0: the larger ones only
WS_PROBE = 0  # lab probe of the WS_STAGES builds (wrong results; experiments/lab/gluon/ws_probe.py only): 1 has the loader
  # copy split 0's first two steps over and over (an L2-resident stream: what the compute warps take alone), 2 has
  # the compute warps take each buffer and release it without decoding or multiplying (what the loader takes alone)
TMA_L2_PROMOTION = 2  # the descriptors' L2 promotion (CUtensorMapL2promotion: 0 none, 1 64 B, 2 128 B, 3 256 B)
L2_PROBE = 0  # lab probe (session 31; wrong results, experiments/lab/gluon/l2_probe.py only): 1 has every split of a
# column tile read split 0's codes and scales, so the weight stream is L2-resident and the time is the kernel's
# without HBM (the register-load builds, M <= 128; the TMA and loader-warp builds have WS_PROBE). Measured: 0.87-0.94
# of the time from HBM at the 7B shapes, M = 1-64: the kernel is bound inside its programs
MMA_ATOMIC = True  # split-K by atomics in the mma.sync builds (M <= 16) too: 1-4% faster at M = 1-16 than
                   # float32 partials (docs/benchmarks.md, session 9); False stores partials as before


@functools.lru_cache(maxsize=None)
def available() -> bool:
  """True when ``triton`` with Gluon imports and a launch path exists (:func:`launcher`).

  Raises:
    ValueError: ``QERL_GLUON_LAUNCH`` set to something other than "ffi" or "jax_triton".
  """
  try:
    from triton.experimental import gluon  # noqa: F401
  except ImportError:
    return False
  return launcher() is not None


def applies(m: int, w, x_dtype) -> bool:
  """Whether :func:`forward` takes ``x [m, K]`` (dtype ``x_dtype``) times ``w``: NVFP4, bf16 x,
  ``1 <= m <= MAX_M`` (``m > 16`` only where every visible GPU is sm_90: wgmma), N a multiple of 256,
  K a multiple of 64 with a split of at most 8 steps."""
  if not isinstance(w, nvfp4.NVFP4Tensor) or jnp.dtype(x_dtype) != jnp.bfloat16:
    return False
  k, n = w.shape
  return 1 <= m <= max_rows() and n % BLOCK_N == 0 and k % BLOCK_K == 0 and _splits(k, n) is not None


def max_rows() -> int:
  """The most rows :func:`applies` takes: ``MAX_M`` where every visible GPU is sm_90 (the wgmma
  builds), else 16 (the mma.sync builds)."""
  return MAX_M if _wgmma_gpus() else 16


def _row_block(m: int) -> int:
  """MB, the rows one program multiplies: 8 or 16 for ``m <= 16`` (mma.sync), else 32, 64 or 128 (wgmma)."""
  return 8 if m <= 8 else 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128


def _use_wgmma(m: int) -> bool:
  """Whether ``m`` rows run the wgmma build (sm_90): ``m > 16``. (A wgmma build at MB = 16 measured
  64.1 µs against 59.5 for mma.sync at M = 16, 7B shapes summed; docs/benchmarks.md, session 9.)"""
  return m > 16


def _splits(k: int, n: int, target: int | None = None, block_n: int = BLOCK_N, max_steps: int | None = None
            ) -> int | None:
  """The split count: a divisor of the K steps with at most ``max_steps`` (default MAX_STEPS) steps per program, giving
  the program count (column tiles x splits) nearest ``target`` (default TARGET_PROGRAMS; ties to
  fewer splits); None if no divisor fits."""
  total = k // BLOCK_K
  tiles = n // block_n
  target = TARGET_PROGRAMS if target is None else target
  max_steps = MAX_STEPS if max_steps is None else max_steps
  options = [s for s in range(1, total + 1) if total % s == 0 and total // s <= max_steps]
  if not options:
    return None
  return min(options, key=lambda s: (abs(tiles * s - target), s))


def _asm(decode_order: bool = False, scale_pairs: bool = False, scale_bytes: bool = False) -> str:
  """Inline PTX: code words ``$8`` (row 2j, 4 columns) and ``$9`` (row 2j+1, same columns), block
  scales ``$10, $11`` (4 bf16, times 2**118) -> ``$0..$3`` low nibbles, ``$4..$7`` high nibbles; each
  output register holds (row 2j, row 2j+1) of one column, as bf16 ``e2m1 * scale * 2**-8`` (exact).

  Bit placement makes ``e2m1 * 2**-126`` (sign to bit 15, the three magnitude bits to 6-8 of each
  16-bit half) and one bf16x2 multiply by the scale finishes it. One ``prmt`` pairs the two rows'
  bytes of two columns, so that each 16-bit half holds four nibbles of one row and the top nibble's
  sign is already in place (the layout Marlin's FP4 dequantization gets by repacking the weight;
  here the pairing is done in registers): about 4 integer operations a register of two weights.
  (Session 7's decode paired one column's bytes at the bottom of each half and moved every sign: 6%
  more instructions at M = 8, 1% slower; docs/benchmarks.md, session 11.)

  ``decode_order``: the codes are in :func:`qerl_jax.nvfp4.to_decode_order`'s order, where each
  ``prmt`` word gives three of its four registers by one mask after a left shift of 0, 3 or 6 bits
  and the fourth from three shifted pieces; the outputs are the same registers with the same values.

  ``scale_pairs`` (:data:`SCALE_PAIRS`): the scales come as four registers ``$10..$13``, column q's bf16
  scale already in both halves (made once a block by the kernel's ``cvt.rn.bf16x2.f32``), instead of
  two registers that this block pairs with four ``prmt``.

  ``scale_bytes`` (:data:`SCALE_BYTES`, lab): ``$10`` holds the four block scales as raw E4M3 bytes. Column q's byte
  goes to bits 4..11 of both halves (one ``prmt``, one shift): an E4M3 byte shifted left by 4 is the bf16 of
  ``scale * 2**-120`` (exponent and mantissa land in bf16's; E4M3 subnormals on bf16 subnormals), and two exact
  bf16x2 multiplies by 2**119 make it ``scale * 2**118``, instead of the kernel's float32 conversion."""
  lines = ["{", ".reg .b32 u, m, t, nz, s0, s1, s2, s3;", "mov.b32 nz, 0x80008000;"]
  if scale_bytes:
    lines += [".reg .b32 z, c119;", "mov.b32 z, 0;", "mov.b32 c119, 0x7B007B00;"]  # bf16 2**119 in both halves
  for q in range(4):  # the bf16 scale of column q in both halves
    sc = "$10" if q < 2 else "$11"
    if scale_bytes:
      lines += [f"prmt.b32 s{q}, $10, z, 0x4{q}4{q};", f"shl.b32 s{q}, s{q}, 4;",
                f"fma.rn.bf16x2 s{q}, s{q}, c119, nz;", f"fma.rn.bf16x2 s{q}, s{q}, c119, nz;"]
      continue
    lines.append(f"mov.b32 s{q}, ${10 + q};" if scale_pairs else
                 f"prmt.b32 s{q}, {sc}, {sc}, {'0x1010' if q % 2 == 0 else '0x3232'};")
  for h in range(2):  # columns 2h, 2h + 1: u = [row 2j: col 2h, col 2h+1 | row 2j+1: col 2h, col 2h+1]
    lines.append(f"prmt.b32 u, $8, $9, {'0x5410' if h == 0 else '0x7632'};")
    if decode_order:  # u is a block word in nvfp4.DECODE_ORDER_BITS: (column, nibble) -> its bits
      for q, nib, pieces in ((0, 0, [("shl", 0, "0x81C081C0")]), (0, 1, [("shl", 3, "0x81C081C0")]),
                             (1, 0, [("shl", 6, "0x81C081C0")]),
                             (1, 1, [("shr", 3, "0x01800180"), ("shl", 2, "0x80008000"), ("shr", 8, "0x00400040")])):
        for i, (op, sh, mask) in enumerate(pieces):
          dst = "m" if i == 0 else "t"
          lines += [f"{op}.b32 {dst}, u, {sh};" if sh else f"mov.b32 {dst}, u;", f"and.b32 {dst}, {dst}, {mask};"]
          lines += [] if i == 0 else ["or.b32 m, m, t;"]
        col = 2 * h + q
        lines.append(f"fma.rn.bf16x2 ${col + 4 * nib}, m, s{col}, nz;")
      continue
    for p in (12, 8, 4, 0):  # nibble at bits p..p+3 of each half: column 2h + p // 8, low nibble if p % 8 == 0
      q = 2 * h + p // 8
      reg = f"${q if p % 8 == 0 else 4 + q}"
      lines.append(f"shr.b32 m, u, {p - 6};" if p > 6 else f"shl.b32 m, u, {6 - p};")
      lines.append("and.b32 m, m, 0x01C001C0;")
      lines += ["and.b32 t, u, 0x80008000;"] if p == 12 else [f"shl.b32 t, u, {12 - p};", "and.b32 t, t, 0x80008000;"]
      lines += ["or.b32 m, m, t;", f"fma.rn.bf16x2 {reg}, m, s{q}, nz;"]
  return "\n".join(lines + ["}"])


# SCALE_F16: four E4M3 block scales (one byte each, $2) -> four bf16 of scale * 2**118 ($0, $1). cvt gives each pair's
# exact float16; its bits shifted right by 3 put float16's exponent on bf16's exponent bits and its 3 nonzero mantissa
# bits (E4M3 has 3) on bf16's top three, and adding 230 to the exponent field (0x7300 a half) turns 2**(e - 15) into
# 2**(e - 15 + 118) under bf16's bias of 127. Every positive E4M3 value (subnormals included) is a normal float16 with
# exponent field 6..23, so the sum stays in 16 bits (no carry between halves) and is exact. Zero, negative and NaN
# scales are outside it (zero gives 2**103), which the NVFP4 quantizer never writes (its block scales are positive).
_SCALE_F16_ASM = "\n".join([
    "{", ".reg .b16 lo, hi;", ".reg .b32 a, b;", "mov.b32 {lo, hi}, $2;",
    "cvt.rn.f16x2.e4m3x2 a, lo;", "cvt.rn.f16x2.e4m3x2 b, hi;",
    "shr.b32 a, a, 3;", "shr.b32 b, b, 3;", "add.u32 $0, a, 0x73007300;", "add.u32 $1, b, 0x73007300;", "}"])


def scale_f16_bits(codes: np.ndarray) -> np.ndarray:
  """:data:`_SCALE_F16_ASM`'s arithmetic on the host, for tests: E4M3 bytes (uint8, any shape) -> the bf16 bit
  patterns (uint16) of ``scale * 2**118`` it produces (float16 bits >> 3, plus 0x7300)."""
  import ml_dtypes
  f16 = np.asarray(codes, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float16).view(np.uint16)
  return ((f16.astype(np.uint32) >> 3) + 0x7300).astype(np.uint16)


@functools.lru_cache(maxsize=None)
def _gdc():
  """The Gluon helper ``gdc(G)`` of the constexpr ``GDC`` (this module's GEMV, :mod:`pallas_kernels.residual_norm`;
  imports triton lazily): grid dependency control for a programmatic dependent launch (PDL). With bit 2 of ``G`` the
  ``griddepcontrol.launch_dependents`` hint (the next grid may launch once every program here has given it), then
  ``griddepcontrol.wait`` (the previous grid has finished and its writes are visible). Both are no-ops in a launch
  without the PDL attribute."""
  from triton.experimental import gluon
  from triton.experimental.gluon import language as ttgl

  @gluon.jit
  def gdc(G: ttgl.constexpr):
    if G & 4:
      ttgl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=ttgl.int32,
                                  is_pure=False, pack=1)
    ttgl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=ttgl.int32, is_pure=False, pack=1)

  return gdc


@functools.lru_cache(maxsize=None)
def _kernel(wg: bool = False, narrow_n: int = 0, lora: bool = False, w8: bool = False, tma: bool = False):
  """Builds the Gluon kernel (imports triton lazily: CPU installs need not have it).

  ``lora``: the entry that also takes a LoRA adapter's ``x @ A`` (bf16 ``[M, R]``, or with constexpr
  ``XP`` > 0 float32 partial products ``[XP, M, R]`` that it sums and rounds to bf16) and ``B`` (bf16
  ``[L, R, N]``) before the output pointers (:data:`_ARG_DTYPES_LORA`) and adds ``LS * (x @ A) @ B``
  to its tile (constexprs ``LR`` = R and ``LS``): split ``s`` of a column tile adds ranks
  ``16 s .. 16 s + 15`` with one more MMA, so the splits share the work (see :func:`lora_into_applies`).

  ``wg=False``: 4 warps, mma.sync, x in registers (MB = 8, 16). ``wg=True``: 8 warps (two
  warpgroups of 128 rows), Hopper ``wgmma`` with the decoded weight from registers and x from
  shared memory (MB = 32, 64): x is stored once per program and step instead of held by every warp.
  ``narrow_n`` (with ``wg``; 0: off): ``narrow_n`` (128 or 256) columns a program, each
  warpgroup 64 of them (one m64 wgmma), so that a thread holds half the accumulator; 8 or 16 warps.
  ``w8`` (mma.sync only; :data:`MMA_WARPS` 8): 8 warps, column bit n2 on the third warp bit as in the wgmma
  builds (each thread 4 contiguous code bytes a row, half the codes a step), rows 16, 32 and 64 of the
  operand on the warps.
  ``tma`` (mma.sync only; :data:`TMA_STAGES`, lab): the entry takes two TMA descriptors first (codes
  ``[L K / 2, N]`` in boxes of ``[32, 256]``, block scales ``[L K / 16, N]`` in boxes of ``[4, 256]``;
  :func:`_tma_specs`), and the codes and scales of ``TS`` steps are copied by TMA into a ring of shared
  buffers (one mbarrier each) ahead of their use, instead of loaded to registers one step ahead.
  """
  from triton.experimental import gluon
  from triton.experimental.gluon import language as ttgl
  from triton.experimental.gluon.language.nvidia import hopper
  from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
  from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma as hopper_tma

  gdc = _gdc()
  asm = ttgl.constexpr(_asm())
  asm_do = ttgl.constexpr(_asm(decode_order=True))  # codes in nvfp4.to_decode_order's order
  asm_sp = ttgl.constexpr(_asm(scale_pairs=True))  # DO bit 1 (SCALE_PAIRS): the scales paired once a block
  asm_do_sp = ttgl.constexpr(_asm(decode_order=True, scale_pairs=True))
  scale_f16_asm = ttgl.constexpr(_SCALE_F16_ASM)
  asm_sb = ttgl.constexpr(_asm(scale_bytes=True))  # DO bit 2 (SCALE_BYTES): the scales as raw E4M3 bytes
  asm_do_sb = ttgl.constexpr(_asm(decode_order=True, scale_bytes=True))
  # codes [32 rows, 256 columns]: registers n0 n1 n2 kp0 kp1 kp4; lanes kp2 kp3 n3 n4 n5; warps n6 n7.
  # With 8 warps, column bit n2 moves from the registers to the third warp bit.
  n2_reg, n2_warp = ([], [[0, 4]]) if wg or w8 else ([[0, 4]], [])
  narrow = narrow_n > 0
  # the narrow build's warps own column bits n4 and up (n4 n5 n6, and n7 with 16 warps)
  top_bits = [1 << b for b in range(4, narrow_n.bit_length() - 1)] if narrow else []
  if narrow:  # codes [32 rows, narrow_n columns]: registers n0 kp0 kp1 kp4; lanes kp2 kp3 n1 n2 n3; warps n4 ..
    code_layout = ttgl.constexpr(ttgl.DistributedLinearLayout(
        reg_bases=[[0, 1], [1, 0], [2, 0], [16, 0]], lane_bases=[[4, 0], [8, 0], [0, 2], [0, 4], [0, 8]],
        warp_bases=[[0, b] for b in top_bits], block_bases=[], shape=[32, narrow_n]))
    group_layout = ttgl.constexpr(ttgl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 1, 0], [2, 0, 0]], lane_bases=[[0, 2, 0], [1, 0, 0], [0, 0, 2], [0, 0, 4], [0, 0, 8]],
        warp_bases=[[0, 0, b] for b in top_bits], block_bases=[], shape=[4, 4, narrow_n]))
  else:
    code_layout = ttgl.constexpr(ttgl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2]] + n2_reg + [[1, 0], [2, 0], [16, 0]],
        lane_bases=[[4, 0], [8, 0], [0, 8], [0, 16], [0, 32]],
        warp_bases=[[0, 64], [0, 128]] + n2_warp, block_bases=[], shape=[32, 256]))
    # the even code rows viewed as [4 scale groups, 4 row pairs, 256]: the block scales' parent layout
    group_layout = ttgl.constexpr(ttgl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2]] + [[0] + b for b in n2_reg] + [[0, 1, 0], [2, 0, 0]],
        lane_bases=[[0, 2, 0], [1, 0, 0], [0, 0, 8], [0, 0, 16], [0, 0, 32]],
        warp_bases=[[0, 0, 64], [0, 0, 128]] + [[0] + b for b in n2_warp], block_bases=[], shape=[4, 4, 256]))
  # LOAD_ASM (lab): inline PTX loads of the codes, 8 bytes a thread and row
  load_asm = ttgl.constexpr(["", "ld.global.L2::256B.v2.b32 {$0, $1}, [$2];",
                             "ld.global.nc.L1::no_allocate.L2::256B.v2.b32 {$0, $1}, [$2];",
                             "ld.global.L1::evict_first.L2::256B.v2.b32 {$0, $1}, [$2];"])
  BN = ttgl.constexpr(narrow_n if narrow else 256)
  NARROW = ttgl.constexpr(narrow)
  # narrow: the decode's axes -> operand rows (r_top .. r0 = n_top .. n4 n0 n3 n2 n1, see decode) and the
  # accumulator's rows -> columns, for TOP = len(top_bits) warp-owned column bits
  TOP = ttgl.constexpr(len(top_bits))
  a_perm_n = ttgl.constexpr(list(range(4, 4 + len(top_bits))) + [3] + [4 + len(top_bits) + i for i in range(3)]
                            + [0, 8 + len(top_bits), 9 + len(top_bits), 1, 2, 7 + len(top_bits)])
  o_perm_n = ttgl.constexpr(list(range(len(top_bits))) + [len(top_bits) + 1 + i for i in range(3)]
                            + [len(top_bits), 4 + len(top_bits)])

  # Operand rows from the decode's output axes (j: 4 bits, labelled columns: 8, p, lo/hi): warps own
  # rows 16 and 32 (and 64 with 8 warps), so there the warp bit n2 (axis 9) takes row 64 and p row 128.
  a_perm = ttgl.constexpr([12, 9] if wg or w8 else [9, 12])
  o_n2 = ttgl.constexpr(1 if wg or w8 else 0)  # the inverse, rows -> [n7 .. n0]: [2, 3, 5, 6, 7, o_n2, 1 - o_n2, 4, 8]
  WARPS = ttgl.constexpr(_warps(wg, narrow_n, w8))
  WG = ttgl.constexpr(wg)
  # the mma.sync accumulator layout: the M <= 16 builds', and every build's LoRA product
  mma_sync = ttgl.constexpr(ttgl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1],
                                                        instr_shape=[16, 8]))

  @gluon.jit
  def wload(ptr, LH: ttgl.constexpr):
    """A load of the weight stream with :data:`LOAD_HINTS` ``LH``'s cache hints."""
    if LH == 1:
      v = ttgl.load(ptr, eviction_policy="evict_first")
    elif LH == 2:
      v = ttgl.load(ptr, cache_modifier=".cg")
    else:
      v = ttgl.load(ptr)
    return v

  @gluon.jit
  def asm_load(ptr, LA: ttgl.constexpr):
    """The codes [32, 256] (code_layout, 8 contiguous bytes a thread and row) loaded by LOAD_ASM ``LA``'s PTX, 8
    bytes an instruction: each element's pointer is its chunk's first byte (the same value for all 8, so the
    asm's 8 pointer operands are one register)."""
    base = ptr - (ptr.to(ttgl.int64, bitcast=True) & 7).to(ttgl.int32)
    return ttgl.inline_asm_elementwise(load_asm[LA], "=r,=r,l,l,l,l,l,l,l,l", [base], dtype=ttgl.uint8,
                                       is_pure=True, pack=8)

  @gluon.jit
  def load_step(x_ptr, p_ptr, s_ptr, c_offs, x_offs, x_mask, s_row0, n0, i, N: ttgl.constexpr,
                WITH_X: ttgl.constexpr = True, LH: ttgl.constexpr = 0, LA: ttgl.constexpr = 0):
    if LA:
      c = asm_load(p_ptr + c_offs + i * (32 * N), LA)
    else:
      c = wload(p_ptr + c_offs + i * (32 * N), LH)
    xb = ttgl.load(x_ptr + x_offs + i * 64, mask=x_mask, other=0.0) if WITH_X else 0
    sg = ttgl.arange(0, 4, layout=ttgl.SliceLayout(1, ttgl.SliceLayout(1, group_layout)))
    sn = ttgl.arange(0, BN, layout=ttgl.SliceLayout(0, ttgl.SliceLayout(1, group_layout)))
    s = wload(s_ptr + ttgl.expand_dims(sg + (s_row0 + i * 4), 1) * N + ttgl.expand_dims(sn, 0) + n0, LH)
    return c, s, xb

  @gluon.jit
  def tma_fill(cd, sd, bar, c_buf, s_buf, c_row, s_row, n0):
    """Arms ``bar`` for one step's codes and scales (36 rows of BN bytes) and copies them by TMA into ``c_buf``,
    ``s_buf`` from code row ``c_row`` and scale row ``s_row`` (column ``n0``)."""
    mbarrier.expect(bar, 36 * BN)
    hopper_tma.async_copy_global_to_shared(cd, [c_row, n0], bar, c_buf)
    hopper_tma.async_copy_global_to_shared(sd, [s_row, n0], bar, s_buf)

  @gluon.jit
  def ws_load(cd, sd, c_smem, s_smem, ready, empty, kp0, s_row0, n0, STEPS: ttgl.constexpr, WSP: ttgl.constexpr):
    """WS_STAGES' loader warp: step i's codes and scales by TMA into buffer i % NB once the compute warps have
    released its previous fill (``empty``), signalling ``ready``. ``WSP`` 1: :data:`WS_PROBE`'s L2-resident stream."""
    NB: ttgl.constexpr = c_smem.type.shape[0]
    for i in ttgl.static_range(STEPS):
      if i >= NB:
        mbarrier.wait(empty.index(i % NB), (i // NB - 1) & 1)
      if WSP == 1:
        tma_fill(cd, sd, ready.index(i % NB), c_smem.index(i % NB), s_smem.index(i % NB), (i % 2) * 32, (i % 2) * 4, n0)
      else:
        tma_fill(cd, sd, ready.index(i % NB), c_smem.index(i % NB), s_smem.index(i % NB), kp0 + i * 32,
                 s_row0 + i * 4, n0)

  @gluon.jit
  def ring_step(x_ptr, x_offs, x_mask, bar, c_buf, s_buf, nxt, phase):
    """A step of a shared-memory ring (TMA_STAGES, WS_STAGES): step ``nxt``'s x loaded ahead, the wait on ``bar``
    (parity ``phase``), then the step's codes and block scales read from ``c_buf``, ``s_buf``."""
    x1 = ttgl.load(x_ptr + x_offs + nxt * 64, mask=x_mask, other=0.0)
    mbarrier.wait(bar, phase)
    return x1, c_buf.load(code_layout), s_buf.load(ttgl.SliceLayout(1, group_layout))

  @gluon.jit
  def ws_compute(x_ptr, x_offs, x_mask, c_smem, s_smem, ready, empty, STEPS: ttgl.constexpr, MB: ttgl.constexpr,
                 DO: ttgl.constexpr, WSP: ttgl.constexpr):
    """WS_STAGES' compute warps: each step waits for its buffer, reads it to registers, releases it to the loader,
    then decodes and multiplies; x by register loads one step ahead. Returns the [BN, MB] float32 accumulator."""
    NB: ttgl.constexpr = c_smem.type.shape[0]
    acc = ttgl.zeros([BN, MB], ttgl.float32, layout=mma_sync)
    xl: ttgl.constexpr = ttgl.DotOperandLayout(1, mma_sync, 8)
    x0 = ttgl.load(x_ptr + x_offs, mask=x_mask, other=0.0)
    for i in ttgl.static_range(STEPS):
      x1, c0, s0 = ring_step(x_ptr, x_offs, x_mask, ready.index(i % NB), c_smem.index(i % NB), s_smem.index(i % NB),
                             min(i + 1, STEPS - 1), (i // NB) & 1)
      if i + NB < STEPS:  # the loader refills this buffer with step i + NB (no proxy fence: the arrive orders the
        mbarrier.arrive(empty.index(i % NB), count=1)  # reads, as CUTLASS's TMA pipelines release their buffers)
      if WSP != 2:
        a = ttgl.convert_layout(decode(c0, s0, DO), ttgl.DotOperandLayout(0, mma_sync, 8))
        acc = mma_v2(a, ttgl.convert_layout(x_slots(x0), xl), acc)
      x0 = x1
    return (acc,)  # (warp_specialize takes the default partition's results as a tuple)

  @gluon.jit
  def decode(c, s, DO_ALL: ttgl.constexpr):
    """codes [32, 256] and block scales [4, 256] of one step -> the weight operand [256 rows, 64 k]
    (``DO_ALL`` bit 0: the codes in decode order; bit 1: :data:`SCALE_PAIRS`; bit 2: :data:`SCALE_BYTES`; bit 3:
    :data:`SCALE_F16`)."""
    DO: ttgl.constexpr = (DO_ALL or 0) % 8  # (an entry's DO left out of the constexprs arrives as None)
    SF: ttgl.constexpr = (DO_ALL or 0) >= 8
    pairs: ttgl.constexpr = DO == 2 or DO == 3
    sbytes: ttgl.constexpr = DO == 4 or DO == 5
    c_a, c_b = ttgl.split(ttgl.permute(ttgl.reshape(c, [16, 2, BN]), [0, 2, 1]))  # rows 2j, 2j+1
    c_a4 = ttgl.reshape(c_a, [4, 4, BN])
    if sbytes:  # raw E4M3 bytes: the asm converts them
      s = s.to(ttgl.uint8, bitcast=True)
    elif SF:  # SCALE_F16: E4M3 -> float16 (exact), then bf16 * 2**118 by bit placement (_SCALE_F16_ASM)
      s = ttgl.inline_asm_elementwise(scale_f16_asm, "=r,=r,r", [s.to(ttgl.uint8, bitcast=True)],
                                      dtype=ttgl.bfloat16, is_pure=True, pack=4)
    else:
      s = s.to(ttgl.float32) * 3.3230699894622896e+35  # times 2**118
      if pairs:  # in both bf16 halves of a register, once a block
        s = ttgl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $1, $1;", "=r,r", [s], dtype=ttgl.uint32,
                                        is_pure=True, pack=1)
      else:
        s = s.to(ttgl.bfloat16)
    s_a = ttgl.reshape(ttgl.broadcast(ttgl.expand_dims(s, 1), c_a4)[0], [16, BN])
    s_a = ttgl.convert_layout(s_a, c_a.type.layout, assert_trivial=True)
    # 8 outputs; the codes of rows 2j and 2j+1; 4 scale registers (pairs), 2 (four bf16 scales) or 1 (E4M3 bytes)
    o1, o2, o3, o4 = ttgl.inline_asm_elementwise(
        (asm_do_sb if DO == 5 else asm_sb) if sbytes else
        (asm_do_sp if DO == 3 else asm_sp) if pairs else (asm_do if DO else asm),
        "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r" if sbytes else
        "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r" if pairs else "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r", [c_a, c_b, s_a],
        dtype=(ttgl.bfloat16, ttgl.bfloat16, ttgl.bfloat16, ttgl.bfloat16), is_pure=True, pack=4)
    if NARROW:
      j = ttgl.reshape(ttgl.join(ttgl.join(o1, o2), ttgl.join(o3, o4)), [2] * (10 + TOP))
      # axes [kp4 kp3 kp2 | kp1 (labelled; holds column n0) | n_top .. n1 | n0 (labelled; holds row parity,
      # k1) | o1/o2: k2 | lo/hi: k0] -> A [rows r_top .. r0 = n_top .. n4 n0 n3 n2 n1, slots s5 .. s0 = k5 k2
      # k0 k4 k3 k1]: the lanes' slot bits 1, 2 (k3, k4) and row bits 0-2, the warps' rows 4 and up where
      # the operand layout has them; the register bits in any order (at 128 columns all six orders
      # compile to the same layout; this one took the fewest registers, offline SASS). At 128
      # columns the permutation is [4, 5, 6, 3, 7, 8, 9, 0, 11, 12, 1, 2, 10].
      a = ttgl.reshape(ttgl.permute(j, a_perm_n.value), [BN, 64])
    else:  # [j 4 bits][column 8 bits][p][lo/hi] -> A [r 8 bits, k slot 6 bits]
      j = ttgl.reshape(ttgl.join(ttgl.join(o1, o2), ttgl.join(o3, o4)), [2] * 14)
      a = ttgl.reshape(ttgl.permute(j, [a_perm[0], a_perm[1], 4, 5, 10, 6, 7, 8, 0, 1, 2, 3, 13, 11]), [256, 64])
      if WG:  # wgmma takes k_width 2: relabel k bits 1, 2, 3, 4 as 3, 4, 1, 2 (a register reordering)
        a = ttgl.reshape(ttgl.permute(ttgl.reshape(a, [256, 2, 2, 2, 2, 2, 2]), [0, 1, 4, 5, 2, 3, 6]), [256, 64])
    return a

  @gluon.jit
  def x_slots(xb):
    """x [64 k, MB] in the weight operand's k order: bits 0 and 1 swapped (the decode pairs code rows
    2j and 2j+1), and for wgmma the k_width-2 relabelling on top."""
    mb: ttgl.constexpr = xb.shape[1]
    if NARROW:
      # slots s5 .. s0 = k5 k2 k0 k4 k3 k1 (the decode's operand above)
      xs = ttgl.reshape(ttgl.permute(ttgl.reshape(xb, [2, 2, 2, 2, 2, 2, mb]), [0, 3, 5, 1, 2, 4, 6]), [64, mb])
    else:
      xs = ttgl.reshape(ttgl.permute(ttgl.reshape(xb, [16, 2, 2, mb]), [0, 2, 1, 3]), [64, mb])
      if WG:
        xs = ttgl.reshape(ttgl.permute(ttgl.reshape(xs, [2, 2, 2, 2, 2, 2, mb]), [0, 3, 4, 1, 2, 5, 6]), [64, mb])
    return xs

  @gluon.jit
  def gemv(x_ptr, p_ptr, s_ptr, gs_ptr, idx_ptr, xa_ptr, b_ptr, z_ptr, o_ptr, M: ttgl.constexpr, N: ttgl.constexpr,
           K: ttgl.constexpr, L: ttgl.constexpr, STEPS: ttgl.constexpr, MB: ttgl.constexpr, ATOMIC: ttgl.constexpr,
           XS: ttgl.constexpr, WA: ttgl.constexpr, DO: ttgl.constexpr, LH: ttgl.constexpr, LA: ttgl.constexpr,
           LR: ttgl.constexpr, LS: ttgl.constexpr, XP: ttgl.constexpr, cd=None, sd=None, TS: ttgl.constexpr = 0,
           WS: ttgl.constexpr = 0, WSP: ttgl.constexpr = 0, LP: ttgl.constexpr = 0, GDC: ttgl.constexpr = 0):
    """The kernel body; ``LR`` > 0 (the mma.sync builds only) adds the LoRA term (see _kernel's ``lora``);
    ``TS`` > 0 (mma.sync only): codes and scales by TMA (descriptors ``cd``, ``sd``) into ``TS`` shared buffers."""
    if WG:
      mma: ttgl.constexpr = ttgl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                        instr_shape=[16, MB, 16])
      a_layout: ttgl.constexpr = ttgl.DotOperandLayout(0, mma, 2)
      # x loaded 8 contiguous k a thread, stored once a step to one of 2 shared buffers for wgmma (or, with
      # the ring, XS buffers that cp.async fills)
      xl: ttgl.constexpr = ttgl.BlockedLayout([8, 1], [8, 4], [1, WARPS], [0, 1])
      xs_layout: ttgl.constexpr = ttgl.NVMMASharedLayout.get_default_for([64, MB], ttgl.bfloat16, transposed=True)
      x_smem = ttgl.allocate_shared_memory(ttgl.bfloat16, [XS if XS > 2 else 2, 64, MB], xs_layout)
    else:
      mma: ttgl.constexpr = mma_sync
      a_layout: ttgl.constexpr = ttgl.DotOperandLayout(0, mma, 8)
      xl: ttgl.constexpr = ttgl.DotOperandLayout(1, mma, 8)
    pid_n = ttgl.program_id(0)
    pid_s = ttgl.program_id(1)
    layer = ttgl.minimum(ttgl.maximum(ttgl.load(idx_ptr), 0), L - 1)
    gs = ttgl.load(gs_ptr + layer)
    n0 = pid_n * BN
    pid_w = pid_s
    if LP:  # (L2_PROBE: every split reads split 0's weight rows, an L2-resident stream)
      pid_w = 0
    kp0 = pid_w * (STEPS * 32) + layer * (K // 2)  # first code row of this split (layers folded)
    s_row0 = pid_w * (STEPS * 4) + layer * (K // 16)
    kp = ttgl.arange(0, 32, layout=ttgl.SliceLayout(1, code_layout))
    nn = ttgl.arange(0, BN, layout=ttgl.SliceLayout(0, code_layout))
    c_offs = ttgl.expand_dims(kp + kp0, 1) * N + ttgl.expand_dims(nn, 0) + n0
    kk = ttgl.arange(0, 64, layout=ttgl.SliceLayout(1, xl))
    mm = ttgl.arange(0, MB, layout=ttgl.SliceLayout(0, xl))
    x_offs = ttgl.expand_dims(kk + pid_s * (STEPS * 64), 1) + ttgl.expand_dims(mm, 0) * K
    x_mask = ttgl.expand_dims(mm < M, 0) & ttgl.expand_dims(kk >= 0, 1)
    acc = ttgl.zeros([BN, MB], ttgl.float32, layout=mma)
    if WS:  # warp-specialized (WS_STAGES): a loader warp fills NB buffers by TMA; the 4 warps here compute
      NB: ttgl.constexpr = TS if TS < STEPS else STEPS
      c_smem = ttgl.allocate_shared_memory(ttgl.uint8, [NB, 32, BN], cd.layout)
      s_smem = ttgl.allocate_shared_memory(ttgl.float8e4nv, [NB, 4, BN], sd.layout)
      ready = ttgl.allocate_shared_memory(ttgl.int64, [NB, 1], mbarrier.MBarrierLayout())
      empty = ttgl.allocate_shared_memory(ttgl.int64, [NB, 1], mbarrier.MBarrierLayout())
      for j in ttgl.static_range(NB):
        mbarrier.init(ready.index(j), count=1)
        mbarrier.init(empty.index(j), count=1)
      hopper.fence_async_shared()
      acc = ttgl.warp_specialize([(ws_compute, (x_ptr, x_offs, x_mask, c_smem, s_smem, ready, empty, STEPS, MB, DO,
                                                WSP)),
                                  (ws_load, (cd, sd, c_smem, s_smem, ready, empty, kp0, s_row0, n0, STEPS, WSP))],
                                 [1], [24])[0]
    elif TS > 0:  # codes and scales by TMA: NB shared buffers, one mbarrier each, refilled NB steps ahead
      NB: ttgl.constexpr = TS if TS < STEPS else STEPS
      c_smem = ttgl.allocate_shared_memory(ttgl.uint8, [NB, 32, BN], cd.layout)
      s_smem = ttgl.allocate_shared_memory(ttgl.float8e4nv, [NB, 4, BN], sd.layout)
      bars = ttgl.allocate_shared_memory(ttgl.int64, [NB, 1], mbarrier.MBarrierLayout())
      for j in ttgl.static_range(NB):
        mbarrier.init(bars.index(j), count=1)
      hopper.fence_async_shared()
      for j in ttgl.static_range(NB):
        tma_fill(cd, sd, bars.index(j), c_smem.index(j), s_smem.index(j), kp0 + j * 32, s_row0 + j * 4, n0)
      ttgl.thread_barrier()  # every thread sees the initialised barriers before it waits on one
      x0 = ttgl.load(x_ptr + x_offs, mask=x_mask, other=0.0)
      for i in ttgl.static_range(STEPS):
        x1, c0, s0 = ring_step(x_ptr, x_offs, x_mask, bars.index(i % NB), c_smem.index(i % NB), s_smem.index(i % NB),
                               min(i + 1, STEPS - 1), (i // NB) & 1)
        if i + NB < STEPS:  # everyone has read buffer i % NB: refill it with step i + NB
          ttgl.thread_barrier()
          hopper.fence_async_shared()
          tma_fill(cd, sd, bars.index(i % NB), c_smem.index(i % NB), s_smem.index(i % NB), kp0 + (i + NB) * 32,
                   s_row0 + (i + NB) * 4, n0)
        a = ttgl.convert_layout(decode(c0, s0, DO), a_layout)
        acc = mma_v2(a, ttgl.convert_layout(x_slots(x0), xl), acc)
        x0 = x1
    elif XS > 0:  # x, already in slot order (x_in_slot_order), copied by cp.async PRE steps ahead into a ring of XS buffers
      # rows past M read row M - 1 (their outputs are never stored)
      xp_offs = ttgl.expand_dims(kk + pid_s * (STEPS * 64), 1) + ttgl.expand_dims(ttgl.minimum(mm, M - 1), 0) * K
      # copies run PRE steps ahead: XS - 1, or XS - 2 with an asynchronous MMA (WA), whose buffer is free
      # one step later
      PRE: ttgl.constexpr = XS - 1 - WA
      for j in ttgl.static_range(PRE):
        if j < STEPS:
          async_copy.async_copy_global_to_shared(x_smem.index(j), x_ptr + xp_offs + j * 64)
        async_copy.commit_group()
      c0, s0, _ = load_step(x_ptr, p_ptr, s_ptr, c_offs, x_offs, x_mask, s_row0, n0, 0, N, False, LH)
      for i in ttgl.static_range(STEPS):
        c1, s1, _ = load_step(x_ptr, p_ptr, s_ptr, c_offs, x_offs, x_mask, s_row0, n0, min(i + 1, STEPS - 1), N,
                              False, LH)
        if WA:  # decoded before the wait, so that it overlaps step i - 1's MMA
          a = ttgl.convert_layout(decode(c0, s0, DO), a_layout, assert_trivial=True)
        async_copy.wait_group(PRE - 1)  # this thread's copies of step i have landed
        hopper.fence_async_shared()
        # everyone's copies of step i are visible, and everyone's MMA of step i - 1 - WA is done (synchronous,
        # or waited for below), so its buffer takes step i + PRE
        ttgl.thread_barrier()
        if i + PRE < STEPS:
          async_copy.async_copy_global_to_shared(x_smem.index((i + PRE) % XS), x_ptr + xp_offs + (i + PRE) * 64)
        async_copy.commit_group()
        if WA:  # step i's MMA runs while step i + 1 decodes; wait for step i - 1's (a kept live until then)
          acc = hopper.warpgroup_mma(a, x_smem.index(i % XS), acc, is_async=True)
          acc, a = hopper.warpgroup_mma_wait(1, deps=[acc, a])
        else:
          acc = hopper.warpgroup_mma(ttgl.convert_layout(decode(c0, s0, DO), a_layout, assert_trivial=True),
                                     x_smem.index(i % XS), acc)
        c0, s0 = c1, s1
      if WA:
        acc = hopper.warpgroup_mma_wait(0, deps=[acc])
    else:
      G: ttgl.constexpr = 0 if GDC is None else GDC  # (an unset constexpr is None here)
      if not G:
        c0, s0, x0 = load_step(x_ptr, p_ptr, s_ptr, c_offs, x_offs, x_mask, s_row0, n0, 0, N, True, LH, LA)
      elif GDC & 2:  # (PDL, decode_chain) step 0's codes and scales before the wait for the previous grid, x after it
        c0, s0, _ = load_step(x_ptr, p_ptr, s_ptr, c_offs, x_offs, x_mask, s_row0, n0, 0, N, False, LH, LA)
        if GDC & 8:  # (and step 1's)
          cp, sp, _ = load_step(x_ptr, p_ptr, s_ptr, c_offs, x_offs, x_mask, s_row0, n0, min(1, STEPS - 1), N, False,
                                LH, LA)
        gdc(GDC)
        x0 = ttgl.load(x_ptr + x_offs, mask=x_mask, other=0.0)
      else:  # (PDL) the wait first
        gdc(GDC)
        c0, s0, x0 = load_step(x_ptr, p_ptr, s_ptr, c_offs, x_offs, x_mask, s_row0, n0, 0, N, True, LH, LA)
      for i in ttgl.static_range(STEPS):  # unrolled; step i+1's loads are issued before step i's math
        if (G & 10) == 10 and i == 0:  # (PDL) step 1's codes and scales came before the wait
          c1, s1 = cp, sp
          x1 = ttgl.load(x_ptr + x_offs + min(1, STEPS - 1) * 64, mask=x_mask, other=0.0)
        else:
          c1, s1, x1 = load_step(x_ptr, p_ptr, s_ptr, c_offs, x_offs, x_mask, s_row0, n0, min(i + 1, STEPS - 1), N,
                                 True, LH, LA)
        if WG:
          # buffer i % 2 was last read by step i - 2's (synchronous) MMA, done before barrier i - 1
          buf = x_smem.index(i % 2)
          buf.store(x_slots(x0))
          hopper.fence_async_shared()
          ttgl.thread_barrier()
          acc = hopper.warpgroup_mma(ttgl.convert_layout(decode(c0, s0, DO), a_layout, assert_trivial=True), buf, acc)
        else:
          a = ttgl.convert_layout(decode(c0, s0, DO), a_layout)
          acc = mma_v2(a, ttgl.convert_layout(x_slots(x0), xl), acc)
        c0, s0, x0 = c1, s1, x1
    acc = acc * (256.0 / gs)  # 2**8 undoes the decode's 2**-8
    # rows r -> columns n = nu(r) (the inverse relabelling), then 16-byte stores along n
    if NARROW:  # rows (r_top .. r0) = (n_top .. n4 n0 n3 n2 n1); at 128 columns [0, 1, 2, 4, 5, 6, 3, 7]
      acc = ttgl.reshape(ttgl.permute(ttgl.reshape(acc, [2] * (4 + TOP) + [MB]), o_perm_n.value), [BN, MB])
    else:
      acc = ttgl.reshape(ttgl.permute(ttgl.reshape(acc, [2] * 8 + [MB]), [2, 3, 5, 6, 7, o_n2, 1 - o_n2, 4, 8]),
                         [256, MB])
    st: ttgl.constexpr = ttgl.BlockedLayout([4, 1], [32, 1], [1, WARPS], [0, 1])
    acc = ttgl.convert_layout(acc, st)
    if LR > 0:  # LS * (x @ A) @ B for this tile: split pid_s takes ranks 16 pid_s .. 16 pid_s + 15
      if pid_s < LR // 16:
        r0 = pid_s * 16
        bl: ttgl.constexpr = ttgl.BlockedLayout([1, 16], [32, 1], [WARPS, 1], [1, 0])  # B^T [BN, 16], lanes along n
        bn = ttgl.arange(0, BN, layout=ttgl.SliceLayout(1, bl))
        br = ttgl.arange(0, 16, layout=ttgl.SliceLayout(0, bl))
        bt = ttgl.load(b_ptr + layer * (LR * N) + ttgl.expand_dims(br + r0, 0) * N + ttgl.expand_dims(bn + n0, 1))
        # (x @ A)^T [16, MB]: bf16, 16 ranks a thread (as measured on the GPU); the partials sum, one value a thread
        al: ttgl.constexpr = (ttgl.BlockedLayout([1, 1], [16, 2], [1, WARPS], [0, 1]) if XP else
                              ttgl.BlockedLayout([16, 1], [1, 32], [1, WARPS], [0, 1]))
        ar = ttgl.arange(0, 16, layout=ttgl.SliceLayout(1, al))
        am = ttgl.arange(0, MB, layout=ttgl.SliceLayout(0, al))
        if XP:  # x @ A as XP float32 partial products [XP, M, R] (lora_xa): summed here, then rounded to bf16
          xa_offs = ttgl.expand_dims(am, 0) * LR + ttgl.expand_dims(ar + r0, 1)
          xa_mask = ttgl.expand_dims(am < M, 0) & ttgl.expand_dims(ar >= 0, 1)
          xas = ttgl.zeros([16, MB], ttgl.float32, layout=al)
          for p in ttgl.static_range(XP):
            xas += ttgl.load(xa_ptr + p * (M * LR) + xa_offs, mask=xa_mask, other=0.0)
          xat = xas.to(ttgl.bfloat16)
        else:
          xat = ttgl.load(xa_ptr + ttgl.expand_dims(am, 0) * LR + ttgl.expand_dims(ar + r0, 1),
                          mask=ttgl.expand_dims(am < M, 0) & ttgl.expand_dims(ar >= 0, 1), other=0.0)
        # mma.sync for this small product in every build (the wgmma builds' own layout is wgmma's)
        lacc = mma_v2(ttgl.convert_layout(bt, ttgl.DotOperandLayout(0, mma_sync, 2)),
                      ttgl.convert_layout(xat, ttgl.DotOperandLayout(1, mma_sync, 2)),
                      ttgl.zeros([BN, MB], ttgl.float32, layout=mma_sync))
        acc = acc + ttgl.convert_layout(lacc, st) * LS
    no = ttgl.arange(0, BN, layout=ttgl.SliceLayout(1, st))
    mo = ttgl.arange(0, MB, layout=ttgl.SliceLayout(0, st))
    o_mask = ttgl.expand_dims(mo < M, 0) & ttgl.expand_dims(no >= 0, 1)
    if ATOMIC:  # split-K summed in the L2: float32 atomics (REDG.F32x4) into the zeroed output, z_ptr's alias
      ttgl.atomic_add(o_ptr + ttgl.expand_dims(mo, 0) * N + ttgl.expand_dims(no + n0, 1), acc, mask=o_mask,
                      sem="relaxed")
    else:  # float32 partials [S, M, N], summed by XLA
      ttgl.store(o_ptr + pid_s * (M * N) + ttgl.expand_dims(mo, 0) * N + ttgl.expand_dims(no + n0, 1), acc,
                 mask=o_mask)

  @gluon.jit
  def w4a16_gemv(x_ptr, p_ptr, s_ptr, gs_ptr, idx_ptr, z_ptr, o_ptr, M: ttgl.constexpr, N: ttgl.constexpr,
                 K: ttgl.constexpr, L: ttgl.constexpr, STEPS: ttgl.constexpr, MB: ttgl.constexpr,
                 ATOMIC: ttgl.constexpr, XS: ttgl.constexpr, WA: ttgl.constexpr, DO: ttgl.constexpr = 0,
                 LH: ttgl.constexpr = 0, LA: ttgl.constexpr = 0, LP: ttgl.constexpr = 0, GDC: ttgl.constexpr = 0):
    ttgl.static_assert(M > 0)  # (names ttgl in the body, so that the annotations resolve)
    gemv(x_ptr, p_ptr, s_ptr, gs_ptr, idx_ptr, x_ptr, x_ptr, z_ptr, o_ptr, M, N, K, L, STEPS, MB, ATOMIC, XS, WA,
         DO, LH, LA, 0, 0.0, 0, LP=LP, GDC=GDC)

  @gluon.jit
  def w4a16_gemv_lora(x_ptr, p_ptr, s_ptr, gs_ptr, idx_ptr, xa_ptr, b_ptr, z_ptr, o_ptr, M: ttgl.constexpr,
                      N: ttgl.constexpr, K: ttgl.constexpr, L: ttgl.constexpr, STEPS: ttgl.constexpr,
                      MB: ttgl.constexpr, ATOMIC: ttgl.constexpr, XS: ttgl.constexpr, WA: ttgl.constexpr,
                      DO: ttgl.constexpr = 0, LH: ttgl.constexpr = 0, LA: ttgl.constexpr = 0, LR: ttgl.constexpr = 16,
                      LS: ttgl.constexpr = 1.0, XP: ttgl.constexpr = 0):
    ttgl.static_assert(LR % 16 == 0)
    gemv(x_ptr, p_ptr, s_ptr, gs_ptr, idx_ptr, xa_ptr, b_ptr, z_ptr, o_ptr, M, N, K, L, STEPS, MB, ATOMIC, XS,
         WA, DO, LH, LA, LR, LS, XP)

  @gluon.jit
  def w4a16_gemv_tma(cd, sd, x_ptr, p_ptr, s_ptr, gs_ptr, idx_ptr, z_ptr, o_ptr, M: ttgl.constexpr, N: ttgl.constexpr,
                     K: ttgl.constexpr, L: ttgl.constexpr, STEPS: ttgl.constexpr, MB: ttgl.constexpr,
                     ATOMIC: ttgl.constexpr, XS: ttgl.constexpr, WA: ttgl.constexpr, DO: ttgl.constexpr = 0,
                     LH: ttgl.constexpr = 0, LA: ttgl.constexpr = 0, TS: ttgl.constexpr = 2, WS: ttgl.constexpr = 0,
                     WSP: ttgl.constexpr = 0):
    ttgl.static_assert(TS > 0)
    gemv(x_ptr, p_ptr, s_ptr, gs_ptr, idx_ptr, x_ptr, x_ptr, z_ptr, o_ptr, M, N, K, L, STEPS, MB, ATOMIC, XS, WA,
         DO, LH, LA, 0, 0.0, 0, cd, sd, TS, WS, WSP)

  @gluon.jit
  def w4a16_gemv_lora_tma(cd, sd, x_ptr, p_ptr, s_ptr, gs_ptr, idx_ptr, xa_ptr, b_ptr, z_ptr, o_ptr,
                          M: ttgl.constexpr, N: ttgl.constexpr, K: ttgl.constexpr, L: ttgl.constexpr,
                          STEPS: ttgl.constexpr, MB: ttgl.constexpr, ATOMIC: ttgl.constexpr, XS: ttgl.constexpr,
                          WA: ttgl.constexpr, DO: ttgl.constexpr = 0, LH: ttgl.constexpr = 0, LA: ttgl.constexpr = 0,
                          LR: ttgl.constexpr = 16, LS: ttgl.constexpr = 1.0, XP: ttgl.constexpr = 0,
                          TS: ttgl.constexpr = 2, WS: ttgl.constexpr = 0, WSP: ttgl.constexpr = 0):
    ttgl.static_assert(LR % 16 == 0)
    gemv(x_ptr, p_ptr, s_ptr, gs_ptr, idx_ptr, xa_ptr, b_ptr, z_ptr, o_ptr, M, N, K, L, STEPS, MB, ATOMIC, XS,
         WA, DO, LH, LA, LR, LS, XP, cd, sd, TS, WS, WSP)

  if tma:
    return w4a16_gemv_lora_tma if lora else w4a16_gemv_tma
  return w4a16_gemv_lora if lora else w4a16_gemv


# The TMA entry's descriptors (TMA_STAGES), one step of a program each: (operand, element type, box) for the codes
# [L K / 2, N] u8 (boxes of 32 x 256) and the block scales [L K / 16, N] (4 x 256), unswizzled
_TMA_BOXES = ((1, "u8", (BLOCK_K // 2, BLOCK_N)), (2, "fp8e4nv", (BLOCK_K // 16, BLOCK_N)))
_TMA_LAYOUT = "NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)"
# their signature types (Triton's host tensor descriptors)
_TMA_DESCRIPTORS = tuple(f"tensordesc<{t}[{r}, {c}],{_TMA_LAYOUT}>" for _, t, (r, c) in _TMA_BOXES)


def _tma_specs(operands, meta) -> np.ndarray | None:
  """The FFI launcher's ``tma`` attribute (``gluon_launch.cc``) for a TMA build (constexpr ``TS``): the two
  descriptors of :data:`_TMA_BOXES`, each ``operand, rows, columns, box rows, box columns, L2 promotion``, after
  their count; None for the other builds."""
  if "TS" not in meta:
    return None
  specs = [[i, *operands[i].shape, *box, TMA_L2_PROMOTION] for i, _, box in _TMA_BOXES]
  return np.array([len(specs)] + [v for spec in specs for v in spec], np.int64)


_INSTALLED = []
# x, codes, block scales, global scales, layer, zeros (the atomic builds' output, aliased, unless the FFI
# launcher zeroes the output; else unused), out
_ARG_DTYPES = ("*bf16", "*u8", "*fp8e4nv", "*fp32", "*i32", "*fp32", "*fp32")
_ARG_DTYPES_LORA = _ARG_DTYPES[:5] + ("*bf16", "*bf16") + _ARG_DTYPES[5:]  # + x @ A [M, R] and B [L, R, N], bf16
_ARG_DTYPES_LORA_XP = _ARG_DTYPES[:5] + ("*fp32", "*bf16") + _ARG_DTYPES[5:]  # x @ A as float32 partials [XP, M, R]
_ARG_DTYPES_XA = ("*bf16", "*bf16", "*i32", "*fp32")  # lora_xa's kernel: x, A [L, K, R], layer, partials [S, M, R]


def _compile_gluon(fn, arg_dtypes, constexprs: dict, cc: int, num_warps: int = 4, maxnreg: int | None = None,
                   options: dict | None = None, gluon: bool = True):
  """``triton.compile`` of the Gluon kernel ``fn`` (with ``gluon=False``, of a plain Triton ``triton.jit`` kernel)
  for ``sm_{cc}``: its arrays typed ``arg_dtypes`` (all 16-byte aligned, as JAX allocates them), ``constexprs``
  specialised, at most ``maxnreg`` registers a thread if given; ``options``: more of Triton's compile options (the
  lab's PDL probe passes ``launch_pdl``; :mod:`pallas_kernels.append_attention` ``num_stages``)."""
  import triton
  from triton.backends.compiler import GPUTarget
  from triton.compiler import ASTSource
  from triton.experimental.gluon._runtime import GluonASTSource

  signature = {fn.arg_names[i]: d for i, d in enumerate(arg_dtypes)}
  signature.update({name: "constexpr" for name in constexprs})
  attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(arg_dtypes))}
  _ensure_triton_cache_dir()
  source = GluonASTSource if gluon else ASTSource
  return triton.compile(source(fn, signature, constexprs=dict(constexprs), attrs=attrs),
                        target=GPUTarget("cuda", cc, 32),
                        options={"num_warps": num_warps, **({"maxnreg": maxnreg} if maxnreg else {}),
                                 **(options or {})})


def _ensure_triton_cache_dir():
  """``triton.compile`` needs a cache folder; where none resolves (an empty ``TRITON_CACHE_DIR``, or
  a home that is not writable, as on the project's GPU machine) a temporary one is used."""
  from triton import knobs
  folder = knobs.cache.dir
  try:
    ok = bool(folder) and (os.makedirs(folder, exist_ok=True) or os.access(folder, os.W_OK))
  except OSError:
    ok = False
  if not ok:
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="qerl-triton-")


def _install():
  """Lets jax-triton's kernel cache compile Gluon kernels (jax-triton 0.3.1 builds every kernel as
  Triton-language TTIR). Idempotent; Triton-language kernels take jax-triton's own path."""
  if _INSTALLED:
    return
  import jax_triton.triton_lib as jt

  original = jt.get_or_create_triton_kernel
  cache = {}

  def get_or_create(backend_init_func, platform, fn, arg_dtypes, scalar_args, *, num_warps, num_stages, num_ctas,
                    compute_capability, enable_fp_fusion, metaparams, dump):
    if not (hasattr(fn, "is_gluon") and fn.is_gluon()):
      return original(backend_init_func, platform, fn, arg_dtypes, scalar_args, num_warps=num_warps,
                      num_stages=num_stages, num_ctas=num_ctas, compute_capability=compute_capability,
                      enable_fp_fusion=enable_fp_fusion, metaparams=metaparams, dump=dump)
    if scalar_args:
      raise ValueError("w4_gluon: Gluon kernels take arrays and constexprs only")
    cc = compute_capability or jt.triton_kernel_call_lib.get_compute_capability(0)
    key = (fn, tuple(arg_dtypes), tuple(sorted(metaparams.items())), num_warps, cc)
    if key not in cache:
      compiled = _compile_gluon(fn, arg_dtypes, metaparams, cc, num_warps, maxnreg=_register_cap(
          num_warps >= 8, num_warps >= 8 and metaparams["MB"] >= NARROW_MIN_MB, metaparams["MB"], metaparams["XS"]))
      kernel = jt.triton_kernel_call_lib.TritonKernel(compiled.metadata.name, num_warps, 1, compiled.metadata.shared,
                                                      compiled.asm["ptx"], "", cc)
      cache[key] = (kernel, {(i,): [["tt.divisibility", 16]] for i in range(len(arg_dtypes))})
    return cache[key]

  jt.get_or_create_triton_kernel = get_or_create
  _INSTALLED.append(True)


_FFI_TARGET = "qerl_gluon_launch"
_CHAIN_TARGET = "qerl_gluon_chain"  # several kernels in one FFI call: chain_call (pallas_kernels.decode_chain)


def _build_ffi_library() -> str | None:
  """Path of the compiled ``gluon_launch.cc`` (built once per source and jaxlib version), or None
  when no C++ compiler is found or the build fails (the jax-triton path is used then)."""
  prebuilt = os.environ.get("QERL_GLUON_LAUNCHER")
  if prebuilt:
    if not os.path.exists(prebuilt):
      warnings.warn(f"QERL_GLUON_LAUNCHER={prebuilt!r} does not exist; the Gluon FFI launcher is off")
      return None
    return prebuilt
  source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gluon_launch.cc")
  include = jax.ffi.include_dir()
  tag = hashlib.sha256(open(source, "rb").read() + include.encode() + jax.__version__.encode()).hexdigest()[:16]
  folder = os.environ.get("QERL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "qerl_jax")
  path = os.path.join(folder, f"libqerl_gluon_launch_{tag}.so")
  if os.path.exists(path):
    return path
  compiler = shutil.which("c++") or shutil.which("g++")
  if compiler is None:
    warnings.warn("no c++/g++ on PATH to build the Gluon kernel's FFI launcher; the Gluon kernel is off "
                  "unless QERL_GLUON=1 with jax-triton installed (docs/kernels.md)")
    return None
  tmp = None
  try:
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-std=c++17", "-w", f"-I{include}", source, "-o", tmp,
                    "-ldl"], check=True, capture_output=True)
    os.replace(tmp, path)  # atomic: a concurrent build never sees half a library
  except (OSError, subprocess.CalledProcessError) as e:
    if tmp is not None and os.path.exists(tmp):
      os.remove(tmp)
    detail = e.stderr.decode(errors="replace")[-2000:] if isinstance(e, subprocess.CalledProcessError) else str(e)
    warnings.warn(f"building the Gluon kernel's FFI launcher failed; the Gluon kernel is off:\n{detail}")
    return None
  return path


@functools.lru_cache(maxsize=None)
def _ffi_library():
  """The loaded launcher library with its FFI target registered for CUDA, or None."""
  path = _build_ffi_library()
  if path is None:
    return None
  try:
    lib = ctypes.CDLL(path)
    jax.ffi.register_ffi_target(_FFI_TARGET, jax.ffi.pycapsule(lib.QerlGluonLaunch), platform="CUDA")
    jax.ffi.register_ffi_target(_CHAIN_TARGET, jax.ffi.pycapsule(lib.QerlGluonChain), platform="CUDA")
  except (OSError, AttributeError) as e:
    warnings.warn(f"loading the Gluon kernel's FFI launcher {path} failed ({e}); the Gluon kernel is off")
    return None
  lib.qerl_gluon_preload.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int,
                                     ctypes.c_longlong]
  return lib


def atomic_split_k() -> bool:
  """Whether the builds (the mma.sync builds at M <= 16 only with ``MMA_ATOMIC``, the default) add
  their split-K parts with float32 atomics (default; faster,
  but the order of the float32 additions, hence the low bits of the result, varies run to run) or
  store partials that XLA sums in a fixed order. ``QERL_GLUON_DETERMINISTIC=1``, or XLA's own
  ``--xla_gpu_deterministic_ops=true`` in ``XLA_FLAGS``, asks for the fixed order. Read when a call
  is traced (a jitted function keeps what it was traced with).

  Raises:
    ValueError: ``QERL_GLUON_DETERMINISTIC`` is set to something other than "0" or "1".
  """
  want = os.environ.get("QERL_GLUON_DETERMINISTIC", "0")
  if want not in ("0", "1"):
    raise ValueError(f"QERL_GLUON_DETERMINISTIC={want!r}; expected '0' or '1'")
  return want == "0" and "--xla_gpu_deterministic_ops=true" not in os.environ.get("XLA_FLAGS", "")


def requested_launcher() -> str:
  """``QERL_GLUON_LAUNCH``: ``""`` (the FFI launcher if it builds, else jax-triton), ``"ffi"`` or
  ``"jax_triton"``.

  Raises:
    ValueError: any other value.
  """
  want = os.environ.get("QERL_GLUON_LAUNCH", "")
  if want not in ("", "ffi", "jax_triton"):
    raise ValueError(f"QERL_GLUON_LAUNCH={want!r}; expected 'ffi', 'jax_triton' or unset")
  return want


@functools.lru_cache(maxsize=None)
def launcher() -> str | None:
  """``"ffi"``, ``"jax_triton"`` or None (no way to launch the kernel); :func:`requested_launcher`
  forces one. Read once per process. Warns (once) when the FFI launcher cannot be built or loaded.

  Raises:
    ValueError: ``QERL_GLUON_LAUNCH`` set to something other than "ffi" or "jax_triton".
  """
  want = requested_launcher()
  if want in ("", "ffi") and _ffi_library() is not None:
    return "ffi"
  if want in ("", "jax_triton"):
    try:
      import jax_triton  # noqa: F401
      return "jax_triton"
    except ImportError:
      return None
  return None


def _register_cap(wg: bool, narrow: bool = False, mb: int = 0, xs: int = 0, w8: bool = False) -> int | None:
  """The register cap of a build: 128 (``MMA_MAX_REGISTERS``) for the mma.sync builds, so that 4 programs of 128 threads share
  an SM. Uncapped, the atomic build takes 130 registers at MB = 8 and 185 at MB = 16 (3 programs an
  SM); capped, MB = 8 fits without spills and MB = 16 spills a few registers yet runs faster: 59.5
  against 68.3 µs at M = 16, 7B shapes summed (docs/benchmarks.md, session 9). The wgmma builds
  (8 warps) keep what they need: 119 registers at MB = 32 (two programs an SM), 159 at MB = 64 (one).
  Capped at 128, MB = 64 spills about 100 registers and ran 153 against 125 µs at M = 64, 7B shapes
  summed, with split-K aimed at 256 or 512 programs (docs/benchmarks.md, session 10). The narrow
  wgmma build takes 123 registers at MB = 64: two programs share an SM (capped at 128 so that they
  always do); at MB = 128 without the cp.async x ring, 164 (one program an SM, uncapped). With the
  ring (``xs`` stages; MB = 128 by default) every wgmma build is capped at 128: uncapped it takes
  111-130 registers, capped none spill (offline SASS), and two programs share an SM. The 8-warp mma.sync
  builds (``w8``, lab) take ``MMA8_MAX_REGISTERS``."""
  if w8:
    return MMA8_MAX_REGISTERS
  if not wg:
    return MMA_MAX_REGISTERS
  if (narrow and mb <= 64) or xs:
    return 128
  return None


@functools.lru_cache(maxsize=None)
def _compiled(meta: tuple, wg: bool, narrow_n: int, maxnreg: int | None, w8: bool = False):
  """``(ptx, kernel name, shared bytes)`` of the kernel for the constexprs ``meta`` (the wgmma build
  if ``wg``) with at most ``maxnreg`` registers a thread (:func:`_register_cap`; part of the cache key),
  compiled for the oldest visible GPU (sm_90 without one) and loaded on every GPU."""
  meta = dict(meta)
  lora = "LR" in meta  # the entry with a LoRA term (forward_into's ``lora``)
  dtypes = (_ARG_DTYPES_LORA_XP if meta.get("XP") else _ARG_DTYPES_LORA) if lora else _ARG_DTYPES
  tma = "TS" in meta  # the TMA entry: two descriptors first (_TMA_DESCRIPTORS)
  return _load(_compile_gluon(_kernel(wg, narrow_n, lora, w8, tma), (_TMA_DESCRIPTORS if tma else ()) + dtypes,
                              meta, _target_cc(), num_warps=_warps(wg, narrow_n, w8), maxnreg=maxnreg))


@functools.lru_cache(maxsize=None)
def _xa_kernel():
  """The Gluon kernel of :func:`lora_xa` (imports triton lazily): program ``s`` multiplies x's K steps
  ``s * STEPS .. s * STEPS + STEPS - 1`` (64 each; past K masked) by A's and stores the float32 partial
  ``[M, R]`` as part ``s``. Swap-AB: ``A^T [RP, 64] x x^T [64, MB]`` by mma.sync, ``RP`` = R padded to a
  power of 2 (at least 16), one warp per 16 rows up to 4."""
  from triton.experimental import gluon
  from triton.experimental.gluon import language as ttgl
  from triton.experimental.gluon.language.nvidia.ampere import mma_v2

  @gluon.jit
  def lora_xa_parts(x_ptr, a_ptr, idx_ptr, o_ptr, M: ttgl.constexpr, K: ttgl.constexpr, R: ttgl.constexpr,
                    RP: ttgl.constexpr, L: ttgl.constexpr, STEPS: ttgl.constexpr, MB: ttgl.constexpr,
                    WARPS: ttgl.constexpr):
    mma: ttgl.constexpr = ttgl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 8])
    al: ttgl.constexpr = ttgl.BlockedLayout([8, 1], [4, 8], [1, WARPS], [0, 1])  # A^T [RP, 64]: 8 contiguous r a thread
    xl: ttgl.constexpr = ttgl.BlockedLayout([8, 1], [8, 4], [1, WARPS], [0, 1])  # x^T [64, MB], 8 contiguous k
    pid = ttgl.program_id(0)
    layer = ttgl.minimum(ttgl.maximum(ttgl.load(idx_ptr), 0), L - 1)
    a_base = a_ptr + layer.to(ttgl.int64) * (K * R)
    ar = ttgl.arange(0, RP, layout=ttgl.SliceLayout(1, al))
    ak = ttgl.arange(0, 64, layout=ttgl.SliceLayout(0, al))
    xk = ttgl.arange(0, 64, layout=ttgl.SliceLayout(1, xl))
    xm = ttgl.arange(0, MB, layout=ttgl.SliceLayout(0, xl))
    acc = ttgl.zeros([RP, MB], ttgl.float32, layout=mma)
    for i in ttgl.static_range(STEPS):
      k0 = (pid * STEPS + i) * 64
      at = ttgl.load(a_base + ttgl.expand_dims(ak + k0, 0) * R + ttgl.expand_dims(ar, 1),
                     mask=ttgl.expand_dims(ar < R, 1) & ttgl.expand_dims(ak + k0 < K, 0), other=0.0)
      xt = ttgl.load(x_ptr + ttgl.expand_dims(xm, 0) * K + ttgl.expand_dims(xk + k0, 1),
                     mask=ttgl.expand_dims(xm < M, 0) & ttgl.expand_dims(xk + k0 < K, 1), other=0.0)
      acc = mma_v2(ttgl.convert_layout(at, ttgl.DotOperandLayout(0, mma, 2)),
                   ttgl.convert_layout(xt, ttgl.DotOperandLayout(1, mma, 2)), acc)
    st: ttgl.constexpr = ttgl.BlockedLayout([1, 1], [32, 1], [WARPS, 1], [0, 1])
    acc = ttgl.convert_layout(acc, st)
    sr = ttgl.arange(0, RP, layout=ttgl.SliceLayout(1, st))
    sm = ttgl.arange(0, MB, layout=ttgl.SliceLayout(0, st))
    ttgl.store(o_ptr + pid * (M * R) + ttgl.expand_dims(sm, 0) * R + ttgl.expand_dims(sr, 1), acc,
               mask=ttgl.expand_dims(sm < M, 0) & ttgl.expand_dims(sr < R, 1))

  return lora_xa_parts


# lora_xa's partial products at most (the LoRA epilogue sums them). Only the 7B down adapter (296 K steps) reaches
# it: 99 parts of 3 steps at 128, where 32 gave 30 parts of 10 and the few programs took 7.8 us. Measured on the
# H200 (LoRA rank 32 + norms + AQN, batch 8, 512 new tokens, alternating; docs/benchmarks.md "Session 25"): a decode
# step 2.72 / 2.71 ms at 32, 2.60 / 2.60 at 64, 2.57 / 2.56 at 128 (against 2.61 / 2.60 in the same run).
XA_MAX_PARTS = 128


def _xa_meta(m: int, k: int, r: int, layers: int) -> dict:
  """:func:`lora_xa`'s constexprs: ``S`` parts of ``STEPS`` K steps of 64, ``S <= XA_MAX_PARTS``."""
  total = -(-k // 64)
  steps = -(-total // min(XA_MAX_PARTS, total))
  rp = max(16, 1 << (r - 1).bit_length())
  return dict(M=m, K=k, R=r, RP=rp, L=layers, STEPS=steps, MB=_row_block(m), WARPS=min(4, rp // 16),
              S=-(-total // steps))


@functools.lru_cache(maxsize=None)
def _compiled_xa(meta: tuple):
  """``(ptx, kernel name, shared bytes)`` of :func:`lora_xa`'s kernel for ``meta`` (:func:`_xa_meta`)."""
  meta = dict(meta)
  meta.pop("S")
  return _load(_compile_gluon(_xa_kernel(), _ARG_DTYPES_XA, meta, _target_cc(), num_warps=meta["WARPS"]))


def _target_cc() -> int:
  """The compute capability kernels are compiled for: the oldest visible GPU's, 90 without one."""
  return min((_cc(d) for d in _gpu_devices()), default=90)


def _load(compiled, ptx: str | None = None) -> tuple[str, str, int]:
  """``(ptx, kernel name, shared bytes)`` of a ``triton.compile`` result, loaded into the FFI
  launcher on every visible GPU (outside any CUDA-graph capture) when the launcher is built;
  ``ptx``: a rewrite of the result's PTX to load instead (same kernel name and shared bytes).

  Raises:
    RuntimeError: loading failed on a GPU.
  """
  ptx = compiled.asm["ptx"] if ptx is None else ptx
  return _preload(ptx, compiled.metadata.name, int(compiled.metadata.shared))


def _preload(ptx: str, name: str, shared: int) -> tuple[str, str, int]:
  """Loads the kernel ``name`` of ``ptx`` (PTX, or ``"cubin:"`` and a cubin's base64) into the FFI launcher on every
  visible GPU, outside any CUDA-graph capture, when the launcher is built; returns ``(ptx, name, shared)``.

  Raises:
    RuntimeError: loading failed on a GPU.
  """
  lib = _ffi_library()
  if lib is not None:
    for device in _gpu_devices():
      err = lib.qerl_gluon_preload(_module_key(ptx, name).encode(), ptx.encode(), name.encode(), device.id, shared)
      if err:
        raise RuntimeError(f"w4_gluon: loading {name} on GPU {device.id} failed (CUresult {err})")
  return ptx, name, shared


def _module_key(ptx: str, name: str) -> str:
  """The launcher's cache key of a kernel: a digest of its PTX and name (32 hex characters), so that a
  launch compares a few bytes, not the PTX (tens of kilobytes)."""
  return hashlib.sha256(ptx.encode() + b"\0" + name.encode()).hexdigest()[:32]


def _launch_attrs(ptx: str, name: str, grid: tuple[int, int, int], shared: int, threads: int = 128,
                  zero_results: bool | int = False, out_offset: int = 0, tma=None) -> dict:
  """The FFI call's attributes, as ``gluon_launch.cc`` binds them (a CPU test checks their count);
  ``zero_results``: a bitmask, bit ``i`` has the launcher zero result ``i`` on the stream before the kernel runs
  (``True``: the first, a single-result call's);
  ``out_offset``: bytes added to the result's pointer (the kernel writes a region of it); ``tma``: the
  TMA descriptors' specs (:func:`_tma_specs`; None: the kernel takes none, sent as ``[0]``)."""
  return dict(key=_module_key(ptx, name), ptx=ptx, name=name, grid_x=np.int64(grid[0]), grid_y=np.int64(grid[1]),
              grid_z=np.int64(grid[2]), threads=np.int64(threads), shared=np.int64(shared),
              zero_results=np.int64(int(zero_results)), out_offset=np.int64(out_offset),
              tma=np.zeros((1,), np.int64) if tma is None else np.asarray(tma, np.int64))


def _wgmma_gpus() -> bool:
  """Whether every visible GPU is sm_90, the one architecture with wgmma (the builds for M > 16)."""
  return all(_cc(d) == 90 for d in _gpu_devices())


def large_m_ready() -> bool:
  """What the large-M Gluon kernels (:mod:`pallas_kernels.w4_gluon_dx`, :mod:`pallas_kernels.w4_gluon_mm`) need
  besides their shapes: at least one visible GPU, every one sm_90 (wgmma), and the FFI launcher (they take more
  than jax-triton passes: TMA descriptors, warp specialization's thread count).

  Raises:
    ValueError: ``QERL_GLUON_LAUNCH`` set to something other than "ffi" or "jax_triton".
  """
  return bool(_gpu_devices()) and _wgmma_gpus() and available() and launcher() == "ffi"


def _warps(wg: bool, narrow_n: int = 0, w8: bool = False) -> int:
  """Warps a program: 4 (mma.sync; 8 with ``w8``), 8 (wgmma), or one per 16 columns of a narrow build."""
  return narrow_n // 16 if narrow_n else 8 if wg or w8 else 4


def _gpu_devices():
  return [d for d in jax.devices() if d.platform == "gpu"]


def _cc(device) -> int:
  major, minor = str(getattr(device, "compute_capability", "9.0")).split(".")
  return int(major) * 10 + int(minor)


class Build(NamedTuple):
  """One launch of the kernel: which build (``wg``: wgmma; ``narrow``: 128 columns a program),
  columns a program, split count, the kernel's constexprs, and ``w8``: an mma.sync build of 8 warps
  (:data:`MMA_WARPS`)."""
  wg: bool
  narrow: bool
  block_n: int
  splits: int
  meta: dict
  w8: bool = False

  @property
  def grid(self) -> tuple[int, int, int]:
    """The launch grid ``(N / block_n, splits, 1)``: column tiles by split-K parts."""
    return self.meta["N"] // self.block_n, self.splits, 1

  @property
  def narrow_n(self) -> int:
    """The narrow build's columns a program (:func:`_kernel`), 0 for the other builds."""
    return self.block_n if self.narrow else 0

  @property
  def warps(self) -> int:
    """Warps a program runs (4 or 8; see ``_warps``)."""
    return _warps(self.wg, self.narrow_n, self.w8)

  @property
  def threads(self) -> int:
    """Threads a program: its warps, and with ``WS_STAGES`` a second warpgroup for the loader warp (Hopper
    allocates registers by warpgroup, so Triton launches 8 warps for 4 + 1)."""
    return 32 * (8 if self.meta.get("WS") else self.warps)

  @property
  def maxnreg(self) -> int | None:
    """The register cap it compiles with (:func:`_register_cap`)."""
    if self.meta.get("WS"):
      return WS_MAX_REGISTERS
    if SMALL_MAX_REGISTERS and _small_mma_sync(self.wg, self.w8, self.meta["K"], self.meta["N"]):
      return SMALL_MAX_REGISTERS  # (lab)
    return _register_cap(self.wg, self.narrow, self.meta["MB"], self.meta["XS"], self.w8)


def _small_mma_sync(wg: bool, w8: bool, k: int, n: int) -> bool:
  """A 4-warp mma.sync build (M <= 16) of a weight of at most LOAD_ASM_MAX_WEIGHTS values (the 7B q/k/v and o): the
  builds that LOAD_ASM, SMALL_TARGET_PROGRAMS and SMALL_MAX_REGISTERS apply to."""
  return not wg and not w8 and k * n <= LOAD_ASM_MAX_WEIGHTS


def _build(m: int, k: int, n: int, layers: int, decode_order: bool = False) -> Build:
  """The :class:`Build` for ``x [m, k]`` times a ``[k, n]`` weight (of a stack of ``layers``), under
  the current settings (``NARROW_MIN_MB``, ``MMA_ATOMIC``, ``X_STAGES``, ``X_RING_MIN_MB``, ``WG_ASYNC``,
  ``LOAD_HINTS``, ``LOAD_ASM``, ``MMA_WARPS``, ``SCALE_PAIRS``, ``TMA_STAGES``, ``WS_STAGES``,
  ``SMALL_TARGET_PROGRAMS``, :func:`atomic_split_k`); the
  shape must be one :func:`applies` takes. ``decode_order``: the weight's codes are in
  :func:`qerl_jax.nvfp4.to_decode_order`'s order (the kernel's cheaper decode).

  Raises:
    ValueError: ``MMA_WARPS`` or ``SCALE_PAIRS`` set to a value it does not take, or ``WS_STAGES`` with
      ``WS_MAX_REGISTERS`` under 64 or with 9 to 16 rows (``m`` > :data:`WS_MAX_M`)."""
  if MMA_WARPS not in (4, 8) or SCALE_PAIRS not in (0, 1, 2):
    raise ValueError(f"w4_gluon: MMA_WARPS={MMA_WARPS!r} (expected 4 or 8), SCALE_PAIRS={SCALE_PAIRS!r} (expected 0, 1 "
                     "or 2)")
  if WS_STAGES and WS_MAX_REGISTERS < 64:
    raise ValueError(f"w4_gluon: WS_MAX_REGISTERS={WS_MAX_REGISTERS!r} is under 64, where the warp-specialized build "
                     "measured wrong results (session 30)")
  wg = _use_wgmma(m)
  if WS_STAGES and not wg and m > WS_MAX_M:
    raise ValueError(f"w4_gluon: WS_STAGES={WS_STAGES!r} at M = {m}: the warp-specialized build has an unresolved race "
                     f"with 16-row x tiles (wrong results now and then, session 55); it takes M <= {WS_MAX_M}")
  narrow = wg and _row_block(m) >= NARROW_MIN_MB
  block_n = (128 if _row_block(m) == 128 else NARROW_BLOCK_N) if narrow else BLOCK_N
  w8 = not wg and MMA_WARPS == 8 and k * n > MMA_WARPS_MIN_WEIGHTS
  small = _small_mma_sync(wg, w8, k, n)
  splits = _splits(k, n, NARROW_TARGET_PROGRAMS if narrow else WG_TARGET_PROGRAMS if wg else
                   (MMA8_TARGET_PROGRAMS or None) if w8 else (SMALL_TARGET_PROGRAMS or None) if small else None, block_n,
                   max(NARROW_MAX_STEPS, MAX_STEPS) if narrow else MAX_STEPS)
  atomic = (wg or MMA_ATOMIC) and atomic_split_k() and splits > 1  # one split stores its output: no memset
  xs = max(X_STAGES, 2) if wg and X_STAGES > 0 and _row_block(m) >= X_RING_MIN_MB else 0
  meta = dict(M=m, N=n, K=k, L=layers, STEPS=k // BLOCK_K // splits, MB=_row_block(m), ATOMIC=atomic,
              XS=xs, WA=int(bool(WG_ASYNC) and xs >= 3))
  pairs = SCALE_PAIRS == 1 or (SCALE_PAIRS == 2 and wg)
  sbytes = bool(SCALE_BYTES) and not pairs
  sf16 = bool(SCALE_F16) and not pairs and not sbytes
  if decode_order or pairs or sbytes or sf16:  # bit 0: the codes in nvfp4.to_decode_order's order (the cheaper decode);
    meta["DO"] = (int(decode_order) | (2 if pairs else 0) | (4 if sbytes else 0)  # bit 1: pairs; bit 2: scale bytes;
                  | (8 if sf16 else 0))  # bit 3: SCALE_F16
  ws = WS_STAGES > 0 and (WS_SMALL or not small)
  if (TMA_STAGES > 0 or ws) and not wg and not w8:  # codes and scales by TMA (no register loads to hint)
    meta["TS"] = int(WS_STAGES if ws else TMA_STAGES)
    if ws:  # by a loader warp (the TMA entry's warp-specialized branch)
      meta["WS"] = 1
      if WS_PROBE:
        meta["WSP"] = int(WS_PROBE)
    return Build(wg, narrow, block_n, splits, meta, w8)
  if L2_PROBE:  # (lab probe: wrong results)
    meta["LP"] = 1
  if LOAD_HINTS and _row_block(m) <= LOAD_HINTS_MAX_MB:
    meta["LH"] = LOAD_HINTS
  if LOAD_ASM and small:  # (its loads take 8 bytes a thread and row)
    meta["LA"] = LOAD_ASM
  return Build(wg, narrow, block_n, splits, meta, w8)


def _build_for(m: int, w: nvfp4.NVFP4Tensor, index) -> Build:
  """:func:`_build` for ``m`` rows times ``w`` (a ``[K, N]`` matrix, or with ``index`` a stack whose
  layer count and code order come from ``w``)."""
  k, n = w.shape
  return _build(m, k, n, 1 if index is None else w.packed.shape[0], w.code_order == "decode")


# The wgmma builds' operand k order within each 64-wide K step: slot s holds x's k = order[s], where
# the 6 bits of s are k's bits in this order (s5 .. s0 = k5 k2 k0 k4 k3 k1; the kernel's ``x_slots``).
X_SLOT_BITS = (0, 3, 5, 1, 2, 4)


def x_in_slot_order(x: jax.Array) -> jax.Array:
  """``x`` ``[M, K]`` (K a multiple of 64) with each 64-wide K step permuted to the wgmma builds'
  operand order (:data:`X_SLOT_BITS`): the input of the cp.async x ring (``X_STAGES``), which copies
  16 contiguous bytes at a time and so cannot permute. Same shape and dtype."""
  m, k = x.shape
  return x.reshape(m, k // 64, *[2] * 6).transpose(0, 1, *[2 + b for b in X_SLOT_BITS]).reshape(m, k)


def _operands(x, w, index, meta, out):
  """The kernel's operands: x (permuted to slot order for the x ring), codes and block scales with the
  layers folded into rows, float32 global scales ``[L]``, the layer ``[1]``, and ``out``: the buffer
  the atomic builds add their split-K parts into when it is aliased to the result, else a placeholder."""
  x_in = x_in_slot_order(x) if meta["XS"] else x
  return (x_in, *w4_triton._layer_operands(w, w4_triton._format_of(w), index), out)


def _ffi_call(build: Build, operands, out_shape, aliases, **attrs):
  """``build``'s kernel on ``operands`` through the FFI launcher; ``attrs``: ``zero_results`` and
  ``out_offset`` of :func:`_launch_attrs`."""
  ptx, name, shared = _compiled(tuple(build.meta.items()), build.wg, build.narrow_n, build.maxnreg, build.w8)
  return jax.ffi.ffi_call(_FFI_TARGET, out_shape, input_output_aliases=aliases)(
      *operands, **_launch_attrs(ptx, name, build.grid, shared, threads=build.threads,
                                 tma=_tma_specs(operands, build.meta), **attrs))


class ChainLaunch(NamedTuple):
  """One kernel of :func:`chain_call`: a compiled kernel (``ptx``, ``name``, ``shared`` bytes, as
  :func:`_load` returns them), its ``grid`` and ``threads``, its pointer parameters as ``(buffer, byte offset)``
  pairs (buffer ``i`` the ``i``-th operand, or result ``i - len(operands)``), and ``pdl``: launched with
  programmatic stream serialization, so that it may start while the kernel before it runs (it must then wait with
  ``griddepcontrol.wait``, constexpr ``GDC``, before reading what that kernel writes; ignored for the first)."""
  ptx: str
  name: str
  shared: int
  grid: tuple[int, int, int]
  threads: int
  params: tuple[tuple[int, int], ...]
  pdl: bool = False


_FIELD_SEPARATOR = "\x1e"  # between the kernels' keys, PTX and names (gluon_launch.cc's Field)


def chain_call(launches, operands, out_shapes, *, zero_results: int = 0, aliases: dict | None = None):
  """Several Gluon kernels launched in order by one FFI call (``gluon_launch.cc``'s ``qerl_gluon_chain``; the decoder's
  chained decode layer, :mod:`pallas_kernels.decode_chain`).

  XLA records each FFI call as its own CUDA-graph node, and a programmatic dependent launch (PDL) edge does not
  cross nodes; kernels launched by one call can be joined by PDL (docs/kernels.md, "Programmatic dependent launch";
  ``experiments/lab/pdl_probe.py`` measured 4.8 µs a 7B decode layer at batch 8 on an H100 outside XLA).

  Args:
    launches: :class:`ChainLaunch` es, in launch order.
    operands: the arrays the kernels read (and, aliased, write).
    out_shapes: ``jax.ShapeDtypeStruct`` s of the results.
    zero_results: bitmask over the results, zeroed (memset) before the first kernel.
    aliases: ``{operand index: result index}`` (``input_output_aliases``).

  Returns:
    The results, a list.

  Raises:
    ValueError: no launch, a kernel name or PTX containing the field separator, or a parameter naming a buffer
      that does not exist or a negative offset.
  """
  launches = list(launches)
  if not launches:
    raise ValueError("chain_call: no kernel to launch")
  n_buffers = len(operands) + len(out_shapes)
  keys, params, launch = [], [], []
  for k in launches:
    key = _module_key(k.ptx, k.name)
    if _FIELD_SEPARATOR in k.ptx or _FIELD_SEPARATOR in k.name:
      raise ValueError(f"chain_call: kernel {k.name!r} has the field separator in its PTX or name")
    bad = [b for b, o in k.params if not 0 <= b < n_buffers or o < 0]
    if bad:
      raise ValueError(f"chain_call: kernel {k.name!r} names buffers {bad} of {n_buffers} (or a negative offset)")
    keys.append(key)
    params += [len(k.params)] + [v for pair in k.params for v in pair]
    launch += [*k.grid, k.threads, k.shared, int(bool(k.pdl))]
  # A kernel launched again in the same call has its PTX once: the launcher finds later ones by key (loaded by the
  # first), so "=" stands for it (a decode step's layers in one call repeat each kernel once a layer).
  ptxs, seen = [], set()
  for key, k in zip(keys, launches):
    ptxs.append("=" if key in seen else k.ptx)
    seen.add(key)
  return jax.ffi.ffi_call(_CHAIN_TARGET, list(out_shapes), input_output_aliases=aliases or {})(
      *operands, keys=_FIELD_SEPARATOR.join(keys), ptxs=_FIELD_SEPARATOR.join(ptxs),
      names=_FIELD_SEPARATOR.join(k.name for k in launches), launch=np.asarray(launch, np.int64),
      params=np.asarray(params, np.int64), zero_results=np.int64(zero_results))


def forward(x: jax.Array, w: nvfp4.NVFP4Tensor, *, out_dtype=None, index=None) -> jax.Array:
  """``x @ W`` by the Gluon decode GEMV (GPU only; no VJP: :mod:`pallas_kernels.matmul` wraps it).

  Args:
    x: bf16 ``[M, K]``, ``1 <= M <= MAX_M`` (128; ``M > 16`` on sm_90 only).
    w: :class:`~qerl_jax.nvfp4.NVFP4Tensor` ``[K, N]``, or with ``index`` a stack ``[L, K, N]``.
    out_dtype: output dtype (default bf16); accumulation is float32.
    index: int32 scalar (may be traced): layer of the stack, clamped to ``[0, L)`` in the kernel.

  Returns:
    ``[M, N]`` in ``out_dtype``.

  Raises:
    ValueError: a shape :func:`applies` rejects, ``index`` with an unstacked weight, or a bad
      ``QERL_GLUON_DETERMINISTIC`` (:func:`atomic_split_k`).
    ImportError: no launch path (:func:`launcher`).
    RuntimeError: the compiled kernel failed to load on a GPU.
  """
  m, k = x.shape
  if not applies(m, w, x.dtype) or x.shape[1] != w.shape[0]:
    raise ValueError(f"w4_gluon.forward: no kernel for x {x.dtype}{list(x.shape)} and weight {type(w).__name__} "
                     f"{list(w.shape)} (needs NVFP4, bf16 x, M <= {MAX_M}, N % {BLOCK_N} == 0, K % {BLOCK_K} == 0)")
  if (index is None) != (w.packed.ndim == 2):
    raise ValueError(f"w4_gluon.forward: index={index!r} with packed codes of shape {w.packed.shape}")
  path = launcher()
  if path is None:
    raise ImportError("w4_gluon.forward needs triton (Gluon) and either a C++ compiler for the FFI launcher "
                      "or jax-triton")
  n = w.shape[1]
  build = _build_for(m, w, index)
  wg, splits, meta = build.wg, build.splits, build.meta
  atomic = meta["ATOMIC"]
  # the FFI launcher zeroes the atomic builds' output itself (a memset node: no XLA buffer to fill and alias)
  memset = atomic and path == "ffi"
  operands = _operands(x, w, index, meta, jnp.zeros((m, n) if atomic and not memset else (1,), jnp.float32))
  out_shape = jax.ShapeDtypeStruct((m, n) if atomic else (splits, m, n), jnp.float32)
  aliases = {5: 0} if atomic and not memset else None
  if path == "ffi":
    out = _ffi_call(build, operands, out_shape, aliases, zero_results=memset)
  else:
    import jax_triton

    if "TS" in meta:
      raise ValueError("w4_gluon.forward: TMA_STAGES needs the FFI launcher (jax-triton passes no TMA descriptors)")
    _install()
    out = jax_triton.triton_call(*operands, kernel=_kernel(wg, build.narrow_n, w8=build.w8), out_shape=out_shape,
                                 grid=build.grid[:2], num_warps=build.warps, input_output_aliases=aliases or {}, **meta)
  y = out if atomic else out[0] if splits == 1 else out.sum(axis=0)
  return y.astype(out_dtype or x.dtype)


def into_applies(x: jax.Array, w, index=None) -> bool:
  """Whether :func:`forward_into` takes ``x`` and ``w`` (with ``index``): :func:`applies`, a stack
  exactly when ``index`` is given, the FFI launcher, and a build that either adds its split-K parts by
  atomics or has a single split (the fixed-order builds' partials need their own buffer)."""
  if x.ndim != 2 or not applies(x.shape[0], w, x.dtype) or x.shape[1] != w.shape[0]:
    return False
  if (index is None) != (w.packed.ndim == 2) or launcher() != "ffi":
    return False
  build = _build_for(x.shape[0], w, index)
  return build.meta["ATOMIC"] or build.splits == 1


def lora_into_applies(x: jax.Array, w, index, lora) -> bool:
  """Whether :func:`forward_into` takes ``lora = (xa, b, scale)``: :func:`into_applies`,
  :data:`LORA_IN_KERNEL`, an mma.sync build (at most 16 rows; or a wgmma build with
  :data:`LORA_IN_KERNEL_WG`) that adds its split-K parts by atomics with
  at least R / 16 splits (split ``s`` adds ranks ``16 s .. 16 s + 15``), R a multiple of 16, ``xa``
  bf16 ``[M, R]`` or :func:`lora_xa`'s float32 partial products ``[S, M, R]`` (``S <= XA_MAX_PARTS``),
  ``b`` bf16 ``[L, R, N]`` with ``w``'s layer count L when ``index`` is given (the same layer is read)
  else ``[R, N]``, and ``scale`` a Python number (compiled in)."""
  xa, b, scale = lora
  if not LORA_IN_KERNEL or not into_applies(x, w, index) or isinstance(scale, bool) or not isinstance(
      scale, (int, float)):
    return False
  m, n = x.shape[0], w.shape[1]
  r = xa.shape[-1]
  layers = None if index is None else w.packed.shape[0]
  want_b = (r, n) if layers is None else (layers, r, n)
  parts = xa.ndim == 3 and xa.dtype == jnp.float32 and 1 <= xa.shape[0] <= XA_MAX_PARTS and xa.shape[1:] == (m, r)
  if not (parts or (xa.shape == (m, r) and xa.dtype == jnp.bfloat16)):
    return False
  if b.dtype != jnp.bfloat16 or b.shape != want_b:
    return False
  build = _build_for(m, w, index)
  return ((not build.wg or LORA_IN_KERNEL_WG) and build.meta["ATOMIC"] and r % 16 == 0
          and 0 < r <= 16 * build.splits)


def lora_xa_applies(x: jax.Array, a: jax.Array, index=None) -> bool:
  """Whether :func:`lora_xa` takes ``x`` and ``a``: the Gluon kernel with the FFI launcher, bf16 ``x
  [M, K]`` with ``1 <= M <= 16``, bf16 ``a`` ``[K, R]`` (``index`` None) or a stack ``[L, K, R]``
  (``index`` given), ``1 <= R <= 128``."""
  if not available() or launcher() != "ffi" or x.ndim != 2 or x.dtype != jnp.bfloat16 or a.dtype != jnp.bfloat16:
    return False
  if a.ndim != (2 if index is None else 3) or a.shape[-2] != x.shape[1]:
    return False
  return 1 <= x.shape[0] <= 16 and 1 <= a.shape[-1] <= 128


def lora_xa_shape(x, a) -> tuple[int, int, int]:
  """The shape ``(S, M, R)`` of :func:`lora_xa`'s result for ``x [M, K]`` and ``a [..., K, R]``."""
  m, k = x.shape
  return (_xa_meta(m, k, a.shape[-1], 1)["S"], m, a.shape[-1])


def lora_xa(x: jax.Array, a: jax.Array, index=None) -> jax.Array:
  """A LoRA adapter's down-projection ``x @ A`` (Hu et al. 2021) for a decode step's few rows, as float32
  partial products over K ranges, for :func:`forward_into`'s ``lora`` (which sums them in its kernel):
  one kernel launch, no memset and no XLA sum, where XLA runs a split GEMM and a reduction.

  Args:
    x: bf16 ``[M, K]``, ``M <= 16``.
    a: bf16 ``[K, R]``, or with ``index`` a stack ``[L, K, R]`` read at layer ``index`` in place
      (int32 scalar, clamped to ``[0, L)``).

  Returns:
    float32 ``[S, M, R]``: part ``s`` holds the product over K steps ``s * STEPS ..`` (64 each); the parts
    sum to ``x @ A``. ``S <= XA_MAX_PARTS``.

  Raises:
    ValueError: :func:`lora_xa_applies` is False.
  """
  if not lora_xa_applies(x, a, index):
    raise ValueError(f"w4_gluon.lora_xa: no kernel for x {x.dtype}{list(x.shape)} and A {a.dtype}{list(a.shape)} "
                     f"(index {'given' if index is not None else 'None'}; see lora_xa_applies)")
  m, k = x.shape
  r = a.shape[-1]
  meta = _xa_meta(m, k, r, 1 if index is None else a.shape[0])
  ptx, name, shared = _compiled_xa(tuple(meta.items()))
  layer = jnp.zeros((1,), jnp.int32) if index is None else jnp.asarray(index, jnp.int32).reshape(1)
  return jax.ffi.ffi_call(_FFI_TARGET, jax.ShapeDtypeStruct((meta["S"], m, r), jnp.float32))(
      x, a.reshape(-1, r), layer,
      **_launch_attrs(ptx, name, (meta["S"], 1, 1), shared, threads=32 * meta["WARPS"]))


def forward_into(x: jax.Array, w: nvfp4.NVFP4Tensor, acc: jax.Array | None, offset: int, *, index=None,
                 size: int | None = None, lora=None) -> tuple[jax.Array, jax.Array]:
  """:func:`forward` with float32 output written into a region of a zeroed buffer instead of a new
  array (GPU only; FFI launcher; forward only, no VJP).

  ``x @ W`` lands in ``acc[offset : offset + M * N]`` (row-major ``[M, N]``), which must hold zeros
  where the build adds its split-K parts by atomics. With ``acc`` None the launcher makes the buffer
  (``size`` elements) and zeroes it with one memset first: the first call of a decode-step layer
  does that, and the layer's other projections write into the same buffer with no memset of their
  own (:mod:`qerl_jax.models.decoder`), where each call of :func:`forward` costs a memset node in
  the step's CUDA graph (about 1 µs each, 0.145 ms of a 2.6 ms batch-8 step; docs/benchmarks.md,
  session 13). The rest of ``acc`` is left as it was. ``acc`` is aliased to the result: pass the
  returned buffer to the next call.

  Args:
    x: bf16 ``[M, K]``, as :func:`forward`.
    w: :class:`~qerl_jax.nvfp4.NVFP4Tensor` ``[K, N]``, or with ``index`` a stack ``[L, K, N]``.
    acc: float32 ``[S]`` (1-D), ``S >= offset + M * N``; or None for a new zeroed buffer.
    offset: static int, in elements.
    index: as :func:`forward`.
    size: with ``acc`` None, ``S`` (static int).
    lora: optional ``(xa, b, scale)``: the kernel also adds ``scale * xa @ b`` (a LoRA adapter's
      up-projection, Hu et al. 2021: ``xa = x @ A`` bf16 ``[M, R]`` or :func:`lora_xa`'s float32 partials
      ``[S, M, R]``, summed and rounded to bf16 in the kernel; ``b`` bf16 ``[R, N]``, or ``[L, R, N]``
      read at ``index``; float32 products) where :func:`lora_into_applies` holds.

  Returns:
    ``(y, acc)``: ``y`` float32 ``[M, N]`` (the region, read back), and the updated ``acc``.

  Raises:
    ValueError: :func:`into_applies` is False, ``acc`` is not a 1-D float32 array (or None with a
      ``size``), the region does not fit in it, or ``lora`` is given where :func:`lora_into_applies`
      is False.
  """
  m, k = x.shape
  n = w.shape[1]
  if not into_applies(x, w, index):
    raise ValueError(f"w4_gluon.forward_into: no accumulating kernel for x {x.dtype}{list(x.shape)} and weight "
                     f"{type(w).__name__} {list(w.shape)} (index {'given' if index is not None else 'None'}; "
                     f"launcher {launcher()!r}; see into_applies)")
  if acc is None and size is None:
    raise ValueError("w4_gluon.forward_into: a new buffer (acc None) needs its size")
  if acc is not None and (acc.ndim != 1 or acc.dtype != jnp.float32):
    raise ValueError(f"w4_gluon.forward_into: acc must be 1-D float32, got {acc.dtype}{list(acc.shape)}")
  total = int(size) if acc is None else acc.shape[0]
  offset = int(offset)
  if offset < 0 or offset + m * n > total:
    raise ValueError(f"w4_gluon.forward_into: region [{offset}, {offset + m * n}) does not fit a buffer of "
                     f"{total} elements")
  if lora is not None and not lora_into_applies(x, w, index, lora):
    raise ValueError(f"w4_gluon.forward_into: no LoRA epilogue for x {list(x.shape)}, weight {list(w.shape)} and "
                     f"x @ A {lora[0].dtype}{list(lora[0].shape)}, B {lora[1].dtype}{list(lora[1].shape)} "
                     f"(see lora_into_applies)")
  build = _build_for(m, w, index)
  new = acc is None
  operands = _operands(x, w, index, build.meta, jnp.zeros((1,), jnp.float32) if new else acc)
  if lora is not None:  # x @ A and B go before the output buffer, the entry's order (_ARG_DTYPES_LORA)
    xa, b, scale = lora
    build = build._replace(meta=dict(build.meta, LR=xa.shape[-1], LS=float(scale),
                                     **({"XP": xa.shape[0]} if xa.ndim == 3 else {})))
    operands = (*operands[:-1], xa, b, operands[-1])
  alias = len(operands) - 1
  acc = _ffi_call(build, operands, jax.ShapeDtypeStruct((total,), jnp.float32), None if new else {alias: 0},
                  zero_results=new, out_offset=4 * offset)
  return jax.lax.slice(acc, (offset,), (offset + m * n,)).reshape(m, n), acc
