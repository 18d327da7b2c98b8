"""Lab: standalone Triton W4A16 kernels (w4_tl.py) vs torch bf16 (GPU only; torch + triton).

Variants (tensor-core dot or FMA GEMV at M=1, split-K with float32 atomics, tile sizes,
unrolled K loop), each checked against a float64 product, then timed as CUDA-graph replays over
rotating weight copies (CUDA events, median of 7). Tried as the jax-triton route of issue 4; it
did not beat the Pallas kernel (docs/benchmarks.md, session 2).

  LAB_SHAPES=7b_qkv,7b_gate LAB_MS=1,8 python3 experiments/lab/triton_lab.py
"""
import itertools, json, os, sys, time
import torch, triton
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.dirname(__file__))
from w4_tl import w4_fwd_kernel

DEV = "cuda" if torch.cuda.is_available() else "cpu"
E2M1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])

def make_w(k, n, seed):
  g = torch.Generator().manual_seed(seed)
  p = torch.randint(0, 256, (k // 2, n), generator=g, dtype=torch.uint8)
  s = (torch.rand(k // 16, n, generator=g) * 1.5 + 0.5).to(torch.float8_e4m3fn)
  return p.to(DEV), s.view(torch.uint8).to(DEV), torch.tensor([1 / 3.0], dtype=torch.float32, device=DEV)

def deq(p, s, igs):
  lo = E2M1.to(p.device)[(p & 15).long()]; hi = E2M1.to(p.device)[(p >> 4).long()]
  w = torch.stack([lo, hi], 1).reshape(p.shape[0] * 2, p.shape[1])
  sf = s.view(torch.float8_e4m3fn).float().repeat_interleave(16, 0)
  return w * sf * igs

def launch(x, p, s, igs, y, cfg):
  m, k = x.shape; n = p.shape[1]
  bm, bn, bk, split, gemv, sg, warps, stages, unroll = cfg
  total = -(-k // bk); steps = -(-total // split); split = -(-total // steps)
  grid = (-(-n // bn), split, -(-m // bm))
  w4_fwd_kernel[grid](x, p, s, igs, y, m, n, k, x.stride(0), y.stride(0), BM=bm, BN=bn, BK=bk, SPLIT_K=split,
                      GEMV=gemv, SCALE_GATHER=sg, STEPS=steps, UNROLL=(steps if unroll else 1), num_warps=warps, num_stages=stages)
  return split

def run(x, p, s, igs, cfg):
  m = x.shape[0]; n = p.shape[1]
  y = torch.full((m, n), float("nan"), dtype=torch.float32, device=x.device)
  if cfg[3] > 1: y.zero_()
  launch(x, p, s, igs, y, cfg)
  return y

def graph_time(fn_list, reps=7):
  s = torch.cuda.Stream()
  s.wait_stream(torch.cuda.current_stream())
  with torch.cuda.stream(s):
    for f in fn_list: f()
  torch.cuda.current_stream().wait_stream(s)
  g = torch.cuda.CUDAGraph()
  with torch.cuda.graph(g):
    for f in fn_list: f()
  g.replay(); torch.cuda.synchronize()
  ts = []
  for _ in range(reps):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(); g.replay(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b) * 1e3 / len(fn_list))
  ts.sort(); return ts[len(ts) // 2]

SHAPES = {"7b_qkv": (3584, 4608), "7b_o": (3584, 3584), "7b_gate": (3584, 18944), "7b_down": (18944, 3584),
          "32b_gate": (5120, 27648)}

def configs_for(m):
  out = []
  if m == 1:
    for bn, bk, split, un in itertools.product((64, 128), (128, 256), (4, 8, 16), (0, 1)):
      out.append((1, bn, bk, split, True, False, 4, 3, un))
  bm = max(16, triton.next_power_of_2(m))
  if bm <= 64:
    for bn, bk, split, un in itertools.product((64, 128), (128, 256), (4, 8), (0, 1)):
      out.append((bm, bn, bk, split, False, False, 4, 3, un))
  return out

def main():
  ms = [int(v) for v in os.environ.get("LAB_MS", "1,8,16,32,64").split(",")]
  shapes = os.environ.get("LAB_SHAPES", ",".join(SHAPES)).split(",")
  budget = float(os.environ.get("LAB_BUDGET", "400")); t0 = time.time()
  rows = []
  for name in shapes:
    k, n = SHAPES[name]
    r = max(1, -(-(256 << 20) // (k * n // 2)))
    ws = [make_w(k, n, i) for i in range(r)]
    rb = max(1, -(-(512 << 20) // (k * n * 2)))
    wb = [deq(*ws[0]).to(torch.bfloat16) for _ in range(min(rb, 4))]
    wb += [wb[0].clone() for _ in range(rb - len(wb))]
    for m in ms:
      if time.time() - t0 > budget: break
      x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
      ref = x.double() @ deq(*ws[0]).double()
      yb = [torch.empty(m, n, device=DEV, dtype=torch.bfloat16) for _ in wb]
      t_bf16 = graph_time([lambda i=i: torch.mm(x, wb[i], out=yb[i]) for i in range(len(wb))])
      best = None
      for cfg in configs_for(m):
        try:
          y = run(x, *ws[0], cfg); torch.cuda.synchronize()
          err = ((y.double() - ref).norm() / ref.norm()).item()
          if not (err < 1e-2):
            print("BAD", name, m, cfg, err); continue
          ys = [torch.zeros(m, n, device=DEV, dtype=torch.float32) for _ in ws]
          def call(i, cfg=cfg):
            if cfg[3] > 1: ys[i].zero_()
            launch(x, *ws[i], ys[i], cfg)
          t = graph_time([lambda i=i: call(i) for i in range(r)])
        except Exception as e:
          print("FAIL", name, m, cfg, repr(e)[:200]); continue
        rows.append(dict(shape=name, m=m, cfg=cfg, us=t, bf16_us=t_bf16, err=err)); print("   ", cfg, f"{t:.1f}", flush=True) if os.environ.get("LAB_V") else None
        if best is None or t < best[0]: best = (t, cfg, err)
      gbs = (k * n / 2 + k * n / 16) / best[0] / 1e3
      print(f"{name:9s} M={m:4d} bf16 {t_bf16:7.1f} us | best {best[0]:7.1f} us {gbs:6.0f} GB/s {t_bf16/best[0]:5.2f}x  cfg={best[1]} err={best[2]:.1e}", flush=True)
  json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "lab.json"), "w"))

if __name__ == "__main__":
  main()
