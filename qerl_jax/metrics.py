"""Run logging: per-step metrics to JSONL and TensorBoard, rollout samples, a summary table.

Files written into a run's workdir:

* ``metrics.jsonl``: one JSON object per line, ``{"step": int, "<name>": float, ...}``;
  evaluation lines carry ``eval/...`` keys. Non-finite values are written as ``null``.
* ``samples.jsonl``: every ``log_samples_every`` steps, a few prompts, completions and rewards.
* ``tensorboard/``: the same scalars as TensorBoard event files (``tensorboardX``).

Resuming: ``MetricsLogger(workdir, resume_step=s)`` drops every line with ``step > s`` from the
JSONL files first, so the lines written after the last checkpoint by a killed run are replaced
by the resumed run's lines and the files match an uninterrupted run's. Its TensorBoard writer starts with
``purge_step = s + 1``, which tells TensorBoard to drop the earlier events of those steps the same way.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

__all__ = [
    "MetricsLogger", "read_metrics", "peak_device_memory_bytes", "format_summary_table",
    "TIMING_KEYS",
]

# Metrics that measure wall time (and so differ between two runs of the same config).
TIMING_KEYS = ("time/", "perf/")


def _to_float(v: Any) -> float | None:
  try:
    f = float(np.asarray(v))
  except (TypeError, ValueError):
    return None
  return f if math.isfinite(f) else None


def _rows(path: str) -> Iterable[dict]:
  """The rows of a JSONL log: the lines that are JSON objects with an integer ``step``. Other lines (one torn
  by a kill mid-write, or anything else written into the file) are passed over."""
  with open(path) as f:
    for line in f:
      try:
        row = json.loads(line)
      except json.JSONDecodeError:
        continue
      if isinstance(row, dict) and isinstance(row.get("step"), int) and not isinstance(row["step"], bool):
        yield row


def _truncate_jsonl(path: str, max_step: int) -> None:
  """Keeps only the rows of ``path`` (:func:`_rows`) whose ``step`` is <= ``max_step``."""
  if not os.path.exists(path):
    return
  kept = [json.dumps(row, sort_keys=True) for row in _rows(path) if row["step"] <= max_step]
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    f.writelines(line + "\n" for line in kept)
  os.replace(tmp, path)


class MetricsLogger:
  """Writes scalar metrics to ``metrics.jsonl`` and TensorBoard, and samples to ``samples.jsonl``.

  Args:
    workdir: the run's folder (created when missing).
    resume_step: when resuming from a checkpoint at this step, lines with a larger step are
      removed from the JSONL files first; None starts fresh (existing files are truncated).
    tensorboard: also write TensorBoard event files under ``workdir/tensorboard``.
  """

  def __init__(self, workdir: str, *, resume_step: int | None = None, tensorboard: bool = True):
    os.makedirs(workdir, exist_ok=True)
    self.workdir = workdir
    self.metrics_path = os.path.join(workdir, "metrics.jsonl")
    self.samples_path = os.path.join(workdir, "samples.jsonl")
    for path in (self.metrics_path, self.samples_path):
      _truncate_jsonl(path, -1 if resume_step is None else int(resume_step))
    self._metrics_file = open(self.metrics_path, "a")
    self._samples_file = open(self.samples_path, "a")
    self._tb = None
    if tensorboard:
      from tensorboardX import SummaryWriter  # imported lazily: heavy
      # resuming: TensorBoard drops the events a killed run wrote after the checkpoint (steps > resume_step),
      # which the resumed run writes again (as the JSONL files above)
      self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"),
                               purge_step=None if resume_step is None else int(resume_step) + 1)

  def write(self, step: int, metrics: Mapping[str, Any]) -> dict:
    """Logs scalar ``metrics`` at ``step``; returns the row written (floats or None)."""
    row = {"step": int(step)}
    for k, v in metrics.items():
      row[str(k)] = _to_float(v)
    self._metrics_file.write(json.dumps(row, sort_keys=True) + "\n")
    self._metrics_file.flush()
    if self._tb is not None:
      for k, v in row.items():
        if k != "step" and v is not None:
          self._tb.add_scalar(k, v, int(step))
    return row

  def write_samples(self, step: int, prompts: Sequence[str], completions: Sequence[str],
                    rewards: Sequence[float], answers: Sequence[str] | None = None) -> None:
    """Logs one JSON line per sample: step, prompt, completion, reward (and gold answer)."""
    for i, (p, c, r) in enumerate(zip(prompts, completions, rewards)):
      row = {"step": int(step), "index": i, "prompt": p, "completion": c, "reward": _to_float(r)}
      if answers is not None:
        row["answer"] = answers[i]
      self._samples_file.write(json.dumps(row, sort_keys=True) + "\n")
    self._samples_file.flush()
    if self._tb is not None and prompts:
      self._tb.add_text("samples", f"**prompt**: {prompts[0]}\n\n**completion**: {completions[0]}"
                        f"\n\n**reward**: {rewards[0]}", int(step))

  def flush(self) -> None:
    """Writes what is buffered to disk: the JSONL files (flushed at every write already) and the TensorBoard
    events, which tensorboardX otherwise holds for up to two minutes (the trainer calls this at every
    checkpoint, so that a killed run's events reach at least its last checkpoint)."""
    self._metrics_file.flush()
    self._samples_file.flush()
    if self._tb is not None:
      self._tb.flush()

  def close(self) -> None:
    """Flushes and closes every file."""
    self._metrics_file.close()
    self._samples_file.close()
    if self._tb is not None:
      self._tb.close()


def read_metrics(workdir: str) -> list[dict]:
  """Reads ``<workdir>/metrics.jsonl`` into a list of dicts, each with an integer ``step`` (torn lines, and
  lines that are not such objects, skipped).

  Raises:
    FileNotFoundError: the workdir has no metrics.jsonl file.
  """
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"no metrics.jsonl in workdir {workdir!r}")
  return list(_rows(path))


def peak_device_memory_bytes() -> int | None:
  """Peak bytes in use on the first local device (``memory_stats()['peak_bytes_in_use']``).

  Returns None where the backend does not report it (the CPU backend usually does not).
  """
  import jax
  try:
    stats = jax.local_devices()[0].memory_stats()
  except Exception:  # pylint: disable=broad-except
    return None
  if not stats:
    return None
  v = stats.get("peak_bytes_in_use", stats.get("bytes_in_use"))
  return None if v is None else int(v)


def format_summary_table(rows: Iterable[tuple[str, Any]]) -> str:
  """Formats ``(name, value)`` pairs as a two-column text table (floats to 4 significant digits)."""
  rows = [(str(k), (f"{v:.4g}" if isinstance(v, float) else str(v))) for k, v in rows]
  if not rows:
    return ""
  w0 = max(len(k) for k, _ in rows)
  w1 = max(len(v) for _, v in rows)
  line = "+" + "-" * (w0 + 2) + "+" + "-" * (w1 + 2) + "+"
  out = [line] + [f"| {k:<{w0}} | {v:>{w1}} |" for k, v in rows] + [line]
  return "\n".join(out)
