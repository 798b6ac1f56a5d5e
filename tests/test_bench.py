"""`bench --quick`: the benchmark runs end to end and writes its files (no thresholds on timings)."""

import json

import pytest

from specviz import cli

pytestmark = [pytest.mark.slow, pytest.mark.offline_model]


def test_bench_quick_writes_json_markdown_and_chart(tmp_path, capsys):
    assert cli.main(["bench", "--quick", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    rows = data["rows"]
    assert len(rows) == 2 and {r["category"] for r in rows} == {"classic", "edit"}
    for r in rows:
        assert r["gamma"] == 3 and r["temperature"] == 0
        assert r["baseline_tps"] > 0 and r["specviz_tps"] > 0 and r["hf_assisted_tps"] > 0 and r["hf_lookup_tps"] > 0
        assert r["speedup"] == pytest.approx(r["specviz_tps"] / r["baseline_tps"])
        assert r["identical_to_baseline"] is not None and r["identical_to_hf"] is not None
    assert data["environment"]["dtype"] and data["environment"]["torch"]
    md = (tmp_path / "results.md").read_text()
    assert "| T | γ | median α" in md and "python -m specviz bench --quick" in md
    assert (tmp_path / "speedup.html").stat().st_size > 10_000
    assert "median speedup" in capsys.readouterr().out
