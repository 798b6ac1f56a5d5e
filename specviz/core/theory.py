"""The expected-speedup formulas of Leviathan et al. 2023 (section 3.4), and c from a run.

alpha: the mean probability that a drafted token is accepted; gamma: tokens drafted per round;
c: the cost of one draft step over one target step.
"""

from __future__ import annotations

from statistics import median

from .events import Run


def expected_tokens_per_round(alpha: float, gamma: int) -> float:
    """E[tokens per round] = (1 - α^(γ+1)) / (1 - α)."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def speedup_bound(alpha: float, gamma: int, c: float) -> float:
    """Expected walltime improvement (1 - α^(γ+1)) / ((1 - α)(γc + 1)), verification costing one step."""
    return expected_tokens_per_round(alpha, gamma) / (gamma * c + 1.0)


def target_step_ms(spec: Run, baseline: Run | None = None) -> float | None:
    """One target step: the baseline's median step if there is one, else the median verify pass."""
    source = baseline.events[1:] if baseline and len(baseline.events) > 1 else spec.events
    times = [e.verify_ms for e in source]
    return median(times) if times else None


def cost_ratio(spec: Run, baseline: Run | None = None) -> float | None:
    """c = draft time per drafted token / target step time, both measured in the run(s)."""
    drafted = sum(e.gamma for e in spec.events)
    step = target_step_ms(spec, baseline)
    if not drafted or not step:
        return None
    return sum(e.draft_ms for e in spec.events) / drafted / step
