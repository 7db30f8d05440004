"""One process's prefix index kept in step with the other processes' placements.

Pure state. With worker processes each worker places on its own index; what
it records goes out in its next report (``take``), the controller applies it
to its own index and relays it to the other workers (``apply``), so the same
prefix reaches the same engine from any worker without a round trip per
request. Forgetting an engine (it left the fleet, or will come back as a new
process with an empty cache) bumps its epoch; a record carries the epoch it was
made in, and one made before the engine was forgotten is never applied.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import msgspec

from narwhal.fleet.placement.prefix_index import PrefixIndex

__all__ = ["IndexRecord", "SharedIndex"]


class IndexRecord(msgspec.Struct, frozen=True, array_like=True):
    """A prompt placed on an engine: its chained block hashes, in the engine's epoch."""

    engine: str
    epoch: int
    blocks: list[int]
    # When it was placed, on the clock every process on the host shares (CLOCK_MONOTONIC).
    at: float = 0.0


class SharedIndex:
    """A ``PrefixIndex`` plus the epochs and the outbox that keep processes' copies in step."""

    def __init__(self, index: PrefixIndex, *, max_outbox: int = 4096) -> None:
        self.index = index
        self.epochs: dict[str, int] = {}
        # Deduplicated by (engine, last block): a hot prompt is sent once per report, not once per request.
        self._outbox: dict[tuple[str, int], IndexRecord] = {}
        self._max_outbox = max_outbox
        self.dropped = 0

    def recorded(self, engine: str, blocks: Sequence[int], at: float) -> None:
        """This process placed ``blocks`` on ``engine`` at ``at`` (the placer's ``on_record``)."""
        outbox = self._outbox
        key = (engine, blocks[-1])
        if key in outbox:
            outbox[key] = IndexRecord(engine, outbox[key].epoch, outbox[key].blocks, at)
            return
        if len(outbox) >= self._max_outbox:
            # Bounded: a controller that stops reading must not grow a worker's memory.
            self.dropped += 1
            return
        outbox[key] = IndexRecord(engine, self.epochs.get(engine, 0), list(blocks), at)

    def take(self) -> list[IndexRecord]:
        """What was recorded since the last call, for the next report."""
        records = list(self._outbox.values())
        self._outbox.clear()
        return records

    def apply(self, records: Iterable[IndexRecord]) -> list[IndexRecord]:
        """Record other processes' placements; returns those applied (a forgotten epoch's are not)."""
        epochs = self.epochs
        applied = []
        for record in records:
            if record.epoch == epochs.get(record.engine, 0):
                self.index.record(record.engine, record.blocks, record.at)
                applied.append(record)
        return applied

    def forget(self, engine: str) -> None:
        """The engine's cache is (or will be) empty: drop its entries and refuse older records."""
        self.epochs[engine] = self.epochs.get(engine, 0) + 1
        self.index.forget(engine)
        for key in [key for key in self._outbox if key[0] == engine]:
            del self._outbox[key]

    def sync(self, epochs: Mapping[str, int]) -> None:
        """Take the controller's epochs: every engine forgotten there is forgotten here."""
        for engine, epoch in epochs.items():
            if epoch > self.epochs.get(engine, 0):
                self.epochs[engine] = epoch
                self.index.forget(engine)
                for key in [key for key in self._outbox if key[0] == engine]:
                    del self._outbox[key]
