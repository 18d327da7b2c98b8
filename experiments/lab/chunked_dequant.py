"""Lab (GPU): the large-M path (dequantize to bf16, then cuBLAS) with the weight dequantized in column chunks
(forward) or row chunks (dx) small enough to stay in the L2 between the dequantize kernel that writes a chunk
and the GEMM that reads it, against dequantizing the whole weight through HBM (today) and bf16.

Forward: y = concat_j x @ deq(W[:, cols_j]); the chunks' codes are sliced once outside the timed call (what a
dequantize kernel with a column offset would read in place). dx: dx = concat_j dy @ deq(W[rows_j, :])^T, the row
chunks read in place as a stack [C, K / C, N]. Device time (sum of the call's kernels) and wall time (median of
10 synchronised calls), µs; each variant checked against today's path first.

  PYTHONPATH=$PWD python3 experiments/lab/chunked_dequant.py          # CH_MS=2048,8192 CH_MB=8,16
"""
import os, statistics, sys, time
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__))))
from labcommon import activations  # noqa: E402
import devtime  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from pallas_kernels import matmul, w4_triton  # noqa: E402
from qerl_jax import nvfp4  # noqa: E402

MS = [int(v) for v in os.environ.get("CH_MS", "2048,8192").split(",")]
CHUNK_MB = [int(v) for v in os.environ.get("CH_MB", "8,16").split(",")]
SHAPES = {"7b_gate": (3584, 18944), "7b_down": (18944, 3584), "32b_gate": (5120, 27648), "32b_down": (27648, 5120)}


def times(fn, *args):
  f = jax.jit(fn)
  jax.block_until_ready(f(*args))
  dev = devtime.device_time(f, *args) * 1e6
  wall = []
  for _ in range(10):
    t = time.perf_counter(); jax.block_until_ready(f(*args)); wall.append((time.perf_counter() - t) * 1e6)
  return dev, statistics.median(wall)


def col_chunks(w, c):
  k, n = w.shape
  step = n // c
  return [nvfp4.NVFP4Tensor(w.packed[:, j * step:(j + 1) * step], w.block_scale[:, j * step:(j + 1) * step],
                            w.global_scale, (k, step), code_order=w.code_order) for j in range(c)]


def row_stack(w, c):
  k, n = w.shape
  return nvfp4.NVFP4Tensor(w.packed.reshape(c, k // 2 // c, n), w.block_scale.reshape(c, k // 16 // c, n),
                           jnp.broadcast_to(w.global_scale, (c,)), (k // c, n), code_order=w.code_order)


def count(extent, other, mb):  # chunks of at most mb MiB of bf16, dividing extent into multiples of 256
  for c in range(1, extent // 256 + 1):
    if extent % c == 0 and (extent // c) % 256 == 0 and (extent // c) * other * 2 <= mb << 20:
      return c
  return None


for name, (k, n) in SHAPES.items():
  w = nvfp4.to_decode_order(nvfp4.quantize(jax.random.normal(jax.random.key(0), (k, n), jnp.float32) * 0.02))
  dense = jax.random.normal(jax.random.key(1), (k, n), jnp.bfloat16)
  for m in MS:
    x = activations(m, k)
    dy = activations(m + 1, n)
    ref = jax.jit(lambda x, w: matmul.kernel_forward(x, w))(x, w)
    refdx = jax.jit(lambda d, w: matmul.kernel_dx(d, w))(dy, w)
    row = {"bf16": times(lambda x, d: jnp.dot(x, d), x, dense)[0],
           "today": times(lambda x, w: matmul.kernel_forward(x, w), x, w),
           "dx bf16": times(lambda d, dd: jax.lax.dot_general(d, dd, (((1,), (1,)), ((), ()))), dy, dense)[0],
           "dx today": times(lambda d, w: matmul.kernel_dx(d, w), dy, w)}
    for mb in CHUNK_MB:
      c = count(n, k, mb)
      if c:
        chunks = col_chunks(w, c)
        f = lambda x, ch: jnp.concatenate(
            [jnp.dot(x, w4_triton.dequantize(wc, x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)
             for wc in ch], axis=1)
        y = jax.jit(f)(x, chunks)
        assert float(jnp.max(jnp.abs(y.astype(jnp.float32) - ref.astype(jnp.float32)))) <= 1e-2 * float(
            jnp.max(jnp.abs(ref.astype(jnp.float32)))) + 1e-6
        row[f"fwd {c} chunks"] = times(f, x, chunks)
      c = count(k, n, mb)
      if c:
        ws = row_stack(w, c)
        g = lambda d, ws: jnp.concatenate(
            [jax.lax.dot_general(d, w4_triton.dequantize(ws, d.dtype, index=j), (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32).astype(d.dtype) for j in range(c)], axis=1)
        y = jax.jit(g)(dy, ws)
        assert float(jnp.max(jnp.abs(y.astype(jnp.float32) - refdx.astype(jnp.float32)))) <= 1e-2 * float(
            jnp.max(jnp.abs(refdx.astype(jnp.float32)))) + 1e-6
        row[f"dx {c} chunks"] = times(g, dy, ws)
    cells = []
    for key, v in row.items():
      if isinstance(v, tuple):
        base = row["bf16"] if not key.startswith("dx") else row["dx bf16"]
        cells.append(f"{key} {v[0]:7.1f} dev / {v[1]:7.1f} wall ({base / v[0]:.2f}x)")
      else:
        cells.append(f"{key} {v:7.1f}")
    print(f"{name:9s} M={m:5d} | " + " | ".join(cells), flush=True)
