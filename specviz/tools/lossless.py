"""Seeing that speculative sampling is lossless (Leviathan et al. 2023, Theorem 3.5; Chen et al. 2023).

The rule keeps a draft d with probability min(1, p(d)/q(d)) and otherwise samples from
norm(max(0, p − q)), so the token it emits follows p exactly, whatever the draft. `sample_check`
shows it with draws: N rows of the same prompt decoded speculatively and N by the target alone
(one batch each, sharing one prefill, every row with its own seed), their first generated tokens
counted against the exact target distribution, with the total-variation distance of each and the
distance sampling noise alone gives at that N.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import replace

import torch

from ..core.events import Candidate, SampleCheck
from ..core.generator import Settings, TokenTexts, decode, encode_prompts
from ..core.kvcache import KVState
from ..core.sampling import logits_to_probs
from ..models.loading import ModelPair

CHUNK = 256  # rows decoded at once: memory stays bounded at any N


@torch.inference_mode()
def exact_next_token(pair: ModelPair, prompt_ids: list[int], settings: Settings) -> torch.Tensor:
    """p [V]: the target's distribution of the first generated token, warped as the settings say."""
    state = KVState(pair.target, 1, "dynamic", pair.vocab_size, len(prompt_ids) + 1)
    logits = state.forward(torch.tensor([prompt_ids], device=pair.device),
                           torch.ones(1, len(prompt_ids), dtype=torch.bool, device=pair.device)).logits[0, -1]
    return logits_to_probs(logits.double(), settings.sampling)


def first_tokens(pair: ModelPair, prompt_ids: list[int], settings: Settings, n: int,
                 mode: str) -> tuple[list[int], int, int]:
    """The first generated token of n rows (seeds settings.seed .. + n - 1); and, speculative,
    how many rows tested a first draft and how many kept it."""
    # a budget of two tokens: the first round drafts one token, so the first token passes the rule
    settings = replace(settings, max_new_tokens=2, record_top=0)
    tokens, tested, kept = [], 0, 0
    for start in range(0, n, CHUNK):
        rows = min(CHUNK, n - start)
        first: dict[int, int] = {}
        seeds = list(range(settings.seed + start, settings.seed + start + rows))
        for round_events in decode(pair, [prompt_ids] * rows, settings, mode, seeds=seeds):
            for row, event in round_events:
                if row not in first:
                    first[row] = event.new_tokens[0]
                    tested += bool(event.drafted) and event.drafted[0].status != "unverified"
                    kept += bool(event.drafted) and event.drafted[0].status == "accepted"
        tokens += [first[row] for row in range(rows)]
    return tokens, tested, kept


def expected_tv(p: torch.Tensor, n: int) -> float:
    """E[TV] between n draws from p and p itself: half the sum of each count's mean absolute
    deviation, E|X − np| = 2ν C(n, ν) p^ν (1 − p)^(n − ν + 1) with ν = ⌊np⌋ + 1 (binomial)."""
    total = 0.0
    for pi in p[p > 0].tolist():
        if pi >= 1.0:
            continue
        nu = math.floor(n * pi) + 1
        log_mad = (math.log(2 * nu) + math.lgamma(n + 1) - math.lgamma(nu + 1) - math.lgamma(n - nu + 1)
                   + nu * math.log(pi) + (n - nu + 1) * math.log1p(-pi))
        total += math.exp(log_mad) / n
    return total / 2


def total_variation(counts: Counter, p: torch.Tensor, n: int) -> float:
    empirical = torch.zeros_like(p)
    for token, count in counts.items():
        empirical[token] = count / n
    return 0.5 * float((empirical - p).abs().sum())


def sample_check(pair: ModelPair, prompt: str, settings: Settings, n: int = 1000, top: int = 10,
                 chat_template: bool = True) -> SampleCheck:
    """Draw the first token n times with speculation (the settings' drafter, one draft) and n times
    from the target alone; compare both with the exact distribution. Needs temperature > 0."""
    if settings.sampling.greedy:
        raise ValueError("the sampling check needs temperature > 0: a greedy run has one outcome")
    if not 1 <= n <= 100_000:
        raise ValueError(f"n must be in [1, 100000], got {n}")
    (ids,) = encode_prompts(pair, [prompt], settings, chat_template)
    p = exact_next_token(pair, ids, settings)
    started = time.perf_counter()
    spec, tested, kept = first_tokens(pair, ids, settings, n, "speculative")
    middle = time.perf_counter()
    alone, _, _ = first_tokens(pair, ids, settings, n, "baseline")
    ended = time.perf_counter()
    spec_counts, alone_counts = Counter(spec), Counter(alone)
    text = TokenTexts(pair.tokenizer)
    likeliest = torch.topk(p, min(top, int((p > 0).sum()))).indices.tolist()
    candidates = [Candidate(t, text(t), float(p[t]), spec_counts[t] / n, alone_counts[t] / n) for t in likeliest]
    rest = [Candidate(-1, "(all others)", 1 - sum(c.exact for c in candidates),
                      1 - sum(c.speculative for c in candidates), 1 - sum(c.target_alone for c in candidates))]
    return SampleCheck(n, candidates + rest, total_variation(spec_counts, p, n), total_variation(alone_counts, p, n),
                       expected_tv(p, n), middle - started, ended - middle, kept / tested if tested else None)
