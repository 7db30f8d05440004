"""Stream continuation against stock vLLM: a greedy answer survives its decode engine's SIGKILL unchanged."""

from __future__ import annotations

import dataclasses
import json
import signal
from typing import Any

import pytest
import trio

from tests.real_vllm.conftest import AUTH, Narwhal
from tests.real_vllm.fleet import MODEL_NAME, Engine

pytestmark = pytest.mark.real_vllm

BOUNDED = {"serving": {"policy": "bounded", "max_attempts": 3, "continue_streams": True}}
PROMPT = "A long answer about whales"
# Long enough to be cut mid-stream (max-model-len is 2048): a busy vLLM may generate a few hundred tokens before its
# API server writes the first one.
MAX_TOKENS = 1500


# A stop string this model never writes: vLLM then holds back its length less one characters of the streamed
# text, which a join must not lose.
NEVER = "@@@@@@@@"


@dataclasses.dataclass(frozen=True)
class Case:
    route: str
    # A stop string (that never comes) in the request.
    stop: bool = False
    # None: no max_tokens (a chat answer then runs to the end of the context, also after the join).
    max_tokens: int | None = MAX_TOKENS
    # "group": SIGKILL the whole engine; "engine_core": only its EngineCore process (the API server lives on).
    kill: str = "group"


def body(case: Case) -> dict[str, Any]:
    # Greedy, a fixed length, token IDs asked for by the client so they can be compared one for one.
    payload: dict[str, Any] = {"model": MODEL_NAME, "temperature": 0, "ignore_eos": True,
                               "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    if case.max_tokens is not None:
        payload["max_tokens"] = case.max_tokens
    if case.stop:
        payload["stop"] = [NEVER]
    if case.route == "/v1/chat/completions":
        payload["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        payload["prompt"] = PROMPT
    return payload


async def admin(narwhal: Narwhal, engine: str, action: str) -> None:
    response = await narwhal.client.post(f"{narwhal.url}/admin/engines/{engine}/{action}", headers=AUTH)
    assert response.status_code == 200, response.text


async def answer(narwhal: Narwhal, case: Case, victim: Engine | None = None) -> tuple[list[Any], int]:
    """The stream's events and how many tokens the client had when ``victim`` (its decode engine) was killed.

    With a victim, the other decode engines are drained first, so the stream has to start on the victim; once the
    client has received part of the answer the victim is killed and they are readmitted (somewhere to continue)."""
    others = [e.name for e in narwhal.fleet.of_role("decode") if victim is not None and e is not victim]
    for name in others:
        await admin(narwhal, name, "drain")
    events: list[Any] = []
    tokens = 0
    killed_at = -1
    async with narwhal.client.stream("POST", f"{narwhal.url}{case.route}", json=body(case),
                                     timeout=300) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            payload = line[6:]
            events.append("[DONE]" if payload == "[DONE]" else json.loads(payload))
            if payload == "[DONE]":
                continue
            choices = events[-1].get("choices") or []
            tokens += sum(len(ch.get("token_ids") or []) for ch in choices)
            # Wherever the engine is when it dies (this random model writes many characters split over byte
            # tokens, so often inside one): the join goes back to a whole character.
            if victim is not None and killed_at < 0 and tokens >= 5:
                # At once: vLLM runs well ahead of what a client has read (1500 tokens of this model take about
                # 3 s), so any admin round trip first would let the engine finish before it dies. The drained
                # engines are readmitted right after; meanwhile the continuation waits for a decode engine.
                if case.kill == "engine_core":
                    assert victim.kill_engine_core() >= 1, "no EngineCore process found"
                else:
                    victim.signal_group(signal.SIGKILL)
                killed_at = tokens
                for name in others:
                    await admin(narwhal, name, "readmit")
    return events, killed_at


def parts(events: list[Any], chat: bool) -> tuple[str, list[int], Any]:
    """The answer's text, token IDs and usage, after checking it is one well-formed stream."""
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = events[:-1]
    assert all("error" not in c for c in chunks), chunks[-1]
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    text = "".join((ch["delta"].get("content") or "") if chat else ch["text"] for c in chunks for ch in c["choices"])
    ids = [i for c in chunks for ch in c["choices"] for i in ch.get("token_ids") or []]
    assert len([ch for c in chunks for ch in c["choices"] if ch.get("finish_reason")]) == 1
    usage = [c["usage"] for c in chunks if c.get("usage")]
    assert len(usage) == 1
    return text, ids, usage[0]


@pytest.mark.parametrize("case", [
    Case("/v1/completions"), Case("/v1/chat/completions"), Case("/v1/completions", stop=True),
    # Without a limit a chat answer continues as chat, from its text: vLLM 0.32 turns a completion's missing or null
    # max_tokens into 16 (seen here), and the router does not know the engine's context length.
    Case("/v1/chat/completions", max_tokens=None),
    # vLLM's API server outlives its engine core: it ends the stream with an error event (or closes it).
    Case("/v1/completions", kill="engine_core"),
], ids=["completions", "chat", "stop-string", "chat-without-max-tokens", "engine-core-killed"])
async def test_a_greedy_stream_whose_decode_engine_is_killed_halfway_equals_the_uninterrupted_one(
        start_narwhal, case) -> None:
    narwhal = await start_narwhal(**BOUNDED)
    route = case.route
    chat = route == "/v1/chat/completions"
    reference, _ = await answer(narwhal, case)
    ref_text, ref_ids, ref_usage = parts(reference, chat)
    # Without max_tokens: to the end of the context (max-model-len 2048, less the prompt).
    assert len(ref_ids) == MAX_TOKENS if case.max_tokens else len(ref_ids) > MAX_TOKENS
    # Real vLLM's chunked SSE stream went through the process's relay pump (on by default), not the task's loop.
    assert await narwhal.process.wait_event("request", timeout_s=10, relay="pump"), narwhal.process.events("request")

    victim = narwhal.fleet.of_role("decode")[0]
    try:
        for attempt in range(1, 4):
            interrupted, killed_at = await answer(narwhal, case, victim)
            sizes = [sum(len(ch.get("token_ids") or []) for ch in c["choices"]) for c in interrupted[:-1]][:6]
            print(f"\nREAL-VLLM continuation {route}: killed {victim.name} ({case.kill}) after {killed_at} of "
                  f"{len(ref_ids)} tokens (tokens in the first events: {sizes})")
            assert 0 < killed_at < len(ref_ids)
            line = await narwhal.process.wait_event("request", timeout_s=10, continuations=1)
            if line:
                break
            # vLLM runs far ahead of its reader on a loaded machine: if it had sent the whole answer before the
            # SIGKILL landed, nothing failed and there is nothing to continue. Only then, and only with the answer
            # whole, try again with the engine back.
            assert parts(interrupted, chat) == (ref_text, ref_ids, ref_usage), narwhal.process.events("request")[-1]
            assert not narwhal.process.events("request_retry"), narwhal.process.events("request_retry")
            print(f"REAL-VLLM continuation {route}: the answer was whole before the kill (attempt {attempt}): "
                  f"{narwhal.process.events('request')[-1]}")
            await trio.to_thread.run_sync(narwhal.fleet.restart, victim.name)
            await narwhal.wait_engine(victim.name, lambda e: e["eligible"], what="eligible after its restart")
            await narwhal.wait_none_ejected(after=f"continuation test, {victim.name} restarted")
        assert line, (narwhal.process.events("request")[-1], narwhal.process.events("stream_not_continued"),
                      narwhal.process.events("request_retry"), interrupted[-3:])
        print(f"REAL-VLLM continuation {route}: request event {line[0]}; engine failures "
              f"{narwhal.process.events('engine_failure')}")
        text, ids, usage = parts(interrupted, chat)
        if case.max_tokens is None:
            # A text join: the new engine retokenizes the text so far, so this random model's answer goes on
            # differently; what counts is that it went on to the end of the context, not 16 tokens past the join.
            # (When vLLM had nearly finished before the kill, the text so far can re-tokenize past the context: the
            # engine refuses the continuation and the router ends the answer as `length` there, no error event.)
            assert usage["completion_tokens"] > MAX_TOKENS and len(ids) == usage["completion_tokens"], usage
            assert text.startswith(ref_text[:8])
            return
        # Token for token: the continuation resumed at the exact token (a token-ID prompt).
        assert ids == ref_ids
        # Character for character: no echo of the prompt, nothing held back lost (docs/architecture.md, "Where an
        # exact join resumes").
        assert text == ref_text, (text, ref_text)
        assert usage == ref_usage
        assert line[0]["decode"] != victim.name and line[0]["tokens"] == len(ref_ids)
    finally:
        # Leave the fleet healthy for the next test.
        await trio.to_thread.run_sync(narwhal.fleet.restart, victim.name)
