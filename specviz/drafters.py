"""Drafting strategies: a small interface with two verbs, propose and verified.

Like transformers' `CandidateGenerator`: a drafter proposes γ tokens with the distribution q each
was drawn from, and is then told how many the target kept, so it can roll its state back.
The generator never looks inside a drafter, so other drafters plug in: a draft model, n-gram
lookup in the text itself (no model at all), or none (the baseline). A drafter may propose fewer
than γ tokens, even none. Drafters work on B rows at once; a single prompt is a batch of one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import PreTrainedModel

from .kvcache import KVState, left_padded
from .sampling import SamplingParams, logits_to_probs, sample


@dataclass
class Proposal:
    tokens: torch.Tensor  # [γ] drafted ids (γ may be less than asked for, even 0)
    q: torch.Tensor  # [γ, V] the distribution each token was drawn from (one-hot when greedy)
    logits: torch.Tensor | None = None  # [γ, V] raw draft logits, if the drafter has a model


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
