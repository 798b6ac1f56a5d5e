"""Compiled forwards (torch.compile of the static cache's Llama forward): same text as eager, and
a clear fallback to eager when compiling is impossible."""

import dataclasses
import logging

import pytest
import torch
from conftest import with_our_build, words
from torch._dynamo.utils import counters

from specviz.core.generator import Settings, generate, generate_batch
from specviz.models.leanllama import LeanLlama
from specviz.models.loading import load_pair

REAL_COMPILE = torch.compile
PROMPTS = [words(2, 3, 4, 5), words(20, 21, 22), words(30, 31, 32, 33)]  # prefills of 2-3 tokens: one width


def fresh_pair(pattern_dirs, arch="llama"):
    """A pair loaded anew, so no compiled (or given-up) forward carries over from another test."""
    target, draft = pattern_dirs(arch)
    return load_pair(str(target), str(draft), device="cpu", dtype=torch.float32)


@pytest.mark.slow
def test_compiled_greedy_equals_eager_and_batch_rows_equal_single_runs(pattern_dirs, pattern_pair):
    """Compiled single runs equal eager ones, and a compiled batch's rows (left-padded) equal them. Few
    graphs to compile (on a cold inductor cache each costs seconds): prefills and verifies of γ = 3 are
    all padded to 4 tokens, other forwards are of 1; a batch adds its row count's graphs (and fewer
    rows' as rows finish: one row's are compiled already). Dynamo compiles a graph per shape counted, no more:
    inputs that are views (a column of a stacked tensor) go in with a new tensor's strides, or each stride
    would be a graph of its own that no budget counts (on a GPU, a compile and a CUDA-graph recording each)."""
    pair = fresh_pair(pattern_dirs)
    settings = Settings(gamma=3, max_new_tokens=16, compile=True)
    graphs = counters["stats"]["unique_graphs"]
    alone = [generate(pair, "", settings, prompt_ids=p) for p in PROMPTS]
    eager = [generate(pattern_pair("llama"), "", Settings(gamma=3, max_new_tokens=16), prompt_ids=p) for p in PROMPTS]
    assert [r.token_ids for r in alone] == [r.token_ids for r in eager]
    batch = generate_batch(pair, [""] * 2, settings, prompts_ids=PROMPTS[:2])
    assert [r.token_ids for r in batch] == [r.token_ids for r in eager[:2]]
    lean = LeanLlama.of(pair.target)
    assert lean.compile_note == "" and {ids[1] for ids, _ in lean.compiled_shapes} <= {1, 4}  # it ran compiled
    assert batch[0].meta.compiled and alone[0].meta.compiled and batch[0].meta.cache == "static"
    shapes = sum(len(LeanLlama.of(m).compiled_shapes) for m in (pair.target, pair.draft))
    assert counters["stats"]["unique_graphs"] - graphs == shapes


def test_a_failing_compiler_falls_back_to_eager_and_says_why(pattern_dirs, pattern_pair, monkeypatch, caplog):
    def broken(fn, **kwargs):
        def run(*args):
            raise RuntimeError("no working compiler here")
        return run

    monkeypatch.setattr(torch, "compile", broken)
    pair = fresh_pair(pattern_dirs)
    with caplog.at_level(logging.WARNING, logger="specviz"):
        run = generate(pair, "", Settings(gamma=3, max_new_tokens=12, compile=True), prompt_ids=PROMPTS[0])
    eager = generate(pattern_pair("llama"), "", Settings(gamma=3, max_new_tokens=12), prompt_ids=PROMPTS[0])
    assert run.token_ids == eager.token_ids
    note = LeanLlama.of(pair.target).compile_note
    assert "compiling failed" in note and "no working compiler here" in note and note in caplog.text


def test_without_a_cpp_compiler_it_runs_eager(pattern_dirs, monkeypatch, caplog):
    import shutil

    monkeypatch.setattr(shutil, "which", lambda name: None)
    pair = fresh_pair(pattern_dirs)
    with caplog.at_level(logging.WARNING, logger="specviz"):
        run = generate(pair, "", Settings(gamma=2, max_new_tokens=6, compile=True), prompt_ids=PROMPTS[0])
    assert run.n_tokens == 6 and "no C++ compiler" in LeanLlama.of(pair.target).compile_note
    assert "no C++ compiler" in caplog.text


def test_other_architectures_run_eager_with_a_note(pattern_pair, caplog):
    from specviz.core import kvcache

    kvcache._warn_once.cache_clear()  # said once per process: make this test see it
    with caplog.at_level(logging.WARNING, logger="specviz"):
        run = generate(pattern_pair("gpt2"), "", Settings(gamma=2, max_new_tokens=6, compile=True),
                       prompt_ids=PROMPTS[0])
    eager = generate(pattern_pair("gpt2"), "", Settings(gamma=2, max_new_tokens=6), prompt_ids=PROMPTS[0])
    assert run.token_ids == eager.token_ids
    assert "applies to the static cache of Llama-family models" in caplog.text


@pytest.mark.slow
def test_a_second_start_loads_the_compiled_graphs_from_disk(pattern_dirs, tmp_path):
    """Two processes, one cache folder: the first compiles, the second loads (in bf16, through
    the pre-packed oneDNN linears where the CPU has them). Prompt lookup drafts and one token is asked for, so
    only the target compiles, a prefill's graph and a step's."""
    import os
    import subprocess
    import sys

    target, draft = pattern_dirs("llama")
    env = {**os.environ, "SPECVIZ_CACHE": str(with_our_build(tmp_path))}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    command = [sys.executable, "-m", "specviz", "generate", "--target", str(target), "--draft", str(draft),
               "--drafter", "lookup", "--prompt", "a b c a b", "--no-chat-template", "--gamma", "1",
               "--max-new-tokens", "1", "--compile", "--dtype", "bfloat16", "--device", "cpu", "--color", "never"]
    logs = [subprocess.run(command, env=env, capture_output=True, text=True, timeout=600) for _ in range(2)]
    assert all(log.returncode == 0 for log in logs), logs[-1].stderr[-2000:]
    first, second = (log.stderr for log in logs)
    assert "(compiled)" in first and "loaded from the disk cache" not in first, first[-2000:]
    assert "(loaded from the disk cache)" in second and "(compiled)" not in second, second[-2000:]
    assert (tmp_path / "inductor").is_dir()


def test_the_vector_instruction_verdict_is_probed_once_then_read_from_the_cache(tmp_path, monkeypatch):
    """inductor's per-process probe of the CPU's vector instructions runs once per machine: the
    verdict is kept in the cache folder, and a different compiler asks again."""
    import os

    from torch._inductor import config, cpp_builder, cpu_vec_isa

    from specviz.models import leanllama

    probes = []
    monkeypatch.setattr(cpu_vec_isa, "pick_vec_isa", lambda: probes.append(1) or "avx512")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    user_choice = config.cpp.vec_isa_ok  # set and restored by hand: monkeypatch's undo deletes the key
    config.cpp.vec_isa_ok = None
    try:
        assert leanllama._vector_isa_known_good() and leanllama._vector_isa_known_good()
        assert len(probes) == 1 and len(list((tmp_path / "specviz-vec-isa-ok").iterdir())) == 1
        compiler = tmp_path / "c++"
        compiler.write_text("")
        compiler.chmod(0o755)
        monkeypatch.setattr(cpp_builder, "get_cpp_compiler", lambda: str(compiler))
        assert leanllama._vector_isa_known_good() and len(probes) == 2
        monkeypatch.setattr(cpu_vec_isa, "pick_vec_isa", lambda: cpu_vec_isa.invalid_vec_isa)
        os.utime(compiler, (1, 1))  # the compiler changed
        assert not leanllama._vector_isa_known_good()  # a probe that fails is not remembered
        config.cpp.vec_isa_ok = False
        assert not leanllama._vector_isa_known_good()  # the user's choice wins
    finally:
        config.cpp.vec_isa_ok = user_choice


class Replaying:
    """A stand-in for a compiled forward run as CUDA graphs, on the CPU: the eager forward, its outputs
    copied into the graph's buffers, and every buffer handed out before overwritten (NaN) on each
    call, as the next replay would. Records each call's batch rows and the caches' addresses."""

    def __init__(self, module):
        self.module, self.buffers, self.calls = module, {}, []

    def __call__(self, ids, positions, mask, slots, keys, values, *rest):
        self.calls.append((ids.shape[0], keys[0].data_ptr()))
        logits, h = self.module(ids, positions, mask, slots, keys, values, *rest)
        for buffer in self.buffers.values():
            buffer.fill_(float("nan"))
        out = []
        for name, x in (("logits", logits), ("h", h)):
            buffer = self.buffers.setdefault((name, x.shape), torch.empty_like(x))
            out.append(buffer.copy_(x))
        return tuple(out)


def replaying_pair(pattern_dirs, monkeypatch, graphs=True):
    """A fresh pair whose compiled forwards are `Replaying`; graphs: the lean models know it (as on CUDA)."""
    monkeypatch.setattr(torch, "compile", lambda module, **kwargs: Replaying(module))
    pair = fresh_pair(pattern_dirs)
    for model in (pair.target, pair.draft):
        LeanLlama.of(model).graphs = graphs
    return pair


def drafted(run):
    return [(d.id, d.status, d.q, d.p) for e in run.events for d in e.drafted]


def test_outputs_of_graph_replays_are_copied_before_the_next_replay(pattern_dirs, pattern_pair, monkeypatch):
    """The draft model's drafter keeps each draft step's logits until the round's last step: as CUDA
    graph outputs they would be overwritten by then. The q and p shown equal the eager run's."""
    prompt, settings = PROMPTS[1], Settings(gamma=3, max_new_tokens=16, compile=True)
    eager = generate(pattern_pair("llama"), "", Settings(gamma=3, max_new_tokens=16), prompt_ids=prompt)
    run = generate(replaying_pair(pattern_dirs, monkeypatch), "", settings, prompt_ids=prompt)
    assert run.token_ids == eager.token_ids
    assert [d[:2] for d in drafted(run)] == [d[:2] for d in drafted(eager)]
    assert torch.tensor([d[2:] for d in drafted(run)]) == pytest.approx(torch.tensor([d[2:] for d in drafted(eager)]),
                                                                        abs=1e-4)
    # the oracle can fail: without the copies, the kept logits are overwritten
    unaware = generate(replaying_pair(pattern_dirs, monkeypatch, graphs=False), "", settings, prompt_ids=prompt)
    assert any(d[2] != d[2] for d in drafted(unaware)) or unaware.token_ids != eager.token_ids  # NaN or wrong


def test_compiled_caches_keep_their_addresses_and_batch_shape_across_runs(pattern_dirs, pattern_pair, monkeypatch):
    """A second run replays the first's graphs (its caches are the same tensors, marked as static inputs), and
    a batch whose rows finish at different rounds runs every forward at its first row count."""
    pair = replaying_pair(pattern_dirs, monkeypatch)
    settings = Settings(gamma=3, max_new_tokens=16, compile=True)
    target = LeanLlama.of(pair.target)
    first = generate(pair, "", settings, prompt_ids=PROMPTS[0])
    addresses = {address for _, address in target.compiled.calls}
    target.compiled.calls.clear()
    second = generate(pair, "", settings, prompt_ids=PROMPTS[0])
    assert second.token_ids == first.token_ids and {a for _, a in target.compiled.calls} == addresses
    stack, keys, values = target.spare[0]
    assert len(addresses) == 1 and all(c._dynamo_static_input_type == "unguarded" for c in keys + values)

    eager = [generate(pattern_pair("llama"), "", Settings(gamma=3, max_new_tokens=16), prompt_ids=p) for p in PROMPTS]
    target.compiled.calls.clear()
    batch = generate_batch(pair, [""] * 3, settings, prompts_ids=PROMPTS)
    assert [r.token_ids for r in batch] == [r.token_ids for r in eager]
    finished = sorted(len(r.events) for r in batch)
    assert finished[0] < finished[-1]  # rows left the batch before others
    assert {rows for rows, _ in target.compiled.calls} == {3}


def test_a_compiled_caches_layers_are_one_tensor_so_a_kept_path_moves_in_one_operation(pattern_dirs, monkeypatch):
    """A compiled cache's keys and values are views of one lent tensor, each marked as a static graph input: moving
    a tree's kept path is one copy for every layer, not one per layer and kind (60 on the offline target, each a
    launch on a GPU), and rows repeated by `select` are one copy too. The moved and copied slots hold the same keys
    and values as before, in every layer."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from specviz.core.kvcache import KVState

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:
                self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    pair = replaying_pair(pattern_dirs, monkeypatch)
    state = KVState(pair.target, 2, "static", pair.vocab_size, 32, compile=True)
    state.prefill([PROMPTS[0], PROMPTS[2]], 0)
    ids = torch.tensor([words(5, 6, 7, 8), words(9, 10, 11, 12)])
    state.forward(ids, [[True] * 4] * 2)
    cache = state.backend
    stack = cache.stack
    assert all(c.untyped_storage().data_ptr() == stack.untyped_storage().data_ptr() and
               c._dynamo_static_input_type == "unguarded" for c in cache.keys + cache.values)
    before = stack.clone()
    src, dst = torch.tensor([4, 6]), torch.tensor([3, 4])
    with torch.inference_mode(), Ops() as ops:  # as the decoder runs it
        cache.move(1, src, dst)
    assert len(ops.names) <= 2, ops.names  # index_select, index_copy_
    layers = len(cache.keys)
    for k, (new, old) in enumerate(zip(cache.keys + cache.values, before.unbind(), strict=True)):
        assert torch.equal(new[1, :, dst], old[1, :, src]) and torch.equal(new[0], old[0]), k
    assert layers == len(LeanLlama.of(pair.target).layers)
    moved = stack.clone()
    with torch.inference_mode():
        cache.select(torch.tensor([1, 1]))
    assert all(torch.equal(c[0], c[1]) and torch.equal(c[0], old[1]) for c, old in
               zip(cache.keys + cache.values, moved.unbind(), strict=True))
    kept = cache.stack.clone()  # a batch with holes outgrows its capacity: a set twice as long, the slots kept
    with torch.inference_mode():
        cache._reserve(2, cache.capacity + 1, cache.stack)
    assert cache.capacity == 2 * kept.shape[3] and torch.equal(cache.stack[:, :, :, : kept.shape[3]], kept)
    assert all(c.untyped_storage().data_ptr() == cache.stack.untyped_storage().data_ptr() for c in cache.keys)


def test_past_the_graph_budget_new_shapes_run_eager_and_say_so(pattern_dirs, pattern_pair, monkeypatch, caplog):
    """Capacities are 256 times a power of two (runs of many lengths share a few shapes), and past GRAPHS shapes a
    process compiles no more: a new shape runs eager with a warning, where dynamo would fall back without one."""
    from specviz.models import leanllama

    assert [leanllama.compiled_capacity(n) for n in (1, 256, 257, 600, 1025)] == [256, 256, 512, 1024, 2048]
    pair = replaying_pair(pattern_dirs, monkeypatch)
    monkeypatch.setattr(LeanLlama, "shapes_compiled", 0)
    monkeypatch.setattr(leanllama, "GRAPHS", 2)
    with caplog.at_level(logging.WARNING, logger="specviz"):
        run = generate(pair, "", Settings(gamma=3, max_new_tokens=12, compile=True), prompt_ids=PROMPTS[0])
    eager = generate(pattern_pair("llama"), "", Settings(gamma=3, max_new_tokens=12), prompt_ids=PROMPTS[0])
    assert run.token_ids == eager.token_ids
    shapes = [len(LeanLlama.of(m).compiled_shapes) for m in (pair.target, pair.draft)]
    assert sum(shapes) == LeanLlama.shapes_compiled == 2 and "2 shapes compiled in this process" in caplog.text


class ReplayingHead:
    """The EAGLE head's compiled layer compiled for real (inductor), its outputs handed out in buffers that the
    next call overwrites (NaN first), as a CUDA graph's replay would."""

    def __init__(self, fn):
        self.fn, self.buffers, self.shapes, self.addresses = REAL_COMPILE(fn, dynamic=False), {}, [], set()

    def __call__(self, *args):
        self.shapes.append(tuple(args[2].shape))
        self.addresses.add(args[0].data_ptr())  # the cache's keys
        h, logits = self.fn(*args)
        for buffer in self.buffers.values():
            buffer.fill_(float("nan"))
        return tuple(self.buffers.setdefault((name, x.shape), torch.empty_like(x)).copy_(x)
                     for name, x in (("h", h), ("logits", logits)))


@pytest.mark.slow
def test_the_eagle_heads_compiled_steps_draft_what_its_eager_steps_draft(pattern_dirs, monkeypatch):
    """Where no C call runs the head's layer (a GPU; here specviz's C library is switched off), --compile runs
    the head's drafting steps compiled, at a few shapes: entries padded to a compiled width, the cache's capacity
    256 times a power of two, its caches lent by the head and handed back (a second run replays in the first's).
    Chain and tree, alone and batched: the same drafts, q to rounding and the same greedy text as its eager
    steps, with its graphs' outputs overwritten at every call as CUDA graphs would."""
    from test_trees import random_head_pair

    from specviz.models import native

    monkeypatch.setattr(native, "runs_here", lambda: False)
    monkeypatch.setattr(torch, "compile",
                        lambda fn, **kw: Replaying(fn) if isinstance(fn, LeanLlama) else ReplayingHead(fn))
    graphs = counters["stats"]["unique_graphs"]
    pair, eager_pair = (dataclasses.replace(random_head_pair(fresh_pair(pattern_dirs), draft_words=range(12)),
                                            eos_token_ids=set()) for _ in range(2))
    pair.head.compiler()
    pair.head.graphs = True  # outputs copied, as on CUDA
    for settings in (Settings(drafter="eagle", gamma=3, max_new_tokens=12, compile=True),
                     Settings(drafter="eagle", gamma=3, branch=3, nodes=5, max_new_tokens=12, compile=True)):
        pair.head.compiled.shapes.clear()
        pair.head.compiled.addresses.clear()
        runs = [generate(pair, "", settings, prompt_ids=p) for p in PROMPTS[:2]]
        assert {s[0] for s in pair.head.compiled.shapes} == {1}
        assert len(pair.head.compiled.addresses) == 1  # the second run drafts in the first's caches, as graphs need
        assert all(c._dynamo_static_input_type == "unguarded" for c in pair.head.spare[0][1] + pair.head.spare[0][2])
        pair.head.compiled.shapes.clear()
        runs += generate_batch(pair, [""] * 2, settings, prompts_ids=PROMPTS[:2])
        # a row that finished first leaves: the other drafts eager after, no graph per row count
        assert {s[0] for s in pair.head.compiled.shapes} == {2} and len({len(r.events) for r in runs[2:]}) == 2
        eager = [generate(eager_pair, "", dataclasses.replace(settings, compile=False), prompt_ids=p)
                 for p in PROMPTS[:2]] * 2
        assert [r.token_ids for r in runs] == [r.token_ids for r in eager]
        assert [[d[:2] for d in drafted(r)] for r in runs] == [[d[:2] for d in drafted(r)] for r in eager]
        q = [d[2] for r in runs for d in drafted(r)]
        assert q == pytest.approx([d[2] for r in eager for d in drafted(r)], abs=1e-4)
    assert {width for (_, width), _ in pair.head.compiled_shapes} == {1, 4}  # a chain's steps; a tree's 3, padded
    # a graph per shape: entries that fill their width go in as they are, but with a new tensor's strides (a view
    # of a stacked tensor has others, and dynamo would compile the graph again for them)
    assert counters["stats"]["unique_graphs"] - graphs == len(pair.head.compiled_shapes)
    assert pair.head.compile_note == "" and eager_pair.head.compiled is None


def test_every_tree_a_preset_prices_and_every_node_budget_verifies_compiled():
    """A compiled forward pads its tokens to the next compiled width and runs eager past the last: every verify a
    preset's first-run table prices (γ, branch, nodes: the drafts and the last token) and any tree with a node
    budget (at most MAX_NODES drafts) fits one, so `--compile` never prices a forward it then runs eager."""
    from specviz.core.events import MAX_NODES
    from specviz.core.generator import draft_width
    from specviz.models.leanllama import WIDTHS
    from specviz.models.loading import PRESETS

    shapes = {(g, b, n) for preset in PRESETS.values() for _, taus in preset.first_run_tables()
              for table in taus.values() for g, b, n in table}
    assert any(b > 1 for _, b, _ in shapes)
    for gamma, branch, nodes in shapes:
        width = draft_width(Settings(gamma=gamma, branch=branch, nodes=nodes)) + 1
        assert width <= WIDTHS[-1], (gamma, branch, nodes, width)
    assert MAX_NODES + 1 <= WIDTHS[-1]
