"""`specviz kernels`, run as a user runs it (a process of its own, on this CPU and capped to AVX2): a file of its
own, as its two runs take minutes and pytest-xdist (`--dist loadfile`) gives a file to one worker."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import needs_native, with_our_build

from specviz.models import kernels

ROOT = Path(__file__).resolve().parent.parent


@needs_native  # it prints the ways the library runs the forward
@pytest.mark.slow
@pytest.mark.offline_model
@pytest.mark.parametrize("cap", ["", "AVX2"])
def test_the_kernels_command_prints_the_machine_the_table_and_c_of_k(tmp_path, cap):
    """`specviz kernels` on this CPU and capped to AVX2 (no AVX512): the machine's class, the
    table with a chosen path per row count, c(k), the drafters ranked; what the table lacked is measured
    and stored."""
    from specviz.models.loading import offline_target_dir

    # a cache folder of its own, so the kernels are measured here and a test never re-times the profile
    # this machine's runs read (a retune under a loaded CPU would store its slow timings there); the
    # converted model linked in
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "SmolLM2-135M-Instruct").symlink_to(offline_target_dir())
    env = {**os.environ, "SPECVIZ_CACHE": str(with_our_build(tmp_path / "cache")), "PYTHONPATH": str(ROOT)}
    if cap and "avx512f" not in kernels._cpu()[1]:
        pytest.skip("this CPU has no AVX512: the uncapped run already runs the AVX2 kernels")
    if cap:
        env.update(ONEDNN_MAX_CPU_ISA=cap, ATEN_CPU_CAPABILITY=cap.lower())
    else:  # the profile other tests made, if they have, less one shape: the command measures what it lacks
        shared = kernels.profile().file
        if shared.is_file():
            stored = json.loads(shared.read_text())
            stored["kernels"].pop("float32|576x576", None)
            (tmp_path / "cache" / "profiles").mkdir()
            (tmp_path / "cache" / "profiles" / shared.name).write_text(json.dumps(stored))
    command = [sys.executable, "-m", "specviz", "kernels", "--dtype", "float32", "--repeats", "1"]
    first = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "measuring matrix-product kernels" in first.stderr
    assert "| 49152x576 | linear |" in first.stdout and "*" in first.stdout
    assert "3 tokens / 1" in first.stdout and "bandwidth:" in first.stdout
    assert "greedy: expected speedup over plain decoding here" in first.stdout  # the drafters ranked by cost
    assert "| expected speedup | over 1,024 tokens of context |" in first.stdout  # and priced over a long context
    assert "c(k) as priced by the tokens already in the cache" in first.stdout and "| 2,048 | " in first.stdout
    assert "sampled (temperature > 0): expected speedup" in first.stdout  # and by τ measured when sampling
    ways = first.stdout.split("the target's forward, ms each way it may run")[1].split("\n\n")[1].splitlines()
    assert ways[0].startswith("| tokens |") and "rows alone" in ways[0]  # from two rows on: shared or alone
    assert all(row.split(" | ")[-1].rstrip(" |") in ways[0] for row in ways[2:]) and len(ways) > 3
    if cap:
        assert "AVX2" in first.stdout.splitlines()[0]
    # what a later start reads: the table it stored (a later start reading it is tested in-process above)
    profile = json.loads(next((tmp_path / "cache" / "profiles").glob("*.json")).read_text())
    assert any(name.startswith("float32|") for name in profile["kernels"]) and profile["rounds"]
    assert "read in" in first.stdout
