"""The fleet page's own script run under Node with a small DOM stand-in (no browser), for the page's tests.

``run_page(tail)`` runs the page's ``<script>`` followed by ``tail`` (which prints one JSON line last) and returns
that line decoded; the test skips when ``node`` is not installed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

import narwhal.app

PAGE = Path(narwhal.app.__file__).parent / "ui_page.html"

# Elements by id are kept (``nodes``) so a test reads back what the page rendered into them.
DOM = r"""
class Node { constructor(tag) { this.tag = tag; this.attrs = {}; this.children = []; this.dataset = {};
  this.hidden = false; this.textContent = ""; }
  setAttribute(k, v) { this.attrs[k] = String(v); } append(...c) { this.children.push(...c); }
  addEventListener() {} replaceChildren(...c) { this.children = c; } }
const nodes = {};
globalThis.document = {createElement: t => new Node(t), createElementNS: (_, t) => new Node(t),
  querySelector: () => new Node("q"), getElementById: id => (nodes[id] ||= new Node(id)), body: new Node("body")};
globalThis.location = {hash: "", pathname: "/admin/ui"};
globalThis.history = {replaceState() {}};
globalThis.fetch = async () => { throw new Error("no network here"); };
globalThis.setTimeout = () => 0; globalThis.setInterval = () => 0;
function text(n) { return typeof n === "string" || typeof n === "number" ? String(n) : n.children.map(text).join(""); }
"""


def page_script() -> str:
    """The page's inline script."""
    return PAGE.read_text().split("<script>", 1)[1].split("</script>", 1)[0]


def run_page(tail: str, **constants: Any) -> Any:
    """Run the page's script, ``constants`` (each as a JSON ``const``), then ``tail``; its last line, decoded."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed: the page's script cannot run here")
    consts = "".join(f"\nconst {name} = {json.dumps(value)};" for name, value in constants.items())
    program = DOM + page_script() + consts + "\n" + tail
    # On stdin: a program with a few hundred views is past what one argument may hold.
    result = subprocess.run([node, "-"], input=program, capture_output=True, text=True, timeout=60, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])
