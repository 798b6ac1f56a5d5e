"""The GPU run's one script (benchmarks/gpu.py), dry-run on this CPU: every step runs and writes its results."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent


def test_the_gpu_script_runs_every_step_on_a_cpu(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--device", "cpu", "--quick", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert list(results) == ["versions", "check", "generate", "profile", "ck"]
    assert results["versions"]["torch"] and results["check"]["float32"]["exit"] == 0
    assert "ok" in (tmp_path / "check-float32.log").read_text()
    assert results["profile"]["speculative"]["rounds"] > 0
    assert results["ck"]["eager"]["1"]["c"] == 1.0 and results["ck"]["eager"]["2"]["ms"] > 0
