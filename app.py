"""specviz web app: watch speculative decoding, round by round (Gradio 6).

Layout first, then handlers as plain generator functions; `python app.py` serves on
0.0.0.0:7860 (GRADIO_SERVER_NAME / GRADIO_SERVER_PORT respected) with the offline default pair.
The UI consumes events from the specviz library and never touches tensors.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import gradio as gr

from specviz.core.events import Run, load_runs
from specviz.core.generator import HEAD_DRAFTERS, MAX_GAMMA, Settings, compile_by_default, generate
from specviz.core.generator import validate_prompt as check_prompt
from specviz.models.loading import PRESETS, ModelPair, load_pair
from specviz.tools.costs import Choice, Costs, describe, first_run
from specviz.tools.lossless import sample_check
from specviz.tools.stream import BatchRound, Finished, RoundDone, Update, stream, stream_batch
from specviz.view import charts
from specviz.view.rendering import (
    CSS,
    batch_html,
    diff_html,
    error_html,
    first_difference,
    legend_html,
    note_html,
    race_html,
    stats_html,
    stream_html,
)
from specviz.view.stages import how_it_works_html, round_stages, stage_html

CUSTOM = "custom (enter ids below)"
EXAMPLES = [
    "The future of AI",
    "Robot learning emotions",
    "Happy Birthday lyrics",
    "Rewrite this function to use a list comprehension:\n\ndef squares(n):\n    out = []\n    for i in range(n):\n"
    "        out.append(i * i)\n    return out",
]
# Edits copy most of their input: where prompt lookup drafts long runs that the target accepts.
EDIT_EXAMPLES = [
    "Correct the spelling in this note: Dear Sam, thank you for the lovley flowers. They brighten up the "
    "kitchen and remind me of our trip to the contryside last sumer.",
    "Add a docstring to this function:\n\ndef clamp(value, low, high):\n    if value < low:\n        return low\n"
    "    if value > high:\n        return high\n    return value",
    "Change this code to print the result instead of returning it:\n\ndef greet(name):\n    message = "
    "'Hello, ' + name + '!'\n    return message",
    "Replace 'car' with 'bicycle' in this text: My car is parked outside. I bought the car last year, and the car "
    "has been very reliable.",
]
DRAFTER_CHOICES = [("draft model", "model"), ("prompt lookup (copies from the prompt, no model)", "lookup"),
                   ("EAGLE head (reads the target's hidden states)", "eagle"),
                   ("prompt lookup where the text repeats, EAGLE head elsewhere", "lookup+eagle")]
POLICY_CHOICES = [("fixed", "fixed"), ("grow-shrink (+2 when all accepted, -1 on a rejection)", "grow-shrink"),
                  ("expected speedup (from measured α and costs)", "expected")]
CACHE_CHOICES = [("static (pre-allocated; rollback moves a length)", "static"),
                 ("dynamic (transformers' DynamicCache)", "dynamic"), ("none (recompute everything)", "none")]
QUEUE_SIZE = int(os.environ.get("SPECVIZ_QUEUE_SIZE", "16"))
# Public mode (on in the Docker image): presets only, and caps on what one request may ask for.
PUBLIC = os.environ.get("SPECVIZ_PUBLIC", "").lower() not in ("", "0", "false", "no")
MAX_PROMPT_CHARS = 2000 if PUBLIC else 50_000
MAX_TOKENS_UI = 256 if PUBLIC else 512
MAX_GAMMA_UI = 8 if PUBLIC else MAX_GAMMA
GAMMA_MAX_ADAPTIVE = min(16, MAX_GAMMA_UI)  # the cap an adaptive policy grows to
FIRST_RUN = PRESETS["offline"]  # the page opens with the offline preset; drafter and γ as measured best here
log = logging.getLogger("specviz")
MAX_BATCH_UI = 4 if PUBLIC else 8
BATCH_SEPARATOR = "---"
TIME_LIMIT_S = float(os.environ.get("SPECVIZ_TIME_LIMIT_S", "120" if PUBLIC else "0"))  # 0: none

try:  # ZeroGPU on Hugging Face Spaces: borrow a GPU per request; elsewhere a no-op
    import spaces

    on_gpu = spaces.GPU(duration=120)
except ImportError:

    def on_gpu(fn):
        return fn


TRACE_DIR = Path(tempfile.mkdtemp(prefix="specviz-traces-"))

SERVED = {"runs": 0, "rounds": 0}  # counters: a cancelled run stops adding rounds
_pairs: dict[tuple[str, str], ModelPair] = {}
_pairs_lock = threading.Lock()


def get_pair(preset: str, custom_target: str, custom_draft: str, dtype: str = "auto") -> ModelPair:
    """Load a pair once and keep it: the default preset, plus the last other pair (or dtype) asked for."""
    if preset == CUSTOM and PUBLIC:
        raise ValueError("custom models are turned off on this public server; pick a preset")
    if preset == CUSTOM:
        if not custom_target.strip() or not custom_draft.strip():
            raise ValueError("a custom pair needs both a target id and a draft id")
        key, kwargs = (custom_target.strip(), custom_draft.strip(), dtype), {"dtype": dtype}
    else:
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; choose one of: {', '.join(PRESETS)}")
        key, kwargs = (PRESETS[preset].target, PRESETS[preset].draft, dtype), {"preset": preset, "dtype": dtype}
    with _pairs_lock:
        if key not in _pairs:
            kwargs["progress"] = log.info  # converting, measuring kernels: on the server's console
            pair = load_pair(*key[:2], **kwargs) if preset == CUSTOM else load_pair(**kwargs)
            for old in [k for k in _pairs if k != (PRESETS["offline"].target, PRESETS["offline"].draft, "auto")]:
                del _pairs[old]  # keep memory bounded: one non-default pair at a time
            _pairs[key] = pair
        return _pairs[key]


@dataclass
class View:
    """Everything the page shows for a pair of runs; `outputs` orders it like OUTPUTS."""

    status: str = ""
    spec: Run | None = None
    base: Run | None = None
    show_rounds: bool = False
    stage: int | None = None  # the stage the last round is shown at (None: all of it)

    def round_view(self) -> tuple[str, str]:
        """The last round shown, stage by stage, and the five steps with its numbers."""
        if self.spec is None or not self.spec.events:
            return STEP_HINT, ""
        event = self.spec.events[-1]
        stage = len(round_stages(event, self.spec.meta)) - 1 if self.stage is None else self.stage
        return stage_html(event, self.spec.meta, stage), how_it_works_html(event, self.spec.meta, stage)

    def outputs(self, download: str | None = None, race: str = "", final: bool = True):
        """The page; between rounds (final=False) the inspector and the download stay as they are."""
        diff_at = greedy_diff(self.spec, self.base)
        runs = [r for r in (self.spec, self.base) if r is not None]
        picker = gr.skip()
        if final:  # the inspector's list only changes when a run ends, not every round
            choices = token_choices(self.spec)
            # open the inspector on the first rejection, where there is most to see
            first_rejected = next((value for label, value in choices if "(rejected)" in label), None)
            picker = gr.update(choices=choices, value=first_rejected)
        return (
            self.status,
            stream_html(self.spec, self.show_rounds, diff_at),
            stream_html(self.base, self.show_rounds, diff_at) if self.base else "",
            diff_html(self.spec, self.base) if self.spec and self.base else "",
            stats_html(self.spec, self.base),
            charts.tokens_per_round(self.spec),
            charts.tokens_over_time(self.spec, self.base),
            charts.acceptance_by_position(self.spec),
            charts.speedup_curve(self.spec, self.base),
            charts.cache_lengths(self.spec),
            runs,
            picker,
            download if final else gr.skip(),
            race if final else gr.skip(),
            *self.round_view(),
        )

    def stage_outputs(self):
        """Only the status and the round view change (a stage within a shown round)."""
        return (self.status, *[gr.skip()] * (len(OUTPUTS) - 3), *self.round_view())


def greedy_diff(spec: Run | None, base: Run | None) -> int | None:
    """Where greedy texts part (None if identical, sampled, or no baseline)."""
    if spec and base and spec.meta.sampling.greedy:
        return first_difference(spec.token_ids, base.token_ids)
    return None


def split_runs(runs: list[Run] | None) -> tuple[Run | None, Run | None]:
    spec = next((r for r in runs or [] if r.meta.mode == "speculative"), None)
    base = next((r for r in runs or [] if r.meta.mode == "baseline"), None)
    return spec, base


def token_choices(run: Run | None) -> list[tuple[str, str]]:
    """Dropdown entries for the inspector: every tested drafted token."""
    out = []
    for e in run.events if run else []:
        for i, t in enumerate(e.drafted):
            if t.status != "unverified":
                out.append((f"round {e.index + 1} · position {i + 1} · {t.text!r} ({t.status})", f"{e.index}:{i}"))
    return out


def check_request(prompt: str, settings: Settings) -> None:
    """What this server accepts, beyond what the library does (ValueError otherwise)."""
    settings.validate()
    if not isinstance(prompt, str):
        raise ValueError("the prompt must be text")
    check_prompt(prompt)
    if len(prompt) > MAX_PROMPT_CHARS:
        raise ValueError(f"the prompt has {len(prompt)} characters; this server takes at most {MAX_PROMPT_CHARS}")
    if settings.max_new_tokens > MAX_TOKENS_UI:
        raise ValueError(f"max_new_tokens must be at most {MAX_TOKENS_UI} here, got {settings.max_new_tokens}")
    if settings.gamma > MAX_GAMMA_UI:
        raise ValueError(f"gamma must be at most {MAX_GAMMA_UI} here, got {settings.gamma}")


def make_settings(gamma, gamma_policy, drafter, temperature, top_k, top_p, seed, max_new_tokens,
                  cache="static", compiled=False, draft_greedy=False) -> Settings:
    """Settings from the page's controls; ValueError with the control's name if one is off."""
    gamma = _int(gamma, "gamma")
    return Settings(gamma=gamma, gamma_policy=str(gamma_policy), gamma_max=max(gamma, GAMMA_MAX_ADAPTIVE),
                    drafter=str(drafter), temperature=_float(temperature, "temperature"), top_k=_int(top_k, "top_k"),
                    top_p=_float(top_p, "top_p"), seed=_int(seed, "seed"),
                    max_new_tokens=_int(max_new_tokens, "max_new_tokens"), cache=str(cache), compile=bool(compiled),
                    draft_greedy=bool(draft_greedy))


def split_batch(text: str) -> list[str]:
    """Prompts separated by lines holding only '---' (a prompt may span lines)."""
    prompts, lines = [], []
    for line in (text or "").splitlines() + [BATCH_SEPARATOR]:
        if line.strip() == BATCH_SEPARATOR:
            if "\n".join(lines).strip():
                prompts.append("\n".join(lines).strip())
            lines = []
        else:
            lines.append(line)
    return prompts


@on_gpu
def run_generation(prompt, preset, custom_target, custom_draft, gamma, temperature, top_k, top_p, seed,
                   max_new_tokens, compare, show_rounds, drafter="model", gamma_policy="fixed", cache="static",
                   compiled=False, draft_greedy=False, request: gr.Request = None):
    """Speculative decoding (then the baseline, if asked): the page once per round."""
    view = View(show_rounds=bool(show_rounds))
    _drop_stepper(request)  # a plain run ends any stepping
    try:
        settings = make_settings(gamma, gamma_policy, drafter, temperature, top_k, top_p, seed, max_new_tokens, cache,
                                 compiled, draft_greedy)
        check_request(prompt, settings)
        view.status = note_html("loading models…")
        yield view.outputs(final=False)
        pair, updates = open_stream(prompt, preset, custom_target, custom_draft, settings, compare)
    except (ValueError, OSError, RuntimeError) as err:
        view.status = error_html(f"Error: {err}")
        yield view.outputs()
        return
    SERVED["runs"] += 1
    yield from follow(view, updates, draft_note(pair, settings))


def open_stream(prompt, preset, custom_target, custom_draft, settings: Settings,
                compare) -> tuple[ModelPair, Iterator[Update]]:
    """The pair and its stream, the request checked against the pair before anything is shown."""
    check_request(prompt, settings)
    pair = get_pair(preset, custom_target or "", custom_draft or "")
    updates = stream(pair, prompt, settings, compare=bool(compare), time_limit_s=TIME_LIMIT_S, trace_dir=TRACE_DIR)
    first = next(updates)
    return pair, _chained(first, updates)


def _chained(first: Update, rest: Iterator[Update]) -> Iterator[Update]:
    """The first update again, then the rest; closing it closes the stream (itertools.chain cannot)."""
    yield first
    yield from rest


def draft_note(pair: ModelPair, settings: Settings) -> str:
    return f"Draft note: {pair.draft_note}. " if pair.draft_note and settings.drafter == "model" else ""


def follow(view: View, updates: Iterator[Update], note: str):
    """The page once per speculative round (every 8 baseline tokens) until the runs finish."""
    for update in updates:
        if isinstance(update, RoundDone):
            event, speculative = update.event, update.run.meta.mode == "speculative"
            if speculative:
                SERVED["rounds"] += 1
                view.spec = update.run
            else:
                view.base = update.run
            if speculative or event.index % 8 == 0 or event.finish_reason:  # the baseline: every 8 tokens
                what = f"round {event.index + 1}, " if speculative else ""
                view.status = note_html(f"{note}{update.run.meta.mode}: {what}{event.tokens_so_far} tokens")
                yield view.outputs(final=False)
        elif isinstance(update, Finished):
            stopped = f" Stopped at this server's time limit ({TIME_LIMIT_S:.0f} s)." if update.stopped else ""
            view.spec, view.base = update.spec, update.base
            view.status = note_html(f"{note}done: {view.spec.n_tokens} tokens.{stopped}")
            yield view.outputs(download=str(update.trace), race=race_html(view.spec, view.base) if view.base else "")


# --- step mode: one round at a time, and each round stage by stage -------------------------------
STEP_HINT = ('<div class="sv-note">Step runs one round and pauses on it; Next ▸ (or the key <b>n</b>) shows '
             "its stages one by one: each draft with q, the verify pass with p, each decision, the added "
             "token. Continue runs to the end.</div>")
MAX_STEPPERS = 32  # runs paused in step mode, one per browser session; the oldest goes first
# The key n presses Next ▸, except while typing in a field.
PAGE_JS = """() => {
  document.addEventListener("keydown", (e) => {
    const t = e.target;
    if (e.key !== "n" || e.ctrlKey || e.metaKey || e.altKey) return;
    if (t && (t.tagName === "INPUT" || t.tagName === "TEXTAREA" || t.isContentEditable)) return;
    const next = document.getElementById("next-btn");
    if (next) { e.preventDefault(); next.click(); }
  });
}"""
# Projector mode: large type through a class on the page, kept in the URL (?projector=1).
PROJECTOR_JS = """(on) => {
  document.body.classList.toggle("sv-projector", on);
  const url = new URL(window.location.href);
  if (on) url.searchParams.set("projector", "1"); else url.searchParams.delete("projector");
  window.history.replaceState(null, "", url);
}"""


def projector_from_url(request: gr.Request = None) -> bool:
    return getattr(request, "query_params", {}).get("projector") == "1"


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
            where = f"round {event.index + 1}, stage {self.stage + 1} of {self.stages()}" if event else "start"
            view.status = note_html(f"{self.note}Stepping: {where}. Next ▸ (key n) for the next stage, Step for the "
                                    "next round, Continue to run to the end; Run starts afresh with the page's "
                                    "settings.")
        else:
            view.status = note_html(f"{self.note}Stepped to the end: {spec.n_tokens} tokens. Step starts again.")
        return view

    def close(self) -> None:
        if self.updates is not None:
            self.updates.close()


_steppers: dict[str, Stepper] = {}
_steppers_lock = threading.Lock()


def _session(request: gr.Request | None) -> str:
    return getattr(request, "session_hash", None) or "-"


def _keep_stepper(request: gr.Request | None, stepper: Stepper) -> None:
    with _steppers_lock:
        old = _steppers.pop(_session(request), None)
        _steppers[_session(request)] = stepper
        if old is not None and old is not stepper:
            old.close()
        while len(_steppers) > MAX_STEPPERS:
            _steppers.pop(next(iter(_steppers))).close()


def _drop_stepper(request: gr.Request | None) -> None:
    with _steppers_lock:
        old = _steppers.pop(_session(request), None)
    if old is not None:
        old.close()


@on_gpu
def step(prompt, preset, custom_target, custom_draft, gamma, temperature, top_k, top_p, seed, max_new_tokens,
         compare, show_rounds, drafter="model", gamma_policy="fixed", cache="static", compiled=False,
         draft_greedy=False, request: gr.Request = None, *, within_round: bool = False):
    """The next round, at its first stage; with nothing to step through, a new run with the page's settings
    (or, after a replay, the trace from its first round). within_round (Next ▸): the shown round's next
    stage first, while it has one."""
    stepper = _steppers.get(_session(request))
    if within_round and stepper is not None and stepper.shown and stepper.stage + 1 < stepper.stages():
        stepper.stage += 1
        return stepper.view(bool(show_rounds)).stage_outputs()
    if stepper is None or not stepper.more():
        if stepper is not None and stepper.replay:
            stepper.shown = 0
        else:
            try:
                settings = make_settings(gamma, gamma_policy, drafter, temperature, top_k, top_p, seed,
                                         max_new_tokens, cache, compiled, draft_greedy)
                pair, updates = open_stream(prompt, preset, custom_target, custom_draft, settings, compare)
            except (ValueError, OSError, RuntimeError) as err:
                return View(status=error_html(f"Error: {err}")).outputs()
            first = next(updates)
            SERVED["runs"] += 1
            stepper = Stepper(spec=first.run, updates=_chained(first, updates), note=draft_note(pair, settings))
            _keep_stepper(request, stepper)
    stepper.next_round()
    return _stepper_outputs(stepper, show_rounds)


def _stepper_outputs(stepper: Stepper, show_rounds):
    view = stepper.view(bool(show_rounds))
    done = not stepper.more()
    race = race_html(view.spec, view.base) if done and view.base else ""
    return view.outputs(download=stepper.trace if done else None, race=race, final=done or stepper.shown == 1)


@functools.wraps(step)  # Gradio reads step's signature through this, so it passes the request too
def next_stage(*inputs, **kwargs):
    return step(*inputs, **kwargs, within_round=True)


def previous_stage(show_rounds, request: gr.Request = None):
    """One stage back, into the previous round's last stage from a round's first."""
    stepper = _steppers.get(_session(request))
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
    stepper = _steppers.get(_session(request))
    if stepper is None or not stepper.more():
        yield View(status=note_html("Nothing to continue: press Run, or Step to go round by round.")).outputs()
        return
    view = View(spec=stepper.spec, base=stepper.base, show_rounds=bool(show_rounds))
    if stepper.updates is not None:  # Stop cancels between rounds and leaves the rest to step through
        for outputs in follow(view, stepper.updates, stepper.note):
            stepper.spec, stepper.base = view.spec, view.base
            yield outputs
        stepper.updates = None
    else:
        view.status = note_html("replayed to the end")
        yield view.outputs(race=race_html(view.spec, view.base) if view.base else "")
    stepper.shown, stepper.stage = len(stepper.spec.events), stepper.stages() - 1


# --- lossless, visible ---------------------------------------------------------------------------
MAX_SAMPLES_UI = 2000 if PUBLIC else 20_000


@on_gpu
def check_float32(runs, preset, custom_target, custom_draft):
    """Run the shown greedy pair of runs again in float32: do the texts then agree token for token?"""
    spec, base = split_runs(runs)
    if spec is None or base is None or not spec.meta.sampling.greedy:
        return note_html("The float32 check reruns a greedy run and its baseline: run with temperature 0 and "
                         "'compare with baseline' first.")
    try:
        pair = get_pair(preset, custom_target or "", custom_draft or "", dtype="float32")
        if pair.target_name != spec.meta.target:
            raise ValueError(f"the page's model pair is not the one this run used ({spec.meta.target})")
        settings = Settings.of_run(spec.meta, record_top=0, compile=False)
        again = [generate(pair, spec.meta.prompt, settings, mode, prompt_ids=spec.meta.prompt_ids)
                 for mode in ("speculative", "baseline")]
    except (ValueError, OSError, RuntimeError) as err:
        return error_html(f"Error: {err}")
    shown, at = greedy_diff(spec, base), greedy_diff(*again)
    before = (f"In {spec.meta.dtype} (the runs above) they "
              + ("are identical." if shown is None else f"part at generated token {shown + 1}."))
    after = (f"identical, token for token ({again[0].n_tokens} tokens)" if at is None
             else f"part at generated token {at + 1}")
    return note_html(f"{before} Rerun just now in float32, same prompt ids and settings: speculative and "
                     f"baseline texts are {after}.")


@on_gpu
def sample_n(prompt, preset, custom_target, custom_draft, gamma, temperature, top_k, top_p, seed, drafter,
             draft_greedy, n):
    """The first token drawn n times with speculation and n times from the target alone."""
    try:
        n = _int(n, "N")
        if not 1 <= n <= MAX_SAMPLES_UI:
            raise ValueError(f"N must be in [1, {MAX_SAMPLES_UI}] here, got {n}")
        settings = make_settings(gamma, "fixed", drafter, temperature, top_k, top_p, seed, 2,
                                 draft_greedy=draft_greedy)
        check_request(prompt, settings)
        pair = get_pair(preset, custom_target or "", custom_draft or "")
        check = sample_check(pair, prompt, settings, n)
    except (ValueError, OSError, RuntimeError) as err:
        return error_html(f"Error: {err}"), charts.sample_histogram(None)
    SERVED["runs"] += 1
    kept = "" if check.acceptance is None else f" The first draft was kept in {check.acceptance:.1%} of the draws."
    verdict = ("within sampling noise" if check.tv_speculative <= 1.5 * check.tv_noise + 0.01 else
               "further from it than sampling noise explains")
    return (note_html(f"{n} + {n} draws in {check.speculative_s + check.target_alone_s:.1f} s. Total variation "
                      f"to the exact distribution: speculative {check.tv_speculative:.4f}, target alone "
                      f"{check.tv_target_alone:.4f}; sampling noise alone gives about {check.tv_noise:.4f} at "
                      f"N = {n}: the speculative draws are {verdict}.{kept}"),
            charts.sample_histogram(check))


@on_gpu
def run_batch(prompts_text, preset, custom_target, custom_draft, gamma, temperature, top_k, top_p, seed,
              max_new_tokens, drafter="model", gamma_policy="fixed", cache="static", compiled=False):
    """Several prompts decoded as one batch: (status, streams, download) once per round."""
    try:
        prompts = split_batch(prompts_text if isinstance(prompts_text, str) else "")
        if not prompts:
            raise ValueError(f"no prompts: write one or more, separated by lines holding only {BATCH_SEPARATOR}")
        if len(prompts) > MAX_BATCH_UI:
            raise ValueError(f"{len(prompts)} prompts; this server decodes at most {MAX_BATCH_UI} at once")
        settings = make_settings(gamma, gamma_policy, drafter, temperature, top_k, top_p, seed, max_new_tokens, cache,
                                 compiled)
        for prompt in prompts:
            check_request(prompt, settings)
        yield note_html("loading models…"), "", gr.skip()
        pair = get_pair(preset, custom_target or "", custom_draft or "")
        updates = stream_batch(pair, prompts, settings, time_limit_s=TIME_LIMIT_S, trace_dir=TRACE_DIR)
        first = next(updates)
    except (ValueError, OSError, RuntimeError) as err:
        yield error_html(f"Error: {err}"), "", gr.skip()
        return

    SERVED["runs"] += 1
    for update in itertools.chain([first], updates):
        if isinstance(update, BatchRound):
            SERVED["rounds"] += 1
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


def _int(value, name: str) -> int:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not number.is_integer():
        raise ValueError(f"{name} must be a whole number, got {value!r}")
    return int(number)


def _float(value, name: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None


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
        _keep_stepper(request, Stepper(spec=spec, base=base, shown=len(spec.events), replay=True))
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


_MACHINE_CHOICES: dict[str, tuple[Choice, Costs]] = {}  # preset -> its drafter and γ measured best here


def machine_first_run(preset: str) -> tuple[Choice, Costs] | None:
    """The preset's drafter and γ with the best expected speedup on this machine (measured once, then
    read from the cache; costs.py), or None for a preset without measured tokens per round."""
    if preset not in _MACHINE_CHOICES and PRESETS[preset].tokens_per_round:
        choice, costs = first_run(get_pair(preset, "", ""), PRESETS[preset].taus(), progress=log.info)
        if choice:
            _MACHINE_CHOICES[preset] = choice, costs
    return _MACHINE_CHOICES.get(preset)


def first_run_values(preset: str) -> tuple[str, int, str]:
    """(drafter, γ, a note) for a first run of this preset: measured here if already known, else the preset's."""
    known = _MACHINE_CHOICES.get(preset)
    if known:
        return known[0].drafter, known[0].gamma, note_html(describe(*known))
    return PRESETS[preset].drafter, PRESETS[preset].gamma, ""


def page_opened():
    drafter, gamma, note = first_run_values("offline")
    return gr.update(value=drafter), gr.update(value=gamma), note


def preset_changed(preset):
    """Custom boxes shown for a custom pair; a preset's first-run settings (drafter, γ, policy)."""
    boxes = [gr.update(visible=preset == CUSTOM)] * 2
    if preset not in PRESETS:
        return [*boxes, gr.skip(), gr.skip(), gr.skip()]
    drafter, gamma, _ = first_run_values(preset)
    return [*boxes, gr.update(value=drafter), gr.update(value=gamma),
            gr.update(value=PRESETS[preset].gamma_policy)]


def race(runs):
    spec, base = split_runs(runs)
    if not (spec and base):
        return note_html("The race needs a run with 'compare with baseline'.")
    # a fresh comment makes the HTML differ, so the browser re-creates it and the animation restarts
    return race_html(spec, base) + f"<!-- {time.monotonic()} -->"


# delete_cache: Gradio's copies of downloaded traces go after an hour, so a public server's disk stays flat
with gr.Blocks(title="specviz: watch speculative decoding", delete_cache=(600, 3600)) as demo:
    gr.Markdown("# specviz: watch speculative decoding\nA small draft model proposes γ tokens; the target "
                "checks them all in one forward pass and keeps each with probability min(1, p/q).")
    with gr.Row():
        with gr.Column(scale=2):
            prompt = gr.Textbox(label="Prompt", lines=3, value=EXAMPLES[0])
            gr.Examples(EXAMPLES, inputs=prompt, label="Example prompts")
            gr.Examples(EDIT_EXAMPLES, inputs=prompt, label="Edits: try them with prompt lookup")
        with gr.Column(scale=1):
            preset = gr.Dropdown([*PRESETS] if PUBLIC else [*PRESETS, CUSTOM], value="offline", label="Model pair")
            custom_target = gr.Textbox(label="Custom target (hub id or local dir)", visible=False)
            custom_draft = gr.Textbox(label="Custom draft (same tokenizer)", visible=False)
            drafter = gr.Dropdown(DRAFTER_CHOICES, value=FIRST_RUN.drafter, label="Drafter", elem_id="drafter")
            gamma_policy = gr.Dropdown(POLICY_CHOICES, value=FIRST_RUN.gamma_policy, label="γ policy",
                                       elem_id="gamma-policy",
                                       info=f"adaptive policies start at γ and draft at most {GAMMA_MAX_ADAPTIVE}")
            with gr.Accordion("Advanced", open=False):
                cache = gr.Radio(CACHE_CHOICES, value="static", label="KV cache (both models)", elem_id="cache-kind",
                                 info="'none' recomputes the whole text at every forward pass: what a KV cache buys")
                compiled = gr.Checkbox(compile_by_default(), label="compiled forwards (torch.compile)",
                                       elem_id="compile", info="static cache, Llama-family models; each new shape "
                                       "compiles once (a minute or so), later starts load it from disk")
    with gr.Row():
        gamma = gr.Slider(1, MAX_GAMMA_UI, value=FIRST_RUN.gamma, step=1, label="γ (draft tokens per round)")
        temperature = gr.Slider(0, 2, value=0, step=0.05, label="temperature (0 = greedy)")
        top_k = gr.Number(0, label="top-k (0 = off)", precision=0)
        top_p = gr.Slider(0.05, 1, value=1, step=0.05, label="top-p")
        seed = gr.Number(0, label="seed", precision=0)
        max_new_tokens = gr.Slider(1, MAX_TOKENS_UI, value=64, step=1, label="max new tokens")
    with gr.Row():
        compare = gr.Checkbox(True, label="compare with baseline")
        show_rounds = gr.Checkbox(False, label="mark round boundaries")
        draft_greedy = gr.Checkbox(False, label="draft greedily", elem_id="draft-greedy",
                                   info="sampled runs: the drafter proposes its most likely token (q one-hot; exact)")
        projector = gr.Checkbox(False, label="projector (large type)", elem_id="projector")
    with gr.Row():
        run_btn = gr.Button("Run", variant="primary", elem_id="run-btn")
        step_btn = gr.Button("Step (one round)", elem_id="step-btn")
        back_btn = gr.Button("◂ Back", elem_id="back-btn")
        next_btn = gr.Button("Next ▸ (key n)", elem_id="next-btn")
        continue_btn = gr.Button("Continue", elem_id="continue-btn")
        stop_btn = gr.Button("Stop", variant="stop", elem_id="stop-btn")
    status = gr.HTML(elem_id="status")
    with gr.Row():
        round_box = gr.HTML(STEP_HINT, elem_id="stage-view")
        how_box = gr.HTML(elem_id="how-it-works")
    gr.HTML(legend_html())
    with gr.Row():
        with gr.Column():
            gr.Markdown("### Speculative")
            spec_html = gr.HTML(elem_id="spec-stream")
        with gr.Column():
            gr.Markdown("### Baseline (target alone)")
            base_html = gr.HTML(elem_id="base-stream")
    diff_box = gr.HTML()
    with gr.Row():  # beside the greedy diff marker: does the text still part in float32?
        fp32_btn = gr.Button("Check in float32", elem_id="fp32-btn", scale=0, min_width=180)
        fp32_status = gr.HTML(elem_id="fp32-status")
    stats = gr.HTML(elem_id="stats")
    with gr.Row():
        fig_rounds = gr.Plot(elem_id="chart-rounds", show_label=False)
        fig_time = gr.Plot(elem_id="chart-time", show_label=False)
    with gr.Row():
        fig_position = gr.Plot(elem_id="chart-position", show_label=False)
        fig_speedup = gr.Plot(elem_id="chart-speedup", show_label=False)
    fig_cache = gr.Plot(elem_id="chart-cache", show_label=False)
    with gr.Accordion("Lossless, visible: sample N times", open=True):
        gr.Markdown("Speculative sampling leaves the target's distribution unchanged. Draw the first token N "
                    "times with speculation and N times from the target alone (the settings above, temperature "
                    "> 0) and compare both with the exact distribution. (Greedy runs: **Check in float32** "
                    "beside the texts.)")
        with gr.Row():
            samples = gr.Number(1000, label="N", precision=0, minimum=1, maximum=MAX_SAMPLES_UI, elem_id="samples")
            sample_btn = gr.Button("Sample N times", elem_id="sample-btn")
        lossless_status = gr.HTML(elem_id="lossless-status")
        fig_sample = gr.Plot(elem_id="chart-sample", show_label=False)
    with gr.Accordion("Token inspector", open=True):
        token_pick = gr.Dropdown([], label="drafted token", elem_id="token-pick")
        fig_inspect = gr.Plot(show_label=False)
    with gr.Accordion("Race replay: both runs at their measured speeds", open=True):
        race_btn = gr.Button("Replay the race")
        race_box = gr.HTML()
    with gr.Accordion("Batch: several prompts decoded together, one stream per prompt", open=False):
        gr.Markdown(f"Up to {MAX_BATCH_UI} prompts, separated by lines holding only `{BATCH_SEPARATOR}`. They use "
                    "the settings above; each row accepts drafts at its own pace, and a row that finishes leaves "
                    "the batch.")
        batch_prompts = gr.Textbox(label="Prompts", lines=6, elem_id="batch-prompts",
                                   value=f"\n{BATCH_SEPARATOR}\n".join(EXAMPLES[:2] + EDIT_EXAMPLES[:2]))
        batch_btn = gr.Button("Run batch", elem_id="batch-btn")
        batch_status = gr.HTML(elem_id="batch-status")
        batch_box = gr.HTML(elem_id="batch-streams")
        batch_download = gr.DownloadButton("Download batch (JSON)", value=None)
    with gr.Row():
        download = gr.DownloadButton("Download run (JSON)", value=None)
        upload = gr.File(label="Replay a JSON run (no model needed)", file_types=[".json"])
    runs_state = gr.State([])

    OUTPUTS = [status, spec_html, base_html, diff_box, stats, fig_rounds, fig_time, fig_position, fig_speedup,
               fig_cache, runs_state, token_pick, download, race_box, round_box, how_box]
    INPUTS = [prompt, preset, custom_target, custom_draft, gamma, temperature, top_k, top_p, seed, max_new_tokens,
              compare, show_rounds, drafter, gamma_policy, cache, compiled, draft_greedy]
    device = {"concurrency_limit": 1, "concurrency_id": "device", "show_progress": "hidden"}
    run_event = run_btn.click(run_generation, INPUTS, OUTPUTS, api_name="run", **device)
    step_btn.click(step, INPUTS, OUTPUTS, api_name="step", **device)
    next_btn.click(next_stage, INPUTS, OUTPUTS, api_name="next", **device)
    back_btn.click(previous_stage, show_rounds, OUTPUTS, api_name="back", show_progress="hidden")
    continue_event = continue_btn.click(continue_run, show_rounds, OUTPUTS, api_name="continue", **device)
    fp32_btn.click(check_float32, [runs_state, preset, custom_target, custom_draft], fp32_status,
                   api_name="check_float32", **device)
    sample_btn.click(sample_n, [prompt, preset, custom_target, custom_draft, gamma, temperature, top_k, top_p, seed,
                                drafter, draft_greedy, samples], [lossless_status, fig_sample], api_name="sample",
                     **device)
    projector.change(None, projector, None, js=PROJECTOR_JS)
    demo.load(projector_from_url, None, projector, api_visibility="private")
    demo.unload(_drop_stepper)
    BATCH_INPUTS = [batch_prompts, preset, custom_target, custom_draft, gamma, temperature, top_k, top_p, seed,
                    max_new_tokens, drafter, gamma_policy, cache, compiled]
    batch_event = batch_btn.click(run_batch, BATCH_INPUTS, [batch_status, batch_box, batch_download],
                                  api_name="batch", concurrency_limit=1, concurrency_id="device",
                                  show_progress="hidden")
    stop_btn.click(None, None, None, cancels=[run_event, batch_event, continue_event], api_visibility="private")
    upload.upload(replay, [upload, show_rounds], OUTPUTS, api_name="replay")
    show_rounds.change(rerender, [runs_state, show_rounds], [spec_html, base_html], api_visibility="private")
    token_pick.change(inspect_token, [runs_state, token_pick], fig_inspect, api_visibility="private")
    race_btn.click(race, runs_state, race_box, api_visibility="private")
    preset.change(preset_changed, preset, [custom_target, custom_draft, drafter, gamma, gamma_policy],
                  api_visibility="private")
    demo.load(page_opened, None, [drafter, gamma, status], api_visibility="private")


def launch(**kwargs):
    """Queue and launch with the app's CSS and script (Gradio 6 takes them at launch)."""
    demo.queue(max_size=QUEUE_SIZE)
    return demo.launch(css=CSS, js=PAGE_JS, show_error=True, **kwargs)


def warm_up() -> None:
    """Load (on first use, convert) the default pair and run it once, speculative and baseline, so
    the first visitor's first round pays neither for loading nor for the kernels' first calls (nor,
    with SPECVIZ_COMPILE=1, for compiling the default settings' forwards)."""
    pair = get_pair("offline", "", "")
    if pair.head is not None:  # the first run's drafter and γ, measured best on this machine
        machine_first_run("offline")
    drafter, gamma, _ = first_run_values("offline")
    drafter = drafter if drafter not in HEAD_DRAFTERS or pair.head is not None else "model"
    settings = Settings(gamma=gamma, drafter=drafter, max_new_tokens=gamma + 2, record_top=0)  # a full round
    for mode in ("speculative", "baseline"):
        generate(pair, EXAMPLES[0], settings, mode=mode)


if __name__ == "__main__":
    logging.basicConfig(format="%(message)s")  # specviz's warnings (compiling, falling back) on the console
    log.setLevel(logging.INFO)  # and its progress (loading, measuring this machine's kernels and costs)
    warm_up()
    launch(server_name=os.environ.get("GRADIO_SERVER_NAME", "0.0.0.0"),
           server_port=int(os.environ.get("GRADIO_SERVER_PORT", "7860")))
