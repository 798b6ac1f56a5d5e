"""Turning rounds into coloured text: ANSI for the terminal, plain markup, and HTML for the app."""

from __future__ import annotations

import html
import math
import re
from statistics import median

from ..core.events import BONUS, CORRECTION, REJECTED, ExactCheck, RoundEvent, Run
from .stages import verdict

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


def count(n: int, noun: str = "token") -> str:
    """'1 token', '2 tokens': a count with its noun."""
    return f"{n:,} {noun}{'s' * (n != 1)}"


def run_text(run: Run, colour: bool) -> str:
    return "".join(round_text(e, colour) for e in run.events)


def summary(run: Run) -> str:
    lines = [f"{run.meta.mode}: {count(run.n_tokens)} in {run.decode_ms / 1000:.2f} s, {run.tokens_per_s:.1f} tokens/s"]
    if run.meta.mode == "speculative":
        alpha = run.acceptance_rate
        lines.append(
            f"  acceptance rate {'n/a' if alpha is None else f'{alpha:.1%}'} "
            f"({run.n_accepted} accepted, {run.n_rejected} rejected"
            f"{f', {run.n_untested} not reached' if run.n_untested else ''} of {run.n_drafted} drafted), "
            f"{run.tokens_per_round:.2f} tokens per round over {count(len(run.events), 'round')} ({gamma_label(run)})"
            + (f", {run.copied_rounds} of them drafted by prompt lookup" if run.copied_rounds else "")
        )
    stages = run.mean_stages()
    lines.append(f"  time: prefill {run.meta.prefill_ms:.0f} ms; a round {sum(stages.values()):.2f} ms: "
                 + ", ".join(f"{STAGE_NAMES[name]} {ms:.2f}" for name, ms in stages.items()))
    return "\n".join(lines)


def gamma_label(run: Run) -> str:
    """'γ = 4', or the policy and the γ it used when γ adapts."""
    if run.meta.gamma_policy == "fixed":
        return f"γ = {run.meta.gamma}"
    gammas = [e.gamma for e in run.events] or [run.meta.gamma]
    return (f"γ {run.meta.gamma_policy}: mean {run.mean_gamma:.1f}, from {min(gammas)} to {max(gammas)}, "
            f"cap {run.meta.gamma_max}")


def batch_summary(runs: list[Run], seconds: float) -> str:
    """A batch's throughput: every row's tokens over the batch's wall time."""
    tokens = sum(r.n_tokens for r in runs)
    rows = ", ".join(f"[{i + 1}] {'n/a' if r.acceptance_rate is None else f'{r.acceptance_rate:.0%}'}"
                     for i, r in enumerate(runs))
    return (f"batch of {len(runs)}: {tokens} tokens in {seconds:.2f} s, {tokens / seconds:.1f} tokens/s; "
            f"acceptance per row: {rows}")


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token, or None if the sequences are equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# --- HTML (the web app) ----------------------------------------------------------------------
# Token text is untrusted model output: every piece goes through html.escape.

CSS = """
#sv-corrected { position: fixed; top: 12px; left: 50%; transform: translateX(-50%); z-index: 1000; padding: 10px 18px;
  background: #fff3cd; color: #5c4400; border: 1px solid #e0c36b; border-radius: 6px; font-size: 16px; }
.sv-projector #sv-corrected { font-size: 28px; }
/* Gradio shows a waiting page's place in the queue over the status box, in a wrapper as high as the box: before a
   first run the box is empty, and the place had no height at all. It gets a line of its own, in the page's type */
#status .wrap.minimal { position: static !important; height: auto !important; overflow: visible !important;
  justify-content: flex-start !important; }
#status .progress-text, #status .sv-queue { font-size: 16px; background: #fff3cd; color: #5c4400; padding: 4px 10px;
  border-radius: 4px; }
#status .sv-hidden { display: none !important; }  /* Gradio's "queue: 1/2 | …", said in words beside it (page script) */
body.sv-projector #status, body.sv-projector #status .progress-text,
body.sv-projector #status .sv-queue { font-size: 26px !important; }
#sv-wait .sv-note { font-size: 16px; } body.sv-projector #sv-wait .sv-note { font-size: 26px !important; }
#sv-wait:not(:has(.sv-note)) { display: none; }  /* no line, no room: the run stays on the first screen */
/* the controls' own text larger too; their labels keep their size, as they would wrap and push the run off the
   first screen */
body.sv-projector button, body.sv-projector textarea, body.sv-projector input { font-size: 20px !important; }
.sv-stream { font-family: ui-monospace, monospace; white-space: pre-wrap; line-height: 1.9; font-size: 15px; }
.sv-tok { border-radius: 3px; padding: 1px 0; cursor: help; }
.sv-accepted { background: #d9f2e1; color: #145a32; }
.sv-rejected { background: #fadbd8; color: #922b21; text-decoration: line-through; }
.sv-correction { background: #d6e6f5; color: #1a4f80; }
.sv-bonus { background: #eadcf3; color: #5b2c6f; }
.sv-target { background: #eeeeee; color: #222; }
.sv-diff { outline: 2px solid #f39c12; }
.sv-special { font-size: 0.75em; border: 1px solid currentColor; border-radius: 3px; padding: 0 2px;
              text-decoration: none; display: inline-block; }
.sv-round { color: #aaa; font-size: 11px; padding: 0 2px; user-select: none; }
.sv-legend { line-height: 2; }
.sv-legend span { margin-right: 6px; padding: 2px 6px; display: inline-block; white-space: nowrap; }
.sv-legend .sv-heading { padding-left: 0; }
.sv-stats td { padding: 2px 10px 2px 0; }
.sv-split { margin-top: 10px; max-width: 720px; }
.sv-split-head { font-weight: 600; margin-bottom: 4px; }
.sv-split-label { font-size: 13px; color: #444; margin-top: 4px; }
.sv-split-bar { display: flex; height: 22px; background: #f6f6f6; border-radius: 3px; overflow: hidden; }
.sv-part { display: inline-block; flex: none; font-size: 11px; line-height: 22px; color: #fff; overflow: hidden;
           white-space: nowrap; text-align: center; }
.sv-split-keys { margin-top: 6px; line-height: 2; }
.sv-split-keys .sv-key { padding: 0 6px; border-radius: 3px; margin-right: 4px; }
/* a round's parts (not .sv-stage: that is the stepped round's view) */
.sv-part-draft { background: #8e44ad; } .sv-part-verify { background: #2e86c1; }
.sv-part-judge { background: #d68910; } .sv-part-record { background: #7f8c8d; }
.sv-part-rest { background: #c0392b; }
.sv-projector .sv-split-label, .sv-projector .sv-split-head { font-size: 22px; }
.sv-error { color: #922b21; background: #fdedec; padding: 8px; border-radius: 4px; }
.sv-batch-row { border-left: 3px solid #ddd; padding: 4px 10px; margin: 8px 0; }
.sv-batch-head { font-size: 13px; color: #555; margin-bottom: 4px; }
.sv-note { color: #7d6608; background: #fef9e7; padding: 6px; border-radius: 4px; }
.sv-race-row { font-family: ui-monospace, monospace; white-space: pre-wrap; margin: 6px 0; }
.sv-race-row .sv-tok { opacity: 0; animation: sv-appear 0.01s forwards; }
@keyframes sv-appear { to { opacity: 1; } }
.sv-stage-caption { font-weight: 600; margin-bottom: 6px; white-space: normal; }
#stage-view { overflow-x: auto; }
/* in projector type the round's table takes the row and the tree goes under it: side by side at 1280x720 the
   tree covered the table's last columns */
body.sv-projector div:has(> #stage-view) { flex-wrap: wrap; }
body.sv-projector #stage-view, body.sv-projector #chart-tree { flex: 1 1 100% !important; min-width: 100% !important; }
.sv-stage-table { border-collapse: collapse; font-family: ui-monospace, monospace; font-size: 14px; }
.sv-stage-table th, .sv-stage-table td { border: 1px solid #ddd; padding: 3px 8px; text-align: center; }
.sv-stage-table th:first-child { text-align: right; color: #555; font-weight: 500; }
.sv-stage-table td.sv-cur { outline: 3px solid #f39c12; }
.sv-how li { margin: 3px 0; color: #444; }
.sv-how li.sv-now { background: #fef5e7; border-left: 4px solid #f39c12; padding-left: 6px; color: #000; }
body.sv-projector .sv-stream, body.sv-projector .sv-stream .sv-tok, body.sv-projector .sv-race-row {
  font-size: 28px; line-height: 1.7; }
/* at 1280x720 a round's stream, table and tree share one screen: the table's rows are the tallest of the three */
body.sv-projector .sv-stage-table th, body.sv-projector .sv-stage-table td { font-size: 21px; padding: 1px 8px; }
.sv-projector .sv-how, .sv-projector .sv-stats { font-size: 22px; }
.sv-projector .sv-stage-caption { font-size: 20px; }
/* Plotly places a legend's entries by its own text widths: larger legend text would run entries into each other */
.sv-projector .js-plotly-plot text:not(.legendtext) { font-size: 18px !important; }
"""

_KIND_CLASS = {"accepted": "sv-accepted", REJECTED: "sv-rejected", CORRECTION: "sv-correction",
               BONUS: "sv-bonus", "target": "sv-target"}


def _fmt(x: float | None) -> str:
    return "–" if x is None else f"{x:.4f}"


# a tokenizer's control tokens as their text reads them (<|im_end|>, <|endoftext|>, </s>): drawn as a small badge
# naming what they are, not as markup, which a viewer reads as garbled text (and, struck through, as noise)
SPECIAL = re.compile(r"<\|([^|<>]{1,40})\|>|</?s>")


def shown(text: str) -> str:
    """A token's text as HTML: control tokens as badges (⟨im_end⟩), a line break with a ⏎ before it."""
    if "<" not in text and "\n" not in text:  # nearly every token: the page draws every token at every update
        return html.escape(text)
    out, at = [], 0
    for match in SPECIAL.finditer(text):
        out.append(html.escape(text[at:match.start()]))
        name = match.group(1) or ("end" if match.group(0) == "</s>" else "start")
        out.append(f'<span class="sv-special">⟨{html.escape(name)}⟩</span>')
        at = match.end()
    out.append(html.escape(text[at:]))
    return "".join(out).replace("\n", "⏎\n")


def _span(text: str, kind: str, title: str, extra_class: str = "", style: str = "") -> str:
    cls = f"sv-tok {_KIND_CLASS[kind]} {extra_class}".strip()
    style_attr = f' style="{style}"' if style else ""
    return f'<span class="{cls}" title="{html.escape(title)}"{style_attr}>{shown(text)}</span>'


SPECULATIVE_KINDS = (("accepted draft", "accepted"), ("rejected draft", REJECTED), ("correction", CORRECTION),
                     ("bonus", BONUS))
BASELINE_KINDS = (("baseline token", "target"),)


def legend_html(heading: str, kinds: tuple[tuple[str, str], ...]) -> str:
    """A stream's heading (HTML) and the colours of the kinds of token it shows, (name, kind) pairs."""
    return (f'<div class="sv-legend"><span class="sv-heading">{heading}</span>'
            + "".join(_span(n, k, n) for n, k in kinds) + "</div>")


def stream_html(run: Run | None, show_rounds: bool = False, diff_at: int | None = None) -> str:
    """The token stream, one span per token; hover shows p, q and the test that kept or rejected it."""
    if run is None or not run.events:
        return '<div class="sv-stream"></div>'
    parts, position, greedy = [], 0, run.meta.sampling.greedy
    for e in run.events:
        if show_rounds:
            parts.append(f'<span class="sv-round">│{e.index + 1}</span>')
        depths = e.depths
        for i, t in enumerate(e.drafted):
            if t.status not in ("accepted", REJECTED):
                continue
            by = " (copied by prompt lookup)" if e.drafted_by == "lookup" else ""
            # greedy keeps a draft when it is the target's argmax: p/q is shown as what it is, not as that verdict;
            # a sampled tree's sibling is kept with its chance less what the ones tried before it took, not min(1, p/q)
            test = (f"p/q = {_fmt(t.p / t.q if t.q else None)}\ngreedy: {verdict(t.status)}, "
                    f"{'the' if t.accepted else 'not the'} target's most likely token" if greedy else
                    f"{'chance kept' if e.parents else 'min(1, p/q)'} = {_fmt(t.accept_prob)}  u = {_fmt(t.u)}")
            title = (f"round {e.index + 1}, draft position {depths[i]}{by}: {verdict(t.status)}\n"
                     f"p = {_fmt(t.p)}  q = {_fmt(t.q)}\n{test}")
            mark = "sv-diff" if t.accepted and position == diff_at else ""
            parts.append(_span(t.text, t.status, title, mark))
            position += t.accepted
        if e.extra is not None:
            x = e.extra
            title = f"round {e.index + 1}: {x.kind} token from the target\np = {_fmt(x.p)}"
            if x.q is not None:
                title += f"  q = {_fmt(x.q)}"
            parts.append(_span(x.text, x.kind, title, "sv-diff" if position == diff_at else ""))
            position += 1
    return '<div class="sv-stream">' + "".join(parts) + "</div>"


def stats_html(spec: Run | None, baseline: Run | None = None) -> str:
    from ..core.theory import cost_ratio

    if spec is None:
        return ""
    alpha = spec.acceptance_rate
    rows = [
        ("drafter", (spec.meta.draft or "–") + (", drafting greedily (q one-hot)" if spec.meta.draft_greedy else "")),
        ("γ", gamma_label(spec)),
        ("acceptance rate α̂", "–" if alpha is None else f"{alpha:.1%}"),
        ("accepted / rejected / drafted", f"{spec.n_accepted} / {spec.n_rejected} / {spec.n_drafted}"
                                          + (f" ({spec.n_untested} not reached)" if spec.n_untested else "")),
        ("mean tokens per round", f"{spec.tokens_per_round:.2f}"),
        ("rounds (target passes)", str(spec.target_passes)),
        ("speculative tokens/s", f"{spec.tokens_per_s:.1f}"),
    ]
    if spec.copied_rounds:
        rows.append(("rounds drafted by prompt lookup", f"{spec.copied_rounds} of {len(spec.events)}"))
    if spec.meta.cache:
        rows.append(("KV cache", spec.meta.cache + (", compiled" if spec.meta.compiled else "")))
    if spec.meta.machine:
        rows.append(("machine", spec.meta.machine))
    rows.append(("dtype", spec.meta.dtype + (f" ({spec.meta.dtype_reason})" if spec.meta.dtype_reason else "")))
    if spec.meta.weights:
        rows.append(("target's weights read", spec.meta.weights))
    c = cost_ratio(spec, baseline)
    if c is not None:
        rows.append(("c (draft step / target step)", f"{c:.3f}"))
    if baseline is not None and baseline.events:
        rows += [
            ("baseline target passes", str(baseline.target_passes)),
            ("baseline tokens/s", f"{baseline.tokens_per_s:.1f}"),
            ("speedup", f"{spec.tokens_per_s / baseline.tokens_per_s:.2f}×" if baseline.tokens_per_s else "–"),
        ]
        note = slower_note(spec, baseline)
        if note:
            rows.append(("on this machine", note))
    body = "".join(f"<tr><td>{html.escape(k)}</td><td><b>{html.escape(v)}</b></td></tr>" for k, v in rows)
    return f'<table class="sv-stats">{body}</table>' + time_split_html(spec, baseline)


STAGE_NAMES = {"draft": "draft", "verify": "verify (target forward)", "judge": "judge (rule and read)",
               "record": "record", "rest": "the rest"}


def time_split_html(spec: Run, baseline: Run | None = None) -> str:
    """Where a round's time went: the run's mean round as a bar of its stages (events.STAGES), and beside it, where
    there is a baseline, a plain step's, on one scale; each bar says what a token cost. '' without rounds."""
    if not spec.events:
        return ""
    runs = [(spec, "speculative round" if spec.meta.mode == "speculative" else "plain step")]
    if baseline is not None and baseline.events:
        runs.append((baseline, "plain step (baseline)"))
    stages_of = [run.mean_stages() for run, _ in runs]
    widest = max(sum(stages.values()) for stages in stages_of) or 1.0
    bars = []
    for (run, label), stages in zip(runs, stages_of, strict=True):
        total = sum(stages.values())
        parts = "".join(
            f'<span class="sv-part sv-part-{name}" data-stage="{name}" data-ms="{ms:.3f}" '
            f'style="width:{100 * ms / widest:.2f}%" title="{STAGE_NAMES[name]}: {ms:.2f} ms">'
            f'{name if ms / widest > 0.12 else ""}</span>' for name, ms in stages.items())
        per_token = total * len(run.events) / run.n_tokens if run.n_tokens else total
        bars.append(f'<div class="sv-split-row" data-run="{run.meta.mode}" data-ms="{total:.3f}">'
                    f'<div class="sv-split-label">{label}: {total:.1f} ms, {run.tokens_per_round:.2f} tokens, '
                    f'{per_token:.1f} ms a token</div><div class="sv-split-bar">{parts}</div></div>')
    legend = " ".join(f'<span class="sv-part sv-part-{name} sv-key">{html.escape(text)}</span>'
                      for name, text in STAGE_NAMES.items())
    return (f'<div class="sv-split" id="sv-time-split"><div class="sv-split-head">Where a round\'s time went (mean '
            f'of {count(len(spec.events), "round")})</div>{"".join(bars)}<div class="sv-split-keys">{legend}</div>'
            "</div>")


def slower_note(spec: Run, baseline: Run) -> str:
    """'' unless speculation ran slower than plain decoding; then why, from the run's own timings: where its
    rounds were the faster part, the prefill (a long prompt's, which the EAGLE head reads too); else what a verify
    pass and the drafting cost here in plain target steps, against the tokens a round gave."""
    from ..core.theory import target_step_ms

    if not baseline.tokens_per_s or spec.tokens_per_s >= baseline.tokens_per_s or not spec.events:
        return ""
    if spec.rounds_ms > 0 and baseline.rounds_ms > 0:
        rounds = (spec.n_tokens / spec.rounds_ms) / (baseline.n_tokens / baseline.rounds_ms)
        if rounds >= 1:
            return (f"plain decoding is faster here end to end, though the rounds decoded {rounds:.2f}x as fast as its "
                    f"steps: the prefill took {spec.meta.prefill_ms:,.0f} ms against its "
                    f"{baseline.meta.prefill_ms:,.0f} ms" + (" (the EAGLE head reads the prompt too)"
                                                             if "eagle" in spec.meta.drafter else ""))
    step = target_step_ms(spec, baseline)
    if not step:
        return ""
    verify = median(e.verify_ms for e in spec.events) / step
    draft = median(e.draft_ms for e in spec.events) / step
    return (f"plain decoding is faster here: a round costs {verify:.2f} steps to verify and {draft:.2f} to draft, "
            f"and gives {spec.tokens_per_round:.2f} tokens (python -m specviz kernels shows this CPU's costs)")


def diff_html(spec: Run, baseline: Run) -> str:
    greedy = spec.meta.sampling.greedy
    at = first_difference(spec.token_ids, baseline.token_ids)
    if not greedy:
        return ('<div class="sv-note">Sampled mode: the two texts are different draws; speculative '
                "sampling keeps the target's distribution, not its individual samples.</div>")
    if at is None:
        return '<div class="sv-note">Greedy: identical to the baseline, token for token.</div>'
    return (f'<div class="sv-note">Greedy: the texts part at generated token {at + 1} (outlined). In '
            f"{html.escape(spec.meta.dtype)} a k-token forward and k one-token forwards round differently, and "
            "a near-tie can flip: numerics, not the algorithm.</div>" + tie_html(spec, baseline, at))


def _p_of(record, token_id: int) -> float | None:
    if record.id == token_id:
        return record.p
    return next((t.p for t in record.top if t.id == token_id), None)


def tie_html(spec: Run, baseline: Run, at: int) -> str:
    """Where two greedy runs part: both candidates' target probabilities in each run, and the
    logit gap ln p(a) − ln p(b) (softmax shares one normaliser): the size of the tie."""
    records = spec.records(), baseline.records()
    if at >= min(map(len, records)):
        return ""
    a, b = records[0][at], records[1][at]
    rows = []
    for name, record in (("speculative", a), ("baseline", b)):
        pa, pb = _p_of(record, a.id), _p_of(record, b.id)
        gap = f"{math.log(pa) - math.log(pb):+.4f}" if pa and pb else "–"
        rows.append(f"<tr><td>{name}</td><td>{_fmt(pa)}</td><td>{_fmt(pb)}</td><td>{gap}</td></tr>")
    head = (f"<tr><th>run</th><th>p({html.escape(repr(a.text))})</th><th>p({html.escape(repr(b.text))})</th>"
            "<th>logit gap</th></tr>")
    return (f'<div class="sv-tie">At generated token {at + 1} the speculative run chose '
            f"{html.escape(repr(a.text))} and the baseline {html.escape(repr(b.text))}; the target's own "
            f'probabilities for both, as each run computed them (– : not among its top candidates):'
            f'<table class="sv-stats">{head}{"".join(rows)}</table></div>')


def race_html(spec: Run, baseline: Run, speed: float = 1.0) -> str:
    """Both texts appear at their measured pace (CSS animation delays, no script)."""
    rows = []
    for run, name in [(spec, "speculative"), (baseline, "baseline")]:
        spans = []
        for e in run.events:
            delay = e.elapsed_ms / 1000 / speed
            kinds = [(t.text, "accepted") for t in e.drafted if t.accepted]
            if e.extra:
                kinds.append((e.extra.text, e.extra.kind))
            for text, kind in kinds:
                spans.append(_span(text, kind, f"{name}: {delay:.2f} s", style=f"animation-delay:{delay:.3f}s"))
        rows.append(f'<div><b>{name}</b> ({run.tokens_per_s:.1f} tokens/s)'
                    f'<div class="sv-race-row">{"".join(spans)}</div></div>')
    return "".join(rows)


def batch_html(runs: list[Run]) -> str:
    """One block per row of a batch: its prompt, its acceptance so far, and its stream."""
    blocks = []
    for i, run in enumerate(runs):
        alpha = run.acceptance_rate
        state = f", {run.finish_reason}" if run.finish_reason else ""
        head = (f"<b>[{i + 1}]</b> {html.escape(run.meta.prompt[:80])}{'…' if len(run.meta.prompt) > 80 else ''}"
                f" · α̂ {'–' if alpha is None else f'{alpha:.0%}'} · {run.tokens_per_round:.2f} tokens/round · "
                f"{count(run.n_tokens)}{state} · {html.escape(gamma_label(run))}"
                + (f" · {run.copied_rounds} of {len(run.events)} rounds copied by prompt lookup" if run.copied_rounds
                   else ""))
        blocks.append(f'<div class="sv-batch-row"><div class="sv-batch-head">{head}</div>{stream_html(run)}</div>')
    return "".join(blocks)


def error_html(message: str) -> str:
    return f'<div class="sv-error">{html.escape(message)}</div>'


def note_html(message: str, detail: str = "") -> str:
    """A status line: one short sentence for a projector; `detail`, where given, on hover."""
    title = f' title="{html.escape(detail)}"' if detail else ""
    return f'<div class="sv-note"{title}>{html.escape(message)}</div>'


def exact_check_text(check: ExactCheck) -> str:
    """The closed-form check of one round in two sentences (the CLI's line, the page's note)."""
    if not check.drafted:
        return ("Exact, in closed form: the drafter proposes nothing for this prompt, so the first round is one "
                "plain target step and emits from p itself.")
    return (f"Exact, in closed form ({check.seconds:.2f} s): one round of the rule emits the first token with a "
            f"distribution that differs from the target's p by at most {check.max_diff:.1e} over the whole "
            f"vocabulary (float64 rounding; a draft at the first position is kept with probability "
            f"{check.first_draft_kept:.3f}). "
            f"A rule that resampled from p instead of the residual max(0, p − q) would miss by "
            f"{check.broken_max_diff:.1e}.")


def speedup_line(spec: Run | None, baseline: Run | None) -> str:
    """' Speedup 1.31× (26.6 against 20.3 tokens/s).' for a run beside its baseline, else ''."""
    if spec is None or baseline is None or not baseline.tokens_per_s:
        return ""
    return (f" Speedup {spec.tokens_per_s / baseline.tokens_per_s:.2f}× ({spec.tokens_per_s:.1f} against "
            f"{baseline.tokens_per_s:.1f} tokens/s).")
