"""llama.cpp as a peer in `bench` (tools/peer.py): the worker's protocol with a stand-in for llama-cpp-python (not a
dependency, not installed in CI), the bench's columns from a stand-in peer, and what a missing package says."""

import io
import json
import sys
import types

import pytest

from specviz.tools import peer, report


class FakeLlama:
    """llama_cpp.Llama's surface the worker uses: generate() yields its script of tokens; reset() is counted."""

    made: list[dict] = []

    def __init__(self, **kwargs):
        FakeLlama.made.append(kwargs)
        self.resets = 0

    def reset(self):
        self.resets += 1

    def generate(self, tokens, **kwargs):
        assert kwargs["temp"] == 0.0  # greedy
        yield from [7, 8, 2, 9, 9]


@pytest.fixture
def fake_llama_cpp(monkeypatch):
    FakeLlama.made = []
    root, spec = types.ModuleType("llama_cpp"), types.ModuleType("llama_cpp.llama_speculative")
    root.Llama, spec.LlamaPromptLookupDecoding = FakeLlama, lambda num_pred_tokens: ("lookup", num_pred_tokens)
    monkeypatch.setitem(sys.modules, "llama_cpp", root)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_speculative", spec)


def test_the_worker_answers_a_line_per_request_stopping_at_eos_or_the_token_budget(fake_llama_cpp, monkeypatch,
                                                                                     capsys):
    asks = [{"ids": [1, 2], "max_new_tokens": 64, "eos": [2], "lookup": 0},
            {"ids": [1, 2], "max_new_tokens": 2, "eos": [2], "lookup": 0},
            {"ids": [1, 2], "max_new_tokens": 64, "eos": [], "lookup": 3}]
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(json.dumps(a) + "\n" for a in asks)))
    peer.serve("model.gguf", 2)
    answers = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [a["ids"] for a in answers] == [[7, 8, 2], [7, 8], [7, 8, 2, 9, 9]]  # EOS kept, as specviz keeps it
    assert all(a["seconds"] > 0 for a in answers)
    # one engine per kind of decoding, on the same file and threads; prompt lookup at the γ asked
    assert [(m["model_path"], m["n_threads"], m["draft_model"]) for m in FakeLlama.made] == [
        ("model.gguf", 2, None), ("model.gguf", 2, ("lookup", 3))]


def test_a_missing_llama_cpp_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(peer.importlib.util, "find_spec", lambda name: None)
    assert "pip install llama-cpp-python==0.3.36" in peer.missing()


class StandInPeer:
    """peer.LlamaPeer's surface: a fixed speed, and the plain run's text as its own."""

    def __init__(self, tps: float):
        self.tps, self.asked = tps, []

    def decode(self, ids, max_new_tokens, eos, lookup=0):
        self.asked.append(lookup)
        return self.tps / (2 if lookup else 1), [5] * max_new_tokens


def test_bench_times_the_peer_in_each_greedy_block_and_reports_against_it(pattern_pair):
    from dataclasses import asdict

    from specviz.tools.bench import bench_pair

    stand_in = StandInPeer(1e9)
    rows = bench_pair(pattern_pair("llama"), {"count": ["w1 w2 w3"]}, [2], [0.0, 1.0], 6, 2, with_hf=False,
                      progress=lambda m: None, drafters=("model", "lookup"), policies=(), peer=stand_in)
    greedy = [r for r in rows if r.temperature == 0]
    assert all(r.llama_plain_tps == 1e9 and r.specviz_over_llama < 1e-3 for r in greedy)
    assert [r.llama_lookup_tps for r in greedy] == [None, 5e8]  # beside specviz's lookup, at its γ
    assert all(r.llama_plain_tps is None for r in rows if r.temperature > 0)  # greedy only
    assert stand_in.asked.count(0) == 1 + 2  # a warm-up, then once a block
    results = {"environment": {"device": "cpu", "dtype": "float32", "cpu": "c", "peer": "llama-cpp-python 0.3.36",
                               "weights": "the GGUF's blocks (Q4_1), 1 MB a step", "threads": 2},
               "command": "c", "run": {}, "rows": [asdict(r) for r in rows], "steps": []}
    md = report.benchmarks_md({"cpu-avx512": results})
    assert "vs llama.cpp plain, greedy |" in md and "| llama.cpp plain, the same GGUF file |" in md
    assert "llama.cpp: llama-cpp-python 0.3.36, 2 threads" in md and "reads the GGUF's blocks" in md
    assert "| llama.cpp prompt lookup, γ = 2 |" in md
