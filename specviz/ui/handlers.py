"""The handlers behind the page's buttons, as plain (generator) functions of one `Page`. Each long
one is a generator that yields between rounds, so Stop ends the work there: Run and Continue see it
themselves and end with their own last update (`stop`), Gradio closes the others."""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass

import gradio as gr

from ..core.events import Run, load_runs
from ..core.generator import DRAFTER_KINDS, encode_prompts
from ..models.loading import PRESETS, ModelPair
from ..tools.costs import context_of
from ..tools.lossless import exact_check, float32_recheck, sample_check_live
from ..tools.stream import BatchRound, Clock, Finished, RoundDone, Update, stream, stream_batch
from ..view import charts
from ..view.rendering import (
    batch_html,
    count,
    error_html,
    exact_check_text,
    note_html,
    race_html,
    speedup_line,
    stream_html,
)
from . import stepping, waiting
from .device import on_device
from .page import (
    BATCH_SEPARATOR,
    CHARTS_S,
    CUSTOM,
    MAX_BATCH_UI,
    MAX_SAMPLES_UI,
    SERVED,
    TIME_LIMIT_S,
    UPDATE_S,
    WARMING,
    Page,
    as_int,
    check_request,
    first_run_values,
    measured_against,
    split_batch,
    trace_dir,
)
from .stepping import Stepper
from .view import FIGURES, View, greedy_diff, split_runs, status_only

try:  # ZeroGPU on Hugging Face Spaces: borrow a GPU per request (its own worker runs the handler)
    import spaces

    on_gpu = spaces.GPU(duration=120)
except ImportError:  # elsewhere every model call on one thread (device.py: CUDA graphs are kept per thread)
    on_gpu = on_device


FAILURES = (ValueError, OSError, RuntimeError)  # what a request can do wrong: shown in the page, never raised
DEVICE_QUEUE = "device"  # the concurrency group of every call that runs a model: one at a time (app.py)


def open_stream(page: Page, settings, prompt_ids: list[int] | None = None) -> tuple[ModelPair, Iterator[Update]]:
    """The pair and its stream, the request checked against the pair before anything is shown."""
    check_request(page.prompt, settings)
    pair = page.pair()
    updates = stream(pair, page.prompt, settings, compare=bool(page.compare), prompt_ids=prompt_ids,
                     time_limit_s=TIME_LIMIT_S, trace_dir=trace_dir())
    first = next(updates)
    return pair, _chained(first, updates)


def opening(page: Page, settings, shown: Callable[[str], tuple]) -> Generator[tuple, None, tuple]:
    """A new run's start, as Run and Step show it (shown: a status's HTML -> the outputs that show it): the request
    checked, 'loading models…' while the pair loads, then the speculative prefill with the prompt's length; returns
    the pair, its stream and the prompt's ids (encoded once, for the stream too)."""
    check_request(page.prompt, settings)
    while not WARMING.ready.wait(timeout=1.0):  # the app's first measuring: said, step by step, until done
        yield shown(note_html(WARMING.said()))
    if not page.pair_loaded():
        yield shown(note_html("loading models…"))
    prompt_ids = encode_prompts(page.pair(), [page.prompt], settings)[0]
    yield shown(note_html(prefilling("speculative", len(prompt_ids))))
    pair, updates = open_stream(page, settings, prompt_ids)
    return pair, updates, prompt_ids


def _chained(first: Update, rest: Iterator[Update]) -> Iterator[Update]:
    """The first update again, then the rest; closing it closes the stream (itertools.chain cannot)."""
    yield first
    yield from rest


def draft_note(pair: ModelPair, settings) -> str:
    return f"Draft note: {pair.draft_note}. " if pair.draft_note and settings.drafter == "model" else ""


def prefilling(mode: str, tokens: int) -> str:
    """The status while a run reads its prompt (seconds for a long one on a CPU, before any round shows)."""
    return f"{mode}: prefill ({tokens:,} prompt tokens)…"


def follow(view: View, updates: Iterator[Update], note: str, against: Callable[[Run, Run], str] | None = None,
           baseline_next: bool = False, watch: Watch | None = None):
    """The page every UPDATE_S at most, and at each run's last round, until the runs finish: every round shows,
    several at once when they come faster (drawn every round, a short comparison that decodes in a second or
    two keeps a 2-core CPU's browser busy many times as long: `bench-page` measures it). The charts (the five
    under the streams and the round's tree) are drawn together at the first round and when the runs finish, and
    in between one at a time, in turn, each at most every CHARTS_S: the browser lays a chart out anew at every
    redraw, on the CPU the decode runs on and in the page's one thread, where all six at once would hold up a
    click (Stop) for their sum. `against`: for a run with the machine's choice, the
    speedup it measured against the expected one (page.measured_against), said when the baseline has run.
    baseline_next: the baseline runs after the speculative run (its prefill is said when that one ends). watch:
    where Stop is seen; the page then shows the runs as far as they got, and follow returns (the caller closes
    `updates`, or keeps them to step through)."""
    drawn = charted = -math.inf  # the first round is drawn at once, charts included
    turn = 0  # the chart redrawn next between a run's first and last rounds
    for update in updates:
        if watch is not None and watch.stop:
            view.status = note_html(note + stopped_line(view))
            yield view.outputs(final=False, redraw=())  # the word at once, then the charts as far as the run got
            yield view.outputs()
            return
        if isinstance(update, RoundDone):
            event, speculative = update.event, update.run.meta.mode == "speculative"
            if speculative:
                SERVED["rounds"] += 1
                view.spec = update.run
            else:
                view.base = update.run
            if event.finish_reason or time.perf_counter() - drawn >= UPDATE_S:
                drawn = time.perf_counter()
                what = f"round {event.index + 1}, " if speculative else ""
                then = f"; {prefilling('baseline', len(update.run.meta.prompt_ids))}" \
                    if speculative and event.finish_reason and baseline_next else ""
                view.status = note_html(f"{note}{update.run.meta.mode}: {what}{count(event.tokens_so_far)}{then}")
                redraw: tuple[str, ...] = ()
                if charted == -math.inf or CHARTS_S == 0:
                    redraw = FIGURES
                elif drawn - charted >= CHARTS_S / len(FIGURES):
                    redraw, turn = (FIGURES[turn % len(FIGURES)],), turn + 1
                if redraw:
                    charted = drawn
                yield view.outputs(final=False, redraw=redraw)
        elif isinstance(update, Finished):
            stopped = f" Stopped at this server's time limit ({TIME_LIMIT_S:.0f} s)." if update.stopped else ""
            view.spec, view.base = update.spec, update.base
            line = against(view.spec, view.base) if against and view.base and not update.stopped else ""
            said = line.partition(": ")[0]  # 'expected 1.44x, measured 1.19x'; what each part cost, on hover
            view.status = note_html(f"{note}done: {count(view.spec.n_tokens)}.{speedup_line(view.spec, view.base)}"
                                    f"{stopped}" + (f" This machine's choice: {said}." if said else ""), line)
            yield view.outputs(download=str(update.trace), race=race_html(view.spec, view.base) if view.base else "")


@on_gpu
def run(page: Page, request=None):
    """Speculative decoding (then the baseline, if asked): the page once per round."""
    view = View(show_rounds=bool(page.show_rounds))
    stepping.drop(request)  # a plain run ends any stepping
    with watched(request, view) as watch:
        began = time.perf_counter()
        yield from _run(page, view, watch)  # (resumed after its last page: Gradio has sent them all)
        runs = [r for r in (view.spec, view.base) if r is not None and r.events]
        if not watch.stop:  # what a waiting viewer's estimate prices the runs ahead at (waiting.py)
            waiting.PACE.learn(sum(r.n_tokens for r in runs), sum(r.events[-1].elapsed_ms for r in runs) / 1000,
                               time.perf_counter() - began)


def _run(page: Page, view: View, watch: Watch):
    charts = [True]  # the last run's charts go with the first yield

    def shown(status: str) -> tuple:
        view.status, redraw, charts[0] = status, FIGURES if charts[0] else (), False
        return view.outputs(final=False, redraw=redraw)

    try:
        settings = page.settings()
        pair, updates, prompt_ids = yield from opening(page, settings, shown)
    except FAILURES as err:
        view.status = error_html(f"Error: {err}")
        yield view.outputs()
        return
    SERVED["runs"] += 1
    context = context_of(len(prompt_ids), settings.max_new_tokens)
    yield from follow(view, updates, draft_note(pair, settings),
                      measured_against(page.preset, not settings.sampling.greedy, context, settings.max_new_tokens),
                      bool(page.compare), watch)
    updates.close()  # where Stop ended it


def waiting_line(budgets: waiting.Budgets, request: gr.Request = None) -> tuple:
    """While the page has a call waiting for the model: the wait expected (waiting.py), and its timer kept
    ticking; once none waits, an empty line and the timer stopped."""
    queue = _queue(request)
    wait = waiting.wait_of(queue, DEVICE_QUEUE, stepping.session(request), budgets) if queue else None
    if wait is None:
        return "", gr.Timer(active=False)
    return note_html(wait.text()), gr.Timer(active=True)


# --- Stop ----------------------------------------------------------------------------------------

MAX_WATCHED = 64


@dataclass
class Watch:
    """A run under way as Stop finds it: its view (how far it got) and whether Stop was pressed."""

    view: View
    stop: bool = False


_watched: dict[str, Watch] = {}  # session -> its run under way
_watched_lock = threading.Lock()


@contextlib.contextmanager
def watched(request, view: View) -> Iterator[Watch]:
    """The session's run, kept where Stop finds it while it goes."""
    key, watch = stepping.session(request), Watch(view)
    with _watched_lock:
        _watched.pop(key, None)
        _watched[key] = watch
        while len(_watched) > MAX_WATCHED:
            _watched.pop(next(iter(_watched)))
    try:
        yield watch
    finally:
        with _watched_lock:
            if _watched.get(key) is watch:
                del _watched[key]


def stopped_line(view: View) -> str:
    spec, base = view.spec.n_tokens if view.spec else 0, view.base.n_tokens if view.base else 0
    return f"Stopped after {count(spec)}" + (f", the baseline after {count(base)}." if base else ".")


async def stop(request: gr.Request = None):
    """Stop. A run under way ends at its next round and says how far it got: its own last update, so that none
    it sent before can arrive after it (Gradio's cancel closes the run's generator while updates it sent are still
    on their way, and the page draws them after the cancel). A run still waiting for the model leaves the queue.
    The page's other long actions Gradio cancels (app.py)."""
    key = stepping.session(request)
    with _watched_lock:
        watch = _watched.get(key)
    if watch is not None:
        watch.stop = True
        return gr.skip()
    if await leave_queue(request, ("run", "continue_run")):
        return note_html("Stopped before it started: the run was waiting for the model.")
    return gr.skip()


def _queue(request: gr.Request | None):
    """Gradio's queue of the app serving the request (None outside a served app)."""
    app = getattr(getattr(request, "request", None), "app", None)
    return app.get_blocks()._queue if app is not None else None


async def leave_queue(request: gr.Request | None, names: tuple[str, ...]) -> bool:
    """The session's events of the handlers named taken out of Gradio's queue while they wait, and their pages
    told they ended (as Gradio's /cancel route does for a waiting event); whether there were any."""
    from gradio.server_messages import ProcessCompletedMessage

    queue, key = _queue(request), stepping.session(request)
    if queue is None:
        return False
    waiting = [event for line in queue.event_queue_per_concurrency_id.values() for event in line.queue
               if event.session_hash == key and event.fn.name in names]
    for event in waiting:
        await queue.remove_from_queue(event._id)
        if (messages := queue.pending_messages_per_session.get(key)) is not None:
            messages.put_nowait(ProcessCompletedMessage(output={}, success=True, event_id=event._id))
    return bool(waiting)


# --- step mode -----------------------------------------------------------------------------------


@on_gpu
def step(page: Page, request=None, within_round: bool = False):
    """The next round, at its first stage; with nothing to step through, a new run with the page's settings
    (or, after a replay, the trace from its first round), the status saying what it waits for until its first
    round shows, as a run's does. within_round (Next ▸): the shown round's next stage first, while it has one."""
    stepper = stepping.current(request)
    if within_round and stepper is not None and stepper.shown and stepper.stage + 1 < stepper.stages():
        stepper.stage += 1
        yield stepper.view(bool(page.show_rounds)).stage_outputs()
        return
    if stepper is None or not stepper.more():
        if stepper is not None and stepper.replay:
            stepper.shown = 0
        else:
            try:
                settings = page.settings()
                pair, updates, _ = yield from opening(page, settings, status_only)
            except FAILURES as err:
                yield View(status=error_html(f"Error: {err}")).outputs()
                return
            first = next(updates)
            SERVED["runs"] += 1
            stepper = Stepper(spec=first.run, updates=_chained(first, updates), note=draft_note(pair, settings),
                              compare=bool(page.compare))
            stepping.keep(request, stepper)
    stepper.next_round()
    yield _stepper_outputs(stepper, page.show_rounds)


def next_stage(page: Page, request=None):
    yield from step(page, request, within_round=True)


def _stepper_outputs(stepper: Stepper, show_rounds):
    view = stepper.view(bool(show_rounds))
    done = not stepper.more()
    race = race_html(view.spec, view.base) if done and view.base else ""
    return view.outputs(download=stepper.trace if done else None, race=race, final=done or stepper.shown == 1)


def previous_stage(show_rounds, request: gr.Request = None):
    """One stage back, into the previous round's last stage from a round's first."""
    stepper = stepping.current(request)
    if stepper is None or not stepper.shown:
        return View(status=note_html("Nothing to step back through: press Step.")).stage_outputs()
    if stepper.stage > 0:
        stepper.stage -= 1
        return stepper.view(bool(show_rounds)).stage_outputs()
    if stepper.shown > 1:
        stepper.shown -= 1
        stepper.stage = stepper.stages() - 1
    return _stepper_outputs(stepper, show_rounds)


@on_gpu
def continue_run(show_rounds, request: gr.Request = None):
    """Run (or show) the stepped run to its end, round by round as Run does."""
    stepper = stepping.current(request)
    if stepper is None or not stepper.more():
        yield View(status=note_html("Nothing to continue: press Run, or Step to go round by round.")).outputs()
        return
    view = View(spec=stepper.spec, base=stepper.base, show_rounds=bool(show_rounds))
    if stepper.updates is not None:
        with watched(request, view) as watch:
            for outputs in follow(view, stepper.updates, stepper.note, baseline_next=stepper.compare, watch=watch):
                stepper.spec, stepper.base = view.spec, view.base
                yield outputs
        if watch.stop:  # the rest is left to step through
            return
        stepper.updates = None
    else:
        view.status = note_html("replayed to the end")
        yield view.outputs(race=race_html(view.spec, view.base) if view.base else "")
    stepper.shown, stepper.stage = len(stepper.spec.events), stepper.stages() - 1


# --- lossless, visible ---------------------------------------------------------------------------


def bounded(work: Iterator, what: str) -> Iterator:
    """work's items until the server's time limit (TIME_LIMIT_S; 0: none) has passed since it started; then it is
    closed (as Stop closes it) and a last item says where it stopped: a long action holds the one generation slot
    no longer than a run may."""
    clock, last = Clock(TIME_LIMIT_S), ""
    for item in work:
        if clock.out():
            work.close()
            yield TimeUp(f"Stopped at this server's time limit ({TIME_LIMIT_S:.0f} s) while {what}"
                         + (f", at {last}" if last else "") + ".")
            return
        last = item if isinstance(item, str) else last
        yield item


class TimeUp(str):
    """The line `bounded` ends a long action with."""


@on_gpu
def check_float32(runs, preset, custom_target, custom_draft):
    """Run the shown greedy pair of runs again in float32: do the texts then agree token for token?"""
    spec, base = split_runs(runs)
    if spec is None or base is None or not spec.meta.sampling.greedy:
        yield note_html("The float32 check reruns a greedy run and its baseline: run with temperature 0 and "
                        "'compare with baseline' first.")
        return
    try:
        page = Page(preset=preset, custom_target=custom_target, custom_draft=custom_draft)
        for said in bounded(float32_recheck(page.pair(dtype="float32"), spec), "rerunning in float32"):
            if isinstance(said, TimeUp):
                yield note_html(said)
                return
            if isinstance(said, str):
                yield note_html(f"Rerunning in float32… {said}")
            else:
                at = said
    except FAILURES as err:
        yield error_html(f"Error: {err}")
        return
    shown = greedy_diff(spec, base)
    before = (f"In {spec.meta.dtype} (the runs above) they "
              + ("are identical." if shown is None else f"part at generated token {shown + 1}."))
    after = (f"identical, token for token ({count(spec.n_tokens)})" if at is None
             else f"part at generated token {at + 1}")
    yield note_html(f"{before} Rerun just now in float32, same prompt ids and settings: speculative and "
                    f"baseline texts are {after}.")


@on_gpu
def sample_n(page: Page):
    """The first token drawn N times with speculation and N times from the target alone."""
    try:
        n = as_int(page.samples, "N")
        if not 1 <= n <= MAX_SAMPLES_UI:
            raise ValueError(f"N must be in [1, {MAX_SAMPLES_UI}] here, got {n}")
        settings = page.settings(gamma_policy="fixed", max_new_tokens=2)
        check_request(page.prompt, settings)
        for said in bounded(sample_check_live(page.pair(), page.prompt, settings, n), "sampling"):
            if isinstance(said, TimeUp):
                yield note_html(f"{said} A smaller N fits in it."), charts.sample_histogram(None)
                return
            if isinstance(said, str):
                yield note_html(f"Sampling… {said} (Stop ends it)"), gr.skip()
            else:
                check = said
    except FAILURES as err:
        yield error_html(f"Error: {err}"), charts.sample_histogram(None)
        return
    SERVED["runs"] += 1
    kept = "" if check.acceptance is None else f" The first draft was kept in {check.acceptance:.1%} of the draws."
    verdict = ("within sampling noise" if check.tv_speculative <= 1.5 * check.tv_noise + 0.01 else
               "further from it than sampling noise explains")
    yield (note_html(f"{n} + {n} draws in {check.speculative_s + check.target_alone_s:.1f} s. Total variation "
                     f"to the exact distribution: speculative {check.tv_speculative:.4f}, target alone "
                     f"{check.tv_target_alone:.4f}; sampling noise alone gives about {check.tv_noise:.4f} at "
                     f"N = {n}: the speculative draws are {verdict}.{kept}"),
           charts.sample_histogram(check))


@on_gpu
def exact(page: Page):
    """One round of the rule for the page's prompt and settings, in closed form, against p."""
    try:
        settings = page.settings(max_new_tokens=2)
        check_request(page.prompt, settings)
        return note_html(exact_check_text(exact_check(page.pair(), page.prompt, settings)))
    except FAILURES as err:
        return error_html(f"Error: {err}")


# --- batch, replay, and the views of a shown run -------------------------------------------------


@on_gpu
def run_batch(page: Page):
    """Several prompts decoded as one batch: (status, streams, download) once per round."""
    try:
        prompts = split_batch(page.batch_prompts if isinstance(page.batch_prompts, str) else "")
        if not prompts:
            raise ValueError(f"no prompts: write one or more, separated by lines holding only {BATCH_SEPARATOR}")
        if len(prompts) > MAX_BATCH_UI:
            raise ValueError(f"{len(prompts)} prompts; this server decodes at most {MAX_BATCH_UI} at once")
        settings = page.settings(draft_greedy=False)
        for prompt in prompts:
            check_request(prompt, settings)
        if not page.pair_loaded():
            yield note_html("loading models…"), "", gr.skip()
        pair = page.pair()
        prompts_ids = encode_prompts(pair, prompts, settings)
        yield note_html(prefilling(f"batch of {len(prompts)}", sum(map(len, prompts_ids)))), "", gr.skip()
        updates = stream_batch(pair, prompts, settings, prompts_ids=prompts_ids, time_limit_s=TIME_LIMIT_S,
                               trace_dir=trace_dir())
        first = next(updates)
    except FAILURES as err:
        yield error_html(f"Error: {err}"), "", gr.skip()
        return
    SERVED["runs"] += 1
    drawn = -math.inf  # the first round is drawn at once
    for update in _chained(first, updates):
        if isinstance(update, BatchRound):
            SERVED["rounds"] += 1
            if time.perf_counter() - drawn >= UPDATE_S:  # as `follow`: every round shows, several at once
                drawn = time.perf_counter()
                status = note_html(f"batch of {len(update.runs)}: round {update.index + 1}")
                yield status, batch_html(update.runs), gr.skip()
        elif isinstance(update, Finished):
            runs = update.runs
            tokens = sum(r.n_tokens for r in runs)
            seconds = max(r.decode_ms for r in runs) / 1000
            stopped = f" Stopped at this server's time limit ({TIME_LIMIT_S:.0f} s)." if update.stopped else ""
            yield (note_html(f"done: a batch of {len(runs)}, {tokens} tokens in {seconds:.2f} s "
                             f"({tokens / seconds:.1f} tokens/s over all rows).{stopped}"), batch_html(runs),
                   str(update.trace))


def replay(file, show_rounds, request: gr.Request = None):
    """Show a saved trace without loading any model; Step then walks through it from its first round."""
    if file is None:
        return View(status=note_html("no file")).outputs()
    try:
        runs = load_runs(file if isinstance(file, str) else file.name)
    except (ValueError, OSError, UnicodeDecodeError) as err:
        return View(status=error_html(f"Error: {err}")).outputs()
    spec, base = split_runs(runs)
    if spec is not None and spec.events:
        stepping.keep(request, Stepper(spec=spec, base=base, shown=len(spec.events), replay=True))
    view = View(status=note_html(f"replaying a trace of {spec.meta.target if spec else '?'}; Step walks through "
                                 "it round by round"), spec=spec, base=base, show_rounds=bool(show_rounds))
    return view.outputs(race=race_html(spec, base) if spec and base else "")


def rerender(runs, show_rounds):
    spec, base = split_runs(runs)
    diff_at = greedy_diff(spec, base)
    return stream_html(spec, show_rounds, diff_at), stream_html(base, show_rounds, diff_at) if base else ""


def inspect_token(runs, choice):
    spec, _ = split_runs(runs)
    if spec is None or not choice:
        return charts.token_inspector(None)
    round_index, position = (int(x) for x in choice.split(":"))
    token = spec.events[round_index].drafted[position]
    return charts.token_inspector(token, f"round {round_index + 1}, position {position + 1}:")


def race(runs):
    spec, base = split_runs(runs)
    if not (spec and base):
        return note_html("The race needs a run with 'compare with baseline'.")
    # a fresh comment makes the HTML differ, so the browser re-creates it and the animation restarts
    return race_html(spec, base) + f"<!-- {time.monotonic()} -->"


def page_opened():
    """The first run's settings for the page and the note saying why; while the app is still measuring this
    machine, what it is at, and the page's timer (`warming`) asks again until it is done."""
    if not WARMING.ready.is_set():
        return *[gr.skip()] * 4, note_html(WARMING.said()), gr.Timer(active=True)
    drafter, gamma, branch, nodes, note = first_run_values("offline")
    return (gr.update(value=drafter), gr.update(value=gamma), gr.update(value=branch), gr.update(value=nodes), note,
            gr.Timer(active=False))


def temperature_changed(preset, temperature, drafter, gamma, branch, nodes):
    """Across 0, the drafting controls follow to what is expected fastest here when sampling (or greedy),
    unless the viewer has set them to something else; with the note that says why."""
    if preset not in PRESETS:
        return [gr.skip()] * 5
    sampled = temperature > 0
    *now, note = first_run_values(preset, sampled)
    other = first_run_values(preset, not sampled)[:4]
    if now == list(other) or [drafter, gamma, branch, nodes] != list(other):
        return [gr.skip()] * 5
    return [*(gr.update(value=v) for v in now), note]


def drafter_picked(drafter, branch):
    """A drafter that drafts chains only (the draft model, prompt lookup) picked while the controls ask for a tree:
    the tree becomes a chain (one child per draft, every draft verified), and the status says so."""
    kind = DRAFTER_KINDS.get(drafter)
    if kind is None or kind.trees or (branch or 1) <= 1:
        return [gr.skip()] * 3
    name = kind.label.split(" (")[0]
    return [gr.update(value=1), gr.update(value=0),
            note_html(f"{name[0].upper()}{name[1:]} drafts chains: children per draft is now 1 (a tree needs the "
                      "EAGLE head).")]


def preset_changed(preset, temperature=0.0):
    """Custom boxes shown for a custom pair, whose draft model drafts (it has no EAGLE head), in chains; a
    preset's first-run settings (drafter, γ, policy), for sampling if the temperature is above 0."""
    boxes = [gr.update(visible=preset == CUSTOM)] * 2
    if preset == CUSTOM:
        return [*boxes, gr.update(value="model"), gr.skip(), gr.skip(), gr.update(value=1), gr.update(value=0)]
    if preset not in PRESETS:
        return [*boxes, *[gr.skip()] * 5]
    drafter, gamma, branch, nodes, _ = first_run_values(preset, temperature > 0)
    return [*boxes, gr.update(value=drafter), gr.update(value=gamma), gr.update(value=PRESETS[preset].gamma_policy),
            gr.update(value=branch), gr.update(value=nodes)]
