"""Lab (no GPU needed): the SASS instruction mix of a w4_triton kernel's main loop.

Lowers ``w4_triton.forward`` (or ``dx``) for a tile config on the CPU to Triton IR
(Pallas' Triton lowering with ``lowering_platforms=("cuda",)``), compiles that IR for
sm_90 with the pip ``triton`` package (3.6; not a project dependency: ``pip install
triton==3.6.0``), disassembles the cubin and counts the instructions of the longest
loop, per warp and K step, and per decoded weight value. The captured TTIR is first
canonicalized and combined (``prepare_ttir``) as the GPU's pipeline does; session-5 counts
include that, earlier ones (6.5/value at M = 8) counted an extra float add per accumulator and dot. XLA's bundled Triton on the
GPU image is a different build, so counts are a guide, not the GPU's truth; session 3
used them to find that the M <= 32 kernel issues about 6-7 instructions per weight
value (ALU-bound, docs/benchmarks.md).

  python3 experiments/lab/offline_sass.py tuned "nopf,prefetch=False" "bits,decode=bits" "m32,m=32"

Each argument is ``tag[,field=value...]`` overriding fields of ``default_config``
(``m=`` sets M). Files go to $SASS_DIR (default /tmp/offline_sass).
"""
import sys, os, json, subprocess, re, collections, dataclasses
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import jax, jax.numpy as jnp
from jax._src.pallas.triton import lowering as L
captured = []
orig = L.lower_jaxpr_to_triton_module
def cap(*a, **k):
  r = orig(*a, **k); captured.append(r.module.operation.get_asm(enable_debug_info=False)); return r
L.lower_jaxpr_to_triton_module = cap
import triton
from triton.backends.compiler import GPUTarget
from qerl_jax import nvfp4
from pallas_kernels import w4_triton
OUT = os.environ.get("SASS_DIR", "/tmp/offline_sass")
os.makedirs(OUT, exist_ok=True)
NV = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")

def loop_hist(sass):
  ins = []
  for l in sass.splitlines():
    m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", l)
    if m: ins.append((int(m.group(1), 16), m.group(2).strip()))
  loops = []
  for addr, t in ins:
    if "BRA" in t:
      m = re.search(r"0x([0-9a-f]+)", t.split("BRA")[1])
      if m and int(m.group(1), 16) < addr: loops.append((int(m.group(1), 16), addr))
  if not loops: return len(ins), collections.Counter(), len(ins)
  a, b = max(loops, key=lambda x: x[1] - x[0])
  body = [t for addr, t in ins if a <= addr <= b]
  ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
  return len(body), ops, len(ins)

def prepare_ttir(text):
  """Canonicalize + combine the Pallas TTIR as the GPU's pipeline does before TTGIR (a .ttir input to
  triton.compile skips them; without them each ``acc += dot`` keeps a float add per accumulator)."""
  from triton._C.libtriton import ir, passes
  from triton.compiler.compiler import make_backend
  ctx = ir.context(); ir.load_dialects(ctx); make_backend(GPUTarget("cuda", 90, 32)).load_dialects(ctx)
  tmp = os.path.join(OUT, "_raw.ttir"); open(tmp, "w").write(text)
  mod = ir.parse_mlir_module(tmp, ctx); mod.context = ctx
  pm = ir.pass_manager(ctx)
  passes.common.add_inliner(pm); passes.common.add_canonicalizer(pm); passes.ttir.add_combine(pm)
  passes.common.add_canonicalizer(pm)
  pm.run(mod, "make_ttir")
  return str(mod)

def run(tag, m=8, k=3584, n=18944, kind="fwd", **over):
  cfg = w4_triton.default_config(m, k, n, kind=kind)
  cfg = dataclasses.replace(cfg, **over)
  x = jax.ShapeDtypeStruct((m, k) if kind == "fwd" else (m, n), jnp.bfloat16)
  w = jax.eval_shape(lambda: nvfp4.quantize(jnp.ones((k, n), jnp.float32)))
  fn = w4_triton.forward if kind == "fwd" else w4_triton.dx
  captured.clear()
  jax.jit(lambda x, w: fn(x, w, config=cfg)).trace(x, w).lower(lowering_platforms=("cuda",))
  path = f"{OUT}/{tag}.ttir"; open(path, "w").write(prepare_ttir(captured[-1]))
  kk = triton.compile(path, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
  open(f"{OUT}/{tag}.ttgir", "w").write(kk.asm["ttgir"]); open(f"{OUT}/{tag}.cubin", "wb").write(kk.asm["cubin"])
  sass = subprocess.check_output([NV + "/cuobjdump", "-sass", f"{OUT}/{tag}.cubin"]).decode()
  open(f"{OUT}/{tag}.sass", "w").write(sass)
  nloop, ops, total = loop_hist(sass)
  usage = subprocess.check_output([NV + "/cuobjdump", "--dump-resource-usage", f"{OUT}/{tag}.cubin"]).decode()
  regs = int(re.search(r"REG:(\d+)", usage).group(1))
  vals = cfg.block_k * cfg.block_n // (32 * cfg.num_warps)  # weight values per thread per step
  print(f"{tag:14s} {cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages} pf={cfg.prefetch} dec={cfg.decode}: "
        f"regs {regs} smem {kk.metadata.shared} loop {nloop} instr/warp-step = {nloop / vals:.2f}/value  top={ops.most_common(6)}")

if __name__ == "__main__":
  for spec in sys.argv[1:]:
    tag, *kv = spec.split(",")
    over = {}
    for item in kv:
      key, v = item.split("=")
      over[key] = {"True": True, "False": False}.get(v, int(v) if v.isdigit() else v)
    m = over.pop("m", 8)
    run(tag, m=m, **over)
