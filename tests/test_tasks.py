import json
import random
import re

import pytest

from bitrl.engine.tasks import REWARDS, ArithmeticTask, CharTokenizer, JsonlTask, extract_final_answer


def test_char_tokenizer_round_trip_and_specials():
    tok = CharTokenizer("0123456789+-=")
    ids = tok.encode("12+3=", add_special_tokens=True)
    assert ids[0] == tok.bos_token_id and len(ids) == 6
    assert tok.decode(ids) == "12+3="
    assert tok.decode(tok.encode("45") + [tok.eos_token_id] + tok.encode("9")) == "45"
    assert tok.vocab_size == 3 + 13


def test_char_tokenizer_rejects_unknown_characters(tmp_path):
    tok = CharTokenizer("0123456789")
    with pytest.raises(ValueError, match=r"\['x'\]"):
        tok.encode("1x")
    tok.save_pretrained(tmp_path)
    assert CharTokenizer.from_pretrained(tmp_path).itos == tok.itos


def test_arithmetic_task_answers_and_heldout_split():
    task = ArithmeticTask(digits=2, n_eval=100, seed=3)
    assert len(task.eval_problems) == 100
    rng = random.Random(0)
    for _ in range(2000):
        p = task.sample(rng)
        a, op, b = p.uid.partition("+") if "+" in p.uid else p.uid.partition("-")
        assert int(p.answer) == (int(a) + int(b) if op == "+" else int(a) - int(b))
        assert p.prompt == p.uid + "="
    heldout = {p.uid for p in task.eval_problems}
    assert not heldout & {task.sample(rng).uid for _ in range(5000)}
    # The same seed gives the same split; another seed another one.
    assert [p.uid for p in ArithmeticTask(2, 100, seed=3).eval_problems] == [
        p.uid for p in task.eval_problems
    ]
    assert [p.uid for p in ArithmeticTask(2, 100, seed=4).eval_problems] != [
        p.uid for p in task.eval_problems
    ]


@pytest.mark.parametrize(
    "kwargs,field",
    [({"digits": 0}, "digits"), ({"ops": "*"}, "ops"), ({"digits": 1, "n_eval": 100}, "n_eval")],
)
def test_arithmetic_task_bad_settings(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ArithmeticTask(**kwargs)


def test_exact_reward():
    assert REWARDS["exact"]("133", "133") == 1.0
    assert REWARDS["exact"](" 133 ", "133") == 1.0
    assert REWARDS["exact"]("1330", "133") == 0.0
    assert REWARDS["exact"]("", "0") == 0.0


@pytest.mark.parametrize(
    "completion,answer,expected",
    [
        ("so the answer is 42.", "42", 1.0),
        ("#### 1,234", "1234", 1.0),
        ("we get \\boxed{1/2}", "0.5", 1.0),
        ("first 3 then 7", "7", 1.0),
        ("first 3 then 7", "3", 0.0),
        ("\\boxed{x+1}", "x + 1", 1.0),
        ("no number here", "5", 0.0),
        ("-12", "-12.0", 1.0),
    ],
)
def test_math_reward(completion, answer, expected):
    assert REWARDS["math"](completion, answer) == expected


def test_extract_final_answer_prefers_boxed():
    assert extract_final_answer("2 and \\boxed{5} then 9") == "5"


def test_jsonl_task_reads_and_validates(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"q{i}", "answer": i}) for i in range(10)) + "\n")
    task = JsonlTask(path, n_eval=3, seed=0)
    assert len(task.eval_problems) == 3 and len(task.train_problems) == 7
    assert all(p.answer == p.prompt[1:] for p in task.eval_problems)

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "answer": 1}\n{"prompt": "b"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: missing field 'answer'"):
        JsonlTask(bad)
    bad.write_text('{"prompt": "a", "answer": 1}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        JsonlTask(bad)
    with pytest.raises(ValueError, match="no such file"):
        JsonlTask(tmp_path / "missing.jsonl")


def test_words_task_states_the_sum_in_words():
    from bitrl.engine.tasks import WordsTask

    task = WordsTask(digits=2, n_eval=50, seed=1, ops="+-")
    rng = random.Random(0)
    problems = [task.sample(rng) for _ in range(500)]
    for p in problems + task.eval_problems:
        a, op, b = (int(x) if x.isdigit() else x for x in re.split(r"([+-])", p.uid, maxsplit=1))
        assert int(p.answer) == (a + b if op == "+" else a - b)
        numbers = [int(n) for n in re.findall(r"\d+", p.prompt)]
        assert numbers == [a, b], p.prompt  # both operands, in order, and no other number
        assert p.prompt.endswith("Reply with just the number.")
    assert len({p.prompt.split()[0] for p in problems}) > 3  # several phrasings
    # one text per problem; the held-out sums never reach training
    assert WordsTask(2, 50, seed=1, ops="+-")._problem(12, "+", 30) == task._problem(12, "+", 30)
    assert not {p.uid for p in task.eval_problems} & {task.sample(rng).uid for _ in range(5000)}
    assert [p.uid for p in task.eval_problems] == [
        p.uid for p in ArithmeticTask(2, 50, 1, "+-").eval_problems
    ]


def test_show_work_words_task_is_seeded_and_asks_for_the_steps():
    from bitrl.engine.tasks import WordsTask

    task = WordsTask(digits=2, n_eval=20, seed=5, ops="+", show_work=True)
    again = WordsTask(digits=2, n_eval=20, seed=5, ops="+", show_work=True)
    assert task.eval_problems == again.eval_problems  # the same prompts and answers from the same seed
    rng, rng_again = random.Random(7), random.Random(7)
    drawn = [task.sample(rng) for _ in range(50)]
    assert drawn == [again.sample(rng_again) for _ in range(50)]
    terse = WordsTask(digits=2, n_eval=20, seed=5, ops="+")
    # the same problems (ids, answers, held-out split) as the terse task; only the instruction differs
    assert [(p.uid, p.answer) for p in task.eval_problems] == [(p.uid, p.answer) for p in terse.eval_problems]
    rng_terse = random.Random(7)
    assert [(p.uid, p.answer) for p in drawn] == [
        (q.uid, q.answer) for q in (terse.sample(rng_terse) for _ in drawn)
    ]
    for p in drawn + task.eval_problems:
        assert "step by step" in p.prompt and p.prompt.endswith("'The answer is N.'")
        assert "Reply with just the number" not in p.prompt
        a, b = map(int, p.uid.split("+"))
        assert [int(n) for n in re.findall(r"\d+", p.prompt)] == [a, b]  # no other number in the text
        assert p.answer == str(a + b)


def test_math_reward_reads_the_final_answer_of_a_worked_response():
    reward = REWARDS["math"]
    worked = (
        "Step 1: add the ones: 7 + 5 = 12, write 2 and carry 1.\n"
        "Step 2: add the tens: 4 + 3 + 1 = 8.\n"
        "So 47 + 35 = 82. The answer is 82."
    )
    assert reward(worked, "82") == 1.0
    assert reward(worked, "12") == 0.0  # an intermediate number is not the answer
    assert reward(worked.replace("The answer is 82.", "The answer is 81."), "82") == 0.0
    # without the closing sentence, the last number counts
    assert reward("7 + 5 = 12, carry 1; 4 + 3 + 1 = 8, so 82", "82") == 1.0
    assert reward("Step 1: 7 + 5 = 12.", "82") == 0.0  # cut off before the answer


def test_math_reward_on_word_problem_answers():
    reward = REWARDS["math"]
    assert reward("12 + 55 = 67", "67") == 1.0
    assert reward("Sam has 3 + 7 = 10 marbles.", "10") == 1.0
    assert reward("There are 3 + 49", "52") == 0.0  # cut off before the answer
    assert reward("The answer is 52.", "52") == 1.0
