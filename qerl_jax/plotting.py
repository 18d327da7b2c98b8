"""PNG training curves from runs' ``metrics.jsonl`` (matplotlib, Agg backend; no display needed)."""

from __future__ import annotations

import math
import os
from typing import Sequence

from qerl_jax import metrics as metrics_lib

__all__ = ["PANELS", "plot_runs"]

# (file stem, y label, metric keys tried in order: the first one a run logged is drawn)
PANELS = (
    ("reward", "mean reward", ("reward",)),
    ("accuracy", "greedy eval accuracy", ("eval/accuracy",)),
    ("train_accuracy", "rollout accuracy", ("accuracy",)),
    ("entropy", "policy entropy (nats/token)", ("entropy",)),
    ("kl", "KL to base policy", ("kl",)),
    ("response_length", "mean completion length (tokens)", ("completions/mean_length",)),
    ("sigma", "AQN sigma", ("aqn/sigma",)),
)


def _series(rows: list[dict], keys: Sequence[str]):
  for key in keys:
    pts = [(r["step"], r[key]) for r in rows
           if r.get(key) is not None and isinstance(r[key], (int, float)) and math.isfinite(r[key])]
    if pts:
      return key, pts
  return None, []


def plot_runs(workdirs: Sequence[str], out_dir: str, *, labels: Sequence[str] | None = None) -> list[str]:
  """Writes one PNG per panel of :data:`PANELS` with one line per run; returns the paths.

  Args:
    workdirs: run folders, each with a ``metrics.jsonl``.
    out_dir: output folder (created).
    labels: one label per workdir (default: each folder's base name).

  Raises:
    ValueError: ``labels`` of the wrong length, or no workdir given.
    FileNotFoundError: a workdir without metrics.jsonl.
  """
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  workdirs = list(workdirs)
  if not workdirs:
    raise ValueError("plot_runs needs at least one workdir")
  if labels is None:
    labels = [os.path.basename(os.path.normpath(w)) for w in workdirs]
  if len(labels) != len(workdirs):
    raise ValueError(f"{len(labels)} labels for {len(workdirs)} workdirs")
  runs = [metrics_lib.read_metrics(w) for w in workdirs]
  os.makedirs(out_dir, exist_ok=True)
  paths = []
  for stem, ylabel, keys in PANELS:
    fig, ax = plt.subplots(figsize=(6, 4))
    drawn = 0
    for label, rows in zip(labels, runs):
      _, pts = _series(rows, keys)
      if pts:
        xs, ys = zip(*pts)
        ax.plot(xs, ys, marker="." if len(xs) < 30 else None, label=label)
        drawn += 1
    if drawn:
      ax.set_xlabel("step")
      ax.set_ylabel(ylabel)
      ax.grid(alpha=0.3)
      ax.legend()
      fig.tight_layout()
      path = os.path.join(out_dir, f"{stem}.png")
      fig.savefig(path, dpi=100)
      paths.append(path)
    plt.close(fig)
  return paths
