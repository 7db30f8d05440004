"""CPU time and peak memory of a process tree, read from ``/proc`` (Linux only).

``utime + stime`` of ``/proc/PID/stat`` is the CPU a process has used; the
benchmark samples it for the router and its descendants before and after the
load and divides the difference by the requests served. ``VmHWM`` of
``/proc/PID/status`` is a process's peak resident set, ``VmRSS`` its resident set now.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import msgspec

__all__ = [
    "CLOCK_TICKS_PER_S",
    "ProcStat",
    "TreeSample",
    "cpu_seconds_between",
    "descendants",
    "listening_pid",
    "parse_stat",
    "parse_vm_hwm_kb",
    "parse_vm_rss_kb",
    "read_stat",
    "sample_tree",
    "tree_rss_kb",
]

CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class ProcStat(msgspec.Struct, frozen=True):
    """The fields of ``/proc/PID/stat`` the benchmark reads; times in clock ticks."""

    pid: int
    comm: str
    state: str
    ppid: int
    utime: int
    stime: int

    @property
    def cpu_ticks(self) -> int:
        return self.utime + self.stime


def parse_stat(text: str) -> ProcStat:
    """Parse one ``/proc/PID/stat`` line.

    The command name sits in parentheses and may itself hold spaces or ``)``,
    so the fields are counted from the last ``)``.
    """
    open_at = text.index("(")
    close_at = text.rindex(")")
    pid = int(text[:open_at])
    comm = text[open_at + 1:close_at]
    # After ")": state(3) ppid(4) pgrp session tty_nr tpgid flags minflt cminflt majflt cmajflt utime(14) stime(15)
    rest = text[close_at + 2:].split()
    return ProcStat(pid=pid, comm=comm, state=rest[0], ppid=int(rest[1]), utime=int(rest[11]), stime=int(rest[12]))


def parse_vm_hwm_kb(text: str) -> int | None:
    """``VmHWM`` (peak resident set, kB) from a ``/proc/PID/status`` text; None for kernel threads."""
    for line in text.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return None


def parse_vm_rss_kb(text: str) -> int | None:
    """``VmRSS`` (resident set now, kB) from a ``/proc/PID/status`` text; None for kernel threads."""
    for line in text.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return None


def tree_rss_kb(root: int) -> int:
    """The resident set of ``root`` and its descendants now, summed (kB)."""
    total = 0
    for pid in [root, *descendants(root)]:
        try:
            with open(f"/proc/{pid}/status") as f:
                total += parse_vm_rss_kb(f.read()) or 0
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def read_stat(pid: int) -> ProcStat | None:
    """The current stat of ``pid``; None once it has gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return parse_stat(f.read())
    except (FileNotFoundError, ProcessLookupError, ValueError, IndexError):
        return None


def _read_vm_hwm_kb(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return parse_vm_hwm_kb(f.read())
    except (FileNotFoundError, ProcessLookupError):
        return None


def _all_pids() -> Iterable[int]:
    for name in os.listdir("/proc"):
        if name.isdigit():
            yield int(name)


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children, grandchildren, ...), by scanning ``/proc``."""
    children: dict[int, list[int]] = {}
    for other in _all_pids():
        stat = read_stat(other)
        if stat is not None:
            children.setdefault(stat.ppid, []).append(other)
    found: list[int] = []
    frontier = [pid]
    # Bounded by the number of processes: each pid has one parent.
    while frontier:
        parent = frontier.pop()
        for child in children.get(parent, ()):
            found.append(child)
            frontier.append(child)
    return found


class TreeSample(msgspec.Struct, frozen=True):
    """CPU ticks per pid of one process tree at one moment, and its summed peak RSS."""

    ticks: dict[int, int]
    peak_rss_kb: int


def sample_tree(root: int) -> TreeSample:
    """CPU ticks of ``root`` and its descendants, and the sum of their ``VmHWM``."""
    ticks: dict[int, int] = {}
    peak_rss_kb = 0
    for pid in [root, *descendants(root)]:
        stat = read_stat(pid)
        if stat is None:
            continue
        ticks[pid] = stat.cpu_ticks
        peak_rss_kb += _read_vm_hwm_kb(pid) or 0
    return TreeSample(ticks=ticks, peak_rss_kb=peak_rss_kb)


def cpu_seconds_between(before: TreeSample, after: TreeSample) -> float:
    """CPU seconds the tree used between two samples; a process born in between counts from zero."""
    ticks = sum(now - before.ticks.get(pid, 0) for pid, now in after.ticks.items())
    return ticks / CLOCK_TICKS_PER_S


def _socket_inodes(port: int) -> set[str]:
    """Inodes of sockets listening on ``port`` (IPv4 or IPv6), from ``/proc/net/tcp*``."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            # State 0A is LISTEN.
            if state == "0A" and int(local.rpartition(":")[2], 16) == port:
                inodes.add(inode)
    return inodes


def listening_pid(port: int) -> int | None:
    """The pid of the process listening on TCP ``port`` on this host, if this user may see it."""
    inodes = _socket_inodes(port)
    if not inodes:
        return None
    wanted = {f"socket:[{inode}]" for inode in inodes}
    for pid in _all_pids():
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except (PermissionError, FileNotFoundError, ProcessLookupError):
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in wanted:
                    return pid
            except OSError:
                continue
    return None
