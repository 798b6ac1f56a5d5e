"""Matrix-product kernels chosen by measuring them on the CPU that runs them.

No kernel wins on every CPU. Measured on different 2-core x86 CPUs, the 576x49152 output head
in float32 is fastest through oneDNN's packed weights on one, through MKL's on another, and
through plain `F.linear` at a few rows on a third; bf16 packing raises where the CPU lacks bf16
instructions. So nothing here is fixed from one machine's timings: the first time a model is
loaded, every linear shape is timed on each path this CPU can run, at the row counts the decoder
uses (ROWS: one-token steps, verify and draft widths), candidates interleaved, medians compared, the
caches evicted before each sweep so the weights come from memory, as they do in a decode.
The fastest path per (shape, rows) goes into a table in the specviz cache folder, keyed by the
machine (CPU model, instruction sets, capped ones too, threads, torch version) and dtype; a later
start reads it. A path the CPU cannot run, or that gives wrong numbers, is skipped and the reason
kept. A shape timed while other programs took much of the CPU time (contention.py) is timed again,
and one still timed busy is marked in the table and timed again by the next start.

A path is one registry line in PATHS: how to pack a weight (once, or once per row count) and how
to multiply by it. Timing is `tune`'s alone (in load_pair's load step, loading.prepare_kernels; for a model loaded
without it, in a Linear's first plan); `choose` only reads the table, and a `Linear` (leanllama.py) asks it once
for each class of row counts, into a plan its forwards read.
In bfloat16 a product keeps to one family of row-invariant kernels (`bits`) at every row count, the family fastest
over them all, so a verify's rows round as the one-token steps do (greedy speculation decodes plain
decoding's tokens bit for bit) and a batch row as its prompt alone (ONE_FAMILY says why not in float32).

Two paths are lossy: "int8" keeps weights as 8-bit integers per output row and quantizes each input
row to 8 bits at run time; "avx2-bf16" rounds float32 weights to bfloat16 (inputs and sums stay
float32). They are chosen only for a drafter's products (`Linear(lossy=True)`, the EAGLE head's): a
draft only proposes, the target's verify decides, and q is what the drafter drew from, so
speculative decoding stays exact with any drafter; the target never takes a lossy path. A drafter's
weight keeps one kind of numbers (`numbers`: the exact paths', bfloat16 weights', int8's) at every row
count, the kind fastest for one row, so a row drafts alike alone and in a batch (only the exact
paths' summation order may differ).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median

import torch
import torch.nn.functional as F

from . import contention, native
from .cachedir import cache_root
from .profile import Profile, entry_key

ROWS = (1, 2, 3, 4, 5, 8, 16)  # rows timed: a step, verify widths of γ 1-4, wider verifies and drafts
CELL_BUDGET_S = 0.025  # seconds per (shape, rows, path), evictions included; at least MIN_REPEATS repeats
MIN_REPEATS, MAX_REPEATS = 5, 40
WEIGHTS_PER_SHAPE = 4  # distinct weights swept per timing
TIMING = "cold: the caches evicted before each sweep; products bound"  # how cells are timed (part of the table's key)
ISA_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
             "avx_ne_convert")
log = logging.getLogger("specviz")
Progress = Callable[[str], None]


@dataclass(frozen=True)
class KernelPath:
    name: str
    dtypes: tuple[torch.dtype, ...]
    per_rows: bool  # the packing depends on the row count: one packed copy per row count used
    pack: Callable[[torch.Tensor, int], torch.Tensor | None]  # (weight [N, K], rows) -> packed; raises if unsupported
    # (packed, weight, bias, rows) -> the product x [..., K] -> [..., N] with all that does not depend on x fixed
    # once: a decode calls it a hundred times a step, so what it does per call is per-call overhead
    bind: Callable[..., Callable[[torch.Tensor], torch.Tensor]]
    about: str = ""
    lossy: bool = False  # other numbers than F.linear's beyond rounding: for drafters only
    numbers: str = ""  # a lossy path's kind of numbers ("" the exact paths'): paths of one kind agree to rounding
    # paths sharing a name give a row the same bits at any row count, on either of them (specviz's kernels: each
    # output one chain of operations); "": a row's bits may depend on the call (the libraries block by shape)
    bits: str = ""
    # model dtype -> C function: where a model of that dtype has a product on this path, native.layers can run it
    # inside its one call (leanllama.layer_plan), through that function of the library
    layers: dict[torch.dtype, str] = field(default_factory=dict)
    # the file's blocks a weight must be made of to take this path ("" any weight): its pack raises for others,
    # and `sample` makes one of them from a random weight (the self-check's)
    blocks: str = ""
    sample: Callable[[torch.Tensor], torch.Tensor] | None = None

    def run(self, x: torch.Tensor, packed, weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> torch.Tensor:
        """One product, bound for it alone (a compiled graph's opaque call; checks)."""
        return self.bind(packed, weight, bias, rows)(x)


def _plain(packed, weight, bias, rows):
    return functools.partial(F.linear, weight=weight, bias=bias)


def _onednn(packed, weight, bias, rows):
    linear = torch.ops.mkldnn._linear_pointwise
    return lambda x: linear(x, packed, bias, "none", [], "")


def _onednn_pack(batch_hint: int) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """oneDNN reorders a weight for the batch size it is told to expect: for 1 row a layout for its
    matrix-vector kernel, for more a blocked one. On an AVX2 CPU the first costs far more at a few rows
    than at one, the second about the same at either: two paths, the table picks."""
    return lambda w, rows: torch.ops.mkldnn._reorder_linear_weight(w, batch_hint)


def _mkl(packed, weight, bias, rows):
    linear = torch.ops.mkl._mkl_linear
    return lambda x: linear(x, packed, weight, bias, rows)


def _avx2_pack(weight: torch.Tensor, rows: int, avx512: bool = False) -> torch.Tensor:
    return native.pack(weight, torch.bfloat16 if weight.dtype == torch.bfloat16 else torch.float32, avx512)


def _native(avx512: bool) -> Callable[..., Callable[[torch.Tensor], torch.Tensor]]:
    def bind(packed, weight, bias, rows):
        """A bfloat16 model's product in float32 (the weights widened exactly, the sums float32 as in any
        bf16 kernel), rounded back to bfloat16; a float32 model's as it is."""
        product = native.bind(packed, weight, bias, avx512)
        return product if weight.dtype == torch.float32 else lambda x: product(x.float()).to(x.dtype)
    return bind


def _avx512_pack(weight: torch.Tensor, rows: int) -> torch.Tensor:
    native.wide()  # this CPU cannot run it: raise now, so the path is skipped before anything calls it
    return _avx2_pack(weight, rows, avx512=True)


def _pairs_pack(weight: torch.Tensor, rows: int) -> torch.Tensor:
    native.wide()
    if not cpu_class().startswith(("AMX", "AVX512-BF16")):  # caps included: a capped CPU runs no such kernel
        raise RuntimeError(f"needs AVX512-BF16 (this process runs {cpu_class()} kernels)")
    return native.pack_pairs(weight)


def _pairs(packed, weight, bias, rows):
    return native.bind_pairs(packed, weight, bias)


def _amx_pack(weight: torch.Tensor, rows: int) -> torch.Tensor:
    if cpu_class() != "AMX":  # caps included: ONEDNN_MAX_CPU_ISA below AMX runs no tiles
        raise RuntimeError(f"needs AMX-BF16 (this process runs {cpu_class()} kernels)")
    native.amx_ready()
    return native.pack_pairs(F.pad(weight, (0, -weight.shape[1] % 32)))  # k in steps of 32, an A tile's width


def _amx(packed, weight, bias, rows):
    return native.bind_pairs(packed, weight, bias, amx=True)


def _quads_pack(weight: torch.Tensor, rows: int) -> torch.Tensor:
    native.wide()
    # the instruction would kill the process, not raise; capped to AVX512_CORE this CPU stands for one without it
    if "avx512_vnni" not in _cpu()[1] or os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() == "AVX512_CORE":
        raise RuntimeError(f"needs AVX512-VNNI (this process runs {cpu_class()} kernels)")
    return native.pack_quads(weight)


def _quads(packed, weight, bias, rows):
    return native.bind_quads(packed, weight, bias)


def _int8_pack(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """Symmetric int8 per output row, packed for the quantized engine (fbgemm on x86; raises where the
    engine cannot run, or once PyTorch drops quantized tensors, which it has announced: then the path
    is skipped like any other this CPU cannot run)."""
    w = weight.detach().float()
    scale = (w.abs().amax(1) / 127).clamp_min(1e-12).double()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.quantize_per_tensor", UserWarning)  # the announcement
        q = torch.quantize_per_channel(w, scale, torch.zeros(w.shape[0], dtype=torch.long), 0, torch.qint8)
    return torch.ops.quantized.linear_prepack(q, None)


def _int8(packed, weight, bias, rows):
    return functools.partial(_int8_product, packed=packed, bias=bias)


def _int8_product(x, packed, bias):
    """Each row scaled to max |x| = 1 and quantized with one range for all, [-1, 1], pinned by an extra
    row (the engine takes its range from the whole input): so a row's result never depends on the rows
    beside it, and a batch row drafts what it drafts alone. 7-bit activations (reduce_range), which CPUs
    without VNNI need to not saturate."""
    flat = x.reshape(-1, x.shape[-1])
    top = flat.abs().amax(-1, keepdim=True).clamp_min(1e-30)  # [R, 1]
    anchor = torch.zeros(1, flat.shape[-1], dtype=flat.dtype, device=flat.device)
    anchor[0, 0], anchor[0, -1] = 1.0, -1.0
    y = torch.ops.quantized.linear_dynamic(torch.cat([flat / top, anchor]), packed, True)[:-1] * top
    y = y.reshape(*x.shape[:-1], y.shape[-1])
    return y if bias is None else y + bias


PATHS: dict[str, KernelPath] = {p.name: p for p in [
    KernelPath("linear", (torch.float32, torch.bfloat16, torch.float16, torch.float64), False, lambda w, r: None,
               _plain, "F.linear: ATen's own choice per call"),
    KernelPath("onednn", (torch.float32, torch.bfloat16), False, _onednn_pack(1), _onednn,
               "weights reordered once for oneDNN, for one row (bf16 needs AVX512-BF16 or AVX-NE-CONVERT)"),
    KernelPath("onednn16", (torch.float32, torch.bfloat16), False, _onednn_pack(16), _onednn,
               "weights reordered once for oneDNN, for a batch of 16 rows (its blocked layout)"),
    KernelPath("mkl", (torch.float32,), True, lambda w, r: torch.ops.mkl._mkl_reorder_linear_weight(w, r), _mkl,
               "weights packed for MKL's sgemm, one copy per row count"),
    KernelPath("avx2", (torch.float32, torch.bfloat16), False, _avx2_pack, _native(False),
               "specviz's own AVX2/FMA kernel: weights in 16-column blocks, up to 6 rows per pass, float32 sums "
               "(bfloat16 weights widened in registers; native.py)", bits="specviz",
               layers={torch.float32: "specviz_gemm", torch.bfloat16: "specviz_gemm_widened"}),
    KernelPath("avx512", (torch.float32, torch.bfloat16), False, _avx512_pack, _native(True),
               "the same kernel in AVX-512 registers: a block per register, up to 12 rows per pass, the same bits",
               bits="specviz", layers={torch.float32: "specviz_gemm512", torch.bfloat16: "specviz_gemm512_widened"}),
    KernelPath("avx512-dot", (torch.bfloat16,), False, _pairs_pack, _pairs,
               "specviz's kernel for bfloat16 models with AVX512-BF16: a pair of products per lane and instruction",
               bits="pairs", layers={torch.bfloat16: "specviz_gemm_pairs"}),
    KernelPath("amx", (torch.bfloat16,), False, _amx_pack, _amx,
               "the pair kernel's weights multiplied with AMX tiles: up to 16 rows at the cost of about one",
               bits="amx", layers={torch.bfloat16: "specviz_gemm_amx"}),
    KernelPath("avx2-bf16", (torch.float32,), False, lambda w, rows: native.pack(w, torch.bfloat16), _native(False),
               "the same kernel on weights rounded to bfloat16, half the bytes (drafters only)", lossy=True,
               numbers="bfloat16 weights", bits="specviz, bfloat16 weights",
               layers={torch.float32: "specviz_gemm_bf16"}),
    KernelPath("avx512-bf16", (torch.float32,), False, lambda w, rows: _avx512_pack(w.bfloat16(), rows),
               _native(True), "the AVX-512 kernel on weights rounded to bfloat16 (drafters only)", lossy=True,
               numbers="bfloat16 weights", bits="specviz, bfloat16 weights",
               layers={torch.float32: "specviz_gemm512_bf16"}),
    KernelPath("vnni-int8", (torch.bfloat16,), False, _quads_pack, _quads,
               "specviz's int8 kernel for bfloat16 drafters with AVX512-VNNI: weights int8 per output column, each "
               "row quantized to 8 bits alone, four products per lane and instruction (drafters only)", lossy=True,
               numbers="int8", bits="vnni-int8", layers={torch.bfloat16: "specviz_gemm_int8"}),
    KernelPath("q4", (torch.float32,), False, lambda w, rows: native.pack_blocks(w, "q4_1"),
               lambda packed, w, b, rows: native.bind_blocks(packed, w, b, "q4_1"),
               "specviz's kernel on a GGUF model's Q4_1 blocks: a fifth of float32's bytes, each weight made in "
               "registers as the float32 model's, the same bits as avx2 (gemm_blocks.c)", bits="specviz",
               layers={torch.float32: "specviz_gemm_q4"}, blocks="q4_1", sample=native.as_q4_1),
    KernelPath("q8", (torch.float32,), False, lambda w, rows: native.pack_blocks(w, "q8_0"),
               lambda packed, w, b, rows: native.bind_blocks(packed, w, b, "q8_0"),
               "the same on Q8_0 blocks (a GGUF model's embedding and tied output head): 1.06 bytes a weight",
               bits="specviz", layers={torch.float32: "specviz_gemm_q8"}, blocks="q8_0", sample=native.as_q8_0),
    KernelPath("q4-512", (torch.float32,), False, lambda w, rows: native.pack_blocks(w, "q4_1", avx512=True),
               lambda packed, w, b, rows: native.bind_blocks(packed, w, b, "q4_1", avx512=True),
               "the q4 kernel in AVX-512 registers: fewer instructions to make a weight, up to 12 rows a pass",
               bits="specviz", layers={torch.float32: "specviz_gemm512_q4"}, blocks="q4_1", sample=native.as_q4_1),
    KernelPath("q8-512", (torch.float32,), False, lambda w, rows: native.pack_blocks(w, "q8_0", avx512=True),
               lambda packed, w, b, rows: native.bind_blocks(packed, w, b, "q8_0", avx512=True),
               "the q8 kernel in AVX-512 registers", bits="specviz", layers={torch.float32: "specviz_gemm512_q8"},
               blocks="q8_0", sample=native.as_q8_0),
    KernelPath("avx2-int8", (torch.float32,), False, lambda w, rows: native.pack_quads(w),
               lambda packed, w, b, rows: native.bind_quads(packed, w, b, torch.float32),
               "specviz's int8 kernel for float32 drafters with AVX2: the vnni-int8 path's weights and numbers, the "
               "integer sums in VPMADDUBSW pairs (gemm_int8.c; drafters only)", lossy=True,
               # not fbgemm's "int8": its 7-bit rows scaled otherwise would give a batch row other q than alone
               numbers="int8, each row alone", bits="int8-avx2", layers={torch.float32: "specviz_gemm_int8_avx2"}),
    KernelPath("int8", (torch.float32,), False, _int8_pack, _int8,
               "weights int8 per output row, rows quantized to 8 bits as they come (drafters only)", lossy=True,
               numbers="int8", bits="int8"),
]}


# --- the machine ---------------------------------------------------------------------------------


@functools.cache
def _cpu() -> tuple[str, tuple[str, ...]]:
    """(CPU model, its flags), read once per process."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("", platform.machine(), platform.processor()):
                model = line.split(":", 1)[1].strip()
            elif line.startswith(("flags", "Features")) and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return model, tuple(f for f in ISA_FLAGS if f in flags)


def machine() -> dict:
    """What the kernel timings depend on. Caps set in the environment count: ONEDNN_MAX_CPU_ISA and
    ATEN_CPU_CAPABILITY make this CPU run another class's kernels, and get their own table; so does turning
    specviz's library off (SPECVIZ_NATIVE=0), whose paths are then skipped."""
    model, isa = _cpu()
    return {"cpu": model, "isa": list(isa), "aten_capability": torch.backends.cpu.get_cpu_capability(),
            "onednn_max_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", ""), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "arch": platform.machine(),
            **({"native": "off"} if native.turned_off() else {})}


def cpu_class(m: dict | None = None) -> str:
    """AMX, AVX512-BF16, AVX512, AVX2 or other: the class of kernels this process runs (caps included)."""
    m = m or machine()
    isa, cap = set(m["isa"]), m["onednn_max_isa"].upper()
    capped = cap and not cap.startswith("AVX512_CORE_AMX") and cap != "ALL"
    if m["aten_capability"] in ("avx2", "default") or cap.startswith("AVX2") or cap.startswith("SSE"):
        return "AVX2" + (" (capped)" if "avx512f" in isa else "") if "avx2" in isa else "other"
    if "amx_bf16" in isa and not capped:
        return "AMX"
    if "avx512_bf16" in isa and not (capped and cap in ("AVX512_CORE", "AVX512_CORE_VNNI")):
        return "AVX512-BF16" + (" (capped)" if "amx_bf16" in isa else "")
    if "avx512f" in isa:
        return "AVX512" + (" (capped)" if "avx512_bf16" in isa else "")
    return "AVX2" if "avx2" in isa else "other"


def describe_machine(m: dict | None = None) -> str:
    m = m or machine()
    threads = f"{m['threads']} thread{'s' if m['threads'] != 1 else ''}"
    return f"{m['cpu']} ({cpu_class(m)}; {' '.join(m['isa']) or 'no AVX'}), {threads}, torch {m['torch']}"


def registry() -> list[str]:
    """What the timings depend on besides the machine: the paths with their dtypes, our own kernel's build, and
    how cells are timed."""
    return [*(f"{name} {' '.join(map(str, PATHS[name].dtypes))}" for name in sorted(PATHS)), native.digest(), TIMING]


def profile() -> Profile:
    """This machine's profile (profile.py): one file per machine() and registry(), a new one where either changes."""
    m = machine()
    facts = json.dumps([m, registry()], sort_keys=True)
    return Profile(cache_root() / "profiles" / f"{hashlib.sha256(facts.encode()).hexdigest()[:16]}.json", m)


# --- the table -----------------------------------------------------------------------------------


def shape_key(weight: torch.Tensor) -> str:
    return f"{weight.shape[0]}x{weight.shape[1]}"  # out x in


# the model dtypes whose products keep to one family of bits at every row count (KernelTable.family): their
# outputs keep 8 bits of mantissa, so a step's and a verify's roundings of one sum part greedy texts at near ties.
# In float32 they part in the last of 24 bits, too little to have parted a greedy text in practice, and one family
# can cost speed (a float32 output head at one row can be fastest through MKL's packing, whose bits vary by call).
ONE_FAMILY = ("bfloat16", "float16")


@dataclass
class KernelTable:
    """ms per call, by shape ("out x in"), rows and path; the fastest is the choice. Held in memory, read from and
    saved to the profile's `kernels` and `skipped` sections for its dtype."""

    machine: dict
    dtype: str
    times: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)  # shape -> rows -> path -> ms
    skipped: dict[str, str] = field(default_factory=dict)  # path -> why this CPU cannot use it
    busy: dict[str, float] = field(default_factory=dict)  # shape -> what other processes took while it was timed
    profile: Profile | None = None

    def settled(self, shape: str) -> bool:
        """Whether the shape's timings stand: made, and on a quiet machine (contention.py) or by this process."""
        return shape in self.times and self.profile.stands("kernels", entry_key(self.dtype, shape),
                                                           self.busy.get(shape))

    def best(self, shape: str, rows: int, per_rows_ok: bool = True, lossy: bool = False,
             in_call: torch.dtype | None = None, refused: frozenset[str] = frozenset()) -> str:
        """The fastest path for `rows` rows: the one measured at the nearest timed row count at or
        above it (above the largest, the largest's fastest that needs no copy per row count); a lossy
        path only where `lossy` (a drafter's product), and then of the kind of numbers fastest at the
        fewest timed rows, whatever `rows` is; in a table of ONE_FAMILY, of the `family` of bits the
        shape has, so a row rounds alike at every row count; with in_call, only paths native.layers runs
        for that model dtype ("linear" if none); never the paths `refused` (whose pack refused the weight)."""
        by_rows = self.times.get(shape)
        if not by_rows:
            return "linear"
        timed = sorted(int(r) for r in by_rows)
        if not blocks_on():
            refused = refused | {p.name for p in PATHS.values() if p.blocks}

        def fastest(rows: int, numbers: str | None = None, bits: str | None = None) -> str | None:
            at = timed_rows(rows, timed)
            fit = per_rows_ok and rows <= timed[-1]
            ms = {p: t for p, t in by_rows[str(at)].items()
                  if p in PATHS and p not in refused and (fit or not PATHS[p].per_rows)
                  and (lossy or not PATHS[p].lossy) and numbers in (None, PATHS[p].numbers)
                  and bits in (None, PATHS[p].bits) and (in_call is None or in_call in PATHS[p].layers)}
            return min(ms, key=ms.get) if ms else None

        kind = PATHS[fastest(timed[0]) or "linear"].numbers if lossy else ""
        family = self.family(shape, kind) if self.dtype in ONE_FAMILY else ""
        return (family and fastest(rows, kind, family)) or fastest(rows, kind) or fastest(rows) or "linear"

    def family(self, shape: str, numbers: str = "") -> str:
        """Of the paths with this kind of numbers (the exact paths': ""), the `bits` whose paths take the least
        time summed over the timed row counts, each row count through its fastest of them, among the families
        with a path at every one ("" if none). A product that keeps to it gives a row the same bits at every row
        count: a verify's rows those of the one-token steps (so greedy speculation decodes plain decoding's
        tokens exactly), a batch row those of its prompt alone."""
        sums: dict[str, list[float]] = {}
        for ms in self.times.get(shape, {}).values():
            best_of: dict[str, float] = {}
            for p, t in ms.items():
                if p in PATHS and PATHS[p].bits and PATHS[p].numbers == numbers:
                    best_of[PATHS[p].bits] = min(t, best_of.get(PATHS[p].bits, t))
            for bits, t in best_of.items():
                sums.setdefault(bits, []).append(t)
        whole = {bits: sum(ts) for bits, ts in sums.items() if len(ts) == len(self.times[shape])}
        return min(whole, key=whole.get) if whole else ""

    def save(self, shapes: Iterable[str] = ()) -> None:
        """Store what was skipped and these shapes' timings in the profile."""
        self.profile.update({"skipped": {self.dtype: {"why": self.skipped}},
                             "kernels": {entry_key(self.dtype, s): {"ms": self.times[s], "busy": self.busy.get(s)}
                                         for s in shapes}})

    def add_stored(self) -> None:
        """Add what the profile holds for this dtype (another process may have stored since); this process's own
        timings win."""
        stored = self.profile.read()
        for name, entry in stored["kernels"].items():
            dtype, shape = name.split("|")
            if dtype == self.dtype and shape not in self.times:
                self.times[shape] = entry["ms"]
                if entry.get("busy") is not None:
                    self.busy[shape] = entry["busy"]
        self.skipped = self.skipped or stored["skipped"].get(self.dtype, {}).get("why", {})


_TABLES: dict[tuple[str, str], KernelTable] = {}


def forget() -> None:
    """Drop the tables held in memory (the next `table` call reads the stored profile, as a new start would)."""
    _TABLES.clear()


def table(dtype: torch.dtype) -> KernelTable:
    """This machine's table for dtype: from memory, else from the profile (empty where it holds none)."""
    prof = profile()
    name = (str(prof.file), str(dtype).removeprefix("torch."))
    if name not in _TABLES:
        _TABLES[name] = KernelTable(prof.machine, name[1], profile=prof)
        _TABLES[name].add_stored()
    return _TABLES[name]


def forget_forwards(dtype: torch.dtype) -> None:
    """Drop the profile's forwards of a dtype (timed on the kernels chosen before a retune): timed again."""
    prof, prefix = profile(), entry_key(str(dtype).removeprefix("torch."), "")
    prof.update({"forwards": {name: None for name in prof.read()["forwards"] if name.startswith(prefix)}})


def stored_forward(dtype: torch.dtype, model: str, rows: int) -> dict[str, float]:
    """ms of a model's forward of `rows` rows by way it may run, as the profile's `forwards` hold them; {} where
    they were never timed, or were timed while other programs took much of the CPU time (timed again)."""
    prof, name = profile(), entry_key(str(dtype).removeprefix("torch."), model, rows)
    entry = prof.entry("forwards", name)
    return entry["ms"] if entry and prof.stands("forwards", name, entry.get("busy")) else {}


def stored_forwards(dtype: torch.dtype, model: str) -> dict[int, dict[str, float]]:
    """Every row count's `stored_forward` for a model."""
    prefix = entry_key(str(dtype).removeprefix("torch."), model, "")
    return {int(name[len(prefix):]): entry["ms"] for name, entry in profile().read()["forwards"].items()
            if name.startswith(prefix)}


def keep_forward(dtype: torch.dtype, model: str, rows: int, ms: dict[str, float], busy: float | None) -> None:
    """Store a forward's timing by way (LeanLlama.timed_ways, loading.compare_forwards, distill.training_dtype) in
    the profile, with what the meter read while it was timed."""
    prof, name = profile(), entry_key(str(dtype).removeprefix("torch."), model, rows)
    prof.timing("forwards", name)
    prof.update({"forwards": {name: {"ms": ms, "busy": busy}}})


def _runs_here(path: KernelPath, dtype: torch.dtype) -> str:
    """'' if the path runs on this CPU in dtype and agrees with F.linear; else why not."""
    if dtype not in path.dtypes:
        return f"no {str(dtype).removeprefix('torch.')} kernel"
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(48, 32, generator=gen).to(dtype), torch.randn(3, 32, generator=gen).to(dtype)
    if path.sample:
        w = path.sample(w)
    try:
        with torch.inference_mode():
            got = path.run(x, path.pack(w, 3), w, None, 3)
    except Exception as err:  # noqa: BLE001 - an unsupported instruction set raises RuntimeError and others
        return f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
    want = F.linear(x.double(), w.double())
    atol = 0.05 if dtype in (torch.bfloat16, torch.float16) else 1e-3
    if not torch.allclose(got.double(), want, rtol=0.05, atol=0.05 * float(want.abs().max()) if path.lossy else atol):
        return "gives wrong results on this CPU"
    return ""


def blocks_on() -> bool:
    """Whether products may read a GGUF model's blocks; SPECVIZ_BLOCKS=0 keeps to the float32 weights any model
    has (the same numbers, more bytes), to compare the two."""
    return os.environ.get("SPECVIZ_BLOCKS", "").lower() not in ("0", "false", "no", "off")


def unavailable(dtype: torch.dtype) -> dict[str, str]:
    """The packed paths this CPU cannot run in dtype, each with why (F.linear always runs)."""
    return {p.name: why for p in PATHS.values() if p.name != "linear" and (why := _runs_here(p, dtype))}


@functools.cache
def _largest_cache_bytes() -> int:
    """The CPU's largest cache in bytes (Linux sysfs), 32 MiB where it cannot be read; SPECVIZ_LLC_BYTES if set
    (the test suite sets 32 MiB: its timings only have to run, and on a CPU with hundreds of MB of cache each
    sweep would read twice that)."""
    if given := os.environ.get("SPECVIZ_LLC_BYTES"):
        return int(given)
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = f.read_text().strip().upper()
            sizes.append(int(text.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(text[-1:], 0))
        except (OSError, ValueError):
            continue
    return max(sizes, default=32 << 20)


@functools.cache
def _eviction_buffer() -> torch.Tensor:
    return torch.ones(min(2 * _largest_cache_bytes(), 512 << 20) // 8, dtype=torch.int64)


def _evict() -> None:
    """Read twice the largest cache's bytes, so the next weights come from memory. In a decode every weight
    does (a model's weights stream through the caches once a step); timed hot, from cache, a kernel that
    computes fast but streams slowly wins cells it loses in a step (oneDNN's at several rows, on one CPU)."""
    _eviction_buffer().sum()


def _time_cells(weights: list[torch.Tensor], paths: list[KernelPath], rows_list: Iterable[int]) -> dict:
    """rows -> path -> ms per call, the weights read from memory, the products bound as a decode binds them;
    paths interleaved within each repeat, medians."""
    out: dict[str, dict[str, float]] = {}
    once = {}
    for p in [p for p in paths if not p.per_rows]:
        try:
            once[p.name] = [p.pack(w, 1) for w in weights]
        except ValueError:  # weights not of the blocks the path needs: it is not timed for them, nor chosen
            if not p.blocks:
                raise
    paths = [p for p in paths if p.per_rows or p.name in once]
    for rows in rows_list:
        x = torch.randn(rows, weights[0].shape[1], dtype=weights[0].dtype)
        products = {p.name: [p.bind(packed, w, None, rows) for w, packed in
                             zip(weights, once.get(p.name) or [p.pack(w, rows) for w in weights], strict=True)]
                    for p in paths}

        def sweep(p: KernelPath, x=x, products=products) -> float:
            _evict()
            start = time.perf_counter()
            for product in products[p.name]:
                product(x)
            return (time.perf_counter() - start) / len(weights)

        started = time.perf_counter()
        for p in paths:  # warm-up, and the size of a repeat (evictions included)
            sweep(p)
        per_path = (time.perf_counter() - started) / len(paths)
        repeats = int(min(MAX_REPEATS, max(MIN_REPEATS, CELL_BUDGET_S / max(per_path, 1e-6))))
        samples: dict[str, list[float]] = {p.name: [] for p in paths}
        for _ in range(repeats):
            for p in paths:
                samples[p.name].append(sweep(p))
        out[str(rows)] = {name: round(1000 * median(s), 4) for name, s in samples.items()}
    return out


@torch.inference_mode()
def tune(weights: Iterable[torch.Tensor], progress: Progress | None = None, retune: bool = False) -> None:
    """Time every shape of these CPU weights that this machine's table lacks (all, with retune),
    per dtype; save the table."""
    by_dtype: dict[torch.dtype, dict[str, list[torch.Tensor]]] = {}
    for w in weights:
        if w.device.type == "cpu":
            by_dtype.setdefault(w.dtype, {}).setdefault(shape_key(w), []).append(w)
    say = progress or log.info
    for dtype, shapes in by_dtype.items():
        if not retune and all(table(dtype).settled(s) for s in shapes):
            continue
        with profile().locked(say):  # another process may have measured meanwhile: read what it stored
            t = table(dtype)
            t.add_stored()
            missing = {s: ws for s, ws in shapes.items() if retune or not t.settled(s)}
            if not missing:
                continue
            if retune:
                say(f"timing {', '.join(missing)} anew")
            else:
                if unmetered := [s for s in missing if s in t.times and s not in t.busy]:
                    say(f"timing {', '.join(unmetered)} again: they were timed {contention.when(None)}")
                if busy := [s for s in missing if s in t.busy]:
                    say(f"timing {', '.join(busy)} again: other programs took more than {contention.BUSY:.0%} of "
                        "the CPU time specviz needed when they were timed")
            native.prepare(say)  # a first start compiles our kernels here: said, not silent
            t.skipped = unavailable(dtype)
            paths = [p for p in PATHS.values() if p.name not in t.skipped]
            started = time.perf_counter()
            say(f"measuring matrix-product kernels on this CPU in {t.dtype} (once; later starts read "
                f"{t.profile.file}): {len(missing)} shapes x {len(ROWS)} row counts x paths "
                f"{', '.join(p.name for p in paths)}")
            for i, (shape, ws) in enumerate(missing.items(), 1):
                t.profile.timing("kernels", entry_key(t.dtype, shape))
                t.times[shape], share = contention.quietest(
                    functools.partial(_time_cells, [w.detach().contiguous() for w in ws[:WEIGHTS_PER_SHAPE]], paths,
                                      ROWS),
                    functools.partial(_again, say, shape))
                t.busy.pop(shape, None)
                if share is not None:
                    t.busy[shape] = round(share, 3)
                t.save([shape])  # each shape as it is done: a start stopped part way keeps what it measured
                say(f"  kernels {i}/{len(missing)}: {shape} done ({time.perf_counter() - started:.1f} s)"
                    + (f"; timed while {contention.took(share)}, so the next start times it again"
                       if share is not None and share > contention.BUSY else ""))


def _again(say: Progress, shape: str, share: float) -> None:
    say(f"  {contention.took(share)} while {shape} was timed; timing it again...")


def measured(weight: torch.Tensor) -> bool:
    """Whether the table has this weight's shape, timed with no heavy load (so `tune` will not time it again)."""
    t, key = table(weight.dtype), shape_key(weight)
    return key in t.times and t.busy.get(key, 0.0) <= contention.BUSY


def choose(weight: torch.Tensor, rows: int, lossy: bool = False, in_call: bool = False,
           refused: frozenset[str] = frozenset()) -> str:
    """The path for a CPU weight multiplied by `rows` rows, as this machine's table has it ("linear" for a shape it
    lacks: `tune` times shapes, in a load step); a lossy one only for a drafter's product; in_call: the fastest that
    native.layers runs ("linear" if none); not one of the paths `refused`."""
    return table(weight.dtype).best(shape_key(weight), rows, lossy=lossy, in_call=weight.dtype if in_call else None,
                                    refused=refused)


# a weight of blocks keeps to them where they take at most this times the fastest path's time: wide enough that
# the timings' own spread at the widest row counts (rare in decoding) does not decide whether a model takes half
# its memory or all of it
BLOCKS_MARGIN = 1.25


def blocks_path(weight: torch.Tensor, rows: int, in_call: bool, chosen: str, refused: frozenset[str]) -> str:
    """For a weight made of a file's blocks, the path at `rows` that keeps it to them: the fastest blocks path
    where `chosen` (the fastest) reads floats and the blocks path is within BLOCKS_MARGIN of it, else `chosen`.
    Where every call reads the blocks the float32 weight need not be kept (Linear.keep_blocks): a few per cent
    on one row count is not worth five times the weight's bytes in memory."""
    t, key = table(weight.dtype), shape_key(weight)
    by_rows = t.times.get(key, {})
    if PATHS[chosen].blocks or not by_rows:
        return chosen
    ms = by_rows[str(timed_rows(rows, sorted(int(r) for r in by_rows)))]
    floats = frozenset(p for p in PATHS if not PATHS[p].blocks)
    alt = t.best(key, rows, in_call=weight.dtype if in_call else None, refused=floats | refused)
    fits = PATHS[alt].blocks and alt in ms and chosen in ms and ms[alt] <= BLOCKS_MARGIN * ms[chosen]
    return alt if fits else chosen


def row_class(rows: int) -> tuple[int, bool]:
    """Row counts that `KernelTable.best` answers alike for a shape timed at ROWS (as `tune` times every shape):
    the timed row count standing for them, and whether they are within the timed ones (a path that packs per row
    count may serve them)."""
    return timed_rows(rows), rows <= ROWS[-1]


def timed_rows(rows: int, timed: tuple[int, ...] | list[int] = ROWS) -> int:
    """Of the timed row counts (ascending), the one whose timings stand for `rows` rows: the nearest at or above
    it, else the largest."""
    return next((r for r in timed if r >= rows), timed[-1])


# --- the dtype `auto` picks on a CPU ---------------------------------------------------------------


def compare_dtypes(out_features: int, in_features: int, rows: tuple[int, ...] = (1, 3),
                   progress: Progress | None = None,
                   products: tuple[tuple[int, int, int, str], ...] = ()) -> tuple[torch.dtype, str]:
    """(dtype, why): bfloat16 if its fastest kernels beat float32's at these timed row counts (a step and a verify
    pass, or a batch's), measured here; else float32. Timed on the model's largest matrix (the output head, out x
    in), or, for a model made of a file's blocks, on all its products (out, in, how many, blocks format or ""):
    in float32 they may read the blocks (a weight of that format is timed), which bfloat16 cannot."""
    products = products or ((out_features, in_features, 1, ""),)
    ms = dict.fromkeys((torch.float32, torch.bfloat16), 0.0)
    for dtype in ms:
        t = table(dtype)
        untimed, unblocked = [], []  # shapes not timed; shapes timed on weights of no blocks (timed again)
        for out, inp, _, fmt in products:
            blocks = fmt if dtype == torch.float32 else ""
            timed = t.times.get(f"{out}x{inp}", {}).get("1", {})
            if not timed or (blocks and not any(PATHS[p].blocks == blocks for p in timed if p in PATHS)):
                weight = torch.randn(out, inp) / inp ** 0.5
                sample = next((p.sample for p in PATHS.values() if blocks and p.blocks == blocks), None)
                (unblocked if timed else untimed).append((sample(weight) if sample else weight).to(dtype))
        for weights, retune in ((untimed, False), (unblocked, True)):
            if weights:
                tune(weights, progress, retune)
        for out, inp, count, _ in products:
            key = f"{out}x{inp}"
            ms[dtype] += count * sum(t.times[key][str(r)][t.best(key, r)] for r in rows)  # rows are among ROWS
    what = (f"the model's {sum(c for *_, c, _ in products)} products (float32 timed on weights of its file's blocks)"
            if len(products) > 1 else f"the output head ({out_features}x{in_features})")
    return faster_dtype(f"{what} at {'+'.join(map(str, rows))} rows", ms[torch.float32], ms[torch.bfloat16])


BF16_MARGIN = 0.9  # bfloat16 is chosen only where it takes less than this part of float32's time


def faster_dtype(label: str, fp32: float, bf16: float, digits: int = 2) -> tuple[torch.dtype, str]:
    """(dtype, why) from what `label` costs in ms in each dtype: bfloat16 only where clearly faster."""
    if bf16 < BF16_MARGIN * fp32:
        return torch.bfloat16, f"bfloat16: {label} costs {bf16:.{digits}f} ms against {fp32:.{digits}f} ms in " \
                               "float32 on this CPU"
    return torch.float32, (f"float32: {label} costs {fp32:.{digits}f} ms against {bf16:.{digits}f} ms in bfloat16 "
                           "on this CPU (bfloat16 is not faster here)")


def summary(dtype: torch.dtype) -> dict:
    """The table's choices for a run's JSON: shape -> rows -> path, a drafter's where a lossy path changes
    them, and what was skipped."""
    t = table(dtype)
    drafting = {s: {r: t.best(s, int(r), lossy=True) for r in by_rows} for s, by_rows in t.times.items()}
    choice = {s: {r: t.best(s, int(r)) for r in by_rows} for s, by_rows in t.times.items()}
    return {"machine": describe_machine(t.machine), "dtype": t.dtype, "skipped": t.skipped, "choice": choice,
            "drafting": {s: rows for s, rows in drafting.items() if rows != choice[s]}}


def bandwidth_gbs(tensors: list[torch.Tensor]) -> float:
    """GB/s of one read of these tensors (a sum over each), the median of three."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    times = []
    with torch.inference_mode():
        for _ in range(3):
            start = time.perf_counter()
            for t in tensors:
                t.sum()
            times.append(time.perf_counter() - start)
    return nbytes / median(times) / 1e9


def table_text(dtype: torch.dtype, shapes: Iterable[str] | None = None) -> str:
    """Markdown: ms per call for every path at every row count, the chosen path starred (+: the choice
    for a drafter's product, where a lossy path is)."""
    t = table(dtype)
    names = [p for p in PATHS if p not in t.skipped]
    lines = ["| shape (out x in) | path | " + " | ".join(f"{r} row{'s' if r > 1 else ''}" for r in ROWS) + " |",
             "|---|---|" + "---|" * len(ROWS)]
    for shape in shapes or t.times:
        by_rows = t.times.get(shape, {})
        if t.busy.get(shape, 0.0) > contention.BUSY:
            lines.append(f"| {shape} | timed while {contention.took(t.busy[shape])}: the next start times it "
                         "again |" + " |" * len(ROWS))
        for name in names:
            cells = []
            for r in ROWS:
                ms = by_rows.get(str(r), {}).get(name)
                star = "" if ms is None else "*" if t.best(shape, r) == name else \
                    "+" if PATHS[name].lossy and t.best(shape, r, lossy=True) == name else ""
                cells.append("–" if ms is None else f"{ms:.3f}{star}")
            lines.append(f"| {shape} | {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
