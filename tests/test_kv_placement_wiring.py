"""The request path with the engines' KV events (in-process fakes): token IDs asked once, before the choice; the
feeds' blocks decide; ``required`` leaves engines without a live feed out."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from narwhal.config import parse_config
from narwhal.fleet.admission import Admission
from narwhal.fleet.placement import InFlight
from narwhal.kv_events.feed import FeedSource, FeedStats
from narwhal.kv_events.service import KvEvents
from narwhal.kv_events.wire import BlockStored, KvBatch
from narwhal.obs.router_metrics import RouterMetrics
from narwhal.serving.placement import RequestPlacement
from narwhal.serving.request_core import RequestCore
from tests.test_placement_wiring import CONFIG, prefills
from tests.test_request_core import FakePool, FakeSupervisor, Sink

TOKENS = list(range(1000, 1000 + 64))


class FakeFeeds:
    """KvFeeds' surface: which engines are live is set by the test."""

    def __init__(self) -> None:
        self.live_engines: set[str] = set()
        self.sources: dict[str, FeedSource] = {}

    def set_sources(self, sources: dict[str, FeedSource]) -> None:
        self.sources = dict(sources)

    def new_process(self, engine: str) -> None:
        pass

    def stats(self) -> dict[str, FeedStats]:
        return {name: FeedStats(state="live" if name in self.live_engines else "down", last_seq=0)
                for name in self.sources}

    def live(self, engine: str) -> bool:
        return engine in self.live_engines


def make_core(*, mode: str = "auto", count_tokens: bool = False, live: tuple[str, ...] = ("p1", "p2"),
              policy: str = "bounded") -> tuple[RequestCore, FakePool, KvEvents]:
    text = CONFIG.format(policy=policy, placement="cache_aware").replace(
        "count_tokens = false", f"count_tokens = {'true' if count_tokens else 'false'}").replace(
        "[placement]", f'[placement]\nkv_events = "{mode}"')
    config = parse_config(text)
    feeds = FakeFeeds()
    kv = KvEvents(config.placement, ["p1", "p2"], feeds=feeds)  # type: ignore[arg-type]
    kv.set_sources({name: FeedSource(publisher=f"tcp://127.0.0.1:{5000 + i}") for i, name in enumerate(("p1", "p2"))})
    feeds.live_engines = set(live)
    supervisor, pool = FakeSupervisor(), FakePool()
    supervisor.roles = {"prefill": ["p1", "p2"], "decode": ["d1"]}
    metrics = RouterMetrics()
    core = RequestCore(config=config, supervisor=supervisor, data_pool=pool,
                       in_flight=InFlight(e.name for e in config.engines), admission=Admission(), metrics=metrics,
                       placement=RequestPlacement(config, metrics, kv=kv))
    return core, pool, kv


def store(kv: KvEvents, engine: str, tokens: list[int], block_size: int = 16) -> None:
    n = len(tokens) // block_size
    kv.index.apply(engine, KvBatch(0.0, [BlockStored(block_hashes=[f"{engine}{i}".encode() for i in range(n)],
                                                     parent_block_hash=None, token_ids=tokens[:n * block_size],
                                                     block_size=block_size)]), 0.0)


def tokenize_answer(tokens: list[int]) -> tuple[int, bytes]:
    return 200, json.dumps({"count": len(tokens), "max_model_len": 4096, "tokens": tokens}).encode()


def body(prompt: Any) -> bytes:
    return msgspec.json.encode({"model": "mock-model", "prompt": prompt, "max_tokens": 2})


def paths(pool: FakePool) -> list[tuple[str, str]]:
    return [(name, path) for name, path, payload, _ in pool.calls
            if path == "/tokenize" or payload.get("kv_transfer_params", {}).get("do_remote_decode")]


async def test_the_engine_whose_feed_holds_the_prompt_takes_it_after_one_tokenize() -> None:
    core, pool, kv = make_core()
    # The approximate index believes p1 has this text; the feeds say p2 holds its tokens.
    core.placement.placer.index.record("p1", list(range(1, 20)), 1.0)
    store(kv, "p2", TOKENS)
    pool.tokenize.append(tokenize_answer(TOKENS + [7, 8, 9]))
    sink = Sink()
    await core.handle("/v1/completions", body("a text prompt " * 40), None, sink)
    assert sink.status == 200
    tokenized, prefill = paths(pool)
    assert tokenized[1] == "/tokenize" and prefill == ("p2", "/v1/completions")
    assert 'narwhal_placement_total{role="prefill",reason="hit",model="mock-model"} 1' in core.metrics.render()


async def test_token_id_prompts_need_no_tokenize_and_without_a_live_feed_nothing_is_asked() -> None:
    core, pool, kv = make_core()
    store(kv, "p1", TOKENS)
    await core.handle("/v1/completions", body(TOKENS + [5]), None, Sink())
    assert paths(pool) == [("p1", "/v1/completions")]
    quiet, pool2, _ = make_core(live=())
    await quiet.handle("/v1/completions", body("plain text " * 30), None, Sink())
    assert [path for _, path in paths(pool2)] == ["/v1/completions"]


async def test_with_count_tokens_the_placement_answer_is_the_context_check() -> None:
    core, pool, kv = make_core(count_tokens=True)
    store(kv, "p2", TOKENS)
    pool.tokenize.append((200, json.dumps({"count": 4000, "max_model_len": 4096, "tokens": TOKENS}).encode()))
    sink = Sink()
    await core.handle("/v1/completions", msgspec.json.encode(
        {"model": "mock-model", "prompt": "long " * 50, "max_tokens": 200}), None, sink)
    # One /tokenize: its count (4000 + 200 > 4096) refuses the request before any prefill.
    assert sink.status == 400 and b"context_length_exceeded" in sink.body
    assert [path for _, path in paths(pool)] == ["/tokenize"]


@pytest.mark.parametrize("live", [("p1",), ()])
async def test_required_places_only_on_engines_with_a_live_feed(live: tuple[str, ...]) -> None:
    # (saturate: a bounded request would wait for capacity until its deadline)
    core, pool, _ = make_core(mode="required", live=live, policy="saturate")
    sinks = [Sink() for _ in range(4)]
    for i, sink in enumerate(sinks):
        await core.handle("/v1/completions", body(f"prompt number {i} " * 20), None, sink)
    if live:
        assert all(sink.status == 200 for sink in sinks) and set(prefills(pool)) == {"p1"}
    else:
        assert all(sink.status == 503 for sink in sinks)
        assert b"live KV event feed" in sinks[0].body and b"no_capacity" in sinks[0].body


async def test_off_subscribes_to_nothing_and_a_reload_turns_it_on() -> None:
    core, pool, kv = make_core(mode="off")
    feeds = kv.feeds
    assert feeds.sources == {}  # type: ignore[attr-defined]
    await core.handle("/v1/completions", body("text " * 40), None, Sink())
    assert [path for _, path in paths(pool)] == ["/v1/completions"]
    on = parse_config(CONFIG.format(policy="bounded", placement="cache_aware").replace(
        "[placement]", '[placement]\nkv_events = "auto"'))
    core.placement.configure(on.placement)
    assert set(feeds.sources) == {"p1", "p2"}  # type: ignore[attr-defined]
    assert kv.stats()["p1"].state == "live"
