"""Lab: per-kernel device time of a 7B-shape rollout (GPU only).

Compiles ``sampling.generate`` like experiments/bench_rollout.py (random Qwen2.5-7B-shape
weights, 256-token prompts, no early stop), runs it once under ``jax.profiler.trace`` with a
perfetto trace, and prints the kernels by total device time. Arguments: ``format:batch:new_tokens``.

  PYTHONPATH=$PWD python3 experiments/lab/profile_rollout.py nvfp4:8:64 bf16:8:64
"""
import collections, glob, gzip, json, os, sys, time
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "experiments"))
import jax, jax.numpy as jnp, numpy as np
from absl import flags
flags.FLAGS(["prof"])
import bench_rollout as br
from qerl_jax import models, sampling

def profile(fmt, batch, new_tokens, out):
  cfg = models.ModelConfig.from_hf(br.QWEN25_7B)
  base = br.make_base(cfg, fmt)
  config = sampling.SamplingConfig(max_new_tokens=new_tokens, eos_token_ids=(cfg.vocab_size + 1,), pad_id=0, temperature=1.0)
  t, m = br.random_prompts(cfg, batch, 256)
  tokens, mask = jnp.asarray(t), jnp.asarray(m)
  c = sampling._generate_jit.lower(cfg, config, 1.0, base, None, None, tokens, mask, jax.random.key(1), jnp.int32(batch)).compile()
  run = lambda live: jax.block_until_ready(c(base, None, None, tokens, mask, jax.random.key(1), jnp.int32(live)))
  run(batch)
  d = os.path.join(out, f"trace_{fmt}_{batch}")
  t0 = time.perf_counter()
  with jax.profiler.trace(d, create_perfetto_trace=True):
    run(batch)
  wall = time.perf_counter() - t0
  f = glob.glob(os.path.join(d, "**", "*perfetto_trace.json.gz"), recursive=True)[0]
  ev = json.load(gzip.open(f))
  ev = ev["traceEvents"] if isinstance(ev, dict) else ev
  pids = {}
  for e in ev:
    if e.get("ph") == "M" and e.get("name") == "process_name":
      pids[e["pid"]] = e["args"]["name"]
  agg = collections.defaultdict(lambda: [0.0, 0])
  tot = 0.0; span = [1e30, 0]
  for e in ev:
    if e.get("ph") != "X": continue
    pn = pids.get(e["pid"], "")
    if "GPU" not in pn and "/device" not in pn: continue
    a = agg[e["name"][:90]]; a[0] += e["dur"]; a[1] += 1; tot += e["dur"]
    span[0] = min(span[0], e["ts"]); span[1] = max(span[1], e["ts"] + e["dur"])
  steps = new_tokens - 1
  print(f"\n== {fmt} batch {batch}: wall {wall*1e3:.0f} ms, device busy {tot/1e3:.0f} ms, span {(span[1]-span[0])/1e3:.0f} ms, "
        f"events {sum(v[1] for v in agg.values())}, per step busy {tot/steps/1e3:.2f} ms; procs {sorted(set(pids.values()))[:6]}")
  for name, (us, n) in sorted(agg.items(), key=lambda kv: -kv[1][0])[:22]:
    print(f"  {us/1e3:9.1f} ms {n:7d}x {us/n:8.1f} us  {name}")

for spec in sys.argv[1:]:
  fmt, b, nt = spec.split(":")
  profile(fmt, int(b), int(nt), os.environ.get("OUT", "/tmp"))
