"""Plotly figures from runs. Pure functions of events: no tensors, no UI.

Figures are plain Plotly JSON specs (`PlotlySpec`, a dict): building and serialising
`plotly.graph_objects.Figure` costs tens of milliseconds a chart, far too much to redraw four charts
every round; a dict costs well under a millisecond. `spec.figure()` gives the full Figure for export.
Every figure sets layout.uirevision, so a chart redrawn each round keeps the viewer's zoom.
"""

from __future__ import annotations

import json
from html import escape
from typing import Any

from ..core.events import DraftedToken, RoundEvent, Run, SampleCheck
from ..core.theory import cost_ratio, speedup_bound
from .stages import NOT_REACHED, depth_of, verdict

COLOURS = {"accepted": "#1a9850", "rejected": "#d73027", "correction": "#2166ac", "bonus": "#8e44ad",
           "baseline": "#7f7f7f", "speculative": "#1a9850", "theory": "#f39c12", "eagle": "#17becf",
           "lookup+eagle": "#e377c2"}


class PlotlySpec(dict):
    """{"data": [...], "layout": {...}}: what plotly.js draws. gr.Plot calls to_json()."""

    def to_json(self) -> str:
        return json.dumps(self)

    def figure(self):
        import plotly.graph_objects as go

        return go.Figure(self)


def _token(text: str, quoted: bool = True) -> str:
    """A token's text as Plotly shows it: quoted (repr, so spaces and newlines show) and with <, > and & as
    entities, since Plotly draws the tags its labels hold (<b>, <br>, <span style>): the chart shows the token."""
    return escape(repr(text) if quoted else text, quote=False)


def _figure(traces: list[dict[str, Any]], title: str, x: str, y: str, key: str, **layout: Any) -> PlotlySpec:
    axis = {"gridcolor": "#e5e5e5", "zerolinecolor": "#cccccc"}
    return PlotlySpec(data=traces, layout={
        "title": {"text": title}, "xaxis": {"title": {"text": x}, **axis}, "yaxis": {"title": {"text": y}, **axis},
        "uirevision": key, "height": 300, "margin": {"l": 50, "r": 10, "t": 40, "b": 40},
        "legend": {"orientation": "h", "y": -0.25}, "plot_bgcolor": "white", "paper_bgcolor": "white", **layout,
    })


def tokens_per_round(run: Run | None) -> PlotlySpec:
    """Stacked bars per round: accepted, rejected, and the +1 the target adds; and γ, the tokens
    drafted that round (it moves when a policy adapts it, or when prompt lookup finds less). Where
    a combined drafter copied a round by prompt lookup, that round's drafts are hatched."""
    events = run.events if run else []
    x = [e.index + 1 for e in events]
    copied = {"shape": ["/" if e.drafted_by == "lookup" else "" for e in events]} if run and run.copied_rounds else {}

    def bar(name: str, y: list[int], colour: str, pattern: dict | None = None) -> dict[str, Any]:
        return {"type": "bar", "name": name, "x": x, "y": y,
                "marker": {"color": colour, **({"pattern": pattern} if pattern else {})}}

    gamma = {"type": "scatter", "mode": "lines+markers", "name": "γ drafted", "x": x, "y": [e.gamma for e in events],
             "line": {"color": COLOURS["theory"], "shape": "hvh", "width": 1.5}, "marker": {"size": 4}}
    drafts = " (hatched: copied by prompt lookup)" if copied else ""
    return _figure([
        bar("accepted" + drafts, [e.n_accepted for e in events], COLOURS["accepted"], copied),
        bar("rejected", [e.n_rejected for e in events], COLOURS["rejected"], copied),
        bar("+1 (correction or bonus)", [1 if e.extra else 0 for e in events], COLOURS["correction"]),
        gamma,
    ], "Tokens per round, and γ", "round", "tokens", "rounds", barmode="stack")


def tokens_over_time(spec: Run | None, baseline: Run | None = None) -> PlotlySpec:
    """Tokens over wall time for both runs, and (right axis) what each target forward pass cost:
    flat with a KV cache, rising with the text without one (cache "none" recomputes it all)."""
    traces = []
    for run, name in [(spec, "speculative"), (baseline, "baseline")]:
        if run and run.events:
            label = f"{name} (no KV cache: recomputing)" if run.meta.cache == "none" else name
            traces.append({
                "type": "scatter", "mode": "lines+markers", "name": label,
                "x": [0.0] + [e.elapsed_ms / 1000 for e in run.events],
                "y": [0] + [e.tokens_so_far for e in run.events],
                "line": {"color": COLOURS[name], "shape": "hv"},
            })
            traces.append({
                "type": "scatter", "mode": "lines", "name": f"{name}: ms per target pass", "yaxis": "y2",
                "x": [e.elapsed_ms / 1000 for e in run.events], "y": [e.verify_ms for e in run.events],
                "line": {"color": COLOURS[name], "dash": "dot", "width": 1},
            })
    return _figure(traces, "Tokens generated over wall time", "seconds", "tokens", "time",
                   yaxis2={"title": {"text": "ms per target pass"}, "overlaying": "y", "side": "right",
                           "rangemode": "tozero", "showgrid": False},
                   margin={"l": 50, "r": 50, "t": 40, "b": 40})


def cache_lengths(run: Run | None) -> PlotlySpec:
    """Both KV caches per round: what each held after the round's rollback, the positions written
    this round and rolled back (marked), and the target's length before the round.

    Derived from the events: the target holds the text but its last token, its verify pass
    appends that token and the g drafts, and the rollback keeps the n accepted. A draft model
    writes d_1..d_{g-1} and keeps the accepted ones; an EAGLE head's drafted entries are always
    dropped (the target's real features replace them next round); a round prompt lookup drafted
    writes nothing. Without a KV cache (cache "none") nothing is kept: every forward recomputes
    the whole text, shown as such.
    """
    events = run.events if run else []
    x = [e.index + 1 for e in events]
    before, start = [], (len(run.meta.prompt_ids) - 1 if run else 0)
    for e in events:
        before.append(start)
        start = e.target_cache_len
    verified = [b + len(e.drafted) + 1 for b, e in zip(before, events, strict=True)]
    kept = [e.target_cache_len for e in events]
    traces: list[dict[str, Any]] = []

    def bars(name: str, group: str, y: list[int], base: list[int] | None, colour: str, **more: Any) -> None:
        traces.append({"type": "bar", "name": name, "x": x, "y": y, "offsetgroup": group,
                       "marker": {"color": colour, **more.pop("marker", {})}, **({"base": base} if base else {}),
                       **more})

    bars("target: kept", "target", kept, None, COLOURS["correction"])
    bars("target: rolled back", "target", [v - k for v, k in zip(verified, kept, strict=True)], kept,
         COLOURS["rejected"], marker={"pattern": {"shape": "/"}})
    drafter = run.meta.drafter if run else ""
    if drafter in ("model", "eagle", "lookup+eagle") and any(e.draft_cache_len for e in events):
        draft_kept = [e.draft_cache_len for e in events]
        # a draft model keeps its accepted entries, a head none; a round lookup drafted wrote nothing
        kept_entries = [e.n_accepted if drafter == "model" else 0 for e in events]
        dropped = [0 if e.drafted_by == "lookup" else max(0, len(e.drafted) - 1 - k)
                   for e, k in zip(events, kept_entries, strict=True)]
        bars(f"{'draft' if drafter == 'model' else 'EAGLE head'}: kept", "draft", draft_kept, None,
             COLOURS["accepted"])
        bars("drafted, then dropped", "draft", dropped, draft_kept, COLOURS["rejected"],
             marker={"pattern": {"shape": "x"}})
    traces.append({"type": "scatter", "mode": "lines", "name": "target before the round", "x": x, "y": before,
                   "line": {"color": COLOURS["baseline"], "shape": "hvh", "dash": "dot"}})
    title = "KV caches per round: kept, and rolled back"
    if run and run.meta.cache == "none":
        title = "No KV cache: every forward recomputes the whole text (the bars)"
    return _figure(traces, title, "round", "tokens in the cache", "caches", barmode="group")


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
    """Leviathan's bound over γ for the measured α and c, with the measured speedup on it. The bound is a
    chain's: a tree run's point (at its drafts a round) says so, since a tree can pass it."""
    traces, shapes = [], []
    alpha = spec.acceptance_rate if spec else None
    c = cost_ratio(spec, baseline) if spec else None
    if alpha is not None and c is not None:
        tree = spec.meta.branch > 1
        gammas = list(range(1, max(max_gamma, spec.meta.gamma) + 1))
        traces.append({"type": "scatter", "mode": "lines",
                       "name": ("a chain's " if tree else "") + f"bound for α={alpha:.2f}, c={c:.2f}",
                       "x": gammas, "y": [speedup_bound(alpha, g, c) for g in gammas],
                       "line": {"color": COLOURS["theory"]}})
        shapes.append({"type": "line", "xref": "paper", "x0": 0, "x1": 1, "y0": 1, "y1": 1,
                       "line": {"dash": "dot", "color": COLOURS["baseline"]}})
        if baseline and baseline.tokens_per_s and spec.tokens_per_s:
            measured = "measured (a tree: it can pass a chain's bound)" if tree else "measured (this run)"
            traces.append({"type": "scatter", "mode": "markers", "name": measured,
                           "x": [round(spec.mean_gamma, 2)], "y": [spec.tokens_per_s / baseline.tokens_per_s],
                           "marker": {"size": 12, "color": COLOURS["speculative"]}})
    return _figure(traces, "Speedup: measured against the Leviathan bound", "γ (tokens drafted per round)",
                   "speedup over the baseline", "speedup", shapes=shapes)


def sample_histogram(check: SampleCheck | None) -> PlotlySpec:
    """The first token's exact distribution beside the shares of speculative and target-alone draws."""
    if check is None:
        return _figure([], "Sample N times: the draws against the exact distribution", "", "probability", "sample")
    names = [_token(c.text, quoted=c.id >= 0) for c in check.top]

    def bar(name: str, y: list[float], colour: str) -> dict[str, Any]:
        return {"type": "bar", "name": name, "x": names, "y": y, "marker": {"color": colour}}

    traces = [bar("exact p (target)", [c.exact for c in check.top], COLOURS["theory"]),
              bar(f"speculative, {check.n} draws", [c.speculative for c in check.top], COLOURS["speculative"]),
              bar(f"target alone, {check.n} draws", [c.target_alone for c in check.top], COLOURS["baseline"])]
    title = (f"First token, {check.n} draws each: TV to exact {check.tv_speculative:.3f} (speculative), "
             f"{check.tv_target_alone:.3f} (target alone); noise alone ≈ {check.tv_noise:.3f}")
    return _figure(traces, title, "token", "probability", "sample", barmode="group")


def token_inspector(token: DraftedToken | None, label: str = "") -> PlotlySpec:
    """p and q over the top candidates at one drafted position, and the residual if rejected."""
    if token is None or not token.top:
        return _figure([], "Pick a drafted token", "", "probability", "inspector")
    names = [_token(t.text) for t in token.top]

    def bar(name: str, y: list[float], colour: str) -> dict[str, Any]:
        return {"type": "bar", "name": name, "x": names, "y": y, "marker": {"color": colour}}

    traces = [bar("p (target)", [t.p for t in token.top], COLOURS["correction"]),
              bar("q (draft)", [t.q for t in token.top], COLOURS["accepted"])]
    if any(t.residual is not None for t in token.top):
        traces.append(bar("norm(max(0, p − q))", [t.residual or 0.0 for t in token.top], COLOURS["rejected"]))
    u = "greedy: kept iff argmax" if token.u is None else f"u = {token.u:.3f}"
    title = f"{label} {_token(token.text)}: {token.status}; min(1, p/q) = {token.accept_prob:.3f}, {u}"
    return _figure(traces, title, "candidate token", "probability", "inspector", barmode="group")


def token_tree(event: RoundEvent | None, shown: int | None = None, decided: int | None = None,
               greedy: bool = False) -> PlotlySpec:
    """One round's drafts as a tree (a chain is a tree of one branch): depth across, the last kept token
    at the root. Kept path green, rejected red, never reached grey; the token the target added hangs
    from the path's end. Hover: p, q, min(1, p/q) and the draft's probability of the path to the node.
    Stepping a round: only nodes up to depth `shown` are drawn (None: all), and only nodes up to index
    `decided` show their outcome (None: all; -1: none yet). `greedy`: the verdict is the argmax test, told apart
    from the ratio p/q it does not use."""

    if event is None or not event.drafted and event.extra is None:
        return _figure([], "The round's token tree", "", "", "tree")
    parents, depth = event.tree, event.depths
    show = [i for i in range(len(parents)) if shown is None or depth[i] <= shown]
    # y: leaves in depth-first order, a parent at the middle of its children
    children: dict[int, list[int]] = {}
    for i in show:
        children.setdefault(parents[i], []).append(i)
    y: dict[int, float] = {}
    leaves = [0]

    def place(node: int) -> float:
        kids = children.get(node, [])
        if not kids:
            y[node] = -leaves[0]
            leaves[0] += 1
        else:
            y[node] = sum(place(k) for k in kids) / len(kids)
        return y[node]

    place(-1)
    x = {-1: 0, **{i: depth[i] for i in show}}
    status = {i: verdict(event.drafted[i].status) if decided is None or i <= decided else "drafted" for i in show}
    colour = {"kept": COLOURS["accepted"], "rejected": COLOURS["rejected"], NOT_REACHED: "#bdbdbd",
              "drafted": "#9ecae1"}
    traces: list[dict[str, Any]] = []
    edges_x, edges_y = [], []
    for i in show:
        edges_x += [x[parents[i]], x[i], None]
        edges_y += [y[parents[i]], y[i], None]
    done = shown is None and decided is None
    end = event.path[-1] if event.path else -1
    if done and event.extra is not None:  # the target's token, after the kept path
        x["extra"], y["extra"] = x[end] + 1, y[end]
        if any(x[i] == x["extra"] and abs(y[i] - y[end]) < 0.25 for i in show):  # a rejected draft sits there
            y["extra"] -= 0.5
        edges_x += [x[end], x["extra"], None]
        edges_y += [y[end], y["extra"], None]
    traces.append({"type": "scatter", "mode": "lines", "x": edges_x, "y": edges_y, "hoverinfo": "skip",
                   "line": {"color": "#cccccc", "width": 1.5}, "showlegend": False})
    for name in ("kept", "rejected", NOT_REACHED, "drafted"):
        nodes = [i for i in show if status[i] == name]
        if not nodes:
            continue
        hover = []
        for i in nodes:
            t = event.drafted[i]
            path = f"<br>draft's path probability {t.score:.3f}" if t.score is not None else ""
            test = ((f"p/q = {t.p / t.q:.3f}" if t.q else "") if greedy else  # a sibling's chance: less what
                    f"chance kept = {t.accept_prob:.3f}" if event.parents else  # the ones before it took
                    f"min(1, p/q) = {t.accept_prob:.3f}")
            hover.append(f"{_token(t.text)}, depth {depth[i]}: {name}<br>p = {t.p:.3f}, q = {t.q:.3f}, {test}{path}")
        traces.append({"type": "scatter", "mode": "markers+text", "name": name, "x": [x[i] for i in nodes],
                       "y": [y[i] for i in nodes], "text": [_short(event.drafted[i].text) for i in nodes],
                       "textposition": "top center", "cliponaxis": False, "hovertext": hover, "hoverinfo": "text",
                       "marker": {"color": colour[name], "size": 14, "line": {"color": "white", "width": 1}}})
    root = {"type": "scatter", "mode": "markers+text", "name": "last kept token", "x": [0], "y": [y[-1]],
            "text": ["▸"], "textposition": "top center", "cliponaxis": False, "hoverinfo": "text",
            "hovertext": ["the last kept token: every draft continues from here"],
            "marker": {"color": "#444444", "size": 10, "symbol": "diamond"}}
    traces.append(root)
    if "extra" in x:
        extra = event.extra
        traces.append({"type": "scatter", "mode": "markers+text", "name": extra.kind, "x": [x["extra"]],
                       "y": [y["extra"]], "text": [_short(extra.text)], "textposition": "top center",
                       "cliponaxis": False, "hoverinfo": "text",
                       "hovertext": [f"{_token(extra.text)}: {extra.kind}, p = {extra.p:.3f}"],
                       "marker": {"color": COLOURS.get(extra.kind, COLOURS["correction"]), "size": 14,
                                  "symbol": "star"}})
    kind = f"tree {depth_of(event)} deep" if event.parents else "chain"
    outcome = f", {event.n_accepted} kept" if done else ""  # while stepping, the verdicts are still to come
    title = (f"Round {event.index + 1}: {len(event.drafted)} drafts as a {kind}{outcome}"
             if event.drafted else f"Round {event.index + 1}: nothing drafted")
    hidden = {"showgrid": False, "zeroline": False}
    low, high = min(y.values()), max(y.values())
    return _figure(traces, title, "", "", "tree", height=max(230, 40 * leaves[0] + 100),
                   yaxis={"visible": False, "range": [low - 0.5, high + 0.7], **hidden},
                   xaxis={"title": {"text": "depth (drafts after the last kept token)"}, "dtick": 1,
                          "range": [-0.4, max(x.values()) + 0.6], **hidden},
                   legend={"orientation": "h", "y": -0.35}, margin={"l": 20, "r": 20, "t": 40, "b": 70})


def _short(text: str, n: int = 10) -> str:
    shown = text.replace("\n", "⏎")
    return _token(shown if len(shown) <= n else shown[: n - 1] + "…", quoted=False)
