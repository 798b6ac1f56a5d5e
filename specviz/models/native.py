"""specviz's own C library (built on first use with the system's C compiler, loaded with ctypes).

The source, by what it does and for which instructions:
- `gemm_avx2.c`: the float32 matrix product for AVX2 + FMA CPUs, weights packed in 16-column blocks as float32
  ("avx2") or bfloat16 ("avx2-bf16", drafters: half the bytes, widened in registers); sums in float32.
- `gemm_avx512.c`: the same kernel in 512-bit registers ("avx512", "avx512-bf16": the same bits), bfloat16 pairs
  per instruction ("avx512-dot", `pack_pairs`), the same packed weights through AMX tiles ("amx"), and 8-bit
  integers for drafters ("vnni-int8", `pack_quads`). Each compiled for its instructions function by function,
  run only where ATen runs AVX-512 kernels.
- `gemm_blocks.c`: float32 rows times a GGUF model's Q4_1 / Q8_0 blocks ("q4", "q8", "-512"; `pack_blocks`):
  the float32 model's weights bit for bit in a fifth of the bytes.
- `layer_ops.c`: a layer's other steps in one call each (RMSNorm `rms_bf16`, attention `attend_bf16` whose
  query's numbers come from the keys it sees alone, RoPE with the cache writes `rope_store_bf16`, SiLU times up
  `silu_mul_bf16`; float32 twins for the whole-layer call), and the vocabulary's `argmax` and `topk`.
- `layers.c`: every decoder layer of a forward in one call (`layers`), through `specviz_abi.h`'s structures,
  which `Layer`, `LayersDims` and `check_abi` below mirror and check.

Why a library of our own: at the row counts a decoder multiplies by (1 row a step, a few a verify) a weight
streamed once per call in 16-column blocks beats oneDNN's and MKL's packed weights on the CPUs measured, and a
layer's steps in one call save the per-operation cost of a dozen ATen calls. Each kernel is one more path in
kernels.PATHS, chosen per shape and row count by this machine's timings like the others, and skipped where it
cannot run: no compiler, no AVX2, or SPECVIZ_NATIVE=0.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from .cachedir import cache_root, locked

SOURCE = Path(__file__).with_name("gemm_avx2.c")
# compiled into one library: the GEMM kernels per instruction set, on GGUF blocks, a layer's other steps, the
# whole-layer call
SOURCES = tuple(SOURCE.with_name(name) for name in ("gemm_avx2.c", "gemm_avx512.c", "gemm_blocks.c", "gemm_int8.c",
                                                     "layer_ops.c", "layers.c"))
HEADERS = tuple(SOURCE.with_name(name) for name in ("kernels.h", "gemm_store.h", "specviz_abi.h"))  # they include
# -Wall: the tests build with -Werror as well (test_kernels); a user's compiler warning about something new is
# no reason to lose the kernels
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-Wall")
SANITIZE = "SPECVIZ_SANITIZE"  # e.g. "undefined" or "address,undefined": the library built with those sanitizers
ABI_VERSION = 1  # specviz_abi.h's SPECVIZ_ABI_VERSION: the structures below mirror it
BLOCK = 16  # output columns per packed block (gemm_avx2.c)
PAIR_GROUP = 64  # output columns per packed group of the pair kernel (gemm_avx512.c, GROUP)
BUILD_TIMEOUT_S = 300  # a compile at -O3 takes seconds even on a small VM: this only stops a compiler that hangs
_FAILED: dict[Path, str] = {}  # libraries whose compile failed in this process, with why: not compiled again


class Product(ctypes.Structure):
    """specviz_abi.h's struct specviz_product: a product's C function, its packed weight and float32 bias."""

    _fields_ = [("run", ctypes.c_void_p), ("weight", ctypes.c_void_p), ("bias", ctypes.c_void_p)]


class Layer(ctypes.Structure):
    """struct specviz_layer: one decoder layer's weights for `layers`."""

    _fields_ = [("norm1", ctypes.c_void_p), ("norm2", ctypes.c_void_p), ("qkv", Product), ("o", Product),
                ("gate_up", Product), ("down", Product)]


class LayersDims(ctypes.Structure):
    """struct specviz_layers_dims: `layers`' sizes (size: this structure's, which the C side checks)."""

    _fields_ = [(name, ctypes.c_int64) for name in (
        "size", "layers", "batch", "tokens", "width", "heads", "kv_heads", "head_dim", "inter", "capacity", "kv_len",
        "mask_batch", "mask_query", "mask_slot", "slots_row", "f32", "share")]


class Abi(ctypes.Structure):
    """struct specviz_abi: what the built library says of its interface."""

    _fields_ = [(name, ctypes.c_int64) for name in ("version", "layers_dims", "layer", "product")]


def check_abi(lib: ctypes.CDLL) -> None:
    """Raise unless the library's interface is the one the structures above mirror (version and sizes)."""
    abi = Abi()
    lib.specviz_abi.argtypes, lib.specviz_abi.restype = [ctypes.POINTER(Abi)], None
    lib.specviz_abi(ctypes.byref(abi))
    want = Abi(ABI_VERSION, ctypes.sizeof(LayersDims), ctypes.sizeof(Layer), ctypes.sizeof(Product))
    got, expected = [getattr(abi, f) for f, _ in Abi._fields_], [getattr(want, f) for f, _ in Abi._fields_]
    if got != expected:
        raise RuntimeError(f"the kernel library's interface (version, sizes {got}) is not the one native.py "
                           f"mirrors ({expected}): specviz_abi.h and native.py were changed apart")


def _compiler() -> str:
    for name in (os.environ.get("CC", ""), "cc", "gcc", "clang"):
        if name and (found := shutil.which(name)):
            return found
    raise RuntimeError("no C compiler found (cc, gcc or clang)")


@functools.cache
def digest() -> str:
    """What the built library and the timings of it depend on: the source and the flags (read once: every
    kernel-table lookup keys on it, and a model's first use of each row count looks the table up)."""
    # a file missing: build() says so, the paths are skipped
    source = b"".join(path.read_bytes() if path.is_file() else b"" for path in (*SOURCES, *HEADERS))
    return hashlib.sha256(source + " ".join(flags()).encode()).hexdigest()[:16]


def flags() -> tuple[str, ...]:
    """The compiler's flags: FLAGS, and where SPECVIZ_SANITIZE names sanitizers, those (stopping at the first
    report) with debug information, as the suite's sanitizer run builds it."""
    sanitize = os.environ.get(SANITIZE, "")
    return FLAGS + ((f"-fsanitize={sanitize}", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-g")
                    if sanitize else ())


def build(progress: Callable[[str], None] | None = None) -> Path:
    """The shared library in the cache folder, compiled now if it is not there (once per machine:
    processes sharing the folder wait for the first), saying so to progress (a few seconds); raises with the
    compiler's words if it fails."""
    built = cache_root() / "kernels" / f"gemm-avx2-{digest()}.so"
    if built.is_file():
        return built
    if built in _FAILED:
        raise RuntimeError(_FAILED[built])
    if missing := [path.name for path in (*SOURCES, *HEADERS) if not path.is_file()]:
        raise RuntimeError(f"{', '.join(missing)} missing from the installed package")
    with locked(built, progress):
        if built.is_file():  # another process built it meanwhile
            return built
        compiler = _compiler()
        if progress:
            progress(f"compiling specviz's C kernels with {Path(compiler).name} (once per machine and kernel "
                     f"source, into {built.parent})...")
        started = time.perf_counter()
        fd, tmp = tempfile.mkstemp(dir=built.parent, prefix=built.name, suffix=".tmp")
        os.close(fd)
        try:
            out = subprocess.run([compiler, *flags(), *map(str, SOURCES), "-o", tmp], capture_output=True, text=True,
                                 timeout=BUILD_TIMEOUT_S)
            if out.returncode:
                _FAILED[built] = f"{Path(compiler).name} failed: {out.stderr.strip()[-300:]}"
                raise RuntimeError(_FAILED[built])
            os.replace(tmp, built)
        except subprocess.TimeoutExpired:
            _FAILED[built] = f"{Path(compiler).name} took more than {BUILD_TIMEOUT_S} s"
            raise RuntimeError(_FAILED[built]) from None
        finally:
            Path(tmp).unlink(missing_ok=True)
        if progress:
            progress(f"  compiled in {time.perf_counter() - started:.0f} s")
    return built


def turned_off() -> bool:
    """SPECVIZ_NATIVE=0: the library is not built or loaded; every product, norm and attention takes torch's way."""
    return os.environ.get("SPECVIZ_NATIVE", "").lower() in ("0", "false", "no", "off")


def _capability() -> str:
    """'' where this process may run the library, else why not: turned off (SPECVIZ_NATIVE=0), or ATen's own
    check of AVX2 and FMA (ATEN_CPU_CAPABILITY caps it)."""
    if turned_off():
        return "turned off (SPECVIZ_NATIVE=0)"
    capability = torch.backends.cpu.get_cpu_capability().lower()
    return "" if capability in ("avx2", "avx512") else f"needs AVX2 and FMA (ATen runs {capability} kernels here)"


def prepare(progress: Callable[[str], None]) -> None:
    """Build the library now, saying so, where this process may run it: the first library() call otherwise
    compiles in silence. A failed build is left to library() to report."""
    if not _capability():
        with contextlib.suppress(RuntimeError, OSError):
            build(progress)


@functools.cache
def library() -> ctypes.CDLL:
    """The kernel, built if need be and loaded; raises with the reason where this process cannot run it."""
    if why := _capability():
        raise RuntimeError(why)
    lib = ctypes.CDLL(str(build()))
    check_abi(lib)
    for entry in (lib.specviz_gemm, lib.specviz_gemm_bf16, lib.specviz_gemm512, lib.specviz_gemm512_bf16,
                  lib.specviz_gemm_dot_bf16, lib.specviz_gemm_q4, lib.specviz_gemm_q8, lib.specviz_gemm512_q4,
                  lib.specviz_gemm512_q8):  # x, w, b, y, m, n, and k (the pair kernel: k / 2)
        entry.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 3
        entry.restype = None
    # x, w, y, rows, n, eps, share (the rows shared among threads or not: rms_bf16)
    lib.specviz_rms_bf16.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 2 + [ctypes.c_float, ctypes.c_int]
    lib.specviz_rms_bf16.restype = None
    lib.specviz_rms_f32.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_float, ctypes.c_int64]
    lib.specviz_rms_f32.restype = None
    lib.specviz_attend_bf16.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_float]  # q, k, v, mask, out, dims, strides
    lib.specviz_attend_bf16.restype = None
    lib.specviz_rope_store_bf16.argtypes = [ctypes.c_void_p] * 8  # qkv, cos, sin, slots, q, k and v caches, dims
    lib.specviz_rope_store_bf16.restype = None
    lib.specviz_silu_mul_bf16.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3  # gate_up table act rows I share
    lib.specviz_silu_mul_bf16.restype = None
    # x, dims, layers, caches, cos, sin, slots, mask, SiLU table, scratch, eps, scale
    lib.specviz_layers.argtypes = [ctypes.c_void_p, ctypes.POINTER(LayersDims), ctypes.POINTER(Layer)] + \
        [ctypes.c_void_p] * 7 + [ctypes.c_float] * 2
    lib.specviz_layers.restype = ctypes.c_int
    lib.specviz_gemm_amx.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 3  # x, w, b, y, m, n, k
    lib.specviz_gemm_amx.restype = None
    for entry in (lib.specviz_gemm_int8, lib.specviz_gemm_int8_avx2):
        entry.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 3  # x, w, b, y, m, n, k
        entry.restype = None
    lib.specviz_amx_ready.argtypes, lib.specviz_amx_ready.restype = [], ctypes.c_int
    lib.specviz_argmax_f32.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]  # x rows n out
    lib.specviz_argmax_f32.restype = None
    lib.specviz_topk_f32.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 4 + [ctypes.c_void_p] * 2  # x r n ld k v i
    lib.specviz_topk_f32.restype = None
    return lib


def entry(name: str) -> int:
    """The address of the library's function `name` (a product's kernel, for a `layers` weight plan)."""
    return ctypes.cast(getattr(library(), name), ctypes.c_void_p).value


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1), the same indices (the first of equal values; a NaN counts as the largest): for float32 on
    the CPU from the library's two passes over each row (ATen's argmax over a 49,152-token vocabulary costs
    many times its max), anything else from torch."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or not x.is_contiguous() or x.dim() == 0 \
            or x.shape[-1] == 0 or not runs_here():
        return x.argmax(-1)
    out = torch.empty(x.shape[:-1], dtype=torch.long)
    library().specviz_argmax_f32(x.data_ptr(), out.numel(), x.shape[-1], out.data_ptr())
    return out


def topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(x, k) of rows x [R, n], the same values, largest first (of equal values the first index first):
    for float32 on the CPU from the library's one pass over each row (ATen's topk over a 49,152-token vocabulary
    costs several times as much), anything else from torch."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1 \
            or not 1 <= k <= min(x.shape[-1], 64) or not runs_here():  # a sorted list of k: for a few
        return torch.topk(x, k)
    values = torch.empty(x.shape[0], k, dtype=torch.float32)
    index = torch.empty(x.shape[0], k, dtype=torch.long)
    library().specviz_topk_f32(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), k, values.data_ptr(),
                               index.data_ptr())
    return values, index


@functools.cache
def runs_here() -> bool:
    """Whether this process can load the library (an AVX2 CPU with a C compiler; asked once)."""
    try:
        library()
    except Exception:  # noqa: BLE001 - no compiler, an older CPU, a failed build: the callers use torch
        return False
    return True


def rms_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float, share: bool = True) -> torch.Tensor:
    """RMSNorm of bfloat16 rows x [..., n] with a bfloat16 weight [n], as transformers computes it (in
    float32, rounded to bfloat16 before the weight), in one call (layer_ops.c, specviz_rms_bf16).

    share: the rows shared among threads (one row never is), as in every row-by-row function here (RoPE with the
    cache writes, SiLU times up, and those inside `layers`). Either way gives the same bits; which is faster
    depends on the machine and the row count (a row's arithmetic is small, but inside a forward its numbers arrive
    from the other core's cache, and starting threads has a cost of its own), so a model times its forward both
    ways (leanllama.LeanLlama.timed_ways) and passes what was faster. Where nothing was timed they are shared."""
    return _rms(library().specviz_rms_bf16, torch.bfloat16, x, weight, eps, share)


def rms_f32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of float32 rows x [..., n] with a float32 weight [n], w (x / sqrt(mean x^2 + eps)), the sum of squares
    in eight lanes (layer_ops.c, specviz_rms_f32: what native.layers computes in float32), in one call, the rows on
    this thread."""
    return _rms(library().specviz_rms_f32, torch.float32, x, weight, eps, False)


def _rms(entry, dtype: torch.dtype, x: torch.Tensor, weight: torch.Tensor, eps: float, share: bool) -> torch.Tensor:
    """rows x [..., n] and a weight [n], both of `dtype`, through the library's norm `entry` (TypeError otherwise)."""
    n = x.shape[-1]
    if x.dtype != dtype or weight.dtype != dtype or weight.shape != (n,):
        name = str(dtype).removeprefix("torch.")
        raise TypeError(f"this RMSNorm needs {name} rows and a weight of {n}, got {x.dtype} and {weight.dtype} "
                        f"{tuple(weight.shape)}")
    flat, w = x.contiguous(), weight.contiguous()
    y = torch.empty_like(flat)
    entry(flat.data_ptr(), w.data_ptr(), y.data_ptr(), flat.numel() // max(n, 1), n, eps, share)
    return y


def attends(heads: int, kv_heads: int, dim: int) -> bool:
    """Whether attend_bf16 takes heads of this shape (layer_ops.c: MAX_DIM, MAX_REP)."""
    return dim <= 256 and heads % kv_heads == 0 and heads // kv_heads <= 16


def attend_bf16(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attention of bfloat16 queries q [B, H, t, D] over keys and values [B, KV, L, D] (query head h reads key
    head h // (H / KV)) where mask [B, 1 or absent, t, L] (bool) is True, in float32, rounded to bfloat16 once
    at the end -> [B, H, t, D] (a view of [B, t, H, D], as the output projection reads it). A query's numbers
    do not depend on the other queries in the call nor on where its visible keys lie (layer_ops.c,
    specviz_attend_bf16). Any strides, but each vector of D contiguous."""
    batch, heads, t, dim = q.shape
    kv_heads, length = k.shape[1], k.shape[2]
    if mask.dim() == 4:
        mask = mask[:, 0]
    mask = mask.expand(batch, t, length)
    if (q.dtype, k.dtype, v.dtype, mask.dtype) != (torch.bfloat16,) * 3 + (torch.bool,):
        raise TypeError(f"attend_bf16 needs bfloat16 q, k, v and a bool mask, got {q.dtype}, {k.dtype}, "
                        f"{v.dtype}, {mask.dtype}")
    if not attends(heads, kv_heads, dim) or v.shape != k.shape:
        raise ValueError(f"attend_bf16 takes heads of at most 256 dimensions, at most 16 query heads per "
                         f"key head: got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty(batch, t, heads, dim, dtype=torch.bfloat16).transpose(1, 2)
    dims = (ctypes.c_int64 * 6)(batch, heads, kv_heads, t, length, dim)
    strides = (ctypes.c_int64 * 15)(*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *mask.stride(),
                                    *out.stride()[:3])
    library().specviz_attend_bf16(q.data_ptr(), k.data_ptr(), v.data_ptr(), mask.data_ptr(), out.data_ptr(),
                                  dims, strides, dim ** -0.5)
    return out


def rope_store_bf16(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int, share: bool = True) -> torch.Tensor:
    """A layer's step after its fused projection, in one call: qkv [B, t, H + 2 KV, D] (bfloat16) -> q [B, H, t, D]
    rotated (a view of [B, t, H, D]), with k rotated and v written to the caches [B, KV, capacity, D] at `slots`
    ([t], or [B, t]: each row its own); cos, sin: [B, t, D] or [B, t, 1, D]. The bits of leanllama.rotate and
    index_copy_ (layer_ops.c, specviz_rope_store_bf16). share: as rms_bf16's."""
    batch, t, all_heads, dim = qkv.shape
    kv_heads = (all_heads - heads) // 2
    qkv, cos, sin, slots = qkv.contiguous(), cos.contiguous(), sin.contiguous(), slots.contiguous()
    # the caches are written in place, as they are: they must be contiguous already
    if any(x.dtype != torch.bfloat16 for x in (qkv, cos, sin, k_cache, v_cache)) or slots.dtype != torch.int64 \
            or not (k_cache.is_contiguous() and v_cache.is_contiguous()) \
            or k_cache.shape != (batch, kv_heads, k_cache.shape[2], dim) or v_cache.shape != k_cache.shape \
            or cos.numel() != batch * t * dim or dim % 2 or slots.shape not in ((t,), (batch, t)):
        raise ValueError("rope_store_bf16 needs contiguous bfloat16 qkv [B, t, H + 2 KV, D], cos and sin [B, t, D], "
                         "caches [B, KV, capacity, D] and int64 slots [t] or [B, t]")
    q = torch.empty(batch, t, heads, dim, dtype=torch.bfloat16)
    dims = (ctypes.c_int64 * 8)(batch, t, heads, kv_heads, dim, k_cache.shape[2], t if slots.dim() == 2 else 0, share)
    library().specviz_rope_store_bf16(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), q.data_ptr(),
                                      k_cache.data_ptr(), v_cache.data_ptr(), dims)
    return q.transpose(1, 2)


@functools.cache
def silu_table() -> torch.Tensor:
    """ATen's SiLU of each of the 65,536 bfloat16 values, indexed by the value's bits: what silu_mul_bf16 and
    `layers` look up in bfloat16 (computed here, by this machine's ATen kernel, so it is ATen's bits)."""
    bits = torch.arange(65536, dtype=torch.int32)
    values = torch.where(bits < 32768, bits, bits - 65536).to(torch.int16).view(torch.bfloat16)
    table = torch.zeros(65537, dtype=torch.int16)  # one entry before the first: the C code gathers 32-bit words
    table[1:] = torch.nn.functional.silu(values).view(torch.int16)  # ending at each entry it reads
    return table[1:]


def silu_mul_bf16(gate_up: torch.Tensor, share: bool = True) -> torch.Tensor:
    """SiLU(gate) * up of a fused projection's output gate_up [..., 2 I] (bfloat16) -> [..., I]: ATen's
    numbers (SiLU from silu_table, the product rounded to bfloat16) in one call instead of three operations.
    share: as rms_bf16's."""
    if gate_up.dtype != torch.bfloat16 or gate_up.shape[-1] % 2:
        raise TypeError(f"silu_mul_bf16 needs bfloat16 [..., 2 I], got {gate_up.dtype} {tuple(gate_up.shape)}")
    width = gate_up.shape[-1] // 2
    flat = gate_up.reshape(-1, 2 * width).contiguous()
    act = torch.empty(*gate_up.shape[:-1], width, dtype=torch.bfloat16)
    library().specviz_silu_mul_bf16(flat.data_ptr(), silu_table().data_ptr(), act.data_ptr(), flat.shape[0], width,
                                    share)
    return act


def layers(x: torch.Tensor, weights: ctypes.Array, keys: list[torch.Tensor], values: list[torch.Tensor],
           cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor, kv_len: int,
           shape: tuple[int, int, int, int], eps: float, share: bool = True) -> torch.Tensor:
    """Decoder layers in one call (layers.c, specviz_layers): x [B, t, C] (bfloat16 or float32) -> the last
    layer's output, what leanllama.LeanLayer.forward computes layer after layer, with every product through the
    C kernel its path runs (`weights`: a Layer a layer, from leanllama.LeanLlama.native_weights, which checks
    that the paths have one); in bfloat16 its bits, in float32 within rounding and row by row alone. keys and
    values [B, KV, capacity, D] are written at `slots` ([t] or [B, t]) as there. shape: H, KV, D, I. mask
    [B, 1, t, >= kv_len] bool; cos, sin [B, t, (1,) D] in x's dtype. share: as rms_bf16's."""
    heads, kv_heads, dim, inter = shape
    batch, t, width = x.shape
    out = x.contiguous().clone()
    cos, sin, slots = cos.contiguous(), sin.contiguous(), slots.contiguous()
    mask = mask[:, 0]
    if x.dtype not in (torch.bfloat16, torch.float32) or mask.dtype != torch.bool \
            or {cos.dtype, sin.dtype, *(c.dtype for c in keys + values)} != {x.dtype} \
            or cos.numel() != batch * t * dim \
            or any(not (c.is_contiguous() and c.shape == keys[0].shape) for c in keys + values) \
            or keys[0].shape[:2] != (batch, kv_heads) or keys[0].shape[3] != dim or len(weights) != len(keys) \
            or slots.dtype != torch.int64 or slots.shape not in ((t,), (batch, t)):
        raise ValueError("layers needs bfloat16 or float32 x, cos and sin [B, t, D] and contiguous caches "
                         "[B, KV, capacity, D] alike, a bool mask and one Layer of weights a layer")
    f32 = x.dtype == torch.float32
    mask_batch, mask_query, mask_slot = mask.stride()
    dims = LayersDims(ctypes.sizeof(LayersDims), len(keys), batch, t, width, heads, kv_heads, dim, inter,
                      keys[0].shape[2], kv_len, mask_batch, mask_query, mask_slot, t if slots.dim() == 2 else 0, f32,
                      share)
    caches = (ctypes.c_void_p * (2 * len(keys)))(*(p for k, v in zip(keys, values, strict=True)
                                                   for p in (k.data_ptr(), v.data_ptr())))
    scratch = torch.empty(batch * t * (2 * width + (heads + 2 * kv_heads) * dim + 2 * heads * dim + 3 * inter),
                          dtype=x.dtype)
    if library().specviz_layers(out.data_ptr(), ctypes.byref(dims), weights, caches, cos.data_ptr(), sin.data_ptr(),
                                slots.data_ptr(), mask.data_ptr(), None if f32 else silu_table().data_ptr(),
                                scratch.data_ptr(), eps, dim ** -0.5):
        raise RuntimeError("specviz_layers refused its dims: the library and native.py disagree on their size")
    return out


def _padded(weight: torch.Tensor, columns: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """weight [N, K] zero-padded to [a multiple of `columns`, k] in dtype (raises first where the kernel
    cannot run here, so the path is skipped before any model uses it)."""
    library()
    n, k_in = weight.shape
    padded = torch.zeros(-(-n // columns) * columns, k, dtype=dtype)
    padded[:n, :k_in] = weight.detach()
    return padded


# Where the AVX2 kernel reads a bfloat16 block's 16 columns: it widens the low and the high four words of each
# 128-bit lane with one instruction each (gemm_avx2.c, load16), so columns 0-3, 8-11, 4-7, 12-15 stored in
# that order come out as 0-7 and 8-15.
UNPACK_ORDER = (0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15)


def pack(weight: torch.Tensor, as_dtype: torch.dtype = torch.float32, avx512: bool = False) -> torch.Tensor:
    """weight [N, K] -> [ceil(N / 16), K, 16] in as_dtype (float32 or bfloat16), zero-padded columns; a
    bfloat16 block for the AVX2 kernel (not avx512) with its columns in UNPACK_ORDER."""
    k = weight.shape[1]
    blocks = _padded(weight, BLOCK, k, as_dtype).view(-1, BLOCK, k)
    if as_dtype == torch.bfloat16 and not avx512:
        blocks = blocks[:, list(UNPACK_ORDER)]
    return blocks.transpose(1, 2).contiguous()


def wide() -> None:
    """Raise unless the AVX-512 kernels can run here: an instruction the CPU lacks would kill the process,
    not raise, so their paths ask this when they pack a weight (kernels.py), before any call."""
    capability = torch.backends.cpu.get_cpu_capability().lower()
    if capability != "avx512":  # ATen's check of AVX512F/BW/VL/DQ and the OS (ATEN_CPU_CAPABILITY caps it)
        raise RuntimeError(f"needs AVX-512 (ATen runs {capability} kernels here)")


def bind(packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
         avx512: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
    """The product x [..., K] @ weight.T + bias -> [..., N] in float32, through the packed blocks (float32 or
    bfloat16 weights; the sums are float32 either way), with 256-bit registers or, avx512, 512-bit ones (where
    `wide()` said they run). All that does not depend on x is looked up once, here."""
    n, k = weight.shape
    lib = library()
    if avx512:
        entry = lib.specviz_gemm512_bf16 if packed.dtype == torch.bfloat16 else lib.specviz_gemm512
    else:
        entry = lib.specviz_gemm_bf16 if packed.dtype == torch.bfloat16 else lib.specviz_gemm
    return _float32_product(entry, packed, bias, n, k, "the avx2 kernel")


def _float32_product(entry, packed: torch.Tensor, bias: torch.Tensor | None, n: int, k: int,
                     what: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """x [..., K] -> [..., N] in float32 through a C kernel entry(x, w, b, y, rows, n, k) on float32 rows."""
    b = None if bias is None else bias.float().contiguous()  # held by the product while the kernel reads it
    at, at_bias = packed.data_ptr(), None if b is None else b.data_ptr()

    def product(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, k).contiguous()
        if flat.dtype != torch.float32:
            raise TypeError(f"{what} multiplies float32, got {flat.dtype}")
        y = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
        entry(flat.data_ptr(), at, at_bias, y.data_ptr(), flat.shape[0], n, k)
        return y

    product.holds = packed, b
    return product


def pack_pairs(weight: torch.Tensor) -> torch.Tensor:
    """A bfloat16 weight [N, K] -> [ceil(N / 64), ceil(K / 2), 64, 2]: per group of 64 columns and pair of k,
    each column's two weights side by side (zero-padded), as VDPBF16PS reads them, 16 columns a register."""
    k = weight.shape[1] + weight.shape[1] % 2
    return _padded(weight, PAIR_GROUP, k, torch.bfloat16).view(-1, PAIR_GROUP, k // 2, 2).transpose(1, 2).contiguous()


@functools.cache
def amx_ready() -> None:
    """Raise unless this process may use AMX tiles: Linux lends them only when asked (once per process). The caller
    has checked that the CPU has AMX-BF16 (kernels.cpu_class: the instructions would kill the process)."""
    if library().specviz_amx_ready():
        raise RuntimeError("Linux did not lend this process the AMX tile registers (or the compiler lacks AMX)")


def bind_pairs(packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               amx: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
    """The product x [..., K] @ weight.T + bias -> [..., N] in bfloat16, x and the weights in bfloat16, the sums
    float32, with VDPBF16PS or, amx, with AMX tiles (the caller has checked that this CPU has AVX512-BF16, or
    that amx_ready() passed: the instructions would kill the process)."""
    n, k = weight.shape
    lib = library()
    entry, pairs = (lib.specviz_gemm_amx, k + k % 2) if amx else (lib.specviz_gemm_dot_bf16, packed.shape[1])
    b = None if bias is None else bias.float().contiguous()  # held by the product while the kernel reads it
    at, at_bias = packed.data_ptr(), None if b is None else b.data_ptr()

    def product(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, k)
        if flat.dtype != torch.bfloat16:
            raise TypeError(f"the pair kernel multiplies bfloat16, got {flat.dtype}")
        flat = (torch.nn.functional.pad(flat, (0, 1)) if k % 2 else flat).contiguous()
        y = torch.empty(*x.shape[:-1], n, dtype=torch.bfloat16)
        entry(flat.data_ptr(), at, at_bias, y.data_ptr(), flat.shape[0], n, pairs)
        return y

    product.holds = packed, b
    return product


def pack_quads(weight: torch.Tensor) -> torch.Tensor:
    """A weight [N, K] as the int8 kernel reads it (gemm_avx512.c, specviz_gemm_int8), one byte tensor: each column's
    scale s = max |w| / 127 (float32) and sum of its int8 values q (int32), N padded to 64, then q = w / s rounded
    to nearest even, [ceil(N / 64), ceil(K / 4), 64, 4] (zero-padded)."""
    library()
    w = weight.detach().float()
    n, k = w.shape
    scale = w.abs().amax(1) / 127  # [N]
    q = torch.where(scale[:, None] > 0, w / scale.clamp_min(1e-38)[:, None], 0).round().clamp(-127, 127)
    groups, quads = -(-n // PAIR_GROUP), -(-k // 4)
    padded = torch.zeros(groups * PAIR_GROUP, quads * 4, dtype=torch.int8)
    padded[:n, :k] = q.to(torch.int8)
    scales = torch.zeros(groups * PAIR_GROUP)
    scales[:n] = scale
    blocks = padded.view(groups, PAIR_GROUP, quads, 4).transpose(1, 2).contiguous()
    return torch.cat([scales.view(torch.uint8), padded.int().sum(1, dtype=torch.int32).view(torch.uint8),
                      blocks.view(-1).view(torch.uint8)])


def bind_quads(packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               dtype: torch.dtype = torch.bfloat16) -> Callable[[torch.Tensor], torch.Tensor]:
    """The product x [..., K] @ weight.T + bias -> [..., N] through pack_quads' int8 weight, each row quantized to 8
    bits alone: bfloat16 rows with AVX512-VNNI (gemm_avx512.c; the caller has checked the CPU), float32 rows with
    AVX2 (gemm_int8.c)."""
    n, k = weight.shape
    entry = library().specviz_gemm_int8 if dtype == torch.bfloat16 else library().specviz_gemm_int8_avx2
    b = None if bias is None else bias.float().contiguous()
    at, at_bias = packed.data_ptr(), None if b is None else b.data_ptr()

    def product(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, k)
        if flat.dtype != dtype:
            raise TypeError(f"this int8 kernel takes {dtype} rows, got {flat.dtype}")
        flat = flat.contiguous()
        y = torch.empty(*x.shape[:-1], n, dtype=dtype)
        entry(flat.data_ptr(), at, at_bias, y.data_ptr(), flat.shape[0], n, k)
        return y

    product.holds = packed, b
    return product


# --- a GGUF model's own blocks (gemm_blocks.c) ---------------------------------------------------

GROUP = 32  # k per block of the file
BLOCK_KERNELS = {("q4_1", False): "specviz_gemm_q4", ("q8_0", False): "specviz_gemm_q8",  # (format, avx512) ->
                 ("q4_1", True): "specviz_gemm512_q4", ("q8_0", True): "specviz_gemm512_q8"}  # its kernel


@functools.cache
def _f16c() -> None:
    """Raise unless the CPU widens float16 (F16C: every AVX2 CPU has it; the kernels widen the scales with it)."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    if " f16c" not in flags:
        raise RuntimeError("needs F16C (not listed in /proc/cpuinfo)")


def _half(values: torch.Tensor, fmt: str) -> torch.Tensor:
    """values (float32) as float16, raising where one is not a float16 exactly (then the weight is no `fmt`)."""
    half = values.half()
    if not torch.equal(half.float(), values):
        raise ValueError(f"not {fmt} blocks: scales that are no float16")
    return half


def q4_1_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d, m, q) with weight = (d * q) + m in float32, bit for bit, per block of 32 k: d and m float16 [N, K / 32],
    q in 0-15 [N, K]. Found from the float32 weight itself (a block's minimum is its m: Q4_1 gives the smallest
    value q = 0; d is the float16 within a few units of (max - min) / 15 that rebuilds every weight), so any
    model dequantized from Q4_1 blocks is packed again whatever file it came from; raises where a block is
    none."""
    n, k = weight.shape
    if k % GROUP:
        raise ValueError(f"k = {k} is no multiple of {GROUP}")
    w = weight.detach().float().reshape(n, k // GROUP, GROUP)  # [N, G, 32]
    m = _half(w.amin(-1), "Q4_1")  # [N, G]
    span = (w.amax(-1) - m.float()) / 15
    start = span.half().view(torch.int16)
    found = torch.zeros(n, k // GROUP, dtype=torch.bool)
    d = torch.zeros(n, k // GROUP, dtype=torch.float16)
    q = torch.zeros(n, k // GROUP, GROUP, dtype=torch.uint8)
    for step in (0, -1, 1, -2, 2, -3, 3):
        cand = (start + step).clamp_min(0).view(torch.float16)  # [N, G], float16 neighbours of the estimate
        scale = cand.float()[..., None]
        tried = torch.where(scale > 0, ((w - m.float()[..., None]) / scale.clamp_min(1e-30)).round(), 0).clamp(0, 15)
        fits = ((scale * tried + m.float()[..., None]) == w).all(-1) & ~found
        d, found = torch.where(fits, cand, d), found | fits
        q = torch.where(fits[..., None], tried.to(torch.uint8), q)
        if found.all():
            return d, m, q.reshape(n, k)
    raise ValueError(f"not Q4_1 blocks: {int((~found).sum())} of {found.numel()} blocks of 32")


def q8_0_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d, q) with weight = d * q in float32, bit for bit, per block of 32 k: d float16 [N, K / 32], q int8 in
    -127-127 [N, K]; Q8_0 gives a block's largest |value| q = ±127, so d = max |w| / 127 (exact); raises where
    a block is none."""
    n, k = weight.shape
    if k % GROUP:
        raise ValueError(f"k = {k} is no multiple of {GROUP}")
    w = weight.detach().float().reshape(n, k // GROUP, GROUP)
    d = _half(w.abs().amax(-1) / 127, "Q8_0")
    scale = d.float()[..., None]
    q = torch.where(scale > 0, (w / scale.clamp_min(1e-30)).round(), 0).clamp(-127, 127)
    if not torch.equal(scale * q, w):
        raise ValueError("not Q8_0 blocks")
    return d, q.to(torch.int8).reshape(n, k)


def as_q4_1(weight: torch.Tensor) -> torch.Tensor:
    """weight quantized to Q4_1 blocks as ggml quantizes (d = (max - min) / 15, m = min, both float16) and made
    float32 again as gguf-py does, (d * q) + m: a weight of the kind a GGUF model's layers have."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // GROUP, GROUP)
    low, d = w.amin(-1, keepdim=True), (w.amax(-1, keepdim=True) - w.amin(-1, keepdim=True)) / 15
    q = ((w - low) * torch.where(d > 0, 1 / d, 0) + 0.5).floor().clamp(0, 15)
    return (d.half().float() * q + low.half().float()).reshape(n, k)


def as_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """weight quantized to Q8_0 blocks (d = max |w| / 127, float16) and made float32 again, d * q."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // GROUP, GROUP)
    d = w.abs().amax(-1, keepdim=True) / 127
    q = (w * torch.where(d > 0, 1 / d, 0)).round().clamp(-127, 127)
    return (d.half().float() * q).reshape(n, k)


def pack_blocks(weight: torch.Tensor, fmt: str, avx512: bool = False) -> torch.Tensor:
    """weight [N, K] as gemm_blocks.c reads it in `fmt` ("q4_1" or "q8_0"): per 16 output columns and 32 k, the
    float16 scales then the integers (uint8, flat); columns padded to 16 with zero weights. Raises where the
    weight is not made of such blocks, or the kernel (avx512: its AVX-512 one) cannot run here."""
    library()
    _f16c()
    if avx512:
        wide()
    n, k = weight.shape
    blocks, groups = -(-n // BLOCK), k // GROUP
    pad = blocks * BLOCK - n

    def by_block(t: torch.Tensor) -> torch.Tensor:  # [N, ...] -> [blocks, 16, ...], zero-padded columns
        return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]).view(blocks, BLOCK, *t.shape[1:])

    if fmt == "q4_1":
        d, m, q = q4_1_blocks(weight)
        scales = [by_block(s).transpose(1, 2).contiguous().view(torch.uint8) for s in (d, m)]  # [B, G, 32] each
        q = by_block(q).view(blocks, BLOCK, groups, GROUP // 2, 2)  # [B, 16 columns, G, 16 pairs, 2]
        ints = (q[..., 0] | q[..., 1] << 4).permute(0, 2, 3, 1).reshape(blocks, groups, -1)  # [B, G, 256]
    elif fmt == "q8_0":
        d, q = q8_0_blocks(weight)
        scales = [by_block(d).transpose(1, 2).contiguous().view(torch.uint8)]
        ints = by_block(q).view(blocks, BLOCK, groups, GROUP).permute(0, 2, 3, 1).reshape(blocks, groups, -1)
        ints = ints.view(torch.uint8)
    else:
        raise ValueError(f"no kernel for blocks {fmt!r}")
    return torch.cat([*scales, ints], -1).reshape(-1).contiguous()


def trim_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim), after large tensors were let go;
    nothing where the C library has no such call."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


MADV_DONTNEED = 4  # Linux's madvise advice: the pages may go; a file's are read from it again if touched


def drop_file_pages(t: torch.Tensor) -> None:
    """Let the pages of a tensor that views a file's memory map (a model loaded from safetensors) leave memory,
    before the tensor is let go: the map lives while any view of it does, and holds every page read. A page of a
    file's map that anything touches again is read from the file, the same bytes; memory of any other kind holds
    its only copy and is left alone."""
    if not t.is_contiguous():
        return
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    page = os.sysconf("SC_PAGE_SIZE")
    first, last = -(-start // page) * page, end // page * page  # the whole pages inside its bytes
    if last <= first:
        return
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            for line in maps:
                span, _, _, _, inode, *path = line.split()
                low, high = (int(a, 16) for a in span.split("-"))
                if low <= start and end <= high:
                    if inode != "0" and path and path[0].startswith("/"):
                        ctypes.CDLL(None).madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first),
                                                  MADV_DONTNEED)
                    return
    except (OSError, AttributeError, ValueError):
        pass


def unpack_blocks(packed: torch.Tensor, fmt: str, n: int, k: int) -> torch.Tensor:
    """pack_blocks' weight [N, K] made again from its blocks: (d * q) + m (Q8_0: d * q) in float32, the values it
    was packed from, bit for bit (each one rounding of an exact product), for a caller that needs the float32
    weight after it was let go (LeanLlama.keep_blocks)."""
    blocks, groups = -(-n // BLOCK), k // GROUP
    scales = 2 if fmt == "q4_1" else 1  # d (and m): 16 float16 each, then the integers
    flat = packed.view(blocks, groups, -1)  # [B, G, bytes of a group]

    def scale(i: int) -> torch.Tensor:  # the i-th scale of each column and group, [B, 16, G, 1]
        half = flat[..., 2 * BLOCK * i:2 * BLOCK * (i + 1)].contiguous().view(torch.float16)  # [B, G, 16]
        return half.float().transpose(1, 2)[..., None]

    d, m = scale(0), scale(1) if scales == 2 else None
    ints = flat[..., scales * 2 * BLOCK:]
    if fmt == "q4_1":
        pairs = ints.view(blocks, groups, GROUP // 2, BLOCK)  # [B, G, 16 pairs, 16 columns]
        q = torch.stack([pairs & 15, pairs >> 4], -1).permute(0, 3, 1, 2, 4)  # [B, 16 columns, G, 16 pairs, 2]
        w = d * q.reshape(blocks, BLOCK, groups, GROUP).float() + m
    elif fmt == "q8_0":
        q = ints.view(torch.int8).view(blocks, groups, GROUP, BLOCK).permute(0, 3, 1, 2)  # [B, 16, G, 32]
        w = d * q.float()
    else:
        raise ValueError(f"no kernel for blocks {fmt!r}")
    return w.reshape(blocks * BLOCK, k)[:n].contiguous()


def bind_blocks(packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fmt: str,
                avx512: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
    """The product x [..., K] @ weight.T + bias -> [..., N] in float32 through the packed blocks."""
    n, k = weight.shape
    return _float32_product(getattr(library(), BLOCK_KERNELS[fmt, avx512]), packed, bias, n, k, "the blocks kernel")
