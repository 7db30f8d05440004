"""Through Narwhal to real vLLM with the official OpenAI client: the API a user sees, and the KV that moves."""

from __future__ import annotations

import httpx
import openai
import pytest
import trio

from tests.real_vllm.conftest import metric, pd_by_hand
from tests.real_vllm.fleet import MAX_MODEL_LEN, MODEL_NAME

pytestmark = pytest.mark.real_vllm

PROMPT = "The narwhal router moves the cache"
CHAT = [{"role": "user", "content": "hello whale"}]


async def test_completions_streamed_and_not(start_narwhal) -> None:
    narwhal = await start_narwhal()
    whole = await narwhal.call(lambda: narwhal.openai.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0))
    assert whole.object == "text_completion" and whole.model == MODEL_NAME
    assert whole.usage.completion_tokens == 8 and whole.choices[0].finish_reason == "length"

    def streamed() -> tuple[list[str], str | None]:
        texts, finish = [], None
        with narwhal.openai.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0,
                                               stream=True) as stream:
            for chunk in stream:
                texts.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
        return texts, finish

    texts, finish = await narwhal.call(streamed)
    # Greedy: the streamed pieces join to the whole answer. How many pieces is vLLM's choice, not ours: on a
    # loaded CPU its output loop can coalesce all 8 tokens into one delta, so the count is not asserted.
    assert "".join(texts) == whole.choices[0].text and finish == "length" and len(texts) >= 1
    # Without usage asked for, the request line's count is the stream's data events less [DONE], counted by
    # event as vLLM writes them: one per chunk the client got.
    with trio.move_on_after(10):
        while len(narwhal.process.events("request")) < 2:
            await trio.sleep(0.05)
    whole_line, streamed_line = narwhal.process.events("request")[:2]
    assert whole_line["tokens"] == 8, whole_line
    assert streamed_line["tokens"] == len(texts), (streamed_line, texts)


async def test_chat_streamed_and_not(start_narwhal) -> None:
    narwhal = await start_narwhal()
    whole = await narwhal.call(lambda: narwhal.openai.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=6, temperature=0))
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens == 6

    def streamed() -> list[str]:
        pieces = []
        with narwhal.openai.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=6, temperature=0,
                                                    stream=True) as stream:
            for chunk in stream:
                assert chunk.object == "chat.completion.chunk"
                if chunk.choices and chunk.choices[0].delta.content:
                    pieces.append(chunk.choices[0].delta.content)
        return pieces

    assert "".join(await narwhal.call(streamed)) == whole.choices[0].message.content


async def test_models_and_a_wrong_model_is_404(start_narwhal) -> None:
    narwhal = await start_narwhal()
    models = await narwhal.call(narwhal.openai.models.list)
    assert [m.id for m in models.data] == [MODEL_NAME]
    with pytest.raises(openai.NotFoundError) as caught:
        await narwhal.call(lambda: narwhal.openai.completions.create(model="gpt-9", prompt=PROMPT, max_tokens=2))
    assert caught.value.status_code == 404 and "gpt-9" in str(caught.value)


async def test_each_request_moves_its_kv_over_nixl_to_the_decode_engine(start_narwhal) -> None:
    narwhal = await start_narwhal()
    decodes = narwhal.fleet.of_role("decode")
    client = narwhal.client

    async def totals() -> tuple[float, float]:
        xfers = tokens = 0.0
        for engine in decodes:
            xfers += await metric(client, engine.url, "vllm:nixl_xfer_time_seconds_count")
            tokens += await metric(client, engine.url, "vllm:prompt_tokens_by_source_total",
                                   source="external_kv_transfer")
        return xfers, tokens

    before = await totals()
    for i in range(3):
        done = await narwhal.call(lambda i=i: narwhal.openai.completions.create(
            model=MODEL_NAME, prompt=f"{PROMPT} {i}", max_tokens=4, temperature=0))
        # vLLM publishes a step's connector stats with its outputs; give /metrics a moment to show them.
        with trio.move_on_after(10):
            while (after := await totals())[0] < before[0] + 1:
                await trio.sleep(0.1)
        # One NIXL read per request, and the decode engine took the whole prompt from it, computing none.
        assert after[0] == before[0] + 1
        assert after[1] - before[1] >= done.usage.prompt_tokens - 1
        before = after


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
async def test_greedy_output_through_narwhal_equals_the_engine_pair_without_it(start_narwhal, route) -> None:
    narwhal = await start_narwhal()
    body = {"model": MODEL_NAME, "max_tokens": 24, "temperature": 0}
    body.update({"prompt": PROMPT} if route == "/v1/completions" else {"messages": CHAT})
    routed = await narwhal.client.post(f"{narwhal.url}{route}", json=body)
    assert routed.status_code == 200, routed.text
    for decode in narwhal.fleet.of_role("decode"):
        direct = await pd_by_hand(narwhal.client, narwhal.fleet["p1"].url, decode.url, route, body)
        pick = (lambda r: r["choices"][0]["text"]) if route == "/v1/completions" else (
            lambda r: r["choices"][0]["message"]["content"])
        assert pick(routed.json()) == pick(direct)
        assert routed.json()["usage"] == direct["usage"]


async def test_token_id_prompts_work_through_narwhal(start_narwhal) -> None:
    narwhal = await start_narwhal()
    ids = [43, 395, 295]
    routed = await narwhal.call(lambda: narwhal.openai.completions.create(
        model=MODEL_NAME, prompt=ids, max_tokens=6, temperature=0))
    assert routed.usage.prompt_tokens == 3 and routed.usage.completion_tokens == 6
    direct = await pd_by_hand(narwhal.client, narwhal.fleet["p1"].url, narwhal.fleet["d1"].url, "/v1/completions",
                              {"model": MODEL_NAME, "prompt": ids, "max_tokens": 6, "temperature": 0})
    assert routed.choices[0].text == direct["choices"][0]["text"]

    def streamed() -> str:
        with narwhal.openai.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=6, temperature=0,
                                               stream=True) as stream:
            return "".join(chunk.choices[0].text for chunk in stream)

    assert await narwhal.call(streamed) == routed.choices[0].text


async def test_a_list_of_prompts_gets_a_clear_400(start_narwhal) -> None:
    narwhal = await start_narwhal()
    for prompts in (["one prompt", "another"], [[43, 395], [295]]):
        with pytest.raises(openai.BadRequestError) as caught:
            await narwhal.call(lambda p=prompts: narwhal.openai.completions.create(
                model=MODEL_NAME, prompt=p, max_tokens=2))
        assert "a list of prompts is not supported" in str(caught.value)


async def test_a_prompt_longer_than_the_context_is_400_and_no_evidence(start_narwhal) -> None:
    narwhal = await start_narwhal()
    long_text = " ".join(["narwhal"] * (MAX_MODEL_LEN + 50))
    long_ids = [43] * (MAX_MODEL_LEN + 1)
    # Token IDs before the router knows the limit: vLLM refuses them, and its 400 is the client's.
    # Then text, counted by /tokenize, which tells the router the limit; then token IDs, refused by the router.
    for prompt, by_router in ((long_ids, False), (long_text, True), (long_ids, True)):
        with pytest.raises(openai.BadRequestError) as caught:
            await narwhal.call(lambda p=prompt: narwhal.openai.completions.create(
                model=MODEL_NAME, prompt=p, max_tokens=4))
        assert caught.value.status_code == 400
        assert (caught.value.code == "context_length_exceeded") == by_router, caught.value.body
    # Fits, but with max_tokens it would not.
    with pytest.raises(openai.BadRequestError):
        await narwhal.call(lambda: narwhal.openai.completions.create(
            model=MODEL_NAME, prompt=[43] * (MAX_MODEL_LEN - 4), max_tokens=10))
    # A client's bad request is never evidence against an engine.
    for name in narwhal.fleet.engines:
        state = await narwhal.engine(name)
        assert state["eligible"] and not state["ejected"], state
        assert not any(state["evidence"].values()) and state["liveness_misses"] == 0, state
    ok = await narwhal.call(lambda: narwhal.openai.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2))
    assert ok.usage.completion_tokens == 2


async def test_ready_and_the_request_log_names_both_engines(start_narwhal) -> None:
    narwhal = await start_narwhal()
    await narwhal.call(lambda: narwhal.openai.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2))
    async with httpx.AsyncClient() as client:
        assert (await client.get(f"{narwhal.url}/ready")).status_code == 200
    lines = await narwhal.process.wait_event("request", timeout_s=10.0)
    assert lines and lines[-1]["prefill"] == "p1" and lines[-1]["decode"].startswith("d")
