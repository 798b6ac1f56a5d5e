"""What other processes take of the CPU time specviz's threads need, read from Linux's /proc/stat.

Timings made while another program runs are slower, and unevenly so: a forward or a product that uses every
core loses more than one that uses one. specviz keeps its timings per machine (profile.py: the kernel table,
the forwards, a round's costs), so one taken on a busy machine would steer every later start. Each reads this
meter while they time, take a timing again while it reads above BUSY (ATTEMPTS times at most, the quietest
kept), keep what it read, and time again at the next start what was still timed busy. Elsewhere than Linux,
and with SPECVIZ_IGNORE_LOAD=1 (a machine that is always shared, or the test suite, whose two workers and
browsers load the machine by design), the meter reads None and timings are kept as they come; such an unmetered
timing stands only for processes that do not meter either, so a start that does times it again, once.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")

BUSY = 0.2  # the part of the CPU time our threads needed that other processes took, above which a timing is redone
ATTEMPTS = 3  # timings on a busy machine, the quietest kept
_TIMED_HERE: set = set()  # what this process has timed: (profile file, section, key)


def took(share: float) -> str:
    """A meter's reading, in words."""
    return f"other programs took {share:.0%} of the CPU time specviz needed"


def stands(busy: float | None, key: object) -> bool:
    """Whether a kept timing stands (busy: what the meter read while it was taken, None: unmetered): taken on a
    quiet machine, or by this process (`timing`); a busy one is timed again, once a start. An unmetered one
    stands only where this process cannot meter either: the test suite's timings, kept as they came on a machine
    it loads, would otherwise steer every later start that shares its cache folder."""
    if key in _TIMED_HERE:
        return True
    return not metered() if busy is None else busy <= BUSY


def when(busy: float | None) -> str:
    """How a timing was taken, in words, for one that is timed again (busy: as in `stands`)."""
    if busy is None:
        return "without measuring the machine's load (SPECVIZ_IGNORE_LOAD, as the test suite sets)"
    return f"while {took(busy)}"


def metered() -> bool:
    """Whether this process reads the meter: where /proc/stat reads (Linux), unless SPECVIZ_IGNORE_LOAD is set."""
    return os.environ.get("SPECVIZ_IGNORE_LOAD", "") in ("", "0") and _stat_reads()


@functools.cache
def _stat_reads() -> bool:
    try:
        os.sched_getaffinity(0)
        with open("/proc/stat", encoding="ascii") as f:
            return bool(f.read())
    except (OSError, AttributeError):
        return False


def timing(key: object) -> None:
    """This process times `key` now: whatever the meter reads, the result stands until the next start."""
    _TIMED_HERE.add(key)


def busy_seconds(stat: str, cpus: set[int]) -> float:
    """CPU-seconds the listed CPUs have spent on anything but idling and waiting for I/O, from the text of
    /proc/stat (its `cpuN user nice system idle iowait irq softirq steal ...` lines, in clock ticks)."""
    ticks = 0
    for line in stat.splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            values = [int(v) for v in fields[:8]]
            ticks += sum(values) - values[3] - values[4]  # all but idle and iowait (steal included: a VM's host)
    return ticks / os.sysconf("SC_CLK_TCK")


def shortfall(others: float, cpus: int, threads: int) -> float:
    """The part of the CPUs our `threads` need (0 to 1) that was not free while other processes kept `others`
    CPUs busy on average, of the `cpus` we may run on."""
    needed = max(min(threads, cpus), 1)
    return min(max(needed - (cpus - others), 0.0) / needed, 1.0)


def others_meter() -> Callable[[], float | None]:
    """Start counting: the function returned gives the part of the CPU time our torch threads needed that other
    processes took since (`shortfall`; their busy CPU-seconds are every CPU's busy time in /proc/stat less
    ours), or None where /proc/stat is missing (not Linux) or SPECVIZ_IGNORE_LOAD is set."""
    if not metered():
        return lambda: None
    try:
        cpus = os.sched_getaffinity(0)
        with open("/proc/stat", encoding="ascii") as f:
            start = busy_seconds(f.read(), cpus)
    except (OSError, AttributeError, ValueError):
        return lambda: None
    ours, wall = time.process_time(), time.perf_counter()

    def share() -> float | None:
        with open("/proc/stat", encoding="ascii") as f:
            others = busy_seconds(f.read(), cpus) - start - (time.process_time() - ours)
        seconds = max(time.perf_counter() - wall, 1e-9)
        return shortfall(max(others, 0.0) / seconds, len(cpus), torch.get_num_threads())

    return share


def quietest(time_it: Callable[[], T], again: Callable[[float], None] | None = None) -> tuple[T, float | None]:
    """time_it()'s result and what the meter read while it ran (None: unknown), timed again while that was above
    BUSY (ATTEMPTS times at most) and the quietest kept; again(share) is called before each new attempt."""
    best: tuple[T, float | None] | None = None
    for attempt in range(ATTEMPTS):
        taken = others_meter()
        result = time_it()
        share = taken()
        if best is None or share is None or share < best[1]:
            best = result, share
        if share is None or share <= BUSY:
            break
        if again and attempt + 1 < ATTEMPTS:
            again(share)
    return best
