"""Runs as the page's components: one `View` per shown pair of runs, its outputs in OUTPUT_NAMES order."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, replace

import gradio as gr

from ..core.events import UNVERIFIED, Run
from ..view import charts
from ..view.rendering import diff_html, first_difference, stats_html, stream_html
from ..view.stages import DECIDE, how_it_works_html, round_stages, stage_html, tree_view

# what a run's handlers fill, in order (app.py maps each name to its component)
OUTPUT_NAMES = ("status", "spec_html", "base_html", "diff_box", "stats", "fig_rounds", "fig_time", "fig_position",
                "fig_speedup", "fig_cache", "fig_tree", "runs_state", "token_pick", "download", "race_box", "round_box",
                "how_box")
CHARTS = ("fig_rounds", "fig_time", "fig_position", "fig_speedup", "fig_cache")  # under the streams, in a tab
FIGURES = (*CHARTS, "fig_tree")  # every Plotly chart of a run: the five and the last round's tree
STEP_HINT = ('<div class="sv-note">Step runs one round and pauses on it; Next ▸ (or the key <b>n</b>) shows '
             "its stages one by one: each draft with q, the verify pass with p, each decision, the added "
             "token. Continue runs to the end.</div>")


def status_only(status: str) -> tuple:
    """The page's outputs with the status alone changed (the last run's view stays until the next one shows)."""
    return tuple(status if name == "status" else gr.skip() for name in OUTPUT_NAMES)


@dataclass
class View:
    """Everything the page shows for a pair of runs."""

    status: str = ""
    spec: Run | None = None
    base: Run | None = None
    show_rounds: bool = False
    stage: int | None = None  # the stage the last round is shown at (None: all of it)

    def _stepping(self) -> tuple[int, int] | None:
        """(stage, stages) of the last round while it is stepped through before its last stage, else None: its
        outcome is then still to be told."""
        if self.stage is None or self.spec is None or not self.spec.events:
            return None
        stages = len(round_stages(self.spec.events[-1], self.spec.meta))
        return (self.stage, stages) if self.stage < stages - 1 else None

    def streamed(self) -> Run | None:
        """The speculative run as its stream shows it: while a round is stepped through, its drafts only once
        decided and its added token only at its last stage."""
        if (at := self._stepping()) is None:
            return self.spec
        event = self.spec.events[-1]
        decided = {s.position for s in round_stages(event, self.spec.meta)[: at[0] + 1] if s.kind == DECIDE}
        drafted = [t if i in decided else replace(t, status=UNVERIFIED) for i, t in enumerate(event.drafted)]
        return replace(self.spec, events=[*self.spec.events[:-1], replace(event, drafted=drafted, extra=None)])

    def counted(self) -> Run | None:
        """The speculative run as the stats and charts count it: a round stepped through counts from its last
        stage on."""
        return self.spec if self._stepping() is None else replace(self.spec, events=self.spec.events[:-1])

    def round_view(self) -> tuple[str, str]:
        """The last round shown, stage by stage, and the five steps with its numbers."""
        if self.spec is None or not self.spec.events:
            return STEP_HINT, ""
        event = self.spec.events[-1]
        stage = len(round_stages(event, self.spec.meta)) - 1 if self.stage is None else self.stage
        return stage_html(event, self.spec.meta, stage), how_it_works_html(event, self.spec.meta, stage)

    def round_tree(self):
        """The last round's token tree, as far as the stage shown has grown and decided it."""
        if self.spec is None or not self.spec.events:
            return waiting(charts.token_tree(None))
        event = self.spec.events[-1]
        stages = round_stages(event, self.spec.meta)
        return charts.token_tree(event, *tree_view(stages[self.stage] if self.stage is not None else None),
                                 greedy=self.spec.meta.sampling.greedy)

    def outputs(self, download: str | None = None, race: str = "", final: bool = True,
                redraw: Collection[str] = FIGURES) -> tuple:
        """The page; between rounds (final=False) the inspector and the download stay as they are, and of the
        charts (FIGURES) only those in `redraw` are drawn."""
        diff_at = greedy_diff(self.spec, self.base)
        runs = [r for r in (self.spec, self.base) if r is not None]
        picker = gr.skip()
        if final:  # the inspector's list only changes when a run ends, not every round
            choices = token_choices(self.spec)
            # open the inspector on the first rejection, where there is most to see
            first_rejected = next((value for label, value in choices if "(rejected)" in label), None)
            picker = gr.update(choices=choices, value=first_rejected)
        return (
            self.status,
            stream_html(self.streamed(), self.show_rounds, diff_at),
            stream_html(self.base, self.show_rounds, diff_at) if self.base else "",
            diff_html(self.spec, self.base) if self.spec and self.base else "",
            stats_html(self.counted(), self.base),
            *self.figures(CHARTS if final else redraw),
            self.round_tree() if final or "fig_tree" in redraw else gr.skip(),
            runs,
            picker,
            download if final else gr.skip(),
            race if final else gr.skip(),
            *self.round_view(),
        )

    def figures(self, redraw: Collection[str] = CHARTS) -> list:
        """The five charts under the streams in CHARTS order, those not in `redraw` skipped (frames saying so
        before a run)."""
        spec = self.counted()
        draw = {"fig_rounds": lambda: charts.tokens_per_round(spec),
                "fig_time": lambda: charts.tokens_over_time(spec, self.base),
                "fig_position": lambda: charts.acceptance_by_position(spec),
                "fig_speedup": lambda: charts.speedup_curve(spec, self.base),
                "fig_cache": lambda: charts.cache_lengths(spec)}
        drawn = spec is not None and spec.events
        return [(draw[name]() if drawn else waiting(draw[name]())) if name in redraw else gr.skip()
                for name in CHARTS]

    def stage_outputs(self) -> tuple:
        """A stage within a shown round: the status, the round view and its tree, the stream as far as the round
        is decided, and the stats; the charts only where the round starts or stops counting (its last stage, and
        the one before, where Back returns to)."""
        round_box, how_box = self.round_view()
        shown = {"status": self.status, "fig_tree": self.round_tree(), "round_box": round_box, "how_box": how_box,
                 "spec_html": stream_html(self.streamed(), self.show_rounds, greedy_diff(self.spec, self.base)),
                 "stats": stats_html(self.counted(), self.base)}
        if self.spec is not None and self.spec.events and self.stage is not None:
            last = len(round_stages(self.spec.events[-1], self.spec.meta)) - 1
            if self.stage >= last - 1:
                shown.update(zip(CHARTS, self.figures(), strict=True))
        return tuple(shown.get(name, gr.skip()) for name in OUTPUT_NAMES)


def waiting(figure: charts.PlotlySpec) -> charts.PlotlySpec:
    """A chart with no run yet: its title and axis titles, no ticks, and a note that a run draws it."""
    layout = figure["layout"]
    for axis in ("xaxis", "yaxis"):
        layout[axis] = {**layout[axis], "showticklabels": False, "showgrid": False, "zeroline": False}
    layout["annotations"] = [{"text": "drawn as a run goes", "showarrow": False, "xref": "paper", "yref": "paper",
                              "x": 0.5, "y": 0.5, "font": {"color": "#999999"}}]
    return figure


def empty_charts() -> dict[str, charts.PlotlySpec]:
    """Every chart of a run before any run: the page opens with their frames drawn (and the browser loads and
    compiles Plotly then, not during the first run, whose decode shares the CPU with it)."""
    view = View()
    return {**dict(zip(CHARTS, view.figures(), strict=True)), "fig_tree": view.round_tree()}


def greedy_diff(spec: Run | None, base: Run | None) -> int | None:
    """Where greedy texts part (None if identical, sampled, or no baseline)."""
    if spec and base and spec.meta.sampling.greedy:
        return first_difference(spec.token_ids, base.token_ids)
    return None


def split_runs(runs: list[Run] | None) -> tuple[Run | None, Run | None]:
    spec = next((r for r in runs or [] if r.meta.mode == "speculative"), None)
    base = next((r for r in runs or [] if r.meta.mode == "baseline"), None)
    return spec, base


def token_choices(run: Run | None) -> list[tuple[str, str]]:
    """Dropdown entries for the inspector: every tested drafted token."""
    out = []
    for e in run.events if run else []:
        for i, t in enumerate(e.drafted):
            if t.status != "unverified":
                out.append((f"round {e.index + 1} · position {i + 1} · {t.text!r} ({t.status})", f"{e.index}:{i}"))
    return out
