"""A lean forward for Llama-family models over a pre-allocated KV cache (gpt-fast's shape).

On a CPU a small model's step costs mostly overhead, not arithmetic: SmolLM2-135M reads 270 MB of
bf16 weights per step, which memory streams in a few milliseconds, yet transformers' eager forward
takes several times that. This forward is the same maths in fewer, larger operations: q, k, v in
one matmul, gate and up in one, keys and values written into a static cache at slot indices
(rolling back is moving a length), and on a CPU each matrix product through the kernel this
machine measured fastest for its shape and row count (kernels.py), weights packed for it once.

Compiled (`compile=True`): torch.compile (inductor) of the same module at fixed shapes, so that a
handful of graphs serve every γ: a forward of t tokens is padded with holes to the next width in
WIDTHS, attention always spans the whole cache (its capacity rounded up to CAPACITY_STEP times a
power of two), and the slots to write are a tensor. On a CPU the graph calls the same chosen,
pre-packed matmuls as one opaque operator each (`packed_linear`), so its weights stay inputs and the
graph can be cached on disk under the specviz cache folder (TORCHINDUCTOR_CACHE_DIR): a second start
loads it instead of compiling again. On CUDA the graphs are replayed as CUDA graphs, their caches at
fixed addresses (LeanCache). If compiling fails (no C++
compiler, an unsupported operator), the model falls back to the eager forward and says why.

It reuses the model's own rotary embedding module (so RoPE scaling variants are the model's) and
computes RMSNorm as transformers does (in float32), so float32 output matches transformers'.
Supported: model_type llama and qwen3 (with its q/k norms), SiLU MLP.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import time
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters
from transformers import PreTrainedModel

from . import contention, kernels, native
from .cachedir import cache_root

SUPPORTED = ("llama", "qwen3")
# compiled forwards: tokens per forward, padded up to one of these; a tree of MAX_NODES drafts and the last token
# fits the last (wider, every drafted node verified: eager, said once). A width costs a graph only once used
WIDTHS = (1, 4, 8, 16, 32, 64)
CAPACITY_STEP = 256  # compiled forwards: cache capacity is this times a power of two (few shapes, few graphs)
GRAPHS = 64  # compiled forwards: shapes compiled per process, all models together (dynamo's limit); past it, eager
SPARE_SETS = 4  # compiled caches a model keeps for reuse once their runs end
CALL_CONTEXT, CALL_REPEATS = 64, 5  # LeanLlama.timed_ways: the slots a timed forward attends over; its repeats
ALONE = ", rows alone"  # LeanLlama.timed_ways: a way timed with the row-by-row C functions on one thread
# a Linear's plan has a path for each row class (kernels.row_class): each timed row count and all above the largest,
# alone and in native.layers' call; CLASS_ROWS: a row count of each, and whether in the call
CLASS_ROWS = tuple((rows, in_call) for rows in (*kernels.ROWS, kernels.ROWS[-1] + 1) for in_call in (False, True))
CLASSES = tuple((in_call, kernels.row_class(rows)) for rows, in_call in CLASS_ROWS)


class Plan(dict):
    """A Linear's path for each row class (CLASSES), made once: a forward only reads it (it refuses changes, and
    copies whole with the model)."""

    def _frozen(self, *args, **kwargs):
        raise TypeError("a Linear's plan is made once (Linear.plan makes a new one)")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _frozen

    def __reduce__(self):
        return Plan, (dict(self),)


# choose(weight, rows, lossy, in_call) -> the path of a product of `rows` rows, as kernels.choose reads this machine's
# table: a plan made by another rule (a test's fixed paths) is given as one
Chooser = Callable[[torch.Tensor, int, bool, bool], str]

log = logging.getLogger("specviz")
_SAID_EAGER: set[int] = set()  # forward widths past the compiled ones, said once a process
PROGRESS = {"progress": True}  # a log record that reports progress (shown as it happens), not a problem


def compiled_capacity(slots: int) -> int:
    """A compiled cache's capacity for `slots`: CAPACITY_STEP times a power of two, so that runs of many
    lengths share a few shapes (each shape is a graph per width; dynamo keeps a bounded number)."""
    steps = -(-slots // CAPACITY_STEP)
    return CAPACITY_STEP << (steps - 1).bit_length()


def fresh(x: torch.Tensor) -> torch.Tensor:
    """x with the strides a new tensor of its shape has (itself if it has them): a compiled graph is specialised
    to its inputs' strides, so a view (a column of a stacked tensor, say) would compile it again, even where
    it differs only in the stride of a dimension of size 1."""
    strides, step = [], 1
    for n in reversed(x.shape):
        strides.append(step)
        step *= max(n, 1)
    return x if x.stride() == tuple(reversed(strides)) else x.clone(memory_format=torch.contiguous_format)


def slot_mask(real: torch.Tensor, start: int, kv_len: int, visible: torch.Tensor | None = None,
              first: int | None = None) -> torch.Tensor:
    """[B, 1, t, kv_len] bool, True = may attend, for queries in slots start..start+t-1.

    real: [B, start + t], which slots hold tokens. A query sees real slots up to its own; a
    hole's query also sees itself, so no row of the mask is empty (an empty row gives NaN that
    would reach the cache). visible [B, n, n]: a tree of n slots from slot `first` (default start)
    to the end, where a query sees only the slots visible says (itself and its ancestors) among them.
    """
    batch, width = real.shape
    cols = torch.arange(kv_len, device=real.device)
    q_slot = torch.arange(start, width, device=real.device)[:, None]  # [t, 1]
    padded = torch.zeros(batch, kv_len, dtype=torch.bool, device=real.device)
    padded[:, :width] = real
    mask = (cols <= q_slot)[None] & padded[:, None, :]  # [B, t, kv_len]
    if visible is not None:
        first = start if first is None else first
        n = width - first
        mask[:, first - start :, first:width] &= visible[:, :n, :n]
    return (mask | (cols == q_slot)[None])[:, None]


class Linear(nn.Module):
    """y = x W^T + b, on CPU through the path its plan names for the row count's class (`plan`: made once from
    this machine's kernel table, or given), weights packed for it on first use; elsewhere F.linear. `lossy`: a
    drafter's product, which may take a lossy path (int8) where that is fastest."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, lossy: bool = False,
                 plan: Mapping[tuple, str] | Chooser | None = None):
        super().__init__()
        self.lossy = lossy
        self.weight = nn.Parameter(weight.detach().contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.paths: dict[int, str] = {}  # rows -> path name, as the plan says, noted on first use of a row count
        self.call_paths: dict[int, str] = {}  # rows -> the fastest path native.layers runs, where a layer plan asks
        # (in_call, kernels.row_class) -> path, for every class (CLASSES): made once (`plan`), then only read
        self.chosen: Plan | None = None
        self.packs: dict[tuple[str, int], torch.Tensor] = {}  # (path, rows or 0) -> packed weight
        self.products: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {}  # rows -> the bound product
        self.refused: frozenset[str] = frozenset()  # paths whose pack refused this weight (not of their blocks)
        self.released = ""  # the blocks format whose packed copy is the only copy of the weight (keep_blocks)
        if plan is not None:
            self.plan(plan)

    @torch.inference_mode()
    def plan(self, given: Mapping[tuple, str] | Chooser | None = None) -> Plan:
        """The path of every row class (CLASSES), frozen: `given` (each class's path, or a Chooser asked for each),
        or this machine's fastest as its table has them
        (the shape timed first where the table lacks it: a model loaded without load_pair's load step plans on its
        first forward). A path whose pack refuses the weight (not made of its blocks) is left for the next fastest;
        so the blocks are packed here, once per format (the kernels on one format read one layout). Off a CPU:
        F.linear. A plan made already stands unless one is given."""
        if self.chosen is not None and given is None:
            return self.chosen
        if callable(given):
            given = {(in_call, kernels.row_class(rows)): given(self.weight, rows, self.lossy, in_call)
                     for rows, in_call in CLASS_ROWS}
        self.paths, self.call_paths, self.products = {}, {}, {}
        while True:
            if given is not None:
                chosen = {c: given[c] for c in CLASSES}
            elif self.weight.device.type != "cpu":
                chosen = dict.fromkeys(CLASSES, "linear")
            else:
                if kernels.shape_key(self.weight) not in kernels.table(self.weight.dtype).times:
                    kernels.tune([self.weight])
                refused = {"refused": self.refused} if self.refused else {}
                chosen = {(in_call, kernels.row_class(rows)): kernels.choose(self.weight, rows, self.lossy, in_call,
                                                                             **refused) for rows, in_call in CLASS_ROWS}
            try:
                for name in {n for n in chosen.values() if kernels.PATHS[n].blocks}:
                    self._pack(name, 0)
            except ValueError:  # a weight not made of the path's blocks, of a shape timed on one that is
                if given is not None:
                    raise
                self.refused |= {name}
                continue
            self.chosen = Plan(chosen)
            return self.chosen

    def _pack(self, name: str, rows: int) -> torch.Tensor | None:
        """The weight packed for a path (rows: 0, or the row count of a path that packs per row count), packed now
        where it is not yet; blocks paths of one format share one packed copy."""
        kind = kernels.PATHS[name]
        key = (name, rows)
        packed = self.packs.get(key)
        if packed is None and kind.blocks:
            packed = next((p for (n, _), p in self.packs.items() if kernels.PATHS[n].blocks == kind.blocks), None)
            if packed is not None and not torch.compiler.is_compiling():
                self.packs[key] = packed
        if packed is None and name != "linear" and not torch.compiler.is_compiling():
            with torch.inference_mode():
                packed = self.packs[key] = kind.pack(self.weight, rows)
        return packed

    def path(self, rows: int, in_call: bool = False) -> tuple[str, torch.Tensor | None]:
        """(path, packed weight) for a product of `rows` rows, as the plan has it for their class (rows of one class
        share their timings: a prompt's length is a new row count, but no new choice); packs on first use (not
        while compiling: LeanLlama.compiler packs the compiled widths beforehand). in_call: the fastest path that
        native.layers runs (for a layer plan), which may be slower alone than the one a product op by op takes."""
        if self.chosen is None:
            if torch.compiler.is_compiling():  # planned before tracing, or F.linear
                return "linear", None
            self.plan()
        paths = self.call_paths if in_call else self.paths
        name = paths.get(rows)
        if name is None:
            name = self.chosen[in_call, kernels.row_class(rows)]
            if not torch.compiler.is_compiling():
                paths[rows] = name
        packed = self._pack(name, rows if kernels.PATHS[name].per_rows else 0)
        return ("linear", None) if packed is None and name != "linear" else (name, packed)

    def keep_blocks(self) -> bool:
        """Let the float32 weight go where the file's blocks can serve every call: every row class's path, alone
        and in native.layers' call, reads one format of blocks (kernels.blocks_path: the blocks one where it is
        about as fast). The packed blocks are then its only copy, a fifth of its bytes, and the weight a stand-in
        of its shape (dense() makes it again). Whether it let go."""
        if not self.released and self.weight.device.type == "cpu":
            plan = self.plan()
            kept = {(in_call, kernels.row_class(rows)): kernels.blocks_path(
                self.weight, rows, in_call, plan[in_call, kernels.row_class(rows)], self.refused)
                for rows, in_call in CLASS_ROWS}
            formats = {kernels.PATHS[name].blocks for name in kept.values()}
            if len(formats) == 1 and "" not in formats:
                self.packs = {key: p for key, p in self.packs.items() if kernels.PATHS[key[0]].blocks}
                self.plan(kept)
                self.released = formats.pop()
                self.weight = nn.Parameter(self.weight.new_zeros(()).expand(self.weight.shape), requires_grad=False)
        return bool(self.released)

    def blocks(self) -> torch.Tensor | None:
        """The packed blocks of the weight, where a path packed them."""
        return next((p for (n, _), p in self.packs.items() if kernels.PATHS[n].blocks), None)

    def dense(self) -> torch.Tensor:
        """The float32 weight, made again from the blocks (the same values, bit for bit) where it was let go."""
        if self.released:
            n, k = self.weight.shape
            self.weight = nn.Parameter(native.unpack_blocks(self.blocks(), self.released, n, k), requires_grad=False)
            self.released = ""
        return self.weight

    def forward(self, x: torch.Tensor, packed: bool = True) -> torch.Tensor:
        if not packed:
            return F.linear(x, self.dense(), self.bias)
        rows = x.shape[:-1].numel()
        if torch.compiler.is_compiling():
            name, weight_packed = self.path(rows)
            if name == "linear":
                return F.linear(x, self.weight, self.bias)
            return packed_linear(x, weight_packed, self.weight, self.bias, name, rows)
        product = self.products.get(rows)
        if product is None:
            name, weight_packed = self.path(rows)
            product = self.products[rows] = kernels.PATHS[name].bind(weight_packed, self.weight, self.bias, rows)
        return product(x)


@torch.library.custom_op("specviz::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  path: str, rows: int) -> torch.Tensor:
    """x W^T + b through the weight packed for `path`, as one opaque operator for compiled graphs: inductor
    can only lower oneDNN's packed linear with its own packing, which needs frozen weights, and graphs with
    frozen weights are never cached on disk (they hold oneDNN tensors, which do not pickle), so every start
    would compile again. With our packing as an opaque call the graph takes the weights as inputs and is
    cached; in bf16 it still measures faster than the eager step."""
    return kernels.PATHS[path].run(x, packed, weight, bias, rows)


@packed_linear.register_fake
def _(x, packed, weight, bias, path, rows):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _fused(*linears: nn.Linear) -> Linear:
    """One product of transformers' projections (q, k, v; gate, up), their weights stacked; the projections then
    read their rows of it, so each weight is held once, not twice (a file's pages they viewed let go first)."""
    biases = [lin.bias for lin in linears]
    fused = Linear(torch.cat([lin.weight for lin in linears]), None if biases[0] is None else torch.cat(biases))
    rows = [lin.out_features for lin in linears]
    for lin, weight, bias in zip(linears, fused.weight.split(rows),
                                 fused.bias.split(rows) if fused.bias is not None else [None] * len(rows), strict=True):
        if lin.weight.device.type == "cpu":
            native.drop_file_pages(lin.weight)
        lin.weight = nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias, requires_grad=False)
    return fused


def in_c(x: torch.Tensor, whole_layers: bool = False) -> bool:
    """Whether bfloat16 work on x goes through specviz's C functions: an RMSNorm in one call (native.rms_bf16:
    transformers' roundings, only the sum of squares in another order), where eight small ATen operations
    cost more than the norm's arithmetic, attention (native.attend_bf16, see `attend`), and RoPE with the
    cache writes (native.rope_store_bf16, ATen's roundings). bfloat16 on a CPU; not while compiling
    (inductor fuses the operations itself), not where gradients flow, and not where the library does not
    run. whole_layers: whether x's layers may run in one call (native.layers), which takes float32 too."""
    return (x.dtype in ((torch.bfloat16, torch.float32) if whole_layers else (torch.bfloat16,))
            and x.device.type == "cpu" and not torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and native.runs_here())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, share: bool = True) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalise in float32, scale in the model's dtype (see in_c; share: the rows
    shared among threads there, native.rms_bf16)."""
    if in_c(x):
        return native.rms_bf16(x, weight.to(x.dtype), eps, share)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE, Llama's rotate-half convention: x [..., D] with cos, sin broadcast to it."""
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True = may attend) as the additive one attention makes of it (0 or -inf), once per
    forward instead of once per layer inside it: the same numbers (bitwise, checked)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, lossy: bool = False
           ) -> torch.Tensor:
    """Attention of queries q [B, H, t, D] over keys and values [B, KV, L, D] (query head h reads key head
    h // (H / KV)), mask [B, 1, t, L] (boolean, True = may attend, or additive) -> [B, H, t, D].

    In bfloat16 on a CPU (`in_c`), specviz's own kernel (native.attend_bf16): a query's numbers depend
    only on the keys it sees, in slot order, not on the queries beside it nor on where those keys lie. So a
    verify's row, a tree node (its ancestors apart) and a batch row get the bits a one-token step gets, and
    bfloat16 speculation decodes the plain decoding's tokens where the products are row-invariant too; it
    also costs less than ATen's at these sizes.

    Elsewhere ATen's: a one-token step on a CPU in bfloat16 or float16 asks for the H / KV query heads of a
    key head as one block of H / KV query rows (ATen's flash attention there is slow for a block of one row;
    bitwise the same numbers, a test), and so does a drafter's (`lossy`) at any width. Off the CPU the key
    heads are repeated to the query heads': there the fused kernels refuse a mask beside `enable_gqa` (flash
    takes no mask, memory-efficient no grouped heads), and every call would fall to the math kernel."""
    batch, heads, t, dim = q.shape
    rep = heads // k.shape[1]
    if in_c(q) and native.attends(heads, k.shape[1], dim):
        return native.attend_bf16(q, k, v, mask if mask.dtype == torch.bool else mask == 0)
    if q.device.type != "cpu" and rep > 1:
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)  # [B, H, L, D]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    if (t > 1 and not lossy) or rep == 1 or q.device.type != "cpu" or q.dtype not in (torch.bfloat16, torch.float16):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=rep > 1)
    # a key head's queries as rows: its query heads' t queries in turn, each with its query's mask row
    grouped = q.reshape(batch, heads // rep, rep * t, dim)
    mask = mask[:, :, None].expand(-1, -1, rep, -1, -1).reshape(batch, mask.shape[1], rep * t, mask.shape[-1])
    out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask)
    return out.view(batch, heads, t, dim)


def _use_our_inductor_cache() -> None:
    """Compiled graphs go under the specviz cache folder, unless the user chose a folder."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen is None or os.path.abspath(chosen) == os.path.abspath(default_cache_dir()):  # torch's own default
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_root() / "inductor")


def _vector_isa_known_good() -> bool:
    """Whether this CPU's vector instructions are known to build and load with this compiler and
    torch. inductor finds out in every process (it compiles a probe per instruction set and loads
    each in a child Python: about a second of every compiled start); the verdict is kept in the
    inductor cache folder, so only the first start pays. A graph's disk-cache key includes the
    setting, so the first start asks here too, before compiling anything."""
    from torch._inductor import config, cpp_builder
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    if config.cpp.vec_isa_ok is not None:  # chosen by the user (TORCHINDUCTOR_VEC_ISA_OK)
        return bool(config.cpp.vec_isa_ok)
    try:  # the compiler inductor will use ($CXX or its search list)
        compiler = shutil.which(cpp_builder.get_cpp_compiler()) or ""
    except Exception:  # none found: inductor will say so when it compiles
        return False
    facts = (torch.__version__, platform.machine(), torch.backends.cpu.get_cpu_capability(), compiler,
             os.path.getmtime(compiler) if compiler else 0)
    marker = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]) / "specviz-vec-isa-ok" / hashlib.sha256(
        repr(facts).encode()).hexdigest()[:16]
    if marker.is_file():
        return True
    if not pick_vec_isa():
        return False
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(repr(facts), encoding="utf-8")
    return True


def layer_plan(rows: int, norm1: torch.Tensor, norm2: torch.Tensor, products: tuple[Linear, ...],
               in_call: bool = False) -> tuple[native.Layer, list] | None:
    """A Llama layer's weights for native.layers at this row count (its norms' weights, then for each of its
    products qkv, o, gate_up and down the C function of the path this machine's timings chose for it at this row
    count, its packed weight and its float32 bias), with the biases they point into; or None where the layer does
    not fit the call: a product's path has no C function for the model's dtype (kernels.KernelPath's `layers`;
    packs on first use, as a product would), norms of another dtype, odd widths (the pair kernel takes pairs of
    k). in_call: each product's fastest path that has a C function, not its fastest. The caller checks the heads
    (native.attends)."""
    dtype = products[0].weight.dtype
    if norm1.dtype != dtype or norm2.dtype != dtype or any(lin.weight.shape[1] % 2 for lin in products):
        return None
    made, biases = [], []
    for lin in products:
        name, packed = lin.path(rows, in_call)
        runs = kernels.PATHS[name].layers.get(dtype)
        if runs is None:
            return None
        biases.append(None if lin.bias is None else lin.bias.float().contiguous())
        made.append(native.Product(native.entry(runs), packed.data_ptr(),
                                   None if biases[-1] is None else biases[-1].data_ptr()))
    return native.Layer(norm1.data_ptr(), norm2.data_ptr(), *made), biases


def layers_plan(layers: list[tuple[native.Layer, list] | None]) -> ctypes.Array | None:
    """Layers' layer_plan answers as native.layers' weights (holding the biases they point into), or None where
    one does not fit."""
    if not layers or not all(layers):
        return None
    plan = (native.Layer * len(layers))(*(layer for layer, _ in layers))
    plan.holds = [held for _, held in layers]
    return plan


def silu_mul(gate_up: torch.Tensor, share: bool = True) -> torch.Tensor:
    """SiLU(gate) * up of a fused projection's output [..., 2 I]; in bfloat16 on a CPU (`in_c`) ATen's SiLU of each
    value looked up, in one call with ATen's bits (native.silu_mul_bf16, as native.layers computes it)."""
    if in_c(gate_up):
        return native.silu_mul_bf16(gate_up, share)
    gate, up = gate_up.chunk(2, -1)
    return F.silu(gate) * up


class LeanLayer(nn.Module):
    def __init__(self, layer: nn.Module, heads: int, kv_heads: int, head_dim: int, eps: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.eps = heads, kv_heads, head_dim, eps
        attn, mlp = layer.self_attn, layer.mlp
        self.norm1, self.norm2 = layer.input_layernorm, layer.post_attention_layernorm
        self.qkv = _fused(attn.q_proj, attn.k_proj, attn.v_proj)
        self.q_norm, self.k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)  # Qwen3
        self.o = Linear(attn.o_proj.weight, attn.o_proj.bias)
        self.gate_up = _fused(mlp.gate_proj, mlp.up_proj)
        self.down = Linear(mlp.down_proj.weight, None)

    def timed(self) -> bool:
        """Whether the kernel table has every product's shape, measured with no other load (so choosing reads it)."""
        return all(lin.weight.device.type == "cpu" and kernels.measured(lin.weight)
                   for lin in (self.qkv, self.o, self.gate_up, self.down))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor, slots: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, kv_len: int, packed: bool,
                share: bool = True) -> torch.Tensor:
        """x: [B, t, C]; cos, sin: [B, t, 1, D]. Writes this layer's keys and values at `slots` and
        returns its output [B, t, C]. share: the rows shared among threads in specviz's C functions (rms_norm)."""
        batch, t = x.shape[:2]
        H, KV, D = self.heads, self.kv_heads, self.head_dim
        h = rms_norm(x, self.norm1.weight, self.eps, share)
        qkv = self.qkv(h, packed).view(batch, t, H + 2 * KV, D)  # [B, t, heads of q, k and v, D]
        if in_c(qkv) and self.q_norm is None:  # RoPE and the cache writes in one call, the same bits
            q = native.rope_store_bf16(qkv, cos, sin, slots, k_cache, v_cache, H, share)
        else:
            qk, v = qkv[:, :, : H + KV], qkv[:, :, H + KV :]
            if self.q_norm is not None:  # Qwen3 normalises each head before RoPE
                qk = torch.cat([self.q_norm(qk[:, :, :H]), self.k_norm(qk[:, :, H:])], 2)
            qk = rotate(qk, cos, sin).transpose(1, 2)  # q and k at once; [B, H + KV, t, D]
            q, k, v = qk[:, :H], qk[:, H:], v.transpose(1, 2)
            k_cache.index_copy_(2, slots, k)
            v_cache.index_copy_(2, slots, v)
        o = attend(q, k_cache[:, :, :kv_len], v_cache[:, :, :kv_len], mask)  # [B, H, t, D]
        x = x + self.o(o.transpose(1, 2).reshape(batch, t, H * D), packed)
        h = rms_norm(x, self.norm2.weight, self.eps, share)
        return x + self.down(silu_mul(self.gate_up(h, packed), share), packed)


class LeanLlama(nn.Module):
    """The model's weights rearranged for the lean forward; one per model, shared by its caches."""

    shapes_compiled = 0  # compiled forwards' shapes in this process, all models (they share dynamo's limit)

    @staticmethod
    def supports(model: PreTrainedModel) -> bool:
        spread = len(set((getattr(model, "hf_device_map", None) or {}).values())) > 1  # accelerate's layers
        return LeanLlama.supports_config(model.config) and not spread

    @staticmethod
    def supports_config(cfg) -> bool:
        """Whether a model of this config runs the lean forward (on one device), known before it loads."""
        return (cfg.model_type in SUPPORTED and getattr(cfg, "hidden_act", "silu") == "silu"
                and not getattr(cfg, "use_sliding_window", False) and not getattr(cfg, "mlp_bias", False))

    @classmethod
    def of(cls, model: PreTrainedModel, keep_blocks: bool = False) -> LeanLlama:
        """Built once per model (packing copies the weights): a model is not trained once loaded. keep_blocks: as
        each layer is built, let its float32 weights go where the kernel table (already measured) has it read the
        file's blocks at every call (keep_blocks), so no more than one layer's copies are held at a time."""
        lean = model.__dict__.get("_specviz_lean")
        if lean is None:
            lean = model.__dict__["_specviz_lean"] = cls(model, keep_blocks)
        return lean

    @torch.inference_mode()
    def __init__(self, model: PreTrainedModel, keep_blocks: bool = False):
        super().__init__()
        cfg = model.config
        self.name = getattr(cfg, "_name_or_path", "") or cfg.model_type
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.embed = model.get_input_embeddings()
        self.rotary = model.model.rotary_emb
        self.norm = model.model.norm
        self.head = Linear(model.get_output_embeddings().weight, None)
        self.let: list[tuple[Linear, tuple[nn.Module, ...]]] = []  # products whose float32 went, their sources
        self.layers = nn.ModuleList()
        for layer in model.model.layers:
            self.layers.append(LeanLayer(layer, self.heads, self.kv_heads, self.head_dim, self.eps))
            if keep_blocks and self.layers[-1].timed():
                self._let_go(self.layers[-1], layer)
        self.eval()
        self.compiled = None  # the compiled forward, once asked for
        self.compile_note = ""  # why compiling was given up, if it was
        self.compiled_shapes: set[tuple] = set()
        self.graphs = self.head.weight.device.type == "cuda"  # compiled forwards replay as CUDA graphs
        self.spare: list[tuple] = []  # compiled caches' sets no one holds (`lend`)
        self.native_plans: dict[int, ctypes.Array | None] = {}  # rows -> native_weights' answer
        self.remade = None  # the hook that makes transformers' weights again from the blocks (keep_blocks)
        self.shared_rows: dict[int, bool] = {}  # rows -> whether they are shared among threads (timed_ways)

    def native_weights(self, rows: int) -> ctypes.Array | None:
        """The layers' weights for native.layers at this row count (layer_plan's, layer after layer), or None
        where a layer does not fit it. Where a product's fastest path has no C function, the layers run in one call
        through the fastest paths that have one only if that measured faster on this machine; from two rows on,
        whether the row-by-row C functions share the rows among threads (`shared_rows`) is as measured too
        (`timed_ways`: the fastest way)."""
        if rows not in self.native_plans:
            plan = self._plan(rows)
            per_op = plan is None and (plan := self._plan(rows, in_call=True)) is not None
            if plan is not None and (per_op or rows > 1):
                ms = self.timed_ways(rows, plan, per_op)
                best = min(ms, key=ms.get)
                plan = None if best.startswith("per op") else plan
                self.shared_rows[rows] = not best.endswith(ALONE)
            self.native_plans[rows] = plan
        return self.native_plans[rows]

    def _plan(self, rows: int, in_call: bool = False) -> ctypes.Array | None:
        fits = native.attends(self.heads, self.kv_heads, self.head_dim)
        return layers_plan([layer_plan(rows, layer.norm1.weight, layer.norm2.weight, (
            layer.qkv, layer.o, layer.gate_up, layer.down), in_call) if fits and layer.q_norm is None else None
            for layer in self.layers])

    def forwards_key(self) -> str:
        """The layers' shapes: the model's key in the profile's `forwards`."""
        first = self.layers[0]
        return (f"{len(self.layers)} layers {first.gate_up.weight.shape[1]}x{first.down.weight.shape[1]}, "
                f"{self.heads}/{self.kv_heads} heads of {self.head_dim}")

    @torch.inference_mode()
    def timed_ways(self, rows: int, plan: ctypes.Array, per_op: bool) -> dict[str, float]:
        """ms of a forward of `rows` rows each way it may run here: its layers in one C call through `plan` ("one
        call") and, per_op, op by op through each product's fastest path ("per op"); from two rows on each of them
        also with the row-by-row C functions on one thread (ALONE; else the rows shared among threads; op by op
        only in bfloat16, where those functions run: `in_c`). Timed once per machine, interleaved (the fastest of
        CALL_REPEATS after one to warm up; again while other programs take much of the CPU time: contention.py), at
        the row count whose kernel timings stand for `rows` (kernels.timed_rows), over a context of CALL_CONTEXT
        slots, and kept in the profile's `forwards`."""
        dtype, key, at = self.embed.weight.dtype, self.forwards_key(), kernels.timed_rows(rows)
        ways = {"one call": (plan, True)} | ({"per op": (None, True)} if per_op else {})
        if at > 1:
            ways |= {way + ALONE: (weights, False) for way, (weights, _) in ways.items()
                     if weights is not None or dtype == torch.bfloat16}
        ms = kernels.stored_forward(dtype, key, at)
        if not set(ways) <= set(ms):
            end = CALL_CONTEXT + at
            like = self.embed.weight
            keys = [like.new_zeros(1, self.kv_heads, end, self.head_dim) for _ in self.layers]
            values = [torch.zeros_like(k) for k in keys]
            slots = torch.arange(CALL_CONTEXT, end)
            mask = torch.ones(1, 1, at, end, dtype=torch.bool).tril(CALL_CONTEXT)
            ids = torch.zeros(1, at, dtype=torch.long)

            def time_them() -> dict[str, float]:
                times = {way: [] for way in ways}
                for _ in range(CALL_REPEATS + 1):  # the first of each warms up
                    for way, run in ways.items():
                        start = time.perf_counter()
                        self.forward(ids, slots[None], mask, slots, keys, values, end, True, False, last_only=True,
                                     way=run)
                        times[way].append(1000 * (time.perf_counter() - start))
                return {way: min(t[1:]) for way, t in times.items()}

            # timed again while other programs take much of the CPU time, as the products are (contention.py)
            timed, busy = contention.quietest(time_them)
            ms = {**ms, **timed}
            kernels.keep_forward(dtype, key, at, ms, busy)
        return {way: ms[way] for way in ways}

    def linears(self) -> list[Linear]:
        return [m for m in self.modules() if isinstance(m, Linear)]

    @torch.inference_mode()
    def keep_blocks(self, model: PreTrainedModel) -> int:
        """Where a layer's product reads the file's blocks at every row count (Linear.keep_blocks), let its
        float32 weights go, the lean forward's and transformers' model's alike: a GGUF model then holds its
        layers as the file does. transformers' forward (HF `generate`, the dynamic caches, distilling) needs
        them: the first one makes them again from the blocks, the same values. Returns the products let go."""
        for lean, layer in zip(self.layers, model.model.layers, strict=True):
            self._let_go(lean, layer)
        let = self.let
        if let and self.remade is None:
            self.native_plans = {}  # their addresses may have changed
            # The rest (embedding, norms) may be views of the loaded file's memory map, which holds every page of
            # it read while they live: copies of their own let the map, and the weights let go, leave memory.
            standins = {id(source.weight) for _, sources in let for source in sources}
            with torch.inference_mode(False), torch.no_grad():  # tensors as loaded, usable where gradients flow
                for tensor in (*model.parameters(), *model.buffers()):
                    if id(tensor) not in standins:
                        loaded, tensor.data = tensor.data, tensor.data.clone()
                        native.drop_file_pages(loaded)
            self.head.weight.data = model.get_output_embeddings().weight.data

            def remake(module, args, kwargs):
                with torch.inference_mode(False), torch.no_grad():
                    for lin, sources in let:
                        n, k = lin.weight.shape
                        whole = native.unpack_blocks(lin.blocks(), lin.released, n, k) if lin.released else \
                            lin.weight  # made again already (Linear.dense)
                        for source, part in zip(sources, whole.split([s.out_features for s in sources]),
                                                strict=True):
                            source.weight = nn.Parameter(part.clone(), requires_grad=False)
                self.remade.remove()

            self.remade = model.register_forward_pre_hook(remake, with_kwargs=True)
        return len(let)

    def _let_go(self, lean: LeanLayer, layer: nn.Module) -> None:
        """keep_blocks for one layer: each product not let go yet that can read only its blocks lets its float32
        weights go, the lean forward's and its sources' in transformers' model (their file pages too)."""
        attn, mlp = layer.self_attn, layer.mlp
        for lin, sources in ((lean.qkv, (attn.q_proj, attn.k_proj, attn.v_proj)), (lean.o, (attn.o_proj,)),
                             (lean.gate_up, (mlp.gate_proj, mlp.up_proj)), (lean.down, (mlp.down_proj,))):
            if not lin.released and lin.keep_blocks():
                for source in sources:
                    native.drop_file_pages(source.weight)
                    source.weight = nn.Parameter(lin.weight[: source.out_features], requires_grad=False)
                self.let.append((lin, sources))

    def weights_read(self) -> str:
        """What a one-token step reads of the weights, by the paths it takes: e.g. "the GGUF's blocks (Q4_1, Q8_0),
        97 MB a step" or "float32, 538 MB a step"."""
        nbytes, kinds = 0, set()
        for lin in self.linears():
            name, packed = lin.path(1)
            fmt = kernels.PATHS[name].blocks
            nbytes += packed.numel() * packed.element_size() if fmt else lin.weight.numel() * lin.weight.element_size()
            kinds.add(fmt.upper() if fmt else str(lin.weight.dtype).removeprefix("torch."))
        blocks = sorted(k for k in kinds if k.startswith("Q"))
        parts = ([f"the GGUF's blocks ({', '.join(blocks)})"] if blocks else []) + sorted(kinds - set(blocks))
        return f"{' and '.join(parts)}, {nbytes / 1e6:.0f} MB a step"

    def backend(self, capacity: int, compile: bool = False) -> LeanCache:
        return LeanCache(self, capacity, compile and self.compiler() is not None)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, slots: torch.Tensor,
                keys: list[torch.Tensor], values: list[torch.Tensor], kv_len: int, packed: bool,
                hidden: bool, last_only: bool = False, keep: int = 0,
                way: tuple[ctypes.Array | None, bool] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids, positions: [B, t] at cache slots `slots` [t]; mask: [B, 1, t, kv_len]. Attention
        spans slots [0, kv_len). Returns logits [B, t, V] (or [B, 1, V] for the last position only, [B, keep, V]
        for the last `keep`) and, if asked, the last hidden state [B, t, C]. way: (the layers' weights for one C
        call or None, whether the row-by-row C functions share their rows), to run it that way (timed_ways);
        else the way this machine's timings chose for the row count."""
        x = self.embed(ids)  # [B, t, C]
        rows, whole = ids.numel(), packed and in_c(x, whole_layers=True)
        if way is None:  # the C functions' rows shared among threads, as timed
            way = self.native_weights(rows) if whole else None, self.shared_rows.get(rows, True)
        weights, share = way[0] if whole else None, way[1]
        if weights is None and not in_c(x):  # the C attention reads the boolean mask
            mask = _additive(mask, x.dtype)
        cos, sin = self.rotary(x, positions)  # [B, t, D]
        cos, sin = cos[:, :, None], sin[:, :, None]  # [B, t, 1, D], broadcast over heads
        if weights is not None:  # every layer in one C call (in bfloat16 the same bits)
            shape = (self.heads, self.kv_heads, self.head_dim, self.layers[0].down.weight.shape[1])
            x = native.layers(x, weights, keys, values, cos, sin, slots, mask, kv_len, shape, self.eps, share)
        else:
            for layer, k_cache, v_cache in zip(self.layers, keys, values, strict=True):
                x = layer(x, cos, sin, mask, slots, k_cache, v_cache, kv_len, packed, share)
        x = rms_norm(x, self.norm.weight, self.eps, share)
        return self.head(x[:, -1:] if last_only else x[:, -keep:] if keep else x, packed), x if hidden else None

    def compiler(self):
        """The compiled forward (made once), or None with `compile_note` saying why not."""
        first = self.compiled is None and not self.compile_note
        if compile_fixed(self, self, self.head.weight.device) is not None and first:
            for lin in self.linears():  # packed before tracing: graphs take the packed weights as inputs
                for width in WIDTHS:
                    lin.path(width)
        return self.compiled

    def run_compiled(self, args: tuple) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """One compiled forward, or None after giving up on compiling (the caller runs eager)."""
        ids, keys = args[0], args[4]
        return run_fixed(self, (tuple(ids.shape), tuple(keys[0].shape)), f"{ids.shape[1]} token(s)", args)


def lend(spare: list, graphs: bool, shape: tuple[int, int, int, int], layers: int, like: torch.Tensor
         ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """A compiled cache's set: one tensor [2 layers, rows, kv heads, slots, head dim] with at least `shape`'s slots,
    and its layers' keys and values as views of it (so that moving or copying rows is one operation for every
    layer, not one per layer; the graphs take the views, which do not overlap). The spare set with the fewest
    slots that fits (zeroed), else a new one, its views marked as fixed-address graph inputs where graphs."""
    batch, kv_heads, capacity, head_dim = shape
    fits = [i for i, (stack, _, _) in enumerate(spare) if stack.shape[1] == batch and stack.shape[3] >= capacity
            and stack.dtype == like.dtype and stack.device == like.device]
    if fits:
        lease = spare.pop(min(fits, key=lambda i: spare[i][0].shape[3]))
        lease[0].zero_()
        return lease
    stack = like.new_zeros((2 * layers, *shape))
    keys, values = list(stack[:layers].unbind()), list(stack[layers:].unbind())
    if graphs:  # the graphs write into these in place; a new address re-records them, not recompiles
        for cache in keys + values:
            torch._dynamo.mark_static_address(cache, guard=False)
    return stack, keys, values


def give_back(spare: list, lease: list) -> None:
    """A compiled cache's set (lease[0]), back among the spares (the newest SPARE_SETS are kept)."""
    if lease[0] is not None:
        spare.append(lease[0])
        lease[0] = None
        del spare[:-SPARE_SETS]


def compile_fixed(owner, fn: Callable, device: torch.device) -> Callable | None:
    """owner.compiled: fn compiled at fixed shapes (made once; CUDA graphs where owner.graphs), or None with
    owner.compile_note saying why not. owner: a lean model or a draft head (name, graphs, compiled,
    compile_note, compiled_shapes)."""
    if owner.compiled is None and not owner.compile_note:
        if device.type == "cpu" and not any(shutil.which(cc) for cc in ("c++", "g++", "clang++")):
            owner.compile_note = "no C++ compiler found (inductor needs one on a CPU)"
        else:
            _use_our_inductor_cache()
            options = {"triton.cudagraphs": owner.graphs}
            if device.type == "cpu" and _vector_isa_known_good():
                options["cpp.vec_isa_ok"] = True
            # dynamo keeps at most recompile_limit graphs per function, and the lean models share one
            # forward: a graph per width, batch size and capacity; run_fixed stops at GRAPHS
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, GRAPHS)
            owner.__dict__["compiled"] = torch.compile(fn, dynamic=False, options=options)  # (not a submodule)
        if owner.compile_note:
            log.warning("specviz: not compiling %s: %s; running eager", owner.name, owner.compile_note)
    return owner.compiled


def run_fixed(owner, shape: tuple, what: str, args: tuple):
    """owner.compiled(*args) at `shape`, or None after giving up on compiling (the caller runs eager): past
    GRAPHS shapes in this process (all owners together), or once compiling failed (said once, with why)."""
    new = shape not in owner.compiled_shapes
    if new and LeanLlama.shapes_compiled >= GRAPHS:  # dynamo would fall back to eager without a word
        log.warning("specviz: %d shapes compiled in this process, the most kept; %s runs a forward of %s "
                    "eager", GRAPHS, owner.name, shape)
        return None
    if new:
        LeanLlama.shapes_compiled += 1
        log.warning("specviz: preparing the compiled forward of %s for %s (compiling takes about "
                    "a minute on a small CPU; later starts load it from %s)", owner.name, what,
                    os.environ.get("TORCHINDUCTOR_CACHE_DIR"), extra=PROGRESS)
        started, hits = time.perf_counter(), counters["inductor"]["fxgraph_cache_hit"]
    try:
        out = owner.compiled(*args)
    except Exception as err:  # noqa: BLE001 - any compiler failure: fall back, and say why
        owner.__dict__["compiled"] = None
        owner.compile_note = f"compiling failed ({type(err).__name__}: {err})"[:500]
        log.warning("specviz: %s; %s runs eager", owner.compile_note, owner.name)
        return None
    if new:
        loaded = counters["inductor"]["fxgraph_cache_hit"] > hits
        log.warning("specviz: ready in %.1f s (%s)", time.perf_counter() - started,
                    "loaded from the disk cache" if loaded else "compiled", extra=PROGRESS)
    owner.compiled_shapes.add(shape)
    return out


class LeanCache:
    """Keys and values [B, kv_heads, capacity, head_dim] per layer, allocated on first use as views of one
    tensor (`stack`), so that `move` and `select` are one operation, not one per layer.

    Compiled, the caches are the graphs' inputs at fixed addresses (CUDA graphs replay at the
    addresses they were recorded with, gpt-fast's caches set up once): a compiled cache borrows a
    spare set of its model's (`LeanLlama.lend`; zeroed, as new) and hands it back when it is
    dropped, so the next run replays the graphs this one recorded; and rows that leave the batch
    stay in their places as holes (`places`), so a run keeps one batch shape."""

    def __init__(self, lean: LeanLlama, capacity: int, compile: bool = False):
        self.lean, self.compile = lean, compile
        self.capacity = compiled_capacity(capacity) if compile else capacity
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.stack: torch.Tensor | None = None  # every layer's keys then values, [2 layers, B, ...]
        self.places: list[int] | None = None  # compiled, once rows left: each live row's row in the caches
        self.place_index: torch.Tensor | None = None  # the same, on the device
        self.lease: list = [None]  # compiled: the set held, handed back when this cache is dropped
        if compile:
            weakref.finalize(self, give_back, lean.spare, self.lease)

    def _hold(self, batch: int, like: torch.Tensor) -> None:
        """Caches for `batch` rows of self.capacity slots (compiled: the model's spare set, if one fits)."""
        lean = self.lean
        shape = (batch, lean.kv_heads, self.capacity, lean.head_dim)
        if self.compile:
            old = self.lease[:]
            lent = lend(lean.spare, lean.graphs, shape, len(lean.layers), like)
            self.lease[0] = self.stack, self.keys, self.values = lent
            give_back(lean.spare, old)
            self.capacity = self.keys[0].shape[2]
        else:
            self._stacked(like.new_zeros((2 * len(lean.layers), *shape)))

    def _stacked(self, stack: torch.Tensor) -> None:
        self.stack, layers = stack, len(self.lean.layers)
        self.keys, self.values = list(stack[:layers].unbind()), list(stack[layers:].unbind())

    def _reserve(self, batch: int, need: int, like: torch.Tensor) -> None:
        """Allocate on first use; batches with holes may outgrow a single run's capacity: double it."""
        if self.keys and need <= self.capacity:
            return
        old = self.stack
        if old is not None:
            self.capacity = compiled_capacity(need) if self.compile else max(2 * self.capacity, need)
            batch = old.shape[1]
        self._hold(batch, like)
        if old is not None:
            self.stack[:, :, :, : old.shape[3]] = old

    def _width(self, t: int) -> int:
        """Slots a forward of t tokens runs: a compiled forward pads t to the next compiled width."""
        if self.compile and self.lean.compiled is not None:
            if t > WIDTHS[-1] and t not in _SAID_EAGER:
                _SAID_EAGER.add(t)
                log.warning("specviz: a %d-token forward runs eager: compiled forwards take at most %d tokens", t,
                            WIDTHS[-1])
            return next((w for w in WIDTHS if w >= t), t)
        return t

    @torch.inference_mode()
    def forward(self, ids, positions, real, start, hidden, last_only, visible=None):
        t = ids.shape[1]
        width = self._width(t)
        if width > t:  # pad with holes: their slots are written, attended by nothing, and overwritten later
            pad = width - t
            ids, positions = F.pad(ids, (0, pad)), F.pad(positions, (0, pad))
            real = F.pad(real, (0, pad))
            visible = None if visible is None else F.pad(visible, (0, pad, 0, pad))
        if self.places is not None:  # rows have left: the live ones run in their places, the others as holes
            ids, positions, real = (self._spread(x) for x in (ids, positions, real))
            visible = None if visible is None else self._spread(visible)
        self._reserve(ids.shape[0], start + width, self.lean.embed.weight)
        slots = torch.arange(start, start + width, device=ids.device)
        out, replayed = None, False
        if self.compile and self.lean.compiled is not None and width in WIDTHS:
            # attention spans the whole cache; hidden states always, so one graph per width serves
            # drafters that read them and those that do not
            args = (fresh(ids), fresh(positions), slot_mask(real, start, self.capacity, visible), slots, self.keys,
                    self.values, self.capacity, True, True)
            out = self.lean.run_compiled(args)  # None: compiling was given up, run eager
            replayed = out is not None and self.lean.graphs
        if out is None:
            end = start + width
            out = self.lean(ids, positions, slot_mask(real, start, end, visible), slots, self.keys, self.values, end,
                            True, hidden, last_only and width == t)
        logits, h = out
        if logits.shape[1] == width:  # every slot's logits: the real tokens' are the first t
            logits = logits[:, t - 1 : t] if last_only else logits[:, :t]
        h = h[:, :t] if hidden else None
        if self.places is not None:
            return logits[self.place_index], None if h is None else h[self.place_index]  # (copies)
        if replayed:  # a CUDA graph's outputs live in its buffers, which the next replay overwrites
            return logits.clone(), None if h is None else h.clone()
        return logits, h

    def _spread(self, x: torch.Tensor) -> torch.Tensor:
        """[live rows, ...] -> [the caches' rows, ...]: zeros (holes) in the rows that left."""
        full = x.new_zeros((self.keys[0].shape[0],) + x.shape[1:])
        full[self.place_index] = x
        return full

    def crop(self, width: int) -> None:
        pass  # the next forward writes from `width` on; the mask hides what lies beyond

    def move(self, row: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy a row's keys and values from slots src to slots dst (a tree's kept path to consecutive slots)."""
        row = row if self.places is None else self.places[row]
        caches = self.stack[:, row]  # [2 layers, KV, capacity, D]
        caches.index_copy_(2, dst, caches.index_select(2, src))

    def select(self, index: torch.Tensor) -> None:
        """Keep these rows (in this order; a row may repeat). Compiled, rows that only leave stay put."""
        if not self.compile or not self.keys:
            if self.stack is not None:
                self._stacked(self.stack[:, index])
            return
        rows = index.tolist()
        if self.places is not None:
            rows = [self.places[r] for r in rows]
        if len(set(rows)) == len(rows):
            self.places = None if rows == list(range(self.keys[0].shape[0])) else rows
            self.place_index = None if self.places is None else torch.tensor(rows, device=index.device)
            return
        old = self.stack  # rows repeat: a set for as many rows
        self._hold(len(rows), self.lean.embed.weight)
        self.stack.copy_(old[:, rows])
        self.places = self.place_index = None
