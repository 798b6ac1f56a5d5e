"""Batched speculative decoding: several prompts at once, each row at its own pace.

Rows accept different numbers of drafts, so after a round their sequences differ in length.
Instead of re-padding, all rows share one rectangular KV cache and a mask says which slots hold
real tokens (`MaskedCache`): a round appends the same number of slots to every row, and the
slots of drafts a row rejected become holes instead of being cropped. Positions are counted per
row (real tokens before a slot), so every row sees exactly the sequence it would see alone, and
its greedy output equals its single-prompt greedy output. Each row has its own random generator
(seeded like a single run), its own γ policy, its own budget, and leaves the batch when done.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace

import torch
from transformers import DynamicCache, PreTrainedModel

from .drafters import PromptLookupDrafter, Proposal
from .events import RoundEvent, Run
from .generator import (
    Settings,
    TokenTexts,
    _round_tokens,
    _seeded_generator,
    _sync,
    check_fits,
    finish_reason,
    kept_drafts,
    make_meta,
    validate_prompt,
)
from .models import ModelPair, encode_prompt
from .sampling import SamplingParams, accept_or_resample, at_least_float32, logits_to_probs, sample
from .schedules import make_policy

MAX_BATCH = 16


class MaskedCache:
    """A DynamicCache over B rows, and mask [B, W]: 1 where a slot holds a real token, 0 a hole."""

    def __init__(self, model: PreTrainedModel, batch: int, device: torch.device):
        self.model = model
        self.cache = DynamicCache(config=model.config)
        self.mask = torch.zeros(batch, 0, dtype=torch.long, device=device)

    @property
    def lengths(self) -> torch.Tensor:
        """[B] real tokens per row."""
        return self.mask.sum(1)

    def forward(self, ids: torch.Tensor, real: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Append ids [B, t] (real [B, t] bool: False marks a hole); logits [B, t, V], at least float32."""
        real = real.long()
        positions = (self.lengths[:, None] + real.cumsum(1) - 1).clamp_min(0)  # a hole's is never used
        self.mask = torch.cat([self.mask, real], dim=1)
        out = self.model(input_ids=ids, attention_mask=self.mask, position_ids=positions,
                         past_key_values=self.cache, use_cache=True)
        return at_least_float32(out.logits[:, :, :vocab_size])

    def prefill(self, prompts: list[list[int]], pad_id: int, vocab_size: int) -> None:
        """Each prompt but its last token, right-aligned (a one-token prompt adds only a hole)."""
        ids, real = _left_padded([p[:-1] or [pad_id] for p in prompts], pad_id, self.mask.device)
        real &= torch.tensor([len(p) > 1 for p in prompts], device=self.mask.device)[:, None]
        self.forward(ids, real, vocab_size)

    def make_holes(self, row: int, start: int, stop: int) -> None:
        """Slots [start, stop) of a row no longer hold tokens of its sequence."""
        self.mask[row, start:stop] = 0

    def select(self, rows: list[int]) -> None:
        """Keep only these rows (finished rows leave the batch)."""
        index = torch.tensor(rows, device=self.mask.device)
        self.cache.batch_select_indices(index)
        self.mask = self.mask[index]

    def trim(self) -> None:
        """Drop trailing slots that are holes in every row, so the cache grows only as needed."""
        real_any = self.mask.any(0).nonzero()
        width = int(real_any[-1]) + 1 if len(real_any) else 0
        if width < self.mask.shape[1]:
            self.cache.crop(width - self.mask.shape[1])
            self.mask = self.mask[:, :width]

    @property
    def width(self) -> int:
        return self.mask.shape[1]


def _left_padded(rows: list[list[int]], pad: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, w] and real [B, w] with each row right-aligned."""
    width = max(map(len, rows))
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=device)
    real = torch.tensor([[False] * (width - len(r)) + [True] * len(r) for r in rows], device=device)
    return ids, real


class BatchLookupDrafter:
    """Prompt lookup for each row, one row at a time (it has no model and no state)."""

    def __init__(self, vocab_size: int):
        self.lookup = PromptLookupDrafter(vocab_size)

    def start(self, prompts: list[list[int]]) -> None:
        pass

    def propose(self, seqs: list[torch.Tensor], gammas: list[int], params: SamplingParams,
                generators: list[torch.Generator]) -> list[Proposal]:
        return [self.lookup.propose(seq[None], gamma, params, generator)
                for seq, gamma, generator in zip(seqs, gammas, generators, strict=True)]

    def verified(self, n_accepted: list[int]) -> None:
        pass

    def select(self, rows: list[int]) -> None:
        pass

    def cache_lens(self) -> list[int]:
        return []


class BatchDraftModelDrafter:
    """The draft model drafts for all rows at once, one token per row and step.

    Its cache holds a real prefix of each row's sequence. A round feeds each row's uncached tail
    (one or two tokens; a shorter tail is padded with a hole), then γ_max - 1 drafted tokens,
    where a row that asked for fewer gets holes. `verified` turns the slots of rejected drafts
    into holes, so each row's real prefix is again a prefix of its sequence.
    """

    def __init__(self, model: PreTrainedModel, vocab_size: int, pad_id: int):
        self.model, self.vocab_size, self.pad_id = model, vocab_size, pad_id
        self.cache: MaskedCache | None = None
        self._draft_slots: list[list[int]] = []  # per row: the slots of d_1..d_{γ-1} this round

    def start(self, prompts: list[list[int]]) -> None:
        self.cache = MaskedCache(self.model, len(prompts), self.model.device)
        self.cache.prefill(prompts, self.pad_id, self.vocab_size)

    def propose(self, seqs: list[torch.Tensor], gammas: list[int], params: SamplingParams,
                generators: list[torch.Generator]) -> list[Proposal]:
        cache, device = self.cache, self.model.device
        self._draft_slots = [[] for _ in seqs]
        steps = max(gammas)
        if steps == 0:  # every row is at its budget's last token
            empty = torch.zeros(0, dtype=torch.long, device=device)
            return [Proposal(empty, torch.zeros(0, self.vocab_size, device=device)) for _ in seqs]
        lengths = cache.lengths.tolist()
        tails = [seq[n:].tolist() for seq, n in zip(seqs, lengths, strict=True)]  # 1 or 2 tokens each
        ids, real = _left_padded(tails, self.pad_id, device)
        real &= torch.tensor([g > 0 for g in gammas], device=device)[:, None]
        tokens = torch.zeros(len(seqs), steps, dtype=torch.long, device=device)  # [B, γ_max]
        qs, logit_rows = [], []
        for step in range(steps):
            logits = cache.forward(ids, real, self.vocab_size)[:, -1]  # [B, V]
            q = logits_to_probs(logits, params)  # [B, V]
            for row, gamma in enumerate(gammas):
                if step < gamma:
                    tokens[row, step] = q[row].argmax() if params.greedy else sample(q[row], generators[row])
            qs.append(q)
            logit_rows.append(logits)
            if step + 1 < steps:  # d_{γ} is never fed, as in the single-row drafter
                for row in range(len(seqs)):
                    self._draft_slots[row].append(cache.width)
                ids = tokens[:, step : step + 1]
                real = torch.tensor([[step + 1 < g] for g in gammas], device=device)
        q_all, logits_all = torch.stack(qs, 1), torch.stack(logit_rows, 1)  # [B, γ_max, V]
        return [Proposal(tokens[row, :g], q_all[row, :g], logits_all[row, :g]) for row, g in enumerate(gammas)]

    def verified(self, n_accepted: list[int]) -> None:
        for row, n in enumerate(n_accepted):
            slots = self._draft_slots[row][n:]  # d_{n+1}.. were rejected or never tested
            if slots:
                self.cache.make_holes(row, slots[0], slots[-1] + 1)
        self.cache.trim()

    def select(self, rows: list[int]) -> None:
        self.cache.select(rows)

    def cache_lens(self) -> list[int]:
        return self.cache.lengths.tolist()


def make_batch_drafter(pair: ModelPair, settings: Settings):
    if settings.drafter == "lookup":
        return BatchLookupDrafter(pair.vocab_size)
    return BatchDraftModelDrafter(pair.draft, pair.vocab_size, _pad_id(pair))


def _pad_id(pair: ModelPair) -> int:
    pad = pair.tokenizer.pad_token_id
    return pad if pad is not None else min(pair.eos_token_ids)


@torch.inference_mode()
def batch_events(
    pair: ModelPair, prompts_ids: list[list[int]], settings: Settings, runs: list[Run] | None = None
) -> Iterator[list[tuple[int, RoundEvent]]]:
    """Yield, per round, (row, event) for every row still running. Fills runs' prefill_ms."""
    settings.validate()
    if not 1 <= len(prompts_ids) <= MAX_BATCH:
        raise ValueError(f"a batch holds 1 to {MAX_BATCH} prompts, got {len(prompts_ids)}")
    params, device, V = settings.sampling, pair.device, pair.vocab_size
    text = TokenTexts(pair.tokenizer)
    pad_id, n_rows = _pad_id(pair), len(prompts_ids)
    generators = [_seeded_generator(device, settings.seed) for _ in range(n_rows)]  # each row as if alone
    policies = [make_policy(settings.gamma_policy, settings.gamma, settings.gamma_max) for _ in range(n_rows)]
    seqs = [torch.tensor(p, device=device) for p in prompts_ids]
    generated, indices = [0] * n_rows, [0] * n_rows
    active = list(range(n_rows))  # original row numbers, in cache order

    start = time.perf_counter()
    target = MaskedCache(pair.target, n_rows, device)  # holds each row's sequence but its last token
    target.prefill(prompts_ids, pad_id, V)
    drafter = make_batch_drafter(pair, settings)
    drafter.start(prompts_ids)
    _sync(device)
    if runs is not None:
        for run in runs:
            run.meta.prefill_ms = 1000 * (time.perf_counter() - start)

    while active:
        # Never draft past a row's budget: n kept + 1 added <= remaining.
        gammas = [min(policies[r].next_gamma(), settings.max_new_tokens - generated[r] - 1) for r in active]
        t0 = time.perf_counter()
        proposals = drafter.propose([seqs[r] for r in active], gammas, params, [generators[r] for r in active])
        _sync(device)
        t1 = time.perf_counter()
        drafted = [p.tokens.shape[0] for p in proposals]  # g_i <= γ_i
        width = max(drafted) + 1
        verify_rows = [[int(seqs[r][-1])] + p.tokens.tolist() for r, p in zip(active, proposals, strict=True)]
        verify_ids = torch.tensor([v + [pad_id] * (width - len(v)) for v in verify_rows], device=device)
        verify_real = torch.tensor([[j < len(v) for j in range(width)] for v in verify_rows], device=device)
        base = target.width
        p_logits = target.forward(verify_ids, verify_real, V)  # [B, g_max+1, V]
        p_all = logits_to_probs(p_logits, params)
        verdicts = [accept_or_resample(p_all[i, : g + 1], prop.q, prop.tokens, generators[r], greedy=params.greedy)
                    for i, (r, g, prop) in enumerate(zip(active, drafted, proposals, strict=True))]
        t2 = time.perf_counter()

        out, n_kept, finished = [], [], []
        for i, (r, g, prop, verdict) in enumerate(zip(active, drafted, proposals, verdicts, strict=True)):
            drafted_ids = prop.tokens.tolist()
            n, stop_at = kept_drafts(verdict.n_accepted, drafted_ids, pair.eos_token_ids)
            target.make_holes(i, base + 1 + n, base + width)  # keep x_last and the n kept drafts
            n_kept.append(n)
            tokens, extra = _round_tokens(prop, p_logits[i, : g + 1], p_all[i, : g + 1], verdict, n, stop_at,
                                          params, settings.record_top, text)
            new = drafted_ids[:n] + ([extra.id] if extra else [])
            seqs[r] = torch.cat([seqs[r], torch.tensor(new, device=device)])
            generated[r] += len(new)
            event = RoundEvent(
                index=indices[r], gamma=g, drafted=tokens, extra=extra, n_accepted=n,
                draft_ms=1000 * (t1 - t0), verify_ms=1000 * (t2 - t1), target_cache_len=0, draft_cache_len=0,
                tokens_so_far=generated[r], elapsed_ms=0.0,
            )
            indices[r] += 1
            event.finish_reason = finish_reason(new, generated[r], settings.max_new_tokens, pair.eos_token_ids)
            if event.finish_reason:
                finished.append(i)
            policies[r].observe(event)
            out.append((r, event))
        drafter.verified(n_kept)
        target.trim()
        target_lens, draft_lens = target.lengths.tolist(), drafter.cache_lens()
        elapsed = 1000 * (time.perf_counter() - start)
        for i, (_, event) in enumerate(out):
            event.target_cache_len = target_lens[i]
            event.draft_cache_len = draft_lens[i] if draft_lens else 0
            event.elapsed_ms = elapsed
        if finished:
            keep = [i for i in range(len(active)) if i not in finished]
            if keep:
                target.select(keep)
                drafter.select(keep)
            active = [active[i] for i in keep]
        yield out


def batch_runs(pair: ModelPair, prompts: list[str], prompts_ids: list[list[int]], settings: Settings) -> list[Run]:
    """One empty Run per row, for batch_events to fill."""
    return [Run(replace(make_meta(pair, "speculative", prompt, ids, settings), batch_size=len(prompts_ids)))
            for prompt, ids in zip(prompts, prompts_ids, strict=True)]


def generate_batch(pair: ModelPair, prompts: list[str], settings: Settings, chat_template: bool = True,
                   prompts_ids: list[list[int]] | None = None) -> list[Run]:
    """Run a batch to the end: one Run per prompt, in order."""
    settings.validate()
    if prompts_ids is None:
        for prompt in prompts:
            validate_prompt(prompt)
        prompts_ids = [encode_prompt(pair.tokenizer, p, chat_template) for p in prompts]
    for ids in prompts_ids:
        check_fits(pair, ids, settings)
    runs = batch_runs(pair, prompts, prompts_ids, settings)
    for round_events in batch_events(pair, prompts_ids, settings, runs):
        for row, event in round_events:
            runs[row].events.append(event)
    for run in runs:
        run.text = pair.tokenizer.decode(run.token_ids, skip_special_tokens=True)
    return runs
