"""XLA flags the launchers set on a GPU before the first computation.

Measured on an H200 with jax 0.11.2 (docs/benchmarks_rollout.md, session 3): the decoder keeps
each linear's weights stacked over layers ``[L, K, N]`` and slices layer ``l`` inside the layer
loop. With XLA's defaults a bf16 base pays for that slice with a device copy of the whole matrix
before every matmul (``memcpy128`` in a profile: 4 x 56 µs per layer and decode step at batch 256),
and small-M matmuls go to XLA's Triton GEMM emitter. The first two flags below let cuBLAS read the slice
in place and handle every dense matmul: bf16 rollouts at batch 8 went from 709 to 1408 tokens/s
(89% of their roofline); NVFP4 rollouts, whose kernels already read the stack in place, did not
change (1669 vs 1661 tokens/s). Re-checked in session 10 with the decode layers unrolled: bf16 at
batch 8 ran at 749 tokens/s with XLA's Triton GEMM and 1727 without. The third flag adds the decode
``while_loop`` (and conditionals) to XLA's CUDA-graph command buffers, so a decode step runs as one graph
instead of returning to the host between steps (session 22, 512 new tokens, 7B shape): a batch-8 step took
2.18 instead of 2.23 ms with NVFP4 and 4.20 instead of 4.24 with bf16; at batch 64 5.25 instead of 5.28 and
5.05 instead of 5.08. The flags only concern GPU compilation; CPU runs ignore them.

XLA reads ``XLA_FLAGS`` once, when the first backend starts, so :func:`apply_recommended` must run
before any computation (the launchers call it first thing in ``main``, with the value of the
``--[no]recommended_xla_flags`` flag that :func:`define_launcher_flag` defines).
"""
from __future__ import annotations

import os
import warnings

RECOMMENDED_GPU_FLAGS: tuple[str, ...] = (
    "--xla_gpu_enable_triton_gemm=false",
    "--xla_gpu_enable_dynamic_slice_fusion=true",
    "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL",
)


def merge(current: str, flags: tuple[str, ...] = RECOMMENDED_GPU_FLAGS) -> str:
  """``current`` (an ``XLA_FLAGS`` string) plus each of ``flags`` whose name it does not set.

  A flag the user already set, to any value, is left as the user set it.

  Args:
    current: the present ``XLA_FLAGS`` value ("" when unset), space-separated ``--name=value``.
    flags: flags to add, each ``--name=value``.

  Returns:
    The merged string.

  Raises:
    ValueError: an entry of ``flags`` is not of the form ``--name=value``.
  """
  names = {f.split("=", 1)[0] for f in current.split() if f.startswith("--")}
  out = current.split()
  for f in flags:
    if not f.startswith("--") or "=" not in f:
      raise ValueError(f"XLA flag {f!r} must look like --name=value")
    if f.split("=", 1)[0] not in names:
      out.append(f)
  return " ".join(out)


def apply_recommended(enabled: bool = True) -> str:
  """Adds :data:`RECOMMENDED_GPU_FLAGS` to ``os.environ["XLA_FLAGS"]`` (keeping the user's own).

  Args:
    enabled: False leaves the environment as it is (a launcher's ``--norecommended_xla_flags``).

  Returns:
    The ``XLA_FLAGS`` value now in effect for backends started later.

  Warns:
    RuntimeWarning: a JAX backend has already started, so the new flags will not take effect in
    this process.
  """
  current = os.environ.get("XLA_FLAGS", "")
  if not enabled:
    return current
  merged = merge(current)
  if merged != current:
    try:
      from jax._src import xla_bridge
      started = xla_bridge.backends_are_initialized()
    except (ImportError, AttributeError):  # private API; without it, assume a fresh process
      started = False
    if started:
      warnings.warn("qerl_jax.xla_flags.apply_recommended ran after a JAX backend started; the flags "
                    f"{RECOMMENDED_GPU_FLAGS} take effect only in a new process", RuntimeWarning, stacklevel=2)
    os.environ["XLA_FLAGS"] = merged
  return merged


def define_launcher_flag():
  """Defines the launchers' absl flag ``--[no]recommended_xla_flags`` (default True) and returns
  its holder; pass ``holder.value`` to :func:`apply_recommended` at the start of ``main``."""
  from absl import flags
  return flags.DEFINE_bool("recommended_xla_flags", True, "Add qerl_jax.xla_flags.RECOMMENDED_GPU_FLAGS to "
                           "XLA_FLAGS (cuBLAS reads stacked bf16 weights in place; the decode loop runs in a CUDA graph; "
                           "GPU only, flags you set win).")
