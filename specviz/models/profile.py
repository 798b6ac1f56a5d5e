"""This machine's profile: everything specviz times here to decide how it runs, in one file.

One JSON file per machine and build (kernels.profile: the CPU with its caps, threads, torch, the product paths and
our library's build) in the cache folder's `profiles/`, in typed sections of entries, each entry with what the load
meter read while it was timed ("busy": contention.py; None where unmetered):

    kernels   "<dtype>|<out>x<in>"        {"ms": {rows: {path: ms}}, "busy"}   kernels.tune
    skipped   "<dtype>"                   {"why": {path: reason}}            kernels.tune
    forwards  "<dtype>|<model>|<rows>"    {"ms": {way: ms}, "busy"}          LeanLlama.timed_ways, compare_forwards,
                                                                             distill.training_dtype
    rounds    "<pair, device, dtype...>"  costs.Costs's fields, "busy"       tools/costs.py

Kernels and forwards are timed in load_pair's load step; a round's costs after it (pricing a round runs the
decoder, tools layer). `update` is the one writer: under the file's lock it reads the stored file again, replaces
the entries given and writes the whole atomically (cachedir.write_json), so processes timing different things
keep each other's. `stands` is the one check of whether an entry is kept or timed again.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from . import contention
from .cachedir import locked, write_json

SECTIONS = ("kernels", "skipped", "forwards", "rounds")
log = logging.getLogger("specviz")


def entry_key(*parts: object) -> str:
    """An entry's key from its parts: "float32|576x576"."""
    return "|".join(map(str, parts))


@dataclass(frozen=True)
class Profile:
    file: Path
    machine: dict  # what the file is for (kernels.machine), kept in it for the reader

    def read(self) -> dict[str, dict[str, dict]]:
        """Every section as stored: section -> key -> entry (empty sections for a missing or unreadable file)."""
        data: dict = {}
        if self.file.is_file():
            try:
                data = json.loads(self.file.read_text(encoding="utf-8"))
            except (ValueError, OSError) as err:
                log.warning("specviz: ignoring an unreadable profile %s (%s); timing again", self.file, err)
        return {s: data.get(s, {}) if isinstance(data.get(s), dict) else {} for s in SECTIONS}

    def entry(self, section: str, name: str) -> dict | None:
        return self.read()[section].get(name)

    def stands(self, section: str, name: str, busy: float | None) -> bool:
        """Whether a stored entry timed while the meter read `busy` is kept: timed on a quiet machine or by this
        process (contention.stands)."""
        return contention.stands(busy, (str(self.file), section, name))

    def timing(self, section: str, name: str) -> None:
        """This process times the entry now: what it stores stands until the next start (contention.timing)."""
        contention.timing((str(self.file), section, name))

    @contextmanager
    def locked(self, progress: Callable[[str], None] | None = None) -> Iterator[None]:
        """Held while timing what the profile lacks, so that processes sharing the cache time it once."""
        with locked(self.file, progress):
            yield

    def update(self, changes: dict[str, dict[str, dict | None]]) -> None:
        """Store these entries (section -> key -> entry; None: drop it), the rest of the file as another process
        may have left it."""
        with self.locked():
            data = self.read()
            for section, entries in changes.items():
                kept = {**data[section], **entries}
                data[section] = {name: entry for name, entry in kept.items() if entry is not None}
            write_json(self.file, {"machine": self.machine, **data})
