"""Runs as a stream of typed updates: what the CLI, the app and a notebook consume.

`stream` runs one prompt speculatively (and then the plain baseline, when asked) and
`stream_batch` several prompts together; both yield an update per round and a last one with
the finished runs, their decoded texts and, if asked, the path of the saved trace. A consumer
maps updates to whatever it shows and stops a run by closing the iterator between rounds. Time
spent by the consumer between updates (rendering, or a viewer stepping through rounds) counts
neither in the runs' times nor against the time limit.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ..core.events import RoundEvent, Run, save_trace
from ..core.generator import Settings, decode, encode_prompts, new_runs, with_texts
from ..models.loading import ModelPair


@dataclass
class RoundDone:
    """A round of one run (a baseline step counts as a round)."""

    run: Run  # the run so far, this round included
    event: RoundEvent


@dataclass
class BatchRound:
    """A round of a batch: every row still running added one event."""

    runs: list[Run]
    index: int  # rounds so far, from 0


@dataclass
class Finished:
    runs: list[Run]  # texts decoded; speculative first, then the baseline if one ran
    stopped: str = ""  # why the runs stopped before their end ("" if they did not)
    trace: Path | None = None  # where the trace was saved, if a folder was given

    @property
    def spec(self) -> Run | None:
        return next((r for r in self.runs if r.meta.mode == "speculative"), None)

    @property
    def base(self) -> Run | None:
        return next((r for r in self.runs if r.meta.mode == "baseline"), None)

    def _repr_html_(self) -> str:  # a notebook draws the runs: compared, alone, or as a batch
        from ..view.notebook import runs_html

        return runs_html(self.runs)


Update = RoundDone | BatchRound | Finished


@dataclass
class Clock:
    """The time a stream has spent running: a consumer's time between updates (a viewer stepping
    through rounds) does not count against the limit."""

    limit_s: float  # 0: none
    start: float = field(default_factory=time.perf_counter)

    @contextmanager
    def paused(self) -> Iterator[None]:
        suspended = time.perf_counter()
        yield
        self.start += time.perf_counter() - suspended

    def out(self) -> str:
        if self.limit_s and time.perf_counter() - self.start > self.limit_s:
            return f"stopped at the time limit ({self.limit_s:.0f} s)"
        return ""


def _finish(pair: ModelPair, runs: list[Run], stopped: str, trace_dir: str | Path | None) -> Finished:
    with_texts(pair, runs)
    return Finished(runs, stopped, save_trace(trace_dir, runs) if trace_dir else None)


def stream(pair: ModelPair, prompt: str, settings: Settings, compare: bool = False, chat_template: bool = True,
           prompt_ids: list[int] | None = None, time_limit_s: float = 0.0,
           trace_dir: str | Path | None = None) -> Iterator[Update]:
    """The speculative run round by round, then (compare) the baseline on the same prompt and seed.

    The baseline runs after the speculative run, never beside it, so that neither slows the other.
    Inputs are validated before any model work (ValueError).
    """
    ids = encode_prompts(pair, [prompt], settings, chat_template, None if prompt_ids is None else [prompt_ids])
    clock, runs, stopped = Clock(time_limit_s), [], ""
    for mode in ("speculative", "baseline") if compare else ("speculative",):
        if stopped:
            break
        (run,) = new_runs(pair, [prompt], ids, settings, mode)
        runs.append(run)
        for ((_, event),) in decode(pair, ids, settings, mode, [run.meta]):
            run.events.append(event)
            with clock.paused():
                yield RoundDone(run, event)
            stopped = clock.out()
            if stopped:
                break
    yield _finish(pair, runs, stopped, trace_dir)


def stream_batch(pair: ModelPair, prompts: list[str], settings: Settings, chat_template: bool = True,
                 prompts_ids: list[list[int]] | None = None, time_limit_s: float = 0.0,
                 trace_dir: str | Path | None = None) -> Iterator[Update]:
    """Several prompts decoded together, each row at its own pace: one update per round."""
    ids = encode_prompts(pair, prompts, settings, chat_template, prompts_ids)
    runs = new_runs(pair, prompts, ids, settings)
    clock, stopped = Clock(time_limit_s), ""
    for index, round_events in enumerate(decode(pair, ids, settings, "speculative", [r.meta for r in runs])):
        for row, event in round_events:
            runs[row].events.append(event)
        with clock.paused():
            yield BatchRound(runs, index)
        stopped = clock.out()
        if stopped:
            break
    yield _finish(pair, runs, stopped, trace_dir)
