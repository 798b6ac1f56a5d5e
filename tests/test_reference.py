"""The full decoder (batches, trees, the viewer's records, one read a round) equals the one-screen reference
decoder token for token: greedy, and sampled on the same seed."""

import pytest
from conftest import words

from specviz.core.generator import Settings, generate
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
