"""Cutting a streamed answer into pieces to speak."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metronome.audio.sentences import CutPolicy, SentenceCutter, speakable

WHOLE_SENTENCES = CutPolicy(max_chars=200, first_clause_chars=0)


def cut(text: str, policy: CutPolicy = WHOLE_SENTENCES, deltas: list[str] | None = None) -> list[str]:
    cutter = SentenceCutter(policy)
    pieces = []
    for delta in deltas if deltas is not None else [text]:
        pieces += cutter.push(delta)
    return pieces + cutter.flush()


def test_sentences_at_their_marks():
    assert cut("Paris is in France. Is it big? Yes! Very…  Fine.") == [
        "Paris is in France.", "Is it big?", "Yes!", "Very…", "Fine."]


def test_abbreviations_and_initials_do_not_end_a_sentence():
    text = "Dr. Smith met Mrs. J. Jones at 5 p.m. on Elm St. today, e.g. for tea. They talked."
    assert cut(text) == ["Dr. Smith met Mrs. J. Jones at 5 p.m. on Elm St. today, e.g. for tea.", "They talked."]


def test_numbers_keep_their_points_and_commas():
    assert cut("It costs 3.50 dollars, about 1,000 yen. Version 2.1.3 is out.") == [
        "It costs 3.50 dollars, about 1,000 yen.", "Version 2.1.3 is out."]


def test_a_point_after_a_number_waits_for_what_follows():
    cutter = SentenceCutter(WHOLE_SENTENCES)
    assert cutter.push("Pi is about 3.") == []          # may go on as 3.14
    assert cutter.push("14. Yes") == ["Pi is about 3.14."]
    assert cutter.push("") == [] and cutter.flush() == ["Yes"]
    cutter = SentenceCutter(WHOLE_SENTENCES)
    assert cutter.push("It was built in 1889.") == []
    assert cutter.push(" It is tall.") == ["It was built in 1889.", "It is tall."]


def test_a_sentence_ends_as_soon_as_its_mark_arrives():
    cutter = SentenceCutter(WHOLE_SENTENCES)
    assert cutter.push("The capital of France is Paris") == []
    assert cutter.push(".") == ["The capital of France is Paris."]   # no need to wait for the next token


def test_closing_quotes_stay_with_their_sentence():
    assert cut('He said "stop." Then he left.') == ['He said "stop."', "Then he left."]


def test_line_breaks_end_pieces_and_list_numbers_stay():
    assert cut("Three cities:\n1. Paris\n2. Lyon\n3. Nice") == ["Three cities:", "1. Paris", "2. Lyon", "3. Nice"]


def test_no_punctuation_is_cut_at_the_length_bound_on_a_word_boundary():
    words = " ".join(["word"] * 100)
    pieces = cut(words, CutPolicy(max_chars=50, first_clause_chars=0))
    assert all(len(p) <= 50 for p in pieces) and len(pieces) > 5
    assert " ".join(pieces) == words


def test_a_long_sentence_is_cut_at_its_last_clause_mark():
    text = "When the sun sets over the hills, the sky turns red, and the birds fly home to their nests at last."
    assert cut(text, CutPolicy(max_chars=60, first_clause_chars=0)) == [
        "When the sun sets over the hills, the sky turns red,", "and the birds fly home to their nests at last."]


def test_the_first_piece_ends_at_a_clause_for_early_audio():
    policy = CutPolicy(max_chars=200, first_clause_chars=20, first_words=0)
    text = "Yes, the capital of France is Paris, a city on the Seine, with many museums. It is old, and big."
    assert cut(text, policy) == [
        "Yes, the capital of France is Paris,", "a city on the Seine, with many museums.", "It is old, and big."]


def test_the_first_piece_ends_after_its_first_words_when_no_clause_mark_comes_sooner():
    policy = CutPolicy(max_chars=200, first_clause_chars=24, first_words=4)
    text = "The capital of France is Paris. It is old, and big."
    assert cut(text, policy) == ["The capital of France", "is Paris.", "It is old, and big."]
    assert cut(text, policy, deltas=["The capital of Fr", "ance", " is Paris.", " It is old, and big."]) == \
        ["The capital of France", "is Paris.", "It is old, and big."]   # "Fr" is not yet a whole word
    assert cut("Yes, it is. Paris is big.", policy) == ["Yes, it is.", "Paris is big."]   # a sentence is sooner


def test_punctuation_alone_is_not_spoken():
    assert cut("Hi! ... ?! Bye.") == ["Hi!", "Bye."]
    assert not speakable("...") and speakable("ok")


def test_deltas_split_anywhere_give_the_same_pieces():
    text = "Dr. Smith lives in Paris, France. He is 42. He likes tea, e.g. green tea! Does he? Yes."
    whole = cut(text)
    assert cut(text, deltas=list(text)) == whole
    assert cut(text, deltas=[text[i:i + 7] for i in range(0, len(text), 7)]) == whole


def test_policy_is_validated():
    with pytest.raises(ValueError):
        CutPolicy(max_chars=0)


_WORDS = st.sampled_from(["the", "Paris", "big", "city", "is", "42", "3.5", "Dr.", "one", "e.g."])
_MARKS = st.sampled_from(["", "", "", ",", ".", "!", "?", ";", ":", "\n"])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(_WORDS, _MARKS), min_size=1, max_size=60), st.data())
def test_nothing_is_lost_and_no_piece_is_too_long(words, data):
    text = " ".join(w + m for w, m in words)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=10)))
    deltas = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    policy = CutPolicy(max_chars=40, first_clause_chars=10)
    pieces = cut(text, policy, deltas)
    assert "".join(pieces).replace(" ", "") == "".join(text.split())
    assert all(len(p) <= policy.max_chars for p in pieces)
