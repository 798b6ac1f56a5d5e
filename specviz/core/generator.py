"""Speculative decoding, one round at a time, for one prompt or a batch, and the plain baseline.

Leviathan et al. 2023, Algorithm 1, with a KV cache on both sides (reference.py writes it for one prompt
and a chain in one screen; the tests hold this loop to it). Each round is five stages:
  propose  the drafter drafts d_1..d_γ with q_1..q_γ                          (drafters.py)
  verify   one target forward over [x_last, d_1..d_γ] gives p_1..p_{γ+1}
  judge    the rule keeps n of them and picks a correction or a bonus token,
           after the round's one read from the device                      (rules.py, reads.py)
  commit   both KV states roll back to the kept prefix                     (kvcache.py)
  record   one RoundEvent per row, with what the viewer shows               (recording.py)
One code path serves everything: a single prompt is a batch of one, and the baseline is the
same loop with a drafter that drafts nothing (each round one plain target step). `decode` is a
Python generator of rounds, so a consumer renders each round as it happens and cancels between
rounds by closing it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import transformers

from ..models import native
from ..models.loading import ModelPair, encode_prompt
from .drafters import (
    Drafter,
    DraftModelDrafter,
    EagleDrafter,
    LookupFirstDrafter,
    NoDrafter,
    PromptLookupDrafter,
    Proposal,
    lookup_first_name,
)
from .events import (
    MAX_BATCH,
    MAX_BRANCH,
    MAX_GAMMA,
    MAX_NEW_TOKENS,
    MAX_NODES,
    MAX_SEED,
    DraftedToken,
    ExtraToken,
    RoundEvent,
    Run,
    RunMeta,
)
from .kvcache import CACHE_KINDS, Forward, KVState, Tree, on_device, reads_wait, stacked
from .reads import fetch
from .recording import Recorder, TokenTexts, View
from .rules import Drafts, rule_for
from .sampling import SamplingParams, Verdict, logits_to_probs
from .schedules import POLICIES, make_policy


def compile_by_default() -> bool:
    """SPECVIZ_COMPILE=1 turns compiled forwards on wherever Settings are made without saying."""
    return os.environ.get("SPECVIZ_COMPILE", "").lower() not in ("", "0", "false", "no")


@dataclass(frozen=True)
class Settings:
    """Everything a run depends on besides the models and the prompt."""

    gamma: int = 4  # tokens drafted per round; where a policy adapts it, the first round's
    gamma_policy: str = "fixed"  # "fixed" | "grow-shrink" | "expected" (schedules.py)
    gamma_max: int = 16  # the most an adaptive policy may draft
    # a tree (EAGLE-head drafters): each drafted node gets `branch` children, γ levels deep, and the
    # `nodes` likeliest are verified together (0: all drafted); branch 1 is a chain of γ. Sampled, a tree is
    # `branch` chains whose first drafts differ, and the first `nodes` drawn are verified (drafters.py)
    branch: int = 1
    nodes: int = 0
    drafter: str = "model"  # a key of DRAFTER_KINDS
    # sampled runs: the drafter proposes its argmax and the rule takes q as one-hot (exact, as for
    # prompt lookup); acceptance becomes p(d) for the draft's likeliest d instead of min(1, p/q)
    draft_greedy: bool = False
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    max_new_tokens: int = 64
    record_top: int = 8  # candidates per drafted position kept for the inspector (0: none)
    cache: str = "static"  # "static" | "dynamic" | "none" (kvcache.py), for both models
    compile: bool = field(default_factory=compile_by_default)  # torch.compile the static cache's forward

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p)

    @classmethod
    def of_run(cls, meta: RunMeta, **changes) -> Settings:
        """The settings a speculative run was made with (to run it again, changed as asked)."""
        fields = dict(gamma=meta.gamma, gamma_policy=meta.gamma_policy, gamma_max=max(meta.gamma_max, meta.gamma),
                      drafter=meta.drafter or "model", temperature=meta.temperature, top_k=meta.top_k,
                      top_p=meta.top_p, seed=meta.seed, max_new_tokens=meta.max_new_tokens,
                      cache=meta.cache or "static", compile=meta.compiled, draft_greedy=meta.draft_greedy,
                      branch=meta.branch, nodes=meta.nodes)
        return cls(**{**fields, **changes})

    def validate(self) -> None:
        """ValueError before any model work, so nothing is left half-done."""

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not is_int(self.gamma) or not 1 <= self.gamma <= MAX_GAMMA:
            raise ValueError(f"gamma (draft length) must be an integer in [1, {MAX_GAMMA}], got {self.gamma!r}")
        if not is_int(self.gamma_max) or not self.gamma <= self.gamma_max <= MAX_GAMMA:
            raise ValueError(f"gamma_max must be an integer in [gamma, {MAX_GAMMA}], got {self.gamma_max!r}")
        if self.gamma_policy not in POLICIES:
            raise ValueError(f"gamma_policy must be one of {', '.join(POLICIES)}, got {self.gamma_policy!r}")
        if self.drafter not in DRAFTER_KINDS:
            raise ValueError(f"drafter must be one of {', '.join(DRAFTER_KINDS)}, got {self.drafter!r}")
        if not is_int(self.branch) or not 1 <= self.branch <= MAX_BRANCH:
            raise ValueError(f"branch (children per drafted node) must be an integer in [1, {MAX_BRANCH}], "
                             f"got {self.branch!r}")
        if self.branch > 1 and not DRAFTER_KINDS[self.drafter].trees:
            raise ValueError(f"the {self.drafter} drafter drafts chains: branch > 1 needs one of "
                             f"{', '.join(k for k, kind in DRAFTER_KINDS.items() if kind.trees)}")
        if not is_int(self.nodes) or not 0 <= self.nodes <= MAX_NODES:
            raise ValueError(f"nodes (drafts verified per round, 0 = all) must be an integer in [0, {MAX_NODES}], "
                             f"got {self.nodes!r}")
        if not is_int(self.max_new_tokens) or not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS:
            raise ValueError(
                f"max_new_tokens must be an integer in [1, {MAX_NEW_TOKENS}], got {self.max_new_tokens!r}"
            )
        if not is_int(self.seed) or not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be an integer in [0, 2**63 - 1], got {self.seed!r}")
        if self.cache not in CACHE_KINDS:
            raise ValueError(f"cache must be one of {', '.join(CACHE_KINDS)}, got {self.cache!r}")
        if not isinstance(self.compile, bool):
            raise ValueError(f"compile must be True or False, got {self.compile!r}")
        if not isinstance(self.draft_greedy, bool):
            raise ValueError(f"draft_greedy must be True or False, got {self.draft_greedy!r}")
        if not is_int(self.record_top) or self.record_top < 0:
            raise ValueError(f"record_top must be an integer >= 0, got {self.record_top!r}")
        self.sampling.validate()


def validate_prompt(prompt: str) -> None:
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("the prompt is empty: type something for the model to continue")


def check_fits(pair: ModelPair, prompt_ids: list[int], settings: Settings) -> None:
    """ValueError if prompt + new tokens (+ a draft's overshoot) exceed either model's context."""
    limits = [getattr(m.config, "max_position_embeddings", None) for m in (pair.target, pair.draft)]
    limit = min((n for n in limits if n), default=None)
    gamma = settings.gamma if settings.gamma_policy == "fixed" else settings.gamma_max
    need = len(prompt_ids) + settings.max_new_tokens + gamma  # a tree's drafts are γ positions deep at most
    if limit is not None and need > limit:
        raise ValueError(f"the prompt is {len(prompt_ids)} tokens; with {settings.max_new_tokens} new tokens and "
                         f"γ = {gamma} that needs {need} positions, more than the models' {limit}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seeded_generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def machine_name(device: torch.device) -> str:
    """The machine a run's timings belong to."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        from ..models.kernels import describe_machine

        return describe_machine()
    return str(device)


def _versions() -> dict[str, str]:
    return {"torch": torch.__version__, "transformers": transformers.__version__}


def drafter_name(pair: ModelPair, drafter: str) -> str:
    """What drafts, as the stats and traces name it."""
    return DRAFTER_KINDS[drafter].name(pair)


def check_drafter(pair: ModelPair, settings: Settings) -> None:
    """ValueError (before any model work) if the pair cannot draft the way settings ask."""
    if DRAFTER_KINDS[settings.drafter].needs_head and pair.head is None:
        raise ValueError(f"the {settings.drafter} drafter needs a head trained for this target: the offline preset "
                         "ships one; for another target make one with `python -m specviz distill --kind eagle` and "
                         "load it with --head DIR")


def make_meta(pair: ModelPair, mode: str, prompt: str, prompt_ids: list[int], settings: Settings,
              batch_size: int = 1) -> RunMeta:
    speculative = mode == "speculative"
    draft = drafter_name(pair, settings.drafter) if speculative else None
    return RunMeta(
        mode=mode,
        target=pair.target_name,
        draft=draft,
        dtype=str(pair.dtype).removeprefix("torch."),
        device=str(pair.device),
        gamma=settings.gamma if speculative else 0,
        gamma_policy=settings.gamma_policy if speculative else "fixed",
        gamma_max=settings.gamma_max if speculative and settings.gamma_policy != "fixed" else 0,
        temperature=settings.temperature,
        top_k=settings.top_k,
        top_p=settings.top_p,
        seed=settings.seed,
        max_new_tokens=settings.max_new_tokens,
        prompt=prompt,
        prompt_ids=list(prompt_ids),
        vocab_size=pair.vocab_size,
        draft_note=pair.draft_note if speculative and settings.drafter == "model" else "",
        batch_size=batch_size,
        cache=settings.cache,
        compiled=settings.compile,
        draft_greedy=settings.draft_greedy and speculative and not settings.sampling.greedy,
        drafter=settings.drafter if speculative else "",
        versions=_versions(),
        machine=machine_name(pair.device),
        dtype_reason=pair.dtype_reason,
        weights=pair.weights,
        branch=settings.branch if speculative else 1,
        nodes=settings.nodes if speculative and settings.branch > 1 else 0,
    )


def kept_drafts(n_accepted: int, drafted_ids: list[int], eos_ids) -> tuple[int, int | None]:
    """(drafts kept, index of an accepted EOS or None): an accepted EOS ends the text there."""
    stop_at = next((i for i in range(n_accepted) if drafted_ids[i] in eos_ids), None)
    return (n_accepted if stop_at is None else stop_at + 1), stop_at


def finish_reason(new: list[int], generated: int, max_new_tokens: int, eos_ids) -> str | None:
    """'eos' if this round's new tokens hold an EOS, 'length' at the budget, else None."""
    if any(t in eos_ids for t in new):
        return "eos"
    return "length" if generated >= max_new_tokens else None


@dataclass(frozen=True)
class DrafterKind:
    """A way to draft: its label on the page, its name in stats and traces, and how to make one for a
    pair (settings, cache capacity). A new drafter is a class in drafters.py and one line in DRAFTER_KINDS."""

    label: str
    name: Callable[[ModelPair], str]
    make: Callable[[ModelPair, Settings, int], Drafter]
    needs_head: bool = False  # reads the pair's EAGLE head
    trees: bool = False  # drafts trees (Settings.branch > 1) as well as chains


def _head_name(pair: ModelPair) -> str:
    origin = pair.head.config.origin if pair.head is not None else ""
    return f"EAGLE head {pair.head_name}" + (f" ({origin})" if origin else "")


def control_ids(tokenizer) -> frozenset[int]:
    """The tokenizer's special tokens (the chat template's markers, end-of-text): prompt lookup copies none."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return frozenset(tokenizer.all_special_ids) | {i for i, token in added.items() if getattr(token, "special", False)}


def _head(pair: ModelPair, settings: Settings, capacity: int) -> EagleDrafter:
    return EagleDrafter(pair.head, pair.vocab_size, pad_id(pair), capacity, _head_name(pair), settings.branch,
                        settings.nodes, settings.compile)


DRAFTER_KINDS: dict[str, DrafterKind] = {
    "model": DrafterKind("draft model", lambda pair: pair.draft_name, lambda pair, s, capacity: DraftModelDrafter(
        pair.draft, pair.vocab_size, pad_id(pair), s.cache, capacity, s.compile)),
    "lookup": DrafterKind("prompt lookup (copies from the prompt, no model)", lambda pair: PromptLookupDrafter.name,
                          lambda pair, s, capacity: PromptLookupDrafter(pair.vocab_size, device=pair.device,
                                                                        stop_ids=control_ids(pair.tokenizer))),
    "eagle": DrafterKind("EAGLE head (reads the target's hidden states)", _head_name,
                         _head, needs_head=True, trees=True),
    "lookup+eagle": DrafterKind("prompt lookup, else EAGLE head",  # lookup where the text repeats
                                lambda pair: lookup_first_name(_head_name(pair)),
                                lambda pair, s, capacity: LookupFirstDrafter(
                                    _head(pair, s, capacity), pair.vocab_size, pair.device,
                                    stop_ids=control_ids(pair.tokenizer)),
                                needs_head=True, trees=True),
}
HEAD_DRAFTERS = tuple(name for name, kind in DRAFTER_KINDS.items() if kind.needs_head)


def make_drafter(pair: ModelPair, settings: Settings, mode: str, capacity: int) -> Drafter:
    if mode == "baseline":
        return NoDrafter(pair.device)
    check_drafter(pair, settings)
    return DRAFTER_KINDS[settings.drafter].make(pair, settings, capacity)


def pad_id(pair: ModelPair) -> int:
    pad = pair.tokenizer.pad_token_id
    return pad if pad is not None else min(pair.eos_token_ids)


def draft_width(settings: Settings) -> int:
    """The most drafts one round verifies: γ for a chain; a tree's node budget, or all it drafts."""
    gamma = settings.gamma if settings.gamma_policy == "fixed" else settings.gamma_max
    k = settings.branch
    drafted = gamma if k == 1 else k + (gamma - 1) * k * k  # EAGLE-2: k children of the k likeliest per level
    return min(drafted, settings.nodes) if settings.nodes else drafted


def tree_label(gamma: int, branch: int, nodes: int) -> str:
    """A tree's shape as specviz writes it: "γxbranch:nodes" (γ deep, branch children per node, nodes verified;
    0 = all). parse_trees reads it back."""
    return f"{gamma}x{branch}:{nodes}"


def parse_trees(text: str) -> list[tuple[int, int, int]]:
    """"4x4:8,3x2:4" -> [(4, 4, 8), (3, 2, 4)]: tree_label's shapes, comma-separated (":nodes" may be left out: all)."""
    shapes = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        try:
            depth, rest = item.split("x")
            branch, nodes = rest.split(":") if ":" in rest else (rest, "0")
            shapes.append((int(depth), int(branch), int(nodes)))
        except ValueError:
            raise ValueError(f"a tree is γxbranch:nodes, for example 4x4:8; got {item!r}") from None
    return shapes


def _capacity(prompts_ids: list[list[int]], settings: Settings) -> int:
    """Slots a static cache needs for a single run: prompt, new tokens, and one round's overshoot."""
    return max(map(len, prompts_ids)) + settings.max_new_tokens + draft_width(settings) + 2


@dataclass
class Rows:
    """Each row's state on the host, by original row number; `active` lists the rows still decoding, in the
    order the models' states hold them."""

    seqs: list[list[int]]  # each row's ids so far
    generators: list[torch.Generator]  # each row's own, seeded as if it ran alone
    policies: list
    generated: list[int]
    rounds: list[int]
    active: list[int]

    @staticmethod
    def of(prompts_ids: list[list[int]], settings: Settings, device: torch.device, seeds: list[int] | None) -> Rows:
        n = len(prompts_ids)
        generators = [_seeded_generator(device, seed) for seed in seeds or [settings.seed] * n]
        policies = [make_policy(settings.gamma_policy, settings.gamma, settings.gamma_max) for _ in range(n)]
        return Rows([list(p) for p in prompts_ids], generators, policies, [0] * n, [0] * n, list(range(n)))

    def now(self, values: list) -> list:
        """The active rows' entries of a per-row list, in state order."""
        return [values[r] for r in self.active]

    def drop(self, finished: list[int], target: KVState, drafter: Drafter) -> None:
        """Take the finished rows (positions in `active`) out of the batch and out of both models' states."""
        if finished:
            keep = [i for i in range(len(self.active)) if i not in finished]
            if keep:
                target.select(keep)
                drafter.select(keep)
            self.active = [self.active[i] for i in keep]

    def gammas(self, settings: Settings, speculative: bool) -> list[int]:
        """Each active row's γ: its policy's, never past its budget (n kept + 1 added <= what remains)."""
        return [min(self.policies[r].next_gamma(), settings.max_new_tokens - self.generated[r] - 1)
                if speculative else 0 for r in self.active]


def _check_decode(settings: Settings, mode: str, prompts_ids: list[list[int]], seeds: list[int] | None) -> None:
    """ValueError before any model work."""
    settings.validate()
    if mode not in ("speculative", "baseline"):
        raise ValueError(f"mode must be 'speculative' or 'baseline', got {mode!r}")
    if not prompts_ids or (seeds is not None and len(seeds) != len(prompts_ids)):
        raise ValueError("decode needs one or more prompts (and, if given, one seed per prompt)")


def _start(pair: ModelPair, prompts_ids: list[list[int]], settings: Settings, drafter: Drafter) -> KVState:
    """The target's state after the prefill, and the drafter's: each row's sequence but its last token. Rows with
    the same prompt share one prefill, copied to them."""
    distinct = {tuple(p): k for k, p in enumerate(dict.fromkeys(map(tuple, prompts_ids)))}  # prompt -> state row
    target = KVState(pair.target, len(distinct), settings.cache, pair.vocab_size, _capacity(prompts_ids, settings),
                     settings.compile)
    prompts = [list(p) for p in distinct]
    drafter.start(prompts, target.prefill(prompts, pad_id(pair), hidden=drafter.requires_hidden).hidden)
    if len(distinct) < len(prompts_ids):
        rows = [distinct[tuple(p)] for p in prompts_ids]
        target.select(rows)
        drafter.select(rows)
    return target


def _any_tree(proposals: list[Proposal]) -> bool:
    """Whether a row drafted a tree this round (else every row's drafts are a chain)."""
    return any(p.is_tree and p.tokens.shape[0] for p in proposals)


def _verify(target: KVState, proposals: list[Proposal], lasts: torch.Tensor, pad: int, hidden: bool,
            shaped: bool) -> tuple[Forward, list[tuple[torch.Tensor, int]]]:
    """One target forward over each row's last token and its drafts, ids [B, width] padded: logits [B, width, V]
    (row 1 + i after node i). A tree's nodes attend to the prefix and their ancestors, at position length +
    depth, the mask made on the device from each row's parents (a tree ranked there is verified before the host
    learns its shape). shaped: the rule wants each row's (parents [g] on the device, branch) too."""
    drafted = [p.tokens.shape[0] for p in proposals]
    width = max(drafted) + 1  # lasts [B]: each row's last token
    ids = stacked([torch.cat([lasts[i : i + 1], p.tokens]) for i, p in enumerate(proposals)], pad)
    real = [[True] * (g + 1) + [False] * (width - g - 1) for g in drafted]
    is_tree = _any_tree(proposals)
    shapes = [p.parents_on_device() for p in proposals] if is_tree or shaped else []
    tree = Tree.from_parents(stacked([parents for parents, _ in shapes], -2)) if is_tree else None
    return target.forward(ids, real, hidden=hidden, tree=tree), shapes


class Judged(NamedTuple):
    """One row's round after the rule: its proposal (a pending tree's shape now on the host), the verdict, and
    what the viewer is shown of it."""

    proposal: Proposal
    verdict: Verdict
    view: View


def _judge(rule, recorder: Recorder, proposals: list[Proposal], logits: torch.Tensor, shapes: list,
           generators: list[torch.Generator], params: SamplingParams) -> list[Judged]:
    """The rule's verdict on each row's drafts, with what the viewer is shown, after one read for the round.
    logits [B, width, V]; greedy, the rule reads each row's argmax only; sampled, p (warped as q was) and q
    over the whole vocabulary."""
    drafted = [p.tokens.shape[0] for p in proposals]
    best = native.argmax(logits) if params.greedy else None  # [B, width]
    if not params.greedy:
        logits_p, proposals = logits_to_probs(logits, params), [prop.widened() for prop in proposals]
    drafts = [Drafts(logits[i, : g + 1] if best is not None else logits_p[i, : g + 1], prop.q, prop.tokens,
                     generators[i], None if best is None else best[i, : g + 1], *(shapes[i] if shapes else (None, 1)))
              for i, (g, prop) in enumerate(zip(drafted, proposals, strict=True))]
    reads = [rule.reads(d) for d in drafts]
    views = [recorder.look(prop, logits[i, : d.gamma + 1], d.p, rule.ends(reads[i]))
             for i, (prop, d) in enumerate(zip(proposals, drafts, strict=True))]
    trees = [prop.tree_reads() if prop.pending is not None else None for prop in proposals]
    fetch(reads + [v.reads for v in views] + [t for t in trees if t is not None])  # the round's one read
    proposals = [prop.settled(t) for prop, t in zip(proposals, trees, strict=True)]
    return [Judged(prop, rule.judge(d, r, prop.tree), view)
            for d, r, prop, view in zip(drafts, reads, proposals, views, strict=True)]


class Kept(NamedTuple):
    """What a row's round added: its drafted tokens and extra token as events, drafts kept, their nodes, and
    why the row ended ("eos", "length"; None: it goes on)."""

    tokens: list[DraftedToken]
    extra: ExtraToken | None
    n: int
    path: list[int]
    finish: str | None


def _commit(pair: ModelPair, settings: Settings, rows: Rows, target: KVState, recorder: Recorder, slots: range,
            judged: list[Judged]) -> list[Kept]:
    """Each active row keeps its accepted drafts (an accepted EOS ends it there) and adds the correction or bonus.
    slots: where the verify wrote the drafts in the target's state; it keeps x_last (the slot before) and the kept
    nodes, moved to the slots after it (a chain's are there already)."""
    out = []
    for i, (r, (prop, verdict, view)) in enumerate(zip(rows.active, judged, strict=True)):
        n, stop_at = kept_drafts(verdict.n_accepted, [verdict.tokens[j] for j in verdict.path], pair.eos_token_ids)
        path = verdict.path[:n]
        target.keep(i, slots.start, slots.stop, [slots[j] for j in path])
        tokens, extra = recorder.tokens(view, prop, verdict, path, stop_at)
        new = [verdict.tokens[j] for j in path] + ([extra.id] if extra else [])
        rows.seqs[r] += new
        rows.generated[r] += len(new)
        out.append(Kept(tokens, extra, n, path, finish_reason(new, rows.generated[r], settings.max_new_tokens,
                                                              pair.eos_token_ids)))
    return out


@torch.inference_mode()
def decode(
    pair: ModelPair, prompts_ids: list[list[int]], settings: Settings, mode: str = "speculative",
    metas: list[RunMeta] | None = None, seeds: list[int] | None = None,
) -> Iterator[list[tuple[int, RoundEvent]]]:
    """Decode B prompts together; yield, per round, (row, event) for every row still running.

    mode "baseline" drafts nothing: one plain target step per round. Each row has its own random
    generator (seeded like a single run with settings.seed, or with seeds[row]), γ policy and
    budget, and leaves the batch when done, so a row decodes what it would decode alone. Times are
    per row: a batch's round time divided by the rows in it (a single run gets the whole). Fills
    metas' prefill_ms. A round: propose, verify, judge, commit, record.
    """
    _check_decode(settings, mode, prompts_ids, seeds)
    params, device, rows = settings.sampling, pair.device, Rows.of(prompts_ids, settings, pair.device, seeds)
    draft_params = SamplingParams(0.0) if settings.draft_greedy else params  # greedy: argmax, q one-hot
    rule = rule_for(params, ahead=reads_wait(device))  # the same tokens either way: read once a round or not
    recorder = Recorder(params, settings.record_top, TokenTexts.of(pair.tokenizer))
    start = time.perf_counter()
    drafter = make_drafter(pair, settings, mode, _capacity(prompts_ids, settings))
    target = _start(pair, prompts_ids, settings, drafter)
    _sync(device)
    for meta in metas or []:
        meta.prefill_ms = 1000 * (time.perf_counter() - start) / len(prompts_ids)

    while rows.active:
        clock = Stopwatch()
        gammas = rows.gammas(settings, mode == "speculative")
        proposals = drafter.propose(rows.now(rows.seqs), gammas, draft_params, rows.now(rows.generators))
        clock.mark("draft")
        width = max(p.tokens.shape[0] for p in proposals) + 1
        slots = range(target.width + 1, target.width + width)  # where the verify writes the drafts
        lasts, chain = on_device([seq[-1] for seq in rows.now(rows.seqs)], device), not _any_tree(proposals)
        verify, shapes = _verify(target, proposals, lasts, pad_id(pair), drafter.requires_hidden, rule.needs_shapes)
        clock.mark("verify")
        judged = _judge(rule, recorder, proposals, verify.logits, shapes, rows.now(rows.generators), params)
        clock.mark("judge")
        kept = _commit(pair, settings, rows, target, recorder, slots, judged)
        clock.mark("record")
        drafter.verified([k.n for k in kept], _along(verify.hidden, [k.path for k in kept], chain))
        out = _record(rows, judged, kept, target.trim(), drafter.cache_lens(), clock)
        rows.drop([i for i, k in enumerate(kept) if k.finish], target, drafter)
        clock.mark("rest")
        for _, event in out:  # the round's end: its last stage's time, and the run's so far
            event.rest_ms, event.elapsed_ms = clock.ms["rest"] / len(out), 1000 * (clock.last - start)
        suspended = time.perf_counter()
        yield out
        start += time.perf_counter() - suspended  # the consumer's time between rounds is not the run's


class Stopwatch:
    """A round's stages (events.STAGES) timed back to back on the host from its start: `mark` ends one, so together
    they are the round's wall time. On a CPU a stage's work is done when its call returns. On a GPU no stage waits
    to be timed (a wait only to time would cost the round a sync the baseline's steps do not pay): the host queues
    the draft and the verify, and their device time shows where it first waits, the judge's read."""

    def __init__(self):
        self.last, self.ms = time.perf_counter(), {}

    def mark(self, stage: str) -> None:
        now = time.perf_counter()
        self.ms[stage], self.last = 1000 * (now - self.last), now


def _record(rows: Rows, judged: list[Judged], kept: list[Kept], target_lens: list[int], draft_lens: list[int],
            clock: Stopwatch) -> list[tuple[int, RoundEvent]]:
    """The round's event for each active row (its γ policy learns from it), with the stages timed so far for the
    whole batch, shared among its rows (the caller adds the last, rest, and the time elapsed)."""
    share, out = 1 / len(rows.active), []
    for i, (r, (prop, *_), k) in enumerate(zip(rows.active, judged, kept, strict=True)):
        event = RoundEvent(
            index=rows.rounds[r], gamma=prop.tokens.shape[0], drafted=k.tokens, extra=k.extra, n_accepted=k.n,
            draft_ms=share * clock.ms["draft"], verify_ms=share * clock.ms["verify"], target_cache_len=target_lens[i],
            draft_cache_len=draft_lens[i] if draft_lens else 0, tokens_so_far=rows.generated[r],
            elapsed_ms=0.0, finish_reason=k.finish, drafted_by=prop.source, parents=list(prop.parents or []),
            judge_ms=share * clock.ms["judge"], record_ms=share * clock.ms["record"],
        )
        rows.rounds[r] += 1
        rows.policies[r].observe(event)
        out.append((r, event))
    return out


def _along(hidden: torch.Tensor | None, paths: list[list[int]], chain: bool) -> torch.Tensor | None:
    """hidden [B, w, H] over [x_last, nodes...] -> [B, n_max + 1, H] over [x_last, kept nodes...]; a chain's
    kept rows are the first ones already (a view, no copy)."""
    if hidden is None:
        return None
    width = 1 + max(map(len, paths))
    if chain:
        return hidden[:, :width]
    index = on_device([[0] + [1 + j for j in path] + [0] * (width - 1 - len(path)) for path in paths],
                      hidden.device)
    return hidden.gather(1, index[:, :, None].expand(-1, -1, hidden.shape[-1]))


def speculative_events(pair: ModelPair, prompt_ids: list[int], settings: Settings,
                       meta: RunMeta | None = None) -> Iterator[RoundEvent]:
    """One prompt: yield one RoundEvent per round until EOS or max_new_tokens. Fills meta.prefill_ms."""
    for ((_, event),) in decode(pair, [prompt_ids], settings, "speculative", [meta] if meta else None):
        yield event


def baseline_events(pair: ModelPair, prompt_ids: list[int], settings: Settings,
                    meta: RunMeta | None = None) -> Iterator[RoundEvent]:
    """Plain autoregressive decoding with the target alone: one event per token, same shape."""
    for ((_, event),) in decode(pair, [prompt_ids], settings, "baseline", [meta] if meta else None):
        yield event


def encode_prompts(pair: ModelPair, prompts: list[str], settings: Settings, chat_template: bool = True,
                   prompts_ids: list[list[int]] | None = None) -> list[list[int]]:
    """Validated prompt ids: encoded here unless given; ValueError before any model work."""
    settings.validate()
    check_drafter(pair, settings)
    count = len(prompts if prompts_ids is None else prompts_ids)
    if not 1 <= count <= MAX_BATCH:
        raise ValueError(f"a batch holds 1 to {MAX_BATCH} prompts, got {count}")
    if prompts_ids is None:
        for prompt in prompts:
            validate_prompt(prompt)
        prompts_ids = [encode_prompt(pair.tokenizer, p, chat_template) for p in prompts]
    for ids in prompts_ids:
        check_fits(pair, ids, settings)
    return prompts_ids


def new_runs(pair: ModelPair, prompts: list[str], prompts_ids: list[list[int]], settings: Settings,
             mode: str = "speculative") -> list[Run]:
    """One empty Run per row, for `decode` to fill."""
    return [Run(make_meta(pair, mode, prompt, ids, settings, batch_size=len(prompts_ids)))
            for prompt, ids in zip(prompts, prompts_ids, strict=True)]


def generate_batch(pair: ModelPair, prompts: list[str], settings: Settings, chat_template: bool = True,
                   prompts_ids: list[list[int]] | None = None, mode: str = "speculative") -> list[Run]:
    """Run B prompts together to the end: one Run per prompt, in order."""
    prompts_ids = encode_prompts(pair, prompts, settings, chat_template, prompts_ids)
    runs = new_runs(pair, prompts, prompts_ids, settings, mode)
    for round_events in decode(pair, prompts_ids, settings, mode, [r.meta for r in runs]):
        for row, event in round_events:
            runs[row].events.append(event)
    return with_texts(pair, runs)


def with_texts(pair: ModelPair, runs: list[Run]) -> list[Run]:
    """The runs, each with its generated text decoded (whole or stopped part way)."""
    for run in runs:
        run.text = pair.tokenizer.decode(run.token_ids, skip_special_tokens=True)
    return runs


def generate(pair: ModelPair, prompt: str, settings: Settings, mode: str = "speculative",
             chat_template: bool = True, prompt_ids: list[int] | None = None) -> Run:
    """Run one prompt to the end and return the whole Run (events plus the decoded text)."""
    return generate_batch(pair, [prompt], settings, chat_template, None if prompt_ids is None else [prompt_ids],
                          mode)[0]
