"""Config decoding: defaults, and every bad case gets one message naming the key."""

import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import msgspec
import pytest

from narwhal.config import Config, ConfigError, default_handoff_path, load_config, parse_config

ROOT = Path(__file__).resolve().parent.parent

GOOD = """
[[engines]]
name = "p1"
url = "http://127.0.0.1:9001"
role = "prefill"

[[engines]]
name = "d1"
url = "http://127.0.0.1:9002"
role = "decode"
"""


def test_minimal_config_gets_documented_defaults():
    config = parse_config(GOOD)
    assert config.serving.listen == "127.0.0.1:8000"
    assert config.serving.max_connections == 256
    assert config.serving.policy == "saturate"
    assert config.engine.control_connections == 16
    assert config.recovery.failure_quarantine_s is None
    assert config.lease.backend == "none"
    assert config.admin.token is None and config.admin.listen is None
    assert [e.name for e in config.engines] == ["p1", "d1"]


def test_example_file_spells_out_exactly_the_defaults():
    config = load_config(ROOT / "examples" / "narwhal.toml")
    assert config == Config(engines=config.engines, fleet=config.fleet)


def _schema_keys() -> dict[str, list[str]]:
    """Each section of the config schema (``engines`` for ``[[engines]]``) with its keys."""
    sections: dict[str, list[str]] = {}
    for field in msgspec.structs.fields(Config):
        kind = typing.get_args(field.type)[0] if typing.get_origin(field.type) is list else field.type
        sections[field.name] = [f.name for f in msgspec.structs.fields(kind)]
    return sections


def _example_keys() -> dict[str, set[str]]:
    """The keys the example names in each section: set, or shown in a comment as ``# key = value``."""
    named: dict[str, set[str]] = {}
    section = ""
    for line in (ROOT / "examples" / "narwhal.toml").read_text().splitlines():
        header = re.fullmatch(r"\[\[?([a-z_]+)\]\]?", line.strip())
        if header:
            section = header.group(1)
            continue
        key = re.match(r"#? ?([a-z_]+) = ", line)
        if key and section:
            named.setdefault(section, set()).add(key.group(1))
    return named


def test_example_file_names_every_key_of_the_schema():
    # "Every key, with its default": a key added to the schema is added to the example too.
    named = _example_keys()
    missing = [f"{section}.{key}" for section, keys in _schema_keys().items() for key in keys
               if key not in named.get(section, set())]
    assert missing == []


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ('[serving]\nlisen = "x"\n', "serving.lisen: unknown key"),
        ("[servng]\n", "servng: unknown key"),
        ('[serving]\nmax_connections = "many"\n', "serving.max_connections: Expected `int`, got `str`"),
        ("[serving]\nmax_connections = 0\n", "serving: max_connections must be > 0"),
        ('[serving]\nlisten = "nowhere"\n', "serving.listen: expected HOST:PORT"),
        ('[serving]\nlisten = "127.0.0.1:99999"\n', "serving.listen: port out of range in '127.0.0.1:99999'"),
        ('[serving]\npolicy = "yolo"\n', """serving.policy: must be one of "saturate", "bounded"; got 'yolo'"""),
        ('[lease]\nbackend = "zk"\n', """lease.backend: must be one of "none", "file", "etcd"; got 'zk'"""),
        ("[recovery]\neject_after = -1\n", "recovery: eject_after must be > 0"),
        ('[lease]\nbackend = "file"\n', "lease.path is required"),
        ('[admin]\nlisten = "x"\n', "admin.listen: expected HOST:PORT"),
    ],
)
def test_bad_values_name_the_key(extra, expected):
    with pytest.raises(ConfigError) as info:
        parse_config(GOOD + extra, "n.toml")
    assert str(info.value).startswith("n.toml: ")
    assert expected in str(info.value)


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ("[serving]\nworkrs = 2\n", "n.toml: serving.workrs: unknown key (did you mean 'workers'?)"),
        ("[servng]\n", "n.toml: servng: unknown key (did you mean 'serving'?)"),
        ("[serving]\nzzzz = 1\n", "n.toml: serving.zzzz: unknown key"),
    ],
)
def test_an_unknown_key_suggests_a_close_one(extra, expected):
    with pytest.raises(ConfigError) as info:
        parse_config(GOOD + extra, "n.toml")
    assert str(info.value) == expected


def test_duplicate_engine_name():
    with pytest.raises(ConfigError, match=r"engines\[1\]\.name: duplicate engine name 'p1'"):
        parse_config(GOOD.replace('"d1"', '"p1"'))


@pytest.mark.parametrize("missing", ["prefill", "decode"])
def test_each_role_is_required(missing):
    other = "decode" if missing == "prefill" else "prefill"
    text = GOOD.replace(f'role = "{missing}"', f'role = "{other}"')
    with pytest.raises(ConfigError, match=f"no {missing} engine configured"):
        parse_config(text)


@pytest.mark.parametrize("url", ["ftp://127.0.0.1:1", "http://", "http://h:99999", "http://h:1/v1", "nonsense"])
def test_bad_engine_urls(url):
    with pytest.raises(ConfigError, match='engine "p1": url '):
        parse_config(GOOD.replace("http://127.0.0.1:9001", url, 1))


def test_engine_messages_name_the_engine_and_list_the_allowed_roles():
    with pytest.raises(ConfigError) as info:
        parse_config(GOOD.replace('role = "decode"', 'role = "decoder"'), "n.toml")
    assert str(info.value) == """n.toml: engine "d1".role: must be one of "prefill", "decode"; got 'decoder'"""
    with pytest.raises(ConfigError) as info:
        parse_config(GOOD.replace('role = "decode"', 'role = "decode"\nweight = 2'), "n.toml")
    assert str(info.value) == 'n.toml: engine "d1".weight: unknown key'


def test_an_engine_without_a_usable_name_keeps_its_index():
    # Two engines named p1: the name does not say which one.
    with pytest.raises(ConfigError, match=r"engines\[1\]\.role: must be one of"):
        parse_config(GOOD.replace('"d1"', '"p1"').replace('role = "decode"', 'role = "decoder"'))


def test_bad_role():
    with pytest.raises(ConfigError, match=r'engine "p1"\.role: must be one of "prefill", "decode"; got \'both\''):
        parse_config(GOOD.replace('role = "prefill"', 'role = "both"'))


def test_not_toml():
    with pytest.raises(ConfigError, match="not valid TOML"):
        parse_config("[serving\n")


def test_unreadable_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "absent.toml")


def test_attestation_key_file_is_read_relative_to_config(tmp_path):
    (tmp_path / "key").write_text("sekrit\n")
    path = tmp_path / "n.toml"
    path.write_text('[fleet]\nattestation_key_file = "key"\n' + GOOD)
    config = load_config(path)
    assert config.attestation_key_bytes(tmp_path) == b"sekrit"
    path.write_text('[fleet]\nattestation_key_file = "nokey"\n' + GOOD)
    with pytest.raises(ConfigError, match="fleet.attestation_key_file: cannot read"):
        load_config(path)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (GOOD + "[serving]\nbogus = 1\n", "serving.bogus: unknown key"),
        (GOOD.replace('"d1"', '"p1"'), "duplicate engine name"),
        ("[serving\n", "not valid TOML"),
        (None, "cannot read config file"),
    ],
)
def test_serve_exits_nonzero_with_one_line_and_no_traceback(tmp_path, text, expected):
    path = tmp_path / "narwhal.toml"
    if text is not None:
        path.write_text(text)
    result = subprocess.run([sys.executable, "-m", "narwhal", "serve", "--config", str(path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("narwhal: config error: ")
    assert expected in lines[0]


# ----- [handoff] path (issue 10, rule 7) -----

def test_the_default_handoff_path_is_in_the_xdg_state_directory() -> None:
    assert default_handoff_path({"XDG_STATE_HOME": "/var/lib/me", "HOME": "/home/me"}) == Path(
        "/var/lib/me/narwhal/narwhal-handoff.json")


@pytest.mark.parametrize("state", [None, "", "relative/state"])
def test_without_a_usable_xdg_state_home_the_handoff_goes_under_home(state: str | None) -> None:
    env = {"HOME": "/home/me"} if state is None else {"HOME": "/home/me", "XDG_STATE_HOME": state}
    assert default_handoff_path(env) == Path("/home/me/.local/state/narwhal/narwhal-handoff.json")


def test_the_handoff_path_is_never_relative_to_the_working_directory(tmp_path: Path) -> None:
    config = parse_config(GOOD)
    assert config.handoff.path is None
    assert config.handoff_path(env={"XDG_STATE_HOME": str(tmp_path)}) == (
        tmp_path / "narwhal" / "narwhal-handoff-127.0.0.1-8000.json")
    named = parse_config(GOOD + '\n[handoff]\npath = "state/h.json"\n')
    assert named.handoff_path(Path("/etc/narwhal")) == Path("/etc/narwhal/state/h.json")
    absolute = parse_config(GOOD + '\n[handoff]\npath = "/srv/h.json"\n')
    assert absolute.handoff_path(Path("/etc/narwhal")) == Path("/srv/h.json")


def test_the_default_handoff_is_each_routers_own() -> None:
    # Two routers on one host never share the default file (one used to rewrite the other's).
    env = {"XDG_STATE_HOME": "/state"}
    plain = parse_config(GOOD)
    assert plain.handoff_path(env=env) == Path("/state/narwhal/narwhal-handoff-127.0.0.1-8000.json")
    assert plain.handoff_path(env=env, listen="127.0.0.1:8010") == Path(
        "/state/narwhal/narwhal-handoff-127.0.0.1-8010.json")
    assert plain.handoff_path(env=env, listen="[::1]:8010") == Path("/state/narwhal/narwhal-handoff-__1-8010.json")
    named = parse_config(GOOD + '\n[lease]\nbackend = "etcd"\nrouter_id = "../router a"\n'
                                'endpoints = ["http://127.0.0.1:2379"]\n')
    assert named.handoff_path(env=env) == Path("/state/narwhal/narwhal-handoff-_router_a.json")
    # Port 0: no stable address, so the process names it; two such routers still differ.
    ephemeral = plain.handoff_path(env=env, listen="127.0.0.1:0")
    assert ephemeral.name.endswith(f"-{os.getpid()}.json") and ephemeral != plain.handoff_path(env=env)


def test_a_file_lease_pair_shares_the_default_handoff_beside_the_lease() -> None:
    text = GOOD + '\n[lease]\nbackend = "file"\nrouter_id = "{}"\npath = "state/lease.json"\n'
    a, b = parse_config(text.format("router-a")), parse_config(text.format("router-b"))
    assert a.handoff_path(Path("/etc/narwhal")) == Path("/etc/narwhal/state/lease.handoff.json")
    assert b.handoff_path(Path("/etc/narwhal")) == a.handoff_path(Path("/etc/narwhal"))


def test_an_empty_handoff_path_is_a_config_error_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"^<config>: handoff: path must not be empty"):
        parse_config(GOOD + '\n[handoff]\npath = ""\n')


def test_a_config_or_key_path_that_is_no_regular_file_is_refused_without_blocking(tmp_path):
    # A FIFO with no writer: a blocking read would wait for one forever.
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match=r"cannot read config file: not a regular file \(a FIFO\)"):
        load_config(fifo)
    config = tmp_path / "narwhal.toml"
    config.write_text(f'[fleet]\nattestation_key_file = "{fifo}"\n' + GOOD)
    with pytest.raises(ConfigError, match=r"fleet.attestation_key_file: .*not a regular file \(a FIFO\)"):
        load_config(config)


def test_a_config_file_over_one_mib_is_refused_naming_the_bound(tmp_path):
    config = tmp_path / "narwhal.toml"
    config.write_text(GOOD + "#" * (1024 * 1024) + "\n")
    with pytest.raises(ConfigError, match="over the 1048576 byte bound"):
        load_config(config)


@pytest.mark.parametrize("url", ["http://127.0.0.1:9002", "http://127.0.0.1:9002/", "HTTP://127.0.0.1:9002"])
def test_two_entries_for_one_engine_and_role_are_refused_naming_both(url):
    text = GOOD + f'\n[[engines]]\nname = "d2"\nurl = "{url}"\nrole = "decode"\n'
    with pytest.raises(ConfigError) as caught:
        parse_config(text, "narwhal.toml")
    message = str(caught.value)
    assert message.startswith('narwhal.toml: engine "d2".url: ') and 'engine "d1"' in message


def test_one_url_per_role_is_allowed_and_names_are_not_resolved():
    # An engine on kv_both may serve both roles; localhost and 127.0.0.1 are different strings (never resolved).
    text = GOOD + ('\n[[engines]]\nname = "pd"\nurl = "http://127.0.0.1:9002"\nrole = "prefill"\n'
                   '\n[[engines]]\nname = "d2"\nurl = "http://localhost:9002"\nrole = "decode"\n'
                   '\n[[engines]]\nname = "d3"\nurl = "https://127.0.0.1:9002"\nrole = "decode"\n')
    assert [e.name for e in parse_config(text).engines] == ["p1", "d1", "pd", "d2", "d3"]
    assert parse_config(text).engines[4].address == ("https", "127.0.0.1", 9002)


def test_an_uppercase_https_scheme_is_tls_with_its_default_port():
    text = GOOD.replace("http://127.0.0.1:9002", "HTTPS://Engine.example")
    spec = parse_config(text).engine_spec("d1")
    assert spec.tls and spec.port == 443 and spec.address == ("https", "engine.example", 443)
