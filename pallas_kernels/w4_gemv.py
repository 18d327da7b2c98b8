"""Decode-path (small M) 4-bit x bf16 matmul on the Pallas Triton backend: a split-K GEMV.

``y[M, N] = x[M, K] @ W[K, N]`` for M = 1 to about 32 rows (decode), where the
time is the time to stream the 4-bit weight from HBM once. Each program owns
one ``block_n``-column tile and one slice of K (split-K, ``splits`` slices, so
that the grid has several programs per SM even for N = 3584); it walks its
slice in ``block_k`` steps, loading the packed codes ``uint8 [block_k/2,
block_n]`` and E4M3 block scales ``[block_k/16, block_n]`` once, decoding them
in registers with :func:`pallas_kernels.w4_triton._decode_tile` (the inline-PTX
E2M1 decode of the fused kernel, reused), and multiplying with x:

* ``mode="fma"`` (M <= 8): broadcast-multiply-reduce in float32 on the CUDA
  cores, ``acc[m, n] += sum_j x[m, j] * w[j, n]``; M is padded only to the next
  power of 2, not to a 16-row tensor-core tile.
* ``mode="fma_defer"``: the same with the K reduction deferred to the end of
  the loop (an unreduced accumulator; cheap in registers only for M = 1-2).
* ``mode="dot"`` (M up to 32): two tensor-core dots per step (even / odd K
  rows, as in the fused kernel), M padded to 16.

Split-K partial sums are combined inside the same launch by float32 atomic adds
(``reduce="atomic"``; the output starts as zeros, the summation order across
slices is not fixed, so results may differ in the last bits between runs), or
written as ``[splits, M, N]`` float32 partials that XLA adds
(``reduce="partials"``; deterministic). The ``1/global_scale`` of NVFP4 is
applied to each partial before it is combined.

Formats: NVFP4 (E2M1 codes + E4M3 block scales of 16 + float32 global scale,
NVIDIA NVFP4 / OCP MX v1.0 E2M1) and NF4 (QLoRA, Dettmers et al. 2023).
Any M, any N, any K that is a multiple of the format's block size: tails are
masked loads (zeros) and masked stores.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import w4_triton


@dataclasses.dataclass(frozen=True)
class GemvConfig:
  """Tile sizes and launch parameters of the split-K GEMV.

  Attributes:
    block_n: output columns per program (power of 2, >= 16).
    block_k: K rows per loop step (power of 2, multiple of the block size).
    target_programs: split K until about this many programs run (0: no split).
    num_warps, num_stages: Triton launch parameters.
    mode: ``"fma"`` (CUDA-core broadcast-multiply-reduce, reduced over K every
      step), ``"fma_defer"`` (the same, with an unreduced ``[M, block_k/2,
      block_n]`` float32 accumulator reduced once at the end: for M = 1-2) or
      ``"dot"`` (tensor cores, M padded to 16).
    reduce: ``"atomic"`` (float32 atomic adds in the kernel) or ``"partials"``
      (float32 ``[splits, M, N]`` summed by XLA).
    decode: ``"asm"`` (inline PTX, GPU only) or ``"bits"``; interpret mode
      always uses ``"bits"``.
  """
  block_n: int = 128
  block_k: int = 128
  target_programs: int = 528
  num_warps: int = 4
  num_stages: int = 3
  mode: str = "fma"
  reduce: str = "atomic"
  decode: str = "asm"


# Config per M bucket (largest M it covers): the winners of the sweep in
# experiments/bench_gemv.py on an H200 (docs/benchmarks.md, "Split-K GEMV").
# fma at M = 8 spilled registers (the [M, block_k/2, block_n] float32 product),
# 40x to 94x slower than dot, so fma is used for M = 1 only.
TUNED: dict = {
    1: GemvConfig(block_n=128, block_k=128, target_programs=528, num_warps=4, num_stages=3, mode="fma"),
    32: GemvConfig(block_n=128, block_k=128, target_programs=528, num_warps=4, num_stages=3, mode="dot"),
}


def default_config(m: int, table: dict | None = None) -> GemvConfig:
  """The tuned :class:`GemvConfig` for ``m`` rows (the smallest bucket >= m; the largest otherwise)."""
  table = TUNED if table is None else table
  keys = sorted(table)
  return table[next((b for b in keys if m <= b), keys[-1])]


def _next_pow2(v: int) -> int:
  return 1 << max(0, (v - 1).bit_length())


def _gemv_kernel(x_ref, p_ref, s_ref, igs_ref, *refs, m, mp, k, n, cfg: GemvConfig, fmt,
                 steps: int, splits: int):
  o_ref = refs[-1]  # refs[0]: the zeroed / poisoned buffer aliased to the output
  bn, bk = cfg.block_n, cfg.block_k
  pid_n, pid_s = pl.program_id(0), pl.program_id(1)
  n0 = pid_n * bn
  m_mask = jnp.arange(mp) < m
  n_mask = (n0 + jnp.arange(bn)) < n
  k_begin = pid_s * (steps * bk)

  def body(i, acc):
    x_even, x_odd, w_lo, w_hi = w4_triton._fwd_step(
        x_ref, p_ref, s_ref, m0=0, bm=mp, m_mask=m_mask, n0=n0, bn=bn, n_mask=n_mask,
        kb=k_begin + i * bk, bk=bk, k=k, fmt=fmt, split_x="registers", decode=cfg.decode)
    if cfg.mode == "dot":
      acc += jnp.dot(x_even, w_lo, preferred_element_type=jnp.float32)
      acc += jnp.dot(x_odd, w_hi, preferred_element_type=jnp.float32)
    else:
      prod = (x_even.astype(jnp.float32)[:, :, None] * w_lo.astype(jnp.float32)[None, :, :]
              + x_odd.astype(jnp.float32)[:, :, None] * w_hi.astype(jnp.float32)[None, :, :])
      acc += prod if cfg.mode == "fma_defer" else jnp.sum(prod, axis=1)
    return acc

  acc_shape = (mp, bk // 2, bn) if cfg.mode == "fma_defer" else (mp, bn)
  acc = lax.fori_loop(0, steps, body, jnp.zeros(acc_shape, jnp.float32))
  if cfg.mode == "fma_defer":
    acc = jnp.sum(acc, axis=1)
  acc = acc * igs_ref[0]
  out_mask = m_mask[:, None] & n_mask[None, :]
  idx = (pl.ds(0, mp), pl.ds(n0, bn))
  if splits == 1:
    plgpu.store(o_ref.at[idx], acc.astype(o_ref.dtype), mask=out_mask)
  elif cfg.reduce == "atomic":  # o_ref is padded to whole tiles; rows/columns past M/N add 0
    plgpu.atomic_add(o_ref, idx, acc)
  else:
    plgpu.store(o_ref.at[(pid_s, *idx)], acc, mask=out_mask)


def gemv(x: jax.Array, w, *, out_dtype=None, config: GemvConfig | None = None,
         interpret: bool = False, poison_output: bool = False) -> jax.Array:
  """``x @ W`` for small M by the split-K GEMV kernel.

  Args:
    x: bf16 (or float16) ``[M, K]``, M small (decode; any M works, but the
      kernel keeps all M rows in one program, so M above ~32 is slow).
    w: NVFP4Tensor or NF4Tensor ``[K, N]`` without leading dims.
    out_dtype: output dtype (default ``x.dtype``); accumulation is float32.
    config: a :class:`GemvConfig` (default :func:`default_config` for M).
    interpret: run in Pallas interpret mode (CPU tests).
    poison_output: start from a NaN-filled output buffer (tests: an element the
      kernel misses stays NaN). Atomic split-K needs a zeroed buffer, so this
      switches the reduction to ``"partials"`` (same kernel body, plain stores).

  Returns:
    ``[M, N]`` in ``out_dtype``.

  Raises:
    TypeError: unsupported weight type. ValueError: shape mismatch, stacked
    ``w``, or a bad config (non-power-of-2 tiles, block_k not a multiple of the
    block size, unknown mode/reduce).
  """
  fmt = w4_triton._format_of(w)
  if w.packed.ndim != 2:
    raise ValueError(f"gemv needs one [K, N] matrix, got packed shape {w.packed.shape}")
  if x.ndim != 2:
    raise ValueError(f"gemv: expected a 2-D x [M, K], got shape {x.shape}")
  k, n = w.shape
  m = x.shape[0]
  if x.shape[1] != k:
    raise ValueError(f"gemv: x has K={x.shape[1]} (shape {x.shape}) but the weight is [{k}, {n}]")
  cfg = config or default_config(m)
  for name in ("block_n", "block_k"):
    v = getattr(cfg, name)
    if v & (v - 1) or v < 16:
      raise ValueError(f"GemvConfig.{name} must be a power of 2 >= 16, got {v}")
  if cfg.block_k % fmt.group:
    raise ValueError(f"GemvConfig.block_k={cfg.block_k} must be a multiple of the block size {fmt.group}")
  if cfg.mode not in ("fma", "fma_defer", "dot") or cfg.reduce not in ("atomic", "partials"):
    raise ValueError(f"GemvConfig mode/reduce must be fma|fma_defer|dot / atomic|partials, got {cfg.mode}/{cfg.reduce}")
  out_dtype = jnp.dtype(out_dtype or x.dtype)
  if interpret:
    cfg = dataclasses.replace(cfg, decode="bits")
  if poison_output:
    cfg = dataclasses.replace(cfg, reduce="partials")
  mp = max(16, _next_pow2(m)) if cfg.mode == "dot" else _next_pow2(m)
  n_tiles = -(-n // cfg.block_n)
  total_steps = -(-k // cfg.block_k)
  splits = 1
  if cfg.target_programs and n_tiles < cfg.target_programs:
    splits = max(1, min(-(-cfg.target_programs // n_tiles), total_steps))
  steps = -(-total_steps // splits)
  splits = -(-total_steps // steps)
  args = (x, w.packed, w.block_scale, w4_triton._inverse_global_scale(w))
  if splits == 1:
    out_shape = jax.ShapeDtypeStruct((m, n), out_dtype)
  elif cfg.reduce == "atomic":  # padded to whole tiles: unmasked atomics (interpret mode has no masked ones)
    out_shape = jax.ShapeDtypeStruct((mp, n_tiles * cfg.block_n), jnp.float32)
  else:
    out_shape = jax.ShapeDtypeStruct((splits, m, n), jnp.float32)
  aliases = {}
  if splits > 1 and cfg.reduce == "atomic":
    args = args + (jnp.zeros(out_shape.shape, jnp.float32),)
    aliases = {len(args) - 1: 0}
  elif poison_output:
    args = args + (jnp.full(out_shape.shape, jnp.nan, out_shape.dtype),)
    aliases = {len(args) - 1: 0}
  kernel = functools.partial(_gemv_kernel, m=m, mp=mp, k=k, n=n, cfg=cfg, fmt=fmt, steps=steps,
                             splits=splits)
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")
    out = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(n_tiles, splits),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        name=f"w4a16_gemv_{cfg.mode}",
        input_output_aliases=aliases,
    )(*args)
  if splits > 1 and cfg.reduce == "partials":
    out = out.sum(axis=0)
  elif splits > 1:
    out = out[:m, :n]
  return out.astype(out_dtype)
