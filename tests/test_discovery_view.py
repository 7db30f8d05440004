"""Discovery's pure parts: a registration value checked as [[engines]] is, and the view as a function of the keys."""

from __future__ import annotations

import json
import logging

import pytest

from narwhal.config import EngineSpec
from narwhal.discovery.entry import (
    MAX_VALUE_BYTES,
    EngineRegistration,
    EntryProblem,
    encode_registration,
    parse_entry,
)
from narwhal.discovery.etcd_http import prefix_end
from narwhal.discovery.etcd_watch import ViewUpdate, WatchStatus
from narwhal.discovery.events import log_update
from narwhal.discovery.view import EngineView, KeyEvent, StoredKey, ViewChange, diff_views

P = "/narwhal/engines/"


def value(url: str = "http://10.0.0.1:8000", role: str = "decode", **extra: object) -> bytes:
    return json.dumps({"url": url, "role": role, **extra}).encode()


def test_a_registration_becomes_an_engine_named_after_the_keys_last_segment() -> None:
    assert parse_entry(P + "d1", value(model="m"), P) == EngineSpec(name="d1", url="http://10.0.0.1:8000",
                                                                     role="decode", model="m")
    # No model: the router's default; a field a newer registrar adds is ignored.
    assert parse_entry(P + "p1", value(role="prefill", zone="a"), P) == EngineSpec(
        name="p1", url="http://10.0.0.1:8000", role="prefill")


def test_encode_round_trips_and_leaves_out_an_absent_model() -> None:
    assert json.loads(encode_registration(EngineRegistration(url="http://h:1", role="decode"))) == {
        "url": "http://h:1", "role": "decode"}
    encoded = encode_registration(EngineRegistration(url="http://h:1", role="prefill", model="m"))
    assert parse_entry(P + "x", encoded, P) == EngineSpec(name="x", url="http://h:1", role="prefill", model="m")


@pytest.mark.parametrize(("key", "raw", "problem"), [
    (P + "d1", b"{not json", "malformed"),
    (P + "d1", b"[1, 2]", "Expected `object`"),
    (P + "d1", value(role="both"), "Invalid enum value 'both'"),
    (P + "d1", value(url="10.0.0.1:8000"), "url must be http://HOST[:PORT]"),
    (P + "d1", value(url="http://h:8000/v1"), "url must have no path"),
    (P + "d1", value(url="http://h:99999"), "bad port"),
    (P + "d1", value(model=""), "model must not be empty"),
    (P + "d1", b'{"role": "decode"}', "missing required field `url`"),
    (P, value(), "no engine name"),
    (P + "zone-a/d1", value(), "one segment"),
    (P + "d1", b" " * (MAX_VALUE_BYTES + 1), "over 65536"),
])
def test_a_bad_key_or_value_is_a_problem_naming_the_key_never_an_exception(key: str, raw: bytes,
                                                                           problem: str) -> None:
    parsed = parse_entry(key, raw, P)
    assert isinstance(parsed, EntryProblem)
    assert parsed.key == key and problem in parsed.problem


def test_a_key_that_is_not_utf8_is_a_problem_that_can_be_logged() -> None:
    key = (P.encode() + b"d\xff").decode(errors="surrogateescape")  # as the watcher reads it
    parsed = parse_entry(key, value(), P)
    assert parsed == EntryProblem(key=P + "d\\xff", problem="key is not UTF-8")
    json.dumps(parsed.key)  # printable in a log line


def test_prefix_end_covers_exactly_the_prefix() -> None:
    assert prefix_end("/narwhal/engines/") == b"/narwhal/engines0"
    assert prefix_end("é") == b"\xc3\xaa"  # byte-wise, on the UTF-8 key
    assert prefix_end("") == b"\0"


def spec(name: str, url: str = "http://10.0.0.1:8000", role: str = "decode") -> EngineSpec:
    return EngineSpec(name=name, url=url, role=role)  # type: ignore[arg-type]


def test_diff_views_names_additions_removals_and_changes() -> None:
    old = {"a": spec("a"), "b": spec("b"), "c": spec("c")}
    new = {"b": spec("b"), "c": spec("c", url="http://10.0.0.2:8000"), "d": spec("d")}
    assert diff_views(old, new) == ViewChange(added=("d",), removed=("a",), changed=("c",),
                                              previous={"a": spec("a"), "c": spec("c")})
    assert not diff_views(new, dict(new))


def test_events_move_the_view_and_say_what_changed() -> None:
    view = EngineView(P)
    first = view.reset([StoredKey(P + "a", value(), 3)], revision=5)
    assert first == ViewChange(added=("a",)) and view.revision == 5
    change = view.apply([KeyEvent("put", P + "b", 6, value(role="prefill")),
                         KeyEvent("put", P + "a", 7, value(url="http://10.0.0.9:8000")),
                         KeyEvent("delete", P + "b", 8)])
    assert change == ViewChange(changed=("a",), previous={"a": spec("a")}) and view.revision == 8
    assert view.engines == {"a": spec("a", url="http://10.0.0.9:8000")}
    assert view.apply([KeyEvent("delete", P + "a", 9)]).removed == ("a",)
    assert view.engines == {}


def test_events_at_or_below_the_views_revision_were_applied_already() -> None:
    # A watch resumed from the last revision may repeat the last one; a relist moved past them.
    view = EngineView(P)
    view.reset([StoredKey(P + "a", value(), 4)], revision=10)
    assert not view.apply([KeyEvent("delete", P + "a", 9), KeyEvent("put", P + "z", 10, value())])
    assert set(view.engines) == {"a"}
    # Two puts of one txn share its revision: both apply.
    change = view.apply([KeyEvent("put", P + "b", 11, value()), KeyEvent("put", P + "c", 11, value())])
    assert change.added == ("b", "c")


def test_an_invalid_value_registers_nothing_and_is_reported_once_per_value() -> None:
    view = EngineView(P)
    view.reset([StoredKey(P + "a", value(), 2)], revision=2)
    change = view.apply([KeyEvent("put", P + "a", 3, b"garbage")])
    # The key no longer names an engine: a router started now would not have it either.
    assert change.removed == ("a",) and [p.key for p in change.problems] == [P + "a"]
    # A relist that finds the same bad value does not report it again; a new bad value is reported.
    assert not view.reset([StoredKey(P + "a", b"garbage", 3)], revision=4)
    again = view.reset([StoredKey(P + "a", b"still garbage", 5)], revision=5)
    assert len(again.problems) == 1 and not again.engines_changed
    # Fixed: the engine is back, and a later breakage is news again.
    assert view.apply([KeyEvent("put", P + "a", 6, value())]) == ViewChange(added=("a",))
    assert len(view.apply([KeyEvent("put", P + "a", 7, b"garbage")]).problems) == 1


def test_a_relist_applies_the_difference_so_nothing_missed_survives() -> None:
    # Events lost to compaction: a deleted key, a changed one, a new one. The relist shows all three.
    view = EngineView(P)
    view.reset([StoredKey(P + "gone", value(), 2), StoredKey(P + "moved", value(), 3),
                StoredKey(P + "same", value(), 4)], revision=4)
    change = view.reset([StoredKey(P + "moved", value(url="http://10.0.0.7:8000"), 9),
                         StoredKey(P + "same", value(), 4), StoredKey(P + "new", value(role="prefill"), 11)],
                        revision=12)
    assert (change.added, change.removed, change.changed) == (("new",), ("gone",), ("moved",))
    assert change.previous["moved"].url == "http://10.0.0.1:8000" and set(change.previous) == {"gone", "moved"}
    assert view.revision == 12 and set(view.engines) == {"moved", "same", "new"}


def test_the_view_handed_out_is_a_copy() -> None:
    view = EngineView(P)
    view.reset([StoredKey(P + "a", value(), 1)], revision=1)
    engines = view.engines
    view.apply([KeyEvent("delete", P + "a", 2)])
    assert set(engines) == {"a"}


def _events(caplog: pytest.LogCaptureFixture) -> list[dict[str, object]]:
    return [json.loads(record.getMessage()) for record in caplog.records if record.name == "narwhal.events"]


def test_log_update_writes_the_issues_lines(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.events")
    view = EngineView(P)
    view.reset([StoredKey(P + "a", value(), 1), StoredKey(P + "b", value(model="m2"), 1)], revision=1)
    change = view.apply([KeyEvent("delete", P + "a", 2), KeyEvent("put", P + "b", 3, value(url="http://10.0.0.5:1")),
                         KeyEvent("put", P + "c", 4, value(role="prefill")), KeyEvent("put", P + "x", 5, b"{")])
    update = ViewUpdate(reason="events", engines=view.engines, change=change, status=WatchStatus())
    log_update(update, source="etcd", default_model="fleet-model")
    lines = [{k: v for k, v in line.items() if k not in ("ts", "level")} for line in _events(caplog)]
    assert lines == [
        {"event": "engine_vanished", "engine": "a", "url": "http://10.0.0.1:8000", "role": "decode",
         "model": "fleet-model", "source": "etcd"},
        {"event": "engine_vanished", "engine": "b", "url": "http://10.0.0.1:8000", "role": "decode",
         "model": "m2", "source": "etcd"},
        {"event": "engine_discovered", "engine": "c", "url": "http://10.0.0.1:8000", "role": "prefill",
         "model": "fleet-model", "source": "etcd"},
        {"event": "engine_discovered", "engine": "b", "url": "http://10.0.0.5:1", "role": "decode",
         "model": "fleet-model", "source": "etcd"},
        {"event": "discovery_entry_invalid", "source": "etcd", "key": P + "x",
         "problem": lines[-1]["problem"]},
    ]
    caplog.clear()
    down = WatchStatus(degraded="etcd unreachable: http://e:2379: ConnectError")
    log_update(ViewUpdate(reason="degraded", engines={}, change=ViewChange(), status=down), source="etcd",
               default_model="m")
    log_update(ViewUpdate(reason="recovered", engines={}, change=ViewChange(), status=WatchStatus()),
               source="etcd", default_model="m")
    assert [(line["event"], line.get("error")) for line in _events(caplog)] == [
        ("discovery_degraded", "etcd unreachable: http://e:2379: ConnectError"), ("discovery_recovered", None)]
