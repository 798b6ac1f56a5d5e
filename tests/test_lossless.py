"""Losslessness made visible: the sample-N check against the exact distribution, the noise it
is compared with, and the shared-prefill batches it draws with; the exact check in closed form,
and a broken rule it tells apart."""

import dataclasses

import pytest
import torch
from conftest import seeded_rows_and_single_runs, words

from specviz.core.generator import Settings
from specviz.core.rules import accept_or_resample
from specviz.core.sampling import SamplingParams, logits_to_probs, residual_distribution
from specviz.tools.lossless import (
    broken_emitted_distribution,
    emitted_distribution,
    exact_check,
    expected_tv,
    sample_check,
    sample_check_live,
)


def test_expected_tv_matches_a_simulation():
    p = torch.tensor([0.5, 0.3, 0.15, 0.04, 0.01], dtype=torch.float64)
    n, trials = 50, 20_000
    draws = torch.multinomial(p.expand(trials, -1), n, replacement=True,
                              generator=torch.Generator().manual_seed(0))  # [trials, n]
    shares = torch.nn.functional.one_hot(draws, len(p)).sum(1) / n  # [trials, 5]
    simulated = 0.5 * (shares - p).abs().sum(1).mean().item()
    assert expected_tv(p, n) == pytest.approx(simulated, rel=0.03)


@pytest.mark.parametrize("draft_greedy", [False, True])
def test_speculative_draws_are_within_sampling_noise(random_pair, draft_greedy):
    settings = Settings(gamma=3, temperature=1.0, top_k=6, seed=7, draft_greedy=draft_greedy)
    check = sample_check(random_pair, "w1 w2", settings, n=3000, chat_template=False)
    assert sum(c.exact for c in check.top) == pytest.approx(1.0)
    assert sum(c.speculative for c in check.top) == pytest.approx(1.0)
    # with 6 outcomes and 3000 draws noise alone gives E[TV] near 0.016; a wrong rule gives far more
    assert check.tv_speculative < 2 * check.tv_noise and check.tv_target_alone < 2 * check.tv_noise
    assert 0 < check.acceptance < 1
    with pytest.raises(ValueError, match="temperature > 0"):
        sample_check(random_pair, "w1 w2", Settings(), n=10, chat_template=False)


@pytest.mark.parametrize("cache", ["static", "dynamic", "none"])
def test_rows_of_one_prompt_share_a_prefill_and_each_equals_its_single_run(random_pair, cache):
    settings = Settings(gamma=2, temperature=1.0, max_new_tokens=6, cache=cache)
    rows, alone = seeded_rows_and_single_runs(random_pair, words(1, 2, 3), settings, [5, 6, 7, 8])
    assert rows == alone
    assert len({tuple(a) for a in alone}) > 1  # the seeds really differ


def test_the_command_line_prints_the_sample_check(pattern_dirs, capsys):
    from specviz.tools.cli import main

    target, draft = pattern_dirs("llama")
    code = main(["generate", "--target", str(target), "--draft", str(draft), "--drafter", "model", "--prompt", "w3 w4",
                 "--no-chat-template", "--temperature", "1", "--sample-check", "300", "--device", "cpu",
                 "--dtype", "float32"])
    out = capsys.readouterr().out
    assert code == 0 and "first token, 300 + 300 draws" in out and "sampling noise alone about" in out
    assert "'w5'" in out  # the counting language's likeliest next word heads the table
    assert "Exact, in closed form" in out and "differs from the target's p by at most" in out


def test_the_closed_form_is_the_implementations_rule_and_equals_p():
    """emitted_distribution against the rule as accept_or_resample applies it, one draft at a time."""
    gen = torch.Generator().manual_seed(3)
    params = SamplingParams(0.8, top_k=5)
    p = logits_to_probs(torch.randn(1, 9, generator=gen, dtype=torch.float64) * 2, params)
    q = logits_to_probs(torch.randn(1, 9, generator=gen, dtype=torch.float64) * 2, params)
    accept = torch.zeros(9, dtype=torch.float64)
    for y in range(9):
        if q[0, y] > 0:
            accept[y] = accept_or_resample(torch.cat([p, p]), q, torch.tensor([y]), None).accept_probs[0]
    by_rule = q[0] * accept + (q[0] * (1 - accept)).sum() * residual_distribution(p[0], q[0])
    torch.testing.assert_close(emitted_distribution(p[0], q[0]), by_rule, atol=1e-15, rtol=0)
    torch.testing.assert_close(emitted_distribution(p[0], q[0]), p[0], atol=1e-12, rtol=0)
    assert (broken_emitted_distribution(p[0], q[0]) - p[0]).abs().max() > 1e-3


@pytest.mark.parametrize("drafter,draft_greedy", [("model", False), ("model", True), ("lookup", False)])
def test_the_exact_check_of_a_real_round_matches_p_and_shows_a_broken_rule(random_pair, drafter, draft_greedy):
    settings = Settings(gamma=2, temperature=1.0, top_p=0.9, drafter=drafter, draft_greedy=draft_greedy)
    check = exact_check(random_pair, "w1 w2 w1", settings, chat_template=False)
    assert check.drafted and check.max_diff < 1e-9
    assert check.broken_max_diff > 1e3 * max(check.max_diff, 1e-15)
    assert 0 <= check.first_draft_kept <= 1


def test_a_stopped_sample_check_ends_between_rounds(random_pair):
    settings = Settings(gamma=2, temperature=1.0)
    live = sample_check_live(random_pair, "w1 w2", settings, n=600, chat_template=False)
    assert next(live) == "speculative: 16 of 600 draws"  # one batched round of the first batch's rows
    live.close()  # what Stop does to the app's handler: no more rounds are decoded
    with pytest.raises(StopIteration):
        next(live)


def test_sample_check_batches_grow_while_fast_and_shrink_when_slow(random_pair, monkeypatch):
    """Batches double while one takes under half of CHUNK_S, up to CHUNK, and halve when one takes longer: a Stop
    waits for one batch at most, whatever the drafter and the CPU."""
    from specviz.tools import lossless

    def done_counts(chunk_s: float) -> list[int]:
        monkeypatch.setattr(lossless, "CHUNK_S", chunk_s)
        settings = Settings(gamma=2, temperature=1.0)
        lines = sample_check_live(random_pair, "w1 w2", settings, n=600, chat_template=False)
        return sorted({int(line.split()[1]) for line in lines if isinstance(line, str) and line.startswith("spec")})

    fast = done_counts(1e9)  # every batch "fast": 16, 32, 64, 128, 256, then the rest
    assert fast == [16, 48, 112, 240, 496, 600]
    slow = done_counts(0.0)  # every batch "slow": 16, 8, 4, 2, 1, 1, ...
    assert slow[:5] == [16, 24, 28, 30, 31] and slow[-1] == 600


def test_the_sample_check_decodes_eager_even_where_the_run_compiles(random_pair, monkeypatch):
    """Its batches (16 to 256 rows) would each compile graphs of their own and spend the process's budget of
    compiled shapes: every decode it runs is asked for eager, whatever the viewer's settings say."""
    from specviz.tools import lossless

    asked = []
    real = lossless.decode

    def decode(pair, prompts, settings, mode, **kwargs):
        asked.append(settings.compile)
        return real(pair, prompts, dataclasses.replace(settings, compile=False), mode, **kwargs)

    monkeypatch.setattr(lossless, "decode", decode)
    settings = Settings(gamma=2, temperature=1.0, compile=True)
    list(sample_check_live(random_pair, "w1 w2", settings, n=20, chat_template=False))
    assert asked and not any(asked)
