"""A round in stages (step mode), the five steps with its numbers, the cache chart, and the tie
shown where greedy runs part: all read from recorded events, so replays step like live runs."""

import dataclasses
import html
import re

import gradio as gr
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
            label = f"stage {k + 1} of {len(stages)}" if k == len(stages) - 1 else f"stage {k + 1} ("
            assert label in page and (" of " in page.split(": ")[0]) == (k == len(stages) - 1)
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


def _tree_round(meta, statuses: list[str], extra: ExtraToken, n_accepted: int) -> RoundEvent:
    """A recorded tree round: three children of the last kept token (d1-d3), two children of d1 (d4, d5)."""
    from specviz.core.events import DraftedToken

    drafted = [DraftedToken(10 + i, f"w{i + 1}", q=0.5, p=0.2 + 0.1 * i, accept_prob=1.0, u=None if meta.sampling.greedy
                            else 0.3, status=s, score=0.5 / (i + 1)) for i, s in enumerate(statuses)]
    return RoundEvent(3, len(drafted), drafted, extra, n_accepted, 1.0, 2.0, 20, 0, 9, 50.0, parents=[-1, -1, -1, 0, 0])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_tree_round_is_told_as_the_tree_it_was(random_pair, temperature):
    """Every stage's words, the table and the tree chart read the round's own record: γ is the tree's depth and the
    drafts are counted apart; the rule walks the tree (no 'first rejection'); a node the walk never tried is 'not
    reached' everywhere; a correction names the depth where no child was kept, a bonus the kept path's end; the
    chart's title keeps the outcome until the stage that decides it."""
    from specviz.core.events import Run
    from specviz.view.rendering import stream_html
    from specviz.view.stages import tree_view

    meta = dataclasses.replace(generate(random_pair, "", Settings(gamma=2, max_new_tokens=2),
                                        prompt_ids=words(1, 2)).meta, temperature=temperature)
    greedy = temperature == 0
    # d1 kept, its children d4 and d5 rejected: a correction at depth 2; d2 and d3 never tried
    corrected = _tree_round(meta, ["accepted", "unverified", "unverified", "rejected", "rejected"],
                            ExtraToken(7, "fix", "correction", 0.6, 0.1), 1)
    # d1 rejected, d2 kept, and d2 has no drafts below it: a bonus; d3, d4, d5 never tried
    bonus = _tree_round(meta, ["rejected", "accepted", "unverified", "unverified", "unverified"],
                        ExtraToken(8, "more", "bonus", 0.7), 1)
    for event, tried in ((corrected, [0, 3, 4]), (bonus, [0, 1])):
        stages = round_stages(event, meta)
        assert [s.kind for s in stages] == [DRAFT, DRAFT, VERIFY] + [DECIDE] * len(tried) + [ADD]
        assert [s.position for s in stages if s.kind == DECIDE] == tried
        assert "5 draft(s)" in stages[2].caption and "ancestors" in stages[2].caption
        final = how_it_works_html(event, meta, len(stages) - 1)
        assert "a tree 2 deep (γ = 2) of 5 drafts" in final and "γ = 5" not in final
        assert "first rejection" not in final and "the last kept token" in final and "child" in final
        table = stage_html(event, meta, len(stages) - 1)
        verdicts = re.findall(r"<td[^>]*>(kept|rejected|not reached)</td>", table)
        assert verdicts == [{"accepted": "kept", "rejected": "rejected"}.get(t.status, "not reached")
                            for t in event.drafted]
        words_shown = re.sub("<[^>]+>", " ", table)
        assert "dropped" not in words_shown and "unverified" not in words_shown and "<th>depth</th>" in table
        done = charts.token_tree(event, greedy=greedy)
        assert done["layout"]["title"]["text"] == "Round 4: 5 drafts as a tree 2 deep, 1 kept"
        names = {t.get("name") for t in done["data"]}
        assert {"kept", "rejected", "not reached"} <= names and "unverified" not in names
        first = charts.token_tree(event, *tree_view(stages[0]), greedy=greedy)
        assert first["layout"]["title"]["text"] == "Round 4: 5 drafts as a tree 2 deep"  # no outcome yet
        hover = " ".join(h for t in done["data"] if t.get("name") == "rejected" for h in t["hovertext"])
        assert ("p/q = " in hover and "min(1" not in hover) if greedy else "chance kept = 1.000" in hover
    assert ("greedy test" if greedy else "chance kept vs u") in stage_html(corrected, meta, 0)
    deeper = dataclasses.replace(meta, gamma=3)  # asked 3 levels, drafted 2: both said
    assert "a tree 2 deep (γ = 2, 3 asked) of 5 drafts" in how_it_works_html(corrected, deeper, 5)
    # d1 rejected, d2 kept, d2's child d4 rejected: the correction names d4 alone, not d1 at depth 1
    sibling = _tree_round(meta, ["rejected", "accepted", "unverified", "rejected", "unverified"],
                          ExtraToken(7, "fix", "correction", 0.6, 0.1), 1)
    sibling = dataclasses.replace(sibling, parents=[-1, -1, -1, 1, 1])
    assert round_stages(sibling, meta)[-1].caption.startswith(
        "After the kept path, no child tried at depth 2 was kept (d4 (depth 2) rejected)")
    add = round_stages(corrected, meta)[-1].caption
    assert add.startswith("After the kept path, no child tried at depth 2 was kept (d4 (depth 2), d5 (depth 2) "
                          "rejected)") and "2 drafts not reached" in add
    assert round_stages(bonus, meta)[-1].caption.startswith(
        "The kept path (1 of the 5 drafts) ends where the tree has no drafts below it")
    assert "All" not in round_stages(bonus, meta)[-1].caption
    # the stream's hover: a tree draft's position is its depth; greedy shows p/q and the argmax verdict apart
    stream = html.unescape(stream_html(Run(meta, [corrected])))
    assert "draft position 2" in stream and "draft position 4" not in stream
    if greedy:
        assert "p/q = 0.4000" in stream and "p/q = 1.2000" in stream  # the ratio, above 1 where p > q
        assert "greedy: rejected, not the target's most likely token" in stream
        assert "min(1, p/q)" not in stream
    else:  # a sibling's chance is less what the ones tried before it took: not min(1, p/q)
        assert "chance kept = 1.0000  u = 0.3000" in stream and "min(1" not in stream


def test_a_chain_keeps_its_words():
    """The chain's own wording stays: γ its length, a first rejection, all drafts kept before a bonus."""
    from specviz.core.events import DraftedToken, RunMeta

    meta = RunMeta("speculative", "t", "d", "float32", "cpu", 2, 0.0, 0, 1.0, 0, 8, "prompt", [1, 2], 10)
    chain = RoundEvent(0, 2, [DraftedToken(1, "a", 0.5, 0.6, 1.0, None, "accepted"),
                              DraftedToken(2, "b", 0.5, 0.7, 1.0, None, "accepted")],
                       ExtraToken(3, "c", "bonus", 0.8), 2, 1.0, 1.0, 5, 0, 3, 10.0)
    stages = round_stages(chain, meta)
    assert stages[-1].caption.startswith("All 2 drafts were kept")
    final = how_it_works_html(chain, meta, len(stages) - 1)
    assert "proposes γ = 2 drafts" in final and "stop at the first rejection: d1 kept, d2 kept" in final


def test_step_mode_tells_a_rounds_outcome_only_from_the_stage_that_decides_it(random_pair):
    """While a round is stepped through, the stream shows its drafts only once decided and its added token at its
    last stage; the stats and charts count the round from its last stage; a step back hides it again."""
    from specviz.core.events import Run
    from specviz.ui.view import CHARTS, OUTPUT_NAMES, View

    meta = generate(random_pair, "", Settings(gamma=2, max_new_tokens=2), prompt_ids=words(1, 2)).meta
    event = _tree_round(meta, ["accepted", "unverified", "unverified", "rejected", "rejected"],
                        ExtraToken(7, "fix", "correction", 0.6, 0.1), 1)
    run = Run(meta, [event])
    stages = round_stages(event, meta)
    last = len(stages) - 1
    for k in range(len(stages)):
        view = View(spec=run, stage=k)
        out = dict(zip(OUTPUT_NAMES, view.stage_outputs(), strict=True))
        decided = {s.position for s in stages[: k + 1] if s.kind == DECIDE}
        stream = out["spec_html"]
        assert ('title="round 4, draft position 1' in stream) == (0 in decided)  # d1, once decided
        assert ("sv-correction" in stream) == (k == last)
        assert ("<b>1 / 2 / 5 " in out["stats"]) == (k == last)  # kept / rejected / drafted, counted at the end
        charted = all(out[name] != gr.skip() for name in CHARTS)
        assert charted == (k >= last - 1)  # redrawn where the round starts or stops counting
        if charted:  # before its last stage the only round is not counted yet: the charts' empty frames
            empty = "annotations" in out["fig_rounds"]["layout"]
            assert empty == (k < last)
    full = dict(zip(OUTPUT_NAMES, View(spec=run).outputs(), strict=True))  # not stepping: the whole round
    assert "sv-correction" in full["spec_html"] and "<b>1 / 2 / 5 " in full["stats"]


def test_the_added_token_is_drawn_beside_the_draft_it_replaced_not_on_it():
    """A correction takes a rejected draft's depth: in the tree chart its star sits half a row off that draft's
    node, so both stay visible."""
    from specviz.core.events import DraftedToken

    chain = RoundEvent(0, 2, [DraftedToken(1, "a", 0.5, 0.1, 0.2, 0.9, "rejected"),
                              DraftedToken(2, "b", 0.5, 0.7, 1.0, None, "unverified")],
                       ExtraToken(3, "c", "correction", 0.8, 0.1), 0, 1.0, 1.0, 5, 0, 1, 10.0)
    traces = {t.get("name"): t for t in charts.token_tree(chain)["data"]}
    rejected, star = traces["rejected"], traces["correction"]
    assert star["x"] == rejected["x"] == [1] and star["y"] != rejected["y"]


def _changed_after(event: RoundEvent, decided: set[int]) -> RoundEvent:
    """The same round as far as the stages deciding `decided` go, and changed in what they do not show: the drafts
    after the last one decided (so the stages before stay the same) flip kept and rejected, with another u; the
    added token, the count kept and the caches differ."""
    flip = {"accepted": "rejected", "rejected": "accepted"}
    after = max(decided, default=-1)
    drafted = [t if i <= after else dataclasses.replace(t, status=flip.get(t.status, t.status), u=0.777)
               for i, t in enumerate(event.drafted)]
    x = event.extra
    extra = ExtraToken(999, "ZZZ", "bonus" if x is not None and x.kind == "correction" else "correction", 0.123,
                       0.456) if x is not None else None
    return dataclasses.replace(event, drafted=drafted, extra=extra, n_accepted=event.n_accepted + 1,
                               target_cache_len=event.target_cache_len + 7)


@pytest.mark.slow
def test_no_stage_tells_what_a_later_stage_decides(eagle_pair):
    """Stepped through, a round shows at each stage only what that stage and the ones before computed: rendered
    beside the same round changed in everything decided later (the drafts not yet tried, the added token, the
    count kept), every stage but the last reads the same in the caption, table, five steps, tree chart, stream and
    stats. Over recorded chain, tree, greedy and sampled rounds."""
    from specviz.core.events import Run
    from specviz.ui.view import View
    from specviz.view.stages import tree_view

    pair = eagle_pair("llama")
    rounds = 0
    for temperature, branch in ((0.0, 1), (1.0, 1), (0.0, 2), (1.0, 2)):
        settings = Settings(gamma=3, branch=branch, nodes=5 if branch > 1 else 0, drafter="eagle",
                            temperature=temperature, max_new_tokens=24, seed=3)
        run = generate(pair, "", settings, prompt_ids=words(2, 3, 4, 5))
        for event in run.events:
            stages = round_stages(event, run.meta)
            for k, stage in enumerate(stages[:-1]):
                decided = {s.position for s in stages[: k + 1] if s.kind == DECIDE}
                other = _changed_after(event, decided)
                if len(round_stages(other, run.meta)) - 1 <= k:
                    continue
                for a, b in ((stage_html(event, run.meta, k), stage_html(other, run.meta, k)),
                             (how_it_works_html(event, run.meta, k), how_it_works_html(other, run.meta, k)),
                             (charts.token_tree(event, *tree_view(stage), greedy=temperature == 0),
                              charts.token_tree(other, *tree_view(stage), greedy=temperature == 0)),
                             (View(spec=Run(run.meta, [event]), stage=k).stage_outputs()[1:],
                              View(spec=Run(run.meta, [other]), stage=k).stage_outputs()[1:])):
                    assert a == b, (temperature, branch, event.index, k, stage.kind)
            rounds += 1
    assert rounds >= 30


def _depth_oracle(parents: list[int], i: int) -> int:
    """A node's depth by walking its ancestors (1: a child of the last kept token)."""
    depth = 1
    while parents[i] >= 0:
        i, depth = parents[i], depth + 1
    return depth


def _target_argmax(token) -> int:
    """The target's likeliest id where the token was judged, from the inspector's candidates recorded with it."""
    return max(token.top, key=lambda c: c.p).id


@pytest.mark.slow
def test_every_hover_sentence_says_what_its_round_recorded(eagle_pair):
    """Each token's hover in the stream and each node's in the tree chart, sentence by sentence, against an oracle
    from the round's record alone: the round, the depth (walked up the parents), kept or rejected, p and q, the
    test the verdict used (greedy: whether the draft is the target's likeliest token, read from the recorded
    candidates; sampled: u against the chance kept, which in a chain is min(1, p/q)), the path probability, and
    whether the added token is a correction or a bonus. Over recorded chain, tree, greedy and sampled rounds."""
    from specviz.view.rendering import stream_html

    pair = eagle_pair("llama")
    number = r"(-?[\d.]+|–)"
    checked = 0
    for temperature, branch in ((0.0, 1), (1.0, 1), (0.0, 2), (1.0, 2)):
        settings = Settings(gamma=3, branch=branch, nodes=5 if branch > 1 else 0, drafter="eagle",
                            temperature=temperature, max_new_tokens=24, seed=3, record_top=8)
        run = generate(pair, "", settings, prompt_ids=words(2, 3, 4, 5))
        greedy = temperature == 0
        titles = iter(html.unescape(t) for t in re.findall(r'class="sv-tok [^"]*" title="([^"]*)"', stream_html(run)))
        for e in run.events:
            parents = list(e.parents) if e.parents else list(range(-1, len(e.drafted) - 1))
            for i, t in enumerate(e.drafted):
                kept, depth = t.status == "accepted", _depth_oracle(parents, i)
                if t.status in ("accepted", "rejected"):  # the stream shows the tested drafts
                    head, values, *tests = next(titles).split("\n")
                    test = "\n".join(tests)
                    assert head == (f"round {e.index + 1}, draft position {depth}"
                                    f"{' (copied by prompt lookup)' if e.drafted_by == 'lookup' else ''}: "
                                    f"{'kept' if kept else 'rejected'}"), head
                    assert values == f"p = {t.p:.4f}  q = {t.q:.4f}"
                    if greedy:
                        is_best = _target_argmax(t) == t.id
                        assert is_best == kept
                        assert test == (f"p/q = {t.p / t.q:.4f}\ngreedy: {'kept' if kept else 'rejected'}, "
                                        f"{'the' if kept else 'not the'} target's most likely token"), test
                    else:
                        chance, u = (float(x) for x in re.fullmatch(
                            rf"(?:min\(1, p/q\)|chance kept) = {number}  u = {number}", test).groups())
                        assert (u < chance) == kept and abs(u - t.u) < 1e-4, (test, t)
                        if e.parents:  # a sibling's chance is less what the ones tried before it took
                            assert test.startswith("chance kept")
                        else:
                            assert test.startswith("min(1, p/q)") and abs(chance - min(1, t.p / t.q)) < 2e-4
            if e.extra is not None:
                end = e.path[-1] if e.path else -1
                children = [j for j in range(len(parents)) if parents[j] == end]
                kind = "correction" if children else "bonus" if e.drafted else "target"
                head, values = next(titles).split("\n")
                assert head == f"round {e.index + 1}: {kind} token from the target" and e.extra.kind == kind
                assert values.startswith(f"p = {e.extra.p:.4f}") and ("q = " in values) == (kind == "correction")
            # the tree chart's hovers, node by node
            figure = charts.token_tree(e, greedy=greedy)
            names = {"accepted": "kept", "rejected": "rejected"}
            for trace in figure["data"]:
                nodes = iter(i for i, t in enumerate(e.drafted)
                             if names.get(t.status, "not reached") == trace.get("name"))
                for hover in trace.get("hovertext", []):
                    m = re.fullmatch(r"(.*), depth (\d+): ([a-z ]+)<br>p = ([\d.]+), q = ([\d.]+), ?(.*?)"
                                     r"(?:<br>draft's path probability ([\d.]+))?", hover)
                    if m is None:  # the root, or the added token
                        if "last kept token" not in hover:
                            assert hover.endswith(f": {e.extra.kind}, p = {e.extra.p:.3f}"), hover
                        continue
                    i = next(nodes)
                    t = e.drafted[i]
                    assert (m[1], m[4], m[5]) == (charts._token(t.text), f"{t.p:.3f}", f"{t.q:.3f}"), hover
                    assert (int(m[2]), m[3]) == (_depth_oracle(parents, i), trace["name"]), hover
                    if not greedy and t.status != "unverified":
                        chance = float(m[6].split(" = ")[1])
                        assert (t.u < chance) == (t.status == "accepted"), hover
                    if m[7] is not None:
                        assert abs(float(m[7]) - t.score) < 1e-3
                    checked += 1
        assert next(titles, None) is None  # every span was one of the record's tokens
    assert checked >= 30
