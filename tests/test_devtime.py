"""experiments/devtime.py: kernel durations from a perfetto trace (hand-made), and the CPU fallback."""

import gzip
import importlib.util
import json
import pathlib

import jax.numpy as jnp
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load():
  spec = importlib.util.spec_from_file_location("devtime", ROOT / "experiments" / "devtime.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_kernel_durations_sums_device_events_only(tmp_path):
  devtime = _load()
  events = [
      {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
      {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
      {"ph": "X", "pid": 1, "name": "w4a16_fwd", "ts": 10, "dur": 7.5},
      {"ph": "X", "pid": 1, "name": "w4a16_fwd", "ts": 30, "dur": 8.5},
      {"ph": "X", "pid": 1, "name": "memcpy128", "ts": 50, "dur": 2.0},
      {"ph": "X", "pid": 2, "name": "w4a16_fwd", "ts": 0, "dur": 100.0},   # host-side op: not counted
      {"ph": "i", "pid": 1, "name": "marker", "ts": 5},                     # not a complete event
  ]
  f = tmp_path / "t.perfetto_trace.json.gz"
  with gzip.open(f, "wt") as fh:
    json.dump({"traceEvents": events}, fh)
  timeline = []
  assert devtime.kernel_durations(str(f), events=timeline) == {"w4a16_fwd": [7.5, 8.5], "memcpy128": [2.0]}
  assert timeline == [("w4a16_fwd", 10.0, 7.5), ("w4a16_fwd", 30.0, 8.5), ("memcpy128", 50.0, 2.0)]
  plain = tmp_path / "t.json"
  plain.write_text(json.dumps(events))  # a bare event list is accepted too
  assert devtime.kernel_durations(str(plain), device_marker="/host:CPU") == {"w4a16_fwd": [100.0]}
  bad = tmp_path / "bad.json"
  bad.write_text(json.dumps({"x": 1}))
  with pytest.raises(ValueError, match="no traceEvents"):
    devtime.kernel_durations(str(bad))


def test_device_time_is_none_without_device_events():
  devtime = _load()
  if any(d.platform == "gpu" for d in __import__("jax").devices()):
    pytest.skip("has a GPU: device events exist")
  assert devtime.device_time(lambda a: a * 2, jnp.ones(4)) is None
