"""Next-leg building: the request each decode leg of a continued stream sends.

A continuation asks for the tokens still owed, after a prompt that holds the
answer so far. Four kinds: a completion by token IDs or by text, a chat answer
as a token-ID completion (exact), or a chat continuing its final message (text).
Pure: the caller says what the answer so far is.
"""

from __future__ import annotations

from typing import Any

import msgspec

from narwhal.serving.continuation.policy import CHAT, COMPLETIONS
from narwhal.serving.continuation.values import is_int

__all__ = ["Leg", "chat_as_completion", "chat_by_text", "completion_by_ids", "completion_by_text", "first_leg",
           "owed", "resumes_exactly"]

# Chat parameters a completions request takes as they are: a chat answer may continue as a
# token-ID completion (an exact join) only when the request asks for nothing outside this set.
_CHAT_AS_COMPLETION = frozenset({
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
    "seed", "stop", "stop_token_ids", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens", "logit_bias",
    "user", "stream", "stream_options", "return_token_ids", "include_stop_str_in_output", "priority",
    "n", "add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs",
})
# Keys only a chat request has: dropped when a chat answer continues as a completion.
_CHAT_ONLY = ("messages", "max_completion_tokens", "add_generation_prompt", "continue_final_message",
              "chat_template", "chat_template_kwargs")
# A completions request without max_tokens gets 16 (OpenAI's default, and vLLM's).
_COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class Leg(msgspec.Struct, frozen=True):
    """One decode leg's route and body; ``as_chat`` when a chat answer continues as a completion."""

    route: str
    body: dict[str, Any]
    as_chat: bool = False


def first_leg(route: str, request: dict[str, Any], *, client_ids: bool) -> Leg:
    """The first leg (or a retry before the client had anything): the request as it came, asking for token IDs."""
    body = dict(request)
    if not client_ids:
        body["return_token_ids"] = True
    return Leg(route, body)


def resumes_exactly(route: str, request: dict[str, Any]) -> bool:
    """Whether an answer with all its token IDs known may continue from them (a token-ID completion).

    Always for a completion. A chat answer only when the request asks for nothing a completion reads
    differently, and says how long the answer may be (a chat answer without a limit runs to the end of the
    context; vLLM 0.32 turns a completion's missing or null max_tokens into 16, and the router does not know
    the engine's context length)."""
    if route != CHAT:
        return True
    return set(request) <= _CHAT_AS_COMPLETION and (
        is_int(request.get("max_completion_tokens")) or is_int(request.get("max_tokens")))


def owed(route: str, request: dict[str, Any], *, client_ids: bool, produced: int) -> dict[str, Any]:
    """A continuation's body before its prompt: the request, asking for token IDs and for what is still owed
    after ``produced`` tokens."""
    body = first_leg(route, request, client_ids=client_ids).body
    if route != CHAT and "max_tokens" not in body:
        # The completions default (OpenAI's and vLLM's) holds for the whole answer, not for each leg.
        body["max_tokens"] = _COMPLETIONS_DEFAULT_MAX_TOKENS
    for key in ("max_tokens", "max_completion_tokens", "min_tokens"):
        value = body.get(key)
        if is_int(value):
            body[key] = max(value - produced, 0 if key == "min_tokens" else 1)
    return body


def completion_by_ids(body: dict[str, Any], prompt_ids: list[int], output_ids: list[int]) -> Leg:
    """A completion resumed at the exact token: the original prompt's IDs plus the answer's."""
    body["prompt"] = prompt_ids + output_ids
    return Leg(COMPLETIONS, body)


def completion_by_text(body: dict[str, Any], output_text: str) -> Leg | None:
    """A completion resumed after the text the client has; None for a token-ID prompt (no text to extend)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        return None
    body["prompt"] = prompt + output_text
    return Leg(COMPLETIONS, body)


def chat_as_completion(body: dict[str, Any], prompt_ids: list[int], output_ids: list[int]) -> Leg:
    """A chat answer resumed at the exact token, as a completion.

    The chat template was applied once, by the first leg: its prompt IDs plus the output IDs resume at the
    exact token, which only a completions request accepts."""
    wanted = body.get("max_completion_tokens", body.get("max_tokens"))
    for key in _CHAT_ONLY:
        body.pop(key, None)
    body["max_tokens"] = wanted
    body["prompt"] = prompt_ids + output_ids
    return Leg(COMPLETIONS, body, as_chat=True)


def chat_by_text(body: dict[str, Any], output_text: str) -> Leg:
    """A chat answer resumed after the text the client has, as the final assistant message continued."""
    messages = [dict(m) for m in body["messages"]]
    last = messages[-1]
    if (body.get("continue_final_message") and last.get("role") == "assistant"
            and isinstance(last.get("content"), str)):
        last["content"] = last["content"] + output_text
    else:
        messages.append({"role": "assistant", "content": output_text})
    body["messages"] = messages
    body["continue_final_message"] = True
    body["add_generation_prompt"] = False
    return Leg(CHAT, body)
