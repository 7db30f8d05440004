"""Cache-aware placement in the request path, the router and between worker processes (in-process fakes)."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import msgspec
import pytest
import trio

from narwhal.config import ConfigError, parse_config
from narwhal.errors import EngineFailure, FailureClass
from narwhal.fleet import FleetEventKind, HoldKind
from narwhal.fleet.admission import Admission
from narwhal.fleet.placement import IndexRecord, InFlight, PrefixIndex, SharedIndex, prompt_blocks
from narwhal.kv_events.wire import BlockStored, KvBatch
from narwhal.obs.router_metrics import RouterMetrics
from narwhal.pools.control import ControlPool
from narwhal.router import Router
from narwhal.serving.request_core import RequestCore
from narwhal.workers.index_relay import IndexRelay
from narwhal.workers.protocol import ControllerMessage, FrameDecoder, IndexUpdate, MetricsState, Report, encode_frame
from tests.test_readmission import FakeEngine
from tests.test_request_core import FakePool, FakeSupervisor, Sink

CONFIG = """
[serving]
count_tokens = false
policy = "{policy}"
[placement]
policy = "{placement}"
[[engines]]
name = "p1"
url = "http://127.0.0.1:9001"
role = "prefill"
[[engines]]
name = "p2"
url = "http://127.0.0.1:9004"
role = "prefill"
[[engines]]
name = "d1"
url = "http://127.0.0.1:9002"
role = "decode"
"""

PROMPT = " ".join(f"w{i}" for i in range(400))


def make_core(policy: str = "saturate", placement: str = "cache_aware") -> tuple[RequestCore, FakePool]:
    config = parse_config(CONFIG.format(policy=policy, placement=placement))
    supervisor, pool = FakeSupervisor(), FakePool()
    supervisor.roles = {"prefill": ["p1", "p2"], "decode": ["d1"]}
    core = RequestCore(config=config, supervisor=supervisor, data_pool=pool,
                       in_flight=InFlight(e.name for e in config.engines), admission=Admission(),
                       metrics=RouterMetrics())
    return core, pool


def body(prompt: str = PROMPT) -> bytes:
    return msgspec.json.encode({"model": "mock-model", "prompt": prompt, "max_tokens": 2})


def prefills(pool: FakePool) -> list[str]:
    return [name for name, _, payload, _ in pool.calls if payload.get("kv_transfer_params", {}).get("do_remote_decode")]


async def test_the_same_prefix_goes_to_the_same_prefill_engine_and_is_counted() -> None:
    core, pool = make_core()
    for i in range(6):
        await core.handle("/v1/completions", body(PROMPT + f" tail{i}"), None, Sink())
    assert len(set(prefills(pool))) == 1
    metrics = core.metrics.render()
    assert 'narwhal_placement_total{role="prefill",reason="miss",model="mock-model"} 1' in metrics
    assert 'narwhal_placement_total{role="prefill",reason="hit",model="mock-model"} 5' in metrics
    assert 'narwhal_placement_total{role="decode",reason="only_choice",model="mock-model"} 6' in metrics
    assert 'narwhal_placement_matched_fraction_bucket{model="mock-model",le="0"} 1' in metrics


async def test_the_request_log_carries_the_matched_share(monkeypatch: pytest.MonkeyPatch) -> None:
    import narwhal.serving.exchange as exchange

    logged: list[dict[str, Any]] = []
    monkeypatch.setattr(exchange, "log_fields", lambda event, fields, **_: logged.append(
        {"event": event, **msgspec.structs.asdict(fields)}))
    core, _ = make_core()
    await core.handle("/v1/completions", body(), None, Sink())
    await core.handle("/v1/completions", body(), None, Sink())
    matches = [event["prefix_match"] for event in logged if event["event"] == "request"]
    assert matches == [0.0, 1.0]


async def test_a_retry_never_returns_to_the_engine_that_just_failed_whatever_its_match() -> None:
    core, pool = make_core(policy="bounded")
    await core.handle("/v1/completions", body(), None, Sink())
    holder = prefills(pool)[0]
    other = "p2" if holder == "p1" else "p1"
    pool.prefill.append(EngineFailure(holder, FailureClass.CONNECTION, "refused"))
    sink = Sink()
    await core.handle("/v1/completions", body(), None, sink)
    assert sink.status == 200
    assert prefills(pool) == [holder, holder, other]


async def test_least_outstanding_policy_keeps_todays_behaviour() -> None:
    core, pool = make_core(placement="least_outstanding")
    core.in_flight.acquire("p1")
    for _ in range(4):
        await core.handle("/v1/completions", body(), None, Sink())
    assert set(prefills(pool)) == {"p2"}
    assert core.placement.placer.index.entries("p2") == 0
    assert 'reason="least_outstanding"' in core.metrics.render()


def test_placement_config_is_checked() -> None:
    for bad, key in (('policy = "random"', "policy"), ("balance_rel = 0.5", "balance_rel"),
                     ("max_index_mb = 0", "max_index_mb"), ("balance_abs = -1", "balance_abs"),
                     ("block_tokens = 0", "block_tokens")):
        text = CONFIG.format(policy="saturate", placement="cache_aware").replace(
            '[placement]\npolicy = "cache_aware"', f"[placement]\n{bad}")
        with pytest.raises(ConfigError, match=key):
            parse_config(text)
    defaults = parse_config(CONFIG.format(policy="saturate", placement="cache_aware")).placement
    assert (defaults.balance_abs, defaults.balance_rel, defaults.max_index_mb) == (8, 1.5, 64.0)


async def test_the_router_forgets_an_engine_on_ejection_and_maintenance_not_on_other_holds() -> None:
    router = Router(parse_config(CONFIG.format(policy="saturate", placement="cache_aware")))
    index = router.prefix_index.index
    blocks = prompt_blocks({"prompt": PROMPT}, chat=False, block_tokens=16)
    for name in ("p1", "p2"):
        index.record(name, blocks, 1.0)
    now = trio.current_time()
    router.fleet.add_hold("p1", HoldKind.OPERATOR_DRAIN, "operator", now)
    assert index.entries("p1") > 0
    router.fleet.add_hold("p1", HoldKind.MAINTENANCE, "upgrade", now)
    assert index.entries("p1") == 0 and index.entries("p2") > 0
    router.fleet.eject("p2", "gone", now)
    assert index.entries("p2") == 0
    assert router.prefix_index.epochs == {"p1": 1, "p2": 1}
    # The admin view and /metrics show the index.
    index.record("p1", blocks, 1.0)
    entry = router.engine_view.engine("p1")
    assert entry.prefix_index is not None and entry.prefix_index.entries == len(blocks)
    assert f'narwhal_placement_index_entries{{engine="p1",model="mock-model"}} {len(blocks)}' in router.metrics.render()
    assert FleetEventKind.EJECTED  # the listener saw the event kinds above


async def test_a_drained_prefill_engine_restarted_as_a_newer_process_is_forgotten_at_its_readmission(
        caplog: pytest.LogCaptureFixture) -> None:
    config = parse_config(CONFIG.format(policy="saturate", placement="cache_aware")
                          + '[fleet]\nattestation_key = "fleet-key"\n')
    router = Router(config)
    engines = {9001: FakeEngine("p1", "prefill"), 9004: FakeEngine("p2", "prefill"), 9002: FakeEngine("d1", "decode")}
    for engine in engines.values():
        engine.model, engine.models_listed = "mock-model", ["mock-model"]

    async def route(request: httpx.Request) -> httpx.Response:
        return await engines[request.url.port].handle(request)

    router.readmitter.control_pool = ControlPool(control_connections=4, engine_config=config.engine,
                                                 transport=httpx.MockTransport(route))
    index = router.prefix_index.index
    blocks = prompt_blocks({"prompt": PROMPT}, chat=False, block_tokens=16)
    # What the engines' KV event feeds said they hold (readmission's process identity clears it too).
    tokens = list(range(64))
    for name in ("p1", "p2"):
        index.record(name, blocks, 1.0)
        router.kv_events.index.apply(name, KvBatch(0.0, [BlockStored(
            block_hashes=[1, 2, 3, 4], parent_block_hash=None, token_ids=tokens, block_size=16)]), 0.0)
    caplog.set_level("INFO", logger="narwhal.events")
    # An operator drain keeps the entries: the process and its cache stay ...
    router.readmitter.drain("p1", trio.current_time())
    assert (await router.readmitter.readmit("p1", operator=True)).readmitted
    assert index.entries("p1") == len(blocks) and router.kv_events.index.blocks("p1") == 4
    # ... unless the engine is restarted while drained: it comes back with an empty cache.
    router.readmitter.drain("p1", trio.current_time())
    engines[9001].process_started_at = time.time() + 1.0
    assert (await router.readmitter.readmit("p1", operator=True)).readmitted
    assert index.entries("p1") == 0 and index.entries("p2") == len(blocks)
    assert (router.kv_events.index.blocks("p1"), router.kv_events.index.blocks("p2")) == (0, 4)
    forgotten = [json.loads(r.getMessage()) for r in caplog.records if "prefix_index_forgotten" in r.getMessage()]
    assert [(line["engine"], line["reason"]) for line in forgotten] == [("p1", "newer_process")]
    await router.readmitter.control_pool.aclose()


# -- between worker processes -----------------------------------------------------------------


class FakeWorker:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, message: Any) -> None:
        # Through the real framing, as a worker would read it.
        self.sent.extend(FrameDecoder(ControllerMessage).feed(encode_frame(message)))


def report(*records: IndexRecord) -> Report:
    return Report(snapshot_seq=1, in_flight={}, requests_in_flight=0, metrics=MetricsState(),
                  placements=list(records))


def test_placements_are_relayed_to_the_other_workers_and_stale_epochs_dropped() -> None:
    controller = SharedIndex(PrefixIndex(["p1", "p2"], max_bytes=1 << 20))
    workers = {0: FakeWorker(), 1: FakeWorker()}
    relay = IndexRelay(controller, workers)
    worker0 = SharedIndex(PrefixIndex(["p1", "p2"], max_bytes=1 << 20))
    worker1 = SharedIndex(PrefixIndex(["p1", "p2"], max_bytes=1 << 20))
    worker0.recorded("p1", [1, 2, 3], 1.0)
    worker0.recorded("p1", [1, 2, 3], 2.0)  # deduplicated within a report, the latest time kept
    records = worker0.take()
    assert len(records) == 1 and records[0].at == 2.0 and worker0.take() == []
    relay.on_report(0, report(*records))
    assert controller.index.match("p1", [1, 2, 3]) == 3
    updates = [m for m in workers[1].sent if isinstance(m, IndexUpdate)]
    assert len(updates) == 1 and updates[0].records == records
    for update in updates:
        worker1.sync(update.epochs)
        worker1.apply(update.records)
    assert worker1.index.match("p1", [1, 2, 3]) == 3
    # p1 ejected: everyone forgets it, and a record made before that is not applied anywhere.
    relay.forget("p1")
    for update in workers[1].sent[len(updates):]:
        worker1.sync(update.epochs)
    assert worker1.index.entries("p1") == 0 and controller.index.entries("p1") == 0
    relay.on_report(0, report(IndexRecord("p1", 0, [7, 8], 3.0)))
    assert controller.index.entries("p1") == 0
    # A worker that has not seen the current epochs gets them in answer to its report.
    workers[2] = FakeWorker()
    relay.on_report(2, report())
    assert [m.epochs for m in workers[2].sent] == [{"p1": 1}]


def test_the_worker_outbox_is_bounded() -> None:
    shared = SharedIndex(PrefixIndex(["p1"], max_bytes=1 << 20), max_outbox=3)
    for i in range(5):
        shared.recorded("p1", [i], float(i))
    assert len(shared.take()) == 3 and shared.dropped == 2
