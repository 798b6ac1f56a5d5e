"""Speculative decoding, one round at a time, for one prompt or a batch, and the plain baseline.

Leviathan et al. 2023, Algorithm 1, with a KV cache on both sides. Each round:
  1. the drafter proposes d_1..d_γ with q_1..q_γ             (drafters.py)
  2. one target forward over [x_last, d_1..d_γ] gives p_1..p_{γ+1}
  3. the acceptance rule keeps n of them and adds a correction or a bonus token (sampling.py)
  4. both KV states roll back to the kept prefix                (kvcache.py)
One code path serves everything: a single prompt is a batch of one, and the baseline is the
same loop with a drafter that drafts nothing (each round one plain target step). `decode` is a
Python generator of rounds, so a consumer renders each round as it happens and cancels between
rounds by closing it.
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
import transformers

from ..models import native
from ..models.loading import ModelPair, encode_prompt
from .drafters import (
    Columns,
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
    ACCEPTED,
    BONUS,
    CORRECTION,
    MAX_BATCH,
    MAX_BRANCH,
    MAX_GAMMA,
    MAX_NEW_TOKENS,
    MAX_NODES,
    MAX_SEED,
    REJECTED,
    TARGET,
    UNVERIFIED,
    DraftedToken,
    ExtraToken,
    RoundEvent,
    Run,
    RunMeta,
    TopToken,
)
from .kvcache import CACHE_KINDS, KVState, Tree, on_device, read_together, reads_wait, stacked
from .sampling import (
    SamplingParams,
    accept_or_resample,
    children_of,
    logits_to_probs,
    rule_reads,
    rule_reads_ahead,
    wide_dtype,
)
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


class TokenTexts:
    """Decoded text of single token ids, memoised (decode is the slow part of an event). `of` keeps one per
    tokenizer across runs: a run records its drafts and, for the inspector, about ten candidates a drafted token,
    mostly the same ids from run to run."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    @staticmethod
    def of(tokenizer) -> TokenTexts:
        texts = _TEXTS.get(tokenizer)
        if texts is None:
            texts = _TEXTS[tokenizer] = TokenTexts(tokenizer)
        return texts

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode([token_id])
        return text


_TEXTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> its TokenTexts


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seeded_generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _top_tokens(p_show, q_show, asks, k, text, residual=None) -> list[list[TopToken]]:
    """Candidates at each asked position, for the inspector: the union of the k most likely tokens
    under p and under q (where q has mass: a one-hot q has one), and the chosen one. asks: per
    position (p row, q row or None, chosen id, with the residual row or not); None as q row: nothing
    was drafted there (a bonus or a baseline step). Two top-k calls and one gather per value for
    the whole round, not a handful of small tensor calls per position."""
    device, g = p_show.probs.device, q_show.probs.shape[0]
    # two reads for the round: the top k ids under p and q (-1 where q has no mass), then the values
    parts = [p_show.top(k)[0]]  # [g + 1, k]
    if g:
        q_ids, mass = q_show.top(k)
        parts.append(torch.where(mass, q_ids, -1))  # [g, k'] (k' < k where the drafter's vocabulary is smaller)
    flat, tops, at = torch.cat([t.flatten() for t in parts]).tolist(), [], 0
    for t in parts:
        for _ in range(t.shape[0]):
            tops.append(flat[at : at + t.shape[1]])
            at += t.shape[1]
    p_top, q_top = tops[: len(tops) - g], [[i for i in row if i >= 0] for row in tops[len(tops) - g :]]
    ids = [sorted({*p_top[p_row], chosen, *(q_top[q_row] if q_row is not None else ())})
           for p_row, q_row, chosen, _ in asks]
    flat = [i for row in ids for i in row]
    p_rows = [p_row for (p_row, *_), row in zip(asks, ids, strict=True) for _ in row]
    q_rows = [q_row or 0 for (_, q_row, *_), row in zip(asks, ids, strict=True) for _ in row]
    p_rows, q_rows, flat_d = on_device([p_rows, q_rows, flat], device)  # sent without a wait
    values = [p_show.at(p_rows, flat_d)]
    if g:
        values.append(q_show.at(q_rows, flat_d))
    if residual is not None:
        values.append(residual[flat_d])
    values = torch.cat(values).tolist()
    n = len(flat)
    p, q = values[:n], values[n : 2 * n] if g else []
    res = values[(2 if g else 1) * n :] if residual is not None else []
    out, at = [], 0
    for (_, q_row, _, with_residual), row in zip(asks, ids, strict=True):
        span = range(at, at + len(row))
        at += len(row)
        rows = [(i, p[j], q[j] if q_row is not None else 0.0, res[j] if with_residual else None)
                for i, j in zip(row, span, strict=True)]
        rows.sort(key=lambda r: -(r[1] + r[2]))
        out.append([TopToken(i, text(i), pi, qi, ri) for i, pi, qi, ri in rows])
    return out


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


@dataclass
class Shown:
    """Rows of a distribution as the page reads them, at a few ids each: probabilities [R, V], or [R, N + 1]
    over a drafter's own vocabulary (columns) and a last column of zeros, where every other id is read."""

    probs: torch.Tensor
    columns: Columns | None = None

    @staticmethod
    def of(probs: torch.Tensor, columns: Columns | None) -> Shown:
        return Shown(probs if columns is None else F.pad(probs, (0, 1)), columns)

    def _cols(self, ids: torch.Tensor) -> torch.Tensor:
        return ids if self.columns is None else self.columns.of[ids]

    def at(self, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The probability of ids in rows (index tensors broadcast together, as in probs[rows, ids])."""
        return self.probs[rows, self._cols(ids)]

    def every(self, ids: torch.Tensor) -> torch.Tensor:
        """[R, n]: the probability of each of ids [n] at every row."""
        return self.probs[:, self._cols(ids)]

    def own(self, ids: torch.Tensor) -> torch.Tensor:
        """[R]: row i's probability of ids[i]."""
        return self.probs.gather(1, self._cols(ids)[:, None])[:, 0]

    def top(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [R, k'], whether each has mass): each row's k likeliest ids (k' = min(k, N))."""
        probs = self.probs if self.columns is None else self.probs[:, :-1]
        values, cols = native.topk(probs, min(k, probs.shape[-1]))
        return (cols if self.columns is None else self.columns.ids[cols]), values > 0


def _shown(proposal: Proposal, p_logits: torch.Tensor, p: torch.Tensor, params: SamplingParams) -> tuple[Shown, Shown]:
    """(p [g + 1 rows], q [g rows]): what the viewer sees, the rule's p and q, or the plain softmax when greedy
    (over the drafter's own vocabulary where it has one: the same numbers, a fraction of the width)."""
    q = proposal.logits.softmax(-1) if params.greedy and proposal.logits is not None else proposal.q
    return Shown(p_logits.softmax(-1) if params.greedy else p), Shown.of(q, proposal.columns)


def _shown_reads(proposal: Proposal, p_show: Shown, q_show: Shown, best: torch.Tensor | None) -> torch.Tensor:
    """The values shown for a round, as one vector on the device (wide_dtype): p of each drafted token at every
    row [g + 1, g] (its parent's row is picked on the host, so no index list goes to the device) and q of
    each [g]. Given best [g + 1], the extra token for each place the walk can end, known before it does
    (greedy: each row's argmax of the target's logits; sampled where a read waits: walk_ends): also its p at
    every row [g + 1] and q at every node [g, g + 1]."""
    drafts = proposal.tokens
    values = [p_show.every(drafts).flatten(), q_show.own(drafts)]
    if best is not None:
        values.append(p_show.own(best))
        if drafts.numel():
            values.append(q_show.every(best).flatten())
    return torch.cat(values).to(wide_dtype(drafts.device))


def _round_tokens(proposal, tokens, p_show, q_show, shown, verdict, path, stop_at, params, record_top, text):
    """The round's drafted nodes (tokens: their ids) and its correction or bonus token, as events.
    p_show, q_show: what the viewer sees (_shown); shown: _shown_reads of them, read; path: the kept nodes."""
    gamma, parents = len(tokens), proposal.tree
    end = path[-1] if path else -1  # the node the walk ended at (-1: the root)
    # a rejection shows where it was tested below the kept path; under an accepted EOS the text has ended
    tested = {-1, *path} - ({end} if stop_at is not None else set())
    corrected = verdict.rejected[-1] if verdict.rejected and parents[verdict.rejected[-1]] == end else None
    extra_id = verdict.next_token if stop_at is None else None
    children = [i for i, parent in enumerate(parents) if parent == end]
    p_d = [shown[(parent + 1) * gamma + i] for i, parent in enumerate(parents)]
    q_d = shown[(gamma + 1) * gamma : (gamma + 2) * gamma]
    if extra_id is not None and len(shown) > (gamma + 2) * gamma:  # known before the walk ended (best): read
        at = (gamma + 2) * gamma
        p_extra = shown[at + end + 1]
        q_extra = shown[at + gamma + 1 + children[0] * (gamma + 1) + end + 1] if children else None
    elif extra_id is not None:  # a sampled walk's, drawn at its end (a CPU): one more read
        at = on_device([end + 1, children[0] if children else 0, extra_id], proposal.tokens.device)
        values = [p_show.at(at[:1], at[2:])] + ([q_show.at(at[1:2], at[2:])] if children else [])
        p_extra, *q_extra = torch.cat(values).tolist()
        q_extra = q_extra[0] if q_extra else None
    tops = [[] for _ in range(gamma + 1)]
    if record_top:  # the extra's candidates too: where two runs part, the size of the tie
        residual = verdict.residual if corrected is not None and not params.greedy else None
        asks = [(parents[i] + 1, i, tok, i == corrected and residual is not None) for i, tok in enumerate(tokens)]
        if extra_id is not None:
            asks.append((end + 1, children[0] if children else None, extra_id, False))
        tops = _top_tokens(p_show, q_show, asks, record_top, text, residual)
    drafted = []
    for i, tok in enumerate(tokens):
        status = ACCEPTED if i in path else REJECTED if i in verdict.rejected and parents[i] in tested else UNVERIFIED
        u = verdict.u[i] if status != UNVERIFIED else None
        score = proposal.scores[i] if proposal.scores is not None else None
        drafted.append(DraftedToken(tok, text(tok), q_d[i], p_d[i], verdict.accept_probs[i], u, status, tops[i],
                                    score))
    extra = None
    if extra_id is not None:
        kind = CORRECTION if children else BONUS if gamma else TARGET  # nothing drafted: a plain step
        extra = ExtraToken(extra_id, text(extra_id), kind, p_extra, q_extra, tops[gamma])
    return drafted, extra


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


def _head(pair: ModelPair, settings: Settings, capacity: int) -> EagleDrafter:
    return EagleDrafter(pair.head, pair.vocab_size, pad_id(pair), capacity, _head_name(pair), settings.branch,
                        settings.nodes, settings.compile)


DRAFTER_KINDS: dict[str, DrafterKind] = {
    "model": DrafterKind("draft model", lambda pair: pair.draft_name, lambda pair, s, capacity: DraftModelDrafter(
        pair.draft, pair.vocab_size, pad_id(pair), s.cache, capacity, s.compile)),
    "lookup": DrafterKind("prompt lookup (copies from the prompt, no model)", lambda pair: PromptLookupDrafter.name,
                          lambda pair, s, capacity: PromptLookupDrafter(pair.vocab_size, device=pair.device)),
    "eagle": DrafterKind("EAGLE head (reads the target's hidden states)", _head_name,
                         _head, needs_head=True, trees=True),
    "lookup+eagle": DrafterKind("prompt lookup, else EAGLE head",  # lookup where the text repeats
                                lambda pair: lookup_first_name(_head_name(pair)),
                                lambda pair, s, capacity: LookupFirstDrafter(_head(pair, s, capacity),
                                                                             pair.vocab_size, pair.device),
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


@torch.inference_mode()
def decode(
    pair: ModelPair, prompts_ids: list[list[int]], settings: Settings, mode: str = "speculative",
    metas: list[RunMeta] | None = None, seeds: list[int] | None = None,
) -> Iterator[list[tuple[int, RoundEvent]]]:
    """Decode B prompts together; yield, per round, (row, event) for every row still running.

    mode "baseline" drafts nothing: one plain target step per round. Each row has its own random
    generator (seeded like a single run with settings.seed, or with seeds[row]), γ policy and
    budget, and leaves the batch when done, so a row decodes what it would decode alone. Rows
    with the same prompt share one prefill. Times are per row: a batch's round time divided by
    the rows in it (a single run gets the whole). Fills metas' prefill_ms.
    """
    settings.validate()
    if mode not in ("speculative", "baseline"):
        raise ValueError(f"mode must be 'speculative' or 'baseline', got {mode!r}")
    if not prompts_ids or (seeds is not None and len(seeds) != len(prompts_ids)):
        raise ValueError("decode needs one or more prompts (and, if given, one seed per prompt)")
    params, device, V = settings.sampling, pair.device, pair.vocab_size
    draft_params = SamplingParams(0.0) if settings.draft_greedy else params  # greedy: argmax, q one-hot
    ahead = not params.greedy and reads_wait(device)  # the same tokens either way, read once a round or not
    text = TokenTexts.of(pair.tokenizer)
    n_rows, capacity, pad = len(prompts_ids), _capacity(prompts_ids, settings), pad_id(pair)
    generators = [_seeded_generator(device, seed) for seed in seeds or [settings.seed] * n_rows]  # as if alone
    policies = [make_policy(settings.gamma_policy, settings.gamma, settings.gamma_max) for _ in range(n_rows)]
    seqs = [list(p) for p in prompts_ids]  # each row's ids so far, on the host
    generated, indices = [0] * n_rows, [0] * n_rows
    active = list(range(n_rows))  # original row numbers, in state order

    start = time.perf_counter()
    drafter = make_drafter(pair, settings, mode, capacity)
    # the target's state holds each row's sequence but its last token
    distinct = {tuple(p): k for k, p in enumerate(dict.fromkeys(map(tuple, prompts_ids)))}  # prompt -> state row
    target = KVState(pair.target, len(distinct), settings.cache, V, capacity, settings.compile)
    prompts = [list(p) for p in distinct]
    prefill = target.prefill(prompts, pad, hidden=drafter.requires_hidden)
    drafter.start(prompts, prefill.hidden)
    if len(distinct) < n_rows:  # copy each distinct prompt's state to its rows
        rows = [distinct[tuple(p)] for p in prompts_ids]
        target.select(rows)
        drafter.select(rows)
    _sync(device)
    for meta in metas or []:
        meta.prefill_ms = 1000 * (time.perf_counter() - start) / n_rows

    while active:
        # Never draft past a row's budget: n kept + 1 added <= remaining.
        gammas = [min(policies[r].next_gamma(), settings.max_new_tokens - generated[r] - 1)
                  for r in active] if mode == "speculative" else [0] * len(active)
        t0 = time.perf_counter()
        proposals = drafter.propose([seqs[r] for r in active], gammas, draft_params, [generators[r] for r in active])
        _sync(device)
        t1 = time.perf_counter()
        drafted = [p.tokens.shape[0] for p in proposals]  # g_i drafted nodes (a chain: g_i <= γ_i)
        width = max(drafted) + 1
        # [B, width]: each row's last token and drafts, padded
        lasts = on_device([seqs[r][-1] for r in active], device)  # [B] each row's last token
        verify_ids = stacked([torch.cat([lasts[i : i + 1], p.tokens]) for i, p in enumerate(proposals)], pad)
        verify_real = [[True] * (g + 1) + [False] * (width - g - 1) for g in drafted]
        # a tree: each node attends to the prefix and its ancestors, at position length + depth, made on the device
        # from each row's parents (a tree ranked there is verified before the host learns its shape)
        is_tree = any(p.is_tree and p.tokens.shape[0] for p in proposals)
        shapes = [p.parents_on_device() for p in proposals] if is_tree or ahead else []  # ([g] parents, branch)
        tree = Tree.from_parents(stacked([parents for parents, _ in shapes], -2)) if is_tree else None
        base = target.width
        verify = target.forward(verify_ids, verify_real, hidden=drafter.requires_hidden, tree=tree)
        best = native.argmax(verify.logits) if params.greedy else None  # [B, g_max+1]: greedy, the extra and the test
        if params.greedy:  # the rule reads neither p nor q: only the drafts and each row's argmax
            ps = [verify.logits[i, : g + 1] for i, g in enumerate(drafted)]
        else:  # [B, g_max+1, V]: row 1+i = p(. | x, path to node i); q over the whole vocabulary too
            p_all = logits_to_probs(verify.logits, params)
            ps = [p_all[i, : g + 1] for i, g in enumerate(drafted)]
            proposals = [prop.widened() for prop in proposals]
        bests = [None if best is None else best[i, : g + 1] for i, g in enumerate(drafted)]
        shows = [_shown(prop, verify.logits[i, : g + 1], ps[i], params)
                 for i, (g, prop) in enumerate(zip(drafted, proposals, strict=True))]
        # one read for the whole round: every row's values for the rule, then the values the page shows
        residuals = [None] * len(proposals)
        if ahead:  # sampled, where a read waits: the walk's reads and draws made for every node (walk_ends)
            reads = [rule_reads_ahead(ps[i], prop.q, prop.tokens, generators[r], children_of(*shapes[i]))
                     for i, (r, prop) in enumerate(zip(active, proposals, strict=True))]
            wanted, residuals = [v for v, _ in reads], [last_r for _, last_r in reads]
            # like greedy's argmax, the token at each node the walk can end at is known already
            bests = [wanted[i][-(g + 1) :].long() for i, g in enumerate(drafted)]
        else:
            wanted = [rule_reads(ps[i], prop.q, prop.tokens, generators[r], params.greedy, bests[i])
                      for i, (r, prop) in enumerate(zip(active, proposals, strict=True))]
        wanted += [_shown_reads(prop, *show, bests[i])
                   for i, (prop, show) in enumerate(zip(proposals, shows, strict=True))]
        wanted += [prop.tree_reads() for prop in proposals if prop.pending is not None]  # and its shape, last
        host = read_together(wanted)
        shapes_read = iter(host[2 * len(active) :])
        proposals = [prop if prop.pending is None else prop.settled(next(shapes_read)) for prop in proposals]
        verdicts = [accept_or_resample(ps[i], prop.q, prop.tokens, generators[r], params.greedy, prop.parents,
                                       host[i], residuals[i])
                    for i, (r, prop) in enumerate(zip(active, proposals, strict=True))]
        _sync(device)
        t2 = time.perf_counter()

        rows, paths = [], []  # per active row: (drafted tokens, extra, n kept, new ids, finish reason); kept nodes
        for i, (r, prop, verdict) in enumerate(zip(active, proposals, verdicts, strict=True)):
            drafted_ids = verdict.tokens
            n, stop_at = kept_drafts(verdict.n_accepted, [drafted_ids[j] for j in verdict.path], pair.eos_token_ids)
            path = verdict.path[:n]
            # keep x_last and the kept nodes, moved to the slots after it (a chain's are there already)
            target.keep(i, base + 1, base + width, [base + 1 + j for j in path])
            tokens, extra = _round_tokens(prop, drafted_ids, *shows[i], host[len(active) + i], verdict, path, stop_at,
                                          params, settings.record_top, text)
            new = [drafted_ids[j] for j in path] + ([extra.id] if extra else [])
            seqs[r] += new
            generated[r] += len(new)
            rows.append((tokens, extra, n, new, finish_reason(new, generated[r], settings.max_new_tokens,
                                                                pair.eos_token_ids)))
            paths.append(path)
        drafter.verified([row[2] for row in rows], _along(verify.hidden, paths, tree is None))
        target_lens, draft_lens = target.trim(), drafter.cache_lens()
        elapsed = 1000 * (time.perf_counter() - start)
        share = 1000 / len(active)  # ms per row of this round's batch-wide seconds

        out, finished = [], []
        for i, (r, g, (tokens, extra, n, _, finish)) in enumerate(zip(active, drafted, rows, strict=True)):
            event = RoundEvent(
                index=indices[r], gamma=g, drafted=tokens, extra=extra, n_accepted=n,
                draft_ms=share * (t1 - t0), verify_ms=share * (t2 - t1), target_cache_len=target_lens[i],
                draft_cache_len=draft_lens[i] if draft_lens else 0, tokens_so_far=generated[r],
                elapsed_ms=elapsed, finish_reason=finish, drafted_by=proposals[i].source,
                parents=list(proposals[i].parents or []),
            )
            indices[r] += 1
            policies[r].observe(event)
            out.append((r, event))
            if finish:
                finished.append(i)
        if finished:
            keep = [i for i in range(len(active)) if i not in finished]
            if keep:
                target.select(keep)
                drafter.select(keep)
            active = [active[i] for i in keep]
        suspended = time.perf_counter()
        yield out
        start += time.perf_counter() - suspended  # the consumer's time between rounds is not the run's


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
