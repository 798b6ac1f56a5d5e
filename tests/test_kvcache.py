"""KV states of every kind: after appends, holes and rollbacks a row's next logits equal a fresh
forward over that row's sequence alone (float32)."""

import inspect

import pytest
import torch
from conftest import ARCHS, PAD, words

from specviz.core.generator import Settings, generate, generate_batch
from specviz.core.kvcache import (
    CACHE_KINDS,
    DynamicBackend,
    KVState,
    LeanDynamicBackend,
    LeanNoCacheBackend,
    NoCacheBackend,
    make_backend,
)
from specviz.models.leanllama import LeanLlama


def fresh_logits(model, ids: list[int], vocab: int) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0, -1, :vocab]


@pytest.mark.parametrize("kind", CACHE_KINDS)
@pytest.mark.parametrize("arch", ARCHS)
def test_rolled_back_state_equals_a_fresh_forward(pattern_pair, arch, kind):
    pair = pattern_pair(arch)
    V = pair.vocab_size
    seqs = [words(0, 1, 2, 3), words(5, 6)]
    # capacity 6 is less than the slots used below: a static cache must grow, not overflow
    state = KVState(pair.target, 2, kind, V, capacity=6)
    with torch.inference_mode():
        state.prefill(seqs, PAD)
        # a round of 4 slots: row 0 keeps 2 of them, row 1 none (its slots become holes)
        start = state.width
        state.forward(torch.tensor([words(3, 4, 5, 6), words(6, 7, 8, 9)]), torch.ones(2, 4, dtype=torch.bool))
        state.make_holes(0, start + 2, start + 4)
        state.make_holes(1, start + 1, start + 4)
        state.trim()
        assert state.lengths.tolist() == [len(seqs[0]) - 1 + 2, len(seqs[1])]
        seqs[0] += words(4, 5)
        # a round that every row rejects entirely: rolled back to where it began
        width = state.width
        state.forward(torch.tensor([words(9, 9), words(9, 9)]), torch.ones(2, 2, dtype=torch.bool))
        for row in range(2):
            state.make_holes(row, width, width + 2)
        state.trim()
        assert state.width == width
        # the next token of each row, at once
        seqs[1] += words(7)
        last = torch.tensor([[seqs[0][-1]], [seqs[1][-1]]])
        cached = state.forward(last, torch.ones(2, 1, dtype=torch.bool)).logits[:, -1]
    for row in range(2):
        torch.testing.assert_close(cached[row], fresh_logits(pair.target, seqs[row], V), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", CACHE_KINDS)
def test_a_drafter_may_ask_for_the_targets_hidden_states(pattern_pair, kind, monkeypatch):
    """A drafter with requires_hidden gets the verify pass's last hidden states: those of a fresh
    forward over the same tokens. One that does not ask makes the target compute none."""
    from specviz.core import generator
    from specviz.core.drafters import PromptLookupDrafter

    pair = pattern_pair("llama")
    seen = []

    class Watching(PromptLookupDrafter):
        requires_hidden = True

        def start(self, prompts, hidden=None):
            seen.append(("start", hidden))

        def verified(self, n_accepted, hidden=None):
            seen.append(("verified", hidden))

    monkeypatch.setattr(generator, "PromptLookupDrafter", Watching)
    prompt = words(1, 2, 3, 1, 2)
    run = generate(pair, "", Settings(gamma=3, drafter="lookup", max_new_tokens=6, cache=kind), prompt_ids=prompt)
    assert seen[0][1].shape[:2] == (1, len(prompt) - 1)
    with torch.inference_mode():
        out = pair.target(torch.tensor([prompt + run.token_ids]), output_hidden_states=True)
    fresh = out.hidden_states[-1][0]  # [L, H], after the final norm
    position = len(prompt) - 1  # the first verify pass starts at the prompt's last token
    for (_, hidden), event in zip(seen[1:], run.events, strict=True):
        kept = event.n_accepted + 1  # the pass's rows over tokens that stayed in the text (a tree's kept path)
        assert hidden.shape[:2] == (1, kept)
        torch.testing.assert_close(hidden[0, :kept], fresh[position : position + kept], atol=1e-4, rtol=1e-4)
        position += len(event.new_tokens)

    monkeypatch.undo()  # the plain lookup drafter again
    calls = []
    original = LeanLlama.forward  # every kind's forward for a Llama-family model

    def spy(self, *args, **kwargs):
        calls.append(inspect.signature(original).bind(self, *args, **kwargs).arguments["hidden"])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(LeanLlama, "forward", spy)
    generate(pair, "", Settings(gamma=3, drafter="lookup", max_new_tokens=6, cache=kind), prompt_ids=prompt)
    assert calls and not any(calls)


def test_the_hosts_copy_of_the_mask_is_the_mask(random_pair, monkeypatch):
    """Rolling back reads nothing from the device while the host keeps a copy of the mask. At every
    roll-back of the target's and the draft model's states (holes of rejected drafts, a tree's moved
    path, rows leaving a batch, a one-token prompt's hole) that copy equals the mask, and trim's
    answer equals what the mask says."""
    from test_trees import random_head_pair

    trim, checked = KVState.trim, []

    def checking(self):
        assert self.flags == self.mask.tolist()
        used = self.mask.any(0).nonzero()
        width = int(used.max()) + 1 if len(used) else 0
        lengths = trim(self)
        assert (lengths, self.width) == (self.mask.sum(1).tolist(), width)
        assert self.flags == self.mask.tolist()
        checked.append(self.mask.shape[0])
        return lengths

    monkeypatch.setattr(KVState, "trim", checking)
    pair = random_head_pair(random_pair)
    prompts = [words(1), words(1, 2, 3, 1, 2), words(4, 5)]
    for settings in (Settings(drafter="model", gamma=3, max_new_tokens=10),
                     Settings(drafter="model", gamma=2, max_new_tokens=10, temperature=1.0, cache="dynamic"),
                     Settings(drafter="eagle", gamma=3, branch=2, nodes=4, max_new_tokens=10),
                     Settings(drafter="lookup+eagle", gamma=3, branch=2, nodes=4, max_new_tokens=10, temperature=1.0)):
        runs = generate_batch(pair, [""] * 3, settings, prompts_ids=prompts)
        assert len({len(r.events) for r in runs}) > 1 or settings.temperature  # rows left at different rounds
    assert len(checked) > 40 and 1 in checked and 3 in checked


@pytest.mark.parametrize("lossy", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("t", [1, 3])
def test_grouped_attention_is_the_attention(dtype, t, lossy, monkeypatch):
    """leanllama.attend through ATen (where specviz's C functions do not run; in bf16 on a CPU, the query heads
    of a key head as one block: in a one-token step, and at any width for a drafter) against float64
    attention with every key head repeated: close, and bitwise what ATen's own grouped-query call gives where
    a target's forward asks; masks with holes and two rows, boolean or made additive (as a forward does once
    for its layers) with the same bits."""
    from specviz.models import leanllama
    from specviz.models.leanllama import _additive, attend

    monkeypatch.setattr(leanllama, "in_c", lambda x: False)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, t, 16, generator=gen).to(dtype)
    k, v = (torch.randn(2, 2, 11, 16, generator=gen).to(dtype) for _ in range(2))
    mask = torch.rand(2, 1, t, 11, generator=gen) > 0.3
    mask[..., 0] = True  # no empty row
    got = attend(q, k, v, mask, lossy)
    assert torch.equal(attend(q, k, v, _additive(mask, dtype), lossy), got)  # the mask made once per forward
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(3, 1),
                                                           v.double().repeat_interleave(3, 1), attn_mask=mask)
    assert got.shape == q.shape and got.dtype == dtype
    torch.testing.assert_close(got.double(), ref, atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=0)
    if not lossy:
        assert torch.equal(got, torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                                 enable_gqa=True))


def test_off_the_cpu_a_masked_grouped_attention_goes_as_full_heads(monkeypatch):
    """Off the CPU (meta tensors stand in for a GPU's), attend hands ATen a mask and as many key heads as query
    heads, never a mask beside enable_gqa, which CUDA's flash and memory-efficient kernels both refuse (every
    layer would run the math kernel); query head h still reads key head h // (H / KV)."""
    from specviz.models import leanllama

    calls = []

    def sdpa(q, k, v, attn_mask=None, enable_gqa=False):
        calls.append((k.shape[1], v.shape[1], attn_mask is not None, enable_gqa))
        return q.new_empty(q.shape)

    monkeypatch.setattr(leanllama.F, "scaled_dot_product_attention", sdpa)
    q = torch.empty(2, 6, 3, 16, device="meta")
    k, v = (torch.empty(2, 2, 11, 16, device="meta") for _ in range(2))
    for lossy in (False, True):
        leanllama.attend(q, k, v, torch.empty(2, 1, 3, 11, dtype=torch.bool, device="meta"), lossy)
    assert calls == [(6, 6, True, False)] * 2
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(1, 2, 4, 8, generator=gen)
    assert torch.equal(k.repeat_interleave(3, 1)[:, 4], k[:, 4 // 3])  # head 4 of 6 reads key head 1 of 2


@pytest.mark.parametrize("dim", [64, 12])
def test_the_c_attention_gives_a_query_the_same_bits_wherever_its_keys_lie(dim):
    """native.attend_bf16 (bf16 attention on a CPU): close to float64; and a query's output is bitwise the same
    alone in a one-token call over just the keys it sees, with those keys spread over other slots among
    keys it does not see (a tree node's ancestors), in a batch row, and read through strided caches (the
    EAGLE head's); an empty row gives zeros; attend() routes bf16 there, boolean or additive mask alike; a long
    prefix seen whole (a verify's) too. ATen's attention fails the layout part (it blocks and reduces keys by slot)."""
    from specviz.models import native
    from specviz.models.leanllama import _additive, attend, in_c

    if not native.runs_here():
        pytest.skip("specviz's C functions do not run here")
    gen = torch.Generator().manual_seed(0)
    B, H, KV, t, L = 2, 6, 2, 5, 72
    q = torch.randn(B, H, t, dim, generator=gen).bfloat16()
    k, v = (torch.randn(B, KV, L, dim, generator=gen).bfloat16() for _ in range(2))
    mask = torch.rand(B, 1, t, L, generator=gen) > 0.4
    mask[0, 0, :, :64] = True  # a prefix every query sees: the C function lists its slots 32 at a time
    mask[1, 0, 2] = False  # a query that sees nothing
    got = native.attend_bf16(q, k, v, mask)
    with torch.no_grad():  # a forward's conditions (where gradients flow, ATen's attention runs)
        assert in_c(q)
        assert torch.equal(attend(q, k, v, mask), got) and torch.equal(attend(q, k, v, _additive(mask, q.dtype)), got)
    assert torch.equal(got[1, :, 2], torch.zeros(H, dim, dtype=torch.bfloat16))
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double().repeat_interleave(3, 1), v.double().repeat_interleave(3, 1), attn_mask=mask)
    ref[1, :, 2] = 0
    torch.testing.assert_close(got.double(), ref, atol=2e-2, rtol=0)
    for b in range(B):
        for i in range(t):
            seen = mask[b, 0, i].nonzero()[:, 0]
            if not len(seen):
                continue
            # the seen keys at other slots: every other slot of a longer cache, junk between them
            spread = 2 * torch.arange(len(seen)) + 1
            k2, v2 = (torch.randn(1, KV, 2 * len(seen) + 3, dim, generator=gen).bfloat16() for _ in range(2))
            k2[0, :, spread], v2[0, :, spread] = k[b, :, seen], v[b, :, seen]
            row = torch.zeros(1, 1, 1, k2.shape[2], dtype=torch.bool)
            row[..., spread] = True
            alone = native.attend_bf16(q[b : b + 1, :, i : i + 1], k2, v2, row)
            assert torch.equal(alone[0, :, 0], got[b, :, i]), (b, i)
    strided_k, strided_v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (k, v))  # [B, L, KV, D] memory
    assert not strided_k.is_contiguous()
    assert torch.equal(native.attend_bf16(q, strided_k, strided_v, mask[:, 0]), got)
    with pytest.raises(TypeError):
        native.attend_bf16(q.float(), k, v, mask)


@pytest.mark.parametrize("t", [3, 40])
@pytest.mark.parametrize("D", [12, 64])  # 64: the offline target's head size
def test_the_rope_and_cache_call_gives_the_bits_of_rotate_and_index_copy(t, D):
    """native.rope_store_bf16 (a bf16 layer's step after its projection, on a CPU): q rotated, k rotated and v
    written at the given slots, bitwise what leanllama.rotate and index_copy_ give (ATen's roundings: each
    product rounded to bfloat16, then the sum); other slots untouched; float32 refused. 80 rows: the rows
    shared among threads."""
    from specviz.models import native
    from specviz.models.leanllama import rotate

    if not native.runs_here():
        pytest.skip("specviz's C functions do not run here")
    gen = torch.Generator().manual_seed(0)
    B, H, KV, C = 2, 6, 2, 50
    qkv = torch.randn(B, t, H + 2 * KV, D, generator=gen).bfloat16()
    angle = torch.randn(B, t, D, generator=gen) * 3
    cos, sin = angle.cos().bfloat16()[:, :, None], angle.sin().bfloat16()[:, :, None]  # [B, t, 1, D], as a forward
    slots = torch.randperm(C, generator=gen)[:t]
    k_ours, v_ours = (torch.randn(B, KV, C, D, generator=gen).bfloat16() for _ in range(2))
    k_ref, v_ref = k_ours.clone(), v_ours.clone()
    q = native.rope_store_bf16(qkv, cos, sin, slots, k_ours, v_ours, H)
    qk = rotate(qkv[:, :, : H + KV], cos, sin).transpose(1, 2)
    k_ref.index_copy_(2, slots, qk[:, H:])
    v_ref.index_copy_(2, slots, qkv[:, :, H + KV :].transpose(1, 2))
    assert q.shape == (B, H, t, D) and torch.equal(q, qk[:, :H])
    assert torch.equal(k_ours, k_ref) and torch.equal(v_ours, v_ref)
    with pytest.raises(ValueError):
        native.rope_store_bf16(qkv.float(), cos, sin, slots, k_ours, v_ours, H)


@pytest.mark.parametrize("kind", ["dynamic", "none"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_every_cache_runs_the_static_caches_forward_where_the_model_has_one(pattern_pair, arch, kind, monkeypatch):
    """For a Llama-family model `dynamic` (keys and values grown by each forward, cut on rollback) and `none` (none
    kept: each forward runs the whole text) run the lean forward the static cache runs (transformers' forward is
    never called), so the kinds differ in the cache alone, and a verify's logits and hidden states are the static
    cache's, after a rollback too; other architectures run transformers' own (its DynamicCache; the whole text)."""
    pair = pattern_pair(arch)
    lean = LeanLlama.supports(pair.target)
    assert lean == (arch == "llama")
    backend = make_backend(pair.target, kind, 8)
    ours, theirs = {"dynamic": (LeanDynamicBackend, DynamicBackend), "none": (LeanNoCacheBackend, NoCacheBackend)}[kind]
    assert isinstance(backend, ours if lean else theirs)
    V, prompt, drafts, verify = pair.vocab_size, words(0, 1, 2, 3), words(3, 7, 8), words(3, 4, 5)
    out = {}
    with torch.inference_mode():
        for cache in ("static", kind):
            state = KVState(pair.target, 1, cache, V, capacity=12)
            state.prefill([prompt], PAD)
            if cache == kind and lean:  # transformers' forward may not run: the lean one does
                monkeypatch.setattr(type(pair.target), "forward", lambda *a, **k: pytest.fail("transformers' forward"))
            start = state.width
            state.forward(torch.tensor([drafts]), [[True] * 3])  # a verify whose drafts are all rejected
            state.make_holes(0, start, start + 3)
            state.trim()
            got = state.forward(torch.tensor([verify]), [[True] * 3], hidden=True)
            out[cache] = got.logits[0], got.hidden[0]
            monkeypatch.undo()
    assert out[kind][0].shape == (3, V) and out[kind][1].shape[0] == 3  # the new tokens' rows, not the text's
    for mine, static in zip(out[kind], out["static"], strict=True):
        torch.testing.assert_close(mine, static, atol=1e-5, rtol=1e-5)
