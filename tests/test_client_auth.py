"""The request path's client auth in process: identify, model, limits, the gate, and the tenants view."""

from __future__ import annotations

import hashlib

import pytest
import trio
import trio.testing

import narwhal.auth.client_auth as client_auth_module
import narwhal.auth.keys as keys_module
from narwhal.app.tenants_view import tenants_view
from narwhal.auth.client_auth import ANONYMOUS, AuthRefused, AuthSettings, ClientAuth, KeyMemo
from narwhal.auth.keys import KeyEntry


def entry(name: str, key: str, **fields: object) -> KeyEntry:
    return KeyEntry(name=name, sha256=hashlib.sha256(key.encode()).hexdigest(), **fields)  # type: ignore[arg-type]


def auth(*keys: KeyEntry, capacity: int = 4, bounded: bool = False, reserve_high: float = 0.0,
         clock: list[float] | None = None) -> ClientAuth:
    now = clock if clock is not None else [0.0]
    return ClientAuth(AuthSettings(keys=list(keys), reserve_high=reserve_high, max_queue=8), capacity=capacity,
                      bounded=bounded, clock=lambda: now[0])


def test_identify_answers_401_for_a_missing_or_unknown_key_and_the_entry_for_a_known_one() -> None:
    alpha = entry("alpha", "k-alpha")
    client = auth(alpha)
    assert client.identify(b"Bearer k-alpha") == alpha
    for header in (None, b"Bearer nope", b"Basic k-alpha", b"k-alpha"):
        with pytest.raises(AuthRefused) as refused:
            client.identify(header)
        assert (refused.value.status, refused.value.code) == (401, "invalid_api_key")
    # Without a keys file every caller is one anonymous tenant.
    off = ClientAuth(AuthSettings(keys=None), capacity=4, bounded=False, clock=lambda: 0.0)
    assert off.identify(None) is ANONYMOUS


def test_a_key_may_use_only_its_models_by_the_name_asked_or_the_served_model() -> None:
    client = auth()
    limited = entry("beta", "k-beta", models=["llama"])
    client.check_model(limited, ("llama", "llama"))
    client.check_model(limited, ("alias-of-llama", "llama"))
    with pytest.raises(AuthRefused) as refused:
        client.check_model(limited, ("other", "other"))
    assert (refused.value.status, refused.value.code, refused.value.reason) == (403, "model_not_allowed", "model")
    client.check_model(entry("all", "k-all"), ("anything", "anything"))


async def test_a_limit_answers_429_with_openais_headers_and_a_finished_request_gives_back_its_slots() -> None:
    now = [0.0]
    alpha = entry("alpha", "k-alpha", requests_per_minute=2, max_concurrent=1)
    client = auth(alpha, clock=now)
    first = await client.admit(alpha, deadline=10.0)
    with pytest.raises(AuthRefused) as refused:
        await client.admit(alpha, deadline=10.0)  # one in flight at most
    assert (refused.value.status, refused.value.code) == (429, "rate_limit_exceeded")
    assert refused.value.reason == "concurrent"
    client.finish(first, tokens=10)
    second = await client.admit(alpha, deadline=10.0)
    client.finish(second, tokens=0)
    with pytest.raises(AuthRefused) as refused:
        await client.admit(alpha, deadline=10.0)
    headers = dict(refused.value.headers)
    assert refused.value.reason == "requests"
    assert headers[b"x-ratelimit-limit-requests"] == b"2" and int(headers[b"retry-after"]) >= 1
    now[0] = 30.0  # one request back (two a minute)
    client.finish(await client.admit(alpha, deadline=40.0), tokens=0)


async def test_saturated_normal_requests_are_refused_overloaded_while_high_ones_take_the_reserve() -> None:
    normal, high = entry("n", "k-n"), entry("h", "k-h", priority="high")
    client = auth(normal, high, capacity=4, reserve_high=0.25)
    held = [await client.admit(normal, deadline=10.0) for _ in range(3)]
    with pytest.raises(AuthRefused) as refused:
        await client.admit(normal, deadline=10.0)
    assert (refused.value.status, refused.value.code) == (503, "overloaded")
    assert dict(refused.value.headers)[b"retry-after"] == b"1"
    top = await client.admit(high, deadline=10.0)
    with pytest.raises(AuthRefused) as refused:
        await client.admit(high, deadline=10.0)
    assert refused.value.code == "pool_saturated"
    for admitted in (*held, top):
        client.finish(admitted, tokens=0)
    # A refused request gave its concurrency back: the tenant is not charged for what it never got.
    assert client.limits.in_flight("n") == 0


async def test_under_the_bounded_policy_a_request_waits_for_capacity_and_says_how_long() -> None:
    normal = entry("n", "k-n")
    client = auth(normal, capacity=1, bounded=True, clock=[0.0])
    first = await client.admit(normal, deadline=trio.current_time() + 10.0)
    waited: list[float] = []

    async def second() -> None:
        admitted = await client.admit(normal, deadline=trio.current_time() + 10.0)
        waited.append(admitted.queue_wait_s)
        client.finish(admitted, tokens=0)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(second)
        await trio.testing.wait_all_tasks_blocked()
        assert not waited
        client.finish(first, tokens=0)
    assert len(waited) == 1


def test_a_reload_admits_new_keys_and_refuses_removed_ones_at_once() -> None:
    alpha, gamma = entry("alpha", "k-alpha"), entry("gamma", "k-gamma")
    client = auth(alpha)
    client.configure(AuthSettings(keys=[gamma], max_queue=8))
    assert client.identify(b"Bearer k-gamma") == gamma
    with pytest.raises(AuthRefused):
        client.identify(b"Bearer k-alpha")


def test_the_tenants_view_sums_the_metrics_and_ranks_by_requests() -> None:
    text = "\n".join([
        '# HELP narwhal_tenant_requests_total Finished client requests by tenant and status.',
        'narwhal_tenant_requests_total{tenant="a",status="200"} 5',
        'narwhal_tenant_requests_total{tenant="a",status="429"} 2',
        'narwhal_tenant_requests_total{tenant="b",status="200"} 9',
        'narwhal_tenant_tokens_total{tenant="a",kind="prompt"} 100',
        'narwhal_tenant_tokens_total{tenant="a",kind="completion"} 40',
        'narwhal_tenant_refusals_total{tenant="a",reason="requests"} 2',
        'narwhal_tenant_refusals_total{tenant="unknown",reason="invalid_api_key"} 3',
        'narwhal_requests_total{route="/v1/completions",status="200",model="m"} 14',
    ])
    view = tenants_view(text, auth=True)
    assert [row.tenant for row in view.tenants] == ["b", "a", "unknown"]
    a = view.tenants[1]
    assert (a.requests, a.errors, a.prompt_tokens, a.completion_tokens, a.refusals) == (7, 2, 100, 40,
                                                                                    {"requests": 2})
    assert tenants_view(text, auth=True, limit=1).tenants[0].tenant == "b"


async def test_each_worker_process_enforces_its_share_of_a_limit(tmp_path) -> None:
    from narwhal.config import parse_config
    from narwhal.router import Router

    (tmp_path / "keys.toml").write_text(f'[[keys]]\nname = "alpha"\nsha256 = "{"a" * 64}"\nrequests_per_minute = 60\n')
    config = parse_config(f"""
[serving]
workers = 2
policy = "bounded"
max_queue = 32
[auth]
keys_file = "keys.toml"
reserve_high = 0.25
[handoff]
path = "{tmp_path / 'handoff.json'}"
[[engines]]
name = "p1"
url = "http://127.0.0.1:9001"
role = "prefill"
[[engines]]
name = "d1"
url = "http://127.0.0.1:9002"
role = "decode"
""")
    router = Router(config, config_dir=tmp_path)
    settings = router._auth_settings()
    assert settings is not None and settings.share == 0.5
    assert (settings.reserve_high, settings.max_queue) == (0.25, 32)
    assert [key.name for key in settings.keys or []] == ["alpha"]
    # The keys travel in every worker's snapshot.
    assert router.hub._content()[1].auth == settings
    await router.control_pool.aclose()


def test_a_bad_keys_file_stops_the_start_naming_the_key(tmp_path) -> None:
    from narwhal.config import ConfigError, parse_config
    from narwhal.router import Router

    (tmp_path / "keys.toml").write_text('[[keys]]\nname = "alpha"\nsha256 = "nothex"\n')
    config = parse_config('[auth]\nkeys_file = "keys.toml"\n[[engines]]\nname = "p1"\n'
                          'url = "http://127.0.0.1:9001"\nrole = "prefill"\n[[engines]]\nname = "d1"\n'
                          'url = "http://127.0.0.1:9002"\nrole = "decode"\n')
    with pytest.raises(ConfigError, match=r"auth\.keys_file: .*keys\[0\]\.sha256"):
        Router(config, config_dir=tmp_path)


def test_saturate_without_a_reserve_takes_no_gate_slot_and_reads_no_clock_for_a_tenant_without_limits() -> None:
    # The data pool refuses a full pool itself (pool_saturated, retry-after): the gate would only repeat it.
    plain, limited = entry("p", "k-p"), entry("l", "k-l", requests_per_minute=60)
    reads: list[int] = []

    def clock() -> float:
        reads.append(1)
        return 0.0

    client = ClientAuth(AuthSettings(keys=[plain, limited], max_queue=8), capacity=1, bounded=False, clock=clock)
    held = [client.admit_now(plain) for _ in range(3)]  # beyond capacity 1: the pool, not the gate, bounds it
    assert all(admitted.ticket is None and not admitted.limited for admitted in held)
    assert client.gate.stats()["normal"]["in_use"] == 0
    for admitted in held:
        client.finish(admitted, tokens=40)
    assert reads == []
    # A tenant with a limit takes it (and reads the clock); its concurrency comes back at finish.
    taken = client.admit_now(limited)
    assert taken.limited and reads
    assert client.limits.in_flight("l") == 1
    client.finish(taken, tokens=0)
    assert client.limits.in_flight("l") == 0


def test_a_reload_adding_a_reserve_gates_new_requests_and_one_admitted_before_leaves_nothing_behind() -> None:
    normal = entry("n", "k-n")
    client = auth(normal, capacity=4)
    before = client.admit_now(normal)
    assert before.ticket is None
    client.configure(AuthSettings(keys=[normal], reserve_high=0.25, max_queue=8))
    after = client.admit_now(normal)
    assert after.ticket is not None
    client.finish(before, tokens=0)  # held no ticket: gives none back
    assert client.gate.stats()["normal"]["in_use"] == 1
    client.finish(after, tokens=0)
    assert client.gate.stats()["normal"]["in_use"] == 0


def test_an_admission_that_holds_nothing_is_one_shared_object_and_a_removed_key_still_gets_its_own() -> None:
    plain, limited = entry("p", "k-p"), entry("l", "k-l", max_concurrent=2)
    client = auth(plain, limited)
    first, second = client.admit_now(plain), client.admit_now(plain)
    # No ticket, no limit taken: nothing for finish to give back, so nothing new per request.
    assert first is second and first.key is plain
    client.finish(first, tokens=10)
    assert (first.ticket, first.limited, first.queue_wait_s) == (None, False, 0.0)
    # A tenant with a limit holds its own (finish gives its concurrency back once).
    taken = [client.admit_now(limited) for _ in range(2)]
    assert taken[0] is not taken[1] and all(admitted.limited for admitted in taken)
    # Looked up before a reload removed it: admitted once more, with an admission of its own (no KeyError).
    client.configure(AuthSettings(keys=[limited], max_queue=8))
    gone = client.admit_now(plain)
    assert gone.key is plain and gone is not first
    # A reload that changes the entry of a name: the new entry's admission, never the old one's.
    changed = entry("l", "k-l")
    client.configure(AuthSettings(keys=[changed], max_queue=8))
    assert client.admit_now(changed).key is changed


def test_a_connections_memo_skips_the_hash_for_its_key_again_but_never_outlives_a_reload(monkeypatch) -> None:
    hashed: list[bytes] = []
    real = keys_module._sha256

    def counting(data: bytes = b"") -> object:
        hashed.append(data)
        return real(data)

    monkeypatch.setattr(keys_module, "_sha256", counting)
    alpha, beta = entry("alpha", "k-alpha"), entry("beta", "k-beta")
    client = auth(alpha, beta)
    memo = KeyMemo()
    assert client.identify(b"Bearer k-alpha", memo) == alpha
    assert client.identify(b"Bearer k-alpha", memo) == alpha
    assert hashed == [b"k-alpha"]  # the second request on the connection: no hash
    # Another key on the same connection is looked up (and remembered instead); a wrong one is refused.
    assert client.identify(b"Bearer k-beta", memo) == beta
    for header in (b"Bearer k-alphb", b"Bearer k-bet", None):
        with pytest.raises(AuthRefused):
            client.identify(header, memo)
    assert client.identify(b"Bearer k-beta", memo) == beta
    # A refused header leaves the memo as it was: beta again costs no hash.
    assert hashed == [b"k-alpha", b"k-beta", b"k-alphb", b"k-bet"]
    # A reload that removes the key refuses it at once, memo or not.
    client.configure(AuthSettings(keys=[alpha], max_queue=8))
    with pytest.raises(AuthRefused) as refused:
        client.identify(b"Bearer k-beta", memo)
    assert refused.value.status == 401


def test_the_memo_compares_the_header_in_constant_time(monkeypatch) -> None:
    compared: list[tuple[bytes, bytes]] = []
    real = client_auth_module.hmac.compare_digest

    def spy(a, b):  # type: ignore[no-untyped-def]
        compared.append((a, b))
        return real(a, b)

    client = auth(entry("alpha", "k-alpha"))
    memo = KeyMemo()
    client.identify(b"Bearer k-alpha", memo)
    monkeypatch.setattr(client_auth_module.hmac, "compare_digest", spy)
    client.identify(b"Bearer k-alpha", memo)
    assert compared == [(b"Bearer k-alpha", b"Bearer k-alpha")]
