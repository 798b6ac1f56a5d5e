"""A round's values wanted on the host, by name, read in one transfer.

On a GPU every read makes the host wait for the device's queue, so a round gathers what its rule, its
viewer and its drafter's tree need and reads it once. Producers add device tensors under names
(`reads.add("u", u)`); `fetch` reads any number of Reads at once; consumers then ask by name and get
host lists shaped as the tensor was (`reads["ratios"][row][i]`). Values come back in wide_dtype
(float64 where the device has it), in which ids and probabilities are exact.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .sampling import wide_dtype


class Reads:
    """Named device tensors to read together, then their values on the host."""

    def __init__(self) -> None:
        self._wanted: dict[str, torch.Tensor] = {}
        self._host: dict[str, list] = {}
        self._kept: dict[str, torch.Tensor] = {}

    def add(self, name: str, value: torch.Tensor) -> Reads:
        """Want `value` (any shape up to 2-d) on the host under `name`."""
        if value.dim() > 2:
            raise ValueError(f"{name}: a read is 0-, 1- or 2-d, got shape {tuple(value.shape)}")
        self._wanted[name] = value
        return self

    def keep(self, name: str, value: torch.Tensor) -> Reads:
        """Keep `value` with these reads on the device, never read (a consumer's device work may need it)."""
        self._kept[name] = value
        return self

    def tensor(self, name: str) -> torch.Tensor:
        """The device tensor added or kept as `name`."""
        return self._kept[name] if name in self._kept else self._wanted[name]

    def __contains__(self, name: str) -> bool:
        return name in self._wanted

    def __getitem__(self, name: str) -> list:
        """The host values of `name`: a float, a list, or a list of rows, as the tensor's shape was."""
        if name not in self._host:
            if name in self._wanted:
                raise RuntimeError(f"{name} is not read yet: fetch([...]) first")
            raise KeyError(name)
        return self._host[name]


def fetch(reads: Iterable[Reads]) -> None:
    """Read every wanted value of every Reads given, in one transfer from the device."""
    reads = list(reads)
    parts = [(r, name, t) for r in reads for name, t in r._wanted.items() if name not in r._host]
    if not parts:
        return
    wide = wide_dtype(parts[0][2].device)
    flat, at = torch.cat([t.reshape(-1).to(wide) for *_, t in parts]).tolist(), 0
    for r, name, t in parts:
        values, at = flat[at : at + t.numel()], at + t.numel()
        if t.dim() == 0:
            values = values[0]
        elif t.dim() == 2:
            width = t.shape[1]
            values = [values[i * width : (i + 1) * width] for i in range(t.shape[0])]
        r._host[name] = values
