"""Building blocks of the decoder: the one linear dispatch, RMSNorm, RoPE, attention.

All functions are pure; shapes use B batch, T new tokens, S key/value slots,
D hidden, H query heads, Hkv key/value heads, G = H / Hkv, hd head_dim.
"""

from __future__ import annotations

import math
import os
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from qerl_jax import nf4, nvfp4
from qerl_jax.models import fuse

MASKED_SCORE = -1e30  # finite, so a fully masked (padding) query row gives no NaN


class StackedWeight(NamedTuple):
  """Layer ``index`` of a stacked 4-bit weight ``[L, K, N]`` (or of a LoRA up-projection stack
  ``[L, R, N]``), read in place by the kernels.

  The decoder's layer ``scan`` with a KV cache wraps its 4-bit weights, and the
  adapters' ``b`` factors, in this instead of slicing them (on a GPU an XLA
  slice feeding a kernel is a device copy of the layer's weight, every decode
  step). It is built only inside a traced layer body and never stored in a
  parameter tree.

  Attributes:
    tensor: NVFP4Tensor or NF4Tensor with one leading (layer) dim, or a float
      array ``[L, R, N]`` (a LoRA ``b`` stack).
    index: int32 scalar layer index (traced).
  """
  tensor: Any
  index: Any


def layer_array(v):
  """``v``, or for a :class:`StackedWeight` its layer ``index`` (an XLA slice, which fuses into an XLA
  consumer)."""
  if isinstance(v, StackedWeight):
    return jax.lax.dynamic_index_in_dim(v.tensor, v.index, 0, keepdims=False)
  return v


def is_quantized(w) -> bool:
  """True for an :class:`NVFP4Tensor` or :class:`NF4Tensor`."""
  return isinstance(w, (nvfp4.NVFP4Tensor, nf4.NF4Tensor))


# For a few bf16 rows on a 4-bit weight, pass the LoRA factors to the 4-bit matmul with the weight
# (pallas_kernels.quantized_matmul(lora=...)) rather than adding the delta here; which kernel then adds
# it in its epilogue and where XLA adds it is pallas_kernels.quantized_matmul's docstring.
# Results are the same (bf16 factors, float32 accumulation). On an H200 (7B shape, rank 32 + AQN,
# experiments/lab/lora_variants.py): 6985 -> 7408 tokens/s at batch 64, 1580 -> 1582 at batch 8
# (docs/benchmarks_rollout.md, session 6). Set False to add it with a separate GEMM.
LORA_EPILOGUE = True


def _epilogue_applies(x: jax.Array, w) -> bool:
  rows = math.prod(x.shape[:-1])
  return (LORA_EPILOGUE and x.dtype == jnp.bfloat16 and (isinstance(w, StackedWeight) or is_quantized(w))
          and rows <= pallas_kernels.matmul.FUSED_MAX_M["fwd"])


def _matmul_f32(x: jax.Array, w, lora=None) -> jax.Array:
  """``x @ W`` in float32 for a float, 4-bit or :class:`StackedWeight` ``W`` (see :func:`linear`);
  ``lora = (xa, b, scale)`` only when :func:`_epilogue_applies` (added by the 4-bit path)."""
  if isinstance(w, StackedWeight):
    return pallas_kernels.quantized_matmul(x, w.tensor, out_dtype=jnp.float32, index=w.index, lora=lora)
  if is_quantized(w):
    return pallas_kernels.quantized_matmul(x, w, out_dtype=jnp.float32, lora=lora)
  if hasattr(w, "dtype") and jnp.issubdtype(w.dtype, jnp.floating):
    if w.shape[-2] != x.shape[-1]:
      raise ValueError(f"linear: x has K={x.shape[-1]} (shape {x.shape}) but W has shape {w.shape}")
    return jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32)
  raise TypeError(f"linear: unsupported weight type {type(w).__name__} "
                  f"(expected a float array, NVFP4Tensor or NF4Tensor)")


# x @ A for a few rows (a decode step) is split along K into this many partial products that
# XLA adds: cuBLAS runs the skinny [M, K] x [K, r] product on 1-2 thread blocks, bound by one
# SM's memory latency. Measured on an H200 with A read from HBM (experiments/lab/lora_xa.py),
# M = 8, r = 32-96: 7.6 -> 4.5 µs at K = 3584 and 26.8 -> 5.8 µs at K = 18944.
_LORA_SPLIT_K = 16
_LORA_SPLIT_MAX_ROWS = 256


def _x_at_a(x: jax.Array, a: jax.Array) -> jax.Array:
  """``x @ a`` in float32 for ``x [..., K]``, ``a [K, r]`` (same dtype), split along K for few rows."""
  k, r = a.shape
  rows = math.prod(x.shape[:-1])
  if rows > _LORA_SPLIT_MAX_ROWS or k % _LORA_SPLIT_K or k < 64 * _LORA_SPLIT_K:
    return jnp.dot(x, a, preferred_element_type=jnp.float32)
  s = _LORA_SPLIT_K
  parts = jnp.einsum("msk,skr->smr", x.reshape(rows, s, k // s), a.reshape(s, k // s, r),
                     preferred_element_type=jnp.float32)
  return parts.sum(0).reshape(*x.shape[:-1], r)


def _lora_b(lora: dict, w, dt):
  """An adapter's ``b`` in dtype ``dt``: a stacked ``B`` (:class:`StackedWeight`) stays whole when ``w`` is
  a stacked 4-bit weight of the same layer index (the kernel reads both in place), else that layer is
  sliced out."""
  b = lora["b"]
  if isinstance(b, StackedWeight):
    in_place = isinstance(w, StackedWeight) and w.index is b.index
    b = b.tensor if in_place else layer_array(b)
  return b.astype(dt)


def _lora_factors(x: jax.Array, lora: dict, lora_scale: float, w=None) -> tuple:
  """``(x @ A in x's dtype, B in x's dtype, scale)``: the operands of the LoRA up-projection (``B`` as
  :func:`_lora_b` gives it; a stacked ``A``, which decode steps keep with
  ``pallas_kernels.w4_gluon.LORA_XA``, is sliced)."""
  dt = x.dtype
  a = layer_array(lora["a"])
  return _x_at_a(x, a.astype(dt)).astype(dt), _lora_b(lora, w, dt), lora_scale


def _kernel_lora_factors(x: jax.Array, lora: dict, lora_scale: float, w, shapes_only: bool = False) -> tuple:
  """:func:`_lora_factors` for the 4-bit kernel's LoRA epilogue: with ``pallas_kernels.w4_gluon.LORA_XA``
  and ``A`` a stack of ``w``'s layer (:class:`StackedWeight`), ``x @ A`` as the float32 partial products
  ``[S, ..., R]`` of :func:`pallas_kernels.w4_gluon.lora_xa` (one kernel, A read in place), else as XLA
  computes it. ``shapes_only``: ``x @ A`` as a ``jax.ShapeDtypeStruct`` (to decide, running nothing)."""
  a, gluon = lora["a"], pallas_kernels.w4_gluon
  x2d = x.reshape(-1, x.shape[-1])
  if (gluon.LORA_XA and isinstance(a, StackedWeight) and isinstance(w, StackedWeight) and a.index is w.index
      and a.tensor.dtype == x.dtype and gluon.lora_xa_applies(x2d, a.tensor, a.index)):
    s, _, r = gluon.lora_xa_shape(x2d, a.tensor)
    shape = (s, *x.shape[:-1], r)
    xa = (jax.ShapeDtypeStruct(shape, jnp.float32) if shapes_only
          else gluon.lora_xa(x2d, a.tensor, a.index).reshape(shape))
    return xa, _lora_b(lora, w, x.dtype), lora_scale
  if shapes_only:  # x @ A's shape and dtype as _lora_factors gives it, without tracing the product
    r = (a.tensor if isinstance(a, StackedWeight) else a).shape[-1]
    return jax.ShapeDtypeStruct((*x.shape[:-1], r), x.dtype), _lora_b(lora, w, x.dtype), lora_scale
  return _lora_factors(x, lora, lora_scale, w)


def _lora_cols(lora: dict) -> int:
  """Output width of an adapter's ``b`` (an array or a :class:`StackedWeight`)."""
  b = lora["b"]
  return (b.tensor if isinstance(b, StackedWeight) else b).shape[-1]


def _lora_f32(x: jax.Array, lora: dict, lora_scale: float) -> jax.Array:
  xa, b, scale = _lora_factors(x, lora, lora_scale)
  return scale * jnp.dot(xa, b, preferred_element_type=jnp.float32)


def _base_f32(x: jax.Array, w, lora: Optional[dict], lora_scale: float) -> tuple:
  """``(x @ W in float32, the adapter still to add)``: with :func:`_epilogue_applies` the 4-bit
  kernel adds ``lora`` itself and None is returned in its place."""
  if lora is not None and _epilogue_applies(x, w):
    return _matmul_f32(x, w, _lora_factors(x, lora, lora_scale, w)), None
  return _matmul_f32(x, w), lora


def _add_bias(y: jax.Array, bias: jax.Array, w) -> jax.Array:
  """``y + bias`` in float32. For a float ``w`` (a cuBLAS GEMM on a GPU) the sum is kept out of the
  GEMM's epilogue by an optimization barrier: XLA folds such an add into a cuBLASLt call with a
  bias epilogue, which its dynamic-slice fusion does not cover, so a layer's weight sliced out of
  the scanned stack was copied whole before the GEMM (Qwen2.5-7B's fused qkv: a 33 MB copy, 16 us,
  every layer of every decode step; docs/benchmarks_rollout.md, session 10). Same numbers either way.
  In prefill and training with a float base the add may likewise become its own small elementwise
  kernel instead of the epilogue (not measured there)."""
  if not (isinstance(w, StackedWeight) or is_quantized(w)):  # a float array (_matmul_f32 took no other)
    y = jax.lax.optimization_barrier(y)
  return y + bias.astype(jnp.float32)


def _env_flag(name: str, default: str) -> bool:
  value = os.environ.get(name, default)
  if value not in ("0", "1"):
    raise ValueError(f"environment variable {name} is {value!r}; expected '0' or '1'")
  return value == "1"


# On the large-M path of a 4-bit weight (prefill, the training forward and its remat: the large-M Gluon forward,
# or dequantize then one cuBLAS GEMM; pallas_kernels.matmul.dense_path_applies) the linear's result is the GEMM's
# own bf16 output, with the bias and the LoRA delta as a bf16 addend (quantized_matmul's addend) added in the GEMM's
# epilogue (the Gluon kernel's, or cuBLAS's C with beta = 1, which XLA folds in: the float32 accumulator plus the
# addend, rounded once to bf16); per-part adapters of a fused q/k/v or gate/up become one
# block-diagonal adapter, so one GEMM writes the whole delta. The float32 route writes a float32 [M, N] product
# and a float32 delta and reads both back before rounding: about 14 bytes an output element against 6. On an
# H200 (7B shapes, rank 32) the four linears' forward is 1.13-1.14x and their VJP 1.14-1.16x faster at
# M = 2048-8192; a 4-layer model's prefill 1.22x and its log-prob gradient 1.12x (docs/benchmarks.md,
# session 33). The addend is rounded to bf16 before the add (half an ulp of the delta and bias, which are small
# next to the product). Set False for the float32 route everywhere; QERL_BF16_EPILOGUE=0 in the environment
# sets that default at import.
BF16_EPILOGUE = _env_flag("QERL_BF16_EPILOGUE", "1")


def bf16_epilogue_applies(x: jax.Array, w) -> bool:
  """Whether :func:`linear` / :func:`fused_linear` take the bf16 route of ``BF16_EPILOGUE`` for ``x @ w``: bf16 ``x``
  ``[..., K]`` and a 4-bit ``w`` (or a :class:`StackedWeight` of one) on the large-M path of
  :func:`pallas_kernels.matmul.dense_path_applies` (a GPU; the Gluon GEMM or dequantize + cuBLAS). Shapes and dtypes
  only are read; ``x`` may be a ``jax.ShapeDtypeStruct``.

  Raises:
    ValueError: a malformed kernel setting (as :func:`pallas_kernels.matmul.dense_path_applies`).
  """
  if not (BF16_EPILOGUE and x.dtype == jnp.bfloat16):
    return False
  tensor, index = _tensor_index(w)
  return is_quantized(tensor) and pallas_kernels.matmul.dense_path_applies(x, tensor, index)


def _linear_bf16(x: jax.Array, w, bias: Optional[jax.Array], lora: Optional[dict], lora_scale: float) -> jax.Array:
  """``x @ W + bias + lora_scale * (x @ A) @ B`` in bf16 (the route of ``BF16_EPILOGUE``): the 4-bit product as the
  large-M GEMM's bf16 output, the adapter's delta as a bf16 GEMM output (XLA folds the scale into its alpha) with
  the bias added to it, and that sum as the first GEMM's addend (``quantized_matmul``'s ``addend``: cuBLAS's C, or
  the large-M Gluon forward's epilogue)."""
  tensor, index = _tensor_index(w)
  c = None if bias is None else bias.astype(x.dtype)
  if lora is not None:
    xa, b, scale = _lora_factors(x, lora, lora_scale)
    delta = scale * jnp.dot(xa, b, preferred_element_type=x.dtype)
    c = delta if c is None else delta + c
  if c is not None:
    c = jnp.broadcast_to(c, (*x.shape[:-1], c.shape[-1]))
  return pallas_kernels.quantized_matmul(x, tensor, out_dtype=x.dtype, index=index, addend=c)


def _block_diagonal(loras: tuple, sizes: tuple) -> Optional[dict]:
  """Per-part adapters (None where a part has none) as one adapter of the fused output
  (:func:`qerl_jax.models.fuse.block_diagonal`, as :func:`qerl_jax.models.fuse.fuse_adapter` builds it for
  sampling), so that one GEMM writes the whole delta where per-part GEMMs need a concatenation pass over
  ``[M, sum(sizes)]``. A stacked factor (:class:`StackedWeight`) is sliced at its layer. None when no part has an
  adapter.

  Raises:
    ValueError: a part's ``b`` whose width is not the part's size, or whose rank differs from its ``a``'s.
  """
  parts = [(f"part {i}", None if i >= len(loras) or loras[i] is None
            else {"a": layer_array(loras[i]["a"]), "b": layer_array(loras[i]["b"])}, size)
           for i, size in enumerate(sizes)]
  if all(ad is None for _, ad, _ in parts):
    return None
  return fuse.block_diagonal(parts, "fused_linear")


def linear(x: jax.Array, w, *, bias: Optional[jax.Array] = None,
           lora: Optional[dict] = None, lora_scale: float = 1.0) -> jax.Array:
  """``x @ W (+ bias) + lora_scale * (x @ A) @ B``: THE one place weights are dispatched.

  * ``W`` a float array ``[K, N]`` -> ``jnp.dot`` in ``x.dtype`` with float32
    accumulation (``preferred_element_type``);
  * ``W`` an NVFP4Tensor / NF4Tensor of logical shape ``[K, N]`` ->
    :func:`pallas_kernels.quantized_matmul` (W4A16 kernel, or its XLA reference);
  * LoRA (Hu et al. 2021): ``lora = {"a": [K, r], "b": [r, N]}``, both matmuls
    in ``x.dtype`` with float32 accumulation.

  The sum is taken in float32 and rounded once to ``x.dtype``, except on the large-M path of a 4-bit ``W``
  in bf16 (``BF16_EPILOGUE``): there the bias plus the adapter's delta is rounded to bf16 first and added to
  the float32 product in the GEMM's epilogue.

  Args:
    x: ``[..., K]`` activations in the compute dtype.
    w: the frozen weight (or a :class:`StackedWeight`: one layer of a stacked
      4-bit weight, read in place).
    bias: optional ``[N]``, added in float32 (see above).
    lora: optional adapter dict.
    lora_scale: ``alpha / r`` (or ``alpha / sqrt(r)`` for rsLoRA), a static float.

  Returns:
    ``[..., N]`` in ``x.dtype``.

  Raises:
    TypeError: ``w`` is neither a float array nor a 4-bit tensor.
    ValueError: K mismatch between ``x`` and ``w``.
  """
  if bf16_epilogue_applies(x, w):
    return _linear_bf16(x, w, bias, lora, lora_scale)
  y, bias = linear_f32_bias_deferred(x, w, bias=bias, lora=lora, lora_scale=lora_scale)
  return finish_linear(y, bias, w, x.dtype)


def _check_part_sizes(sizes: tuple[int, ...], n: int) -> None:
  """Raises ValueError unless ``sizes`` add up to the fused weight's ``n`` columns."""
  if n != sum(sizes):
    raise ValueError(f"fused_linear: part sizes {sizes} add up to {sum(sizes)}, but W has {n} columns")


def fused_linear(x: jax.Array, w, sizes: tuple[int, ...], *, bias: Optional[jax.Array] = None,
                 loras: tuple = (), lora: Optional[dict] = None,
                 lora_scale: float = 1.0) -> tuple[jax.Array, ...]:
  """One matmul by column-concatenated weights ``[W_1 | W_2 | ...]``, split back into its parts.

  Part ``i`` equals ``linear(x, W_i, bias=b_i, lora=loras[i])`` (on :func:`linear`'s bf16 route, per-part
  adapters are one block-diagonal adapter: the same delta, up to the order of float32 sums): the base product
  and bias are computed once for all parts (one kernel launch instead of one per
  part, e.g. q/k/v or gate/up in a decode step), then each part gets its own LoRA
  delta. See :func:`qerl_jax.models.fuse.fuse_projections`.

  Args:
    x: ``[..., K]`` activations.
    w: the fused weight ``[K, sum(sizes)]`` (float, 4-bit, or a :class:`StackedWeight`).
    sizes: output width of each part, in order.
    bias: optional fused bias ``[sum(sizes)]``.
    loras: one adapter dict or None per part (missing trailing entries = None).
    lora: one adapter ``{"a": [K, R], "b": [R, sum(sizes)]}`` for the whole fused output
      (:func:`qerl_jax.models.fuse.fuse_adapter`: the parts' adapters side by side, ``b``
      block diagonal), added before the split; at most one of ``loras`` and ``lora``.
    lora_scale: as in :func:`linear`.

  Returns:
    One ``[..., sizes[i]]`` array per part, in ``x.dtype``.

  Raises:
    ValueError: ``sizes`` do not add up to the weight's output width (or the fused
      adapter's); both ``loras`` and ``lora`` given.
  """
  if lora is not None and any(l is not None for l in loras):
    raise ValueError("fused_linear: give per-part `loras` or one fused `lora`, not both")
  if lora is not None and _lora_cols(lora) != sum(sizes):
    raise ValueError(f"fused_linear: the fused adapter's b has {_lora_cols(lora)} columns, the parts "
                     f"{sizes} add up to {sum(sizes)}")
  if bf16_epilogue_applies(x, w):
    _check_part_sizes(sizes, _tensor_index(w)[0].shape[-1])
    if any(l is not None for l in loras):
      lora = _block_diagonal(loras, sizes)
    y = _linear_bf16(x, w, bias, lora, lora_scale)
    return tuple(jnp.split(y, np.cumsum(sizes)[:-1].tolist(), axis=-1))
  y, lora = _base_f32(x, w, lora, lora_scale)
  _check_part_sizes(sizes, y.shape[-1])
  if bias is not None:
    y = _add_bias(y, bias, w)
  if lora is not None:
    y = y + _lora_f32(x, lora, lora_scale)
  outs, start = [], 0
  for i, size in enumerate(sizes):
    part = y[..., start:start + size]
    lora = loras[i] if i < len(loras) else None
    if lora is not None:
      part = part + _lora_f32(x, lora, lora_scale)
    outs.append(part.astype(x.dtype))
    start += size
  return tuple(outs)


def linear_f32_bias_deferred(x: jax.Array, w, *, bias: Optional[jax.Array] = None,
                              lora: Optional[dict] = None, lora_scale: float = 1.0) -> tuple:
  """:func:`linear` before its bias and its cast: ``(y float32 [..., N], bias still to add or None)``.

  For a consumer that adds the bias and rounds to the compute dtype itself (the decode step's
  fused attention, :func:`pallas_kernels.decode_attention.decode_attention_append`), so that
  ``bf16(y + bias)`` equals :func:`linear`'s output: the float32 sum runs in :func:`linear`'s
  order, so when an adapter delta is still to add after the bias (the 4-bit kernel's epilogue
  does not apply) the bias is added here and None is returned in its place.

  Args and raises: as :func:`linear` (``lora`` one adapter for the whole output).
  """
  y, lora = _base_f32(x, w, lora, lora_scale)
  return _bias_deferred(x, w, y, bias, lora, lora_scale)


def _bias_deferred(x, w, y, bias, lora, lora_scale) -> tuple:
  """``(y, bias)`` when no adapter delta is left to add (``lora`` None), else ``(y + bias + delta, None)``
  in :func:`linear`'s order."""
  if lora is None:
    return y, bias
  if bias is not None:
    y = _add_bias(y, bias, w)
  return y + _lora_f32(x, lora, lora_scale), None


class Accumulator(NamedTuple):
  """A zeroed float32 buffer that a decode step's 4-bit projections write their outputs into, one
  region each (:func:`linear_f32_into`), so that the four W4A16 kernels of a layer share one memset
  instead of one each (on an H200 a memset node costs about 1 µs in the step's CUDA graph:
  0.145 ms of a 2.6 ms batch-8 step; docs/benchmarks.md, sessions 13 and 15).
  Built by :func:`new_accumulator` inside a traced layer body; never stored.

  Attributes:
    buffer: float32 ``[size]``, zero from ``offset`` on; None until the first projection, whose
      launch makes it and zeroes it (an XLA zero fill in every layer of an unrolled step would be
      one constant that XLA copies into each layer's buffer).
    offset: static int, the first free element.
    size: static int, the buffer's length.
  """
  buffer: Optional[jax.Array]
  offset: int
  size: int


def _tensor_index(w):
  return (w.tensor, w.index) if isinstance(w, StackedWeight) else (w, None)


def _accumulates(x: jax.Array, w) -> bool:
  """Whether ``x @ w`` can run into an :class:`Accumulator` (:func:`pallas_kernels.accumulate_applies`)."""
  tensor, index = _tensor_index(w)
  return is_quantized(tensor) and pallas_kernels.accumulate_applies(x, tensor, index)


def new_accumulator(rows: int, weights, dtype=jnp.bfloat16) -> Optional[Accumulator]:
  """An :class:`Accumulator` with room for a region of ``rows x N`` for each weight of ``weights``
  (``[K, N]`` 4-bit tensors or :class:`StackedWeight`; None entries skipped) that
  :func:`linear_f32_into` runs into for ``rows`` activations of ``dtype``, or None when none does
  (CPU, float weights, the Gluon kernel off: the callers' plain path). Its buffer is made and zeroed
  by the first :func:`linear_f32_into` that uses it.

  Returns:
    :class:`Accumulator` (size ``rows * sum(N)``, offset 0, no buffer yet) or None.
  """
  cols = 0
  for w in weights:
    if w is None:
      continue
    k, n = _tensor_index(w)[0].shape
    if _accumulates(jax.ShapeDtypeStruct((rows, k), dtype), w):
      cols += n
  return Accumulator(None, 0, rows * cols) if cols else None


def adapter_in_kernel(x: jax.Array, w, lora: Optional[dict], lora_scale: float = 1.0) -> bool:
  """Whether :func:`linear_f32_into` has the 4-bit kernel add ``lora``'s up-projection ``(x @ A) @ B``
  itself (:func:`pallas_kernels.matmul.accumulate_lora_applies`), so that its region of the accumulator
  holds the finished product (read in place by the next kernel). False without an adapter."""
  if lora is None or not _epilogue_applies(x, w):
    return False
  tensor, index = _tensor_index(w)
  return pallas_kernels.matmul.accumulate_lora_applies(x, tensor, index,
                                                       _kernel_lora_factors(x, lora, lora_scale, w, shapes_only=True))


def linear_f32_into(x: jax.Array, w, acc: Optional[Accumulator], *, bias: Optional[jax.Array] = None,
                    lora: Optional[dict] = None, lora_scale: float = 1.0) -> tuple:
  """:func:`linear_f32_bias_deferred` whose 4-bit product is written into the next region of ``acc``
  (:func:`pallas_kernels.quantized_matmul_into`; forward only) where that applies, with the same
  float32 result (up to the order of the kernel's split-K additions, which atomics do not fix).
  An adapter's up-projection ``(x @ A) @ B`` is added by the same kernel where
  :func:`pallas_kernels.matmul.accumulate_lora_applies` holds (decode steps of at most 128 rows; ``x @ A`` by
  :func:`pallas_kernels.w4_gluon.lora_xa` at most 16, see :func:`_kernel_lora_factors`, else by XLA), else by an
  XLA GEMM. Otherwise (``acc`` None, a float weight, a shape the kernel does
  not take, an adapter with ``pallas_kernels.matmul.GLUON_LORA`` "0") it is
  :func:`linear_f32_bias_deferred` and ``acc`` is returned unchanged.

  Args:
    x: ``[..., K]`` activations in the compute dtype; w, bias, lora, lora_scale: as :func:`linear`.
    acc: an :class:`Accumulator` from :func:`new_accumulator`, or None.

  Returns:
    ``(y float32 [..., N], bias still to add or None, acc)``, ``acc`` advanced past the region used.

  Raises:
    As :func:`linear`; ValueError when ``acc`` has no room for the region.
  """
  if acc is None or not _accumulates(x, w) or (lora is not None and pallas_kernels.matmul.GLUON_LORA != "1"):
    return (*linear_f32_bias_deferred(x, w, bias=bias, lora=lora, lora_scale=lora_scale), acc)
  tensor, index = _tensor_index(w)
  in_kernel = adapter_in_kernel(x, w, lora, lora_scale)
  factors = _kernel_lora_factors(x, lora, lora_scale, w) if in_kernel else None
  y, buffer = pallas_kernels.quantized_matmul_into(x, tensor, acc.buffer, acc.offset, index=index, size=acc.size,
                                                   lora=factors)
  acc = Accumulator(buffer, acc.offset + y.size, acc.size)
  if lora is not None and _epilogue_applies(x, w):  # where _base_f32's kernel would add it, before the bias: added
    # by the 4-bit kernel (pallas_kernels.w4_gluon.lora_into_applies), or here by XLA
    y, lora = (y if in_kernel else y + _lora_f32(x, lora, lora_scale)), None
  return (*_bias_deferred(x, w, y, bias, lora, lora_scale), acc)


def finish_linear(y: jax.Array, bias: Optional[jax.Array], w, dtype) -> jax.Array:
  """The end of :func:`linear` after :func:`linear_f32_bias_deferred` or :func:`linear_f32_into`:
  ``y (+ bias)`` in float32, cast to ``dtype``."""
  if bias is not None:
    y = _add_bias(y, bias, w)
  return y.astype(dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float,
             noise: Optional[jax.Array] = None) -> jax.Array:
  """RMSNorm (Zhang & Sennrich 2019): ``x / sqrt(mean(x^2) + eps) * (weight + noise)``.

  Statistics in float32; ``noise`` (AQN, QeRL Sec. 3.3) is added to the weight
  in float32. Returns ``x.dtype``, shape of ``x`` ``[..., D]``; weight ``[D]``.
  """
  xf = x.astype(jnp.float32)
  var = jnp.mean(jnp.square(xf), axis=-1, keepdims=True)
  normed = (xf * jax.lax.rsqrt(var + eps)).astype(x.dtype)
  w = weight.astype(jnp.float32)
  if noise is not None:
    w = w + noise.astype(jnp.float32)
  return (w * normed.astype(jnp.float32)).astype(x.dtype)


def rope(x_BxTxNxhd: jax.Array, positions_BxT: jax.Array, inv_freq: jax.Array) -> jax.Array:
  """Rotary position embedding (RoFormer), HF "rotate half" layout.

  Args:
    x_BxTxNxhd: queries or keys ``[B, T, heads, hd]``.
    positions_BxT: int32 token positions.
    inv_freq: float32 ``[hd / 2]`` from :func:`config.rope_inv_freq`.

  Returns:
    Same shape and dtype as ``x``; angles and cos/sin in float32.
  """
  ang = positions_BxT.astype(jnp.float32)[..., None] * inv_freq  # [B, T, hd/2]
  return apply_rope(x_BxTxNxhd, jnp.cos(ang), jnp.sin(ang))


def apply_rope(x_BxTxNxhd: jax.Array, cos_BxTxR: jax.Array, sin_BxTxR: jax.Array) -> jax.Array:
  """:func:`rope` from the angles' float32 cos and sin ``[B, T, hd / 2]``: ``x * cos + rotate_half(x) * sin``
  with cos and sin rounded to x's dtype and the products and sum in x's dtype."""
  cos = jnp.concatenate([cos_BxTxR, cos_BxTxR], axis=-1)[:, :, None, :].astype(x_BxTxNxhd.dtype)
  sin = jnp.concatenate([sin_BxTxR, sin_BxTxR], axis=-1)[:, :, None, :].astype(x_BxTxNxhd.dtype)
  half = x_BxTxNxhd.shape[-1] // 2
  x1, x2 = x_BxTxNxhd[..., :half], x_BxTxNxhd[..., half:]
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return x_BxTxNxhd * cos + rotated * sin


ATTENTION_IMPLEMENTATIONS = ("xla", "cudnn", "auto")
CUDNN_HEAD_DIMS = (64, 128)  # head sizes "auto" hands to cuDNN's fused attention (the models here use 64 or 128)


def resolve_attention_implementation(implementation: str, dtype, head_dim: int, t: int, s: int) -> str:
  """The implementation :func:`attention` runs for ``implementation``: ``"auto"`` becomes ``"cudnn"`` where cuDNN's
  fused attention applies (a GPU backend whose first device has compute capability >= 8.0, bf16 or fp16
  inputs, a head size in :data:`CUDNN_HEAD_DIMS`, the training forward's ``T == S``) and ``"xla"`` elsewhere
  (a CPU, float32 inputs, a decode step); ``"xla"`` and ``"cudnn"`` come back as given.

  Measured (docs/benchmarks.md, session 43, H100): the 7B GSM8K update step, 64 completions of 2048 tokens,
  33.2 s with "xla" against 16.2 s with "cudnn", peak memory 18.8 against 16.5 GiB.

  Raises:
    ValueError: an ``implementation`` not in :data:`ATTENTION_IMPLEMENTATIONS`.
  """
  if implementation not in ATTENTION_IMPLEMENTATIONS:
    raise ValueError(f"attention implementation {implementation!r} is not one of {ATTENTION_IMPLEMENTATIONS}")
  if implementation != "auto":
    return implementation
  if (t != s or head_dim not in CUDNN_HEAD_DIMS or jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16)
      or jax.default_backend() != "gpu"):
    return "xla"
  try:
    major = int(str(jax.devices()[0].compute_capability).split(".")[0])
  except (AttributeError, ValueError):  # a GPU backend that reports no compute capability (ROCm)
    return "xla"
  return "cudnn" if major >= 8 else "xla"


def attention(q_BxTxHxhd, k_BxSxKxhd, v_BxSxKxhd, mask_BxTxS, *,
              q_chunk: Optional[int] = None, implementation: str = "xla") -> jax.Array:
  """Grouped-query softmax attention (Ainslie et al. 2023), scale ``1/sqrt(hd)``.

  Scores and softmax in float32; masked slots get :data:`MASKED_SCORE` (a row
  with every slot masked, a left-padding query, gives a finite average).

  ``implementation="cudnn"`` runs cuDNN's fused (flash) attention through
  ``jax.nn.dot_product_attention`` on a GPU instead: the scores never reach memory, the mask becomes
  an additive bias, and each query may also attend its own slot (``T == S`` only, the training
  forward), so that a padding query row, which attends nothing otherwise, stays finite. Rows of real
  queries get the same numbers as ``"xla"`` to rounding (softmax in float32, probabilities in the
  compute dtype either way). ``q_chunk`` does not apply to it.

  Args:
    q_BxTxHxhd: queries (H = Hkv * G).
    k_BxSxKxhd, v_BxSxKxhd: keys and values with Hkv heads.
    mask_BxTxS: bool, True where query t may attend to slot s.
    q_chunk: if set and smaller than T, queries run in chunks of this many
      tokens under ``lax.map`` with each chunk rematerialised in the backward
      pass, so the float32 scores ``[B, H, T, S]`` never exist at once (only
      ``[B, H, q_chunk, S]``). Same numbers.
    implementation: ``"xla"`` (the einsums above; any backend), ``"cudnn"`` (a GPU's fused
      attention, for the training forward's ``T == S``) or ``"auto"`` (``"cudnn"`` where it applies, else
      ``"xla"``: :func:`resolve_attention_implementation`).

  Returns:
    ``[B, T, H, hd]`` in q's dtype.

  Raises:
    ValueError: an unknown ``implementation``, or ``"cudnn"`` with ``T != S`` or off a GPU backend.
  """
  implementation = resolve_attention_implementation(implementation, q_BxTxHxhd.dtype, q_BxTxHxhd.shape[-1],
                                                    q_BxTxHxhd.shape[1], k_BxSxKxhd.shape[1])
  if implementation == "cudnn":
    if jax.default_backend() != "gpu":
      raise ValueError(f"attention implementation 'cudnn' needs a GPU backend (JAX's is {jax.default_backend()!r}); "
                       "use 'xla'")
    return self_attention_jax_nn(q_BxTxHxhd, k_BxSxKxhd, v_BxSxKxhd, mask_BxTxS, "cudnn")
  t = q_BxTxHxhd.shape[1]
  if q_chunk is not None and q_chunk < t:
    n = -(-t // q_chunk)
    pad = n * q_chunk - t
    q, m = q_BxTxHxhd, mask_BxTxS
    if pad:
      q = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
      m = jnp.pad(m, ((0, 0), (0, pad), (0, 0)))
    b, _, h, hd = q.shape
    qc = q.reshape(b, n, q_chunk, h, hd).swapaxes(0, 1)
    mc = m.reshape(b, n, q_chunk, m.shape[-1]).swapaxes(0, 1)
    one = jax.checkpoint(lambda a: _attention(a[0], k_BxSxKxhd, v_BxSxKxhd, a[1]))
    out = jax.lax.map(one, (qc, mc)).swapaxes(0, 1).reshape(b, n * q_chunk, h, hd)
    return out[:, :t]
  return _attention(q_BxTxHxhd, k_BxSxKxhd, v_BxSxKxhd, mask_BxTxS)


def self_attention_jax_nn(q_BxTxHxhd, k_BxSxKxhd, v_BxSxKxhd, mask_BxTxS, implementation: str, *,
                          pad_to_even: Optional[bool] = None) -> jax.Array:
  """:func:`attention` through ``jax.nn.dot_product_attention(implementation=...)`` (``"cudnn"`` on a GPU;
  ``"xla"`` anywhere, which is how the CPU tests check the mask's handling), for ``T == S``: the mask as
  given, plus each query's own slot, so that no row is fully masked (cuDNN's additive mask would
  average a fully masked row over every slot, or give NaN). ``[B, T, H, hd]`` in q's dtype.

  ``pad_to_even`` (default: for ``"cudnn"``) runs an odd ``T`` as ``T + 1`` with one padding slot that no real
  query attends, and drops its row: JAX's cuDNN route refuses the gradient of a masked attention over an odd
  length (``NotImplementedError: Unsupported sequence length``), which a prompt + completion of, say, 255 + 2048
  tokens is. Same numbers on the real rows.

  Raises:
    ValueError: ``T != S``.
  """
  t, s = q_BxTxHxhd.shape[1], k_BxSxKxhd.shape[1]
  if t != s:
    raise ValueError(f"fused attention takes the training forward's T == S; got T={t}, S={s}")
  dt = q_BxTxHxhd.dtype
  q, k, v, m = q_BxTxHxhd, k_BxSxKxhd.astype(dt), v_BxSxKxhd.astype(dt), mask_BxTxS
  if (implementation == "cudnn" if pad_to_even is None else pad_to_even) and t % 2:
    q, k, v = (jnp.pad(x, ((0, 0), (0, 1), (0, 0), (0, 0))) for x in (q, k, v))
    m = jnp.pad(m, ((0, 0), (0, 1), (0, 1)))  # the padding slot: attended by no real query
  mask = m | jnp.eye(m.shape[1], dtype=bool)[None]
  out = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], implementation=implementation)
  return out[:, :t].astype(dt)


def _attention(q_BxTxHxhd, k_BxSxKxhd, v_BxSxKxhd, mask_BxTxS) -> jax.Array:
  b, t, h, hd = q_BxTxHxhd.shape
  kh = k_BxSxKxhd.shape[2]
  dt = q_BxTxHxhd.dtype
  q = q_BxTxHxhd.reshape(b, t, kh, h // kh, hd)
  scores = jnp.einsum("btkgd,bskd->bkgts", q, k_BxSxKxhd.astype(dt),
                      preferred_element_type=jnp.float32) * (hd ** -0.5)
  scores = jnp.where(mask_BxTxS[:, None, None, :, :], scores, MASKED_SCORE)
  probs = jax.nn.softmax(scores, axis=-1).astype(dt)
  out = jnp.einsum("bkgts,bskd->btkgd", probs, v_BxSxKxhd.astype(dt),
                   preferred_element_type=jnp.float32)
  return out.reshape(b, t, h, hd).astype(dt)
