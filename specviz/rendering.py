"""Turning rounds into coloured text: ANSI for the terminal, plain markup elsewhere."""

from __future__ import annotations

from .events import BONUS, CORRECTION, REJECTED, RoundEvent, Run

# ANSI SGR: green, red + strike-through, blue, magenta
_ANSI = {"accepted": "32", REJECTED: "31;9", CORRECTION: "34", BONUS: "35"}
# Without colour, the kinds are told apart by brackets.
_PLAIN = {"accepted": ("", ""), REJECTED: ("[-", "-]"), CORRECTION: ("{", "}"), BONUS: ("<", ">")}


def _paint(text: str, kind: str, colour: bool) -> str:
    if colour:
        return f"\x1b[{_ANSI[kind]}m{text}\x1b[0m" if kind in _ANSI else text
    before, after = _PLAIN.get(kind, ("", ""))
    return f"{before}{text}{after}"


def legend(colour: bool) -> str:
    kinds = [("accepted", "accepted"), ("rejected", REJECTED), ("correction", CORRECTION), ("bonus", BONUS)]
    return "  ".join(_paint(name, kind, colour) for name, kind in kinds)


def round_text(event: RoundEvent, colour: bool) -> str:
    """Accepted and rejected drafts, then the correction or bonus token. Untested drafts after
    a rejection are not shown: they never reached the text."""
    parts = [_paint(t.text, t.status, colour) for t in event.drafted if t.status in ("accepted", REJECTED)]
    if event.extra is not None:
        parts.append(_paint(event.extra.text, event.extra.kind, colour))
    return "".join(parts)


def run_text(run: Run, colour: bool) -> str:
    return "".join(round_text(e, colour) for e in run.events)


def summary(run: Run) -> str:
    lines = [f"{run.meta.mode}: {run.n_tokens} tokens in {run.decode_ms / 1000:.2f} s, {run.tokens_per_s:.1f} tokens/s"]
    if run.meta.mode == "speculative":
        alpha = run.acceptance_rate
        lines.append(
            f"  acceptance rate {'n/a' if alpha is None else f'{alpha:.1%}'} "
            f"({run.n_accepted} accepted, {run.n_rejected} rejected of {run.n_drafted} drafted), "
            f"{run.tokens_per_round:.2f} tokens per round over {len(run.events)} rounds (γ = {run.meta.gamma})"
        )
    return "\n".join(lines)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token, or None if the sequences are equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
