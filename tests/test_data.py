"""Data tests on the real files in ../shared/data (plus malformed rows appended) and the real
Qwen2.5 tokenizer in ../shared/fixtures (loaded offline)."""

import json

import numpy as np
import pytest

from qerl_jax import data


@pytest.fixture(scope="module")
def tokenizer(qwen_tokenizer):
  return qwen_tokenizer


def test_load_real_files(data_dir):
  ex, rep = data.load_examples(str(data_dir / "gsm8k" / "test.jsonl"))
  assert rep.rows == 1319 and rep.kept == 1319 and rep.num_skipped == 0
  assert ex[0].kind == "gsm8k" and ex[0].answer == "18" and ex[0].question.startswith("Janet")
  assert ex[0].row == 0 and ex[0].solution.endswith("#### 18")
  for name, n, first_answer in (("math500", 500, "\\left( 3, \\frac{\\pi}{2} \\right)"),
                                ("aime24", 30, "204"), ("amc23", 40, "27")):
    ex, rep = data.load_examples(str(data_dir / name / "test.jsonl"))
    assert (rep.rows, rep.kept, rep.num_skipped) == (n, n, 0), name
    assert ex[0].kind == "math" and ex[0].answer == first_answer, name
  # every amc23 float answer becomes its integer text, checked against the raw file
  raw = [json.loads(l)["answer"] for l in (data_dir / "amc23" / "test.jsonl").read_text().splitlines()]
  ex, _ = data.load_examples(str(data_dir / "amc23" / "test.jsonl"), kind="math")
  assert [e.answer for e in ex] == [str(int(a)) for a in raw]


def test_malformed_rows_are_skipped_and_counted(data_dir, tmp_path, caplog):
  lines = (data_dir / "gsm8k" / "test.jsonl").read_text().splitlines()[:20]
  bad = [
      "{not json",
      "",
      json.dumps(["a", "list"]),
      json.dumps({"question": "no answer field"}),
      json.dumps({"question": "", "answer": "#### 3"}),
      json.dumps({"question": "no hashes", "answer": "the answer is 3"}),
      json.dumps({"question": "no number", "answer": "#### many"}),
  ]
  path = tmp_path / "gsm8k_bad.jsonl"
  path.write_text("\n".join(lines[:10] + bad + lines[10:]) + "\n")
  with caplog.at_level("WARNING"):
    ex, rep = data.load_examples(str(path), kind="gsm8k")
  assert rep.rows == 27 and rep.kept == 20 and rep.num_skipped == 7
  assert [r for r, _ in rep.skipped] == list(range(10, 17))
  reasons = dict(rep.skipped)
  assert "invalid JSON" in reasons[10] and "empty" in reasons[11] and "list" in reasons[12]
  assert "####" in reasons[15] and "no number" in reasons[16]
  assert "skipped 7 of 27 rows" in caplog.text
  # the good rows keep their file order and row numbers
  assert [e.row for e in ex] == list(range(10)) + list(range(17, 27))

  math_path = tmp_path / "math_bad.jsonl"
  math_path.write_text("\n".join([
      json.dumps({"problem": "1+1?", "answer": "2"}),
      json.dumps({"problem": "x?", "answer": None}),
      json.dumps({"problem": "y?", "answer": float("nan")}),
      json.dumps({"problem": "z?", "answer": 2.5}),
      json.dumps({"answer": "3"}),
  ]))
  ex, rep = data.load_examples(str(math_path))
  assert [e.answer for e in ex] == ["2", "2.5"] and rep.num_skipped == 3


def test_load_home_relative_path_and_byte_order_mark(data_dir, tmp_path, monkeypatch):
  raw = (data_dir / "aime24" / "test.jsonl").read_bytes()
  (tmp_path / "aime.jsonl").write_bytes(b"\xef\xbb\xbf" + raw)  # a UTF-8 BOM, as some editors save
  first = json.loads(raw.decode().splitlines()[0])
  ex, rep = data.load_examples(str(tmp_path / "aime.jsonl"))
  assert (rep.rows, rep.kept, rep.num_skipped) == (30, 30, 0)  # row 0 is not "invalid JSON"
  assert ex[0].answer == first["answer"] == "204" and ex[0].question == first["problem"].strip()
  monkeypatch.setenv("HOME", str(tmp_path))
  ex, rep = data.load_examples("~/aime.jsonl")  # the file exists: local, not FileNotFoundError
  assert (rep.rows, rep.kept) == (30, 30) and ex[0].answer == "204"
  with pytest.raises(FileNotFoundError, match="nope.jsonl"):
    data.load_examples("~/nope.jsonl")


def test_load_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="nope.jsonl"):
    data.load_examples(str(tmp_path / "nope.jsonl"))
  with pytest.raises(ValueError, match="unknown data kind"):
    data.load_examples(str(tmp_path / "x.jsonl"), kind="mmlu")
  p = tmp_path / "odd.jsonl"
  p.write_text(json.dumps({"text": "hello"}) + "\n")
  with pytest.raises(ValueError, match="infer"):
    data.load_examples(str(p))


def test_build_prompt_with_qwen_chat_template(tokenizer):
  text = data.build_prompt(tokenizer, "What is 2+2?", system_prompt="You are a careful math tutor.")
  assert text == ("<|im_start|>system\nYou are a careful math tutor.<|im_end|>\n"
                  "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
  # no system prompt: Qwen2.5's template adds its own default
  text = data.build_prompt(tokenizer, "Hello!")
  assert text == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
                  "<|im_end|>\n<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n")
  text = data.build_prompt(tokenizer, "Q", system_prompt="S", user_template=data.MATH_USER_TEMPLATE)
  assert "<|im_start|>user\nQ\nPlease reason step by step, and put your final answer within \\boxed{}.<|im_end|>" in text


def test_build_prompt_without_chat_template():
  class Plain:
    chat_template = None

  assert data.build_prompt(Plain(), "Q", system_prompt="S") == "S\n\nQ\n"


def test_tokenize_prompts_left_pads(tokenizer):
  prompts = [data.build_prompt(tokenizer, q, system_prompt="S") for q in ("Hi", "What is the sum of 1 and 2?")]
  batch = data.tokenize_prompts(tokenizer, prompts)
  ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
  width = max(len(x) for x in ids)
  assert batch.tokens.shape == batch.mask.shape == (2, width)
  assert batch.tokens.dtype == np.int32 and batch.mask.dtype == np.int32
  pad = tokenizer.pad_token_id
  assert pad == 151643  # <|endoftext|>
  for row, x in enumerate(ids):
    n_pad = width - len(x)
    assert batch.tokens[row, n_pad:].tolist() == x
    assert batch.tokens[row, :n_pad].tolist() == [pad] * n_pad
    assert batch.mask[row].tolist() == [0] * n_pad + [1] * len(x)
    assert batch.lengths[row] == len(x)
  assert tokenizer.decode(batch.tokens[0][batch.mask[0] == 1]) == prompts[0]
  # a fixed width for static shapes; too long is an error naming the prompt
  wide = data.tokenize_prompts(tokenizer, prompts, pad_to=width + 5)
  assert wide.tokens.shape == (2, width + 5) and wide.mask[:, :5].sum() == 0
  with pytest.raises(ValueError, match=r"prompt 1 has \d+ tokens, more than pad_to=3"):
    data.tokenize_prompts(tokenizer, prompts, pad_to=3)
  with pytest.raises(ValueError, match="no prompts"):
    data.tokenize_prompts(tokenizer, [])


def test_filter_by_length(tokenizer):
  ex = [data.Example("short?", "1", "gsm8k", 0), data.Example("long " * 200, "2", "gsm8k", 1)]
  kept, dropped = data.filter_by_length(tokenizer, ex, 64, system_prompt="S")
  assert [e.row for e in kept] == [0] and dropped == 1


def test_data_order_is_a_seeded_permutation_per_epoch():
  order = data.DataOrder(num_examples=10, batch_size=3, seed=7)
  assert order.batches_per_epoch == 3
  # independent: numpy's generator seeded with [seed, epoch]
  p0 = np.random.default_rng([7, 0]).permutation(10)
  p1 = np.random.default_rng([7, 1]).permutation(10)
  expected = [p0[0:3], p0[3:6], p0[6:9], p1[0:3], p1[3:6], p1[6:9], np.random.default_rng([7, 2]).permutation(10)[0:3]]
  got = [b for _, b in zip(range(7), order.batches())]
  for g, e in zip(got, expected):
    np.testing.assert_array_equal(g[1], e)
  assert [g[0] for g in got] == list(range(7))
  # each epoch covers distinct examples; epochs differ; another seed differs
  assert len(set(np.concatenate([g[1] for g in got[:3]]).tolist())) == 9
  assert not np.array_equal(p0, p1)
  assert not np.array_equal(data.DataOrder(10, 3, seed=8).batch_indices(0), got[0][1])


def test_data_order_resumes_identically():
  order = data.DataOrder(num_examples=50, batch_size=8, seed=3)
  straight = [b[1].tolist() for _, b in zip(range(20), order.batches())]
  # consume 11 batches, "checkpoint" the position, rebuild everything, resume
  it = order.batches()
  for _ in range(11):
    position, _ = next(it)
  saved = position + 1
  resumed_order = data.DataOrder(num_examples=50, batch_size=8, seed=3)
  resumed = [b[1].tolist() for _, b in zip(range(9), resumed_order.batches(start=saved))]
  assert straight[:11] + resumed == straight
  with pytest.raises(ValueError):
    data.DataOrder(num_examples=4, batch_size=8)
  with pytest.raises(ValueError):
    order.batch_indices(-1)


def test_prompt_batch_from_order(tokenizer, data_dir):
  examples, _ = data.load_examples(str(data_dir / "gsm8k" / "test.jsonl"))
  order = data.DataOrder(len(examples), batch_size=4, seed=1)
  idx = order.batch_indices(5)
  batch, answers = data.prompt_batch(tokenizer, examples, idx, pad_to=256, system_prompt="S")
  assert batch.tokens.shape == (4, 256) and answers == [examples[i].answer for i in idx]
  first = tokenizer.decode(batch.tokens[0][batch.mask[0] == 1])
  assert first == data.build_prompt(tokenizer, examples[idx[0]].question, system_prompt="S",
                                    user_template=data.GSM8K_USER_TEMPLATE)
  assert data.default_user_template("math") == data.MATH_USER_TEMPLATE
  with pytest.raises(ValueError):
    data.default_user_template("mmlu")


def test_filter_by_length_renders_as_prompt_batch_does(tokenizer):
  """Its default rendered the bare question while prompt_batch's adds the kind's instruction, so a
  kept prompt could overflow prompt_batch(pad_to=the same length)."""
  ex = [data.Example("What is 2 + 3?", "5", "gsm8k", 0), data.Example("x " * 40, "1", "math", 1)]
  lengths = [len(tokenizer(data.build_prompt(tokenizer, e.question, user_template=data.default_user_template(e.kind)),
                           add_special_tokens=False)["input_ids"]) for e in ex]
  for limit in (min(lengths) - 1, min(lengths), max(lengths)):
    kept, dropped = data.filter_by_length(tokenizer, ex, limit)
    assert [e.row for e in kept] == [i for i, n in enumerate(lengths) if n <= limit] and dropped == 2 - len(kept)
    if kept:
      batch, _ = data.prompt_batch(tokenizer, kept, range(len(kept)), pad_to=limit)
      assert batch.tokens.shape == (len(kept), limit)


def test_big_math_and_hendrycks_math_rows(tmp_path):
  """open-r1/Big-Math-RL-Verified-Processed (the BigMath recipe's training set) names its columns prompt and
  solution (its create_dataset.py renames problem and answer): every row was skipped as having no 'problem'.
  A Hendrycks MATH row without 'answer' takes the last box of its worked solution."""
  path = tmp_path / "bigmath.jsonl"
  path.write_text("\n".join(json.dumps(r) for r in [
      {"prompt": "Find x if 2x = 10.", "solution": "5", "source": "aops", "llama8b_solve_rate": 0.4},
      {"prompt": "Simplify 6/8.", "solution": "\\frac{3}{4}"},
      {"problem": "What is 1+2?", "solution": "We add: $1 + 2 = \\boxed{3}$, not \\boxed{4} first... so \\boxed{3}."},
      {"problem": "What is 2+2?", "answer": "4", "solution": "So \\boxed{5}."},  # an answer field wins
      {"prompt": "No answer here."},
      {"prompt": ["not", "text"], "solution": "1"},
  ]))
  ex, rep = data.load_examples(str(path))  # kind inferred from prompt + solution
  assert [(e.question, e.answer) for e in ex] == [("Find x if 2x = 10.", "5"), ("Simplify 6/8.", "\\frac{3}{4}"),
                                                  ("What is 1+2?", "3"), ("What is 2+2?", "4")]
  assert rep.num_skipped == 2 and "no 'solution'" in dict(rep.skipped)[4]
  assert "missing or empty 'problem' (or 'question', 'prompt')" in dict(rep.skipped)[5]
