"""A stand-in for ``vllm serve``: a FastAPI app on uvicorn with vLLM's routes and P/D handoff,
loading ``--middleware`` the way vLLM's OpenAI api server does.

    python tests/fake_vllm.py serve MODEL [--port P] [--served-model-name NAME ...]
        [--kv-transfer-config JSON] [--middleware dotted.path ...]

The command line has vLLM's shape, so the identity plugin reads it from
``sys.argv`` exactly as it would inside vLLM. Routes: ``GET /health``,
``GET /v1/models``, ``POST /tokenize``, ``POST /v1/completions`` (a prefill with
``do_remote_decode`` answers one token and a handoff naming this engine; a
decode with ``do_remote_prefill`` needs a readable handoff; the KV role from
``--kv-transfer-config`` decides which of the two this engine accepts), and, for
tests, ``POST /fake/release``: a streamed completion sent with
``x-fake-hold: 1`` stops after its first event until it is called.

Prints ``{"event": "fake_vllm_ready", "port": N}`` on stdout once serving.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import itertools
import json
import socket
import sys
import time
import zlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

_HOLD_LIMIT_S = 30.0
_ROLES = {"kv_producer": {"producer"}, "kv_consumer": {"consumer"}, "kv_both": {"producer", "consumer"}}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="fake_vllm")
    parser.add_argument("subcommand", choices=["serve"])
    parser.add_argument("model")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", nargs="+")
    parser.add_argument("--kv-transfer-config", type=json.loads)
    parser.add_argument("--max-model-len", type=int, default=4096)
    # As vLLM declares it: repeatable, each a dotted path to a class or a coroutine function.
    parser.add_argument("--middleware", action="append", default=[])
    return parser.parse_args(argv)


def _error(status: int, message: str, type_: str = "BadRequestError") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": None, "code": status}},
                        status_code=status)


def build_app(args: argparse.Namespace) -> FastAPI:
    served = args.served_model_name or [args.model]
    kv_role = (args.kv_transfer_config or {}).get("kv_role")
    roles = _ROLES.get(kv_role, set())
    created = int(time.time())
    blocks = itertools.count(1)
    release = asyncio.Event()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Lifespan runs through the middleware stack, so it is built (and the plugin constructed) by now.
        sys.stdout.write(json.dumps({"event": "fake_vllm_ready", "port": args.bound_port}) + "\n")
        sys.stdout.flush()
        yield

    app = FastAPI(lifespan=lifespan)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "vllm", "root": args.model,
             "parent": None, "max_model_len": args.max_model_len, "permission": []} for name in served]}

    def tokens(prompt: Any) -> list[int]:
        if isinstance(prompt, list):
            return [int(t) for t in prompt]
        return [zlib.crc32(word.encode()) % 32000 for word in str(prompt).split()]

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Any:
        body = await request.json()
        ids = tokens(body.get("prompt", ""))
        return {"count": len(ids), "max_model_len": args.max_model_len, "tokens": ids}

    @app.post("/fake/release")
    async def fake_release() -> dict[str, bool]:
        release.set()
        return {"released": True}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await request.json()
        if body.get("model") not in (None, *served):
            return _error(404, f"The model `{body.get('model')}` does not exist.", "NotFoundError")
        prompt_tokens = len(tokens(body.get("prompt", "")))
        kv = body.get("kv_transfer_params") or {}
        if kv.get("do_remote_decode"):
            if "producer" not in roles:
                return _error(400, f"this engine's kv_role {kv_role!r} does not produce KV")
            handoff = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": args.model,
                       "remote_block_ids": [next(blocks) for _ in range(max(1, -(-prompt_tokens // 16)))],
                       "remote_host": args.host, "remote_port": args.bound_port, "tp_size": 1}
            return JSONResponse({
                "id": "cmpl-prefill", "object": "text_completion", "created": int(time.time()),
                "model": served[0],
                "choices": [{"index": 0, "text": " tok0", "logprobs": None, "finish_reason": "length",
                             "stop_reason": None}],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 1,
                          "total_tokens": prompt_tokens + 1},
                "kv_transfer_params": handoff})
        if kv.get("do_remote_prefill"):
            if "consumer" not in roles:
                return _error(400, f"this engine's kv_role {kv_role!r} does not consume KV")
            missing = [k for k in ("remote_engine_id", "remote_block_ids", "remote_host", "remote_port")
                       if kv.get(k) is None]
            if missing:
                return _error(400, f"kv_transfer_params lacks {missing}")
        n = int(body.get("max_tokens") or 16)
        if not body.get("stream"):
            return JSONResponse({
                "id": "cmpl-1", "object": "text_completion", "created": int(time.time()), "model": served[0],
                "choices": [{"index": 0, "text": "".join(f" tok{i}" for i in range(n)), "logprobs": None,
                             "finish_reason": "length", "stop_reason": None}],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                          "total_tokens": prompt_tokens + n}})
        hold = request.headers.get("x-fake-hold") == "1"

        async def events() -> AsyncIterator[bytes]:
            for i in range(n):
                chunk = {"id": "cmpl-1", "object": "text_completion", "created": int(time.time()),
                         "model": served[0], "choices": [{"index": 0, "text": f" tok{i}", "logprobs": None,
                                                          "finish_reason": "length" if i == n - 1 else None,
                                                          "stop_reason": None}]}
                yield f"data: {json.dumps(chunk)}\n\n".encode()
                if hold and i == 0:
                    await asyncio.wait_for(release.wait(), _HOLD_LIMIT_S)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    # Loading --middleware as vLLM's api server does: import the dotted path; a class is
    # added with app.add_middleware(cls) and no options, a coroutine function as an
    # "http" middleware, anything else refused.
    for dotted in args.middleware:
        module_name, attribute = dotted.rsplit(".", 1)
        loaded = getattr(importlib.import_module(module_name), attribute)
        if inspect.isclass(loaded):
            app.add_middleware(loaded)
        elif inspect.iscoroutinefunction(loaded):
            app.middleware("http")(loaded)
        else:
            raise ValueError(f"Invalid middleware {dotted}. Must be a function or a class.")
    return app


def main() -> None:
    args = parse_args(sys.argv[1:])
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    sock.listen(128)
    args.bound_port = sock.getsockname()[1]
    app = build_app(args)
    # vLLM's uvicorn keeps idle connections 5 s.
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_keep_alive=5))
    asyncio.run(server.serve(sockets=[sock]))


if __name__ == "__main__":
    main()
