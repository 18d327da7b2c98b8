"""Reward tests: hand-worked extraction cases, math-verify equivalence with bounded time,
the safe_reward wrapper, and every gold answer of the real GSM8K and MATH-500 files."""

import functools
import json
import threading
import time
from decimal import Decimal

import numpy as np
import pytest

from qerl_jax import rewards
from qerl_jax.rewards import extract_boxed, extract_gsm8k_answer, format_reward, gsm8k_reward, math_reward, safe_reward


@pytest.mark.parametrize("text, expected", [
    # the answer after ####, before anything else
    ("She has 3 apples and 4 pears.\n#### 7", "7"),
    ("#### 5\nbut the last number is 9", "5"),
    # a markdown heading '#### Step 2: ...' is no '#### <answer>' (Qwen-style step headings)
    ("#### Step 1: Cost\n2 * 3 = 6\n#### Step 2: Total\n6 + 4 = 10\nThe answer is 10.", "10"),
    ("#### Step 1\n3 + 4 = 7\n#### 7\n#### Check: 2 ways", "7"),
    ("#### Final answer\n\\boxed{12} (from 3 * 4)", "12"),
    ("#### $1,000", "1000"),
    # else the last \boxed{}, else the last number
    ("First 3, then \\boxed{12} and finally 99", "12"),
    ("I think 4 then 5 then 18.", "18"),
    # thousands separators read as one number
    ("#### 1,000", "1000"),
    ("It costs $9{,}500 in total", "9500"),
    ("The total is 1,234,567 dollars", "1234567"),
    ("\\$1,234.50", "1234.5"),
    # a bare comma is not a number, and no number gives None
    ("a, b, c", None),
    ("no number here", None),
    (",", None),
    ("1, 2, 3", "3"),
    # signs kept; +7 is 7; -3.0 is -3
    ("The answer is -3", "-3"),
    ("#### +7", "7"),
    ("x = -3.0", "-3"),
    ("5-3=2", "2"),  # an operator is not a sign
    ("3.50", "3.5"),
    # markdown bold and $ stripped
    ("**Answer:** $**42**$", "42"),
    ("The answer is **$18**.", "18"),
    # answer tags
    ("<answer> 42 </answer> then 7", "42"),
])
def test_extract_gsm8k_answer(text, expected):
  assert extract_gsm8k_answer(text) == expected


def test_gsm8k_reward_compares_numbers():
  completions = ["so #### 1,000", "The answer is -3", "The answer is 3", "+7", "**-3.0**", "nothing", "#### 72"]
  answers = ["blah #### 1000", "#### -3", "#### -3", "#### 7", "#### -3", "#### 0", "72"]
  assert gsm8k_reward(completions, answers) == [1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0]
  with pytest.raises(ValueError, match="2 completions but 1 answers"):
    gsm8k_reward(["a", "b"], ["1"])


def test_gsm8k_a_digit_run_longer_than_pythons_int_str_limit_scores_not_raises():
  # a degenerate completion (a run of 5000 digits) is a wrong answer (0.0), not a raise that
  # safe_reward turns into NaN ("missing"); Python refuses str(int) beyond 4300 digits
  run = "7" * 5000
  assert extract_gsm8k_answer("The answer is " + run) == run
  assert extract_gsm8k_answer(run + ".000") == run
  assert gsm8k_reward(["The answer is " + run, "#### " + run], ["#### 7", "#### " + run]) == [0.0, 1.0]
  r, problems = safe_reward(gsm8k_reward, ["The answer is " + run], ["#### 7"])
  assert r.tolist() == [0.0] and problems == []
  assert extract_gsm8k_answer("#### -0") == "0" and extract_gsm8k_answer("-0.00") == "0"


@pytest.mark.parametrize("text, expected", [
    ("\\boxed{\\frac{3}{2}}", "1.5"),        # was read as its denominator, 2
    ("\\boxed{\\dfrac{10}{5}}", "2"),
    ("\\boxed{-\\frac{1}{3}}", "-1/3"),      # a non-terminating decimal stays a reduced fraction
    ("\\boxed{\\frac{-2}{6}}", "-1/3"),
    ("\\frac12 of them", "0.5"),             # the shorthand; was no answer
    ("so 1/2", "0.5"), ("#### 3/4", "0.75"), ("#### 1,000/8", "125"),
    ("the answer is 12/4 = 3", "3"),           # a number after the fraction is the answer
    ("5/0", None),                             # a zero denominator is no answer
])
def test_gsm8k_fractions_are_read_as_their_value(text, expected):
  assert extract_gsm8k_answer(text) == expected


def test_gsm8k_reward_fraction_against_its_denominator():
  # hand-worked: 3/2 is not 2 (a false positive before), 4/2 is, 1/2 is 0.5 (a false negative before)
  assert gsm8k_reward(["\\boxed{\\frac{3}{2}}", "\\boxed{\\frac{4}{2}}", "#### 1/2", "\\boxed{\\frac{1}{2}}"],
                      ["#### 2", "#### 2", "#### 0.5", "#### 2"]) == [0.0, 1.0, 1.0, 0.0]


def test_gsm8k_reward_scores_non_terminating_fractions_instead_of_raising():
  # hand-worked: the answer "1/3" (kept as a fraction: its decimal does not terminate) equals 2/6, not 5 and
  # not 0.333; before, Decimal("1/3") raised and safe_reward turned each of these rewards into NaN (missing)
  assert gsm8k_reward(["#### 1/3", "so \\frac{2}{6}", "#### 5", "#### 0.333", "#### 1/3"],
                      ["#### 1/3", "#### 1/3", "#### 1/3", "#### 1/3", "#### 5"]) == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_math_reward_shortcut_keeps_spaces_between_digits_and_drops_a_final_period():
  pytest.importorskip("math_verify")
  # hand-worked: '1 2' is not 12 (the identical-answer shortcut dropped every space and scored it 1); a
  # sentence's period inside the box ('104.', which math-verify cannot parse) is no reason to score 0;
  # spaces around operators and braces still do not matter
  assert math_reward(["\\boxed{1 2}", "\\boxed{104.}", "\\boxed{x = 5}", "\\boxed{\\frac {1} {2}}"],
                     ["12", "104", "x=5", "\\frac{1}{2}"], timeout_s=5) == [0.0, 1.0, 1.0, 1.0]


def test_every_gsm8k_gold_answer_parses_to_its_number(data_dir):
  n = 0
  for split in ("train", "test"):
    for line in (data_dir / "gsm8k" / f"{split}.jsonl").read_text().splitlines():
      answer = json.loads(line)["answer"]
      tail = answer.split("####")[1].strip()
      expected = Decimal(tail.replace(",", ""))  # independent reading of the number after ####
      got = extract_gsm8k_answer(answer)
      assert got is not None and Decimal(got) == expected, (answer[-80:], got)
      n += 1
  assert n == 8792


@pytest.mark.parametrize("text, expected", [
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("first \\boxed{1} then \\boxed{\\sqrt{2}} end", "\\sqrt{2}"),
    ("\\fbox{3} x", "3"),
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped braces do not count
    ("\\boxed{1} then \\boxed{\\frac{1}{2}", None),  # the last box is unclosed: no answer
    ("\\boxed{", None),
    ("no box", None),
    ("\\boxed {7}", "7"),
    # a LaTeX line break '\\' before a brace: the brace is a real one
    (r"\boxed{\begin{pmatrix}1\\{-2}\end{pmatrix}} done", r"\begin{pmatrix}1\\{-2}\end{pmatrix}"),
    (r"\boxed{a\\} b", "a\\\\"),
    (r"\boxed{\\\{1\}}", r"\\\{1\}"),  # line break, then an escaped brace
])
def test_extract_boxed(text, expected):
  assert extract_boxed(text) == expected


def test_math_reward_cases():
  completions = ["so \\boxed{\\frac{1}{2}}", "\\boxed{0.5}", "\\boxed{\\frac{1}{2}", "1/2", "\\boxed{\\frac13}",
                 "\\fbox{\\sqrt{2}/2}", "\\boxed{x = 5}", "\\boxed{(3, \\frac{\\pi}{2})}"]
  answers = ["\\frac{1}{2}", "\\frac12", "\\frac{1}{2}", "\\frac{1}{2}", "\\frac{1}{2}",
             "\\frac{\\sqrt{2}}{2}", "5", "\\left( 3, \\frac{\\pi}{2} \\right)"]
  assert math_reward(completions, answers) == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0]


ADVERSARIAL = "\\boxed{9^{9^{9^{9}}}}"  # sympy would try to evaluate a number with ~10^8 digits


def test_math_reward_time_is_bounded_on_the_main_thread():
  t0 = time.perf_counter()
  assert math_reward([ADVERSARIAL, "\\boxed{5}"], ["5", "5"], timeout_s=1) == [0.0, 1.0]
  assert time.perf_counter() - t0 < 30  # a hang guard, not a speed target: it returns at all


def test_math_reward_works_outside_the_main_thread():
  out = []
  t = threading.Thread(target=lambda: out.append(
      math_reward(["\\boxed{0.5}", "\\boxed{3}", ADVERSARIAL], ["\\frac{1}{2}", "4", "5"], timeout_s=1)))
  t.start()
  t.join(timeout=120)
  assert not t.is_alive()
  assert out == [[1.0, 0.0, 0.0]]


def test_every_math500_gold_is_equal_to_itself(data_dir):
  golds = [json.loads(l)["answer"] for l in (data_dir / "math500" / "test.jsonl").read_text().splitlines()]
  assert len(golds) == 500
  # through math-verify itself (the string shortcut off), then through math_reward
  not_equal = [g for g in golds if not rewards._verify_one(g, g, 5, exact_shortcut=False)]
  assert not_equal == []
  assert math_reward([f"The answer is \\boxed{{{g}}}." for g in golds], golds) == [1.0] * 500


def test_format_reward_with_weight():
  comps = ["reasoning\n#### 42", "<answer>7</answer>", "\\boxed{3}", "the answer is 5", "<answer> </answer>", "####"]
  assert format_reward(comps, weight=0.2) == [0.2, 0.2, 0.2, 0.0, 0.0, 0.0]
  assert format_reward(comps, kind="hash") == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
  assert format_reward(comps, kind="answer_tags", weight=0.5) == [0.0, 0.5, 0.0, 0.0, 0.0, 0.0]
  assert format_reward(comps, kind="boxed") == [0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
  # usable as a reward function with a bound weight
  fn = functools.partial(format_reward, weight=0.1)
  r, problems = safe_reward(fn, comps[:2], ["1", "2"])
  np.testing.assert_array_equal(r, np.float32([0.1, 0.1]))
  assert problems == [] and not np.isnan(r).any()
  with pytest.raises(ValueError, match="unknown kind"):
    format_reward(comps, kind="xml")


def test_degenerate_completions_score_without_raising_or_quadratic_scans():
  """From an adversarial probe: '1,' * 100000 took 282 s (the fraction pattern rescanned the digit run from each
  of its digits), '\\boxed{' * 4000 3.5 s (every unclosed box scanned to the end), and a fraction beyond
  Python's 4300-digit int -> str limit raised out of gsm8k_reward. Each input here took minutes or raised."""
  assert rewards.extract_gsm8k_answer("1," * 50000 + "x") == "1"
  assert rewards.extract_gsm8k_answer("12, 3/4 " + "7," * 30000) == "7"
  assert extract_boxed("\\boxed{" * 20000) is None
  assert extract_boxed("\\boxed{1} and \\boxed{2}") == "2"
  assert extract_boxed("\\boxed{1} and \\boxed{2") is None  # the last box decides, as before
  huge = "1" * 4400 + "/3"
  assert gsm8k_reward(["#### " + huge, "#### 7"], ["7", "#### " + huge]) == [0.0, 0.0]
  assert gsm8k_reward(["#### 2/6"], ["1/3"]) == [1.0]  # fractions still compare exactly
  for bad in (("42", ["42"]), (["42"], "42")):  # a str where a list goes: scored character by character before
    with pytest.raises(TypeError, match="must be a sequence of strings, got one str"):
      gsm8k_reward(*bad)
  with pytest.raises(TypeError, match="math_reward: completions must be a sequence of strings"):
    math_reward("42", ["42"])
  with pytest.raises(ValueError, match="timeout_s must be a finite number of seconds >= 1, got nan"):
    math_reward(["1"], ["1"], timeout_s=float("nan"))
  with pytest.raises(ValueError, match="weight must be a finite number, got nan"):
    format_reward(["#### 1"], weight=float("nan"))


def test_safe_reward_passes_good_values_through():
  r, problems = safe_reward(gsm8k_reward, ["#### 1", "#### 2"], ["1", "3"])
  assert r.dtype == np.float32 and r.tolist() == [1.0, 0.0] and problems == []


def test_safe_reward_reports_a_raising_fn_by_name_and_index():
  def picky(completions, answers):
    out = []
    for c in completions:
      if "boom" in c:
        raise RuntimeError("cannot score")
      out.append(1.0)
    return out

  r, problems = safe_reward(picky, ["a", "boom", "c", "boom"], ["1", "2", "3", "4"])
  assert r[0] == 1.0 and r[2] == 1.0 and np.isnan(r[1]) and np.isnan(r[3])
  text = "\n".join(problems)
  assert "'picky'" in text and "index 1" in text and "index 3" in text and "RuntimeError" in text


def test_safe_reward_reports_wrong_count_and_bad_values():
  def short(completions, answers):
    return [1.0] * (len(completions) - 1)

  r, problems = safe_reward(short, ["a", "b", "c"], ["1", "2", "3"], name="short_fn")
  assert np.isnan(r).all()
  assert any("'short_fn' returned 2 values for 3 completions" in p for p in problems)

  def odd(completions, answers):
    return [1.0, float("nan"), "x", float("inf"), 0.5]

  r, problems = safe_reward(odd, list("abcde"), list("12345"))
  assert r[0] == 1.0 and r[4] == 0.5 and np.isnan(r[1:4]).all()
  text = "\n".join(problems)
  assert "index 1" in text and "index 2" in text and "index 3" in text and "index 4" not in text

  with pytest.raises(ValueError, match="2 completions but 1 answers"):
    safe_reward(gsm8k_reward, ["a", "b"], ["1"])


def test_safe_reward_bounds_a_hanging_fn_and_logs_one_warning_a_call(caplog):
  """A reward that hangs hung the whole run (no time bound outside math_reward); one that failed on every
  completion logged a warning line per completion (144 lines for two steps of the main job)."""
  import threading
  release = threading.Event()

  def hangs(completions, answers):
    release.wait(30)
    return [1.0] * len(completions)

  try:
    r, problems = safe_reward(hangs, ["a", "b", "c"], ["1", "2", "3"], timeout_s=0.2)
  finally:
    release.set()
  assert np.isnan(r).all() and len(problems) == 1
  assert problems[0] == ("reward fn 'hangs' returned no result within 0.2 s on the batch of 3; all its rewards "
                         "for this batch are missing")

  def fails(completions, answers):
    raise ValueError("bad parse")

  caplog.clear()
  with caplog.at_level("WARNING", logger="qerl_jax.rewards"):
    r, problems = safe_reward(fails, list("abcde"), list("12345"), timeout_s=5)
  assert np.isnan(r).all() and len(problems) == 6  # the batch, then each of the 5 alone
  assert len(caplog.records) == 1
  assert caplog.messages[0].startswith("reward fn 'fails': 5 of 5 rewards missing: reward fn 'fails' raised "
                                       "ValueError: bad parse on the batch of 5")
  assert caplog.messages[0].endswith("; and 3 more")

  calls = []

  def slow_alone(completions, answers):  # raises on the batch, hangs on a completion alone
    calls.append(len(completions))
    if len(completions) > 1:
      raise RuntimeError("batch failed")
    release.wait(30) if completions[0] == "b" else None
    return [0.5]

  release.clear()
  try:
    r, problems = safe_reward(slow_alone, ["a", "b", "c", "d"], ["1", "2", "3", "4"], timeout_s=0.2)
  finally:
    release.set()
  assert r[0] == 0.5 and np.isnan(r[1:]).all()
  assert calls == [4, 1, 1]  # after the retry that timed out, no more retries
  assert problems[-1] == "reward fn 'slow_alone' returned no result within 0.2 s at completion index 1; the rest are missing"


def test_accuracy_reward_fn():
  assert rewards.accuracy_reward_fn("gsm8k") is gsm8k_reward
  assert rewards.accuracy_reward_fn("math") is math_reward
  with pytest.raises(ValueError, match="unknown kind"):
    rewards.accuracy_reward_fn("code")


def test_format_reward_think_answer_is_qerls_regex():
  """kind="think_answer" agrees with QeRL's released soft-format check, re.search(r"<think>.*?</think>\\s*
  <answer>.*?</answer>", text, re.DOTALL), on hand-made cases and on random strings of its pieces."""
  import re
  qerl = re.compile(r"<think>.*?</think>\s*<answer>.*?</answer>", re.DOTALL)
  hand = {"<think>a</think><answer>1</answer>": 1.0, "<think>a</think>\n  <answer>1</answer>": 1.0,
          "<think>a</think> x <answer>1</answer>": 0.0, "<answer>1</answer>": 0.0,
          "</think><answer>1</answer><think>": 0.0, "<think>a</think><answer>1": 0.0,
          "<think>a</think>x<think>b</think>\n<answer>2</answer>": 1.0}
  assert format_reward(list(hand), kind="think_answer", weight=0.2) == [0.2 * v for v in hand.values()]
  rng = np.random.default_rng(0)
  pieces = ["<think>", "</think>", "<answer>", "</answer>", " ", "\n", "x", "7"]
  weights = [0.2, 0.2, 0.2, 0.2, 0.05, 0.05, 0.05, 0.05]
  texts = ["".join(rng.choice(pieces, size=rng.integers(0, 16), p=weights)) for _ in range(3000)]
  got = format_reward(texts, kind="think_answer")
  want = [1.0 if qerl.search(t) else 0.0 for t in texts]
  assert got == want and 50 < sum(want) < 2950  # both outcomes well represented
  with pytest.raises(ValueError, match="unknown kind 'think'"):
    format_reward(["x"], kind="think")


def test_format_reward_hash_takes_the_unicode_minus_the_answer_check_takes():
  """'#### −5' (U+2212) scored 1 in gsm8k_reward but 0 as a '####' format."""
  assert gsm8k_reward(["#### \u22125"], ["-5"]) == [1.0]
  assert format_reward(["#### \u22125", "#### -5", "#### five"], kind="hash") == [1.0, 1.0, 0.0]
