"""`python -m specviz check`: the matrix runs, its oracles can fail, and a failing case fails the command."""

import copy
import dataclasses
import logging
import math

import pytest
import torch
from conftest import words

from specviz.core.generator import Settings, generate
from specviz.models import leanllama
from specviz.models.leanllama import LeanLlama
from specviz.tools import check
from specviz.tools.cli import main

PROMPTS = ["w2 w3 w4", "w10 w11", "w20 w21 w22 w20 w21"]  # the last repeats itself: prompt lookup copies


@pytest.mark.slow
def test_every_case_runs_and_holds_on_saved_models(pattern_dirs, eagle_dirs, monkeypatch, capsys):
    """Loaded from disk as a user's models are: every cache kind, drafter shape and temperature, each ok
    in float32 (greedy = plain decoding, batch rows = alone, the first round exact)."""
    target, draft = pattern_dirs("llama")
    monkeypatch.setattr(check, "PROMPTS", PROMPTS)
    code = main(["check", "--target", str(target), "--draft", str(draft), "--head", str(eagle_dirs("llama")[1]),
                 "--device", "cpu", "--dtype", "float32", "--max-new-tokens", "10"])
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.split(" ", 1)[0] in ("ok", "differs", "failed", "skipped")]
    assert code == 0, out
    assert len(lines) == 18 and all(line.startswith("ok ") for line in lines if "T=0" in line), out
    # sampled, a draw near a boundary may part a batch row from its run alone where kernels round apart: "differs"
    assert all(line.startswith(("ok ", "differs ")) for line in lines), out
    for part in ("static cache", "dynamic cache", "none cache", "model γ 3", "lookup+eagle γ 2", "tree 3x2:4",
                 "T=0", "T=1", "greedy = plain decoding 3/3", "batch rows = alone 3/3", "waits/round"):
        assert part in out, part
    assert all(float(x.split("max|emitted−p| ")[1].split(";")[0]) <= check.EXACT
               for x in lines if "max|emitted" in x)


def test_a_pair_without_a_head_skips_the_head_drafters_before_any_model_work(pattern_pair):
    outcomes = list(check.check(pattern_pair("llama"), compiled=False, max_new_tokens=6, prompts=PROMPTS))
    by_status = {s: [o for o in outcomes if o.status == s] for s in ("ok", "skipped")}
    assert len(by_status["ok"]) == 6 and {o.case.drafter for o in by_status["ok"]} == {"model"}
    assert len(by_status["skipped"]) == 12 and all("needs a head" in o.checks[0] for o in by_status["skipped"])


def test_a_case_that_raises_fails_the_command_and_the_others_still_run(pattern_dirs, monkeypatch, capsys):
    target, draft = pattern_dirs("llama")
    real = check.generate_batch

    def broken(pair, prompts, settings, *args, **kwargs):
        if settings.cache == "dynamic":
            raise RuntimeError("an op this device lacks")
        return real(pair, prompts, settings, *args, **kwargs)

    monkeypatch.setattr(check, "generate_batch", broken)
    monkeypatch.setattr(check, "PROMPTS", PROMPTS)
    code = main(["check", "--target", str(target), "--draft", str(draft), "--device", "cpu", "--dtype", "float32",
                 "--max-new-tokens", "6", "--only", "T=0"])
    captured = capsys.readouterr()
    assert code == 1
    assert "failed   model γ 3, dynamic cache, T=0: RuntimeError: an op this device lacks" in captured.out
    for cache in ("static", "none"):
        assert f"ok       model γ 3, {cache} cache, T=0" in captured.out
    assert "Traceback" in captured.err and "an op this device lacks" in captured.err
    assert "2 ok, 1 failed, 6 skipped" in captured.out  # --only T=0: 9 cases, the head's skipped (no head)
    assert main(["check", "--target", str(target), "--draft", str(draft), "--device", "cpu", "--only", "T=2"]) == 2
    assert "no case's name contains 'T=2'" in capsys.readouterr().err  # nothing ran: not a pass


def test_the_verdicts_fail_where_they_should(pattern_pair):
    pair = pattern_pair("llama")
    f32, bf16 = torch.float32, torch.bfloat16
    runs = [generate(pair, "", Settings(gamma=3, max_new_tokens=8, drafter=d), prompt_ids=p)
            for d, p in (("model", words(2, 3, 4)), ("model", words(10, 11)))]
    case = check.Case("model", 3, 1, 0, "static", False, 0.0)
    assert check.judge(case, f32, runs, runs, runs, None) == ("ok", ["greedy = plain decoding 2/2",
                                                                   "batch rows = alone 2/2"])
    swapped = runs[::-1]
    status, checks = check.judge(case, f32, runs, runs, swapped, None)  # texts apart: float32 fails
    assert status == "failed" and checks[0].startswith("greedy = plain decoding 0/2 (first difference at token")
    assert check.judge(case, bf16, runs, runs, swapped, None)[0] == "differs"  # reduced precision: reported
    assert check.judge(case, f32, runs, runs, None, 1e-3)[0] == "failed"  # the closed form misses p
    assert check.judge(case, f32, runs, runs, None, float("nan"))[0] == "failed"
    # a batch row that records other numbers for the same drafts: in float32 beyond rounding fails (q: beyond
    # an int8 step where the drafter is quantized); in bfloat16 the gap is reported
    drafted = next(i for i, e in enumerate(runs[0].events) if e.drafted and min(e.drafted[0].p, e.drafted[0].q) > 0.01)
    for field, scale, dtype, quantized, verdict in (
            ("q", 0.8, f32, False, "failed"), ("q", 1 - 1e-6, f32, False, "ok"), ("q", 0.95, f32, False, "failed"),
            ("q", 0.95, f32, True, "ok"), ("q", 0.8, f32, True, "failed"), ("p", 0.95, f32, True, "failed"),
            ("q", 0.8, bf16, False, "ok")):
        moved = copy.deepcopy(runs)
        token = moved[0].events[drafted].drafted[0]
        setattr(token, field, getattr(token, field) * scale)
        status, checks = check.judge(case, dtype, runs, moved, None, 0.0, quantized)
        assert status == verdict, (field, scale, dtype, quantized, checks)
        assert f"{field} within {1 - scale:.0e}" in checks[0] or scale > 0.99, checks
    parted = copy.deepcopy(runs)  # the same numbers, another token drawn near a boundary: differs
    parted[0].events[-1].extra.id += 1
    assert check.judge(case, f32, runs, parted, None, 0.0) == ("differs", ["batch rows = alone 1/2",
                                                                         "first round exact: max|emitted−p| 0.0e+00"])
    # every row computed alone (row_alone): judged bit for bit in bfloat16 too
    assert check.judge(case, bf16, runs, runs, runs, None, alone=True) == (
        "ok", ["greedy = plain decoding 2/2", "batch rows = alone 2/2",
               "judged bit for bit (every row computed alone)"])
    assert check.judge(case, bf16, runs, runs, swapped, None, alone=True)[0] == "failed"
    assert check.judge(case, bf16, runs, parted, None, 0.0, alone=True)[0] == "failed"
    moved = copy.deepcopy(runs)
    moved[0].events[drafted].drafted[0].q *= 1 - 1e-7
    assert check.judge(case, bf16, runs, moved, None, 0.0, alone=True)[0] == "failed"
    broken = copy.deepcopy(runs)
    broken[0].events[-1].extra.p = math.nan
    assert check.judge(case, f32, broken, broken, None, 0.0)[0] == "failed"
    broken[0].events[-1].extra.p = 1.5
    assert check.judge(case, f32, broken, broken, None, 0.0)[1][-1] == "a p, q or min(1, p/q) outside [0, 1]"


def test_a_case_reports_warnings_once_and_not_progress():
    caught, log = check._Caught(), logging.getLogger("specviz")
    log.addHandler(caught)
    try:
        log.warning("specviz: preparing the compiled forward of m for 4 token(s)", extra=leanllama.PROGRESS)
        for _ in range(2):
            log.warning("specviz: 64 shapes compiled in this process, the most kept; m runs a forward eager")
    finally:
        log.removeHandler(caught)
    assert caught.seen == ["specviz: 64 shapes compiled in this process, the most kept; m runs a forward eager"]


def test_a_compiled_run_without_cuda_graphs_or_with_uncounted_graphs_says_so(pattern_pair, monkeypatch):
    """On a GPU inductor may run a compiled graph without CUDA graphs (and count it), and dynamo may compile a
    graph again for something other than a new shape (a stride, a guard, a graph break): the case says how
    often, and a new shape that specviz counts is not such a graph."""
    from torch._dynamo.utils import counters

    real = check.generate_batch

    def skipping(*args, **kwargs):
        counters["inductor"]["cudagraph_skips"] += 2
        counters["stats"]["unique_graphs"] += 3
        LeanLlama.shapes_compiled += 1  # one of the three a new shape
        return real(*args, **kwargs)

    monkeypatch.setattr(check, "generate_batch", skipping)
    monkeypatch.setattr(LeanLlama, "shapes_compiled", LeanLlama.shapes_compiled)
    (outcome,) = check.check(pattern_pair("llama"), compiled=False, max_new_tokens=4, prompts=PROMPTS,
                             only=lambda c: c.name == "model γ 3, static cache, T=0")
    assert outcome.status == "ok" and outcome.checks[-2].startswith("CUDA graphs skipped 2 times")
    assert outcome.checks[-1].startswith("2 graph(s) compiled beyond the shapes counted")


def test_after_the_device_is_lost_the_other_cases_are_skipped_saying_why(monkeypatch):
    """A CUDA device-side assert leaves the context unusable: the case that met it fails with its error, and every
    case after it is skipped naming that error, not run to fail the same way; any other error fails one case."""
    ran = []

    def run_case(pair, case, prompts, max_new_tokens, plain):
        ran.append(case)
        if len(ran) == 2:
            return check.Outcome(case, "failed", ["AcceleratorError: CUDA error: device-side assert triggered"],
                                 error="torch.AcceleratorError: CUDA error: device-side assert triggered")
        return check.Outcome(case, "failed", ["ValueError: one case"], error="ValueError: one case")

    monkeypatch.setattr(check, "run_case", run_case)
    outcomes = list(check.check(None, compiled=False))
    assert len(ran) == 2 and len(outcomes) == len(check.cases(False))
    assert [o.status for o in outcomes[:2]] == ["failed", "failed"]
    assert all(o.status == "skipped" and "device-side assert" in o.checks[0] for o in outcomes[2:])


def test_a_reduced_precision_greedy_case_that_parts_is_judged_by_a_float32_rerun(pattern_pair, monkeypatch):
    """Texts parted in bfloat16 are rounding only if the same case agrees in float32: rerun there, a case whose
    float32 texts agree stays "differs" and says so; one whose float32 texts part too (a fault, here a plain decode
    made to write another token) fails."""
    pair32 = pattern_pair("llama")
    case = next(c for c in check.cases(False) if c.temperature == 0 and c.cache == "static" and c.branch == 1)

    def run_case(pair, case, prompts, max_new_tokens, plain):
        return check.Outcome(case, "differs", ["greedy = plain 1/2 (first difference at token 3)"])

    monkeypatch.setattr(check, "run_case", run_case)
    prompts = ["w1 w2 w3", "w4 w5"]

    def outcome():
        return next(check.check(None, False, 8, prompts, only=lambda c: c == case, float32=lambda: pair32))

    held = outcome()
    assert held.status == "differs" and held.checks[-1] == ("float32 rerun: greedy = plain 2/2: the "
                                                            "reduced-precision texts parted at near ties")
    real = check.generate

    def broken(pair, prompt, settings, mode="speculative", **kwargs):
        run = real(pair, prompt, settings, mode=mode, **kwargs)
        if mode == "baseline":  # a fault: plain decoding's third token (index 2) another
            run.events[2] = dataclasses.replace(run.events[2], extra=dataclasses.replace(
                run.events[2].extra, id=run.events[2].extra.id + 1))
        return run

    monkeypatch.setattr(check, "generate", broken)
    failed = outcome()
    assert failed.status == "failed" and failed.checks[-1].startswith("float32 rerun: greedy = plain 0/2 (first "
                                                                      "difference at token 2)")
