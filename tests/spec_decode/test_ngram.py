"""The n-gram proposer: longest suffix match first, recent occurrences with a full continuation
preferred, nothing below prompt_lookup_min."""
from __future__ import annotations

from shardserve.spec_decode.ngram import propose_ngram


def test_the_longest_matching_suffix_wins():
    # Suffix [1, 2, 3] occurs at 0 (followed by 9 9) and [2, 3] also at 7 (followed by 5): n=3 first.
    tokens = [1, 2, 3, 9, 9, 7, 7, 2, 3, 5, 6, 1, 2, 3]
    assert propose_ngram(tokens, 1, 3, 2) == [9, 9]
    assert propose_ngram(tokens, 1, 2, 2) == [5, 6]   # n <= 2: the latest [2, 3] with 2 tokens after it


def test_latest_occurrence_with_a_full_continuation():
    tokens = [4, 8, 1, 4, 8, 2, 4, 8, 3, 3, 4, 8]
    assert propose_ngram(tokens, 2, 2, 2) == [3, 3]
    assert propose_ngram(tokens, 2, 2, 4) == [3, 3, 4, 8]
    assert propose_ngram(tokens, 2, 2, 5) == [2, 4, 8, 3, 3]   # only the 2nd occurrence has 5 after it
    # A run repeats: its latest full occurrence gives k tokens, not the one token before the end.
    assert propose_ngram([7] * 10, 1, 3, 4) == [7, 7, 7, 7]


def test_no_match_below_the_minimum_gives_nothing():
    assert propose_ngram([1, 2, 3, 4, 5, 6], 1, 4, 3) == []
    assert propose_ngram([1, 2, 1, 3], 2, 3, 3) == []     # only a 1-gram repeats
    assert propose_ngram([1, 2, 1, 3, 1], 1, 3, 3) == [2, 1, 3]   # the first [1]: the latest lacks 3 after it
    assert propose_ngram([1, 2, 1, 3, 1], 1, 3, 2) == [3, 1]
    assert propose_ngram([5], 1, 3, 3) == []
