"""How many tokens to draft next round: a fixed γ, or one that adapts as the run goes.

- "fixed": γ every round.
- "grow-shrink": the heuristic of HF's assistant schedule: +2 after a round whose drafts were
  all accepted, -1 after a rejection, within [1, γ_max].
- "expected": each round, the γ that maximises the expected speedup of Leviathan et al. 2023
  (section 3.4) under what this run has measured so far: acceptance, the draft's time per
  token, and the verify pass's time as a line in the number of tokens it checks (verifying
  γ + 1 tokens is not free on a CPU):
      speedup(γ) = E[tokens | γ] / (γ · t_draft + t_verify(γ + 1)).
  Leviathan's E[tokens] assumes every draft is accepted independently with one rate α. Prompt
  lookup breaks that: inside a copied span every draft is accepted, outside it the first one
  fails. So acceptance is measured in two rates, α1 for a round's first draft and α2 for a
  draft whose predecessor was accepted (a two-state Markov chain; α1 = α2 gives Leviathan's):
      E[tokens | γ] = 1 + α1 · (1 - α2^γ) / (1 - α2).
  It starts at the given γ and needs no tuning.
"""

from __future__ import annotations

from typing import Protocol

from .events import RoundEvent
from .theory import expected_tokens_per_round

POLICIES = ("fixed", "grow-shrink", "expected")


class GammaPolicy(Protocol):
    def next_gamma(self) -> int:
        """γ for the coming round (the generator may still cut it to the remaining budget)."""

    def observe(self, event: RoundEvent) -> None:
        """Learn from a finished round."""


class FixedGamma:
    def __init__(self, gamma: int):
        self.gamma = gamma

    def next_gamma(self) -> int:
        return self.gamma

    def observe(self, event: RoundEvent) -> None:
        pass


class GrowShrinkGamma:
    def __init__(self, gamma: int, gamma_max: int):
        self.gamma, self.gamma_max = gamma, gamma_max

    def next_gamma(self) -> int:
        return self.gamma

    def observe(self, event: RoundEvent) -> None:
        if event.gamma == 0:  # nothing was drafted (the budget's last token, or no lookup match)
            return
        if event.n_rejected == 0 and event.n_accepted == event.gamma:
            self.gamma = min(self.gamma + 2, self.gamma_max)
        else:
            self.gamma = max(self.gamma - 1, 1)


class ExpectedSpeedupGamma:
    """Chooses γ from measured acceptance and costs. Priors (one accepted and one rejected draft
    for each rate; verify cost flat in γ) only matter until the run has a few rounds."""

    def __init__(self, gamma: int, gamma_max: int):
        self.gamma, self.gamma_max = gamma, gamma_max
        # [accepted, rejected] for a round's first draft, and for drafts after an accepted one
        self.first, self.later = [1, 1], [1, 1]
        self.drafted, self.draft_ms = 0, 0.0
        # running sums for the verify line: rounds, Σn, Σt, Σn², Σnt (n tokens checked, t ms)
        self.rounds, self.sn, self.st, self.snn, self.snt = 0, 0.0, 0.0, 0.0, 0.0

    def next_gamma(self) -> int:
        if not self.rounds or not self.drafted:
            return self.gamma
        alpha1 = self.first[0] / sum(self.first)
        alpha2 = self.later[0] / sum(self.later)
        t_draft = self.draft_ms / self.drafted
        t0, slope = self._verify_line()

        def speedup(g: int) -> float:
            # 1 + α1 (1 + α2 + ... + α2^(g-1)): the target's token plus the accepted drafts
            tokens = 1.0 + alpha1 * expected_tokens_per_round(alpha2, g - 1)
            return tokens / (g * t_draft + t0 + slope * (g + 1))

        self.gamma = max(range(1, self.gamma_max + 1), key=speedup)
        return self.gamma

    def _verify_line(self) -> tuple[float, float]:
        """Least-squares t_verify(n) = t0 + slope * n over the rounds so far (slope >= 0)."""
        mean_n, mean_t = self.sn / self.rounds, self.st / self.rounds
        var = self.snn - self.rounds * mean_n**2
        slope = max(0.0, (self.snt - self.rounds * mean_n * mean_t) / var) if var > 1e-9 else 0.0
        return max(mean_t - slope * mean_n, 1e-6), slope

    def observe(self, event: RoundEvent) -> None:
        accepted, rejected = event.n_accepted, event.n_rejected  # an accepted prefix, then ≤ 1 rejection
        if accepted:
            self.first[0] += 1
            self.later[0] += accepted - 1
        if rejected:
            (self.later if accepted else self.first)[1] += 1
        if event.gamma:
            self.drafted += event.gamma
            self.draft_ms += event.draft_ms
        n, t = event.gamma + 1, event.verify_ms
        self.rounds += 1
        self.sn, self.st, self.snn, self.snt = self.sn + n, self.st + t, self.snn + n * n, self.snt + n * t


def make_policy(name: str, gamma: int, gamma_max: int) -> GammaPolicy:
    if name == "fixed":
        return FixedGamma(gamma)
    if name == "grow-shrink":
        return GrowShrinkGamma(gamma, gamma_max)
    if name == "expected":
        return ExpectedSpeedupGamma(gamma, gamma_max)
    raise ValueError(f"gamma policy must be one of {', '.join(POLICIES)}; got {name!r}")
