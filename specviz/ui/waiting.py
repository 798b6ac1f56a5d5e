"""How long a waiting page will wait: its place in the model's queue and what the calls ahead of it will take.

Gradio's own estimate is the average call's time, whatever the calls ahead ask for: behind a 512-token run it
says the same as behind a 16-token one. Here a Run ahead counts its own token budget (twice where it runs the
baseline too) at the pace this server's finished runs measured, with what a run spends besides its tokens (its
prefill, the page's drawing); a call of another kind
counts Gradio's average for its kind; the call under way counts what it has left. A run that meets its
end-of-text early makes the wait shorter than said.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

OTHER_S = 5.0  # a call of a kind Gradio has not timed yet
MIN_TOKENS = 8  # a run this short times its prefill and drawing more than its tokens: not learned from


class Pace:
    """A run's time as this server's finished runs measured it: ms a token of decoding, and the seconds a run
    spends besides (its prefill, the page's drawing, the trace), each a moving mean (None until a run finished)."""

    def __init__(self) -> None:
        self.ms: float | None = None
        self.overhead_s = 0.0
        self._lock = threading.Lock()

    def learn(self, tokens: int, decode_s: float, wall_s: float) -> None:
        """A finished run: its tokens (its baseline's included), their decoding's seconds, and the run's in all."""
        if tokens < MIN_TOKENS or decode_s <= 0:
            return
        ms, overhead = 1000 * decode_s / tokens, max(wall_s - decode_s, 0.0)
        with self._lock:
            first = self.ms is None
            self.ms = ms if first else 0.7 * self.ms + 0.3 * ms
            self.overhead_s = overhead if first else 0.7 * self.overhead_s + 0.3 * overhead

    def seconds(self, tokens: int) -> float:
        return self.overhead_s + tokens * (self.ms or 0.0) / 1000


PACE = Pace()


@dataclass
class Budgets:
    """The token budget a queued call asks for, read from its inputs as the page sent them: by handler name, the
    positions of its max-new-tokens and compare inputs (None: it never runs the baseline)."""

    fields: dict[str, tuple[int, int | None]]

    def tokens(self, name: str, data: list | None) -> int | None:
        """Tokens the call decodes at most; None for a call of another kind, or inputs that do not say."""
        if name not in self.fields or not data:
            return None
        at, compare = self.fields[name]
        try:
            tokens = int(data[at])
        except (IndexError, TypeError, ValueError):
            return None
        return tokens * (2 if compare is not None and compare < len(data) and data[compare] else 1)


@dataclass
class Wait:
    """A waiting call's place (1: next) among `of` waiting, and the seconds until it starts (None: no run has
    been timed here yet, so its calls cannot be priced), with the tokens ahead that went into it."""

    place: int
    of: int
    seconds: float | None
    tokens_ahead: int
    ms_a_token: float | None

    def text(self) -> str:
        if self.seconds is None:
            return "No run has finished on this server yet: the wait is not estimated."
        runs = f"the runs ahead ask for up to {self.tokens_ahead} tokens, at {self.ms_a_token:.0f} ms a token " \
            "here" if self.tokens_ahead else "from what calls of the kinds ahead took here"
        return f"About {self.seconds:.0f} s more to wait ({runs})."


def wait_of(queue, concurrency_id: str, session: str, budgets: Budgets, pace: Pace = PACE,
            now: Callable[[], float] = time.time) -> Wait | None:
    """The session's first waiting call on `concurrency_id` in Gradio's queue (its `Queue`), and when it starts;
    None if the session has no call waiting there."""
    line = queue.event_queue_per_concurrency_id.get(concurrency_id)
    mine = next((i for i, e in enumerate(line.queue) if e.session_hash == session), None) if line else None
    if mine is None:
        return None
    ms, tokens_ahead, unknown = pace.ms, 0, False

    def seconds(event) -> float:
        nonlocal tokens_ahead, unknown
        tokens = budgets.tokens(event.fn.name, getattr(event.data, "data", None))
        if tokens is not None:
            tokens_ahead += tokens
            unknown = unknown or ms is None
            return pace.seconds(tokens)
        timed = queue.process_time_per_fn.get(event.fn)
        return timed.avg_time if timed is not None and timed.count else OTHER_S

    running = [e for job in queue.active_jobs if job for e in job if e.concurrency_id == concurrency_id]
    started = [t for times in line.start_times_per_fn.values() for t in times]
    begun = min(started) if started else now()
    total = sum(max(seconds(e) - (now() - begun), 0.0) for e in running)
    total += sum(seconds(e) for e in line.queue[:mine])
    return Wait(mine + 1, len(line.queue), None if unknown else total, tokens_ahead, ms)
