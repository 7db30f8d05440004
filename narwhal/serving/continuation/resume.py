"""Resume points and divergence: where an exact join may resume, and what a continuation generates again.

A join resumes at the last point known to end on a whole character, far enough
back that the next engine sees any stop string the join could split. The
tokens after that point are generated again; what the client already has of
them is not sent twice, and a sampled answer that comes out differently is
noticed (``diverged``).
"""

from __future__ import annotations

from collections import deque
from typing import Any

from narwhal.serving.continuation.values import lax_bool

__all__ = ["ResumePoints", "stop_lookback"]


def stop_lookback(request: dict[str, Any]) -> tuple[int, int]:
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
    return (0 if lax_bool(request.get("include_stop_str_in_output")) else span), span


class ResumePoints:
    """The token IDs and characters of one answer so far, in the client's coordinates and the current engine's.

    ``token_ids``, ``sent``, ``sent_chars`` and ``engine_pos`` are public: the
    first leg's reader updates them inline (it runs per token of long streams).
    """

    __slots__ = ("token_ids", "sent", "sent_chars", "engine_pos", "_held", "_stop_span", "_checked_chars",
                 "_points", "_overlap_text", "_overlap_from", "regenerated", "diverged", "leg_diverged")

    def __init__(self, request: dict[str, Any]) -> None:
        # The token IDs the client holds (or would hold, had it asked for them), in order; ``token_ids`` is the
        # sequence the current engine continues, which a join cuts back to a whole character.
        self.token_ids: list[int] = []
        self.sent: list[int] = []
        self.sent_chars = 0
        # Where the current leg's next character falls in the answer's text (the client's coordinates).
        self.engine_pos = 0
        # vLLM holds back this many characters of a stream whose stop strings are excluded from the text
        # (a stop string is never half-sent), and a stop string can span this many characters before a join.
        self._held, self._stop_span = stop_lookback(request)
        # The answer's text up to here is known to the engines to hold no stop string.
        self._checked_chars = 0
        # Points where the answer ends on a whole character: (output tokens, characters of text), oldest first.
        self._points: deque[tuple[int, int]] = deque([(0, 0)])
        # The client's text after the current leg's resume point: what the leg generates again is compared with it.
        self._overlap_text = ""
        self._overlap_from = 0
        # Tokens a continuation generated again (the client had them) and whether any came out different
        # (ever, and in the current leg).
        self.regenerated = 0
        self.diverged = False
        self.leg_diverged = False

    def resume_from_text(self, tokens_before: int) -> int:
        """A text join resumes after everything the client has: nothing is generated again. Returns the
        tokens before the next leg."""
        self.leg_diverged = False
        if len(self.token_ids) < len(self.sent):
            self.token_ids.extend(self.sent[len(self.token_ids):])
        self.engine_pos = self.sent_chars
        self._overlap_text = ""
        return max(tokens_before, len(self.sent))

    def resume_exactly(self, text: list[str]) -> int:
        """Cut the answer's token IDs back to where the next leg resumes; returns the tokens before it.

        ``text`` is the client's text, in pieces. The resume point is the last one known to end on a whole
        character, far enough back that the next engine sees any stop string the join could split.
        Why not at the last token: vLLM's detokenizer, primed with a prompt ending inside a character (byte tokens
        of an emoji or a CJK character), emits the prompt's whole text again in its first delta; a stop string
        spanning the join would go unseen; text held back under a stop string would be lost. The tokens after the
        resume point are generated again; what the client already has of them is not sent twice.
        """
        self.leg_diverged = False
        limit = self._checked_chars - self._stop_span
        tokens, chars = self._points[0]
        for point in reversed(self._points):
            if point[1] <= limit and point[1] <= self.sent_chars:
                tokens, chars = point
                break
        while self._points[-1][0] > tokens:
            self._points.pop()
        del self.token_ids[tokens:]
        self.engine_pos = chars
        if chars < self.sent_chars:
            self._overlap_text = "".join(text)[chars:]
            self._overlap_from = chars
        else:
            self._overlap_text = ""
        return tokens

    def advance(self, ids: list[int] | None, text: str, first_leg: bool) -> tuple[int, int, int]:
        """Take one choice's tokens and text as the engine sent them. Returns how many leading IDs and characters
        the client already has (a continuation generating again what followed its resume point), and how many
        tokens an engine without token IDs generated again, matching the client's text."""
        skip_ids = skip_chars = 0
        owed = 0
        if not first_leg:
            owed = len(self.sent) - len(self.token_ids)
            if ids and owed > 0:
                at = len(self.token_ids)
                skip_ids = min(owed, len(ids))
                self.regenerated += skip_ids
                if ids[:skip_ids] != self.sent[at:at + skip_ids]:
                    self.diverged = self.leg_diverged = True
            if text and self.leg_diverged:
                # A sampled answer that came out differently: the client keeps what it has, and gets the new
                # engine's text from the first event that brings a token it did not have.
                skip_chars = len(text) if ids and owed >= len(ids) else 0
            elif text:
                skip_chars = min(max(self.sent_chars - self.engine_pos, 0), len(text))
                if skip_chars:
                    start = self.engine_pos - self._overlap_from
                    if text[:skip_chars] != self._overlap_text[start:start + skip_chars]:
                        self.diverged = self.leg_diverged = True
        if ids is not None:
            self.token_ids.extend(ids)
            self.sent.extend(ids[skip_ids:] if skip_ids else ids)
        in_overlap = owed > 0 and (ids is None or owed > len(ids))
        if self.leg_diverged and not in_overlap:
            # Past the tokens generated again: the text runs on from what the client has.
            self.engine_pos = self.sent_chars - skip_chars
        caught_up = 0
        if text:
            self.engine_pos += len(text)
            self.sent_chars += len(text) - skip_chars
            if ids is None and owed > 0 and self.engine_pos >= self.sent_chars:
                # An engine without token IDs generated again all the client had (its text matched): the same
                # tokens, so the answer's IDs run on as the client's.
                self.regenerated += owed
                caught_up = owed
                self.token_ids.extend(self.sent[len(self.token_ids):])
            if not (self.leg_diverged and in_overlap):
                # (Positions inside tokens that came out differently say nothing about the client's text.)
                self.text_came(ids)
        return skip_ids, skip_chars, caught_up

    def text_came(self, ids: list[int] | None) -> None:
        """The engine sent text with ``ids`` (``engine_pos`` past it): what the engines have checked for stop
        strings, and whether the answer ends on a whole character here."""
        # Held-back text is released as the engine's text grows: once some came, the engine's text is exactly
        # ``_held`` characters ahead of what it sent.
        known = self.engine_pos + self._held
        if known > self._checked_chars:
            self._checked_chars = known
        if ids is not None and len(ids) == 1:
            # One token that brought text: the detokenizer emits nothing while the text ends inside a
            # character, so the answer ends on a whole one here (a read of several tokens cannot say).
            self._point(len(self.token_ids), known)

    def _point(self, tokens: int, chars: int) -> None:
        points = self._points
        if not self._stop_span:
            # Without stop strings the newest point is the only one ever needed.
            points[0] = (tokens, chars)
            return
        points.append((tokens, chars))
        limit = self._checked_chars - self._stop_span
        # Only the newest point far enough back is ever needed: points keep at most a stop string's span of text.
        while len(points) > 1 and points[1][1] <= limit:
            points.popleft()
