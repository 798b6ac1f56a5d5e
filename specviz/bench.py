"""Measurements that take minutes, not pass/fail tests. Ratios are measured side by side in one run."""

from __future__ import annotations

import time
from dataclasses import replace
from statistics import median

from . import charts
from .events import Run
from .generator import Settings, make_meta, speculative_events
from .models import ModelPair
from .rendering import stats_html, stream_html


def render_page(run: Run) -> int:
    """What the app does each round: the stream and stats HTML and the four charts as Plotly JSON."""
    size = len(stream_html(run)) + len(stats_html(run))
    for fig in (charts.tokens_per_round(run), charts.tokens_over_time(run), charts.acceptance_by_position(run),
                charts.speedup_curve(run)):
        size += len(fig.to_json())
    return size


def render_cost(pair: ModelPair, prompt: str, prompt_ids: list[int], settings: Settings, repeats: int = 3) -> dict:
    """Seconds for the bare generator against the generator plus per-round page rendering.

    The two alternate, `repeats` times each, after a warm-up; medians are compared.
    """
    for _ in speculative_events(pair, prompt_ids, replace(settings, max_new_tokens=8)):
        pass
    bare, rendered = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in speculative_events(pair, prompt_ids, settings):
            pass
        bare.append(time.perf_counter() - start)

        run = Run(make_meta(pair, "speculative", prompt, prompt_ids, settings))
        start = time.perf_counter()
        for event in speculative_events(pair, prompt_ids, settings):
            run.events.append(event)
            render_page(run)
        rendered.append(time.perf_counter() - start)
    return {"bare_s": median(bare), "rendered_s": median(rendered), "ratio": median(rendered) / median(bare),
            "rounds": len(run.events), "tokens": run.n_tokens}
