"""A round's time by stage (events.STAGES): each stage holds its own work, and together they are the round's wall
time, in a single run, a batch, the baseline, and on the page."""

import re
import time
from statistics import median

import pytest
from conftest import words

from specviz.core import drafters, generator, recording
from specviz.core.events import STAGES, runs_from_json, runs_to_json
from specviz.core.generator import Settings, generate, generate_batch
from specviz.view.rendering import stats_html, summary

PAUSE_S = 0.03


def slowed(monkeypatch, owner, name: str) -> None:
    """owner.name sleeps PAUSE_S before doing its work."""
    work = getattr(owner, name)

    def slow(*args, **kwargs):
        time.sleep(PAUSE_S)
        return work(*args, **kwargs)

    monkeypatch.setattr(owner, name, slow)


@pytest.mark.parametrize(("owner", "name", "stage"), [
    (drafters.DraftModelDrafter, "propose", "draft"),
    (generator, "_verify", "verify"),
    (generator, "_judge", "judge"),
    (recording.Recorder, "tokens", "record"),
    (drafters.DraftModelDrafter, "verified", "rest"),
])
def test_each_stage_holds_its_own_work(pattern_pair, monkeypatch, owner, name, stage):
    """A pause in one stage's work shows in that stage and in no other (medians over the rounds: a busy machine may
    stall any one round anywhere)."""
    pair = pattern_pair("llama")

    def medians() -> dict[str, float]:
        run = generate(pair, "", Settings(gamma=2, max_new_tokens=12), prompt_ids=words(2, 3, 4))
        return {s: median(e.stage_ms[s] for e in run.events) for s in STAGES}

    plain = medians()
    slowed(monkeypatch, owner, name)
    paused = medians()
    assert paused[stage] >= 1000 * PAUSE_S
    assert all(paused[other] < plain[other] + 500 * PAUSE_S for other in STAGES if other != stage), (plain, paused)


@pytest.mark.parametrize("mode", ["speculative", "baseline"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_stages_add_up_to_the_rounds(pattern_pair, mode, temperature):
    pair = pattern_pair("llama")
    run = generate(pair, "", Settings(gamma=3, max_new_tokens=24, temperature=temperature), mode=mode,
                   prompt_ids=words(2, 3, 4))
    assert all(min(e.stage_ms.values()) >= 0 and e.verify_ms > 0 and e.judge_ms > 0 for e in run.events)
    if mode == "speculative":
        assert all(e.draft_ms > 0 for e in run.events)
    # each round ends where the next begins: what lies between is a few statements, not a stage left out (a median:
    # a busy machine may stall the process between two rounds)
    starts = [run.meta.prefill_ms] + [e.elapsed_ms for e in run.events[:-1]]
    between = [event.elapsed_ms - start - event.round_ms for start, event in zip(starts, run.events, strict=True)]
    assert min(between) > -1e-6 and median(between) < 0.1


def test_a_batch_shares_each_round_among_its_rows(pattern_pair):
    pair = pattern_pair("llama")
    runs = generate_batch(pair, ["", ""], Settings(gamma=2, max_new_tokens=12),
                          prompts_ids=[words(2, 3, 4), words(5, 6, 7)])
    for a, b in zip(runs[0].events, runs[1].events, strict=False):
        assert a.stage_ms == pytest.approx(b.stage_ms)  # both rows ran every round together: equal shares
        assert a.elapsed_ms == b.elapsed_ms


def test_the_split_travels_in_traces_and_is_drawn(pattern_pair):
    pair = pattern_pair("llama")
    spec = generate(pair, "", Settings(gamma=2, max_new_tokens=12), prompt_ids=words(2, 3, 4))
    base = generate(pair, "", Settings(gamma=2, max_new_tokens=12), mode="baseline", prompt_ids=words(2, 3, 4))
    again = runs_from_json(runs_to_json([spec]))[0]
    assert [e.stage_ms for e in again.events] == [e.stage_ms for e in spec.events]
    page = stats_html(spec, base)
    bars = dict(re.findall(r'data-run="(\w+)" data-ms="([\d.]+)"', page))
    assert float(bars["speculative"]) == pytest.approx(sum(spec.mean_stages().values()), abs=1e-3)
    assert float(bars["baseline"]) == pytest.approx(sum(base.mean_stages().values()), abs=1e-3)
    drawn = [float(ms) for ms in re.findall(r'data-stage="\w+" data-ms="([\d.]+)"', page)]
    assert len(drawn) == 2 * len(STAGES)
    assert sum(drawn[: len(STAGES)]) == pytest.approx(float(bars["speculative"]), abs=0.01)
    assert "verify (target forward)" in summary(spec)


def test_an_old_trace_without_the_split_loads(pattern_pair):
    pair = pattern_pair("llama")
    run = generate(pair, "", Settings(gamma=2, max_new_tokens=6), prompt_ids=words(2, 3, 4))
    text = re.sub(r', "(judge|record|rest)_ms": [\d.e-]+', "", runs_to_json([run]))
    assert "judge_ms" not in text
    old = runs_from_json(text)[0]
    assert all(e.round_ms == e.draft_ms + e.verify_ms for e in old.events)
    assert "sv-time-split" in stats_html(old)
