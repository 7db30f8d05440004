"""The README's commands work as written on a fresh machine: console scripts, `.venv/bin/` throughout, CI = README."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

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
    assert install_and_test[0] in ci
    # And the first command a newcomer runs is the demo through the console script.
    assert readme_commands()[0] == "python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/narwhal demo"


def test_the_vllm_guide_gives_each_engine_its_own_kv_role():
    # vLLM 0.32 logs kv_both as deprecated with NixlConnector.
    guide = (ROOT / "docs" / "vllm.md").read_text()
    commands = re.findall(r"```bash\n(.*?)```", guide, flags=re.DOTALL)
    serving = [c for c in commands if "vllm serve" in c and "--kv-transfer-config" in c]
    roles = [re.search(r'"kv_role":"(\w+)"', c).group(1) for c in serving]
    assert roles == ["kv_producer", "kv_consumer"]
    assert '"kv_role":"kv_both"' not in guide
