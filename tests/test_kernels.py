"""Kernels chosen by measuring on this machine (kernels.py): the table, its choices, its cache, and
every CPU-dependent path forced on this CPU (instruction-set caps, packing made to fail)."""

import copy
import functools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import PAD, needs_native, scripted_meters, while_another_process_makes, with_our_build, word_id, words

from specviz.core.generator import Settings, generate
from specviz.core.kvcache import KVState
from specviz.models import kernels, leanllama
from specviz.models.leanllama import CLASSES, LeanLlama, Linear
from specviz.models.loading import plan_forwards

ROOT = Path(__file__).resolve().parent.parent


def _relinked(pair):
    """The pair's lean forward built again, so its Linear modules ask the (new) table."""
    pair.target.__dict__.pop("_specviz_lean", None)
    return LeanLlama.of(pair.target)


def test_the_table_is_measured_once_stored_and_read_back(fresh_tables):
    w = torch.randn(96, 64)
    t = kernels.table(torch.float32)  # held before tuning (as compare_dtypes holds it): it sees the new shape
    kernels.tune([w])
    assert kernels.table(torch.float32) is t
    assert set(t.times["96x64"]) == {str(r) for r in kernels.ROWS}
    assert "linear" in t.times["96x64"]["1"]
    stored = json.loads(kernels.profile().file.read_text())  # one entry a shape in the machine's profile
    assert stored["machine"] == kernels.machine() and stored["kernels"] == {"float32|96x64": {"ms": t.times["96x64"],
                                                                                             "busy": None}}
    kernels._TABLES.clear()  # a later start reads the file instead of measuring
    again = kernels.table(torch.float32)
    assert again is not t and again.times == t.times
    said = []
    kernels.tune([w], said.append, retune=True)  # retune times it anew
    assert said[0] == "timing 96x64 anew" and any(m.startswith("measuring matrix-product kernels") for m in said)


def test_a_start_stopped_while_measuring_keeps_the_shapes_it_measured(fresh_tables, monkeypatch):
    real, timed = kernels._time_cells, []

    def stopped_at_the_second_shape(weights, *args):
        if timed:
            raise KeyboardInterrupt
        timed.append(kernels.shape_key(weights[0]))
        return real(weights, *args)

    monkeypatch.setattr(kernels, "_time_cells", stopped_at_the_second_shape)
    with pytest.raises(KeyboardInterrupt):
        kernels.tune([torch.randn(96, 64), torch.randn(48, 64)])
    kernels._TABLES.clear()  # the next start reads what was stored
    assert list(kernels.table(torch.float32).times) == timed == ["96x64"]


def test_every_timed_sweep_reads_its_weights_from_memory(monkeypatch):
    """The caches are evicted before each sweep (warm-up and repeats, every path and row count), so a cell
    times what a decode pays: weights streamed from memory, not the few of one shape left in cache. The
    eviction reads at least twice the largest cache, and how cells are timed keys the table. Products are
    bound once per weight and row count, as a decode binds them, not in the timed sweeps."""
    log, binds = [], []
    monkeypatch.setattr(kernels, "_evict", lambda: log.append("evict"))

    def bind(packed, w, b, rows, name):
        binds.append((name, rows))
        return lambda x: log.append(name) or x @ w.T

    paths = [kernels.KernelPath(name, (torch.float32,), False, lambda w, rows: None,
                                functools.partial(bind, name=name)) for name in ("one", "other")]
    weights = [torch.randn(8, 4) for _ in range(3)]
    times = kernels._time_cells(weights, paths, (1, 2))
    assert set(times) == {"1", "2"} and set(times["1"]) == {"one", "other"}
    assert sorted(binds) == sorted((name, rows) for name in ("one", "other") for rows in (1, 2) for _ in weights)
    sweeps = " ".join(log).split("evict")[1:]
    assert log[0] == "evict" and len(sweeps) >= 2 * 2 * (1 + kernels.MIN_REPEATS)
    assert all(s.split() in (["one"] * 3, ["other"] * 3) for s in sweeps)  # one path's 3 weights per sweep
    assert kernels._eviction_buffer().numel() * 8 >= min(2 * kernels._largest_cache_bytes(), 512 << 20)
    assert kernels.TIMING in kernels.registry()


def test_a_second_process_waits_for_the_first_and_reads_its_table(fresh_tables):
    """Two processes sharing the cache (two app starts, two test workers) measure once: while one holds
    the table's lock, the other says it waits, then reads what the first stored instead of measuring."""
    profile = kernels.profile()
    theirs = {"96x64": {"1": {"linear": 123.0}}}
    _, said = while_another_process_makes(
        profile.file, lambda progress: kernels.tune([torch.randn(96, 64)], progress),
        lambda: kernels.KernelTable(kernels.machine(), "float32", theirs, profile=profile).save(["96x64"]))
    assert kernels.table(torch.float32).times == theirs  # read, not measured again
    assert not any(m.startswith("measuring") for m in said)


def test_a_shape_timed_on_a_busy_machine_is_timed_again_and_said_to_be(fresh_tables, monkeypatch):
    """Other programs slow a two-thread path more than a one-thread one, so a table timed beside them picks
    wrong paths (several of the offline pair's choices in bfloat16 under a one-core hog): a shape is timed
    again while the meter reads above BUSY (the quietest of ATTEMPTS kept), and one still timed busy is marked
    in the table and timed again by the next process."""
    from specviz.models import contention

    timings = []

    def cells(weights, paths, rows):
        timings.append(len(timings))
        return {str(r): {"linear": float(len(timings))} for r in rows}  # which attempt was kept

    monkeypatch.setattr(kernels, "_time_cells", cells)
    monkeypatch.setattr(contention, "_TIMED_HERE", set())
    w, said = torch.randn(96, 64), []
    monkeypatch.setattr(contention, "others_meter", scripted_meters([0.6, 0.1]))
    kernels.tune([w], said.append)
    t = kernels.table(torch.float32)
    assert len(timings) == 2 and t.times["96x64"]["1"]["linear"] == 2.0 and t.busy == {"96x64": 0.1}
    assert any("took 60% of the CPU time specviz needed while 96x64 was timed; timing it again" in m for m in said)

    kernels.forget()
    t.profile.file.unlink()
    timings.clear()
    contention._TIMED_HERE.clear()
    monkeypatch.setattr(contention, "others_meter", scripted_meters([0.6, 0.5, 0.7]))
    kernels.tune([w])
    t = kernels.table(torch.float32)
    assert len(timings) == 3 and t.times["96x64"]["1"]["linear"] == 2.0 and t.busy == {"96x64": 0.5}
    assert "timed while other programs took 50% of the CPU time specviz needed" in kernels.table_text(torch.float32)
    assert t.profile.entry("kernels", "float32|96x64")["busy"] == 0.5
    monkeypatch.setattr(contention, "others_meter", scripted_meters([]))
    kernels.tune([w])  # this process timed it: kept
    assert len(timings) == 3

    kernels.forget()  # the next process times it again, quiet now, and says why
    contention._TIMED_HERE.clear()
    said.clear()
    monkeypatch.setattr(contention, "others_meter", scripted_meters([0.0]))
    kernels.tune([w], said.append)
    assert len(timings) == 4 and kernels.table(torch.float32).busy == {"96x64": 0.0}
    assert any(m.startswith("timing 96x64 again: other programs took more than 20%") for m in said)
    assert "timed while" not in kernels.table_text(torch.float32)


def test_a_table_kept_unmetered_is_timed_again_by_a_start_that_meters(fresh_tables, monkeypatch):
    """The test suite keeps timings as they come (SPECVIZ_IGNORE_LOAD) on a machine it loads by design: such a
    table serves processes that do not meter either, and a start that does times it again, once, saying why.
    (Else a suite run with the user's cache folder would leave an app choosing from a table of that kind.)"""
    from specviz.models import contention

    timings = []

    def cells(weights, paths, rows):
        timings.append(len(timings))
        return {str(r): {"linear": float(len(timings))} for r in rows}

    monkeypatch.setattr(kernels, "_time_cells", cells)
    monkeypatch.setattr(contention, "_TIMED_HERE", set())
    monkeypatch.setattr(contention, "_stat_reads", lambda: True)  # a machine where the meter reads
    monkeypatch.setenv("SPECVIZ_IGNORE_LOAD", "1")
    w, said = torch.randn(96, 64), []
    kernels.tune([w])
    assert len(timings) == 1 and kernels.table(torch.float32).busy == {}
    kernels.forget()
    contention._TIMED_HERE.clear()  # another process that ignores the load: reads it
    kernels.tune([w])
    assert len(timings) == 1
    kernels.forget()
    contention._TIMED_HERE.clear()  # one that meters: times it again, and keeps the reading
    monkeypatch.delenv("SPECVIZ_IGNORE_LOAD")
    monkeypatch.setattr(contention, "others_meter", scripted_meters([0.0]))
    kernels.tune([w], said.append)
    assert len(timings) == 2 and kernels.table(torch.float32).busy == {"96x64": 0.0}
    assert any(m.startswith("timing 96x64 again: they were timed without measuring the machine's load") for m in said)
    kernels.forget()
    contention._TIMED_HERE.clear()
    kernels.tune([w])  # and the next reads it
    assert len(timings) == 2


def test_the_choice_is_the_fastest_at_the_nearest_timed_rows():
    t = kernels.KernelTable({}, "float32", {"8x8": {
        "1": {"linear": 1.0, "onednn": 2.0, "mkl": 0.5},
        "4": {"linear": 1.0, "onednn": 0.7, "mkl": 3.0},
        "16": {"linear": 2.0, "onednn": 3.0, "mkl": 1.0}}})
    assert t.best("8x8", 1) == "mkl"
    assert t.best("8x8", 3) == "onednn"  # 3 rows: as measured at 4
    assert t.best("8x8", 16) == "mkl"
    assert t.best("8x8", 40) == "linear"  # beyond the timed rows: no copy per row count
    assert t.best("other", 1) == "linear"  # never measured
    lossy = kernels.KernelTable({}, "float32", {"8x8": {"1": {"linear": 1.0, "onednn": 0.9, "int8": 0.5}}})
    assert lossy.best("8x8", 1) == "onednn" and lossy.best("8x8", 1, lossy=True) == "int8"  # int8: drafters only


def test_a_bfloat16_weight_keeps_one_family_of_bits_at_every_row_count():
    """A bf16 product takes the family of row-invariant kernels fastest over all timed row counts, even at a row
    count where another path is faster alone, so a verify's rows round as the one-token steps do; with no family
    at every row count, and in float32, the fastest path of each."""
    times = {"1": {"linear": 0.20, "avx512-dot": 0.091, "amx": 0.092, "avx512": 0.12},  # an AMX CPU's qkv at one row
             "4": {"linear": 0.30, "avx512-dot": 0.125, "amx": 0.081, "avx512": 0.128},
             "16": {"linear": 0.25, "onednn16": 0.22, "avx512-dot": 0.255, "amx": 0.123}}
    t = kernels.KernelTable({}, "bfloat16", {"960x576": times})
    assert t.family("960x576") == "amx"
    assert [t.best("960x576", r) for r in (1, 3, 16, 40)] == ["amx"] * 4
    times["1"]["amx"] = 9.0  # amx dear enough at one row: the pair kernel's family wins the sum
    assert {t.best("960x576", r) for r in (1, 3, 16)} == {"avx512-dot"}
    del times["16"]["avx512-dot"], times["16"]["amx"]  # no family timed at 16 rows: each row count's fastest
    assert t.family("960x576") == ""
    assert [t.best("960x576", r) for r in (1, 4, 16)] == ["avx512-dot", "amx", "onednn16"]
    times["16"].update({"avx512-dot": 0.255, "amx": 0.123})
    float32 = kernels.KernelTable({}, "float32", {"960x576": times})  # float32: each row count's fastest
    assert float32.family("960x576") == "pairs" and float32.best("960x576", 4) == "amx"
    drafter = {"1": {"avx512-dot": 0.09, "amx": 0.1}, "4": {"avx512-dot": 0.2, "amx": 0.1}}
    assert [kernels.KernelTable({}, "bfloat16", {"s": drafter}).best("s", r, lossy=True) for r in (1, 4)] == \
        ["amx", "amx"]  # a drafter's product too: a batch row drafts as its prompt alone


def test_a_drafters_weight_keeps_one_kind_of_numbers_at_every_row_count():
    """Which lossy kind a drafter's weight takes is decided at the fewest rows: the same row then drafts
    alike alone and in a batch (where its product has more rows); within the kind, the fastest path."""
    times = {"1": {"linear": 3.0, "avx2-bf16": 1.0, "avx512-bf16": 1.5, "int8": 2.0},
             "4": {"linear": 3.0, "avx2-bf16": 2.0, "avx512-bf16": 1.8, "int8": 1.0},
             "16": {"linear": 3.0, "avx2-bf16": 2.5, "avx512-bf16": 2.6, "int8": 0.5}}
    t = kernels.KernelTable({}, "float32", {"8x8": times})
    assert [t.best("8x8", r, lossy=True) for r in (1, 3, 9, 40)] == ["avx2-bf16", "avx512-bf16", "avx2-bf16",
                                                                      "avx2-bf16"]
    assert [t.best("8x8", r) for r in (1, 9)] == ["linear", "linear"]  # the target: exact paths only
    times["1"]["int8"] = 0.9  # int8 fastest for one row: int8 at every row count, even where it is slower
    times["4"]["int8"] = 9.0
    assert {t.best("8x8", r, lossy=True) for r in (1, 3, 9, 40)} == {"int8"}
    times["1"]["linear"] = 0.1  # an exact path fastest for one row: exact paths only
    assert {t.best("8x8", r, lossy=True) for r in (1, 3, 9)} == {"linear"}
    # specviz's AVX2 int8 kernel and fbgemm's both keep int8 weights, but fbgemm scales a row otherwise: never one
    # for some row counts and the other for the rest (a batch row would draft from other q than alone)
    times["1"].update(linear=3.0, **{"avx2-int8": 0.5})
    times["4"]["avx2-int8"] = times["16"]["avx2-int8"] = 5.0
    assert {t.best("8x8", r, lossy=True) for r in (1, 3, 9, 40)} == {"avx2-int8"}


def test_a_machine_keys_its_own_profile(monkeypatch):
    m, mine = kernels.machine(), kernels.profile().file
    other = {**m, "isa": [f for f in m["isa"] if f != "avx512_bf16"] + ["x"]}
    with monkeypatch.context() as patched:
        patched.setattr(kernels, "machine", lambda: other)
        assert kernels.profile().file != mine and kernels.profile().machine == other
    with monkeypatch.context() as patched:  # a changed path: a new profile too
        patched.setattr(kernels, "registry", lambda: ["another path"])
        assert kernels.profile().file != mine
    assert kernels.cpu_class({**m, "isa": ["avx2"], "aten_capability": "avx2", "onednn_max_isa": ""}) == "AVX2"
    assert kernels.cpu_class({**m, "isa": ["avx2", "avx512f", "avx512_bf16", "amx_bf16"], "aten_capability": "avx512",
                              "onednn_max_isa": ""}) == "AMX"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packing_unavailable_skips_the_path_and_decodes_the_same(pattern_pair, fresh_tables, monkeypatch, dtype):
    """Make every packed path raise (a CPU without oneDNN or MKL, or without bf16 instructions):
    the table says why, every product runs through F.linear, and greedy text is unchanged."""
    pair = pattern_pair("llama", dtype)
    settings = Settings(gamma=3, max_new_tokens=12, drafter="model", record_top=0)
    prompt = words(0, 1, 2, 3)
    before = generate(pair, "", settings, prompt_ids=prompt).token_ids

    def broken(w, rows):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert")

    for name in [n for n in kernels.PATHS if n != "linear"]:
        monkeypatch.setitem(kernels.PATHS, name, kernels.KernelPath(name, kernels.PATHS[name].dtypes, False, broken,
                                                                    kernels.PATHS[name].bind))
    kernels._TABLES.clear()
    try:
        lean = _relinked(pair)
        pair.draft.__dict__.pop("_specviz_lean", None)  # the draft model's products ask again too
        linears = lean.linears() + LeanLlama.of(pair.draft).linears()
        kernels.tune([lin.weight for lin in linears], retune=True)
        t = kernels.table(dtype)
        assert "avx_ne_convert" in t.skipped["onednn"]
        assert all(set(ms) == {"linear"} for lin in linears for ms in t.times[kernels.shape_key(lin.weight)].values())
        after = generate(pair, "", settings, prompt_ids=prompt).token_ids
        assert {name for lin in linears for name in lin.paths.values()} == {"linear"}
    finally:
        pair.target.__dict__.pop("_specviz_lean", None)
        pair.draft.__dict__.pop("_specviz_lean", None)
    assert after == before


def test_a_linear_plans_each_class_of_row_counts_once_and_its_forwards_only_read_it(monkeypatch):
    """A prompt's length is a new row count for every product; rows the table answers alike (the same timed row
    count standing for them, on the same side of the largest) are one class, and a plan asks the table once for
    each class, alone and in native.layers' call, all at once: row counts then only read it."""
    from specviz.models.leanllama import CLASS_ROWS

    asked = []
    monkeypatch.setattr(kernels, "choose", lambda weight, rows, lossy=False, in_call=False: asked.append(
        (rows, in_call)) or "linear")
    lin = Linear(torch.randn(8, 4), None)
    for rows in (6, 7, 8, 1, 20, 33, 6):
        assert lin.path(rows) == ("linear", None)
    lin.path(7, in_call=True)
    assert asked == list(CLASS_ROWS) and len(lin.chosen) == len(kernels.ROWS) * 2 + 2
    assert set(lin.paths) == {6, 7, 8, 1, 20, 33} and set(lin.call_paths) == {7}
    assert kernels.row_class(6) == kernels.row_class(8) != kernels.row_class(5)
    assert kernels.row_class(17) == kernels.row_class(300) != kernels.row_class(16)


def test_each_row_count_takes_its_chosen_path_and_matches_a_fresh_forward(pattern_pair, fresh_tables):
    """A table that picks MKL at 4 rows and oneDNN at 1: a 4-token verify pass packs for MKL at 4
    rows, a step uses oneDNN, and the logits equal transformers' forward."""
    pair = pattern_pair("llama")
    if not torch.backends.mkl.is_available() or not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build lacks MKL or oneDNN")
    lean = _relinked(pair)
    t = kernels.table(torch.float32)
    for lin in lean.linears():
        t.times[kernels.shape_key(lin.weight)] = {"1": {"linear": 2.0, "onednn": 1.0, "mkl": 3.0},
                                                  "4": {"linear": 2.0, "onednn": 3.0, "mkl": 1.0}}
    V, prompt, verify = pair.vocab_size, words(0, 1, 2, 3), words(3, 4, 9, 6)
    state = KVState(pair.target, 1, "static", V, capacity=12)
    try:
        with torch.inference_mode():
            state.prefill([prompt], PAD)
            logits = state.forward(torch.tensor([verify]), torch.ones(1, 4, dtype=torch.bool)).logits[0]
            step = state.forward(torch.tensor([words(5)]), torch.ones(1, 1, dtype=torch.bool)).logits[0, -1]
            full = pair.target(torch.tensor([prompt + verify[1:] + words(5)])).logits[0, -5:, :V].float()
        assert lean.head.paths == {4: "mkl", 1: "onednn"}
        assert ("mkl", 4) in lean.head.packs and ("onednn", 0) in lean.head.packs
    finally:
        pair.target.__dict__.pop("_specviz_lean", None)
    torch.testing.assert_close(logits, full[:4], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(step, full[4], atol=1e-4, rtol=1e-4)


def test_a_linear_on_another_device_never_asks_the_table():
    lin = Linear(torch.randn(8, 4, device="meta"), None)
    assert lin.path(3) == ("linear", None)


def test_auto_dtype_comes_from_the_measurement(fresh_tables):
    from specviz.models.loading import resolve_dtype

    for dtype, ms in ((torch.float32, 1.0), (torch.bfloat16, 3.0)):  # bf16 measured slower: float32
        t = kernels.table(dtype)
        t.times["40x30"] = {str(r): {"linear": ms} for r in kernels.ROWS}
    dtype, why = resolve_dtype("auto", torch.device("cpu"), (40, 30))
    assert dtype == torch.float32 and "not faster" in why
    kernels.table(torch.bfloat16).times["40x30"] = {str(r): {"linear": 0.2} for r in kernels.ROWS}
    dtype, why = resolve_dtype("auto", torch.device("cpu"), (40, 30))
    assert dtype == torch.bfloat16 and "0.40 ms against 2.00 ms" in why
    assert resolve_dtype("float32", torch.device("cpu")) == (torch.float32, "as asked")


def test_a_model_on_transformers_forward_is_timed_as_it_runs(pattern_dirs, fresh_tables, monkeypatch):
    """`auto` on a CPU for a model that runs transformers' forward (not the lean one): its forward is timed in both
    dtypes (a one-layer model of its config, once per machine), not specviz's kernels, which it never takes: on an
    AVX2 CPU GPT-2's decoding runs several times slower in bfloat16, GPT-NeoX's faster. The
    timings are kept; the model is priced as layers x (forward - head) + head; a Llama-family model still asks the
    kernel table."""
    from transformers import AutoConfig

    from specviz.models import loading

    cpu = torch.device("cpu")
    (gpt2, _), (llama, _) = pattern_dirs("gpt2"), pattern_dirs("llama")
    monkeypatch.setattr(kernels, "compare_dtypes", lambda *a, **k: pytest.fail("asked specviz's kernels"))
    dtype, why = loading.choose_dtype(str(gpt2), "auto", cpu)
    assert dtype in (torch.float32, torch.bfloat16)
    assert "transformers' forward of gpt2 (3 layers, priced from one)" in why
    cfg = AutoConfig.from_pretrained(gpt2)
    key = next(k.split("|")[1] for k in kernels.profile().read()["forwards"] if "|transformers gpt2 " in k)
    for dt in (torch.float32, torch.bfloat16):  # kept, for both row counts
        assert set(kernels.stored_forwards(dt, key)) == {1, 3}
        assert all(set(c) == {"forward", "head"} for c in kernels.stored_forwards(dt, key).values())
    # a later start reads them: nothing is built or timed again, and the stored numbers decide
    monkeypatch.setattr(loading.AutoModelForCausalLM, "from_config", lambda *a, **k: pytest.fail("timed again"))
    for dt, (forward, head) in ((torch.float32, (2.0, 1.0)), (torch.bfloat16, (2.5, 0.2))):
        for r in (1, 3):
            kernels.keep_forward(dt, key, r, {"forward": forward, "head": head}, None)
    # one layer and its head: bf16 2.5 ms against 2.0; the model's 3 layers: 3 x 2.3 + 0.2 = 7.1 against 4.0 each
    assert loading.compare_forwards(cfg) == (torch.float32, "float32: transformers' forward of gpt2 (3 layers, priced "
                                             "from one) at 1+3 rows costs 8.0 ms against 14.2 ms in bfloat16 on this "
                                             "CPU (bfloat16 is not faster here)")
    for r in (1, 3):
        kernels.keep_forward(torch.bfloat16, key, r, {"forward": 0.5, "head": 0.2}, None)
    assert loading.compare_forwards(cfg)[0] == torch.bfloat16
    assert loading.choose_dtype(str(gpt2), "float32", cpu) == (torch.float32, "as asked")
    if "onednn" in kernels.unavailable(torch.bfloat16):  # no bf16 instructions: said for this forward
        assert "runs transformers' forward" in loading.choose_dtype(str(gpt2), "bfloat16", cpu)[1]
    monkeypatch.setattr(kernels, "compare_dtypes", lambda out, inp, rows, progress=None: (torch.float32, "kernels"))
    assert loading.choose_dtype(str(llama), "auto", cpu) == (torch.float32, "auto: kernels")

FORCED = """
import sys, torch
from specviz.models import kernels
from specviz.models.loading import load_pair
from specviz.core.generator import Settings, generate
pair = load_pair(sys.argv[1], sys.argv[2], device="cpu", dtype=sys.argv[3])
ids = [5, 6, 7, 8, 5, 6]
settings = Settings(gamma=3, max_new_tokens=10, drafter="model", record_top=0)
spec = generate(pair, "", settings, prompt_ids=ids).token_ids
base = generate(pair, "", settings, prompt_ids=ids, mode="baseline").token_ids
t = kernels.table(pair.dtype)
from specviz.models.leanllama import LeanLlama
from specviz.tools.check import one_family
families = all(one_family(lin) for lin in LeanLlama.of(pair.target).linears())
print(kernels.cpu_class(), "|", pair.dtype_reason, "|", sorted(t.skipped), "|", spec == base, "|", families)
"""


@needs_native
@pytest.mark.slow
@pytest.mark.parametrize("cap,aten", [("AVX2", "avx2"), ("AVX512_CORE", "avx512"), ("AVX512_CORE_BF16", "avx512"),
                                      ("AVX512_CORE_AMX", "avx512")])
def test_every_instruction_set_class_decodes_in_both_dtypes(pattern_dirs, tmp_path, cap, aten):
    """This CPU runs another class's kernels under ONEDNN_MAX_CPU_ISA / ATEN_CPU_CAPABILITY caps. A
    oneDNN cap above what the CPU has changes nothing (so it is skipped: the class below runs the same
    kernels); ATen's is only lowered, never raised (ATen obeys it and dies of an illegal instruction
    on a CPU without AVX512). Each class: both dtypes decode, no traceback, speculative = baseline, in bf16
    each product of the target through one family of kernels; under the AVX2 cap bf16 packing is skipped and
    the reason is shown."""
    needs = {"AVX512_CORE": "avx512f", "AVX512_CORE_BF16": "avx512_bf16", "AVX512_CORE_AMX": "amx_bf16"}.get(cap)
    if needs and needs not in kernels._cpu()[1]:
        pytest.skip(f"this CPU has no {needs}: capped to {cap} it runs the class below it, tested here too")
    target, draft = pattern_dirs("llama")
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": cap, "SPECVIZ_CACHE": str(with_our_build(tmp_path)),
           "PYTHONPATH": str(ROOT)}
    if aten == "avx2" or "avx512f" in kernels._cpu()[1]:
        env["ATEN_CPU_CAPABILITY"] = aten
    for dtype in ("float32", "bfloat16"):
        out = subprocess.run([sys.executable, "-c", FORCED, str(target), str(draft), dtype], env=env,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        cls, why, skipped, same, families = out.stdout.strip().splitlines()[-1].split(" | ")
        assert same == "True"
        # bf16: every product of the target through one family of row-invariant kernels at every row count it took
        assert families == "True" or dtype == "float32"
        if cap == "AVX2" and dtype == "bfloat16":
            assert cls.startswith("AVX2") and "onednn" in skipped and "no bf16 matrix instructions" in why
        if cap == "AVX2":  # our AVX-512 kernels are never called there (an illegal instruction kills, not raises)
            assert "'avx512'" in skipped and "'avx512-dot'" in skipped
        if cap == "AVX512_CORE":  # AVX-512 without its bf16 instructions: the pair kernel is not called
            assert "'avx512-dot'" in skipped
        if cap != "AVX512_CORE_AMX":  # below AMX no tile is touched (an illegal instruction kills, not raises)
            assert "'amx'" in skipped
        if cap in ("AVX2", "AVX512_CORE"):  # classes without VNNI: the int8 kernel is not called
            assert "'vnni-int8'" in skipped


@pytest.mark.parametrize("path", [name for name, p in kernels.PATHS.items() if torch.float32 in p.dtypes])
def test_every_registered_path_gives_transformers_logits_at_a_step_and_a_verify(pattern_pair, fresh_tables, path):
    """Each path in the registry, chosen for every shape and row count, decodes what transformers
    computes (float32): a new path is tested by adding its registry line. A lossy one (drafters only)
    leaves the target on an exact path."""
    why = kernels.unavailable(torch.float32).get(path)
    if why:
        pytest.skip(f"{path} does not run on this CPU: {why}")
    pair = pattern_pair("llama")
    lean = _relinked(pair)
    t = kernels.table(torch.float32)
    for lin in lean.linears():
        t.times[kernels.shape_key(lin.weight)] = {str(r): {p: 1.0 if p == path else 2.0 for p in kernels.PATHS}
                                                  for r in kernels.ROWS}
    V, prompt, verify = pair.vocab_size, words(0, 1, 2, 3), words(3, 4, 9)
    state = KVState(pair.target, 1, "static", V, capacity=12)
    try:
        with torch.inference_mode():
            state.prefill([prompt], PAD)
            logits = state.forward(torch.tensor([verify]), torch.ones(1, 3, dtype=torch.bool)).logits[0]
            step = state.forward(torch.tensor([words(5)]), torch.ones(1, 1, dtype=torch.bool)).logits[0, -1]
            full = pair.target(torch.tensor([prompt + verify[1:] + words(5)])).logits[0, -4:, :V].float()
        # a lossy path is never the target's: it takes the fastest exact one; nor is a blocks path (q4, q8) this
        # model's, whose weights are not made of them (tests/test_blocks.py runs those on weights that are)
        kind = kernels.PATHS[path]
        assert lean.head.paths == ({3: "linear", 1: "linear"} if kind.lossy or kind.blocks else {3: path, 1: path})
    finally:
        pair.target.__dict__.pop("_specviz_lean", None)
    torch.testing.assert_close(logits, full[:3], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(step, full[3], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("path", [name for name, p in kernels.PATHS.items()
                                  if torch.bfloat16 in p.dtypes and not p.lossy])  # a lossy one: drafters only
def test_every_bfloat16_path_gives_transformers_logits_within_bfloat16(random_pair, fresh_tables, path):
    """A bfloat16 model through each path that multiplies bfloat16, chosen for every shape and row count:
    a verify's and a step's logits equal the float32 computation of the same bfloat16 weights within
    bfloat16's rounding, as transformers' own bfloat16 forward does."""
    unavailable = kernels.unavailable(torch.bfloat16)
    if why := unavailable.get(path):
        pytest.skip(f"{path} does not run on this CPU: {why}")
    V, prompt, verify = random_pair.vocab_size, words(0, 1, 2, 3), words(3, 4, 6)
    target = copy.deepcopy(random_pair.target).to(torch.bfloat16)
    target.__dict__.pop("_specviz_lean", None)  # the copied float64 one
    t = kernels.table(torch.bfloat16)
    lean = LeanLlama.of(target)
    # a table as tune() makes it: the paths this CPU runs (a layer plan may ask another), but no other family of
    # bits (in bf16 a product keeps to a family where one is timed at every row count, however slow)
    family = ("", kernels.PATHS[path].bits)
    runs = [p for p in kernels.PATHS if p not in unavailable and kernels.PATHS[p].bits in family]
    for lin in lean.linears():
        t.times[kernels.shape_key(lin.weight)] = {str(r): {p: 1.0 if p == path else 2.0 for p in runs}
                                                  for r in kernels.ROWS}
    state = KVState(target, 1, "static", V, capacity=12)
    with torch.inference_mode():
        state.prefill([prompt], PAD)
        logits = state.forward(torch.tensor([verify]), [[True] * 3]).logits[0]
        step = state.forward(torch.tensor([words(5)]), [[True]]).logits[0, -1]
        ids = torch.tensor([prompt + verify[1:] + words(5)])
        exact = target.float()(ids).logits[0, -4:, :V]  # the same bfloat16 weights, in float32
        theirs = target.to(torch.bfloat16)(ids).logits[0, -4:, :V].float()
    assert lean.head.paths == {3: path, 1: path}
    ours = torch.cat([logits, step[None]])
    scale = exact.abs().max()
    assert (ours - exact).abs().max() <= max(2 * (theirs - exact).abs().max(), 0.02 * scale)


def test_a_lossy_path_drafts_only_and_the_output_stays_exact(eagle_pair, fresh_tables, monkeypatch):
    """int8 forced wherever it may go: only the EAGLE head's products take it; greedy tree text equals the
    baseline's, and seeded sampled rows of a batch decode what they decode alone (each row quantized on
    its own: with one scale for all rows, the head's q of a row would depend on the others)."""
    from conftest import seeded_rows_and_single_runs

    if why := kernels.unavailable(torch.float32).get("int8"):
        pytest.skip(f"int8 does not run on this CPU: {why}")
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(0)) * torch.tensor([[1.0], [30.0], [1e-3], [1], [1]])
    w = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    packed = kernels._int8_pack(w, 1)
    together = kernels.PATHS["int8"].run(x, packed, w, None, 5)
    assert torch.equal(together[2:3], kernels.PATHS["int8"].run(x[2:3], packed, w, None, 1))  # alone: the same bits
    assert ((together - x @ w.T).norm(dim=-1) / (x @ w.T).norm(dim=-1)).max() < 0.03  # close, not equal

    pair = eagle_pair("llama")
    head, saved = pair.head, (pair.head._lean, pair.head._lean_linears)
    head._lean = head._lean_linears = None  # Linear modules built anew, planned as given
    _relinked(pair)
    plan_forwards(pair, lambda weight, rows, lossy, in_call: "int8" if lossy else "linear")
    try:
        prompt = words(3, 4, 5, 6, 7)
        tree = Settings(gamma=3, branch=2, nodes=4, drafter="eagle", max_new_tokens=16)
        spec = generate(pair, "", tree, prompt_ids=prompt)
        assert spec.token_ids == generate(pair, "", tree, mode="baseline", prompt_ids=prompt).token_ids
        assert {p for lin in head.lean_linears().values() for p in lin.paths.values()} == {"int8"}
        assert "int8" not in {p for lin in LeanLlama.of(pair.target).linears() for p in lin.paths.values()}
        sampled = Settings(gamma=2, branch=2, nodes=3, drafter="eagle", temperature=1.0, max_new_tokens=12)
        rows, alone = seeded_rows_and_single_runs(pair, prompt, sampled, seeds=[1, 2, 3])
        assert rows == alone
    finally:
        head._lean, head._lean_linears = saved
        pair.target.__dict__.pop("_specviz_lean", None)


@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16])
def test_our_avx2_kernel_multiplies_exactly_and_each_row_alone(fresh_tables, weights):
    """gemm_avx2.c against float64 for every row count up to 13 (passes of 1-6 rows), a width that is
    not a multiple of its 16-column blocks, and a bias; a row's numbers are bitwise the same alone and
    among others (each output is one k-ordered chain of FMAs), so a batch row drafts and verifies what it
    would alone. Weights packed as bfloat16 (the drafters' "avx2-bf16") give the product of the weights
    rounded to bfloat16, summed in float32: nothing else is lost."""
    from specviz.models import native

    if why := kernels.unavailable(torch.float32).get("avx2"):
        pytest.skip(f"our kernel does not run here: {why}")
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(37, 70, generator=gen), torch.randn(37, generator=gen)
    x = torch.randn(13, 70, generator=gen)
    packed = native.pack(w, weights)
    order = list(native.UNPACK_ORDER) if weights == torch.bfloat16 else list(range(16))  # AVX2 unpacks bf16
    assert packed.shape == (3, 70, 16) and packed.dtype == weights
    assert torch.equal(packed[1], w[16:32][order].T.to(weights))  # block 1: columns 16-31, in `order`
    padding = torch.tensor(order) >= 5  # the last block: columns 32-36, then zeros
    assert not packed[2][:, padding].any() and packed[2][:, ~padding].all()
    product = native.bind(packed, w, b)
    alone = torch.cat([product(x[i:i + 1]) for i in range(13)])
    rounded = w.to(weights).double()  # what the kernel multiplies by
    torch.testing.assert_close(alone.double(), x.double() @ rounded.T + b.double(), rtol=1e-5, atol=1e-5)
    if weights == torch.bfloat16:  # and it is not the float32 product: the test would see a lost rounding
        assert (alone.double() - (x.double() @ w.double().T + b.double())).abs().max() > 1e-3
    for rows in range(2, 14):
        together = product(x[:rows].view(1, rows, 70))
        assert together.shape == (1, rows, 37) and torch.equal(together[0], alone[:rows]), rows
    if "avx512" not in kernels.unavailable(torch.float32):  # the same chains of FMAs in wider registers
        wide = native.pack(w, weights, avx512=True)  # bf16 in column order: one widening takes all 16
        for rows in (1, 3, 6, 7, 12, 13):
            assert torch.equal(native.bind(wide, w, b, avx512=True)(x[:rows]), alone[:rows]), rows


@pytest.mark.parametrize("path", ["avx512-dot", "amx"])
def test_the_pair_kernels_multiply_bfloat16_and_each_row_alone(fresh_tables, path):
    """The AVX512-BF16 kernel of a bfloat16 model (pairs of k per instruction) and the AMX one on the same packed
    weights: against float64 of the same bfloat16 numbers, within the sum's float32 and the output's bfloat16
    roundings, for every row count up to 40 (passes of 1-6 rows; AMX tiles of up to 16), an odd k (AMX: one that
    is not a multiple of its 32) and a width that is not a multiple of 16 or 64; a row's numbers are bitwise the
    same alone and among others."""
    from specviz.models import native

    if why := kernels.unavailable(torch.bfloat16).get(path):
        pytest.skip(f"the {path} kernel does not run here: {why}")
    k = 71
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(101, k, generator=gen).bfloat16(), torch.randn(101, generator=gen).bfloat16()
    x = torch.randn(40, k, generator=gen).bfloat16()
    packed = kernels.PATHS[path].pack(w, 1)  # 2 groups of 64 columns, the second 37 real ones; pairs of k
    pairs = 48 if path == "amx" else 36  # k padded to 96 (AMX) or 72
    assert packed.shape == (2, pairs, 64, 2) and not packed[1, :, 37:].any() and not packed[:, 35:, :, 1].any()
    product = native.bind_pairs(packed, w, b, amx=path == "amx")
    alone = torch.cat([product(x[i:i + 1]) for i in range(40)])
    exact = x.double() @ w.double().T + b.double()
    assert alone.dtype == torch.bfloat16
    torch.testing.assert_close(alone.double(), exact, rtol=8e-3, atol=8e-3)
    for rows in range(2, 41):
        together = product(x[:rows].view(1, rows, k))
        assert together.shape == (1, rows, 101) and torch.equal(together[0], alone[:rows]), rows


def test_the_int8_kernel_is_its_quantization_and_each_row_alone(fresh_tables):
    """specviz's int8 kernel for bfloat16 drafters (AVX512-VNNI) computes what its quantization defines: weights
    int8 per output column, each input row quantized alone to 8 bits (to nearest even), the integer sums exact, then
    scaled (+ bias, fused with the last product) and rounded to bfloat16: against those integers summed in float64,
    bitwise without a bias and at most one bfloat16 step apart with one, and within int8's error of the float64 product;
    every row count up to 14 (passes of 1-6 rows), a k that is not a multiple of 4, a width that is not a multiple of
    64, rows of zeros and of very different sizes; a row's numbers the same alone and among others."""
    from specviz.models import native

    if why := kernels.unavailable(torch.bfloat16).get("vnni-int8"):
        pytest.skip(f"the int8 kernel does not run here: {why}")
    gen = torch.Generator().manual_seed(0)
    k, n = 75, 101
    w, b = torch.randn(n, k, generator=gen).bfloat16(), torch.randn(n, generator=gen)
    x = (torch.randn(14, k, generator=gen) * torch.logspace(-3, 2, 14)[:, None]).bfloat16()
    x[5] = 0
    packed = kernels.PATHS["vnni-int8"].pack(w, 1)
    assert packed.dtype == torch.uint8 and packed.numel() == 128 * 8 + 2 * 19 * 64 * 4  # header, 2 groups, 19 quads
    product = native.bind_quads(packed, w, b)
    alone = torch.cat([product(x[i : i + 1]) for i in range(14)])
    wf, xf = w.float(), x.float()
    scale = wf.abs().amax(1) / 127
    q = (wf / scale[:, None]).round().clamp(-127, 127)
    top = xf.abs().amax(1)
    up = torch.where(top > 0, torch.full_like(top, 127.0) / top, 0)  # (`127 / top` is 127 times a reciprocal)
    u = (xf * up[:, None]).round().clamp(-127, 127)
    want = ((u.double() @ q.double().T).float() * (top / 127)[:, None] * scale + b).bfloat16()
    steps = (alone.view(torch.int16).int() - want.view(torch.int16).int()).abs()
    assert steps.max() <= 1 and (steps == 0).float().mean() > 0.99
    assert torch.equal(alone[5], b.bfloat16())  # a row of zeros: the bias alone
    exact, plain = x.double() @ w.double().T, native.bind_quads(packed, w, None)(x)
    assert torch.equal(plain, ((u.double() @ q.double().T).float() * (top / 127)[:, None] * scale).bfloat16())
    plain = plain.double()  # rows of any size: within a few %
    assert ((plain - exact).norm(dim=-1) / exact.norm(dim=-1).clamp_min(1e-30)).max() < 0.03
    for rows in range(2, 15):
        together = product(x[:rows].view(1, rows, k))
        assert together.shape == (1, rows, n) and torch.equal(together[0], alone[:rows]), rows


def test_the_avx2_int8_kernel_is_its_quantization_and_each_row_alone(fresh_tables):
    """specviz's int8 kernel for float32 drafters on AVX2 (gemm_int8.c) computes what the VNNI kernel's quantization
    defines, in float32: weights int8 per output column, each row quantized alone (to nearest even), the integer
    sums exact (VPMADDUBSW on |u| and q with u's sign never saturates), then scaled: bitwise without a bias, within
    float32's rounding of the fused bias with one, within int8's error of the float64 product; every row count up to
    14, a k that is not a multiple of 4, a width that is not a multiple of 8 or 64, rows of zeros, of very different
    sizes and of extreme bytes (|u| = 127 throughout, the largest pair sums); a row's numbers the same alone."""
    from specviz.models import native

    if why := kernels.unavailable(torch.float32).get("avx2-int8"):
        pytest.skip(f"the int8 kernel does not run here: {why}")
    gen = torch.Generator().manual_seed(0)
    k, n = 75, 101
    w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    w[3] = w[3].sign() * w[3].abs().max()  # every q of column 3 is ±127
    x = torch.randn(14, k, generator=gen) * torch.logspace(-3, 2, 14)[:, None]
    x[5], x[7] = 0, -1.0  # a row of zeros; a row whose every u is -127
    packed = kernels.PATHS["avx2-int8"].pack(w, 1)
    assert packed.dtype == torch.uint8 and packed.numel() == 128 * 8 + 2 * 19 * 64 * 4  # header, 2 groups, 19 quads
    product = native.bind_quads(packed, w, b, torch.float32)
    alone = torch.cat([product(x[i : i + 1]) for i in range(14)])
    scale = w.abs().amax(1) / 127
    q = (w / scale[:, None]).round().clamp(-127, 127)
    top = x.abs().amax(1)
    up = torch.where(top > 0, torch.full_like(top, 127.0) / top, 0)
    u = (x * up[:, None]).round().clamp(-127, 127)
    sums = (u.double() @ q.double().T).float()
    plain = native.bind_quads(packed, w, None, torch.float32)(x)
    assert torch.equal(plain, sums * (top / 127)[:, None] * scale)
    assert torch.allclose(alone, sums * (top / 127)[:, None] * scale + b, rtol=1e-6, atol=1e-6)
    assert torch.equal(alone[5], b)  # a row of zeros: the bias alone
    exact = x.double() @ w.double().T
    assert ((plain.double() - exact).norm(dim=-1) / exact.norm(dim=-1).clamp_min(1e-30)).max() < 0.03
    for rows in range(2, 15):
        together = product(x[:rows].view(1, rows, k))
        assert together.shape == (1, rows, n) and torch.equal(together[0], alone[:rows]), rows


def test_the_float32_rms_call_is_rmsnorm_within_rounding():
    """native.rms_f32 (the EAGLE head's norms in float32): transformers' RMSNorm formula to float32's rounding (the
    sum of squares in another order), rows of very different sizes, an odd width, a batch; other dtypes refused."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from specviz.models import native

    if not native.runs_here():
        pytest.skip("specviz's library does not run here")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 75, generator=gen) * torch.logspace(-4, 3, 5)[None, :, None]
    norm = LlamaRMSNorm(75, eps=1e-5)
    norm.weight.data = torch.randn(75, generator=gen)
    with torch.no_grad():
        want = norm(x)
    got = native.rms_f32(x, norm.weight.data, 1e-5)
    assert got.shape == x.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-7)
    with pytest.raises(TypeError, match="float32 rows"):
        native.rms_f32(x.bfloat16(), norm.weight.data, 1e-5)


def test_the_rms_call_is_transformers_rmsnorm(monkeypatch):
    """leanllama.rms_norm on bfloat16 rows (one C call where the library runs) against transformers'
    LlamaRMSNorm: the same roundings, so at most one bfloat16 step apart where the sum of squares, taken in
    another order, lands on the other side of a rounding; rows of very different sizes, an odd width, a
    batch. Where gradients flow, or the library does not run here, it is transformers' formula exactly."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from specviz.models import native
    from specviz.models.leanllama import rms_norm

    gen = torch.Generator().manual_seed(0)
    norm = LlamaRMSNorm(77, eps=1e-5)
    norm.weight.data = (torch.rand(77, generator=gen) + 0.5)
    norm = norm.to(torch.bfloat16)
    x = (torch.randn(2, 9, 77, generator=gen) * torch.logspace(-3, 3, 9)[:, None]).bfloat16()
    with torch.inference_mode():
        want = norm(x)
        got = rms_norm(x, norm.weight, 1e-5)
        assert got.shape == want.shape and got.dtype == torch.bfloat16
        steps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
        assert steps.max() <= 1 and (steps == 0).float().mean() > 0.99
        many = x.repeat(5, 1, 1).view(90, 77)
        for share in (True, False):  # the rows shared among threads or on one: the same bits
            assert torch.equal(rms_norm(many, norm.weight, 1e-5, share), got.repeat(5, 1, 1).view(90, 77))
        for row in (0, 4, 8):  # a row alone (on the calling thread) as among others
            assert torch.equal(rms_norm(x[1, row : row + 1], norm.weight, 1e-5), got[1, row : row + 1])
        if native.runs_here():  # one call, not torch's operations (which would give transformers' bits exactly)
            calls = []
            monkeypatch.setattr(native, "rms_bf16", lambda *a: calls.append(a) or want)
            rms_norm(x, norm.weight, 1e-5)
            assert len(calls) == 1
            monkeypatch.undo()
        monkeypatch.setattr(native, "runs_here", lambda: False)
        assert torch.equal(rms_norm(x, norm.weight, 1e-5), want)
    monkeypatch.undo()
    with torch.enable_grad():
        assert torch.equal(rms_norm(x, norm.weight, 1e-5), norm(x))


@needs_native
def test_our_kernel_is_skipped_without_a_compiler_and_built_once(fresh_tables, monkeypatch):
    """No C compiler: the path is skipped with the reason, and models take the others. With one, the
    library is compiled once into the cache folder and later loads find it there."""
    from specviz.models import native

    if torch.backends.cpu.get_cpu_capability().lower() not in ("avx2", "avx512"):
        pytest.skip("this CPU runs no AVX2 kernels")
    unbuilt = fresh_tables / "unbuilt"  # fresh_tables links this run's build in: a folder without it
    monkeypatch.setenv("SPECVIZ_CACHE", str(unbuilt))
    compiler = native._compiler
    native.library.cache_clear()
    monkeypatch.setattr(native, "_compiler", lambda: (_ for _ in ()).throw(RuntimeError("no C compiler found")))
    assert "no C compiler found" in kernels.unavailable(torch.float32)["avx2"]
    assert "no C compiler found" in kernels.unavailable(torch.float32)["q4"]  # the blocks' kernels too: float32
    from specviz.models.leanllama import Linear

    weight = native.as_q4_1(torch.randn(32, 64))  # a GGUF layer's weight: a library's path takes it
    kernels.tune([weight])
    lin, x = Linear(weight, None), torch.randn(2, 64)
    assert not kernels.PATHS[lin.path(2)[0]].bits and not lin.keep_blocks()
    torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, weight))
    monkeypatch.setattr(native, "_compiler", compiler)
    native.library.cache_clear()
    said = []
    built = native.build(said.append)
    assert built.parent == unbuilt / "kernels" and built.name.startswith("gemm-avx2-")
    assert said[0].startswith("compiling specviz's C kernels") and said[-1].startswith("  compiled in")
    calls = []
    monkeypatch.setattr(native, "_compiler", lambda: calls.append(1) or "cc")
    assert native.build(said.append) == built and not calls and "avx2" not in kernels.unavailable(torch.float32)
    assert len(said) == 2  # found built: nothing said

    # a compile that fails is not tried again in the same process (a start would otherwise wait for it twice)
    failing = fresh_tables / "failing-cc"
    failing.write_text(f"#!/bin/sh\necho run >> {fresh_tables / 'runs'}\necho 'error: no such flag' >&2\nexit 1\n")
    failing.chmod(0o755)
    monkeypatch.setattr(native, "_compiler", lambda: str(failing))
    monkeypatch.setenv("SPECVIZ_CACHE", str(fresh_tables / "failed"))
    native.prepare(said.append)  # says it compiles; the failure is library()'s to report
    assert said[-1].startswith("compiling specviz's C kernels with failing-cc")
    with pytest.raises(RuntimeError, match="failing-cc failed: error: no such flag"):
        native.build()
    assert (fresh_tables / "runs").read_text() == "run\n"


@needs_native
def test_without_avx2_our_kernel_is_skipped_and_decoding_runs(pattern_dirs, tmp_path):
    """ATen capped below AVX2 (a CPU without it, as far as our kernel can tell): the path is skipped with
    the reason, float32 decodes on the others, speculative = baseline."""
    target, draft = pattern_dirs("llama")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "SPECVIZ_CACHE": str(tmp_path), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", FORCED + "print(t.skipped.get('avx2'))", str(target), str(draft),
                          "float32"], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    verdict, why = out.stdout.strip().splitlines()[-2:]
    _, _, skipped, same, _ = verdict.split(" | ")
    assert "'avx2'" in skipped and same == "True"
    assert "needs AVX2 and FMA" in why


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_speculation_decodes_the_plain_tokens_where_every_sum_is_row_invariant(random_pair, fresh_tables, monkeypatch,
                                                                               dtype):
    """bf16 and float32 on a CPU with every product forced through specviz's AVX2 kernel (a row's numbers alone,
    at any row count) and attention through its C kernel (a query's numbers from the keys it sees, wherever they
    lie; in float32 inside the layers' one C call): greedy chains and trees decode plain decoding's tokens with the
    same p bit for bit, and batch rows their numbers alone, on an untrained pair whose logits lie close (near
    ties everywhere). With ATen's attention it fails (checked)."""
    import dataclasses

    from specviz.core.generator import generate_batch
    from specviz.models import native
    from specviz.models.eagle import EagleHead, HeadConfig
    from specviz.models.loading import load_pair
    from specviz.tools import check
    from specviz.tools.cli import _bit_for_bit

    if not native.runs_here():
        pytest.skip("specviz's C functions do not run here")
    def avx2(weight, rows, lossy, in_call):
        return "avx2"

    pair = load_pair(random_pair.target.config._name_or_path, random_pair.draft.config._name_or_path,
                     device="cpu", dtype=dtype, choose=avx2)
    torch.manual_seed(0)
    head = EagleHead(HeadConfig.for_target(pair.target, words(0, 1, 2, 5, 6), pair.vocab_size, 16))
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.3)
    pair = dataclasses.replace(pair, head=head.to(dtype).bind(pair.target, pair.vocab_size), head_name="r")
    plan_forwards(pair, avx2)

    def ps(run):  # the target's p of each emitted token, in text order
        return [t.p for t in run.records()]

    prompts = [words(1, 2, 3, 4), words(5, 5, 6), words(7, 0, 1, 2, 3, 4, 5)]
    for settings in (Settings(drafter="model", gamma=3, max_new_tokens=24, record_top=0),
                     Settings(drafter="lookup+eagle", gamma=2, max_new_tokens=24, record_top=0),
                     Settings(drafter="eagle", gamma=3, branch=2, nodes=4, max_new_tokens=24, record_top=0)):
        alone = [generate(pair, "", settings, prompt_ids=p) for p in prompts]
        plain = [generate(pair, "", settings, mode="baseline", prompt_ids=p) for p in prompts]
        assert [r.token_ids for r in alone] == [r.token_ids for r in plain]
        assert [ps(r) for r in alone] == [ps(r) for r in plain]  # the same bits, not only the same argmax
        batch = generate_batch(pair, [""] * 3, settings, prompts_ids=prompts)
        assert [ps(r) for r in batch] == [ps(r) for r in alone]
        for cache in ("dynamic", "none"):  # the same forward over other storage: a grown cache, the text again
            other = [generate(pair, "", dataclasses.replace(settings, cache=cache), prompt_ids=p) for p in prompts]
            assert [ps(r) for r in other] == [ps(r) for r in alone]
    lean = LeanLlama.of(pair.target)
    assert {p for lin in lean.linears() for p in lin.paths.values()} == {"avx2"}
    # the layers ran in one call at every row count (bf16: `avx2` widening its numbers to float32 there)
    assert lean.native_plans and all(lean.native_plans.values())
    # what `specviz check` reads off the run: every row computed alone here, not with another cache or product
    static, dynamic, compiled = (check.Case("eagle", 3, 2, 4, cache, comp, 0.0)
                                 for cache, comp in (("static", False), ("dynamic", False), ("static", True)))
    assert check.row_alone(pair, static) and check.row_alone(pair, dynamic) and not check.row_alone(pair, compiled)
    assert _bit_for_bit(pair).startswith("bit for bit: yes")  # what `specviz kernels` says
    monkeypatch.setitem(lean.head.paths, 7, "linear")  # ATen's product at one more row count
    assert not check.row_alone(pair, static)
    said = _bit_for_bit(pair)
    assert said.startswith("bit for bit: no") and f"{kernels.shape_key(lean.head.weight)} takes " in said
    assert "linear at 7 rows" in said


def test_silu_times_up_in_one_call_is_atens(monkeypatch):
    """native.silu_mul_bf16 (a bf16 layer's MLP on a CPU): SiLU(gate) * up of a fused projection's output, bitwise
    ATen's F.silu(gate) * up for every one of the 65,536 bfloat16 gates (NaN where ATen's is NaN), 8 x 16 rows
    (shared among threads or on one), 2 x 2 rows, and a row alone as among others."""
    from specviz.models import native

    if not native.runs_here():
        pytest.skip("specviz's C functions do not run here")
    gen = torch.Generator().manual_seed(0)
    bits = torch.arange(65536, dtype=torch.int32)
    gate = torch.where(bits < 32768, bits, bits - 65536).to(torch.int16).view(torch.bfloat16).view(2, 2, 16384)
    up = (torch.randn(2, 2, 16384, generator=gen) * 4).bfloat16()
    got = native.silu_mul_bf16(torch.cat([gate, up], -1))
    assert got.shape == (2, 2, 16384) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got, torch.nn.functional.silu(gate) * up, rtol=0, atol=0, equal_nan=True)
    gate, up = gate.reshape(8, 16, 512), up.reshape(8, 16, 512)
    for share in (True, False):
        got = native.silu_mul_bf16(torch.cat([gate, up], -1), share)
        torch.testing.assert_close(got, torch.nn.functional.silu(gate) * up, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(native.silu_mul_bf16(torch.cat([gate, up], -1)[3, 5:6]), got[3, 5:6])
    with pytest.raises(TypeError):
        native.silu_mul_bf16(up.float())


def test_the_c_argmax_is_torchs():
    """native.argmax (a greedy round's argmax over the vocabulary): torch.argmax's index for rows of every length
    around the 8 lanes, with ties (the first), all -inf, signed zeros, +inf, and NaN (the first NaN); other dtypes
    and layouts go to torch."""
    from specviz.models import native

    if not native.runs_here():
        pytest.skip("specviz's C functions do not run here")
    gen = torch.Generator().manual_seed(0)
    for n in (1, 7, 8, 9, 17, 49152 + 5):
        x = torch.randn(3, n, generator=gen)
        def filled(base, columns, value):
            return base.index_fill(1, torch.tensor(columns), value)

        cases = [x, (x * 2).round(), torch.full((3, n), -math.inf), filled(torch.zeros(3, n), [*range(0, n, 2)], -0.0),
                 filled(x, [n - 1], math.inf), filled(x, [n // 2, n - 1], math.nan),
                 filled(x, [n - 1, max(n - 2, 0)], 9.0)]
        for case in cases:
            got = native.argmax(case)
            assert got.dtype == torch.long and torch.equal(got, case.argmax(-1)), (n, case)
    assert torch.equal(native.argmax(x[None]), x.argmax(-1)[None])  # [1, 3, n]: a verify's [B, width, V]
    assert torch.equal(native.argmax(x.T), x.T.argmax(-1)) and torch.equal(native.argmax(x.double()), x.argmax(-1))


def test_the_c_topk_is_torchs():
    """native.topk (the inspector's candidates): torch.topk's values, largest first, for rows of every length around
    the 8 lanes and k up to 64, and its indices, where torch leaves ties open the first of equal values first; a
    NaN ranks above every number, as in torch; rows a stride apart (a slice of wider rows); other dtypes, shapes and
    a k past 64 go to torch."""
    from specviz.models import native

    if not native.runs_here():
        pytest.skip("specviz's C functions do not run here")
    gen = torch.Generator().manual_seed(0)
    for n in (1, 7, 8, 9, 17, 49152 + 5):
        x = torch.randn(3, n, generator=gen)
        for k in sorted({1, min(8, n), min(n, 64)}):
            values, index = native.topk(x, k)
            assert torch.equal(values, torch.topk(x, k).values) and torch.equal(x.gather(1, index), values), (n, k)
            assert all(len(set(row)) == k for row in index.tolist())
            tied = (x * 2).round().clamp(-2, 2)  # five values over n columns: ties everywhere
            values, index = native.topk(tied, k)
            order = sorted(range(n), key=lambda j: -tied[0, j].item())[:k]  # a stable sort: the first index first
            assert torch.equal(values, torch.topk(tied, k).values) and index[0].tolist() == order, (n, k)
    row = torch.tensor([[1.0, math.nan, 3.0, -math.inf, 3.0, math.nan, 0.5, 2.0, 9.0, -0.0]])
    values, index = native.topk(row, 5)
    assert index.tolist() == [[1, 5, 8, 2, 4]] and values[0, 2:].tolist() == [9.0, 3.0, 3.0]
    wide = torch.randn(4, 8193, generator=gen)
    narrow = wide[:, :-1]  # rows 8,193 apart
    assert torch.equal(native.topk(narrow, 8)[1], torch.topk(narrow, 8).indices)
    assert torch.equal(native.topk(wide.double(), 3)[1], torch.topk(wide.double(), 3).indices)
    assert torch.equal(native.topk(wide, 65)[0], torch.topk(wide, 65).values)


@pytest.mark.parametrize("path", ["avx512-dot", "avx512", "avx2"])
def test_the_layers_in_one_call_give_the_layer_by_layer_bits(random_pair, fresh_tables, monkeypatch, tmp_path, path):
    """bf16 on a CPU where every product of the layers takes one path with a C function for bf16 models (the pair
    kernel of AVX512-BF16 CPUs, or the FMA kernels, which widen a bf16 model's numbers to float32, as on AVX2
    CPUs): the layers run as one C call (native.layers) and give the layer-by-layer path's bits (logits, hidden
    states, every cache) at a prefill of two rows of different lengths, a one-token step and a tree verify, with
    biases on the attention's products too. One layer's product on another path sends the whole forward layer by
    layer."""
    from transformers import AutoModelForCausalLM

    from specviz.core.kvcache import Tree

    if why := kernels.unavailable(torch.bfloat16).get(path):
        pytest.skip(f"{path} does not run here: {why}")
    config = copy.deepcopy(random_pair.target.config)
    config.attention_bias = True
    torch.manual_seed(0)
    biased = AutoModelForCausalLM.from_config(config)
    for name, p in biased.named_parameters():
        torch.nn.init.normal_(p, std=0.3 if name.endswith("bias") else 0.2)
    biased.save_pretrained(tmp_path / "biased")
    models = [AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
              for path in (random_pair.target.config._name_or_path, tmp_path / "biased")]
    native_weights = LeanLlama.native_weights
    vocab = random_pair.vocab_size

    def run(model, native: bool):
        monkeypatch.setattr(LeanLlama, "native_weights", native_weights if native else lambda self, rows: None)
        state = KVState(model, 2, "static", vocab, 32)
        outs = [state.prefill([words(1, 2, 3, 4, 5), words(6, 7)], PAD, hidden=True).hidden]
        step = state.forward(torch.tensor([[word_id(1)], [word_id(2)]]), [[True], [True]], hidden=True)
        tree = Tree.of([[-1, 0, 0, 1], [-1, 0]], 5, torch.device("cpu"))
        verify = state.forward(torch.tensor([words(3, 4, 5, 6, 7), words(1, 2, 0, 0, 0)]),
                               [[True] * 5, [True] * 3 + [False] * 2], hidden=True, tree=tree)
        return outs + [step.logits, step.hidden, verify.logits, verify.hidden, state.backend.stack.clone()]

    for model in models:
        lean = LeanLlama.of(model)
        for lin in lean.linears():
            lin.plan(lambda weight, rows, lossy, in_call: path)
        with torch.inference_mode():
            fused, layered = run(model, True), run(model, False)
            monkeypatch.setitem(lean.shared_rows, 2 * 5, not lean.shared_rows[2 * 5])
            flipped = run(model, True)  # the verify's rows shared among threads or on one: the same bits
        assert set(lean.native_plans) >= {1 * 2, 5 * 2} and all(lean.native_plans.values())
        for a, b, c in zip(fused, layered, flipped, strict=True):
            assert torch.equal(a, b) and torch.equal(a, c)
    assert models[1].model.layers[0].self_attn.o_proj.bias is not None
    lean.native_plans.clear()
    monkeypatch.setattr(LeanLlama, "native_weights", native_weights)
    monkeypatch.setitem(lean.layers[-1].down.paths, 2, "linear")  # its fastest path at 2 rows has no C function
    # as if timed: op by op faster, with the rows on one thread
    kernels.keep_forward(torch.bfloat16, lean.forwards_key(), 2,
                         {"one call": 2.0, "per op": 1.5, "one call, rows alone": 2.0, "per op, rows alone": 1.0}, None)
    assert lean.native_weights(2) is None and lean.native_weights(10) is not None and not lean.shared_rows[2]
    kernels.keep_forward(torch.bfloat16, lean.forwards_key(), 2,
                         {"one call": 1.0, "per op": 2.0, "one call, rows alone": 1.5, "per op, rows alone": 2.0}, None)
    lean.native_plans.clear()  # one call (through the path's C function) faster, the rows shared
    assert lean.native_weights(2) is not None and lean.layers[-1].down.call_paths[2] == path and lean.shared_rows[2]


@pytest.mark.parametrize("path", ["avx512-dot", "avx2", "vnni-int8"])
def test_the_eagle_heads_layer_in_one_call_drafts_the_layer_by_layer_bits(random_pair, fresh_tables, monkeypatch,
                                                                       path):
    """The EAGLE head's layer through native.layers (its cache in the target's layout, a slot per row and
    entry) drafts what the layer-by-layer step drafts, bit for bit: every drafted token and its q, for trees and
    chains, greedy and sampled, a batch of rows of different lengths; a bf16 head on the pair kernel, on the AVX2
    kernel, which widens its numbers, or on the int8 kernel (a drafter's lossy path)."""
    import dataclasses

    from specviz.core.generator import generate_batch
    from specviz.models.eagle import EagleHead, HeadConfig
    from specviz.models.loading import load_pair

    if why := kernels.unavailable(torch.bfloat16).get(path):
        pytest.skip(f"{path} does not run here: {why}")
    def fixed(weight, rows, lossy, in_call):
        return path

    pair = load_pair(random_pair.target.config._name_or_path, random_pair.draft.config._name_or_path,
                     device="cpu", dtype=torch.bfloat16, choose=fixed)
    torch.manual_seed(0)
    head = EagleHead(HeadConfig.for_target(pair.target, words(0, 1, 2, 5, 6), pair.vocab_size, 16))
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.3)
    head = head.to(torch.bfloat16).bind(pair.target, pair.vocab_size)
    pair = dataclasses.replace(pair, head=head, head_name="r")
    plan_forwards(pair, fixed)
    native_weights = EagleHead.native_weights
    prompts = [words(1, 2, 3, 4), words(5, 6), words(7, 0, 1, 2, 3, 4, 5)]

    def drafts(native: bool):
        monkeypatch.setattr(EagleHead, "native_weights", native_weights if native else lambda self, rows: None)
        out = []
        for settings in (Settings(drafter="eagle", gamma=3, branch=2, nodes=4, max_new_tokens=16, record_top=0),
                         Settings(drafter="eagle", gamma=2, max_new_tokens=16, temperature=1.0, record_top=0)):
            for run in generate_batch(pair, [""] * 3, settings, prompts_ids=prompts):
                out.append([(t.id, t.q, t.p) for e in run.events for t in e.drafted])
        return out

    fused, layered = drafts(True), drafts(False)
    assert fused == layered and sum(map(len, fused)) > 50
    assert head._native_plans and all(head._native_plans.values())


def test_float32_layers_in_one_call_are_within_rounding_and_row_alone(random_pair, fresh_tables, monkeypatch):
    """float32 on a CPU where every product of the layers takes specviz's own kernel: the layers run as one C call
    (native.layers, with float32 RMSNorm, RoPE, attention and SiLU of its own), within rounding of the
    layer-by-layer path (ATen's operations between the products); and a row's numbers never depend on the rows
    beside it: each row of a 3-token verify gets the bits of a one-token step, a batch row the bits it gets alone,
    with the AVX2 kernel and the AVX-512 one alike (the same bits). A product on ATen's path sends the forward layer
    by layer."""
    from transformers import AutoModelForCausalLM

    runs = [name for name in ("avx2", "avx512") if name not in kernels.unavailable(torch.float32)]
    if not runs:
        pytest.skip("specviz's float32 kernels do not run here")
    model = AutoModelForCausalLM.from_pretrained(random_pair.target.config._name_or_path, dtype=torch.float32)
    lean, vocab = LeanLlama.of(model), random_pair.vocab_size
    native_weights = LeanLlama.native_weights
    prompts, steps = [words(1, 2, 3, 4, 5), words(6, 7)], [words(3, 4, 5), words(0, 1, 2)]

    def run(native: bool, prompts: list[list[int]], width: int) -> list[torch.Tensor]:
        """Logits of `steps` fed `width` tokens a forward after the prompts, then the whole cache stack."""
        monkeypatch.setattr(LeanLlama, "native_weights", native_weights if native else lambda self, rows: None)
        state = KVState(model, len(prompts), "static", vocab, 32)
        out = [state.prefill(prompts, PAD).logits[:, -1]]
        rows = steps[-len(prompts):]
        for i in range(0, 3, width):
            tokens = torch.tensor([row[i : i + width] for row in rows])
            out += state.forward(tokens, [[True] * width] * len(prompts)).logits.unbind(1)
        return out + [state.backend.stack[:, :, :, : len(prompts[0]) + 3].clone()]

    results = {}
    with torch.inference_mode():
        for name in runs:
            for lin in lean.linears():  # every product on this path: a plan given, not a table patched
                lin.plan(dict.fromkeys(CLASSES, name))
            lean.native_plans.clear()
            results[name] = fused = run(True, prompts, 3)
            assert 2 * 3 in lean.native_plans and all(lean.native_plans.values())
            for a, b in zip(fused, run(False, prompts, 3), strict=True):
                torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5 * b.abs().max().item())
            for a, b in zip(fused, run(True, prompts, 1), strict=True):  # a verify row = a one-token step
                assert torch.equal(a, b)
            for share in (True, False):  # the row-by-row functions' rows shared among threads or on one
                monkeypatch.setitem(lean.shared_rows, 2 * 3, share)
                assert all(torch.equal(a, b) for a, b in zip(fused, run(True, prompts, 3), strict=True))
            alone = run(True, prompts[1:], 1)  # the second row alone (its prompt unpadded)
            for a, b in zip(fused[:-1], alone[:-1], strict=True):
                assert torch.equal(a[1:], b)
    if len(results) == 2:  # where AVX-512 runs: both kernels, the same bits
        assert all(torch.equal(a, b) for a, b in zip(*results.values(), strict=True))
    monkeypatch.setattr(LeanLlama, "native_weights", native_weights)
    lean.native_plans.clear()
    monkeypatch.setitem(lean.layers[0].qkv.paths, 2, "linear")
    monkeypatch.setitem(lean.layers[0].qkv.call_paths, 2, "linear")  # and no path with a C function either
    assert lean.native_weights(2) is None and lean.native_weights(3) is not None


def test_one_call_or_op_by_op_is_timed_once_per_machine_and_kept(random_pair, fresh_tables, monkeypatch):
    """Where one product's fastest path at a row count has no C function, the layers run in one call through
    each product's fastest path that has one only if that forward timed faster than op by op: timed once, at
    the kernel table's row count for it, kept in the table's file beside what another process stored there, and
    read back by a later start (which times nothing)."""
    from transformers import AutoModelForCausalLM

    if "avx2" in kernels.unavailable(torch.float32):
        pytest.skip("specviz's float32 kernels do not run here")
    # the fastest path has no C function at 2 rows (ATen's), the fastest that has one is `avx2`
    model = AutoModelForCausalLM.from_pretrained(random_pair.target.config._name_or_path, dtype=torch.float32)
    lean = LeanLlama.of(model)
    for lin in lean.linears():
        lin.plan(lambda weight, rows, lossy, in_call: "avx2" if in_call or rows != 2 else "linear")
    timed = []
    forward = LeanLlama.forward
    monkeypatch.setattr(LeanLlama, "forward", lambda self, *a, **k: timed.append(a[0].shape) or forward(self, *a, **k))
    with torch.inference_mode():
        assert lean.native_weights(1) is not None and not timed  # every fastest path has a C function
        theirs = {"ms": {"one call": 1.0, "per op": 2.0}, "busy": None}  # another process stores its own meanwhile
        kernels.profile().update({"forwards": {"float32|another model|4": theirs}})
        plan = lean.native_weights(2)
    ms = kernels.stored_forward(torch.float32, lean.forwards_key(), 2)
    # op by op in float32 runs no row-by-row C function: no way of it with the rows alone
    assert set(ms) == {"one call", "per op", "one call, rows alone"} and all(t > 0 for t in ms.values())
    assert (plan is not None) == (min(ms["one call"], ms["one call, rows alone"]) <= ms["per op"])
    assert lean.shared_rows[2] == (ms["one call"] <= ms["one call, rows alone"] or plan is None)
    assert set(timed) == {(1, 2)} and len(timed) == 3 * (leanllama.CALL_REPEATS + 1)
    assert 2 not in lean.native_plans or lean.native_plans[2] is plan  # the timing left no plan of its own
    kernels.forget()  # a later start: the table's file
    lean.native_plans.clear()
    timed.clear()
    with torch.inference_mode():
        assert (lean.native_weights(2) is not None) == (plan is not None) and not timed
    assert kernels.stored_forward(torch.float32, lean.forwards_key(), 2) == ms
    assert kernels.profile().entry("forwards", "float32|another model|4") == theirs  # kept, not overwritten


def test_specviz_native_0_turns_the_library_off_with_a_profile_of_its_own(fresh_tables, monkeypatch):
    """SPECVIZ_NATIVE=0: the library is neither built nor loaded, its paths are skipped with the reason, the
    products take torch's paths, and the timings go in a profile of their own (its machine says so)."""
    from specviz.models import native
    from specviz.models.leanllama import Linear

    monkeypatch.delenv("SPECVIZ_NATIVE", raising=False)  # the table of a run with the library on, first
    on = kernels.profile().file
    monkeypatch.setenv("SPECVIZ_NATIVE", "0")
    native.library.cache_clear()
    native.runs_here.cache_clear()  # both asked once a process: a process starts with the switch set or not
    try:
        assert not native.runs_here() and "SPECVIZ_NATIVE=0" in kernels.unavailable(torch.float32)["avx2"]
        assert kernels.machine()["native"] == "off" and kernels.profile().file != on
        w = torch.randn(32, 64)
        kernels.tune([w])
        lin, x = Linear(w, None), torch.randn(3, 64)
        assert not kernels.PATHS[lin.path(3)[0]].bits  # a library's path (oneDNN, MKL or F.linear)
        torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, w))
    finally:
        native.library.cache_clear()
        native.runs_here.cache_clear()


@needs_native
def test_a_loaded_pair_decodes_on_its_plans_and_times_nothing(pattern_dirs, fresh_tables, monkeypatch):
    """load_pair measures what this machine's table lacks (the products, and each row class's way to run the
    layers) and plans every product's path, so a decode's forwards, at row counts timed or not, only read their
    plans."""
    from specviz.models.loading import load_pair

    target, draft = pattern_dirs("llama")
    pair = load_pair(str(target), str(draft), device="cpu", dtype=torch.float32)
    assert LeanLlama.of(pair.target).native_plans.keys() >= set(kernels.ROWS)
    assert all(lin.chosen is not None for lin in LeanLlama.of(pair.target).linears())
    timed = []
    monkeypatch.setattr(kernels, "tune", lambda *a, **k: timed.append("products"))
    monkeypatch.setattr(kernels, "choose", lambda *a, **k: timed.append("a path"))
    monkeypatch.setattr(kernels, "keep_forward", lambda *a, **k: timed.append("ways"))
    for gamma in (3, 6):  # verifies of 4 and 7 rows: a timed class and one between two
        generate(pair, "", Settings(gamma=gamma, max_new_tokens=12), prompt_ids=words(2, 3, 4))
    generate(pair, "", Settings(gamma=2, max_new_tokens=4), prompt_ids=words(*range(20)))  # a prefill above them
    assert not timed
