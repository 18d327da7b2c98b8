"""Lab (GPU, torch + triton 3.6): the Gluon swap-AB W4A16 GEMV (w4_gluon_v2.py) against a float32
reference and against cuBLAS bf16, at the 7B shapes. CUDA graphs over rotating weight copies."""
import os, sys, itertools, statistics
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import w4_gluon_v2 as g

LUT = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float32, device="cuda")
SHAPES = {"qkv": (3584, 4608), "o": (3584, 3584), "gate": (3584, 18944), "down": (18944, 3584)}

def make(k, n, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    p = torch.randint(0, 256, (k // 2, n), dtype=torch.uint8, device="cuda", generator=gen)
    s = (torch.rand((k // 16, n), device="cuda", generator=gen) * 1.75 + 0.25).to(torch.float8_e4m3fn)
    return p, s

def dequant(p, s, gs):
    k2, n = p.shape
    w = torch.empty((k2 * 2, n), dtype=torch.float32, device="cuda")
    w[0::2] = LUT[(p & 15).long()]
    w[1::2] = LUT[(p >> 4).long()]
    return w * s.float().repeat_interleave(16, 0) * gs

def perm_x(x):  # slot s <- k with bits 0 and 1 swapped
    k = x.shape[1]
    idx = torch.arange(k, device="cuda")
    idx = (idx & ~3) | ((idx & 1) << 1) | ((idx >> 1) & 1)
    return x[:, idx].contiguous()

def run(x, p, s, gs, splits, mb, ahead=1, out=None):
    m, k = x.shape
    n = p.shape[1]
    steps = k // 64 // splits
    assert steps * splits * 64 == k
    if out is None:
        out = torch.empty((splits, m, n), dtype=torch.float32, device="cuda")
    g.kern[(n // 256, splits)](perm_x(x), p, s, out, gs, m, N=n, K=k, STEPS=steps, MB=mb, AHEAD=ahead, num_warps=4)
    return out.sum(0)

def bench(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); graph.replay(); b.record(); torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000)
    return statistics.median(times)

def main():
    ms = [int(v) for v in os.environ.get("GL_MS", "1,8").split(",")]
    for name, (k, n) in SHAPES.items():
        p, s = make(k, n)
        for m in ms:
            x = torch.randn((m, k), device="cuda").to(torch.bfloat16)
            ref = x.float() @ dequant(p, s, 0.01)
            y = run(x, p, s, 0.01, 7 if k == 3584 else 37, 8 if m <= 8 else 16)
            err = ((y - ref).norm() / ref.norm()).item()
            print(f"check {name} M={m}: rel err {err:.2e} finite {bool(torch.isfinite(y).all())}", flush=True)
            assert err < 1e-2
    for name, (k, n) in SHAPES.items():
        r = max(2, (256 << 20) // (k * n // 2))
        ws = [make(k, n, i) for i in range(r)]
        wb = [torch.randn((k, n), device="cuda").to(torch.bfloat16) for _ in range(max(2, (512 << 20) // (k * n * 2)))]
        steps_total = k // 64
        cands = [(sp, a) for sp in (4, 7, 14, 28, 37, 74) for a in (1, 2) if steps_total % sp == 0 and steps_total // sp <= 14]
        for m in ms:
            x = torch.randn((m, k), device="cuda").to(torch.bfloat16)
            xp = perm_x(x)
            tb = bench(lambda: [x @ w for w in wb]) / len(wb)
            row = [f"{name:5s} M={m:2d} bf16 {tb:6.1f}"]
            for sp, ahead in cands:
                outs = torch.empty((sp, m, n), dtype=torch.float32, device="cuda")
                mb = 8 if m <= 8 else 16
                def f(sp=sp, outs=outs, mb=mb, ahead=ahead):
                    for p, s in ws:
                        g.kern[(n // 256, sp)](xp, p, s, outs, 0.01, m, N=n, K=k, STEPS=k // 64 // sp, MB=mb, AHEAD=ahead, num_warps=4)
                t = bench(f) / len(ws)
                row.append(f"s{sp}a{ahead} {t:5.1f}")
            print(" | ".join(row), flush=True)

if __name__ == "__main__":
    main()
