"""StreamJoin: one streamed request's answer so far, composed of the parts that each do one job.

It frames the engine's reads into events, relays the first leg's through
``FirstLeg`` (read lazily), rewrites a continuation leg's events so the client
sees one stream, and records each event into the ``TokenAccount`` and the
``ResumePoints``; ``next_leg`` asks ``legs`` for the next decode leg's request.
"""

from __future__ import annotations

from typing import Any

import msgspec

from narwhal.serving.continuation import legs
from narwhal.serving.continuation.accounting import TokenAccount
from narwhal.serving.continuation.events import (
    DATA,
    DONE_EVENT,
    MAX_EVENT_BYTES,
    EngineErrorEvent,
    decode_event,
    decode_json,
    drop_logprobs,
    encode_json,
    error_message,
    finish_event,
    read_head,
    usage_event,
)
from narwhal.serving.continuation.lazy import FirstLeg
from narwhal.serving.continuation.policy import CHAT
from narwhal.serving.continuation.resume import ResumePoints
from narwhal.serving.continuation.values import int_list

__all__ = ["StreamJoin"]


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
        self._first = FirstLeg(client_ids=self.client_ids, chat=self.chat)
        self._account = TokenAccount(request, chat=self.chat)
        self._resume = ResumePoints(request)
        # Continuation legs started (counted by the caller when a leg gets its engines).
        self.continuations = 0
        self.continuing = False
        self._finished = False
        # Ended by ``end_at_context``: the tail carries the finish_reason no engine sent.
        self._ended_at_context = False
        self.leg_route = route
        self.leg_relayed = False
        self.last_relay_at: float | None = None
        self._buffer = b""
        self._leg_done = False
        self._chat_as_completion = False
        self._relayed_any = False
        # Why the answer cannot be resumed once started (None: it can).
        self.not_resumable: str | None = None

    # -- what was relayed ---------------------------------------------------

    @property
    def tokens(self) -> int:
        """Completion tokens the client has received, over all legs."""
        return self._account.total(self._first.tokens() if self._first.raw else 0, len(self._resume.sent))

    @property
    def tokens_before(self) -> int:
        """Completion tokens relayed by legs before the current one."""
        return self._account.tokens_before

    @property
    def uncounted(self) -> bool:
        """Tokens without IDs reached the client since an engine last counted them (``counted``)."""
        return self._account.uncounted

    @property
    def usage_sent(self) -> bool:
        return self._account.usage_sent

    @property
    def prompt_tokens(self) -> int | None:
        """The original prompt's token count, when known (its IDs, the first leg's usage, /tokenize)."""
        return self._account.prompt_tokens

    @property
    def regenerated(self) -> int:
        """Tokens continuations generated again (the client had them)."""
        return self._resume.regenerated

    @property
    def diverged(self) -> bool:
        """Whether any token a continuation generated again came out different."""
        return self._resume.diverged

    @property
    def _sent(self) -> list[int]:
        return self._resume.sent

    def note_prompt_tokens(self, count: int) -> None:
        """The original prompt's token count, as an engine gave it (the first leg's usage, /tokenize)."""
        self._account.note_prompt_tokens(count)

    def prompt_query(self) -> dict[str, Any] | None:
        """The /tokenize body (less ``model``) that counts the original prompt as the first leg's engine
        did; None when the count is known, or cannot be asked (a token-ID prompt counts itself)."""
        return self._account.prompt_query()

    def counted(self, tokens: int | None, prompt_tokens: int | None = None) -> None:
        """An engine's count (/tokenize) of the tokens in all the text the client has, and of the original
        prompt: what the answer's length and its usage are built from after tokens without IDs."""
        self.fold()
        self._account.counted(tokens, prompt_tokens, len(self._resume.sent))

    @property
    def output_text(self) -> str:
        self.fold()
        return "".join(self.text)

    @property
    def token_ids(self) -> list[int]:
        self.fold()
        return self._resume.token_ids

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
        if not self._first.raw:
            return
        for event in self._first.drain().split(b"\n\n"):
            if not event.startswith(DATA):
                continue
            payload = event[len(DATA):].strip()
            if self._first_leg_event(payload) is None:
                try:
                    self._rewrite(payload)
                except ValueError:
                    # Relayed as the engine sent it (as without continuation); nothing to learn from it.
                    pass

    # -- legs ------------------------------------------------------------------

    def next_leg(self) -> tuple[str, dict[str, Any]] | None:
        """The route and body of the next decode leg; None when the answer cannot be resumed
        (``not_resumable`` says why)."""
        self.fold()
        self._buffer = b""
        self._leg_done = False
        self.leg_relayed = False
        self._resume.leg_diverged = False
        account = self._account
        account.end_leg()
        self.continuing = self.started
        if not self.started:
            self.leg_route = self.route
            return self.route, legs.first_leg(self.route, self.request, client_ids=self.client_ids).body
        if self.not_resumable is not None:
            return None
        exact = (account.ids_complete and account.prompt_ids is not None
                 and legs.resumes_exactly(self.route, self.request))
        if exact:
            account.tokens_before = self._resume.resume_exactly(self.text)
        else:
            account.tokens_before = self._resume.resume_from_text(account.tokens_before)
        body = legs.owed(self.route, self.request, client_ids=self.client_ids, produced=account.tokens_before)
        if exact:
            assert account.prompt_ids is not None
            leg = (legs.chat_as_completion if self.chat else legs.completion_by_ids)(
                body, account.prompt_ids, self._resume.token_ids)
        elif self.chat:
            leg = legs.chat_by_text(body, "".join(self.text))
        else:
            found = legs.completion_by_text(body, "".join(self.text))
            if found is None:
                self._chat_as_completion = False
                self.not_resumable = "token_id_prompt_without_ids"
                return None
            leg = found
        self._chat_as_completion = leg.as_chat
        self.leg_route = leg.route
        return leg.route, leg.body

    # -- events ----------------------------------------------------------------

    def feed(self, chunk: bytes) -> tuple[bytes, bool]:
        """Rewrite the complete events in ``chunk``: (bytes for the client, whether [DONE] came)."""
        data = self._buffer + chunk if self._buffer else chunk
        end = data.rfind(b"\n\n")
        if end < 0:
            if len(data) > MAX_EVENT_BYTES:
                raise ValueError(f"an SSE event longer than {MAX_EVENT_BYTES} bytes")
            self._buffer = data
            return b"", False
        self._buffer = data[end + 2:]
        if len(self._buffer) > MAX_EVENT_BYTES:
            raise ValueError(f"an SSE event longer than {MAX_EVENT_BYTES} bytes")
        if not self.continuing:
            first = self._first
            relayed, done = first.take(data[:end + 2])
            if done:
                self._leg_done = True
            if not relayed:
                return b"", self._leg_done
            if self.id is None:
                head = read_head(relayed)
                if head is not None:
                    self.id, self.created = head
            if first.full:
                self.fold()
            self.leg_relayed = self._relayed_any = True
            return relayed, self._leg_done
        out: list[bytes] = []
        for event in data[:end].split(b"\n\n"):
            if not event:
                continue
            if not event.startswith(DATA):
                # Comments and other fields go on as they came.
                out.append(event + b"\n\n")
                continue
            payload = event[len(DATA):].strip()
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

    def _rewrite(self, payload: bytes) -> bytes | None:
        try:
            obj = decode_json.decode(payload)
        except (msgspec.DecodeError, RecursionError):
            raise ValueError("an SSE data line that is not JSON") from None
        if not isinstance(obj, dict):
            raise ValueError("an SSE event that is not a JSON object")
        if "error" in obj or obj.get("object") == "error":
            raise EngineErrorEvent(error_message(obj))
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
            self._account.note_prompt(prompt_ids)
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
            account = self._account
            account.usage_came(usage, first_leg)
            if self.continuing:
                account.rewrite_usage(usage, len(self._resume.sent))
            if not obj.get("choices"):
                account.usage_sent = True
        self.leg_relayed = True
        return DATA + encode_json.encode(obj) + b"\n\n"

    def _first_leg_event(self, payload: bytes) -> bytes | None:
        """The first leg's chunk, recorded and relayed as it came (less Narwhal's token IDs).

        The common case, kept cheap: one typed decode and no re-encoding. None sends the
        event down the general path (an unexpected shape, a KV field to strip).
        """
        try:
            event = decode_event(payload)
        except (msgspec.DecodeError, RecursionError):
            return None
        if event.kv_transfer_params is not None:
            return None
        if self.id is None:
            self.id, self.created = event.id, event.created
        account = self._account
        resume = self._resume
        if event.prompt_token_ids is not None:
            account.note_prompt(event.prompt_token_ids)
        for choice in event.choices or ():
            if choice.prompt_token_ids is not None:
                account.note_prompt(choice.prompt_token_ids)
            text = choice.delta.content if self.chat and choice.delta is not None else choice.text
            if choice.delta is not None and (choice.delta.reasoning_content is not None
                                             or choice.delta.reasoning is not None):
                self.not_resumable = "reasoning"
            if text:
                self.text.append(text)
            ids = choice.token_ids
            # ``ResumePoints.advance`` for a first leg, less its continuation cases, and the accounting inline:
            # this runs per token of long streams.
            if ids is not None:
                resume.token_ids.extend(ids)
                resume.sent.extend(ids)
                account.leg_tokens += len(ids)
            if text:
                resume.engine_pos += len(text)
                resume.sent_chars += len(text)
                resume.text_came(ids)
            if ids is None and text:
                account.ids_complete = False
                account.uncounted = True
                account.leg_tokens += 1
            if choice.finish_reason is not None:
                self._finished = True
        if event.usage is not None:
            account.usage_came(event.usage, True)
            if not event.choices:
                account.usage_sent = True
        self.leg_relayed = True
        return DATA + payload + b"\n\n"

    def _choice(self, choice: dict[str, Any], first_leg: bool) -> bool:
        """Record and rewrite one choice; False when it carries nothing the client needs."""
        account = self._account
        prompt_ids = choice.pop("prompt_token_ids", None)
        if first_leg and prompt_ids is not None:
            account.note_prompt(prompt_ids)
            if self.client_ids:
                choice["prompt_token_ids"] = prompt_ids
        ids = choice.get("token_ids") if self.client_ids else choice.pop("token_ids", None)
        ids = int_list(ids)
        if self._chat_as_completion:
            # A completion's choice as the chat chunk's the client asked for (inline: this runs per event).
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
        skip_ids, skip_chars, caught_up = self._resume.advance(ids, text or "", first_leg)
        if caught_up:
            account.leg_tokens += caught_up
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
                drop_logprobs(choice, skip_ids)
            if not text and (ids is None or skip_ids == len(ids)) and choice.get("finish_reason") is None:
                if ids is not None:
                    account.leg_tokens += len(ids)
                return False
        if text:
            self.text.append(text)
        if ids is not None:
            account.leg_tokens += len(ids)
        elif text:
            # No IDs for this token: the next join resumes from text, and counts it with /tokenize.
            account.ids_complete = False
            account.uncounted = True
            account.leg_tokens += 1
        if choice.get("finish_reason") is not None:
            self._finished = True
        return True

    @property
    def tail_needs_count(self) -> bool:
        """Whether ``tail`` owes a usage chunk whose numbers no engine has given yet (``counted`` gives them)."""
        return self._account.tail_needs_count

    def end_at_context(self) -> None:
        """The answer so far fills the engines' context: it ends here, as an engine ends it, with
        ``finish_reason: "length"`` (``tail`` then gives the chunk before its usage and [DONE])."""
        self.fold()
        self._finished = True
        self._ended_at_context = True

    def tail(self) -> bytes:
        """The end of an answer whose last token came but whose leg failed before [DONE].

        Its usage chunk, when the client asked for one, carries the engines' counts; if
        they could not be had (``tail_needs_count`` still true), it is left out: no usage
        rather than a wrong one."""
        model = self.request.get("model")
        head = finish_event(self.id, self.created, model, self.chat, "length") if self._ended_at_context else b""
        usage = self._account.tail_usage(self.tokens)
        if usage is None:
            return head + DONE_EVENT
        return head + usage_event(self.id, self.created, model, self.chat, usage) + DONE_EVENT
