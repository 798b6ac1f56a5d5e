"""Drafting strategies: a small interface with two verbs, propose and verified.

Like transformers' `CandidateGenerator`: a drafter proposes γ tokens with the distribution q each
was drawn from, and is then told how many the target kept, so it can roll its state back.
The generator never looks inside a drafter, so other drafters plug in: a draft model, or n-gram
lookup in the text itself (no model at all). A drafter may propose fewer than γ tokens, even none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import DynamicCache, PreTrainedModel

from .sampling import SamplingParams, at_least_float32, logits_to_probs, sample


@dataclass
class Proposal:
    tokens: torch.Tensor  # [γ] drafted ids (γ may be less than asked for, even 0)
    q: torch.Tensor  # [γ, V] the distribution each token was drawn from (one-hot when greedy)
    logits: torch.Tensor | None = None  # [γ, V] raw draft logits, if the drafter has a model


class Drafter(Protocol):
    name: str

    def start(self, prompt_ids: torch.Tensor) -> None:
        """Begin a sequence. prompt_ids: [1, L]."""

    def propose(
        self, ids: torch.Tensor, gamma: int, params: SamplingParams, generator: torch.Generator
    ) -> Proposal:
        """Draft γ tokens after ids [1, L] (the whole sequence so far)."""

    def verified(self, n_accepted: int) -> None:
        """The target kept the first n_accepted drafted tokens (then added one of its own)."""

    @property
    def cache_len(self) -> int:
        """Tokens the drafter holds state for (0 if it keeps none)."""


def model_logits(model: PreTrainedModel, ids: torch.Tensor, cache: DynamicCache, vocab_size: int,
                 last_only: bool = False) -> torch.Tensor:
    """Forward new ids [1, n] on top of the cache; logits [n, V] (or [1, V]), at least float32.

    Logits are cut to the pair's shared vocabulary: padded embedding rows never get sampled.
    """
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1 if last_only else 0)
    return at_least_float32(out.logits[0, :, :vocab_size])


class DraftModelDrafter:
    """A small causal LM drafts autoregressively, keeping its KV cache across rounds.

    The cache holds the sequence minus its uncached tail. A round feeds the tail (the last token,
    or two after a fully accepted round) and then each drafted token but the last; `verified`
    crops the cache back to the kept prefix, so no prefix is ever recomputed.
    """

    def __init__(self, model: PreTrainedModel, vocab_size: int, name: str = "draft model"):
        self.model = model
        self.vocab_size = vocab_size
        self.name = name
        self.cache: DynamicCache | None = None
        self._cached = 0  # tokens in the cache
        self._prefix = 0  # sequence length when the last proposal was made
        self._gamma = 0

    @property
    def cache_len(self) -> int:
        return self._cached

    @torch.inference_mode()
    def start(self, prompt_ids: torch.Tensor) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self._cached = 0
        if prompt_ids.shape[1] > 1:
            model_logits(self.model, prompt_ids[:, :-1], self.cache, self.vocab_size, last_only=True)
            self._cached = prompt_ids.shape[1] - 1

    @torch.inference_mode()
    def propose(
        self, ids: torch.Tensor, gamma: int, params: SamplingParams, generator: torch.Generator
    ) -> Proposal:
        assert self.cache is not None, "start() first"
        self._prefix, self._gamma = ids.shape[1], gamma
        feed = ids[:, self._cached :]  # [1, t] the uncached tail, t >= 1
        tokens, qs, logits_rows = [], [], []
        for _ in range(gamma):
            logits = model_logits(self.model, feed, self.cache, self.vocab_size, last_only=True)[-1]  # [V]
            self._cached += feed.shape[1]
            q = logits_to_probs(logits, params)  # [V]
            token = q.argmax() if params.greedy else sample(q, generator)
            tokens.append(token)
            qs.append(q)
            logits_rows.append(logits)
            feed = token.view(1, 1)
        # The last drafted token was never fed: the cache holds ids + d_1..d_{γ-1}.
        return Proposal(torch.stack(tokens), torch.stack(qs), torch.stack(logits_rows))

    def verified(self, n_accepted: int) -> None:
        keep = self._prefix + min(n_accepted, self._gamma - 1)
        if keep < self._cached:
            self.cache.crop(keep - self._cached)  # transformers 5: a negative count to remove
            self._cached = keep


class PromptLookupDrafter:
    """Drafts by copying: the continuation of the latest earlier match of the text's last n tokens.

    Prompt lookup decoding (Saxena 2023, HF `prompt_lookup_num_tokens`) with the longest-match-
    first n of adaptive n-gram decoding (Ou et al. 2024): try n = max_ngram down to min_ngram
    and take the first n that matches anywhere in the prompt or the text so far. The proposal
    is deterministic, so q is one-hot: the rule keeps d with probability p(d), and on a
    rejection samples from p with d removed, renormalised; exact, like the draft-model path.
    No match: an empty proposal, and the round is a plain target step.
    """

    name = "prompt lookup"

    def __init__(self, vocab_size: int, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.vocab_size = vocab_size
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    @property
    def cache_len(self) -> int:
        return 0

    def start(self, prompt_ids: torch.Tensor) -> None:
        pass

    def propose(
        self, ids: torch.Tensor, gamma: int, params: SamplingParams, generator: torch.Generator
    ) -> Proposal:
        seq = ids[0]  # [L]
        tokens = lookup_continuation(seq, gamma, self.max_ngram, self.min_ngram) if gamma else seq[:0]  # [g]
        q = torch.zeros(tokens.shape[0], self.vocab_size, device=seq.device)  # [g, V], one-hot: q(d) = 1
        q[torch.arange(tokens.shape[0], device=seq.device), tokens] = 1.0
        return Proposal(tokens, q)

    def verified(self, n_accepted: int) -> None:
        pass


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
