"""benchmarks/task_screen.py's candidate tasks: their rules against hand-written answers."""

import importlib.util

import pytest

from tests.helpers import REPO

spec = importlib.util.spec_from_file_location("task_screen", REPO / "benchmarks" / "task_screen.py")
task_screen = importlib.util.module_from_spec(spec)
spec.loader.exec_module(task_screen)


def test_roman_numerals_by_hand():
    by_hand = {1: "I", 4: "IV", 9: "IX", 14: "XIV", 40: "XL", 90: "XC", 400: "CD", 1987: "MCMLXXXVII",
               2024: "MMXXIV", 3999: "MMMCMXCIX"}  # fmt: skip
    assert {n: task_screen.roman(n) for n in by_hand} == by_hand


def test_snake_case_by_hand_and_the_names_are_camel_case():
    assert task_screen.snake("getLogger") == "get_logger"
    assert task_screen.snake("assertNotAlmostEqual") == "assert_not_almost_equal"
    names = task_screen.camel_names()
    assert "getLogger" in names and "assertEqual" in names and len(names) > 100
    assert all(n[0].islower() and any(c.isupper() for c in n) and n.isalpha() for n in names)


def test_candidates_are_n_questions_each_and_dates_come_from_the_validation_split():
    from squash.datasets.iso_dates import iso_date_pairs

    tasks = task_screen.candidates(7)
    assert {k: len(v) for k, v in tasks.items()} == {"date": 7, "roman": 7, "snake": 7}
    assert [a for _, a in tasks["date"]] == [a for _, a in iso_date_pairs("validation")[:7]]
    assert tasks["roman"][0][1] == task_screen.roman(int(tasks["roman"][0][0].split()[1]))


@pytest.mark.parametrize("task", ["roman", "snake"])
def test_candidate_splits_are_disjoint_and_checked_by_the_rule(task):
    val, train = task_screen.candidate_split(task, "validation"), task_screen.candidate_split(task, "train")
    assert val == task_screen.candidates(50)[task] and len(val) == 50
    assert not {q for q, _ in val} & {q for q, _ in train}
    assert len(train) == (3999 if task == "roman" else len(task_screen.camel_names())) - 50
    for q, a in val + train:
        subject = q.split()[1] if task == "roman" else q.split()[4]
        assert a == (task_screen.roman(int(subject)) if task == "roman" else task_screen.snake(subject))
    with pytest.raises(ValueError, match="task must be roman or snake"):
        task_screen.candidate_split("date", "train")
