"""Lab: per-kernel device time of a 7B-shape rollout (GPU only).

Compiles ``sampling.generate`` like experiments/bench_rollout.py (random Qwen2.5-7B-shape
weights, 256-token prompts, no early stop), runs it once under ``jax.profiler.trace`` with a
perfetto trace, and prints the kernels by total device time. Arguments:
``format:batch:new_tokens[:lora_rank[:aqn]]`` (a LoRA rank > 0 attaches a training-style adapter on all 7
linears, as ``bench_rollout.py --lora_rank``; a fifth field ``aqn`` adds AQN norm noise).
``PROFILE_PROMPT`` sets the prompt length (default 256; a longer one stands for the KV cache of a
later decode step). ``PROFILE_TOP`` sets how many kernels are listed (default 22); ``PROFILE_SCAN=1`` keeps the decode
step's layer loop scanned (``SamplingConfig.unroll_decode=False``). ``PROFILE_POSITIONS=1`` adds, for a kernel called 2-8 times a layer and step, its
median time by call position within the layer (trace order). ``PROFILE_HLO=1`` adds, under each
XLA kernel, the fusion's output shape and the JAX op and source line it came from (from the compiled
HLO's metadata), to find which model code a small kernel belongs to, and writes the compiled HLO
text to $OUT (default /tmp). ``PROFILE_MODEL_SET="NAME=int,..."`` sets qerl_jax.models.decoder's module
settings first (as ab_rollout.py's MODEL_SET), ``PROFILE_MM_SET`` pallas_kernels.w4_gluon_mm's (as its MM_SET).

  PYTHONPATH=$PWD python3 experiments/lab/profile_rollout.py nvfp4:8:64 bf16:8:64 nvfp4_fused:8:64:32:aqn
"""
import os, re, sys, time
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "experiments"))
import jax, jax.numpy as jnp, numpy as np
import devtime
from absl import flags
flags.FLAGS(["prof"])
import bench_rollout as br
from qerl_jax import models, sampling, xla_flags
xla_flags.apply_recommended()  # the launchers' GPU flags (bench_rollout's main is not run here)
from qerl_jax.models import decoder
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # experiments/lab
from labcommon import set_module_settings
set_module_settings("PROFILE_MODEL_SET", decoder)
from pallas_kernels import w4_gluon_mm
set_module_settings("PROFILE_MM_SET", w4_gluon_mm)

def profile(fmt, batch, new_tokens, out, rank=0, aqn=False):
  cfg = models.ModelConfig.from_hf(br.QWEN25_7B)
  base = br.make_base(cfg, fmt)
  lora, scale, noise = br.adapter_and_noise(cfg, base, rank, aqn)
  config = sampling.SamplingConfig(max_new_tokens=new_tokens, eos_token_ids=(cfg.vocab_size + 1,), pad_id=0, temperature=1.0,
                                   unroll_decode=os.environ.get("PROFILE_SCAN", "0") != "1")
  t, m = br.random_prompts(cfg, batch, int(os.environ.get("PROFILE_PROMPT", 256)))
  tokens, mask = jnp.asarray(t), jnp.asarray(m)
  c = sampling._generate_jit.lower(cfg, config, scale, base, lora, noise, tokens, mask, jax.random.key(1),
                                   jnp.int32(batch)).compile()
  run = lambda live: jax.block_until_ready(c(base, lora, noise, tokens, mask, jax.random.key(1), jnp.int32(live)))
  t0 = time.perf_counter()
  events = []
  durs = devtime.trace_durations(lambda: run(batch), events=events)
  wall = time.perf_counter() - t0
  agg = {name: [sum(ts), len(ts)] for name, ts in durs.items()}
  tot = sum(v[0] for v in agg.values())
  steps = new_tokens - 1
  print(f"\n== {fmt} batch {batch} lora {rank} aqn {aqn}: wall (warm-up + traced run) {wall*1e3:.0f} ms, device busy {tot/1e3:.0f} ms, "
        f"kernels {sum(v[1] for v in agg.values())}, per step busy {tot/steps/1e3:.2f} ms")
  where = {}
  if os.environ.get("PROFILE_HLO"):
    text = c.as_text()
    where = hlo_origins(text)
    with open(os.path.join(out, f"{fmt}_{batch}_{rank}{'_aqn' if aqn else ''}.hlo.txt"), "w") as f:
      f.write(text)
  if os.environ.get("PROFILE_SEQ"):
    step_sequence(events, agg, steps, int(os.environ["PROFILE_SEQ"]), where)
  for name, (us, n) in sorted(agg.items(), key=lambda kv: -kv[1][0])[:int(os.environ.get("PROFILE_TOP", 22))]:
    print(f"  {us/1e3:9.1f} ms {n:7d}x {us/n:8.1f} us  {name}")
    if name in where:
      print(f"{'':36s}{where[name]}")
    per_layer_step = n // (steps * cfg.num_layers) if n % (steps * cfg.num_layers) == 0 else 0
    if os.environ.get("PROFILE_POSITIONS") and 1 < per_layer_step <= 8:
      ts = np.asarray(durs[name]).reshape(-1, per_layer_step)  # trace order: one row per layer and step
      print(f"{'':36s}by call within a layer (median us): "
            + " ".join(f"{v:.1f}" for v in np.median(ts, axis=0)))


def step_sequence(events, agg, steps, show, where=None):
  """Prints one decode step from the trace: its kernels in order (the first ``show``), the step's
  device busy and wall time (first kernel start to last kernel end), and the idle gaps between its
  kernels. A step is delimited by the first kernel (by name) that runs once a step plus once in
  prefill (``steps + 1`` times; the LM-head GEMM is one, but another such kernel may be picked, and
  the sequence then starts elsewhere in the step: the header names it). With ``where``
  (:func:`hlo_origins`, ``PROFILE_HLO=1``) each kernel's shape and source line follow its name."""
  head = [name for name, (_, n) in agg.items() if n == steps + 1]
  if not head:
    print("  (no kernel runs steps + 1 times; no step sequence)")
    return
  events = sorted(events, key=lambda e: e[1])
  marks = [i for i, e in enumerate(events) if e[0] == head[0]]
  mid = len(marks) // 2
  step = events[marks[mid] + 1:marks[mid + 1] + 1]
  busy = sum(d for _, _, d in step)
  wall = step[-1][1] + step[-1][2] - step[0][1]
  gaps = [b[1] - (a[1] + a[2]) for a, b in zip(step, step[1:])]
  print(f"  one decode step ({head[0]} ends it): {len(step)} kernels, busy {busy:.0f} us, wall {wall:.0f} us, "
        f"gaps {sum(gaps):.0f} us (median {np.median(gaps):.2f} us)")
  for (name, ts, dur), gap in list(zip(step, [0.0] + gaps))[:show]:
    print(f"    {dur:7.1f} us  gap {gap:5.1f}  {name}" + (f"   [{where[name]}]" if where and name in where else ""))


def hlo_origins(text):
  """{instruction name: 'shape  op_name  file:line'} for the instructions of a compiled HLO text."""
  out = {}
  for line in text.splitlines():
    m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (\(.*?\)|\S+) ([\w\-]+)\(", line)
    if not m:
      continue
    op = re.search(r'op_name="([^"]*)"', line)
    src = re.search(r'source_file="([^"]*)" source_line=(\d+)', line)
    origin = (op.group(1).split("/")[-4:] if op else [m.group(3)])
    out[m.group(1)] = (f"{m.group(2)[:40]}  {'/'.join(origin)[:110]}  "
                       + (f"{os.path.basename(src.group(1))}:{src.group(2)}" if src else ""))
  return out

for spec in sys.argv[1:]:
  fmt, b, nt, *rest = spec.split(":")
  profile(fmt, int(b), int(nt), os.environ.get("OUT", "/tmp"), int(rest[0]) if rest else 0, rest[1:] == ["aqn"])
