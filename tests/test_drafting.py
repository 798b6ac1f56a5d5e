"""Prompt lookup drafting and adaptive γ: both stay lossless, and each does what it claims."""

import random
from collections import Counter

import pytest
import torch
from conftest import ARCHS, seeded_runs, words
from test_generator import exact_baseline_distribution, run_both

from specviz.core.drafters import lookup_continuation
from specviz.core.events import ACCEPTED, REJECTED, TARGET, DraftedToken, RoundEvent
from specviz.core.generator import Settings, generate
from specviz.core.sampling import SamplingParams
from specviz.core.schedules import ExpectedSpeedupGamma, GrowShrinkGamma, make_policy


def test_lookup_takes_the_longest_then_latest_match():
    # "1 2 3" occurs twice before the end; the latest with a full continuation wins
    assert lookup_continuation([5, 1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 4, 1, 2, 3], 4, 3) == [7, 8, 4, 1]
    # the 3-gram "4 1 2" matches nowhere but "1 2" does: fall back to n = 2 (the latest is "1 2 -> 3")
    assert lookup_continuation([1, 2, 3, 6, 4, 1, 2], 2, 3) == [3, 6]
    # in a loop, an earlier match offers the whole γ where the latest offers one token
    assert lookup_continuation([1, 2, 1, 2, 1, 2], 4, 2) == [1, 2, 1, 2]
    assert lookup_continuation([1, 2, 3], 4, 3) == []  # no match: nothing drafted
    assert lookup_continuation([7], 4, 3) == []


def test_lookup_equals_a_search_of_every_window():
    """The host search against the plain definition (every n-gram window that has a next token, as
    tensors), on random texts over a small alphabet, so matches of every length are common."""
    def by_windows(ids, gamma, max_ngram, min_ngram):
        seq = torch.tensor(ids)
        for n in range(min(max_ngram, len(ids) - 1), min_ngram - 1, -1):
            starts = (seq[:-1].unfold(0, n, 1) == seq[-n:]).all(dim=1).nonzero()[:, 0] + n
            if len(starts):
                full = starts[starts + gamma <= len(ids)]
                start = int(full[-1] if len(full) else starts[-1])
                return ids[start : start + gamma]
        return []

    rng = random.Random(0)
    found = 0
    for _ in range(400):
        ids = [rng.randrange(rng.choice([2, 4, 30])) for _ in range(rng.randrange(1, 40))]
        gamma, max_ngram = rng.randrange(1, 6), rng.randrange(1, 5)
        min_ngram = rng.randrange(1, max_ngram + 1)
        expected = by_windows(ids, gamma, max_ngram, min_ngram)
        assert lookup_continuation(ids, gamma, max_ngram, min_ngram) == expected, (ids, gamma, max_ngram, min_ngram)
        found += bool(expected)
    assert 100 < found < 400  # both outcomes were tried


@pytest.mark.parametrize("arch", ARCHS)
def test_lookup_greedy_equals_baseline(pattern_pair, arch):
    pair = pattern_pair(arch)
    # the prompt holds w20..w29 then w20 w21, so the lookup copies w22..w29 ahead, and the copy
    # is rejected where the prompt went back to w20 (the models count on, more or less well)
    prompt = words(*range(20, 30), 20, 21)
    settings = Settings(gamma=4, drafter="lookup", max_new_tokens=15)
    spec, base = run_both(pair, prompt, settings)
    assert spec.token_ids == base.token_ids and spec.n_tokens == 15
    assert spec.meta.draft == "prompt lookup"
    assert spec.n_accepted >= 1 and spec.n_rejected >= 1
    assert all(t.q == 1.0 for e in spec.events for t in e.drafted)  # one-hot


def test_lookup_without_a_match_is_a_plain_step(pattern_pair):
    pair = pattern_pair("llama")
    spec = generate(pair, "", Settings(gamma=4, drafter="lookup", max_new_tokens=3), prompt_ids=words(2, 3, 4))
    assert [e.gamma for e in spec.events] == [0, 0, 0]  # counting never repeats a word
    assert all(e.extra.kind == TARGET for e in spec.events)


@pytest.mark.slow
def test_sampled_lookup_matches_baseline_distribution(random_pair):
    """As the draft-model test in test_generator.py: 20 000 runs, first two tokens, TV < 0.03.

    The prompt ends in a repeat, so every first round drafts (a one-hot q) and is tested.
    """
    params = SamplingParams(0.9, top_k=7, top_p=0.95)
    prompt = words(1, 2, 5, 6, 1, 2)
    exact = exact_baseline_distribution(random_pair, prompt, params)
    n = 20_000
    settings = Settings(gamma=2, drafter="lookup", temperature=0.9, top_k=7, top_p=0.95, max_new_tokens=2,
                        record_top=0)
    runs = seeded_runs(random_pair, prompt, settings, n)
    drafted = sum(events[0].gamma for events in runs)
    counts = Counter(tuple([t for e in events for t in e.new_tokens][:2]) for events in runs)
    assert drafted == n  # γ is cut to 1 by the 2-token budget; each first round drafted w5
    assert set(counts) <= set(exact)
    tv = 0.5 * sum(abs(counts[k] / n - exact[k]) for k in exact)
    assert tv < 0.03, f"total variation {tv:.4f}"


def observe(policy, gamma, n_accepted, draft_ms, verify_ms):
    e = RoundEvent(index=0, gamma=gamma, drafted=[], extra=None, n_accepted=n_accepted, draft_ms=draft_ms,
                   verify_ms=verify_ms, target_cache_len=0, draft_cache_len=0, tokens_so_far=0, elapsed_ms=0.0)
    rejected = n_accepted < gamma
    e.drafted = [_drafted(ACCEPTED if i < n_accepted else REJECTED if i == n_accepted else "unverified")
                 for i in range(gamma)]
    assert e.n_rejected == int(rejected)
    policy.observe(e)


def _drafted(status):
    return DraftedToken(0, "", 0.5, 0.5, 1.0, None, status)


def test_grow_shrink_policy():
    policy = GrowShrinkGamma(4, gamma_max=7)
    observe(policy, 4, 4, 1, 10)
    assert policy.next_gamma() == 6
    observe(policy, 6, 6, 1, 10)
    assert policy.next_gamma() == 7  # capped
    observe(policy, 7, 2, 1, 10)
    assert policy.next_gamma() == 6
    for _ in range(10):
        observe(policy, policy.next_gamma(), 0, 1, 10)
    assert policy.next_gamma() == 1  # never below one


def test_expected_policy_follows_the_measured_alpha_and_costs():
    # a costly draft (c = 0.5) that is rarely right: draft one token
    policy = ExpectedSpeedupGamma(4, gamma_max=16)
    for _ in range(20):
        observe(policy, 4, 1, draft_ms=4 * 5.0, verify_ms=10.0)
    assert policy.next_gamma() == 1
    # a free draft that is almost always right, verify cost rising 1 ms per token from 10 ms:
    # the best γ is where the extra tokens stop paying for the longer verify pass
    policy = ExpectedSpeedupGamma(2, gamma_max=16)
    for g in (2, 4, 8, 2, 4, 8):
        observe(policy, g, g, draft_ms=0.0, verify_ms=10.0 + (g + 1))
    for g in range(1, 8):
        observe(policy, g, g - 1 if g % 5 == 0 else g, draft_ms=0.0, verify_ms=10.0 + (g + 1))
    best = policy.next_gamma()
    assert 6 <= best <= 16


def test_expected_policy_drafts_long_when_acceptance_comes_in_runs():
    # Half the drafts accepted either way, verify cost rising 1 ms a token from 10 ms, free draft.
    # Independent acceptance: a long γ only buys 1 + 0.5 + 0.25 + ... tokens, so stay short.
    # Copied spans (prompt lookup): a round is all accepted or fails on its first draft, so every
    # extra draft pays half a token for a tenth of a step: draft long.
    coin = random.Random(0)
    independent, in_runs = ExpectedSpeedupGamma(4, gamma_max=16), ExpectedSpeedupGamma(4, gamma_max=16)
    for i in range(200):
        g = 2 + i % 7
        n_accepted = next((k for k in range(g) if coin.random() < 0.5), g)
        observe(independent, g, n_accepted, draft_ms=0.0, verify_ms=10.0 + (g + 1))
        observe(in_runs, g, g if i % 2 else 0, draft_ms=0.0, verify_ms=10.0 + (g + 1))
    assert independent.next_gamma() <= 3
    assert in_runs.next_gamma() == 16
    with pytest.raises(ValueError, match="gamma policy"):
        make_policy("sometimes", 4, 8)


@pytest.mark.parametrize("drafter", ["model", "lookup"])
@pytest.mark.parametrize("policy", ["grow-shrink", "expected"])
def test_adaptive_gamma_stays_lossless_and_varies(pattern_pair, drafter, policy):
    pair = pattern_pair("qwen3")
    prompt = words(*range(2, 14), 2, 3)
    settings = Settings(gamma=2, gamma_policy=policy, gamma_max=8, drafter=drafter, max_new_tokens=30)
    spec, base = run_both(pair, prompt, settings)
    assert spec.token_ids == base.token_ids and spec.n_tokens == 30
    gammas = [e.gamma for e in spec.events]
    assert len(set(gammas)) > 1 and max(gammas) <= 8, gammas
    assert spec.meta.gamma_policy == policy and spec.meta.gamma_max == 8


def test_a_new_drafter_plugs_in_with_one_registry_line(pattern_pair, monkeypatch):
    """A toy drafter (repeat the last token γ times, q one-hot) is one class plus one DRAFTER_KINDS
    line: Settings accept it, runs name it, and greedy output stays the target's own."""
    from specviz.core import generator
    from specviz.core.drafters import Proposal, StatelessDrafter

    class RepeatDrafter(StatelessDrafter):
        name = "repeat the last token"

        def __init__(self, vocab_size):
            self.vocab_size = vocab_size

        def propose(self, seqs, gammas, params, generators):
            out = []
            for s, g in zip(seqs, gammas, strict=True):
                tokens = torch.tensor(s[-1:]).repeat(g)
                q = torch.zeros(g, self.vocab_size)
                q[torch.arange(g), tokens] = 1.0
                out.append(Proposal(tokens, q))
            return out

    monkeypatch.setitem(generator.DRAFTER_KINDS, "repeat", generator.DrafterKind(
        "repeat the last token", lambda pair: RepeatDrafter.name, lambda pair, s, capacity: RepeatDrafter(
            pair.vocab_size)))
    pair = pattern_pair("llama")
    settings = Settings(drafter="repeat", gamma=3, max_new_tokens=12)
    spec = generate(pair, "", settings, prompt_ids=words(1, 2, 3))
    base = generate(pair, "", settings, prompt_ids=words(1, 2, 3), mode="baseline")
    assert spec.meta.draft == "repeat the last token" and spec.n_drafted > 0
    assert spec.token_ids == base.token_ids


def test_prompt_lookup_copies_no_control_token(random_pair):
    """The chat template puts its markers after text an answer often repeats ('The future of AI<|im_end|>'): a copy
    stops before any special token, so lookup drafts text only, alone or before the head."""
    from specviz.core.drafters import LookupFirstDrafter, PromptLookupDrafter
    from specviz.core.generator import control_ids

    stop = 99
    seq = [5, 6, 7, stop, 8, 9, 5, 6, 7]  # "5 6 7" recurs; before, it was followed by the control token
    params, gens = SamplingParams(0.0), [torch.Generator()]
    plain = PromptLookupDrafter(120, 3, 3).propose([seq], [3], params, gens)[0]
    assert plain.tokens.tolist() == [stop, 8, 9]
    stopped = PromptLookupDrafter(120, 3, 3, stop_ids=frozenset({stop})).propose([seq], [3], params, gens)[0]
    assert stopped.tokens.tolist() == []  # nothing left to copy: the round is the fallback's
    assert PromptLookupDrafter(120, 3, 3, stop_ids=frozenset({9})).propose([seq], [3], params, gens)[0] \
        .tokens.tolist() == [stop, 8]
    tokenizer = random_pair.tokenizer
    assert set(tokenizer.all_special_ids) <= control_ids(tokenizer)
    drafter = LookupFirstDrafter(PromptLookupDrafter(120), 120, stop_ids=frozenset({stop}))
    assert drafter.lookup.stop_ids == {stop}
