"""Every file path in the config is resolved one way: ``~`` expanded, relative to the config file's directory."""

from pathlib import Path

import pytest

from narwhal.config import ConfigError, load_config, parse_config, resolve_config_path
from narwhal.lease import FileLeaseBackend, build_backend
from narwhal.tls import TLSContexts
from tests.test_config import GOOD


@pytest.mark.parametrize(("path", "config_dir", "expected"), [
    ("key.pem", Path("/etc/narwhal"), Path("/etc/narwhal/key.pem")),
    ("sub/key.pem", Path("/etc/narwhal"), Path("/etc/narwhal/sub/key.pem")),
    ("/abs/key.pem", Path("/etc/narwhal"), Path("/abs/key.pem")),
    ("~/key.pem", Path("/etc/narwhal"), Path("/home/op/key.pem")),
    ("key.pem", None, Path("key.pem")),
])
def test_resolve_config_path(monkeypatch, path, config_dir, expected) -> None:
    monkeypatch.setenv("HOME", "/home/op")
    assert resolve_config_path(path, config_dir) == expected


def test_every_path_key_uses_the_config_files_directory_and_expands_home(tmp_path, monkeypatch) -> None:
    home, conf = tmp_path / "home", tmp_path / "conf"
    home.mkdir()
    conf.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)  # not the config's directory: nothing may be read from here
    (home / "fleet.key").write_text("home-key\n")
    (conf / "local.key").write_text("conf-key\n")
    text = ('[fleet]\nattestation_key_file = "~/fleet.key"\n[handoff]\npath = "state/handoff.json"\n'
            '[lease]\nbackend = "file"\npath = "~/lease.json"\n' + GOOD)
    (conf / "narwhal.toml").write_text(text)
    config = load_config(str(conf / "narwhal.toml"))
    assert config.attestation_key_bytes(conf) == b"home-key"
    assert config.handoff_path(conf) == conf / "state" / "handoff.json"
    backend = build_backend(config, config.handoff_path(conf), conf)
    assert isinstance(backend, FileLeaseBackend) and Path(backend.path) == home / "lease.json"
    relative = parse_config(text.replace("~/fleet.key", "local.key"), source=str(conf / "narwhal.toml"))
    assert relative.attestation_key_bytes(conf) == b"conf-key"
    # TLS files too: a missing one is named with the resolved path.
    with pytest.raises(ConfigError, match=str(home / "missing-ca.pem")):
        TLSContexts(parse_config('[engine]\ntls_ca_file = "~/missing-ca.pem"\n' + GOOD), conf)
