"""The acceptance rule as three small pieces behind one interface, chosen once per run.

A rule judges one row's drafts in two steps around the round's one read from the device: `reads` names
the values it needs on the host (core/reads.py), `judge` walks the drafts with them and returns the
Verdict. The walk is sampling.py's: from the root, try a node's children in order, keep a child with
probability min(1, r(d)/q(d)), on a rejection r = norm(max(0, r - q)), end with a correction from the last
r or a bonus from p.

- GreedyRule: p and q one-hot; a child is kept exactly when it is the target's argmax. Reads ids only.
- SampledRule: the walk on the host, asking the device for a later child's ratio and the last draw
  (on a CPU a read is a load, so computing only what the walk reaches is cheapest).
- AheadRule: the walk's ratios and its last draw made for every node on the device before the read
  (walk_ends), so on a GPU the walk waits for nothing more. The same numbers and draws as SampledRule.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .reads import Reads, fetch
from .sampling import (
    SamplingParams,
    Verdict,
    acceptance_probability,
    chain_parents,
    children_of,
    residual_distribution,
    sample,
    walk_ends,
)


@dataclass
class Drafts:
    """One row's round as the rule sees it."""

    p: torch.Tensor  # [g + 1, V] the target's distribution after the last kept token (row 0) and after each node
    q: torch.Tensor  # [g, V] what each node was drawn from
    tokens: torch.Tensor  # [g] the drafted ids
    generator: torch.Generator | None  # the row's own: seeded runs repeat
    best: torch.Tensor | None = None  # [g + 1] each p row's argmax, where the caller has it (greedy)
    parents: torch.Tensor | None = None  # [g] each node's parent on the device (-1: the root), for AheadRule
    branch: int = 1  # the most children a node has

    @property
    def gamma(self) -> int:
        return self.tokens.shape[0]


def _walk(parents: list[int], kept: Callable[[int], bool]) -> tuple[list[int], list[int], int]:
    """From the root, try each node's children in order and move to the first `kept`; (path, rejected in the
    order tried, the node the walk ended at: -1 the root). Parents come before children."""
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(node)
    path, rejected, node = [], [], -1
    while True:
        for child in children.get(node, []):
            if kept(child):
                break
            rejected.append(child)
        else:  # every child rejected, or none
            return path, rejected, node
        path.append(child)
        node = child


class GreedyRule:
    """Keep a draft while it is the target's argmax; the last token is the argmax where the walk ends."""

    needs_shapes = False  # Drafts.parents: only AheadRule reads the tree's shape on the device

    def ends(self, reads: Reads) -> torch.Tensor | None:
        """[g + 1] on the device: the token the round adds if the walk ends at each node, where the rule knows it
        before the read (None: it is drawn at the walk's end)."""
        return reads.tensor("best")

    def reads(self, d: Drafts) -> Reads:
        return Reads().add("tokens", d.tokens).add("best", d.p.argmax(-1) if d.best is None else d.best)

    def judge(self, d: Drafts, reads: Reads, parents: list[int]) -> Verdict:
        tokens, best = [int(t) for t in reads["tokens"]], [int(t) for t in reads["best"]]
        accept = [1.0 if tokens[i] == best[parent + 1] else 0.0 for i, parent in enumerate(parents)]
        path, rejected, end = _walk(parents, lambda c: accept[c] == 1.0)
        return Verdict(path, best[end + 1], accept, [None] * len(tokens), rejected, None, tokens)


class SampledRule:
    """The sampled walk on the host. Reads every draft's ratio at every p row [g + 1, g] (its parent's row is
    picked here, so no index list goes to the device), one uniform per node [g] and the ids [g]; a later
    child's ratio against a residual, and the last draw, are asked for when the walk gets there."""

    needs_shapes = False

    def ends(self, reads: Reads) -> torch.Tensor | None:
        return None

    def reads(self, d: Drafts) -> Reads:
        ratios = acceptance_probability(d.p[:, d.tokens], d.q.gather(1, d.tokens[:, None]).T)  # [g + 1, g]
        u = torch.rand(d.gamma, generator=d.generator, device=d.tokens.device)
        return Reads().add("ratios", ratios).add("u", u).add("tokens", d.tokens)

    def _start(self, reads: Reads, parents: list[int]) -> tuple[list[int], list[float], list[float]]:
        """(ids, each node's ratio against its parent's p row as if tried first, its uniform)."""
        tokens, ratios = [int(t) for t in reads["tokens"]], reads["ratios"]
        return tokens, [ratios[parent + 1][i] for i, parent in enumerate(parents)], reads["u"]

    def judge(self, d: Drafts, reads: Reads, parents: list[int]) -> Verdict:
        tokens, accept, u = self._start(reads, parents)
        state = {"parent": None, "r": None}  # the r the next child of `parent` is tried against (None: its p row)

        def kept(child: int) -> bool:
            if state["parent"] != parents[child]:
                state.update(parent=parents[child], r=None)
            r = state["r"]
            if r is not None:
                accept[child] = float(acceptance_probability(r[tokens[child]], d.q[child, tokens[child]]))
            if u[child] < accept[child]:
                return True
            state["r"] = residual_distribution(d.p[parents[child] + 1] if r is None else r, d.q[child])
            return False

        path, rejected, end = _walk(parents, kept)
        residual = state["r"] if rejected and parents[rejected[-1]] == end else None  # a correction's r
        r = d.p[end + 1] if residual is None else residual
        return Verdict(path, int(sample(r, d.generator)), accept, _tried(u, path, rejected), rejected, residual,
                       tokens)


class AheadRule(SampledRule):
    """SampledRule's reads plus, for every node, its ratio against the r it is tried with [g] and the token the
    round adds if the walk ends there [g + 1] (walk_ends: drawn after the rule's uniforms, as the walk's own
    draw would be); each node's last r [g + 1, V] stays on the device for the correction's residual."""

    needs_shapes = True

    def ends(self, reads: Reads) -> torch.Tensor | None:
        return reads.tensor("ends")

    def reads(self, d: Drafts) -> Reads:
        reads = super().reads(d)
        tried, ends, last_r = walk_ends(d.p, d.q, d.tokens, children_of(d.parents, d.branch), d.generator)
        return reads.add("tried", tried).add("ends", ends).keep("last_r", last_r)

    def judge(self, d: Drafts, reads: Reads, parents: list[int]) -> Verdict:
        tokens, accept, u = self._start(reads, parents)
        tried = reads["tried"]

        def kept(child: int) -> bool:
            accept[child] = tried[child]
            return u[child] < accept[child]

        path, rejected, end = _walk(parents, kept)
        residual = reads.tensor("last_r")[end + 1] if rejected and parents[rejected[-1]] == end else None
        return Verdict(path, int(reads["ends"][end + 1]), accept, _tried(u, path, rejected), rejected, residual,
                       tokens)


def _tried(u: list[float], path: list[int], rejected: list[int]) -> list[float | None]:
    """Each node's uniform where it was tried, else None."""
    tested = {*path, *rejected}
    return [x if i in tested else None for i, x in enumerate(u)]


GREEDY, SAMPLED, AHEAD = GreedyRule(), SampledRule(), AheadRule()


def rule_for(params: SamplingParams, ahead: bool) -> GreedyRule | SampledRule:
    """The run's rule: greedy; else sampled, drawn ahead where a read makes the host wait (kvcache.reads_wait)."""
    return GREEDY if params.greedy else AHEAD if ahead else SAMPLED


def accept_or_resample(p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor, generator: torch.Generator | None,
                       greedy: bool = False, parents: list[int] | None = None) -> Verdict:
    """One round of the rule over g drafted nodes, read and judged at once. p: target [g + 1, V] (row 0 after
    the last kept token, row 1 + i after node i), q: [g, V] (row i: what node i was drawn from), draft: ids [g],
    parents: [g] (-1: the root; None: a chain). Greedy: p and q one-hot, no draws."""
    rule, d = GREEDY if greedy else SAMPLED, Drafts(p, q, draft, generator)
    reads = rule.reads(d)
    fetch([reads])
    return rule.judge(d, reads, chain_parents(d.gamma) if parents is None else parents)
