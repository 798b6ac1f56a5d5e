"""What the page offers and accepts: examples, choices, this server's limits, the pairs it keeps
loaded, and `Page`, the page's settings read into one object in one place."""

from __future__ import annotations

import atexit
import functools
import gc
import logging
import math
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from ..core.events import Run
from ..core.generator import DRAFTER_KINDS, MAX_GAMMA, MAX_NODES, Settings, draft_width
from ..core.generator import validate_prompt as check_prompt
from ..models.loading import PRESETS, ModelPair, load_pair
from ..tools.costs import RUN_TOKENS, Choice, Costs, against, describe, expected_speedup, first_run, headline, rank
from ..view.rendering import note_html

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
DRAFTER_CHOICES = [(kind.label, name) for name, kind in DRAFTER_KINDS.items()]
POLICY_CHOICES = [("fixed", "fixed"), ("grow-shrink (+2 when all accepted, -1 on a rejection)", "grow-shrink"),
                  ("expected speedup (from measured α and costs)", "expected")]
CACHE_CHOICES = [("static (pre-allocated; rollback moves a length)", "static"),
                 ("dynamic (grown at every pass, as transformers' DynamicCache)", "dynamic"),
                 ("none (recompute everything)", "none")]


def setting(name: str, default: float, whole: bool = False, least: float = 0) -> float:
    """The environment variable `name` as a number of at least `least` (a whole one where `whole`), or `default`
    where it is unset or empty; a value that is neither stops the app with one line saying so, not a traceback."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text) if whole else float(text)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or value < least:
        kind = "a whole number" if whole else "a number"
        raise SystemExit(f"{name} must be {kind} of at least {least:g}, got {text!r}")
    return value


# Viewers waiting for the model at most (a lecture hall of 120 pressing Run at once, twice over): each waits in
# Gradio's queue, holding a request's few kilobytes, and sees their place; the next is refused with "queue full".
QUEUE_SIZE = setting("SPECVIZ_QUEUE_SIZE", 256, whole=True, least=1)
# Public mode (on in the Docker image): presets only, and caps on what one request may ask for.
PUBLIC = os.environ.get("SPECVIZ_PUBLIC", "").lower() not in ("", "0", "false", "no")
MAX_PROMPT_CHARS = 2000 if PUBLIC else 50_000
MAX_TOKENS_UI = 256 if PUBLIC else 512
MAX_GAMMA_UI = 8 if PUBLIC else MAX_GAMMA
MAX_NODES_UI = 31 if PUBLIC else MAX_NODES
GAMMA_MAX_ADAPTIVE = min(16, MAX_GAMMA_UI)  # the cap an adaptive policy grows to
MAX_BATCH_UI = 4 if PUBLIC else 8
MAX_SAMPLES_UI = 2000 if PUBLIC else 20_000
BATCH_SEPARATOR = "---"
TIME_LIMIT_S = setting("SPECVIZ_TIME_LIMIT_S", 120 if PUBLIC else 0)  # 0: none
UPDATE_S = setting("SPECVIZ_UPDATE_S", 0.25)  # the page drawn at most this often in a run (0: always)
# each of the run's charts redrawn at most this often in a run, one at a time, and all at its end (0: all with the
# page): each redraw is a Plotly layout in the browser's one thread, where a click (Stop) waits for it, and on the
# CPU the decode runs on (`bench-page --charts-s`)
CHARTS_S = setting("SPECVIZ_CHARTS_S", 3.0)
FIRST_RUN = PRESETS["offline"]  # the page opens with the offline preset; drafter and γ as measured best here
SERVED = {"runs": 0, "rounds": 0}  # counters: a cancelled run stops adding rounds

log = logging.getLogger("specviz")


class Warming:
    """The app's first work on this machine (loading, on a fresh cache converting and timing, then measuring the
    first run's costs) while the page is already served: its step for the page to say, and a Run waiting on it
    (a run beside the measuring would spoil both). Ready unless a warm-up is under way."""

    def __init__(self):
        self.ready, self.step, self.total, self.what = threading.Event(), 0, 0, ""
        self.ready.set()

    def begin(self, total: int) -> None:
        self.step, self.total = 0, total
        self.ready.clear()

    def at(self, what: str) -> None:
        self.step, self.what = self.step + 1, what
        log.info("warming up, step %d of %d: %s", self.step, self.total, what)

    def finish(self) -> None:
        self.ready.set()

    def said(self) -> str:
        return f"Measuring this machine, step {self.step} of {self.total}: {self.what}. Runs start when it is done."


WARMING = Warming()


def share_the_cores() -> str:
    """Set the threads the app decodes with, and say why. A browser on the same machine draws the page while
    the model runs, and a decode on every core then waits for it at each of the forward's parallel steps: with
    the page open on a 2-core CPU, a decode on both cores runs far slower than on one (`bench-page` measures
    it). So the app leaves one core to the browser and the server; public mode (the Docker
    image) and a Hugging Face Space (SPACE_ID), whose browsers are elsewhere, keep them all; SPECVIZ_THREADS
    sets the count."""
    import torch

    if asked := setting("SPECVIZ_THREADS", 0, whole=True, least=1):
        threads, why = asked, "SPECVIZ_THREADS"
    elif PUBLIC or os.environ.get("SPACE_ID"):
        threads, why = torch.get_num_threads(), "public mode or a Space: browsers elsewhere"
    else:
        threads = max(1, torch.get_num_threads() - 1)
        why = "one core left to a browser on this machine and the server (SPECVIZ_THREADS to change)"
    torch.set_num_threads(threads)
    return f"decoding on {threads} thread{'s' if threads > 1 else ''}: {why}"


@functools.cache
def trace_dir() -> Path:
    """The folder the runs' trace files go to (the newest 64 kept): made on the first run inside Gradio's own
    cache folder, so that Gradio serves the files where they are instead of keeping copies, and removed when the
    process ends (Ctrl-C or SIGTERM; app.py)."""
    from gradio.utils import get_upload_folder

    (cache := Path(get_upload_folder())).mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="specviz-traces-", dir=cache))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


@dataclass
class Page:
    """The page's controls, as a handler reads them (names are the components' keys in app.py)."""

    prompt: Any = ""
    preset: Any = "offline"
    custom_target: Any = ""
    custom_draft: Any = ""
    gamma: Any = 2
    temperature: Any = 0.0
    top_k: Any = 0
    top_p: Any = 1.0
    seed: Any = 0
    max_new_tokens: Any = 64
    compare: Any = True
    show_rounds: Any = False
    drafter: Any = "model"
    gamma_policy: Any = "fixed"
    cache: Any = "static"
    compiled: Any = False
    draft_greedy: Any = False
    branch: Any = 1
    nodes: Any = 0
    samples: Any = 1000
    batch_prompts: Any = ""

    @classmethod
    def of(cls, values: dict[str, Any]) -> Page:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})

    def settings(self, **changes) -> Settings:
        """Settings from the controls; ValueError naming the control that is off."""
        gamma = as_int(self.gamma, "gamma")
        values = dict(gamma=gamma, gamma_policy=str(self.gamma_policy), gamma_max=max(gamma, GAMMA_MAX_ADAPTIVE),
                      drafter=str(self.drafter), temperature=as_float(self.temperature, "temperature"),
                      top_k=as_int(self.top_k, "top_k"), top_p=as_float(self.top_p, "top_p"),
                      seed=as_int(self.seed, "seed"),
                      max_new_tokens=as_int(self.max_new_tokens, "max_new_tokens"), cache=str(self.cache),
                      compile=bool(self.compiled), draft_greedy=bool(self.draft_greedy),
                      branch=as_int(self.branch, "branch"), nodes=as_int(self.nodes, "nodes"))
        return Settings(**{**values, **changes})

    def pair(self, dtype: str = "auto") -> ModelPair:
        return get_pair(self.preset, self.custom_target or "", self.custom_draft or "", dtype)

    def pair_loaded(self) -> bool:
        return pair_loaded(self.preset, self.custom_target or "", self.custom_draft or "")


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
    if draft_width(settings) > MAX_NODES_UI:
        raise ValueError(f"a round may verify at most {MAX_NODES_UI} drafts here; this tree has "
                         f"{draft_width(settings)}: set 'drafts verified per round' lower")


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


def as_int(value, name: str) -> int:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not number.is_integer():
        raise ValueError(f"{name} must be a whole number, got {value!r}")
    return int(number)


def as_float(value, name: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None


# --- the pairs this server keeps loaded, and their first-run settings ---------------------------
_pairs: dict[tuple[str, str, str], ModelPair] = {}
_pairs_lock = threading.Lock()


def _pair_key(preset: str, custom_target: str, custom_draft: str, dtype: str) -> tuple[tuple[str, str, str], dict]:
    """The key a pair is kept under, and load_pair's arguments for it (ValueError for a pair not to be had)."""
    if preset == CUSTOM and PUBLIC:
        raise ValueError("custom models are turned off on this public server; pick a preset")
    if preset == CUSTOM:
        if not custom_target.strip() or not custom_draft.strip():
            raise ValueError("a custom pair needs both a target id and a draft id")
        return (custom_target.strip(), custom_draft.strip(), dtype), {"dtype": dtype}
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of: {', '.join(PRESETS)}")
    return (PRESETS[preset].target, PRESETS[preset].draft, dtype), {"preset": preset, "dtype": dtype}


def pair_loaded(preset: str, custom_target: str, custom_draft: str, dtype: str = "auto") -> bool:
    return _pair_key(preset, custom_target, custom_draft, dtype)[0] in _pairs


def get_pair(preset: str, custom_target: str, custom_draft: str, dtype: str = "auto") -> ModelPair:
    """Load a pair once and keep it: the default preset, plus the pair (or dtype) asked for last. Any other is let go
    as soon as another is asked for, the default included, so memory goes back to what the default takes."""
    key, kwargs = _pair_key(preset, custom_target, custom_draft, dtype)
    default = _pair_key("offline", "", "", "auto")[0]
    with _pairs_lock:
        gone = [k for k in _pairs if k not in (default, key)]
        for old in gone:
            del _pairs[old]
        if gone:
            gc.collect()  # the models' cycles (modules, hooks) would otherwise wait for the next collection
        if key not in _pairs:
            kwargs["progress"] = log.info  # converting, measuring kernels: on the server's console
            _pairs[key] = load_pair(*key[:2], **kwargs) if preset == CUSTOM else load_pair(**kwargs)
        return _pairs[key]


_MACHINE_CHOICES: dict[tuple[str, bool], tuple[Choice, Costs]] = {}  # (preset, sampled) -> its best here


def machine_first_run(preset: str) -> tuple[Choice, Costs] | None:
    """The preset's drafter and shape with the best expected speedup on this machine, greedy (and, where
    the preset measured τ at temperature 1, sampled), measured once, then read from the cache
    (tools/costs.py); None for a preset without measured tokens per round."""
    for sampled, taus in PRESETS[preset].first_run_tables():
        if (preset, sampled) not in _MACHINE_CHOICES:
            choice, costs = first_run(get_pair(preset, "", ""), taus, progress=log.info, sampled=sampled)
            if choice:
                _MACHINE_CHOICES[preset, sampled] = choice, costs
    return _MACHINE_CHOICES.get((preset, False))


def measured_against(preset: str, sampled: bool, context: int | None = None, new_tokens: int = RUN_TOKENS
                     ) -> Callable[[Run, Run], str] | None:
    """(run, its baseline) -> how a run of what this machine chose for the preset (greedy or sampled) measured
    against the expected speedup, part by part, priced at the run's context (costs.context_of; '' for a run of
    other settings: costs.against), and which shape is expected faster at that context where another is; None
    where nothing was chosen. A run of that other shape is told its own expectation."""
    chosen = _MACHINE_CHOICES.get((preset, sampled))
    if chosen is None:
        return None
    if context is None:
        return functools.partial(against, *chosen, sampled=sampled)
    choice, costs = chosen
    here = replace(choice, context=context, new_tokens=new_tokens, expected=expected_speedup(
        costs, choice.drafter, choice.shape, choice.tokens_per_round, sampled, context, new_tokens))
    ranked = rank(costs, PRESETS[preset].taus(sampled), sampled, context, new_tokens)
    best = ranked[0] if ranked and ranked[0].expected > here.expected else here

    def line(run: Run, baseline: Run) -> str:
        if said := against(best, costs, run, baseline, sampled):
            return f"at a context of {context:,} tokens, {best.text}, {said}" if best is not here else said
        said = against(here, costs, run, baseline, sampled)
        return said + (f"; at a context of {context:,} tokens {best.text} is expected faster "
                       f"({best.expected:.2f}x)" if said and best is not here else "")

    return line


def first_run_values(preset: str, sampled: bool = False) -> tuple[str, int, int, int, str]:
    """(drafter, γ, branch, nodes, a note) for a first greedy (or sampled) run of this preset: measured here
    if already known, else the preset's. The note names what is expected fastest in the other mode, where
    that differs."""
    mode = _MACHINE_CHOICES.get((preset, sampled)) or _MACHINE_CHOICES.get((preset, False))
    if mode:
        choice = mode[0]
        other = (_MACHINE_CHOICES.get((preset, not sampled)) or mode)[0]
        when = "a temperature of 0" if sampled else "a temperature above 0"
        also = (f" With {when}, {other.text} is expected fastest here ({other.expected:.2f}x)."
                if (other.drafter, other.shape) != (choice.drafter, choice.shape) else "")
        return (choice.drafter, choice.gamma, choice.branch, choice.nodes,
                note_html(f"This machine's choice: {headline(choice)}.", describe(*mode) + also))
    first = PRESETS[preset]
    return first.drafter, first.gamma, first.branch, first.nodes, ""
