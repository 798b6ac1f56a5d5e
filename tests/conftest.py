"""Tiny models built from configs, saved with save_pretrained and loaded back through the real
loading path. No network.

The "pattern" pairs are trained for a few seconds on a counting language (w_k is followed by
w_{k+1}, the last word by <eos>), so that greedy drafts are often accepted. The draft learns a
slightly wrong language (after every fifth word it skips one), so rounds also see rejections
and corrections at known places.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPTNeoXConfig,
    LlamaConfig,
    OPTConfig,
    PreTrainedTokenizerFast,
    Qwen3Config,
)

from specviz.models import kernels, native
from specviz.models.cachedir import locked
from specviz.models.loading import load_pair
from specviz.tools.distill import DistillConfig, distill_eagle

# tests of the library itself: a suite run with SPECVIZ_NATIVE=0 (the library switched off) skips them
needs_native = pytest.mark.skipif(native.turned_off(), reason="SPECVIZ_NATIVE=0: the C library is switched off")

def with_our_build(cache: Path) -> Path:
    """cache (a fresh SPECVIZ_CACHE for a subprocess), with specviz's C library as this run built it linked in:
    building it once per run is enough (the file is named by the source's digest, so a changed
    source still builds anew). Where it cannot be built, nothing is linked and the subprocess says why."""
    from specviz.models import native

    try:
        built = native.build()
    except RuntimeError:
        return cache
    (cache / "kernels").mkdir(parents=True, exist_ok=True)
    if not (cache / "kernels" / built.name).exists():
        (cache / "kernels" / built.name).symlink_to(built)
    return cache


def pytest_configure(config):
    """Under pytest-xdist (the README's command runs two workers) each worker takes its share of
    torch's threads, and so do the processes its tests start (OMP_NUM_THREADS): two processes of two
    threads on two cores would wait on each other's threads. The suite loads the machine by design (two
    workers, servers, browsers), so timings are kept as they come (SPECVIZ_IGNORE_LOAD, models/contention.py):
    no test waits on a timing taken again; test_costs scripts the meter where it tests that."""
    os.environ["SPECVIZ_IGNORE_LOAD"] = "1"
    os.environ["SPECVIZ_LLC_BYTES"] = str(32 << 20)  # kernel timings evict 64 MB, whatever this CPU's cache
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, torch.get_num_threads() // workers))
        os.environ["OMP_NUM_THREADS"] = str(torch.get_num_threads())


@pytest.fixture(scope="session", autouse=True)
def temp_files_under_pytest(tmp_path_factory):
    """What the tests and the servers they start put in the system's temp folder goes under pytest's own
    (pytest keeps its last three runs): gradio_client leaves an empty folder there per file it downloads."""
    folder = tmp_path_factory.mktemp("tmp")
    before = tempfile.tempdir, os.environ.get("TMPDIR")
    tempfile.tempdir, os.environ["TMPDIR"] = str(folder), str(folder)
    yield folder
    tempfile.tempdir = before[0]
    if before[1] is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before[1]


@pytest.fixture
def fresh_tables(tmp_path, monkeypatch):
    """A cache folder with no table (our C library as this run built it linked in) and no table in memory;
    restored afterwards."""
    monkeypatch.setenv("SPECVIZ_CACHE", str(with_our_build(tmp_path)))
    saved = dict(kernels._TABLES)
    kernels._TABLES.clear()
    yield tmp_path
    kernels._TABLES.clear()
    kernels._TABLES.update(saved)


UNK, PAD, EOS = 0, 1, 2
N_WORDS = 40
WORD0 = 3  # id of w0
VOCAB = WORD0 + N_WORDS
ARCHS = ["gpt2", "opt", "gpt_neox", "llama", "qwen3"]


def word_id(k: int) -> int:
    return WORD0 + k


def make_tokenizer(path: Path, n_words: int = N_WORDS) -> PreTrainedTokenizerFast:
    vocab = {"<unk>": UNK, "<pad>": PAD, "<eos>": EOS} | {f"w{k}": WORD0 + k for k in range(n_words)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>")
    tok.save_pretrained(path)
    return tok


def make_config(arch: str, vocab: int, size: str, init: float = 0.02):
    """size: 'target' (deeper, wider) or 'draft'."""
    h, layers, heads = (48, 3, 4) if size == "target" else (32, 1, 2)
    common = dict(vocab_size=vocab, bos_token_id=EOS, eos_token_id=EOS, pad_token_id=PAD, initializer_range=init)
    if arch == "gpt2":
        return GPT2Config(n_embd=h, n_layer=layers, n_head=heads, n_positions=256, **common)
    if arch == "opt":
        return OPTConfig(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads, ffn_dim=2 * h,
                         max_position_embeddings=256, word_embed_proj_dim=h, **common)
    if arch == "gpt_neox":
        return GPTNeoXConfig(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                             intermediate_size=2 * h, max_position_embeddings=256, **common)
    if arch == "llama":
        return LlamaConfig(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=2,
                           intermediate_size=2 * h, max_position_embeddings=256, **common)
    if arch == "qwen3":
        return Qwen3Config(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=2,
                           head_dim=16, intermediate_size=2 * h, max_position_embeddings=256, **common)
    raise ValueError(arch)


def pattern_batch(gen: torch.Generator, skip_every: int | None, batch: int = 32, length: int = 20) -> torch.Tensor:
    """Counting sequences from random starts, ending in <eos> then padding with <eos>."""
    rows = []
    for start in torch.randint(0, N_WORDS, (batch,), generator=gen).tolist():
        row, k = [], start
        while len(row) < length:
            if k >= N_WORDS:
                row.append(EOS)
                continue
            row.append(word_id(k))
            k += 2 if skip_every and k % skip_every == skip_every - 1 else 1
        rows.append(row)
    return torch.tensor(rows)


def train_pattern(model, skip_every: int | None, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(steps):
        batch = pattern_batch(gen, skip_every)
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def build_model(path: Path, arch: str, size: str, vocab: int, seed: int, init: float = 0.02,
                train_steps: int = 0, skip_every: int | None = None) -> Path:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(arch, vocab, size, init))
    if train_steps:
        train_pattern(model, skip_every, train_steps, seed)
    model.save_pretrained(path)
    make_tokenizer(path, vocab - WORD0 if vocab <= VOCAB else N_WORDS)
    return path


@pytest.fixture(scope="session")
def pattern_dirs(tmp_path_factory):
    """arch -> (target_dir, draft_dir), trained on the counting language (cached per session)."""
    cache: dict[str, tuple[Path, Path]] = {}

    def get(arch: str) -> tuple[Path, Path]:
        if arch not in cache:
            root = tmp_path_factory.mktemp(f"pattern-{arch}")
            # OPT's target gets padded embeddings (8 extra rows): logits must be cut to VOCAB.
            target_vocab = VOCAB + 8 if arch == "opt" else VOCAB
            target = build_model(root / "target", arch, "target", target_vocab, seed=1, train_steps=150)
            draft = build_model(root / "draft", arch, "draft", VOCAB, seed=2, train_steps=150, skip_every=5)
            cache[arch] = (target, draft)
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def pattern_pair(pattern_dirs):
    pairs = {}

    def get(arch: str, dtype=torch.float32):
        key = (arch, dtype)
        if key not in pairs:
            target, draft = pattern_dirs(arch)
            pairs[key] = load_pair(str(target), str(draft), device="cpu", dtype=dtype)
        return pairs[key]

    return get


@pytest.fixture(scope="session")
def random_pair(tmp_path_factory):
    """An untrained Llama pair over 8 words: broad, different p and q, for sampling tests."""
    root = tmp_path_factory.mktemp("random-llama")
    vocab = WORD0 + 8
    target = build_model(root / "target", "llama", "target", vocab, seed=3, init=0.3)
    draft = build_model(root / "draft", "llama", "draft", vocab, seed=4, init=0.3)
    return load_pair(str(target), str(draft), device="cpu", dtype=torch.float64)


def words(*ks: int) -> list[int]:
    return [word_id(k) for k in ks]


def seeded_rows_and_single_runs(pair, prompt: list[int], settings, seeds: list[int]):
    """Tokens of rows of one prompt decoded together (row i seeded with seeds[i]), and of the
    single runs with those seeds: the oracle for a shared prefill."""
    import dataclasses

    from specviz.core.generator import decode, generate

    rows: list[list[int]] = [[] for _ in seeds]
    for round_events in decode(pair, [prompt] * len(seeds), settings, seeds=seeds):
        for row, event in round_events:
            rows[row] += event.new_tokens
    alone = [generate(pair, "", dataclasses.replace(settings, seed=s), prompt_ids=prompt).token_ids for s in seeds]
    return rows, alone


def seeded_runs(pair, prompt: list[int], settings, n: int, chunk: int = 2000) -> list[list]:
    """The events of n runs of one prompt seeded 0..n-1, decoded as batches over one prefill (a
    batch row decodes what the single run with its seed decodes: tested above)."""
    from specviz.core.generator import decode

    runs: list[list] = []
    for start in range(0, n, chunk):
        rows: dict[int, list] = {}
        size = min(chunk, n - start)
        for round_events in decode(pair, [prompt] * size, settings, seeds=list(range(start, start + size))):
            for row, event in round_events:
                rows.setdefault(row, []).append(event)
        runs += [rows[row] for row in range(size)]
    return runs


DRAFT_VOCAB = 30  # of the 43 ids: the head can never draft the other 13 (reached through the residual)


def tiny_config(target, out, data_file=None) -> DistillConfig:
    return DistillConfig(str(target), str(out), prompts_file=str(out.parent / "prompts.txt"), chat_template=False,
                         new_tokens=16, gen_batch=16, max_steps=80, batch=8, lr=3e-3, holdout=0.2,
                         draft_vocab=DRAFT_VOCAB, ttt_steps=2, head_intermediate=64, data_file=data_file)


@pytest.fixture(scope="session")
def eagle_dirs(pattern_dirs, tmp_path_factory):
    """arch -> a head trained for a few seconds on the pattern target's own counting."""
    cache = {}

    def get(arch):
        if arch not in cache:
            target, _ = pattern_dirs(arch)
            root = tmp_path_factory.mktemp(f"eagle-{arch}")
            (root / "prompts.txt").write_text("\n".join(" ".join(f"w{k + i}" for i in range(3)) for k in range(36)))
            cache[arch] = (distill_eagle(tiny_config(target, root / "head"), progress=lambda m: None), root / "head")
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def eagle_pair(pattern_dirs, eagle_dirs):
    pairs = {}

    def get(arch, dtype=torch.float32):
        if (arch, dtype) not in pairs:
            target, draft = pattern_dirs(arch)
            pairs[arch, dtype] = load_pair(str(target), str(draft), device="cpu", dtype=dtype,
                                           head=str(eagle_dirs(arch)[1]))
        return pairs[arch, dtype]

    return get


def while_another_process_makes(file: Path, call, store):
    """Run call(progress) in a thread while this test holds `file`'s cache lock, as a second process would
    while a first measures or converts; once call says it is waiting, store() what the first made and
    release. -> (call's result, its progress messages)."""
    said, result = [], []
    with locked(file):
        thread = threading.Thread(target=lambda: result.append(call(said.append)))
        thread.start()
        deadline = time.monotonic() + 60
        while not any("waiting for another specviz process" in m for m in said):
            assert thread.is_alive() and time.monotonic() < deadline, f"never waited for the lock: {said}"
            time.sleep(0.01)
        store()
    thread.join(timeout=120)
    assert result, "the waiting call did not finish"
    return result[0], said


def scripted_meters(shares):
    """A stand-in for contention.others_meter: each meter started reads the next of `shares`."""
    left = iter(shares)

    def others_meter():
        share = next(left)
        return lambda: share

    return others_meter
