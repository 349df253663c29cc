"""The ngram drafter's candidates on hand-written histories."""

from __future__ import annotations

from specdraft.drafters.ngram import NgramConfig, NgramDrafter
from specdraft.verify import Accepted


def make(history: list[int], **kw) -> NgramDrafter:
    d = NgramDrafter(NgramConfig(**kw))
    d.reset(history[:-1], history[-1], None)
    return d


def test_longest_match_first_and_several_matches():
    # "1 2" occurs twice before the end, followed by 3 4 and by 7 8; "9 1 2" once, followed by 7 8
    d = make([1, 2, 3, 4, 5, 9, 1, 2, 7, 8, 6, 9, 1, 2], depth=2, max_n=3, min_n=2)
    cands = d.candidates()
    assert cands[0] == [7, 8]  # from the 3-gram match "9 1 2"
    assert [3, 4] in cands
    tree = d.propose(budget=10)
    assert tree.tokens[0] == 2 and set(tree.children(0)) == {7, 3}


def test_no_match_gives_root_only():
    d = make([1, 2, 3, 4], max_n=3, min_n=2)
    assert d.candidates() == []
    assert len(d.propose(budget=8)) == 1


def test_commit_extends_index():
    d = make([5, 6, 7, 5], depth=3, max_n=2, min_n=1)
    assert d.candidates()[0] == [6, 7, 5]
    d.commit(Accepted(path=[0, 1], tokens=[6], bonus=9), None)
    assert d.history == [5, 6, 7, 5, 6, 9]
    assert d.candidates() == []  # "6 9" and "9" never occurred before
