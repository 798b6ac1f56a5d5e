"""Plotly figures from runs. Pure functions of events: no tensors, no UI.

Figures are plain Plotly JSON specs (`PlotlySpec`, a dict): building and serialising
`plotly.graph_objects.Figure` costs ~40 ms a chart, far too much to redraw four charts every
round; a dict costs well under a millisecond. `spec.figure()` gives the full Figure for export.
Every figure sets layout.uirevision, so a chart redrawn each round keeps the viewer's zoom.
"""

from __future__ import annotations

import json
from typing import Any

from .events import DraftedToken, Run
from .theory import cost_ratio, speedup_bound

COLOURS = {"accepted": "#1a9850", "rejected": "#d73027", "correction": "#2166ac", "bonus": "#8e44ad",
           "baseline": "#7f7f7f", "speculative": "#1a9850", "theory": "#f39c12"}


class PlotlySpec(dict):
    """{"data": [...], "layout": {...}}: what plotly.js draws. gr.Plot calls to_json()."""

    def to_json(self) -> str:
        return json.dumps(self)

    def figure(self):
        import plotly.graph_objects as go

        return go.Figure(self)


def _figure(traces: list[dict[str, Any]], title: str, x: str, y: str, key: str, **layout: Any) -> PlotlySpec:
    axis = {"gridcolor": "#e5e5e5", "zerolinecolor": "#cccccc"}
    return PlotlySpec(data=traces, layout={
        "title": {"text": title}, "xaxis": {"title": {"text": x}, **axis}, "yaxis": {"title": {"text": y}, **axis},
        "uirevision": key, "height": 300, "margin": {"l": 50, "r": 10, "t": 40, "b": 40},
        "legend": {"orientation": "h", "y": -0.25}, "plot_bgcolor": "white", "paper_bgcolor": "white", **layout,
    })


def tokens_per_round(run: Run | None) -> PlotlySpec:
    """Stacked bars per round: accepted, rejected, and the +1 the target adds; and γ, the tokens
    drafted that round (it moves when a policy adapts it, or when prompt lookup finds less)."""
    events = run.events if run else []
    x = [e.index + 1 for e in events]

    def bar(name: str, y: list[int], colour: str) -> dict[str, Any]:
        return {"type": "bar", "name": name, "x": x, "y": y, "marker": {"color": colour}}

    gamma = {"type": "scatter", "mode": "lines+markers", "name": "γ drafted", "x": x, "y": [e.gamma for e in events],
             "line": {"color": COLOURS["theory"], "shape": "hvh", "width": 1.5}, "marker": {"size": 4}}
    return _figure([
        bar("accepted", [e.n_accepted for e in events], COLOURS["accepted"]),
        bar("rejected", [e.n_rejected for e in events], COLOURS["rejected"]),
        bar("+1 (correction or bonus)", [1 if e.extra else 0 for e in events], COLOURS["correction"]),
        gamma,
    ], "Tokens per round, and γ", "round", "tokens", "rounds", barmode="stack")


def tokens_over_time(spec: Run | None, baseline: Run | None = None) -> PlotlySpec:
    traces = []
    for run, name in [(spec, "speculative"), (baseline, "baseline")]:
        if run and run.events:
            traces.append({
                "type": "scatter", "mode": "lines+markers", "name": name,
                "x": [0.0] + [e.elapsed_ms / 1000 for e in run.events],
                "y": [0] + [e.tokens_so_far for e in run.events],
                "line": {"color": COLOURS[name], "shape": "hv"},
            })
    return _figure(traces, "Tokens generated over wall time", "seconds", "tokens", "time")


def acceptance_by_position(run: Run | None) -> PlotlySpec:
    """Of the drafted tokens tested at position i, the share accepted."""
    accepted: dict[int, int] = {}
    tested: dict[int, int] = {}
    for e in run.events if run else []:
        for i, t in enumerate(e.drafted):
            if t.status in ("accepted", "rejected"):
                tested[i] = tested.get(i, 0) + 1
                accepted[i] = accepted.get(i, 0) + (t.status == "accepted")
    positions = sorted(tested)
    trace = {"type": "bar", "name": "acceptance", "x": [i + 1 for i in positions],
             "y": [accepted[i] / tested[i] for i in positions],
             "text": [f"{accepted[i]}/{tested[i]}" for i in positions], "marker": {"color": COLOURS["accepted"]}}
    fig = _figure([trace], "Acceptance rate by draft position", "position in the draft", "accepted / tested",
                  "position")
    fig["layout"]["yaxis"]["range"] = [0, 1]
    return fig


def speedup_curve(spec: Run | None, baseline: Run | None = None, max_gamma: int = 16) -> PlotlySpec:
    """Leviathan's bound over γ for the measured α and c, with the measured speedup on it."""
    traces, shapes = [], []
    alpha = spec.acceptance_rate if spec else None
    c = cost_ratio(spec, baseline) if spec else None
    if alpha is not None and c is not None:
        gammas = list(range(1, max(max_gamma, spec.meta.gamma) + 1))
        traces.append({"type": "scatter", "mode": "lines", "name": f"bound for α={alpha:.2f}, c={c:.2f}",
                       "x": gammas, "y": [speedup_bound(alpha, g, c) for g in gammas],
                       "line": {"color": COLOURS["theory"]}})
        shapes.append({"type": "line", "xref": "paper", "x0": 0, "x1": 1, "y0": 1, "y1": 1,
                       "line": {"dash": "dot", "color": COLOURS["baseline"]}})
        if baseline and baseline.tokens_per_s and spec.tokens_per_s:
            traces.append({"type": "scatter", "mode": "markers", "name": "measured (this run)",
                           "x": [round(spec.mean_gamma, 2)], "y": [spec.tokens_per_s / baseline.tokens_per_s],
                           "marker": {"size": 12, "color": COLOURS["speculative"]}})
    return _figure(traces, "Speedup: measured against the Leviathan bound", "γ (tokens drafted per round)",
                   "speedup over the baseline", "speedup", shapes=shapes)


def token_inspector(token: DraftedToken | None, label: str = "") -> PlotlySpec:
    """p and q over the top candidates at one drafted position, and the residual if rejected."""
    if token is None or not token.top:
        return _figure([], "Pick a drafted token", "", "probability", "inspector")
    names = [repr(t.text) for t in token.top]

    def bar(name: str, y: list[float], colour: str) -> dict[str, Any]:
        return {"type": "bar", "name": name, "x": names, "y": y, "marker": {"color": colour}}

    traces = [bar("p (target)", [t.p for t in token.top], COLOURS["correction"]),
              bar("q (draft)", [t.q for t in token.top], COLOURS["accepted"])]
    if any(t.residual is not None for t in token.top):
        traces.append(bar("norm(max(0, p − q))", [t.residual or 0.0 for t in token.top], COLOURS["rejected"]))
    u = "greedy: kept iff argmax" if token.u is None else f"u = {token.u:.3f}"
    title = f"{label} {token.text!r}: {token.status}; min(1, p/q) = {token.accept_prob:.3f}, {u}"
    return _figure(traces, title, "candidate token", "probability", "inspector", barmode="group")
