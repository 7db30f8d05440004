"""Real vLLM engines that die, freeze or are restarted for maintenance, behind Narwhal, with the plugin in them."""

from __future__ import annotations

import signal
import time
from typing import Any

import openai
import pytest
import trio

from tests.real_vllm.conftest import AUTH, Narwhal
from tests.real_vllm.fleet import MODEL_NAME, TIER_NOTES, Engine

pytestmark = pytest.mark.real_vllm

# Long enough to be cut mid-stream: on a busy machine vLLM may generate a few hundred tokens of this model before
# its API server writes the first one, and the whole answer then arrives at once.
LONG = {"model": MODEL_NAME, "prompt": "A long answer about whales", "max_tokens": 1800, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True}, "extra_body": {"ignore_eos": True}}


class StreamWatch:
    """A long stream read in a worker thread: when its first token arrived, and how it ended.

    ``first_signal``: what the stream's engine is sent as its first token is read, at once from the reading thread
    (a hop to the test's event loop first let a busy machine's vLLM finish all 1,800 tokens before the signal
    landed, and the stream then ended whole).
    """

    def __init__(self, first_signal: int | None = None) -> None:
        self.first_signal = first_signal
        self.victim: Engine | None = None
        self.first = trio.Event()
        self.ended = trio.Event()
        self.chunks = 0
        # The usage chunk's count: how many deltas carried the tokens is vLLM's choice (a busy one coalesces).
        self.completion_tokens = 0
        self.error: openai.APIError | None = None
        self.other: BaseException | None = None
        self.finished = False
        self.first_after_s = 0.0

    def read(self, narwhal: Narwhal, token: trio.lowlevel.TrioToken) -> None:
        started = time.monotonic()
        try:
            with narwhal.openai.completions.create(**LONG) as stream:
                for chunk in stream:
                    self.chunks += 1
                    if chunk.usage is not None:
                        self.completion_tokens = chunk.usage.completion_tokens
                    if self.chunks == 1:
                        self.first_after_s = time.monotonic() - started
                        if self.first_signal is not None and self.victim is not None:
                            self.victim.signal_group(self.first_signal)
                        trio.from_thread.run_sync(self.first.set, trio_token=token)
            self.finished = True
        except openai.APIError as exc:
            self.error = exc
        except BaseException as exc:  # reported by the test, not lost in the thread
            self.other = exc
        finally:
            trio.from_thread.run_sync(self.first.set, trio_token=token)
            trio.from_thread.run_sync(self.ended.set, trio_token=token)

    async def start(self, narwhal: Narwhal, nursery: trio.Nursery) -> Engine:
        """Start the stream on the first decode engine (the others drained, so placement has no choice: a 400-token
        stream can end in a second on an idle machine, before anyone could find where it went); once its first
        token has arrived (and the engine was sent ``first_signal``), that engine."""
        victim, *others = narwhal.fleet.of_role("decode")
        self.victim = victim
        for other in others:
            response = await narwhal.client.post(f"{narwhal.url}/admin/engines/{other.name}/drain", headers=AUTH)
            assert response.status_code == 200, response.text
        nursery.start_soon(narwhal.call, self.read, narwhal, trio.lowlevel.current_trio_token())
        with trio.fail_after(120):
            await self.first.wait()
        return victim

    async def end(self, timeout_s: float) -> None:
        """Wait for the stream to end, by an error event or [DONE]; anything else fails the test."""
        with trio.fail_after(timeout_s):
            await self.ended.wait()
        assert self.other is None, repr(self.other)


async def readmit_drained(narwhal: Narwhal, victim: Engine) -> None:
    """The operator's readmission of the decode engines ``StreamWatch.start`` drained."""
    for engine in narwhal.fleet.of_role("decode"):
        if engine is not victim:
            response = await narwhal.client.post(f"{narwhal.url}/admin/engines/{engine.name}/readmit", headers=AUTH)
            assert response.status_code == 200, response.text


def readmitted_by_itself(state: dict[str, Any]) -> bool:
    last = state["last_readmission"]
    return state["eligible"] and last is not None and last["outcome"] == "readmitted" and not last["operator"]


# Tries at cutting a stream: one is enough unless the machine is so busy that vLLM wrote the whole answer before its
# first token reached the client (nothing was left to cut; the engine is then restarted and the stream started again).
CUT_ATTEMPTS = 3


async def killed_mid_stream(narwhal: Narwhal, nursery: trio.Nursery) -> tuple[StreamWatch, Engine]:
    """A stream whose decode engine was SIGKILLed after its first token and before its last."""
    for attempt in range(1, CUT_ATTEMPTS + 1):
        watch = StreamWatch(signal.SIGKILL)
        victim = await watch.start(narwhal, nursery)
        await watch.end(60)
        if not watch.finished:
            return watch, victim
        # A stream that ended cleanly must be the whole answer: a cut one closed with [DONE] is a router defect.
        assert watch.completion_tokens == LONG["max_tokens"], (
            f"the stream ended cleanly with {watch.completion_tokens} of {LONG['max_tokens']} tokens")
        TIER_NOTES.append(f"SIGKILL test, attempt {attempt}: vLLM wrote all {watch.completion_tokens} tokens before "
                          f"the first reached the client ({watch.chunks} chunks, the first after "
                          f"{watch.first_after_s:.1f} s); restarting {victim.name} and trying again")
        await trio.to_thread.run_sync(narwhal.fleet.restart, victim.name)
        await narwhal.wait_engine(victim.name, lambda e: e["eligible"], what="eligible after the restart",
                                  timeout_s=120)
        await narwhal.wait_none_ejected(after=f"SIGKILL test, {victim.name} restarted")
        await readmit_drained(narwhal, victim)
    raise AssertionError(f"no stream of {LONG['max_tokens']} tokens could be cut in {CUT_ATTEMPTS} attempts")


async def test_sigkill_mid_stream_is_an_sse_stream_error_then_ejection_and_automatic_readmission(
        start_narwhal, nursery) -> None:
    narwhal = await start_narwhal()
    watch, victim = await killed_mid_stream(narwhal, nursery)
    assert watch.error is not None, "the stream should end with an error event"
    assert isinstance(watch.error.body, dict) and watch.error.body.get("code") == "stream", watch.error.body
    assert victim.name in str(watch.error)

    state = await narwhal.wait_engine(victim.name, lambda e: e["ejected"], what="ejected after SIGKILL",
                                      timeout_s=60)
    assert not state["eligible"]
    # The others keep serving meanwhile.
    await readmit_drained(narwhal, victim)
    done = await narwhal.call(lambda: narwhal.openai.completions.create(model=MODEL_NAME, prompt="still here",
                                                                        max_tokens=2))
    assert done.usage.completion_tokens == 2

    await trio.to_thread.run_sync(narwhal.fleet.restart, victim.name)
    state = await narwhal.wait_engine(victim.name, readmitted_by_itself, what="readmitted after the restart",
                                      timeout_s=120)
    assert state["last_readmission"]["check"] is None


async def test_sigstop_is_ejected_after_silent_sweeps_and_readmitted_after_sigcont(start_narwhal, nursery) -> None:
    narwhal = await start_narwhal(engine={"stream_silence_s": 120.0, "health_timeout_s": 1.0},
                                  recovery={"liveness_misses": 3, "probe_interval_s": 1.0})
    watch = StreamWatch(signal.SIGSTOP)
    victim = await watch.start(narwhal, nursery)
    try:
        state = await narwhal.wait_engine(victim.name, lambda e: e["ejected"], what="ejected while frozen",
                                          timeout_s=90)
        assert "liveness" in (state["ejected_cause"] or "") + (state["ejected_reason"] or ""), state
    finally:
        victim.signal_group(signal.SIGCONT)
    await narwhal.wait_engine(victim.name, readmitted_by_itself, what="readmitted after SIGCONT", timeout_s=120)
    # The request that was on it when it froze completed.
    await watch.end(120)
    assert watch.finished and watch.error is None and watch.completion_tokens == LONG["max_tokens"]


async def test_planned_maintenance_refuses_readmission_until_the_vllm_process_is_newer(start_narwhal) -> None:
    narwhal = await start_narwhal()
    name = narwhal.fleet.of_role("decode")[-1].name
    url = f"{narwhal.url}/admin/engines/{name}"
    response = await narwhal.client.post(f"{url}/maintenance", headers=AUTH)
    assert response.status_code == 200, response.text
    await narwhal.wait_engine(name, lambda e: e["drained"], what="drained for maintenance", timeout_s=30)

    response = await narwhal.client.post(f"{url}/readmit", headers=AUTH)
    assert response.status_code == 409, response.text
    assert "newer_process" in response.text and "restart the engine" in response.text
    state = await narwhal.engine(name)
    assert [h["kind"] for h in state["holds"]] == ["maintenance"] and not state["eligible"]

    await trio.to_thread.run_sync(narwhal.fleet.restart, name)
    response = await narwhal.client.post(f"{url}/readmit", headers=AUTH)
    assert response.status_code == 200, response.text
    state = await narwhal.engine(name)
    assert state["eligible"] and state["holds"] == [] and "newer_process" in state["last_readmission"]["passed"]
