"""Router overhead in front of real vLLM on CPU: ``python -m narwhal bench --target`` at a Narwhal router in front
of the real-vLLM tier's fleet, with the same load through the engine pair with no router as the baseline.

    python3 bench/real_vllm.py [--decode 1] [BENCH OPTIONS...]     # e.g. --tokens 32 --concurrency 4

It builds or finds the tier's cached venv and model (tests/real_vllm/setup_env.py), takes the machine's real-vLLM
lock, starts 1 prefill + N decode engines (the tier's command line), a router in front of them, then runs
``python -m narwhal bench --target ROUTER --model tiny-llama --baseline pair --pair PREFILL DECODE1 ...`` with
the venv's python and prints its table.  Everything it started is stopped at the end.  With several decode
engines the router spreads the load while the pair baseline uses the first one only: use --decode 1 for a
like-for-like comparison.

    python3 bench/real_vllm.py --vllm-router /PATH/vllm-router --concurrencies 1,4,8 --rounds 2 \
        --tokens 32 --requests 60 --quiet

measures Narwhal and vllm-router side by side instead: per round (the order alternating) each router is started
in front of the same engines, its idle CPU per second measured (``--idle-s``), then the same loads sent through
it; the table gives CPU per request with the idle CPU included and taken out (``cpu_s - idle rate x wall``), and
the user and system parts apart, each less its own idle rate.

    python3 bench/real_vllm.py --cprofile-router /tmp/rv --cprofile-requests 50,250 --tokens 32 --concurrency 4 \
        --quiet --router-set controller.monitor_interval_s=30

runs Narwhal under cProfile instead, started afresh for 50 and for 250 requests (/tmp/rv-50.prof, /tmp/rv-250.prof):
``python bench/cprofile_compare.py MOCK-50.prof MOCK-250.prof /tmp/rv-50.prof /tmp/rv-250.prof --requests 200``
then shows what a request in front of real vLLM calls that one in front of the mock engines does not.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> int:
    """Outside the venv (standard library only): set up, take the lock, run the rest in the venv."""
    from tests.real_vllm.run import lock, setup

    env = setup()
    if isinstance(env, str):
        print(f"bench/real_vllm.py: cannot build the environment: {env}", file=sys.stderr)
        return 3
    fd = lock(3600.0)
    try:
        return subprocess.run([env["python"], __file__, "--inner", env["model"], *sys.argv[1:]],
                              env={**os.environ, "PYTHONPATH": str(REPO)}).returncode
    finally:
        os.close(fd)


def inner(model: str, argv: list[str]) -> int:
    """In the venv, holding the lock: the fleet, the router(s), the benchmark."""
    from tests.real_vllm.fleet import MODEL_NAME, running_fleet

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decode", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the benchmark this many times in a row (router, pair, router, pair, ...), "
                             "each with --json PREFIX.N.json when --json-prefix is given")
    parser.add_argument("--json-prefix", help="write round N's figures to PREFIX.N.json")
    parser.add_argument("--vllm-router", metavar="BIN",
                        help="also measure vllm-router (this executable) in front of the same engines: each "
                             "router's idle CPU, then the same load through each, alternating; no pair baseline")
    parser.add_argument("--concurrencies", default=None,
                        help="with --vllm-router: comma-separated concurrencies, each run per router and round "
                             "(default: the bench's --concurrency)")
    parser.add_argument("--idle-s", type=float, default=20.0,
                        help="with --vllm-router: seconds of each router's idle CPU measured before its load")
    parser.add_argument("--router-set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="a Narwhal config value over the tier's (repeatable), e.g. serving.count_tokens=false")
    parser.add_argument("--cprofile-router", metavar="PREFIX",
                        help="no table: run Narwhal under cProfile once per --cprofile-requests count (the router "
                             "started afresh each time), writing PREFIX-N.prof; bench/cprofile_compare.py gives "
                             "the calls per request (against the mock's from bench/cprofile_router.py)")
    parser.add_argument("--cprofile-requests", default="50,250", metavar="N1,N2",
                        help="with --cprofile-router: the two request counts (default 50,250)")
    args, bench_args = parser.parse_known_args(argv)
    python = sys.executable
    with tempfile.TemporaryDirectory(prefix="narwhal-real-vllm-bench-") as tmp, \
            running_fleet(python, model, Path(tmp), prefill=1, decode=args.decode) as fleet:
        config = Path(tmp) / "narwhal.toml"
        config.write_text(fleet.router_config(Path(tmp) / "handoff.json", **_sections(args.router_set)))
        child_env = {**os.environ, "PYTHONPATH": str(REPO)}
        if args.vllm_router:
            return _side_by_side(args, bench_args, python, fleet, config, Path(tmp), child_env, MODEL_NAME)
        if args.cprofile_router:
            return _profiled(args, bench_args, python, config, Path(tmp), child_env, MODEL_NAME)
        router, url = _start_narwhal(python, config, Path(tmp) / "router.log", child_env)
        try:
            status = 0
            for n in range(1, args.rounds + 1):
                out = ["--json", f"{args.json_prefix}.{n}.json"] if args.json_prefix else []
                cmd = [python, "-m", "narwhal", "bench", "--target", url, "--target-pid", str(router.pid),
                       "--model", MODEL_NAME, "--baseline", "pair", "--pair", fleet["p1"].url,
                       fleet["d1"].url, *bench_args, *out]
                print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
                status = status or subprocess.run(cmd, env=child_env, cwd=REPO).returncode
            return status
        finally:
            _stop(router)


def _sections(settings: list[str]) -> dict[str, dict[str, object]]:
    """``SECTION.KEY=VALUE`` items as config sections (values read as TOML literals, else strings)."""
    import tomllib

    sections: dict[str, dict[str, object]] = {}
    for item in settings:
        key, _, raw = item.partition("=")
        section, _, name = key.partition(".")
        if not (section and name and _):
            raise SystemExit(f"--router-set {item!r}: expected SECTION.KEY=VALUE")
        try:
            value: object = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        sections.setdefault(section, {})[name] = value
    return sections


def _start_narwhal(python: str, config: Path, log_path: Path, env: dict[str, str], *,
                   wrap: list[str] | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """A Narwhal router on a free port (under ``python [wrap] -m narwhal``), once it serves; its URL."""
    with log_path.open("w") as log:
        proc = subprocess.Popen([python, *(wrap or []), "-m", "narwhal", "serve", "--config", str(config),
                                 "--listen", "127.0.0.1:0"], stderr=log, env=env, start_new_session=True)
    try:
        return proc, _router_url(log_path, proc)
    except BaseException:
        _stop(proc)
        raise


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _user_sys(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of ``pid`` and its descendants."""
    from narwhal.tools.bench.procstat import CLOCK_TICKS_PER_S, descendants, read_stat

    user = system = 0
    for each in [pid, *descendants(pid)]:
        stat = read_stat(each)
        if stat is not None:
            user += stat.utime
            system += stat.stime
    return user / CLOCK_TICKS_PER_S, system / CLOCK_TICKS_PER_S


def _wait_http_ok(url: str, process: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the router exited ({process.returncode}) before it answered {url}")
        try:
            with httpx.Client(timeout=2.0) as client:
                if client.get(url).status_code == 200:
                    return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer 200 within {timeout_s:g} s")


def _side_by_side(args: argparse.Namespace, bench_args: list[str], python: str, fleet: object, config: Path,
                  tmp: Path, env: dict[str, str], model_name: str) -> int:
    """Narwhal and vllm-router in front of the same engines: idle CPU each, then the same loads, alternating."""
    from tests.real_vllm.fleet import free_port

    prefill = fleet["p1"].url  # type: ignore[index]
    decodes = [e.url for e in fleet.of_role("decode")]  # type: ignore[attr-defined]
    concurrencies = [int(c) for c in (args.concurrencies or "").split(",") if c] or [None]
    results: list[dict[str, object]] = []
    status = 0

    def start(name: str) -> tuple[subprocess.Popen[bytes], str]:
        if name == "narwhal":
            return _start_narwhal(python, config, tmp / f"{name}.log", env)
        log = (tmp / f"{name}.log").open("w")
        port, metrics = free_port(), free_port()
        cmd = [args.vllm_router, "--vllm-pd-disaggregation", "--prefill", prefill,
               *[flag for url in decodes for flag in ("--decode", url)], "--host", "127.0.0.1", "--port",
               str(port), "--prometheus-port", str(metrics), "--policy", "round_robin"]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        _wait_http_ok(f"{url}/health", proc)
        return proc, url

    for n in range(1, args.rounds + 1):
        # Alternate which router goes first from one round to the next.
        order = ["narwhal", "vllm-router"] if n % 2 else ["vllm-router", "narwhal"]
        for name in order:
            proc, url = start(name)
            try:
                time.sleep(2.0)  # past start-up work (first health passes, connections)
                (user0, sys0), t0 = _user_sys(proc.pid), time.monotonic()
                time.sleep(args.idle_s)
                (user1, sys1), idle_s = _user_sys(proc.pid), time.monotonic() - t0
                idle_cpu_s_per_s = (user1 + sys1 - user0 - sys0) / idle_s
                idle_rates = ((user1 - user0) / idle_s, (sys1 - sys0) / idle_s)
                for conc in concurrencies:
                    out = tmp / f"{name}.{n}.{conc}.json"
                    cmd = [python, "-m", "narwhal", "bench", "--target", url, "--target-pid", str(proc.pid),
                           "--model", model_name, *bench_args,
                           *(["--concurrency", str(conc)] if conc is not None else []), "--json", str(out)]
                    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
                    # The run's user and system time apart, less idle each: which side a difference is on.
                    (user0, sys0), t0 = _user_sys(proc.pid), time.monotonic()
                    status = status or subprocess.run(cmd, env=env, cwd=REPO).returncode
                    (user1, sys1), wall = _user_sys(proc.pid), time.monotonic() - t0
                    less_idle = (max(0.0, user1 - user0 - idle_rates[0] * wall),
                                 max(0.0, sys1 - sys0 - idle_rates[1] * wall))
                    results.append(_figures(name, n, conc, idle_cpu_s_per_s, out, less_idle))
            finally:
                _stop(proc)
    if args.json_prefix:
        Path(f"{args.json_prefix}.side-by-side.json").write_text(json.dumps(results, indent=1))
    _print_side_by_side(results)
    return status


def _profiled(args: argparse.Namespace, bench_args: list[str], python: str, config: Path, tmp: Path,
              env: dict[str, str], model_name: str) -> int:
    """Narwhal under cProfile in front of the engines, once per request count: exact Python calls per request."""
    status = 0
    for count in (int(n) for n in args.cprofile_requests.split(",")):
        out = Path(f"{args.cprofile_router}-{count}.prof").resolve()
        proc, url = _start_narwhal(python, config, tmp / f"profiled-{count}.log", env,
                                   wrap=["-m", "cProfile", "-o", str(out)])
        try:
            cmd = [python, "-m", "narwhal", "bench", "--target", url, "--target-pid", str(proc.pid), "--model",
                   model_name, "--warmup", "0", *bench_args, "--requests", str(count)]
            print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
            status = status or subprocess.run(cmd, env=env, cwd=REPO).returncode
        finally:
            _stop(proc)
        print(f"wrote {out}", file=sys.stderr, flush=True)
    return status


def _figures(router: str, round_: int, conc: int | None, idle: float, path: Path,
             user_sys: tuple[float, float]) -> dict[str, object]:
    """One run's CPU per request with the router's idle CPU included and taken out."""
    run = json.loads(path.read_text())["run"]
    load, usage = run["load"], run["router"]
    ok, wall, cpu = load["ok"], load["duration_s"], usage["cpu_s"]
    less_idle = max(0.0, cpu - idle * wall)

    def per_request(seconds: float) -> float | None:
        return round(seconds * 1000 / ok, 3) if ok else None

    return {"router": router, "round": round_, "concurrency": conc, "ok": ok, "errors": load["errors"],
            "requests_per_s": load["requests_per_s"], "ttft_p50_ms": (load["ttft"] or {}).get("p50_ms"),
            "idle_cpu_ms_per_s": round(idle * 1000, 3), "cpu_ms_per_request": per_request(cpu),
            "cpu_ms_per_request_less_idle": per_request(less_idle),
            # Over the bench process's whole life (its start-up included), each less its idle rate.
            "user_ms_per_request_less_idle": per_request(user_sys[0]),
            "sys_ms_per_request_less_idle": per_request(user_sys[1])}


def _print_side_by_side(results: list[dict[str, object]]) -> None:
    import statistics

    keys = ("idle_cpu_ms_per_s", "cpu_ms_per_request", "cpu_ms_per_request_less_idle",
            "user_ms_per_request_less_idle", "sys_ms_per_request_less_idle", "requests_per_s", "ttft_p50_ms")
    print("| concurrency | router | " + " | ".join(keys) + " | errors |")
    print("|---" * (len(keys) + 3) + "|")
    medians: dict[tuple[object, str], dict[str, float]] = {}
    for conc in sorted({r["concurrency"] for r in results}, key=lambda c: c or 0):
        for router in ("narwhal", "vllm-router"):
            rows = [r for r in results if r["concurrency"] == conc and r["router"] == router]
            if not rows:
                continue
            med = {k: statistics.median(float(r[k]) for r in rows if r[k] is not None) for k in keys
                   if any(r[k] is not None for r in rows)}
            medians[(conc, router)] = med
            errors = sum(int(r["errors"]) for r in rows)  # type: ignore[call-overload]
            print(f"| {conc} | {router} | " + " | ".join(f"{med.get(k, float('nan')):.3f}" for k in keys)
                  + f" | {errors} |")
    for conc in sorted({c for c, _ in medians}, key=lambda c: c or 0):
        a, b = medians.get((conc, "narwhal")), medians.get((conc, "vllm-router"))
        if a and b:
            ratios = ", ".join(f"{k} {a[k] / b[k]:.2f}x" for k in keys[1:5] if b.get(k))
            print(f"c{conc}: narwhal / vllm-router: {ratios}")


def _router_url(log_path: Path, router: subprocess.Popen[bytes], timeout_s: float = 60.0) -> str:
    """The router's URL from its ``router_started`` line, once it serves a completion."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if router.poll() is not None:
            raise RuntimeError(f"the router exited ({router.returncode}): {log_path.read_text()[-2000:]}")
        for line in log_path.read_text().splitlines():
            if '"router_started"' in line:
                url = "http://" + json.loads(line)["listen"]
                with httpx.Client(timeout=5.0) as client:
                    if client.get(f"{url}/ready").status_code == 200:
                        return url
        time.sleep(0.2)
    raise RuntimeError(f"the router did not become ready within {timeout_s:g} s")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--inner"]:
        sys.exit(inner(sys.argv[2], sys.argv[3:]))
    sys.exit(main())
