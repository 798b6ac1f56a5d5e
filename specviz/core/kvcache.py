"""KV state for B rows decoded together: append slots, punch holes, roll back by a length.

All rows share one rectangular grid of slots (columns). A forward appends the same number of
slots to every row; `real` says which new slots hold a token of that row's sequence and which
are holes (padding, or a draft the row rejected while another row kept its own). Positions are
counted per row (real tokens before a slot), so every row sees exactly the sequence it would see
alone: a batch row decodes what a single run decodes, and a single prompt is a batch of one.
Rolling back is `trim()`: trailing slots that are holes in every row are dropped.

Three kinds of storage behind the same slots (`CACHE_KINDS`):
- "static": pre-allocated, written at a slot index; rolling back moves a length (gpt-fast's
  cache). For Llama-family models specviz runs its own lean forward over it (leanllama.py);
  for the others transformers' StaticCache, written at our length.
- "dynamic": grown by each forward's new slots (new storage, the old copied in) and cut on rollback,
  as transformers' DynamicCache is; other architectures use that cache itself.
- "none": no cache: every forward recomputes the whole sequence (what a KV cache buys).
For Llama-family models all three run specviz's lean forward (leanllama.py), so they differ in the
cache alone (transformers' bfloat16 forward is several times slower on a CPU without bf16
instructions).
"""

from __future__ import annotations

import contextvars
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel, StaticCache

from ..models.leanllama import LeanCache, LeanLlama, slot_mask
from .sampling import at_least_float32


@dataclass
class Forward:
    logits: torch.Tensor  # [B, t, V] at least float32, cut to the shared vocabulary
    hidden: torch.Tensor | None  # [B, t, H] last hidden state (after the final norm), when asked


class Backend(Protocol):
    """Where the keys and values live. The KV state does the slot bookkeeping."""

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, real: torch.Tensor, start: int,
                hidden: bool, last_only: bool, visible: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run ids [B, t] at slots start..start+t-1; real [B, start + t]; visible [B, t, t]: which of
        the new slots each new one attends to (a tree; None: causal). (logits [B, t or 1, V], hidden
        [B, t, H] or None)."""

    def crop(self, width: int) -> None:
        """Forget slots from `width` on."""

    def select(self, index: torch.Tensor) -> None:
        """Keep only these rows."""

    def move(self, row: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy one row's entries from slots src to slots dst (a tree's kept path, made consecutive)."""


def _hf_outputs(out, hidden: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    return out.logits, out.hidden_states[-1] if hidden else None


class DynamicBackend:
    def __init__(self, model: PreTrainedModel):
        self.model, self.cache = model, DynamicCache(config=model.config)

    def forward(self, ids, positions, real, start, hidden, last_only, visible=None):
        out = self.model(input_ids=ids, attention_mask=slot_mask(real, start, real.shape[1], visible),
                         position_ids=positions,
                         past_key_values=self.cache, use_cache=True, output_hidden_states=hidden,
                         logits_to_keep=int(last_only))
        return _hf_outputs(out, hidden)

    def crop(self, width: int) -> None:
        if width < self.cache.get_seq_length():
            self.cache.crop(width - self.cache.get_seq_length())  # transformers 5: a negative count

    def select(self, index: torch.Tensor) -> None:
        self.cache.batch_select_indices(index)

    def move(self, row, src, dst):
        _move_layers(self.cache.layers, row, src, dst)


class StaticBackend:
    """transformers' StaticCache, written at our own length: rollback moves the length."""

    def __init__(self, model: PreTrainedModel, capacity: int):
        self.model, self.capacity = model, capacity
        self.cache = StaticCache(config=model.config, max_cache_len=capacity)

    def _set_length(self, width: int) -> None:
        for layer in self.cache.layers:
            if layer.is_initialized:
                layer.cumulative_length.fill_(width)

    def _grow(self, need: int) -> None:
        """Batches leave holes, so their slots may outgrow a single run's; double the storage."""
        self.capacity = max(2 * self.capacity, need)
        for layer in self.cache.layers:
            layer.max_cache_len = self.capacity
            if layer.is_initialized:
                pad = self.capacity - layer.keys.shape[2]
                layer.keys = torch.nn.functional.pad(layer.keys, (0, 0, 0, pad))
                layer.values = torch.nn.functional.pad(layer.values, (0, 0, 0, pad))

    def forward(self, ids, positions, real, start, hidden, last_only, visible=None):
        # the cache's length is already `start`: a forward adds its tokens, a rollback sets it
        if real.shape[1] > self.capacity:
            self._grow(real.shape[1])
        out = self.model(input_ids=ids, attention_mask=slot_mask(real, start, self.capacity, visible),
                         position_ids=positions,
                         cache_position=torch.arange(start, real.shape[1], device=ids.device),
                         past_key_values=self.cache, use_cache=True, output_hidden_states=hidden,
                         logits_to_keep=int(last_only))
        return _hf_outputs(out, hidden)

    def crop(self, width: int) -> None:
        self._set_length(width)

    def select(self, index: torch.Tensor) -> None:
        for layer in self.cache.layers:
            if layer.is_initialized:
                layer.keys, layer.values = layer.keys[index], layer.values[index]
                layer.batch_size = len(index)

    def move(self, row, src, dst):
        _move_layers(self.cache.layers, row, src, dst)


class NoCacheBackend:
    """Keeps the token ids and positions only; each forward runs the whole sequence again."""

    def __init__(self, model: PreTrainedModel):
        self.model = model
        self.ids: torch.Tensor | None = None  # [B, W]
        self.positions: torch.Tensor | None = None

    def _whole(self, ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The text so far with ids [B, t] appended (kept for the next forward): its ids and positions [B, W]."""
        if self.ids is not None:
            ids, positions = torch.cat([self.ids, ids], 1), torch.cat([self.positions, positions], 1)
        self.ids, self.positions = ids, positions
        return ids, positions

    def forward(self, ids, positions, real, start, hidden, last_only, visible=None):
        ids, positions = self._whole(ids, positions)
        t = real.shape[1] - start
        out = self.model(input_ids=ids, attention_mask=slot_mask(real, 0, real.shape[1], visible, start),
                         position_ids=positions,
                         use_cache=False, output_hidden_states=hidden, logits_to_keep=1 if last_only else t)
        logits, h = _hf_outputs(out, hidden)
        return logits, None if h is None else h[:, -t:]

    def crop(self, width: int) -> None:
        if self.ids is not None:
            self.ids, self.positions = self.ids[:, :width], self.positions[:, :width]

    def select(self, index: torch.Tensor) -> None:
        if self.ids is not None:
            self.ids, self.positions = self.ids[index], self.positions[index]

    def move(self, row, src, dst):
        self.ids[row, dst], self.positions[row, dst] = self.ids[row, src], self.positions[row, src]


class LeanNoCacheBackend(NoCacheBackend):
    """`none` for a Llama-family model: no keys or values kept; each forward runs the whole sequence through
    specviz's lean forward (the static cache's kernels) into a cache made for that forward alone."""

    def __init__(self, model: PreTrainedModel):
        super().__init__(model)
        self.lean = LeanLlama.of(model)

    @torch.inference_mode()
    def forward(self, ids, positions, real, start, hidden, last_only, visible=None):
        ids, positions = self._whole(ids, positions)
        lean, (rows, width), t = self.lean, ids.shape, real.shape[1] - start
        layers = len(lean.layers)  # keys then values, [B, KV, W, D] a layer, written and read by this forward only
        stack = lean.embed.weight.new_zeros((2 * layers, rows, lean.kv_heads, width, lean.head_dim))
        mask, slots = slot_mask(real, 0, width, visible, start), torch.arange(width, device=ids.device)
        logits, h = lean(ids, positions, mask, slots, list(stack[:layers].unbind()), list(stack[layers:].unbind()),
                         width, True, hidden, last_only, t)
        return logits, None if h is None else h[:, -t:]


class LeanDynamicBackend(LeanCache):
    """`dynamic` for a Llama-family model: the lean forward over keys and values that each forward grows by its
    new slots, into new storage with the old copied in, and a rollback cuts (transformers' DynamicCache's way)."""

    def __init__(self, lean: LeanLlama):
        super().__init__(lean, 0)

    def _reserve(self, batch: int, need: int, like: torch.Tensor) -> None:
        old, lean = self.stack, self.lean  # [2 layers, B, KV, slots, D]
        have = 0 if old is None else old.shape[3]
        if need > have:
            grown = like.new_zeros((2 * len(lean.layers), batch if old is None else old.shape[1], lean.kv_heads,
                                    need - have, lean.head_dim))
            self._stacked(grown if old is None else torch.cat([old, grown], 3))

    def crop(self, width: int) -> None:
        if self.stack is not None and width < self.stack.shape[3]:
            self._stacked(self.stack[:, :, :, :width])  # a view, as transformers crops; the next forward copies it


def _move_layers(layers, row: int, src: torch.Tensor, dst: torch.Tensor) -> None:
    """transformers' cache layers, keys and values [B, heads, slots, D]: one row's slots src -> dst."""
    for layer in layers:
        for cache in (layer.keys, layer.values):
            cache[row, :, dst] = cache[row, :, src]


# cache kind -> its storage for (model, capacity); a new kind plugs in here
BACKENDS: dict[str, Callable[[PreTrainedModel, int], Backend]] = {
    "static": StaticBackend,
    "dynamic": lambda model, capacity: DynamicBackend(model),
    "none": lambda model, capacity: NoCacheBackend(model),
}
CACHE_KINDS = tuple(BACKENDS)
# and for a Llama-family model (LeanLlama.supports), through specviz's lean forward: (model, capacity, compile)
LEAN_BACKENDS: dict[str, Callable[[PreTrainedModel, int, bool], Backend]] = {
    "static": lambda model, capacity, compile: LeanLlama.of(model).backend(capacity, compile),
    "dynamic": lambda model, capacity, compile: LeanDynamicBackend(LeanLlama.of(model)),
    "none": lambda model, capacity, compile: LeanNoCacheBackend(model),
}


def make_backend(model: PreTrainedModel, kind: str, capacity: int, compile: bool = False) -> Backend:
    """The kind's storage; for a Llama-family model, specviz's lean forward where the kind has one (LEAN_BACKENDS;
    the static cache's compiled if asked)."""
    if kind not in BACKENDS:
        raise ValueError(f"cache must be one of {', '.join(CACHE_KINDS)}, got {kind!r}")
    lean = kind in LEAN_BACKENDS and LeanLlama.supports(model)
    if compile and not (lean and kind == "static"):
        _warn_once(f"specviz: --compile applies to the static cache of Llama-family models; "
                   f"{model.config.model_type} with the {kind} cache runs eager")
    return LEAN_BACKENDS[kind](model, capacity, compile) if lean else BACKENDS[kind](model, capacity)


@functools.cache
def _warn_once(message: str) -> None:
    logging.getLogger("specviz").warning(message)


class KVState:
    """One model's state for B rows: mask [B, W] (1 where a slot holds a real token) and a backend.

    flags: the mask's copy on the host, kept while every slot appended came as host lists, so rolling
    back reads nothing from the device (on a GPU a read waits for the queue); None once a forward was
    given a device tensor (trim then reads the mask)."""

    def __init__(self, model: PreTrainedModel, batch: int, kind: str, vocab_size: int, capacity: int,
                 compile: bool = False):
        self.kind, self.vocab_size = kind, vocab_size
        self.backend = make_backend(model, kind, capacity, compile)
        self.mask = torch.zeros(batch, 0, dtype=torch.bool, device=model.device)
        self.flags: list[list[bool]] | None = [[] for _ in range(batch)]

    @property
    def lengths(self) -> torch.Tensor:
        """[B] real tokens per row."""
        return self.mask.sum(1)

    @property
    def width(self) -> int:
        return self.mask.shape[1]

    def forward(self, ids: torch.Tensor, real: torch.Tensor | list[list[bool]], hidden: bool = False,
                last_only: bool = False, tree: Tree | None = None) -> Forward:
        """Append ids [B, t] (real [B, t] bool: False marks a hole; as host lists, the host keeps its copy)
        and run them; last_only: logits of the last slot only ([B, 1, V]), for a forward whose other
        positions nobody reads. tree: the new slots are a tree (each attends to its ancestors; position =
        length + depth), not a sequence."""
        if isinstance(real, list):
            if self.flags is not None:
                for row, flags in zip(self.flags, real, strict=True):
                    row.extend(flags)
            real = on_device(real, self.mask.device, torch.bool)
        else:
            self.flags = None
        real = real.bool()
        if tree is None:
            positions = (self.lengths[:, None] + real.long().cumsum(1) - 1).clamp_min(0)  # a hole's is never used
        else:
            positions = self.lengths[:, None] + tree.depth
        start = self.width
        self.mask = torch.cat([self.mask, real], dim=1)
        logits, h = self.backend.forward(ids, positions, self.mask, start, hidden, last_only,
                                         None if tree is None else tree.visible)
        return Forward(at_least_float32(logits[:, :, : self.vocab_size]), h)

    def prefill(self, prompts: list[list[int]], pad_id: int, hidden: bool = False) -> Forward:
        """Each prompt but its last token, right-aligned (a one-token prompt adds only a hole)."""
        ids, real = left_padded([p[:-1] or [pad_id] for p in prompts], pad_id, self.mask.device)
        real = [r if len(p) > 1 else [False] * len(r) for r, p in zip(real, prompts, strict=True)]
        return self.forward(ids, real, hidden, last_only=True)

    def _set(self, row: int, start: int, stop: int, value: bool) -> None:
        self.mask[row, start:stop] = value
        if self.flags is not None:
            flags = self.flags[row]
            flags[start:stop] = [value] * len(flags[start:stop])

    def make_holes(self, row: int, start: int, stop: int) -> None:
        """Slots [start, stop) of a row no longer hold tokens of its sequence."""
        self._set(row, start, stop, False)

    def keep(self, row: int, start: int, stop: int, slots: list[int]) -> None:
        """Of a row's slots [start, stop), keep the entries in `slots` (ascending; a tree's kept path),
        moved to start, start+1, ...; the rest become holes. A chain's kept slots are there already."""
        dst = list(range(start, start + len(slots)))
        if slots != dst:
            device = self.mask.device
            self.backend.move(row, on_device(slots, device), on_device(dst, device))
        self._set(row, start, start + len(slots), True)
        self._set(row, start + len(slots), stop, False)

    def select(self, rows: list[int]) -> None:
        """Keep only these rows (finished rows leave the batch)."""
        index = on_device(rows, self.mask.device)
        self.backend.select(index)
        self.mask = self.mask[index]
        if self.flags is not None:
            self.flags = [list(self.flags[r]) for r in rows]

    def trim(self) -> list[int]:
        """Roll back: drop trailing slots that are holes in every row. Returns each row's length (from the
        host's copy of the mask; without one, read with the width in one read)."""
        if self.flags is not None:
            width = max(len(row) - row[::-1].index(True) if True in row else 0 for row in self.flags)
            lengths = [row.count(True) for row in self.flags]
            self.flags = [row[:width] for row in self.flags]
        else:
            columns = torch.arange(1, self.width + 1, device=self.mask.device)
            last = (self.mask.any(0) * columns).max(0, keepdim=True).values if self.width else columns.new_zeros(1)
            width, *lengths = torch.cat([last, self.lengths]).tolist()  # past the last real slot; the lengths
        if width < self.width:
            self.backend.crop(width)
            self.mask = self.mask[:, :width]
        return lengths


@dataclass
class Tree:
    """B rows of t new slots as trees: slot 0 is each row's root (its last kept token)."""

    depth: torch.Tensor  # [B, t] slots from the root (root 0); position = the row's length + depth
    visible: torch.Tensor  # [B, t, t] bool: slot i attends to slot j (j is i or an ancestor of i)

    @staticmethod
    def of(parents: list[list[int]], width: int, device: torch.device) -> Tree:
        """parents[b][i]: the parent of node i (slot 1 + i), -1 for the root; slots past a row's nodes
        are holes (depth 0, seeing themselves only)."""
        padded = [row + [-2] * (width - 1 - len(row)) for row in parents]
        return Tree.from_parents(on_device(padded, device, torch.long))

    @staticmethod
    def from_parents(parents: torch.Tensor) -> Tree:
        """parents [B, t - 1] on the device: node i's parent (slot 1 + i), -1 the root, -2 a hole (depth 0,
        seeing itself only). Made there, so a tree drafted there is verified without a read: node i sees j
        when j is i or an ancestor, and its depth is how many those are; ancestors by doubling the paths
        of one step up (a matrix product a pass: paths up to t - 2 steps in log2 t passes)."""
        if not reads_wait(parents.device):  # a read is a load: a few lists beat a dozen small operations
            return Tree._from_lists(parents.tolist())
        return Tree._by_doubling(parents)

    @staticmethod
    def _by_doubling(parents: torch.Tensor) -> Tree:
        rows, n = parents.shape
        real = parents >= -1
        up = F.one_hot((parents + 1).clamp_min(0), n + 1)[..., 1:].float()  # [B, n, n]: node -> its parent
        reach = torch.eye(n, device=parents.device) + up  # paths of 0 or 1 step up
        for _ in range(max(n - 1, 1).bit_length()):
            reach = (reach @ reach).clamp_max(1.0)  # twice as long
        seen = reach > 0  # [B, n, n]
        depth = torch.where(real, seen.sum(-1), 0)
        visible = torch.zeros(rows, n + 1, n + 1, dtype=torch.bool, device=parents.device)
        visible[:, 0, 0] = True
        visible[:, 1:, 1:] = seen
        visible[:, 1:, 0] = real
        return Tree(F.pad(depth, (1, 0)), visible)

    @staticmethod
    def _from_lists(parents: list[list[int]]) -> Tree:
        """from_parents' tree from host lists (the same tensors): each node's ancestors by walking up."""
        n = len(parents[0]) if parents else 0
        depths, visible = [], []
        for row in parents:
            lines = [[True] + [False] * n]  # the root sees itself
            depth = [0]
            for i, parent in enumerate(row):
                line = [parent >= -1] + [False] * n  # a hole sees itself alone, not the root
                line[1 + i], steps, at = True, 1, parent
                while at >= 0:
                    line[1 + at], steps, at = True, steps + 1, row[at]
                lines.append(line)
                depth.append(steps if parent >= -1 else 0)
            visible.append(lines)
            depths.append(depth)
        return Tree(torch.tensor(depths, dtype=torch.long).view(len(parents), n + 1),
                    torch.tensor(visible, dtype=torch.bool).view(len(parents), n + 1, n + 1))


# whether a read makes the host wait, if not by the device: tools.syncs.SyncCounter counts as on a GPU
READS_WAIT: contextvars.ContextVar[bool | None] = contextvars.ContextVar("reads_wait", default=None)


def reads_wait(device: torch.device) -> bool:
    """Whether reading a value back makes the host wait for the device's queue of kernels (CUDA, MPS), so
    that a round does better to compute more and read once. On a CPU the host is the device and a read is a
    load: there a sampled walk asks for what it needs, instead of drawing for every node it could end at, and
    a tree's mask is made from host lists."""
    forced = READS_WAIT.get()
    return device.type != "cpu" if forced is None else forced


def on_device(values: list, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host list as a tensor on `device`, without making the host wait: on CUDA through pinned memory,
    copied asynchronously (`torch.tensor(list, device=...)` waits for every queued kernel first)."""
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def stacked(rows: list[torch.Tensor], pad: int) -> torch.Tensor:
    """ids [B, w] from each row's ids already on the device (nothing sent from the host), padded on the
    right to the longest row."""
    width = max(len(r) for r in rows)
    return torch.stack([F.pad(r, (0, width - len(r)), value=pad) for r in rows])


def left_padded(rows: list[list[int]], pad: int, device: torch.device) -> tuple[torch.Tensor, list[list[bool]]]:
    """Host rows right-aligned: ids [B, w] on the device (one copy) and real [B][w] on the host."""
    width = max(map(len, rows))
    ids = on_device([[pad] * (width - len(r)) + r for r in rows], device, torch.long)
    return ids, [[False] * (width - len(r)) + [True] * len(r) for r in rows]
