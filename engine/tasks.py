"""Tasks (prompts with verifiable answers), their rewards, and the character tokenizer of the demo.

A task yields `Problem`s; a reward function maps (completion text, answer) to a float in [0, 1].
Rewards are registered by name so that a config can pick one.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path


class InputError(ValueError):
    """Bad input files or settings found before any model loads (a data file, a model path); the command
    line prints its one-line message instead of a traceback."""


# --------------------------------------------------------------------------- tokenizer


class CharTokenizer:
    """One token per character over a fixed alphabet, plus <pad>, <bos> and <eos>.

    It has the small part of the Hugging Face tokenizer interface that bitrl uses
    (`encode`, `decode`, `pad_token_id`, `eos_token_id`, `bos_token_id`, `vocab_size`, `save_pretrained`).
    """

    SPECIALS = ("<pad>", "<bos>", "<eos>")

    def __init__(self, alphabet: str):
        if len(set(alphabet)) != len(alphabet):
            raise ValueError(f"tokenizer alphabet has repeated characters: {alphabet!r}")
        self.alphabet = alphabet
        self.itos = list(self.SPECIALS) + list(alphabet)
        self.stoi = {s: i for i, s in enumerate(self.itos)}
        self.pad_token_id, self.bos_token_id, self.eos_token_id = 0, 1, 2

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        unknown = sorted(set(text) - set(self.alphabet))
        if unknown:
            raise ValueError(f"characters {unknown} are not in the tokenizer alphabet {self.alphabet!r}")
        ids = [self.stoi[c] for c in text]
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i == self.eos_token_id and skip_special_tokens:
                break
            if i < len(self.SPECIALS):
                if not skip_special_tokens:
                    out.append(self.itos[i])
                continue
            out.append(self.itos[i])
        return "".join(out)

    def save_pretrained(self, directory: str | Path) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / "char_tokenizer.json").write_text(json.dumps({"alphabet": self.alphabet}))

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> CharTokenizer:
        return cls(json.loads((Path(directory) / "char_tokenizer.json").read_text())["alphabet"])


# --------------------------------------------------------------------------- rewards

REWARDS: dict[str, Callable[[str, str], float]] = {}


def register_reward(name: str):
    def wrap(fn):
        REWARDS[name] = fn
        return fn

    return wrap


@register_reward("exact")
def exact_reward(completion: str, answer: str) -> float:
    """1 if the completion, stripped of surrounding whitespace, is exactly the answer."""
    return float(completion.strip() == answer.strip())


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")


def _parse_number(text: str) -> Fraction | None:
    text = text.strip().replace(",", "").replace("$", "").rstrip(".")
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def extract_final_answer(completion: str) -> str | None:
    r"""The answer a math completion commits to: the last \boxed{...}, else text after '####' or
    'answer is', else the last number in the text."""
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", completion)
    if boxed:
        return boxed[-1]
    for marker in ("####", "answer is", "Answer:"):
        if marker in completion:
            tail = completion.rsplit(marker, 1)[1]
            numbers = _NUMBER.findall(tail)
            return numbers[0] if numbers else tail.strip()
    numbers = _NUMBER.findall(completion)
    return numbers[-1] if numbers else None


@register_reward("math")
def math_reward(completion: str, answer: str) -> float:
    """1 if the completion's final answer equals the reference, numerically where both parse as numbers
    (so '0.5', '1/2' and '\\boxed{1/2}' all match '1/2'), else as normalised strings."""
    predicted = extract_final_answer(completion)
    if predicted is None:
        return 0.0
    a, b = _parse_number(predicted), _parse_number(answer)
    if a is not None and b is not None:
        return float(a == b)
    norm = lambda s: re.sub(r"\s+", "", s).strip("$").lower()
    return float(norm(predicted) == norm(answer))


# --------------------------------------------------------------------------- tasks


@dataclass(frozen=True)
class Problem:
    uid: str  # stable identity, used by caches and for the train/held-out split
    prompt: str
    answer: str


class ArithmeticTask:
    """Addition and subtraction of integers with up to `digits` digits, e.g. '47+86=' -> '133'.

    The held-out split is a fixed, seeded sample of problems that the training stream never yields.
    """

    alphabet = "0123456789+-="

    def __init__(self, digits: int = 2, n_eval: int = 400, seed: int = 0, ops: str = "+-"):
        if digits < 1 or digits > 6:
            raise InputError(f"task.digits must be in 1..6, got {digits}")
        if not ops or set(ops) - {"+", "-"}:
            raise InputError(f"task.ops must use only '+' and '-', got {ops!r}")
        self.digits, self.ops = digits, ops
        self.high = 10**digits
        total = self.high * self.high * len(ops)
        if n_eval > total // 4:
            raise InputError(f"task.n_eval={n_eval} is too large for {total} distinct problems")
        rng = random.Random(f"heldout-{seed}")
        held = set()
        while len(held) < n_eval:
            held.add(self._triple(rng))
        self.heldout_keys = held
        self.eval_problems = [self._problem(*t) for t in sorted(held)]

    def _triple(self, rng: random.Random) -> tuple[int, str, int]:
        return rng.randrange(self.high), rng.choice(self.ops), rng.randrange(self.high)

    def _problem(self, a: int, op: str, b: int) -> Problem:
        value = a + b if op == "+" else a - b
        return Problem(uid=f"{a}{op}{b}", prompt=f"{a}{op}{b}=", answer=str(value))

    def sample(self, rng: random.Random) -> Problem:
        """A training problem drawn with `rng`; never one of the held-out problems."""
        while True:
            t = self._triple(rng)
            if t not in self.heldout_keys:
                return self._problem(*t)


class WordsTask(ArithmeticTask):
    """The arithmetic task's sums told as short English word problems with numeric answers, e.g.
    'Maya has 23 marbles. She gets 41 more. How many marbles does Maya have now? Reply with just the number.'
    -> '64', for pretrained (instruct) models and the `math` reward.

    The phrasing is a function of the numbers, so each problem has one text; the held-out split is over the
    numbers (a held-out sum never reaches training under any phrasing).
    """

    NAMES = ("Maya", "Leo", "Ana", "Sam", "Priya", "Tom", "Lena", "Omar", "Kai", "Zoe", "Ivan", "Nia")
    ITEMS = ("apples", "marbles", "stickers", "books", "coins", "pencils", "cards", "shells", "stamps")
    ADD = (
        "What is {a} plus {b}?",
        "What is the sum of {a} and {b}?",
        "Add {a} and {b}.",
        "{name} has {a} {items} and gets {b} more. How many {items} does {name} have now?",
        "A box holds {a} {items} and another box holds {b} {items}. How many {items} are there in total?",
        "{name} read {a} pages on Monday and {b} pages on Tuesday. How many pages did {name} read in all?",
    )
    SUBTRACT = (
        "The temperature was {a} degrees. It fell by {b} degrees. What is the temperature now?",
        "{name} had {a} points in a game and lost {b} points. What is {name}'s score now?",
        "What is {a} minus {b}?",
    )
    INSTRUCTION = " Reply with just the number."
    # show_work: long responses (worked steps, then the answer) for benchmarks of long-response rollouts;
    # the `math` reward reads the number after the last "answer is". Worded for sums, as the presets use
    # (ops "+"); the benchmark figures in the README were measured with exactly this text.
    SHOW_WORK = (
        " Show your work: explain step by step how you add the numbers, digit by digit, then finish"
        " with 'The answer is N.'"
    )

    def __init__(
        self, digits: int = 2, n_eval: int = 400, seed: int = 0, ops: str = "+-", show_work: bool = False
    ):
        self.show_work = show_work  # before the base class builds the held-out problems
        super().__init__(digits, n_eval, seed, ops)

    def _problem(self, a: int, op: str, b: int) -> Problem:
        value = a + b if op == "+" else a - b
        pick = random.Random(f"words-{a}{op}{b}")
        text = pick.choice(self.ADD if op == "+" else self.SUBTRACT).format(
            a=a, b=b, name=pick.choice(self.NAMES), items=pick.choice(self.ITEMS)
        )
        instruction = self.SHOW_WORK if self.show_work else self.INSTRUCTION
        return Problem(uid=f"{a}{op}{b}", prompt=text + instruction, answer=str(value))


class JsonlTask:
    """Problems from a JSONL file of {"prompt": str, "answer": str|number} objects, one per line.

    The last `n_eval` lines (after a seeded shuffle) are held out.
    """

    def __init__(self, path: str | Path, n_eval: int = 64, seed: int = 0):
        path = Path(path)
        if not path.is_file():
            raise InputError(f"task.path: no such file {str(path)!r}")
        problems = []
        for lineno, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise InputError(f"{path}:{lineno}: expected an object with 'prompt' and 'answer'")
            for field in ("prompt", "answer"):
                if field not in row:
                    raise InputError(f"{path}:{lineno}: missing field {field!r}")
            if not isinstance(row["prompt"], str) or not row["prompt"]:
                raise InputError(f"{path}:{lineno}: field 'prompt' must be a non-empty string")
            if not isinstance(row["answer"], str | int | float):
                raise InputError(f"{path}:{lineno}: field 'answer' must be a string or a number")
            problems.append(
                Problem(uid=str(row.get("id", lineno)), prompt=row["prompt"], answer=str(row["answer"]))
            )
        if len(problems) < 2:
            raise InputError(
                f"{path}: {len(problems)} problem(s), too few for a training and a held-out split (need 2)"
            )
        random.Random(seed).shuffle(problems)
        n_eval = min(n_eval, len(problems) // 2)
        self.train_problems = problems[: len(problems) - n_eval]
        self.eval_problems = problems[len(problems) - n_eval :]

    def sample(self, rng: random.Random) -> Problem:
        return rng.choice(self.train_problems)
