"""Training checkpoints with orbax: the trainable state only, never the frozen base.

One checkpoint (a numbered folder under ``<workdir>/checkpoints``) holds

* ``state``: a pytree with the LoRA tree (plus trainable RMSNorm scales when they are trained),
  the optax optimizer state, the step counter (int32 scalar) and the run's PRNG key
  (``uint32 [2]`` raw key data);
* ``meta``: JSON with the step, the data position (how many batches of prompts the seeded order
  has served: ``data.DataOrder.batch_indices`` takes it as the next batch's number), the epoch, and
  the full config as JSON, so a checkpoint says how it was made.

The frozen base weights are reloaded from their source (``config.model.path``) on resume.

Saves are asynchronous (orbax writes in a background thread while the next step computes) and
atomic: orbax writes into a temporary folder and renames it when the write is complete, so a
process killed in the middle of a save leaves either the previous checkpoint set or the new
complete one; ``latest_step`` ignores unfinished temporary folders and :class:`Checkpointer`
deletes them when it opens the folder for training (not when opened ``read_only``, as evaluation
does, so that evaluating a run while it trains never removes the save in progress). The last
``keep`` checkpoints are kept.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Any, Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp

__all__ = ["Checkpointer"]


class Checkpointer:
  """A thin wrapper over ``orbax.checkpoint.CheckpointManager`` for the training state.

  Args:
    directory: folder for the numbered checkpoints (created when missing); str or path.
    keep: how many of the most recent checkpoints to keep (>= 1).
    async_save: write in a background thread (default True). ``wait()`` blocks until done.
    read_only: open for restoring only (evaluation, export): the folder is neither created nor
      cleaned, so a training process that is saving into it at the same moment keeps its
      unfinished save; :meth:`save` then raises.

  Raises:
    ValueError: ``keep < 1``.
  """

  def __init__(self, directory: str | os.PathLike, *, keep: int = 3, async_save: bool = True,
               read_only: bool = False):
    if int(keep) < 1:
      raise ValueError(f"checkpoint keep must be >= 1, got keep={keep}")
    self.directory = os.path.abspath(os.fspath(directory))
    self.read_only = bool(read_only)
    if not self.read_only:
      _remove_unfinished(self.directory)
    else:
      _quiet_read_only_notice()
    options = ocp.CheckpointManagerOptions(
        # read-only: the values orbax would force (and warn about), given here
        max_to_keep=None if self.read_only else int(keep),
        save_interval_steps=0 if self.read_only else 1,
        create=not self.read_only,
        cleanup_tmp_directories=not self.read_only,
        read_only=self.read_only,
        enable_async_checkpointing=bool(async_save),
    )
    self._manager = ocp.CheckpointManager(
        self.directory, options=options, item_names=("state", "meta"))

  def latest_step(self) -> int | None:
    """The step of the newest complete checkpoint, or None when there is none."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def all_steps(self) -> list[int]:
    """Steps of all complete checkpoints, ascending: numbered folders that hold both items (``state`` and
    ``meta``). Orbax counts any numbered folder as a step; one without the items (made by hand, or copied in
    part) is not a checkpoint and would stop a resume, so it is left out."""
    return sorted(s for s in self._manager.all_steps()
                  if all(os.path.isdir(os.path.join(self.directory, str(s), item)) for item in ("state", "meta")))

  def incomplete_steps(self) -> list[int]:
    """Numbered folders under the directory that are not complete checkpoints (no ``state`` or ``meta``
    inside: a save cut short, or a folder made by hand), ascending; :meth:`all_steps` leaves them out."""
    if not os.path.isdir(self.directory):
      return []
    complete = set(self.all_steps())
    return sorted(int(n) for n in os.listdir(self.directory)
                  if n.isdigit() and os.path.isdir(os.path.join(self.directory, n)) and int(n) not in complete)

  def _step_or_latest(self, step: int | None) -> int:
    """``step``, or the newest complete checkpoint's when None; FileNotFoundError when there is none."""
    if step is None:
      step = self.latest_step()
    if step is None:
      raise FileNotFoundError(f"no complete checkpoint under {self.directory}")
    return int(step)

  def restore_meta(self, step: int | None = None) -> dict:
    """The ``meta`` JSON of ``step`` (None: the latest) alone, without reading the state's arrays.

    Raises:
      FileNotFoundError: no complete checkpoint in the directory.
    """
    step = self._step_or_latest(step)
    restored = self._manager.restore(int(step), args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    return dict(restored["meta"])

  def save(self, step: int, state: Any, meta: Mapping[str, Any]) -> None:
    """Starts saving ``state`` (a pytree of arrays) and ``meta`` (JSON-serialisable) at ``step``.

    Returns as soon as the arrays are copied to host memory; the write continues in the
    background. A save at a step that already exists is skipped (orbax refuses it).

    Raises:
      PermissionError: the checkpointer was opened with ``read_only=True``.
    """
    if self.read_only:
      raise PermissionError(f"Checkpointer({self.directory!r}) was opened read-only; it cannot save")
    if step in self._manager.all_steps():
      return
    self._manager.save(
        int(step),
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            meta=ocp.args.JsonSave(_jsonable(dict(meta))),
        ),
    )

  def restore(self, step: int | None, target: Any) -> tuple[Any, dict]:
    """Restores ``(state, meta)`` of ``step`` (None: the latest).

    Args:
      step: checkpoint step, or None for the latest.
      target: a pytree with the same structure, shapes and dtypes as the saved state
        (e.g. a freshly initialised state); the restored arrays take its dtypes.

    Raises:
      FileNotFoundError: no complete checkpoint in the directory.
    """
    step = self._step_or_latest(step)
    abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, target)
    restored = self._manager.restore(
        int(step),
        args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract),
            meta=ocp.args.JsonRestore(),
        ),
    )
    return restored["state"], dict(restored["meta"])

  def wait(self) -> None:
    """Blocks until every pending asynchronous save has been written."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for pending saves and releases the manager's threads."""
    self._manager.wait_until_finished()
    self._manager.close()


def _remove_unfinished(directory: str) -> None:
  """Deletes the temporary folders of saves that never finished (a process killed mid-save).

  Orbax writes ``<step>.orbax-checkpoint-tmp*`` and renames it to ``<step>`` only when the save
  is complete; such a folder is never a checkpoint, and a later save of the same step would
  collide with it. Single-writer assumption: only the training process writes here.
  """
  if not os.path.isdir(directory):
    return
  for name in os.listdir(directory):
    if ".orbax-checkpoint-tmp" in name:
      shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def _jsonable(x: Any) -> Any:
  """Converts numpy scalars/arrays and tuples inside ``x`` to plain JSON types."""
  if isinstance(x, Mapping):
    return {str(k): _jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_jsonable(v) for v in x]
  if isinstance(x, np.generic):
    return x.item()
  if isinstance(x, np.ndarray):
    return x.tolist()
  if isinstance(x, (str, int, float, bool)) or x is None:
    return x
  return json.loads(json.dumps(x, default=str))


class _DropReadOnlyNotice(logging.Filter):
  """Drops orbax's ``Given directory is read only=<dir>`` warning: orbax logs it whenever a manager is opened
  read-only, which is what ``Checkpointer(read_only=True)`` asks for, so it only alarms (eval printed it twice)."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("Given directory is read only")


def _quiet_read_only_notice() -> None:
  """Installs :class:`_DropReadOnlyNotice` on absl's logger (orbax logs through absl), once."""
  log = logging.getLogger("absl")
  if not any(isinstance(f, _DropReadOnlyNotice) for f in log.filters):
    log.addFilter(_DropReadOnlyNotice())
