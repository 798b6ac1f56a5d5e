"""Speculative decoding, one round at a time, and the plain autoregressive baseline.

Leviathan et al. 2023, Algorithm 1, with a KV cache on both sides. Each round:
  1. the drafter proposes d_1..d_γ with q_1..q_γ             (drafters.py)
  2. one target forward over [x_last, d_1..d_γ] gives p_1..p_{γ+1}
  3. the acceptance rule keeps n of them and adds a correction or a bonus token (sampling.py)
  4. both caches are cropped back to the kept prefix.
Both generators are Python generators of `RoundEvent`s (events.py), so a consumer can render
each round as it happens, and stop (cancel) between rounds by closing the generator.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import transformers
from transformers import DynamicCache

from .drafters import Drafter, DraftModelDrafter, PromptLookupDrafter, model_logits
from .events import (
    ACCEPTED,
    BONUS,
    CORRECTION,
    REJECTED,
    TARGET,
    UNVERIFIED,
    DraftedToken,
    ExtraToken,
    RoundEvent,
    Run,
    RunMeta,
    TopToken,
)
from .models import ModelPair, encode_prompt
from .sampling import SamplingParams, accept_or_resample, logits_to_probs, residual_distribution, sample
from .schedules import POLICIES, make_policy

MAX_GAMMA = 32
MAX_NEW_TOKENS = 4096
MAX_SEED = 2**63 - 1
DRAFTERS = ("model", "lookup")  # the pair's draft model, or prompt lookup (n-gram copying)


@dataclass(frozen=True)
class Settings:
    """Everything a run depends on besides the models and the prompt."""

    gamma: int = 4  # tokens drafted per round; where a policy adapts it, the first round's
    gamma_policy: str = "fixed"  # "fixed" | "grow-shrink" | "expected" (schedules.py)
    gamma_max: int = 16  # the most an adaptive policy may draft
    drafter: str = "model"  # "model" | "lookup"
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    max_new_tokens: int = 64
    record_top: int = 8  # candidates per drafted position kept for the inspector (0: none)

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p)

    def validate(self) -> None:
        """ValueError before any model work, so nothing is left half-done."""

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not is_int(self.gamma) or not 1 <= self.gamma <= MAX_GAMMA:
            raise ValueError(f"gamma (draft length) must be an integer in [1, {MAX_GAMMA}], got {self.gamma!r}")
        if not is_int(self.gamma_max) or not self.gamma <= self.gamma_max <= MAX_GAMMA:
            raise ValueError(f"gamma_max must be an integer in [gamma, {MAX_GAMMA}], got {self.gamma_max!r}")
        if self.gamma_policy not in POLICIES:
            raise ValueError(f"gamma_policy must be one of {', '.join(POLICIES)}, got {self.gamma_policy!r}")
        if self.drafter not in DRAFTERS:
            raise ValueError(f"drafter must be one of {', '.join(DRAFTERS)}, got {self.drafter!r}")
        if not is_int(self.max_new_tokens) or not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS:
            raise ValueError(
                f"max_new_tokens must be an integer in [1, {MAX_NEW_TOKENS}], got {self.max_new_tokens!r}"
            )
        if not is_int(self.seed) or not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be an integer in [0, 2**63 - 1], got {self.seed!r}")
        if not is_int(self.record_top) or self.record_top < 0:
            raise ValueError(f"record_top must be an integer >= 0, got {self.record_top!r}")
        self.sampling.validate()


def validate_prompt(prompt: str) -> None:
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("the prompt is empty: type something for the model to continue")


def check_fits(pair: ModelPair, prompt_ids: list[int], settings: Settings) -> None:
    """ValueError if prompt + new tokens (+ a draft's overshoot) exceed either model's context."""
    limits = [getattr(m.config, "max_position_embeddings", None) for m in (pair.target, pair.draft)]
    limit = min((n for n in limits if n), default=None)
    gamma = settings.gamma if settings.gamma_policy == "fixed" else settings.gamma_max
    need = len(prompt_ids) + settings.max_new_tokens + gamma
    if limit is not None and need > limit:
        raise ValueError(f"the prompt is {len(prompt_ids)} tokens; with {settings.max_new_tokens} new tokens and "
                         f"γ = {gamma} that needs {need} positions, more than the models' {limit}")


class TokenTexts:
    """Decoded text of single token ids, memoised (decode is the slow part of an event)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode([token_id])
        return text


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seeded_generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _top_tokens(p_row, q_row, residual_row, drafted_id, k, text) -> list[TopToken]:
    """The union of the k most likely tokens under p and under q, and the drafted one."""
    ids = set(torch.topk(p_row, k).indices.tolist()) | set(torch.topk(q_row, k).indices.tolist())
    ids.add(drafted_id)
    ordered = sorted(ids, key=lambda i: -float(p_row[i] + q_row[i]))
    return [
        TopToken(i, text(i), float(p_row[i]), float(q_row[i]),
                 None if residual_row is None else float(residual_row[i]))
        for i in ordered
    ]


def speculative_round(
    target,
    target_cache: DynamicCache,
    drafter: Drafter,
    ids: torch.Tensor,
    gamma: int,
    params: SamplingParams,
    vocab_size: int,
    generator: torch.Generator,
):
    """One round. ids: [1, L], the sequence so far; the target cache holds ids[:, :-1].

    Returns (proposal, p_logits [g+1, V], p [g+1, V], verdict, draft_s, verify_s), where g <= γ
    is what the drafter proposed (g = 0: a plain target step). The target cache then holds
    L + g entries; the caller crops it once it knows where the run stops.
    """
    device = ids.device
    t0 = time.perf_counter()
    proposal = drafter.propose(ids, gamma, params, generator)  # d: [γ], q: [γ, V]
    _sync(device)
    t1 = time.perf_counter()
    verify_ids = torch.cat([ids[:, -1:], proposal.tokens.view(1, -1)], dim=1)  # [1, g+1]
    p_logits = model_logits(target, verify_ids, target_cache, vocab_size)  # [g+1, V]
    p = logits_to_probs(p_logits, params)  # p_i = p(. | x, d_<i), i = 1..g+1
    verdict = accept_or_resample(p, proposal.q, proposal.tokens, generator, greedy=params.greedy)
    t2 = time.perf_counter()
    return proposal, p_logits, p, verdict, t1 - t0, t2 - t1


def _versions() -> dict[str, str]:
    return {"torch": torch.__version__, "transformers": transformers.__version__}


def make_meta(pair: ModelPair, mode: str, prompt: str, prompt_ids: list[int], settings: Settings) -> RunMeta:
    return RunMeta(
        mode=mode,
        target=pair.target_name,
        draft=(pair.draft_name if settings.drafter == "model" else PromptLookupDrafter.name)
        if mode == "speculative" else None,
        dtype=str(pair.dtype).removeprefix("torch."),
        device=str(pair.device),
        gamma=settings.gamma if mode == "speculative" else 0,
        gamma_policy=settings.gamma_policy if mode == "speculative" else "fixed",
        gamma_max=settings.gamma_max if mode == "speculative" and settings.gamma_policy != "fixed" else 0,
        temperature=settings.temperature,
        top_k=settings.top_k,
        top_p=settings.top_p,
        seed=settings.seed,
        max_new_tokens=settings.max_new_tokens,
        prompt=prompt,
        prompt_ids=list(prompt_ids),
        vocab_size=pair.vocab_size,
        draft_note=pair.draft_note if mode == "speculative" and settings.drafter == "model" else "",
        versions=_versions(),
    )


@torch.inference_mode()
def speculative_events(
    pair: ModelPair,
    prompt_ids: list[int],
    settings: Settings,
    meta: RunMeta | None = None,
    drafter: Drafter | None = None,
    target_cache: DynamicCache | None = None,
) -> Iterator[RoundEvent]:
    """Yield one RoundEvent per round until EOS or max_new_tokens. Fills meta.prefill_ms.

    drafter and target_cache default to new ones; pass your own to look at them between rounds.
    """
    settings.validate()
    params, device, V = settings.sampling, pair.device, pair.vocab_size
    text = TokenTexts(pair.tokenizer)
    drafter = drafter or make_drafter(pair, settings)
    policy = make_policy(settings.gamma_policy, settings.gamma, settings.gamma_max)
    generator = _seeded_generator(device, settings.seed)
    ids = torch.tensor([prompt_ids], device=device)  # [1, L]

    start = time.perf_counter()
    if target_cache is None:
        target_cache = DynamicCache(config=pair.target.config)
    if ids.shape[1] > 1:  # the target cache always holds all but the last token
        model_logits(pair.target, ids[:, :-1], target_cache, V, last_only=True)
    drafter.start(ids)
    _sync(device)
    if meta is not None:
        meta.prefill_ms = 1000 * (time.perf_counter() - start)

    generated, index = 0, 0
    while generated < settings.max_new_tokens:
        remaining = settings.max_new_tokens - generated
        # Never draft past the budget: n kept + 1 added <= remaining.
        gamma = min(policy.next_gamma(), remaining - 1)
        if gamma == 0:
            event, new = _target_step(pair, ids, target_cache, params, generator, text, index)
            event.draft_cache_len = drafter.cache_len
        else:
            proposal, p_logits, p, verdict, draft_s, verify_s = speculative_round(
                pair.target, target_cache, drafter, ids, gamma, params, V, generator
            )
            gamma = proposal.tokens.shape[0]  # the drafter may propose fewer
            drafted_ids = proposal.tokens.tolist()
            n, stop_at = kept_drafts(verdict.n_accepted, drafted_ids, pair.eos_token_ids)
            # Roll back: the target cache holds L + γ, keep the new sequence minus its last token.
            target_cache.crop(-(gamma - n) if stop_at is None else -(gamma - n + 1))
            drafter.verified(n)

            drafted, extra = _round_tokens(proposal, p_logits, p, verdict, n, stop_at, params, settings.record_top,
                                           text)
            new = drafted_ids[:n] + ([extra.id] if extra else [])
            event = RoundEvent(
                index=index, gamma=gamma, drafted=drafted, extra=extra, n_accepted=n,
                draft_ms=1000 * draft_s, verify_ms=1000 * verify_s,
                target_cache_len=0, draft_cache_len=drafter.cache_len,
                tokens_so_far=0, elapsed_ms=0.0,
            )
        ids = torch.cat([ids, torch.tensor([new], device=device)], dim=1)
        generated += len(new)
        index += 1
        event.target_cache_len = target_cache.get_seq_length()
        event.tokens_so_far = generated
        event.elapsed_ms = 1000 * (time.perf_counter() - start)
        event.finish_reason = finish_reason(new, generated, settings.max_new_tokens, pair.eos_token_ids)
        policy.observe(event)
        yield event
        if event.finish_reason:
            return


def kept_drafts(n_accepted: int, drafted_ids: list[int], eos_ids) -> tuple[int, int | None]:
    """(drafts kept, index of an accepted EOS or None): an accepted EOS ends the text there."""
    stop_at = next((i for i in range(n_accepted) if drafted_ids[i] in eos_ids), None)
    return (n_accepted if stop_at is None else stop_at + 1), stop_at


def finish_reason(new: list[int], generated: int, max_new_tokens: int, eos_ids) -> str | None:
    """'eos' if this round's new tokens hold an EOS, 'length' at the budget, else None."""
    if any(t in eos_ids for t in new):
        return "eos"
    return "length" if generated >= max_new_tokens else None


def make_drafter(pair: ModelPair, settings: Settings) -> Drafter:
    if settings.drafter == "lookup":
        return PromptLookupDrafter(pair.vocab_size)
    return DraftModelDrafter(pair.draft, pair.vocab_size)


def _round_tokens(proposal, p_logits, p, verdict, n, stop_at, params, record_top, text):
    """The round's drafted tokens and its correction or bonus token, as events.

    What the viewer sees is the rule's p and q, or the plain softmax when greedy.
    """
    gamma = proposal.tokens.shape[0]
    if params.greedy:
        p_show = p_logits.softmax(-1)
        q_show = proposal.logits.softmax(-1) if proposal.logits is not None else proposal.q
    else:
        p_show, q_show = p, proposal.q
    rows = torch.arange(gamma, device=p.device)
    p_d = p_show[rows, proposal.tokens].tolist()
    q_d = q_show[rows, proposal.tokens].tolist()
    drafted = []
    for i, tok in enumerate(proposal.tokens.tolist()):
        status = ACCEPTED if i < n else REJECTED if i == n and stop_at is None else UNVERIFIED
        top = []
        if record_top:
            rejected_sampled = status == REJECTED and not params.greedy
            residual = residual_distribution(p[i], proposal.q[i]) if rejected_sampled else None
            top = _top_tokens(p_show[i], q_show[i], residual, tok, record_top, text)
        u = verdict.u[i] if status != UNVERIFIED else None
        drafted.append(DraftedToken(tok, text(tok), q_d[i], p_d[i], verdict.accept_probs[i], u, status, top))
    extra = None
    if stop_at is None:
        nt = verdict.next_token
        q_extra = float(q_show[n, nt]) if n < gamma else None
        kind = CORRECTION if n < gamma else BONUS if gamma else TARGET  # nothing drafted: a plain step
        extra = ExtraToken(nt, text(nt), kind, float(p_show[n, nt]), q_extra)
    return drafted, extra


def _target_step(pair, ids, target_cache, params, generator, text, index):
    """One plain target step on ids[:, -1:] (the cache holds the rest): a baseline event."""
    t0 = time.perf_counter()
    logits = model_logits(pair.target, ids[:, -1:], target_cache, pair.vocab_size)[-1]  # [V]
    token = _draw(logits, params, generator)
    t1 = time.perf_counter()
    shown = logits.softmax(-1) if params.greedy else logits_to_probs(logits, params)
    extra = ExtraToken(token, text(token), TARGET, float(shown[token]))
    event = RoundEvent(
        index=index, gamma=0, drafted=[], extra=extra, n_accepted=0, draft_ms=0.0,
        verify_ms=1000 * (t1 - t0), target_cache_len=0, draft_cache_len=0, tokens_so_far=0, elapsed_ms=0.0,
    )
    return event, [token]


def _draw(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    if params.greedy:
        return int(logits.argmax())
    return int(sample(logits_to_probs(logits, params), generator))


@torch.inference_mode()
def baseline_events(
    pair: ModelPair, prompt_ids: list[int], settings: Settings, meta: RunMeta | None = None
) -> Iterator[RoundEvent]:
    """Plain autoregressive decoding with the target alone: one event per token, same shape."""
    settings.validate()
    params, device = settings.sampling, pair.device
    text = TokenTexts(pair.tokenizer)
    generator = _seeded_generator(device, settings.seed)
    ids = torch.tensor([prompt_ids], device=device)

    start = time.perf_counter()
    target_cache = DynamicCache(config=pair.target.config)
    if ids.shape[1] > 1:
        model_logits(pair.target, ids[:, :-1], target_cache, pair.vocab_size, last_only=True)
    _sync(device)
    if meta is not None:
        meta.prefill_ms = 1000 * (time.perf_counter() - start)
    for index in range(settings.max_new_tokens):
        event, new = _target_step(pair, ids, target_cache, params, generator, text, index)
        ids = torch.cat([ids, torch.tensor([new], device=device)], dim=1)
        event.target_cache_len = target_cache.get_seq_length()
        event.tokens_so_far = index + 1
        event.elapsed_ms = 1000 * (time.perf_counter() - start)
        event.finish_reason = finish_reason(new, index + 1, settings.max_new_tokens, pair.eos_token_ids)
        yield event
        if event.finish_reason:
            return


def generate(
    pair: ModelPair,
    prompt: str,
    settings: Settings,
    mode: str = "speculative",
    chat_template: bool = True,
    prompt_ids: list[int] | None = None,
) -> Run:
    """Run to the end and return the whole Run (events plus the decoded text)."""
    settings.validate()
    if prompt_ids is None:
        validate_prompt(prompt)
        prompt_ids = encode_prompt(pair.tokenizer, prompt, chat_template)
    check_fits(pair, prompt_ids, settings)
    if mode not in ("speculative", "baseline"):
        raise ValueError(f"mode must be 'speculative' or 'baseline', got {mode!r}")
    run = Run(make_meta(pair, mode, prompt, prompt_ids, settings))
    events = (speculative_events if mode == "speculative" else baseline_events)(pair, prompt_ids, settings, run.meta)
    run.events.extend(events)
    run.text = pair.tokenizer.decode(run.token_ids, skip_special_tokens=True)
    return run
