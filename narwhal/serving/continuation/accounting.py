"""Token accounting: how many tokens the client has and the prompt had, across a stream's legs.

Counts come from the token IDs relayed, from events when a token came without
IDs (a lower bound, never to build a leg from), from the engines' usage, and
from /tokenize (``counted``). A continuation's usage is rewritten to the whole
answer's.
"""

from __future__ import annotations

from typing import Any

from narwhal.serving.continuation.values import int_list, is_int

__all__ = ["TokenAccount", "include_usage"]

# The chat request's keys vLLM's /tokenize reads to count a chat's prompt as its chat route does.
_TOKENIZE_CHAT_KEYS = ("messages", "add_generation_prompt", "continue_final_message", "chat_template",
                       "chat_template_kwargs", "tools")


def include_usage(request: dict[str, Any]) -> bool:
    """Whether the client asked for a usage chunk (``stream_options.include_usage``)."""
    options = request.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


class TokenAccount:
    """One streamed request's token counts: the prompt's, the legs' before the current one, the current leg's."""

    __slots__ = ("_request", "_chat", "prompt_ids", "_prompt_count", "ids_complete", "uncounted", "leg_usage",
                 "tokens_before", "leg_tokens", "usage_sent")

    def __init__(self, request: dict[str, Any], *, chat: bool) -> None:
        self._request = request
        self._chat = chat
        self.prompt_ids: list[int] | None = None if chat else int_list(request.get("prompt"))
        # The original prompt's token count when its IDs are unknown: from the first leg's usage or /tokenize.
        self._prompt_count: int | None = None
        # False once a relayed token came without its IDs: the join falls back to text.
        self.ids_complete = True
        # Tokens without IDs reached the client since an engine last counted them (``counted``): how many
        # tokens the client holds is then known only as a lower bound (events), never to build a leg from.
        self.uncounted = False
        # The completion_tokens of the current leg's latest usage (continuous_usage_stats, or the final one).
        self.leg_usage: int | None = None
        # Completion tokens relayed by legs before the current one, and by the current one.
        self.tokens_before = 0
        self.leg_tokens = 0
        # A usage-only chunk reached the client.
        self.usage_sent = False

    def total(self, unread: int, sent: int) -> int:
        """Completion tokens the client has, over all legs: ``unread`` are in events not read yet, and
        ``sent`` the token IDs it holds."""
        leg = self.leg_tokens
        if self.leg_usage is not None and self.leg_usage > leg:
            # The engine's own count beats one from events (an event may carry several tokens).
            leg = self.leg_usage
        return max(self.tokens_before + leg + unread, sent)

    @property
    def prompt_tokens(self) -> int | None:
        """The original prompt's token count, when known (its IDs, the first leg's usage, /tokenize)."""
        return len(self.prompt_ids) if self.prompt_ids is not None else self._prompt_count

    def note_prompt(self, prompt_ids: Any) -> None:
        """The original prompt's token IDs, as the first leg's engine sent them (the first ones win)."""
        ids = int_list(prompt_ids)
        if ids is not None and self.prompt_ids is None:
            self.prompt_ids = ids

    def note_prompt_tokens(self, count: int) -> None:
        """The original prompt's token count, as an engine gave it (the first leg's usage, /tokenize)."""
        if self._prompt_count is None and is_int(count) and count >= 0:
            self._prompt_count = count

    def prompt_query(self) -> dict[str, Any] | None:
        """The /tokenize body (less ``model``) that counts the original prompt as the first leg's engine
        did; None when the count is known, or cannot be asked (a token-ID prompt counts itself)."""
        if self.prompt_tokens is not None:
            return None
        request = self._request
        if self._chat:
            query = {key: request[key] for key in _TOKENIZE_CHAT_KEYS if key in request}
            return query if isinstance(query.get("messages"), list) else None
        prompt = request.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        return {"prompt": prompt} if isinstance(prompt, str) else None

    def counted(self, tokens: int | None, prompt_tokens: int | None, sent: int) -> None:
        """An engine's count (/tokenize) of the tokens in all the text the client has (which holds ``sent``
        token IDs), and of the original prompt."""
        if tokens is not None and self.uncounted:
            self.tokens_before = max(tokens, sent)
            self.leg_tokens = 0
            self.leg_usage = None
            self.uncounted = False
        if prompt_tokens is not None:
            self.note_prompt_tokens(prompt_tokens)

    def usage_came(self, usage: dict[str, Any], first_leg: bool) -> None:
        """Note what a usage says before it is rewritten: the leg's tokens so far, the first leg's prompt."""
        completion = usage.get("completion_tokens")
        if is_int(completion):
            self.leg_usage = completion
        prompt = usage.get("prompt_tokens")
        if first_leg and is_int(prompt):
            self.note_prompt_tokens(prompt)

    def rewrite_usage(self, usage: dict[str, Any], sent: int) -> None:
        """A continuation leg's usage, in place, as the whole answer's (the client holds ``sent`` token IDs)."""
        completion = usage.get("completion_tokens")
        if not is_int(completion):
            return
        # A sampled leg may end among the tokens it generated again: the client has more than it made.
        usage["completion_tokens"] = max(completion + self.tokens_before, sent)
        prompt = self.prompt_tokens
        if prompt is not None:
            usage["prompt_tokens"] = prompt
        elif is_int(usage.get("prompt_tokens")):
            usage["prompt_tokens"] = max(usage["prompt_tokens"] - self.tokens_before, 0)
        if is_int(usage.get("prompt_tokens")):
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]

    def end_leg(self) -> None:
        """The current leg's tokens join those before it (the engine's usage, when it counted more)."""
        if self.leg_usage is not None and self.leg_usage > self.leg_tokens:
            self.leg_tokens = self.leg_usage
        self.leg_usage = None
        self.tokens_before += self.leg_tokens
        self.leg_tokens = 0

    @property
    def tail_needs_count(self) -> bool:
        """Whether the answer owes a usage chunk whose numbers no engine has given yet (``counted`` gives them)."""
        return (include_usage(self._request) and not self.usage_sent
                and (self.uncounted or self.prompt_tokens is None))

    def tail_usage(self, total: int) -> dict[str, int] | None:
        """The usage the end of the answer owes the client (``total`` completion tokens), once; None when none is
        owed or its numbers could not be had: no usage rather than a wrong one."""
        if not include_usage(self._request) or self.usage_sent or self.tail_needs_count:
            return None
        prompt = self.prompt_tokens
        assert prompt is not None
        self.usage_sent = True
        return {"prompt_tokens": prompt, "total_tokens": prompt + total, "completion_tokens": total}
