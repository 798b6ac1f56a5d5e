"""End to end on the offline default pair (SmolLM2-135M-Instruct; converted once into the cache)."""

import re
import subprocess
import sys

import pytest
import torch

from specviz.core.events import load_runs
from specviz.core.generator import Settings, generate
from specviz.models.loading import load_pair

pytestmark = [pytest.mark.slow, pytest.mark.offline_model]

PROMPTS = ["The future of AI", "Happy Birthday lyrics", "Write a Python function that reverses a string."]


@pytest.fixture(scope="module")
def offline_fp32():
    # float32: where rounding cannot flip a near-tie, greedy texts must match exactly
    return load_pair(preset="offline", device="cpu", dtype="float32")


@pytest.mark.parametrize("prompt", PROMPTS)
def test_offline_greedy_equals_baseline(offline_fp32, prompt):
    settings = Settings(gamma=4, max_new_tokens=24)
    spec = generate(offline_fp32, prompt, settings)
    base = generate(offline_fp32, prompt, settings, mode="baseline")
    assert spec.token_ids == base.token_ids and spec.text == base.text
    assert spec.n_tokens == 24 or spec.finish_reason == "eos"


def test_prompt_lookup_drafts_no_control_token_on_the_offline_pair(offline_fp32):
    """The answer to "The future of AI" starts by repeating the prompt, which the chat template follows with
    <|im_end|>: lookup copies the text, never the template's markers."""
    special = set(offline_fp32.tokenizer.all_special_ids)
    for drafter in ("lookup", "lookup+eagle"):
        run = generate(offline_fp32, "The future of AI", Settings(gamma=3, drafter=drafter, max_new_tokens=24))
        copied = [t.id for e in run.events if e.drafted_by == "lookup" or drafter == "lookup" for t in e.drafted]
        assert not special & set(copied), drafter
        assert copied or drafter != "lookup"


def test_offline_pair_loads_in_the_dtype_asked_for():
    pair = load_pair(preset="offline", device="cpu", dtype="bfloat16")
    assert pair.dtype == torch.bfloat16
    assert {p.dtype for m in (pair.target, pair.draft) for p in m.parameters()} == {torch.bfloat16}
    assert pair.vocab_size == 49152 and pair.draft.config.num_hidden_layers < pair.target.config.num_hidden_layers


def test_cli_compare_prints_tokens_rate_and_speedup(tmp_path):
    trace = tmp_path / "run.json"
    out = subprocess.run(
        [sys.executable, "-m", "specviz", "generate", "--preset", "offline", "--prompt", "The future of AI",
         "--max-new-tokens", "16", "--temperature", "0", "--compare", "--trace", str(trace), "--color", "always"],
        capture_output=True, text=True, timeout=600, check=True,
    ).stdout
    assert "\x1b[32m" in out or "\x1b[34m" in out  # coloured tokens
    assert "acceptance rate" in out and "speedup:" in out
    assert "greedy text:" in out
    spec, base = load_runs(trace)
    assert spec.meta.mode == "speculative" and base.meta.mode == "baseline" and base.n_tokens == 16
    # no --drafter or --gamma: both chosen from this machine's measured costs, priced at the run's middle (the
    # prompt and half the budget), and the choice said
    said = re.search(r"chosen for this machine at a context of (\d+) tokens:|On this machine at a context of (\d+) "
                     r"tokens no drafter and γ is expected to beat plain decoding", out)
    assert said and int(said.group(1) or said.group(2)) == len(spec.meta.prompt_ids) + 16 // 2


@pytest.mark.parametrize("drafter", ["model", "lookup"])
def test_offline_batch_rows_equal_single_runs(offline_fp32, drafter):
    from specviz.core.generator import generate_batch

    prompts = PROMPTS + ["Correct the spelling: Teh cat sat on teh mat and lookd at the burds."]
    settings = Settings(gamma=3, drafter=drafter, max_new_tokens=16)
    batch = generate_batch(offline_fp32, prompts, settings)
    alone = [generate(offline_fp32, p, settings) for p in prompts]
    assert [b.token_ids for b in batch] == [a.token_ids for a in alone]
    assert len({len(r.meta.prompt_ids) for r in batch}) > 1  # rows of different lengths, left-padded


def test_the_check_holds_on_the_offline_pair_with_every_drafter(offline_fp32):
    """`specviz check`'s static-cache cases in float32 on the shipped models. A row's numbers must agree within
    rounding alone and in a batch, which batch rows drafting through int8 products beside the same prompts alone
    through bfloat16 weights would not (q far apart); 'differs' allows a draw near a boundary to part the texts on
    another CPU's kernels."""
    from specviz.tools.check import check, report_line

    outcomes = list(check(offline_fp32, compiled=False, max_new_tokens=12, only=lambda c: c.cache == "static"))
    assert len(outcomes) == 6 and all(o.status in ("ok", "differs") for o in outcomes), list(map(report_line, outcomes))


@pytest.fixture(scope="module")
def hf_greedy(offline_fp32):
    """Hugging Face `generate`, greedy, on every benchmark prompt: the reference text."""
    from specviz.models.loading import encode_prompt
    from specviz.tools.prompts import BENCHMARK_PROMPTS

    out = {}
    for prompt in [p for texts in BENCHMARK_PROMPTS.values() for p in texts]:
        ids = torch.tensor([encode_prompt(offline_fp32.tokenizer, prompt)])
        with torch.inference_mode():
            new = offline_fp32.target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32,
                                               do_sample=False, pad_token_id=offline_fp32.tokenizer.eos_token_id)
        out[prompt] = new[0, ids.shape[1]:].tolist()
    return out


@pytest.mark.parametrize("cache", ["static", "dynamic", "none"])
def test_offline_greedy_equals_hf_generate_on_every_benchmark_prompt(offline_fp32, hf_greedy, cache):
    """float32, eager: speculative text, and our baseline's, equal HF's token for token: the static
    cache (the default, with this machine's kernels) on every benchmark prompt (the baseline on the
    first of each category), `dynamic` on the first prompt of the first two categories, `none` (it
    recomputes the whole text at every pass: slow) on the first prompt of the first, for 16 tokens."""
    from specviz.tools.prompts import BENCHMARK_PROMPTS

    firsts = [texts[0] for texts in BENCHMARK_PROMPTS.values()]
    chosen = {"static": set(hf_greedy), "dynamic": set(firsts[:2]), "none": set(firsts[:1])}[cache]
    # `none` decodes the reference's first 16 tokens: each of its passes recomputes the whole text
    settings = Settings(gamma=3, max_new_tokens=16 if cache == "none" else 32, cache=cache, record_top=0)
    for prompt, reference in hf_greedy.items():
        if prompt not in chosen:
            continue
        reference = reference[: settings.max_new_tokens]
        assert generate(offline_fp32, prompt, settings).token_ids == reference, prompt
        if prompt in firsts:
            assert generate(offline_fp32, prompt, settings, mode="baseline").token_ids == reference, prompt
