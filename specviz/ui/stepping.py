"""Step mode's sessions: a run shown round by round, and each round stage by stage, one per browser
session (the oldest paused run goes first when MAX_STEPPERS are kept)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace

import gradio as gr

from ..core.events import Run
from ..tools.stream import Finished, RoundDone, Update
from ..view.rendering import count, note_html
from ..view.stages import round_stages, stage_label
from .page import SERVED
from .view import View

MAX_STEPPERS = 32


@dataclass
class Stepper:
    """A run shown round by round: the live stream (None once it ended, and for a replay), the
    runs so far, and how many of the speculative rounds the page shows, at which stage."""

    spec: Run
    base: Run | None = None
    updates: Iterator[Update] | None = None
    note: str = ""
    shown: int = 0
    stage: int = 0
    trace: str | None = None
    replay: bool = False  # a loaded trace: stepping past its end starts it again
    compare: bool = False  # the baseline runs after the speculative run

    def more(self) -> bool:
        return self.shown < len(self.spec.events) or self.updates is not None

    def next_round(self) -> None:
        """Show the next speculative round at its first stage, running it first if it is live."""
        while self.shown == len(self.spec.events) and self.updates is not None:
            update = next(self.updates, None)
            if isinstance(update, RoundDone) and update.run.meta.mode == "speculative":
                self.spec = update.run
                SERVED["rounds"] += 1
            elif isinstance(update, Finished) or update is None:  # the baseline ran on the way, if asked
                if update is not None:
                    self.spec, self.base, self.trace = update.spec, update.base, str(update.trace)
                self.updates = None
                return
        self.shown, self.stage = min(self.shown + 1, len(self.spec.events)), 0

    def stages(self) -> int:
        return len(round_stages(self.spec.events[self.shown - 1], self.spec.meta)) if self.shown else 0

    def view(self, show_rounds: bool) -> View:
        spec = self.spec if self.shown == len(self.spec.events) else replace(self.spec,
                                                                             events=self.spec.events[: self.shown])
        view = View(spec=spec, base=self.base if not self.more() else None, show_rounds=show_rounds,
                    stage=self.stage)
        if self.more():
            event = spec.events[-1] if spec.events else None
            where = stage_label(event, round_stages(event, spec.meta), self.stage).lower() if event else "start"
            view.status = note_html(f"{self.note}Stepping: {where}. Next ▸ (key n) for the next stage.",
                                    "Next ▸ (key n) for the next stage, Step for the next round, Continue to run to "
                                    "the end; Run starts afresh with the page's settings.")
        else:
            view.status = note_html(f"{self.note}Stepped to the end: {count(spec.n_tokens)}. Step starts again.")
        return view

    def close(self) -> None:
        if self.updates is not None:
            self.updates.close()


_steppers: dict[str, Stepper] = {}
_steppers_lock = threading.Lock()


def session(request) -> str:
    return getattr(request, "session_hash", None) or "-"


def current(request) -> Stepper | None:
    return _steppers.get(session(request))


def keep(request, stepper: Stepper) -> None:
    with _steppers_lock:
        old = _steppers.pop(session(request), None)
        _steppers[session(request)] = stepper
        if old is not None and old is not stepper:
            old.close()
        while len(_steppers) > MAX_STEPPERS:
            _steppers.pop(next(iter(_steppers))).close()


def drop(request: gr.Request | None) -> None:  # also the page's unload handler
    with _steppers_lock:
        old = _steppers.pop(session(request), None)
    if old is not None:
        old.close()
