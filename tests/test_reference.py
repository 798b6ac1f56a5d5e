"""The full decoder (batches, trees, the viewer's records, one read a round) equals the one-screen reference
decoder token for token: greedy, and sampled on the same seed."""

import pytest
from conftest import words

from specviz.core.generator import Settings, generate, generate_batch
from specviz.core.reference import reference_decode


@pytest.mark.parametrize("drafter", ["model", "lookup", "eagle", "lookup+eagle"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_the_decoder_equals_the_reference(eagle_pair, random_pair, drafter, temperature):
    pair = eagle_pair("llama") if temperature == 0.0 or drafter != "model" else random_pair
    prompt = words(2, 3, 4, 2, 3)  # repeats itself: prompt lookup finds its matches
    rounds, kept = 0, 0
    for seed in range(4):
        for gamma in (1, 3):
            settings = Settings(gamma=gamma, drafter=drafter, temperature=temperature, seed=seed, max_new_tokens=23)
            run = generate(pair, "", settings, prompt_ids=prompt)
            assert run.token_ids == reference_decode(pair, prompt, settings), (seed, gamma)
            rounds, kept = rounds + len(run.events), kept + run.n_accepted
    assert 0 < kept < rounds * 3  # drafts were kept, and not all of them: both ways of ending a round ran


def test_the_reference_drafts_chains_of_a_fixed_gamma(random_pair):
    with pytest.raises(ValueError, match="chain of a fixed"):
        reference_decode(random_pair, words(2, 3), Settings(drafter="eagle", branch=2))


def decoded(run) -> tuple:
    """What a run decoded, the inspector's candidates aside: its tokens, and each round's drafted tokens with
    their p, q, draw and verdict, its tree and its extra token."""
    return run.token_ids, [([(d.id, d.p, d.q, d.u, d.status) for d in e.drafted], e.tree,
                            e.extra and (e.extra.id, e.extra.kind, e.extra.p, e.extra.q)) for e in run.events]


@pytest.mark.parametrize("shape", [("model", 3, 1, 0), ("lookup+eagle", 2, 1, 0), ("eagle", 3, 2, 4)],
                         ids=["model", "lookup+eagle", "tree"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_the_inspectors_candidates_change_nothing_decoded(eagle_pair, shape, temperature):
    """record_top only adds candidates to the records (the page's inspector): the same tokens, p, q and draws,
    bit for bit, for one row and for a batch."""
    drafter, gamma, branch, nodes = shape
    prompts = [words(2, 3, 4, 2, 3), words(5, 6), words(1, 2, 3, 4)]
    runs = {}
    for top in (0, 8):
        settings = Settings(drafter=drafter, gamma=gamma, branch=branch, nodes=nodes, temperature=temperature,
                            seed=5, max_new_tokens=20, record_top=top)
        runs[top] = ([generate(eagle_pair("llama"), "", settings, prompt_ids=prompts[0])]
                     + generate_batch(eagle_pair("llama"), [""] * 3, settings, prompts_ids=prompts))
    for bare, recorded in zip(runs[0], runs[8], strict=True):
        assert decoded(bare) == decoded(recorded)
        assert not any(d.top for e in bare.events for d in e.drafted)
        assert all(d.top for e in recorded.events for d in e.drafted)  # the candidates were recorded
    statuses = {d.status for run in runs[8] for e in run.events for d in e.drafted}
    assert {"accepted", "rejected"} <= statuses  # both ways of ending a round ran
