"""A round in stages (step mode), the five steps with its numbers, the cache chart, and the tie
shown where greedy runs part: all read from recorded events, so replays step like live runs."""

import dataclasses

import pytest
from conftest import words

from specviz.core.events import ExtraToken, RoundEvent, TopToken
from specviz.core.generator import Settings, generate
from specviz.view import charts
from specviz.view.rendering import tie_html
from specviz.view.stages import ADD, DECIDE, DRAFT, VERIFY, how_it_works_html, round_stages, stage_html


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_round_steps_through_drafts_verify_decisions_and_the_added_token(random_pair, temperature):
    run = generate(random_pair, "", Settings(gamma=3, temperature=temperature, max_new_tokens=14, seed=2),
                   prompt_ids=words(1, 2))
    for event in run.events:
        stages = round_stages(event, run.meta)
        tested = [i for i, t in enumerate(event.drafted) if t.status in ("accepted", "rejected")]
        assert [s.kind for s in stages] == [DRAFT] * len(event.drafted) + [VERIFY] + [DECIDE] * len(tested) + [ADD]
        assert [s.position for s in stages if s.kind == DECIDE] == tested
        for k, stage in enumerate(stages):
            page = stage_html(event, run.meta, k)
            assert f"stage {k + 1} of {len(stages)}" in page
            marked = page.count('class="sv-cur')  # the stage's own cell; the whole p row for the verify pass
            assert marked == len(event.drafted) if stage.kind == VERIFY else marked <= 1
            if event.drafted and stage.kind == DRAFT:  # p is not known before the verify pass
                assert f"{event.drafted[0].p:.3f}" not in page.split("p (target)")[1].split("</tr>")[0]
        final = stage_html(event, run.meta, len(stages) - 1)
        assert all(f"{t.p:.3f}" in final for t in event.drafted)
    sampled = [s for e in run.events for s in round_stages(e, run.meta) if s.kind == DECIDE]
    if temperature:
        assert sampled and all("u = " in s.caption and "min(1, p/q)" in s.caption for s in sampled)
    else:
        assert all("most likely" in s.caption for s in sampled)


def test_how_it_works_fills_in_the_round_up_to_the_stage(random_pair):
    run = generate(random_pair, "", Settings(gamma=3, temperature=1.0, max_new_tokens=10, seed=4),
                   prompt_ids=words(1, 2))
    event = next(e for e in run.events if e.n_rejected)
    stages = round_stages(event, run.meta)
    first, last = how_it_works_html(event, run.meta, 0), how_it_works_html(event, run.meta, len(stages) - 1)
    assert first.count("…") == 4 and 'class="sv-now"><b>Draft' in first  # only step 1 has numbers yet
    assert "…" not in last and "rejected" in last and f"target cache {event.target_cache_len} tokens" in last
    assert last.count('class="sv-now"') == 2  # adding the token and rolling back end the round together


def test_a_copied_draft_is_told_as_copied_not_sampled(random_pair):
    settings = Settings(gamma=2, temperature=1.0, max_new_tokens=6, drafter="lookup")
    run = generate(random_pair, "", settings, prompt_ids=words(1, 2, 1, 2))
    drafts = [s.caption for e in run.events for s in round_stages(e, run.meta) if s.kind == DRAFT]
    assert drafts and all("copied from" in text and "sampled" not in text for text in drafts)


def test_token_text_is_escaped_in_the_stage_view(random_pair):
    run = generate(random_pair, "", Settings(gamma=2, max_new_tokens=4), prompt_ids=words(1, 2))
    event = dataclasses.replace(run.events[0], extra=ExtraToken(5, "<script>x</script>", "bonus", 0.5))
    page = stage_html(event, run.meta, 99) + how_it_works_html(event, run.meta, 99)
    assert "<script>" not in page and "&lt;script&gt;" in page


@pytest.mark.parametrize("drafter", ["model", "lookup"])
def test_cache_chart_keeps_the_text_and_marks_what_was_rolled_back(random_pair, drafter):
    run = generate(random_pair, "", Settings(gamma=3, temperature=1.0, max_new_tokens=16, seed=1, drafter=drafter),
                   prompt_ids=words(1, 2, 1, 2))
    figure = charts.cache_lengths(run)
    series = {t["name"]: t for t in figure["data"]}
    prompt = len(run.meta.prompt_ids)
    # after each rollback the target holds the text but its last token: an oracle from the text alone
    assert series["target: kept"]["y"] == [prompt - 1 + e.tokens_so_far for e in run.events]
    assert series["target: rolled back"]["y"] == [len(e.drafted) - e.n_accepted for e in run.events]
    assert series["target before the round"]["y"][0] == prompt - 1
    assert ("drafted, then dropped" in series) == (drafter == "model")


def test_records_follow_the_text_and_the_tie_shows_both_candidates(random_pair):
    run = generate(random_pair, "", Settings(gamma=3, max_new_tokens=12), prompt_ids=words(1, 2))
    assert [r.id for r in run.records()] == run.token_ids
    assert all(r.top for r in run.records())  # candidates recorded at every position, added tokens included
    base = generate(random_pair, "", Settings(max_new_tokens=12), mode="baseline", prompt_ids=words(1, 2))
    other = dataclasses.replace(base, events=list(base.events))
    last = other.events[-1]
    swapped = next(t for t in last.extra.top if t.id != last.extra.id)
    other.events[-1] = dataclasses.replace(last, extra=ExtraToken(swapped.id, swapped.text, "target", swapped.p,
                                                                  top=last.extra.top))
    page = tie_html(base, other, base.n_tokens - 1)  # the two part at their last token
    assert f"{swapped.p:.4f}" in page and f"{last.extra.p:.4f}" in page and "logit gap" in page
    assert isinstance(last.extra.top[0], TopToken) and isinstance(run.events[0], RoundEvent)
