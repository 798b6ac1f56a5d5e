"""The generator on tiny models of five architectures: lossless, stops right, caches right."""

from collections import Counter

import pytest
import torch
from conftest import ARCHS, EOS, seeded_runs, words

from specviz.core.events import (
    ACCEPTED,
    BONUS,
    CORRECTION,
    REJECTED,
    load_runs,
    runs_from_json,
    runs_to_json,
    save_runs,
)
from specviz.core.generator import Settings, TokenTexts, generate
from specviz.core.sampling import SamplingParams, logits_to_probs
from specviz.view.rendering import stats_html


def run_both(pair, prompt_ids, settings):
    spec = generate(pair, "", settings, prompt_ids=prompt_ids)
    base = generate(pair, "", settings, mode="baseline", prompt_ids=prompt_ids)
    return spec, base


@pytest.mark.parametrize("gamma", [1, 3, 8])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_baseline(pattern_pair, arch, gamma):
    pair = pattern_pair(arch)
    # 29 tokens: no multiple of γ + 1 for γ in {3, 8}, so the budget ends inside a round
    spec, base = run_both(pair, words(2, 3, 4), Settings(gamma=gamma, max_new_tokens=29))
    assert spec.token_ids == base.token_ids
    assert spec.n_tokens == 29 and len(spec.token_ids) == 29 and spec.finish_reason == "length"
    # the draft's language differs every fifth word, so both paths of the rule ran
    assert spec.n_accepted > 0 and spec.n_rejected > 0
    kinds = Counter(e.extra.kind for e in spec.events if e.extra)
    assert kinds[CORRECTION] > 0
    # a round drafts at most what the budget leaves room for besides the target's own token
    assert [e.gamma for e in spec.events] == [min(gamma, 29 - (e.tokens_so_far - len(e.new_tokens)) - 1)
                                              for e in spec.events]
    if gamma > 1:  # budgets ending inside a round: of any γ + 1 in a row, one leaves the last round less than γ
        cut = False
        for budget in range(29 - gamma, 29):
            short = generate(pair, "", Settings(gamma=gamma, max_new_tokens=budget), prompt_ids=words(2, 3, 4))
            assert short.token_ids == base.token_ids[:budget] and short.finish_reason == "length"
            cut |= short.events[-1].gamma < gamma
        assert cut


@pytest.mark.parametrize("arch", ARCHS)
def test_eos_inside_a_draft_stops_there(pattern_pair, arch):
    pair = pattern_pair(arch)
    prompt = words(30, 31, 32)  # the counting language ends: w39, <eos>
    spec, base = run_both(pair, prompt, Settings(gamma=8, max_new_tokens=40))
    assert spec.token_ids == base.token_ids == words(33, 34, 35, 36, 37, 38, 39) + [EOS]
    last = spec.events[-1]
    assert spec.finish_reason == "eos" and last.extra is None  # the EOS was an accepted draft token
    eos_at = [t.id for t in last.drafted].index(EOS)
    assert eos_at < last.gamma - 1 and last.drafted[eos_at].status == ACCEPTED
    assert all(t.status != ACCEPTED for t in last.drafted[eos_at + 1 :])  # nothing after EOS is kept


def test_bonus_token_when_all_accepted(pattern_pair):
    spec = generate(pattern_pair("llama"), "", Settings(gamma=3, max_new_tokens=12), prompt_ids=words(5, 6))
    bonus_rounds = [e for e in spec.events if e.extra and e.extra.kind == BONUS]
    assert bonus_rounds and all(e.n_accepted == e.gamma for e in bonus_rounds)
    assert all(len(e.new_tokens) == e.gamma + 1 for e in bonus_rounds)


def test_same_seed_same_run_other_seed_other_run(random_pair):
    settings = Settings(gamma=3, temperature=1.0, max_new_tokens=24, seed=5)
    a = generate(random_pair, "", settings, prompt_ids=words(1, 2))
    b = generate(random_pair, "", settings, prompt_ids=words(1, 2))
    assert a.token_ids == b.token_ids
    assert [[t.u for t in e.drafted] for e in a.events] == [[t.u for t in e.drafted] for e in b.events]
    others = {tuple(generate(random_pair, "", Settings(gamma=3, temperature=1.0, max_new_tokens=24, seed=s),
                             prompt_ids=words(1, 2)).token_ids) for s in range(6, 9)}
    assert others - {tuple(a.token_ids)}


def exact_baseline_distribution(pair, prompt_ids, params):
    """P(first two tokens) of plain sampling from the target, by enumeration."""
    with torch.inference_mode():
        p1 = logits_to_probs(pair.target(torch.tensor([prompt_ids])).logits[0, -1, : pair.vocab_size], params)
        dist = {}
        for x1, px1 in enumerate(p1.tolist()):
            if px1 == 0:
                continue
            if x1 in pair.eos_token_ids:
                dist[(x1,)] = px1
                continue
            logits = pair.target(torch.tensor([prompt_ids + [x1]])).logits[0, -1, : pair.vocab_size]
            for x2, px2 in enumerate(logits_to_probs(logits, params).tolist()):
                dist[(x1, x2)] = dist.get((x1, x2), 0.0) + px1 * px2
    return dist


@pytest.mark.slow
@pytest.mark.parametrize("draft_greedy", [False, True])
def test_sampled_generation_matches_baseline_distribution(random_pair, draft_greedy):
    """20 000 speculative runs (γ = 2, as batches over one prefill): the first two tokens follow
    the target's exact law, with sampled drafts and with greedy drafts (argmax, q one-hot).

    Test: total variation between the empirical and the exact distribution below 0.03. With
    about 80 outcomes, sampling noise alone gives an expected TV near 0.015 at this size.
    """
    params = SamplingParams(0.9, top_k=7, top_p=0.95)  # every warp at once
    prompt = words(1, 2)
    exact = exact_baseline_distribution(random_pair, prompt, params)
    settings = Settings(gamma=2, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                        max_new_tokens=2, record_top=0, draft_greedy=draft_greedy)
    n = 20_000
    counts = Counter(tuple([t for e in events for t in e.new_tokens][:2])
                     for events in seeded_runs(random_pair, prompt, settings, n))
    assert set(counts) <= set(exact)
    tv = 0.5 * sum(abs(counts[k] / n - exact[k]) for k in exact)
    assert tv < 0.03, f"total variation {tv:.4f}"


def test_token_texts_are_decoded_once_per_tokenizer_across_runs(random_pair, monkeypatch):
    """The inspector's candidates (about ten a drafted token) are decoded once per tokenizer, not once per run."""
    settings = Settings(gamma=2, max_new_tokens=6, record_top=4)
    generate(random_pair, "", settings, prompt_ids=words(3, 4))
    decoded = []
    real = random_pair.tokenizer.decode
    monkeypatch.setattr(random_pair.tokenizer, "decode", lambda ids, **kw: decoded.append(ids) or real(ids, **kw))
    again = generate(random_pair, "", settings, prompt_ids=words(3, 4))
    assert again.events[0].drafted[0].top  # candidates recorded, their texts from the first run's decodes
    assert [ids for ids in decoded if len(ids) == 1] == []  # (only the run's whole text, in one call)
    texts = TokenTexts.of(random_pair.tokenizer)
    assert texts is TokenTexts.of(random_pair.tokenizer) and texts(5) == real([5])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_recorded_p_and_q_match_fresh_forwards(random_pair, temperature):
    pair = random_pair
    settings = Settings(gamma=3, temperature=temperature, top_k=5 if temperature else 0, max_new_tokens=16, seed=2)
    run = generate(pair, "", settings, prompt_ids=words(3, 4))
    params = settings.sampling

    def dist(model, prefix):
        with torch.inference_mode():
            logits = model(torch.tensor([prefix])).logits[0, -1, : pair.vocab_size]
        return logits.softmax(-1) if params.greedy else logits_to_probs(logits, params)

    prefix = list(run.meta.prompt_ids)
    checked = 0
    for e in run.events:
        for i, t in enumerate(e.drafted):
            ctx = prefix + [d.id for d in e.drafted[:i]]
            assert t.p == pytest.approx(float(dist(pair.target, ctx)[t.id]), abs=1e-9)
            assert t.q == pytest.approx(float(dist(pair.draft, ctx)[t.id]), abs=1e-9)
            checked += 1
        if e.extra is not None:
            ctx = prefix + [d.id for d in e.drafted[: e.n_accepted]]
            assert e.extra.p == pytest.approx(float(dist(pair.target, ctx)[e.extra.id]), abs=1e-9)
        prefix += e.new_tokens
    assert checked >= 6
    if temperature:
        assert any(t.status == REJECTED for e in run.events for t in e.drafted)


def test_run_round_trips_through_json(random_pair, tmp_path):
    settings = Settings(gamma=3, temperature=1.0, top_p=0.9, max_new_tokens=12, seed=1)
    spec = generate(random_pair, "a prompt", settings, prompt_ids=words(1, 2))
    base = generate(random_pair, "a prompt", settings, mode="baseline", prompt_ids=words(1, 2))
    assert runs_from_json(runs_to_json([spec, base])) == [spec, base]
    save_runs(tmp_path / "trace.json", [spec, base])
    loaded = load_runs(tmp_path / "trace.json")
    assert loaded == [spec, base]
    assert loaded[0].acceptance_rate == spec.acceptance_rate and loaded[0].events[0].drafted[0].top
    with pytest.raises(ValueError, match="not a specviz trace"):
        runs_from_json('{"runs": []}')


@pytest.mark.parametrize("path, value, message", [
    (("events", 0, "n_accepted"), "2", "runs[0].events[0].n_accepted must be a whole number, got \"2\""),
    (("events", 1, "gamma"), -1, "runs[0].events[1].gamma must be at least 0, got -1"),
    (("events", 0, "drafted", 0, "q"), 1.5, "runs[0].events[0].drafted[0].q must be a probability"),
    (("events", 0, "drafted", 0, "status"), "maybe", "runs[0].events[0].drafted[0].status must be one of"),
    (("events", 0, "extra"), [], "runs[0].events[0].extra must be an object, got []"),
    (("meta", "temperature"), None, "runs[0].meta.temperature must be a number, got null"),
    (("meta", "prompt_ids"), [1, "x"], "runs[0].meta.prompt_ids[1] must be a whole number"),
    (("meta", "compiled"), 1, "runs[0].meta.compiled must be true or false, got 1"),
    (("events",), {}, "runs[0].events must be a list, got {}"),
    # every number held to what a run can be, as its settings are
    (("events", 0, "gamma"), 10**9, "runs[0].events[0].gamma must be at most 63, got 1000000000"),
    (("meta", "max_new_tokens"), 10**6, "runs[0].meta.max_new_tokens must be at most 4,096"),
    (("meta", "batch_size"), 17, "runs[0].meta.batch_size must be at most 16, got 17"),
    (("events", 0, "drafted"), [{}] * 64, "runs[0].events[0].drafted holds 64 entries; a run's has at most 63"),
])
def test_a_trace_with_a_wrong_field_is_refused_by_name(random_pair, path, value, message):
    import json

    settings = Settings(gamma=3, temperature=1.0, max_new_tokens=8, seed=1)
    data = json.loads(runs_to_json([generate(random_pair, "a prompt", settings, prompt_ids=words(1, 2))]))
    node = data["runs"][0]
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(ValueError, match="not a valid specviz trace") as err:
        runs_from_json(json.dumps(data))
    assert message in str(err.value)


def test_a_trace_with_a_missing_or_unknown_field_is_refused_by_name(random_pair):
    import json

    run = generate(random_pair, "a prompt", Settings(gamma=2, max_new_tokens=4), prompt_ids=words(1, 2))
    data = json.loads(runs_to_json([run]))
    del data["runs"][0]["events"][0]["verify_ms"]
    with pytest.raises(ValueError, match=r"runs\[0\]\.events\[0\]\.verify_ms is missing"):
        runs_from_json(json.dumps(data))
    data = json.loads(runs_to_json([run]))
    data["runs"][0]["meta"]["colour"] = "red"
    with pytest.raises(ValueError, match="runs\\[0\\]\\.meta has an unknown field 'colour'"):
        runs_from_json(json.dumps(data))


def test_a_forged_trace_file_is_refused_in_one_sentence(random_pair, tmp_path, monkeypatch):
    """Too large, nested too deep, not UTF-8, too many runs: each refused with one readable sentence, before any
    of it is read into runs."""
    import json

    from specviz.core import events

    run = generate(random_pair, "a prompt", Settings(gamma=2, max_new_tokens=4), prompt_ids=words(1, 2))
    good = tmp_path / "good.json"
    save_runs(good, [run])
    monkeypatch.setattr(events, "MAX_TRACE_MB", good.stat().st_size / 2**20 / 2)  # this file is twice the limit
    with pytest.raises(ValueError, match=r"^not a specviz trace: the file is \d+ MB, and a trace of the longest run "
                                         r"is under"):
        load_runs(good)
    monkeypatch.undo()
    deep = tmp_path / "deep.json"
    deep.write_text('{"format": "specviz-trace/1", "runs": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ValueError, match="^not a specviz trace: its JSON nests far deeper than a trace does$"):
        load_runs(deep)
    latin = tmp_path / "latin.json"
    latin.write_bytes(text := b'{"format": "specviz-trace/1", "runs": ["caf\xe9"]}')  # Latin-1, not UTF-8
    with pytest.raises(ValueError, match=r"^not a specviz trace: the file is not UTF-8 text \(byte 0xe9 at position "
                                         rf"{text.index(0xe9)}\)$"):
        load_runs(latin)
    many = tmp_path / "many.json"
    many.write_text(json.dumps({"format": "specviz-trace/1", "runs": [run.to_dict()] * 33}))
    with pytest.raises(ValueError, match="^not a specviz trace: 33 runs, where a trace holds at most 32$"):
        load_runs(many)


def test_baseline_events_have_the_speculative_shape(random_pair):
    base = generate(random_pair, "", Settings(max_new_tokens=5), mode="baseline", prompt_ids=words(1, 2))
    assert [e.tokens_so_far for e in base.events] == [1, 2, 3, 4, 5]
    assert all(e.gamma == 0 and e.drafted == [] and e.extra.kind == "target" for e in base.events)
    assert [e.target_cache_len for e in base.events] == [2, 3, 4, 5, 6]


def test_greedy_drafts_under_sampling_are_the_drafts_argmax_with_q_one_hot(random_pair):
    settings = Settings(gamma=3, temperature=1.0, max_new_tokens=12, seed=3, draft_greedy=True)
    run = generate(random_pair, "", settings, prompt_ids=words(1, 2))
    drafted = [t for e in run.events for t in e.drafted]
    assert drafted and all(t.q == 1.0 for t in drafted)
    assert all(t.accept_prob == pytest.approx(min(1.0, t.p)) for t in drafted if t.status != "unverified")
    assert run.meta.draft_greedy and "drafting greedily" in stats_html(run)
    greedy_run = generate(random_pair, "", Settings(gamma=3, max_new_tokens=12, draft_greedy=True),
                          prompt_ids=words(1, 2))
    assert not greedy_run.meta.draft_greedy  # a greedy run drafts greedily anyway: nothing to say
