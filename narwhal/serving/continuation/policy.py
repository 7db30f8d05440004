"""Which streams are continued: the routes, the failure classes that start a continuation, and the
requests whose answer a second engine cannot resume as one stream."""

from __future__ import annotations

from typing import Any

from narwhal.errors import FailureClass
from narwhal.serving.continuation.values import is_int

__all__ = ["CHAT", "COMPLETIONS", "CONTINUED_CLASSES", "ENGINE_REMOVED", "not_continued_reason"]

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
# A leg cut because a config reload removed its engine and serving.shutdown_grace_s passed:
# no failure of the engine (never evidence), but the answer is owed all the same.
ENGINE_REMOVED = "engine_removed"
# Failure classes of a decode leg that start a continuation once the client has bytes.
CONTINUED_CLASSES = frozenset({FailureClass.CONNECTION.value, FailureClass.TIMEOUT.value,
                               FailureClass.STREAM.value, ENGINE_REMOVED})


def not_continued_reason(route: str, request: dict[str, Any]) -> str | None:
    """Why this request's stream is never continued, or None when it may be.

    Each of these makes an answer that a second engine cannot resume as one
    stream: several choices, an echoed prompt, output under a grammar or a tool
    parser whose state lives in the failed engine.
    """
    n = request.get("n")
    if n is not None and n != 1:
        return "n"
    best_of = request.get("best_of")
    if best_of is not None and best_of != 1:
        return "best_of"
    if request.get("echo"):
        return "echo"
    response_format = request.get("response_format")
    if response_format is not None and not (isinstance(response_format, dict)
                                            and response_format.get("type") == "text"):
        return "structured_output"
    if request.get("structured_outputs") is not None or any(
            key.startswith("guided_") and value is not None for key, value in request.items()):
        return "structured_output"
    if request.get("tools") or request.get("tool_choice") is not None:
        return "tools"
    if route == COMPLETIONS:
        prompt = request.get("prompt")
        if isinstance(prompt, list) and prompt and not all(is_int(t) for t in prompt):
            if len(prompt) != 1 or not isinstance(prompt[0], str):
                return "several_prompts"
    return None
