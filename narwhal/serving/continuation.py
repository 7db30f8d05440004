"""Stream continuation: one client stream across decode legs on several engines.

Under ``serving.policy = "bounded"`` with ``serving.continue_streams`` on, a
streamed request whose decode leg fails (class connection, timeout or stream,
or cut because a reload removed its engine) after its stream reached the
client is continued: a fresh prefill of the original prompt plus the output so
far, then a decode on another engine asking for the tokens still owed, relayed
into the same client stream.

``plan`` says whether a request may be continued (and why not). A ``StreamJoin``
holds one request's answer so far: it asks the engine for token IDs (exact
joins), rewrites every event so the client sees one stream (one ``id`` and
``created``, one role chunk, usage summed, Narwhal's own additions stripped),
and builds each continuation leg's request (``narwhal.serving.relay.relay_joined``
relays one decode leg through it into the client's stream). No I/O.
"""

from __future__ import annotations

import re
from collections import deque
from typing import Any, TypeGuard

import msgspec

from narwhal.errors import FailureClass, NarwhalError
from narwhal.serving.client_view import KV_KEY, strip_kv_from_events

__all__ = ["CONTINUED_CLASSES", "ENGINE_REMOVED", "StreamJoin", "not_continued_reason", "plan"]

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
# A leg cut because a config reload removed its engine and serving.shutdown_grace_s passed:
# no failure of the engine (never evidence), but the answer is owed all the same.
ENGINE_REMOVED = "engine_removed"
# Failure classes of a decode leg that start a continuation once the client has bytes.
CONTINUED_CLASSES = frozenset({FailureClass.CONNECTION.value, FailureClass.TIMEOUT.value,
                               FailureClass.STREAM.value, ENGINE_REMOVED})
# One SSE event larger than this is not a stream we can join (a prompt's token IDs fit easily).
_MAX_EVENT_BYTES = 16 * 1024 * 1024
_DONE_EVENT = b"data: [DONE]\n\n"
_DATA = b"data: "
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

# The chat request's keys vLLM's /tokenize reads to count a chat's prompt as its chat route does.
_TOKENIZE_CHAT_KEYS = ("messages", "add_generation_prompt", "continue_final_message", "chat_template",
                       "chat_template_kwargs", "tools")

# A completions request without max_tokens gets 16 (OpenAI's default, and vLLM's).
_COMPLETIONS_DEFAULT_MAX_TOKENS = 16

_decode_json = msgspec.json.Decoder()
_encode_json = msgspec.json.Encoder()


class _Delta(msgspec.Struct):
    content: str | None = None
    # A reasoning parser's output (vLLM names it either way across versions).
    reasoning_content: str | None = None
    reasoning: str | None = None


class EngineErrorEvent(NarwhalError, ValueError):
    """An engine ended its stream with an error event (vLLM does when its engine core dies): a failed stream."""


class _Choice(msgspec.Struct):
    text: str | None = None
    delta: _Delta | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    finish_reason: str | None = None


class _Event(msgspec.Struct):
    """The fields of a first-leg chunk the join records; the chunk itself is relayed as it came."""

    id: Any = None
    created: Any = None
    choices: list[_Choice] | None = None
    prompt_token_ids: list[int] | None = None
    usage: dict[str, Any] | None = None
    kv_transfer_params: Any = None


class _Head(msgspec.Struct):
    id: Any = None
    created: Any = None


_decode_event = msgspec.json.Decoder(_Event).decode
_decode_head = msgspec.json.Decoder(_Head).decode
# The first leg's unread events are read once they pass this size: memory per stream stays bounded.
_FOLD_BYTES = 128 * 1024
# The token-ID lists of events (not the prompt's: a quote comes right before "token_ids").
_TOKEN_LISTS = re.compile(rb'"token_ids":\s*\[([\d,\s]*)\]')
# A token-ID list (or null) and its comma, as a key of a JSON object: the quote before the key
# cannot occur unescaped inside a string, so this never matches text. One pass per read and key for
# the compact form vLLM writes (each pattern starts with a long literal, which is searched for
# quickly), then any spacing, only if some is left. The event lists are captured, to count their IDs.
_IDS = re.compile(rb',\s*"(?:prompt_)?token_ids":\s*(?:\[[\d,\s]*\]|null)'
                  rb'|"(?:prompt_)?token_ids":\s*(?:\[[\d,\s]*\]|null)\s*,')
# A choice's non-empty text (completions) or delta content (chat).
_TEXT_EVENTS = re.compile(rb'"text":\s*"[^"]')
_CONTENT_EVENTS = re.compile(rb'"content":\s*"[^"]')
_PROMPT_IDS_COMPACT = re.compile(rb',"prompt_token_ids":(?:\[[\d,]*\]|null)')
_TOKEN_IDS_COMPACT = re.compile(rb',"token_ids":(\[[\d,]*\]|null)')


def _strip_compact_ids(data: bytes) -> tuple[bytes, int, int]:
    """``data`` less its compact token-ID lists, with the event lists removed and their IDs
    (counted as ``_TOKEN_LISTS`` would)."""
    if b'prompt_token_ids"' in data:
        data = _PROMPT_IDS_COMPACT.sub(b"", data)
    parts = _TOKEN_IDS_COMPACT.split(data)
    if len(parts) == 1:
        return data, 0, 0
    removed = b"".join(parts[1::2])
    # Each list is "[...]" of digits and commas (or null): its IDs are its commas plus one, unless empty.
    lists = removed.count(b"[")
    return b"".join(parts[::2]), lists, lists - removed.count(b"[]") + removed.count(b",")


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
        if isinstance(prompt, list) and prompt and not all(_is_int(t) for t in prompt):
            if len(prompt) != 1 or not isinstance(prompt[0], str):
                return "several_prompts"
    return None


def plan(route: str, request: dict[str, Any], *, enabled: bool) -> tuple[StreamJoin | None, str | None]:
    """A StreamJoin for a streamed request that may be continued, else None and the reason."""
    if not enabled:
        return None, "continue_streams_off"
    reason = not_continued_reason(route, request)
    if reason is not None:
        return None, reason
    return StreamJoin(route, request), None


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_list(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(_is_int(v) for v in value):
        return value
    return None


def _stop_lookback(request: dict[str, Any]) -> tuple[int, int]:
    """(characters vLLM holds back while streaming, characters a stop string can span) for ``request``."""
    stop = request.get("stop")
    if isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list):
        stops = [s for s in stop if isinstance(s, str)]
    else:
        stops = []
    span = max((len(s) for s in stops), default=1) - 1
    if span <= 0:
        return 0, 0
    return (0 if _lax_bool(request.get("include_stop_str_in_output")) else span), span


_TRUE_WORDS = frozenset({"1", "on", "t", "true", "y", "yes"})


def _lax_bool(value: Any) -> bool:
    """A boolean request field as vLLM reads it (pydantic's lax mode: 1 and "true" are true)."""
    if isinstance(value, str):
        return value.strip().lower() in _TRUE_WORDS
    return value is True or (_is_int(value) and value == 1)


# How an engine's error event starts (vLLM 0.32: {"error": {...}}; older: {"object": "error", ...}). A JSON string
# cannot hold either unescaped, so a token's text never matches.
_ERROR_MARK = b'data: {"error"'
_OLD_ERROR_MARK = b'"object":"error"'


def _error_message(obj: dict[str, Any]) -> str:
    error = obj.get("error")
    message = error.get("message") if isinstance(error, dict) else obj.get("message")
    return f"the engine ended its stream with an error event: {str(message)[:200]}"


def _raise_error_events(complete: bytes) -> None:
    """Raise EngineErrorEvent if one of these complete events is an engine's error event."""
    for event in complete.split(b"\n\n"):
        if event.startswith(_DATA) and (_ERROR_MARK[6:] in event or _OLD_ERROR_MARK in event):
            try:
                obj = _decode_json.decode(event[len(_DATA):])
            except (msgspec.DecodeError, RecursionError):
                continue
            if isinstance(obj, dict) and ("error" in obj or obj.get("object") == "error"):
                raise EngineErrorEvent(_error_message(obj))


def _drop_logprobs(choice: dict[str, Any], count: int) -> None:
    """Drop the first ``count`` tokens' entries from a completions choice's ``logprobs``."""
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict):
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            entries = logprobs.get(key)
            if isinstance(entries, list):
                logprobs[key] = entries[count:]


class StreamJoin:
    """One streamed request's answer so far, and the rewriting that makes its legs one stream."""

    def __init__(self, route: str, request: dict[str, Any]) -> None:
        self.route = route
        self.request = request
        # Token IDs the client asked for are relayed; the ones Narwhal asked for are not.
        self.client_ids = request.get("return_token_ids") is True
        self.chat = route == CHAT
        self.id: Any = None
        self.created: Any = None
        self.text: list[str] = []
        self._token_ids: list[int] = []
        # False once a relayed token came without its IDs: the join falls back to text.
        self.ids_complete = True
        prompt = request.get("prompt")
        self.prompt_ids: list[int] | None = _int_list(prompt) if not self.chat else None
        # The original prompt's token count when its IDs are unknown: from the first leg's usage or /tokenize.
        self._prompt_count: int | None = None
        # Tokens without IDs reached the client since an engine last counted them (``counted``): how many
        # tokens the client holds is then known only as a lower bound (events), never to build a leg from.
        self.uncounted = False
        # The completion_tokens of the current leg's latest usage (continuous_usage_stats, or the final one).
        self._leg_usage: int | None = None
        # Completion tokens relayed by legs before the current one, and by the current one.
        self.tokens_before = 0
        self.leg_tokens = 0
        # Continuation legs started (counted by the caller when a leg gets its engines).
        self.continuations = 0
        self.continuing = False
        self._finished = False
        self.usage_sent = False
        self.leg_route = route
        self.leg_relayed = False
        self.last_relay_at: float | None = None
        self._buffer = b""
        self._leg_done = False
        self._chat_as_completion = False
        self._relayed_any = False
        # The first leg's events, relayed but not yet read: most streams end without a failure,
        # so they are read (``fold``) only when a continuation needs them, or in batches.
        self._raw: list[bytes] = []
        self._raw_size = 0
        # What ``_raw_tokens`` would find in them, counted as the relay strips the IDs: the event token-ID
        # lists seen and their IDs; valid while ``_raw_counted`` (else counted from the events themselves).
        self._raw_lists = 0
        self._raw_ids = 0
        self._raw_counted = True
        # -- where an exact join may resume (see ``_resume_point``) --
        # The token IDs the client holds (or would hold, had it asked for them), in order; ``_token_ids`` is the
        # sequence the current engine continues, which a join cuts back to a whole character.
        self._sent: list[int] = []
        self._sent_chars = 0
        # Where the current leg's next character falls in the answer's text (the client's coordinates).
        self._engine_pos = 0
        # vLLM holds back this many characters of a stream whose stop strings are excluded from the text
        # (a stop string is never half-sent), and a stop string can span this many characters before a join.
        self._held, self._stop_span = _stop_lookback(request)
        # The answer's text up to here is known to the engines to hold no stop string.
        self._checked_chars = 0
        # Points where the answer ends on a whole character: (output tokens, characters of text), oldest first.
        self._resume_points: deque[tuple[int, int]] = deque([(0, 0)])
        # The client's text after the current leg's resume point: what the leg generates again is compared with it.
        self._overlap_text = ""
        self._overlap_from = 0
        # Tokens a continuation generated again (the client had them) and whether any came out different
        # (ever, and in the current leg).
        self.regenerated = 0
        self.diverged = False
        self._leg_diverged = False
        # Why the answer cannot be resumed once started (None: it can).
        self.not_resumable: str | None = None

    # -- what was relayed ---------------------------------------------------

    @property
    def tokens(self) -> int:
        """Completion tokens the client has received, over all legs."""
        leg = self.leg_tokens
        if self._leg_usage is not None and self._leg_usage > leg:
            # The engine's own count beats one from events (an event may carry several tokens).
            leg = self._leg_usage
        return max(self.tokens_before + leg + self._raw_tokens(), len(self._sent))

    @property
    def prompt_tokens(self) -> int | None:
        """The original prompt's token count, when known (its IDs, the first leg's usage, /tokenize)."""
        return len(self.prompt_ids) if self.prompt_ids is not None else self._prompt_count

    def note_prompt_tokens(self, count: int) -> None:
        """The original prompt's token count, as an engine gave it (the first leg's usage, /tokenize)."""
        if self._prompt_count is None and _is_int(count) and count >= 0:
            self._prompt_count = count

    def prompt_query(self) -> dict[str, Any] | None:
        """The /tokenize body (less ``model``) that counts the original prompt as the first leg's engine
        did; None when the count is known, or cannot be asked (a token-ID prompt counts itself)."""
        if self.prompt_tokens is not None:
            return None
        if self.chat:
            query = {key: self.request[key] for key in _TOKENIZE_CHAT_KEYS if key in self.request}
            return query if isinstance(query.get("messages"), list) else None
        prompt = self.request.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        return {"prompt": prompt} if isinstance(prompt, str) else None

    def counted(self, tokens: int | None, prompt_tokens: int | None = None) -> None:
        """An engine's count (/tokenize) of the tokens in all the text the client has, and of the original
        prompt: what the answer's length and its usage are built from after tokens without IDs."""
        self.fold()
        if tokens is not None and self.uncounted:
            self.tokens_before = max(tokens, len(self._sent))
            self.leg_tokens = 0
            self._leg_usage = None
            self.uncounted = False
        if prompt_tokens is not None:
            self.note_prompt_tokens(prompt_tokens)

    @property
    def output_text(self) -> str:
        self.fold()
        return "".join(self.text)

    @property
    def token_ids(self) -> list[int]:
        self.fold()
        return self._token_ids

    @property
    def finished(self) -> bool:
        """True once a chunk with a ``finish_reason`` reached the client."""
        self.fold()
        return self._finished

    @property
    def started(self) -> bool:
        """True once anything of the answer (an id, a role chunk, a token) reached the client."""
        return self._relayed_any

    def fold(self) -> None:
        """Read the first leg's relayed events into the answer so far."""
        if not self._raw:
            return
        raw = b"".join(self._raw)
        self._raw.clear()
        self._raw_size = 0
        self._raw_lists = self._raw_ids = 0
        self._raw_counted = True
        for event in raw.split(b"\n\n"):
            if not event.startswith(_DATA):
                continue
            payload = event[len(_DATA):].strip()
            if self._first_leg_event(payload) is None:
                try:
                    self._rewrite(payload)
                except ValueError:
                    # Relayed as the engine sent it (as without continuation); nothing to learn from it.
                    pass

    def _raw_tokens(self) -> int:
        """The tokens in the first leg's unread events, counted without reading them."""
        if not self._raw:
            return 0
        if self._raw_counted and self._raw_lists:
            return self._raw_ids
        raw = b"".join(self._raw)
        lists = _TOKEN_LISTS.findall(raw) if not self._raw_counted else []
        if lists:
            return sum(1 + ids.count(b",") for ids in lists if ids.strip())
        # No IDs: the events with text (a lower bound: an event may carry several tokens), in any JSON spacing.
        return len((_CONTENT_EVENTS if self.chat else _TEXT_EVENTS).findall(raw))

    def _include_usage(self) -> bool:
        options = self.request.get("stream_options")
        return isinstance(options, dict) and options.get("include_usage") is True

    # -- legs ------------------------------------------------------------------

    def next_leg(self) -> tuple[str, dict[str, Any]] | None:
        """The route and body of the next decode leg; None when the answer cannot be resumed
        (``not_resumable`` says why)."""
        self.fold()
        self._buffer = b""
        self._leg_done = False
        self.leg_relayed = False
        self._leg_diverged = False
        if self._leg_usage is not None and self._leg_usage > self.leg_tokens:
            self.leg_tokens = self._leg_usage
        self._leg_usage = None
        self.tokens_before += self.leg_tokens
        self.leg_tokens = 0
        body = dict(self.request)
        if not self.client_ids:
            body["return_token_ids"] = True
        self.continuing = self.started
        if not self.started:
            self.leg_route = self.route
            return self.route, body
        if self.not_resumable is not None:
            return None
        ids = self.ids_complete and self.prompt_ids is not None
        exact = ids and (not self.chat or self._chat_resumes_as_completion())
        if exact:
            self._resume_exactly()
        else:
            self._resume_from_text()
        produced = self.tokens_before
        if not self.chat and "max_tokens" not in body:
            # The completions default (OpenAI's and vLLM's) holds for the whole answer, not for each leg.
            body["max_tokens"] = _COMPLETIONS_DEFAULT_MAX_TOKENS
        for key in ("max_tokens", "max_completion_tokens", "min_tokens"):
            value = body.get(key)
            if _is_int(value):
                body[key] = max(value - produced, 0 if key == "min_tokens" else 1)
        self._chat_as_completion = False
        if not self.chat:
            if exact:
                assert self.prompt_ids is not None
                body["prompt"] = self.prompt_ids + self._token_ids
            else:
                prompt = body.get("prompt")
                if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                    prompt = prompt[0]
                if not isinstance(prompt, str):
                    self.not_resumable = "token_id_prompt_without_ids"
                    return None
                body["prompt"] = prompt + self.output_text
            self.leg_route = COMPLETIONS
            return COMPLETIONS, body
        if exact:
            # The chat template was applied once, by the first leg: its prompt IDs plus the
            # output IDs resume at the exact token, which only a completions request accepts.
            assert self.prompt_ids is not None
            wanted = body.get("max_completion_tokens", body.get("max_tokens"))
            for key in _CHAT_ONLY:
                body.pop(key, None)
            body["max_tokens"] = wanted
            body["prompt"] = self.prompt_ids + self._token_ids
            self._chat_as_completion = True
            self.leg_route = COMPLETIONS
            return COMPLETIONS, body
        messages = [dict(m) for m in body["messages"]]
        last = messages[-1]
        if (self.request.get("continue_final_message") and last.get("role") == "assistant"
                and isinstance(last.get("content"), str)):
            last["content"] = last["content"] + self.output_text
        else:
            messages.append({"role": "assistant", "content": self.output_text})
        body["messages"] = messages
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
        self.leg_route = CHAT
        return CHAT, body

    def _chat_resumes_as_completion(self) -> bool:
        """Whether a chat answer may continue as a token-ID completion: only when the request asks for nothing a
        completion reads differently, and says how long the answer may be (a chat answer without a limit runs to
        the end of the context; vLLM 0.32 turns a completion's missing or null max_tokens into 16, and the router
        does not know the engine's context length)."""
        request = self.request
        return set(request) <= _CHAT_AS_COMPLETION and (
            _is_int(request.get("max_completion_tokens")) or _is_int(request.get("max_tokens")))

    def _resume_from_text(self) -> None:
        """A text join resumes after everything the client has: nothing is generated again."""
        self.tokens_before = max(self.tokens_before, len(self._sent))
        if len(self._token_ids) < len(self._sent):
            self._token_ids.extend(self._sent[len(self._token_ids):])
        self._engine_pos = self._sent_chars
        self._overlap_text = ""

    def _resume_exactly(self) -> None:
        """Cut the answer's token IDs back to where the next leg resumes: the last point known to end on a whole
        character, far enough back that the next engine sees any stop string the join could split.

        Why not at the last token: vLLM's detokenizer, primed with a prompt ending inside a character (byte tokens
        of an emoji or a CJK character), emits the prompt's whole text again in its first delta; a stop string
        spanning the join would go unseen; text held back under a stop string would be lost. The tokens after the
        resume point are generated again; what the client already has of them is not sent twice.
        """
        limit = self._checked_chars - self._stop_span
        tokens, chars = self._resume_points[0]
        for point in reversed(self._resume_points):
            if point[1] <= limit and point[1] <= self._sent_chars:
                tokens, chars = point
                break
        while self._resume_points[-1][0] > tokens:
            self._resume_points.pop()
        del self._token_ids[tokens:]
        self.tokens_before = tokens
        self._engine_pos = chars
        if chars < self._sent_chars:
            self._overlap_text = "".join(self.text)[chars:]
            self._overlap_from = chars
        else:
            self._overlap_text = ""

    def _advance(self, ids: list[int] | None, text: str, first_leg: bool) -> tuple[int, int]:
        """Take one choice's tokens and text as the engine sent them; returns how many leading IDs and characters
        the client already has (a continuation generating again what followed its resume point)."""
        skip_ids = skip_chars = 0
        owed = 0
        if not first_leg:
            owed = len(self._sent) - len(self._token_ids)
            if ids and owed > 0:
                at = len(self._token_ids)
                skip_ids = min(owed, len(ids))
                self.regenerated += skip_ids
                if ids[:skip_ids] != self._sent[at:at + skip_ids]:
                    self.diverged = self._leg_diverged = True
            if text and self._leg_diverged:
                # A sampled answer that came out differently: the client keeps what it has, and gets the new
                # engine's text from the first event that brings a token it did not have.
                skip_chars = len(text) if ids and owed >= len(ids) else 0
            elif text:
                skip_chars = min(max(self._sent_chars - self._engine_pos, 0), len(text))
                if skip_chars:
                    start = self._engine_pos - self._overlap_from
                    if text[:skip_chars] != self._overlap_text[start:start + skip_chars]:
                        self.diverged = self._leg_diverged = True
        if ids is not None:
            self._token_ids.extend(ids)
            self._sent.extend(ids[skip_ids:] if skip_ids else ids)
        in_overlap = owed > 0 and (ids is None or owed > len(ids))
        if self._leg_diverged and not in_overlap:
            # Past the tokens generated again: the text runs on from what the client has.
            self._engine_pos = self._sent_chars - skip_chars
        if text:
            self._engine_pos += len(text)
            self._sent_chars += len(text) - skip_chars
            if ids is None and owed > 0 and self._engine_pos >= self._sent_chars:
                # An engine without token IDs generated again all the client had (its text matched): the same
                # tokens, so the answer's IDs run on as the client's.
                self.regenerated += owed
                self.leg_tokens += owed
                self._token_ids.extend(self._sent[len(self._token_ids):])
            if not (self._leg_diverged and in_overlap):
                # (Positions inside tokens that came out differently say nothing about the client's text.)
                self._text_came(ids)
        return skip_ids, skip_chars

    def _text_came(self, ids: list[int] | None) -> None:
        """The engine sent text with ``ids``: what the engines have checked for stop strings, and whether the
        answer ends on a whole character here."""
        # Held-back text is released as the engine's text grows: once some came, the engine's text is exactly
        # ``_held`` characters ahead of what it sent.
        known = self._engine_pos + self._held
        if known > self._checked_chars:
            self._checked_chars = known
        if ids is not None and len(ids) == 1:
            # One token that brought text: the detokenizer emits nothing while the text ends inside a
            # character, so the answer ends on a whole one here (a read of several tokens cannot say).
            self._resume_point(len(self._token_ids), known)

    def _resume_point(self, tokens: int, chars: int) -> None:
        points = self._resume_points
        if not self._stop_span:
            # Without stop strings the newest point is the only one ever needed.
            points[0] = (tokens, chars)
            return
        points.append((tokens, chars))
        limit = self._checked_chars - self._stop_span
        # Only the newest point far enough back is ever needed: points keep at most a stop string's span of text.
        while len(points) > 1 and points[1][1] <= limit:
            points.popleft()

    # -- events ----------------------------------------------------------------

    def feed(self, chunk: bytes) -> tuple[bytes, bool]:
        """Rewrite the complete events in ``chunk``: (bytes for the client, whether [DONE] came)."""
        data = self._buffer + chunk if self._buffer else chunk
        end = data.rfind(b"\n\n")
        if end < 0:
            if len(data) > _MAX_EVENT_BYTES:
                raise ValueError(f"an SSE event longer than {_MAX_EVENT_BYTES} bytes")
            self._buffer = data
            return b"", False
        self._buffer = data[end + 2:]
        if len(self._buffer) > _MAX_EVENT_BYTES:
            raise ValueError(f"an SSE event longer than {_MAX_EVENT_BYTES} bytes")
        if not self.continuing:
            return self._first_leg(data[:end + 2])
        out: list[bytes] = []
        for event in data[:end].split(b"\n\n"):
            if not event:
                continue
            if not event.startswith(_DATA):
                # Comments and other fields go on as they came.
                out.append(event + b"\n\n")
                continue
            payload = event[len(_DATA):].strip()
            if payload == b"[DONE]":
                self._leg_done = True
                continue
            rewritten = self._rewrite(payload)
            if rewritten is not None:
                out.append(rewritten)
        relayed = b"".join(out)
        if relayed:
            self._relayed_any = True
        return relayed, self._leg_done

    def _first_leg(self, complete: bytes) -> tuple[bytes, bool]:
        """The first leg's complete events: relayed as they came, less Narwhal's token IDs, any
        ``kv_transfer_params`` (the engines' business) and [DONE] (``relay`` writes the last one)."""
        found = complete.find(b"[DONE]")
        while found >= 0:
            before = complete.rfind(b"\n\n", 0, found)
            start = before + 2 if before >= 0 else 0
            end = complete.find(b"\n\n", found) + 2
            event = complete[start:end - 2]
            if event.startswith(b"data:") and event[5:].strip() == b"[DONE]":
                self._leg_done = True
                complete = complete[:start] + complete[end:]
                found = complete.find(b"[DONE]", start)
            else:
                found = complete.find(b"[DONE]", end)
        if not complete:
            return b"", self._leg_done
        if _ERROR_MARK in complete or _OLD_ERROR_MARK in complete:
            _raise_error_events(complete)
        if self.id is None:
            self._note_id(complete)
        raw = complete
        # This read's event token-ID lists and IDs (as _raw_tokens counts them); None: not counted here.
        counted: tuple[int, int] | None = (0, 0)
        if KV_KEY in complete:
            # The engine's KV handoff is never the client's (the relay without a join strips it too).
            complete = strip_kv_from_events(complete)
            counted = None
        if b"token_ids" in complete:
            if self.client_ids:
                counted = None
            else:
                complete, lists, ids = _strip_compact_ids(complete)
                if b'token_ids"' in complete:
                    # Another spelling (spaces, the key first in its object): the general pattern.
                    complete = _IDS.sub(b"", complete)
                    counted = None
                elif counted is not None:
                    counted = (lists, ids)
        if counted is None:
            self._raw_counted = False
        else:
            self._raw_lists += counted[0]
            self._raw_ids += counted[1]
        self._raw.append(raw)
        self._raw_size += len(raw)
        if self._raw_size > _FOLD_BYTES:
            self.fold()
        self.leg_relayed = self._relayed_any = True
        return complete, self._leg_done

    def _note_id(self, complete: bytes) -> None:
        """The answer's ``id`` and ``created``, from its first event: every later chunk carries them."""
        for event in complete.split(b"\n\n", 8):
            if event.startswith(_DATA):
                try:
                    head = _decode_head(event[len(_DATA):])
                except (msgspec.DecodeError, RecursionError):
                    continue
                self.id, self.created = head.id, head.created
                return

    def _rewrite(self, payload: bytes) -> bytes | None:
        try:
            obj = _decode_json.decode(payload)
        except (msgspec.DecodeError, RecursionError):
            raise ValueError("an SSE data line that is not JSON") from None
        if not isinstance(obj, dict):
            raise ValueError("an SSE event that is not a JSON object")
        if "error" in obj or obj.get("object") == "error":
            raise EngineErrorEvent(_error_message(obj))
        first_leg = not self.continuing
        if self.id is None:
            self.id, self.created = obj.get("id"), obj.get("created")
        else:
            if "id" in obj:
                obj["id"] = self.id
            if "created" in obj:
                obj["created"] = self.created
        obj.pop("kv_transfer_params", None)
        prompt_ids = obj.pop("prompt_token_ids", None)
        if first_leg and prompt_ids is not None:
            self._note_prompt(prompt_ids)
            if self.client_ids:
                obj["prompt_token_ids"] = prompt_ids
        choices = obj.get("choices")
        if isinstance(choices, list):
            kept = []
            for choice in choices:
                if isinstance(choice, dict) and self._choice(choice, first_leg):
                    kept.append(choice)
            if not kept and choices:
                # Nothing of it for the client (a chat continuation's role chunk, tokens it already has); a usage
                # it carried (continuous_usage_stats) is not the answer's: without choices it would read as the end.
                return None
            obj["choices"] = kept
        if self._chat_as_completion:
            obj["object"] = "chat.completion.chunk"
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self._leg_usage_came(usage, first_leg)
            self._usage(usage)
            if not obj.get("choices"):
                self.usage_sent = True
        self.leg_relayed = True
        return _DATA + _encode_json.encode(obj) + b"\n\n"

    def _first_leg_event(self, payload: bytes) -> bytes | None:
        """The first leg's chunk, recorded and relayed as it came (less Narwhal's token IDs).

        The common case, kept cheap: one typed decode and no re-encoding. None sends the
        event down the general path (an unexpected shape, a KV field to strip).
        """
        try:
            event = _decode_event(payload)
        except (msgspec.DecodeError, RecursionError):
            return None
        if event.kv_transfer_params is not None:
            return None
        if self.id is None:
            self.id, self.created = event.id, event.created
        if event.prompt_token_ids is not None:
            self._note_prompt(event.prompt_token_ids)
        for choice in event.choices or ():
            if choice.prompt_token_ids is not None:
                self._note_prompt(choice.prompt_token_ids)
            text = choice.delta.content if self.chat and choice.delta is not None else choice.text
            if choice.delta is not None and (choice.delta.reasoning_content is not None
                                             or choice.delta.reasoning is not None):
                self.not_resumable = "reasoning"
            if text:
                self.text.append(text)
            ids = choice.token_ids
            # ``_advance`` for a first leg, less its continuation cases: this runs per token of long streams.
            if ids is not None:
                self._token_ids.extend(ids)
                self._sent.extend(ids)
                self.leg_tokens += len(ids)
            if text:
                self._engine_pos += len(text)
                self._sent_chars += len(text)
                self._text_came(ids)
            if ids is None and text:
                self.ids_complete = False
                self.uncounted = True
                self.leg_tokens += 1
            if choice.finish_reason is not None:
                self._finished = True
        if event.usage is not None:
            self._leg_usage_came(event.usage, True)
            if not event.choices:
                self.usage_sent = True
        self.leg_relayed = True
        return _DATA + payload + b"\n\n"

    def _note_prompt(self, prompt_ids: Any) -> None:
        ids = _int_list(prompt_ids)
        if ids is not None and self.prompt_ids is None:
            self.prompt_ids = ids

    def _choice(self, choice: dict[str, Any], first_leg: bool) -> bool:
        """Record and rewrite one choice; False when it carries nothing the client needs."""
        prompt_ids = choice.pop("prompt_token_ids", None)
        if first_leg and prompt_ids is not None:
            self._note_prompt(prompt_ids)
            if self.client_ids:
                choice["prompt_token_ids"] = prompt_ids
        ids = choice.get("token_ids") if self.client_ids else choice.pop("token_ids", None)
        ids = _int_list(ids)
        if self._chat_as_completion:
            text = choice.pop("text", None)
            choice.pop("logprobs", None)
            choice["delta"] = {"content": text} if text else {}
            choice["logprobs"] = None
            # Keep the client's key order close to what a chat engine sends.
            for key in ("finish_reason", "stop_reason", "token_ids"):
                if key in choice:
                    choice[key] = choice.pop(key)
        delta = choice.get("delta") if self.chat else None
        if self.chat:
            text = delta.get("content") if isinstance(delta, dict) else None
            if isinstance(delta, dict) and (delta.get("reasoning_content") is not None
                                            or delta.get("reasoning") is not None):
                # The failed engine's reasoning parser knew where the thinking ends; a continuation cannot.
                self.not_resumable = "reasoning"
            if not first_leg and isinstance(delta, dict) and "role" in delta:
                # The client had its role chunk from the first leg.
                del delta["role"]
                if not text and len(delta) <= 1 and choice.get("finish_reason") is None and not ids:
                    return False
        else:
            text = choice.get("text")
        if not isinstance(text, str):
            text = None
        skip_ids, skip_chars = self._advance(ids, text or "", first_leg)
        if skip_ids or skip_chars:
            # Generated again after the resume point: the client has this much of it already.
            assert ids is not None or not skip_ids
            if skip_chars:
                assert text is not None
                text = text[skip_chars:]
                if isinstance(delta, dict):
                    delta["content"] = text
                else:
                    choice["text"] = text
            if skip_ids:
                assert ids is not None
                if self.client_ids:
                    choice["token_ids"] = ids[skip_ids:]
                _drop_logprobs(choice, skip_ids)
            if not text and (ids is None or skip_ids == len(ids)) and choice.get("finish_reason") is None:
                if ids is not None:
                    self.leg_tokens += len(ids)
                return False
        if text:
            self.text.append(text)
        if ids is not None:
            self.leg_tokens += len(ids)
        elif text:
            # No IDs for this token: the next join resumes from text, and counts it with /tokenize.
            self.ids_complete = False
            self.uncounted = True
            self.leg_tokens += 1
        if choice.get("finish_reason") is not None:
            self._finished = True
        return True

    def _leg_usage_came(self, usage: dict[str, Any], first_leg: bool) -> None:
        """Note what a usage says before it is rewritten: the leg's tokens so far, the first leg's prompt."""
        completion = usage.get("completion_tokens")
        if _is_int(completion):
            self._leg_usage = completion
        prompt = usage.get("prompt_tokens")
        if first_leg and _is_int(prompt):
            self.note_prompt_tokens(prompt)

    def _usage(self, usage: dict[str, Any]) -> None:
        completion = usage.get("completion_tokens")
        if not _is_int(completion):
            return
        if not self.continuing:
            return
        # A sampled leg may end among the tokens it generated again: the client has more than it made.
        usage["completion_tokens"] = max(completion + self.tokens_before, len(self._sent))
        prompt = self.prompt_tokens
        if prompt is not None:
            usage["prompt_tokens"] = prompt
        elif _is_int(usage.get("prompt_tokens")):
            usage["prompt_tokens"] = max(usage["prompt_tokens"] - self.tokens_before, 0)
        if _is_int(usage.get("prompt_tokens")):
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]

    @property
    def tail_needs_count(self) -> bool:
        """Whether ``tail`` owes a usage chunk whose numbers no engine has given yet (``counted`` gives them)."""
        return (self._include_usage() and not self.usage_sent
                and (self.uncounted or self.prompt_tokens is None))

    def tail(self) -> bytes:
        """The end of an answer whose last token came but whose leg failed before [DONE].

        Its usage chunk, when the client asked for one, carries the engines' counts; if
        they could not be had (``tail_needs_count`` still true), it is left out: no usage
        rather than a wrong one."""
        out = b""
        if self._include_usage() and not self.usage_sent and not self.tail_needs_count:
            prompt = self.prompt_tokens
            assert prompt is not None
            total = self.tokens
            obj = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                   "created": self.created, "model": self.request.get("model"), "choices": [],
                   "usage": {"prompt_tokens": prompt, "total_tokens": prompt + total, "completion_tokens": total}}
            out = _DATA + _encode_json.encode(obj) + b"\n\n"
            self.usage_sent = True
        return out + _DONE_EVENT
