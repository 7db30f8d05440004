"""The keys file (every problem named by entry and key) and the lookup of an Authorization header."""

from __future__ import annotations

import hashlib
import re

import pytest

import narwhal.auth.keys as keys_module
from narwhal.auth.keys import KeyEntry, KeyStore, hash_key, new_key, parse_keys_file, read_keys_file
from narwhal.config import ConfigError

H = "a" * 64


def entry_toml(**fields: object) -> str:
    lines = ["[[keys]]"]
    for key, value in fields.items():
        lines.append(f"{key} = {value}")
    return "\n".join(lines) + "\n"


def test_a_full_entry_and_the_defaults():
    text = (entry_toml(name='"team-a"', sha256=f'"{H.upper()}"', models='["m1", "alias"]', priority='"high"',
                       requests_per_minute=60, tokens_per_minute=1000, max_concurrent=4)
            + entry_toml(name='"b.2_x"', sha256=f'"{"b" * 64}"'))
    keys = parse_keys_file(text, "k.toml").keys
    assert keys[0] == KeyEntry(name="team-a", sha256=H, models=["m1", "alias"], priority="high",
                               requests_per_minute=60, tokens_per_minute=1000, max_concurrent=4)
    assert keys[0].sha256 == H  # stored lowercase
    assert keys[1] == KeyEntry(name="b.2_x", sha256="b" * 64)
    assert (keys[1].models, keys[1].priority, keys[1].requests_per_minute, keys[1].tokens_per_minute,
            keys[1].max_concurrent) == (None, "normal", None, None, None)
    assert parse_keys_file("").keys == []


@pytest.mark.parametrize(("second", "expected"), [
    ({"sha256": '"xyz"'}, "keys[1].sha256: must be 64 hex digits"),
    ({"sha256": f'"{"g" * 64}"'}, "keys[1].sha256: must be 64 hex digits"),
    ({"sha256": f'"{"a" * 63}"'}, "keys[1].sha256: must be 64 hex digits"),
    ({"name": '"a b"'}, "keys[1].name: must be 1 to 64 letters, digits"),
    ({"name": '""'}, "keys[1].name: must be 1 to 64"),
    ({"name": f'"{"n" * 65}"'}, "keys[1].name: must be 1 to 64"),
    ({"name": '"tenant\\u00e9"'}, "keys[1].name: must be 1 to 64"),
    ({"priority": '"urgent"'}, 'keys[1].priority: must be one of "high", "normal", "low"'),
    ({"prioriti": '"high"'}, "keys[1].prioriti: unknown key (did you mean 'priority'?)"),
    ({"requests_per_minute": 0}, "keys[1].requests_per_minute: must be > 0, got 0"),
    ({"tokens_per_minute": -5}, "keys[1].tokens_per_minute: must be > 0, got -5"),
    ({"max_concurrent": 0}, "keys[1].max_concurrent: must be > 0, got 0"),
    ({"max_concurrent": 1.5}, "keys[1].max_concurrent: Expected `int | null`, got `float`"),
    ({"requests_per_minute": "true"}, "keys[1].requests_per_minute: Expected `int | null`, got `bool`"),
    ({"models": "[]"}, "keys[1].models: must not be empty"),
    ({"models": '["m", ""]'}, "keys[1].models: a model name must not be empty"),
    ({"name": '"first"'}, "keys[1].name: 'first' is also keys[0]'s name"),
    ({"sha256": f'"{"F" * 64}"'}, "keys[1].sha256: the same as keys[0]'s"),
])
def test_every_problem_names_the_file_the_entry_and_the_key(second, expected):
    fields = {"name": '"second"', "sha256": f'"{"c" * 64}"'} | second
    text = entry_toml(name='"first"', sha256=f'"{"f" * 64}"') + entry_toml(**fields)
    with pytest.raises(ConfigError) as info:
        parse_keys_file(text, "keys.toml")
    assert str(info.value).startswith(f"keys.toml: {expected}"), str(info.value)


def test_a_missing_field_an_unknown_section_and_bad_toml():
    for text, expected in [(entry_toml(name='"a"'), "k.toml: keys[0]: Object missing required field `sha256`"),
                           ("keyz = 1", "k.toml: keyz: unknown key (did you mean 'keys'?)"),
                           ("keys = [", "k.toml: not valid TOML")]:
        with pytest.raises(ConfigError, match=re.escape(expected)):
            parse_keys_file(text, "k.toml")


def test_read_keys_file_is_bounded_and_names_the_path(tmp_path):
    path = tmp_path / "keys.toml"
    with pytest.raises(ConfigError, match=f"^{re.escape(str(path))}: cannot read keys file"):
        read_keys_file(path)
    path.write_text(entry_toml(name='"a"', sha256=f'"{H}"'))
    assert [e.name for e in read_keys_file(path).keys] == ["a"]
    with path.open("ab") as f:
        f.write(b"#" * (4 << 20))
    with pytest.raises(ConfigError, match="over the 4194304 byte bound"):
        read_keys_file(path)
    with pytest.raises(ConfigError, match="not a regular file"):
        read_keys_file(tmp_path)


def test_new_keys_and_their_digests():
    key = new_key()
    assert re.fullmatch(r"nwk-[A-Za-z0-9_-]{43}", key)
    assert new_key() != key
    assert hash_key(key) == hashlib.sha256(key.encode()).hexdigest()


KEY = "nwk-" + "k" * 43
OTHER = "nwk-" + "o" * 43


@pytest.fixture
def store() -> KeyStore:
    return KeyStore([KeyEntry(name="alice", sha256=hash_key(KEY)),
                     KeyEntry(name="bob", sha256=hash_key(OTHER).upper())])


def test_lookup_finds_the_tenant_of_its_key(store):
    assert len(store) == 2
    assert store.lookup(f"Bearer {KEY}".encode()).name == "alice"
    assert store.lookup(f"Bearer {OTHER}".encode()).name == "bob"  # an uppercase digest in the file works
    # The scheme in any case; more than one space, and spaces around the value, as HTTP allows.
    for header in (f"bearer {KEY}", f"BEARER {KEY}", f"Bearer   {KEY}", f" Bearer {KEY} "):
        assert store.lookup(header.encode()).name == "alice", header


@pytest.mark.parametrize("header", [
    None, b"", b"Bearer", b"Bearer ", b"Bearer  ", KEY.encode(), f"Basic {KEY}".encode(), f"Bearer{KEY}".encode(),
    b"Bearer nwk-wrong", f"Bearer {KEY}x".encode(), f"Bearer {KEY} extra".encode(),
    "Bearer nwk-ключ".encode(), b"Bearer \xff\xfe", b"Bearer " + "é".encode("latin-1"),
])
def test_lookup_refuses_missing_malformed_and_unknown_keys(store, header):
    assert store.lookup(header) is None


def test_a_long_header_is_refused_without_hashing(store, monkeypatch):
    hashed = []
    real = keys_module._sha256

    def counting(data: bytes = b"") -> object:
        hashed.append(len(data))
        return real(data)

    monkeypatch.setattr(keys_module, "_sha256", counting)
    assert store.lookup(b"Bearer " + b"k" * 10_000) is None
    assert store.lookup(b"Bearer " + b"k" * 513) is None
    assert hashed == []
    # At the bound it is hashed (and unknown); a right key is one hash.
    assert store.lookup(b"Bearer " + b"k" * 512) is None
    assert store.lookup(f"Bearer {KEY}".encode()).name == "alice"
    assert hashed == [512, len(KEY)]


def test_the_fast_and_general_header_paths_agree(store):
    # "Bearer KEY" as clients send it takes the path without a method call; spaces, tabs or another case take
    # the general one: either finds the same tenant, and neither accepts a key the other refuses.
    for header in (f"Bearer {KEY}", f"Bearer \t{KEY}", f"Bearer {KEY}\t", f"Bearer {KEY} ", f"bEaReR {KEY}",
                   f"\tBearer {KEY}"):
        assert store.lookup(header.encode()).name == "alice", header
    for header in (f"Bearer {KEY[:-1]}", f"Bearer {KEY}{KEY}", f"Bearer\t{KEY}", "Bearer \t", "Bearer \t "):
        assert store.lookup(header.encode()) is None, header


def test_the_key_hash_is_sha256():
    # CPython's own SHA-256 where it has one (faster than OpenSSL's for a key): the digest hashlib gives.
    for data in (b"", b"nwk-" + b"k" * 43, bytes(range(256)) * 3):
        assert keys_module._sha256(data).hexdigest() == hashlib.sha256(data).hexdigest()


def test_the_digest_is_compared_in_constant_time(store, monkeypatch):
    compared = []
    real = keys_module.hmac.compare_digest

    def spy(a, b):
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(keys_module.hmac, "compare_digest", spy)
    assert store.lookup(f"Bearer {KEY}".encode()).name == "alice"
    assert compared == [(hash_key(KEY), hash_key(KEY))]
