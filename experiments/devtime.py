"""Device (GPU kernel) time of a jitted program, read from a ``jax.profiler`` trace.

Wall-clock timing around ``block_until_ready`` counts dispatch and launch gaps,
which dominate small kernels (a 25 MB bf16 GEMV shows 20 µs of wall time for
about 8 µs of kernel time on an H200). ``jax.profiler.trace(...,
create_perfetto_trace=True)`` records every kernel's device start and duration
(CUPTI); this module sums them. Used by experiments/bench_kernels.py and the lab
scripts under experiments/lab/.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import tempfile
from typing import Callable, Optional

import jax


def kernel_durations(trace_file: str, device_marker: str = "/device:GPU", events: Optional[list] = None
                     ) -> dict[str, list[float]]:
  """Durations (µs) of the complete events on device processes of a perfetto JSON trace, by name.

  Args:
    trace_file: a ``*.perfetto_trace.json.gz`` (or plain ``.json``) written by
      ``jax.profiler.trace(..., create_perfetto_trace=True)``.
    device_marker: substring of the process names that hold device events.
    events: if given, ``(name, start µs, duration µs)`` of every device event is appended to it.

  Returns:
    ``{kernel name: [duration in µs, ...]}`` in trace order; empty when the
    trace has no device process (a CPU run).

  Raises:
    OSError: the file cannot be read. ValueError: it is not a trace (no event list).
  """
  opener = gzip.open if trace_file.endswith(".gz") else open
  with opener(trace_file, "rt") as f:
    data = json.load(f)
  trace = data.get("traceEvents") if isinstance(data, dict) else data
  if not isinstance(trace, list):
    raise ValueError(f"{trace_file}: no traceEvents list; not a perfetto JSON trace")
  names = {e["pid"]: e.get("args", {}).get("name", "") for e in trace
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  out: dict[str, list[float]] = collections.defaultdict(list)
  for e in trace:
    if e.get("ph") == "X" and device_marker in names.get(e.get("pid"), ""):
      out[e.get("name", "?")].append(float(e.get("dur", 0.0)))
      if events is not None:
        events.append((e.get("name", "?"), float(e.get("ts", 0.0)), float(e.get("dur", 0.0))))
  return dict(out)


def trace_durations(fn: Callable, *args, events: Optional[list] = None) -> dict[str, list[float]]:
  """Kernel durations (µs, by name) of one call ``fn(*args)``, after one warm-up call; ``events``
  as in :func:`kernel_durations`.

  Returns:
    :func:`kernel_durations` of a ``jax.profiler`` trace of the second call;
    empty without device events (CPU).

  Raises:
    whatever ``fn`` raises.
  """
  jax.block_until_ready(fn(*args))
  with tempfile.TemporaryDirectory(prefix="devtime_") as d:
    with jax.profiler.trace(d, create_perfetto_trace=True):
      jax.block_until_ready(fn(*args))
    files = glob.glob(os.path.join(d, "**", "*perfetto_trace.json*"), recursive=True)
    return kernel_durations(files[0], events=events) if files else {}


def device_time(fn: Callable, *args) -> Optional[float]:
  """Seconds of device kernel time that one call ``fn(*args)`` takes, or None without device events.

  The durations of every kernel of one traced call (:func:`trace_durations`)
  are summed; gaps between kernels are not counted. Divide by the number of operations ``fn`` runs to
  get a per-op time.

  Raises:
    whatever ``fn`` raises.
  """
  durs = trace_durations(fn, *args)
  return sum(sum(v) for v in durs.values()) * 1e-6 if durs else None
