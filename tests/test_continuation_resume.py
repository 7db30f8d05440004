"""Resume points and divergence, alone: where an exact join resumes and what a continuation generates again."""

from __future__ import annotations

from narwhal.serving.continuation.resume import ResumePoints, stop_lookback


def first_leg(points: ResumePoints, reads: list[tuple[list[int] | None, str]]) -> list[str]:
    """Feed a first leg's reads (token IDs, text); the client's text in pieces."""
    text = []
    for ids, piece in reads:
        assert points.advance(ids, piece, True) == (0, 0, 0)
        if piece:
            text.append(piece)
    return text


def test_stop_lookback_reads_the_stop_strings_as_vllm_does():
    assert stop_lookback({}) == (0, 0)
    assert stop_lookback({"stop": "x"}) == (0, 0)
    assert stop_lookback({"stop": "abc"}) == (2, 2)
    assert stop_lookback({"stop": ["ab", 7, "abcd"]}) == (3, 3)
    # Included in the output: nothing is held back, but the span still matters at a join.
    assert stop_lookback({"stop": "abc", "include_stop_str_in_output": "true"}) == (0, 2)
    assert stop_lookback({"stop": "abc", "include_stop_str_in_output": 1}) == (0, 2)


def test_without_stop_strings_the_join_resumes_after_the_last_whole_character():
    points = ResumePoints({})
    text = first_leg(points, [([1], "a"), ([2], "b"), ([3], "c")])
    assert points.resume_exactly(text) == 3
    assert points.token_ids == [1, 2, 3] and points.engine_pos == 3


def test_a_read_of_several_tokens_is_no_resume_point_and_what_follows_is_generated_again():
    points = ResumePoints({})
    text = first_leg(points, [([1], "a"), ([2], "b"), ([4, 5], "de")])
    assert points.resume_exactly(text) == 2
    assert points.token_ids == [1, 2]
    # The next engine generates "d" and "e" again: the client has them, and they are not sent twice.
    assert points.advance([4], "d", False) == (1, 1, 0)
    assert points.advance([5], "e", False) == (1, 1, 0)
    assert points.advance([6], "f", False) == (0, 0, 0)
    assert points.regenerated == 2 and not points.diverged
    assert points.sent == [1, 2, 4, 5, 6] and points.token_ids == [1, 2, 4, 5, 6] and points.sent_chars == 5


def test_a_byte_token_without_text_is_no_resume_point():
    points = ResumePoints({})
    text = first_leg(points, [([1], "a"), ([2], ""), ([3], "é")])
    # Token 2 ended inside a character: only after token 3 is the answer whole again.
    assert points.resume_exactly(text) == 3


def test_a_stop_string_spanning_the_join_is_seen_by_the_next_engine():
    points = ResumePoints({"stop": "xyz", "include_stop_str_in_output": True})
    text = first_leg(points, [([1], "a"), ([2], "b"), ([3], "c"), ([4], "d")])
    # The join resumes a stop string's span (2 characters) back: "cd" is generated again.
    assert points.resume_exactly(text) == 2
    assert points.advance([3], "c", False) == (1, 1, 0)
    assert points.advance([4], "d", False) == (1, 1, 0)
    assert not points.diverged


def test_a_sampled_continuation_that_comes_out_differently_diverges_and_the_client_keeps_its_text():
    points = ResumePoints({})
    text = first_leg(points, [([1], "a"), ([2], "b"), ([4, 5], "de")])
    assert points.resume_exactly(text) == 2
    # Two tokens generated again, both different: the client keeps "de" and gets nothing of them.
    assert points.advance([9], "x", False) == (1, 1, 0)
    assert points.diverged and points.leg_diverged
    assert points.advance([10], "y", False) == (1, 1, 0)
    # The first token it did not have: its text runs on from what the client has.
    assert points.advance([11], "z", False) == (0, 0, 0)
    assert points.regenerated == 2
    assert points.sent == [1, 2, 4, 5, 11] and points.sent_chars == 5 and points.engine_pos == 5


def test_the_next_leg_starts_without_the_last_legs_divergence():
    points = ResumePoints({})
    text = first_leg(points, [([1], "a"), ([4, 5], "de")])
    points.resume_exactly(text)
    points.advance([9], "x", False)
    assert points.leg_diverged
    points.resume_exactly(text)
    assert points.diverged and not points.leg_diverged


def test_an_engine_without_token_ids_that_generates_the_same_text_again_catches_up():
    points = ResumePoints({})
    text = first_leg(points, [([1], "a"), ([4, 5], "de")])
    assert points.resume_exactly(text) == 1
    # No IDs, but the text matches all the client had: the same tokens, counted as regenerated.
    assert points.advance(None, "de", False) == (0, 2, 2)
    assert points.token_ids == [1, 4, 5] and points.regenerated == 2 and not points.diverged


def test_a_text_join_resumes_after_everything_the_client_has():
    points = ResumePoints({})
    first_leg(points, [([1], "a"), ([4, 5], "de")])
    del points.token_ids[1:]
    assert points.resume_from_text(1) == 3
    assert points.token_ids == [1, 4, 5] and points.engine_pos == 3
    assert points.advance([6], "f", False) == (0, 0, 0)
