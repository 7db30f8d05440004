"""Next-leg building, alone: the four kinds of continuation request and what each leg still asks for."""

from __future__ import annotations

import copy

from narwhal.serving.continuation import legs
from narwhal.serving.continuation.policy import CHAT, COMPLETIONS


def test_the_first_leg_asks_for_token_ids_without_touching_the_request():
    request = {"model": "m", "prompt": "p"}
    leg = legs.first_leg(COMPLETIONS, request, client_ids=False)
    assert leg == legs.Leg(COMPLETIONS, {"model": "m", "prompt": "p", "return_token_ids": True})
    assert request == {"model": "m", "prompt": "p"}
    asked = {"prompt": "p", "return_token_ids": True}
    assert legs.first_leg(COMPLETIONS, asked, client_ids=True).body == asked


def test_a_continuation_asks_for_the_tokens_still_owed():
    body = legs.owed(COMPLETIONS, {"prompt": "p", "max_tokens": 10, "min_tokens": 3}, client_ids=False, produced=4)
    assert body == {"prompt": "p", "max_tokens": 6, "min_tokens": 0, "return_token_ids": True}
    # The completions default (16) holds for the whole answer.
    assert legs.owed(COMPLETIONS, {"prompt": "p"}, client_ids=True, produced=5)["max_tokens"] == 11
    # Never asks for none: an engine answers max_tokens 0 with an error.
    assert legs.owed(COMPLETIONS, {"prompt": "p", "max_tokens": 4}, client_ids=True, produced=4)["max_tokens"] == 1
    chat = legs.owed(CHAT, {"messages": [], "max_completion_tokens": 9}, client_ids=True, produced=2)
    assert chat == {"messages": [], "max_completion_tokens": 7}
    # A chat without a limit gets none.
    assert "max_tokens" not in legs.owed(CHAT, {"messages": []}, client_ids=True, produced=2)


def test_a_completion_resumes_by_token_ids():
    leg = legs.completion_by_ids({"prompt": "p", "max_tokens": 3}, [1, 2], [7, 8])
    assert leg == legs.Leg(COMPLETIONS, {"prompt": [1, 2, 7, 8], "max_tokens": 3})


def test_a_completion_resumes_by_exactly_the_text_the_client_has():
    for text in (" ends with a space ", "no space", "\n\n"):
        assert legs.completion_by_text({"prompt": "Say:"}, text) == legs.Leg(COMPLETIONS, {"prompt": "Say:" + text})
    assert legs.completion_by_text({"prompt": ["Say:"]}, " x").body["prompt"] == "Say: x"
    # A token-ID prompt has no text to extend.
    assert legs.completion_by_text({"prompt": [1, 2]}, " x") is None


def test_a_chat_answer_resumes_as_a_token_id_completion():
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 5,
            "add_generation_prompt": True, "chat_template_kwargs": {}, "stream": True}
    leg = legs.chat_as_completion(body, [1, 2], [3])
    assert leg == legs.Leg(COMPLETIONS, {"model": "m", "stream": True, "max_tokens": 5, "prompt": [1, 2, 3]},
                           as_chat=True)


def test_a_chat_answer_resumes_by_text_as_its_final_message_continued():
    messages = [{"role": "user", "content": "x"}]
    original = copy.deepcopy(messages)
    leg = legs.chat_by_text({"messages": messages, "add_generation_prompt": True}, "Hello, wor")
    assert leg == legs.Leg(CHAT, {"messages": [*original, {"role": "assistant", "content": "Hello, wor"}],
                                  "add_generation_prompt": False, "continue_final_message": True})
    assert messages == original
    # The client's own final assistant message, continued: the answer runs on inside it.
    prefilled = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "Sure: "}]
    leg = legs.chat_by_text({"messages": prefilled, "continue_final_message": True}, "one")
    assert leg.body["messages"] == [{"role": "user", "content": "x"}, {"role": "assistant", "content": "Sure: one"}]
    assert prefilled[1]["content"] == "Sure: "


def test_a_chat_resumes_exactly_only_when_a_completion_reads_it_the_same_and_it_has_a_limit():
    assert legs.resumes_exactly(COMPLETIONS, {"prompt": "p", "logprobs": 2})
    assert legs.resumes_exactly(CHAT, {"messages": [], "max_tokens": 4, "temperature": 0.5})
    assert legs.resumes_exactly(CHAT, {"messages": [], "max_completion_tokens": 4})
    assert not legs.resumes_exactly(CHAT, {"messages": []})
    assert not legs.resumes_exactly(CHAT, {"messages": [], "max_tokens": True})
    assert not legs.resumes_exactly(CHAT, {"messages": [], "max_tokens": 4, "logprobs": True})
