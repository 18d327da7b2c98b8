"""The synthetic GSM8K-like task (qerl_jax/synthetic.py) and its tokenizer.

Answers are re-derived independently: every equation ``a op b = c`` of a worked
solution is evaluated with Python integers, and the final ``####`` value is
recomputed from the numbers stated in the question text (parsed with regular
expressions, not with the generator's code).
"""

import re

import pytest

from qerl_jax import synthetic

_EQ = re.compile(r"(\d+) ([-+*/]) (\d+) = (\d+)")


def _solve_from_question(q: str) -> int:
  """An independent solver: reads the question text and computes the answer."""
  if m := re.match(r"(\w+) has (\d+) (\w+) and (\w+) has (\d+) \w+\. .* among (\d+) friends", q):
    total = int(m[2]) + int(m[5])
    assert total % int(m[6]) == 0
    return total // int(m[6])
  if m := re.match(r"One of the (\w+) costs (\d+) dollars\. \w+ buys (\d+) \w+ and some \w+ for (\d+) dollars\.", q):
    total = int(m[2]) * int(m[3]) + int(m[4])
    if b := re.search(r"pays with (\d+) dollars", q):
      return int(b[1]) - total
    return total
  if m := re.match(r"\w+ puts \w+ in (\d+) rows with (\d+) \w+ in each row\. Then \w+ (takes away|adds) (\d+)", q):
    total = int(m[1]) * int(m[2])
    return total - int(m[4]) if m[3] == "takes away" else total + int(m[4])
  m = re.match(r"(\w+) has (\d+) (\w+)\.", q)
  assert m, q
  value = int(m[2])
  for sentence in q.split(". ")[1:]:
    if b := re.search(r"buys (\d+) \w+ with (\d+) \w+ in each", sentence):
      value += int(b[1]) * int(b[2])
    elif b := re.search(r"(buys|gets) (\d+)", sentence):
      value += int(b[2])
    elif b := re.search(r"(gives|loses) (\d+)", sentence):
      value -= int(b[2])
  return value


def test_answers_checked_independently():
  recs = synthetic.make_split("train", 400, seed=3) + synthetic.make_split("test", 100, seed=3)
  kinds = set()
  for r in recs:
    lines = r["answer"].split("\n")
    assert lines[-1] == f"#### {r['gold']}"
    eqs = _EQ.findall(r["answer"])
    assert 2 <= len(eqs) <= 3, r["answer"]
    for a, op, b, c in eqs:
      a, b, c = int(a), int(b), int(c)
      want = {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op]
      assert c == want, (r["answer"], a, op, b, c)
      if op == "/":
        assert a % b == 0
      assert 0 <= c <= synthetic.MAX_VALUE
    assert int(eqs[-1][3]) == int(r["gold"])
    assert _solve_from_question(r["question"]) == int(r["gold"]), r["question"]
    kinds.add(r["question"].split(" ")[1])
  assert len(kinds) >= 3  # several templates are exercised


def test_splits_disjoint_and_deterministic():
  train = synthetic.make_split("train", 3000, seed=0)
  test = synthetic.make_split("test", 300, seed=0)
  tq, eq = {r["question"] for r in train}, {r["question"] for r in test}
  assert len(tq) == 3000 and len(eq) == 300  # no duplicates within a split
  assert not tq & eq
  assert all(synthetic.split_of(q) == "test" for q in eq)
  # Deterministic by seed; another seed gives other problems; a prefix is stable.
  assert synthetic.make_split("test", 300, seed=0) == test
  assert synthetic.make_split("test", 50, seed=0) == test[:50]
  assert synthetic.make_split("test", 50, seed=1) != test[:50]
  # Across seeds the test split stays disjoint from every train split (split by question hash).
  assert not {r["question"] for r in synthetic.make_split("test", 300, seed=7)} & tq


def test_extract_answer():
  assert synthetic.extract_answer("a\n#### 12") == "12"
  assert synthetic.extract_answer("#### 3 #### 45 apples") == "45"
  assert synthetic.extract_answer("no answer") is None
  assert synthetic.extract_answer("####") is None


def test_bad_arguments():
  with pytest.raises(ValueError, match="split"):
    synthetic.make_split("valid", 3)
  with pytest.raises(ValueError, match="num"):
    synthetic.make_split("train", -1)
  with pytest.raises(ValueError, match="vocab_size"):
    synthetic.build_tokenizer(["x"], vocab_size=100)


def test_tokenizer_round_trip_and_chat_template(tmp_path):
  from transformers import AutoTokenizer
  recs = synthetic.make_split("train", 300, seed=0)
  tok = synthetic.build_tokenizer(synthetic.training_texts(recs), vocab_size=400)
  tok.save_pretrained(str(tmp_path))
  # With a qwen2 config.json beside it, AutoTokenizer picks transformers' Qwen2Tokenizer, which
  # re-applies Qwen2's pre-tokenizer: it must tokenize exactly like the tokenizer we trained.
  (tmp_path / "config.json").write_text('{"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}')
  loaded = AutoTokenizer.from_pretrained(str(tmp_path))
  for text in synthetic.training_texts(recs[:50]):
    assert loaded(text, add_special_tokens=False)["input_ids"] == tok(text, add_special_tokens=False)["input_ids"]
  tok = loaded
  assert tok.convert_tokens_to_ids(list(synthetic.SPECIAL_TOKENS)) == [0, 1, 2]
  assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
  for text in [r["answer"] for r in recs[:20]] + ["Unseen wörds & 12345 ∑!\n  tabs\t"]:
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
  # Every digit is its own token.
  ids = tok("1234567890", add_special_tokens=False)["input_ids"]
  assert tok.convert_ids_to_tokens(ids) == list("1234567890")
  text = tok.apply_chat_template(synthetic.prompt_messages("Q?"), tokenize=False, add_generation_prompt=True)
  assert text == "<|im_start|>user\nQ?<|im_end|>\n<|im_start|>assistant\n"
