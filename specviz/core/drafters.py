"""Drafting strategies: a small interface with two verbs, propose and verified.

Like transformers' `CandidateGenerator`: a drafter proposes γ tokens with the distribution q each
was drawn from, and is then told how many the target kept, so it can roll its state back.
The generator never looks inside a drafter, so other drafters plug in: a draft model, a head on
the target's own hidden states (EAGLE), n-gram lookup in the text itself (no model at all), lookup
where the text repeats and another drafter elsewhere, or none (the baseline). A drafter may propose
fewer than γ tokens, even none. Drafters work on B rows at once; a single prompt is a batch of one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import torch
from transformers import PreTrainedModel

from ..models.eagle import EagleHead, HeadCache
from .kvcache import KVState, left_padded
from .sampling import SamplingParams, at_least_float32, logits_to_probs, sample


@dataclass
class Proposal:
    tokens: torch.Tensor  # [γ] drafted ids (γ may be less than asked for, even 0)
    q: torch.Tensor  # [γ, V] the distribution each token was drawn from (one-hot when greedy)
    logits: torch.Tensor | None = None  # [γ, V] raw draft logits, if the drafter has a model
    source: str = ""  # which part of a combined drafter proposed (e.g. "lookup"); "" for a single one


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

    def propose(self, seqs: list[torch.Tensor], gammas: list[int], params: SamplingParams,
                generators: list[torch.Generator]) -> list[Proposal]:
        """Draft up to γ_i tokens after each row's sequence seqs[i] [L_i]."""

    def verified(self, n_accepted: list[int], hidden: torch.Tensor | None) -> None:
        """Row i kept its first n_accepted[i] drafts (then the target added one token).

        hidden: [B, g_max + 1, H], the verify pass over [x_last, d_1..d_g], if asked for."""

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

    def propose(self, seqs, gammas, params, generators) -> list[Proposal]:
        return [Proposal(seq[:0], torch.zeros(0, 0, device=seq.device)) for seq in seqs]


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
        self._draft_slots: list[list[int]] = []  # per row: the slots of d_1..d_{γ-1} this round

    def start(self, prompts: list[list[int]], hidden=None) -> None:
        self.state = KVState(self.model, len(prompts), self.cache_kind, self.vocab_size, self.capacity, self.compile)
        self.state.prefill(prompts, self.pad_id)

    def propose(self, seqs: list[torch.Tensor], gammas: list[int], params: SamplingParams,
                generators: list[torch.Generator]) -> list[Proposal]:
        state, device = self.state, self.model.device
        self._draft_slots = [[] for _ in seqs]
        steps = max(gammas)
        if steps == 0:  # every row is at its budget's last token
            empty = torch.zeros(0, dtype=torch.long, device=device)
            return [Proposal(empty, torch.zeros(0, self.vocab_size, device=device)) for _ in seqs]
        lengths = state.lengths.tolist()
        tails = [seq[n:].tolist() for seq, n in zip(seqs, lengths, strict=True)]  # 1 or 2 tokens each
        ids, real = left_padded(tails, self.pad_id, device)
        real &= torch.tensor([g > 0 for g in gammas], device=device)[:, None]
        tokens = torch.zeros(len(seqs), steps, dtype=torch.long, device=device)  # [B, γ_max]
        qs, logit_rows = [], []
        for step in range(steps):
            logits = state.forward(ids, real, last_only=True).logits[:, -1]  # [B, V]
            q = logits_to_probs(logits, params)  # [B, V]
            if params.greedy:
                tokens[:, step] = q.argmax(-1)
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
                real = torch.tensor([[step + 1 < g] for g in gammas], device=device)
        q_all, logits_all = torch.stack(qs, 1), torch.stack(logit_rows, 1)  # [B, γ_max, V]
        return [Proposal(tokens[row, :g], q_all[row, :g], logits_all[row, :g]) for row, g in enumerate(gammas)]

    def verified(self, n_accepted: list[int], hidden=None) -> None:
        for row, n in enumerate(n_accepted):
            slots = self._draft_slots[row][n:]  # d_{n+1}.. were rejected or never tested
            if slots:
                self.state.make_holes(row, slots[0], slots[-1] + 1)
        self.state.trim()

    def select(self, rows: list[int]) -> None:
        self.state.select(rows)

    def cache_lens(self) -> list[int]:
        return self.state.lengths.tolist()


class EagleDrafter:
    """Drafts with a feature-level head (eagle.py) that reads the target's own hidden states.

    The head holds one entry per position 0..L-2 of each row, (f_i, x_{i+1}), and the target's
    features f arrive with each verify pass. `verified` keeps the kept positions' features as
    pending; the next `propose` writes their entries in one head forward (rows right-aligned,
    short rows padded into a scratch slot), whose last output gives q for d_1; each further
    step feeds the head its own output with the drafted token. Drafted entries sit after the real
    ones and are forgotten by not moving the length. q lives on the head's reduced vocabulary and
    is 0 elsewhere: the acceptance rule stays exact (a token q cannot draft comes from the
    residual). A row with no entry yet (a one-token prompt) drafts nothing in its first round.
    """

    requires_hidden = True

    def __init__(self, head: EagleHead, vocab_size: int, pad_id: int, capacity: int, name: str = "EAGLE head"):
        self.head, self.vocab_size, self.pad_id, self.capacity, self.name = head, vocab_size, pad_id, capacity, name
        self.cache: HeadCache | None = None
        self.pending: list[torch.Tensor] = []  # per row: [n, F] features whose entries are not written yet

    def start(self, prompts: list[list[int]], hidden: torch.Tensor | None) -> None:
        self.cache = HeadCache(self.head, len(prompts), self.capacity, like=hidden)
        width = hidden.shape[1]
        self.pending = [hidden[row, width - (len(p) - 1) :] for row, p in enumerate(prompts)]  # f_0..f_{P-2}

    def _catch_up(self, seqs: list[torch.Tensor], reserve: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Write the pending entries; (h [B, 1, D], logits [B, N]) of each row's last one, or None."""
        cache, widths = self.cache, [len(f) for f in self.pending]
        width = max(widths)
        if width == 0:
            return None
        cache.reserve(max(n + length for n, length in zip(widths, cache.lengths, strict=True)) + reserve)
        rows, device = len(seqs), seqs[0].device
        feats = self.pending[0].new_zeros(rows, width, self.pending[0].shape[-1])  # [B, w, F]
        tokens = torch.full((rows, width), self.pad_id, dtype=torch.long, device=device)
        positions = torch.zeros(rows, width, dtype=torch.long, device=device)
        slots = torch.full((rows, width), cache.scratch, dtype=torch.long, device=device)
        for row, (seq, n) in enumerate(zip(seqs, widths, strict=True)):
            if n:
                start = cache.lengths[row]  # entry i = (f_i, x_{i+1}) at position i
                feats[row, width - n :] = self.pending[row]
                tokens[row, width - n :] = seq[start + 1 : start + 1 + n]
                positions[row, width - n :] = slots[row, width - n :] = torch.arange(start, start + n, device=device)
                cache.lengths[row] += n
        h, logits = self.head.step(cache, tokens, self.head.features_in(feats), slots, positions)
        self.pending = [f[:0] for f in self.pending]
        return h[:, -1:], logits[:, -1]

    def propose(self, seqs: list[torch.Tensor], gammas: list[int], params: SamplingParams,
                generators: list[torch.Generator]) -> list[Proposal]:
        cache, device, V = self.cache, seqs[0].device, self.vocab_size
        caught_up = self._catch_up(seqs, max(gammas))
        gammas = [g if cache.lengths[row] else 0 for row, g in enumerate(gammas)]  # no entry yet: no draft
        steps = max(gammas)
        tokens = torch.zeros(len(seqs), steps, dtype=torch.long, device=device)  # [B, γ_max]
        qs, logit_rows = [], []
        if steps:
            g, logits = caught_up  # g [B, 1, D]: fed back in place of a feature; logits [B, N]
            draft_ids = self.head.draft_ids
        for step in range(steps):
            logits = at_least_float32(logits)
            q = logits_to_probs(logits, params)  # [B, N] on the reduced vocabulary
            picks = q.argmax(-1) if params.greedy else torch.stack([
                sample(q[row], generators[row]) if step < gamma else q.new_zeros((), dtype=torch.long)
                for row, gamma in enumerate(gammas)])
            tokens[:, step] = draft_ids[picks]
            qs.append(q)
            logit_rows.append(logits)
            if step + 1 < steps:  # d_γ is never fed
                live = torch.tensor([step + 1 < gm for gm in gammas], device=device)
                lengths = torch.tensor(cache.lengths, device=device)
                positions = torch.where(live, lengths + step, 0)[:, None]  # entry (h, d) after the real ones
                slots = torch.where(live, lengths + step, cache.scratch)[:, None]
                g, logits = self.head.step(cache, tokens[:, step : step + 1], g, slots, positions)
                logits = logits[:, 0]
        out, dtype = [], qs[0].dtype if qs else torch.float32  # at least float32, as logits_to_probs gives
        for row, gamma in enumerate(gammas):
            q_full = torch.zeros(gamma, V, device=device, dtype=dtype)  # [γ, V]: 0 outside the head's vocabulary
            logits_full = torch.full((gamma, V), float("-inf"), device=device, dtype=dtype)
            if gamma:
                q_full[:, draft_ids] = torch.stack([q[row] for q in qs[:gamma]])
                logits_full[:, draft_ids] = torch.stack([lg[row] for lg in logit_rows[:gamma]])
            out.append(Proposal(tokens[row, :gamma], q_full, logits_full))
        return out

    def verified(self, n_accepted: list[int], hidden: torch.Tensor | None) -> None:
        # hidden [B, g_max + 1, F] over [x_last, d_1..]: the kept positions' features
        self.pending = [hidden[row, : n + 1] for row, n in enumerate(n_accepted)]

    def select(self, rows: list[int]) -> None:
        self.cache.select(rows)
        self.pending = [self.pending[r] for r in rows]

    def cache_lens(self) -> list[int]:
        return list(self.cache.lengths)


class PromptLookupDrafter(StatelessDrafter):
    """Drafts by copying: the continuation of the latest earlier match of the text's last n tokens.

    Prompt lookup decoding (Saxena 2023, HF `prompt_lookup_num_tokens`) with the longest-match-
    first n of adaptive n-gram decoding (Ou et al. 2024): try n = max_ngram down to min_ngram
    and take the first n that matches anywhere in the prompt or the text so far. The proposal
    is deterministic, so q is one-hot: the rule keeps d with probability p(d), and on a
    rejection samples from p with d removed, renormalised; exact, like the draft-model path.
    No match: an empty proposal, and the round is a plain target step. No state, no model.
    """

    name = "prompt lookup"

    def __init__(self, vocab_size: int, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.vocab_size = vocab_size
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, seqs: list[torch.Tensor], gammas: list[int], params: SamplingParams,
                generators: list[torch.Generator]) -> list[Proposal]:
        out = []
        for seq, gamma in zip(seqs, gammas, strict=True):
            tokens = lookup_continuation(seq, gamma, self.max_ngram, self.min_ngram) if gamma else seq[:0]  # [g]
            q = torch.zeros(tokens.shape[0], self.vocab_size, device=seq.device)  # [g, V], one-hot: q(d) = 1
            q[torch.arange(tokens.shape[0], device=seq.device), tokens] = 1.0
            out.append(Proposal(tokens, q))
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

    def __init__(self, fallback: Drafter, vocab_size: int, min_ngram: int = 3, max_ngram: int = 4):
        self.fallback, self.requires_hidden = fallback, fallback.requires_hidden
        self.lookup = PromptLookupDrafter(vocab_size, max_ngram, min_ngram)
        self.name = lookup_first_name(fallback.name)

    def start(self, prompts: list[list[int]], hidden: torch.Tensor | None) -> None:
        self.fallback.start(prompts, hidden)

    def propose(self, seqs: list[torch.Tensor], gammas: list[int], params: SamplingParams,
                generators: list[torch.Generator]) -> list[Proposal]:
        copied = self.lookup.propose(seqs, gammas, params, generators)
        rest = self.fallback.propose(seqs, [0 if c.tokens.numel() else g for c, g in zip(copied, gammas, strict=True)],
                                     params, generators)
        return [replace(c, source="lookup") if c.tokens.numel() else r for c, r in zip(copied, rest, strict=True)]

    def verified(self, n_accepted: list[int], hidden: torch.Tensor | None) -> None:
        self.fallback.verified(n_accepted, hidden)

    def select(self, rows: list[int]) -> None:
        self.fallback.select(rows)

    def cache_lens(self) -> list[int]:
        return self.fallback.cache_lens()


def lookup_first_name(fallback: str) -> str:
    """What LookupFirstDrafter over a drafter named `fallback` is called in stats and traces."""
    return f"{PromptLookupDrafter.name} where the text repeats, else the {fallback}"


def lookup_continuation(seq: torch.Tensor, gamma: int, max_ngram: int, min_ngram: int = 1) -> torch.Tensor:
    """seq [L]: up to γ tokens that followed the latest earlier occurrence of seq's last n tokens."""
    length = seq.shape[0]
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        windows = seq[:-1].unfold(0, n, 1)  # [L - n, n]: every n-gram that has a next token
        hits = (windows == seq[-n:]).all(dim=1).nonzero()
        if len(hits):
            # The latest match is the most relevant one (an edit copies the passage it is at),
            # but one too close to the end has less than γ tokens to offer: in a loop an earlier
            # one carries the same text further.
            starts = hits[:, 0] + n
            full = starts[starts + gamma <= length]
            start = int(full[-1] if len(full) else starts[-1])
            return seq[start : start + gamma]
    return seq[:0]
