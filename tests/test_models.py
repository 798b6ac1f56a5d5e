"""Loading: presets, shared vocabulary, device and dtype."""

import torch
from conftest import VOCAB

from specviz.models import OFFLINE_DRAFT, OFFLINE_TARGET, PRESETS, SHIPPED_DRAFT, resolve_device, resolve_dtype


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
    assert (SHIPPED_DRAFT / "model.safetensors").stat().st_size <= 25_000_000  # the cap
    pairs = {(p.target, p.draft) for p in PRESETS.values()}
    assert ("facebook/opt-350m", "facebook/opt-125m") in pairs
    assert ("Qwen/Qwen3-4B-Instruct-2507", "Qwen/Qwen3-0.6B") in pairs
    assert len(PRESETS) == 8


def test_device_and_dtype_resolution():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_dtype("float32", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cpu")) in (torch.bfloat16, torch.float32)
    assert resolve_dtype("auto", torch.device("cuda")) in (torch.bfloat16, torch.float16)
