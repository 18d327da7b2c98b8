"""Shared 4-bit code machinery for the NVFP4 and NF4 weight formats.

Both formats store one 4-bit code per weight, two codes per byte, packed along
the contraction axis K of a ``[K, N]`` weight: byte ``j`` of column ``n`` holds
code ``2j`` in its low nibble and code ``2j + 1`` in its high nibble. A code is
an index into a 16-entry codebook (E2M1 for NVFP4, NormalFloat for NF4).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def pack_nibbles(codes: jax.Array) -> jax.Array:
  """Packs 4-bit codes two per byte along axis -2.

  Args:
    codes: integer array ``[..., K, N]`` with values in ``[0, 15]``; K even.

  Returns:
    uint8 ``[..., K // 2, N]``: row ``j`` is ``codes[2j] | codes[2j + 1] << 4``.

  Raises:
    ValueError: if K is odd.
  """
  k = codes.shape[-2]
  if k % 2:
    raise ValueError(f"pack_nibbles needs an even K (axis -2), got shape {codes.shape}")
  codes = codes.astype(jnp.uint8)
  pairs = codes.reshape(*codes.shape[:-2], k // 2, 2, codes.shape[-1])
  return pairs[..., 0, :] | (pairs[..., 1, :] << 4)


def unpack_nibbles(packed: jax.Array) -> jax.Array:
  """Inverse of :func:`pack_nibbles`: uint8 ``[..., K/2, N]`` -> uint8 codes ``[..., K, N]``."""
  low = packed & 0xF
  high = packed >> 4
  codes = jnp.stack([low, high], axis=-2)  # [..., K/2, 2, N]
  return codes.reshape(*packed.shape[:-2], packed.shape[-2] * 2, packed.shape[-1])


def exact_divide(a: jax.Array, b) -> jax.Array:
  """``a / b`` with ``b`` broadcast to ``a``'s shape, correctly rounded (IEEE division) on every backend.

  Two rewrites would make it inexact, and the quantizers must match the PyTorch recipes bit for bit:

  * XLA's algebraic simplifier turns ``a / broadcast(b)`` (and ``a / constant``) into
    ``a * (1 / b)``, off by one ulp for about a third of the inputs. Adding ``a * 0`` gives the
    divisor ``a``'s shape without changing its value for finite ``a`` (a NaN/Inf in ``a`` is
    rejected by the callers' checks), so XLA keeps a true division.
  * On a GPU, XLA lowers a float32 division to PTX ``div.full.f32`` (LLVM ``-nvptx-prec-divf32=1``),
    up to 2 ulp off. So there (``jax.lax.platform_dependent``: any platform but the CPU, whose
    division is IEEE) the quotient is taken in float64 (``div.rn.f64``) and rounded once to ``a``'s
    dtype: with 53 >= 2 * 24 + 2 bits, that double rounding equals a single correct rounding of the
    quotient (Figueroa, "When is double rounding innocuous?", 1995). That result is materialized
    (:func:`materialize`), so that no later rewrite reaches back into the float64 quotient (a
    precaution; what was measured is in docs/benchmarks.md, session 19). The CPU keeps the float32
    division, about twice as fast as the float64 one in ``nvfp4.quantize``.

  Args:
    a: float32 (or narrower float) array, any shape.
    b: float array or scalar broadcastable to ``a``.

  Returns:
    ``a``'s shape and dtype.
  """
  a, b = jnp.asarray(a), jnp.asarray(b)

  def ieee_division(a, b):  # the CPU's float32 division is correctly rounded
    return a / (b.astype(a.dtype) + a * 0)

  def through_float64(a, b):
    with jax.enable_x64(True):
      a64 = a.astype(jnp.float64)
      q = (a64 / (b.astype(jnp.float64) + a64 * 0)).astype(a.dtype)
    return materialize(q)

  return jax.lax.platform_dependent(a, b, cpu=ieee_division, default=through_float64)


def materialize(x: jax.Array) -> jax.Array:
  """``x`` unchanged, behind an optimization barrier, so that a rounding that made it (a cast to a
  narrower float) stays in the program.

  On a GPU, XLA (``--xla_allow_excess_precision``, on by default) removes a convert pair such as
  float32 -> float8/bf16 -> float32 and keeps the unrounded float32 value. The quantizers round
  block scales to E4M3 and statistics to bf16 on purpose; without the barrier a GPU quantized
  with unrounded scales and never saw an E4M3 scale round to zero (README, "The weight formats";
  docs/benchmarks.md, session 19).
  """
  return jax.lax.optimization_barrier(x)


def decode(codes: jax.Array, codebook: np.ndarray, dtype=jnp.float32) -> jax.Array:
  """Looks codes up in a 16-entry codebook: ``codebook[codes]`` cast to ``dtype``."""
  table = jnp.asarray(codebook, dtype=jnp.float32)
  return jnp.take(table, codes.astype(jnp.int32), axis=0).astype(dtype)


def is_array_like(x) -> bool:
  """True for an array or a tracer (something with a tuple ``shape`` and a ``dtype``); False for what a
  ``tree_map`` over a 4-bit tensor may leave in its place (a shape tuple, a string, None)."""
  return isinstance(getattr(x, "shape", None), tuple) and hasattr(x, "dtype")


def check_finite(w, name: str) -> None:
  """Raises ValueError naming how many entries of a concrete array are NaN/Inf and where.

  Traced values are not checked (the jit-able cores skip the check).
  """
  if isinstance(w, jax.core.Tracer):
    return
  arr = np.asarray(jax.device_get(w), dtype=np.float32)
  bad = ~np.isfinite(arr)
  n_bad = int(bad.sum())
  if n_bad:
    where = [tuple(int(i) for i in idx) for idx in np.argwhere(bad)[:5]]
    n_nan = int(np.isnan(arr).sum())
    more = f" (and {n_bad - len(where)} more)" if n_bad > len(where) else ""
    raise ValueError(
        f"{name}: input of shape {arr.shape} has {n_bad} non-finite values "
        f"({n_nan} NaN, {n_bad - n_nan} Inf) at indices {where}{more}")


def checked_k_padding(shape, block: int, name: str, pad: bool, dtype=None):
  """Checks a weight's shape and dtype for quantization and returns how many rows of K padding it needs
  (``K`` rounded up to a multiple of ``block``; nonzero only with ``pad``).

  Raises:
    ValueError: a rank below 2, an empty K or N, or K % block != 0 without ``pad``.
    TypeError: ``dtype`` (when given) not a real floating dtype (an int or bool weight has no scale to keep;
      a complex one lost its imaginary part).
  """
  if len(shape) < 2:
    raise ValueError(f"{name}: expected a weight of shape [..., K, N], got shape {tuple(shape)}")
  if dtype is not None and not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"{name}: expected a floating-point weight, got dtype {jnp.dtype(dtype)}")
  if shape[-2] == 0 or shape[-1] == 0:
    raise ValueError(f"{name}: the weight of shape {tuple(shape)} is empty (K or N is 0)")
  k = shape[-2]
  rem = k % block
  if rem and not pad:
    raise ValueError(
        f"{name}: K = {k} (axis -2 of shape {tuple(shape)}) is not a multiple of the "
        f"block size {block}; pass pad=True to zero-pad K explicitly")
  return (block - rem) % block
