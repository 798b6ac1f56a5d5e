"""`bench --quick`: the benchmark runs end to end and writes its files (no thresholds on timings)."""

import json
import shutil

import pytest

from specviz.models import contention
from specviz.models.loading import SHIPPED_HEAD
from specviz.tools import cli
from specviz.tools.prompts import BENCHMARK_PROMPTS

pytestmark = [pytest.mark.slow, pytest.mark.offline_model]


def test_bench_quick_writes_json_markdown_and_chart(tmp_path, capsys):
    head = shutil.copytree(SHIPPED_HEAD, tmp_path / "another-head")  # --head: a head in place of the preset's
    assert cli.main(["bench", "--quick", "--drafters", "model,lookup+eagle", "--trees", "3x2:4", "--step-caches",
                     "static", "--head", str(head), "--out", str(tmp_path / "out")]) == 0
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert data["environment"]["head"] == "another-head"  # which head drafted, named in the record
    rows = data["rows"]
    # per prompt: the draft model and lookup-then-head at γ 3, each with the 'expected' policy, and the
    # head's tree 3 deep, 2 children per node, 4 drafts verified
    drafters = ("model", "lookup+eagle")
    assert len(rows) == 10 and {r["category"] for r in rows} == {"classic", "edit"}
    assert {(r["drafter"], r["policy"], r["tree"]) for r in rows} == {
        (d, p, "") for d in drafters for p in ("fixed", "expected")} | {("lookup+eagle", "fixed", "3x2:4")}
    trees = [r for r in rows if r["tree"]]
    assert all(len(r["depth_alpha"]) == 3 and r["tokens_per_round"] > 1 and r["bound"] is None for r in trees)
    for r in rows:
        assert r["temperature"] == 0 and r["baseline_tps"] > 0 and r["specviz_tps"] > 0 and r["hf_plain_tps"] > 0
        # against the faster of two baselines, each repeat's ratio can only be smaller
        assert 0 < r["speedup_vs_best"] <= r["speedup"]
        assert r["identical_to_baseline"] is not None and r["cache"] == "static"
        # each round's tokens reach the host (to be shown): at least one wait per round
        assert r["syncs_per_round"] >= 1 and r["baseline_syncs_per_round"] >= 1
        if r["policy"] == "fixed":
            assert r["gamma"] == 3 and r["mean_gamma"] is None
            hf = {"model": r["hf_assisted_tps"], "lookup": r["hf_lookup_tps"]}.get(r["drafter"])
            assert (r["specviz_over_hf"] is None) == ("eagle" in r["drafter"])  # transformers has no EAGLE
            assert hf is None or (hf > 0 and r["specviz_over_hf"] > 0)
            # the bound needs i.i.d. acceptance from a drafter with a cost, along a chain
            assert (r["bound"] is None) == ("lookup" in r["drafter"] or bool(r["tree"]))
        else:
            # drafted tokens per round: below 1 where prompt lookup found no match in some rounds
            assert 0 < r["mean_gamma"] <= 16 and r["bound"] is None
    assert [(b["drafter"], b["prompts"]) for b in data["batch"]] == [(d, 2) for d in drafters]
    assert all(b["batch_tps"] > 0 and b["sequential_tps"] > 0 for b in data["batch"])
    assert data["environment"]["dtype"] and data["environment"]["torch"]
    # what other processes took of the CPU time the run needed, where the meter reads (not in the suite: conftest)
    taken = data["environment"].get("taken by other processes")
    assert (taken is None) == (contention.others_meter()() is None)
    assert taken is None or taken.endswith("% of the CPU time specviz needed")
    steps = {(s["model"], s["cache"]): s["ms"] for s in data["steps"]}
    # both offline models run the lean static forward, so their matrix products are timed alone too
    assert set(steps) == {(m, c) for m in ("target", "draft") for c in ("static", "matrix products alone")}
    assert all(ms["1"] > 0 and ms["5"] > 0 for ms in steps.values())
    md = (tmp_path / "out" / "results.md").read_text()
    assert "| drafter | T | γ | median α" in md and "python -m specviz bench --quick" in md
    assert "policy / best fixed" in md and "batch / sequential" in md
    assert "### Forward passes" in md and "median baseline / HF plain" in md
    assert "| lookup+eagle | 0 | tree 3x2:4 | 5 |" in md  # chains and trees, with the verify width
    for r in rows:  # each row's round by stage, and a plain step's, as events.STAGES name them
        assert list(r["stages_ms"]) == list(r["baseline_stages_ms"]) == ["draft", "verify", "judge", "record", "rest"]
        assert r["stages_ms"]["verify"] > 0 and r["stages_ms"]["draft"] > 0
        assert r["baseline_stages_ms"]["draft"] < r["baseline_stages_ms"]["verify"]  # a plain step drafts nothing
    split = md.split("### Where a round's time goes")[1].split("###")[0]
    assert "| lookup+eagle | 0 | tree 3x2:4 |" in split and "| model | 0 | chain γ = 3 |" in split
    assert (tmp_path / "out" / "speedup.html").stat().st_size > 10_000
    assert "median speedup" in capsys.readouterr().out


def test_a_sampled_setting_runs_once_per_seed_and_greedy_once(pattern_pair):
    from specviz.tools.bench import bench_pair, markdown_table

    rows = bench_pair(pattern_pair("llama"), {"count": ["w1 w2 w3"]}, [2], [0.0, 1.0], 8, 1, with_hf=False,
                      progress=lambda m: None, drafters=("model",), policies=(), seeds=3)
    assert [(r.temperature, r.seed) for r in rows] == [(0.0, 0), (1.0, 0), (1.0, 1), (1.0, 2)]
    assert "| count | w1 w2 w3 | 1 | 2 | model | 2 |" in markdown_table(rows)  # T, seed, drafter, γ


def test_record_top_times_the_runs_as_the_page_records_them(pattern_pair, monkeypatch):
    """bench --record-top: every specviz run it times (and warms up), speculative and baseline, records that many
    candidates a position, as the app's runs do; by default none (the decode alone)."""
    from specviz.core import generator
    from specviz.tools.bench import bench_pair

    seen = []

    def spy(pair, prompt, settings, *args, **kwargs):
        seen.append((kwargs.get("mode", args[0] if args else "speculative"), settings.record_top))
        return real(pair, prompt, settings, *args, **kwargs)

    real = generator.generate
    monkeypatch.setattr(generator, "generate", spy)
    for record_top in (0, 3):
        seen.clear()
        bench_pair(pattern_pair("llama"), {"count": ["w1 w2 w3"]}, [2], [0.0], 6, 1, with_hf=False,
                   progress=lambda m: None, drafters=("model",), policies=(), record_top=record_top)
        assert {mode for mode, _ in seen} == {"speculative", "baseline"} and {top for _, top in seen} == {record_top}


def test_a_stopped_bench_keeps_the_prompts_it_finished(pattern_pair, tmp_path, monkeypatch, capsys):
    """bench writes results.json and results.md after each prompt, saying how far it got, so a run stopped (Ctrl-C,
    a session's end) keeps its whole prompts; the finished run's files say nothing of the kind, and charts come
    with the whole run only (an earlier run's are removed, not left beside this run's rows)."""
    from specviz.tools import bench

    real, prompts = bench.bench_pair, {"count": ["w1 w2 w3", "w4 w5 w6", "w7 w8 w9"]}

    def two_then_stop(pair, _prompts, *args, kept=None, **kwargs):  # the small pair's prompts; Ctrl-C after two
        def keep(rows, done):
            kept(rows, done)
            if done == 2:
                raise KeyboardInterrupt
        return real(pair, prompts, *args, kept=keep, **kwargs)

    monkeypatch.setattr(cli, "load_pair", lambda **kwargs: pattern_pair("llama"))
    monkeypatch.setattr(bench, "bench_pair", two_then_stop)
    (tmp_path / "speedup.html").write_text("an earlier run's chart")
    argv = ["bench", "--drafters", "model", "--gammas", "2", "--temperatures", "0", "--policies", "", "--batch", "0",
            "--step-caches", "", "--no-hf", "--max-new-tokens", "6", "--repeats", "1", "--no-choice",
            "--out", str(tmp_path)]
    assert cli.main(argv) == 130
    n = sum(map(len, BENCHMARK_PROMPTS.values()))  # the command's own prompts, in its count
    data = json.loads((tmp_path / "results.json").read_text())
    assert [r["prompt"] for r in data["rows"]] == prompts["count"][:2]
    assert data["stopped"] == f"2 of {n} prompts" and "**Not finished**: 2 of" in (tmp_path / "results.md").read_text()
    assert not (tmp_path / "speedup.html").exists()
    assert f"the rows of the 2 of {n} prompts done are in {tmp_path}" in capsys.readouterr().err

    monkeypatch.setattr(bench, "bench_pair", lambda pair, _prompts, *args, **kwargs: real(pair, prompts, *args,
                                                                                           **kwargs))
    assert cli.main(argv) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert len(data["rows"]) == 3 and "stopped" not in data
    assert "Not finished" not in (tmp_path / "results.md").read_text()
    assert (tmp_path / "speedup.html").exists()


def test_saved_results_are_named_by_machine_class_and_render_into_the_report(pattern_pair, tmp_path, monkeypatch):
    """bench --save keeps results.json as <dir>/<machine class>.json, with what the report states beside its table:
    the machine, its class, the commit, the date and the run's settings; --report renders it (measuring nothing)."""
    from specviz.models import kernels
    from specviz.tools import bench, report

    prompts = {"count": ["w1 w2 w3", "w4 w5 w6"]}
    monkeypatch.setattr(cli, "load_pair", lambda **kwargs: pattern_pair("llama"))
    real = bench.bench_pair
    monkeypatch.setattr(bench, "bench_pair", lambda pair, _p, *args, **kwargs: real(pair, prompts, *args, **kwargs))
    argv = ["bench", "--drafters", "model", "--gammas", "2", "--temperatures", "0", "--policies", "", "--batch", "0",
            "--step-caches", "", "--no-hf", "--max-new-tokens", "6", "--repeats", "1", "--no-choice",
            "--out", str(tmp_path / "out"), "--save", str(tmp_path / "benchmarks")]
    assert cli.main(argv) == 0
    name = "cpu-" + kernels.cpu_class().lower().replace(" (capped)", "-capped")
    data = json.loads((tmp_path / "benchmarks" / f"{name}.json").read_text())
    env = data["environment"]
    assert env["class"] == kernels.cpu_class() and env["commit"] and env["date"].startswith("20")
    assert env["kernels"] and env["cpu"].startswith(kernels.machine()["cpu"])  # the kernels it chose, on a CPU
    assert data["run"]["max_new_tokens"] == 6 and data["run"]["repeats"] == 1 and len(data["rows"]) == 2

    (tmp_path / "README.md").write_text(f"intro\n{report.README_START}\nold\n{report.README_END}\nrest\n")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", "--report"]) == 0
    md = (tmp_path / "BENCHMARKS.md").read_text()
    assert f"## {report._title(name)}" in md and "| model, γ = 2 |" in md and "| specviz plain |" in md
    readme = (tmp_path / "README.md").read_text()
    assert readme.startswith("intro\n") and readme.endswith("rest\n") and "old" not in readme
