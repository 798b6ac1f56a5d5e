"""What the viewer sees of a round, recorded as its events' tokens.

The decoder hands the recorder each row's proposal, p, and the token the round adds wherever the walk can
end if the rule knows it before the read; the recorder names what it wants read with the rule's values
(`look`: one fetch for the round) and, once the rule has judged, makes the round's DraftedToken and
ExtraToken records (`tokens`), with the likeliest candidates at each place for the inspector (`record_top`
of them; 0: none, and no reads for them).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..models import native
from .drafters import Columns, Proposal
from .events import (
    ACCEPTED,
    BONUS,
    CORRECTION,
    REJECTED,
    TARGET,
    UNVERIFIED,
    DraftedToken,
    ExtraToken,
    TopToken,
)
from .kvcache import on_device
from .reads import Reads, fetch
from .sampling import SamplingParams, Verdict


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
        """(ids [R, k'], their probabilities [R, k']): each row's k likeliest ids (k' = min(k, N))."""
        probs = self.probs if self.columns is None else self.probs[:, :-1]
        values, cols = native.topk(probs, min(k, probs.shape[-1]))
        return (cols if self.columns is None else self.columns.ids[cols]), values


@dataclass
class View:
    """One row's round as the viewer sees it: p [g + 1 rows] and q [g rows], and what is read of them."""

    p: Shown
    q: Shown
    reads: Reads


class Recorder:
    """Records each round's tokens with the p and q the page shows: the rule's, or where greedy the plain
    softmax (over the drafter's own vocabulary where it has one: the same numbers, a fraction of the width)."""

    def __init__(self, params: SamplingParams, record_top: int, text: TokenTexts):
        self.params, self.record_top, self.text = params, record_top, text

    def look(self, proposal: Proposal, p_logits: torch.Tensor, p: torch.Tensor, ends: torch.Tensor | None) -> View:
        """What to show of one row: p of each drafted token at every row ("p_drafts" [g + 1, g]: its parent's row
        is picked on the host, so no index list goes to the device) and q of each ("q_drafts" [g]). ends [g + 1]:
        the token added where the walk ends at each node, if known before the read (the rule's `ends`); then also
        its p at every row ("p_ends" [g + 1]) and q at every node ("q_ends" [g, g + 1])."""
        greedy = self.params.greedy
        q = proposal.logits.softmax(-1) if greedy and proposal.logits is not None else proposal.q
        p_show, q_show = Shown(p_logits.softmax(-1) if greedy else p), Shown.of(q, proposal.columns)
        drafts = proposal.tokens
        reads = Reads().add("p_drafts", p_show.every(drafts)).add("q_drafts", q_show.own(drafts))
        if ends is not None:
            reads.add("p_ends", p_show.own(ends))
            if drafts.numel():
                reads.add("q_ends", q_show.every(ends))
        if self.record_top:
            _candidates(reads, p_show, q_show, self.record_top)
        return View(p_show, q_show, reads)

    def tokens(self, view: View, proposal: Proposal, verdict: Verdict, path: list[int],
               stop_at: int | None) -> tuple[list[DraftedToken], ExtraToken | None]:
        """The round's drafted nodes and its correction or bonus token, as events; path: the kept nodes,
        stop_at: an accepted EOS's node (the text ends there)."""
        tokens, parents, shown, text = verdict.tokens, proposal.tree, view.reads, self.text
        gamma = len(tokens)
        end = path[-1] if path else -1  # the node the walk ended at (-1: the root)
        # a rejection shows where it was tested below the kept path; under an accepted EOS the text has ended
        tested = {-1, *path} - ({end} if stop_at is not None else set())
        corrected = verdict.rejected[-1] if verdict.rejected and parents[verdict.rejected[-1]] == end else None
        extra_id = verdict.next_token if stop_at is None else None
        children = [i for i, parent in enumerate(parents) if parent == end]
        p_d = [shown["p_drafts"][parent + 1][i] for i, parent in enumerate(parents)]
        q_d = shown["q_drafts"]
        if extra_id is not None and "p_ends" in shown:  # known before the walk ended: read
            p_extra = shown["p_ends"][end + 1]
            q_extra = shown["q_ends"][children[0]][end + 1] if children else None
        elif extra_id is not None:  # a sampled walk's, drawn at its end (a CPU): one more read
            at = on_device([end + 1, children[0] if children else 0, extra_id], proposal.tokens.device)
            extra = Reads().add("p", view.p.at(at[:1], at[2:])[0])
            if children:
                extra.add("q", view.q.at(at[1:2], at[2:])[0])
            fetch([extra])
            p_extra, q_extra = extra["p"], extra["q"] if children else None
        tops = [[] for _ in range(gamma + 1)]
        if self.record_top:  # the extra's candidates too: where two runs part, the size of the tie
            residual = verdict.residual if corrected is not None and not self.params.greedy else None
            asks = [Ask(parents[i] + 1, i, tok, p_d[i], q_d[i], i == corrected and residual is not None)
                    for i, tok in enumerate(tokens)]
            if extra_id is not None:
                asks.append(Ask(end + 1, children[0] if children else None, extra_id, p_extra, q_extra or 0.0))
            tops = _top_tokens(view, asks, text, residual)
        drafted, rejected = [], set(verdict.rejected)
        for i, tok in enumerate(tokens):
            status = ACCEPTED if i in path else REJECTED if i in rejected and parents[i] in tested else UNVERIFIED
            u = verdict.u[i] if status != UNVERIFIED else None
            score = proposal.scores[i] if proposal.scores is not None else None
            drafted.append(DraftedToken(tok, text(tok), q_d[i], p_d[i], verdict.accept_probs[i], u, status, tops[i],
                                        score))
        extra = None
        if extra_id is not None:
            kind = CORRECTION if children else BONUS if gamma else TARGET  # nothing drafted: a plain step
            extra = ExtraToken(extra_id, text(extra_id), kind, p_extra, q_extra, tops[gamma])
        return drafted, extra


def _candidates(reads: Reads, p: Shown, q: Shown, k: int) -> None:
    """What the inspector's candidates need, added to the round's one read: the k likeliest ids of each row of p
    ("top_p_ids" [g + 1, k]) and of q ("top_q_ids" [g, k'], k' = min(k, N)) with their probabilities, each row's
    p at every row's q candidates ("p_at_q" [g + 1, g·k']) and q at p's ("q_at_p" [g, (g + 1)·k]): which row of p
    a node is judged at is known after the read (a tree's parents), so every pair is read (a few hundred values)."""
    p_ids, p_top = p.top(k)
    reads.add("top_p_ids", p_ids).add("top_p", p_top)
    if q.probs.shape[0]:
        q_ids, q_top = q.top(k)
        reads.add("top_q_ids", q_ids).add("top_q", q_top)
        reads.add("p_at_q", p.every(q_ids.flatten())).add("q_at_p", q.every(p_ids.flatten()))


class Ask(NamedTuple):
    """A place whose candidates the inspector shows: its row of p, its row of q (None: nothing was drafted there,
    a bonus or a baseline step), the token chosen there with its p and q, and whether a rejection's residual is
    shown there too."""

    p_row: int
    q_row: int | None
    chosen: int
    p: float
    q: float
    with_residual: bool = False


def _top_tokens(view: View, asks: list[Ask], text, residual=None) -> list[list[TopToken]]:
    """Candidates at each asked place, for the inspector: the union of the k most likely tokens under p and
    under q (where q has mass: a one-hot q has one), and the chosen one, each with its p and q, all from the
    round's one read (`_candidates`); the residual's values at them (a sampled rejection's) in one more."""
    shown = view.reads
    p_ids, p_top = shown["top_p_ids"], shown["top_p"]
    g = view.q.probs.shape[0]
    q_ids, q_top = (shown["top_q_ids"], shown["top_q"]) if g else ([], [])
    p_at_q, q_at_p = (shown["p_at_q"], shown["q_at_p"]) if g else ([], [])
    k, kq = len(p_ids[0]), len(q_ids[0]) if g else 0
    places = []
    for ask in asks:
        p_of = {int(i): v for i, v in zip(p_ids[ask.p_row], p_top[ask.p_row], strict=True)}
        q_of = {}
        if ask.q_row is not None:
            row = range(ask.q_row * kq, (ask.q_row + 1) * kq)
            for i, v, at in zip(q_ids[ask.q_row], q_top[ask.q_row], row, strict=True):
                if v > 0:  # a candidate of q's where it has mass
                    q_of[int(i)] = v
                    p_of.setdefault(int(i), p_at_q[ask.p_row][at])
            for j, i in enumerate(p_ids[ask.p_row]):
                q_of.setdefault(int(i), q_at_p[ask.q_row][ask.p_row * k + j])
        p_of.setdefault(ask.chosen, ask.p)
        q_of.setdefault(ask.chosen, ask.q)
        places.append((ask, sorted(p_of), p_of, q_of))
    res = {}
    if residual is not None and any(ask.with_residual for ask in asks):
        ids = [i for ask, row, *_ in places if ask.with_residual for i in row]
        fetch([values := Reads().add("residual", residual[on_device(ids, residual.device)])])
        res = dict(zip(ids, values["residual"], strict=True))
    out = []
    for ask, row, p_of, q_of in places:
        rows = [(i, p_of[i], q_of[i] if ask.q_row is not None else 0.0, res[i] if ask.with_residual else None)
                for i in row]
        rows.sort(key=lambda r: -(r[1] + r[2]))
        out.append([TopToken(i, text(i), pi, qi, ri) for i, pi, qi, ri in rows])
    return out
