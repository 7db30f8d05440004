"""Lazy parsing: the first leg's events are relayed as they came and read only when needed.

Most streams end without a failure, so a first leg's events are kept unread
(``take``) and handed back for reading (``drain``) when a continuation needs
them, or in batches past ``_FOLD_BYTES``; their tokens are counted without
reading them (``tokens``).
"""

from __future__ import annotations

import re

from narwhal.serving.client_view import KV_KEY, strip_kv_from_events
from narwhal.serving.continuation.events import ERROR_MARK, IDS, OLD_ERROR_MARK, raise_error_events, strip_compact_ids

__all__ = ["FirstLeg"]

# The first leg's unread events are read once they pass this size: memory per stream stays bounded.
_FOLD_BYTES = 128 * 1024
# The token-ID lists of events (not the prompt's: a quote comes right before "token_ids").
_TOKEN_LISTS = re.compile(rb'"token_ids":\s*\[([\d,\s]*)\]')
# A choice's non-empty text (completions) or delta content (chat).
_TEXT_EVENTS = re.compile(rb'"text":\s*"[^"]')
_CONTENT_EVENTS = re.compile(rb'"content":\s*"[^"]')


class FirstLeg:
    """The first leg's relayed events not yet read, and what they hold counted without reading them."""

    __slots__ = ("_client_ids", "_text_events", "raw", "size", "full", "_lists", "_ids", "_counted")

    def __init__(self, *, client_ids: bool, chat: bool) -> None:
        # Token IDs the client asked for are relayed; the ones Narwhal asked for are not.
        self._client_ids = client_ids
        self._text_events = _CONTENT_EVENTS if chat else _TEXT_EVENTS
        self.raw: list[bytes] = []
        self.size = 0
        # Past _FOLD_BYTES: the events are due to be read (``drain``).
        self.full = False
        # What ``tokens`` would find in them, counted as ``take`` strips the IDs: the event token-ID lists seen
        # and their IDs; valid while ``_counted`` (else counted from the events themselves).
        self._lists = 0
        self._ids = 0
        self._counted = True

    def take(self, complete: bytes) -> tuple[bytes, bool]:
        """These complete events as the client gets them, and whether [DONE] was among them.

        Relayed as they came, less Narwhal's token IDs, any ``kv_transfer_params``
        (the engines' business) and [DONE] (``relay`` writes the last one); kept
        unread. Raises EngineErrorEvent for an engine's error event.
        """
        done = False
        found = complete.find(b"[DONE]")
        while found >= 0:
            before = complete.rfind(b"\n\n", 0, found)
            start = before + 2 if before >= 0 else 0
            end = complete.find(b"\n\n", found) + 2
            event = complete[start:end - 2]
            if event.startswith(b"data:") and event[5:].strip() == b"[DONE]":
                done = True
                complete = complete[:start] + complete[end:]
                found = complete.find(b"[DONE]", start)
            else:
                found = complete.find(b"[DONE]", end)
        if not complete:
            return b"", done
        # find, not `in`: `in` on bytes costs a raised and cleared TypeError per call (docs/benchmarks.md).
        if complete.find(ERROR_MARK) >= 0 or complete.find(OLD_ERROR_MARK) >= 0:
            raise_error_events(complete)
        raw = complete
        # This read's event token-ID lists and IDs (as ``tokens`` counts them); None: not counted here.
        counted: tuple[int, int] | None = (0, 0)
        if complete.find(KV_KEY) >= 0:
            # The engine's KV handoff is never the client's (the relay without a join strips it too).
            complete = strip_kv_from_events(complete)
            counted = None
        if complete.find(b"token_ids") >= 0:
            if self._client_ids:
                counted = None
            else:
                complete, lists, ids = strip_compact_ids(complete)
                if b'token_ids"' in complete:
                    # Another spelling (spaces, the key first in its object): the general pattern.
                    complete = IDS.sub(b"", complete)
                    counted = None
                elif counted is not None:
                    counted = (lists, ids)
        if counted is None:
            self._counted = False
        else:
            self._lists += counted[0]
            self._ids += counted[1]
        self.raw.append(raw)
        self.size += len(raw)
        if self.size > _FOLD_BYTES:
            self.full = True
        return complete, done

    def drain(self) -> bytes:
        """The unread events, as the engine sent them; none are kept."""
        raw = b"".join(self.raw)
        self.raw.clear()
        self.size = 0
        self.full = False
        self._lists = self._ids = 0
        self._counted = True
        return raw

    def tokens(self) -> int:
        """The tokens in the unread events, counted without reading them."""
        if not self.raw:
            return 0
        if self._counted and self._lists:
            return self._ids
        raw = b"".join(self.raw)
        lists = _TOKEN_LISTS.findall(raw) if not self._counted else []
        if lists:
            return sum(1 + ids.count(b",") for ids in lists if ids.strip())
        # No IDs: the events with text (a lower bound: an event may carry several tokens), in any JSON spacing.
        return len(self._text_events.findall(raw))
