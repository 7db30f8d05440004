"""The command line's own surface: --version, help for every option, one-line usage errors, missing dependencies."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from narwhal import __version__
from narwhal.cli import _build_parser, main
from narwhal.tools.bench.cli import build_parser as build_bench_parser
from narwhal.tools.mock.engine import build_parser as build_mock_parser


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"narwhal {__version__}\n"


def _parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_every_option_of_every_command_has_help():
    bench = argparse.ArgumentParser(prog="narwhal bench")
    build_bench_parser(bench)
    parsers = [*_parsers(_build_parser()), build_mock_parser(argparse.ArgumentParser(prog="narwhal mock-engine")),
               bench]
    missing = [f"{parser.prog} {action.option_strings[0]}" for parser in parsers for action in parser._actions
               if action.option_strings and not action.help]
    assert missing == []


@pytest.mark.parametrize(("argv", "expected"), [
    (["serve", "--config", "x.toml", "--listen", "http://127.0.0.1:8000"],
     "narwhal serve: --listen: expected HOST:PORT without a scheme, got 'http://127.0.0.1:8000' "
     "(try '127.0.0.1:8000')"),
    (["demo", "--listen", "https://0.0.0.0:8000/"],
     "narwhal demo: --listen: expected HOST:PORT without a scheme, got 'https://0.0.0.0:8000/' (try '0.0.0.0:8000')"),
    (["admin", "--url", "127.0.0.1:8000", "engines"],
     "narwhal admin: --url: expected http://HOST:PORT or https://HOST:PORT, got '127.0.0.1:8000' "
     "(try 'http://127.0.0.1:8000')"),
    (["admin", "engines", "--url", "localhost:8000"],
     "narwhal admin engines: --url: expected http://HOST:PORT or https://HOST:PORT, got 'localhost:8000' "
     "(try 'http://localhost:8000')"),
    (["bench", "--target", "127.0.0.1:8000"],
     "narwhal bench: --target: expected http://HOST:PORT or https://HOST:PORT, got '127.0.0.1:8000' "
     "(try 'http://127.0.0.1:8000')"),
    (["mock-engine", "--role", "decoder"],
     "narwhal mock-engine: --role: invalid choice: 'decoder' (choose from 'prefill', 'decode')"),
])
def test_a_bad_address_is_one_usage_line_and_exit_2(capsys, argv, expected):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err == f"{expected} (see {expected.split(': ')[0]} --help)\n"


# A python whose `import trio` fails, as in a venv where narwhal was installed with --no-deps.
_WITHOUT_TRIO = """
import sys
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name == "trio" or name.startswith("trio."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Blocker())
from narwhal.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("argv", [["--help"], ["engine-check", "http://127.0.0.1:9"], ["mock-engine", "--help"]])
def test_a_missing_dependency_is_one_line_naming_it(argv):
    result = subprocess.run([sys.executable, "-c", _WITHOUT_TRIO, *argv], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr == ("narwhal: missing dependency 'trio': install narwhal with its dependencies "
                             "(pip install narwhal, not --no-deps)\n")


def test_a_mock_engine_on_a_taken_port_is_one_line_and_exit_2():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "narwhal", "mock-engine", "--role", "decode",
                                 "--port", str(port)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert "Traceback" not in result.stderr
    assert lines[-1] == f"narwhal mock-engine: cannot listen on 127.0.0.1:{port}: Address already in use"
    # Besides the line, only the JSON log event.
    assert len(lines) == 2 and '"event":"mock_engine_error"' in lines[0]
