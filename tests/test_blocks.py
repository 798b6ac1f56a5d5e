"""The kernels on a GGUF model's own blocks (gemm_blocks.c): the float32 model's weights, bit for bit, in a fifth
of the bytes; the same sums as specviz's float32 kernel at every row count; weights of other kinds refused."""

import pytest
import torch

from specviz.models import kernels, native

pytestmark = pytest.mark.skipif(bool(native._capability()), reason="needs AVX2 and FMA")

FORMATS = {"q4_1": native.as_q4_1, "q8_0": native.as_q8_0}


def made(fmt: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return FORMATS[fmt](torch.randn(n, k, generator=gen) * 0.05)


def wide() -> bool:
    try:
        native.wide()
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(96, 64), (100, 160), (7, 32)])  # whole blocks, a cut last block, one block
@pytest.mark.parametrize("avx512", [False, pytest.param(True, marks=pytest.mark.skipif(not wide(),
                                                                                      reason="needs AVX-512"))])
def test_the_blocks_kernel_gives_the_float32_kernels_bits_at_every_row_count(fmt, shape, avx512):
    """Each output is the float32 kernel's chain of FMAs on the same float32 weights, so the sums agree bit for
    bit with specviz_gemm's at 1-25 rows (the AVX-512 kernel's too: passes of 12 rows), bias added, and a row's
    result is the same alone as beside others."""
    w = made(fmt, *shape)
    bias = torch.randn(shape[0])
    ours = native.bind_blocks(native.pack_blocks(w, fmt, avx512), w, bias, fmt, avx512)
    floats = native.bind(native.pack(w), w, bias)
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 12, 13, 25):
        x = torch.randn(rows, shape[1])
        y = ours(x)
        assert torch.equal(y, floats(x)), (rows, (y - floats(x)).abs().max())
        assert torch.equal(ours(x[-1:]), y[-1:])  # the last row alone: the same bits
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w, bias), rtol=1e-5, atol=1e-5)


def test_the_blocks_are_found_again_from_the_float32_weights():
    """A Q4_1 (Q8_0) weight made float32 is split into d, m and q again that rebuild it exactly; its packed
    bytes are the file's size, 0.625 (1.0625) a weight for whole blocks of 16 columns."""
    w = made("q4_1", 64, 96)
    d, m, q = native.q4_1_blocks(w)
    assert d.dtype == m.dtype == torch.float16 and int(q.max()) <= 15
    rebuilt = d.float().repeat_interleave(32, 1) * q.float() + m.float().repeat_interleave(32, 1)
    assert torch.equal(rebuilt, w)
    assert native.pack_blocks(w, "q4_1").numel() == 64 * 96 * 5 // 8
    w8 = made("q8_0", 64, 96)
    d8, q8 = native.q8_0_blocks(w8)
    assert torch.equal(d8.float().repeat_interleave(32, 1) * q8.float(), w8)
    assert native.pack_blocks(w8, "q8_0").numel() == 64 * 96 * 17 // 16


def test_weights_not_made_of_blocks_are_refused():
    """A plain float32 weight, k not a multiple of 32, or Q8_0 asked of a Q4_1 weight: ValueError, which the
    kernel table and `Linear` take as "not this path for this weight"."""
    with pytest.raises(ValueError, match="not Q4_1"):
        native.pack_blocks(torch.randn(32, 64), "q4_1")
    with pytest.raises(ValueError, match="multiple of 32"):
        native.pack_blocks(native.as_q4_1(torch.randn(32, 64))[:, :48], "q4_1")
    with pytest.raises(ValueError):
        native.pack_blocks(made("q4_1", 32, 64), "q8_0")


def test_the_table_leaves_out_a_blocks_path_for_weights_not_of_its_blocks():
    """Timing a shape whose weights are plain float32: the blocks paths are not timed, so never chosen for it;
    for Q4_1 weights the q4 path is timed beside avx2."""
    plain = [torch.randn(48, 64)]
    cells = kernels._time_cells(plain, [kernels.PATHS[p] for p in ("avx2", "q4", "q8")], [1])
    assert set(cells["1"]) == {"avx2"}
    cells = kernels._time_cells([made("q4_1", 48, 64)], [kernels.PATHS[p] for p in ("avx2", "q4", "q8")], [1])
    assert set(cells["1"]) == {"avx2", "q4"}


def test_a_linear_whose_weight_a_chosen_blocks_path_refuses_takes_the_next_path(fresh_tables):
    """A shape timed on Q4_1 weights, another weight of it that is not: its pack refuses it, the plan takes the
    next fastest path and the product says the same numbers."""
    from specviz.models.leanllama import Linear

    timed("48x64", q4=0.5, avx2=1.0)
    w = torch.randn(48, 64)
    linear = Linear(w, None)
    x = torch.randn(2, 64)
    assert torch.equal(linear(x), native.bind(native.pack(w), w, None)(x))
    assert linear.refused == {"q4"} and linear.paths == {2: "avx2"} and set(linear.chosen.values()) == {"avx2"}


def test_a_linear_runs_the_plan_it_is_given_and_refuses_one_its_weight_cannot_take(fresh_tables):
    """A plan given is the plan: every row class on it, whatever the table says; one that names a blocks path
    for a weight not made of those blocks is refused when given, not at a forward."""
    from specviz.models.leanllama import CLASSES, Linear

    timed("48x64", q4=0.5, avx2=1.0)
    w, x = made("q4_1", 48, 64), torch.randn(3, 64)
    linear = Linear(w, None, plan=dict.fromkeys(CLASSES, "avx2"))
    assert torch.equal(linear(x), native.bind(native.pack(w), w, None)(x)) and linear.paths == {3: "avx2"}
    with pytest.raises(TypeError):
        linear.chosen[False, (1, True)] = "q4"  # frozen: a forward only reads it
    with pytest.raises(ValueError):
        Linear(torch.randn(48, 64), None, plan=dict.fromkeys(CLASSES, "q4"))


def test_the_blocks_unpack_to_the_weight_they_were_packed_from():
    """unpack_blocks, which makes a let-go weight again, gives the float32 values packed, bit for bit."""
    for fmt in FORMATS:
        for shape in ((96, 64), (100, 160), (7, 32)):
            w = made(fmt, *shape)
            assert torch.equal(native.unpack_blocks(native.pack_blocks(w, fmt), fmt, *shape), w)


def timed(shape: str, **ms: float) -> None:
    """The float32 table's cells for a shape: these paths at these ms, at every row count."""
    kernels.table(torch.float32).times[shape] = {str(r): dict(ms) for r in kernels.ROWS}


def test_a_weight_of_blocks_keeps_only_them_where_they_serve_every_call(fresh_tables):
    """Where a blocks path is the fastest (or within BLOCKS_MARGIN of it) at every row count, the float32 weight
    goes: a stand-in of its shape with no bytes; products give the same bits as before; dense() makes the weight
    again. Where a float path is clearly faster at some row count, the weight stays."""
    from specviz.models.leanllama import Linear

    w = made("q4_1", 48, 64)
    x = torch.randn(3, 64)
    timed("48x64", avx2=1.0, q4=1.1)  # within the margin: blocks everywhere
    lin = Linear(w, None)
    before = lin(x)
    assert lin.keep_blocks() and lin.released == "q4_1"
    assert lin.weight.shape == w.shape and lin.weight.untyped_storage().nbytes() <= 4
    assert set(lin.chosen.values()) == {"q4"} and torch.equal(lin(x), before)
    assert torch.equal(lin.dense(), w) and not lin.released
    timed("48x64", avx2=1.0, q4=2.0)
    kept = Linear(w, None)
    assert not kept.keep_blocks() and torch.equal(kept.weight, w)
    timed("48x64", avx2=1.0)  # no blocks path timed (a plain weight of the shape): nothing to keep
    assert not Linear(w, None).keep_blocks()


def test_specviz_blocks_0_keeps_to_the_float32_weights(fresh_tables, monkeypatch):
    timed("48x64", avx2=1.0, q4=0.1)
    assert kernels.table(torch.float32).best("48x64", 1) == "q4"
    monkeypatch.setenv("SPECVIZ_BLOCKS", "0")
    assert kernels.table(torch.float32).best("48x64", 1) == "avx2"


@pytest.fixture
def blocks_llama(tmp_path):
    """A Llama whose layers' weights are Q4_1 blocks made float32 (as a GGUF model loads), saved and loaded."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=50, max_position_embeddings=64)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layers" in name and p.dim() == 2:
                p.copy_(native.as_q4_1(p))
    model.save_pretrained(tmp_path / "m")
    return AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32).eval()


def blocks_everywhere(model, ids: torch.Tensor) -> torch.Tensor:
    """The table of blocks_llama's shapes with q4 fastest at every row count (the head's: a float path only); the
    model's logits for ids before anything lets go."""
    for shape in ("128x64", "64x64", "256x64", "64x128"):
        timed(shape, avx2=1.0, q4=0.5)
    timed("50x64", avx2=1.0)
    with torch.inference_mode():
        return model(ids).logits


def test_a_model_of_blocks_lets_its_layers_float32_go_and_transformers_forward_gets_them_back(fresh_tables,
                                                                                               blocks_llama):
    """Every layer product on blocks: lean and transformers' weights alike become stand-ins (the memory goes);
    the lean products give the bits they gave; transformers' first forward makes the weights again, and its
    logits are the ones it gave before."""
    from specviz.models.leanllama import LeanLlama

    model, ids = blocks_llama, torch.tensor([[1, 5, 7, 9]])
    logits = blocks_everywhere(model, ids)
    lean = LeanLlama.of(model)
    x = torch.randn(2, 64)
    before = lean.layers[0].qkv(x)
    assert lean.keep_blocks(model) == 8
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.untyped_storage().nbytes() <= 4 and lean.layers[1].down.released == "q4_1"
    assert torch.equal(lean.layers[0].qkv(x), before)
    assert not model.get_input_embeddings().weight.is_inference()  # copied as loaded: gradients may flow past it
    assert "Q4_1" in lean.weights_read() and "MB a step" in lean.weights_read()
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, logits)
    assert attn.q_proj.weight.untyped_storage().nbytes() == 64 * 64 * 4


def test_auto_weighs_the_blocks_a_models_file_has(fresh_tables):
    """With the model's products given (a GGUF's), float32 is timed reading its blocks: bfloat16 faster on the
    head alone, float32 faster on the whole model where the layers' blocks are the cheapest."""
    for shape, f32, bf16 in (("64x64", {"avx2": 1.0, "q4": 0.2}, 0.5), ("50x64", {"avx2": 1.0}, 0.5)):
        timed(shape, **f32)
        kernels.table(torch.bfloat16).times[shape] = {str(r): {"avx2": bf16} for r in kernels.ROWS}
    assert kernels.compare_dtypes(50, 64)[0] == torch.bfloat16
    dtype, why = kernels.compare_dtypes(50, 64, products=((64, 64, 10, "q4_1"), (50, 64, 1, "")))
    assert dtype == torch.float32 and "11 products" in why


def test_a_measured_machine_lets_each_layer_go_as_the_lean_forward_is_built(fresh_tables, blocks_llama):
    """With the table measured (any start after the first), the float32 copies go layer by layer as they are
    built, not after all are: the same products, the same logits from transformers' forward afterwards."""
    from specviz.models.leanllama import LeanLlama

    model, ids = blocks_llama, torch.tensor([[1, 5, 7, 9]])
    logits = blocks_everywhere(model, ids)
    q = model.model.layers[0].self_attn.q_proj.weight.clone()
    lean = LeanLlama.of(model, keep_blocks=True)
    assert len(lean.let) == 8 and model.model.layers[1].mlp.up_proj.weight.untyped_storage().nbytes() <= 4
    x = torch.randn(2, 64)
    assert torch.equal(lean.layers[0].qkv(x)[:, :64], native.bind(native.pack(q), q, None)(x))  # avx2's bits
    assert lean.keep_blocks(model) == 8  # the rest of the model copied, the remaking hook set
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, logits)


def test_the_pages_of_a_files_map_are_dropped_and_read_again_and_other_memory_is_left(tmp_path):
    """drop_file_pages on a tensor viewing a file's map: the values read the same afterwards (from the file); on a
    tensor of the process's own memory it does nothing (madvise would zero it)."""
    w = torch.randn(1024, 1024)
    (tmp_path / "w.bin").write_bytes(w.numpy().tobytes())
    mapped = torch.from_file(str(tmp_path / "w.bin"), shared=False, size=w.numel(), dtype=torch.float32)
    mapped = mapped.view(1024, 1024)
    assert torch.equal(mapped, w)
    native.drop_file_pages(mapped)
    assert torch.equal(mapped, w)
    own = w.clone()
    native.drop_file_pages(own)
    assert torch.equal(own, w)
