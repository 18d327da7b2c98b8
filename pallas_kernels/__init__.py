"""4-bit x bf16 matmul kernels (W4A16) and their one public entry point.

``quantized_matmul(x, w)`` computes ``x @ W`` for ``x`` ``[..., K]`` and ``W`` an
:class:`~qerl_jax.nvfp4.NVFP4Tensor` or :class:`~qerl_jax.nf4.NF4Tensor` of
logical shape ``[K, N]``. It picks a kernel by backend and shape; on CPU (and
for formats without a kernel) it runs the pure-XLA reference.
"""

from pallas_kernels.matmul import quantized_matmul, reference_matmul

__all__ = ["quantized_matmul", "reference_matmul"]
