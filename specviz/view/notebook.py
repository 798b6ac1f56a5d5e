"""Runs that draw themselves in a notebook (Jupyter, Colab, VS Code) through `_repr_html_`.

The app's own renderers, not a third copy: the token stream (p, q, min(1, p/q) and u on hover)
and the stats table from rendering.py, the tokens-per-round chart from charts.py, with the app's
CSS inlined. Plotly's script comes from its CDN, as in plotly's own notebook output; offline, the
chart stays empty and the rest still shows (or call `run_html(run, plotlyjs=True)` to embed it).
"""

from __future__ import annotations

from ..core.events import Run, register_html
from .charts import PlotlySpec, tokens_per_round
from .rendering import CSS, batch_html, count, diff_html, stats_html, stream_html


def _chart(spec: PlotlySpec, plotlyjs: bool | str) -> str:
    import plotly.io

    return plotly.io.to_html(spec, full_html=False, include_plotlyjs=plotlyjs, default_height="300px")


def _page(*parts: str) -> str:
    return f'<div class="sv-notebook"><style>{CSS}</style>{"".join(parts)}</div>'


def run_html(run: Run, plotlyjs: bool | str = "cdn") -> str:
    """One run: its header line, the coloured stream, the stats and the per-round chart."""
    head = f"<b>{run.meta.mode}</b>: {count(run.n_tokens)}, {run.meta.target}"
    parts = [f"<div>{head}</div>", stream_html(run), stats_html(run if run.meta.mode == "speculative" else None)]
    if run.meta.mode == "speculative":
        parts.append(_chart(tokens_per_round(run), plotlyjs))
    return _page(*parts)


def comparison_html(spec: Run, base: Run, plotlyjs: bool | str = "cdn") -> str:
    """A speculative run beside its baseline: both streams, the greedy diff, stats with the speedup."""
    columns = "".join(f'<div style="flex:1"><b>{title}</b>{stream_html(run)}</div>'
                      for title, run in (("speculative", spec), ("baseline (target alone)", base)))
    return _page(f'<div style="display:flex;gap:16px">{columns}</div>', diff_html(spec, base),
                 stats_html(spec, base), _chart(tokens_per_round(spec), plotlyjs))


def runs_html(runs: list[Run]) -> str:
    """What a finished stream holds: a comparison, one run, or a batch (one stream per prompt)."""
    spec = next((r for r in runs if r.meta.mode == "speculative"), None)
    base = next((r for r in runs if r.meta.mode == "baseline"), None)
    if spec is not None and base is not None and len(runs) == 2:
        return comparison_html(spec, base)
    if len(runs) == 1:
        return run_html(runs[0])
    return _page(batch_html(runs))


register_html(run_html)  # Run._repr_html_ draws through this
