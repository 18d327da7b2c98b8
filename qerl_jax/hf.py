"""Hugging Face checkpoints in and out: safetensors only, quantized as they are read.

``load_pretrained(path)`` reads ``config.json``, the safetensors shards (via
``model.safetensors.index.json`` when present), the tokenizer and
``generation_config.json``. Each decoder linear is read one layer at a time,
transposed to the model's ``x @ W`` layout and quantized at once, and each
stacked ``[L, K, N]`` weight is moved to the device before the next is built,
so host memory stays near one float matrix plus the bf16 embeddings; the
stacked ``[L, K, N]`` weights are preallocated on the device and filled layer
by layer in place (buffer donation). The bf16 model never exists at once.

Already-NVFP4 checkpoints load without requantizing:

* compressed-tensors ``nvfp4-pack-quantized`` (llm-compressor): ``weight_packed``
  uint8 ``[N, K/2]``, ``weight_scale`` E4M3 ``[N, K/16]``, ``weight_global_scale``
  float32 ``[1]``, a *divisor* (dequant = ``e2m1 * scale / global_scale``);
* NVIDIA ModelOpt NVFP4: ``weight`` uint8 ``[N, K/2]``, ``weight_scale`` E4M3,
  ``weight_scale_2`` float32 ``[]``, a *multiplier*; stored here as the divisor
  ``float32(1 / weight_scale_2)`` (exact whenever that reciprocal round-trips in
  float32, which holds for the scales in the tests; otherwise within 1 ulp of the scale).

Pickle checkpoints (``pytorch_model.bin``) are never read.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import struct
from typing import Any, Iterable, Mapping, NamedTuple, Optional

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from qerl_jax import nf4, nvfp4
from qerl_jax.models import decoder
from qerl_jax.models.config import SUPPORTED_ARCHITECTURES, ModelConfig

# Model tree name -> HF module name inside ``model.layers.{i}``.
HF_LINEARS = {("attn", "q"): "self_attn.q_proj", ("attn", "k"): "self_attn.k_proj",
              ("attn", "v"): "self_attn.v_proj", ("attn", "o"): "self_attn.o_proj",
              ("mlp", "gate"): "mlp.gate_proj", ("mlp", "up"): "mlp.up_proj",
              ("mlp", "down"): "mlp.down_proj"}
HF_NORMS = {"input_norm": "input_layernorm.weight",
            "post_attn_norm": "post_attention_layernorm.weight"}
HF_BIASES = {"q_bias": "self_attn.q_proj.bias", "k_bias": "self_attn.k_proj.bias",
             "v_bias": "self_attn.v_proj.bias"}
HF_QK_NORMS = {"q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight"}
EMBED_KEY = "model.embed_tokens.weight"
FINAL_NORM_KEY = "model.norm.weight"
LM_HEAD_KEY = "lm_head.weight"

_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16,
              "BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn,
              "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
              "U8": np.uint8, "BOOL": np.bool_}
_NP_TO_ST = {np.dtype(v): k for k, v in _ST_DTYPES.items()}


class Pretrained(NamedTuple):
  """What :func:`load_pretrained` returns (unpacks as a 4-tuple)."""
  cfg: ModelConfig
  base: dict
  tokenizer: Any  # a transformers tokenizer, or None when the folder has none
  generation_config: dict  # generation_config.json plus "eos_token_ids": every EOS id


# ----------------------------------------------------------------------------- safetensors I/O

class SafetensorsFile:
  """Reads single tensors from a ``.safetensors`` file by seeking (no mmap, no
  whole-file read), so resident memory is only the tensors asked for."""

  def __init__(self, path):
    """Reads the header of ``path``.

    Raises:
      ValueError: the file is not a readable safetensors file (too short, a header length beyond the file, a
        header that is not a JSON object), naming the file. OSError: it cannot be opened.
    """
    self.path = str(path)
    size = os.path.getsize(self.path)
    with open(self.path, "rb") as f:
      head = f.read(8)
      n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
      if n is None or n > size - 8:
        raise ValueError(f"{self.path}: not a safetensors file (truncated or corrupt: {size} bytes, header length "
                         f"{n})")
      try:
        header = json.loads(f.read(n))
      except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{self.path}: not a safetensors file (its header is not JSON: {e})") from None
    if not isinstance(header, dict):
      raise ValueError(f"{self.path}: not a safetensors file (its header is not a JSON object)")
    self._offset = 8 + n
    header.pop("__metadata__", None)
    self.header = header

  def keys(self):
    """The tensor names in the file's header."""
    return self.header.keys()

  def shape(self, key) -> tuple:
    """Tensor ``key``'s shape from the header (nothing is read)."""
    return tuple(self.header[key]["shape"])

  def dtype(self, key) -> str:
    """Tensor ``key``'s safetensors dtype name (``"BF16"``, ``"F32"``, ``"U8"``, ...) from the header."""
    return self.header[key]["dtype"]

  def read(self, key) -> np.ndarray:
    """Tensor ``key`` as a numpy array of its stored shape and dtype (bf16 as ``ml_dtypes.bfloat16``).

    Raises:
      KeyError: no tensor ``key``.
      ValueError: a dtype this reader does not know, or fewer bytes in the file than the header promises (truncated).
    """
    info = self.header[key]
    if info["dtype"] not in _ST_DTYPES:
      raise ValueError(f"{self.path}: tensor {key!r} has unsupported dtype {info['dtype']}")
    start, end = info["data_offsets"]
    out = np.empty(tuple(info["shape"]), _ST_DTYPES[info["dtype"]])
    with open(self.path, "rb") as f:
      f.seek(self._offset + start)
      view = memoryview(out.reshape(-1).view(np.uint8))
      if f.readinto(view) != end - start:
        raise ValueError(f"{self.path}: tensor {key!r} is truncated")
    return out


def save_safetensors(path, tensors: Mapping[str, np.ndarray], metadata: Optional[dict] = None) -> None:
  """Writes numpy arrays (including bfloat16 / float8_e4m3fn from ml_dtypes) to a safetensors file.

  Raises:
    ValueError: a tensor of a dtype safetensors has no code for.
  """
  header, offset, arrays = {}, 0, []
  for key, arr in tensors.items():
    arr = np.ascontiguousarray(arr)
    if arr.dtype not in _NP_TO_ST:
      raise ValueError(f"save_safetensors: tensor {key!r} has unsupported dtype {arr.dtype}")
    header[key] = {"dtype": _NP_TO_ST[arr.dtype], "shape": list(arr.shape),
                   "data_offsets": [offset, offset + arr.nbytes]}
    offset += arr.nbytes
    arrays.append(arr)
  if metadata:
    header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for arr in arrays:
      f.write(arr.reshape(-1).view(np.uint8).tobytes())


class CheckpointReader:
  """All tensors of a checkpoint folder, across shards.

  Raises:
    FileNotFoundError: no safetensors weights in the folder (a pickle-only
      folder is named as such), or a shard named by the index is missing.
  """

  def __init__(self, folder):
    folder = pathlib.Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
      weight_map = json.loads(index.read_text())["weight_map"]
    elif (folder / "model.safetensors").is_file():
      weight_map = None
    else:
      pickles = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt")]
      extra = (f" (found pickle files {sorted(pickles)}: only safetensors are read, never pickle)"
               if pickles else "")
      raise FileNotFoundError(f"{folder}: no model.safetensors or model.safetensors.index.json{extra}")
    if weight_map is None:
      f = SafetensorsFile(folder / "model.safetensors")
      self._files = {"model.safetensors": f}
      self._where = {k: "model.safetensors" for k in f.keys()}
    else:
      missing = sorted({s for s in weight_map.values() if not (folder / s).is_file()})
      if missing:
        raise FileNotFoundError(f"{folder}: shard file(s) named in model.safetensors.index.json "
                                f"are missing: {missing}")
      self._files = {s: SafetensorsFile(folder / s) for s in sorted(set(weight_map.values()))}
      self._where = dict(weight_map)
      for s, f in self._files.items():  # tensors present but not indexed still count
        for k in f.keys():
          self._where.setdefault(k, s)

  def __contains__(self, key) -> bool:
    return key in self._where

  def keys(self):
    """The tensor names of every shard."""
    return self._where.keys()

  def shape(self, key) -> tuple:
    """Tensor ``key``'s shape from its shard's header (nothing is read)."""
    return self._files[self._where[key]].shape(key)

  def dtype(self, key) -> str:
    """Tensor ``key``'s safetensors dtype name, from its shard's header."""
    return self._files[self._where[key]].dtype(key)

  def read(self, key, expected_shape: Optional[tuple] = None) -> np.ndarray:
    """Reads ``key``; with ``expected_shape``, raises ValueError naming the tensor and both shapes."""
    if key not in self._where:
      raise KeyError(f"tensor {key!r} not found in the checkpoint")
    if expected_shape is not None and self.shape(key) != tuple(expected_shape):
      raise ValueError(f"tensor {key!r} has shape {list(self.shape(key))} but the config implies "
                       f"{list(expected_shape)}")
    return self._files[self._where[key]].read(key)


# ----------------------------------------------------------------------------- loading

def _resolve(path_or_hub_id) -> pathlib.Path:
  p = pathlib.Path(os.path.expanduser(str(path_or_hub_id)))
  if p.is_dir():
    return p
  if p.exists():
    raise ValueError(f"{p} is a file; pass the checkpoint folder")
  s = str(path_or_hub_id)
  # A hub id is "name" or "owner/name"; anything else can only have been meant as a local folder.
  if (isinstance(path_or_hub_id, os.PathLike) or p.is_absolute() or s.startswith((".", "~"))
      or s.count("/") > 1):
    raise FileNotFoundError(f"{p}: no such checkpoint folder")
  try:  # hub id: download safetensors + json + tokenizer files only (untested offline)
    from huggingface_hub import snapshot_download
  except ImportError as e:  # pragma: no cover
    raise FileNotFoundError(f"{path_or_hub_id!r} is not a folder and huggingface_hub is missing") from e
  try:
    return pathlib.Path(snapshot_download(
        s, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.txt", "*.model", "*.tiktoken"]))
  except Exception as e:  # pragma: no cover (needs the network)
    raise FileNotFoundError(f"{s!r} is not a local folder, and fetching it as a Hugging Face hub id "
                            f"failed: {type(e).__name__}: {e}") from e


_MODELOPT_ALGOS = ("NVFP4", "W4A16_NVFP4")  # ModelOpt's NVFP4 (W4A4) and NVFP4A16


def _check_quantization_config(config: dict, folder: pathlib.Path) -> None:
  qc = config.get("quantization_config")
  if qc is None and "quantization" in config:
    raise ValueError("config.json has a 'quantization' block without a quant_method (an MLX-style "
                     "quantized checkpoint); only bf16/fp16/fp32, compressed-tensors "
                     "nvfp4-pack-quantized and ModelOpt NVFP4 checkpoints are supported")
  hq = folder / "hf_quant_config.json"
  if qc is None:
    if hq.is_file():
      algo = json.loads(hq.read_text()).get("quantization", {}).get("quant_algo")
      if algo not in _MODELOPT_ALGOS:
        raise ValueError(f"hf_quant_config.json quant_algo {algo!r} is not supported (NVFP4 only)")
    return
  method = qc.get("quant_method")
  if method not in ("compressed-tensors", "modelopt"):
    raise ValueError(f"quantization_config.quant_method {method!r} is not supported; supported: "
                     "'compressed-tensors' (nvfp4-pack-quantized) and 'modelopt' (NVFP4)")
  if method == "modelopt":  # ModelOpt >= 0.37 writes quant_algo into config.json as well
    algo = qc.get("quant_algo")
    if algo is None and hq.is_file():
      algo = json.loads(hq.read_text()).get("quantization", {}).get("quant_algo")
    if algo is not None and algo not in _MODELOPT_ALGOS:
      raise ValueError(f"quantization_config.quant_algo {algo!r} (ModelOpt) is not supported; "
                       f"supported: {', '.join(_MODELOPT_ALGOS)}")
  if method == "compressed-tensors":
    formats = {g.get("format") or qc.get("format") for g in (qc.get("config_groups") or {}).values()}
    formats = formats or {qc.get("format")}
    bad = sorted(str(f) for f in formats - {"nvfp4-pack-quantized", "dense", None})
    if bad:
      raise ValueError(f"compressed-tensors format(s) {bad} are not supported; only "
                       "'nvfp4-pack-quantized' (NVFP4A16) checkpoints load")


class _LinearSource(NamedTuple):
  kind: str  # "float", "compressed", "modelopt"
  prefix: str


def _linear_source(reader: CheckpointReader, prefix: str) -> _LinearSource:
  if prefix + ".weight_packed" in reader:
    return _LinearSource("compressed", prefix)
  if prefix + ".weight_scale_2" in reader and prefix + ".weight" in reader:
    return _LinearSource("modelopt", prefix)
  if prefix + ".weight" in reader:
    dt = reader.dtype(prefix + ".weight")
    if dt not in ("F32", "F16", "BF16", "F64"):
      raise ValueError(f"tensor {prefix + '.weight'!r} has dtype {dt}, which is neither a float "
                       f"weight nor a recognised NVFP4 layout")
    return _LinearSource("float", prefix)
  raise ValueError(f"tensor {prefix + '.weight'!r} not found in the checkpoint")


def _read_nvfp4(reader: CheckpointReader, src: _LinearSource, k: int, n: int) -> nvfp4.NVFP4Tensor:
  p = src.prefix
  packed_key = p + (".weight_packed" if src.kind == "compressed" else ".weight")
  packed = reader.read(packed_key, (n, k // 2))
  scale = reader.read(p + ".weight_scale", (n, k // nvfp4.BLOCK_SIZE))
  if src.kind == "compressed":
    gs = np.asarray(reader.read(p + ".weight_global_scale"), np.float32).reshape(())
  else:
    ws2 = np.asarray(reader.read(p + ".weight_scale_2"), np.float32).reshape(())
    with np.errstate(divide="ignore"):
      gs = np.float32(1.0) / ws2
  try:
    return nvfp4.from_compressed_tensors(packed, scale, gs)
  except ValueError as e:
    raise ValueError(f"{p} ({src.kind} NVFP4): {e}") from None


@functools.partial(jax.jit, donate_argnums=0)
def _set_layer(buf, x, i):
  """``buf[i] = x`` in place (the donated stacked buffer is reused)."""
  return jax.lax.dynamic_update_index_in_dim(buf, x.astype(buf.dtype), i, 0)


def _load_stacked_linears(reader, cfg, group, names, quant, param_dtype, share_global_scale=False):
  """Stacked ``[L, K, N]`` linears ``names`` of ``group``, written layer by layer into preallocated
  device buffers; ``{name: array or 4-bit tensor}``.

  ``share_global_scale`` (NVFP4 from float weights): in each layer the parts are quantized with one
  global scale, the smallest of their own (what vLLM's fused q/k/v and gate/up kernels require);
  each weight is still read once, the parts of one layer held together in host memory. A layer
  whose parts are pre-quantized keeps the checkpoint's scales.
  """
  shapes = {name: cfg.linear_shapes()[(group, name)] for name in names}
  bufs, first_def = {}, {}
  for i in range(cfg.num_layers):
    srcs = {name: _linear_source(reader, f"model.layers.{i}.{HF_LINEARS[(group, name)]}") for name in names}
    read = lambda name: reader.read(srcs[name].prefix + ".weight", shapes[name][::-1]).astype(np.float32).T
    floats, gs = {}, None
    if share_global_scale and quant == "nvfp4" and all(src.kind == "float" for src in srcs.values()):
      floats = {name: read(name) for name in names}  # [K, N] each
      gs = np.min(np.asarray([nvfp4.compute_global_scale(w) for w in floats.values()], np.float32))
    for name in names:
      src, (k, n) = srcs[name], shapes[name]
      if src.kind != "float":
        t = _read_nvfp4(reader, src, k, n)
        if quant == "nvfp4":
          q = t
        else:
          w = nvfp4.dequantize(t, jnp.float32)
          q = nf4.quantize(w) if quant == "nf4" else w.astype(param_dtype)
      else:
        w = floats.pop(name) if name in floats else read(name)  # [K, N]
        if quant == "nvfp4":
          q = nvfp4.quantize(w, global_scale=gs)
        elif quant == "nf4":
          q = nf4.quantize(w)
        else:
          q = np.ascontiguousarray(w.astype(param_dtype))
        del w
      leaves, treedef = jax.tree_util.tree_flatten(q)
      if name not in bufs:
        bufs[name] = [jnp.zeros((cfg.num_layers,) + tuple(leaf.shape), leaf.dtype) for leaf in leaves]
        first_def[name] = treedef
      elif treedef != first_def[name]:
        raise ValueError(f"layer {i} of {src.prefix}: the layers of one linear mix weight formats")
      bufs[name] = [_set_layer(b, leaf, i) for b, leaf in zip(bufs[name], leaves)]
      del q, leaves
  return {name: jax.tree_util.tree_unflatten(first_def[name], bufs[name]) for name in names}


def _read_float(reader, key, shape, dtype) -> jax.Array:
  return jax.device_put(reader.read(key, shape).astype(dtype))


def load_pretrained(path_or_hub_id, *, quant: str = "nvfp4", dtype=jnp.bfloat16,
                    compute_dtype: str = "bfloat16", share_fused_global_scale: bool = False,
                    load_tokenizer: bool = True) -> Pretrained:
  """Loads a Hugging Face Qwen2/Qwen2.5, Qwen3 or Llama 3 checkpoint.

  Args:
    path_or_hub_id: a local folder, or a hub id (fetched with
      ``huggingface_hub.snapshot_download``; needs network).
    quant: ``"nvfp4"`` (decoder linears to NVFP4Tensor; an NVFP4 checkpoint is
      kept as stored), ``"nf4"`` or ``"none"`` (float linears in ``dtype``).
    dtype: dtype of the float parameters (embeddings, lm_head, norms, biases,
      and linears when ``quant="none"``); bf16 by default, float32 for parity tests.
    compute_dtype: ``ModelConfig.dtype`` of the returned config.
    share_fused_global_scale: give q/k/v (and gate/up) one NVFP4 global scale
      per layer, the smallest of the group (what vLLM's fused kernels and
      ``models.fuse_projections`` require; the group's float weights of one
      layer are then held in host memory together). A pre-quantized checkpoint
      keeps its own scales.
    load_tokenizer: load the tokenizer with ``transformers.AutoTokenizer``.

  Returns:
    :class:`Pretrained` ``(cfg, base, tokenizer, generation_config)`` (``tokenizer`` None when the folder has no
    tokenizer files, or ``load_tokenizer`` is False);
    ``generation_config["eos_token_ids"]`` lists every EOS id of
    generation_config.json and config.json (Qwen2.5-Instruct has two).

  Raises:
    ValueError: unsupported architecture (lists the supported ones), an
      unsupported quantization scheme, a non-floating ``dtype``, more layers in the checkpoint than
      ``num_hidden_layers``, a weights file that is not safetensors (named), ``tie_word_embeddings`` false with no
      ``lm_head.weight`` (names the key), a tensor whose shape disagrees with the
      config (names the tensor and both shapes), an unknown ``quant``, a file path given for the folder.
    FileNotFoundError: no such folder (and not a hub id that downloads), no config.json /
      safetensors, or a missing shard file.
    KeyError: a tensor the config needs (an embedding, a norm, a bias) missing from the checkpoint
      (names it).
  """
  if quant not in ("nvfp4", "nf4", "none"):
    raise ValueError(f"quant must be 'nvfp4', 'nf4' or 'none', got {quant!r}")
  if not jnp.issubdtype(dtype, jnp.floating):  # an integer dtype cast every weight to 0
    raise ValueError(f"dtype must be a floating dtype (bfloat16, float16, float32), got {np.dtype(dtype)}")
  folder = _resolve(path_or_hub_id)
  cfg_path = folder / "config.json"
  if not cfg_path.is_file():
    raise FileNotFoundError(f"{folder}: no config.json")
  config = json.loads(cfg_path.read_text())
  cfg = ModelConfig.from_hf(config, dtype=compute_dtype)
  _check_quantization_config(config, folder)
  reader = CheckpointReader(folder)
  dtype = np.dtype(dtype)
  V, D, L = cfg.vocab_size, cfg.hidden_size, cfg.num_layers

  base = {"embed": _read_float(reader, EMBED_KEY, (V, D), dtype),
          "final_norm": _read_float(reader, FINAL_NORM_KEY, (D,), dtype)}
  if not cfg.tie_word_embeddings:
    if LM_HEAD_KEY not in reader:
      raise ValueError(f"tie_word_embeddings is false but the checkpoint has no {LM_HEAD_KEY!r}; "
                       "refusing to initialise the output projection randomly")
    base["lm_head"] = jax.device_put(np.ascontiguousarray(reader.read(LM_HEAD_KEY, (V, D)).T.astype(dtype)))

  extra = sorted({int(k.split(".")[2]) for k in reader.keys() if k.startswith("model.layers.")
                  and k.split(".")[2].isdigit() and int(k.split(".")[2]) >= L})
  if extra:  # they were dropped without a word
    raise ValueError(f"the checkpoint has layers up to {extra[-1]} but config.json's num_hidden_layers is {L}")
  lay = {"attn": {}, "mlp": {}}
  for ours, hf_name in HF_NORMS.items():
    lay[ours] = jax.device_put(np.stack([reader.read(f"model.layers.{i}.{hf_name}", (D,)).astype(dtype)
                                         for i in range(L)]))
  for group, names in (("attn", ("q", "k", "v")), ("attn", ("o",)), ("mlp", ("gate", "up")), ("mlp", ("down",))):
    if share_fused_global_scale:
      lay[group].update(_load_stacked_linears(reader, cfg, group, names, quant, dtype, share_global_scale=True))
    else:  # one matrix at a time: the least host memory
      for name in names:
        lay[group].update(_load_stacked_linears(reader, cfg, group, (name,), quant, dtype))
  if cfg.attention_bias:
    sizes = {"q_bias": cfg.q_dim, "k_bias": cfg.kv_dim, "v_bias": cfg.kv_dim}
    for ours, hf_name in HF_BIASES.items():
      lay["attn"][ours] = jax.device_put(np.stack(
          [reader.read(f"model.layers.{i}.{hf_name}", (sizes[ours],)).astype(dtype) for i in range(L)]))
  if cfg.qk_norm:
    for ours, hf_name in HF_QK_NORMS.items():
      lay["attn"][ours] = jax.device_put(np.stack(
          [reader.read(f"model.layers.{i}.{hf_name}", (cfg.head_dim,)).astype(dtype) for i in range(L)]))
  base["layers"] = lay

  tokenizer = _load_tokenizer(folder) if load_tokenizer else None
  return Pretrained(cfg, base, tokenizer, load_generation_config(folder, config))


def load_tokenizer(path_or_hub_id):
  """The tokenizer of a checkpoint (``transformers.AutoTokenizer``), without reading its weights: the same one
  :func:`load_pretrained` returns. The trainer reads its data with it before the model loads.

  Args:
    path_or_hub_id: as :func:`load_pretrained`'s (a hub id downloads the checkpoint, as there).

  Returns:
    The tokenizer, or None when the folder has no tokenizer files.

  Raises:
    FileNotFoundError: no such folder (and not a hub id that downloads). ValueError: a file path given for the
    folder.
  """
  return _load_tokenizer(_resolve(path_or_hub_id))


def _load_tokenizer(folder: pathlib.Path):
  names = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
  if not any((folder / n).is_file() for n in names):
    return None
  from transformers import AutoTokenizer
  return AutoTokenizer.from_pretrained(str(folder))


def _as_list(x) -> list:
  if x is None:
    return []
  return [int(v) for v in x] if isinstance(x, (list, tuple)) else [int(x)]


def load_generation_config(folder, config: Optional[dict] = None) -> dict:
  """``generation_config.json`` (or ``{}``) plus ``"eos_token_ids"``: the ordered union of
  its ``eos_token_id`` and config.json's (Qwen2.5-Instruct: [151645, 151643])."""
  folder = pathlib.Path(folder)
  gen_path = folder / "generation_config.json"
  gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
  if config is None and (folder / "config.json").is_file():
    config = json.loads((folder / "config.json").read_text())
  eos = []
  for v in _as_list(gen.get("eos_token_id")) + _as_list((config or {}).get("eos_token_id")):
    if v not in eos:
      eos.append(v)
  gen = dict(gen)
  gen["eos_token_ids"] = eos
  return gen


# ----------------------------------------------------------------------------- export

def to_hf_state_dict(cfg: ModelConfig, base: dict, dtype=ml_dtypes.bfloat16) -> dict:
  """The base as a Hugging Face state dict: ``{hf_key: np.ndarray}`` in ``dtype``.

  Linears are transposed back to ``[out, in]``; 4-bit linears are dequantized
  (merge LoRA into a float base first to export a merged model); fused
  projections are split back into q/k/v and gate/up. Tied models get no
  ``lm_head.weight``.

  Raises:
    ValueError: a fused projection whose width does not match ``cfg`` (``unfuse_projections``).
  """
  from qerl_jax.models import fuse
  if fuse.is_fused(base):
    base = fuse.unfuse_projections(base, cfg)
  out = {}
  np_dt = np.dtype(dtype)
  f = lambda a: np.asarray(jnp.asarray(a).astype(jnp.float32)).astype(np_dt)
  out[EMBED_KEY] = f(base["embed"])
  out[FINAL_NORM_KEY] = f(base["final_norm"])
  if not cfg.tie_word_embeddings:
    out[LM_HEAD_KEY] = np.ascontiguousarray(f(base["lm_head"]).T)
  lay = decoder.dequantize_base(base, jnp.float32)["layers"]
  for i in range(cfg.num_layers):
    pre = f"model.layers.{i}."
    for ours, hf_name in HF_NORMS.items():
      out[pre + hf_name] = f(lay[ours][i])
    for (group, name), hf_name in HF_LINEARS.items():
      out[pre + hf_name + ".weight"] = np.ascontiguousarray(f(lay[group][name][i]).T)
    if cfg.attention_bias:
      for ours, hf_name in HF_BIASES.items():
        out[pre + hf_name] = f(lay["attn"][ours][i])
    if cfg.qk_norm:
      for ours, hf_name in HF_QK_NORMS.items():
        out[pre + hf_name] = f(lay["attn"][ours][i])
  return out


def save_pretrained(folder, cfg: ModelConfig, base: dict, *, dtype=ml_dtypes.bfloat16,
                    tokenizer=None, generation_config: Optional[dict] = None,
                    max_shard_bytes: int = 4 << 30) -> None:
  """Writes a transformers-loadable checkpoint: config.json, safetensors shards (+ index),
  optional tokenizer and generation_config.json. 4-bit linears are dequantized to ``dtype``."""
  folder = pathlib.Path(folder)
  folder.mkdir(parents=True, exist_ok=True)
  sd = to_hf_state_dict(cfg, base, dtype)
  hf_cfg = cfg.to_hf()
  hf_cfg["torch_dtype"] = {"bfloat16": "bfloat16", "float32": "float32", "float16": "float16"}[np.dtype(dtype).name]
  (folder / "config.json").write_text(json.dumps(hf_cfg, indent=2))
  shards, cur, size = [], {}, 0
  for k, v in sd.items():
    if cur and size + v.nbytes > max_shard_bytes:
      shards.append(cur)
      cur, size = {}, 0
    cur[k] = v
    size += v.nbytes
  shards.append(cur)
  if len(shards) == 1:
    save_safetensors(folder / "model.safetensors", shards[0], {"format": "pt"})
  else:
    weight_map = {}
    for j, shard in enumerate(shards):
      name = f"model-{j + 1:05d}-of-{len(shards):05d}.safetensors"
      save_safetensors(folder / name, shard, {"format": "pt"})
      weight_map.update({k: name for k in shard})
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": int(sum(v.nbytes for v in sd.values()))}, "weight_map": weight_map},
        indent=2))
  if generation_config:
    gen = {k: v for k, v in generation_config.items() if k != "eos_token_ids"}
    if "eos_token_ids" in generation_config:
      gen["eos_token_id"] = generation_config["eos_token_ids"]
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2))
  if tokenizer is not None:
    tokenizer.save_pretrained(str(folder))


def base_from_state_dict(cfg: ModelConfig, state_dict: Mapping[str, Any], *, dtype=np.float32) -> dict:
  """A float base tree from an in-memory HF state dict (numpy / torch tensors), e.g.
  ``model.state_dict()`` of a transformers model; for tests and small models.

  Returns:
    ``{"embed": [V, D], "final_norm": [D], "layers": {...}, "lm_head": [D, V] (untied only)}`` in
    ``dtype`` (default float32), the layers stacked over ``L``: linears ``[L, in, out]`` (transposed
    from HF's ``[out, in]``), norms ``[L, D]``, and the q/k/v biases and q/k norms where ``cfg`` has them.

  Raises:
    ValueError: ``cfg.tie_word_embeddings`` is false and the state dict has no ``lm_head.weight``.
    KeyError: a tensor ``cfg`` needs is missing from ``state_dict``.
  """
  sd = {k: np.asarray(v.detach().float().numpy() if hasattr(v, "detach") else v) for k, v in state_dict.items()}
  L = cfg.num_layers
  g = lambda key: sd[key].astype(dtype)
  lay = {"attn": {}, "mlp": {}}
  for ours, hf_name in HF_NORMS.items():
    lay[ours] = jnp.asarray(np.stack([g(f"model.layers.{i}.{hf_name}") for i in range(L)]))
  for (group, name), hf_name in HF_LINEARS.items():
    lay[group][name] = jnp.asarray(np.stack([g(f"model.layers.{i}.{hf_name}.weight").T for i in range(L)]))
  if cfg.attention_bias:
    for ours, hf_name in HF_BIASES.items():
      lay["attn"][ours] = jnp.asarray(np.stack([g(f"model.layers.{i}.{hf_name}") for i in range(L)]))
  if cfg.qk_norm:
    for ours, hf_name in HF_QK_NORMS.items():
      lay["attn"][ours] = jnp.asarray(np.stack([g(f"model.layers.{i}.{hf_name}") for i in range(L)]))
  base = {"embed": jnp.asarray(g(EMBED_KEY)), "final_norm": jnp.asarray(g(FINAL_NORM_KEY)), "layers": lay}
  if not cfg.tie_word_embeddings:
    if LM_HEAD_KEY not in sd:
      raise ValueError(f"tie_word_embeddings is false but the state dict has no {LM_HEAD_KEY!r}")
    base["lm_head"] = jnp.asarray(g(LM_HEAD_KEY).T)
  return base
