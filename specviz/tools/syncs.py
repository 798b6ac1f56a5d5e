"""Host-device synchronisations, counted on any device: the waits a GPU run would make.

On a GPU the host queues kernels and runs ahead of them. It must stop and wait for the queue to
drain whenever it reads a value back (`.item()`, `.tolist()`, `bool(t)`, `int(t)`), asks for an
output whose size depends on the data (`nonzero`, boolean indexing, `masked_select`), or copies a
host list to the device (`torch.tensor(list, device=...)`: a blocking copy). For a small model a
speculative round is bound by these waits and the launches between them, not by arithmetic
(gpt-fast's decode loop keeps them out). The counter sits at the Python level (a TorchFunctionMode),
so a run on a CPU counts the waits the same code makes on CUDA; compiled graphs are not looked into,
so count eager runs. Where the decoder takes another way on a CPU, whose reads cost nothing
(`kvcache.reads_wait`), the counter has it take the GPU's.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

from ..core.kvcache import READS_WAIT

T = torch.Tensor
READS = {T.item: "item", T.tolist: "tolist", T.__bool__: "bool", T.__int__: "int", T.__float__: "float",
         T.__index__: "index", T.cpu: "cpu", T.numpy: "numpy"}
SIZED = {torch.nonzero: "nonzero", T.nonzero: "nonzero", torch.masked_select: "masked_select",
         T.masked_select: "masked_select", torch.unique: "unique", T.unique: "unique", torch.argwhere: "nonzero"}
FROM_HOST = {torch.tensor: "tensor(list)", torch.as_tensor: "tensor(list)"}


def _has_bool_index(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


def sync_kind(func, args: tuple, kwargs: dict) -> str | None:
    """Why this call would make the host wait for the device, or None."""
    if func in READS:
        return READS[func]
    if func in SIZED:
        return SIZED[func]
    if func is torch.where and len(args) + len(kwargs) == 1:
        return "nonzero"
    if func in (T.__getitem__, T.__setitem__) and _has_bool_index(args[1]):
        return "boolean index"
    data = args[0] if args else kwargs.get("data")
    if func in FROM_HOST and kwargs.get("device") is not None and not isinstance(data, torch.Tensor) \
            and not (isinstance(data, list | tuple) and not data):  # no data, no copy (transformers' cache starts so)
        return FROM_HOST[func]
    if func in (torch.repeat_interleave, T.repeat_interleave) and "output_size" not in kwargs \
            and len(args) > 1 and isinstance(args[1], torch.Tensor):
        return "repeat_interleave"
    return None


class SyncCounter(TorchFunctionMode):
    """`with SyncCounter() as syncs: ...`, then syncs.counts: why -> how many times."""

    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()
        self._reads_wait = None

    def __enter__(self):
        self._reads_wait = READS_WAIT.set(True)
        return super().__enter__()

    def __exit__(self, *exc):
        READS_WAIT.reset(self._reads_wait)
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = sync_kind(func, args, kwargs)
        if kind:
            self.counts[kind] += 1
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        return sum(self.counts.values())
