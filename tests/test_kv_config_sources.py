"""KV event config keys, where each engine's publisher comes from, and a publisher change that is not a new engine."""

from __future__ import annotations

import msgspec
import pytest

from narwhal.config import ConfigError, parse_config
from narwhal.fleet.registry import EngineRegistry, entries_from_config
from narwhal.kv_events.feed import FeedSource
from narwhal.kv_events.sources import KvPublishers, connect_endpoint, feed_sources
from narwhal.wire import KvEventsIdentity

ENGINES = """
[[engines]]
name = "p1"
url = "http://10.0.0.1:8000"
role = "prefill"
kv_events = "tcp://10.0.0.1:5557"
kv_events_replay = "tcp://10.0.0.1:5558"
kv_events_topic = "kv"
[[engines]]
name = "p2"
url = "http://10.0.0.2:8000"
role = "prefill"
[[engines]]
name = "d1"
url = "http://10.0.0.3:8000"
role = "decode"
"""


def test_engine_kv_event_keys_parse_and_placement_kv_events_defaults_to_auto() -> None:
    config = parse_config(ENGINES)
    assert config.placement.kv_events == "auto"
    p1 = config.engines[0]
    assert (p1.kv_events, p1.kv_events_replay, p1.kv_events_topic) == (
        "tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558", "kv")
    assert parse_config('[placement]\nkv_events = "required"\n' + ENGINES).placement.kv_events == "required"


@pytest.mark.parametrize(("text", "message"), [
    ('[placement]\nkv_events = "sometimes"\n' + ENGINES, "placement.kv_events"),
    (ENGINES.replace('"tcp://10.0.0.1:5557"', '"http://10.0.0.1:5557"'), "kv_events must be tcp://HOST:PORT"),
    (ENGINES.replace('"tcp://10.0.0.1:5557"', '"tcp://*:5557"'), "kv_events names no host to connect to"),
    (ENGINES.replace('"tcp://10.0.0.1:5558"', '"tcp://10.0.0.1:0"'), "kv_events_replay must be tcp://HOST:PORT"),
    (ENGINES.replace('kv_events = "tcp://10.0.0.1:5557"\n', ""), "kv_events_replay needs kv_events"),
    (ENGINES.replace('role = "decode"', 'role = "decode"\nkv_events = "tcp://10.0.0.3:5557"'),
     "kv_events is for prefill engines"),
])
def test_a_bad_kv_events_key_is_refused_naming_it(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(text)
    assert message in str(caught.value)


@pytest.mark.parametrize(("endpoint", "host", "expected"), [
    ("tcp://*:5557", "10.0.0.9", "tcp://10.0.0.9:5557"),
    ("tcp://0.0.0.0:5557", "engine.internal", "tcp://engine.internal:5557"),
    ("tcp://[::]:5557", "10.0.0.9", "tcp://10.0.0.9:5557"),
    ("tcp://*:5557", "::1", "tcp://[::1]:5557"),
    ("tcp://10.1.1.1:6000", "10.0.0.9", "tcp://10.1.1.1:6000"),
    ("tcp://*:0", "10.0.0.9", None),
    ("ipc:///tmp/kv", "10.0.0.9", None),
    ("inproc://cache", "10.0.0.9", None),
    ("nonsense", "10.0.0.9", None),
])
def test_a_reported_endpoint_becomes_one_a_subscriber_connects_to(endpoint: str, host: str,
                                                                   expected: str | None) -> None:
    assert connect_endpoint(endpoint, host) == expected


def test_config_wins_then_identity_and_decode_engines_have_none() -> None:
    config = parse_config(ENGINES)
    reported = {"p1": KvEventsIdentity(endpoint="tcp://*:9999"),
                "p2": KvEventsIdentity(endpoint="tcp://*:5557", replay_endpoint="tcp://*:5558", topic="t"),
                "d1": KvEventsIdentity(endpoint="tcp://*:5557")}
    assert feed_sources(config.engines, reported) == {
        "p1": FeedSource(publisher="tcp://10.0.0.1:5557", replay="tcp://10.0.0.1:5558", topic="kv"),
        "p2": FeedSource(publisher="tcp://10.0.0.2:5557", replay="tcp://10.0.0.2:5558", topic="t"),
    }
    # An engine that reports nothing (or nothing reachable) has no feed.
    assert "p2" not in feed_sources(config.engines, {"p2": KvEventsIdentity(endpoint="ipc:///x")})
    assert feed_sources(config.engines, {}) == {"p1": FeedSource(publisher="tcp://10.0.0.1:5557",
                                                                 replay="tcp://10.0.0.1:5558", topic="kv")}


def test_publishers_tell_of_a_change_only() -> None:
    changes: list[int] = []
    publishers = KvPublishers(on_change=lambda: changes.append(1))
    reported = KvEventsIdentity(endpoint="tcp://*:5557")
    publishers.record("p1", reported)
    publishers.record("p1", KvEventsIdentity(endpoint="tcp://*:5557"))
    assert len(changes) == 1
    publishers.record("p1", None)
    publishers.forget("p1")
    assert len(changes) == 2
    assert publishers.get("p1") is None


def test_a_new_publisher_is_the_same_engine_not_a_removal_and_an_addition() -> None:
    config = parse_config(ENGINES)
    registry = EngineRegistry(entries_from_config(config), grace_s=5.0)
    registry.drain_events()
    moved = parse_config(ENGINES.replace("tcp://10.0.0.1:5557", "tcp://10.0.0.1:6000"))
    diff = registry.apply(entries_from_config(moved), now=0.0)
    assert (diff.added, diff.removed, diff.changed) == ([], [], [])
    assert registry.drain_events() == []
    assert registry.specs["p1"].kv_events == "tcp://10.0.0.1:6000"
    # Another url still is another engine.
    elsewhere = parse_config(ENGINES.replace("http://10.0.0.1:8000", "http://10.0.0.7:8000"))
    assert registry.apply(entries_from_config(elsewhere), now=1.0).changed == ["p1"]


def test_an_identity_whose_kv_events_cannot_be_read_still_identifies_the_engine() -> None:
    from narwhal.control.contract import read_identity

    base = {"engine_id": "p1", "model": "m", "generation": "g", "process_started_at": 1.0, "kv_roles": ["kv_producer"]}
    good = read_identity(msgspec.json.encode({**base, "kv_events": {"endpoint": "tcp://*:5557", "topic": "kv"}}))
    assert good.kv_events == KvEventsIdentity(endpoint="tcp://*:5557", topic="kv")
    assert read_identity(msgspec.json.encode(base)).kv_events is None
    odd = read_identity(msgspec.json.encode({**base, "kv_events": {"endpoint": 5557}}))
    assert (odd.engine_id, odd.kv_events) == ("p1", None)
