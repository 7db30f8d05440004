"""The README's commands work as written on a fresh machine: console scripts, `.venv/bin/` throughout, CI = README."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

from narwhal.config import load_config, parse_config
from narwhal.router import Router, preflight
from tests.test_config import GOOD

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def readme_commands() -> list[str]:
    """The README's indented command lines and the commands in its tables."""
    indented = [line.strip() for line in README.splitlines() if line.startswith("    ") and line.strip()]
    tabled = re.findall(r"^\| `([^`]+)`", README, flags=re.MULTILINE)
    return [line for line in indented + tabled if not line.startswith(("curl", "narwhal:", "#"))]


def test_the_narwhal_console_script_is_declared_beside_narwhal_serve():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["narwhal"] == "narwhal.cli:main"
    assert scripts["narwhal-serve"] == "narwhal.cli:serve_main"


def test_every_readme_command_runs_from_the_venv_without_activating_it():
    commands = [c for c in readme_commands() if "narwhal" in c and not c.startswith(("from ", "client", "for ",
                                                                                      "print"))]
    assert len(commands) >= 8, commands
    for command in commands:
        for part in command.split("&&"):
            part = part.strip()
            if part.startswith("python3 -m venv"):
                continue
            assert part.startswith(".venv/bin/"), f"needs an activated venv: {command!r}"


def test_ci_runs_exactly_the_readme_test_command():
    install_and_test = [c for c in readme_commands() if "pytest" in c]
    assert len(install_and_test) == 1
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    # As written, then stopping CI at a failure of any of its steps.
    assert f"{install_and_test[0]} || exit 1" in ci
    # And the first command a newcomer runs is the demo through the console script.
    assert readme_commands()[0] == "python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/narwhal demo"


def test_the_vllm_guide_gives_each_engine_its_own_kv_role():
    # vLLM 0.32 logs kv_both as deprecated with NixlConnector.
    guide = (ROOT / "docs" / "vllm.md").read_text()
    # The walk-through's two engines (the several-models section adds a pool of its own, one role each too).
    walk_through = guide[:guide.index("### Several models behind one router")]
    commands = re.findall(r"```bash\n(.*?)```", walk_through, flags=re.DOTALL)
    serving = [c for c in commands if "vllm serve" in c and "--kv-transfer-config" in c]
    roles = [re.search(r'"kv_role":"(\w+)"', c).group(1) for c in serving]
    assert roles == ["kv_producer", "kv_consumer"]
    assert '"kv_role":"kv_both"' not in guide


def test_the_gpu_free_recipe_runs_narwhal_where_its_dependencies_are():
    guide = (ROOT / "docs" / "vllm.md").read_text()
    recipe = guide[guide.index("## Try it without a GPU"):guide.index("## Tested versions")]
    # Narwhal in the engines' venv is the plugin only (--no-deps): no router command may run there.
    assert "python -m narwhal" not in recipe
    router_venv = re.search(r"python3\.11 -m venv (\S+) && \1/bin/pip install /path/to/narwhal", recipe)
    assert router_venv is not None
    commands = re.findall(r"([^\s`]*narwhal) (?:engine-check|serve|admin)\b", recipe)
    assert commands and set(commands) == {f"{router_venv.group(1)}/bin/narwhal"}
    # All three engines in full, each with its id, port and role; and how to stop or crash one.
    engines = re.findall(r"NARWHAL_ENGINE_ID=(\w+) \\\n.*?--port (\d+) .*?\"kv_role\":\"(\w+)\"", recipe,
                         flags=re.DOTALL)
    assert engines == [("p1", "8100", "kv_producer"), ("d1", "8200", "kv_consumer"), ("d2", "8201", "kv_consumer")]
    assert "kill $(cat d1.pid)" in recipe and "NixlConnector" in recipe.split("**The engines**")[0]


def test_the_standby_recipe_polls_for_the_lease_instead_of_sleeping():
    # A standby says "lease not read yet" before its first read; a fixed sleep raced it.
    guide = (ROOT / "docs" / "operations.md").read_text()
    recipe = guide[guide.index("examples/standby-a.toml 2> a.log"):]
    recipe = recipe[:recipe.index("\n\n", recipe.index("kill -TERM $B"))]
    assert not re.search(r"^\s*sleep \d+\s*$", recipe, flags=re.MULTILINE)
    assert "| grep -q 'lease held by'" in recipe


EXAMPLES = sorted((ROOT / "examples").glob("*.toml"))


def test_every_example_starts_on_a_fresh_machine(tmp_path, monkeypatch):
    # No /var/lib/narwhal, nothing made by hand: a home directory is all an example may assume.
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    assert len(EXAMPLES) >= 3
    for example in EXAMPLES:
        config = load_config(example)
        handoff = config.handoff_path(example.parent, listen=config.serving.listen)
        preflight(config, config.serving.listen, handoff)
        assert handoff.is_relative_to(tmp_path), example
        if config.lease.path:
            assert Path(config.lease.path).expanduser().parent.is_dir(), example


def test_a_standby_pair_shares_its_handoff_and_lease():
    a, b = (load_config(ROOT / "examples" / f"standby-{x}.toml") for x in "ab")
    assert a.handoff_path(ROOT / "examples") == b.handoff_path(ROOT / "examples")
    assert a.lease.path == b.lease.path and a.lease.router_id != b.lease.router_id


def test_the_operations_recipe_starts_every_engine_the_examples_name():
    guide = (ROOT / "docs" / "operations.md").read_text()
    recipe = guide.split("### Trying it on one host", 1)[1].split("\n## ", 1)[0]
    started = set(re.findall(r"narwhal mock-engine --port (\d+) --role (\w+) --engine-id (\w+)", recipe))
    needed = {(str(e.port), e.role, e.name) for example in EXAMPLES for e in load_config(example).engines}
    assert started == needed
    # The recipe serves both examples of the pair, SIGKILLs and SIGTERMs the active, and times the takeover.
    for step in ("--config examples/standby-a.toml", "--config examples/standby-b.toml", "kill -KILL", "kill -TERM",
                 "time (until curl -sf"):
        assert step in recipe


async def test_the_endpoint_table_lists_every_route_of_the_control_app():
    router = Router(parse_config(GOOD))
    try:
        rules = [rule for rule in router.app.url_map.iter_rules() if rule.endpoint != "static"]
    finally:
        await router.control_pool.aclose()
        await router.data_plane.data_pool.aclose()
    table = README.split("## Endpoints", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"`((?:GET|POST) /[^`]*)`", table))
    missing = []
    for rule in rules:
        path = re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", rule.rule)
        missing += [f"{method} {path}" for method in sorted(rule.methods - {"HEAD", "OPTIONS"})
                    if f"{method} {path}" not in listed]
    assert len(rules) >= 12 and missing == []


def test_ci_stops_when_the_install_fails(tmp_path: Path) -> None:
    # `set -e` does not stop at a failed step before the last of an && list: a broken install must not go on
    # to the linters and the real tier (and pass with an old environment's tools).
    (tmp_path / ".ci").mkdir()
    shutil.copy(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    ran = tmp_path / "ran"
    stubs = {"python3": "exit 1", "chromium": "exit 0"}  # the venv cannot be made; chromium is there already
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/bin/sh\necho {name} >> {ran}\n{body}\n")
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    for name in ("ruff", "mypy"):  # what a previous install left: they must not run
        (tmp_path / ".venv" / "bin" / name).write_text(f"#!/bin/sh\necho {name} >> {ran}\n")
    for stub in [*bin_dir.iterdir(), *(tmp_path / ".venv" / "bin").iterdir()]:
        stub.chmod(0o755)
    run = subprocess.run(["bash", str(tmp_path / ".ci" / "run")], cwd=tmp_path, capture_output=True, text=True,
                         env={**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin"}, timeout=60)
    assert run.returncode != 0
    assert ran.read_text().split() == ["python3"]
