"""Pods as engines, with no I/O: the parts of the API's JSON the watcher reads, and which Pods are engines.

A Pod is an engine, named after the Pod, at ``http://POD_IP:PORT``, only
while Running, Ready, not being deleted and with an IP. ``compose_engines``
makes the view from every selector's Pods; a Pod two selectors select is no
engine. Everything else of the API's objects is ignored, so newer fields
never break a watch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Literal

import msgspec

from narwhal.config import EngineSpec
from narwhal.discovery.entry import EntryProblem

__all__ = ["ApiStatus", "Pod", "PodList", "PodState", "Role", "WatchEvent", "compose_engines", "decode_api_status",
           "decode_pod", "decode_pod_list", "decode_watch_event", "newest_resource_version", "pod_engine"]


class _Meta(msgspec.Struct):
    name: str = ""
    resourceVersion: str = ""  # the API's spelling
    labels: dict[str, str] | None = None
    deletionTimestamp: str | None = None


class _Port(msgspec.Struct):
    containerPort: int = 0
    name: str | None = None


class _Container(msgspec.Struct):
    ports: list[_Port] | None = None


class _PodSpec(msgspec.Struct):
    containers: list[_Container] | None = None


class _Condition(msgspec.Struct):
    type: str = ""
    status: str = ""


class _PodStatus(msgspec.Struct):
    phase: str = ""
    podIP: str | None = None
    conditions: list[_Condition] | None = None


class Pod(msgspec.Struct):
    """The parts of a Pod the watcher reads; the API's other fields are ignored."""

    metadata: _Meta = msgspec.field(default_factory=_Meta)
    spec: _PodSpec = msgspec.field(default_factory=_PodSpec)
    status: _PodStatus = msgspec.field(default_factory=_PodStatus)


class _ListMeta(msgspec.Struct):
    resourceVersion: str = ""
    continue_: str | None = msgspec.field(default=None, name="continue")


class PodList(msgspec.Struct):
    """One page of a list: its Pods, the snapshot's resourceVersion, and the token of the next page, if any."""

    metadata: _ListMeta = msgspec.field(default_factory=_ListMeta)
    items: list[Pod] | None = None


class ApiStatus(msgspec.Struct):
    """The API's answer to a failure (an HTTP error's body, an ERROR event's object): code 410 means Gone."""

    code: int = 0
    reason: str = ""
    message: str = ""


class WatchEvent(msgspec.Struct):
    """One line of a watch: ADDED / MODIFIED / DELETED / BOOKMARK (a Pod) or ERROR (an ApiStatus)."""

    type: str
    object: msgspec.Raw


decode_pod_list = msgspec.json.Decoder(PodList)
decode_watch_event = msgspec.json.Decoder(WatchEvent)
decode_pod = msgspec.json.Decoder(Pod)
decode_api_status = msgspec.json.Decoder(ApiStatus)

Role = Literal["prefill", "decode"]
PodState = EngineSpec | EntryProblem | None  # an engine, a Pod that should be one and cannot, or not (yet) one


def pod_engine(pod: Pod, *, role: Role, namespace: str, port: int | str, model_label: str | None,
               default_model: str | None) -> PodState:
    """The engine ``pod`` is: only while Running, Ready, not being deleted, with an IP; else None."""
    meta, status = pod.metadata, pod.status
    if meta.deletionTimestamp or status.phase != "Running" or not status.podIP:
        return None  # a terminating Pod stops taking new work at once, as Endpoints drop it
    if not any(c.type == "Ready" and c.status == "True" for c in status.conditions or ()):
        return None
    key = f"{namespace}/{meta.name}"
    number = port if isinstance(port, int) else _named_port(pod, port)
    if number is None:
        return EntryProblem(key=key, problem=f"no container port named {port!r}")
    model = (meta.labels or {}).get(model_label) if model_label else None
    host = f"[{status.podIP}]" if ":" in status.podIP else status.podIP
    try:
        return EngineSpec(name=meta.name, url=f"http://{host}:{number}", role=role, model=model or default_model)
    except ValueError as exc:
        return EntryProblem(key=key, problem=str(exc))


def _named_port(pod: Pod, name: str) -> int | None:
    for container in pod.spec.containers or ():
        for port in container.ports or ():
            if port.name == name and port.containerPort:
                return port.containerPort
    return None


def compose_engines(pods: Mapping[str, Mapping[str, PodState]],
                    namespace: str) -> tuple[dict[str, EngineSpec], dict[str, str]]:
    """The engines from each role's Pods ({role: {pod: state}}), and {key: problem} for the Pods that are none."""
    engines: dict[str, EngineSpec] = {}
    problems: dict[str, str] = {}
    counts: dict[str, int] = {}
    for states in pods.values():
        for name in states:
            counts[name] = counts.get(name, 0) + 1
    for states in pods.values():
        for name, state in states.items():
            if counts[name] > 1:
                problems[f"{namespace}/{name}"] = "selected by both prefill_selector and decode_selector"
            elif isinstance(state, EngineSpec):
                engines[name] = state
            elif isinstance(state, EntryProblem):
                problems[state.key] = state.problem
    return engines, problems


def newest_resource_version(versions: Iterable[str]) -> str:
    """The newest resourceVersion, for display only (resuming uses each selector's own, opaque as the API says).

    They are integers in practice (etcd revisions): compared as such, else none is called newest.
    """
    known = [version for version in versions if version]
    if known and all(version.isdigit() for version in known):
        return max(known, key=int)
    return ""
