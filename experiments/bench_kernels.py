"""Benchmark of the fused 4-bit x bf16 matmul kernels against bf16 and XLA dequantize-then-dot.

Prints one table: for Qwen2.5-7B and -32B layer shapes and M in {1, 8, 32, 64,
128, 256, 2048, 8192}, the kernel's time (median over warm runs), its
effective HBM bandwidth (bytes it must move: 4-bit weight + scales + x + y,
over its time), the same-run times of a bf16 ``jnp.dot`` and of XLA
dequantize-then-dot, and the kernel's speed-up over each (bf16: the faster of a float32-accumulated
and a plain bf16 ``jnp.dot``). ``--kinds dx`` adds
the backward for x (``dy @ W^T``) at the training sizes. Every row is first
checked against the XLA reference (relative error, NaN, a NaN-poisoned output
buffer that the kernel must fully overwrite).

Timing: each measured program runs the op on R distinct copies of the weight
(so that no weight sits in the 60 MB L2 from the previous call: R copies hold
at least --rotate_mb of 4-bit weight), each call with its own copy of x (so that
XLA cannot rewrite the R calls together, as it did to bf16's dots with one
shared x: see --x_copies), and is dispatched --inner times back to back. ``--timer=device`` (default): the per-call time is the summed device time
of the kernels in one profiled run of that (``jax.profiler`` trace, see
experiments/devtime.py) divided by R * inner, so launch gaps are not counted;
on a CPU, or where the trace has no device events, it falls back to ``--timer=wall``:
the median over --reps synchronised (``block_until_ready``) samples of wall
time, divided by R * inner.

Usage (on the GPU):
  PYTHONUNBUFFERED=1 python experiments/bench_kernels.py --json /tmp/bench.json
  python experiments/bench_kernels.py --models 7b --ms 1,2048 --kinds fwd   # a quick subset
  python experiments/bench_kernels.py --sweep                                # tile-config sweep
  python experiments/bench_kernels.py --kinds dx --gluon_dx                  # + the opt-in no-bf16-W dx kernel
"""

from __future__ import annotations

import json
import statistics
import sys
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

import devtime  # experiments/devtime.py (this script's folder is on sys.path)
from pallas_kernels import matmul, w4_gluon_dx, w4_triton
from qerl_jax import nvfp4, xla_flags

FLAGS = flags.FLAGS
_XLA = xla_flags.define_launcher_flag()  # the bf16 baseline as the launchers run it (cuBLAS)
flags.DEFINE_string("models", "7b,32b", "comma list of 7b, 32b")
flags.DEFINE_string("ms", "1,8,32,64,128,256,2048,8192", "forward M values")
flags.DEFINE_string("dx_ms", "2048,8192", "M values for the dx backward")
flags.DEFINE_string("kinds", "fwd,dx", "fwd and/or dx")
flags.DEFINE_string("layers", "qkv,o,gate,down", "layers to time")
flags.DEFINE_integer("reps", 10, "timed samples (median taken; --timer=wall)")
flags.DEFINE_enum("timer", "device", ["device", "wall"],
                  "device: summed kernel time from a jax.profiler trace (no launch gaps; wall where no device events); "
                  "wall: synchronised wall clock")
flags.DEFINE_integer("inner", 3, "programs dispatched back to back per sample")
flags.DEFINE_integer("rotate_mb", 256, "MiB of 4-bit weight copies rotated through per program")
flags.DEFINE_bool("x_copies", True, "give each weight copy its own copy of x (false: one x for all, as before "
                  "session 55, which lets XLA compute work on x alone once for all the copies)")
flags.DEFINE_bool("check", True, "check each row against the XLA reference with a poisoned output")
flags.DEFINE_bool("ragged", True, "also check ragged shapes (M=1,3,17,100, N/K off the tiles)")
flags.DEFINE_bool("sweep", False, "sweep tile configs first (winners used for the table)")
flags.DEFINE_integer("sweep_budget_s", 240, "stop starting new sweep buckets after this many seconds")
flags.DEFINE_bool("table", True, "time the table")
flags.DEFINE_string("json", "", "write rows here as JSON")
flags.DEFINE_enum("code_order", "auto", ["standard", "decode", "auto"],
                  "NVFP4 code order of the weights (nvfp4.to_decode_order); auto: decode order where "
                  "pallas_kernels.decode_order_applies()")
flags.DEFINE_enum("peer", "", ["", "ejkernel"], "add a peer column: ejkernel's NVFP4 quantized_matmul (forward "
                  "rows; needs ejkernel installed, e.g. pip install --no-deps ejkernel==0.0.80.3 and its "
                  "pure-Python dependencies; see experiments/lab/ejkernel_peer.py)")
flags.DEFINE_string("peer_platform", "triton", "ejkernel's platform for the peer column (xla on a CPU)")
flags.DEFINE_bool("gluon_dx", False, "add columns to the dx rows: the opt-in large-M Gluon dx kernel, which writes no "
                  "bf16 W (pallas_kernels.w4_gluon_dx; QERL_GLUON_DX=1), where it applies (an sm_90 GPU)")
flags.DEFINE_bool("smoke", False, "CPU smoke test of this script: tiny shapes, kernels in interpret mode")

# (layer, K, N): q/k/v fused (q + 2 kv heads x 128), o, gate (= up), down.
SHAPES = {
    "7b": {"qkv": (3584, 3584 + 2 * 512), "o": (3584, 3584), "gate": (3584, 18944), "down": (18944, 3584)},
    "32b": {"qkv": (5120, 5120 + 2 * 1024), "o": (5120, 5120), "gate": (5120, 27648), "down": (27648, 5120)},
}


def _rel(a, b):
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _copies(tree, r):
  return [jax.tree.map(lambda a: a.copy() if hasattr(a, "copy") else a, tree) for _ in range(r)]


def _time(fn, x, ws, reps, inner):
  # each weight copy with its own copy of x, as a model's layers each have their own input. With one x shared by
  # the R calls (--x_copies=false, the script before session 55) XLA ran the bf16 dots of the 7B q/k/v and o and
  # the 32B o 2.4-2.8x slower than alone (docs/benchmarks.md, "Session 55"), and it may compute work on x alone
  # (the Gluon GEMM's K permute of x) once for all R
  if FLAGS.x_copies:
    x = [x.copy() for _ in ws]
    prog = jax.jit(lambda xs, ws: tuple(fn(x, w) for x, w in zip(xs, ws)))
  else:
    prog = jax.jit(lambda x, ws: tuple(fn(x, w) for w in ws))
  jax.block_until_ready(prog(x, ws))
  jax.block_until_ready(prog(x, ws))
  if FLAGS.timer == "device" and jax.default_backend() in ("gpu", "cuda"):
    t = devtime.device_time(lambda: [prog(x, ws) for _ in range(inner)])
    if t is not None:
      return t / (inner * len(ws))
  samples = []
  for _ in range(reps):
    t0 = time.perf_counter()
    outs = [prog(x, ws) for _ in range(inner)]
    jax.block_until_ready(outs)
    samples.append((time.perf_counter() - t0) / (inner * len(ws)))
    del outs
  return statistics.median(samples)


def _weights(k, n, seed):
  key = jax.random.PRNGKey(seed)
  w = jax.random.normal(key, (k, n), jnp.float32) * 0.02
  wq = nvfp4.quantize(w)
  order = FLAGS.code_order
  if matmul.resolve_code_order(order) == "decode" and (order == "decode" or n % 2 == 0):  # "auto" skips odd N
    wq = nvfp4.to_decode_order(wq)
  return w.astype(jnp.bfloat16), wq


def _row_check(kind, x, wq, cfg=None):
  """Relative error of the dispatched kernel path vs the reference; NaN anywhere (the fused
  kernels write into a NaN-poisoned buffer; the dequantize path is checked bit-exact)."""
  m = x.shape[0]
  gluon = cfg is None and _path_name(kind, x, wq) in ("gluon", "gluon_mm")  # checked through the dispatch
  fused = m <= matmul.FUSED_MAX_M[kind] or gluon
  nan = False
  if not fused:
    nan = bool(jnp.any(w4_triton.dequantize(wq, jnp.bfloat16) != nvfp4.dequantize(wq, jnp.bfloat16)))
  if kind == "fwd":
    if gluon:
      y = matmul.kernel_forward(x, wq)  # the dispatched Gluon kernel, which the timing runs too
    else:
      y = (w4_triton.forward(x, wq, config=cfg, poison_output=True) if fused else matmul.kernel_forward(x, wq))
    ref = matmul.reference_matmul(x, wq)
  else:
    y = (w4_triton.dx(x, wq, config=cfg, poison_output=True) if fused else matmul.kernel_dx(x, wq))
    ref = jnp.dot(x, nvfp4.dequantize(wq, jnp.bfloat16).T, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
  nan = nan or bool(jnp.isnan(y).any())
  return _rel(y, ref), nan


def _ejkernel():
  """ejkernel's ``(quantize, quantized_matmul)``. ejkernel 0.0.80.3 still calls
  ``jax.core.concrete_or_error``, which jax 0.11 moved to ``jax.extend.core``: aliased here.

  Raises:
    ImportError: ejkernel is not installed.
  """
  import jax.extend.core
  if not hasattr(jax.core, "concrete_or_error"):
    jax.core.concrete_or_error = jax.extend.core.concrete_or_error
  try:
    from ejkernel.modules import quantized_matmul
    from ejkernel.quantization import quantize
  except ImportError as e:
    raise ImportError("--peer=ejkernel needs ejkernel: pip install --no-deps ejkernel==0.0.80.3 beartype einops "
                      "jaxtyping wadler_lindig pydantic (experiments/lab/ejkernel_peer.py)") from e
  return quantize, quantized_matmul


def _peer_row(x, w_bf16, r):
  """``(µs, relative error)`` of ejkernel's NVFP4 ``x @ W`` on its own quantization of the same float
  weight (uint32 codes ``[N, K/8]``, read with ``transpose=True``), over ``r`` rotating copies; the error
  is against ejkernel's own dequantize-then-dot (``fuse=False``), as its format is not ours."""
  quantize, qmm = _ejkernel()
  wq, s = quantize(w_bf16.astype(jnp.float32), mode="nvfp4", axis="row")
  call = lambda x, w, fuse=True: qmm(x, w[0], w[1], mode="nvfp4", transpose=True, fuse=fuse,
                                     platform=FLAGS.peer_platform if fuse else "xla")
  err = _rel(call(x, (wq, s)).astype(jnp.float32), call(x, (wq, s), fuse=False).astype(jnp.float32))
  copies = [(wq ^ jnp.uint32(i % 2), s) for i in range(r)]
  return _time(call, x, copies, FLAGS.reps, FLAGS.inner) * 1e6, err


def _bench_row(model, layer, k, n, m, kind, w_bf16, wq, cfg=None, check=True):
  key = jax.random.PRNGKey(m * 7 + k)
  rows_in = (m, k) if kind == "fwd" else (m, n)
  x = jax.random.normal(key, rows_in, jnp.float32).astype(jnp.bfloat16)
  err, nan = _row_check(kind, x, wq, cfg) if check else (float("nan"), False)
  r = int(max(1, min(32, -(-FLAGS.rotate_mb * 2**20 // wq.nbytes))))
  if m >= 2048:
    r = 1
  wqs = _copies(wq, r)
  wbs = _copies(w_bf16, r)
  if kind == "fwd":
    f_kernel = lambda x, w: matmul.kernel_forward(x, w)
    f_bf16s = (lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16),
               lambda x, w: jnp.dot(x, w))
    f_xla = lambda x, w: matmul.reference_matmul(x, w)
  else:
    f_kernel = lambda x, w: matmul.kernel_dx(x, w)
    f_bf16s = (lambda x, w: jnp.dot(x, w.T, preferred_element_type=jnp.float32).astype(jnp.bfloat16),
               lambda x, w: jnp.dot(x, w.T))
    f_xla = lambda x, w: jnp.dot(x, nvfp4.dequantize(w, jnp.bfloat16).T,
                                 preferred_element_type=jnp.float32).astype(jnp.bfloat16)
  t_k = _time(f_kernel, x, wqs, FLAGS.reps, FLAGS.inner)
  # bf16: the faster of a float32-accumulated dot (as the model computes) and a plain bf16 dot. At M = 1
  # XLA lowers the first to a slow reduction (7B qkv on an H200 under the launchers' flags: 43.6 against
  # 27.1 us for the plain dot, session 10), which would flatter the kernel.
  t_b = min(_time(f, x, wbs, FLAGS.reps, FLAGS.inner) for f in f_bf16s)
  t_x = _time(f_xla, x, wqs, FLAGS.reps, FLAGS.inner)
  act = m * (k + n) * 2
  gbs = (wq.nbytes + act) / t_k / 1e9
  gbs_b = (k * n * 2 + act) / t_b / 1e9
  row = dict(model=model, layer=layer, K=k, N=n, M=m, kind=kind, us_kernel=t_k * 1e6, us_bf16=t_b * 1e6,
             us_xla=t_x * 1e6, gbs_kernel=gbs, gbs_bf16=gbs_b, vs_bf16=t_b / t_k, vs_xla=t_x / t_k,
             rel_err=err, nan=nan, R=r,
             path=_path_name(kind, x, wq))
  if FLAGS.peer and kind == "fwd":
    row["us_peer"], row["peer_err"] = _peer_row(x, w_bf16, r)
    row["vs_peer"] = row["us_peer"] / row["us_kernel"]
  if FLAGS.gluon_dx and kind == "dx" and w4_gluon_dx.applies(m, wq, x.dtype):
    row["gluon_dx_err"] = _rel(jax.jit(w4_gluon_dx.dx)(x, wq), f_xla(x, wq))
    row["us_gluon_dx"] = _time(lambda x, w: w4_gluon_dx.dx(x, w), x, wqs, FLAGS.reps, FLAGS.inner) * 1e6
    row["gluon_dx_vs_bf16"] = row["us_bf16"] / row["us_gluon_dx"]
  return row


def _path_name(kind, x, wq) -> str:
  """Which kernel path ``matmul.kernel_forward`` / ``kernel_dx`` takes for this row (asked of the dispatch itself)."""
  return matmul.forward_path(x, wq) if kind == "fwd" else matmul.dx_path(x, wq)


def _print_row(d):
  peer = ""
  if FLAGS.peer:
    peer = (f" {d['us_peer']:9.1f} | {d['vs_peer']:6.2f}x | {d['peer_err']:.1e} |" if "us_peer" in d else
            " - | - | - |")
  if FLAGS.gluon_dx:
    peer += (f" {d['us_gluon_dx']:9.1f} | {d['gluon_dx_vs_bf16']:5.2f}x | {d['gluon_dx_err']:.1e} |"
             if "us_gluon_dx" in d else " - | - | - |")
  print(f"| {d['model']:>3} | {d['layer']:>4} | {d['K']:>5}x{d['N']:<5} | {d['kind']:>3} | {d['M']:>5} | "
        f"{d['us_kernel']:9.1f} | {d['gbs_kernel']:7.0f} | {d['us_bf16']:9.1f} | {d['gbs_bf16']:7.0f} | "
        f"{d['us_xla']:9.1f} | {d['vs_bf16']:5.2f}x | {d['vs_xla']:5.2f}x | {d['rel_err']:.1e}{' NaN!' if d['nan'] else ''} | {d['path']} |"
        + peer, flush=True)


HEADER = ("| model | layer | K x N | kind | M | kernel us | kernel GB/s | bf16 us | bf16 GB/s | XLA deq+dot us | "
          "vs bf16 | vs XLA | rel err | path |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
PEER_HEADER = (" {peer} us | vs {peer} | {peer} err (vs its own reference) |", "---|---|---|")


GLUON_DX_HEADER = (" no-bf16-W dx us | its vs bf16 | its rel err |", "---|---|---|")


def _header() -> str:
  """The table's header, with the peer's columns when ``--peer`` is set and the Gluon dx kernel's with
  ``--gluon_dx``."""
  top, rule = HEADER.split("\n")
  if FLAGS.peer:
    top, rule = top + PEER_HEADER[0].format(peer=FLAGS.peer), rule + PEER_HEADER[1]
  if FLAGS.gluon_dx:
    top, rule = top + GLUON_DX_HEADER[0], rule + GLUON_DX_HEADER[1]
  return top + "\n" + rule


_BACKEND = "pallas"


def _interpreted(fn):
  return lambda *a, **kw: fn(*a, **{**kw, "interpret": True})


def _ragged_checks():
  print("ragged checks (kernel vs XLA reference, poisoned output):")
  ok = True
  for (m, k, n) in [(1, 1040, 200), (3, 1040, 200), (17, 3584, 1000), (100, 1040, 4100), (2050, 1040, 200)]:
    _, wq = _weights(k, n, m)
    for kind in ("fwd", "dx"):
      x = jax.random.normal(jax.random.PRNGKey(m), (m, k if kind == "fwd" else n)).astype(jnp.bfloat16)
      err, nan = _row_check(kind, x, wq)
      good = err < 1e-2 and not nan
      ok &= good
      print(f"  M={m} K={k} N={n} {kind}: rel err {err:.2e} nan={nan} {'ok' if good else 'FAIL'}", flush=True)
  # gradient through the custom_vjp vs through the reference
  _, wq = _weights(1040, 200, 5)
  x = jax.random.normal(jax.random.PRNGKey(1), (17, 1040)).astype(jnp.bfloat16)
  ct = jax.random.normal(jax.random.PRNGKey(2), (17, 200))
  loss = lambda x, b: jnp.sum(matmul.quantized_matmul(x, wq, backend=b).astype(jnp.float32) * ct)
  g_k = jax.grad(loss)(x, _BACKEND)
  g_r = jax.grad(loss)(x, "reference")
  err = _rel(g_k, g_r)
  print(f"  grad x through custom_vjp vs reference: rel err {err:.2e}", flush=True)
  return ok and err < 1e-2


# Per bucket of TUNED: (representative M, [(model, layer)], candidates).
# Per bucket of TUNED: (representative M, [(model, layer)], candidates).
_R, _B, _A = "registers", "bits", "asm"
SWEEP = {
    ("fwd", 16): (1, [("7b", "qkv"), ("7b", "gate")],
                  [(16, 128, 256, 4, 3, 264, _R, _B), (16, 128, 256, 4, 3, 264, _R, _A),
                   (16, 64, 256, 4, 3, 264, _R, _A), (16, 128, 128, 4, 3, 264, _R, _A),
                   (16, 128, 256, 4, 3, 528, _R, _A), (16, 256, 256, 8, 3, 264, _R, _A),
                   (16, 128, 256, 8, 3, 264, _R, _A), (16, 128, 512, 4, 3, 264, _R, _A),
                   (16, 64, 512, 4, 3, 528, _R, _A)]),
    ("fwd", 32): (32, [("7b", "qkv"), ("7b", "gate")],
                  [(32, 128, 128, 4, 4, 264, _R, _B), (32, 128, 128, 4, 4, 264, _R, _A),
                   (32, 128, 256, 4, 3, 264, _R, _A), (32, 64, 256, 4, 3, 264, _R, _A),
                   (32, 128, 128, 4, 4, 528, _R, _A), (32, 256, 128, 8, 3, 264, _R, _A)]),
    ("dx", 64): (32, [("7b", "gate")],
                 [(64, 128, 128, 4, 4, 264, _R, _B), (64, 128, 128, 4, 4, 264, _R, _A),
                  (32, 128, 128, 4, 4, 264, _R, _A)]),
}
DEQ_SWEEP = [(64, 256, 4), (32, 512, 4), (128, 128, 4), (64, 256, 8), (128, 256, 8), (32, 256, 4)]


def _sweep_dequant():
  """Times the one-pass dequantize kernel on 7B gate; returns the best (block_k2, block_n, num_warps)."""
  k, n = SHAPES["7b"]["gate"]
  _, wq = _weights(k, n, 0)
  r = int(max(1, min(32, -(-FLAGS.rotate_mb * 2**20 // wq.nbytes))))
  wqs = _copies(wq, r)
  ref = nvfp4.dequantize(wq, jnp.bfloat16)
  best = None
  for c in DEQ_SWEEP:
    try:
      d = w4_triton.dequantize(wq, jnp.bfloat16, block_k2=c[0], block_n=c[1], num_warps=c[2])
      bad = int(jnp.sum(d != ref))
      t = _time(lambda x, w: w4_triton.dequantize(w, jnp.bfloat16, block_k2=c[0], block_n=c[1], num_warps=c[2]),
                None, wqs, FLAGS.reps, FLAGS.inner)
      gbs = (wq.nbytes + k * n * 2) / t / 1e9
      print(f"  dequantize {c}: {t * 1e6:8.1f} us {gbs:6.0f} GB/s, {bad} bf16 mismatches vs nvfp4.dequantize", flush=True)
      if bad == 0 and (best is None or t < best[0]):
        best = (t, c)
    except Exception as e:
      print(f"  dequantize {c}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
  return best[1] if best else None


def _sweep(budget_s):
  """Times each candidate of SWEEP, writes the winners into w4_triton.TUNED (this process only)."""
  t_start = time.time()
  winners = {}
  for (kind, bucket), (m, shapes, cands) in SWEEP.items():
    if time.time() - t_start > budget_s:
      print(f"sweep budget spent; keeping {(kind, bucket)} = {w4_triton.TUNED[(kind, bucket)]}")
      continue
    data = []
    for model, layer in shapes:
      k, n = SHAPES[model][layer]
      w_bf16, wq = _weights(k, n, 0)
      x = jax.random.normal(jax.random.PRNGKey(m), (m, k if kind == "fwd" else n)).astype(jnp.bfloat16)
      r = 1 if m >= 2048 else int(max(1, min(32, -(-FLAGS.rotate_mb * 2**20 // wq.nbytes))))
      f_bf16 = ((lambda x, w: jnp.dot(x, w)) if kind == "fwd" else (lambda x, w: jnp.dot(x, w.T)))
      t_b = _time(f_bf16, x, _copies(w_bf16, r), FLAGS.reps, FLAGS.inner)
      data.append((model, layer, k, n, x, _copies(wq, r), t_b))
    scores = []
    for c in cands:
      table = dict(w4_triton.TUNED)
      table[(kind, bucket)] = c
      ratios = []
      try:
        for model, layer, k, n, x, wqs, t_b in data:
          cfg = w4_triton.default_config(m, k, n, kind=kind, table=table)
          fn = w4_triton.forward if kind == "fwd" else w4_triton.dx
          y = fn(x, wqs[0], config=cfg)
          ref = (matmul.reference_matmul(x, wqs[0]) if kind == "fwd" else
                 jnp.dot(x, nvfp4.dequantize(wqs[0], jnp.bfloat16).T, preferred_element_type=jnp.float32))
          err = _rel(y, ref)
          if not err < 1e-2:
            raise ValueError(f"wrong result: rel err {err:.2e}")
          t_k = _time(lambda x, w: fn(x, w, config=cfg), x, wqs, FLAGS.reps, FLAGS.inner)
          ratios.append(t_b / t_k)
        score = float(np.exp(np.mean(np.log(ratios))))
        scores.append((score, c))
        print(f"  {kind} M={m} {c}: vs bf16 " + " ".join(f"{v:.2f}x" for v in ratios) + f"  (geo {score:.2f})",
              flush=True)
      except Exception as e:  # a config that does not compile (shared memory, registers) is skipped
        print(f"  {kind} M={m} {c}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
    if scores:
      best = max(scores)[1]
      w4_triton.TUNED[(kind, bucket)] = best
      winners[str((kind, bucket))] = best
      print(f"sweep {(kind, bucket)} winner {best}", flush=True)
  deq = _sweep_dequant()
  if deq:
    winners["dequantize"] = deq
    w4_triton.DEQUANT_CONFIG = deq
    print(f"dequantize winner {deq}", flush=True)
  print("TUNED = " + repr(w4_triton.TUNED), flush=True)
  return winners


def main(argv):
  del argv
  xla_flags.apply_recommended(_XLA.value)  # before the first computation: XLA reads XLA_FLAGS once
  print(f"jax {jax.__version__}, devices {jax.devices()}", flush=True)
  if not FLAGS.smoke and jax.default_backend() not in ("gpu", "cuda"):  # the kernels run only on a GPU
    print(f"error: bench_kernels.py times the 4-bit GPU kernels and needs an NVIDIA GPU (JAX's backend here is "
          f"{jax.default_backend()}); --smoke checks this script on a CPU (tiny shapes, kernels interpreted)",
          file=sys.stderr)
    sys.exit(2)
  global _BACKEND
  if FLAGS.smoke:
    _BACKEND = "interpret"
    for name in ("forward", "dx", "dequantize"):
      setattr(w4_triton, name, _interpreted(getattr(w4_triton, name)))
    SHAPES["7b"] = {"qkv": (256, 384), "o": (128, 128), "gate": (128, 320), "down": (320, 128)}
    SHAPES["32b"] = SHAPES["7b"]
  winners = _sweep(FLAGS.sweep_budget_s) if FLAGS.sweep else {}
  if FLAGS.json and winners:
    with open(FLAGS.json.replace(".json", "_sweep.json"), "w") as f:
      json.dump({"winners": winners, "tuned": {str(k): v for k, v in w4_triton.TUNED.items()}}, f, indent=1)
  ok = _ragged_checks() if FLAGS.ragged else True
  rows = []
  if not FLAGS.table:
    return
  print(_header(), flush=True)
  for model in FLAGS.models.split(","):
    for layer in FLAGS.layers.split(","):
      k, n = SHAPES[model][layer]
      w_bf16, wq = _weights(k, n, 0)
      for kind in FLAGS.kinds.split(","):
        ms = FLAGS.ms if kind == "fwd" else FLAGS.dx_ms
        for m in [int(v) for v in ms.split(",")]:
          d = _bench_row(model, layer, k, n, m, kind, w_bf16, wq, check=FLAGS.check)
          ok &= (d["rel_err"] < 1e-2 and not d["nan"]) or not FLAGS.check
          ok &= d.get("peer_err", 0.0) < 1e-2  # the peer's own check
          ok &= d.get("gluon_dx_err", 0.0) < 1e-2
          rows.append(d)
          _print_row(d)
          if FLAGS.json:
            with open(FLAGS.json, "w") as f:
              json.dump(rows, f, indent=1)
  print("\n" + _header())
  for d in rows:
    _print_row(d)
  print("all checks passed" if ok else "SOME CHECKS FAILED")
  sys.exit(0 if ok else 1)


if __name__ == "__main__":
  app.run(main)
