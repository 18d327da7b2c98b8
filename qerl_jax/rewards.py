"""Rewards for math RL: GSM8K numeric answers, MATH-style LaTeX answers, format.

Every reward function has the signature ``fn(completions, answers) -> list[float]``:
``completions`` and ``answers`` are equal-length sequences of ``str`` (the model's
decoded completion text and the gold answer text), and the result holds exactly one
float per completion, in order. :func:`safe_reward` runs any such function so that one
that raises costs only the completions it raises on, and one that returns the wrong count
costs that batch's rewards (NaN, which the advantage computation treats as missing), never the run.

Host-side, pure Python (no JAX), so it can run while the device works.

References: GSM8K (Cobbe et al. 2021, answers after ``####``); MATH (Hendrycks et al.
2021, answers in ``\\boxed{}``); math-verify (Hugging Face) for LaTeX equivalence;
QeRL (NVlabs 2025) for the accuracy + weighted format reward.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import re
import subprocess
import sys
import threading
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Callable, Optional, Sequence

import numpy as np

logger = logging.getLogger(__name__)

RewardFn = Callable[[Sequence[str], Sequence[str]], Sequence[float]]

# A number: optional sign (only where no word character or '.' precedes it, so the '-'
# of "5-3" is an operator), digits with comma thousands separators or plain digits,
# optional decimals. A comma not followed by exactly three digits is no separator.
_NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|(?<![\w.])[-+]?\.\d+")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")


def _clean(text: str) -> str:
  """Drops markdown bold, dollar signs (plain and LaTeX-escaped), ``{,}`` separators,
  LaTeX thin spaces, and maps the Unicode minus to '-'."""
  text = text.replace("{,}", ",").replace("\\!", "").replace("\\,", "")
  text = text.replace("\\$", "").replace("$", "").replace("**", "").replace("\u2212", "-")
  return text


def _canonical_number(s: str) -> Optional[str]:
  """'1,000' -> '1000', '+7' -> '7', '-3.0' -> '-3', '2.50' -> '2.5'; None if not a number."""
  try:
    d = Decimal(s.replace(",", ""))
  except InvalidOperation:
    return None
  if not d.is_finite():
    return None
  if d == d.to_integral_value():
    # not str(int(d)): Python refuses int -> str beyond 4300 digits (a degenerate completion's
    # digit run would raise instead of scoring 0); '-0' is '0'
    return "0" if d.is_zero() else format(d.to_integral_value(), "f")
  return format(d.normalize(), "f")


# A fraction of plain numbers: [sign] \frac{a}{b} (also \dfrac, \tfrac, and the shorthand \frac12), or a / b.
# It starts only where no digit, comma or '.' precedes it, and its digit run is possessive (Python 3.11+): a run
# like '1,1,1,...' is scanned once, not once from each of its digits (quadratic: 1.9 s for 16 000 characters).
_NUM = r"(?<![\d,.])[-+]?(?:\d[\d,]*+(?:\.\d+)?|\.\d+)"
_FRACTION = re.compile(rf"([-+]?)\s*\\[dt]?frac\s*(?:\{{\s*({_NUM})\s*\}}\s*\{{\s*({_NUM})\s*\}}|(\d)(\d))"
                       rf"|({_NUM})\s*/\s*({_NUM})")


def _fraction_value(m: re.Match) -> Optional[str]:
  """A :data:`_FRACTION` match's value as a canonical number string when it is a terminating
  decimal (``3/4`` -> ``"0.75"``, ``6/3`` -> ``"2"``), else as the reduced ``"p/q"`` (``2/6`` ->
  ``"1/3"``); None for a zero denominator."""
  if m.group(6) is not None:
    sign, num, den = "", m.group(6), m.group(7)
  else:
    sign, num, den = m.group(1), m.group(2) or m.group(4), m.group(3) or m.group(5)
  a, b = _canonical_number(num), _canonical_number(den)
  if a is None or b is None or Decimal(b) == 0:
    return None
  f = Fraction(Decimal(a)) / Fraction(Decimal(b)) * (-1 if sign == "-" else 1)
  q = f.denominator
  for p in (2, 5):
    while q % p == 0:
      q //= p
  try:  # Python refuses int -> str beyond 4300 digits: no answer then, as for a digit run it cannot read
    if q != 1:
      return f"{f.numerator}/{f.denominator}"
    return _canonical_number(str(Decimal(f.numerator) / Decimal(f.denominator)))
  except ValueError:
    return None


def _last_number(text: str) -> Optional[str]:
  """The last number of ``text``, canonical; when the text ends its numbers with a fraction
  (``\\frac{3}{4}``, ``3/4``: the last number is its denominator), the fraction's value
  instead, so ``\\boxed{\\frac{3}{2}}`` is 1.5, not 2."""
  text = _clean(text)
  nums, fracs = list(_NUMBER.finditer(text)), list(_FRACTION.finditer(text))
  if fracs and (not nums or fracs[-1].end() >= nums[-1].end()):
    return _fraction_value(fracs[-1])
  return _canonical_number(nums[-1].group(0)) if nums else None


def extract_boxed(text: str) -> Optional[str]:
  """The content of the last complete ``\\boxed{...}`` or ``\\fbox{...}`` in ``text``.

  Braces are matched, so ``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``; a box whose
  braces never close gives no answer (None) and an earlier complete box is not used in its
  place. Returns None when there is no complete box.
  """
  m = None
  for m in _BOX_OPEN.finditer(text):  # only the last box decides (scanning each one's braces was quadratic)
    pass
  if m is None:
    return None
  depth, i = 1, m.end()
  while i < len(text) and depth:
    c = text[i]
    if c == "\\":
      i += 2  # a backslash takes the next character: \{ and \} do not count, \\{ (newline, brace) does
      continue
    depth += (c == "{") - (c == "}")
    i += 1
  return text[m.end():i - 1].strip() if depth == 0 else None


def extract_gsm8k_answer(text: str) -> Optional[str]:
  """The numeric answer of a GSM8K-style solution, as a canonical number string.

  Looks, in order, at: the number right after the last ``####`` that has one (so a markdown
  heading ``#### Step 2: ...`` is no answer), the last ``<answer>...</answer>`` tag, the last complete ``\\boxed{}`` (its last number), and
  finally the last number anywhere. A fraction of plain numbers (``\\frac{3}{4}``, ``3/4``) where
  that number would be read counts as its value (``"0.75"``; ``"1/3"`` when the decimal does
  not terminate), never as its denominator. Thousands separators (``1,000``, ``$9{,}500``) read as
  one number; a bare comma is not a number; signs are kept (``-3`` is not ``3``; ``+7`` is
  ``7``); ``-3.0`` is ``-3``; markdown bold and ``$`` are ignored.

  Args:
    text: a completion or a gold answer (``"... #### 72"``, or just ``"72"``).

  Returns:
    e.g. ``"1000"``, ``"-3"``, ``"2.5"``; None when no number is found.

  Raises:
    TypeError: ``text`` is not a str.
  """
  if not isinstance(text, str):
    raise TypeError(f"extract_gsm8k_answer expects str, got {type(text).__name__}")
  # the last '####' with a number right after it; '#### Step 2: ...' is a markdown heading
  for tail in reversed(text.split("####")[1:]):
    tail = _clean(tail).lstrip()
    f = _FRACTION.match(tail)
    if f and f.group(6) is not None:  # '#### 3/4'
      return _fraction_value(f)
    m = _NUMBER.match(tail)
    if m:
      return _canonical_number(m.group(0))
  tags = _ANSWER_TAG.findall(text)
  if tags:
    ans = _last_number(tags[-1])
    if ans is not None:
      return ans
  boxed = extract_boxed(text)
  if boxed is not None:
    ans = _last_number(boxed)
    if ans is not None:
      return ans
  return _last_number(text)


def _check_lengths(name: str, completions, answers) -> None:
  """TypeError for a str where a sequence of str goes (gsm8k_reward("42", "42") scored each character);
  ValueError for sequences of different lengths."""
  for what, v in (("completions", completions), ("answers", answers)):
    if isinstance(v, (str, bytes)):
      raise TypeError(f"{name}: {what} must be a sequence of strings, got one {type(v).__name__} ({v[:40]!r})")
  if len(completions) != len(answers):
    raise ValueError(f"{name}: {len(completions)} completions but {len(answers)} answers")


def gsm8k_reward(completions: Sequence[str], answers: Sequence[str]) -> list[float]:
  """1.0 where the completion's number (:func:`extract_gsm8k_answer`) equals the gold
  answer's number exactly (``"1/3"`` equals ``2/6``; ``0.75`` equals ``3/4``), else 0.0. Gold answers
  are parsed by the same function.

  Raises:
    ValueError: if the two sequences differ in length. TypeError: a str given for either (one string is
      not a batch).
  """
  _check_lengths("gsm8k_reward", completions, answers)
  out = []
  for c, a in zip(completions, answers):
    gold = extract_gsm8k_answer(str(a))
    pred = extract_gsm8k_answer(c)
    out.append(1.0 if gold is not None and pred is not None and _exact_value(gold) == _exact_value(pred) else 0.0)
  return out


def _exact_value(number: str) -> Fraction:
  """The exact value of a canonical number string of :func:`extract_gsm8k_answer`: a decimal (``"0.75"``)
  or, for a non-terminating one, a reduced fraction (``"1/3"``), which ``Decimal`` cannot read. Decimals go
  through ``Decimal``: ``Fraction("777...")`` refuses more than 4300 digits, as ``int`` does."""
  return Fraction(number) if "/" in number else Fraction(Decimal(number))


def _normalize_latex(s: str) -> str:
  """For the identical-answer shortcut: whitespace dropped except between two letters or digits (``1 2``
  is not ``12``), ``\\left``, ``\\right`` and ``\\!`` dropped."""
  s = re.sub(r"(?<=[A-Za-z0-9])\s+(?=[A-Za-z0-9])", " ", s.strip())
  s = re.sub(r"(?<![A-Za-z0-9])\s+|\s+(?![A-Za-z0-9])", "", s)
  return s.replace("\\left", "").replace("\\right", "").replace("\\!", "")


def _drop_final_period(s: str) -> str:
  """``104.`` -> ``104``: a sentence's period inside the box, which math-verify cannot parse."""
  s = s.strip()
  return s[:-1].rstrip() if len(s) > 1 and s.endswith(".") else s


def _verify_one(gold: str, pred: str, timeout_s: int, exact_shortcut: bool = True) -> bool:
  """math-verify equivalence of two LaTeX answers, each bounded by ``timeout_s`` seconds
  (math-verify's signal-based timeouts; main thread only)."""
  from math_verify import parse, verify  # pylint: disable=g-import-not-at-top

  gold, pred = _drop_final_period(gold), _drop_final_period(pred)
  if exact_shortcut and _normalize_latex(gold) == _normalize_latex(pred):
    return True
  g = parse("\\boxed{" + gold + "}", parsing_timeout=timeout_s)
  p = parse("\\boxed{" + pred + "}", parsing_timeout=timeout_s)
  if not g or not p:
    return False
  return bool(verify(g, p, timeout_seconds=timeout_s))


def _math_reward_in_process(completions, answers, timeout_s: int) -> list[float]:
  out = []
  for c, a in zip(completions, answers):
    pred = extract_boxed(c)
    if pred is None:
      out.append(0.0)
      continue
    try:
      out.append(1.0 if _verify_one(str(a), pred, timeout_s) else 0.0)
    except Exception as e:  # math-verify raises on timeouts only with raise_on_error; be safe
      logger.warning("math_reward: verification failed (%s: %s); reward 0", type(e).__name__, e)
      out.append(0.0)
  return out


def math_reward(completions: Sequence[str], answers: Sequence[str], *, timeout_s: int = 5) -> list[float]:
  """1.0 where the last complete ``\\boxed{}``/``\\fbox{}`` of the completion is
  mathematically equal to the gold LaTeX answer (math-verify), else 0.0.

  A completion with no complete box scores 0. Identical answers (up to whitespace and
  ``\\left``/``\\right``) score 1 without calling math-verify.

  Time is bounded per answer: each parse and each comparison gets ``timeout_s`` seconds
  (math-verify's own timeout, which uses ``signal.alarm`` and so works only on the main
  thread). Called from any other thread, the batch runs in a child process (whose main
  thread applies the same per-answer timeouts), killed after ``4 * timeout_s * len + 60`` s;
  a killed batch scores 0 everywhere and logs a warning. The child costs about a second.

  Args:
    completions: completion texts ``[n]``.
    answers: gold answers ``[n]`` in LaTeX without the box (MATH-500's ``answer`` field).
    timeout_s: whole seconds per parse / comparison (>= 1).

  Raises:
    ValueError: lengths differ, or ``timeout_s`` not a finite number >= 1.
    TypeError: a str given for ``completions`` or ``answers``.
  """
  _check_lengths("math_reward", completions, answers)
  if not (isinstance(timeout_s, numbers.Real) and math.isfinite(timeout_s) and int(timeout_s) >= 1):
    raise ValueError(f"math_reward: timeout_s must be a finite number of seconds >= 1, got {timeout_s!r}")
  timeout_s = int(timeout_s)
  if threading.current_thread() is threading.main_thread():
    return _math_reward_in_process(completions, answers, timeout_s)
  payload = json.dumps({"completions": list(completions), "answers": [str(a) for a in answers],
                        "timeout_s": timeout_s})
  # The child must import this very package, installed or not.
  pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [pkg_root, os.environ.get("PYTHONPATH")])))
  try:
    proc = subprocess.run([sys.executable, "-m", "qerl_jax.rewards"], input=payload, text=True, env=env,
                          capture_output=True, timeout=4 * timeout_s * len(completions) + 60, check=True)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
  except (subprocess.SubprocessError, ValueError, IndexError) as e:
    logger.warning("math_reward: child process failed (%s); rewards 0 for this batch", e)
    return [0.0] * len(completions)
  return [float(r) for r in out]


FORMAT_KINDS = ("any", "hash", "answer_tags", "boxed", "think_answer")
_THINK_END_ANSWER = re.compile(r"</think>\s*<answer>")


def _think_then_answer(text: str) -> bool:
  """Whether ``<think>.*?</think>\\s*<answer>.*?</answer>`` (DOTALL) matches somewhere in ``text``: some
  ``</think>``, followed by only whitespace and ``<answer>``, has a ``<think>`` before it and an ``</answer>``
  after it. One pass over the ``</think>`` occurrences (the lazy regex backtracks over every ``<think>``)."""
  first = text.find("<think>")
  if first < 0:
    return False
  last_close = text.rfind("</answer>")
  return any(m.start() >= first + len("<think>") and last_close >= m.end()
             for m in _THINK_END_ANSWER.finditer(text, first + len("<think>")))


def format_reward(completions: Sequence[str], answers: Optional[Sequence[str]] = None, *,
                  weight: float = 1.0, kind: str = "any") -> list[float]:
  """``weight`` for each completion that states its answer in the expected form, else 0.

  Args:
    completions: completion texts ``[n]``.
    answers: ignored (present so that the signature is that of every reward function).
    weight: the reward for a well-formatted completion (QeRL adds a small weighted
      format term to the accuracy reward).
    kind: ``"hash"`` (a ``#### <number>`` line), ``"answer_tags"``
      (``<answer>...</answer>`` with something inside), ``"boxed"`` (a complete
      ``\\boxed{}``), ``"think_answer"`` (``<think>...</think>`` then, after only
      whitespace, ``<answer>...</answer>``: the format term of QeRL's released GSM8K and
      Big-Math rewards, its regex ``<think>.*?</think>\\s*<answer>.*?</answer>`` with
      DOTALL, checked in linear time), or ``"any"`` of the first three.

  Raises:
    ValueError: unknown ``kind``, a ``weight`` that is not a finite number, or ``answers`` of another length.
  """
  if not (isinstance(weight, numbers.Real) and math.isfinite(weight)):
    raise ValueError(f"format_reward: weight must be a finite number, got {weight!r}")
  checks = {
      "hash": lambda c: re.search(r"####\s*[-+\u2212$]?\s*\d", c) is not None,  # (U+2212: the answer check's minus)
      "answer_tags": lambda c: any(t.strip() for t in _ANSWER_TAG.findall(c)),
      "boxed": lambda c: bool(extract_boxed(c)),
      "think_answer": _think_then_answer,
  }
  if kind not in FORMAT_KINDS:
    raise ValueError(f"format_reward: unknown kind {kind!r}; expected one of {FORMAT_KINDS}")
  if answers is not None:
    _check_lengths("format_reward", completions, answers)
  use = [checks[k] for k in ("hash", "answer_tags", "boxed")] if kind == "any" else [checks[kind]]
  return [float(weight) if any(f(c) for f in use) else 0.0 for c in completions]


def accuracy_reward_fn(kind: str) -> RewardFn:
  """The accuracy reward for a data kind: ``"gsm8k"`` -> :func:`gsm8k_reward`,
  ``"math"`` -> :func:`math_reward` (``qerl_jax.data.Example.kind``).

  Raises:
    ValueError: unknown kind.
  """
  fns = {"gsm8k": gsm8k_reward, "math": math_reward}
  if kind not in fns:
    raise ValueError(f"accuracy_reward_fn: unknown kind {kind!r}; expected one of {sorted(fns)}")
  return fns[kind]


def _fn_name(fn) -> str:
  return getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__", None) or repr(fn)


class RewardTimeout(Exception):
  """A reward function did not return within :func:`safe_reward`'s ``timeout_s``."""


def _call(fn: RewardFn, completions, answers, timeout_s: Optional[float]) -> list:
  """``list(fn(completions, answers))``, in a daemon thread bounded by ``timeout_s`` seconds when given.

  Raises:
    RewardTimeout: ``fn`` ran longer (the thread is left to finish on its own: Python cannot stop it).
    Whatever ``fn`` raises.
  """
  if timeout_s is None:
    return list(fn(completions, answers))
  out: dict = {}

  def target():
    try:
      out["values"] = list(fn(completions, answers))
    except BaseException as e:  # pylint: disable=broad-except  # re-raised in the caller's thread
      out["error"] = e

  worker = threading.Thread(target=target, daemon=True, name=f"reward:{_fn_name(fn)}")
  worker.start()
  worker.join(timeout_s)
  if worker.is_alive():
    raise RewardTimeout(f"no result within {timeout_s:g} s")
  if "error" in out:
    raise out["error"]
  return out["values"]


def safe_reward(fn: RewardFn, completions: Sequence[str], answers: Sequence[str], *,
                name: Optional[str] = None, timeout_s: Optional[float] = None) -> tuple[np.ndarray, list[str]]:
  """Runs a reward function so that its failures cost only the affected completions.

  * ``fn`` returns exactly one finite float per completion: that is the result.
  * ``fn`` raises: it is run again on each completion alone; the ones that still raise get
    NaN, each reported with its index.
  * ``fn`` runs longer than ``timeout_s``: every reward of the batch is NaN, reported (it is not
    retried; the call is left running in a daemon thread, which Python cannot stop).
  * ``fn`` returns the wrong number of values: every reward is NaN (no order can be
    trusted), reported with both counts.
  * a value that is not a number, or NaN/Inf: NaN at that index, reported.

  NaN means "missing": the advantage computation excludes it and gives that completion
  advantage 0. A call with problems logs one warning (``logging.warning``) with the function's name,
  how many rewards are missing, and the first few problems.

  Args:
    fn: ``fn(completions, answers) -> Sequence[float]``.
    completions, answers: equal-length sequences ``[n]``.
    name: how to name ``fn`` in reports (default: its ``__name__``).
    timeout_s: seconds the batch's call may take (None: unbounded; then ``fn`` runs in the caller's
      thread). :func:`math_reward` bounds its own time; the trainer gives this bound to reward functions
      passed to it.

  Returns:
    ``(rewards, problems)``: float32 ``[n]`` and a list of messages (empty when all went well).

  Raises:
    ValueError: if ``completions`` and ``answers`` differ in length (a caller bug).
  """
  name = name or _fn_name(fn)
  n = len(completions)
  _check_lengths(f"safe_reward({name})", completions, answers)
  problems: list[str] = []
  rewards = np.full((n,), np.nan, np.float32)
  try:
    values = _call(fn, completions, answers, timeout_s)
  except RewardTimeout as e:
    problems.append(f"reward fn {name!r} returned {e} on the batch of {n}; all its rewards for this batch are "
                    "missing")
    values = [None] * n
  except Exception as e:  # find the completions that make it fail
    problems.append(f"reward fn {name!r} raised {type(e).__name__}: {e} on the batch of {n}; "
                    "retrying each completion alone")
    values, timed_out = [], False
    for i in range(n):
      if timed_out:  # a retry timed out: no n timeouts in a row
        values.append(None)
        continue
      try:
        one = _call(fn, completions[i:i + 1], answers[i:i + 1], timeout_s)
        values.append(one[0] if len(one) == 1 else None)
        if len(one) != 1:
          problems.append(f"reward fn {name!r} returned {len(one)} values for the single completion {i}")
      except RewardTimeout as e_i:
        problems.append(f"reward fn {name!r} returned {e_i} at completion index {i}; the rest are missing")
        values.append(None)
        timed_out = True
      except Exception as e_i:
        problems.append(f"reward fn {name!r} raised {type(e_i).__name__}: {e_i} at completion index {i}")
        values.append(None)
  if len(values) != n:
    problems.append(f"reward fn {name!r} returned {len(values)} values for {n} completions; "
                    "all its rewards for this batch are missing")
    values = [None] * n
  for i, v in enumerate(values):
    if v is None:
      continue
    try:
      f = float(v)
    except (TypeError, ValueError):
      problems.append(f"reward fn {name!r} returned a non-number {v!r} at completion index {i}")
      continue
    if not math.isfinite(f):
      problems.append(f"reward fn {name!r} returned {f} at completion index {i}")
      continue
    rewards[i] = f
  if problems:
    shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
    logger.warning("reward fn %r: %d of %d rewards missing: %s", name, int(np.isnan(rewards).sum()), n, shown)
  return rewards, problems


def _child_main() -> None:
  """``python -m qerl_jax.rewards``: math_reward on a JSON batch from stdin (main thread)."""
  req = json.loads(sys.stdin.read())
  out = _math_reward_in_process(req["completions"], req["answers"], int(req["timeout_s"]))
  sys.stdout.write(json.dumps(out) + "\n")


if __name__ == "__main__":
  _child_main()
