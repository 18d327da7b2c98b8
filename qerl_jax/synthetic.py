"""A synthetic GSM8K-like task: short multi-step arithmetic word problems.

Each problem is drawn from a template with a random name, item and small
numbers, and comes with a worked solution in GSM8K's style: one line per step,
each step an equation ``a op b = c``, then a final line ``#### <number>``
(the format of GSM8K, Cobbe et al. 2021, "Training Verifiers to Solve Math Word
Problems"). Problems have 2 or 3 steps, every intermediate value is an integer
in [0, 99], and a solution is about 30-80 tokens with the tokenizer of
:func:`build_tokenizer`, so that a model of about half a million parameters
learns it on a CPU in minutes and GRPO can improve it further.

Records have GSM8K's fields, so the rest of the project treats them like
GSM8K rows::

    {"question": str, "answer": "<worked solution>\\n#### 12", "gold": "12"}

Splits are disjoint by construction: a problem belongs to the ``"test"``
split when the SHA-256 of its question text falls in the first
``TEST_FRACTION`` of hash space, otherwise to ``"train"``. Within a split the
records are a deterministic function of ``seed``.
"""

from __future__ import annotations

import hashlib
import random
from typing import Callable

TEST_FRACTION = 0.1
"""Fraction of problem space (by question hash) reserved for the test split."""

SPLITS = ("train", "test")

NAMES = (
    "Mia", "Leo", "Ava", "Sam", "Zoe", "Max", "Lily", "Ben", "Emma", "Noah",
    "Ella", "Jack", "Ruby", "Owen", "Lucy", "Finn", "Nora", "Eli", "Ivy", "Tom",
)
ITEMS = (
    "apples", "pens", "books", "marbles", "cookies", "stickers", "cards",
    "coins", "shells", "stamps", "balloons", "candies",
)
CONTAINERS = ("bags", "boxes", "packs", "jars")
_PRONOUN = {n: ("She" if n in {"Mia", "Ava", "Zoe", "Lily", "Emma", "Ella", "Ruby", "Lucy", "Nora", "Ivy"} else "He")
            for n in NAMES}

MAX_VALUE = 99
"""Largest value any quantity or intermediate result may take."""


def _hash_fraction(text: str) -> float:
    """Position of ``text`` in hash space, a float in [0, 1) (SHA-256, first 8 bytes)."""
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def split_of(question: str) -> str:
    """The split (``"train"`` or ``"test"``) a question belongs to, by its SHA-256."""
    return "test" if _hash_fraction(question) < TEST_FRACTION else "train"


# --- templates -----------------------------------------------------------------
# Each template takes a random.Random and returns (question, solution lines, answer)
# or None when the drawn numbers leave [0, MAX_VALUE].


def _have_change(rng: random.Random):
    """Start with a count, then 2 or 3 gains/losses."""
    name, other = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    he = _PRONOUN[name]
    value = rng.randint(2, 20)
    q = [f"{name} has {value} {item}."]
    s = [f"{name} starts with {value} {item}."]
    kinds = [rng.choice(("buy", "find", "give", "lose", "bags")) for _ in range(rng.randint(2, 3))]
    if "bags" in kinds:  # a bags step is two equations: keep the solution at <= 3 equations
        kinds = [k if k != "bags" else "buy" for k in kinds[:2]]
        kinds[rng.randint(0, 1)] = "bags"
    for i, kind in enumerate(kinds):
        then = "Then " + he.lower() if i else he
        if kind == "buy":
            k = rng.randint(1, 20)
            q.append(f"{then} buys {k} more {item}.")
            s.append(f"{he} buys {k}, so {he.lower()} has {value} + {k} = {value + k} {item}.")
            value += k
        elif kind == "find":
            k = rng.randint(1, 20)
            q.append(f"{then} gets {k} {item} from {other}.")
            s.append(f"{he} gets {k}, so {he.lower()} has {value} + {k} = {value + k} {item}.")
            value += k
        elif kind == "give":
            k = rng.randint(1, 20)
            q.append(f"{then} gives {k} {item} to {other}.")
            s.append(f"{he} gives {k} away, so {he.lower()} has {value} - {k} = {value - k} {item}.")
            value -= k
        elif kind == "lose":
            k = rng.randint(1, 20)
            q.append(f"{then} loses {k} {item}.")
            s.append(f"{he} loses {k}, so {he.lower()} has {value} - {k} = {value - k} {item}.")
            value -= k
        else:
            n, k = rng.randint(2, 5), rng.randint(2, 9)
            container = rng.choice(CONTAINERS)
            q.append(f"{then} buys {n} {container} with {k} {item} in each.")
            s.append(f"{n} {container} hold {n} * {k} = {n * k} {item}.")
            s.append(f"So {he.lower()} has {value} + {n * k} = {value + n * k} {item}.")
            value += n * k
        if not 0 <= value <= MAX_VALUE:
            return None
    q.append(f"How many {item} does {name} have now?")
    return " ".join(q), s, value


def _shopping(rng: random.Random):
    """Buy some of one thing at a unit price plus another thing, maybe pay with a bill."""
    name = rng.choice(NAMES)
    he = _PRONOUN[name]
    a, b = rng.sample(ITEMS, 2)
    n, price, other = rng.randint(2, 9), rng.randint(2, 9), rng.randint(1, 20)
    cost = n * price
    total = cost + other
    q = [f"One of the {a} costs {price} dollars. {name} buys {n} {a} and some {b} for {other} dollars."]
    s = [f"The {a} cost {n} * {price} = {cost} dollars.",
         f"In total {he.lower()} spends {cost} + {other} = {total} dollars."]
    if rng.random() < 0.5:
        bill = rng.choice((50, 60, 70, 80, 90, 99))
        if total > bill:
            return None
        q.append(f"{he} pays with {bill} dollars. How much change does {he.lower()} get?")
        s.append(f"The change is {bill} - {total} = {bill - total} dollars.")
        answer = bill - total
    else:
        q.append(f"How many dollars does {name} spend?")
        answer = total
    if total > MAX_VALUE:
        return None
    return " ".join(q), s, answer


def _share(rng: random.Random):
    """Pool two amounts, then share them equally."""
    name, other = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    people = rng.randint(2, 5)
    each = rng.randint(2, 12)
    total = people * each
    first = rng.randint(1, total - 1)
    second = total - first
    q = (f"{name} has {first} {item} and {other} has {second} {item}. "
         f"They put them together and share them equally among {people} friends. "
         f"How many {item} does each friend get?")
    s = [f"Together they have {first} + {second} = {total} {item}.",
         f"Each friend gets {total} / {people} = {each} {item}."]
    return q, s, each


def _rows(rng: random.Random):
    """Rows times items per row, then some removed or added."""
    name = rng.choice(NAMES)
    he = _PRONOUN[name]
    item = rng.choice(ITEMS)
    rows, per = rng.randint(2, 9), rng.randint(2, 9)
    k = rng.randint(1, 20)
    total = rows * per
    if rng.random() < 0.5:
        if k > total:
            return None
        q = (f"{name} puts {item} in {rows} rows with {per} {item} in each row. "
             f"Then {he.lower()} takes away {k} {item}. How many {item} are left?")
        s = [f"There are {rows} * {per} = {total} {item}.",
             f"After taking away {k}, there are {total} - {k} = {total - k} {item}."]
        answer = total - k
    else:
        if total + k > MAX_VALUE:
            return None
        q = (f"{name} puts {item} in {rows} rows with {per} {item} in each row. "
             f"Then {he.lower()} adds {k} more {item}. How many {item} are there now?")
        s = [f"There are {rows} * {per} = {total} {item}.",
             f"After adding {k}, there are {total} + {k} = {total + k} {item}."]
        answer = total + k
    return q, s, answer


TEMPLATES: tuple[Callable, ...] = (_have_change, _have_change, _shopping, _share, _rows)
"""Templates, sampled uniformly (``_have_change`` twice as often)."""


def make_problem(rng: random.Random) -> dict:
    """Draw one problem from a random template.

    Args:
      rng: a ``random.Random``; advanced by this call.

    Returns:
      ``{"question": str, "answer": str, "gold": str}``: ``answer`` is the worked
      solution, one step per line, ending with the line ``#### <gold>``; ``gold``
      is the integer answer in decimal, in [0, MAX_VALUE].
    """
    while True:
        out = rng.choice(TEMPLATES)(rng)
        if out is not None:
            question, steps, answer = out
            gold = str(answer)
            return {"question": question, "answer": "\n".join(steps + [f"#### {gold}"]), "gold": gold}


def make_split(split: str, num: int, seed: int = 0) -> list[dict]:
    """``num`` distinct problems of one split, a deterministic function of ``seed``.

    Args:
      split: ``"train"`` or ``"test"``; the splits never share a question.
      num: number of records, >= 0.
      seed: integer seed of the ``random.Random`` that draws the problems.

    Returns:
      a list of ``num`` records as from :func:`make_problem`, no question twice.

    Raises:
      ValueError: unknown ``split`` or negative ``num``, or the split ran out of
        distinct problems (more than ~100x ``num`` draws failed).
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if num < 0:
        raise ValueError(f"num must be >= 0, got {num}")
    # Separate streams per split, so asking for more test rows never changes train rows.
    rng = random.Random(f"qerl-synthetic/{split}/{seed}")
    seen: set[str] = set()
    out: list[dict] = []
    attempts = 0
    while len(out) < num:
        attempts += 1
        if attempts > 100 * num + 1000:
            raise ValueError(f"could not draw {num} distinct {split} problems (got {len(out)})")
        rec = make_problem(rng)
        if rec["question"] in seen or split_of(rec["question"]) != split:
            continue
        seen.add(rec["question"])
        out.append(rec)
    return out


def extract_answer(completion: str) -> str | None:
    """The text after the last ``####`` in ``completion``, stripped, or None if absent."""
    if "####" not in completion:
        return None
    tail = completion.rsplit("####", 1)[1].strip()
    return tail.split()[0] if tail else None


def prompt_messages(question: str) -> list[dict]:
    """The chat messages the tiny model was trained on: the question as the one user turn."""
    return [{"role": "user", "content": question}]


# --- tokenizer -------------------------------------------------------------------

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
"""Special tokens, ids 0, 1, 2: pad/end of text, turn start, turn end (= eos)."""

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""Qwen's ChatML template without the default system turn (keeps prompts short)."""

# Qwen2's pre-tokenizer split (words, single digits, punctuation runs, newlines), exactly: transformers'
# Qwen2Tokenizer (picked by AutoTokenizer for model_type qwen2) re-applies this pattern on load.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def build_tokenizer(texts, vocab_size: int = 512):
    """Train a small byte-level BPE tokenizer (Qwen2-style) on ``texts``.

    Digits are always single tokens (the pre-tokenizer splits every digit), the
    byte-level alphabet makes encode/decode an exact round trip for any text,
    and the three :data:`SPECIAL_TOKENS` get ids 0, 1, 2.

    Args:
      texts: an iterable of training strings.
      vocab_size: the vocabulary size the BPE trainer aims for (256 bytes +
        3 special tokens + merges); the result may be smaller.

    Returns:
      a ``transformers.PreTrainedTokenizerFast`` with eos ``<|im_end|>``, pad
      ``<|endoftext|>`` and :data:`CHAT_TEMPLATE`; ``save_pretrained`` writes
      tokenizer.json and tokenizer_config.json for ``AutoTokenizer``.

    Raises:
      ValueError: ``vocab_size`` below 259 (bytes + special tokens).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False, trim_offsets=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE, model_max_length=512, clean_up_tokenization_spaces=False)


def training_texts(records) -> list[str]:
    """Chat-formatted strings (prompt + solution + ``<|im_end|>``) for training a tokenizer."""
    out = []
    for r in records:
        out.append(f"<|im_start|>user\n{r['question']}<|im_end|>\n<|im_start|>assistant\n{r['answer']}<|im_end|>\n")
    return out
