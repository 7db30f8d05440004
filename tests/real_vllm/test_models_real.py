"""Two models behind one router, on stock vLLM: the openai client lists and calls both, and each moves its KV.

Model A is the tier's fleet (``tiny-llama``: ``p1``, ``d1``, ``d2``); model B is two more engines started for
this module only, ``b-p1`` (prefill) and ``b-d1`` (decode), serving the same tiny weights under
``--served-model-name B``: to vLLM and to the router a second model, the cheapest honest layout on 2 cores (one
prefill and one decode, the least a model's pool may have).  ``b-alias`` is an alias of B
(``[[fleet.models]]``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
import trio

from tests.real_vllm.conftest import metric
from tests.real_vllm.fleet import DEFAULT_START_TIMEOUT_S, MODEL_NAME, VllmFleet, running_fleet

pytestmark = pytest.mark.real_vllm

B = "B"
B_ALIAS = "b-alias"
PROMPT = "The narwhal router moves the cache"
CHAT = [{"role": "user", "content": "hello whale"}]


@pytest.fixture(scope="module")
def fleet_b(vllm_fleet: VllmFleet, vllm_environment: tuple[str, str],
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmFleet]:
    """Model B's engines, started after the session's fleet (one start at a time on 2 cores), stopped after."""
    python, model = vllm_environment
    with running_fleet(python, model, tmp_path_factory.mktemp("vllm-b"), prefill=1, decode=1,
                       served_name=B, prefix="b-", timeout_s=DEFAULT_START_TIMEOUT_S) as fleet:
        vllm_fleet.start_times.extend(fleet.start_times)
        yield fleet


@pytest.fixture
async def two_models(start_narwhal, fleet: VllmFleet, fleet_b: VllmFleet):
    """A router serving ``tiny-llama`` on the tier's fleet and ``B`` (alias ``b-alias``) on ``fleet_b``."""
    fleet_b.ensure_healthy(DEFAULT_START_TIMEOUT_S)
    return await start_narwhal(more_engines=fleet_b.described(), models=[{"name": B, "aliases": [B_ALIAS]}])


def _pools(fleet: VllmFleet) -> tuple[set[str], set[str]]:
    return {e.name for e in fleet.of_role("prefill")}, {e.name for e in fleet.of_role("decode")}


async def test_the_openai_client_lists_both_models_and_the_alias(two_models) -> None:
    models = await two_models.call(two_models.openai.models.list)
    by_id = {m.id: m for m in models.data}
    assert {MODEL_NAME, B, B_ALIAS} <= set(by_id), sorted(by_id)
    assert all(m.object == "model" and m.owned_by == "narwhal" for m in models.data)
    assert getattr(by_id[B_ALIAS], "parent", None) == B
    # Both engines' own /v1/models say max_model_len 2048: the router reports the smallest its engines report.
    assert getattr(by_id[B], "max_model_len", None) == getattr(by_id[MODEL_NAME], "max_model_len", None) == 2048


async def test_each_model_serves_completions_and_chat_and_moves_its_kv(two_models, fleet_b: VllmFleet) -> None:
    narwhal = two_models
    client = narwhal.client
    pools = {MODEL_NAME: _pools(narwhal.fleet), B: _pools(fleet_b)}
    decode_urls = {MODEL_NAME: [e.url for e in narwhal.fleet.of_role("decode")],
                   B: [e.url for e in fleet_b.of_role("decode")]}

    async def kv_reads() -> dict[str, tuple[float, float]]:
        """Per model: NIXL reads, and prompt tokens its decode engines took over KV transfer."""
        totals = {}
        for model, urls in decode_urls.items():
            xfers = tokens = 0.0
            for url in urls:
                xfers += await metric(client, url, "vllm:nixl_xfer_time_seconds_count")
                tokens += await metric(client, url, "vllm:prompt_tokens_by_source_total",
                                       source="external_kv_transfer")
            totals[model] = (xfers, tokens)
        return totals

    def completion(name: str) -> tuple[str, str, int]:
        whole = narwhal.openai.completions.create(model=name, prompt=PROMPT, max_tokens=8, temperature=0)
        return whole.model, whole.choices[0].text, whole.usage.prompt_tokens

    def completion_streamed(name: str) -> tuple[str, str, int]:
        texts, answered = [], ""
        with narwhal.openai.completions.create(model=name, prompt=PROMPT, max_tokens=8, temperature=0,
                                               stream=True) as stream:
            for chunk in stream:
                answered = chunk.model
                texts.append(chunk.choices[0].text)
        return answered, "".join(texts), 0

    def chat(name: str) -> tuple[str, str, int]:
        whole = narwhal.openai.chat.completions.create(model=name, messages=CHAT, max_tokens=6, temperature=0)
        return whole.model, whole.choices[0].message.content or "", whole.usage.prompt_tokens

    def chat_streamed(name: str) -> tuple[str, str, int]:
        pieces, answered = [], ""
        with narwhal.openai.chat.completions.create(model=name, messages=CHAT, max_tokens=6, temperature=0,
                                                    stream=True) as stream:
            for chunk in stream:
                answered = chunk.model
                if chunk.choices and chunk.choices[0].delta.content:
                    pieces.append(chunk.choices[0].delta.content)
        return answered, "".join(pieces), 0

    calls = {"completion": completion, "completion streamed": completion_streamed, "chat": chat,
             "chat streamed": chat_streamed}
    texts: dict[tuple[str, str], str] = {}
    for sent, own in ((MODEL_NAME, MODEL_NAME), (B, B), (B_ALIAS, B)):
        other = B if own == MODEL_NAME else MODEL_NAME
        for kind, call in calls.items():
            what = f"{kind} for {sent!r}"
            before = await kv_reads()
            lines = len(narwhal.process.events("request"))
            answered, text, prompt_tokens = await narwhal.call(call, sent)
            # The engines got the model's own name (an alias too), and the answer carries it, as vLLM's does.
            assert answered == own, what
            assert text, what
            texts[(sent, kind)] = text
            # The router's request line: prefill on one engine and decode on another, both of this model.
            with trio.move_on_after(10):
                while len(narwhal.process.events("request")) <= lines:
                    await trio.sleep(0.05)
            line: dict[str, Any] = narwhal.process.events("request")[lines]
            prefills, decodes = pools[own]
            assert line["status"] == 200 and line["model"] == own, (what, line)
            assert line["prefill"] in prefills and line["decode"] in decodes, (what, line)
            # The KV moved: one NIXL read on this model's decode engines (the handoff's kv_transfer_params
            # reached them), the prompt taken over the transfer, and nothing on the other model's engines.
            with trio.move_on_after(10):
                while (after := await kv_reads())[own][0] < before[own][0] + 1:
                    await trio.sleep(0.1)
            assert after[own][0] == before[own][0] + 1, (what, before, after)
            assert after[own][1] > before[own][1], (what, before, after)
            assert after[other] == before[other], (what, before, after)
            if prompt_tokens:
                assert after[own][1] - before[own][1] >= prompt_tokens - 1, (what, before, after)
    # Greedy, same weights: each model's answers are the same text, whichever name was sent.
    for kind in calls:
        assert texts[(MODEL_NAME, kind)] == texts[(B, kind)] == texts[(B_ALIAS, kind)], kind


async def test_an_unknown_model_is_404_before_any_engine(two_models) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        await two_models.call(lambda: two_models.openai.completions.create(model="C", prompt=PROMPT, max_tokens=2))
    assert caught.value.status_code == 404 and "C" in str(caught.value)
    body = caught.value.body if isinstance(caught.value.body, dict) else {}
    assert body.get("code") == "model_not_found" and body.get("type") == "invalid_request_error", body
