"""The first run's drafter and γ from this machine's costs: the expected-speedup rule in closed form,
the note where nothing wins, and the measurement kept in the cache."""

from dataclasses import replace

import pytest
from conftest import scripted_meters, while_another_process_makes

from specviz.core.generator import Settings
from specviz.models import contention, kernels
from specviz.tools import costs
from specviz.tools.costs import Choice, Costs, describe, expected_speedup, note, rank


def made_costs(forward, draft, overhead=None) -> Costs:
    return Costs("test machine", "float32", False, forward, draft, overhead or {})


def test_expected_speedup_is_tokens_per_round_over_the_round_in_steps():
    c = made_costs({1: 10.0, 2: 12.0, 3: 15.0}, {"eagle": 1.0}, {"": 1.0, "eagle": 2.0})
    # plain: 10 + 1 per token; a γ = 2 round: verify(3) 15 + 2 drafts of 1 + 2 of bookkeeping
    assert expected_speedup(c, "eagle", (2, 1, 0), 1.9) == pytest.approx(1.9 * 11 / 19)
    assert c.c(3) == pytest.approx(1.5) and c.c(9) == pytest.approx(1.5)  # beyond the widths timed: the widest


def test_a_runs_prefill_is_priced_with_its_rounds_and_a_long_prompt_brings_it_towards_one():
    """A run's tokens per second count its prefill: the target's over the 34-token calibration prompt took 25 ms. A
    run of 64 new tokens is priced as (25 + 64 · 11) / (25 + 64 / 1.9 · 19), not 1.9 · 11 / 19; a prompt's prefill
    is affine in its tokens (a one-token forward at two), so after a long one it takes most of both runs and the
    expectation falls towards 1."""
    c = made_costs({1: 10.0, 2: 12.0, 3: 15.0}, {"eagle": 1.0}, {"": 1.0, "eagle": 2.0})
    rounds_alone = expected_speedup(c, "eagle", (2, 1, 0), 1.9)
    assert rounds_alone == pytest.approx(1.9 * 11 / 19)
    assert expected_speedup(c, "eagle", (2, 1, 0), 1.9, new_tokens=64) == rounds_alone  # no prefill timed
    c.context, c.prefill_ms = 34, 25.0
    run = expected_speedup(c, "eagle", (2, 1, 0), 1.9, new_tokens=64)
    assert run == pytest.approx((25 + 64 * 11) / (25 + 64 / 1.9 * 19)) and 1 < run < rounds_alone
    assert c.prefill(34) == 25.0 and c.prefill(2) == 10.0 and c.prefill(1) == 0.0
    assert c.prefill(66) == pytest.approx(10 + 15 * 64 / 32)
    long = expected_speedup(c, "eagle", (2, 1, 0), 1.9, context=4000 + 32, new_tokens=64)
    assert 1 < long < 1.1  # (the forwards not timed over a long context here: the prefill alone moves it)
    best = rank(c, {"eagle": {(2, 1, 0): 1.9}}, new_tokens=64)[0]
    assert best.expected == pytest.approx(run) and "in a run of 64 new tokens, prefills included" in describe(best, c)


def test_rank_weighs_acceptance_against_the_machines_verify_cost():
    taus = {"eagle": {(1, 1, 0): 1.5, (2, 1, 0): 1.8, (3, 1, 0): 2.0}, "lookup": {(2, 1, 0): 1.2},
            "unmeasured": {(1, 1, 0): 9.0}}
    cheap = made_costs({1: 10.0, 2: 10.0, 3: 10.0, 4: 10.0}, {"eagle": 1.0, "lookup": 0.0})
    dear = made_costs({1: 10.0, 2: 16.0, 3: 22.0, 4: 28.0}, {"eagle": 1.0, "lookup": 0.0})
    assert rank(cheap, taus)[0] == Choice("eagle", 3, pytest.approx(2.0 * 10 / 13))  # flat verify: draft deep
    best = rank(dear, taus)[0]
    assert (best.drafter, best.gamma) == ("eagle", 1)  # dear verify: draft one
    assert all(ch.drafter != "unmeasured" for ch in rank(cheap, taus))  # no cost measured: never chosen
    assert note(rank(cheap, taus)[0], cheap) == ""


def test_a_tree_wins_where_wide_verifies_are_cheap_and_loses_where_they_are_dear():
    """A tree of 8 drafts (width 9) at 2.4 tokens per round against a chain of 2 at 1.8."""
    taus = {"eagle": {(2, 1, 0): 1.8, (4, 4, 8): 2.4}}
    flat = made_costs({1: 10.0, 2: 10.0, 3: 10.5, 5: 11.0, 9: 12.0}, {"eagle": 1.0})
    steep = made_costs({1: 10.0, 2: 11.0, 3: 12.0, 5: 16.0, 9: 30.0}, {"eagle": 1.0})
    flat.tree_ms[costs.tree_key("eagle", (4, 4, 8))] = steep.tree_ms[costs.tree_key("eagle", (4, 4, 8))] = 4.0
    best = rank(flat, taus)[0]
    assert (best.shape, best.expected) == ((4, 4, 8), pytest.approx(2.4 * 10 / 16))
    assert rank(steep, taus)[0].shape == (2, 1, 0)
    assert "as a tree (4 deep, 4 children per node, 8 drafts verified)" in describe(best, flat)
    assert costs.width((4, 4, 8)) == 9 and costs.width((3, 2, 0)) == 2 + 2 * 4 + 1


def test_trees_are_priced_on_one_plane_through_their_rounds_so_one_slow_calibration_does_not_reorder_them():
    """The offline preset's ten trees, whose rounds cost 1 + 1 ms a level + 0.1 ms a draft verified, but for 3x4:8,
    whose calibration decode ran 1.5 ms slow: priced on the plane through all ten, most of that is gone and 3x4:8
    still ranks above 3x3:5 (at its own round it would not); below four trees, or at one depth, each its own round."""
    shapes = [(3, 2, 4), (2, 4, 6), (3, 4, 8), (4, 4, 8), (5, 4, 12), (5, 4, 16), (3, 3, 5), (4, 2, 5), (4, 3, 5),
              (4, 3, 6)]
    c = made_costs({1: 10.0, **{w: 10.0 for w in range(2, 18)}}, {"eagle": 1.0})
    on_line = {shape: 1 + shape[0] + 0.1 * (costs.width(shape) - 1) for shape in shapes}
    c.tree_ms = {costs.tree_key("eagle", shape): ms for shape, ms in on_line.items()}
    c.tree_ms[costs.tree_key("eagle", (3, 4, 8))] += 1.5
    c.tree_ms[costs.tree_key("eagle", (3, 4, 8), sampled=True)] = 9.0  # sampled trees: their own plane, if any
    line = costs.tree_line(c, "eagle")
    assert set(line) == set(shapes) and line[3, 4, 8] - on_line[3, 4, 8] < 0.5
    assert max(abs(line[s] - on_line[s]) for s in shapes) < 0.6  # spread over the others, none moved as far
    taus = {"eagle": {(3, 3, 5): 2.3, (3, 4, 8): 2.4}}
    assert rank(c, taus)[0].shape == (3, 4, 8)
    assert costs.beside_verify_ms(c, "eagle", (3, 4, 8), sampled=True) == 9.0  # one sampled tree: its own round
    c.tree_ms = {key: ms for key, ms in c.tree_ms.items() if any(t in key for t in (" 3x4:8", " 3x3:5", " 2x4:6"))}
    assert costs.tree_line(c, "eagle") == {} and rank(c, taus)[0].shape == (3, 3, 5)  # three: each its own round
    one_depth = made_costs({1: 10.0}, {"eagle": 1.0})
    one_depth.tree_ms = {costs.tree_key("eagle", (3, b, n)): 5.0 for b, n in ((2, 4), (3, 5), (4, 8), (4, 6))}
    assert costs.tree_line(one_depth, "eagle") == {}


def test_a_long_context_prices_wide_verifies_dearer_and_can_choose_a_narrower_shape(monkeypatch):
    """Each token of a forward attends over every cached key: timed over 32 and 1,032 tokens of cache, a forward
    over n tokens is priced as the short one plus n times what a key adds, and a long prompt's run can be better off
    with a chain where a short one's is a tree; the app's closing line prices a run at its own context and names
    that shape."""
    taus = {"eagle": {(1, 1, 0): 1.5, (3, 2, 4): 2.2}}
    c = made_costs({1: 10.0, 2: 10.5, 5: 12.0}, {"eagle": 1.0})
    c.tree_ms[costs.tree_key("eagle", (3, 2, 4))] = 3.0
    c.context, c.long_context, c.long_ms = 32, 1032, {1: 12.0, 2: 14.5, 5: 22.0}
    assert c.forward(5) == c.forward(5, 32) == c.forward(5, 8) == 12.0  # the calibration prompt's, and below it
    assert c.forward(5, 532) == pytest.approx(17.0) and c.forward(4, 2032) == pytest.approx(32.0)  # 2 k ms per 1,000
    assert c.c(5, 1032) == pytest.approx(22.0 / 12.0)
    assert replace(c, long_ms={1: 9.0, 2: 10.5, 5: 12.0}).forward(1, 1032) == 10.0  # a noisy slope under 0: flat
    # what a context token adds is a line in k through every width's two timings: a noisy long timing of one wide
    # forward (5 tokens: 3 ms more, where 1-3 tokens took 2, 4 and 6 more) does not price it below a narrower one
    noisy = replace(c, forward_ms={1: 10.0, 2: 10.5, 3: 11.0, 5: 12.0}, long_ms={1: 12.0, 2: 14.5, 3: 17.0, 5: 15.0})
    assert noisy.per_token(5) * 1000 == pytest.approx(3.75 + 0.2 * 2.25)  # mean 3.75 ms at k = 2.75, 0.2 ms a token
    assert noisy.forward(5, 1032) == pytest.approx(16.2) and noisy.forward(3, 1032) == pytest.approx(14.8)
    assert replace(c, long_context=0).forward(5, 5000) == 12.0  # not timed long: the short context's
    assert costs.context_of(1769, 64) == 1801

    short, long = rank(c, taus)[0], rank(c, taus, context=1032)[0]
    assert (short.shape, short.context) == ((3, 2, 4), None)
    assert short.expected == pytest.approx(2.2 * 10 / 15)  # a tree of 4 drafts: a verify of 5 and 3 ms drafting
    assert (long.shape, long.context) == ((1, 1, 0), 1032)
    assert long.expected == pytest.approx(1.5 * 12 / 15.5)
    assert "chosen for this machine at a context of 1,032 tokens: eagle at γ = 1" in describe(long, c)
    assert "a verify of 2 tokens costs 1.21 one-token steps of 12.0 ms here" in describe(long, c)
    longer = rank(c, taus, context=4000)[0]
    assert longer.expected < 1 and "On this machine at a context of 4,000 tokens no drafter" in note(longer, c)

    # the app: a run of the choice made on a short prompt, told at its own context, with the shape expected faster
    from specviz.models.loading import Preset
    from specviz.ui import page

    monkeypatch.setattr(page, "PRESETS", {"p": Preset("p", "t", "d", "", tokens_per_round=(
        ("eagle", 1, 1.5), ("eagle", 3, 2.2, 2, 4)))})
    monkeypatch.setattr(page, "_MACHINE_CHOICES", {("p", False): (short, c)})
    told = []
    monkeypatch.setattr(page, "against", lambda choice, *args, **kwargs: told.append(choice) or (
        "told" if (choice.drafter, choice.shape) == ("eagle", (3, 2, 4)) else ""))
    assert page.measured_against("p", False, 1032)(None, None) == (
        f"told; at a context of 1,032 tokens eagle at γ = 1 is expected faster ({long.expected:.2f}x)")
    assert told[-1].context == 1032 and told[-1].expected == pytest.approx(2.2 * 12 / (22 + 3))
    assert page.measured_against("p", False, 40)(None, None) == "told"  # short: the choice stands
    monkeypatch.setattr(page, "against", lambda choice, *args, **kwargs: "told" if choice.gamma == 1 else "")
    assert page.measured_against("p", False, 1032)(None, None) == "at a context of 1,032 tokens, eagle at γ = 1, told"


def test_when_nothing_beats_plain_decoding_the_note_says_so_and_why():
    c = made_costs({1: 10.0, 2: 25.0, 3: 40.0}, {"eagle": 2.0})
    best = rank(c, {"eagle": {(1, 1, 0): 1.5, (2, 1, 0): 1.8}})[0]
    assert best.expected < 1
    text = describe(best, c)
    assert "no drafter and γ is expected to beat plain decoding:" in text and "2.50 one-token steps" in text
    barely = made_costs({1: 10.0, 2: 12.0, 3: 16.0}, {"eagle": 0.5})  # a γ = 1 round: 12.5 ms against 10 a token
    assert note(rank(barely, {"eagle": {(1, 1, 0): 1.5}})[0], barely) == ""
    close = rank(barely, {"eagle": {(1, 1, 0): 1.3}})[0]
    assert 1 < close.expected < 1.05
    said = note(close, barely)
    assert "expected to beat plain decoding by 5%: the best, eagle at γ = 1, is expected at 1.04x" in said


def test_a_run_of_the_machines_choice_is_told_its_expectation_part_by_part(pattern_pair):
    """costs.against: the speedup a run measured beside the one expected, and each part of the expectation as the
    run measured it, in its baseline's one-token steps, beside what the choice priced it at."""
    from statistics import median

    from specviz.core.generator import Settings
    from specviz.tools.stream import stream

    done = list(stream(pattern_pair("llama"), "w2 w3 w4", Settings(gamma=2, max_new_tokens=24), compare=True,
                       chat_template=False))[-1]
    spec, base = done.spec, done.base
    step = median(e.verify_ms for e in base.events[1:])  # the baseline's first step holds its prefill's last token
    verify = median(e.verify_ms for e in spec.events) / step
    # a round's time outside its verify (drafting, bookkeeping), in steps
    rest = (spec.decode_ms - spec.meta.prefill_ms - sum(e.verify_ms for e in spec.events)) / len(spec.events) / step
    measured = (f"measured {spec.tokens_per_s / base.tokens_per_s:.2f}x: a round verified in {verify:.2f} steps "
                f"(priced at {{}}), drafted and kept its books in {rest:.2f} more (priced at {{}}) "
                f"and yielded {spec.tokens_per_round:.2f} tokens ({{}} on a median benchmark prompt)")
    c = made_costs({1: 10.0, 2: 11.0, 3: 12.0, 5: 14.0}, {"model": 2.0}, {"": 0.5, "model": 1.0})
    # a chain of 2: a verify of 3 tokens at 12 / 10; 2 drafts of 2 ms and 1 ms of bookkeeping a round
    chain = costs.against(Choice("model", 2, 1.5, tokens_per_round=1.8), c, spec, base)
    assert chain == "expected 1.50x, " + measured.format("1.20", "0.50", "1.80")
    # a tree, sampled: a verify of 5 tokens, and the sampled round's drafting and bookkeeping as timed
    c.tree_ms[costs.tree_key("eagle", (3, 2, 4), sampled=True)] = 7.0
    as_tree = replace(spec, meta=replace(spec.meta, drafter="eagle", gamma=3, branch=2, nodes=4, temperature=1.0))
    tree = costs.against(Choice("eagle", 3, 1.4, 2, 4, 2.1), c, as_tree, base, sampled=True)
    assert tree == "expected 1.40x, " + measured.format("1.40", "0.70", "2.10")
    assert costs.against(Choice("eagle", 3, 1.4, 2, 4, 2.1), c, as_tree, base) == ""  # the greedy choice's price
    # what the costs did not price, or nothing to count in: no sentence
    for other in (dict(gamma=3), dict(cache="dynamic"), dict(compiled=True), dict(dtype="bfloat16"),
                  dict(gamma_policy="grow-shrink"), dict(batch_size=2)):
        assert costs.against(Choice("model", 2, 1.5), c, replace(spec, meta=replace(spec.meta, **other)), base) == ""
    assert costs.against(Choice("model", 2, 1.5), c, spec, replace(base, events=[])) == ""


def test_costs_are_measured_once_then_read_from_the_cache(pattern_pair, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECVIZ_CACHE", str(tmp_path))
    pair = pattern_pair("llama")
    messages = []
    choice, measured = costs.first_run(pair, {"model": {(1, 1, 0): 1.5, (2, 1, 0): 1.8}}, messages.append)
    assert choice is not None and choice.drafter == "model" and choice.gamma in (1, 2)
    assert set(measured.forward_ms) == set(range(1, costs.MAX_WIDTH + 1)) and measured.draft_ms["model"] > 0
    # timed over a long context too: as long as the model holds, past the calibration prompt
    limit = pair.target.config.max_position_embeddings
    assert set(measured.long_ms) == set(measured.forward_ms)
    assert measured.context < measured.long_context == min(costs.LONG_CONTEXT, limit - costs.MAX_WIDTH - 1)
    assert messages[0].endswith(f"(once, then cached): forwards of 1 to {costs.MAX_WIDTH} tokens, over a short and a "
                                "long context; rounds of plain decoding, model...")
    assert costs._missing(set(), [("eagle", (3, 2, 4), False), ("eagle", (2, 1, 0), False),
                                  ("eagle", (3, 3, 5), False), ("eagle", (3, 2, 4), True)]) \
        == "rounds of eagle; eagle trees 3x2:4, 3x3:5; sampled eagle trees 3x2:4"
    assert list(kernels.profile().read()["rounds"])  # kept in the machine's profile

    def no_decoding(*args, **kwargs):
        raise AssertionError("a second start must read the stored costs")

    monkeypatch.setattr(costs, "_round_costs", no_decoding)
    monkeypatch.setattr(costs, "forward_ms", no_decoding)
    again, read = costs.first_run(pair, {"model": {(1, 1, 0): 1.5, (2, 1, 0): 1.8}})
    assert read == measured and again == choice
    assert costs.first_run(pair, {}) == (None, None)  # a preset with no measured τ keeps its own defaults

    # a second process that starts while the first measures waits for it, then reads its costs
    profile = kernels.profile()
    stored = profile.file.read_bytes()
    profile.update({"rounds": dict.fromkeys(profile.read()["rounds"])})  # None: dropped
    (waited, read), said = while_another_process_makes(
        profile.file, lambda progress: costs.first_run(pair, {"model": {(1, 1, 0): 1.5, (2, 1, 0): 1.8}}, progress),
        lambda: profile.file.write_bytes(stored))
    assert (waited, read) == (choice, measured) and not any("measuring" in m for m in said)


def test_a_sampled_first_run_chooses_by_the_tokens_per_round_measured_when_sampling(monkeypatch):
    """A sampled tree keeps fewer tokens per node than a greedy one: with τ at temperature 1 in the preset,
    the shape chosen for sampling is the chain where the greedy choice is a tree, and the page says so."""
    import gradio as gr

    from specviz.models.loading import Preset
    from specviz.ui import handlers, page

    preset = Preset("p", "t", "d", "", tokens_per_round=(("eagle", 2, 1.8), ("eagle", 4, 2.4, 4, 8)),
                    sampled_tokens_per_round=(("eagle", 2, 1.6), ("eagle", 4, 1.7, 4, 8)))
    assert preset.taus(sampled=True) == {"eagle": {(2, 1, 0): 1.6, (4, 4, 8): 1.7}}
    assert Preset("q", "t", "d", "", tokens_per_round=preset.tokens_per_round).taus(sampled=True) == preset.taus()
    flat = made_costs({1: 10.0, 2: 10.0, 3: 10.5, 5: 11.0, 9: 12.0}, {"eagle": 1.0})
    flat.tree_ms[costs.tree_key("eagle", (4, 4, 8))] = flat.tree_ms[costs.tree_key("eagle", (4, 4, 8), True)] = 4.0
    greedy, sampled = rank(flat, preset.taus())[0], rank(flat, preset.taus(sampled=True), sampled=True)[0]
    assert (greedy.shape, sampled.shape) == ((4, 4, 8), (2, 1, 0))
    # the line says which τ the expectation assumes: a prompt that keeps fewer tokens a round gains less
    assert "at the 2.40 tokens a round it keeps on a median benchmark prompt" in costs.describe(greedy, flat)
    assert "at the 1.60 tokens a round" in costs.describe(sampled, flat)

    monkeypatch.setattr(page, "_MACHINE_CHOICES", {("p", False): (greedy, flat), ("p", True): (sampled, flat)})
    drafter, gamma, branch, nodes, note = page.first_run_values("p")
    assert (drafter, gamma, branch, nodes) == ("eagle", 4, 4, 8)
    # the line a projector shows is short; why it was chosen is on hover
    assert f">This machine&#x27;s choice: eagle, tree 4x4:8, expected {greedy.expected:.2f}x here.</div>" in note
    assert 'title="chosen for this machine' in note
    assert f"With a temperature above 0, eagle at γ = 2 is expected fastest here ({sampled.expected:.2f}x)." in note
    assert "With a temperature of 0, eagle as a tree" in page.first_run_values("p", sampled=True)[4]

    # in the app: raising the temperature moves untouched controls to the sampled choice, and back at 0
    monkeypatch.setattr(handlers, "PRESETS", {"p": preset})
    to_sampled = handlers.temperature_changed("p", 0.7, "eagle", 4, 4, 8)
    assert [u["value"] for u in to_sampled[:4]] == ["eagle", 2, 1, 0] and "chosen for this machine" in to_sampled[4]
    assert [u["value"] for u in handlers.temperature_changed("p", 0, "eagle", 2, 1, 0)[:4]] == ["eagle", 4, 4, 8]
    skip = gr.skip()
    assert handlers.temperature_changed("p", 0.7, "eagle", 3, 1, 0) == [skip] * 5  # set by the viewer: kept
    assert handlers.temperature_changed("p", 0.9, "eagle", 2, 1, 0) == [skip] * 5  # already the sampled choice
    assert [u["value"] for u in handlers.preset_changed("p", 0.7)[2:4]] == ["eagle", 2]

    monkeypatch.setattr(page, "_MACHINE_CHOICES", {("p", False): (greedy, flat), ("p", True): (greedy, flat)})
    assert "temperature above 0" not in page.first_run_values("p")[4]
    assert handlers.temperature_changed("p", 0.7, "eagle", 4, 4, 8) == [skip] * 5  # one choice for both


def test_a_sampled_tree_is_priced_by_its_own_round_not_the_greedy_one():
    """A sampled tree drafts fewer levels than the greedy tree of the same shape: a cheaper round can
    make it the choice when sampling, where the greedy round would not."""
    taus = {"eagle": {(2, 1, 0): 1.6, (3, 2, 4): 1.75}}
    c = made_costs({1: 10.0, 2: 10.5, 3: 11.0, 5: 12.0}, {"eagle": 1.0})
    c.tree_ms[costs.tree_key("eagle", (3, 2, 4))] = 4.0  # three head steps
    c.tree_ms[costs.tree_key("eagle", (3, 2, 4), sampled=True)] = 2.0  # two
    assert rank(c, taus)[0].shape == (2, 1, 0)  # 1.6 · 10 / 13 > 1.75 · 10 / 16
    assert rank(c, taus, sampled=True)[0] == Choice("eagle", 3, pytest.approx(1.75 * 10 / 14), 2, 4)


def test_a_first_run_adds_what_the_stored_costs_lack_and_keeps_the_rest(eagle_pair, tmp_path, monkeypatch):
    """The greedy and the sampled first run time different tree rounds: the second adds its own to the
    file, so neither measures again after both have run once."""
    monkeypatch.setenv("SPECVIZ_CACHE", str(tmp_path))
    pair = eagle_pair("llama")
    taus = {"eagle": {(2, 1, 0): 1.5, (3, 2, 4): 1.9}}
    _, greedy = costs.first_run(pair, taus)
    assert set(greedy.tree_ms) == {costs.tree_key("eagle", (3, 2, 4))}
    seen = []
    real = costs._round_costs
    monkeypatch.setattr(costs, "_round_costs", lambda *args: seen.append(args[3:]) or real(*args))
    monkeypatch.setattr(costs, "_quietest_forwards", lambda *a: pytest.fail("the forwards were timed: kept ones "
                                                                             "suffice"))
    _, both = costs.first_run(pair, taus, sampled=True)
    assert seen == [((3, 2, 4), True)]  # only the sampled tree's round
    assert both.tree_ms[costs.tree_key("eagle", (3, 2, 4))] == greedy.tree_ms[costs.tree_key("eagle", (3, 2, 4))]
    assert costs.tree_key("eagle", (3, 2, 4), True) in both.tree_ms
    seen.clear()
    assert costs.first_run(pair, taus)[1] == both and costs.first_run(pair, taus, sampled=True)[1] == both
    assert seen == []  # both stored: read


def test_every_preset_times_its_sampled_shapes_with_the_greedy_ones():
    """A sampled-only shape would need a verify width the greedy first run did not time: the second first
    run would time every forward again."""
    from specviz.models.loading import PRESETS

    for preset in PRESETS.values():
        greedy, sampled = preset.taus(), preset.taus(sampled=True)
        assert all(shape in greedy.get(d, {}) for d, shapes in sampled.items() for shape in shapes if shape[1] > 1)


def test_a_trees_drafting_is_its_median_round_so_one_slow_round_does_not_reorder_shapes(monkeypatch):
    """Rounds drafting in 2, 2, 3 and (one slow round) 40 ms: the tree is priced at its median, 2.5 ms, where
    the mean (11.75) would rank a shape one head step cheaper below a deeper one; a chain keeps its mean per
    drafted token."""
    from types import SimpleNamespace as NS

    rounds = [NS(draft_ms=d, verify_ms=10.0, gamma=2, elapsed_ms=0.0) for d in (2.0, 40.0, 3.0, 2.0)]
    run = NS(events=rounds, meta=NS(prefill_ms=0.0))
    rounds[-1].elapsed_ms = sum(e.draft_ms + e.verify_ms for e in rounds) + 4.0  # 1 ms of bookkeeping a round
    run.rounds_ms = rounds[-1].elapsed_ms  # no prefill (Run.rounds_ms)
    asked = []
    monkeypatch.setattr(costs, "generate", lambda pair, prompt, settings, mode: asked.append(settings) or run)
    draft, bookkeeping = costs._round_costs(None, "eagle", False, (3, 3, 5))
    assert (draft, bookkeeping) == (pytest.approx(2.5), pytest.approx(1.0))
    assert costs._round_costs(None, "eagle", False, (2, 1, 0))[0] == pytest.approx(47.0 / 8)
    # timed as the app and `generate` run: recording the inspector's candidates, whose cost is the round's too
    assert {s.record_top for s in asked} == {Settings().record_top} and Settings().record_top > 0


def test_each_calibration_decode_is_put_at_the_pace_the_forwards_were_timed_at(tmp_path, monkeypatch):
    """The forwards were timed at 10 ms a step; right after a decode one takes 20 (the VM runs at half speed for
    a while): what that decode measured is priced at half, as it would have cost when the forwards were timed."""
    from types import SimpleNamespace as NS

    c = made_costs({k: 10.0 for k in range(1, 6)}, {})
    c.forward_ms[costs.width((3, 2, 4))] = 11.0
    times = iter([25.0, 20.0, 22.0])
    assert costs._pace(c, lambda: next(times)) == 0.5  # the fastest of three
    assert costs._pace(made_costs({}, {}), lambda: 20.0) == costs._pace(c, None) == 1.0  # either unknown: as measured
    monkeypatch.setattr(costs, "_one_step", lambda pair, compiled: lambda: 20.0)
    monkeypatch.setattr(costs, "_round_costs", lambda *args: (2.0, 1.0))
    monkeypatch.setattr(costs, "_quietest_forwards", lambda *a: pytest.fail("the forwards are known"))
    got = costs._measure(NS(tokenizer=None), ["eagle"], [("eagle", (3, 2, 4), False)], False,
                         None, c)
    assert (got.draft_ms, got.overhead_ms) == ({"eagle": 1.0}, {"": 0.5, "eagle": 0.5})
    assert got.tree_ms == {costs.tree_key("eagle", (3, 2, 4)): 1.5}


def test_the_cpus_other_processes_take_are_read_from_proc_stat():
    """/proc/stat's per-CPU lines (clock ticks: user nice system idle iowait irq softirq steal), the CPUs we
    may run on only; and the part of what our threads need that others' load leaves short, in closed form."""
    import os

    tick = os.sysconf("SC_CLK_TCK")
    stat = ("cpu  900 0 900 900 900 0 0 0 0 0\n"
            "cpu0 100 1 10 500 7 2 3 4 0 0\n"
            "cpu1 800 0 800 100 100 0 0 0 0 0\n"
            "cpu2 5 0 5 300 800 0 0 0 0 0\n"
            "intr 12345 0 0\nctxt 999\n")
    assert contention.busy_seconds(stat, {0, 2}) == pytest.approx((100 + 1 + 10 + 2 + 3 + 4 + 5 + 5) / tick)
    assert contention.busy_seconds(stat, {1}) == pytest.approx(1600 / tick)
    assert contention.shortfall(1.0, cpus=2, threads=2) == pytest.approx(0.5)  # a hog on one of two CPUs: half
    assert contention.shortfall(0.0, cpus=2, threads=2) == 0.0
    assert contention.shortfall(32.0, cpus=64, threads=2) == 0.0  # a busy big host still leaves two CPUs free
    assert contention.shortfall(3.5, cpus=4, threads=8) == pytest.approx(0.875)  # needs min(threads, cpus) = 4
    assert contention.shortfall(9.0, cpus=4, threads=2) == 1.0


def test_another_process_burning_every_cpu_is_seen(monkeypatch):
    import os
    import subprocess
    import sys
    import time

    if not os.path.exists("/proc/stat") or len(os.sched_getaffinity(0)) > 8:
        pytest.skip("needs Linux's /proc/stat and at most 8 CPUs to fill")
    monkeypatch.delenv("SPECVIZ_IGNORE_LOAD", raising=False)  # the suite keeps timings as they come (conftest)
    burn = "import time\nend = time.time() + 2\nwhile time.time() < end: pass"
    children = [subprocess.Popen([sys.executable, "-c", burn]) for _ in os.sched_getaffinity(0)]
    try:
        time.sleep(0.3)  # let them start
        share = contention.others_meter()
        time.sleep(1.0)
        taken = share()
    finally:
        for child in children:
            child.wait()
    assert taken > contention.BUSY
    monkeypatch.setenv("SPECVIZ_IGNORE_LOAD", "1")
    assert contention.others_meter()() is None  # told to keep timings as they come


def test_a_forward_costs_the_fastest_of_its_repeats(pattern_pair, monkeypatch):
    """Repeats slowed by another program (half of them, here) move neither a width's cost nor c(k): 1.1, where
    the medians would give 19.5 / 14.5 = 1.34."""
    warm = [50.0, 50.0]  # two repeats warm up
    times = {1: iter(warm + [12.0, 10.0, 18.0, 17.0, 19.0, 10.4]), 2: iter(warm + [11.0, 20.0, 21.0, 11.2, 22.0, 19.0])}
    monkeypatch.setattr(costs, "timed_forward", lambda state, ids: lambda k: next(times[k]))
    assert costs.forward_ms(pattern_pair("llama"), [1, 2, 3], [1, 2], 6, False) == {1: 10.0, 2: 11.0}


def test_costs_timed_on_a_busy_machine_are_timed_again_and_said_to_be(pattern_pair, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECVIZ_CACHE", str(tmp_path))
    pair, taus = pattern_pair("llama"), {"model": {(1, 1, 0): 1.5, (2, 1, 0): 1.8}}
    timings = []

    def forwards(pair, ids, widths, repeats, compiled):
        if repeats == costs.REPEATS:  # an attempt's first timing (the short context's; the long one follows)
            timings.append(len(timings))
        return {k: 10.0 + len(timings) + k for k in widths}  # which attempt was kept: 11 + k, 12 + k, ...

    monkeypatch.setattr(costs, "forward_ms", forwards)
    monkeypatch.setattr(costs, "_round_costs", lambda *args, **kwargs: (1.0, 0.5))

    # busy, then quiet: the forwards are timed twice and the quiet timing kept
    said = []
    monkeypatch.setattr(contention, "others_meter", scripted_meters([0.6, 0.05, 0.0]))
    choice, quiet = costs.first_run(pair, taus, said.append)
    assert len(timings) == 2 and quiet.forward_ms[1] == 13.0 and quiet.busy == 0.05 and not quiet.disturbed
    assert any("other programs took 60% of the CPU time specviz needed" in m for m in said)
    assert "Timed while" not in costs.describe(choice, quiet)

    # busy at every attempt: the quietest of three kept, and the costs say so
    kernels.profile().update({"rounds": dict.fromkeys(kernels.profile().read()["rounds"])})  # None: dropped
    contention._TIMED_HERE.clear()
    timings.clear()
    monkeypatch.setattr(contention, "others_meter", scripted_meters([0.6, 0.4, 0.7, 0.3]))
    choice, busy = costs.first_run(pair, taus)
    assert len(timings) == 3 and busy.forward_ms[1] == 13.0 and busy.busy == 0.4 and busy.disturbed
    assert "Timed while other programs took 40% of the CPU time specviz needed" in costs.describe(choice, busy)

    # read again in this process; timed again by the next one (quiet now), and then read
    monkeypatch.setattr(contention, "others_meter", scripted_meters([]))
    assert costs.first_run(pair, taus) == (choice, busy) and len(timings) == 3
    contention._TIMED_HERE.clear()  # a new process
    said.clear()
    monkeypatch.setattr(contention, "others_meter", scripted_meters([0.0, 0.0]))
    _, again = costs.first_run(pair, taus, said.append)
    assert len(timings) == 4 and again.busy == 0.0
    assert any("the stored costs were timed while other programs took 40%" in m for m in said)
    contention._TIMED_HERE.clear()
    monkeypatch.setattr(contention, "others_meter", scripted_meters([]))
    assert costs.first_run(pair, taus)[1] == again and len(timings) == 4


def test_costs_kept_unmetered_are_timed_again_by_a_start_that_meters(pattern_pair, tmp_path, monkeypatch):
    """Costs the test suite timed on the machine it loads (SPECVIZ_IGNORE_LOAD: kept as they came) serve processes
    that do not meter either; a start that meters times them again, once, and says why."""
    monkeypatch.setenv("SPECVIZ_CACHE", str(tmp_path))
    monkeypatch.setattr(contention, "_TIMED_HERE", set())
    monkeypatch.setattr(contention, "_stat_reads", lambda: True)
    pair, taus = pattern_pair("llama"), {"model": {(1, 1, 0): 1.5, (2, 1, 0): 1.8}}
    timings = []
    monkeypatch.setattr(costs, "forward_ms", lambda pair, ids, widths, repeats, compiled: (
        repeats == costs.REPEATS and timings.append(1)) or {k: 10.0 + len(timings) + k for k in widths})
    monkeypatch.setattr(costs, "_round_costs", lambda *args, **kwargs: (1.0, 0.5))
    monkeypatch.setenv("SPECVIZ_IGNORE_LOAD", "1")
    _, kept = costs.first_run(pair, taus)
    assert kept.busy is None and len(timings) == 1
    contention._TIMED_HERE.clear()
    assert costs.first_run(pair, taus)[1] == kept and len(timings) == 1  # another process ignoring the load
    contention._TIMED_HERE.clear()
    monkeypatch.delenv("SPECVIZ_IGNORE_LOAD")
    monkeypatch.setattr(contention, "others_meter", scripted_meters([0.0, 0.0]))
    said = []
    _, again = costs.first_run(pair, taus, said.append)
    assert len(timings) == 2 and again.busy == 0.0 and again.forward_ms[1] == 13.0
    assert any(m.startswith("the stored costs were timed without measuring the machine's load") for m in said)
    contention._TIMED_HERE.clear()
    monkeypatch.setattr(contention, "others_meter", scripted_meters([]))
    assert costs.first_run(pair, taus)[1] == again and len(timings) == 2


def test_round_costs_on_a_gpu_are_kept_under_its_name(monkeypatch):
    """The profile file is the CPU's: costs timed on one kind of GPU must not be read for another in the same host
    (or after a swap), so a GPU's entry is keyed by the GPU's name; a CPU's key is as it was (stored costs stand)."""
    import hashlib
    import json
    from types import SimpleNamespace

    import torch

    def pair(device):
        return SimpleNamespace(device=torch.device(device), dtype=torch.bfloat16, target_name="t", draft_name="d",
                               head_name="h")

    names = iter(["NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA H100 80GB HBM3"])
    monkeypatch.setattr(costs, "machine_name", lambda device: next(names))
    h100, h200, again = (costs._key(pair("cuda"), False) for _ in range(3))
    assert h100 != h200 and h100 == again
    monkeypatch.setattr(costs, "machine_name", lambda device: pytest.fail("a CPU's key reads no name"))
    facts = json.dumps(["cpu", "torch.bfloat16", "t", "d", "h", False, costs.TIMING], sort_keys=True)
    assert costs._key(pair("cpu"), False) == hashlib.sha256(facts.encode()).hexdigest()[:16]
