"""The benchmark report: BENCHMARKS.md and the README's speed tables are views of benchmarks/*.json."""

from pathlib import Path

import pytest

from specviz.tools import report

ROOT = Path(__file__).resolve().parent.parent


def _row(prompt: str, temperature: float, drafter: str, speedup: float, *, tree: str = "", same: bool = True,
         base: float = 20.0, hf: float = 10.0, tau: float = 2.0, gamma: int = 2, **extra) -> dict:
    return {"category": "chat", "prompt": prompt, "temperature": temperature, "gamma": gamma, "seed": 0,
            "drafter": drafter, "policy": "fixed", "tree": tree, "tokens_per_round": tau, "baseline_tps": base,
            "hf_plain_tps": hf, "specviz_tps": base * speedup, "speedup": speedup, "speedup_vs_best": speedup,
            "identical_to_baseline": same if temperature == 0 else None, "hf_assisted_tps": None,
            "hf_lookup_tps": None, **extra}


def _results(rows: list[dict], choice: dict | None = None) -> dict:
    env = {"device": "cpu", "dtype": "bfloat16", "cpu": "Some CPU (AVX2; avx2 fma), 2 threads, torch 2.13.0",
           "class": "AVX2", "target": "t", "draft": "d", "commit": "abc1234", "date": "2030-01-02", "threads": 2,
           "torch": "2.13.0"}
    if choice:
        env["first_run_choice"] = choice
    return {"environment": env, "command": "python -m specviz bench --save benchmarks",
            "run": {"max_new_tokens": 64, "repeats": 2, "seeds": 1}, "rows": rows, "steps": []}


def test_a_table_takes_medians_over_prompts_marks_the_choice_and_counts_identical_texts():
    rows = [_row("a", 0, "eagle", 1.2, hf_assisted_tps=None), _row("b", 0, "eagle", 1.6, same=False),
            _row("c", 0, "eagle", 1.4), _row("a", 1, "eagle", 1.1), _row("b", 1, "eagle", 1.3),
            _row("a", 0, "lookup+eagle", 2.0, tree="3x3:5", tau=3.0), _row("b", 0, "lookup+eagle", 1.8, tree="3x3:5",
                                                                            tau=2.0),
            _row("a", 0, "model", 0.9, hf_assisted_tps=12.0), _row("b", 0, "model", 0.7, hf_assisted_tps=8.0)]
    table = {r["name"]: r for r in report.rows_of(_results(rows, {"drafter": "eagle", "gamma": 2, "tree": ""}))}
    eagle = table["eagle, γ = 2"]
    assert eagle["vs"] == pytest.approx(1.4) and eagle["hot"] == pytest.approx(1.2) and eagle["same"] == "2 of 3"
    assert eagle["choice"] and not table["lookup+eagle, tree 3x3:5"]["choice"]
    assert table["lookup+eagle, tree 3x3:5"]["tau"] == pytest.approx(2.5)  # the mean, as the costs price it
    # plain decoders: one figure per prompt, against the faster of the two in each prompt's rows
    assert table["specviz plain"]["vs"] == 1.0 and table["Hugging Face plain `generate`"]["vs"] == pytest.approx(0.5)
    assert table["Hugging Face assisted (draft model), γ = 2"]["tps"] == pytest.approx(10.0)
    names = list(table)
    assert names.index("lookup+eagle, tree 3x3:5") < names.index("eagle, γ = 2") < names.index("model, γ = 2")
    md = report.benchmarks_md({"cpu-avx2": _results(rows, {"drafter": "eagle", "gamma": 2, "tree": ""})})
    assert "| eagle, γ = 2 (**this machine's first-run choice**) | 28.0 | 1.40x | 2.00 | 1.20x | 2 of 3 |" in md
    assert "## CPUs with AVX2 only" in md and "commit abc1234 · 2030-01-02" in md and "64 new tokens each" in md
    assert "No GPU has run this benchmark" in md


def test_machine_files_are_named_by_class_and_by_dtype_when_one_was_asked_for():
    assert report.machine_file({"device": "cpu", "class": "AVX512-BF16"}) == "cpu-avx512-bf16.json"
    assert report.machine_file({"device": "cpu", "class": "AVX2 (capped)"}) == "cpu-avx2-capped.json"
    amx = {"device": "cpu", "class": "AMX", "dtype": "float32"}
    assert report.machine_file(amx, "float32") == "cpu-amx-float32.json"
    assert report.machine_file({"device": "cuda:0", "gpu": "NVIDIA H200"}) == "gpu-nvidia-h200.json"


def test_a_readme_without_the_markers_is_refused_by_name():
    with pytest.raises(ValueError, match="no speed block"):
        report.with_readme_tables("no markers here", {})


def test_benchmarks_md_and_the_readme_are_what_the_report_renders_from_the_results_files():
    """Edit benchmarks/*.json (by `bench --save`), then `python -m specviz bench --report`: never the documents."""
    files = report.load(ROOT / "benchmarks")
    assert files, "benchmarks/ holds no results file"
    assert (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8") == report.benchmarks_md(files), (
        "BENCHMARKS.md differs from what `python -m specviz bench --report` renders")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert report.with_readme_tables(readme, files) == readme, (
        "README.md's speed tables differ from what `python -m specviz bench --report` renders")


def test_a_capped_class_is_re_measured_under_its_caps():
    """A file of AVX2 kernels run on an AVX-512 CPU re-measures only under the caps that made it so: its command
    in the report carries them, once."""
    bare = {"command": "python -m specviz bench --save benchmarks"}
    caps = report.CAPS["cpu-avx2-capped"]
    assert report._command("cpu-avx2-capped", bare) == f"{caps} python -m specviz bench --save benchmarks"
    assert report._command("cpu-avx2-capped", {"command": f"{caps} python -m specviz bench"}).count(caps) == 1
    assert report._command("cpu-avx2", bare) == bare["command"]
