"""Drafting strategies: a small interface with two verbs, propose and verified.

Like transformers' `CandidateGenerator`: a drafter proposes γ tokens with the distribution q each
was drawn from, and is then told how many the target kept, so it can roll its state back.
The generator never looks inside a drafter, so other drafters plug in: a draft model, a head on
the target's own hidden states (EAGLE), n-gram lookup in the text itself (no model at all), lookup
where the text repeats and another drafter elsewhere, or none (the baseline). A drafter may propose
fewer than γ tokens, even none. Drafters work on B rows at once; a single prompt is a batch of one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Protocol

import torch
from transformers import PreTrainedModel

from ..models import native
from ..models.eagle import EagleHead, HeadCache
from .kvcache import KVState, left_padded, on_device
from .reads import Reads, fetch
from .sampling import (
    SamplingParams,
    at_least_float32,
    chain_parents,
    draw_children,
    logits_to_probs,
    sample,
)


@dataclass(frozen=True, eq=False)
class Columns:
    """A drafter's own vocabulary, part of the target's: ids [N], the target id of each column, and
    of [V], the column of each target id (N where it has none: one past the last). Its q and logits rows
    are N wide, not V."""

    ids: torch.Tensor
    of: torch.Tensor

    @staticmethod
    def of_ids(ids: torch.Tensor, vocab_size: int) -> Columns:
        of = torch.full((vocab_size,), ids.shape[0], dtype=torch.long, device=ids.device)
        of[ids] = torch.arange(ids.shape[0], device=ids.device)
        return Columns(ids, of)


@dataclass(frozen=True)
class PendingTree:
    """A tree's shape still on the device, read with the round's values (`Proposal.settled`): a drafter
    that ranks its nodes there never waits for the device to learn which it kept."""

    parents: torch.Tensor  # [γ] long: each node's parent (-1: the last kept token)
    scores: torch.Tensor  # [γ] float: the draft's probability of the path to each node
    branch: int  # no node has more children


@dataclass
class Proposal:
    tokens: torch.Tensor  # [γ] drafted ids (γ may be less than asked for, even 0)
    q: torch.Tensor  # [γ, N] the distribution each token was drawn from (one-hot when greedy), over `columns`
    logits: torch.Tensor | None = None  # [γ, N] raw draft logits, if the drafter has a model
    source: str = ""  # which part of a combined drafter proposed (e.g. "lookup"); "" for a single one
    parents: list[int] | None = None  # [γ] a tree: each node's parent (-1: the last kept token); None: a chain
    scores: list[float] | None = None  # [γ] a tree's nodes: the draft's probability of the path to each
    columns: Columns | None = None  # q's and logits' columns, a drafter's own vocabulary; None: all V, N = V
    pending: PendingTree | None = None  # a tree whose parents and scores are still on the device

    @property
    def is_tree(self) -> bool:
        return self.parents is not None or self.pending is not None

    @property
    def tree(self) -> list[int]:
        """Each node's parent, a chain's too (a pending tree: settle it first)."""
        if self.pending is not None:
            raise RuntimeError("a pending tree's parents are on the device: Proposal.settled() reads them")
        return chain_parents(self.tokens.shape[0]) if self.parents is None else self.parents

    def tree_reads(self) -> Reads:
        """What `settled` reads of a pending tree: its parents [γ] and scores [γ]."""
        return Reads().add("parents", self.pending.parents).add("scores", self.pending.scores)

    def settled(self, reads: Reads | None = None) -> Proposal:
        """The proposal with its tree's parents and scores on the host; reads: tree_reads(), fetched by the
        caller with others (else read here: one wait)."""
        if self.pending is None:
            return self
        if reads is None:
            fetch([reads := self.tree_reads()])
        return replace(self, parents=[int(v) for v in reads["parents"]], scores=reads["scores"], pending=None)

    def parents_on_device(self) -> tuple[torch.Tensor, int]:
        """([γ] each node's parent, -1 the root, on the device; the most children a node has), sent from
        the host without a wait, or made there (a chain's, a pending tree's)."""
        gamma, device = self.tokens.shape[0], self.tokens.device
        if self.pending is not None:
            return self.pending.parents, self.pending.branch if gamma else 0
        if self.parents is None:
            return torch.arange(-1, gamma - 1, device=device), min(gamma, 1)
        return on_device(self.parents, device, torch.long), max(self.parents.count(n) for n in range(-1, gamma))

    def widened(self) -> Proposal:
        """The same proposal with q and logits over the whole vocabulary, [γ, V] (0 and -inf outside the
        drafter's own): what the rule reads when it samples (a greedy round reads neither)."""
        if self.columns is None:
            return self
        rows, (ids, of) = self.tokens.shape[0], (self.columns.ids, self.columns.of)
        q = self.q.new_zeros(rows, of.shape[0]).index_copy_(1, ids, self.q)
        logits = None if self.logits is None else \
            self.logits.new_full((rows, of.shape[0]), -math.inf).index_copy_(1, ids, self.logits)
        return replace(self, q=q, logits=logits, columns=None)


class Drafter(Protocol):
    """Drafts for B rows at once (a single prompt is a batch of one).

    requires_hidden: the drafter reads the target's last hidden states (after its final norm):
    `start` gets the prefill's and `verified` each verify pass's. A drafter that does not ask
    makes the target compute nothing extra.
    """

    name: str
    requires_hidden: bool

    def start(self, prompts: list[list[int]], hidden: torch.Tensor | None) -> None:
        """Begin B sequences. hidden: [B, w, H] for the prefill (right-aligned), if asked for."""

    def propose(self, seqs: list[list[int]], gammas: list[int], params: SamplingParams,
                generators: list[torch.Generator]) -> list[Proposal]:
        """Draft up to γ_i tokens after each row's sequence seqs[i] (L_i ids, on the host: the decoder
        knows every token it added there, so reading them never makes the host wait for the device)."""

    def verified(self, n_accepted: list[int], hidden: torch.Tensor | None) -> None:
        """Row i kept its first n_accepted[i] drafts (then the target added one token).

        hidden: [B, n_max + 1, H], the verify pass's rows over [x_last, the kept drafts] (a tree's kept
        path, root to leaf), if asked for."""

    def select(self, rows: list[int]) -> None:
        """Keep only these rows (finished rows leave the batch)."""

    def cache_lens(self) -> list[int]:
        """Tokens each row holds state for (empty if the drafter keeps none)."""


class StatelessDrafter:
    """What a drafter that keeps nothing between rounds does with the other verbs: nothing."""

    requires_hidden = False

    def start(self, prompts: list[list[int]], hidden: torch.Tensor | None = None) -> None:
        pass

    def verified(self, n_accepted: list[int], hidden: torch.Tensor | None = None) -> None:
        pass

    def select(self, rows: list[int]) -> None:
        pass

    def cache_lens(self) -> list[int]:
        return []


class NoDrafter(StatelessDrafter):
    """Drafts nothing: every round is one plain target step. This is the baseline."""

    name = "none (the target alone)"

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = device

    def propose(self, seqs, gammas, params, generators) -> list[Proposal]:
        empty = torch.zeros(0, dtype=torch.long, device=self.device)
        return [Proposal(empty, torch.zeros(0, 0, device=self.device)) for _ in seqs]


class DraftModelDrafter:
    """A small causal LM drafts for all rows at once, one token per row and step.

    Its KV state holds a real prefix of each row's sequence. A round feeds each row's uncached
    tail (one or two tokens; a shorter tail is padded with a hole), then γ_max - 1 drafted
    tokens, where a row that asked for fewer gets holes. d_γ is never fed. `verified` turns the
    slots of rejected drafts into holes and trims, so each row's real prefix is again a prefix of
    its sequence and nothing kept is ever recomputed.
    """

    name = "draft model"
    requires_hidden = False

    def __init__(self, model: PreTrainedModel, vocab_size: int, pad_id: int, cache: str, capacity: int,
                 compile: bool = False):
        self.model, self.vocab_size, self.pad_id = model, vocab_size, pad_id
        self.cache_kind, self.capacity, self.compile = cache, capacity, compile
        self.state: KVState | None = None
        self.lengths: list[int] = []  # per row: real tokens in the state (as trim last read them)
        self._draft_slots: list[list[int]] = []  # per row: the slots of d_1..d_{γ-1} this round

    def start(self, prompts: list[list[int]], hidden=None) -> None:
        self.state = KVState(self.model, len(prompts), self.cache_kind, self.vocab_size, self.capacity, self.compile)
        self.state.prefill(prompts, self.pad_id)
        self.lengths = [len(p) - 1 for p in prompts]

    def propose(self, seqs: list[list[int]], gammas: list[int], params: SamplingParams,
                generators: list[torch.Generator]) -> list[Proposal]:
        state, device = self.state, self.model.device
        self._draft_slots = [[] for _ in seqs]
        steps = max(gammas)
        if steps == 0:  # every row is at its budget's last token
            empty = torch.zeros(0, dtype=torch.long, device=device)
            return [Proposal(empty, torch.zeros(0, self.vocab_size, device=device)) for _ in seqs]
        # each row's uncached tail (1 or 2 tokens), right-aligned; a row not drafting: holes
        ids, real = left_padded([seq[n:] for seq, n in zip(seqs, self.lengths, strict=True)], self.pad_id, device)
        real = [r if g else [False] * len(r) for r, g in zip(real, gammas, strict=True)]
        tokens = torch.zeros(len(seqs), steps, dtype=torch.long, device=device)  # [B, γ_max]
        qs, logit_rows = [], []
        for step in range(steps):
            logits = state.forward(ids, real, last_only=True).logits[:, -1]  # [B, V]
            best = native.argmax(logits) if params.greedy else None  # [B]
            q = logits_to_probs(logits, params, best)  # [B, V]
            if params.greedy:
                tokens[:, step] = best
            else:
                for row, gamma in enumerate(gammas):
                    if step < gamma:
                        tokens[row, step] = sample(q[row], generators[row])
            qs.append(q)
            logit_rows.append(logits)
            if step + 1 < steps:  # d_γ is never fed
                for row in range(len(seqs)):
                    self._draft_slots[row].append(state.width)
                ids = tokens[:, step : step + 1]
                real = [[step + 1 < g] for g in gammas]
        q_all, logits_all = torch.stack(qs, 1), torch.stack(logit_rows, 1)  # [B, γ_max, V]
        return [Proposal(tokens[row, :g], q_all[row, :g], logits_all[row, :g]) for row, g in enumerate(gammas)]

    def verified(self, n_accepted: list[int], hidden=None) -> None:
        for row, n in enumerate(n_accepted):
            slots = self._draft_slots[row][n:]  # d_{n+1}.. were rejected or never tested
            if slots:
                self.state.make_holes(row, slots[0], slots[-1] + 1)
        self.lengths = self.state.trim()

    def select(self, rows: list[int]) -> None:
        self.state.select(rows)
        self.lengths = [self.lengths[r] for r in rows]

    def cache_lens(self) -> list[int]:
        return list(self.lengths)


class EagleDrafter:
    """Drafts with a feature-level head (eagle.py) that reads the target's own hidden states.

    The head holds one entry per position 0..L-2 of each row, (f_i, x_{i+1}), and the target's
    features f arrive with the prefill and each verify pass. `start` writes the prompt's entries (the head's
    own prefill, timed with the target's); `verified` keeps the kept positions' features as pending, and the
    next `propose` writes their entries in one head forward (rows right-aligned, short rows padded into a
    scratch slot), whose last output gives q for d_1; each further
    step feeds the head its own output with the drafted token. Drafted entries sit after the real
    ones and are forgotten by not moving the length. q lives on the head's reduced vocabulary and
    is 0 elsewhere: the acceptance rule stays exact (a token q cannot draft comes from the
    residual). A row with no entry yet (a one-token prompt) drafts nothing in its first round.
    """

    requires_hidden = True

    def __init__(self, head: EagleHead, vocab_size: int, pad_id: int, capacity: int, name: str = "EAGLE head",
                 branch: int = 1, nodes: int = 0, compile: bool = False):
        self.head, self.vocab_size, self.pad_id, self.capacity, self.name = head, vocab_size, pad_id, capacity, name
        self.compile = compile  # the head's steps compiled where no C call runs its layer (EagleHead.step)
        self.columns = Columns.of_ids(head.draft_ids, vocab_size)  # q and logits stay on the head's vocabulary
        self.branch, self.nodes = branch, nodes  # children per node (1: a chain); nodes kept (0: all drafted)
        self.cache: HeadCache | None = None
        self.pending: list[torch.Tensor] = []  # per row: [n, F] features whose entries are not written yet
        self.root: tuple[torch.Tensor, torch.Tensor] | None = None  # (h, logits) of start's entries, for round 1

    def start(self, prompts: list[list[int]], hidden: torch.Tensor | None) -> None:
        self.cache = HeadCache(self.head, len(prompts), self.capacity, like=hidden, compile=self.compile)
        self.device = hidden.device
        width = hidden.shape[1]
        self.pending = [hidden[row, width - (len(p) - 1) :] for row, p in enumerate(prompts)]  # f_0..f_{P-2}
        self.root = self._catch_up(prompts, 0)  # the prompt's entries now: a long prompt's cost is prefill's

    def _catch_up(self, seqs: list[list[int]], reserve: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Write the pending entries, with room for `reserve` drafted ones after them; (h [B, 1, D], logits
        [B, N]) of each row's last entry: the new one's, or where none was pending the one `start` wrote (None
        where no row has an entry)."""
        cache, widths = self.cache, [len(f) for f in self.pending]
        width = max(widths)
        if width == 0:
            cache.reserve(max(cache.lengths) + reserve)
            root, self.root = self.root, None
            return root
        cache.reserve(max(n + length for n, length in zip(widths, cache.lengths, strict=True)) + reserve)
        feats = self.pending[0].new_zeros(len(seqs), width, self.pending[0].shape[-1])  # [B, w, F]
        host = []  # per row, right-aligned: [token ids, positions, slots]; a hole: pad at position 0, the scratch
        for row, (seq, n) in enumerate(zip(seqs, widths, strict=True)):
            start, holes = cache.lengths[row], width - n  # entry i = (f_i, x_{i+1}) at position i
            if n:
                feats[row, holes:] = self.pending[row]
            places = list(range(start, start + n))
            host.append([[self.pad_id] * holes + seq[start + 1 : start + 1 + n], [0] * holes + places,
                         [cache.scratch] * holes + places])
            cache.lengths[row] += n
        tokens, positions, slots = on_device(host, self.device).unbind(1)  # [B, w] each
        h, logits = self.head.step(cache, tokens, self.head.features_in(feats, lean=True), slots, positions,
                                   last_only=True)
        self.pending = [f[:0] for f in self.pending]
        return h[:, -1:], logits[:, -1]

    def propose(self, seqs: list[list[int]], gammas: list[int], params: SamplingParams,
                generators: list[torch.Generator]) -> list[Proposal]:
        """Expand each row's tree level by level (EAGLE-2): feed the head the `branch` most likely nodes
        of the last level (by cumulative draft probability), give each its `branch` likeliest children,
        and after γ levels keep the `nodes` likeliest of all. A sampled run drafts `branch` chains instead:
        the root's children drawn from q without replacement (`draw_children`; each keeps the q it was
        drawn from, so sampling.py's rule stays exact), then one child drawn below each node, and keeps its
        first `nodes` in level order (never by value: see graft); a chain (branch 1) is one of them."""
        cache, device, k = self.cache, self.device, self.branch
        caught_up = self._catch_up(seqs, max(gammas) * k)
        gammas = [g if cache.lengths[row] else 0 for row, g in enumerate(gammas)]  # no entry yet: no draft
        depth = max(gammas)
        if not depth:
            empty = torch.zeros(0, dtype=torch.long, device=device)
            return [Proposal(empty, torch.zeros(0, self.vocab_size, device=device), parents=[]) for _ in seqs]
        sampled = not params.greedy  # children drawn from q; else the top k, chosen (q one-hot)
        if sampled and self.nodes:  # k nodes a level, the first `nodes` kept: no level past them
            depth = min(depth, -(-self.nodes // k))
        h, logits = caught_up  # h [B, 1, D]: the root's output, fed back with each child; logits [B, N]
        rows, (lengths, drafting) = len(seqs), on_device([cache.lengths, gammas], device)  # [B] each: entries, γ
        # a chain feeds its one node a level, unranked, and its entries follow the real ones: the head's causal mask
        chain = k == 1
        # the real entries each fed node sees, [B, 1, C + 1]; a row past its γ sees slot 0 and writes the scratch
        seen = None if chain else (cache.slot_index < lengths[:, None])[:, None]
        # per level: [B, n] ids (on the head's vocabulary), parents, log scores, [B, n, N] q; [B, f, N] logits of
        # the fed nodes, and each node's fed node (its parent) among all levels' (a node's logits are its parent's)
        tokens, parents, scores, node_q, fed_logits, fed_of = [], [], [], [], [], []
        fed_score = torch.zeros(rows, 1, device=device)
        beam_ids = torch.full((rows, 1), -1, dtype=torch.long, device=device)  # node index of each fed node
        logits = at_least_float32(logits)[:, None]  # [B, f, N]: the fed nodes' (first, the root's)
        for level in range(1, depth + 1):
            # children per fed node: k, or when sampling one below the first level (there a drawn sibling keeps
            # fewer tokens than a drawn child one level deeper)
            kk = 1 if sampled and level > 1 else k
            if sampled:  # per row still drafting, in row order (seeded runs repeat), kk draws per fed node
                q = logits_to_probs(logits, params)  # [B, f, N] on the reduced vocabulary
                picks = torch.zeros(q.shape[:2] + (kk,), dtype=torch.long, device=device)
                child_q = q[:, :, None].repeat(1, 1, kk, 1)  # [B, f, kk, N]: what each child was drawn from
                for row, gm in enumerate(gammas):
                    if level <= gm:
                        picks[row], child_q[row] = draw_children(q[row], kk, generators[row])
            else:
                picks = native.topk(logits.reshape(-1, logits.shape[-1]), k)[1].view(*logits.shape[:2], k)  # [B, f, k]
            tokens.append(picks.flatten(1))
            if not chain:  # ranked by the head's own (unwarped) probability
                logp = logits.log_softmax(-1).gather(-1, picks)
                parents.append(beam_ids[:, :, None].expand(-1, -1, kk).flatten(1))
                scores.append((fed_score[:, :, None] + logp).flatten(1))
            fed = sum(x.shape[1] for x in fed_logits)  # fed nodes of the levels above
            fed_of += [fed + j // kk for j in range(logits.shape[1] * kk)]
            fed_logits.append(logits)
            if sampled:  # chosen nodes get one-hot rows in _proposals: no [B, f·k, N] copy per level
                node_q.append(child_q.flatten(1, 2))
            if level == depth:
                break
            if chain:  # the node fed at the slot after the last, where the row drafts a level below it
                slots = torch.where(level < drafting, lengths + level - 1, cache.scratch)[:, None]  # [B, 1]
                h, logits = self.head.step(cache, self.head.draft_ids[tokens[-1]], h, slots,
                                           torch.where(slots == cache.scratch, 0, slots))
                logits = at_least_float32(logits)
                continue
            # the next beam: the k likeliest nodes of this level, fed as entries (h of their parent, token)
            first = sum(t.shape[1] for t in tokens[:-1])  # node index of this level's first node
            beam = torch.topk(scores[-1], min(k, scores[-1].shape[1]), dim=-1).indices  # [B, f']
            beam_ids, fed_score = beam + first, scores[-1].gather(1, beam)
            parent_pos = beam // picks.shape[-1]  # which fed node each beam node hangs from, [B, f']
            g = h.gather(1, parent_pos[:, :, None].expand(-1, -1, h.shape[-1]))
            slots = lengths[:, None] + (level - 1) * k + torch.arange(beam.shape[1], device=device)  # [B, f']
            # a node is fed only where the row drafts a level below it
            slots = torch.where((level < drafting)[:, None], slots, cache.scratch)
            positions = torch.where(slots == cache.scratch, 0, lengths[:, None] + level - 1)
            own = torch.zeros(rows, beam.shape[1], cache.scratch + 1, dtype=torch.bool, device=device)
            own.scatter_(2, slots[:, :, None], True)
            seen = seen.gather(1, parent_pos[:, :, None].expand(-1, -1, seen.shape[-1])) | own
            seen[:, :, 0] |= slots == cache.scratch  # a row done drafting: its query sees slot 0, never nothing
            h, logits = self.head.step(cache, self.head.draft_ids[tokens[-1].gather(1, beam)], g, slots,
                                       positions, visible=seen)
            logits = at_least_float32(logits)
        return self._proposals(gammas, tokens, parents, scores, torch.cat(fed_logits, 1), fed_of,
                               node_q if sampled else None)

    def _proposals(self, gammas, tokens, parents, scores, fed_logits, fed_of, node_q) -> list[Proposal]:
        """Per row: the `nodes` likeliest nodes no deeper than its γ, in level order (parents first),
        with q (what each node was drawn from; one-hot where node_q is None, the nodes chosen) and logits on
        the head's vocabulary (Proposal.columns): node j's are its fed node's, fed_logits[:, fed_of[j]]
        ([B, F, N], F fed nodes: each level's logits once, not once per child)."""
        draft_ids = self.head.draft_ids
        depth = [level + 1 for level, t in enumerate(tokens) for _ in range(t.shape[1])]  # [M]
        tokens = torch.cat(tokens, 1)  # [B, M]
        node_q = torch.cat(node_q, 1) if node_q is not None else None  # [B, M, N]
        tree = self.branch > 1  # a chain stays a chain (no parents): its verify is causal, its events a chain's
        if tree:  # [B, M] each: the nodes' parents (node indices, -1 the root) and log scores, left on the device
            parents, scores = torch.cat(parents, 1), torch.cat(scores, 1)
        device, out = tokens.device, []
        fed_of = on_device(fed_of, device, torch.long)  # [M]
        for row, gamma in enumerate(gammas):
            allowed = [j for j, d in enumerate(depth) if d <= gamma]
            budget = min(self.nodes or len(depth), len(allowed))
            if tree and node_q is None:  # chosen nodes: the likeliest, in level order (ancestors first: a child never
                # outscores its parent; a stable sort, so ties go in level order)
                candidates = on_device(allowed, device, torch.long)
                likeliest = scores[row, candidates].sort(descending=True, stable=True).indices[:budget]
                keep = candidates[likeliest.sort().values]
            else:  # a chain, or drawn nodes: the first in level and draw order (drawn: never kept for their value,
                keep = on_device(allowed[:budget], device, torch.long)  # see graft)
            pending = None
            if tree:  # each kept node's parent renumbered among the kept (a kept node's parent is kept)
                renumber = torch.full((len(depth),), -1, dtype=torch.long, device=device)
                renumber[keep] = torch.arange(budget, device=device)
                node_parents = parents[row, keep]
                pending = PendingTree(torch.where(node_parents >= 0, renumber[node_parents.clamp_min(0)], -1),
                                      scores[row, keep].exp(), self.branch)
            columns = tokens[row, keep]  # [budget] on the head's vocabulary
            logits = fed_logits[row, fed_of[keep]]  # [budget, N]
            if node_q is None:  # chosen: one-hot
                q = torch.zeros_like(logits).scatter_(1, columns[:, None], 1.0)
            else:  # drawn: the rule needs the q each was drawn from
                q = node_q[row, keep]
            out.append(Proposal(draft_ids[columns], q, logits, columns=self.columns, pending=pending))
        return out

    def verified(self, n_accepted: list[int], hidden: torch.Tensor | None) -> None:
        # hidden [B, n_max + 1, F] over [x_last, the kept drafts]: the kept positions' features
        self.pending = [hidden[row, : n + 1] for row, n in enumerate(n_accepted)]

    def select(self, rows: list[int]) -> None:
        self.cache.select(rows)
        self.pending = [self.pending[r] for r in rows]
        if self.root is not None:
            index = on_device(rows, self.device)
            self.root = self.root[0][index], self.root[1][index]

    def cache_lens(self) -> list[int]:
        return list(self.cache.lengths)


class PromptLookupDrafter(StatelessDrafter):
    """Drafts by copying: the continuation of the latest earlier match of the text's last n tokens.

    Prompt lookup decoding (Saxena 2023, HF `prompt_lookup_num_tokens`) with the longest-match-
    first n of adaptive n-gram decoding (Ou et al. 2024): try n = max_ngram down to min_ngram
    and take the first n that matches anywhere in the prompt or the text so far. The proposal
    is deterministic, so q is one-hot: the rule keeps d with probability p(d), and on a
    rejection samples from p with d removed, renormalised; exact, like the draft-model path.
    No match: an empty proposal, and the round is a plain target step. No state, no model; the
    search runs on the host's copy of the text, so it never waits for the device. A copy stops before
    any of `stop_ids`, the chat template's control tokens: the prompt's template puts them after text
    the answer often repeats, and the target does not write them mid-answer.
    """

    name = "prompt lookup"

    def __init__(self, vocab_size: int, max_ngram: int = 3, min_ngram: int = 1, device: torch.device | str = "cpu",
                 stop_ids: frozenset[int] = frozenset()):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.vocab_size, self.device, self.stop_ids = vocab_size, device, stop_ids
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def _copy(self, seq: list[int], gamma: int) -> list[int]:
        copied = lookup_continuation(seq, gamma, self.max_ngram, self.min_ngram) if gamma else []
        stop = next((i for i, token in enumerate(copied) if token in self.stop_ids), len(copied))
        return copied[:stop]

    def propose(self, seqs: list[list[int]], gammas: list[int], params: SamplingParams,
                generators: list[torch.Generator]) -> list[Proposal]:
        copies = [self._copy(seq, gamma) for seq, gamma in zip(seqs, gammas, strict=True)]
        every = on_device(sum(copies, []), self.device, torch.long)  # all rows' drafts in one copy
        out, first = [], 0
        for copied in copies:
            g = len(copied)
            tokens = every[first : first + g]  # [g]
            q = torch.zeros(g, self.vocab_size, device=self.device)  # [g, V], one-hot: q(d) = 1
            q[torch.arange(g, device=self.device), tokens] = 1.0
            out.append(Proposal(tokens, q))
            first += g
        return out


class LookupFirstDrafter:
    """Prompt lookup where the text repeats itself, another drafter everywhere else.

    Where a row's last n >= min_ngram tokens occurred before (an edit copying its passage, code
    repeating a name), it drafts the continuation of that match, q one-hot, as PromptLookupDrafter
    does; every other row drafts with `fallback`. Requiring a few tokens of match keeps lookup to
    real copying: one or two tokens recur all over ordinary prose, and what followed them once says
    little about what comes next, where the fallback knows better. The fallback sees every round:
    it is asked for no drafts on a copied row and told every verification, so its state stays
    whole. Each row's proposal is exact on its own terms, so the acceptance rule stays exact.
    """

    def __init__(self, fallback: Drafter, vocab_size: int, device: torch.device | str = "cpu", min_ngram: int = 3,
                 max_ngram: int = 4, stop_ids: frozenset[int] = frozenset()):
        self.fallback, self.requires_hidden = fallback, fallback.requires_hidden
        self.lookup = PromptLookupDrafter(vocab_size, max_ngram, min_ngram, device, stop_ids)
        self.name = lookup_first_name(fallback.name)

    def start(self, prompts: list[list[int]], hidden: torch.Tensor | None) -> None:
        self.fallback.start(prompts, hidden)

    def propose(self, seqs: list[list[int]], gammas: list[int], params: SamplingParams,
                generators: list[torch.Generator]) -> list[Proposal]:
        copied = self.lookup.propose(seqs, gammas, params, generators)
        if getattr(self.fallback, "branch", 1) > 1:  # a tree: the copied continuation joins it as a branch
            trees = self.fallback.propose(seqs, gammas, params, generators)
            budget = getattr(self.fallback, "nodes", 0)
            joined = [i for i, c in enumerate(copied) if c.tokens.numel()]
            fetch(reads := [graft_reads(trees[i], copied[i]) for i in joined])  # every row's, at once
            reads = iter(reads)
            return [graft(t, c, budget, not params.greedy, next(reads)) if c.tokens.numel() else t
                    for c, t in zip(copied, trees, strict=True)]
        rest = self.fallback.propose(seqs, [0 if c.tokens.numel() else g for c, g in zip(copied, gammas, strict=True)],
                                     params, generators)
        return [replace(c, source="lookup") if c.tokens.numel() else r for c, r in zip(copied, rest, strict=True)]

    def verified(self, n_accepted: list[int], hidden: torch.Tensor | None) -> None:
        self.fallback.verified(n_accepted, hidden)

    def select(self, rows: list[int]) -> None:
        self.fallback.select(rows)

    def cache_lens(self) -> list[int]:
        return self.fallback.cache_lens()


def graft_reads(tree: Proposal, chain: Proposal) -> Reads:
    """What `graft` reads: the tree's ids, the chain's, and a pending tree's shape (tree_reads)."""
    reads = tree.tree_reads() if tree.pending is not None else Reads()
    return reads.add("tree", tree.tokens).add("chain", chain.tokens)


def graft(tree: Proposal, chain: Proposal, budget: int = 0, drawn: bool = False,
          reads: Reads | None = None) -> Proposal:
    """The tree with a deterministic chain (q one-hot, as prompt lookup's) joined from the root: where a
    node with the chain's next token exists it is shared, else a new node is added. Over a node budget,
    the tree's least likely leaves off the chain make room. The rule stays exact: every node is still a
    draw from its own q (sampling.py). A `drawn` tree (a sampled run's) must never lose a node for its
    value, or what is kept is no longer a draw from q (a likely token kept more often than q says): the
    chain is its own branch, shares nothing, and the tree's last nodes in level and draw order make room.
    reads: graft_reads(tree, chain), fetched by the caller with other rows' (else read here: one wait)."""
    if reads is None:
        fetch([reads := graft_reads(tree, chain)])
    tree = tree.settled(reads).widened()  # widened: the chain's tokens may lie outside the tree's vocabulary
    parents, tokens = list(tree.tree), [int(t) for t in reads["tree"]]
    scores = list(tree.scores) if tree.scores is not None else [1.0] * len(tokens)
    if drawn and budget:
        tree_nodes = max(budget - chain.tokens.shape[0], 0)
        parents, tokens, scores = parents[:tree_nodes], tokens[:tree_nodes], scores[:tree_nodes]
    from_tree = len(tokens)  # nodes below this index are the tree's
    on_chain, node = set(), -1
    for token in (int(t) for t in reads["chain"]):
        child = None if drawn else next(
            (i for i, (p, t) in enumerate(zip(parents, tokens, strict=True)) if (p, t) == (node, token)), None)
        if child is None:
            parents.append(node)
            tokens.append(token)
            scores.append(scores[node] if node >= 0 else 1.0)
            child = len(tokens) - 1
        on_chain.add(child)
        node = child
    keep = list(range(len(tokens)))
    while budget and len(keep) > max(budget, len(on_chain)):  # drop the least likely leaf off the chain
        leaves = [i for i in keep if i not in on_chain and not any(parents[j] == i for j in keep)]
        keep.remove(min(leaves, key=lambda i: (scores[i], -i)))
    device, V = tree.tokens.device, chain.q.shape[1]
    renumber = {old: new for new, old in enumerate(keep)}
    ids = on_device([tokens[i] for i in keep], device, torch.long)
    q = torch.zeros(len(keep), V, device=device, dtype=tree.q.dtype)
    logits = torch.full((len(keep), V), -math.inf, device=device, dtype=tree.q.dtype)
    for new, old in enumerate(keep):
        if old < from_tree:
            q[new], logits[new] = tree.q[old], tree.logits[old]
        else:
            q[new, tokens[old]], logits[new, tokens[old]] = 1.0, 0.0
    return Proposal(ids, q, logits, "lookup", [renumber[parents[i]] if parents[i] >= 0 else -1 for i in keep],
                    [scores[i] for i in keep])


def lookup_first_name(fallback: str) -> str:
    """What LookupFirstDrafter over a drafter named `fallback` is called in stats and traces."""
    return f"{PromptLookupDrafter.name} where the text repeats, else the {fallback}"


def lookup_continuation(seq: list[int], gamma: int, max_ngram: int, min_ngram: int = 1) -> list[int]:
    """Up to γ tokens that followed the latest earlier occurrence of seq's last n tokens (n from
    max_ngram down to min_ngram, the first n that matches)."""
    length = len(seq)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        tail = seq[-n:]
        # where the continuation of each earlier occurrence starts (every n-gram with a next token)
        starts = [i + n for i in _occurrences(seq, tail[0], length - n) if seq[i : i + n] == tail]
        if starts:
            # The latest match is the most relevant one (an edit copies the passage it is at),
            # but one too close to the end has less than γ tokens to offer: in a loop an earlier
            # one carries the same text further.
            full = [s for s in starts if s + gamma <= length]
            start = full[-1] if full else starts[-1]
            return seq[start : start + gamma]
    return []


def _occurrences(seq: list[int], token: int, stop: int) -> list[int]:
    """Every i < stop with seq[i] == token (list.index scans in C)."""
    found, i = [], -1
    try:
        while True:
            i = seq.index(token, i + 1, stop)
            found.append(i)
    except ValueError:
        return found
