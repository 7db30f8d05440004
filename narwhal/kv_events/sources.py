"""Where each prefill engine publishes its KV events: its ``[[engines]]`` keys, else what its identity reports.

An engine's config (or its discovery registration, which becomes the same
``EngineSpec``) wins; an engine that says nothing there is subscribed to at
the endpoints its identity reports (the vLLM plugin gives vLLM's
``--kv-events-config`` as vLLM holds it, usually a bind address such as
``tcp://*:5557``, whose wildcard host is the engine's own). No I/O.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable, Iterable, Mapping

from narwhal.config import EngineSpec, zmq_endpoint_problem
from narwhal.kv_events.feed import FeedSource
from narwhal.wire import KvEventsIdentity

__all__ = ["KvPublishers", "connect_endpoint", "feed_sources"]

_WILDCARDS = ("*", "0.0.0.0", "::", "")


def connect_endpoint(endpoint: str, engine_host: str) -> str | None:
    """``endpoint`` as a subscriber on another host connects to it: a wildcard host becomes ``engine_host``.

    None for what no subscriber can reach (ipc://, inproc://, port 0, not an endpoint at all).
    """
    if not endpoint.startswith("tcp://"):
        return None
    rest = endpoint[len("tcp://"):]
    host, sep, port = rest.rpartition(":")
    if not sep:
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host in _WILDCARDS:
        host = engine_host
    shown = f"[{host}]" if ":" in host else host
    candidate = f"tcp://{shown}:{port}"
    return None if zmq_endpoint_problem(candidate) is not None else candidate


class KvPublishers:
    """Engine name -> the KV event endpoints its identity last reported (an engine that reported none is absent)."""

    def __init__(self, on_change: Callable[[], None] | None = None) -> None:
        self._by_engine: dict[str, KvEventsIdentity] = {}
        self.on_change = on_change

    def record(self, engine: str, reported: KvEventsIdentity | None) -> None:
        """What ``engine``'s identity said now (None: it publishes none, which replaces an older answer)."""
        before = self._by_engine.get(engine)
        if reported is None:
            self._by_engine.pop(engine, None)
        else:
            self._by_engine[engine] = reported
        if reported != before and self.on_change is not None:
            self.on_change()

    def forget(self, engine: str) -> None:
        """``engine`` left the fleet."""
        if self._by_engine.pop(engine, None) is not None and self.on_change is not None:
            self.on_change()

    def get(self, engine: str) -> KvEventsIdentity | None:
        return self._by_engine.get(engine)

    def reported(self) -> Mapping[str, KvEventsIdentity]:
        return self._by_engine


def feed_sources(specs: Iterable[EngineSpec], reported: Mapping[str, KvEventsIdentity]) -> dict[str, FeedSource]:
    """Each prefill engine's publisher: its config's, else its identity's (wildcard host resolved); none: absent."""
    sources: dict[str, FeedSource] = {}
    for spec in specs:
        if spec.role != "prefill":
            continue
        if spec.kv_events is not None:
            sources[spec.name] = FeedSource(publisher=spec.kv_events, replay=spec.kv_events_replay,
                                            topic=spec.kv_events_topic)
            continue
        identity = reported.get(spec.name)
        if identity is None:
            continue
        host = urllib.parse.urlsplit(spec.url).hostname or ""
        publisher = connect_endpoint(identity.endpoint, host)
        if publisher is None:
            continue
        replay = connect_endpoint(identity.replay_endpoint, host) if identity.replay_endpoint else None
        topic = spec.kv_events_topic if spec.kv_events_topic is not None else (identity.topic or None)
        sources[spec.name] = FeedSource(publisher=publisher, replay=replay, topic=topic)
    return sources
