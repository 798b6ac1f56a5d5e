"""A feature-level draft head: drafting from the target's own hidden states (EAGLE).

EAGLE (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty") and
EAGLE-3 (Li et al. 2025): the target's last hidden state f_i at position i already summarises the
context, so one decoder layer that reads it, with the embedding of the token after it, predicts
the token after that. Entry i of the head is (f_i, x_{i+1}) at position i; its output h_i gives q
for x_{i+2}. Drafting further, the head feeds its own output back in place of the target's
feature: entry (h_i, d_{i+2}) at position i + 1 gives q for x_{i+3}, and so on.

    g_i = fc(rms(f_i))                      target feature -> head space   (h_{i-1} when drafted)
    x_i = in_proj([embed(x_{i+1}); g_i])    embed: the target's, frozen
    h_i = mlp(attn(x_i)) with residuals     one Llama-style layer, RoPE, causal over the entries
    q   = softmax(rms(h_i) @ W_out[vocab].T)  W_out: the target's output head, frozen

The output covers a reduced vocabulary (FR-Spec; EAGLE-3): the target's most frequent tokens, so
a head step multiplies by N x D weights, not V x D. q is 0 outside the subset, and the acceptance
rule min(1, p/q) with the residual max(0, p - q) stays exact for any q: a token outside the subset
is simply never drafted, and is reached through the residual.

Training (distill.py, `--kind eagle`) unrolls the layer over its own outputs for a few steps
("training-time test", EAGLE-3), so later draft positions see at training what they see when
drafting. The inference path here is lean (plain tensor operations on a pre-allocated cache whose
rollback is moving a length): a transformers module call per draft step would cost more than the
head's arithmetic.
"""

from __future__ import annotations

import ctypes
import functools
import json
import math
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PreTrainedModel

from . import native
from .leanllama import (
    WIDTHS,
    Linear,
    attend,
    compile_fixed,
    compiled_capacity,
    fresh,
    give_back,
    in_c,
    layer_plan,
    layers_plan,
    lend,
    rotate,
    run_fixed,
    silu_mul,
)

CONFIG_FILE, WEIGHTS_FILE = "eagle_config.json", "eagle_head.safetensors"


@dataclass
class HeadConfig:
    feature: int  # F: width of the target's hidden states
    embed: int  # E: width of the target's input embedding
    width: int  # D: the head's width, the input width of the target's output head
    heads: int
    kv_heads: int
    intermediate: int
    vocab_size: int  # the target's vocabulary the ids below index (checked on load)
    draft_vocab: list[int]  # the target ids the head can draft (N of them)
    target: str = ""  # what it was trained for
    origin: str = ""  # how it was made, shown with the drafter's name
    rope_theta: float = 10000.0
    eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.width // self.heads

    @staticmethod
    def for_target(target: PreTrainedModel, draft_vocab: list[int], vocab_size: int, intermediate: int,
                   name: str = "") -> HeadConfig:
        """The target's own attention shape where it fits the head's width, else one head per 64."""
        feature = target.config.hidden_size
        embed = target.get_input_embeddings().weight.shape[1]
        width = target.get_output_embeddings().weight.shape[1]
        heads = getattr(target.config, "num_attention_heads", 0)
        kv = getattr(target.config, "num_key_value_heads", None) or heads
        if not heads or width % heads or heads % kv or (width // heads) % 2:
            heads = kv = max(1, width // 64) if width % 64 == 0 else 1
        return HeadConfig(feature, embed, width, heads, kv, intermediate, vocab_size, list(draft_vocab), name)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm, fused (the weight cast to x's dtype, as under autocast x may be bf16); drafting on a CPU, in one C
    call where F.rms_norm runs several operations: in bfloat16 the target's, in float32 the one native.layers runs
    (its sum of squares in another order than ATen's: a drafter may round otherwise)."""
    if in_c(x):
        return native.rms_bf16(x, weight.to(x.dtype), eps)
    if x.dtype == torch.float32 and weight.dtype == torch.float32 and in_c(x, whole_layers=True):
        return native.rms_f32(x, weight, eps)
    return F.rms_norm(x, weight.shape, weight.to(x.dtype), eps)


def _rope(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [..., head_dim] for integer positions [...] (Llama's rotate-half convention)."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = positions.float()[..., None] * inv  # [..., head_dim / 2]
    angles = torch.cat([angles, angles], -1)
    return angles.cos(), angles.sin()


@functools.lru_cache(maxsize=4)
def _rope_table(head_dim: int, theta: float, length: int, device: torch.device,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """_rope of positions 0..length-1 in the model's dtype, [length, head_dim] each: a drafting step looks
    its positions up (the same numbers as _rope's cast, in 2 operations instead of 11)."""
    return tuple(t.to(dtype) for t in _rope(torch.arange(length, device=device), head_dim, theta))


def check_head_folder(folder: str | Path) -> Path:
    """`folder` if it holds a head's config; else a ValueError saying how to make one (cheap: asked before any
    model loads)."""
    folder = Path(folder)
    if not (folder / CONFIG_FILE).is_file():
        raise ValueError(f"{folder} holds no EAGLE head ({CONFIG_FILE} missing); make one with "
                         f"`python -m specviz distill --kind eagle`")
    return folder


class EagleHead(nn.Module):
    """The trainable weights; the target's embedding and output rows are bound, not owned."""

    def __init__(self, config: HeadConfig):
        super().__init__()
        c = self.config = config
        kv_width = c.kv_heads * c.head_dim
        self.feature_norm = nn.Parameter(torch.ones(c.feature))
        self.fc = nn.Linear(c.feature, c.width, bias=False)
        self.in_proj = nn.Linear(c.embed + c.width, c.width, bias=False)
        self.attn_norm = nn.Parameter(torch.ones(c.width))
        self.qkv = nn.Linear(c.width, c.width + 2 * kv_width, bias=False)
        self.o = nn.Linear(c.width, c.width, bias=False)
        self.mlp_norm = nn.Parameter(torch.ones(c.width))
        self.gate_up = nn.Linear(c.width, 2 * c.intermediate, bias=False)
        self.down = nn.Linear(c.intermediate, c.width, bias=False)
        self.final_norm = nn.Parameter(torch.ones(c.width))
        for lin in (self.fc, self.in_proj, self.qkv, self.o, self.gate_up, self.down):
            nn.init.normal_(lin.weight, std=0.02)
        self.register_buffer("draft_ids", torch.tensor(c.draft_vocab, dtype=torch.long), persistent=False)
        self.embed_weight: torch.Tensor | None = None  # [V, E] the target's, frozen
        self.out_weight: torch.Tensor | None = None  # [N, D] the target's output rows of draft_ids
        self._lean: dict | None = None  # name -> packed linear, built on first drafting step
        self._lean_linears: dict[str, Linear] | None = None
        self._native_plans: dict[int, ctypes.Array | None] = {}  # rows -> native_weights' answer
        self.name = "the EAGLE head"
        self.compiled = None  # the compiled drafting step (`compiler`), once asked for
        self.compile_note = ""  # why compiling was given up, if it was
        self.compiled_shapes: set[tuple] = set()
        self.graphs = False  # the compiled step replays as CUDA graphs (set by `compiler`)
        self.spare: list[tuple] = []  # compiled caches' sets no one holds (leanllama.lend)

    # -- binding and files ---------------------------------------------------------------------

    def bind(self, target: PreTrainedModel, vocab_size: int) -> EagleHead:
        """Use this target's embedding and output head; ValueError if the head was not made for it."""
        c = self.config
        emb, out = target.get_input_embeddings().weight, target.get_output_embeddings().weight
        shapes = (target.config.hidden_size, emb.shape[1], out.shape[1])
        if shapes != (c.feature, c.embed, c.width) or vocab_size != c.vocab_size:
            raise ValueError(
                f"this EAGLE head was trained for {c.target or 'another target'} (hidden {c.feature}, embedding "
                f"{c.embed}, output {c.width}, vocabulary {c.vocab_size}); the target has hidden {shapes[0]}, "
                f"embedding {shapes[1]}, output {shapes[2]}, vocabulary {vocab_size}")
        self.embed_weight = emb.detach()
        self.out_weight = out.detach()[self.draft_ids.to(out.device)]
        self._lean = self._lean_linears = None
        self._native_plans = {}
        return self

    def save(self, folder: str | Path) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        weights = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in self.state_dict().items()}
        save_file(weights, str(folder / WEIGHTS_FILE))
        (folder / CONFIG_FILE).write_text(json.dumps(asdict(self.config)), encoding="utf-8")

    @classmethod
    def load(cls, folder: str | Path, target: PreTrainedModel, vocab_size: int) -> EagleHead:
        """The head in `folder`, in the target's dtype and device, bound to the target."""
        folder = check_head_folder(folder)
        head = cls(HeadConfig(**json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))))
        head.load_state_dict(load_file(str(folder / WEIGHTS_FILE)))
        head.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)
        return head.bind(target, vocab_size)

    # -- one layer, two ways to attend ---------------------------------------------------------

    def features_in(self, features: torch.Tensor, lean: bool = False) -> torch.Tensor:
        """The target's hidden states [..., F] -> the head's input space [..., D]."""
        return self._linears(lean)["fc"](_rms(features, self.feature_norm, self.config.eps))

    def _entries(self, tokens, g, lin):
        """Entries (g, token) [B, t] -> the layer's input x [B, t, D]."""
        return lin["in_proj"](torch.cat([F.embedding(tokens, self.embed_weight), g], -1))

    def _qkv(self, tokens, g, cos, sin, lin):
        """cos, sin [B, t, hd] at the entries' positions -> x [B, t, D] and q, k, v [B, heads, t, hd]."""
        c = self.config
        x = self._entries(tokens, g, lin)  # [B, t, D]
        qkv = lin["qkv"](_rms(x, self.attn_norm, c.eps)).view(*x.shape[:2], -1, c.head_dim)  # [B, t, all heads, hd]
        qk = rotate(qkv[:, :, : c.heads + c.kv_heads], cos[:, :, None].to(x.dtype), sin[:, :, None].to(x.dtype))
        q, k, v = qk[:, :, : c.heads], qk[:, :, c.heads :], qkv[:, :, c.heads + c.kv_heads :]
        return x, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def _finish(self, x, attended, lin):
        """x [B, t, D], attended [B, heads, t, hd] -> h [B, t, D], the layer's output."""
        x = x + lin["o"](attended.transpose(1, 2).reshape(x.shape))
        return x + lin["down"](silu_mul(lin["gate_up"](_rms(x, self.mlp_norm, self.config.eps))))

    def logits(self, h: torch.Tensor, lean: bool = False) -> torch.Tensor:
        """h [..., D] -> logits [..., N] over the draft vocabulary, through the target's output rows."""
        return self._linears(lean)["out"](_rms(h, self.final_norm, self.config.eps))

    def _linears(self, lean: bool) -> dict:
        if not lean:
            out = self.out_weight
            return {"fc": self.fc, "in_proj": self.in_proj, "qkv": self.qkv, "o": self.o, "gate_up": self.gate_up,
                    "down": self.down, "out": lambda h: h @ out.T}
        if self._lean is None:  # through the kernels this machine measured fastest, as leanllama does
            self._lean = {name: functools.partial(lin, packed=True) for name, lin in self.lean_linears().items()}
        return self._lean

    def lean_linears(self) -> dict[str, Linear]:
        """The drafting step's matrix products (built once per binding)."""
        if self._lean_linears is None:
            self._lean_linears = {name: Linear(getattr(self, name).weight, None, lossy=True)
                                  for name in ("fc", "in_proj", "qkv", "o", "gate_up", "down")}
            self._lean_linears["out"] = Linear(self.out_weight, None, lossy=True)
        return self._lean_linears

    def forward_train(self, tokens: torch.Tensor, features: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Teacher-forced, unrolled `steps` times over the head's own outputs (training-time test).

        tokens [B, L] (x_0..x_{L-1}), features [B, L-1, F] (f_0..f_{L-2}). Returns, per step j = 1..steps,
        h [B, L-1, D] where h[:, i] predicts x_{i+j+1} through `logits` (past the end: garbage, masked).
        Step j's entry at i is (h^{j-1}_i, x_{i+j}) at position i + j - 1 and attends to the real
        entries 0..i and to its own chain's entries at i of steps 2..j: what drafting sees.
        """
        c, lin = self.config, self._linears(False)
        n = features.shape[1]
        rep = c.heads // c.kv_heads
        g = self.features_in(features)
        causal = torch.ones(n, n, dtype=torch.bool, device=tokens.device).tril()
        chain_k, chain_v, outputs = [], [], []
        base = torch.arange(n, device=tokens.device).expand(tokens.shape[0], n)
        for j in range(1, steps + 1):
            step_tokens = F.pad(tokens[:, j:], (0, j - 1))  # x_{i+j}, padded past the end
            x, q, k, v = self._qkv(step_tokens[:, :n], g, *_rope(base + (j - 1), c.head_dim, c.rope_theta), lin)
            if j == 1:
                real_k, real_v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            chain_k.append(k.repeat_interleave(rep, 1))
            chain_v.append(v.repeat_interleave(rep, 1))
            scale = 1 / math.sqrt(c.head_dim)
            scores = (q @ real_k.transpose(-1, -2)) * scale  # [B, h, n, n]
            scores = scores.masked_fill(~causal, float("-inf"))
            # the chain: entries of steps 2..j at the same i (step 1's is the diagonal above)
            diag = [(q * ck).sum(-1, keepdim=True) * scale for ck in chain_k[1:]]  # each [B, h, n, 1]
            weights = torch.cat([scores, *diag], -1).softmax(-1)
            attended = weights[..., :n] @ real_v
            for i, cv in enumerate(chain_v[1:]):
                attended = attended + weights[..., n + i : n + i + 1] * cv
            g = self._finish(x, attended, lin)
            outputs.append(g)
        return outputs

    def step(self, cache: HeadCache, tokens: torch.Tensor, g: torch.Tensor, slots: torch.Tensor,
             positions: torch.Tensor, lean: bool = True, visible: torch.Tensor | None = None, last_only: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write entries (g, token) [B, t] at cache slots [B, t] and attend over slots <= position, or,
        for a tree's entries, over the slots visible [B, t, C + 1] says (the real ones and the ancestors').
        Where no C call runs the layer, a compiled cache's steps run compiled (`compiler`).

        Returns h [B, t, D] (fed back when drafting further) and logits [B, t, N]; last_only: the last entry's
        alone, [B, 1, N], where the step computes them itself (a compiled step's graph gives all t)."""
        c = self.config
        cos, sin = _rope_table(c.head_dim, c.rope_theta, cache.keys.shape[2], positions.device, cache.keys.dtype)
        # [B, t, C + 1]: entries are contiguous from 0
        mask = cache.slot_index <= positions[..., None] if visible is None else visible
        weights = self.native_weights(tokens.numel()) if lean and in_c(g, whole_layers=True) else None
        if weights is not None:  # the layer as one C call (the target's layers' function; in bfloat16 the same bits)
            shape = (c.heads, c.kv_heads, c.head_dim, c.intermediate)
            x = self._entries(tokens, g, self._linears(lean))
            h = native.layers(x, weights, [cache.keys], [cache.values], cos[positions], sin[positions], slots,
                              mask[:, None], cache.keys.shape[2], shape, c.eps)
            return h, self.logits(h[:, -1:] if last_only else h, lean)
        width = next((w for w in WIDTHS if w >= tokens.shape[1]), None)
        if lean and cache.compiled and width is not None and self.compiled is not None:
            out = self._compiled_step(cache, tokens, g, slots, positions, mask, cos, sin, width)
            if out is not None:
                return out
        return self._layer(cache.keys, cache.values, tokens, g, cos[positions], sin[positions], slots, mask, lean,
                           last_only)

    def _layer(self, keys, values, tokens, g, cos, sin, slots, mask, lean=True, last_only=False):
        """The step's layer: entries (g, token) [B, t] with their cos, sin [B, t, hd]; keys and values
        [B, kv, C + 1, hd] written at slots [B, t] in place; mask [B, t, C + 1] -> h [B, t, D], logits [B, t, N]."""
        lin = self._linears(lean)
        x, q, k, v = self._qkv(tokens, g, cos, sin, lin)
        rows = torch.arange(tokens.shape[0], device=tokens.device)[:, None]
        keys[rows, :, slots] = k.transpose(1, 2)  # [B, t, kv, hd] into [B, kv, C + 1, hd] at each row's slots
        values[rows, :, slots] = v.transpose(1, 2)
        attended = attend(q, keys, values, mask[:, None], lossy=lean)
        h = self._finish(x, attended, lin)
        return h, self.logits(h[:, -1:] if last_only else h, lean)

    def compiler(self):
        """The compiled step's layer (made once; CUDA graphs on CUDA, as the target's forward), or None with
        compile_note saying why not."""
        if self.compiled is None and not self.compile_note:
            self.graphs = self.fc.weight.device.type == "cuda"
        return compile_fixed(self, self._layer, self.fc.weight.device)

    def _compiled_step(self, cache, tokens, g, slots, positions, mask, cos, sin, width):
        """`_layer` compiled at fixed shapes: t entries padded with holes to `width` (token 0 at position 0,
        written to the scratch slot, seeing slot 0 only), dropped after. None if compiling was given up."""
        t, pad = tokens.shape[1], width - tokens.shape[1]
        if pad:  # (entries that fill the width go in as they are)
            tokens, positions = F.pad(tokens, (0, pad)), F.pad(positions, (0, pad))
            slots, g = F.pad(slots, (0, pad), value=cache.scratch), F.pad(g, (0, 0, 0, pad))
            holes = F.pad(mask.new_ones(mask.shape[0], pad, 1), (0, mask.shape[2] - 1))  # [B, pad, C + 1]: slot 0
            mask = torch.cat([mask, holes], 1)
        args = (cache.keys, cache.values, *map(fresh, (tokens, g)), cos[positions], sin[positions],
                *map(fresh, (slots, mask)))
        shape = ((g.shape[0], width), tuple(cache.keys.shape))
        if shape not in self.compiled_shapes:  # packed before tracing: the graph takes the eager step's products
            for lin in self.lean_linears().values():
                lin.path(g.shape[0] * width)
        out = run_fixed(self, shape, f"{width} {'entry' if width == 1 else 'entries'}", args)
        if out is None:
            return None
        h, logits = (x[:, :t] for x in out)
        return (h.clone(), logits.clone()) if self.graphs else (h, logits)  # a replay overwrites its outputs

    def native_weights(self, rows: int) -> ctypes.Array | None:
        """The layer's weights for native.layers at this row count (leanllama.layer_plan's), or None."""
        if rows not in self._native_plans:
            c, lin = self.config, self.lean_linears()
            fits = native.attends(c.heads, c.kv_heads, c.head_dim)
            self._native_plans[rows] = layers_plan([fits and layer_plan(
                rows, self.attn_norm, self.mlp_norm, (lin["qkv"], lin["o"], lin["gate_up"], lin["down"]))])
        return self._native_plans[rows]


def _slot_index(capacity: int, device: torch.device) -> torch.Tensor:
    """What a query at position p compares with p: slot numbers, the scratch slot never <= p."""
    index = torch.arange(capacity + 1, device=device)
    index[-1] = torch.iinfo(torch.long).max
    return index


class HeadCache:
    """Keys and values [B, kv heads, C + 1, hd] of B rows' entries, slots 0..C-1 plus a scratch slot C for padding
    writes (the target's cache layout, so that its C functions take the head's too).

    Row b's real entries fill slots 0..lengths[b]-1, one per position; drafted entries go after
    them and are forgotten by not moving the length (rollback is free). Compiled (where no C call runs the
    head's layer), the steps run compiled (EagleHead.step) over a set of the head's spare caches at fixed
    addresses, handed back when the cache is dropped, as the target's compiled caches are (leanllama.lend)."""

    def __init__(self, head: EagleHead, batch: int, capacity: int, like: torch.Tensor, compile: bool = False):
        self.compiled = compile and not in_c(like, whole_layers=True) and head.compiler() is not None
        self.head, self.lease = head, [None]  # compiled: the set held
        if self.compiled:
            weakref.finalize(self, give_back, head.spare, self.lease)
        self._hold(batch, compiled_capacity(capacity) if self.compiled else capacity, like)
        self.lengths = [0] * batch

    def _hold(self, batch: int, capacity: int, like: torch.Tensor) -> None:
        """Caches of `batch` rows, `capacity` slots and the scratch slot (compiled: a spare set, if one fits)."""
        c = self.head.config
        shape = (batch, c.kv_heads, capacity + 1, c.head_dim)
        if self.compiled:
            lent = lend(self.head.spare, self.head.graphs, shape, 1, like)
            self.lease[0] = self.stack, (self.keys,), (self.values,) = lent
        else:  # [2, B, ...]: keys and values as views of one tensor, as the compiled sets are
            self._stacked(like.new_zeros((2, *shape)))
        self.slot_index = _slot_index(self.scratch, like.device)

    def _stacked(self, stack: torch.Tensor) -> None:
        self.stack = stack
        self.keys, self.values = stack.unbind()

    @property
    def scratch(self) -> int:
        return self.keys.shape[2] - 1

    def reserve(self, need: int) -> None:
        """Grow (doubling; compiled, to 256 times a power of two: few shapes) so that slots 0..need-1 exist."""
        if need <= self.scratch:
            return
        old, lease, slots = self.stack, self.lease[:], self.scratch
        self._hold(old.shape[1], compiled_capacity(need) if self.compiled else max(need, 2 * slots), old)
        self.stack[:, :, :, :slots] = old[:, :, :, :slots]
        give_back(self.head.spare, lease)

    def select(self, rows: list[int]) -> None:
        """Keep these rows. Compiled, in place while the row count stays; once rows leave, the steps run eager:
        each new row count would compile graphs of its own (the target's cache keeps its rows as holes instead;
        the head's steps cost far less)."""
        index = torch.tensor(rows, device=self.keys.device)
        if self.compiled and len(rows) == self.keys.shape[0]:  # the graphs keep their addresses
            self.stack.copy_(self.stack[:, index])
        else:
            self._stacked(self.stack[:, index])
            if self.compiled:
                self.compiled = False
                give_back(self.head.spare, self.lease)
        self.lengths = [self.lengths[r] for r in rows]
