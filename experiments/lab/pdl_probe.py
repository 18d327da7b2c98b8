"""Lab (GPU): what programmatic dependent launch (PDL) would buy a decode step's chain of W4A16 GEMVs.

A decode step at batch 8 is a chain of short kernels (docs/benchmarks.md "Session 37": q/k/v 6.2 µs, o 5.6,
gate/up 26.5, down 14.7 a layer on the H200), each starting with a wait for its first weight loads. With PDL
(``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``) the next kernel may launch before the previous one
ends; with ``griddepcontrol.wait`` placed after its first step's code and scale loads (``w4_gluon``'s lab
constexpr ``GDC``), only the activation load waits for the previous grid. XLA 0.11's FFI custom calls are each
captured as their own CUDA-graph node, which keeps PDL from crossing them (docs/kernels.md, "Programmatic
dependent launch"), so this probe launches the library's GEMV builds by Triton's own launcher from PyTorch and
times the 7B layer chain (q/k/v, o, gate/up, down, ``PDL_LAYERS`` layers of a stack, so the weights stream from
HBM) in one CUDA graph per variant:

- ``base``: the library's build, launched without the attribute;
- ``wait_first``: PDL, the wait before any load (hides the launch only);
- ``weights_first``: PDL, step 0's codes and scales loaded before the wait;
- ``two_steps_first``: PDL, steps 0 and 1's codes and scales before the wait (all of a q/k/v or o program's);
- ``..._trigger``: plus ``griddepcontrol.launch_dependents`` at the start, so the next grid may launch as soon as
  every program of this one has begun.

Every variant's outputs are checked against ``base``'s (float32 atomics: 1e-5 relative) before timing. Prints a
table of µs a layer (median of ``PDL_REPS`` graph replays).

A second table times a whole decode layer's kernel sequence as the decoder runs it at batch 8: q/k/v, a stand-in
for attention (a PyTorch reduction over a 21 MB cache-sized array, not PDL-aware), o, the post-attention
:mod:`pallas_kernels.residual_norm` kernel, gate/up, a stand-in for SwiGLU (a PyTorch multiply), down, and the
layer-end residual norm that zeroes the next accumulator; with ``pdl`` every Gluon kernel takes the PDL
attribute and its ``GDC`` (the GEMVs ``weights_first_trigger``, the norms their weight and noise loaded before
the wait, the trigger first), so only the four boundaries between Gluon kernels can overlap.

Run on a GPU from the repository root:

  XLA_PYTHON_CLIENT_PREALLOCATE=false python3 experiments/lab/pdl_probe.py

Settings (environment): ``PDL_M`` (rows, 8), ``PDL_LAYERS`` (28), ``PDL_REPS`` (30).
"""
import os
import statistics
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the kernels are compiled here, launched by Triton: JAX stays off the GPU
sys.path.insert(0, os.getcwd())

import torch  # noqa: E402

from pallas_kernels import residual_norm, w4_gluon  # noqa: E402

M = int(os.environ.get("PDL_M", "8"))
LAYERS = int(os.environ.get("PDL_LAYERS", "28"))
REPS = int(os.environ.get("PDL_REPS", "30"))
SHAPES = (("q/k/v", 3584, 4608), ("o", 3584, 3584), ("gate/up", 3584, 37888), ("down", 18944, 3584))
VARIANTS = (("base", 0, False), ("wait_first", 1, True), ("weights_first", 2, True),
            ("wait_first_trigger", 5, True), ("weights_first_trigger", 6, True), ("two_steps_first", 10, True),
            ("two_steps_first_trigger", 14, True))


def compile_build(build, gdc: int, pdl: bool):
  meta = dict(build.meta)
  if gdc:
    meta["GDC"] = gdc
  fn = w4_gluon._kernel(build.wg, build.narrow_n, False, build.w8, False)
  kern = w4_gluon._compile_gluon(fn, w4_gluon._ARG_DTYPES, meta, 90, num_warps=build.warps, maxnreg=build.maxnreg,
                                 options={"launch_pdl": pdl})
  return kern, len(meta)  # Triton's launcher takes a (unused) value for each constexpr of the signature too


def compile_norm(b: int, d: int, layers: int, zero_size: int, gdc: int, pdl: bool):
  meta = residual_norm._meta(b, d, layers, 0, 1e-6, True, zero_size)
  if gdc:
    meta["GDC"] = gdc
  arg_dtypes = ("*bf16", "*fp32", "*bf16", "*fp32", "*i32", "*bf16", "*bf16", "*fp32")
  kern = w4_gluon._compile_gluon(residual_norm._kernel(), arg_dtypes, meta, 90, num_warps=residual_norm.WARPS,
                                 options={"launch_pdl": pdl})
  return kern, len(meta), (b + -(-zero_size // residual_norm.ZERO_CHUNK), 1, 1)


def time_graph(record, reps: int) -> tuple[float, float, float]:
  """(median, min, max) ms of ``reps`` replays of a CUDA graph of ``record()``, after 3 untimed ones."""
  graph = torch.cuda.CUDAGraph()
  stream = torch.cuda.Stream()
  with torch.cuda.stream(stream):
    record()  # warm the launchers outside the capture
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, stream=stream):
      record()
  times = []
  for rep in range(reps + 3):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    if rep >= 3:
      times.append(start.elapsed_time(end))
  return statistics.median(times), min(times), max(times)


def layer_table(projections):
  """The second table: a decode layer's sequence, base against PDL between its Gluon kernels."""
  dev = torch.device("cuda")
  d = SHAPES[0][1]
  acc_size = M * sum(n for _, _, n in SHAPES)
  w_stack = (torch.rand((LAYERS, d), device=dev) + 0.5).to(torch.bfloat16)
  noise = torch.randn((LAYERS, d), device=dev) * 1e-3
  h = torch.randn((M, d), device=dev).to(torch.bfloat16)
  h_out = torch.empty_like(h)
  x_out = torch.empty_like(h)
  zeros = torch.empty((acc_size,), dtype=torch.float32, device=dev)
  kv = torch.randn((81920, 128), device=dev).to(torch.bfloat16)  # 21 MB: a batch-8 layer's cache at 1300 slots
  kv_sum = torch.empty((128,), dtype=torch.bfloat16, device=dev)
  g, u = (torch.randn((M, 18944), device=dev).to(torch.bfloat16) for _ in range(2))
  swiglu = torch.empty_like(g)
  (_, qkv), (_, o), (_, gate_up), (_, down) = [(p[0], p) for p in projections]
  out = {}
  for vname, gdc_mm, gdc_norm, pdl in (("base", 0, 0, False), ("pdl", 6, 5, True), ("base", 0, 0, False),
                                       ("pdl", 6, 5, True)):
    mm = {p[0]: compile_build(p[1], gdc_mm, pdl) for p in projections}
    post = compile_norm(M, d, LAYERS, 0, gdc_norm, pdl)
    end = compile_norm(M, d, LAYERS, acc_size, gdc_norm, pdl)

    def gemv(p, layer):
      (kern, nconst), (_, build, codes, scales, gs, x, y, idx) = mm[p[0]], p
      kern[build.grid](x, codes, scales, gs, idx[layer], y, y, *[None] * nconst)

    def norm(k, y, layer, idx):
      kern, nconst, grid = k
      kern[grid](h, y, w_stack, noise, idx[layer], h_out, x_out, zeros, *[None] * nconst)

    def record():
      for layer in range(LAYERS):
        gemv(qkv, layer)
        torch.sum(kv, dim=0, out=kv_sum)
        gemv(o, layer)
        norm(post, o[6], layer, o[7])
        gemv(gate_up, layer)
        torch.mul(g, u, out=swiglu)
        gemv(down, layer)
        norm(end, down[6], layer, down[7])

    for p in projections:
      p[6].zero_()
    record()
    torch.cuda.synchronize()
    got = (h_out.float().clone(), x_out.float().clone())
    if "want" in out:
      for a, b in zip(got, out["want"]):
        assert torch.allclose(a, b, rtol=2e-2, atol=2e-2), f"layer sequence {vname}: norm outputs differ from base"
    else:
      out["want"] = got
    med, lo, hi = time_graph(record, REPS)
    out.setdefault(vname, []).append((med * 1e3 / LAYERS, lo * 1e3 / LAYERS, hi * 1e3 / LAYERS))
  print("\n| decode layer, batch %d (two runs each, alternating) | µs a layer (median) | min | max |" % M)
  print("|---|---:|---:|---:|")
  for vname in ("base", "pdl"):
    for med, lo, hi in out[vname]:
      print(f"| {vname} | {med:.2f} | {lo:.2f} | {hi:.2f} |")


def main():
  torch.manual_seed(0)
  dev = torch.device("cuda")
  print(f"{torch.cuda.get_device_name()}; M = {M}, {LAYERS} layers, {REPS} replays")
  projections = []
  for name, k, n in SHAPES:
    build = w4_gluon._build(M, k, n, LAYERS, decode_order=True)
    codes = torch.randint(0, 256, (LAYERS * k // 2, n), dtype=torch.uint8, device=dev)
    scales = (torch.rand((LAYERS * k // 16, n), device=dev) * 1.75 + 0.25).to(torch.float8_e4m3fn)
    gs = torch.full((LAYERS,), 0.5, dtype=torch.float32, device=dev)
    x = torch.randn((M, k), device=dev).to(torch.bfloat16)
    out = torch.zeros((M, n), dtype=torch.float32, device=dev)
    idx = [torch.full((1,), i, dtype=torch.int32, device=dev) for i in range(LAYERS)]
    projections.append((name, build, codes, scales, gs, x, out, idx))
    print(f"  {name}: K {k} N {n}, grid {build.grid}, {build.meta}")

  def launch(kernels, layer):
    for (kern, nconst), (_, build, codes, scales, gs, x, out, idx) in zip(kernels, projections):
      kern[build.grid](x, codes, scales, gs, idx[layer], out, out, *[None] * nconst)

  results, reference = {}, None
  for vname, gdc, pdl in VARIANTS:
    kernels = [compile_build(p[1], gdc, pdl) for p in projections]
    for p in projections:
      p[6].zero_()
    launch(kernels, 1)
    torch.cuda.synchronize()
    outs = [p[6].clone() for p in projections]
    if reference is None:
      reference = outs
    else:
      for (pname, *_), got, want in zip(projections, outs, reference):
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert err < 1e-5, f"{vname} {pname}: relative error {err:.2e} against base"
    med, lo, hi = time_graph(lambda: [launch(kernels, layer) for layer in range(LAYERS)], REPS)
    results[vname] = (med * 1e3 / LAYERS, lo * 1e3 / LAYERS, hi * 1e3 / LAYERS)

  base = results["base"][0]
  print("\n| variant | µs a layer (median) | min | max | against base |")
  print("|---|---:|---:|---:|---:|")
  for vname, (med, lo, hi) in results.items():
    print(f"| {vname} | {med:.2f} | {lo:.2f} | {hi:.2f} | {base / med:.3f}x |")
  layer_table(projections)


if __name__ == "__main__":
  main()
