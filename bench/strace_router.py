"""Start a Narwhal router (the tree in the working directory) under `strace -f -c`, for `--router-cmd`.

Usage, from the tree to measure (strace must be installed):

    python -m narwhal bench --concurrency 16 --requests N --warmup 0 --count-tokens off --quiet \
        --router-cmd "python bench/strace_router.py {port} {prefill[0]} {decode[0]} OUT.txt [SECTION.KEY=VALUE ...]"

The router's config is the one `python -m narwhal bench` writes (token counting off), plus any
SECTION.KEY=VALUE given (read as TOML values, like the bench's `--set`). strace writes its
per-syscall counts to OUT.txt when the router exits. Startup and shutdown are in the counts
too, so run N=500 and N=2500 and divide the difference by 2,000 for syscalls per request
(docs/benchmarks.md); `bench/pump_compare.sh` does the same per 1,000 tokens.
"""

import os
import sys
import tempfile
import tomllib

from narwhal.tools.local_fleet import render_config

port, prefill_url, decode_url, out = sys.argv[1:5]
sections: dict[str, dict[str, object]] = {
    "serving": {"count_tokens": False, "shutdown_grace_s": 2.0},
    "fleet": {"attestation_key": "narwhal-dev-key"},
}
for item in sys.argv[5:]:
    key, _, raw = item.partition("=")
    section, _, name = key.partition(".")
    try:
        value: object = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    sections.setdefault(section, {})[name] = value
work = tempfile.mkdtemp(prefix="narwhal-strace-")
sections.setdefault("handoff", {})["path"] = os.path.join(work, "handoff.json")
config = os.path.join(work, "narwhal.toml")
with open(config, "w") as f:
    f.write(render_config([("p1", prefill_url, "prefill"), ("d1", decode_url, "decode")], sections))
# The router's JSON logs go to a file: a pipe nobody reads would stall it.
log = os.open(os.path.join(work, "router.log"), os.O_WRONLY | os.O_CREAT, 0o600)
os.dup2(log, 2)
os.execvp("strace", ["strace", "-f", "-c", "-o", out, sys.executable, "-m", "narwhal", "serve",
                     "--config", config, "--listen", f"127.0.0.1:{port}"])
