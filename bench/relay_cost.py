"""The relay's cost per token on a fixed workload, counted (instructions, syscalls), not timed.

A driver process plays the prefill engine, the decode engine and the clients;
the measured process is the data plane alone (the front, the request core, the
data pool and its relay pump, as the router wires them), optionally under a
counting tool. The decode engine writes one SSE event per stream, as vLLM
does, and the next only once every client has received the previous one, so
every run makes the same reads and writes whatever the machine's load. Two
runs that differ only in tokens per stream give the cost of a token:

    python bench/relay_cost.py --tool valgrind             # instructions per token (valgrind)
    python bench/relay_cost.py --tool strace               # syscalls per 1,000 tokens (strace -f -c)
    python bench/relay_cost.py --tool cprofile             # Python calls per token (cProfile)

``--streams`` streams relay side by side (default 16: the hub takes several ready
sockets per wake-up, as at c64); ``--policy bounded`` relays through the
continuation's join instead of the plain relay.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import selectors
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

_CONFIG = """
[serving]
count_tokens = false
policy = "{policy}"
relay_pump = {pump}
[engine]
request_timeout_s = 600.0
first_token_deadline_s = 600.0
stream_silence_s = 600.0
pool_idle_s = 600.0
[[engines]]
name = "p1"
url = "http://127.0.0.1:{prefill_port}"
role = "prefill"
[[engines]]
name = "d1"
url = "http://127.0.0.1:{decode_port}"
role = "decode"
"""

_PREFILL_BODY = (b'{"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,'
                 b'"remote_engine_id":"p1","remote_block_ids":[1,2,3],"remote_host":"127.0.0.1",'
                 b'"remote_port":9001}}')
_PREFILL_ANSWER = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                   % (len(_PREFILL_BODY), _PREFILL_BODY))
_SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
# The mock engine's completion event (narwhal/tools/mock/engine.py), one token of text each.
_EVENT = (b'data: {"id":"cmpl-0123456789abcdef","object":"text_completion","created":1764633600,'
          b'"model":"mock-model","choices":[{"index":0,"text":" tok%04d","logprobs":null,'
          b'"finish_reason":null,"stop_reason":null}]}\n\n')
_DONE = b"data: [DONE]\n\n"
_REQUEST = b'{"model": "mock-model", "prompt": "hi", "max_tokens": %d, "stream": true}'


# -- the measured process ------------------------------------------------------------------------

def _router(prefill_port: int, decode_port: int, policy: str, pump: bool, profile: str | None) -> None:
    """The data plane as the router wires it, on 127.0.0.1; prints its port, stops at stdin's EOF."""
    import trio

    from narwhal.config import parse_config
    from narwhal.errors import FailureClass, SuccessKind
    from narwhal.fleet.admission import Admission
    from narwhal.fleet.placement import InFlight
    from narwhal.obs.router_metrics import RouterMetrics
    from narwhal.pools.data import DataPool
    from narwhal.serving.front import Front, build_front_server
    from narwhal.serving.request_core import RequestCore

    class Supervisor:
        # The request path asks per model (issue 35); this router serves one.
        def eligible(self, role: str, model: str | None = None) -> list[str]:
            return ["p1"] if role == "prefill" else ["d1"]

        def capacity_problem(self, model: str | None = None) -> str | None:
            return None

        def record_failure(self, engine: str, failure_class: FailureClass) -> None:
            raise SystemExit(f"engine failure {engine} {failure_class}")

        def record_success(self, engine: str, kind: SuccessKind) -> None:
            pass

    config = parse_config(_CONFIG.format(policy=policy, pump=str(pump).lower(), prefill_port=prefill_port,
                                         decode_port=decode_port))

    async def main() -> None:
        pool = DataPool(max_connections=256, engine_config=config.engine)
        async with trio.open_nursery() as nursery:
            await nursery.start(pool.run)
            core = RequestCore(config=config, supervisor=Supervisor(), data_pool=pool,
                               in_flight=InFlight(["p1", "d1"]), admission=Admission(), metrics=RouterMetrics())

            async def rest(request: object, responder: object) -> None:
                raise SystemExit("only completions are served here")
            front = Front(core, rest, via_token="relay-cost", admin_elsewhere=None)  # type: ignore[arg-type]
            server = build_front_server(config, front, None)
            port = await nursery.start(server.serve, "127.0.0.1", 0)
            print(port, flush=True)
            await trio.lowlevel.wait_readable(sys.stdin.fileno())
            nursery.cancel_scope.cancel()
        await pool.aclose()

    if profile is None:
        trio.run(main)
        return
    import cProfile
    profiler = cProfile.Profile()
    profiler.enable()
    trio.run(main)
    profiler.disable()
    profiler.dump_stats(profile)


# -- the driver -----------------------------------------------------------------------------------

class _Peer:
    """One socket of the driver's, with what it received so far."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.data = bytearray()

    def fill(self) -> bool:
        """False when the router closed the connection (an idle pooled one may be)."""
        data = self.sock.recv(1 << 20)
        self.data += data
        return bool(data)


def _request_done(data: bytearray) -> bool:
    head_end = data.find(b"\r\n\r\n")
    if head_end < 0:
        return False
    match = re.search(rb"content-length: *(\d+)", bytes(data[:head_end]), re.IGNORECASE)
    return len(data) >= head_end + 4 + (int(match.group(1)) if match else 0)


class _Client:
    """A client's chunked response, de-chunked as it comes."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.raw = bytearray()
        self.body = bytearray()
        self.head = False
        self.ended = False

    def fill(self) -> None:
        data = self.sock.recv(1 << 20)
        if not data:
            raise SystemExit("the router closed a client connection")
        self.raw += data
        if not self.head:
            end = self.raw.find(b"\r\n\r\n")
            if end < 0:
                return
            if not self.raw.startswith(b"HTTP/1.1 200"):
                raise SystemExit(f"the router answered {bytes(self.raw[:200])!r}")
            del self.raw[:end + 4]
            self.head = True
        while True:
            line_end = self.raw.find(b"\r\n")
            if line_end < 0:
                return
            size = int(self.raw[:line_end], 16)
            if len(self.raw) < line_end + 2 + size + 2:
                return
            if size == 0:
                self.ended = True
            self.body += self.raw[line_end + 2:line_end + 2 + size]
            del self.raw[:line_end + 2 + size + 2]


def _drive(router_cmd: list[str], requests: int, streams: int, tokens: int, policy: str, pump: bool,
           env: dict[str, str]) -> None:
    """Start the router (``router_cmd`` + its arguments) and relay ``requests`` rounds of ``streams`` streams."""
    prefill_listener = socket.create_server(("127.0.0.1", 0), backlog=512)
    decode_listener = socket.create_server(("127.0.0.1", 0), backlog=512)
    args = [str(prefill_listener.getsockname()[1]), str(decode_listener.getsockname()[1]), policy,
            "on" if pump else "off"]
    router = subprocess.Popen([*router_cmd, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    assert router.stdout is not None and router.stdin is not None
    port = int(router.stdout.readline())
    selector = selectors.DefaultSelector()
    engines: dict[socket.socket, _Peer] = {}
    for listener in (prefill_listener, decode_listener):
        selector.register(listener, selectors.EVENT_READ, "accept")

    def pump_engines(until: int) -> list[_Peer]:
        """Serve prefill requests and accept decode ones until ``until`` decode requests came in."""
        decodes: list[_Peer] = []
        while len(decodes) < until:
            for key, _ in selector.select():
                if key.data == "accept":
                    sock, _ = key.fileobj.accept()  # type: ignore[union-attr]
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    engines[sock] = _Peer(sock)
                    role = "prefill" if key.fileobj is prefill_listener else "decode"
                    selector.register(sock, selectors.EVENT_READ, role)
                    continue
                peer = engines[key.fileobj]  # type: ignore[index]
                if not peer.fill():
                    selector.unregister(peer.sock)
                    del engines[peer.sock]
                    peer.sock.close()
                    continue
                if not _request_done(peer.data):
                    continue
                peer.data.clear()
                if key.data == "prefill":
                    peer.sock.sendall(_PREFILL_ANSWER)
                else:
                    decodes.append(peer)
        return decodes

    for _ in range(requests):
        clients = []
        for _ in range(streams):
            sock = socket.create_connection(("127.0.0.1", port))
            body = _REQUEST % tokens
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(body), body))
            clients.append(_Client(sock))
        decodes = pump_engines(streams)
        expected = 0
        for index in range(tokens + 1):
            event = _EVENT % index if index < tokens else _DONE
            framed = b"%x\r\n%s\r\n" % (len(event), event)
            if index == 0:
                framed = _SSE_HEAD + framed
            if index == tokens:
                framed += b"0\r\n\r\n"
            for peer in decodes:
                peer.sock.sendall(framed)
            expected += len(event)
            for client in clients:
                while len(client.body) < expected and not (index == tokens and client.ended):
                    client.fill()
        for client in clients:
            while not client.ended:
                client.fill()
            client.sock.close()
    router.stdin.close()
    if router.wait() != 0:
        raise SystemExit(f"the router exited with {router.returncode}")


def _run(tool: str, requests: int, streams: int, tokens: int, policy: str, pump: bool, workdir: Path) -> float:
    """One run; returns the tool's total (instructions, syscalls or Python calls)."""
    script = str(Path(__file__).resolve())
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    python = [sys.executable, script, "router"]
    out = workdir / f"{tool}-{tokens}.out"
    if tool == "valgrind":
        # Instruction counts only (cachegrind without its cache simulation: the cheapest counting tool).
        cmd = ["valgrind", "--tool=cachegrind", "--cache-sim=no", f"--cachegrind-out-file={out}", *python]
    elif tool == "strace":
        cmd = ["strace", "-f", "-c", "-o", str(out), *python]
    elif tool == "cprofile":
        cmd = [*python, "--profile", str(out)]
    else:
        cmd = python
    with contextlib.redirect_stdout(sys.stderr):
        _drive(cmd, requests, streams, tokens, policy, pump, env)
    if tool == "valgrind":
        for line in out.read_text().splitlines():
            if line.startswith("summary:") or line.startswith("totals:"):
                return float(line.split()[1])
        raise SystemExit("no totals in the cachegrind output")
    if tool == "strace":
        return _strace_total(out.read_text())
    if tool == "cprofile":
        import pstats
        stats = pstats.Stats(str(out))
        return float(stats.total_calls)  # type: ignore[attr-defined]
    return 0.0


def _calls_by_function(path: Path) -> dict[str, int]:
    import pstats
    stats = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    return {f"{Path(file).name}:{line}({name})": calls[1] for (file, line, name), calls in stats.items()}


def _strace_total(text: str) -> float:
    # The sum of the rows, not the total line (whose columns differ between strace versions).
    kinds = _strace_kinds(text)
    if not kinds:
        raise SystemExit("no syscalls in the strace output")
    return float(sum(kinds.values()))


def _strace_kinds(text: str) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 5 and fields[0][0].isdigit() and fields[-1] != "total":
            kinds[fields[-1]] = int(fields[3])
    return kinds


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "router":
        parser = argparse.ArgumentParser()
        parser.add_argument("mode")
        parser.add_argument("prefill_port", type=int)
        parser.add_argument("decode_port", type=int)
        parser.add_argument("policy")
        parser.add_argument("pump")
        parser.add_argument("--profile")
        args = parser.parse_args()
        _router(args.prefill_port, args.decode_port, args.policy, args.pump == "on", args.profile)
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tool", choices=["valgrind", "strace", "cprofile", "none"], default="valgrind")
    parser.add_argument("--requests", type=int, default=2, help="rounds of --streams streams (default 2)")
    parser.add_argument("--streams", type=int, default=16, help="streams relayed side by side (default 16)")
    parser.add_argument("--tokens", type=int, nargs=2, default=[32, 160],
                        help="tokens per stream in the two runs (default 32 160)")
    parser.add_argument("--policy", choices=["saturate", "bounded"], default="saturate")
    parser.add_argument("--pump", choices=["on", "off"], default="on")
    parser.add_argument("--keep", help="keep the tools' outputs in this directory")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(args.keep or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        few, many = args.tokens
        totals = [_run(args.tool, args.requests, args.streams, n, args.policy, args.pump == "on", workdir)
                  for n in (few, many)]
        tokens = args.requests * args.streams * (many - few)
        per_token = (totals[1] - totals[0]) / tokens
        unit = {"valgrind": "instructions", "strace": "syscalls", "cprofile": "Python calls", "none": ""}[args.tool]
        print(f"{args.tool}: {totals[0]:,.0f} and {totals[1]:,.0f} {unit} for {few} and {many} tokens per stream "
              f"({args.requests} x {args.streams} streams, policy {args.policy}, pump {args.pump})")
        if args.tool == "strace":
            print(f"syscalls per 1,000 tokens: {1000 * per_token:,.1f}")
            kinds = [_strace_kinds((workdir / f"strace-{n}.out").read_text()) for n in (few, many)]
            for name in sorted(set(kinds[0]) | set(kinds[1]), key=lambda k: -(kinds[1].get(k, 0) - kinds[0].get(k, 0))):
                delta = kinds[1].get(name, 0) - kinds[0].get(name, 0)
                if delta:
                    print(f"  {name:<16} {1000 * delta / tokens:8.1f}")
        elif args.tool != "none":
            print(f"{unit} per token: {per_token:,.1f}")
        if args.tool == "cprofile":
            calls = [_calls_by_function(workdir / f"cprofile-{n}.out") for n in (few, many)]
            for name, delta in sorted(((name, calls[1][name] - calls[0].get(name, 0)) for name in calls[1]),
                                      key=lambda item: -item[1])[:40]:
                if delta / tokens >= 0.01:
                    print(f"  {delta / tokens:6.2f}  {name}")


if __name__ == "__main__":
    main()
