"""Math data sets, chat prompts, left-padded prompt batches, and a resumable data order.

* :func:`load_examples` reads GSM8K- or MATH-style rows from a local JSONL file (the real
  files in ``../shared/data``) or, given a hub id, through ``datasets.load_dataset``.
  Rows it cannot use are skipped and counted, never fatal.
* :func:`build_prompt` renders one problem with the tokenizer's chat template and a
  configurable system prompt; :func:`tokenize_prompts` makes a left-padded
  ``tokens [B, P]`` / ``mask [B, P]`` numpy batch for the sampler's prefill.
* :class:`DataOrder` is a seeded shuffle per epoch addressed by one integer ``position``
  (batches served so far); store it in the checkpoint and the resumed run serves the
  identical sequence of batches.

Fields by data set (one JSON object per line):

=========  ===================  ==========================================
set        problem field        answer field
=========  ===================  ==========================================
gsm8k      ``question``         ``answer``: reasoning, then ``#### <number>``
math500    ``problem``          ``answer``: LaTeX
aime24     ``problem``          ``answer``: integer as text
amc23      ``problem``          ``answer``: a float such as 27.0
=========  ===================  ==========================================

Pure Python + numpy; the tokenizer is any Hugging Face tokenizer (``transformers``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from typing import Any, Iterator, Optional, Sequence

import numpy as np

from qerl_jax import rewards

logger = logging.getLogger(__name__)

KINDS = ("gsm8k", "math")

# Default instructions; both are plain config (override them per recipe).
GSM8K_USER_TEMPLATE = "{question}\nLet's think step by step and output the final answer after \"####\"."
MATH_USER_TEMPLATE = "{question}\nPlease reason step by step, and put your final answer within \\boxed{{}}."


@dataclasses.dataclass(frozen=True)
class Example:
  """One problem.

  Attributes:
    question: the problem text.
    answer: the gold final answer: a canonical number string for GSM8K (``"1000"``; a fraction
      whose decimal does not terminate stays ``"p/q"``, as :func:`qerl_jax.rewards.extract_gsm8k_answer` gives it), the
      LaTeX answer for MATH-style sets (``"\\frac{14}{3}"``; a float such as 27.0 becomes
      ``"27"``).
    kind: ``"gsm8k"`` or ``"math"`` (which reward applies).
    row: the 0-based row (line) number in the source.
    solution: the reference solution text when the source has one, else ``""``.
  """

  question: str
  answer: str
  kind: str
  row: int
  solution: str = ""


@dataclasses.dataclass(frozen=True)
class LoadReport:
  """What :func:`load_examples` read: ``rows`` seen, ``kept``, and ``skipped`` as
  ``(row, reason)`` pairs."""

  source: str
  rows: int
  kept: int
  skipped: tuple[tuple[int, str], ...]

  @property
  def num_skipped(self) -> int:
    """How many records were left out (``len(skipped)``)."""
    return len(self.skipped)


def _answer_text(value: Any) -> Optional[str]:
  """A MATH-style gold answer as text: str stripped; int/float to a canonical number."""
  if isinstance(value, bool):
    return None
  if isinstance(value, (int, float)):
    if not math.isfinite(value):
      return None
    return str(int(value)) if float(value).is_integer() else repr(float(value))
  if isinstance(value, str) and value.strip():
    return value.strip()
  return None


def parse_row(row: Any, kind: str, index: int) -> Example:
  """Turns one parsed JSON row into an :class:`Example`.

  Args:
    row: a dict from the JSONL file or the hub data set.
    kind: ``"gsm8k"`` (``question`` + ``answer`` with ``#### n``) or ``"math"``: the problem from
      ``problem``, ``question`` or ``prompt`` (the first that is a non-empty string), the gold answer from
      ``answer``, or else from ``solution``: the last ``\boxed{}`` of a worked solution (Hendrycks MATH), or
      the whole field when it has no box (open-r1/Big-Math-RL-Verified-Processed renames ``problem`` to
      ``prompt`` and ``answer`` to ``solution``).
    index: the row number, kept in the example.

  Raises:
    ValueError: the row is unusable (the message says why); :func:`load_examples`
      catches it and counts the row as skipped.
  """
  if kind not in KINDS:
    raise ValueError(f"unknown data kind {kind!r}; expected one of {KINDS}")
  if not isinstance(row, dict):
    raise ValueError(f"row is a {type(row).__name__}, not a JSON object")
  if kind == "gsm8k":
    question, raw = row.get("question"), row.get("answer")
    if not isinstance(question, str) or not question.strip():
      raise ValueError("missing or empty 'question'")
    if not isinstance(raw, str) or "####" not in raw:
      raise ValueError("'answer' has no '#### <number>'")
    answer = rewards.extract_gsm8k_answer(raw[raw.rindex("####"):])
    if answer is None:
      raise ValueError(f"no number after '####' in {raw[raw.rindex('####'):][:40]!r}")
    return Example(question.strip(), answer, kind, index, raw)
  question = next((row[k] for k in ("problem", "question", "prompt") if isinstance(row.get(k), str)
                   and row[k].strip()), None)
  if question is None:
    raise ValueError("missing or empty 'problem' (or 'question', 'prompt')")
  solution = row.get("solution") if isinstance(row.get("solution"), str) else ""
  answer = _answer_text(row.get("answer"))
  if answer is None and "answer" not in row and solution.strip():
    answer = rewards.extract_boxed(solution) if "\\boxed" in solution or "\\fbox" in solution else solution.strip()
    answer = _answer_text(answer)
  if answer is None:
    raise ValueError(f"missing or unusable 'answer' {row.get('answer')!r}" + ("" if "answer" in row else
                     " (and no 'solution' to take it from)"))
  return Example(question.strip(), answer, kind, index, solution)


def _infer_kind(rows: Sequence[Any]) -> str:
  for row in rows:
    if isinstance(row, dict):
      if "problem" in row or ("prompt" in row and "solution" in row):
        return "math"
      if isinstance(row.get("answer"), str) and "####" in row["answer"]:
        return "gsm8k"
  raise ValueError("cannot infer the data kind (no row has 'problem' or a '####' answer); pass kind=")


def load_examples(source: str, *, kind: Optional[str] = None, split: str = "train",
                  hub_config: Optional[str] = None) -> tuple[list[Example], LoadReport]:
  """Loads a GSM8K- or MATH-style data set.

  Args:
    source: a local JSONL path, or a Hugging Face hub id (``"openai/gsm8k"``) that is
      read with ``datasets.load_dataset(source, hub_config, split=split)``. A source that
      names an existing file is local (``~`` is expanded); one that ends in
      ``.jsonl``/``.json`` but does not exist (or starts with ``/``, ``./``, ``../``, ``~``)
      is an error, not a hub id. A UTF-8 byte-order mark at the start is ignored.
    kind: ``"gsm8k"`` or ``"math"``; inferred from the rows when None.
    split: the hub split (ignored for local files).
    hub_config: the hub configuration name (``"main"`` for openai/gsm8k).

  Returns:
    ``(examples, report)``: the usable rows in file order, and a :class:`LoadReport`
    counting the skipped ones (invalid JSON, missing fields, no final answer). The skip
    count is also logged as a warning. Never raises for a bad row.

  Raises:
    FileNotFoundError: a local-looking path that does not exist.
    ValueError: an unknown ``kind``, or a kind that cannot be inferred.
  """
  if kind is not None and kind not in KINDS:
    raise ValueError(f"unknown data kind {kind!r}; expected one of {KINDS}")
  rows: list[Any] = []
  skipped: list[tuple[int, str]] = []
  path = os.path.expanduser(source)  # "~/x.jsonl" is local (as train_config.validate reads it)
  if os.path.isfile(path):
    # utf-8-sig: a byte-order mark (files saved by some Windows editors) is not part of row 0
    with open(path, encoding="utf-8-sig") as f:
      for i, line in enumerate(f):
        if not line.strip():
          skipped.append((i, "empty line"))
          rows.append(None)
          continue
        try:
          rows.append(json.loads(line))
        except json.JSONDecodeError as e:
          skipped.append((i, f"invalid JSON: {e.msg}"))
          rows.append(None)
  elif source.endswith((".jsonl", ".json")) or source.startswith(("/", "./", "../", "~")):
    raise FileNotFoundError(f"data file {source!r} does not exist")
  else:
    import datasets  # pylint: disable=g-import-not-at-top  (optional dependency, hub only)
    ds = datasets.load_dataset(source, hub_config, split=split)
    rows = [dict(r) for r in ds]
  kind = kind or _infer_kind([r for r in rows if r is not None])
  examples = []
  bad_rows = {i for i, _ in skipped}
  for i, row in enumerate(rows):
    if i in bad_rows:
      continue
    try:
      examples.append(parse_row(row, kind, i))
    except ValueError as e:
      skipped.append((i, str(e)))
  skipped.sort()
  report = LoadReport(source, len(rows), len(examples), tuple(skipped))
  if skipped:
    logger.warning("%s: skipped %d of %d rows (first: row %d, %s)", source, len(skipped), len(rows),
                   skipped[0][0], skipped[0][1])
  return examples, report


def build_prompt(tokenizer, question: str, *, system_prompt: Optional[str] = None,
                 user_template: str = "{question}") -> str:
  """The prompt text for one problem, rendered with the tokenizer's chat template.

  Args:
    tokenizer: a Hugging Face tokenizer.
    question: the problem text.
    system_prompt: the system message; None leaves it out (a template may then add its
      own default, as Qwen2.5's does).
    user_template: the user message, with ``{question}`` where the problem goes (e.g.
      :data:`GSM8K_USER_TEMPLATE`, :data:`MATH_USER_TEMPLATE`).

  Returns:
    The text up to and including the assistant turn's opening
    (``add_generation_prompt=True``). A tokenizer without a chat template (a base model)
    gets ``"{system}\\n\\n{user}\\n"``.
  """
  user = user_template.format(question=question)
  messages = ([{"role": "system", "content": system_prompt}] if system_prompt is not None else [])
  messages.append({"role": "user", "content": user})
  if getattr(tokenizer, "chat_template", None):
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
  return (f"{system_prompt}\n\n" if system_prompt else "") + user + "\n"


@dataclasses.dataclass(frozen=True)
class PromptBatch:
  """Left-padded prompt tokens for prefill.

  Attributes:
    tokens: int32 ``[B, P]``, pad id on the left of shorter prompts.
    mask: int32 ``[B, P]``, 1 on prompt tokens, 0 on padding.
    lengths: int32 ``[B]``, prompt lengths in tokens.
  """

  tokens: np.ndarray
  mask: np.ndarray
  lengths: np.ndarray


def tokenize_prompts(tokenizer, prompts: Sequence[str], *, pad_to: Optional[int] = None,
                     pad_id: Optional[int] = None) -> PromptBatch:
  """Tokenizes rendered prompts (no special tokens added: the chat template has them) and
  left-pads them into one batch.

  Args:
    tokenizer: a Hugging Face tokenizer.
    prompts: ``B`` prompt texts (from :func:`build_prompt`).
    pad_to: the width ``P`` (a fixed width keeps jit shapes static); default the longest.
    pad_id: default ``tokenizer.pad_token_id``, else its ``eos_token_id``.

  Returns:
    :class:`PromptBatch` with numpy int32 arrays.

  Raises:
    ValueError: empty ``prompts``, an empty prompt, no pad id, or a prompt longer than
      ``pad_to`` (naming its index and length; drop long prompts beforehand with
      :func:`filter_by_length`).
  """
  if not prompts:
    raise ValueError("tokenize_prompts: no prompts")
  ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
  for i, x in enumerate(ids):
    if not x:
      raise ValueError(f"tokenize_prompts: prompt {i} is empty")
  if pad_id is None:
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
  if pad_id is None:
    raise ValueError("tokenize_prompts: the tokenizer has no pad or eos token; pass pad_id")
  longest = max(len(x) for x in ids)
  width = longest if pad_to is None else int(pad_to)
  if longest > width:
    i = max(range(len(ids)), key=lambda j: len(ids[j]))
    raise ValueError(f"tokenize_prompts: prompt {i} has {len(ids[i])} tokens, more than pad_to={width}")
  tokens = np.full((len(ids), width), pad_id, np.int32)
  mask = np.zeros((len(ids), width), np.int32)
  for i, x in enumerate(ids):
    tokens[i, width - len(x):] = x
    mask[i, width - len(x):] = 1
  return PromptBatch(tokens, mask, np.asarray([len(x) for x in ids], np.int32))


def default_user_template(kind: str) -> str:
  """:data:`GSM8K_USER_TEMPLATE` for ``"gsm8k"``, :data:`MATH_USER_TEMPLATE` for ``"math"``.

  Raises:
    ValueError: any other ``kind``.
  """
  if kind not in KINDS:
    raise ValueError(f"unknown data kind {kind!r}; expected one of {KINDS}")
  return GSM8K_USER_TEMPLATE if kind == "gsm8k" else MATH_USER_TEMPLATE


def prompt_batch(tokenizer, examples: Sequence[Example], indices: Sequence[int], *,
                 pad_to: Optional[int] = None, system_prompt: Optional[str] = None,
                 user_template: Optional[str] = None) -> tuple[PromptBatch, list[str]]:
  """Renders and tokenizes ``examples[i] for i in indices`` (e.g. from :class:`DataOrder`).

  Args:
    tokenizer: a Hugging Face tokenizer.
    examples: the data set.
    indices: ``B`` example indices.
    pad_to, system_prompt: as in :func:`tokenize_prompts` / :func:`build_prompt`.
    user_template: default :func:`default_user_template` of each example's kind.

  Returns:
    ``(batch, answers)``: the left-padded :class:`PromptBatch` and the ``B`` gold answers.

  Raises:
    ValueError: an example of unknown kind (:func:`default_user_template`), or as
      :func:`tokenize_prompts`.
  """
  chosen = [examples[int(i)] for i in indices]
  prompts = [build_prompt(tokenizer, e.question, system_prompt=system_prompt,
                          user_template=user_template or default_user_template(e.kind)) for e in chosen]
  return tokenize_prompts(tokenizer, prompts, pad_to=pad_to), [e.answer for e in chosen]


def filter_by_length(tokenizer, examples: Sequence[Example], max_prompt_len: int, *,
                     system_prompt: Optional[str] = None, user_template: Optional[str] = None
                     ) -> tuple[list[Example], int]:
  """Drops the examples whose rendered prompt is longer than ``max_prompt_len`` tokens.

  The prompt is rendered as :func:`prompt_batch` renders it with the same ``system_prompt`` and
  ``user_template`` (None: :func:`default_user_template` of each example's kind), so what this keeps
  fits ``prompt_batch(..., pad_to=max_prompt_len)``.

  Returns:
    ``(kept, num_dropped)``.

  Raises:
    ValueError: an example of unknown kind when ``user_template`` is None.
  """
  kept = [e for e in examples
          if len(tokenizer(build_prompt(tokenizer, e.question, system_prompt=system_prompt,
                                        user_template=user_template or default_user_template(e.kind)),
                           add_special_tokens=False)["input_ids"]) <= max_prompt_len]
  return kept, len(examples) - len(kept)


@dataclasses.dataclass(frozen=True)
class DataOrder:
  """A deterministic, resumable order of batches over ``num_examples`` examples.

  Epoch ``e`` is the permutation ``numpy.random.default_rng([seed, e]).permutation(n)``;
  batch ``position`` (0, 1, 2, ... over all epochs) is the ``position % batches_per_epoch``-th
  slice of ``batch_size`` from epoch ``position // batches_per_epoch``; the last partial
  batch of an epoch is dropped so every batch is full. ``position`` is the only state:
  store it in the checkpoint and :meth:`batches` from it again.

  Raises:
    ValueError (at construction): ``batch_size`` < 1 or larger than ``num_examples``.
  """

  num_examples: int
  batch_size: int
  seed: int = 0

  def __post_init__(self):
    if self.batch_size < 1 or self.num_examples < self.batch_size:
      raise ValueError(f"DataOrder: need 1 <= batch_size <= num_examples, got batch_size={self.batch_size}, "
                       f"num_examples={self.num_examples}")

  @property
  def batches_per_epoch(self) -> int:
    """Whole batches an epoch (``num_examples // batch_size``); the last ``num_examples % batch_size`` of each
    epoch's permutation are not served that epoch (the next epoch is a fresh permutation)."""
    return self.num_examples // self.batch_size

  def epoch_permutation(self, epoch: int) -> np.ndarray:
    """int64 ``[num_examples]``, the order of epoch ``epoch``."""
    return np.random.default_rng([self.seed, epoch]).permutation(self.num_examples)

  def batch_indices(self, position: int) -> np.ndarray:
    """int64 ``[batch_size]``: example indices of batch number ``position`` (>= 0).

    Raises:
      ValueError: a negative ``position``.
    """
    if position < 0:
      raise ValueError(f"DataOrder: position must be >= 0, got {position}")
    epoch, i = divmod(int(position), self.batches_per_epoch)
    return self.epoch_permutation(epoch)[i * self.batch_size:(i + 1) * self.batch_size]

  def batches(self, start: int = 0) -> Iterator[tuple[int, np.ndarray]]:
    """Yields ``(position, indices)`` forever from ``start``; after consuming batch ``p``,
    the position to store is ``p + 1``."""
    position = start
    while True:
      yield position, self.batch_indices(position)
      position += 1
