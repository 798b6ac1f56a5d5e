"""`distill` end to end on a tiny target: data from the target, a draft that loads and pairs."""

import dataclasses
import hashlib
import json

import pytest
import torch
from conftest import words

from specviz.core.generator import Settings, generate
from specviz.models import kernels
from specviz.models.loading import SHIPPED_HEAD, load_pair
from specviz.tools import cli, distill
from specviz.tools.distill import HELP, DistillConfig, load_prompts, training_dtype
from specviz.tools.prompts import BENCHMARK_PROMPTS, RINGS, TEMPLATES, TOPICS, training_prompts


def test_training_prompts_hold_out_the_benchmark():
    prompts = training_prompts(5000)
    assert len(prompts) == len(set(prompts)) > 1000
    held_out = {p.lower() for ps in BENCHMARK_PROMPTS.values() for p in ps}
    assert not any(h in p.lower() for p in prompts for h in held_out)


def test_each_ring_of_prompts_comes_before_the_next():
    """A ring added later leaves the prompts before it where they were: a head's report names its prompt count, and
    `distill --first-prompt N` starts past the prompts an earlier head was trained on."""
    held_out = [p.lower() for ps in BENCHMARK_PROMPTS.values() for p in ps]
    everything, end = training_prompts(100_000), 0
    for templates, topics in RINGS:
        upto = {TEMPLATES[i].format(t=TOPICS[j]) for i in range(templates) for j in range(topics)}
        upto = {p for p in upto if not any(h in p.lower() or p.lower() in h for h in held_out)}
        assert len(upto) > end and set(everything[: len(upto)]) == upto
        end = len(upto)
    assert end == len(everything) and RINGS[-1] == (len(TEMPLATES), len(TOPICS))
    # the first head's 8,060 prompts, as they were when it was made: the shipped head went on from it, and its
    # model card rebuilds both from these (and the third ring's) by their places in the list
    assert "--prompts 8060 " in (SHIPPED_HEAD / "README.md").read_text()
    assert hashlib.sha256("\n".join(everything[:8060]).encode()).hexdigest()[:16] == "ca7ae1566862b17a"
    assert hashlib.sha256("\n".join(everything[:11159]).encode()).hexdigest()[:16] == "17f650c912623a36"  # 3 rings
    assert hashlib.sha256("\n".join(everything).encode()).hexdigest()[:16] == "2c2e6f2b95b123f2"  # all 20,639


def test_a_json_prompts_file_keeps_prompts_with_line_breaks(tmp_path, capsys):
    """Code prompts span lines, so a one-per-line file cannot hold them; a .json list can. A file that is
    not a list of strings is refused before any model is loaded (the target named here does not exist)."""
    prompts = ["Fix this code:\n\ndef f(x):\n    return x +", "  ", "Name three rivers. "]
    (tmp_path / "p.json").write_text(json.dumps(prompts))
    cfg = DistillConfig("no-such-target", str(tmp_path / "out"), prompts_file=str(tmp_path / "p.json"))
    assert load_prompts(cfg) == [prompts[0], "Name three rivers."]
    assert load_prompts(dataclasses.replace(cfg, first_prompt=1, prompts=5)) == ["Name three rivers."]
    (tmp_path / "bad.json").write_text(json.dumps({"prompts": prompts}))
    argv = ["distill", "--target", str(tmp_path / "no-such-target"), "--out", str(tmp_path / "out"),
            "--prompts-file", str(tmp_path / "bad.json")]
    assert cli.main(argv) == 2
    assert "expected a JSON list of prompt strings" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_every_distill_setting_is_an_option_that_says_what_it_does(capsys):
    """`distill --help` lists each of DistillConfig's settings with its meaning (HELP) and, for numbers, its
    default; the target, the output folder and the chat template have options of their own."""
    with pytest.raises(SystemExit):
        cli.main(["distill", "--help"])
    text = "".join(capsys.readouterr().out.split())  # argparse wraps lines, even at hyphens
    for field in dataclasses.fields(DistillConfig):
        if field.name in ("target", "out", "chat_template"):
            continue
        option = f"--{field.name.replace('_', '-')}"
        assert option in text and "".join(HELP[field.name].split()) in text, option
        if isinstance(field.default, int | float) and not isinstance(field.default, bool):
            assert f"(default:{field.default})" in text, option
    assert "--no-chat-template" in text and "chattemplate" in text.split("--no-chat-template")[-1]


@pytest.mark.slow
def test_distill_a_tiny_target(pattern_dirs, tmp_path, capsys):
    target, _ = pattern_dirs("llama")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(" ".join(f"w{k + i}" for i in range(3)) for k in range(0, 30, 2)))
    out = tmp_path / "draft"
    argv = ["distill", "--target", str(target), "--out", str(out), "--prompts-file", str(prompts),
            "--new-tokens", "12", "--gen-batch", "8", "--layers", "1", "--hidden", "32", "--heads", "2",
            "--kv-heads", "1", "--intermediate", "64", "--max-steps", "60", "--batch", "8", "--lr", "1e-2",
            "--holdout", "0.2", "--no-chat-template"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr()
    assert "held-out greedy agreement" in printed.out
    printed = printed.out + printed.err  # the progress lines
    # the target's dtype for batched generation is measured at the batch's rows, not at a decode step's
    assert "data: auto: " in printed and " at 8 rows costs " in printed
    report = json.loads((out / "distill_report.json").read_text())
    assert report["training"]["steps"] == 60 and report["data"]["train_tokens"] > 100
    # the draft learnt something of the counting language
    assert report["held_out"]["greedy_agreement"] > report["held_out_before"]["greedy_agreement"]
    assert (out / "model.safetensors").exists()
    pair = load_pair(str(target), str(out), device="cpu", dtype="float32")  # loads, same tokenizer
    spec = generate(pair, "", Settings(gamma=3, max_new_tokens=10), prompt_ids=words(4, 5, 6))
    base = generate(pair, "", Settings(gamma=3, max_new_tokens=10), mode="baseline", prompt_ids=words(4, 5, 6))
    assert spec.token_ids == base.token_ids


def test_training_autocasts_only_where_a_measured_training_step_is_faster(fresh_tables, monkeypatch):
    """On a CPU the head trains in bf16 autocast only where a timed training step is clearly faster in it; the
    two precisions are timed interleaved, the warm-up dropped, and the answer kept per machine, so a second run
    (a second start too) trains in the precision of the first (where the two precisions cost about the same, a
    timing taken anew each run could flip between runs)."""
    cpu = torch.device("cpu")
    calls = []

    def timed(fp32_ms, bf16_ms):
        def step_ms(lin, x, bf16):
            calls.append(bf16)
            warm = len(calls) <= 2  # the first of each precision: far faster than the rest, and dropped
            return 0.001 if warm else (bf16_ms if bf16 else fp32_ms) + 0.1 * (len(calls) % 3)
        return step_ms

    assert training_dtype(cpu, 8, 16, step_ms=timed(10.0, 5.0)) == (
        torch.bfloat16, "bfloat16 autocast: a 8x16 training product costs 5.0 ms against 10.0 ms in float32 here")
    assert calls == [False, True] * (distill.TRAINING_REPEATS + 1)
    assert kernels.stored_forwards(torch.float32, "training 8x16") == {512: {"float32": 10.0, "bfloat16": 5.0}}

    def never(lin, x, bf16):
        pytest.fail("timed again")

    assert training_dtype(cpu, 8, 16, step_ms=never)[0] == torch.bfloat16  # kept in this process
    kernels.forget()
    assert training_dtype(cpu, 8, 16, step_ms=never)[0] == torch.bfloat16  # and in the file: a new start reads it
    calls.clear()
    assert training_dtype(cpu, 8, 24, step_ms=timed(10.0, 50.0)) == (
        torch.float32, "float32: a 8x24 training product costs 10.0 ms against 50.0 ms in bfloat16 here")
    calls.clear()
    assert training_dtype(cpu, 8, 32, step_ms=timed(10.0, 9.5))[0] == torch.float32  # not clearly faster
    # not the decode step's choice: on a CPU without bf16 instructions our kernels make bf16 decoding the
    # faster, and ATen's bf16 training the far slower; a real measurement, whatever it picks
    monkeypatch.setattr(kernels, "compare_dtypes", lambda *a, **k: pytest.fail("asked the decode step's table"))
    dtype, why = training_dtype(cpu, 32, 64)
    assert "32x64 training product" in why and dtype in (torch.float32, torch.bfloat16)
    assert set(kernels.stored_forward(torch.float32, "training 32x64", 512)) == {"float32", "bfloat16"}


def test_fewer_prompts_than_asked_are_named_before_any_model_work(tmp_path):
    """Asking for more prompts than the built-in set or a file holds makes less data than asked: said with the
    numbers, before the target loads (the target named here does not exist)."""
    (tmp_path / "p.txt").write_text("\n".join(f"Prompt {i}." for i in range(5)))
    said = []
    for cfg, line in ((DistillConfig("/nowhere", "o", prompts_file=str(tmp_path / "p.txt"), prompts=8),
                       f"data: 5 prompts, not 8: {tmp_path / 'p.txt'} holds 5 ("),
                      (DistillConfig("/nowhere", "o", prompts_file=str(tmp_path / "p.txt"), prompts=8, first_prompt=2),
                       f"data: 3 prompts, not 8: {tmp_path / 'p.txt'} holds 3 from prompt 2 on ("),
                      (DistillConfig("/nowhere", "o", prompts=30_000), "data: 20639 prompts, not 30000: the built-in")):
        said.clear()
        with pytest.raises(ValueError, match="no model folder at /nowhere"):  # the note came before loading
            distill._target_and_prompts(cfg, "eagle", said.append)
        assert any(s.startswith(line) for s in said), said
    said.clear()
    with pytest.raises(ValueError, match="no model folder"):
        distill._target_and_prompts(DistillConfig("/nowhere", "o", prompts=4), "eagle", said.append)
    assert not any("prompts, not" in s for s in said)
