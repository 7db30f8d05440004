"""The cluster's pure parts and shells, in process: the fleet records' view, a replica's local evidence,
the link's receiver and sender, the publisher, the config rules, admission's view deadline and the gates
that keep a replica from deciding."""

from __future__ import annotations

import json
from typing import Any

import httpx
import msgspec
import pytest
import trio
import trio.testing

from narwhal.cluster.control import ClusterControl, LocalExclusions
from narwhal.cluster.fleet_view import FleetRecordsView
from narwhal.cluster.link import EvidenceReceiver, EvidenceSender, PlacementRelay
from narwhal.cluster.publisher import FleetPublisher, stable_entry
from narwhal.cluster.records import ControllerRef, EvidenceItem, EvidenceReply, FleetEntry, PlacedPrompt
from narwhal.config import ConfigError, parse_config
from narwhal.control.fleet_writer import FleetWriter
from narwhal.discovery.view import KeyEvent, StoredKey
from narwhal.errors import FailureClass, SuccessKind
from narwhal.fleet import Fleet, HoldKind
from narwhal.fleet.admission import Admission
from narwhal.fleet.model import EngineRecord, HoldRecord
from narwhal.fleet.registry import EngineEntry
from narwhal.obs.router_metrics import RouterMetrics

PREFIX = "/narwhal/lease/fleet/"
ENGINES = """
[[engines]]
name = "p1"
url = "http://127.0.0.1:9001"
role = "prefill"
[[engines]]
name = "d1"
url = "http://127.0.0.1:9002"
role = "decode"
"""


def entry(name: str, *, role: str = "prefill", ejected: bool = False, process: float | None = None,
          written_at: float = 0.0) -> FleetEntry:
    port = 8000 + ord(name[0]) * 10 + ord(name[-1])
    return FleetEntry(entry=EngineEntry(name=name, url=f"http://10.0.0.1:{port}", role=role, model="m"),
                      record=EngineRecord(name=name, role=role, model="m", ejected=ejected),
                      process_started_at=process, written_at=written_at)


def stored(value: FleetEntry, revision: int) -> StoredKey:
    return StoredKey(PREFIX + value.entry.name, msgspec.json.encode(value), revision)


# -- the fleet records' view (pure) -------------------------------------------------------

def test_the_view_lists_applies_events_and_says_what_changed() -> None:
    view = FleetRecordsView(PREFIX)
    change = view.reset([stored(entry("p1"), 5), stored(entry("d1", role="decode"), 6)], revision=7)
    assert change.added == ("d1", "p1") and view.revision == 7
    assert set(view.engines) == {"p1", "d1"} and view.mod_revisions == {"p1": 5, "d1": 6}
    ejected = entry("p1", ejected=True)
    change = view.apply([KeyEvent("put", PREFIX + "p1", 8, msgspec.json.encode(ejected)),
                         KeyEvent("delete", PREFIX + "d1", 9)])
    assert change.changed == ("p1",) and change.removed == ("d1",)
    assert view.entries["p1"].record.ejected and view.revision == 9
    # Events at or below the revision applied are skipped (a watch resumed from an older revision).
    assert not view.apply([KeyEvent("delete", PREFIX + "p1", 8)])
    assert "p1" in view.entries


def test_a_value_that_does_not_decode_or_names_another_engine_is_no_engine() -> None:
    view = FleetRecordsView(PREFIX)
    view.reset([StoredKey(PREFIX + "p1", b"{not json", 3), stored(entry("p2"), 4)], revision=4)
    assert view.entries == {"p2": entry("p2")} and view.invalid == 1
    renamed = msgspec.json.encode(entry("other"))
    change = view.apply([KeyEvent("put", PREFIX + "p2", 5, renamed)])
    assert change.removed == ("p2",) and view.invalid == 2


# -- a replica's own evidence ---------------------------------------------------------------

class FakeSupervisor:
    def __init__(self) -> None:
        self.names = {"prefill": ["p1", "p2"], "decode": ["d1"]}
        self.failures: list[tuple[str, FailureClass]] = []
        self.successes: list[tuple[str, SuccessKind]] = []

    def eligible(self, role: str, model: str | None = None) -> list[str]:
        return list(self.names[role])

    def eligible_pools(self) -> dict[str, dict[str, list[str]]]:
        return {"m": {role: list(names) for role, names in self.names.items()}}

    def capacity_problem(self, model: str | None = None) -> str | None:
        return None

    def capacity_problems(self) -> dict[str, str]:
        return {}

    def record_failure(self, engine: str, failure_class: FailureClass) -> None:
        self.failures.append((engine, failure_class))

    def record_success(self, engine: str, kind: SuccessKind) -> None:
        self.successes.append((engine, kind))

    def state_version(self) -> int:
        return 1

    def valid_until(self) -> float | None:
        return None


def control(replica: bool = True) -> tuple[ClusterControl, FakeSupervisor, list[EvidenceItem], list[float]]:
    supervisor, reported, now = FakeSupervisor(), [], [100.0]
    ctl = ClusterControl(supervisor, replica=lambda: replica, report=reported.append, clock=lambda: now[0],
                         hold_s=lambda: 5.0)
    return ctl, supervisor, reported, now


def test_a_replica_stops_placing_on_an_engine_it_cannot_reach_at_once_and_reports_it() -> None:
    ctl, supervisor, reported, now = control()
    version = ctl.state_version()
    ctl.record_failure("p1", FailureClass.CONNECTION)
    assert ctl.eligible("prefill") == ["p2"]
    assert ctl.eligible_pools()["m"]["prefill"] == ["p2"]
    assert ctl.state_version() != version  # workers get a new snapshot
    assert ctl.valid_until() == 105.0
    assert reported == [EvidenceItem("p1", failure_class="connection")]
    assert supervisor.failures == [("p1", FailureClass.CONNECTION)]  # counted (metrics); the writer is gated
    # Other classes are reported but are not this replica's to act on.
    ctl.record_failure("p2", FailureClass.TIMEOUT)
    assert ctl.eligible("prefill") == ["p2"]
    # It is tried again after hold_s, or at once when the controller's record for it changes.
    now[0] = 105.0
    assert ctl.eligible("prefill") == ["p1", "p2"]
    ctl.record_failure("p1", FailureClass.CONNECTION)
    ctl.exclusions.clear("p1")
    assert ctl.eligible("prefill") == ["p1", "p2"]


def test_every_engine_a_replica_cannot_reach_is_a_capacity_problem_of_its_own() -> None:
    ctl, _, _, _ = control()
    ctl.record_failure("d1", FailureClass.CONNECTION)
    assert "unreachable from this replica" in (ctl.capacity_problem() or "")


def test_a_replica_reports_a_success_only_after_a_failure_it_reported() -> None:
    ctl, _, reported, _ = control()
    ctl.record_success("p1", SuccessKind.DECODE_TERMINAL)
    assert reported == []  # one message per request would be the controller's whole load
    ctl.record_failure("p1", FailureClass.TIMEOUT)
    ctl.record_success("p1", SuccessKind.DECODE_TERMINAL)
    ctl.record_success("p1", SuccessKind.DECODE_TERMINAL)
    assert reported == [EvidenceItem("p1", failure_class="timeout"), EvidenceItem("p1", success_kind="decode_terminal")]


def test_on_the_controller_the_control_plane_is_the_supervisor() -> None:
    ctl, supervisor, reported, _ = control(replica=False)
    ctl.record_failure("p1", FailureClass.CONNECTION)
    assert ctl.eligible("prefill") == ["p1", "p2"] and reported == []
    assert supervisor.failures == [("p1", FailureClass.CONNECTION)]


def test_exclusions_expire_and_say_so_in_their_version() -> None:
    exclusions = LocalExclusions()
    exclusions.exclude("a", until=10.0)
    version = exclusions.version
    assert exclusions.active(9.0) == {"a"} and exclusions.version == version
    assert exclusions.active(10.0) == frozenset() and exclusions.version == version + 1


# -- the link: the controller's receiver -------------------------------------------------------

def receiver(ref: ControllerRef | None = None, *, token: str | None = "s3cret", mutual_tls: bool = False
             ) -> tuple[EvidenceReceiver, list[Any], list[list[PlacedPrompt]]]:
    applied: list[Any] = []
    placed: list[list[PlacedPrompt]] = []
    return EvidenceReceiver(router_id="r1", token=token, mutual_tls=mutual_tls, controller_ref=lambda: ref,
                            apply_evidence=lambda *args: applied.append(args), apply_placements=placed.append,
                            relay=PlacementRelay(), clock=lambda: 0.0), applied, placed


def batch(**fields: Any) -> bytes:
    return json.dumps({"router_id": "r2", **fields}).encode()


def test_the_receiver_refuses_a_peer_without_the_token_or_a_certificate() -> None:
    recv, applied, _ = receiver()
    assert recv.handle(batch(), authorization=None, peer_cert=False)[0] == 401
    assert recv.handle(batch(), authorization="Bearer wrong", peer_cert=False)[0] == 401
    assert recv.handle(batch(), authorization="Basic s3cret", peer_cert=False)[0] == 401
    # A certificate counts only when the link is mutual TLS.
    assert recv.handle(batch(), authorization=None, peer_cert=True)[0] == 401
    status, body = recv.handle(batch(), authorization="Bearer s3cret", peer_cert=False)
    assert status == 200 and json.loads(body)["controller"] == "r1"
    tls, _, _ = receiver(token=None, mutual_tls=True)
    assert tls.handle(batch(), authorization=None, peer_cert=True)[0] == 200
    assert tls.handle(batch(), authorization="Bearer s3cret", peer_cert=False)[0] == 401
    assert applied == [] and recv.refused == 4


def test_the_receiver_applies_known_evidence_and_skips_what_it_does_not_know() -> None:
    recv, applied, _ = receiver()
    body = batch(evidence=[["p1", "connection", None], ["p1", None, "decode_terminal"], ["p1", "from_the_future"],
                           ["p1", None, None]])
    status, answer = recv.handle(body, authorization="Bearer s3cret", peer_cert=False)
    assert status == 200 and msgspec.json.decode(answer, type=EvidenceReply).applied == 2
    assert applied == [("p1", FailureClass.CONNECTION, None), ("p1", None, SuccessKind.DECODE_TERMINAL)]


def test_the_receiver_answers_bad_bodies_4xx_and_a_replica_409_naming_the_controller() -> None:
    recv, _, _ = receiver()
    assert recv.handle(b"[1, 2", authorization="Bearer s3cret", peer_cert=False)[0] == 400
    assert recv.handle(b'{"evidence": []}', authorization="Bearer s3cret", peer_cert=False)[0] == 400
    assert recv.handle(b" " * (4 * 1024 * 1024 + 1), authorization="Bearer s3cret", peer_cert=False)[0] == 413
    replica, applied, _ = receiver(ControllerRef(router_id="r9", cluster_url="http://10.0.0.9:8000"))
    status, body = replica.handle(batch(evidence=[["p1", "connection"]]), authorization="Bearer s3cret",
                                  peer_cert=False)
    assert status == 409 and applied == []
    answer = json.loads(body)
    assert answer["error"]["code"] == "not_controller" and answer["controller"]["router_id"] == "r9"


def test_placements_are_relayed_to_the_other_routers_by_cursor() -> None:
    recv, _, placed = receiver()
    auth = {"authorization": "Bearer s3cret", "peer_cert": False}
    first = json.loads(recv.handle(json.dumps({"router_id": "r2", "placements": [["p1", [1, 2]]]}).encode(),
                                   **auth)[1])
    assert first["placements"] == [] and placed == [[PlacedPrompt("p1", [1, 2])]]
    recv.placed_here([PlacedPrompt("p2", [7])])
    other = json.loads(recv.handle(json.dumps({"router_id": "r3"}).encode(), **auth)[1])
    assert other["placements"] == [["p1", [1, 2]], ["p2", [7]]]
    again = json.loads(recv.handle(json.dumps({"router_id": "r3", "cursor": other["cursor"]}).encode(), **auth)[1])
    assert again["placements"] == []
    mine = json.loads(recv.handle(json.dumps({"router_id": "r2", "cursor": first["cursor"]}).encode(), **auth)[1])
    assert mine["placements"] == [["p2", [7]]]  # not its own back


def test_the_relay_is_bounded_and_a_cursor_past_it_starts_over() -> None:
    relay = PlacementRelay(capacity=3)
    relay.add("a", [PlacedPrompt("p1", [n]) for n in range(5)])
    prompts, cursor = relay.since(0, exclude="b")
    assert [p.blocks for p in prompts] == [[2], [3], [4]] and cursor == 5
    assert relay.since(99, exclude="b")[0] == prompts  # another controller's cursor


# -- the link: a replica's sender ---------------------------------------------------------------

async def test_the_sender_posts_evidence_with_the_token_and_applies_relayed_placements() -> None:
    seen: list[httpx.Request] = []
    applied: list[list[PlacedPrompt]] = []
    reply = EvidenceReply(controller="r1", applied=1, placements=[PlacedPrompt("p2", [9])], cursor=4)

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, content=msgspec.json.encode(reply))

    sender = EvidenceSender(router_id="r2", controller=lambda: ControllerRef(router_id="r1",
                                                                             cluster_url="http://ctl:1"),
                            token="s3cret", apply_placements=applied.append,
                            client=httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    sender.report(EvidenceItem("p1", failure_class="connection"))
    sender.placed("p1", [1, 2])
    sender.placed("p1", [1, 2])  # the same prompt twice goes once
    assert await sender._send(ControllerRef(router_id="r1", cluster_url="http://ctl:1"))
    request = seen[0]
    assert str(request.url) == "http://ctl:1/cluster/evidence"
    assert request.headers["authorization"] == "Bearer s3cret"
    body = json.loads(request.content)
    assert body["evidence"] == [["p1", "connection", None]] and body["placements"] == [["p1", [1, 2]]]
    assert applied == [[PlacedPrompt("p2", [9])]] and sender.cursor == 4
    await sender.aclose()


async def test_the_sender_keeps_evidence_for_a_link_that_fails_within_its_bound() -> None:
    sender = EvidenceSender(router_id="r2", controller=lambda: None, token=None, apply_placements=None,
                            max_queue=2, client=httpx.AsyncClient(
                                transport=httpx.MockTransport(lambda request: httpx.Response(503))))
    for engine in ("a", "b", "c"):
        sender.report(EvidenceItem(engine, failure_class="timeout"))
    assert sender.dropped == 1
    assert not await sender._send(ControllerRef(router_id="r1", cluster_url="http://ctl:1"))
    assert [item.engine for item in sender._queue] == ["b", "c"] and sender.problem == "HTTP 503: "
    await sender.aclose()


# -- the controller's publisher ---------------------------------------------------------------

async def test_the_publisher_writes_what_changed_and_deletes_what_left_never_on_a_timer() -> None:
    current = [entry("p1"), entry("d1", role="decode")]
    writes: list[tuple[list[str], list[str]]] = []
    owned = [True]

    async def write(puts: Any, deletes: Any) -> bool:
        writes.append(([key for key, _ in puts], list(deletes)))
        return owned[0]

    async def names() -> list[str]:
        return ["p1", "gone"]

    publisher = FleetPublisher(prefix=PREFIX, entries=lambda: current, write=write, published_names=names,
                               acting=lambda: True, wall_clock=lambda: 1000.0)
    assert await publisher.publish_once()
    assert writes == [([PREFIX + "p1", PREFIX + "d1"], [PREFIX + "gone"])]
    assert await publisher.publish_once()
    assert len(writes) == 1  # nothing changed: nothing written
    current[0] = entry("p1", ejected=True)
    assert await publisher.publish_once()
    assert writes[-1] == ([PREFIX + "p1"], [])
    current.pop()
    owned[0] = False
    assert not await publisher.publish_once()  # the lease is not ours: the next term starts over
    assert writes[-1] == ([], [PREFIX + "d1"])


def test_a_record_rebuilt_a_moment_later_is_the_same_entry() -> None:
    hold = HoldRecord(kind=HoldKind.OPERATOR_DRAIN, reason="x", since_wall=1000.000001)
    one = msgspec.structs.replace(entry("p1"), record=EngineRecord(name="p1", role="prefill", holds=[hold]))
    later = msgspec.structs.replace(one, written_at=5.0, record=msgspec.structs.replace(
        one.record, holds=[msgspec.structs.replace(hold, since_wall=1000.000004)]))
    assert stable_entry(one) == stable_entry(later)


# -- config, admission, and the gates --------------------------------------------------------

@pytest.mark.parametrize(("lease", "problem"), [
    ('mode = "replicas"\nbackend = "file"\npath = "/tmp/x"', 'lease.mode = "replicas" needs lease.backend = "etcd"'),
    ('mode = "replicas"\nbackend = "etcd"\nendpoints = ["http://127.0.0.1:2379"]', "link authenticated"),
    ('mode = "active-active"', "mode"),
    ('replica_stale_s = 0', "replica_stale_s"),
])
def test_replicas_mode_needs_etcd_and_an_authenticated_link(lease: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        parse_config(f"[lease]\n{lease}\n{ENGINES}")


def test_replicas_mode_with_a_token_file_reads_one_token(tmp_path) -> None:
    config = parse_config('[lease]\nmode = "replicas"\nbackend = "etcd"\nendpoints = ["http://127.0.0.1:2379"]\n'
                          f'cluster_token_file = "token"\n{ENGINES}')
    (tmp_path / "token").write_text("abc\n")
    assert config.cluster_token(tmp_path) == "abc"
    (tmp_path / "token").write_text("two words\n")
    with pytest.raises(ConfigError, match="lease.cluster_token_file"):
        config.cluster_token(tmp_path)


def test_admission_refuses_past_the_view_deadline_saying_how_old_the_view_is() -> None:
    now = [10.0]
    admission = Admission(clock=lambda: now[0], view_reason=lambda t: f"replica: fleet view {int(t - 5)} s old")
    admission.view_deadline = 35.0
    assert admission.reason() is None
    now[0] = 36.0
    assert admission.reason() == "replica: fleet view 31 s old"
    admission.close("shutdown", "shutting down")
    assert admission.reason() == "shutting down"


def test_a_replicas_fleet_writer_decides_nothing_but_takes_the_controllers_records() -> None:
    deciding = [False]
    fleet = FleetWriter(Fleet([("p1", "prefill"), ("d1", "decode")], eject_after=1, liveness_misses=1,
                              failure_quarantine_s=None, probe_interval_s=1.0), RouterMetrics(),
                        decides=lambda: deciding[0])
    assert fleet.record_failure("p1", FailureClass.CONNECTION, 1.0) == []
    assert fleet.eject("p1", "no", 1.0) == []
    assert fleet.add_hold("p1", HoldKind.OPERATOR_DRAIN, "x", 1.0) == []
    assert fleet.is_eligible("p1", 1.0)
    fleet.restore([EngineRecord(name="p1", role="prefill", ejected=True)], 2.0, 1000.0)
    assert not fleet.is_eligible("p1", 2.0)
    fleet.readmit("p1", 3.0)
    assert not fleet.is_eligible("p1", 3.0)
    deciding[0] = True
    fleet.readmit("p1", 4.0)
    assert fleet.is_eligible("p1", 4.0)


async def test_a_replicas_monitor_runs_only_its_passive_stages() -> None:
    from narwhal.control.monitor import Monitor

    ran: list[str] = []

    class Stage:
        def __init__(self, name: str, after: tuple[str, ...] = ()) -> None:
            self.name = name
            self.after = after

        async def run(self, pass_number: int) -> None:
            ran.append(self.name)

    acting = [False]
    monitor = Monitor([Stage("health"), Stage("telemetry"), Stage("readmission")], interval_s=1.0,
                      stage_timeout_s=1.0, failure_limit=3, admission=Admission(), metrics=RouterMetrics(),
                      acting=lambda: acting[0])
    await monitor.run_pass()
    assert ran == ["telemetry"]
    acting[0] = True
    ran.clear()
    await monitor.run_pass()
    assert sorted(ran) == ["health", "readmission", "telemetry"]


async def test_the_publishers_loop_writes_when_poked_and_only_while_acting() -> None:
    writes: list[int] = []
    acting = [False]

    async def write(puts: Any, deletes: Any) -> bool:
        writes.append(len(puts))
        return True

    async def names() -> list[str]:
        return []

    publisher = FleetPublisher(prefix=PREFIX, entries=lambda: [entry("p1")], write=write, published_names=names,
                               acting=lambda: acting[0])
    async with trio.open_nursery() as nursery:
        await nursery.start(publisher.run)
        publisher.poke()
        await trio.testing.wait_all_tasks_blocked()
        assert writes == []
        acting[0] = True
        publisher.new_term()
        await trio.testing.wait_all_tasks_blocked()
        assert writes == [1]
        nursery.cancel_scope.cancel()


async def test_the_sender_keeps_a_batch_under_the_admin_listeners_body_bound() -> None:
    bodies: list[bytes] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(request.content)
        return httpx.Response(200, content=msgspec.json.encode(EvidenceReply(controller="r1")))

    sender = EvidenceSender(router_id="r2", controller=lambda: None, token=None, apply_placements=lambda p: None,
                            client=httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    for n in range(400):
        sender.placed("p1", [n * 1_000_003 + block for block in range(40)])
    ref = ControllerRef(router_id="r1", cluster_url="http://ctl:1")
    while sender._placed:
        assert await sender._send(ref)
    assert all(len(body) <= 60_000 for body in bodies) and len(bodies) > 1
    assert sum(len(json.loads(body)["placements"]) for body in bodies) == 400
    await sender.aclose()


def test_the_controller_publishes_its_decisions_not_its_evidence() -> None:
    from narwhal.cluster.records import decisions_of, with_decisions
    from narwhal.fleet.model import EngineCounters

    hold = HoldRecord(kind=HoldKind.OPERATOR_DRAIN, reason="x", since_wall=1.0)
    full = EngineRecord(name="p1", role="prefill", model="m", ejected=True, ejected_reason="dead",
                        holds=[hold], streaks={FailureClass.TIMEOUT: 2}, liveness_misses=1,
                        counters=EngineCounters(ejections=3))
    published = decisions_of(full)
    assert published.ejected and published.holds == [hold] and published.ejected_reason == "dead"
    assert published.streaks == {} and published.liveness_misses == 0 and published.counters == EngineCounters()
    # Another failure counted changes nothing published: no write, no watch event on every router.
    assert decisions_of(msgspec.structs.replace(full, streaks={FailureClass.TIMEOUT: 3})) == published
    mine = EngineRecord(name="p1", role="prefill", model="m", counters=EngineCounters(ejections=7))
    merged = with_decisions(mine, published)
    assert merged.ejected and merged.holds == [hold] and merged.counters.ejections == 7
