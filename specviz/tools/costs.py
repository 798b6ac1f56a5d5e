"""What a round costs on this machine, and the drafter and γ a first run should use here.

Leviathan et al. 2023 (section 3.4), with the verify pass priced as measured rather than free: a
round with drafter d at γ yields τ_d(γ) tokens on average (the target's own included) and costs
γ draft steps, one forward of γ + 1 tokens and the round's bookkeeping; plain decoding pays one
one-token forward and its bookkeeping per token. So the expected speedup over plain decoding is

    S(d, γ) = τ_d(γ) · (step + base_overhead) / (verify(γ + 1) + γ · draft_d + overhead_d)

over the rounds alone. A run's tokens per second count its prefill too (the page's speedup, bench's), so a run of
N new tokens after a prompt is priced as (prefill + N · (step + base_overhead)) / (prefill + N / τ_d(γ) · round),
the target's prefill of the calibration prompt timed with the forwards and priced affine in the prompt's tokens
(`Costs.prefill`): after a long prompt it takes most of both runs, and the expected speedup falls towards 1. A
drafter's own start (the EAGLE head's pass over the prompt: one layer against the target's thirty) is left
unpriced: measured as the difference of two prefills, a small difference of two noisy timings, it would be
multiplied by a long prompt's length.

A tree (γ levels deep, `branch` children per node, `nodes` verified) is priced the same way with its
own measured round: S = τ · (step + base_overhead) / (verify(nodes + 1) + its drafting and bookkeeping
per round, on the plane through every measured tree's rounds by depth and drafts verified: `tree_line`), so the
shape chosen is the one this machine's c(k) pays for. A sampled tree
drafts other levels than a greedy one of the same shape (drafters.EagleDrafter.propose), so its round
is timed sampling, apart from the greedy one.

A forward's cost grows with the tokens already in the cache, and more for a wide one: each of its k tokens
attends over every cached key, while its matrix products read the weights once whatever k (so c(6), and a
one-token step too, measure higher over a thousand cached tokens than over a short prompt). So the forwards are timed
over two caches, the calibration prompt's and LONG_CONTEXT tokens, and a forward over a context of n tokens is
priced as the short one's time plus n times what a context token adds to it (attention is linear in the keys),
a + b k for k tokens, fitted through every width's two timings (`Costs.per_token`). A run is priced at its middle,
the prompt plus half its budget (`context_of`): a long prompt can make a narrower verify the better choice. The
head's own attention over the context (one layer's against the target's thirty) is left unpriced.

τ belongs to the pair and the text, not the machine (but for the drafter's lossy kernels, chosen per
machine, which move it a little): it is measured on held-out prompts and kept
in the preset (`Preset.tokens_per_round`). Every cost is measured on the machine that runs: the
target's forward of k tokens for k = 1..MAX_WIDTH (so c(k) = verify(k) / step), and a short
decode per drafter for its draft time per token and its round overhead. The measurement takes a
few seconds once per machine, pair, dtype and compile mode, and is kept in the `rounds` of this
machine's profile (models/profile.py), beside its kernel timings. Where no candidate reaches S > 1,
`note` says so in one sentence, so neither the app nor the CLI leaves the viewer to discover it.

Timed while other programs use the CPU, forwards slow down unevenly (a one-token step timed slow can price a
5-token forward below one step). So a forward's cost is the fastest of its repeats
(other work only ever slows one down); how much of the CPUs our threads need other processes took while
timing is read from Linux's /proc/stat (models/contention.py); the forwards are timed again, up to ATTEMPTS
times, while that exceeds BUSY; and costs still timed on a busy machine are said to be so (`describe`) and
timed again at the next start.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from statistics import median

import torch

from ..core.events import Run
from ..core.generator import (
    HEAD_DRAFTERS,
    Settings,
    compile_by_default,
    draft_width,
    generate,
    machine_name,
    parse_trees,
    tree_label,
)
from ..core.kvcache import KVState
from ..core.theory import target_step_ms
from ..models import contention, kernels
from ..models.loading import ModelPair, encode_prompt
from ..models.profile import Profile

MAX_WIDTH = 5  # forwards timed at 1..MAX_WIDTH tokens: verifies of γ <= 4 (and at each tree's width)
CALIBRATION_PROMPT = "The future of AI"
CALIBRATION_TOKENS = 24
REPEATS = 10  # each width's forwards timed, interleaved
LONG_CONTEXT = 1024  # tokens in the cache under the second timing of the forwards (fewer where the model holds fewer)
LONG_REPEATS = 5
RUN_TOKENS = Settings.max_new_tokens  # a run priced where its budget is not known: the app's and generate's default
TREE_LINE = 4  # measured trees of a drafter from which their rounds are priced on one plane (tree_line)
# candidates each drafted and extra token keeps for the inspector in the calibration decodes: as many as the runs a
# first run's choice serves record (the app's and `generate`'s, Settings' default), whose rounds pay for them (a
# measurable part of a round's time, more for a speculative round than for a plain step)
RECORD_TOP = Settings.record_top
# (in the stored costs' key)
TIMING = ("forwards: the fastest of their repeats, over two contexts; a tree's drafting: its median round; "
          f"rounds recording {RECORD_TOP} candidates a token, the judge in their bookkeeping; prefills; decodes at the "
          "forwards' pace")
log = logging.getLogger("specviz")
Progress = Callable[[str], None]


@dataclass
class Costs:
    """ms on this machine: the target's forward by width, and per drafter its draft time per drafted
    token and its bookkeeping per round (all but drafting and the verify forward)."""

    machine: str
    dtype: str
    compiled: bool
    forward_ms: dict[int, float]  # k tokens -> ms of one target forward over a cached prompt
    draft_ms: dict[str, float] = field(default_factory=dict)  # drafter -> ms per drafted token
    overhead_ms: dict[str, float] = field(default_factory=dict)  # drafter ("" = plain decoding) -> ms per round
    tree_ms: dict[str, float] = field(default_factory=dict)  # tree_key -> drafting and bookkeeping ms per round
    busy: float | None = None  # the most of the CPUs our threads needed that other processes took while timing
    context: int = 0  # tokens in the cache under forward_ms (the calibration prompt's)
    long_ms: dict[int, float] = field(default_factory=dict)  # k tokens -> ms of a forward over long_context tokens
    long_context: int = 0  # (0: not timed)
    prefill_ms: float = 0.0  # the target's prefill of the calibration prompt (prefill_ms; 0: not timed)

    @property
    def disturbed(self) -> bool:
        return self.busy is not None and self.busy > contention.BUSY

    def forward(self, k: int, context: int | None = None) -> float:
        """ms of a forward of k tokens (the narrowest measured width that holds k) over the calibration prompt, or
        over `context` tokens: the short context's time plus what each further context token adds (per_token)."""
        w = min((w for w in self.forward_ms if w >= k), default=max(self.forward_ms))
        if context is None:
            return self.forward_ms[w]
        return self.forward_ms[w] + self.per_token(w) * max(context - self.context, 0)

    def per_token(self, k: int) -> float:
        """ms that one more token of context adds to a forward of k tokens: a + b k, each of the k tokens attending
        to it, a line fitted by least squares through every width's (long - short) / (long_context - context): on a
        noisy VM one width's own pair of timings can price a 5-token forward over a long context below a 3-token
        one, the line through all ten widths does not. b >= 0 (a wider forward never pays less for a key), the line
        >= 0; 0 with no long timing."""
        widths = [w for w in self.long_ms if w in self.forward_ms]
        if not widths or self.long_context <= self.context:
            return 0.0
        extra = [(self.long_ms[w] - self.forward_ms[w]) / (self.long_context - self.context) for w in widths]
        mean_w, mean_e = sum(widths) / len(widths), sum(extra) / len(extra)
        spread = sum((w - mean_w) ** 2 for w in widths)
        covariance = sum((w - mean_w) * (e - mean_e) for w, e in zip(widths, extra, strict=True))
        b = max(covariance / spread, 0.0) if spread else 0.0
        return max(mean_e + b * (k - mean_w), 0.0)

    def prefill(self, prompt_tokens: int) -> float | None:
        """ms of the target's prefill after a prompt of that many tokens (all but its last go through it): affine in
        the prompt's tokens, through a one-token forward at a two-token prompt and the calibration prompt's measured
        prefill; None where not measured."""
        if not self.prefill_ms or self.context < 3:
            return None
        if prompt_tokens < 2:
            return 0.0  # nothing to prefill but a hole
        step = self.forward_ms[1]
        return max(step + (self.prefill_ms - step) * (prompt_tokens - 2) / (self.context - 2), 0.0)

    def c(self, k: int, context: int | None = None) -> float:
        """c(k): a forward of k tokens in one-token forwards (over `context` tokens of cache)."""
        return self.forward(k, context) / self.forward(1, context)


def context_of(prompt_tokens: int, max_new_tokens: int) -> int:
    """The context a run is priced at: its middle, the prompt plus half the budget."""
    return prompt_tokens + max_new_tokens // 2


Shape = tuple[int, int, int]  # (γ: depth, branch: children per node, nodes verified; 0 = all); a chain: (γ, 1, 0)


def tree_key(drafter: str, shape: Shape, sampled: bool = False) -> str:
    return f"{drafter} {tree_label(*shape)}" + (" sampled" if sampled else "")


def width(shape: Shape) -> int:
    """Tokens in the verify forward."""
    return draft_width(Settings(gamma=shape[0], branch=shape[1], nodes=shape[2], drafter="eagle")) + 1


@dataclass(frozen=True)
class Choice:
    drafter: str
    gamma: int
    expected: float  # S(d, γ), expected speedup over plain decoding on this machine
    branch: int = 1  # a tree's children per node (1: a chain)
    nodes: int = 0  # a tree's drafts verified per round (0: all)
    tokens_per_round: float = field(default=0.0, compare=False)  # the τ `expected` assumes (the preset's, measured)
    context: int | None = field(default=None, compare=False)  # tokens of cache it was priced at (None: a short prompt)
    new_tokens: int = field(default=0, compare=False)  # the run's budget it was priced for, prefills included

    @property
    def shape(self) -> Shape:
        return self.gamma, self.branch, self.nodes

    @property
    def text(self) -> str:
        if self.branch == 1:
            return f"{self.drafter} at γ = {self.gamma}"
        return (f"{self.drafter} as a tree ({self.gamma} deep, {self.branch} children per node, "
                f"{width(self.shape) - 1} drafts verified)")


def expected_speedup(costs: Costs, drafter: str, shape: Shape, tokens_per_round: float, sampled: bool = False,
                     context: int | None = None, new_tokens: int = 0) -> float:
    """S of the module docstring, for a chain (branch 1) or a tree (its round timed greedy or sampled), with the
    forwards priced over `context` tokens of cache (None: the calibration prompt's); for a run of `new_tokens`, its
    prefills included (the prompt: context_of's, or the calibration prompt; 0: the rounds alone)."""
    plain = costs.forward(1, context) + costs.overhead_ms.get("", 0.0)
    spec = costs.forward(width(shape), context) + beside_verify_ms(costs, drafter, shape, sampled)
    prefill = costs.prefill(costs.context if context is None else context - new_tokens // 2)
    if not new_tokens or prefill is None:
        return tokens_per_round * plain / spec
    return (prefill + new_tokens * plain) / (prefill + new_tokens / tokens_per_round * spec)


def beside_verify_ms(costs: Costs, drafter: str, shape: Shape, sampled: bool = False) -> float:
    """A round's drafting and bookkeeping as priced: a chain's γ drafts and its drafter's bookkeeping, a tree's
    round (greedy or sampled) as `tree_line` prices it."""
    if shape[1] == 1:
        return shape[0] * costs.draft_ms.get(drafter, 0.0) + costs.overhead_ms.get(drafter, 0.0)
    return tree_line(costs, drafter, sampled).get(shape) or costs.tree_ms[tree_key(drafter, shape, sampled)]


def tree_line(costs: Costs, drafter: str, sampled: bool = False) -> dict[Shape, float]:
    """Each measured tree of the drafter (greedy or sampled) priced on the least-squares plane a + b·depth +
    c·drafts verified through all of their measured rounds, where at least TREE_LINE shapes at two depths or more
    were timed and the plane rises with depth; else {} (each tree at its own median round). A head step per level
    makes most of a tree's drafting, and each shape's calibration decode has only about ten rounds, timed at its own
    moment: from one calibration to the next the same shape's median moves by far more than shapes of one depth
    differ a draft, enough to reorder them; the plane pools every shape's rounds."""
    points = []
    for key, ms in costs.tree_ms.items():
        name, label, *mode = key.split(" ")
        if name == drafter and bool(mode) == sampled:
            shape = parse_trees(label)[0]
            points.append((shape, (1.0, float(shape[0]), float(width(shape) - 1)), ms))
    x = torch.tensor([row for _, row, _ in points], dtype=torch.float64)  # [shapes, 3]
    if len(points) < TREE_LINE or torch.linalg.matrix_rank(x) < 3:  # one depth, or drafts a multiple of depth
        return {}
    beta = torch.linalg.lstsq(x, torch.tensor([[ms] for _, _, ms in points], dtype=torch.float64)).solution[:, 0]
    if beta[1] <= 0:
        return {}
    return {shape: max(float(row @ beta), 0.0) for (shape, _, _), row in zip(points, x, strict=True)}


def rank(costs: Costs, tokens_per_round: dict[str, dict[Shape, float]], sampled: bool = False,
         context: int | None = None, new_tokens: int = RUN_TOKENS) -> list[Choice]:
    """Every (drafter, shape) with a measured τ and a measured cost, best first (τ and tree rounds
    measured sampling where `sampled`; forwards priced over `context` tokens of cache; for runs of `new_tokens`,
    their prefills included: expected_speedup)."""
    choices = [Choice(d, shape[0], expected_speedup(costs, d, shape, tau, sampled, context, new_tokens), shape[1],
                      shape[2], tau, context, new_tokens)
               for d, by_shape in tokens_per_round.items() if d in costs.draft_ms
               for shape, tau in by_shape.items()
               if (shape[1] == 1 and shape[0] + 1 <= MAX_WIDTH) or tree_key(d, shape, sampled) in costs.tree_ms]
    return sorted(choices, key=lambda ch: -ch.expected)


WORTH = 1.05  # the least expected speedup said plainly to pay: within 5 % of plain decoding, a run's noise decides


def note(best: Choice | None, costs: Costs | None) -> str:
    """One sentence when nothing is expected to beat plain decoding by WORTH here, else ''."""
    if best is None or costs is None or best.expected >= WORTH:
        return ""
    k = width(best.shape)
    beat = "beat plain decoding" if best.expected < 1 else f"beat plain decoding by {WORTH - 1:.0%}"
    return (f"On this machine{at(best)} no drafter and γ is expected to {beat}: the best, {best.text}, "
            f"is expected at {best.expected:.2f}x, because a verify of {k} tokens costs "
            f"{costs.c(k, best.context):.2f} one-token steps of {costs.forward(1, best.context):.1f} ms here.")


def at(choice: Choice) -> str:
    """' at a context of N tokens' for a choice priced at one, else ''."""
    return f" at a context of {choice.context:,} tokens" if choice.context is not None else ""


# --- measuring -----------------------------------------------------------------------------------


def _ms(work: Callable[[], object], device: torch.device) -> float:
    """ms that work() takes, a GPU's queued work included."""
    start = time.perf_counter()
    work()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - start)


def timed_forward(state: KVState, prompt_ids: list[int]) -> Callable[[int], float]:
    """run(k) -> ms of one forward of k tokens over the cached prompt, rolled back afterwards (a
    verify whose drafts are all rejected), so every repeat runs at the same length."""
    def run(k: int) -> float:
        ids = torch.tensor([prompt_ids[-k:]], device=state.mask.device)
        elapsed = _ms(lambda: state.forward(ids, torch.ones_like(ids, dtype=torch.bool)), ids.device)
        state.make_holes(0, state.width - k, state.width)
        state.trim()
        return elapsed
    return run


def _over_prompt(pair: ModelPair, prompt_ids: list[int], widest: int, compiled: bool) -> Callable[[int], float]:
    """timed_forward on a static cache made for forwards of up to `widest` tokens, the prompt prefilled."""
    state = KVState(pair.target, 1, "static", pair.vocab_size, len(prompt_ids) + widest + 1, compiled)
    with torch.inference_mode():
        state.prefill([prompt_ids], 0)
    return timed_forward(state, prompt_ids)


def forward_ms(pair: ModelPair, prompt_ids: list[int], widths: range, repeats: int, compiled: bool) -> dict[int, float]:
    """ms of the target's forward of k tokens (static cache), widths interleaved: the fastest of the repeats,
    since other work on the machine only ever slows a forward down."""
    run = _over_prompt(pair, prompt_ids, max(widths), compiled)
    times: dict[int, list[float]] = {k: [] for k in widths}
    with torch.inference_mode():
        for rep in range(repeats + 2):  # two to warm up (and compile)
            for k in widths:
                elapsed = run(k)
                if rep >= 2:
                    times[k].append(elapsed)
    return {k: min(v) for k, v in times.items()}


def prefill_ms(pair: ModelPair, ids: list[int], repeats: int, compiled: bool) -> float:
    """ms of the target's prefill of the prompt into a fresh static cache: the fastest of the repeats, as a forward's
    (a run's prefill, timed in its decode, is one sample, which a busy moment can read far above its time)."""
    times = []
    with torch.inference_mode():
        for rep in range(repeats + 2):  # two to warm up (and compile)
            state = KVState(pair.target, 1, "static", pair.vocab_size, len(ids) + 1, compiled)
            elapsed = _ms(functools.partial(state.prefill, [ids], 0), state.mask.device)
            if rep >= 2:
                times.append(elapsed)
    return min(times)


def _quietest_forwards(pair: ModelPair, widths: list[int], compiled: bool, progress: Progress | None
                       ) -> tuple[tuple[list[int], dict[int, float], list[int], dict[int, float], float], float | None]:
    """forward_ms over the calibration prompt and over a long context (that prompt's ids repeated to LONG_CONTEXT
    tokens, or as many as the model holds), and the prompt's prefill_ms, timed again while other processes took too
    much of the CPU time our threads needed (contention.quietest): ((short ids, their forwards, long ids, theirs, the
    prefill), that part; None: unknown). No long timing where the model holds no more than the short prompt."""
    ids = encode_prompt(pair.tokenizer, CALIBRATION_PROMPT)
    limit = getattr(pair.target.config, "max_position_embeddings", None) or LONG_CONTEXT + max(widths) + 1
    long = min(LONG_CONTEXT, limit - max(widths) - 1)
    long_ids = (ids * (long // len(ids) + 1))[:long] if long > len(ids) else []

    def again(share: float) -> None:
        if progress:
            progress(f"{contention.took(share)} while the forwards were timed; timing them again...")

    def both():
        short = forward_ms(pair, ids, widths, REPEATS, compiled)
        long = forward_ms(pair, long_ids, widths, LONG_REPEATS, compiled) if long_ids else {}
        return ids, short, long_ids, long, prefill_ms(pair, ids, REPEATS, compiled)

    return contention.quietest(both, again)


def _round_costs(pair: ModelPair, drafter: str, compiled: bool, shape: Shape = (2, 1, 0),
                 sampled: bool = False) -> tuple[float, float]:
    """(draft ms per drafted token, bookkeeping ms per round) from a short greedy decode at γ = 2; for a
    tree `shape`, (draft ms per round, bookkeeping ms per round), from a decode at temperature 1 where
    `sampled`; drafter "" is plain decoding (draft 0). A tree's drafting is its median round: a
    calibration decode has a dozen rounds, and one slow round (the VM's noise) moved a mean enough to
    reorder shapes whose rounds differ by a head step. The decodes record RECORD_TOP candidates a token, as the
    runs the choice serves do. Times as measured: `_measure` puts them at the forwards' pace (`_pace`)."""
    tree = shape[1] > 1
    settings = Settings(gamma=shape[0], branch=shape[1], nodes=shape[2], drafter=drafter or "model",
                        max_new_tokens=CALIBRATION_TOKENS, record_top=RECORD_TOP, compile=compiled,
                        temperature=1.0 if sampled else 0.0)
    mode = "speculative" if drafter else "baseline"
    generate(pair, CALIBRATION_PROMPT, replace(settings, max_new_tokens=4), mode=mode)  # first calls
    run = generate(pair, CALIBRATION_PROMPT, settings, mode=mode)
    events = run.events[1:] if mode == "baseline" else run.events  # a baseline's first step is the prefill's
    if tree:
        draft = median(e.draft_ms for e in events) if events else 0.0
    else:
        drafted = sum(e.gamma for e in events)
        draft = sum(e.draft_ms for e in events) / drafted if drafted else 0.0
    spent = run.rounds_ms - sum(e.draft_ms + e.verify_ms for e in run.events)
    return draft, max(spent, 0.0) / max(len(run.events), 1)


PACE_REPEATS = 3  # one-token forwards timed right after each calibration decode (the fastest counts)


def _one_step(pair: ModelPair, compiled: bool) -> Callable[[], float]:
    """() -> ms of a one-token forward over the calibration prompt, as the forwards are timed, on a state made once."""
    run = _over_prompt(pair, encode_prompt(pair.tokenizer, CALIBRATION_PROMPT), 1, compiled)

    def step() -> float:
        with torch.inference_mode():
            return run(1)
    return step


def _pace(costs: Costs, step: Callable[[], float] | None) -> float:
    """The timed one-token forward over one timed now by `step`, right after a calibration decode (the fastest of a
    few, as the forwards): what puts the decode's times at the forwards' pace (1 where either is not known). A VM
    runs some seconds faster than others, and the forwards and each decode are timed at different moments:
    priced as measured, the same drafting cost far more one-token steps in one calibration than in another."""
    if step is None or 1 not in costs.forward_ms:
        return 1.0
    return costs.forward_ms[1] / min(step() for _ in range(PACE_REPEATS))


def _key(pair: ModelPair, compiled: bool) -> str:
    """The pair's entry in the profile's `rounds`: its models, device (a GPU by its name: the profile is the CPU's,
    and one host may hold several kinds), dtype, compile mode and how they are timed."""
    device = str(pair.device) if pair.device.type == "cpu" else f"{pair.device.type}: {machine_name(pair.device)}"
    facts = json.dumps([device, str(pair.dtype), pair.target_name, pair.draft_name, pair.head_name, compiled,
                        TIMING], sort_keys=True)
    return hashlib.sha256(facts.encode()).hexdigest()[:16]


TreeRound = tuple[str, Shape, bool]  # a tree round to time: (drafter, shape, sampled)


def measure(pair: ModelPair, drafters: list[str], progress: Progress | None = None, retune: bool = False,
            compiled: bool | None = None, trees: list[TreeRound] = ()) -> Costs:
    """This machine's costs for the pair: from the cache, with what it lacks measured and added (all of
    it measured anew with retune)."""
    compiled = compile_by_default() if compiled is None else compiled
    drafters = [d for d in drafters if d not in HEAD_DRAFTERS or pair.head is not None]
    trees = [t for t in trees if t[0] in drafters]
    prof, key = kernels.profile(), _key(pair, compiled)
    if not retune and _serves(costs := _stored(prof, key), drafters, trees, prof, key):
        return costs
    with prof.locked(progress):  # another process may be measuring the same: it stores, we read
        known = None if retune else _stored(prof, key)
        if _serves(known, drafters, trees, prof, key):
            return known
        if known is not None and not prof.stands("rounds", key, known.busy):
            if progress:
                progress(f"the stored costs were timed {contention.when(known.busy)}; timing them again...")
            known = None
        prof.timing("rounds", key)
        costs = _measure(pair, drafters, trees, compiled, progress, known)
        prof.update({"rounds": {key: asdict(costs)}})
        return costs


def _stored(prof: Profile, key: str) -> Costs | None:
    """The costs stored in the profile, if any."""
    data = prof.entry("rounds", key)
    if data is None:
        return None
    try:
        by_width = {k: {int(w): ms for w, ms in data.get(k, {}).items()} for k in ("forward_ms", "long_ms")}
        return Costs(**{**data, **by_width})
    except (ValueError, KeyError, TypeError) as err:
        log.warning("specviz: ignoring unreadable costs in %s (%s); measuring again", prof.file, err)
        return None


def _serves(costs: Costs | None, drafters: list[str], trees: list[TreeRound], prof: Profile, key: str) -> bool:
    """Whether stored costs do: they hold every drafter and tree asked for, and were timed on a quiet machine
    (or by this process already)."""
    return costs is not None and all(d in costs.draft_ms for d in drafters) and all(
        tree_key(*t) in costs.tree_ms and width(t[1]) in costs.forward_ms for t in trees) and prof.stands(
        "rounds", key, costs.busy)


def _measure(pair: ModelPair, drafters: list[str], trees: list[TreeRound], compiled: bool,
             progress: Progress | None, known: Costs | None = None) -> Costs:
    """Time what `known` lacks (all, without it: the forwards, a short decode per drafter and tree)."""
    started = time.perf_counter()
    widths = {*range(1, MAX_WIDTH + 1), *(width(t[1]) for t in trees)}
    costs = known or Costs(kernels.describe_machine() if pair.device.type == "cpu" else str(pair.device),
                           str(pair.dtype).removeprefix("torch."), compiled, {})
    rounds = [(d, (2, 1, 0), False) for d in ["", *drafters] if d not in costs.overhead_ms]
    rounds += [t for t in trees if tree_key(*t) not in costs.tree_ms]
    # all widths timed together where one is missing: c(k) compares forwards of one run
    forwards = set() if widths <= set(costs.forward_ms) else widths | set(costs.forward_ms)
    if progress:
        progress(f"measuring what a round costs on this machine (once, then cached): {_missing(forwards, rounds)}...")
    shares = [costs.busy]  # how much of what our threads needed other processes took, part by part
    if forwards:
        (ids, costs.forward_ms, long_ids, costs.long_ms, costs.prefill_ms), busy = _quietest_forwards(
            pair, sorted(forwards), compiled, progress)
        costs.context, costs.long_context = len(ids), len(long_ids)
        shares.append(busy)
    taken = contention.others_meter()
    step = _one_step(pair, compiled) if rounds and 1 in costs.forward_ms else None
    for d, shape, sampled in rounds:
        if shape[1] == 1:
            draft, bookkeeping = _round_costs(pair, d, compiled)
            pace = _pace(costs, step)
            costs.draft_ms[d], costs.overhead_ms[d] = draft * pace, bookkeeping * pace
        else:
            draft, bookkeeping = _round_costs(pair, d, compiled, shape, sampled)
            costs.tree_ms[tree_key(d, shape, sampled)] = (draft + bookkeeping) * _pace(costs, step)
    shares.append(taken() if rounds else None)
    costs.draft_ms.pop("", None)
    costs.busy = max((b for b in shares if b is not None), default=None)
    if progress:
        progress(f"measured in {time.perf_counter() - started:.1f} s: c(3) = {costs.c(3):.2f}, "
                 f"one step {costs.forward_ms[1]:.1f} ms" + (
                     f"; {contention.took(costs.busy)}, so the next start times it again" if costs.disturbed else ""))
    return costs


def _missing(widths: set[int], rounds: list[TreeRound]) -> str:
    """What a measurement times (the forwards' widths, the rounds), for its progress line: 'forwards of 1 to 9
    tokens; rounds of plain decoding, eagle; eagle trees 3x2:4, 3x3:5'."""
    parts = [f"forwards of 1 to {max(widths)} tokens, over a short and a long context"] if widths else []
    if chains := [d or "plain decoding" for d, shape, _ in rounds if shape[1] == 1]:
        parts.append("rounds of " + ", ".join(chains))
    trees: dict[str, list[str]] = {}
    for d, (gamma, branch, nodes), sampled in (t for t in rounds if t[1][1] > 1):
        trees.setdefault(("sampled " if sampled else "") + d, []).append(tree_label(gamma, branch, nodes))
    parts += [f"{kind} trees {', '.join(shapes)}" for kind, shapes in trees.items()]
    return "; ".join(parts)


def first_run(pair: ModelPair, tokens_per_round: dict[str, dict[Shape, float]], progress: Progress | None = None,
              retune: bool = False, sampled: bool = False, context: int | None = None, new_tokens: int = RUN_TOKENS
              ) -> tuple[Choice | None, Costs | None]:
    """The best (drafter, shape) for this pair on this machine, with its costs; (None, None) when the pair
    has no measured τ (then the preset's fixed defaults stand). `sampled`: τ measured at temperature 1, and
    tree rounds timed sampling; `context` and `new_tokens`: the run's (context_of; its budget), where known."""
    if not tokens_per_round:
        return None, None
    trees = [(d, shape, sampled) for d, by_shape in tokens_per_round.items() for shape in by_shape if shape[1] > 1]
    costs = measure(pair, list(tokens_per_round), progress, retune, trees=trees)
    ranked = rank(costs, tokens_per_round, sampled, context, new_tokens)
    return (ranked[0] if ranked else None), costs


def headline(choice: Choice) -> str:
    """The choice in a few words, for a status line read from afar: 'lookup+eagle, tree 3x3:5, expected 1.67x
    here' (describe gives the why)."""
    shape = f"tree {tree_label(*choice.shape)}" if choice.branch > 1 else f"γ = {choice.gamma}"
    return f"{choice.drafter}, {shape}, expected {choice.expected:.2f}x here"


def describe(choice: Choice, costs: Costs) -> str:
    """One line: the chosen drafter and γ, and why (for the CLI and the app's note)."""
    k = width(choice.shape)
    busy = f" Timed while {contention.took(costs.busy)}: the next start times it again." if costs.disturbed else ""
    return (note(choice, costs) or (
        f"chosen for this machine{at(choice)}: {choice.text}, expected {choice.expected:.2f}x over "
        f"plain decoding{run_of(choice, costs)} (a verify of {k} tokens costs {costs.c(k, choice.context):.2f} "
        f"one-token steps of {costs.forward(1, choice.context):.1f} ms here{held(choice)}).")) + busy


def against(choice: Choice, costs: Costs, spec: Run, baseline: Run, sampled: bool = False) -> str:
    """One sentence for a run of the choice (greedy, or sampled where `sampled`) beside its baseline: the speedup it
    measured against the one expected, and the expectation's parts as the run measured them, each in the
    baseline's one-token steps: a round's verify (priced as the forward alone, c(k)), the rest of a round
    (drafting and bookkeeping), and the tokens a round kept (τ, the preset's median prompt's). So a viewer sees
    which part moved: this prompt's acceptance, or this machine's timings, which vary from start to start. '' for
    a run the costs did not price (another drafter or shape, an adaptive γ, another cache, dtype or compiling, a
    batch row) or without a baseline step to count in."""
    m = spec.meta
    priced = (m.drafter, m.gamma, m.branch, m.nodes, m.gamma_policy, m.cache, m.compiled, m.dtype, m.batch_size,
              not m.sampling.greedy) == (choice.drafter, choice.gamma, choice.branch, choice.nodes, "fixed", "static",
                                         costs.compiled, costs.dtype, 1, sampled)
    step = target_step_ms(spec, baseline)
    if not priced or not step or not spec.events or not baseline.tokens_per_s:
        return ""
    rest = beside_verify_ms(costs, choice.drafter, choice.shape, sampled) / costs.forward(1, choice.context)
    spent = (spec.rounds_ms - sum(e.verify_ms for e in spec.events)) / len(spec.events)
    return (f"expected {choice.expected:.2f}x, measured {spec.tokens_per_s / baseline.tokens_per_s:.2f}x: a round "
            f"verified in {median(e.verify_ms for e in spec.events) / step:.2f} steps (priced at "
            f"{costs.c(width(choice.shape), choice.context):.2f}), drafted and kept its books in {spent / step:.2f} "
            f"more (priced at {rest:.2f}) and yielded {spec.tokens_per_round:.2f} tokens "
            f"({choice.tokens_per_round:.2f} on a median benchmark prompt)")


def run_of(choice: Choice, costs: Costs) -> str:
    """' in a run of N new tokens, prefills included' for a choice priced so, else ''."""
    priced = choice.new_tokens and costs.prefill(choice.context or costs.context) is not None
    return f" in a run of {choice.new_tokens} new tokens, prefills included" if priced else ""


def held(choice: Choice) -> str:
    """Where the expectation's τ comes from: a text that keeps fewer tokens a round is sped up less."""
    if not choice.tokens_per_round:
        return ""
    return f", at the {choice.tokens_per_round:.2f} tokens a round it keeps on a median benchmark prompt"
