"""Token accounting, alone: the client's and the prompt's token counts from IDs, events, usage and /tokenize."""

from __future__ import annotations

from narwhal.serving.continuation.accounting import TokenAccount

USAGE = {"stream_options": {"include_usage": True}}


def test_the_engines_usage_beats_a_count_from_events_and_the_ids_held_beat_both():
    account = TokenAccount({"prompt": "p"}, chat=False)
    account.leg_tokens = 3
    assert account.total(0, 0) == 3
    account.usage_came({"completion_tokens": 5}, True)
    assert account.total(0, 0) == 5
    # Unread events count on top; the token IDs the client holds are a floor.
    assert account.total(2, 0) == 7 and account.total(0, 9) == 9
    account.end_leg()
    assert (account.tokens_before, account.leg_tokens, account.leg_usage) == (5, 0, None)


def test_the_prompts_count_comes_from_its_ids_else_the_first_engine_that_gives_one():
    assert TokenAccount({"prompt": [4, 5, 6]}, chat=False).prompt_tokens == 3
    account = TokenAccount({"prompt": "p"}, chat=False)
    assert account.prompt_tokens is None
    account.usage_came({"prompt_tokens": 7}, False)
    assert account.prompt_tokens is None  # a continuation's prompt holds the answer so far
    for wrong in (-1, True, "7"):
        account.note_prompt_tokens(wrong)  # type: ignore[arg-type]
    assert account.prompt_tokens is None
    account.usage_came({"prompt_tokens": 7}, True)
    account.note_prompt_tokens(8)
    assert account.prompt_tokens == 7
    account.note_prompt([1, 2])
    account.note_prompt([1, 2, 3])
    assert account.prompt_ids == [1, 2] and account.prompt_tokens == 2


def test_the_tokenize_query_counts_the_prompt_as_the_first_leg_did():
    assert TokenAccount({"prompt": "p"}, chat=False).prompt_query() == {"prompt": "p"}
    assert TokenAccount({"prompt": ["p"]}, chat=False).prompt_query() == {"prompt": "p"}
    assert TokenAccount({"prompt": [1, 2]}, chat=False).prompt_query() is None
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}], "add_generation_prompt": True,
            "max_tokens": 3}
    assert TokenAccount(chat, chat=True).prompt_query() == {"messages": chat["messages"],
                                                           "add_generation_prompt": True}
    known = TokenAccount({"prompt": "p"}, chat=False)
    known.note_prompt_tokens(4)
    assert known.prompt_query() is None


def test_a_tokenize_count_replaces_the_event_count_only_of_tokens_that_came_without_ids():
    account = TokenAccount({"prompt": "p"}, chat=False)
    account.leg_tokens = 4
    account.counted(10, 3, 2)
    assert (account.tokens_before, account.prompt_tokens) == (0, 3)  # nothing was uncounted
    account.uncounted = True
    account.counted(10, None, 12)
    assert (account.tokens_before, account.leg_tokens, account.uncounted) == (12, 0, False)


def test_a_continuations_usage_is_the_whole_answers():
    account = TokenAccount({"prompt": [1, 2, 3]}, chat=False)
    account.tokens_before = 6
    usage = {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13}
    account.rewrite_usage(usage, 8)
    assert usage == {"prompt_tokens": 3, "completion_tokens": 10, "total_tokens": 13}
    # The prompt's count unknown: the continuation's prompt less the answer it held.
    unknown = TokenAccount({"prompt": "p"}, chat=False)
    unknown.tokens_before = 6
    usage = {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13}
    unknown.rewrite_usage(usage, 12)
    assert usage == {"prompt_tokens": 3, "completion_tokens": 12, "total_tokens": 15}


def test_the_tail_owes_one_usage_only_when_asked_and_only_with_the_engines_counts():
    assert TokenAccount({"prompt": [1]}, chat=False).tail_usage(4) is None
    account = TokenAccount({"prompt": "p", **USAGE}, chat=False)
    assert account.tail_needs_count and account.tail_usage(4) is None
    account.note_prompt_tokens(2)
    account.uncounted = True
    assert account.tail_needs_count and account.tail_usage(4) is None
    account.counted(5, None, 0)
    assert not account.tail_needs_count
    assert account.tail_usage(5) == {"prompt_tokens": 2, "total_tokens": 7, "completion_tokens": 5}
    assert account.usage_sent and account.tail_usage(5) is None
