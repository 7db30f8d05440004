"""What one placement costs the router at 2 to 256 prefill candidates, timed in a loop (no router, no I/O).

    python bench/placement_cost.py [TREE]

TREE (default: this checkout) is the source tree whose ``Placer`` is timed, so two trees compare
side by side. Three cases, each the best of 5 rounds of 20,000 calls:

- hit: one prompt, sent again and again (``narwhal bench``'s load), so one engine holds it; ``prefill``
  then ``record``, loads 0 or 1 (a quarter busy), the busy engines given as the request path gives them;
- miss: a prompt nobody holds, loads as above, the caches as the hit left them (all but one empty):
  the least loaded with the emptiest cache tie, and rendezvous picks among them;
- no block: a prompt shorter than one block (the fleet scenario's 16 words), loads as above, the busy
  engines given as the request path gives them: a random draw among the idle ones;
- decode: 192 candidates, 64 of them busy (and 8 busy engines of the other role).
"""

from __future__ import annotations

import random
import sys
import timeit
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(sys.argv[1]).resolve()) if len(sys.argv) > 1 else str(Path(__file__).resolve().parents[1]))

from narwhal.fleet.placement import InFlight, Placer  # noqa: E402  (the tree's own, after the path is set)
from narwhal.fleet.placement.prefix_index import PrefixIndex  # noqa: E402

CALLS, ROUNDS = 20_000, 5


def best_us(call: Callable[[], object]) -> float:
    return min(timeit.repeat(call, number=CALLS, repeat=ROUNDS)) / CALLS * 1e6


def prefill_case(size: int) -> tuple[float, float, float]:
    names = [f"p{i}" for i in range(size)]
    index = PrefixIndex(names, max_bytes=64 << 20)
    placer = Placer(index, rng=random.Random(1))
    rng = random.Random(2)
    loads = [{name: rng.choice((0, 0, 0, 1)) for name in names} for _ in range(64)]
    # The engines with a request in flight, as the request path passes them (InFlight.busy).
    busy = [{name for name, n in load.items() if n} for load in loads]
    blocks = [123456789]
    turn = iter(range(10**9)).__next__

    def hit() -> None:
        n = turn() & 63
        choice = placer.prefill(names, blocks, loads[n].__getitem__, busy=busy[n])
        assert choice is not None
        placer.record(choice.engine, blocks)

    def miss() -> None:
        n = turn()
        placer.prefill(names, [n * 7919 + 11], loads[n & 63].__getitem__, busy=busy[n & 63])

    def no_block() -> None:
        n = turn() & 63
        placer.prefill(names, [], loads[n].__getitem__, busy=busy[n])

    return best_us(hit), best_us(miss), best_us(no_block)


def decode_case() -> float:
    decode = [f"d{i}" for i in range(192)]
    prefill = [f"p{i}" for i in range(64)]
    in_flight = InFlight(decode + prefill)
    rng = random.Random(1)
    for name in rng.sample(decode, 64) + rng.sample(prefill, 8):
        in_flight.acquire(name)
    placer = Placer(PrefixIndex([], max_bytes=0), rng=random.Random(3))
    return best_us(lambda: placer.decode(list(decode), in_flight.loader(), in_flight.busy))


def main() -> None:
    for size in (2, 16, 64, 256):
        hit, miss, no_block = prefill_case(size)
        print(f"prefill over {size:3d} candidates: hit + record {hit:6.2f} us, miss {miss:6.2f} us, "
              f"no block {no_block:6.2f} us")
    print(f"decode over 192 candidates, 64 busy: {decode_case():.2f} us")


if __name__ == "__main__":
    main()
