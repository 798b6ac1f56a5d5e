"""The EAGLE head (eagle.py, drafters.EagleDrafter, distill --kind eagle) on tiny targets:
lossless like every drafter, the lean drafting path equal to the training forward, and the
tiny training configuration that CI runs end to end."""

import dataclasses
import json
from collections import Counter

import pytest
import torch
from conftest import ARCHS, DRAFT_VOCAB, seeded_rows_and_single_runs, seeded_runs, tiny_config, word_id, words
from test_generator import exact_baseline_distribution

from specviz.core.generator import Settings, generate, generate_batch
from specviz.core.sampling import SamplingParams
from specviz.models.eagle import EagleHead, HeadCache, HeadConfig
from specviz.models.loading import load_model
from specviz.tools import cli, distill
from specviz.tools.distill import distill_eagle
from specviz.tools.syncs import SyncCounter
from specviz.view import charts


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_eagle_greedy_equals_baseline(eagle_pair, arch):
    pair = eagle_pair(arch)
    settings = Settings(gamma=4, max_new_tokens=29, drafter="eagle")
    spec = generate(pair, "", settings, prompt_ids=words(2, 3, 4))
    base = generate(pair, "", settings, mode="baseline", prompt_ids=words(2, 3, 4))
    assert spec.token_ids == base.token_ids
    assert spec.meta.draft.startswith("EAGLE head")
    # trained: drafts are kept; the reduced vocabulary and imperfect training give rejections too
    assert spec.n_accepted > 0 and spec.n_rejected > 0
    assert spec.events[0].draft_cache_len == 2  # entries for positions 0..L-2 of the 3-token prompt


@pytest.mark.slow
def test_eagle_distill_report(eagle_dirs):
    report, folder = eagle_dirs("llama")
    first, second = report["held_out_by_position"]
    assert first["position"] == 1 and second["position"] == 2 and first["tokens"] > 50
    # the counting language is easy: the head learnt it at both positions
    assert first["greedy_agreement"] > 0.5 and second["greedy_agreement"] > 0.3
    assert report["data"]["draft_vocab"] == DRAFT_VOCAB and 0 < report["data"]["held_out_vocab_coverage"] <= 1
    assert report["training"]["precision"].startswith(("float32: a 48x64 ", "bfloat16 autocast: a 48x64 "))
    saved = json.loads((folder / "eagle_config.json").read_text())
    assert len(saved["draft_vocab"]) == DRAFT_VOCAB and (folder / "eagle_head.safetensors").exists()


@pytest.mark.slow
def test_a_bigger_distill_reuses_the_answers_in_its_data_file(pattern_dirs, tmp_path, monkeypatch):
    """More prompts on the same data file: only the new prompts are answered; the old answers stay."""
    target, _ = pattern_dirs("llama")
    (tmp_path / "prompts.txt").write_text("\n".join(" ".join(f"w{k + i}" for i in range(3)) for k in range(12)))
    answered = []
    generate = distill.generate_feature_data

    def spy(target, tokenizer, prompts, *rest):
        answered.append(prompts)
        return generate(target, tokenizer, prompts, *rest)

    monkeypatch.setattr(distill, "generate_feature_data", spy)
    data = tmp_path / "data.pt"
    for n in (8, 12):
        cfg = dataclasses.replace(tiny_config(target, tmp_path / "head", str(data)), prompts=n, max_steps=1)
        distill_eagle(cfg, progress=lambda m: None)
        saved = torch.load(data, weights_only=True)
        if n == 8:
            first = saved
    assert [len(p) for p in answered] == [8, 4] and answered[1][0] == "w8 w9 w10"
    assert saved["jobs"][: len(first["jobs"])] == first["jobs"] and len(saved["jobs"]) == 12 * 2  # two temperatures
    for old, kept in zip(first["samples"], saved["samples"], strict=False):
        assert old["ids"] == kept["ids"] and torch.equal(old["features"], kept["features"])


@pytest.mark.slow
def test_a_heads_first_weights_are_the_seeds_alone(pattern_dirs, tmp_path, monkeypatch):
    """The head starts from cfg.seed whatever ran before it: a run that answers its prompts (which may draw random
    numbers: a kernel table measured on a new machine, sampling) and one that loads those answers from the data file
    start from the same weights (lr 0: the saved head is its first weights)."""
    from safetensors.torch import load_file

    target, _ = pattern_dirs("llama")
    (tmp_path / "prompts.txt").write_text("\n".join(" ".join(f"w{k + i}" for i in range(3)) for k in range(8)))
    generate = distill.generate_feature_data

    def drawing(*args):
        torch.rand(3)  # something before the head that uses the global random state
        return generate(*args)

    monkeypatch.setattr(distill, "generate_feature_data", drawing)
    heads = []
    for run in ("answers", "loads"):
        cfg = dataclasses.replace(tiny_config(target, tmp_path / run, str(tmp_path / "data.pt")), prompts=8,
                                  max_steps=1, lr=0.0)
        distill_eagle(cfg, progress=lambda m: None)
        heads.append(load_file(str(tmp_path / run / "eagle_head.safetensors")))
    assert heads[0].keys() == heads[1].keys() and all(torch.equal(heads[0][k], heads[1][k]) for k in heads[0])


@pytest.mark.slow
def test_a_stopped_distill_keeps_the_answers_it_saved_and_the_next_run_goes_on(pattern_dirs, tmp_path, monkeypatch):
    """With a data file, answers are saved after each part (parts as large as what is saved, at least SAVE_EVERY
    prompts): a run stopped in its second part leaves the first part's answers, whole, and no partial file; the next
    run answers only the rest."""
    target, _ = pattern_dirs("llama")
    (tmp_path / "prompts.txt").write_text("\n".join(" ".join(f"w{k + i}" for i in range(3)) for k in range(8)))
    monkeypatch.setattr(distill, "SAVE_EVERY", 3)
    answered, stop = [], [True]
    generate = distill.generate_feature_data

    def spy(target, tokenizer, prompts, *rest):
        if stop[0] and answered:
            raise KeyboardInterrupt
        answered.append(prompts)
        return generate(target, tokenizer, prompts, *rest)

    monkeypatch.setattr(distill, "generate_feature_data", spy)
    data = tmp_path / "data.pt"
    cfg = dataclasses.replace(tiny_config(target, tmp_path / "head", str(data)), prompts=8, max_steps=1)
    with pytest.raises(KeyboardInterrupt):
        distill_eagle(cfg, progress=lambda m: None)
    first = torch.load(data, weights_only=True)
    assert [len(p) for p in answered] == [3] and len(first["jobs"]) == 3 * 2  # two temperatures
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("data")] == ["data.pt"]
    stop[0] = False
    distill_eagle(cfg, progress=lambda m: None)
    saved = torch.load(data, weights_only=True)
    assert [len(p) for p in answered] == [3, 3, 2] and not set(answered[0]) & set(answered[1] + answered[2])
    assert saved["jobs"][:6] == first["jobs"] and len(saved["jobs"]) == 8 * 2
    for old, kept in zip(first["samples"], saved["samples"], strict=False):
        assert old["ids"] == kept["ids"] and torch.equal(old["features"], kept["features"])


@pytest.mark.slow
def test_init_goes_on_training_a_head_from_its_weights_and_vocabulary(pattern_dirs, eagle_dirs, tmp_path):
    """distill --init: the earlier head's weights and draft vocabulary are where training starts (with a learning
    rate of 0 the saved head is the earlier one, bit for bit, with its vocabulary of DRAFT_VOCAB ids where a new head
    would take draft_vocab's fewer), on the prompts after --first-prompt."""
    from safetensors.torch import load_file

    target, _ = pattern_dirs("llama")
    _, earlier = eagle_dirs("llama")
    (tmp_path / "prompts.txt").write_text("\n".join(" ".join(f"w{k + i}" for i in range(3)) for k in range(36)))
    cfg = dataclasses.replace(tiny_config(target, tmp_path / "head"), init=str(earlier), first_prompt=30, prompts=6,
                              draft_vocab=DRAFT_VOCAB - 7, max_steps=2, lr=0.0)
    assert distill.load_prompts(cfg) == [f"w{k} w{k + 1} w{k + 2}" for k in range(30, 36)]
    report = distill_eagle(cfg, progress=lambda m: None)
    saved, before = (json.loads((d / "eagle_config.json").read_text()) for d in (tmp_path / "head", earlier))
    assert saved["draft_vocab"] == before["draft_vocab"] and report["data"]["draft_vocab"] == DRAFT_VOCAB
    assert saved["origin"].startswith(before["origin"] + "; then ")
    new, old = (load_file(str(d / "eagle_head.safetensors")) for d in (tmp_path / "head", earlier))
    assert new.keys() == old.keys() and all(torch.equal(new[k], old[k]) for k in old)
    # refused before any model work: a draft model cannot go on from a head
    assert cli.main(["distill", "--target", "/nowhere", "--out", str(tmp_path / "x"), "--init", str(earlier)]) == 2
    assert not (tmp_path / "x").exists()


def test_feature_data_is_the_targets_own_forward(pattern_dirs, tmp_path, monkeypatch):
    """Every answer's features and top-k are those of one forward of the target over the answer alone;
    greedy answers follow its argmax; an answer stops at its end token, and answers that end leave the
    batch while the others go on (their data kept whole)."""
    target_dir, _ = pattern_dirs("llama")
    target, tokenizer = load_model(str(target_dir), torch.device("cpu"), torch.float32)
    vocab = min(target.get_output_embeddings().weight.shape[0], len(tokenizer))
    stop = word_id(10)  # counting from w0-w7 reaches it within 12 tokens; from w20 and w30 it never does
    monkeypatch.setattr(distill, "eos_ids_of", lambda *args: {stop})
    kept_rows = []
    select = distill.KVState.select

    def spy(state, rows):
        kept_rows.append(len(rows))
        return select(state, rows)

    monkeypatch.setattr(distill.KVState, "select", spy)
    steps, forward = [], distill.KVState.forward
    monkeypatch.setattr(distill.KVState, "forward", lambda *a, **k: steps.append(1) or forward(*a, **k))
    prompts = [" ".join(f"w{k + i}" for i in range(3)) for k in (0, 5, 20, 7, 30, 2)]
    cfg = dataclasses.replace(tiny_config(target_dir, tmp_path / "head"), new_tokens=12, gen_batch=8)
    with SyncCounter() as syncs:
        samples = distill.generate_feature_data(target, tokenizer, prompts, cfg, vocab, lambda m: None)
    assert kept_rows and min(kept_rows) < 8  # rows left a batch before its end
    # a step reads back which rows have ended, and nothing else (on a GPU, a wait); an answer is read once
    prefills = -(-len(prompts) * len(cfg.temperatures) // cfg.gen_batch)  # a batch's prefill is a forward too
    assert syncs.total == len(steps) - prefills + len(samples), dict(syncs.counts)

    jobs = [(p, t) for p in prompts for t in cfg.temperatures]
    ended = 0
    for (prompt, temperature), s in zip(jobs, samples, strict=True):
        assert s.ids[: s.start] == distill.encode_prompt(tokenizer, prompt, False)
        answer = s.ids[s.start :]
        ended += answer[-1] == stop
        assert stop not in answer[:-1] and (answer[-1] == stop or len(answer) == cfg.new_tokens)
        with torch.no_grad():
            out = target(input_ids=torch.tensor([s.ids]), output_hidden_states=True)
        torch.testing.assert_close(s.features.float(), out.hidden_states[-1][0, :-1], atol=0.02, rtol=0.02)  # bf16
        logits = out.logits[0, s.start - 1 : -1, :vocab]  # [T, V]: the target's law for each answer token
        p = logits.softmax(-1)
        top_p = p.gather(-1, s.top_ids.long())  # [T, k]: the kept ids are the k likeliest, in order
        assert torch.all(top_p[:, -1] >= p.topk(cfg.top_k, -1).values[:, -1] - 1e-6)
        assert torch.all(top_p[:, :-1] >= top_p[:, 1:] - 1e-6)
        torch.testing.assert_close(s.top_probs.float(), top_p / top_p.sum(-1, keepdim=True), atol=2e-3, rtol=0)
        if temperature == 0:
            assert answer == logits.argmax(-1).tolist()
    assert 0 < ended < len(samples)


@pytest.mark.slow
def test_eagle_batch_rows_equal_single_runs(eagle_pair):
    pair = eagle_pair("llama")
    prompts = [words(2, 3, 4), words(10), words(20, 21, 22, 23, 24, 25), words(7, 8)]  # ragged; a 1-token prompt
    for settings in (Settings(gamma=3, max_new_tokens=20, drafter="eagle"),
                     Settings(gamma=3, max_new_tokens=20, drafter="eagle", temperature=1.0, seed=5)):
        batch = generate_batch(pair, [""] * 4, settings, prompts_ids=prompts)
        singles = [generate(pair, "", settings, prompt_ids=p) for p in prompts]
        assert [r.token_ids for r in batch] == [r.token_ids for r in singles]
    one_token = singles[1]
    assert one_token.events[0].gamma == 0  # nothing to draft from before the target's first feature


def test_lean_drafting_equals_the_training_forward(eagle_pair):
    """What the drafter computes step by step equals the unrolled training forward: the real
    entries (step 1) and a drafted entry fed the head's own output (step 2)."""
    pair = eagle_pair("llama", torch.float64)
    head = pair.head
    tokens = torch.tensor([words(3, 4, 5, 6, 7, 8)])  # [1, L]
    with torch.no_grad():
        out = pair.target(input_ids=tokens, output_hidden_states=True)
        feats = out.hidden_states[-1][:, :-1]  # f_0..f_{L-2}
        train_h = head.forward_train(tokens, feats, steps=2)
        cache = HeadCache(head, 1, 16, like=feats)
        positions = torch.arange(5)[None]
        h, logits = head.step(cache, tokens[:, 1:], head.features_in(feats), positions, positions)
        torch.testing.assert_close(h, train_h[0])
        torch.testing.assert_close(logits, head.logits(train_h[0]))
        # step 2 at entry i = 2: (h_2, x_4) at position 3, after the real entries 0..2
        cache.lengths = [3]
        h2, _ = head.step(cache, tokens[:, 4:5], h[:, 2:3], torch.tensor([[3]]), torch.tensor([[3]]))
        torch.testing.assert_close(h2[:, 0], train_h[1][:, 2])


@pytest.mark.slow
def test_eagle_sampled_output_follows_the_target(random_pair):
    """A random head whose vocabulary misses some of the target's tokens: 20 000 runs, the first
    two tokens follow the target's exact law (total variation < 0.03, noise alone about 0.015)."""
    target, vocab = random_pair.target, random_pair.vocab_size
    torch.manual_seed(0)
    config = HeadConfig.for_target(target, [word_id(k) for k in (0, 1, 2, 5)], vocab, 16)
    head = EagleHead(config)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.3)
    pair = random_pair.__class__(**{**random_pair.__dict__, "head": head.to(torch.float64).bind(target, vocab),
                                    "head_name": "random"})
    params = SamplingParams(0.9, top_k=7, top_p=0.95)
    prompt = words(1, 2)
    exact = exact_baseline_distribution(pair, prompt, params)
    n = 20_000
    settings = Settings(gamma=2, temperature=0.9, top_k=7, top_p=0.95, max_new_tokens=2, record_top=0,
                        drafter="eagle")
    runs = seeded_runs(pair, prompt, settings, n)
    accepted = sum(e.n_accepted for events in runs for e in events)
    counts = Counter(tuple([t for e in events for t in e.new_tokens][:2]) for events in runs)
    assert accepted > 1000  # the rule ran both ways
    tv = 0.5 * sum(abs(counts[k] / n - exact[k]) for k in exact)
    assert tv < 0.03, f"total variation {tv:.4f}"


# ends on a 3-gram seen before: lookup copies what followed it (w5 w6 ...); past w9 nothing repeats
REPEATING = words(2, 3, 4, 5, 6, 7, 8, 9, 2, 3, 4)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_lookup_then_eagle_greedy_equals_baseline(eagle_pair, arch):
    pair = eagle_pair(arch)
    settings = Settings(gamma=4, max_new_tokens=24, drafter="lookup+eagle")
    spec = generate(pair, "", settings, prompt_ids=REPEATING)
    base = generate(pair, "", settings, mode="baseline", prompt_ids=REPEATING)
    assert spec.token_ids == base.token_ids
    sources = [e.drafted_by for e in spec.events if e.gamma]
    assert sources[0] == "lookup" and "" in sources  # copied first, then the head where nothing repeats
    assert spec.meta.draft.startswith("prompt lookup where the text repeats, else the EAGLE head")
    # the head caught up on copied rounds too: before drafting, an entry for every position of the text but its last
    before = [len(REPEATING) + e.tokens_so_far - len(e.new_tokens) for e in spec.events]
    assert [e.draft_cache_len for e in spec.events] == [length - 1 for length in before]
    chart = {t["name"]: t["y"] for t in charts.cache_lengths(spec)["data"]}
    assert all(d == 0 for d, e in zip(chart["drafted, then dropped"], spec.events, strict=True) if e.drafted_by)


@pytest.mark.slow
def test_lookup_then_eagle_batch_rows_equal_single_runs(eagle_pair):
    pair = eagle_pair("llama")
    prompts = [REPEATING, words(2, 3, 4), words(10), words(20, 21, 22, 23, 24, 25)]  # ragged; copies and drafts
    for settings in (Settings(gamma=3, max_new_tokens=20, drafter="lookup+eagle"),
                     Settings(gamma=3, max_new_tokens=20, drafter="lookup+eagle", temperature=1.0, seed=5)):
        batch = generate_batch(pair, [""] * 4, settings, prompts_ids=prompts)
        singles = [generate(pair, "", settings, prompt_ids=p) for p in prompts]
        assert [r.token_ids for r in batch] == [r.token_ids for r in singles]
        assert [e.drafted_by for e in batch[0].events] == [e.drafted_by for e in singles[0].events]
        first = [r.events[0] for r in batch]  # one round, two drafters: row 0 copies, row 1 asks the head
        assert first[0].drafted_by == "lookup" and first[1].drafted_by == "" and first[1].gamma == 3


@pytest.mark.slow
def test_lookup_then_eagle_sampled_output_follows_the_target(random_pair):
    """Round 1 copies (the prompt ends on a repeated 3-gram); after a rejected copy the head drafts
    the second token. 20 000 runs: the first two tokens follow the target's exact law."""
    target, vocab = random_pair.target, random_pair.vocab_size
    torch.manual_seed(0)
    head = EagleHead(HeadConfig.for_target(target, [word_id(k) for k in (0, 1, 2, 5)], vocab, 16))
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.3)
    pair = random_pair.__class__(**{**random_pair.__dict__, "head": head.to(torch.float64).bind(target, vocab),
                                    "head_name": "random"})
    params = SamplingParams(0.9, top_k=7, top_p=0.95)
    prompt = words(1, 2, 3, 1, 2, 3)
    exact = exact_baseline_distribution(pair, prompt, params)
    n = 20_000
    settings = Settings(gamma=2, temperature=0.9, top_k=7, top_p=0.95, max_new_tokens=3, record_top=0,
                        drafter="lookup+eagle")
    runs = seeded_runs(pair, prompt, settings, n)
    drafted = Counter((e.index, e.drafted_by, e.n_accepted > 0) for events in runs for e in events if e.gamma)
    assert drafted[0, "lookup", True] > 1000 and drafted[0, "lookup", False] > 1000  # copies kept and rejected
    assert drafted[1, "", True] > 500 and drafted[1, "", False] > 500  # the head's draft for token 2, both ways
    counts = Counter(tuple([t for e in events for t in e.new_tokens][:2]) for events in runs)
    tv = 0.5 * sum(abs(counts[k] / n - exact[k]) for k in exact)
    assert tv < 0.03, f"total variation {tv:.4f}"


def test_eagle_needs_a_head_and_the_right_target(pattern_pair, random_pair, eagle_dirs):
    pair = pattern_pair("llama")  # loaded without a head
    with pytest.raises(ValueError, match="needs a head"):
        generate(pair, "w1 w2", Settings(drafter="eagle"))
    _, head_dir = eagle_dirs("llama")
    with pytest.raises(ValueError, match="trained for"):  # another vocabulary
        EagleHead.load(head_dir, random_pair.target, random_pair.vocab_size)


@pytest.mark.slow
def test_cli_distill_eagle_then_generate(pattern_dirs, eagle_dirs, tmp_path, capsys):
    """The tiny configuration through the command line, reusing the fixture's data file."""
    target, draft = pattern_dirs("llama")
    (tmp_path / "prompts.txt").write_text("\n".join(" ".join(f"w{k + i}" for i in range(3)) for k in range(20)))
    out = tmp_path / "head"
    argv = ["distill", "--kind", "eagle", "--target", str(target), "--out", str(out), "--prompts-file",
            str(tmp_path / "prompts.txt"), "--no-chat-template", "--new-tokens", "12", "--gen-batch", "16",
            "--max-steps", "20", "--batch", "8", "--draft-vocab", "30", "--ttt-steps", "2",
            "--head-intermediate", "32", "--data-file", str(tmp_path / "data.pt"), "--temperatures", "0"]
    assert cli.main(argv) == 0
    assert "held-out greedy agreement by draft position" in capsys.readouterr().out
    assert (tmp_path / "data.pt").exists()
    report = json.loads((out / "distill_report.json").read_text())
    assert report["training"]["steps"] == 20 and report["data"]["answers"] == 20  # one temperature
    assert cli.main(["generate", "--target", str(target), "--draft", str(draft), "--head", str(out), "--drafter",
                     "eagle", "--prompt", "w3 w4 w5", "--no-chat-template", "--max-new-tokens", "8",
                     "--compare", "--color", "never"]) == 0
    printed = capsys.readouterr().out
    assert "EAGLE head head" in printed and "identical to the baseline" in printed


def test_the_heads_prompt_entries_are_written_with_the_prefill(eagle_pair, monkeypatch):
    """EagleDrafter.start writes the prompt's entries, so the head's own prefill is timed with the target's (a
    long prompt's would otherwise be the first round's drafting, which the page and the cost notes read), with
    logits for the last entry alone (a long prompt's logits at every entry cost a good part of its prefill): every
    round then feeds the head only the last verification's features and its drafts, the first round its drafts
    alone; the run still decodes the baseline's tokens."""
    from specviz.core import drafters

    pair = eagle_pair("llama")
    calls, phase = [], [0]  # (phase, entries fed) per head step; phase 0: start, n: the n-th propose
    logit_rows = []  # (phase, rows) per logits computed
    step, propose, logits = EagleHead.step, drafters.EagleDrafter.propose, EagleHead.logits

    def spied_logits(self, h, *args, **kwargs):
        logit_rows.append((phase[0], h.shape[1]))
        return logits(self, h, *args, **kwargs)

    def spied_step(self, cache, tokens, *args, **kwargs):
        calls.append((phase[0], tokens.shape[1]))
        return step(self, cache, tokens, *args, **kwargs)

    def spied_propose(self, *args):
        phase[0] += 1
        return propose(self, *args)

    monkeypatch.setattr(EagleHead, "step", spied_step)
    monkeypatch.setattr(EagleHead, "logits", spied_logits)
    monkeypatch.setattr(drafters.EagleDrafter, "propose", spied_propose)
    settings = Settings(gamma=3, max_new_tokens=12, drafter="eagle")
    prompt = words(2, 3, 4, 5, 6, 7)
    spec = generate(pair, "", settings, prompt_ids=prompt)
    assert spec.token_ids == generate(pair, "", settings, mode="baseline", prompt_ids=prompt).token_ids
    assert [w for p, w in calls if p == 0] == [len(prompt) - 1]  # entries for positions 0..P-2, at once
    assert [rows for p, rows in logit_rows if p == 0] == [1]  # q for d_1 only
    assert [w for p, w in calls if p == 1] == [1, 1]  # d_1 and d_2 fed for d_2 and d_3: no entry of the prompt's
    assert phase[0] > 1 and all(w <= settings.gamma + 1 for p, w in calls if p > 1)  # a verification's features
    assert spec.events[0].draft_cache_len == len(prompt) - 1


def test_eagle_rows_of_one_prompt_share_a_prefill(eagle_pair):
    """The head's pending features are copied with the target's state to every row."""
    pair = eagle_pair("llama")
    settings = Settings(gamma=3, temperature=1.0, max_new_tokens=10, drafter="eagle")
    rows, alone = seeded_rows_and_single_runs(pair, words(4, 5, 6), settings, [1, 2, 3])
    assert rows == alone
