"""Dispatch for 4-bit x bf16 matmuls: GPU kernels where they win, XLA reference elsewhere."""

from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import w4_gluon, w4_gluon_dx, w4_gluon_mm, w4_triton
from qerl_jax import nf4, nvfp4

BACKENDS = ("auto", "reference", "pallas", "interpret")

# Largest row count (M = prod of x's leading dims) for which the fused kernel
# runs; above it the kernel path dequantizes W once with a Pallas kernel and
# calls XLA's bf16 matmul (cuBLAS), which measured faster on an H200 (see
# docs/benchmarks.md). Per direction: "fwd" (x @ W) and "dx" (dy @ W^T).
FUSED_MAX_M = {"fwd": 64, "dx": 32}

# The Gluon decode GEMV (pallas_kernels.w4_gluon) for the forward at M <= 128 (17-128 on sm_90 only) on
# NVFP4 weights whose shapes it takes. "auto" (default): when it is launched through its command-buffer-compatible FFI
# handler (built with the system C++ compiler), or when QERL_GLUON_LAUNCH=jax_triton asks for that
# path; a batch-8 rollout runs 2565 instead of 2037 tokens/s on an H200 with the FFI handler, 1697
# through jax-triton (docs/benchmarks.md, session 7). "1": whenever a launch path exists; "0":
# never. QERL_GLUON in the environment sets the default at import; assign to change it later.
GLUON = os.environ.get("QERL_GLUON", "auto")
# With a LoRA adapter: "1" (default) runs the Gluon kernel and adds the delta with XLA (a batch-8
# training rollout, rank 32 + AQN: 1840 tokens/s); "0" keeps the Pallas kernel, which adds the delta
# in its epilogue (1743). QERL_GLUON_LORA in the environment sets the default at import.
GLUON_LORA = os.environ.get("QERL_GLUON_LORA", "1")
# The large-M Gluon dx kernel (pallas_kernels.w4_gluon_dx: dy @ W^T with no bf16 W in HBM) for
# M >= w4_gluon_dx.MIN_M, where it applies and the Gluon kernels are enabled (gluon_enabled). "1" uses
# it, before GLUON_MM_DX's build; "0" (default) leaves the choice to GLUON_MM_DX and dequantize + cuBLAS, both
# faster: 0.86x / 0.96x of bf16 at M = 2048 / 8192 for dequantize + cuBLAS against the kernel's 0.57x / 0.62x
# (7B shapes, H200; docs/benchmarks.md, session 17). QERL_GLUON_DX in the environment sets the default.
GLUON_DX = os.environ.get("QERL_GLUON_DX", "0")
# The large-M Gluon forward (pallas_kernels.w4_gluon_mm: the 4-bit codes decoded in registers as wgmma's operand, no
# bf16 W in HBM) for bf16 results with FUSED_MAX_M["fwd"] < M <= w4_gluon_mm.MAX_M rows where the Gluon decode GEMV
# does not run, the kernel applies and the Gluon kernels are enabled (gluon_enabled). "auto" (default) uses it; "0"
# keeps dequantize + cuBLAS. On an H100 (7B shapes summed) it ran at 0.95x of bf16 at M = 2048 against 0.84x for
# dequantize + cuBLAS, 0.93x against 0.73x at M = 1024; at M = 8192 dequantize + cuBLAS wins (0.955x against
# 0.90x), hence MAX_M; per shape, w4_gluon_mm.pays decides by a cost model (docs/benchmarks.md, session 46). Since
# session 47 it also takes bf16 products of w4_gluon_mm.NARROW_MIN_M < M <= w4_gluon_mm.SMALL_M_MAX (32 < M <= 128)
# in narrow tiles, instead of the decode GEMV, and splits along K where its tiles leave SMs idle (MAX_SPLITS).
# QERL_GLUON_MM in the environment sets the default.
GLUON_MM = os.environ.get("QERL_GLUON_MM", "auto")
# The same kernel's dx build (w4_gluon_mm.dx: dy @ W^T with no bf16 W in HBM) for kernel_dx at
# FUSED_MAX_M["dx"] < M <= w4_gluon_mm.MAX_M where it applies. "1" (default) uses it: on the H200 it ran the 7B
# shapes at M = 2048 at 0.924x of bf16 against 0.851x for dequantize + cuBLAS (at 8192, above MAX_M, 0.878x against
# 0.957x; docs/benchmarks.md, session 49). "0" keeps dequantize + cuBLAS. QERL_GLUON_MM_DX in the environment sets
# the default.
GLUON_MM_DX = os.environ.get("QERL_GLUON_MM_DX", "1")
# The model's 4-bit linears (qerl_jax.models.layers.linear, fused_linear: their bf16 route, BF16_EPILOGUE) also at
# 32 < M <= 128 rows where the dispatch sends a bf16 product to the large-M forward's narrow tiles (_use_gluon_mm).
# Without it dense_path_applies is false up to 128 rows wherever the decode GEMV runs, so a model's product there
# takes the GEMV's float32 route and the narrow tiles (session 47) reach only callers that ask for bf16 themselves.
# Lab harness, M = 64, decode-order codes, the 7B gate/up (a batch-64 decode step's largest product): 56.7 against
# the GEMV's 81.2 us on the H200 (session 49), 56.0 against 85.3 on the H100 (session 50). In a 7B NVFP4 rollout
# (512 new tokens, H100, session 51, experiments/lab/gpu_checkpoint.sh step 68) the decode step takes 4.63 against
# 5.60 ms at batch 64, 6.45 against 8.33 at batch 128, and 5.77 against 6.72 at batch 64 with the training adapter
# (LoRA rank 32 + AQN). "1" (default, session 51) / "0". QERL_GLUON_MM_NARROW_MODEL in the environment sets the
# default.
GLUON_MM_NARROW_MODEL = os.environ.get("QERL_GLUON_MM_NARROW_MODEL", "1")


def _check_setting(name: str, value: str, allowed) -> None:
  if value not in allowed:
    raise ValueError(f"pallas_kernels.matmul.{name} (env QERL_{name}) is {value!r}; expected one of {allowed}")


def gluon_enabled() -> bool:
  """Whether the settings let :func:`kernel_forward` take the Gluon decode GEMV for the shapes it
  applies to (``w4_gluon.applies``): ``GLUON`` is not "0", a launch path exists, and it is either
  asked for ("1") or the FFI launcher (or a requested jax-triton launch) is available.

  Raises:
    ValueError: ``GLUON`` not "auto"/"1"/"0".
  """
  _check_setting("GLUON", GLUON, ("auto", "1", "0"))
  if GLUON == "0" or not w4_gluon.available():
    return False
  return GLUON == "1" or w4_gluon.launcher() == "ffi" or w4_gluon.requested_launcher() == "jax_triton"


def _use_gluon(x2d, w, interpret: bool, lora) -> bool:
  """Whether :func:`kernel_forward` takes the Gluon decode GEMV (see ``GLUON``, ``GLUON_LORA``).

  Raises:
    ValueError: ``GLUON`` not "auto"/"1"/"0" or ``GLUON_LORA`` not "1"/"0".
  """
  _check_setting("GLUON", GLUON, ("auto", "1", "0"))
  _check_setting("GLUON_LORA", GLUON_LORA, ("1", "0"))
  if interpret or GLUON == "0" or (lora is not None and GLUON_LORA != "1"):
    return False
  return w4_gluon.applies(x2d.shape[0], w, x2d.dtype) and gluon_enabled()


def _use_gluon_mm(x2d, w, out_dtype, interpret: bool, lora) -> bool:
  """Whether :func:`kernel_forward` takes the large-M Gluon forward (see ``GLUON_MM``): a bf16 result without a
  LoRA term, more rows than the fused Pallas kernel and the Gluon decode GEMV take, at most
  ``w4_gluon_mm.MAX_M``, where its cost model has it no slower than dequantize + cuBLAS (``w4_gluon_mm.pays``:
  shapes with too few tiles for the SMs stay on dequantize + cuBLAS); and every bf16 product of
  ``w4_gluon_mm.NARROW_MIN_M < M <= w4_gluon_mm.SMALL_M_MAX`` rows (32 < M <= 128), in the kernel's narrow tiles,
  instead of the decode GEMV, which keeps weights of at most ``w4_gluon_mm.NARROW_SMALL_WEIGHTS`` values at M <= 64
  (``w4_gluon_mm.narrow_takes``). (A decode step's projections into its shared float32 accumulator,
  ``quantized_matmul_into``, stay on the decode GEMV.)

  Raises:
    ValueError: ``GLUON_MM`` not "auto"/"0" (or ``GLUON`` / ``GLUON_LORA`` malformed).
  """
  _check_setting("GLUON_MM", GLUON_MM, ("auto", "0"))
  m = x2d.shape[0]
  if interpret or GLUON_MM == "0" or lora is not None or jnp.dtype(out_dtype) != jnp.bfloat16:
    return False
  gemv = _use_gluon(x2d, w, interpret, lora)
  # the narrow tiles instead of the decode GEMV (which keeps the smallest weights at M <= 64)
  narrow = w4_gluon_mm.narrow_takes(m, *w.shape, gemv)
  if not narrow and (not FUSED_MAX_M["fwd"] < m <= w4_gluon_mm.MAX_M or gemv):
    return False
  return w4_gluon_mm.applies(m, w, x2d.dtype) and (narrow or w4_gluon_mm.pays(m, *w.shape)) and gluon_enabled()


def forward_path(x2d, w, *, out_dtype=None, interpret: bool = False, lora=None) -> str:
  """Which kernel :func:`kernel_forward` (without ``addend``) runs for ``x2d`` (``[M, K]``, or a
  ``jax.ShapeDtypeStruct``; shapes only are read) and ``w``, in its order of precedence: ``"gluon_mm"`` (the large-M
  Gluon forward, which also takes 32 < M <= 128 in narrow tiles), ``"gluon"`` (the Gluon decode GEMV), ``"fused"``
  (the Pallas dequantize-in-registers kernel, ``M <= FUSED_MAX_M["fwd"]``), else ``"dequantize+dot"`` (a Pallas
  dequantize to bf16, then one GEMM). ``out_dtype`` defaults to ``x2d``'s dtype. For benchmarks and tests that label
  or check the path a shape takes.

  Raises:
    ValueError: a malformed ``GLUON``, ``GLUON_LORA`` or ``GLUON_MM`` setting.
  """
  out_dtype = jnp.dtype(x2d.dtype if out_dtype is None else out_dtype)
  if _use_gluon_mm(x2d, w, out_dtype, interpret, lora):
    return "gluon_mm"
  if _use_gluon(x2d, w, interpret, lora):
    return "gluon"
  if x2d.shape[0] <= FUSED_MAX_M["fwd"]:
    return "fused"
  return "dequantize+dot"


def kernel_forward(x2d: jax.Array, w, *, out_dtype=None, interpret: bool = False, index=None,
                   lora=None, addend=None) -> jax.Array:
  """The kernel path's ``x @ W`` for 2-D bf16 ``x`` ``[M, K]`` -> ``[M, N]`` (no VJP).

  The kernel :func:`forward_path` names, in its order: the large-M Gluon forward (:mod:`pallas_kernels.w4_gluon_mm`,
  see ``GLUON_MM``; a bf16 result without ``lora``, its narrow tiles also at 32 < M <= 128) where it applies; else
  the Gluon decode GEMV (:mod:`pallas_kernels.w4_gluon`) where it applies (NVFP4, ``M <= 128``; see ``GLUON`` and
  ``GLUON_LORA``); else the Pallas fused dequantize-in-registers kernel for ``M <= FUSED_MAX_M["fwd"]``; else a
  one-pass Pallas dequantize to bf16 followed by ``jnp.dot`` (float32 accumulation). With ``index`` (int32
  scalar), ``w`` is a stack ``[L, K, N]`` and layer ``index`` is read in place. ``lora = (xa [M, R], b, scale)``
  adds ``scale * xa @ b``: in the fused kernel's epilogue, else by XLA; ``b`` is ``[R, N]``, or with ``index`` a
  stack ``[L, R, N]`` whose layer ``index`` is used.
  ``addend`` (``[M, N]``, not with ``lora``): added to the float32 product before its one rounding to ``out_dtype``
  (the large-M Gluon forward's epilogue, or XLA's addend to the cuBLAS GEMM). Its route: the large-M Gluon forward
  where :func:`forward_path` names it and the addend is bf16; else the float32 result's path where that is a
  GEMV-sized kernel (``"gluon"`` or ``"fused"``), the addend added in XLA; else dequantize + dot.

  Raises:
    TypeError: unsupported weight type. ValueError: K mismatch, stacked ``w``, ``addend`` with ``lora``.
  """
  out_dtype = jnp.dtype(out_dtype or x2d.dtype)
  if addend is not None:
    if lora is not None:
      raise ValueError("kernel_forward: addend and lora cannot be combined; fold the delta into the addend")
    # the large-M Gluon forward adds a bf16 addend in its epilogue; otherwise the float32 product of a
    # GEMV-sized path (the float32 result's own forward_path) takes the addend before its one rounding
    if addend.dtype == jnp.bfloat16 and forward_path(x2d, w, out_dtype=out_dtype, interpret=interpret) == "gluon_mm":
      return w4_gluon_mm.forward(x2d, w, index=index, addend=addend)
    if forward_path(x2d, w, out_dtype=jnp.float32, interpret=interpret) != "dequantize+dot":
      y = kernel_forward(x2d, w, out_dtype=jnp.float32, interpret=interpret, index=index)
      return (y + addend.astype(jnp.float32)).astype(out_dtype)
    w_dense = w4_triton.dequantize(w, x2d.dtype, interpret=interpret, index=index)
    y = _dense_dot(x2d, w_dense, ((1,), (0,)), out_dtype, interpret)
    # on the GPU a bf16 GEMM output plus a bf16 addend: XLA folds the addend into cuBLAS's C (beta = 1)
    return y + addend.astype(out_dtype)
  path = forward_path(x2d, w, out_dtype=out_dtype, interpret=interpret, lora=lora)
  if path == "gluon_mm":
    return w4_gluon_mm.forward(x2d, w, index=index)
  if path == "gluon":
    y = w4_gluon.forward(x2d, w, out_dtype=jnp.float32 if lora is not None else out_dtype, index=index)
    return y if lora is None else (y + _lora_delta(*lora, index=index)).astype(out_dtype)
  if path == "fused":
    return w4_triton.forward(x2d, w, out_dtype=out_dtype, interpret=interpret, index=index, lora=lora)
  w_dense = w4_triton.dequantize(w, x2d.dtype, interpret=interpret, index=index)
  if lora is None:
    return _dense_dot(x2d, w_dense, ((1,), (0,)), out_dtype, interpret)
  y = jnp.dot(x2d, w_dense, preferred_element_type=jnp.float32)
  return (y + _lora_delta(*lora, index=index)).astype(out_dtype)


def dense_path_applies(x: jax.Array, w, index=None) -> bool:
  """Whether :func:`quantized_matmul` (``backend="auto"``) multiplies ``x [..., K]`` by ``w`` (with ``index``) on
  the large-M path of :func:`kernel_forward`: the large-M Gluon forward (``GLUON_MM``), or the weight dequantized
  by a Pallas kernel, then one cuBLAS GEMM. That holds on a GPU for bf16 ``x``, a 4-bit ``w`` the kernels take,
  and more rows (the product of ``x``'s leading dims) than the fused kernel's ``FUSED_MAX_M["fwd"]``, where the
  Gluon decode GEMV does not apply (it takes up to 128 rows). There a bf16 result is the GEMM's own output, so a
  caller can pass its bf16 ``[M, N]`` terms as ``quantized_matmul``'s ``addend``, added in the GEMM's epilogue
  (:func:`qerl_jax.models.layers.linear`). Shapes only are read (``x`` may be a ``jax.ShapeDtypeStruct``).

  With ``GLUON_MM_NARROW_MODEL = "1"`` (the default) it also holds where the large-M forward's narrow tiles would take a
  bf16 product of 32 < M <= 128 rows (instead of the decode GEMV).

  Raises:
    ValueError: ``GLUON`` not "auto"/"1"/"0", ``GLUON_LORA`` or ``GLUON_MM_NARROW_MODEL`` not "1"/"0" (or
      ``GLUON_MM`` not "auto"/"0").
  """
  if not (_on_gpu() and _kernel_applies(x, w, index)):
    return False
  rows = int(np.prod(x.shape[:-1]))
  x2d = jax.ShapeDtypeStruct((rows, x.shape[-1]), x.dtype)
  if rows > FUSED_MAX_M["fwd"] and not _use_gluon(x2d, w, False, None):
    return True
  _check_setting("GLUON_MM_NARROW_MODEL", GLUON_MM_NARROW_MODEL, ("1", "0"))
  return GLUON_MM_NARROW_MODEL == "1" and _use_gluon_mm(x2d, w, jnp.bfloat16, False, None)


def _layer_b(b, index):
  """``b`` ``[R, N]`` as given, or layer ``index`` (clamped) of a stack ``[L, R, N]``."""
  return b if b.ndim == 2 else w4_triton.layer_slice(b, index)


def _lora_delta(xa, b, scale, index=None):
  """``scale * xa @ b`` in float32 (bf16 operands, as the kernel's epilogue); a stacked ``b``
  ``[L, R, N]`` is sliced at ``index`` (clamped)."""
  return scale * jnp.dot(xa.astype(jnp.bfloat16), _layer_b(b, index).astype(jnp.bfloat16),
                         preferred_element_type=jnp.float32)


def _use_gluon_mm_dx(dy2d, w, interpret: bool) -> bool:
  """Whether :func:`kernel_dx` takes the large-M Gluon forward's dx build (see ``GLUON_MM_DX``) for ``dy2d`` of more
  than ``FUSED_MAX_M["dx"]`` rows.

  Raises:
    ValueError: ``GLUON_MM_DX`` not "1"/"0".
  """
  _check_setting("GLUON_MM_DX", GLUON_MM_DX, ("1", "0"))
  return (GLUON_MM_DX == "1" and not interpret and dy2d.shape[0] <= w4_gluon_mm.MAX_M
          and w4_gluon_mm.dx_applies(dy2d.shape[0], w, dy2d.dtype) and gluon_enabled())


def _use_gluon_dx(dy2d, w, interpret: bool) -> bool:
  """Whether :func:`kernel_dx` takes the large-M Gluon dx kernel (see ``GLUON_DX``).

  Raises:
    ValueError: ``GLUON_DX`` not "1"/"0" (or ``GLUON`` not "auto"/"1"/"0").
  """
  _check_setting("GLUON_DX", GLUON_DX, ("1", "0"))
  if interpret or GLUON_DX == "0" or dy2d.shape[0] < w4_gluon_dx.MIN_M:
    return False
  return w4_gluon_dx.applies(dy2d.shape[0], w, dy2d.dtype) and gluon_enabled()


def dx_path(dy2d, w, *, interpret: bool = False) -> str:
  """Which kernel :func:`kernel_dx` runs for ``dy2d`` (``[M, N]``, or a ``jax.ShapeDtypeStruct``) and ``w``, in its
  order of precedence: ``"fused"`` (``M <= FUSED_MAX_M["dx"]``), ``"gluon_dx"`` (the opt-in ``GLUON_DX`` kernel:
  set, it wins over the default below), ``"gluon_mm_dx"`` (the large-M Gluon forward's dx build, ``GLUON_MM_DX``),
  else ``"dequantize+dot"``.

  Raises:
    ValueError: ``GLUON_DX`` or ``GLUON_MM_DX`` not "1"/"0" (or ``GLUON`` malformed).
  """
  if dy2d.shape[0] <= FUSED_MAX_M["dx"]:
    return "fused"
  if _use_gluon_dx(dy2d, w, interpret):
    return "gluon_dx"
  if _use_gluon_mm_dx(dy2d, w, interpret):
    return "gluon_mm_dx"
  return "dequantize+dot"


def kernel_dx(dy2d: jax.Array, w, *, out_dtype=jnp.bfloat16, interpret: bool = False, index=None) -> jax.Array:
  """The kernel path's ``dy @ W^T`` for 2-D bf16 ``dy`` ``[M, N]`` -> ``[M, K]``.

  Fused kernel for ``M <= FUSED_MAX_M["dx"]``; with ``GLUON_DX = "1"`` (opt-in) and ``M >= w4_gluon_dx.MIN_M``
  the large-M Gluon dx kernel where it applies (NVFP4 on sm_90); else, with ``GLUON_MM_DX = "1"`` (the default)
  and ``M <= w4_gluon_mm.MAX_M``, the large-M Gluon forward's dx build where it applies (neither writes a bf16
  W); else Pallas dequantize + XLA matmul contracting N (no transposed copy of W is made).
  ``index``: as in :func:`kernel_forward`.

  Raises:
    TypeError: unsupported weight type. ValueError: N mismatch, stacked ``w``, ``GLUON_DX`` or ``GLUON_MM_DX`` not
      "1"/"0".
  """
  path = dx_path(dy2d, w, interpret=interpret)
  if path == "fused":
    return w4_triton.dx(dy2d, w, out_dtype=out_dtype, interpret=interpret, index=index)
  if path == "gluon_dx":
    return w4_gluon_dx.dx(dy2d, w, index=index).astype(out_dtype)
  if path == "gluon_mm_dx":
    return w4_gluon_mm.dx(dy2d, w, index=index).astype(out_dtype)
  w_dense = w4_triton.dequantize(w, dy2d.dtype, interpret=interpret, index=index)
  return _dense_dot(dy2d, w_dense, ((1,), (1,)), out_dtype, interpret)


def _dense_dot(a: jax.Array, w_dense: jax.Array, contract, out_dtype, interpret: bool) -> jax.Array:
  """The large-M path's GEMM of ``a`` (bf16 ``[M, *]``) with the dequantized ``w_dense`` over ``contract`` (a pair
  of axis tuples), float32 accumulation, ``out_dtype`` result.

  On the GPU a bf16 result is the GEMM's own output: cuBLAS accumulates bf16 products in float32 (XLA:GPU's
  compute type for bf16 GEMMs), so this is the float32 product rounded once, without a float32 ``[M, N]`` written
  to HBM and a conversion pass over it (session 31: 56 of 454 µs at the 7B gate matrix, M = 2048; 216 of 1631 at
  8192). Elsewhere (interpret mode, a float32 result) the float32 product is cast."""
  dims = (contract, ((), ()))
  if not interpret and jnp.dtype(out_dtype) == a.dtype == w_dense.dtype == jnp.bfloat16:
    return jax.lax.dot_general(a, w_dense, dims, preferred_element_type=jnp.bfloat16)
  return jax.lax.dot_general(a, w_dense, dims, preferred_element_type=jnp.float32).astype(out_dtype)


def _dequantize(w, dtype):
  if isinstance(w, nvfp4.NVFP4Tensor):
    return nvfp4.dequantize(w, dtype)
  if isinstance(w, nf4.NF4Tensor):
    return nf4.dequantize(w, dtype)
  raise TypeError(f"expected an NVFP4Tensor or NF4Tensor, got {type(w).__name__}")


def _check_x(x: jax.Array, k: int, n: int) -> None:
  """ValueError unless ``x`` is a float array ``[..., K]`` for a ``[K, N]`` weight (an integer ``x`` would
  dequantize the weight to integers, truncating its values)."""
  if x.ndim < 1 or not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"quantized_matmul: x must be a float array [..., K={k}]; got {x.dtype}{list(x.shape)}")
  if x.shape[-1] != k:
    raise ValueError(f"quantized_matmul: x has K={x.shape[-1]} (shape {x.shape}) but the weight is [{k}, {n}]")


def reference_matmul(x: jax.Array, w, *, out_dtype=None) -> jax.Array:
  """Pure-XLA reference: dequantize ``w`` to ``x.dtype`` and ``dot`` with float32 accumulation.

  Args:
    x: ``[..., K]`` activations (bf16, float16 or float32).
    w: NVFP4Tensor / NF4Tensor of logical shape ``[K, N]`` (a stack ``[L, K, N]`` gives
      ``jnp.dot``'s ``[..., L, N]``: ``x`` times every layer).
    out_dtype: output dtype, default ``x.dtype``.

  Returns:
    ``[..., N]`` in ``out_dtype``.

  Raises:
    TypeError: unsupported weight type. ValueError: K mismatch, a scalar or non-float ``x``
      (the weight would be dequantized to an integer dtype: its values truncated).
  """
  k, n = w.shape
  _check_x(x, k, n)
  out_dtype = out_dtype or x.dtype
  w_deq = _dequantize(w, x.dtype)
  return jnp.dot(x, w_deq, preferred_element_type=jnp.float32).astype(out_dtype)


def _zero_cotangent(a):
  if jnp.issubdtype(a.dtype, jnp.inexact):
    return jnp.zeros(a.shape, a.dtype)
  return np.zeros(a.shape, jax.dtypes.float0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _kernel_matmul(x2d, w, index, out_dtype, interpret):
  return kernel_forward(x2d, w, out_dtype=out_dtype, interpret=interpret, index=index)


def _kernel_matmul_fwd(x2d, w, index, out_dtype, interpret):
  return _kernel_matmul(x2d, w, index, out_dtype, interpret), (w, index)


def _kernel_matmul_bwd(out_dtype, interpret, res, dy):
  del out_dtype
  w, index = res
  dx = kernel_dx(dy.astype(jnp.bfloat16), w, out_dtype=jnp.bfloat16, interpret=interpret, index=index)
  # W is frozen: its cotangent is zero (float0 for the integer codes and the layer index).
  return dx, jax.tree.map(_zero_cotangent, w), (None if index is None else _zero_cotangent(index))


_kernel_matmul.defvjp(_kernel_matmul_fwd, _kernel_matmul_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _kernel_matmul_add(x2d, w, index, addend, out_dtype, interpret):
  return kernel_forward(x2d, w, out_dtype=out_dtype, interpret=interpret, index=index, addend=addend)


def _kernel_matmul_add_fwd(x2d, w, index, addend, out_dtype, interpret):
  # (the addend's dtype travels as a 0-d array: residuals must be JAX values)
  return _kernel_matmul_add(x2d, w, index, addend, out_dtype, interpret), (w, index, jnp.zeros((), addend.dtype))


def _kernel_matmul_add_bwd(out_dtype, interpret, res, dy):
  w, index, addend_like = res
  dx, dw, dindex = _kernel_matmul_bwd(out_dtype, interpret, (w, index), dy)
  return dx, dw, dindex, dy.astype(addend_like.dtype)


_kernel_matmul_add.defvjp(_kernel_matmul_add_fwd, _kernel_matmul_add_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _kernel_matmul_lora(x2d, w, index, xa, b, scale, out_dtype, interpret):
  return kernel_forward(x2d, w, out_dtype=out_dtype, interpret=interpret, index=index, lora=(xa, b, scale))


def _kernel_matmul_lora_fwd(x2d, w, index, xa, b, scale, out_dtype, interpret):
  return _kernel_matmul_lora(x2d, w, index, xa, b, scale, out_dtype, interpret), (w, index, xa, b)


def _kernel_matmul_lora_bwd(scale, out_dtype, interpret, res, dy):
  w, index, xa, b = res
  dx, dw, dindex = _kernel_matmul_bwd(out_dtype, interpret, (w, index), dy)
  dy32 = dy.astype(jnp.float32)
  dxa = (scale * jnp.dot(dy32, _layer_b(b, index).astype(jnp.float32).T)).astype(xa.dtype)
  db = (scale * jnp.dot(xa.astype(jnp.float32).T, dy32)).astype(b.dtype)
  if b.ndim == 3:  # only layer `index` (clamped, as in the forward) of the stack gets a cotangent
    db = jax.lax.dynamic_update_index_in_dim(jnp.zeros_like(b), db, w4_triton.clamp_layer(index, b.shape[0]), 0)
  return dx, dw, dindex, dxa, db


_kernel_matmul_lora.defvjp(_kernel_matmul_lora_fwd, _kernel_matmul_lora_bwd)


def _on_gpu() -> bool:
  return jax.default_backend() in ("gpu", "cuda")


def _kernel_applies(x, w, index=None) -> bool:
  return (isinstance(w, (nvfp4.NVFP4Tensor, nf4.NF4Tensor)) and w.packed.ndim == (2 if index is None else 3)
          and x.dtype == jnp.bfloat16)


def dequantize(w, dtype=jnp.bfloat16, *, backend: str = "auto") -> jax.Array:
  """A 4-bit weight (or a stack of them) as a dense array: the values the large-M path multiplies by.

  The sampler uses it to dequantize a base once for a whole rollout
  (``SamplingConfig.dequantize_min_rows``) instead of once per layer and decode step.

  Args:
    w: NVFP4Tensor or NF4Tensor ``[K, N]``, or a stack ``[L, K, N]`` (one leading dim).
    dtype: output dtype (bf16 or float32).
    backend: ``"auto"`` (the Pallas dequantize kernel on a GPU, one launch per layer of a stack,
      each reading its layer in place; else the reference), ``"reference"``
      (:func:`qerl_jax.nvfp4.dequantize` / :func:`qerl_jax.nf4.dequantize` in XLA), ``"pallas"``
      (the kernel; GPU only) or ``"interpret"`` (the kernel in Pallas interpret mode, for CPU tests).

  Returns:
    ``dtype`` ``[K, N]`` or ``[L, K, N]``; ``K x N x 2`` bytes a layer in bf16. The kernel's values
    equal the reference's up to the final rounding to ``dtype`` (float32 products of the E2M1 value,
    the E4M3 block scale and the inverse global scale, taken in a different order;
    :func:`pallas_kernels.w4_triton.dequantize`).

  Raises:
    ValueError: unknown backend, or more than one leading dim.
    TypeError: ``w`` is not an NVFP4Tensor or NF4Tensor.
  """
  if backend not in BACKENDS:
    raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
  if not isinstance(w, (nvfp4.NVFP4Tensor, nf4.NF4Tensor)):
    raise TypeError(f"expected an NVFP4Tensor or NF4Tensor, got {type(w).__name__}")
  if w.packed.ndim not in (2, 3):
    raise ValueError(f"dequantize takes [K, N] or a stack [L, K, N]; packed codes have shape {w.packed.shape}")
  if backend == "auto":
    backend = "pallas" if _on_gpu() else "reference"
  if backend == "reference":
    return _dequantize(w, dtype)
  interpret = backend == "interpret"
  if w.packed.ndim == 2:
    return w4_triton.dequantize(w, dtype, interpret=interpret)
  layers = jnp.arange(w.packed.shape[0], dtype=jnp.int32)
  return jax.lax.map(lambda i: w4_triton.dequantize(w, dtype, interpret=interpret, index=i), layers)


def layer_of(w, index):
  """Layer ``index`` (int32 scalar, traced or not; clamped to ``[0, L)``) of a stacked 4-bit tensor
  ``[L, K, N]`` as a ``[K, N]`` tensor.

  An XLA dynamic slice (a copy of the layer on a GPU); the kernel path reads
  the layer in place instead.

  Raises:
    ValueError: ``w`` has no single leading (layer) dim.
  """
  if w.packed.ndim != 3:
    raise ValueError(f"expected a stack of 4-bit matrices [L, K, N], got packed shape {w.packed.shape}")
  return w4_triton.layer_slice(w, index)


def quantized_matmul(x: jax.Array, w, *, out_dtype=None, backend: str = "auto", index=None,
                     lora=None, addend=None) -> jax.Array:
  """``x @ W`` (``+ scale * xa @ b``, ``+ addend``) for a 4-bit ``W``; the one entry point the model calls.

  Differentiable in ``x`` (``jax.custom_vjp`` on the kernel path: the backward
  ``dx = dy @ W^T`` is a fused kernel too); ``W`` is frozen and gets a zero
  cotangent.

  Args:
    x: ``[..., K]`` bf16 (or float32) activations.
    w: NVFP4Tensor or NF4Tensor, logical ``[K, N]`` (no leading dims on the
      kernel path; stacked weights without ``index`` go through the reference,
      which multiplies ``x`` by every layer: ``[..., L, N]``), or with
      ``index``, a stack of ``L`` such matrices (one leading dim).
    out_dtype: output dtype (default ``x.dtype``); accumulation is float32.
    backend: ``"auto"`` (the kernel path on a GPU for bf16 ``x``, else
      the reference), ``"reference"`` (XLA dequantize-then-dot), ``"pallas"``
      (the kernel path, GPU only: the Gluon decode GEMV of :mod:`pallas_kernels.w4_gluon`
      for NVFP4 at ``M <= 128`` where ``GLUON`` allows it, else the Pallas Triton fused kernel
      for ``M <= FUSED_MAX_M``, else Pallas dequantize + cuBLAS), ``"interpret"``
      (the same kernels in Pallas interpret mode: slow, for CPU tests).
    index: optional int32 scalar (may be traced): multiply by layer ``index``
      of a stacked ``w``. The kernels read that layer in place, so a layer
      ``scan`` over stacked weights copies no weight per step (an XLA dynamic
      slice feeding a custom call is a device copy); the reference slices.
      Clamped to ``[0, L)`` on every backend (a negative index gives layer 0).
    lora: optional ``(xa, b, scale)``: a LoRA delta ``scale * xa @ b`` (Hu et
      al. 2021) added to the product, with ``xa = x @ A`` ``[..., R]`` (x's
      leading dims), ``b`` ``[R, N]`` and a static float ``scale``; both
      factors are multiplied in bf16 with float32 accumulation. The Pallas Triton fused
      kernel adds it in its epilogue; on the Gluon and dequantize + cuBLAS paths XLA adds it with
      a separate GEMM here (the decoder's own 4-bit linears reach the Gluon kernel's epilogue
      through ``forward_into`` instead, :data:`w4_gluon.LORA_IN_KERNEL`); differentiable in
      ``xa`` and ``b``. With ``index``, ``b`` may also be a stack
      ``[L, R, N]``: the kernel reads layer ``index`` of it in place (a decode
      step's layer scan then copies no adapter factor per step).
    addend: optional ``[..., N]`` (x's leading dims; not with ``lora``) added to the float32 product before its one
      rounding to ``out_dtype``: the model's bias plus LoRA delta on its bf16 route (``layers.BF16_EPILOGUE``). On
      the large-M Gluon forward (``GLUON_MM``) its epilogue adds it; on dequantize + cuBLAS XLA folds it into the
      GEMM (cuBLAS's ``C``); its cotangent is ``dy``.

  Returns:
    ``[..., N]`` in ``out_dtype`` (zeros when ``x`` has no rows).

  Raises:
    ValueError: unknown backend, a scalar or non-float ``x``, K mismatch, ``lora``
      shapes that do not match (or ``lora`` with a stacked ``w`` and no ``index``), a non-finite Python
      ``lora`` scale, a non-floating ``out_dtype``, an ``addend`` that is not a float ``[..., N]`` of x's leading
      dims (or comes with ``lora``), or a forced kernel backend with an input it does not take (non-bf16 ``x``,
      stacked ``w``).
    TypeError: unsupported weight type; an ``index`` that is not an integer scalar.
  """
  if backend not in BACKENDS:
    raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
  if not isinstance(w, (nvfp4.NVFP4Tensor, nf4.NF4Tensor)):
    raise TypeError(f"expected an NVFP4Tensor or NF4Tensor, got {type(w).__name__}")
  k, n = w.shape
  _check_x(x, k, n)
  if index is not None and w.packed.ndim != 3:
    raise ValueError(f"quantized_matmul: index given but the weight is not a stack [L, K, N] "
                     f"(packed shape {w.packed.shape})")
  if index is not None and (jnp.ndim(index) != 0 or not jnp.issubdtype(jnp.result_type(index), jnp.integer)):
    raise TypeError(f"quantized_matmul: index must be an integer scalar, got {jnp.result_type(index)} of shape "
                    f"{jnp.shape(index)}")  # 1.7 read layer 1; a [2] array failed in a reshape
  if out_dtype is not None and not jnp.issubdtype(out_dtype, jnp.floating):
    raise ValueError(f"quantized_matmul: out_dtype must be a floating dtype, got {jnp.dtype(out_dtype)}")
  if lora is not None:
    xa, b, scale = lora
    if isinstance(scale, (int, float)) and not math.isfinite(scale):  # a NaN scale made every output NaN
      raise ValueError(f"quantized_matmul: the lora scale must be finite, got {scale}")
    b_ok = b.shape[-2:] == (xa.shape[-1], n) and (b.ndim == 2 or (b.ndim == 3 and index is not None))
    if xa.shape[:-1] != x.shape[:-1] or not b_ok:
      raise ValueError(f"quantized_matmul: lora needs xa [..., R] with x's leading dims {x.shape[:-1]} and "
                       f"b [R, {n}] (or a stack [L, R, {n}] with index); got xa {xa.shape}, b {b.shape}")
    if index is None and w.packed.ndim != 2:  # the product would be [..., L, N]: the delta does not line up
      raise ValueError(f"quantized_matmul: lora needs a [K, N] weight, or a stack [L, K, N] with index; got "
                       f"packed shape {w.packed.shape} and no index")
  if addend is not None:
    if lora is not None:
      raise ValueError("quantized_matmul: addend and lora cannot be combined; fold the delta into the addend")
    if addend.shape != (*x.shape[:-1], n) or not jnp.issubdtype(addend.dtype, jnp.floating):
      raise ValueError(f"quantized_matmul: addend must be a float array {[*x.shape[:-1], n]} (x's leading dims, "
                       f"N); got {addend.dtype}{list(addend.shape)}")
  if backend == "auto":
    backend = "pallas" if (_on_gpu() and _kernel_applies(x, w, index)) else "reference"
  if backend == "reference":
    w = jax.lax.stop_gradient(w)  # frozen: a zero cotangent, as the kernel path's custom_vjp gives it
    y = reference_matmul(x, w if index is None else layer_of(w, index), out_dtype=jnp.float32)
    if lora is not None:
      y = y + _lora_delta(*lora, index=index)
    if addend is not None:
      y = y + addend.astype(jnp.float32)
    return y.astype(out_dtype or x.dtype)
  if not _kernel_applies(x, w, index):
    raise ValueError(f"backend {backend!r} needs bf16 x and a [K, N] weight without leading dims "
                     f"(or a stack [L, K, N] with index); got x {x.dtype}{list(x.shape)}, packed {list(w.packed.shape)}")
  out_dtype = jnp.dtype(out_dtype or x.dtype)
  lead = x.shape[:-1]
  if x.size == 0:  # M = 0: nothing to launch (the kernels' tile choice divides by the row tiles)
    return jnp.zeros((*lead, n), out_dtype)
  if index is not None:
    index = jnp.asarray(index, jnp.int32)
  interpret = backend == "interpret"
  if addend is not None:
    y = _kernel_matmul_add(x.reshape(-1, k), w, index, addend.reshape(-1, n), out_dtype, interpret)
  elif lora is None:
    y = _kernel_matmul(x.reshape(-1, k), w, index, out_dtype, interpret)
  else:
    y = _kernel_matmul_lora(x.reshape(-1, k), w, index, xa.reshape(-1, xa.shape[-1]), b, float(scale), out_dtype,
                            interpret)
  return y.reshape(*lead, n)


def decode_order_applies() -> bool:
  """Whether :func:`qerl_jax.nvfp4.to_decode_order`'s code order pays here: on a GPU where the Gluon
  decode GEMV runs (:func:`gluon_enabled`). There its decode-order build made a 7B decode step 4.6%
  shorter at batch 8 and 1% at batch 64 (docs/benchmarks.md, session 16), and the large-M path
  (prefill, the update step) reads that order in place as fast as the standard one (session 17).
  ``model.code_order="auto"`` uses it (:func:`resolve_code_order`).

  Raises:
    ValueError: ``GLUON`` not "auto"/"1"/"0".
  """
  return _on_gpu() and gluon_enabled()


CODE_ORDERS = (*nvfp4.CODE_ORDERS, "auto")  # the stored orders, and "auto"


def resolve_code_order(order: str) -> str:
  """``order`` (``"standard"``, ``"decode"`` or ``"auto"``) as the NVFP4 code order to store:
  ``"auto"`` is ``"decode"`` where :func:`decode_order_applies`, else ``"standard"``.

  Raises:
    ValueError: an order not in :data:`CODE_ORDERS` (or a bad ``GLUON``).
  """
  if order not in CODE_ORDERS:
    raise ValueError(f"code order {order!r} is not one of {CODE_ORDERS}")
  if order == "auto":
    return "decode" if decode_order_applies() else "standard"
  return order


def accumulate_applies(x: jax.Array, w, index=None) -> bool:
  """Whether :func:`quantized_matmul_into` runs its accumulating kernel for ``x [..., K]`` (rows =
  the product of the leading dims) and ``w`` (with ``index``): on a GPU, bf16 ``x``, NVFP4 ``w``,
  the Gluon kernel enabled (``GLUON``) and :func:`pallas_kernels.w4_gluon.into_applies`.

  Raises:
    ValueError: ``GLUON`` not "auto"/"1"/"0" (:func:`gluon_enabled`).
  """
  if not (_on_gpu() and isinstance(w, nvfp4.NVFP4Tensor) and _kernel_applies(x, w, index)):
    return False
  x2d = jax.ShapeDtypeStruct((int(np.prod(x.shape[:-1])), x.shape[-1]), x.dtype)
  return gluon_enabled() and w4_gluon.into_applies(x2d, w, index)


def _lora_rows_shape(x, xa) -> tuple:
  """``xa``'s shape with its row dims flattened, as the Gluon kernel takes it: ``[M, R]``, or ``[S, M, R]`` for
  :func:`pallas_kernels.w4_gluon.lora_xa`'s float32 partial products ``[S, ..., R]`` (one more dim than ``x``)."""
  lead = xa.shape[:1] if xa.dtype == jnp.float32 and xa.ndim == x.ndim + 1 else ()
  return (*lead, int(np.prod(xa.shape[len(lead):-1])), xa.shape[-1])


def accumulate_lora_applies(x: jax.Array, w, index, lora) -> bool:
  """Whether :func:`quantized_matmul_into` also adds ``lora = (xa [..., R], b, scale)`` in its kernel:
  :func:`accumulate_applies` and :func:`pallas_kernels.w4_gluon.lora_into_applies` (``b`` bf16 ``[R, N]``, or
  ``[L, R, N]`` read at ``index``; ``scale`` a Python number).

  Raises:
    ValueError: as :func:`accumulate_applies`.
  """
  if not accumulate_applies(x, w, index):
    return False
  xa, b, scale = lora
  x2d = jax.ShapeDtypeStruct((int(np.prod(x.shape[:-1])), x.shape[-1]), x.dtype)
  return w4_gluon.lora_into_applies(x2d, w, index, (jax.ShapeDtypeStruct(_lora_rows_shape(x, xa), xa.dtype), b, scale))


def quantized_matmul_into(x: jax.Array, w, acc: jax.Array | None, offset: int, *, index=None,
                          size: int | None = None, lora=None) -> tuple[jax.Array, jax.Array]:
  """``x @ W`` in float32, written into ``acc[offset : offset + M * N]`` of a zeroed float32 buffer
  (forward only; :func:`accumulate_applies` must hold): several decode-step projections share one
  memset instead of one each (:func:`pallas_kernels.w4_gluon.forward_into`).

  Args:
    x: bf16 ``[..., K]``; ``M`` = the product of the leading dims (at most 128).
    w: NVFP4Tensor ``[K, N]``, or with ``index`` a stack ``[L, K, N]``.
    acc: float32 ``[S]``, zero in the region (the rest is left as it is); or None: a new buffer of
      ``size`` elements, zeroed by the launcher before the kernel runs.
    offset: static int, elements.
    index: optional int32 scalar layer of a stacked ``w`` (clamped to ``[0, L)``).
    size: with ``acc`` None, the new buffer's length (static int).
    lora: optional ``(xa [..., R] bf16, b, scale)``: also add ``scale * xa @ b`` (a LoRA adapter's
      up-projection) in the kernel; :func:`accumulate_lora_applies` must hold. ``xa`` may also be
      :func:`pallas_kernels.w4_gluon.lora_xa`'s float32 partial products ``[S, ..., R]``.

  Returns:
    ``(y float32 [..., N], acc)``; pass the returned ``acc`` on to the next call.

  Raises:
    ValueError: :func:`accumulate_applies` (or with ``lora``, :func:`accumulate_lora_applies`) is False,
      no ``size`` for a new buffer, or the region does not fit.
  """
  if not accumulate_applies(x, w, index):
    raise ValueError(f"quantized_matmul_into: no accumulating kernel for x {x.dtype}{list(x.shape)} and "
                     f"{type(w).__name__} {list(w.shape)} here (GPU, bf16 x, NVFP4, M <= {w4_gluon.MAX_M}, "
                     f"the Gluon FFI launcher; see accumulate_applies)")
  k, n = w.shape
  if lora is not None:
    xa, b, scale = lora
    lora = (xa.reshape(_lora_rows_shape(x, xa)), b, scale)
  y, acc = w4_gluon.forward_into(x.reshape(-1, k), w, acc, offset,
                                 index=None if index is None else jnp.asarray(index, jnp.int32), size=size,
                                 lora=lora)
  return y.reshape(*x.shape[:-1], n), acc
