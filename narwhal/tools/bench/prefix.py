"""The prefix scenario (``bench --scenario prefix``): shared prefixes, unique suffixes, and the cache hits.

Each request takes one of ``prefixes`` groups: the group's shared prefix of
``prefix_words`` words, then ``suffix_words`` words no other request has. With
``skew`` a share of all requests goes to group 0 and the rest spread over the
others. With ``chat_turns`` the requests are chat conversations instead: the
group's prefix is the system message, each group has a few conversations, and
each request is the next turn of one of them (the whole conversation so far,
then a new user message), so conversations grow as in a chat client.

The mock prefill engines model a prefix cache; after the load their
``/mock/stats`` give the hit rate (cached prompt tokens over prompt tokens, as
vLLM's prefix-cache metrics count it) and each engine's share of prefills.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Any

import httpx
import msgspec

from narwhal.tools.bench.cluster import RouterUsage, format_router_lines

__all__ = ["CONVERSATIONS_PER_GROUP", "PlacementPass", "PrefixReport", "PrefixWorkload", "collect_prefix_report",
           "format_pass_lines", "format_prefix_lines", "same_engine_share"]

# Conversations that share one group's system prompt at a time (chat_turns > 0).
CONVERSATIONS_PER_GROUP = 4
# Words an assistant turn adds to a conversation.
_ANSWER_WORDS = 16
# The engines' (and the mock's) KV block: only whole blocks are cached.
_BLOCK_TOKENS = 16

_encode = msgspec.json.Encoder().encode
# Summed over the model label (one series per model and reason).
_PREFILL_REASON = re.compile(r'^narwhal_placement_total\{role="prefill",reason="([a-z_]+)"(?:,model="[^"]*")?\} '
                             r'([0-9.e+]+)$')


class PrefixWorkload:
    """Bodies for the prefix scenario, one per call; deterministic for a seed."""

    def __init__(self, *, prefixes: int, prefix_words: int, suffix_words: int, skew: float, chat_turns: int,
                 max_tokens: int, stream: bool, model: str = "mock-model", seed: int = 1) -> None:
        self.prefixes = prefixes
        self.prefix_words = prefix_words
        self.suffix_words = suffix_words
        self.skew = skew
        self.chat_turns = chat_turns
        self.max_tokens = max_tokens
        self.stream = stream
        self.model = model
        self._rng = random.Random(seed)
        self._serial = 0
        self._prefix_text = [" ".join(f"g{g}w{i}" for i in range(prefix_words)) for g in range(prefixes)]
        # (group, conversation) -> the conversation's messages after its system prompt.
        self._conversations: dict[tuple[int, int], list[dict[str, str]]] = {}
        # The best possible hit rate's count (completions only): groups already sent (warm-up included),
        # and since start_measuring the prompt tokens sent and those a perfect placement would find cached.
        self._seen: set[int] = set()
        self.prompt_tokens = 0
        self.best_cached_tokens = 0

    def start_measuring(self) -> None:
        """Count the best possible hit rate from here (after the warm-up); groups already sent stay seen."""
        self.prompt_tokens = self.best_cached_tokens = 0

    @property
    def best_hit_rate(self) -> float | None:
        """Cached over prompt tokens if every request after its group's first found the group's whole
        shared prefix (in whole blocks) cached and nothing else; None for chat or before any request."""
        if self.chat_turns or not self.prompt_tokens:
            return None
        return round(self.best_cached_tokens / self.prompt_tokens, 4)

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat_turns else "/v1/completions"

    def group(self) -> int:
        """The next request's prefix group."""
        rng = self._rng
        if self.prefixes > 1 and self.skew > 0:
            if rng.random() < self.skew:
                return 0
            return rng.randrange(1, self.prefixes)
        return rng.randrange(self.prefixes)

    def _unique(self, words: int) -> str:
        self._serial += 1
        return " ".join(f"u{self._serial}x{i}" for i in range(words))

    def __call__(self) -> bytes:
        group = self.group()
        body: dict[str, Any] = {"model": self.model, "max_tokens": self.max_tokens, "stream": self.stream}
        if not self.chat_turns:
            body["prompt"] = self._prefix_text[group] + " " + self._unique(self.suffix_words)
            # The mock counts a word as a token; an engine never counts the whole prompt as cached.
            tokens = self.prefix_words + self.suffix_words
            self.prompt_tokens += tokens
            if group in self._seen:
                self.best_cached_tokens += min(self.prefix_words // _BLOCK_TOKENS * _BLOCK_TOKENS, tokens - 1)
            self._seen.add(group)
            return _encode(body)
        key = (group, self._rng.randrange(CONVERSATIONS_PER_GROUP))
        turns = self._conversations.get(key)
        if turns is None or len(turns) >= 2 * self.chat_turns - 1:
            # A finished conversation makes way for a new one on the same system prompt.
            turns = self._conversations[key] = []
        elif turns:
            turns.append({"role": "assistant", "content": self._unique(_ANSWER_WORDS)})
        turns.append({"role": "user", "content": self._unique(self.suffix_words)})
        body["messages"] = [{"role": "system", "content": self._prefix_text[group]}, *turns]
        return _encode(body)


class EngineCache(msgspec.Struct, frozen=True, kw_only=True):
    """One prefill mock's prefix cache during the load."""

    name: str
    prefills: int
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float | None


class PrefixReport(msgspec.Struct, frozen=True, kw_only=True):
    """The prefix scenario's figures: hit rate over all prefill engines, and how prefills spread."""

    hit_rate: float | None
    largest_prefill_share: float | None
    engines: list[EngineCache]
    workload: dict[str, Any]
    # Narwhal's own count of its prefill choices by reason, when the router is Narwhal.
    placements: dict[str, float] = {}
    # The best possible hit rate (PrefixWorkload.best_hit_rate) and hit_rate over it.
    best_hit_rate: float | None = None
    hit_rate_vs_best: float | None = None
    # Prefills whose prefix (prompt's first block) went to that prefix's most common engine, over all.
    same_engine_share: float | None = None


class PlacementPass(msgspec.Struct, frozen=True, kw_only=True):
    """One pass of ``--compare-kv-events`` (or ``--routers N``): its placement mode and what it got."""

    name: str
    kv_events: str
    routers: int
    requests: int
    errors: int
    requests_per_s: float | None
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    prefix: PrefixReport
    # Per router: per prefill engine, the kv_events state in its /admin/placement after the load.
    feeds: list[dict[str, str]] = []
    # The routers formed one cluster ([lease] mode = "replicas" on etcd; bench --routers N >= 2).
    cluster: bool = False
    # Per router: its role, the requests the load sent it and their CPU (bench.cluster.RouterUsage).
    router_usage: list[RouterUsage] = []


def _placements(metrics: str) -> dict[str, float]:
    found: dict[str, float] = {}
    for line in metrics.splitlines():
        match = _PREFILL_REASON.match(line)
        if match:
            found[match.group(1)] = found.get(match.group(1), 0.0) + float(match.group(2))
    return found


async def collect_prefix_report(client: httpx.AsyncClient, prefill_urls: Sequence[tuple[str, str]],
                                workload: PrefixWorkload, narwhal_url: str | None = None) -> PrefixReport:
    """Read every prefill mock's prefix-cache counters (reset at the start of the measured load).

    With ``narwhal_url`` also Narwhal's prefill placements by reason (warm-up included).
    """
    engines: list[EngineCache] = []
    by_block: dict[str, dict[str, int]] = {}
    for name, url in prefill_urls:
        stats = (await client.get(url + "/mock/stats")).json()
        for key, count in (stats.get("prefills_by_first_block") or {}).items():
            by_block.setdefault(key, {})[name] = int(count)
        cache = stats.get("prefix_cache") or {}
        engines.append(EngineCache(name=name, prefills=int(stats.get("prefill", 0)),
                                   prompt_tokens=int(cache.get("prompt_tokens", 0)),
                                   cached_tokens=int(cache.get("cached_tokens", 0)), hit_rate=cache.get("hit_rate")))
    placements: dict[str, float] = {}
    if narwhal_url is not None:
        try:
            placements = _placements((await client.get(narwhal_url + "/metrics")).text)
        except httpx.HTTPError:
            placements = {}
    prompt = sum(engine.prompt_tokens for engine in engines)
    prefills = sum(engine.prefills for engine in engines)
    hit_rate = round(sum(engine.cached_tokens for engine in engines) / prompt, 4) if prompt else None
    best = workload.best_hit_rate
    return PrefixReport(
        hit_rate=hit_rate, best_hit_rate=best,
        hit_rate_vs_best=round(hit_rate / best, 4) if hit_rate is not None and best else None,
        same_engine_share=same_engine_share(by_block),
        largest_prefill_share=round(max(engine.prefills for engine in engines) / prefills, 4) if prefills else None,
        engines=engines,
        workload={"prefixes": workload.prefixes, "skew": workload.skew, "chat_turns": workload.chat_turns,
                  "suffix_words": workload.suffix_words},
        placements=placements)


def same_engine_share(by_block: dict[str, dict[str, int]]) -> float | None:
    """Of all prefills, the share that went to their prefix's most common engine (prefix -> engine -> count)."""
    total = sum(sum(counts.values()) for counts in by_block.values())
    if not total:
        return None
    return round(sum(max(counts.values()) for counts in by_block.values() if counts) / total, 4)


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _pass_label(p: PlacementPass) -> str:
    return f"{p.name} x{p.routers}{' cluster' if p.cluster else ''}"


def format_pass_lines(passes: Sequence[PlacementPass]) -> list[str]:
    """Placement passes: one row per pass, each router's role and CPU per request, the feeds' states."""
    lines = ["", "placement passes (same fleet, caches reset between passes; best: see docs/benchmarks.md)",
             f"  {'pass':<12} {'kv_events':<9} {'routers':>10} {'hit rate':>8} {'best':>6} {'/best':>6} "
             f"{'same eng':>8} {'ttft p50':>9} {'ttft p99':>9} {'req/s':>7} {'errors':>6}"]
    for p in passes:
        ttft = "-" if p.ttft_p50_ms is None else f"{p.ttft_p50_ms:.1f}ms"
        ttft99 = "-" if p.ttft_p99_ms is None else f"{p.ttft_p99_ms:.1f}ms"
        rps = "-" if p.requests_per_s is None else f"{p.requests_per_s:.1f}"
        routers = f"{p.routers} cluster" if p.cluster else str(p.routers)
        lines.append(f"  {p.name:<12} {p.kv_events:<9} {routers:>10} {_share(p.prefix.hit_rate):>8} "
                     f"{_share(p.prefix.best_hit_rate):>6} {_share(p.prefix.hit_rate_vs_best):>6} "
                     f"{_share(p.prefix.same_engine_share):>8} {ttft:>9} {ttft99:>9} {rps:>7} {p.errors:>6}")
    for p in passes:
        lines += format_router_lines(_pass_label(p), p.router_usage)
    for p in passes:
        if p.feeds:
            states = "; ".join(", ".join(f"{engine} {state}" for engine, state in sorted(feed.items()))
                               for feed in p.feeds)
            lines.append(f"  {_pass_label(p)} feeds by router: {states}")
    return lines


def format_prefix_lines(report: PrefixReport) -> list[str]:
    """The prefix scenario's lines under the table."""
    def share(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    lines = ["", f"prefix scenario: {report.workload}",
             f"  prefix hit rate (cached / prompt tokens)  {share(report.hit_rate)}",
             f"  largest share of prefills on one engine   {share(report.largest_prefill_share)}"]
    if report.best_hit_rate is not None:
        lines.append(f"  best possible hit rate                    {share(report.best_hit_rate)} "
                     f"(hit rate / best {share(report.hit_rate_vs_best)})")
    if report.same_engine_share is not None:
        lines.append(f"  prefills on their prefix's usual engine   {share(report.same_engine_share)}")
    for engine in report.engines:
        lines.append(f"  {engine.name}: {engine.prefills} prefills, hit rate {share(engine.hit_rate)}")
    if report.placements:
        counts = ", ".join(f"{reason} {int(n)}" for reason, n in sorted(report.placements.items()))
        lines.append(f"  narwhal prefill placements (warm-up included): {counts}")
    return lines
