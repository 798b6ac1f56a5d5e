"""The UI's building blocks: escaped HTML, hover text, charts that keep their zoom, the theory."""

import dataclasses
import re

import pytest

from specviz.core.events import DraftedToken, ExtraToken, RoundEvent, Run, RunMeta, TopToken
from specviz.core.theory import cost_ratio, expected_tokens_per_round, speedup_bound
from specviz.view import charts
from specviz.view.rendering import (
    batch_html,
    count,
    diff_html,
    first_difference,
    run_text,
    slower_note,
    stats_html,
    stream_html,
    summary,
)


def make_run(mode="speculative", temperature=0.0) -> Run:
    meta = RunMeta(mode, "t", "d", "float32", "cpu", 2, temperature, 0, 1.0, 0, 8, "p", [1], 10)
    evil = "<script>alert(1)</script>"
    events = [
        RoundEvent(0, 2, [DraftedToken(5, "a", 0.5, 0.4, 0.8, 0.3, "accepted", [TopToken(5, "a", 0.4, 0.5)]),
                          DraftedToken(6, evil, 0.6, 0.1, 1 / 6, 0.9, "rejected",
                                       [TopToken(6, evil, 0.1, 0.6, 0.0), TopToken(7, "c", 0.5, 0.1, 0.8)])],
                   ExtraToken(7, "c", "correction", 0.5, 0.1), 1, 4.0, 10.0, 2, 2, 2, 20.0),
        RoundEvent(1, 2, [DraftedToken(8, "d", 0.9, 0.9, 1.0, 0.1, "accepted"),
                          DraftedToken(9, "e", 0.8, 0.9, 1.0, 0.2, "accepted")],
                   ExtraToken(4, "f", "bonus", 0.7), 2, 4.0, 10.0, 5, 4, 5, 40.0, "length"),
    ]
    return Run(meta, events)


def test_token_text_is_escaped_and_hover_has_p_q_u():
    html = stream_html(make_run(temperature=1.0), show_rounds=True)
    assert "<script>" not in html and "&lt;script&gt;" in html
    assert html.count("sv-accepted") == 3 and html.count("sv-rejected") == 1
    assert "p = 0.1000  q = 0.6000" in html and "min(1, p/q) = 0.1667  u = 0.9000" in html and "│2" in html
    # greedy keeps the target's argmax: the ratio p/q and that verdict are shown as two things, and no u
    greedy = stream_html(make_run())
    assert "p/q = 0.1667\ngreedy: rejected, not the target&#x27;s most likely token" in greedy
    assert "p/q = 0.8000\ngreedy: kept, the target&#x27;s most likely token" in greedy and "u = " not in greedy


def test_rounds_prompt_lookup_drafted_are_named_in_hover_and_stats():
    run = make_run()
    run.events[1] = dataclasses.replace(run.events[1], drafted_by="lookup")
    html = stream_html(run)
    assert html.count("(copied by prompt lookup)") == 2  # round 2's two drafts, not round 1's
    assert "<td>rounds drafted by prompt lookup</td><td><b>1 of 2</b>" in stats_html(run)
    assert "over 2 rounds (γ = 2), 1 of them drafted by prompt lookup" in summary(run)
    assert "γ = 2 · 1 of 2 rounds copied by prompt lookup</div>" in batch_html([run])
    assert "prompt lookup" not in stats_html(make_run()) + summary(make_run())
    accepted, rejected = charts.tokens_per_round(run)["data"][:2]
    assert accepted["marker"]["pattern"]["shape"] == rejected["marker"]["pattern"]["shape"] == ["", "/"]
    assert "copied by prompt lookup" in accepted["name"]
    assert "pattern" not in charts.tokens_per_round(make_run())["data"][0]["marker"]


def test_the_stats_say_what_a_step_read_of_the_targets_weights_where_known():
    run = make_run()
    assert "weights read" not in stats_html(run)
    run.meta.weights = "the GGUF's blocks (Q4_1, Q8_0), 96 MB a step"
    assert "<td>target&#x27;s weights read</td><td><b>the GGUF&#x27;s blocks (Q4_1, Q8_0), 96 MB a step</b>" in \
        stats_html(run)


def test_summaries():
    run = make_run()
    assert (run.n_accepted, run.n_rejected, run.n_tokens, run.token_ids) == (3, 1, 5, [5, 7, 8, 9, 4])
    assert run.acceptance_rate == 0.75 and run.tokens_per_round == 2.5 and run.tokens_per_s == 125.0
    assert run_text(run, colour=False) == "a[-<script>alert(1)</script>-]{c}de<f>"
    assert "3 / 1 / 4</b>" in stats_html(run) and "rejected of 4 drafted" in summary(run)
    first = run.events[0]  # a third draft after the rejection: drafted, never judged
    untested = DraftedToken(3, "x", 0.2, 0.1, 0.5, None, "unverified")
    run.events[0] = dataclasses.replace(first, gamma=3, drafted=[*first.drafted, untested])
    assert run.n_untested == 1 and run.acceptance_rate == 0.75
    assert "3 / 1 / 5 (1 not reached)</b>" in stats_html(run)
    assert "(3 accepted, 1 rejected, 1 not reached of 5 drafted)" in summary(run)
    assert first_difference([1, 2, 3], [1, 2, 3]) is None and first_difference([1, 2], [1, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_a_run_slower_than_plain_decoding_is_told_why_from_its_own_timings():
    """Rounds slower than plain steps: what a round costs in steps against the tokens it gave. Rounds faster,
    the run slower end to end: the prefill (a long prompt's, which the EAGLE head reads too)."""
    def timed(run, prefill_ms, ends_ms, drafter=""):  # the rounds' ends, since the run started
        meta = dataclasses.replace(run.meta, prefill_ms=prefill_ms, drafter=drafter)
        return dataclasses.replace(run, meta=meta, events=[
            dataclasses.replace(e, elapsed_ms=end) for e, end in zip(run.events, ends_ms, strict=True)])

    base = timed(make_run("baseline"), 5.0, [20.0, 36.0])  # 5 tokens: in 36 ms, 31 after the prefill
    assert slower_note(timed(make_run(), 5.0, [20.0, 30.0]), base) == ""  # faster: nothing to explain
    spec = timed(make_run(), 30.0, [35.0, 40.0], "lookup+eagle")  # in 40 ms, but 10 after the prefill
    assert slower_note(spec, base) == ("plain decoding is faster here end to end, though the rounds decoded 3.10x "
                                       "as fast as its steps: the prefill took 30 ms against its 5 ms (the EAGLE "
                                       "head reads the prompt too)")
    assert slower_note(dataclasses.replace(spec, meta=dataclasses.replace(spec.meta, drafter="model")), base) \
        .endswith("against its 5 ms")
    slow_rounds = timed(make_run(), 5.0, [25.0, 40.0])  # 35 ms of rounds against the baseline's 31
    assert slower_note(slow_rounds, base).startswith("plain decoding is faster here: a round costs 1.00 steps to "
                                                     "verify and 0.40 to draft, and gives 2.50 tokens")


def test_diff_marker_names_the_position():
    a, b = make_run(), make_run("baseline")
    assert "identical" in diff_html(a, b)
    b.events[1].extra = ExtraToken(3, "g", "bonus", 0.7)
    assert "part at generated token 5" in diff_html(a, b)
    assert "Sampled mode" in diff_html(make_run(temperature=1.0), b)


def test_charts_keep_zoom_and_show_the_data():
    run = make_run()
    figs = [charts.tokens_per_round(run), charts.tokens_over_time(run, run), charts.acceptance_by_position(run),
            charts.speedup_curve(run, run), charts.token_inspector(run.events[0].drafted[1], "x"),
            charts.cache_lengths(run), charts.sample_histogram(None)]
    assert all(f["layout"]["uirevision"] for f in figs)
    assert figs[0]["data"][0]["y"] == [1, 2] and figs[0]["data"][1]["y"] == [1, 0]
    assert figs[2]["data"][0]["y"] == [1.0, 0.5]  # position 1: 2 of 2 accepted; position 2: 1 of 2
    assert len(figs[4]["data"]) == 3  # p, q and the residual at a rejected position
    per_pass = [t for t in figs[1]["data"] if t.get("yaxis") == "y2"]  # each run's ms per target pass
    assert [t["y"] for t in per_pass] == [[e.verify_ms for e in run.events]] * 2
    for fig in figs:  # valid Plotly: the full Figure accepts every spec
        assert fig.figure().to_json()


def test_a_tree_runs_speedup_point_says_the_bound_is_a_chains():
    """Leviathan's bound is for a chain of γ drafts: a tree of as many drafts can pass it, and says so."""
    chain = make_run()
    tree = dataclasses.replace(chain, meta=dataclasses.replace(chain.meta, branch=3, nodes=5))
    names = [[trace["name"] for trace in charts.speedup_curve(run, run)["data"]] for run in (chain, tree)]
    assert names[0] == ["bound for α=0.75, c=0.20", "measured (this run)"]
    assert names[1] == ["a chain's bound for α=0.75, c=0.20", "measured (a tree: it can pass a chain's bound)"]


def test_theory():
    assert expected_tokens_per_round(0.0, 4) == 1.0
    assert expected_tokens_per_round(1.0, 4) == 5.0
    assert expected_tokens_per_round(0.5, 1) == pytest.approx(1.5)
    assert speedup_bound(0.8, 4, 0.05) == pytest.approx((1 - 0.8**5) / 0.2 / 1.2)
    run = make_run()
    assert cost_ratio(run) == pytest.approx((8.0 / 4) / 10.0)  # 2 ms per drafted token over a 10 ms step


def test_counts_read_as_english():
    """A one-token run or first round says '1 token', not '1 tokens'."""
    assert [count(1), count(2), count(0), count(4096), count(1, "round")] == [
        "1 token", "2 tokens", "0 tokens", "4,096 tokens", "1 round"]


def test_control_tokens_show_as_what_they_are_and_line_breaks_as_a_mark():
    """A chat template's <|im_end|> (or </s>) is drawn as a badge naming it, not as markup; a token's line break
    keeps its break with a ⏎ before it; other text stays escaped."""
    run = make_run()
    run.events[0] = dataclasses.replace(run.events[0], extra=ExtraToken(7, "<|im_end|>", "correction", 0.5, 0.1))
    run.events[1].drafted[0] = dataclasses.replace(run.events[1].drafted[0], text="end.\n")
    page = stream_html(run)
    drawn = re.sub(r'title="[^"]*"', "", page)  # what the page draws, the hovers aside
    assert '<span class="sv-special">⟨im_end⟩</span>' in drawn and "im_end|" not in drawn
    assert ">end.⏎\n</span>" in page
    assert "&lt;script&gt;" in page  # the rest escaped as before


MARKUP = ['<b style="font-size:80px">BIG</b>', "<br>", '<span style="color:red">x</span>']


def _strings(spec) -> list[str]:
    """Every string in a Plotly spec (titles, names, text, hover), wherever it sits."""
    if isinstance(spec, str):
        return [spec]
    if isinstance(spec, dict):
        return [s for v in spec.values() for s in _strings(v)]
    if isinstance(spec, list | tuple):
        return [s for v in spec for s in _strings(v)]
    return []


@pytest.mark.parametrize("markup", MARKUP)
def test_charts_show_token_markup_as_text(markup):
    """Plotly draws the tags its labels hold (bold, line breaks, styles): a token's text reaches it with <, > as
    entities, so the chart shows the token. Only the charts' own line breaks stay tags."""
    from specviz.core.events import Candidate, SampleCheck

    top = [TopToken(6, markup, 0.1, 0.6, 0.0), TopToken(7, "c", 0.5, 0.1, 0.8)]
    drafted = [DraftedToken(5, markup, 0.5, 0.4, 0.8, 0.3, "accepted", top, score=0.5),
               DraftedToken(6, markup, 0.6, 0.1, 1 / 6, 0.9, "rejected", top, score=0.2)]
    event = RoundEvent(0, 2, drafted, ExtraToken(7, markup, "correction", 0.5, 0.1, top), 1, 4.0, 10.0, 2, 2, 2,
                       20.0, parents=[-1, 0])
    check = SampleCheck(100, [Candidate(6, markup, 0.5, 0.4, 0.6)], 0.1, 0.1, 0.05, 1.0, 1.0, 0.5)
    figs = [charts.token_tree(event), charts.token_tree(event, shown=1, decided=-1, greedy=True),
            charts.token_inspector(drafted[1], "round 1, position 2:"), charts.sample_histogram(check)]
    for fig in figs:
        text = " ".join(_strings(fig)).replace("<br>", " ")
        assert "<" not in text and ">" not in text, text
        assert fig.figure().to_json()
    shown = " ".join(_strings(figs[0]))
    assert markup.replace("<", "&lt;").replace(">", "&gt;")[:9] in shown
