"""4-bit x bf16 matmul kernels (W4A16) and their one public entry point.

``quantized_matmul(x, w)`` computes ``x @ W`` for ``x`` ``[..., K]`` and ``W`` an
:class:`~qerl_jax.nvfp4.NVFP4Tensor` or :class:`~qerl_jax.nf4.NF4Tensor` of
logical shape ``[K, N]``, differentiable in ``x``. On a GPU with bf16 ``x`` it
runs the Pallas kernels of :mod:`pallas_kernels.w4_triton` (a fused
dequantize-in-registers kernel for small M, a one-pass dequantize + cuBLAS
for large M); on CPU, and for inputs without a kernel, the pure-XLA reference.
:mod:`pallas_kernels.w4_gluon` holds the Gluon decode GEMV that takes M <= 128 on NVFP4 weights
(launched by the XLA FFI handler in ``gluon_launch.cc``; ``matmul.GLUON``).
``decode_order_applies()`` says whether the Gluon kernel reads NVFP4 codes stored in its own order
(``qerl_jax.nvfp4.to_decode_order``) on this machine.
``dequantize(w)`` gives a 4-bit weight (or a stack) as a dense array, the large-M path's values.
``quantized_matmul_into(x, w, acc, offset)`` runs it into a region of a zeroed float32 buffer, so that
a decode step's projections share one memset (forward only).
``quantized_matmul(x, w_stack, index=i)`` multiplies by layer ``i`` of a stacked
``[L, K, N]`` weight, read in place by the kernels (the decoder's layer scan uses it).
:mod:`pallas_kernels.decode_attention` holds the decode-step attention kernel that reads
one layer of the stacked KV cache in place. See docs/kernels.md.
"""

from pallas_kernels.matmul import (FUSED_MAX_M, accumulate_applies, decode_order_applies, dequantize, quantized_matmul,
                                   quantized_matmul_into, reference_matmul, resolve_code_order)

__all__ = ["FUSED_MAX_M", "accumulate_applies", "decode_order_applies", "dequantize", "quantized_matmul",
           "quantized_matmul_into", "reference_matmul", "resolve_code_order"]
