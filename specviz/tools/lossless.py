"""Seeing that speculative sampling is lossless (Leviathan et al. 2023, Theorem 3.5; Chen et al. 2023).

The rule keeps a draft d with probability min(1, p(d)/q(d)) and otherwise samples from
norm(max(0, p − q)), so the token it emits follows p exactly, whatever the draft. `sample_check`
shows it with draws: N rows of the same prompt decoded speculatively and N by the target alone
(one batch each, sharing one prefill, every row with its own seed), their first generated tokens
counted against the exact target distribution, with the total-variation distance of each and the
distance sampling noise alone gives at that N. Draws tell a correct rule from a subtly wrong one
only at large N, so `exact_check` computes the same thing in closed form for one round of the
viewer's own prompt and settings: with p the target's warped distribution of the first token and
q the drafter's, the token emitted is d ~ q kept with min(1, p(d)/q(d)), else a draw from the
residual, so P(x) = q(x) min(1, p(x)/q(x)) + (1 − Σ_d q(d) min(1, p(d)/q(d))) norm(max(0, p − q))(x),
which is min(p, q)(x) + max(0, p − q)(x) = p(x). In float64 it matches p to rounding; a rule that
resamples from p instead of the residual misses by a visible margin, shown beside it.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace

import torch

from ..core.events import Candidate, ExactCheck, Run, SampleCheck
from ..core.generator import Settings, TokenTexts, decode, encode_prompts, make_drafter, pad_id
from ..core.kvcache import KVState
from ..core.sampling import SamplingParams, acceptance_probability, logits_to_probs, residual_distribution
from ..models.loading import ModelPair
from ..view.rendering import first_difference
from .stream import Finished, RoundDone, stream

CHUNK = 256  # at most this many rows decoded at once: memory stays bounded at any N
CHUNK_S = 1.0  # a batch aims at about this many seconds, so a Stop ends the work within about that


@torch.inference_mode()
def exact_next_token(pair: ModelPair, prompt_ids: list[int], settings: Settings) -> torch.Tensor:
    """p [V]: the target's distribution of the first generated token, warped as the settings say."""
    state = KVState(pair.target, 1, "dynamic", pair.vocab_size, len(prompt_ids) + 1)
    logits = state.forward(torch.tensor([prompt_ids], device=pair.device),
                           torch.ones(1, len(prompt_ids), dtype=torch.bool, device=pair.device)).logits[0, -1]
    return logits_to_probs(logits.to("cpu", torch.float64), settings.sampling)  # float64 (mps has none): on the CPU


def first_tokens(pair: ModelPair, prompt_ids: list[int], settings: Settings, n: int,
                 mode: str) -> Iterator[int]:
    """Yields the rows drawn so far after each batched round (closing it stops between rounds);
    returns the first generated token of n rows (seeds settings.seed .. + n - 1) and, speculative,
    how many rows tested a first draft and how many kept it. Batches start at 16 rows and double
    while one takes under half of CHUNK_S (halve over it), up to CHUNK: a wide tree on a slow CPU
    still stops soon, a fast one batches. A row's token depends on its seed only, not on its batch."""
    # a budget of two tokens: the first round drafts one token, so the first token passes the rule; eager: each
    # batch size (16 to 256 rows) would compile graphs of its own and spend the process's budget of shapes
    settings = replace(settings, max_new_tokens=2, record_top=0, compile=False)
    tokens, tested, kept = [], 0, 0
    start, size = 0, 16
    while start < n:
        rows, began = min(size, n - start), time.perf_counter()
        first: dict[int, int] = {}
        seeds = list(range(settings.seed + start, settings.seed + start + rows))
        for round_events in decode(pair, [prompt_ids] * rows, settings, mode, seeds=seeds):
            for row, event in round_events:
                if row not in first:
                    first[row] = event.new_tokens[0]
                    tested += bool(event.drafted) and event.drafted[0].status != "unverified"
                    kept += bool(event.path)  # a draft at the first position was kept (a tree's: any)
            yield start + len(first)
        tokens += [first[row] for row in range(rows)]
        start, took = start + rows, time.perf_counter() - began
        if took < CHUNK_S / 2:
            size = min(CHUNK, 2 * size)
        elif took > CHUNK_S:
            size = max(1, size // 2)
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
    *_, check = sample_check_live(pair, prompt, settings, n, top, chat_template)
    return check


def sample_check_live(pair: ModelPair, prompt: str, settings: Settings, n: int = 1000, top: int = 10,
                      chat_template: bool = True) -> Iterator[str | SampleCheck]:
    """sample_check as it goes: a line of progress after each batched round, then the SampleCheck.
    Closing it (a Stop) ends the work between rounds."""
    if settings.sampling.greedy:
        raise ValueError("the sampling check needs temperature > 0: a greedy run has one outcome")
    if not 1 <= n <= 100_000:
        raise ValueError(f"n must be in [1, 100000], got {n}")
    (ids,) = encode_prompts(pair, [prompt], settings, chat_template)
    p = exact_next_token(pair, ids, settings)
    draws, seconds = {}, {}
    for mode in ("speculative", "baseline"):
        started, rounds = time.perf_counter(), first_tokens(pair, ids, settings, n, mode)
        while mode not in draws:
            try:
                done = next(rounds)
            except StopIteration as finished:
                draws[mode] = finished.value
            else:
                yield f"{'speculative' if mode == 'speculative' else 'target alone'}: {done} of {n} draws"
        seconds[mode] = time.perf_counter() - started
    (spec, tested, kept), (alone, _, _) = draws["speculative"], draws["baseline"]
    spec_counts, alone_counts = Counter(spec), Counter(alone)
    text = TokenTexts.of(pair.tokenizer)
    likeliest = torch.topk(p, min(top, int((p > 0).sum()))).indices.tolist()
    candidates = [Candidate(t, text(t), float(p[t]), spec_counts[t] / n, alone_counts[t] / n) for t in likeliest]
    rest = [Candidate(-1, "(all others)", 1 - sum(c.exact for c in candidates),
                      1 - sum(c.speculative for c in candidates), 1 - sum(c.target_alone for c in candidates))]
    yield SampleCheck(n, candidates + rest, total_variation(spec_counts, p, n), total_variation(alone_counts, p, n),
                      expected_tv(p, n), seconds["speculative"], seconds["baseline"], kept / tested if tested else None)


# --- the same, exactly: one round in closed form -------------------------------------------------


def emitted_distribution(p: torch.Tensor, q: torch.Tensor | list[torch.Tensor], broken: bool = False) -> torch.Tensor:
    """[V]: P(the round emits x first) when d ~ q is kept with min(1, p(d)/q(d)), else x ~ norm(max(0, p − q)).
    q may be a tree's first level, one q per child tried in order (sampling.py): then a rejected child's
    residual is the next child's target, and the last residual the draw. broken: resample from p instead of
    the residual."""
    qs = [q] if isinstance(q, torch.Tensor) else q
    if not qs:
        return p
    kept = qs[0] * acceptance_probability(p, qs[0])
    after = p if broken else residual_distribution(p, qs[0])
    return kept + (1 - kept.sum()) * emitted_distribution(after, qs[1:], broken)


def broken_emitted_distribution(p: torch.Tensor, q: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
    """The same for a rule that, on a rejection, resamples from p instead of the residual."""
    return emitted_distribution(p, q, broken=True)


def kept_mass(p: torch.Tensor, qs: list[torch.Tensor]) -> float:
    """The chance one of the first level's drafts is kept (for a chain, Σ_d q(d) min(1, p(d)/q(d)))."""
    if not qs:
        return 0.0
    kept = float((qs[0] * acceptance_probability(p, qs[0])).sum())
    return kept + (1 - kept) * kept_mass(residual_distribution(p, qs[0]), qs[1:])


@torch.inference_mode()
def first_round_distributions(pair: ModelPair, prompt_ids: list[int], settings: Settings) -> tuple[torch.Tensor,
                                                                                                   list[torch.Tensor]]:
    """(p [V], qs) in float64 for the first token of a run: the target's warped distribution and the q of
    each draft at the first position, in the order the rule tries them (one for a chain, a tree's first
    level; none if nothing is drafted here), set up as `decode` sets it up."""
    drafter = make_drafter(pair, settings, "speculative", len(prompt_ids) + 2)
    state = KVState(pair.target, 1, settings.cache, pair.vocab_size, len(prompt_ids) + 2, False)
    prefill = state.prefill([prompt_ids], pad_id(pair), hidden=drafter.requires_hidden)
    drafter.start([prompt_ids], prefill.hidden)
    params = SamplingParams(0.0) if settings.draft_greedy else settings.sampling
    generator = torch.Generator(device=pair.device).manual_seed(settings.seed)
    (proposal,) = drafter.propose([list(prompt_ids)], [1], params, [generator])
    proposal = proposal.settled().widened()  # the tree's shape on the host; q over the whole vocabulary
    last = torch.tensor([prompt_ids[-1:]], device=pair.device)  # the verify pass's first position
    logits = state.forward(last, torch.ones_like(last, dtype=torch.bool)).logits[0, -1]
    p = logits_to_probs(logits.to("cpu", torch.float64), settings.sampling)  # float64 (mps has none): on the CPU
    return p, [proposal.q[i].to("cpu", torch.float64) for i, parent in enumerate(proposal.tree) if parent < 0]


def exact_check(pair: ModelPair, prompt: str, settings: Settings, chat_template: bool = True) -> ExactCheck:
    """One round of the rule for this prompt and these settings, in closed form (module docstring)."""
    started = time.perf_counter()
    (ids,) = encode_prompts(pair, [prompt], settings, chat_template)
    p, qs = first_round_distributions(pair, ids, settings)
    if not qs:  # no draft: the round is one plain target step, which emits from p itself
        return ExactCheck(False, 0.0, 0.0, 0.0, time.perf_counter() - started)
    emitted, broken = emitted_distribution(p, qs), broken_emitted_distribution(p, qs)
    return ExactCheck(True, float((emitted - p).abs().max()), float((broken - p).abs().max()),
                      kept_mass(p, qs), time.perf_counter() - started)


def float32_recheck(pair: ModelPair, spec: Run) -> Iterator[str | int | None]:
    """A greedy run and its baseline decoded again with `pair` (float32) on the same prompt ids and
    settings: a line of progress per round, then where the texts part (None: identical). Closing it
    ends the work between rounds."""
    if pair.target_name != spec.meta.target:
        raise ValueError(f"the page's model pair is not the one this run used ({spec.meta.target})")
    settings = Settings.of_run(spec.meta, record_top=0, compile=False)
    for update in stream(pair, spec.meta.prompt, settings, compare=True, prompt_ids=spec.meta.prompt_ids):
        if isinstance(update, RoundDone):
            yield f"{update.run.meta.mode}: {update.event.tokens_so_far} tokens"
        elif isinstance(update, Finished):
            yield first_difference(update.spec.token_ids, update.base.token_ids)
