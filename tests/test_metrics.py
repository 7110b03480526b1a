import pytest

from evals.metrics import exact_match, f1, final_number, gsm8k_match, normalize_answer


@pytest.mark.parametrize("raw, norm", [
    ("The Eiffel Tower!", "eiffel tower"),
    ("  an   apple,  a day ", "apple day"),
    ("Theatre", "theatre"),                 # 'the' only as a whole word
    ("1,000.5 km", "10005 km"),
])
def test_normalize_like_squad(raw, norm):
    assert normalize_answer(raw) == norm


def test_em_and_f1_by_hand():
    assert exact_match("the Denver Broncos", ["Denver Broncos", "Broncos"]) == 1.0
    assert exact_match("Denver", ["Denver Broncos"]) == 0.0
    # pred {denver}, gold {denver, broncos}: precision 1, recall 1/2 -> F1 2/3
    assert f1("Denver", ["Denver Broncos"]) == pytest.approx(2 / 3)
    assert f1("Carolina Panthers", ["Denver Broncos"]) == 0.0
    assert f1("x", ["Denver Broncos", "x y z w"]) == pytest.approx(2 * 1 * 0.25 / 1.25)


def test_gsm8k_final_number():
    assert final_number("She has 3 + 4 = 7 apples.\n#### 7") == "7"
    assert final_number("so the total is $1,250.00") == "1250"
    assert final_number("no digits") is None
    assert gsm8k_match("The answer is 72.", "... #### 72") == 1.0
    assert gsm8k_match("The answer is 71.", "... #### 72") == 0.0
