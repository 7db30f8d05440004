"""Start a Narwhal router from TREE under cProfile, for `--router-cmd`: exact Python call counts per request.

Usage, from any tree (TREE is the tree whose router runs; the bench and the mocks are the caller's):

    python -m narwhal bench --concurrency 8 --requests N --warmup 0 --count-tokens off --mock-writes per-event \
        --quiet --router-cmd "python bench/cprofile_router.py TREE {port} {prefill[0]} {decode[0]} OUT.prof \
        [SECTION.KEY=VALUE ...]"

The config is the one `bench/strace_router.py` writes (token counting off unless
serving.count_tokens=true is given). cProfile writes OUT.prof when the router exits
(the bench stops it with SIGTERM). Startup, shutdown and the monitor are in the
counts too: run N=500 and N=2500 and let `bench/cprofile_compare.py` divide the
difference by 2,000. Call counts do not move with the machine's load; times do.

With ``--cachegrind`` before TREE the router runs under valgrind's cachegrind instead
(user-space instructions, OUT.cg): `bench/cachegrind_compare.py` divides those the same
way. Instructions also count the C work a call count does not see (a hash, a copy).
"""

import os
import sys
import tempfile
import tomllib

args = sys.argv[1:]
cachegrind = bool(args) and args[0] == "--cachegrind"
if cachegrind:
    args = args[1:]
tree, port, prefill_url, decode_url, out = args[:5]
tree = os.path.abspath(tree)
sys.path.insert(0, tree)
os.chdir(tree)
from narwhal.tools.local_fleet import render_config  # noqa: E402  (the tree's own, after the path is set)

sections: dict[str, dict[str, object]] = {
    "serving": {"count_tokens": False, "shutdown_grace_s": 2.0},
    "fleet": {"attestation_key": "narwhal-dev-key"},
}
for item in args[5:]:
    key, _, raw = item.partition("=")
    section, _, name = key.partition(".")
    try:
        value: object = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    sections.setdefault(section, {})[name] = value
work = tempfile.mkdtemp(prefix="narwhal-cprofile-")
sections.setdefault("handoff", {})["path"] = os.path.join(work, "handoff.json")
config = os.path.join(work, "narwhal.toml")
with open(config, "w") as f:
    f.write(render_config([("p1", prefill_url, "prefill"), ("d1", decode_url, "decode")], sections))
# The router's JSON logs go to a file: a pipe nobody reads would stall it.
log = os.open(os.path.join(work, "router.log"), os.O_WRONLY | os.O_CREAT, 0o600)
os.dup2(log, 2)
serve = ["-m", "narwhal", "serve", "--config", config, "--listen", f"127.0.0.1:{port}"]
if cachegrind:
    os.execvp("valgrind", ["valgrind", "--tool=cachegrind", "--cache-sim=no",
                           f"--cachegrind-out-file={os.path.abspath(out)}", sys.executable, *serve])
os.execvp(sys.executable, [sys.executable, "-m", "cProfile", "-o", os.path.abspath(out), *serve])
