"""Batched speculation: every row decodes exactly what it would decode alone."""

import pytest
from conftest import ARCHS, EOS, words

from specviz.core.generator import MAX_BATCH, Settings, generate, generate_batch

# different lengths (left padding), one that reaches <eos> early (leaves the batch), and
# repeats for the lookup drafter to copy
PROMPTS = [words(2, 3, 4), words(*range(20, 30), 20, 21), words(35, 36), words(7, 8, 9, 10, 11, 7)]


def single_runs(pair, prompts, settings):
    return [generate(pair, "", settings, prompt_ids=p) for p in prompts]


@pytest.mark.parametrize("drafter", ["model", "lookup"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_rows_equal_single_prompt_runs(pattern_pair, arch, drafter):
    pair = pattern_pair(arch)
    settings = Settings(gamma=3, drafter=drafter, max_new_tokens=20)
    batch = generate_batch(pair, [""] * len(PROMPTS), settings, prompts_ids=PROMPTS)
    alone = single_runs(pair, PROMPTS, settings)
    for row, (b, a) in enumerate(zip(batch, alone, strict=True)):
        assert b.token_ids == a.token_ids, row
        assert b.meta.batch_size == len(PROMPTS)
    assert batch[2].finish_reason == "eos" and batch[2].token_ids[-1] == EOS  # w37 w38 w39 <eos>
    assert batch[0].finish_reason == "length" and batch[0].n_tokens == 20
    assert len(batch[2].events) < len(batch[0].events)  # the finished row left early
    assert sum(r.n_accepted for r in batch) > 0 and sum(r.n_rejected for r in batch) > 0


@pytest.mark.parametrize("drafter", ["model", "lookup"])
def test_sampled_rows_equal_single_prompt_runs(random_pair, drafter):
    """Each row draws from its own generator, seeded like a single run: same draws, same text."""
    settings = Settings(gamma=3, drafter=drafter, temperature=1.0, top_k=6, max_new_tokens=16, seed=11)
    prompts = [words(1, 2, 1), words(3), words(4, 5, 6, 7, 4, 5)]
    batch = generate_batch(random_pair, [""] * 3, settings, prompts_ids=prompts)
    alone = single_runs(random_pair, prompts, settings)
    assert [b.token_ids for b in batch] == [a.token_ids for a in alone]
    assert [[e.n_accepted for e in b.events] for b in batch] == [[e.n_accepted for e in a.events] for a in alone]


def test_adaptive_gamma_in_a_batch_is_per_row(pattern_pair):
    pair = pattern_pair("llama")
    settings = Settings(gamma=2, gamma_policy="grow-shrink", gamma_max=8, max_new_tokens=24)
    batch = generate_batch(pair, [""] * 2, settings, prompts_ids=PROMPTS[:2])
    alone = single_runs(pair, PROMPTS[:2], settings)
    assert [b.token_ids for b in batch] == [a.token_ids for a in alone]
    assert [[e.gamma for e in b.events] for b in batch] == [[e.gamma for e in a.events] for a in alone]


def test_batch_limits(pattern_pair):
    pair = pattern_pair("llama")
    with pytest.raises(ValueError, match="batch holds"):
        generate_batch(pair, [""] * (MAX_BATCH + 1), Settings(), prompts_ids=[words(1)] * (MAX_BATCH + 1))
    with pytest.raises(ValueError, match="prompt is empty"):
        generate_batch(pair, ["w1", " "], Settings())


def test_cli_batch_prints_each_row_and_the_ratio(pattern_dirs, tmp_path, capsys):
    from specviz.core.events import load_runs
    from specviz.tools import cli

    target, draft = pattern_dirs("gpt2")
    trace = tmp_path / "batch.json"
    argv = ["generate", "--target", str(target), "--draft", str(draft), "--no-chat-template", "--dtype", "float32",
            "--prompt", "w2 w3 w4", "--prompt", "w7 w8 w9 w7", "--drafter", "lookup", "--gamma-policy",
            "expected", "--max-new-tokens", "8", "--compare", "--trace", str(trace), "--color", "never"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "[1] 'w2 w3 w4'" in out and "[2] 'w7 w8 w9 w7'" in out
    assert "batch of 2: 16 tokens" in out and "one after another: 16 tokens" in out
    assert "greedy text: 2 of 2 rows identical" in out
    runs = load_runs(trace)
    assert [r.meta.batch_size for r in runs] == [2, 2] and runs[0].meta.gamma_policy == "expected"
