"""Logits to distributions, and the speculative-sampling acceptance rule.

The rule follows Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative
Decoding", Algorithm 1) and Chen et al. 2023 ("Accelerating LLM Decoding with Speculative
Sampling"): a drafted token d drawn from q is kept with probability min(1, p(d) / q(d)); on
rejection the replacement is drawn from norm(max(0, p - q)). The output is then distributed
exactly as p, provided p and q were warped (temperature, top-k, top-p) the same way, which is why
one function, `logits_to_probs`, makes both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How logits become a distribution. temperature 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0  # 1.0: no nucleus cut

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise ValueError on parameters no sampler accepts."""
        t, k, p = self.temperature, self.top_k, self.top_p
        if not isinstance(t, (int, float)) or math.isnan(t) or t < 0 or math.isinf(t):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {k!r}")
        if not isinstance(p, (int, float)) or math.isnan(p) or not 0.0 < p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {p!r}")


def at_least_float32(t: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 -> float32 for the maths; float32 and float64 stay as they are."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] in float32 (float64 stays float64).

    Greedy gives the one-hot distribution of the argmax, so that the acceptance rule below
    reduces to "keep the draft while it equals the target's argmax". Otherwise the order is
    HF's: temperature, then top-k, then top-p (keep the smallest set of tokens whose mass
    reaches top_p; the most likely token always stays).
    """
    logits = at_least_float32(logits)
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # mass strictly before each token; drop a token once that mass already reaches top_p
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, -math.inf)
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """probs [..., V] -> token ids [...], drawn with the given generator (seeded runs repeat)."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


@dataclass
class Verdict:
    """What the rule decided for one round of γ drafted tokens."""

    n_accepted: int  # drafted tokens kept, 0..γ
    next_token: int  # the correction (n_accepted < γ) or the bonus token (n_accepted == γ)
    accept_probs: list[float]  # min(1, p(d_i) / q(d_i)) for each drafted token, length γ
    u: list[float | None]  # the uniform draw each tested token got; None where none was drawn


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) over the last axis: where a rejected draft's replacement comes from.

    The rule only rejects where q(d) > p(d), so the mass is positive there; if p == q to the
    last bit it is not, and p itself is the right answer (the rule could not have rejected).
    """
    residual = (p - q).clamp_min(0.0)
    mass = residual.sum(-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp_min(1e-30), p)


def acceptance_probability(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """min(1, p(d) / q(d)), elementwise: the chance a token d drawn from q is kept."""
    return (p / q.clamp_min(1e-30)).clamp_max(1.0)


def accept_or_resample(
    p: torch.Tensor,
    q: torch.Tensor,
    draft: torch.Tensor,
    generator: torch.Generator | None,
    greedy: bool = False,
) -> Verdict:
    """One round of the rule. p: target [γ+1, V], q: draft [γ, V], draft: ids [γ].

    For i = 1..γ: draw u_i ~ U[0, 1) and keep d_i if u_i < min(1, p_i(d_i) / q_i(d_i)); at the
    first rejection draw the replacement from norm(max(0, p_i - q_i)) and stop; if all γ are
    kept, draw the bonus token from p_{γ+1}. Greedy (one-hot p and q) needs no draws: a token is
    kept exactly when it is the target's argmax, and the replacement is that argmax.
    """
    gamma = draft.shape[0]
    positions = torch.arange(gamma, device=draft.device)
    p_d = p[positions, draft]  # [γ] p_i(d_i)
    q_d = q[positions, draft]  # [γ] q_i(d_i) > 0, since d_i was drawn from q_i
    accept_probs = acceptance_probability(p_d, q_d)
    if greedy:
        kept = accept_probs >= 1.0
        u_all: list[float | None] = [None] * gamma
    else:
        u = torch.rand(gamma, generator=generator, device=draft.device)
        kept = u < accept_probs
        u_all = u.tolist()
    kept_list = kept.tolist()
    n_accepted = kept_list.index(False) if False in kept_list else gamma
    u_used = [u_all[i] if i <= n_accepted else None for i in range(gamma)]
    if n_accepted < gamma:
        if greedy:
            next_token = int(p[n_accepted].argmax())
        else:
            residual = residual_distribution(p[n_accepted], q[n_accepted])
            next_token = int(sample(residual, generator))
    else:
        next_token = int(p[gamma].argmax()) if greedy else int(sample(p[gamma], generator))
    return Verdict(n_accepted, next_token, accept_probs.tolist(), u_used)
