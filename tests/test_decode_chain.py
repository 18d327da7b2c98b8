"""pallas_kernels.decode_chain (lab): a decode layer after attention as one FFI call of six Gluon kernels, and the
decoder's route to it (decoder.PDL_CHAIN)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import decode_chain, residual_norm, w4_gluon
from qerl_jax import models, nvfp4
from tests._model_utils import assert_same_as_on_cpu, decode_all, left_padded_batch

S = jax.ShapeDtypeStruct


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _dense_ints(text: str, name: str) -> list:
  """The int64 array attribute ``name`` of lowered StableHLO text (MLIR prints a long one as hex bytes)."""
  found = re.search(name + r' = dense<(?:\[([0-9, ]+)\]|"0x([0-9A-F]+)")>', text)
  if found.group(1) is not None:
    return [int(v) for v in found.group(1).split(",")]
  return np.frombuffer(bytes.fromhex(found.group(2)), "<i8").tolist()


def _lowering_ready(monkeypatch):
  pytest.importorskip("triton.experimental.gluon")
  monkeypatch.delenv("QERL_GLUON_LAUNCH", raising=False)
  if w4_gluon.launcher() != "ffi":
    pytest.skip("no C++ compiler for the FFI launcher")
  monkeypatch.setattr(residual_norm, "available", lambda: True)  # (the norm kernel asks for a GPU backend)


def _stacks(layers, d, q, inter):
  """Abstract 7B-shaped decode-order stacks (o, gate/up, down)."""
  st = lambda k, n: jax.eval_shape(lambda: nvfp4.to_decode_order(nvfp4.quantize(jnp.ones((layers, k, n)))))
  return st(q, d), st(d, 2 * inter), st(inter, d)


def test_post_attention_lowers_six_kernels_into_one_ffi_call(monkeypatch):
  """The chain at the 7B shape (batch 8): one qerl_gluon_chain custom call with the six entries (three GEMVs, the
  two residual norms, SwiGLU), PDL on every launch but the first and eight griddepcontrol.wait (each GEMV one, each
  norm two: row and zeroing programs, SwiGLU one); each kernel's parameters as (buffer, byte offset) pairs: the
  GEMVs write the accumulator (result 0, aliased to operand 16) at their regions' byte offsets (o after the
  4608-wide q/k/v head, then gate/up, then down), gate/up reads the post-attention norm's x (result 2), down reads
  SwiGLU's y (result 3), the last norm the first one's h (result 1). Without PDL: no grid dependency control, no
  PDL flag. Bad requests are refused."""
  _lowering_ready(monkeypatch)
  m, d, q, inter, layers = 8, 3584, 3584, 18944, 3
  wo, wgu, wd = _stacks(layers, d, q, inter)
  o, h = S((m, q), jnp.bfloat16), S((m, d), jnp.bfloat16)
  head = m * 4608
  size = head + m * (2 * d + 2 * inter)
  post = decode_chain.NormStacks(S((layers, d), jnp.bfloat16), S((layers, d), jnp.float32))
  nxt = decode_chain.NormStacks(S((layers, d), jnp.float32), None)
  assert decode_chain.applies(o, h, wo, wgu, wd, post, nxt)
  # 16 rows: the mma.sync builds, which wait for the kernel before them; 32: the wgmma builds, whose main loop has no
  # griddepcontrol.wait, so no chain (the decoder then runs the separate calls)
  rows = lambda r: (S((r, q), jnp.bfloat16), S((r, d), jnp.bfloat16))
  assert decode_chain.applies(*rows(16), wo, wgu, wd, post, nxt)
  assert not decode_chain.applies(*rows(32), wo, wgu, wd, post, nxt)

  def lower(pdl):
    fn = lambda o, h, acc, wo, wgu, wd, i, post, nxt: decode_chain.post_attention(
        o, h, acc, head, wo, wgu, wd, i, post, nxt, 1e-6, zero_size=size, pdl=pdl)
    return jax.jit(fn).trace(o, h, S((size,), jnp.float32), wo, wgu, wd, S((), jnp.int32), post, nxt).lower(
        lowering_platforms=("cuda",)).as_text()

  text = lower(True)
  assert text.count("qerl_gluon_chain") == 1 and "qerl_gluon_launch" not in text
  entries = re.findall(r"\.entry (\w+)", text)
  assert [e.split("_")[0] for e in entries] == ["w4a16", "residual", "w4a16", "swiglu", "w4a16", "residual"], entries
  assert text.count("griddepcontrol.wait") == 8
  launch = [int(v) for v in re.search(r"launch = dense<\[([0-9, ]+)\]>", text).group(1).split(",")]
  grids = [tuple(launch[6 * i:6 * i + 3]) for i in range(6)]
  # o: 14 column tiles x 28 splits; norm: 8 rows; gate/up: 148 x 7; SwiGLU: 8 x 18944 / 2048; down: 14 x 37;
  # the last norm also zeroes the next accumulator (ZERO_CHUNK elements a program)
  assert grids == [(14, 28, 1), (8, 1, 1), (148, 7, 1), (74, 1, 1), (14, 37, 1),
                   (8 + -(-size // residual_norm.ZERO_CHUNK), 1, 1)], grids
  assert [launch[6 * i + 5] for i in range(6)] == [0, 1, 1, 1, 1, 1]
  params = [int(v) for v in re.search(r"params = dense<\[([0-9, ]+)\]>", text).group(1).split(",")]
  kernels, at = [], 0
  while at < len(params):
    n = params[at]
    kernels.append([tuple(params[at + 1 + 2 * j:at + 3 + 2 * j]) for j in range(n)])
    at += 1 + 2 * n
  acc, h1, x1, y = 17, 18, 19, 20  # results after the 17 operands
  o_at, gu_at = head, head + m * d
  down_at = gu_at + 2 * m * inter
  assert kernels[0] == [(0, 0), (1, 0), (2, 0), (3, 0), (10, 0), (acc, 0), (acc, 4 * o_at)]
  assert kernels[2] == [(x1, 0), (4, 0), (5, 0), (6, 0), (10, 0), (acc, 0), (acc, 4 * gu_at)]
  assert kernels[3] == [(acc, 0), (y, 0)]
  assert kernels[4] == [(y, 0), (7, 0), (8, 0), (9, 0), (10, 0), (acc, 0), (acc, 4 * down_at)]
  # norms: h, the accumulator (region offset compiled in), weight, noise, layer, h out, x out, zeros
  assert kernels[1] == [(11, 0), (acc, 0), (12, 0), (13, 0), (10, 0), (h1, 0), (x1, 0), (acc, 0)]
  assert kernels[5] == [(h1, 0), (acc, 0), (14, 0), (15, 0), (10, 0), (21, 0), (22, 0), (23, 0)]
  assert "output_operand_aliases" in text and "operand_index = 16" in text
  # with the next layer's q/k/v (a 4608-wide stack, next index as operand 15): a seventh GEMV, PDL, reading the
  # layer-end norm's x and writing the head of the new buffer (the last result)
  wqkv = jax.eval_shape(lambda: nvfp4.to_decode_order(nvfp4.quantize(jnp.ones((layers, d, 4608)))))
  text7 = jax.jit(lambda o, h, acc, wo, wgu, wd, wqkv, i, post, nxt: decode_chain.post_attention(
      o, h, acc, head, wo, wgu, wd, i, post, nxt, 1e-6, zero_size=size, next_qkv=(wqkv, i + 1))).trace(
      o, h, S((size,), jnp.float32), wo, wgu, wd, wqkv, S((), jnp.int32), post, nxt).lower(
      lowering_platforms=("cuda",)).as_text()
  assert len(re.findall(r"\.entry (\w+)", text7)) == 7 and text7.count("griddepcontrol.wait") == 9
  launch7 = [int(v) for v in re.search(r"launch = dense<\[([0-9, ]+)\]>", text7).group(1).split(",")]
  assert launch7[36:39] == [18, 28, 1] and launch7[41] == 1
  params7 = [int(v) for v in re.search(r"params = dense<\[([0-9, ]+)\]>", text7).group(1).split(",")]
  # operands: o 0, o / gate-up / down / q/k/v weights 1-12, layer 13, h 14, next layer 15, norms 16-19, acc 20;
  # results 21 (acc) ... 26 (x next), 27 (the new buffer)
  assert params7[-15:] == [7, 26, 0, 10, 0, 11, 0, 12, 0, 15, 0, 27, 0, 27, 0]
  with pytest.raises(ValueError, match="hold the next q/k/v"):
    jax.eval_shape(lambda o, h, acc, wo, wgu, wd, wqkv: decode_chain.post_attention(
        o, h, acc, head, wo, wgu, wd, 0, post, nxt, 1e-6, zero_size=m * 4608 - 1, next_qkv=(wqkv, 1)),
        o, h, S((size,), jnp.float32), wo, wgu, wd, wqkv)
  off = lower(False)
  assert "griddepcontrol" not in off
  assert re.search(r"launch = dense<\[([0-9, ]+)\]>", off).group(1).replace(" ", "").split(",")[5::6] == ["0"] * 6
  call = lambda offset, w_down, zero_size: jax.eval_shape(
      lambda o, h, acc, wo, wgu, wd: decode_chain.post_attention(o, h, acc, offset, wo, wgu, wd, 0, post, nxt, 1e-6,
                                                                 zero_size=zero_size), o, h, S((size,), jnp.float32),
      wo, wgu, w_down)
  with pytest.raises(ValueError, match="do not fit"):
    call(head + 4, wd, size)
  with pytest.raises(ValueError, match="multiple of 4"):
    call(head + 1, wd, size)
  with pytest.raises(ValueError, match="zero_size"):
    call(head, wd, 0)
  with pytest.raises(ValueError, match="no chain"):  # down's K is not gate/up's half
    call(head, wo, size)

def test_post_attention_with_the_next_attention_lowers_eight_kernels(monkeypatch):
  """With ``next_attention`` (decoder.PDL_CHAIN = 4; 7B shape, batch 8, a 2304-slot bf16 cache, a bf16 q/k/v bias
  stack) the chain's eighth kernel is append_attention's, launched with PDL over (row, KV head, split) = (8, 4, 12)
  programs of 128 threads, built with griddepcontrol (ten waits in all); the caches and the counters are aliased
  operands; the results add the next layer's attention output [M H, hd]. Refused: next_attention without next_qkv,
  and caches of another batch."""
  _lowering_ready(monkeypatch)
  m, d, q, inter, layers, slots = 8, 3584, 3584, 18944, 3, 2304
  wo, wgu, wd = _stacks(layers, d, q, inter)
  wqkv = jax.eval_shape(lambda: nvfp4.to_decode_order(nvfp4.quantize(jnp.ones((layers, d, 4608)))))
  o, h = S((m, q), jnp.bfloat16), S((m, d), jnp.bfloat16)
  head = m * 4608
  size = head + m * (2 * d + 2 * inter)
  post = decode_chain.NormStacks(S((layers, d), jnp.bfloat16), S((layers, d), jnp.float32))
  nxt = decode_chain.NormStacks(S((layers, d), jnp.float32), None)
  cache = S((layers, m, slots, 4, 128), jnp.bfloat16)
  parts = (cache, cache, S((m * 4,), jnp.int32), S((layers, 4608), jnp.bfloat16), S((m, slots), jnp.int8),
           S((), jnp.int32), S((m, 64), jnp.float32), S((m, 64), jnp.float32))
  assert decode_chain.attention_applies(decode_chain.NextAttention(*parts, 28), m, wqkv)
  assert not decode_chain.attention_applies(decode_chain.NextAttention(*parts, 28), 16, wqkv)

  def fn(o, h, acc, wo, wgu, wd, wqkv, i, post, nxt, parts):
    return decode_chain.post_attention(o, h, acc, head, wo, wgu, wd, i, post, nxt, 1e-6, zero_size=size,
                                       next_qkv=(wqkv, i + 1), next_attention=decode_chain.NextAttention(*parts, 28))
  traced = jax.jit(fn).trace(o, h, S((size,), jnp.float32), wo, wgu, wd, wqkv, S((), jnp.int32), post, nxt, parts)
  attn = traced.out_info[4]
  assert [(a.shape, a.dtype) for a in attn] == [((m * 28, 128), jnp.bfloat16), (cache.shape, jnp.bfloat16),
                                                 (cache.shape, jnp.bfloat16), ((m * 4,), jnp.int32)]
  text = traced.lower(lowering_platforms=("cuda",)).as_text()
  entries = re.findall(r"\.entry (\w+)", text)
  assert entries[-2:] == ["w4a16_gemv", "attend_append"] and len(entries) == 8, entries
  assert text.count("griddepcontrol.wait") == 10
  launch = [int(v) for v in re.search(r"launch = dense<\[([0-9, ]+)\]>", text).group(1).split(",")]
  assert launch[-6:-2] == [8, 4, 12, 128] and launch[-1] == 1
  # operands: ... acc 20, then bias 21, cos 22, sin 23, k 24, v 25, mask 26, length 27, sync 28
  for operand in (20, 24, 25, 28):
    assert f"operand_index = {operand}" in text, operand
  with pytest.raises(ValueError, match="next_attention needs next_qkv"):
    jax.eval_shape(lambda o, h, acc, wo, wgu, wd, parts: decode_chain.post_attention(
        o, h, acc, head, wo, wgu, wd, 0, post, nxt, 1e-6, zero_size=size,
        next_attention=decode_chain.NextAttention(*parts, 28)), o, h, S((size,), jnp.float32), wo, wgu, wd, parts)


def _decode_layers_traced(layers: int, post_noise: bool):
  """decode_chain.decode_layers traced at the 7B shape (batch 8, a 2304-slot bf16 cache, no q/k/v bias) over
  ``layers`` abstract layers; returns ``(traced, head, size)``: the q/k/v head and accumulator sizes."""
  m, d, q, inter, slots = 8, 3584, 3584, 18944, 2304
  wo, wgu, wd = _stacks(layers, d, q, inter)
  wqkv = jax.eval_shape(lambda: nvfp4.to_decode_order(nvfp4.quantize(jnp.ones((layers, d, 4608)))))
  head = m * 4608
  size = head + m * (2 * d + 2 * inter)
  post = decode_chain.NormStacks(S((layers, d), jnp.bfloat16), S((layers, d), jnp.float32) if post_noise else None)
  nxt = decode_chain.NormStacks(S((layers, d), jnp.float32), None)
  cache = S((layers, m, slots, 4, 128), jnp.bfloat16)
  parts = (cache, cache, S((m * 4,), jnp.int32), None, S((m, slots), jnp.int8), S((), jnp.int32),
           S((m, 64), jnp.float32), S((m, 64), jnp.float32))

  def fn(h, o0, buf0, wqkv, wo, wgu, wd, post, nxt, parts):
    return decode_chain.decode_layers(h, o0, buf0, head, wqkv, wo, wgu, wd, post, nxt,
                                      decode_chain.NextAttention(*parts, 28), 1e-6, zero_size=size)
  traced = jax.jit(fn).trace(S((m, d), jnp.bfloat16), S((m, q), jnp.bfloat16), S((size,), jnp.float32), wqkv, wo,
                             wgu, wd, post, nxt, parts)
  return traced, head, size


def test_decode_layers_lowers_every_layer_into_one_ffi_call(monkeypatch):
  """decode_chain.decode_layers (decoder.PDL_CHAIN = 5) at the 7B shape, batch 8, 3 layers: one qerl_gluon_chain call
  of 8 L - 2 = 22 kernels (each layer's six, then the next layer's q/k/v and attention but after the last), PDL on
  all but the first; each kernel's PTX once in the call's attribute ("=" for a kernel launched again; the last
  layer's end is another norm build, zeroing nothing); layer l's
  kernels read the index operand at byte 16 l (the next q/k/v and attention at 16 (l + 1)); the accumulators
  alternate (layer 0 writes the aliased buffer0, layer 1 the second buffer); the caches and counters are aliased."""
  _lowering_ready(monkeypatch)
  traced, head, size = _decode_layers_traced(3, post_noise=True)
  m, d, layers, slots = 8, 3584, 3, 2304
  cache = S((layers, m, slots, 4, 128), jnp.bfloat16)
  assert [(a.shape, a.dtype) for a in traced.out_info] == [((m, d), jnp.bfloat16)] * 2 + [
      (cache.shape, jnp.bfloat16)] * 2 + [((m * 4,), jnp.int32)]
  text = traced.lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("qerl_gluon_chain") == 1
  entries = re.findall(r"\.entry (\w+)", text)
  layer_kernels = ["w4a16", "residual", "w4a16", "swiglu", "w4a16", "residual"]
  # (each PTX once; the last layer's end zeroes no next accumulator: another build of the norm)
  assert [e.split("_")[0] for e in entries] == layer_kernels + ["w4a16", "attend", "residual"], entries
  launch = _dense_ints(text, "launch")
  assert len(launch) == 6 * 22 and launch[5::6] == [0] + [1] * 21
  params = _dense_ints(text, "params")
  kernels, at = [], 0
  while at < len(params):
    kernels.append([tuple(params[at + 1 + 2 * j:at + 3 + 2 * j]) for j in range(params[at])])
    at += 1 + 2 * params[at]
  assert len(kernels) == 22
  idx = 12  # operands: o, gate/up, down, q/k/v (3 each), then the index array
  n_ops = 12 + 1 + 4 + 3 + 8
  acc_a, acc_b = n_ops, n_ops + 1
  for layer, first in ((0, 0), (1, 8), (2, 16)):
    assert kernels[first][4] == (idx, 16 * layer) and kernels[first + 1][4] == (idx, 16 * layer)
    assert kernels[first][6][0] == (acc_a, acc_b, acc_a)[layer]  # the o product's accumulator
  assert kernels[6][4] == (idx, 16) and kernels[7][7] == (idx, 16)  # layer 0's next q/k/v and attention: layer 1
  assert kernels[6][6] == (acc_b, 0) and kernels[7][0] == (acc_b, 0)
  for operand in (19, 23, 24, 27):  # buffer0, the caches, the counters
    assert f"operand_index = {operand}" in text, operand


def test_decode_layers_can_launch_the_pallas_attention_build(monkeypatch):
  """append_attention.FORM = "pallas" (lab): decode_layers launches the Pallas decode attention's own Triton IR,
  captured from its lowering and compiled here, with a griddepcontrol wait inserted at its start: the call's entries
  name it, and a model without a q/k/v bias gets a zero bias stack (that kernel always reads one). The Triton form's
  option it cannot honour (running past the last layer) is refused."""
  _lowering_ready(monkeypatch)
  from pallas_kernels import append_attention
  monkeypatch.setattr(append_attention, "FORM", "pallas")
  m, layers, slots = 8, 2, 2304
  try:
    text = _decode_layers_traced(layers, post_noise=False)[0].lower(lowering_platforms=("cuda",)).as_text()
  except RuntimeError as e:
    if "capture" in str(e):
      pytest.skip(str(e))
    raise
  entries = re.findall(r"\.entry (\w+)", text)
  assert "decode_attention_append" in entries and "attend_append" not in entries, entries
  assert text.count("griddepcontrol.launch_dependents; griddepcontrol.wait; mov.u32") == 1
  bufs = append_attention.Buffers(*range(14))
  with pytest.raises(ValueError, match="skip_past_last"):
    append_attention.launch(bufs, batch=m, heads=28, heads_kv=4, slots=slots, head_dim=128, layers=layers,
                            bias_dtype=jnp.float32, bias_stacked=True, skip_past_last=True)


def test_decode_layers_qkv_gemv_does_not_release_the_attention(monkeypatch):
  """decode_layers' call (2 layers): the q/k/v GEMV before the attention is the one GEMV built without
  griddepcontrol.launch_dependents, so that the attention launches only as it ends (released early, its programs
  landed on SMs still busy with the GEMV: 2.604 against 2.516 ms a batch-8 step, session 65, H100); it still waits
  for the kernel before it, and the other GEMVs release their successors."""
  _lowering_ready(monkeypatch)
  text = _decode_layers_traced(2, post_noise=False)[0].lower(lowering_platforms=("cuda",)).as_text()
  bodies = re.split(r"\.entry ", text)[1:]  # each module's kernel, in the order of first launch
  names = [re.match(r"\w+", b).group(0) for b in bodies]
  assert names.count("attend_append") == 1 and names.count("w4a16_gemv") == 4, names
  qkv = names.index("attend_append") - 1
  assert names[qkv] == "w4a16_gemv"
  for k, (name, body) in enumerate(zip(names, bodies)):
    if name == "w4a16_gemv":
      assert body.count("griddepcontrol.wait") >= 1, k
      assert (body.count("griddepcontrol.launch_dependents") == 0) == (k == qkv), k


@pytest.mark.parametrize("lora_kind,setting", [(None, 2), (None, 3), ("fused", 3), (None, 4), (None, 5)])
def test_decode_step_routes_the_layer_after_attention_to_the_chain(monkeypatch, lora_kind, setting):
  """decoder.PDL_CHAIN: an accumulating decode step with the fused layer ends hands each layer after attention to
  decode_chain.post_attention (here an XLA stand-in of its formula: the o, gate/up and down products into their
  regions from the o region's offset on, the two residual norms, SwiGLU on the bf16-rounded halves): the same
  logits as the step without it (bit for bit on the CPU), called once a trace with the o region's offset, the
  next accumulator's size and ``pdl`` = (setting != 2). Setting 3 also hands it the fused q/k/v stack and the next
  layer's index (each layer then reads its q/k/v from its buffer's head, layer 0's computed before the loop): the
  same logits. Setting 4 also hands it the next layer's attention (decode_chain.NextAttention: the caches, counters,
  bias stack and the step's mask, length, cos and sin), layer 0's run alone before the loop
  (append_attention.attend_append; both stand-ins run decode_attention_append): the same logits. Setting 5 hands
  every layer after layer 0's attention to one decode_chain.decode_layers call (a stand-in running setting 4's
  chain layer by layer, the final norm at the end): the same logits. With an adapter on o and down (XLA adds their
  deltas) the chain is not taken."""
  import pallas_kernels
  from pallas_kernels import decode_attention as da
  from qerl_jax import lora as lora_lib
  from qerl_jax.models import decoder
  cfg = models.ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=16, attention_bias=True, dtype="bfloat16")
  base = models.quantize_base(models.fuse_projections(models.init_params(cfg, jax.random.key(0), dtype=jnp.bfloat16,
                                                                         std=0.1)), "nvfp4")
  kw = {"norm_noise": {n: 0.05 * jax.random.normal(jax.random.key(i), (cfg.num_layers, cfg.hidden_size))
                       for i, n in enumerate(("input_norm", "post_attn_norm"))},
        "compiler_options": {"xla_allow_excess_precision": False}}
  if lora_kind:
    c = lora_lib.LoRAConfig(r=4, lora_alpha=8.0, target_modules=("q", "v", "o", "down"))
    lora = lora_lib.init_lora(jax.random.key(5), cfg, c)
    lora = jax.tree.map(lambda a: a + 0.05 * jax.random.normal(jax.random.key(a.size), a.shape, a.dtype), lora)
    kw.update(lora=models.fuse_adapter(lora, cfg, dtype=jnp.bfloat16), lora_cfg=c)
  tokens, mask = (jnp.asarray(a) for a in left_padded_batch(cfg.vocab_size, seed=7))
  monkeypatch.setattr(da, "auto_backend", lambda dtype: "interpret")

  def end_stand_in(h, src, offset, w, index, eps, noise=None, *, zero_size=0):
    out = residual_norm.reference(h, src[offset:offset + h.size].reshape(h.shape), w[index], eps,
                                  None if noise is None else noise[index])
    return (*out, jnp.zeros((zero_size,), jnp.float32)) if zero_size else out

  def into_stand_in(x, w, acc, offset, *, index=None, size=None, lora=None):
    assert lora is None
    y = pallas_kernels.quantized_matmul(x, w, index=index, out_dtype=jnp.float32).reshape(-1)
    acc = jnp.zeros((size,), jnp.float32) if acc is None else acc
    acc = jax.lax.dynamic_update_slice(acc, acc[offset:offset + y.size] + y, (offset,))
    return acc[offset:offset + y.size].reshape(*x.shape[:-1], w.shape[1]), acc

  calls, firsts = [], []

  def attention_stand_in(qkv, bias, kc, vc, layer, mask8, length, cos, sin, num_heads):
    return da.decode_attention_append(qkv, bias, kc, vc, layer, mask8, length, cos, sin, num_heads=num_heads,
                                      dtype=jnp.bfloat16, sync=da.new_sync(mask8.shape[0], kc.shape[3]))[:3]

  def first_stand_in(qkv, bias, kc, vc, layer, mask8, length, cos, sin, *, num_heads, sync):
    firsts.append(int(layer))
    o, kc, vc = attention_stand_in(qkv, bias, kc, vc, layer, mask8, length, cos, sin, num_heads)
    return o, kc, vc, sync

  def chain_stand_in(o, h, acc, offset, w_o, w_gu, w_down, index, post, nxt, eps, *, zero_size, pdl=True,
                     next_qkv=None, next_attention=None):
    calls.append((acc.shape[0], offset, zero_size, pdl, next_qkv is not None, next_attention is not None))
    mm = lambda x, w: pallas_kernels.quantized_matmul(x, w, index=index, out_dtype=jnp.float32)
    norm = lambda h, y, s: residual_norm.reference(h, y, s.weight[index], eps,
                                                   None if s.noise is None else s.noise[index])
    h1, x1 = norm(h, mm(o, w_o), post)
    inter = w_down.shape[0]
    gu = mm(x1, w_gu).astype(h.dtype).astype(jnp.float32)
    y = (jax.nn.silu(gu[:, :inter]) * gu[:, inter:]).astype(h.dtype)
    h2, x2 = norm(h1, mm(y, w_down), nxt)
    zeros = jnp.zeros((zero_size,), jnp.float32)
    if next_qkv is not None:  # the next layer's q/k/v at the head (the kernel clamps the index past the last layer)
      w_qkv, nxt_i = next_qkv
      qkv = pallas_kernels.quantized_matmul(x2, w_qkv, index=jnp.minimum(nxt_i, w_qkv.packed.shape[0] - 1),
                                            out_dtype=jnp.float32).reshape(-1)
      zeros = zeros.at[:qkv.size].set(qkv)
    if next_attention is None:
      return h2, x2, zeros, acc
    na = next_attention  # the next layer's attention on that q/k/v; nothing past the last layer
    o_next, kc, vc = attention_stand_in(zeros, na.bias, na.k_cache, na.v_cache, nxt_i, na.slot_mask, na.length,
                                        na.cos, na.sin, na.num_heads)
    past = nxt_i >= na.k_cache.shape[0]
    kc, vc = (jnp.where(past, old, new) for old, new in ((na.k_cache, kc), (na.v_cache, vc)))
    return h2, x2, zeros, acc, (o_next.reshape(o.shape[0], -1), kc, vc, na.sync)

  monkeypatch.setattr(residual_norm, "available", lambda: True)
  monkeypatch.setattr(residual_norm, "applies", lambda h, w, noise=None: True)
  monkeypatch.setattr(residual_norm, "residual_rms_norm", end_stand_in)
  monkeypatch.setattr(pallas_kernels, "accumulate_applies", lambda x, w, index=None: x.shape[-1] == w.shape[0])
  monkeypatch.setattr(pallas_kernels, "quantized_matmul_into", into_stand_in)
  monkeypatch.setattr(pallas_kernels.matmul, "accumulate_lora_applies", lambda *a: False)
  monkeypatch.setattr(decode_chain, "applies", lambda *a: True)
  layer_calls = []

  def layers_stand_in(h, o0, buffer0, offset, w_qkv, w_o, w_gu, w_down, post, nxt, attention, eps, *, zero_size,
                      pdl=True):
    layer_calls.append((buffer0.shape[0], offset, zero_size, pdl))
    n_layers, o, acc, na = w_o.packed.shape[0], o0, buffer0, attention
    for layer in range(n_layers):
      h, x, zeros, _, (o, kc, vc, sync) = chain_stand_in(
          o, h, acc, offset, w_o, w_gu, w_down, layer, post, nxt, eps, zero_size=zero_size, pdl=pdl,
          next_qkv=(w_qkv, layer + 1), next_attention=na)
      na, acc = na._replace(k_cache=kc, v_cache=vc, sync=sync), zeros
    return h, x, na.k_cache, na.v_cache, na.sync

  monkeypatch.setattr(decode_chain, "post_attention", chain_stand_in)
  monkeypatch.setattr(decode_chain, "decode_layers", layers_stand_in)
  monkeypatch.setattr(decode_chain, "attention_applies", lambda *a: True)
  monkeypatch.setattr(decoder.append_attention, "attend_append", first_stand_in)
  monkeypatch.setattr(decoder, "PDL_CHAIN", 0)
  plain, _ = decode_all(cfg, base, tokens, mask, n_prefill=6, cache_dtype=jnp.bfloat16, **kw)
  assert not calls
  monkeypatch.setattr(decoder, "PDL_CHAIN", setting)
  chained, _ = decode_all(cfg, base, tokens, mask, n_prefill=6, cache_dtype=jnp.bfloat16, **kw)
  assert_same_as_on_cpu(chained, plain)
  b = tokens.shape[0]
  total = b * (cfg.q_dim + 2 * cfg.kv_dim + 2 * cfg.hidden_size + 2 * cfg.intermediate_size)
  head = b * (cfg.q_dim + 2 * cfg.kv_dim)
  if setting == 5:  # (the stand-in's own chain calls: one a layer)
    assert layer_calls == [(total, head, total, True)] and firsts == [0]
    return
  assert not layer_calls
  assert calls == ([] if lora_kind else [(total, head, total, setting != 2, setting >= 3, setting == 4)])
  assert firsts == ([0] if setting == 4 else [])


def _gpu_chain_ready():
  if not (decode_chain.residual_norm.available() and w4_gluon.launcher() == "ffi"):
    pytest.skip("the Gluon FFI launcher and a GPU backend are needed")


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [True, False])
def test_gpu_post_attention_matches_the_separate_kernels(pdl):
  """(lab) The chain at the 7B shape (batch 8, layer 1 of 2-layer stacks, AQN noise on the post-attention norm):
  its accumulator regions, h and next x against the library's separate calls (forward_into, residual_rms_norm,
  XLA's SwiGLU) and SwiGLU's y against float64 on the chain's own gate/up product; the head of the accumulator
  (q/k/v's region, NaN here) is left as it was, and the next accumulator is zero. With ``next_qkv`` (the index
  past the last layer, clamped) the next accumulator's head holds x_next @ W_qkv and the rest is zero."""
  _gpu_chain_ready()
  m, d, q, inter = 8, 3584, 3584, 18944
  rng = np.random.default_rng(60)
  st = lambda k, n: nvfp4.to_decode_order(nvfp4.quantize(jnp.asarray(rng.standard_normal((2, k, n)) * 0.03,
                                                                     jnp.float32)))
  wo, wgu, wd = st(q, d), st(d, 2 * inter), st(inter, d)
  o = jnp.asarray(rng.standard_normal((m, q)), jnp.bfloat16)
  h = jnp.asarray(rng.standard_normal((m, d)) * 4.0, jnp.bfloat16)
  post = decode_chain.NormStacks(jnp.asarray(1 + 0.1 * rng.standard_normal((2, d)), jnp.bfloat16),
                                 jnp.asarray(0.01 * rng.standard_normal((2, d)), jnp.float32))
  nxt = decode_chain.NormStacks(jnp.asarray(1 + 0.1 * rng.standard_normal((2, d)), jnp.float32), None)
  head = 76  # (a q/k/v head of 19 16-byte words)
  size = head + m * (2 * d + 2 * inter)
  acc = jnp.full((size,), jnp.nan, jnp.float32).at[head:].set(0.0)
  chain = lambda o, h, acc, wo, wgu, wd, post, nxt, **kw: decode_chain.post_attention(
      o, h, acc, head, wo, wgu, wd, 1, post, nxt, 1e-6, zero_size=size, pdl=pdl, **kw)
  h2, x2, zeros, acc = jax.jit(chain)(o, h, acc, wo, wgu, wd, post, nxt)
  acc = np.asarray(acc)
  assert np.isnan(acc[:head]).all() and (np.asarray(zeros) == 0).all() and zeros.shape == (size,)
  gu_at = head + m * d
  down_at = gu_at + 2 * m * inter
  y_o = w4_gluon.forward(o, wo, out_dtype=jnp.float32, index=1)
  assert _rel(acc[head:gu_at].reshape(m, d), y_o) < 1e-5
  h1, x1 = residual_norm.residual_rms_norm(h, acc[head:gu_at], 0, post.weight, 1, 1e-6, post.noise)
  gu = w4_gluon.forward(x1, wgu, out_dtype=jnp.float32, index=1)
  gu_chain = acc[gu_at:down_at].reshape(m, 2 * inter)
  assert _rel(gu_chain, gu) < 1e-5
  g = np.asarray(jnp.asarray(gu_chain).astype(jnp.bfloat16), np.float64)
  y64 = g[:, :inter] / (1 + np.exp(-g[:, :inter])) * g[:, inter:]
  g32 = jnp.asarray(gu_chain).astype(jnp.bfloat16).astype(jnp.float32)
  y = (jax.nn.silu(g32[:, :inter]) * g32[:, inter:]).astype(jnp.bfloat16)
  y_down = w4_gluon.forward(y, wd, out_dtype=jnp.float32, index=1)
  down_chain = acc[down_at:].reshape(m, d)
  assert _rel(down_chain, y_down) < 5e-3
  # (y itself is not a result: checked through the down product, against float64's y times layer 1 of W_down)
  assert _rel(down_chain, y64 @ np.asarray(nvfp4.dequantize(wd)[1], np.float64)) < 1e-2
  want_h2, want_x2 = residual_norm.residual_rms_norm(h1, jnp.asarray(down_chain).reshape(-1), 0, nxt.weight, 1, 1e-6)
  np.testing.assert_array_equal(np.asarray(h2, np.float32), np.asarray(want_h2, np.float32))
  np.testing.assert_array_equal(np.asarray(x2, np.float32), np.asarray(want_x2, np.float32))
  # with the next layer's q/k/v: index 2 of a 2-layer stack, clamped to 1, into the head of the new buffer
  wqkv = st(d, 4608)
  acc2 = jnp.full((size,), jnp.nan, jnp.float32).at[head:].set(0.0)
  h2b, x2b, buf, _ = jax.jit(lambda *a: chain(*a, next_qkv=(wqkv, jnp.int32(2))))(o, h, acc2, wo, wgu, wd, post, nxt)
  buf = np.asarray(buf)
  assert (buf[m * 4608:] == 0).all()
  assert _rel(buf[:m * 4608].reshape(m, 4608), w4_gluon.forward(x2b, wqkv, out_dtype=jnp.float32, index=1)) < 1e-5
  assert _rel(x2b, x2) < 1e-2 and _rel(h2b, h2) < 1e-2


@pytest.mark.gpu
def test_gpu_decode_step_with_the_chain_matches_without():
  """(lab) decoder.PDL_CHAIN = 1 to 5 on a small NVFP4 model whose decode step takes the chain (hidden 512,
  4 heads of 128, intermediate 1024, AQN noise, a q/k/v bias): every position's logits within bf16 rounding of the
  step without it (the GEMVs' float32 atomics add in another order; 4 runs attention by the Triton kernel), and the
  chain was traced (with 4, with the next layer's attention; 5 runs decode_chain.decode_layers instead); and 5 with
  append_attention.FORM = "pallas" (the Pallas attention's captured build in the call)."""
  _gpu_chain_ready()
  from pallas_kernels import append_attention
  from qerl_jax.models import decoder
  cfg = models.ModelConfig(vocab_size=512, hidden_size=512, intermediate_size=1024, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=128, attention_bias=True, dtype="bfloat16")
  base = models.to_decode_order(models.quantize_base(models.fuse_projections(
      models.init_params(cfg, jax.random.key(1), dtype=jnp.bfloat16, std=0.05)), "nvfp4"))
  noise = {n: 0.02 * jax.random.normal(jax.random.key(i), (cfg.num_layers, cfg.hidden_size))
           for i, n in enumerate(("input_norm", "post_attn_norm"))}
  tokens, mask = (jnp.asarray(a) for a in left_padded_batch(cfg.vocab_size, seed=9))
  real, real_layers, traced, default = decode_chain.post_attention, decode_chain.decode_layers, [], decoder.PDL_CHAIN
  outs = {}
  try:
    decode_chain.post_attention = lambda *a, **k: traced.append(
        (k["pdl"], k["next_qkv"] is not None, k.get("next_attention") is not None)) or real(*a, **k)
    decode_chain.decode_layers = lambda *a, **k: traced.append("layers") or real_layers(*a, **k)
    for setting in (0, 1, 2, 3, 4, 5, "5 pallas"):
      decoder.PDL_CHAIN = int(str(setting)[0])
      append_attention.FORM = "pallas" if setting == "5 pallas" else "tl"
      outs[setting], _ = decode_all(cfg, base, tokens, mask, n_prefill=6, cache_dtype=jnp.bfloat16,
                                    norm_noise=noise)
  finally:
    decoder.PDL_CHAIN, append_attention.FORM = default, "tl"
    decode_chain.post_attention, decode_chain.decode_layers = real, real_layers
  assert traced == [(True, False, False), (False, False, False), (True, True, False), (True, True, True), "layers",
                    "layers"]
  for setting in (1, 2, 3, 4, 5, "5 pallas"):
    assert _rel(outs[setting], outs[0]) < 1e-2, (setting, _rel(outs[setting], outs[0]))
