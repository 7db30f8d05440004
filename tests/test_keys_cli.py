"""``narwhal keys add|list``: the key printed once, only its digest stored, other entries kept, never a key listed."""

from __future__ import annotations

import os
import re
import stat

import pytest

from narwhal.auth.keys import KeyEntry, KeyStore, hash_key, read_keys_file
from narwhal.cli import main


def run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_add_and_list_round_trip(tmp_path, capsys):
    path = tmp_path / "keys.toml"
    code, out, err = run(capsys, "keys", "add", "--file", str(path), "team-a", "--models", "m1", "alias-2",
                         "--priority", "high", "--rpm", "60", "--tpm", "100000", "--max-concurrent", "8")
    assert code == 0, err
    key = out.strip()
    assert re.fullmatch(r"nwk-[A-Za-z0-9_-]{43}", key) and out == key + "\n"
    assert err.count("\n") == 1 and "shown once" in err and "sha256" in err and key not in err
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    text = path.read_text()
    assert key not in text and hash_key(key) in text
    assert read_keys_file(path).keys == [KeyEntry(name="team-a", sha256=hash_key(key), models=["m1", "alias-2"],
                                                  priority="high", requests_per_minute=60, tokens_per_minute=100000,
                                                  max_concurrent=8)]
    # The printed key is the one the router will find.
    assert KeyStore(read_keys_file(path).keys).lookup(f"Bearer {key}".encode()).name == "team-a"

    code, out2, err = run(capsys, "keys", "add", "--file", str(path), "b")
    assert code == 0, err
    second = out2.strip()
    assert second != key
    assert path.read_text().startswith(text)  # the first entry as it was
    assert [e.name for e in read_keys_file(path).keys] == ["team-a", "b"]

    code, listing, err = run(capsys, "keys", "list", "--file", str(path))
    assert code == 0 and err == ""
    assert key not in listing and second not in listing and hash_key(key) not in listing
    lines = listing.splitlines()
    assert lines[0].split() == ["NAME", "PRIORITY", "MODELS", "RPM", "TPM", "MAX", "CONCURRENT", "SHA256"]
    assert lines[1].split() == ["team-a", "high", "m1,alias-2", "60", "100000", "8", hash_key(key)[:12]]
    assert lines[2].split() == ["b", "normal", "all", "-", "-", "-", hash_key(second)[:12]]


def test_a_duplicate_name_is_refused_and_changes_nothing(tmp_path, capsys):
    path = tmp_path / "keys.toml"
    assert run(capsys, "keys", "add", "--file", str(path), "a")[0] == 0
    before = path.read_bytes()
    code, out, err = run(capsys, "keys", "add", "--file", str(path), "a", "--rpm", "5")
    assert (code, out) == (2, "")
    assert err == f"narwhal keys: {path}: a key named 'a' already exists\n"
    assert path.read_bytes() == before


def test_comments_and_hand_written_entries_are_kept(tmp_path, capsys):
    path = tmp_path / "keys.toml"
    hand = f'# the team\'s key\n[[keys]]\nname = "x"\nsha256 = "{"A" * 64}"  # rotated in May\n'
    path.write_text(hand)
    path.chmod(0o640)
    assert run(capsys, "keys", "add", "--file", str(path), "y")[0] == 0
    assert path.read_text().startswith(hand)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640  # an existing file keeps its mode
    assert [e.name for e in read_keys_file(path).keys] == ["x", "y"]


def test_an_inline_array_is_rewritten_whole(tmp_path, capsys):
    path = tmp_path / "keys.toml"
    path.write_text(f'keys = [{{name = "x", sha256 = "{"b" * 64}", models = ["q\\"\\u007f"]}}]\n')
    assert run(capsys, "keys", "add", "--file", str(path), "y")[0] == 0
    keys = read_keys_file(path).keys
    assert [e.name for e in keys] == ["x", "y"] and keys[0].models == ['q"\x7f']


@pytest.mark.parametrize(("content", "argv", "expected"), [
    ('[[keys]]\nname = "a"\nsha256 = "xyz"\n', ["list"], "keys[0].sha256: must be 64 hex digits"),
    ('[[keys]]\nname = "a"\nsha256 = "xyz"\n', ["add", "b"], "keys[0].sha256: must be 64 hex digits"),
    ("keys = [", ["list"], "not valid TOML"),
    (None, ["list"], "cannot read keys file"),
])
def test_a_bad_keys_file_is_one_line_and_exit_2(tmp_path, capsys, content, argv, expected):
    path = tmp_path / "keys.toml"
    if content is not None:
        path.write_text(content)
    action, *rest = argv
    code, out, err = run(capsys, "keys", action, "--file", str(path), *rest)
    assert (code, out) == (2, "")
    assert err.startswith(f"narwhal keys: {path}: {expected}") and err.count("\n") == 1, err
    assert content is None or path.read_text() == content


@pytest.mark.parametrize(("argv", "expected"), [
    (["bad name"], "narwhal keys: name: must be 1 to 64 letters"),
    (["a", "--rpm", "0"], "narwhal keys add: --rpm: expected a whole number > 0, got '0'"),
    (["a", "--max-concurrent", "x"], "narwhal keys add: --max-concurrent: expected a whole number > 0"),
    (["a", "--priority", "urgent"], "narwhal keys add: --priority: invalid choice: 'urgent'"),
])
def test_bad_arguments_are_one_line_and_exit_2_and_write_nothing(tmp_path, capsys, argv, expected):
    path = tmp_path / "keys.toml"
    code, out, err = run(capsys, "keys", "add", "--file", str(path), *argv)
    assert (code, out) == (2, "")
    assert err.startswith(expected) and err.count("\n") == 1, err
    assert not path.exists()
