"""Logits to distributions, and the speculative-sampling acceptance rule, for a chain or a tree.

The rule (applied by rules.py) follows Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative
Decoding", Algorithm 1) and Chen et al. 2023 ("Accelerating LLM Decoding with Speculative
Sampling"): a drafted token d drawn from q is kept with probability min(1, p(d) / q(d)); on
rejection the replacement is drawn from norm(max(0, p - q)). The output is then distributed
exactly as p, provided p and q were warped (temperature, top-k, top-p) the same way, which is why
one function, `logits_to_probs`, makes both.

A tree (EAGLE-2, Li et al. 2024; SpecInfer, Miao et al. 2024) gives a node several children, each
drawn from its own q_j. At a node the rule tries them in order with SpecInfer's multi-step
speculative sampling: r = p; keep child j with min(1, r(d_j)/q_j(d_j)); if rejected,
r = norm(max(0, r - q_j)) and try child j+1; if all are rejected, draw from the last r.
Why it is exact: one try with target r and draft q_j emits d_j ~ q_j kept, else a draw from
norm(max(0, r - q_j)); if that draw follows the residual, the try emits r exactly (the chain's
proof: min(r, q_j) + max(0, r - q_j) = r). The last "draw" is one from r itself, and each try is a
draw from its r as long as the next one is, so by induction from the last child back the node
emits p. That holds when q_j depends on the siblings drawn before it, since each try only needs
d_j ~ q_j given what came before: `draw_children` draws a node's children without replacement (q_j
is q with d_1..d_{j-1} removed, renormalised; Jeon et al. 2024, recursive rejection sampling).
Children chosen deterministically (EAGLE-2 takes the draft's top k) are draws from one-hot
q_j: the try keeps d_j with r(d_j) and the residual is r with d_j removed, renormalised, so the
node samples from p by sequential elimination. Once a child is kept the walk moves to it, where
the same argument holds with that child's p. A chain is a tree whose nodes have one child each,
and there the rule is Leviathan's, draw for draw.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class SamplingParams:
    """How logits become a distribution. temperature 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0  # 1.0: no nucleus cut

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise ValueError on parameters no sampler accepts."""
        t, k, p = self.temperature, self.top_k, self.top_p
        if not isinstance(t, (int, float)) or math.isnan(t) or t < 0 or math.isinf(t):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {k!r}")
        if not isinstance(p, (int, float)) or math.isnan(p) or not 0.0 < p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {p!r}")


NO_FLOAT64 = {"mps"}  # device types without float64 (Apple's Metal)


def wide_dtype(device: torch.device | str) -> torch.dtype:
    """float64 where the device has it, else float32: for sums that must not round, and for the values a
    round reads to the host at once (ids are exact below 2^53 in float64, 2^24 in float32: every
    vocabulary is smaller; p and q are float32 or, in a float64 model, float64, kept whole)."""
    return torch.float32 if torch.device(device).type in NO_FLOAT64 else torch.float64


def at_least_float32(t: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 -> float32 for the maths; float32 and float64 stay as they are."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def logits_to_probs(logits: torch.Tensor, params: SamplingParams, best: torch.Tensor | None = None) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] in float32 (float64 stays float64).

    Greedy gives the one-hot distribution of the argmax, so that the acceptance rule below
    reduces to "keep the draft while it equals the target's argmax" (best [...]: logits.argmax(-1),
    if the caller has it: over a 49,152-token vocabulary it costs more than the softmax). Otherwise
    the order is HF's: temperature, then top-k, then top-p (keep the smallest set of tokens whose
    mass reaches top_p; the most likely token always stays).
    """
    logits = at_least_float32(logits)
    if params.greedy:
        best = logits.argmax(-1) if best is None else best
        return torch.zeros_like(logits).scatter_(-1, best[..., None], 1.0)
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # mass strictly before each token; drop a token once that mass already reaches top_p
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, -math.inf)
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None, one_uniform: bool = False) -> torch.Tensor:
    """probs [..., V] -> token ids [...], drawn with the given generator (seeded runs repeat).

    Inverse CDF: one uniform u per row (one_uniform: one for all the rows, for a caller that uses
    only one of them), the token whose interval of the cumulative sum holds u · total.
    The sum runs in float64 (float32 where the device lacks it), so each interval is its probability
    to rounding; a token of probability 0 has an empty interval and is never drawn. The same law as
    torch.multinomial, measured far faster for a 49,152-token vocabulary on an AVX2 CPU."""
    flat = probs.reshape(-1, probs.shape[-1])
    wide = wide_dtype(probs.device)
    cdf = flat.to(wide).cumsum(-1)  # [R, V]
    total = cdf[:, -1:]
    u = torch.rand((1, 1) if one_uniform else total.shape, generator=generator, device=probs.device, dtype=wide) * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))  # below the total: a token of mass
    return torch.searchsorted(cdf, u, right=True).reshape(probs.shape[:-1])


def draw_children(q: torch.Tensor, k: int, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """k children per node drawn from q [..., N] without replacement -> (ids [..., k], rows [..., k, N]):
    child j is a draw from rows[j], q with children 0..j-1 removed and renormalised (recursive rejection
    sampling, Jeon et al. 2024), so no two children repeat a token and the tree rule below stays exact
    with each child's own row. Gumbel top-k: the k largest log q + Gumbel noise come in the order and
    with the law of sequential draws (one uniform per token, no multinomial). If q's support runs out
    first, the remaining children are other tokens, chosen (one-hot rows). One child (a chain) is
    `sample(q)`, as a chain has always drawn."""
    if k == 1:
        return sample(q, generator)[..., None], q[..., None, :]
    u = torch.rand(q.shape, generator=generator, device=q.device, dtype=q.dtype)
    keys = torch.where(q > 0, q.log() - (-u.log()).log(), torch.finfo(q.dtype).min)  # log q + Gumbel(0, 1)
    ids = keys.topk(k).indices  # [..., k]
    rows = q[..., None, :].repeat(*(1,) * (q.dim() - 1), k, 1)  # [..., k, N]
    for j in range(1, k):  # rows j.. without child j-1
        rows[..., j:, :].scatter_(-1, ids[..., None, j - 1 : j].expand(*ids.shape[:-1], k - j, 1), 0.0)
    mass = rows.sum(-1, keepdim=True)
    chosen = torch.zeros_like(rows).scatter_(-1, ids[..., None], 1.0)  # one-hot: where the support ran out
    return ids, torch.where(mass > 0, rows / mass.clamp_min(1e-30), chosen)  # (no read back to test for it)


@dataclass
class Verdict:
    """What the rule decided for one round's drafts (a chain, or a tree of them)."""

    path: list[int]  # the kept drafts, root to leaf: node indices in depth order (a chain: 0..n-1)
    next_token: int  # the correction (every child of the path's end rejected) or the bonus (it has none)
    accept_probs: list[float]  # per node: min(1, r(d)/q(d)) when tested, else min(1, p(d)/q(d)) at its parent
    u: list[float | None]  # the uniform draw each tested node got; None where none was drawn
    rejected: list[int] = field(default_factory=list)  # nodes tested and rejected, in the order tested
    residual: torch.Tensor | None = None  # [V] what the correction was drawn from (sampled rounds)
    tokens: list[int] = field(default_factory=list)  # the drafted ids, read with the round's values

    @property
    def n_accepted(self) -> int:
        return len(self.path)


def chain_parents(gamma: int) -> list[int]:
    """A chain as a tree: d_1's parent is the root (-1), d_i's is d_{i-1}."""
    return list(range(-1, gamma - 1))


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) over the last axis: where a rejected draft's replacement comes from.

    The rule only rejects where q(d) > p(d), so the mass is positive there; if p == q to the
    last bit it is not, and p itself is the right answer (the rule could not have rejected).
    """
    residual = (p - q).clamp_min(0.0)
    mass = residual.sum(-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp_min(1e-30), p)


def children_of(parents: torch.Tensor, branch: int) -> torch.Tensor:
    """[g + 1, branch]: row n + 1 lists node n's children in the order the walk tries them (row 0: the
    root's), padded with g (no node); parents [g] on the device (-1: the root), and no node has more than
    `branch` children. A chain: row i holds node i, row g nothing. Made on the device: a drafted tree's
    parents need not be read first."""
    g = parents.shape[0]
    earlier = torch.ones(g, g, dtype=torch.bool, device=parents.device).tril(-1)  # [i, j]: j comes before i
    rank = ((parents[:, None] == parents[None, :]) & earlier).sum(1)  # [g]: elder siblings
    table = torch.full(((g + 1) * branch,), g, dtype=torch.long, device=parents.device)
    table[(parents + 1) * branch + rank] = torch.arange(g, device=parents.device)
    return table.view(g + 1, branch)


def walk_ends(p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor, children: torch.Tensor,
              generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a sampled walk would learn on the way, for every node at once, so that the round reads it with
    the rule's values and the walk waits for nothing: ([g] each node's min(1, r(d)/q(d)) against the r it is
    tried with, its parent's p row less its elder siblings' q as the module docstring says; [g + 1] the token
    the round adds if the walk ends at each node: every child rejected, a draw from the last r; none, the
    bonus from p; [g + 1, V] that last r, p's row where no child was tried). The walk ends at one node, so
    one uniform serves every row: drawn after the rule's, it is the one the walk's own `sample(r)` would draw.
    p: [g + 1, V], q: [g, V], draft: [g], children: children_of(parents, b) [g + 1, b]. Costs b residuals of
    g + 1 rows: a handful of elementwise passes over the vocabulary."""
    g = draft.shape[0]
    q_pad, d_pad = F.pad(q, (0, 0, 0, 1)), F.pad(draft, (0, 1))  # row g: no node
    tried, r = p.new_zeros(g + 1), p  # r [g + 1, V], row n + 1: node n's before its next child's try
    for j in range(children.shape[1]):
        kid = children[:, j]  # [g + 1]: each node's j-th child (g: none)
        q_kid, d_kid = q_pad[kid], d_pad[kid, None]
        tried = tried.scatter(0, kid, acceptance_probability(r.gather(1, d_kid), q_kid.gather(1, d_kid))[:, 0])
        r = torch.where((kid < g)[:, None], residual_distribution(r, q_kid), r)
    return tried[:g], sample(r, generator, one_uniform=True), r


def acceptance_probability(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """min(1, p(d) / q(d)), elementwise: the chance a token d drawn from q is kept."""
    return (p / q.clamp_min(1e-30)).clamp_max(1.0)
