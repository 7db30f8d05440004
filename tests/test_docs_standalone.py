"""The repository stands alone: no doc or source points to files a reader of it does not have."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Where the project's design notes lived before they were written into docs/ (design.md, stack.md).
OUTSIDE = ("../shared", "/work/shared", "perf-notes", "steering repo")


def repository_texts() -> list[Path]:
    paths = [ROOT / "README.md", ROOT / "pyproject.toml"]
    for folder, pattern in (("docs", "*.md"), ("narwhal", "*.py"), ("examples", "*"), ("bench", "*"),
                            ("tests", "*.py")):
        paths.extend(path for path in sorted((ROOT / folder).rglob(pattern)) if path.is_file())
    return [path for path in paths if path != Path(__file__).resolve() and "__pycache__" not in path.parts]


def test_nothing_points_outside_the_repository() -> None:
    found = []
    for path in repository_texts():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            found.extend(f"{path.relative_to(ROOT)}:{number}: {line.strip()}" for needle in OUTSIDE
                         if needle in line)
    assert found == []


def test_every_document_the_docs_name_exists() -> None:
    # `design.md`, `docs/stack.md`, ...: a named document is one of ours, so the reader has it.
    missing = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for name in re.findall(r"`((?:docs/)?[\w-]+\.md)`", path.read_text()):
            if not ((ROOT / name).is_file() or (ROOT / "docs" / name).is_file()):
                missing.append(f"{path.relative_to(ROOT)}: {name}")
    assert missing == []
