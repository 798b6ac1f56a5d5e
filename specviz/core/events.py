"""What a generation run emits: one plain dataclass per round, and a run that round-trips JSON.

A speculative round and a baseline step have the same shape (`RoundEvent`), so a UI or a
benchmark consumes both the same way: a baseline step has no drafted tokens and one extra token
of kind "target".

Probabilities: in sampled mode `p` and `q` are the warped distributions the acceptance rule
used. In greedy mode the rule compares argmaxes, so `p` and `q` are the models' plain softmax
(temperature 1), which is what a viewer wants to see, and `accept_prob` is 1 or 0.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import types
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .sampling import SamplingParams

# What drafts a speculative run (generator.make_drafter builds each): the pair's draft model, prompt
# lookup, the pair's EAGLE head, or prompt lookup where the text repeats and the head elsewhere.
_HTML_DRAWER: list = []  # [run -> HTML], filled by register_html


def register_html(draw) -> None:
    """How a notebook draws a Run: the view layer says it here when it is imported."""
    _HTML_DRAWER[:] = [draw]


TRACE_FORMAT = "specviz-trace/1"

# What a run can be (Settings.validate holds a run's settings to them; a loaded trace's fields are held to them too)
MAX_GAMMA = 32
MAX_NEW_TOKENS = 4096
MAX_SEED = 2**63 - 1
MAX_BATCH = 16
MAX_BRANCH = 8
MAX_NODES = 63  # a verify pass of at most 64 tokens
# a trace of the page's longest run (spec and baseline, 4,096 tokens, 8 candidates a token) is about 20 MB: a file
# far larger is no trace of specviz's, and reading it would hold the server for a minute
MAX_TRACE_MB = 32

ACCEPTED, REJECTED, UNVERIFIED = "accepted", "rejected", "unverified"
# A round's parts, in order; each is RoundEvent.<stage>_ms, and together they are the round's wall time:
#   draft   the drafter's proposal (a head's or draft model's steps, a lookup's search)
#   verify  the target's forward over the last token and the drafts
#   judge   the acceptance rule and the round's one read of p, q and what the viewer is shown
#   record  the kept tokens committed, and the round's records made (the inspector's candidates, token texts)
#   rest    all else between a round's start and its end (γ, the drafter told what was kept, rows that finish)
STAGES = ("draft", "verify", "judge", "record", "rest")
CORRECTION, BONUS, TARGET = "correction", "bonus", "target"


@dataclass
class TopToken:
    """One candidate at a drafted position, for the inspector."""

    id: int
    text: str
    p: float
    q: float
    residual: float | None = None  # norm(max(0, p - q)) at a rejected position, else None


@dataclass
class DraftedToken:
    id: int
    text: str
    q: float  # draft probability of this token
    p: float  # target probability of this token
    accept_prob: float  # min(1, p / q)
    u: float | None  # the uniform draw it was tested with; None if untested or greedy
    status: str  # "accepted" | "rejected" | "unverified" (after a rejection or a stop)
    top: list[TopToken] = field(default_factory=list)
    score: float | None = None  # a tree's node: the draft's probability of the path from the root to it

    @property
    def accepted(self) -> bool:
        return self.status == ACCEPTED


@dataclass
class ExtraToken:
    """The token the target adds in a round: a correction, a bonus, or a plain baseline step."""

    id: int
    text: str
    kind: str  # "correction" | "bonus" | "target"
    p: float  # target probability of this token
    q: float | None = None  # draft probability (corrections only)
    top: list[TopToken] = field(default_factory=list)  # the candidates at this position


@dataclass
class RoundEvent:
    index: int
    gamma: int  # tokens drafted this round (0 for a baseline step)
    drafted: list[DraftedToken]
    extra: ExtraToken | None  # None when the round ended on an accepted EOS
    # drafted tokens kept in the text; an accepted EOS ends the text, so drafts after it are not
    # counted even where the rule accepted them (they show as "unverified")
    n_accepted: int
    draft_ms: float  # the stages' times (STAGES); in a batch, this row's share (the batch's time over its rows)
    verify_ms: float  # the forward alone (traces written before judge_ms existed counted the judge here)
    target_cache_len: int  # after rollback
    draft_cache_len: int  # after rollback (0 for the baseline and for drafters without a model)
    tokens_so_far: int  # generated tokens, this round's included
    elapsed_ms: float  # since the run started, prefill included
    finish_reason: str | None = None  # "eos" | "length" on the last round
    drafted_by: str = ""  # in a run whose drafter combines two: "lookup" where prompt lookup drafted
    # a tree round: each drafted node's parent (an index into drafted; -1 the last kept token), parents
    # first; empty for a chain, where d_i's parent is d_{i-1}
    parents: list[int] = field(default_factory=list)
    judge_ms: float = 0.0
    record_ms: float = 0.0
    rest_ms: float = 0.0

    @property
    def stage_ms(self) -> dict[str, float]:
        """ms of each of the round's stages (STAGES), in order."""
        return {stage: getattr(self, f"{stage}_ms") for stage in STAGES}

    @property
    def round_ms(self) -> float:
        """The round's wall time: its stages' sum."""
        return sum(self.stage_ms.values())

    @property
    def tree(self) -> list[int]:
        """Each drafted node's parent, a chain's too."""
        return self.parents or list(range(-1, len(self.drafted) - 1))

    @property
    def depths(self) -> list[int]:
        """Each drafted node's depth: 1 for a child of the last kept token."""
        depth: list[int] = []
        for parent in self.tree:
            depth.append(1 if parent < 0 else depth[parent] + 1)
        return depth

    @property
    def path(self) -> list[int]:
        """The kept nodes, root to leaf."""
        return [i for i, t in enumerate(self.drafted) if t.accepted]

    @property
    def n_rejected(self) -> int:
        return sum(t.status == REJECTED for t in self.drafted)

    @property
    def new_tokens(self) -> list[int]:
        """Ids this round added to the text, in order."""
        kept = [t.id for t in self.drafted if t.accepted]
        return kept + ([self.extra.id] if self.extra else [])


@dataclass
class RunMeta:
    mode: str  # "speculative" | "baseline"
    target: str
    draft: str | None
    dtype: str
    device: str
    gamma: int  # the first round's when a policy adapts it
    temperature: float
    top_k: int
    top_p: float
    seed: int
    max_new_tokens: int
    prompt: str
    prompt_ids: list[int]
    vocab_size: int
    draft_note: str = ""  # a caveat about the draft, shown wherever the pair shows
    gamma_policy: str = "fixed"  # "fixed" | "grow-shrink" | "expected"
    gamma_max: int = 0  # the policy's cap (0 when fixed)
    batch_size: int = 1  # prompts decoded together; this run is one row
    prefill_ms: float = 0.0  # in a batch: this row's share
    cache: str = ""  # KV cache kind: "static" | "dynamic" | "none" ("" in traces from before it was recorded)
    compiled: bool = False  # compiled forwards were asked for
    draft_greedy: bool = False  # a sampled run whose drafter proposed its argmax (q one-hot)
    drafter: str = ""  # its key in core/generator.DRAFTER_KINDS ("" for the baseline and old traces)
    versions: dict[str, str] = field(default_factory=dict)
    machine: str = ""  # where it ran: CPU model and instruction-set class, threads (or the GPU)
    dtype_reason: str = ""  # why this dtype: asked for, or what `auto` measured on that machine
    weights: str = ""  # what a step of the target read of its weights ("" where unknown)
    branch: int = 1  # children per drafted node (1: chains)
    nodes: int = 0  # drafts a tree round verifies at most (0: all it drafted)


    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p)


@dataclass
class Run:
    meta: RunMeta
    events: list[RoundEvent] = field(default_factory=list)
    text: str = ""  # the generated text, decoded from all generated ids at the end

    # --- summaries -------------------------------------------------------------------------
    @property
    def token_ids(self) -> list[int]:
        return [i for e in self.events for i in e.new_tokens]

    def records(self) -> list[DraftedToken | ExtraToken]:
        """What the run recorded for each generated token, in text order."""
        out: list[DraftedToken | ExtraToken] = []
        for e in self.events:
            out += [e.drafted[i] for i in e.path] + ([e.extra] if e.extra else [])
        return out

    @property
    def n_tokens(self) -> int:
        return self.events[-1].tokens_so_far if self.events else 0

    @property
    def n_accepted(self) -> int:
        return sum(e.n_accepted for e in self.events)

    @property
    def n_rejected(self) -> int:
        return sum(e.n_rejected for e in self.events)

    @property
    def n_drafted(self) -> int:
        return sum(e.gamma for e in self.events)

    @property
    def n_untested(self) -> int:
        """Drafts the target never judged: after a rejection, past EOS or the budget, or on a tree's other
        branches."""
        return self.n_drafted - self.n_accepted - self.n_rejected

    @property
    def copied_rounds(self) -> int:
        """Rounds prompt lookup drafted, in a run whose drafter combines it with another."""
        return sum(e.drafted_by == "lookup" for e in self.events)

    @property
    def mean_gamma(self) -> float:
        """Tokens drafted per round: γ itself unless a policy adapted it or lookup found less."""
        return self.n_drafted / len(self.events) if self.events else float(self.meta.gamma)

    @property
    def acceptance_rate(self) -> float | None:
        """α̂ = accepted / (accepted + rejected): the per-token acceptance of Leviathan's formula.

        Tokens drafted after a rejection (or after EOS) were never tested and do not count.
        """
        tested = self.n_accepted + self.n_rejected
        return self.n_accepted / tested if tested else None

    @property
    def target_passes(self) -> int:
        """Target forward passes after prefill: one per round (or per baseline step)."""
        return len(self.events)

    @property
    def tokens_per_round(self) -> float:
        return self.n_tokens / len(self.events) if self.events else 0.0

    @property
    def decode_ms(self) -> float:
        """Wall time of the whole run, prefill included."""
        return self.events[-1].elapsed_ms if self.events else 0.0

    @property
    def rounds_ms(self) -> float:
        """Wall time of the rounds: the run's, prefill excluded."""
        return self.decode_ms - self.meta.prefill_ms if self.events else 0.0

    @property
    def tokens_per_s(self) -> float:
        return 1000.0 * self.n_tokens / self.decode_ms if self.decode_ms > 0 else 0.0

    def mean_stages(self) -> dict[str, float]:
        """ms a round spends in each stage (STAGES), the mean over the run's rounds (0 each without rounds)."""
        n = max(len(self.events), 1)
        return {stage: sum(getattr(e, f"{stage}_ms") for e in self.events) / n for stage in STAGES}

    @property
    def finish_reason(self) -> str | None:
        return self.events[-1].finish_reason if self.events else None

    def _repr_html_(self) -> str | None:
        """What a notebook shows: drawn by the view layer, which registers itself (view/notebook.py;
        importing specviz does), so this record imports no view. None: plain repr."""
        return _HTML_DRAWER[0](self) if _HTML_DRAWER else None

    # --- JSON ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any, where: str = "run") -> Run:
        """A run from its JSON form, checked field by field: ValueError naming the first field
        that is missing, unknown or of the wrong type or range."""
        return _build(cls, data, where)


# Ranges beyond the types: a field named here must hold a value at least this.
_AT_LEAST = {"index": 0, "gamma": 0, "n_accepted": 0, "target_cache_len": 0, "draft_cache_len": 0,
             "tokens_so_far": 0, "draft_ms": 0, "verify_ms": 0, "elapsed_ms": 0, "id": 0, "vocab_size": 1,
             "max_new_tokens": 1, "gamma_max": 0, "batch_size": 1, "prefill_ms": 0, "temperature": 0, "top_k": 0,
             "parents": -1, "branch": 1, "nodes": 0}
_AT_MOST = {"index": MAX_NEW_TOKENS, "tokens_so_far": MAX_NEW_TOKENS, "max_new_tokens": MAX_NEW_TOKENS,
            "gamma": max(MAX_GAMMA, MAX_NODES), "n_accepted": max(MAX_GAMMA, MAX_NODES), "gamma_max": MAX_GAMMA,
            "batch_size": MAX_BATCH, "branch": MAX_BRANCH, "nodes": MAX_NODES, "parents": MAX_NODES, "seed": MAX_SEED,
            "id": 2**31 - 1, "vocab_size": 2**31 - 1, "top_k": 2**31 - 1}
# the longest list a field may hold (a round drafts at most MAX_NODES; a run has at most MAX_NEW_TOKENS rounds)
_LONGEST = {"events": MAX_NEW_TOKENS, "drafted": MAX_NODES, "parents": MAX_NODES, "top": 1024}
_PROBABILITIES = {"p", "q", "accept_prob", "u", "residual", "top_p", "score"}
_CHOICES = {"status": (ACCEPTED, REJECTED, UNVERIFIED), "kind": (CORRECTION, BONUS, TARGET),
            "mode": ("speculative", "baseline"), "finish_reason": (None, "eos", "length"),
            "drafted_by": ("", "lookup")}


def _build(cls: type, data: Any, where: str) -> Any:
    """An instance of dataclass `cls` from JSON `data`, every field checked against its type hint."""
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be an object, got {_shown(data)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"{where} has an unknown field {unknown[0]!r}")
    hints = typing.get_type_hints(cls)
    values = {}
    for name, f in fields.items():
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ValueError(f"{where}.{name} is missing")
            continue
        values[name] = _value(hints[name], data[name], f"{where}.{name}", name)
    parents = values.get("parents") if cls is RoundEvent else None
    if parents and (len(parents) != len(values["drafted"]) or any(p >= i for i, p in enumerate(parents))):
        raise ValueError(f"{where}.parents must give each drafted node a parent before it (or -1)")
    return cls(**values)


def _value(hint: Any, value: Any, where: str, name: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):  # X | None
        if value is None and type(None) in args:
            return None
        (hint,) = [a for a in args if a is not type(None)]
        return _value(hint, value, where, name)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, where)
    if origin is list:
        if not isinstance(value, list):
            raise ValueError(f"{where} must be a list, got {_shown(value)}")
        if name in _LONGEST and len(value) > _LONGEST[name]:
            raise ValueError(f"{where} holds {len(value):,} entries; a run's has at most {_LONGEST[name]:,}")
        return [_value(args[0], v, f"{where}[{i}]", name) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            raise ValueError(f"{where} must be an object of strings, got {_shown(value)}")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{where} must be true or false, got {_shown(value)}")
    elif hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where} must be a whole number, got {_shown(value)}")
    elif hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{where} must be a number, got {_shown(value)}")
        value = float(value)
    elif hint is str:
        if not isinstance(value, str):
            raise ValueError(f"{where} must be text, got {_shown(value)}")
    if name in _AT_LEAST and value < _AT_LEAST[name]:
        raise ValueError(f"{where} must be at least {_AT_LEAST[name]}, got {_shown(value)}")
    if name in _AT_MOST and value > _AT_MOST[name]:
        raise ValueError(f"{where} must be at most {_AT_MOST[name]:,}, got {_shown(value)}")
    if name in _PROBABILITIES and not 0 <= value <= 1 + 1e-6:  # rounding may pass 1 by an ulp
        raise ValueError(f"{where} must be a probability (0 to 1), got {_shown(value)}")
    if name in _CHOICES and value not in _CHOICES[name]:
        raise ValueError(f"{where} must be one of {', '.join(map(repr, _CHOICES[name]))}, got {_shown(value)}")
    return value


def _shown(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def runs_to_json(runs: list[Run]) -> str:
    return json.dumps({"format": TRACE_FORMAT, "runs": [r.to_dict() for r in runs]})


def runs_from_json(text: str) -> list[Run]:
    """Parse a trace; ValueError with a readable reason if it is not one."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"not a specviz trace: invalid JSON ({err})") from err
    except RecursionError:  # a trace nests four levels deep; this is a forged or broken file
        raise ValueError("not a specviz trace: its JSON nests far deeper than a trace does") from None
    if not isinstance(data, dict) or data.get("format") != TRACE_FORMAT:
        raise ValueError(f"not a specviz trace: expected format {TRACE_FORMAT!r}")
    runs = data.get("runs")
    if not isinstance(runs, list) or not runs:
        raise ValueError("not a specviz trace: 'runs' must be a non-empty list")
    if len(runs) > 2 * MAX_BATCH:  # a batch's rows and their baselines at most
        raise ValueError(f"not a specviz trace: {len(runs)} runs, where a trace holds at most {2 * MAX_BATCH}")
    try:
        return [Run.from_dict(r, f"runs[{i}]") for i, r in enumerate(runs)]
    except ValueError as err:
        raise ValueError(f"not a valid specviz trace: {err}") from None


def save_runs(path: str | Path, runs: list[Run]) -> None:
    Path(path).write_text(runs_to_json(runs), encoding="utf-8")


def load_runs(path: str | Path) -> list[Run]:
    """A trace file's runs; ValueError, in one sentence, for a file too large, not UTF-8 text or not a trace."""
    path = Path(path)
    size = path.stat().st_size
    if size > MAX_TRACE_MB * 2**20:
        raise ValueError(f"not a specviz trace: the file is {size / 2**20:.0f} MB, and a trace of the longest run "
                         f"is under {MAX_TRACE_MB} MB")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"not a specviz trace: the file is not UTF-8 text (byte 0x{data[err.start]:02x} at "
                         f"position {err.start:,})") from None
    return runs_from_json(text)


def save_trace(folder: str | Path, runs: list[Run], keep: int = 64) -> Path:
    """Save runs as a new trace file in a folder, keeping only the `keep` newest there."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"specviz-run-{time.time_ns()}.json"
    save_runs(path, runs)
    for old in sorted(folder.glob("specviz-run-*.json"))[:-keep]:
        old.unlink(missing_ok=True)
    return path


# --- the sample check's result (tools/lossless.py computes it, view/charts.py draws it) ---


@dataclass
class Candidate:
    id: int
    text: str
    exact: float  # the target's probability
    speculative: float  # share of the speculative draws
    target_alone: float  # share of the target-alone draws


@dataclass
class SampleCheck:
    n: int
    top: list[Candidate]  # the likeliest tokens, then an "all others" entry (id -1)
    tv_speculative: float  # total variation between the draws and the exact distribution
    tv_target_alone: float
    tv_noise: float  # what sampling noise alone gives, in expectation, at this n
    speculative_s: float
    target_alone_s: float
    acceptance: float | None  # of the first draft, over the speculative draws


@dataclass
class ExactCheck:
    """The first emitted token's distribution under one round of the rule, in closed form, against p."""

    drafted: bool  # the drafter proposed a first token (else the round is a plain target step: p itself)
    max_diff: float  # max over the vocabulary of |emitted − p|, float64
    broken_max_diff: float  # the same for a broken rule that resamples from p instead of the residual
    first_draft_kept: float  # the chance the first draft is kept, sum over d of q(d) min(1, p(d)/q(d))
    seconds: float
