"""`python -m specviz check`: every way specviz decodes, run once on this device, each against an oracle.

A path no machine has run (a GPU's, say) is known to work only once it has. Instead of a page of
commands to type on a lent GPU, one command runs the whole matrix there (or on any new machine):
every cache kind, the compiled static cache where asked, greedy and sampled, one prompt and a
batch, each drafter kind, a chain and a tree. Every case is judged by oracles that can fail:
  - greedy: each prompt's speculative tokens equal plain decoding's with the same cache
    (speculation changes the cost of the text, never the text; Leviathan et al. 2023);
  - a batch: every row computes what its prompt computes alone with the same settings and seed: the
    same tokens, or, where a draw or a near tie parts them, the same p and q (every one both runs
    recorded for the same token, up to the round where they part) within rounding (float32: GAP; a
    drafter's q within QUANTIZED where it drafts through int8 products, whose rounding jumps);
  - sampled: the first round's emitted distribution, in closed form from the real p and q, equals
    the target's to float64 rounding (lossless.exact_check), and every recorded p, q, min(1, p/q)
    lies in [0, 1].
Another row count may take another kernel, whose sums round apart: in the last bits in float32,
by up to a step of the logits (several percent of a probability) in bfloat16 or float16. That moves
sampled draws that lie near a boundary and, in reduced precision, near ties, so texts that part
with their numbers within rounding are reported as `differs`, not failed; in float32 greedy text
must equal plain decoding's, and in reduced precision the gaps are shown, not judged, except where
every number is computed row by row alone (`row_alone`: attention in specviz's C kernel, in float32 the
layers in one C call, and each product through paths of one `bits` family at every row count): there any
difference fails. A reduced-precision greedy case whose texts part is decoded again in float32
(`float32_rerun`, the `check` command does so): texts that part there too fail. Each case
also reports its host-device waits per round (tools/syncs.py: what a GPU round waits for; eager
cases only), the warnings it raised (a compiled forward falling back to eager, for one), how
often inductor ran a compiled graph without CUDA graphs, and any graph dynamo compiled beyond the shapes
specviz counts (a recompile for a stride, a guard, a graph break). No timings here: `bench` measures.
"""

from __future__ import annotations

import logging
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field, replace

import torch
from torch._dynamo.utils import counters

from ..core.events import Run
from ..core.generator import Settings, encode_prompts, generate, generate_batch, tree_label
from ..core.kvcache import LEAN_BACKENDS
from ..models import kernels, native
from ..models.leanllama import LeanLlama
from ..models.loading import ModelPair
from ..view.rendering import first_difference
from .lossless import exact_check
from .prompts import BENCHMARK_PROMPTS
from .syncs import SyncCounter

# one prompt of three kinds: the edit repeats its input, so prompt lookup drafts there too
PROMPTS = [BENCHMARK_PROMPTS["classic"][0], BENCHMARK_PROMPTS["code"][0], BENCHMARK_PROMPTS["edit"][1]]
# (drafter, γ, branch, nodes): a draft model's chain, lookup then the head's chain, the head's tree
SHAPES = [("model", 3, 1, 0), ("lookup+eagle", 2, 1, 0), ("eagle", 3, 2, 4)]
EXACT = 1e-9  # the closed-form check's tolerance, max |emitted − p| in float64
# how far apart a row's p and q may be, alone and in a batch, relative (below 1e-3: absolute): rounding, not a
# batching bug (an int8 product in one and bfloat16 weights in the other put q far beyond it)
GAP = {torch.float32: 1e-3, torch.float64: 1e-3}
QUANTIZED = 0.1  # int8 products: a last-bit change upstream moves a value across a quantization step


@dataclass(frozen=True)
class Case:
    drafter: str
    gamma: int
    branch: int
    nodes: int
    cache: str
    compiled: bool
    temperature: float

    @property
    def name(self) -> str:
        shape = f"γ {self.gamma}" if self.branch == 1 else f"tree {tree_label(self.gamma, self.branch, self.nodes)}"
        cache = self.cache + (" compiled" if self.compiled else "")
        return f"{self.drafter} {shape}, {cache} cache, T={self.temperature:g}"

    def settings(self, max_new_tokens: int) -> Settings:
        return Settings(drafter=self.drafter, gamma=self.gamma, branch=self.branch, nodes=self.nodes,
                        cache=self.cache, compile=self.compiled, temperature=self.temperature, seed=7,
                        max_new_tokens=max_new_tokens)


@dataclass
class Outcome:
    case: Case
    status: str  # "ok" | "differs" (texts apart, numbers within rounding) | "failed" | "skipped" (refused)
    checks: list[str] = field(default_factory=list)  # what held, or what did not
    waits_per_round: float | None = None
    warnings: list[str] = field(default_factory=list)
    error: str = ""  # a traceback, when the case raised


# A CUDA error such as a device-side assert leaves the process's CUDA context unusable: every later call fails
# with it, so the cases after it would only repeat it
DEVICE_LOST = ("device-side assert", "CUDA error", "AcceleratorError")


def cases(compiled: bool) -> list[Case]:
    """The matrix: cache kinds (and the compiled static cache), drafter shapes, greedy and sampled."""
    caches = [("static", False), ("dynamic", False), ("none", False)] + ([("static", True)] if compiled else [])
    return [Case(d, g, b, n, cache, comp, t) for cache, comp in caches for d, g, b, n in SHAPES for t in (0.0, 1.0)]


class _Caught(logging.Handler):
    """Warnings logged while a case runs (specviz's and torch's; not progress), in order, each once."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage().strip().splitlines()[0][:200]
        if text not in self.seen and not getattr(record, "progress", False):
            self.seen.append(text)


def _in_range(run: Run) -> bool:
    """Every recorded probability of the run is a number in [0, 1] (NaN is not)."""
    values = [v for e in run.events for t in e.drafted for v in (t.p, t.q, t.accept_prob)]
    return all(0.0 <= v <= 1.0 for v in values + [e.extra.p for e in run.events if e.extra])


def _quantized(pair: ModelPair) -> bool:
    """Whether the EAGLE head's products took an int8 path (kernels.py) for some row count."""
    linears = pair.head.lean_linears().values() if pair.head is not None else []
    return any(kernels.PATHS[name].numbers == "int8" for lin in linears for name in lin.paths.values())


def one_family(lin) -> bool:
    """Whether a product took paths of one row-invariant `bits` family at every row count it ran (or ran none)."""
    families = {kernels.PATHS[name].bits for name in lin.paths.values()}
    return len(families) <= 1 and "" not in families


def row_alone(pair: ModelPair, case: Case) -> bool:
    """Whether the case's numbers were all computed row by row alone, after it ran (the paths are chosen as row
    counts come): specviz's lean forward (any cache kind of a Llama-family model), eager, on a CPU, attention
    through specviz's C kernel (a query's bits from the keys it sees alone: leanllama.attend in bfloat16; in
    float32 only inside native.layers, so there every product must have taken a path that call runs), and every
    product of the target and of the drafter through paths of one `bits` family at every row count it took. Then
    a verify row, a tree node, a batch row and a text run again whole (`none`) carry the bits of the plain step
    and of the prompt alone, and any difference is a bug."""
    if case.cache not in LEAN_BACKENDS or case.compiled or pair.device.type != "cpu" \
            or pair.dtype not in (torch.bfloat16, torch.float32) or not native.runs_here():
        return False
    leans = [LeanLlama.of(m) for m in (pair.target, pair.draft if case.drafter == "model" else None)
             if m is not None and LeanLlama.supports(m)]
    if len(leans) < 1 + (case.drafter == "model"):
        return False
    heads = [(lean.heads, lean.kv_heads, lean.head_dim) for lean in leans]
    linears = [lin for lean in leans for lin in lean.linears()]
    if "eagle" in case.drafter and pair.head is not None:
        c = pair.head.config
        heads.append((c.heads, c.kv_heads, c.head_dim))
        linears += pair.head.lean_linears().values()
    in_call = pair.dtype == torch.bfloat16 or all(kernels.PATHS[name].layers for lin in linears
                                                   for name in lin.paths.values())
    return in_call and all(native.attends(*h) for h in heads) and all(one_family(lin) for lin in linears)


def gap(a: Run, b: Run) -> tuple[float, float]:
    """The largest relative gaps between the p, and between the q, both runs recorded for the same token,
    up to the round where their tokens part ((0, 0) for two identical runs)."""
    p_gap = q_gap = 0.0
    for ea, eb in zip(a.events, b.events, strict=False):
        same = [(x, y) for x, y in zip(ea.drafted, eb.drafted, strict=False) if x.id == y.id]
        ps = [(x.p, y.p) for x, y in same] + ([(ea.extra.p, eb.extra.p)] if ea.extra and eb.extra
                                                and ea.extra.id == eb.extra.id else [])
        p_gap = max([p_gap] + [abs(x - y) / max(abs(x), abs(y), 1e-3) for x, y in ps])
        q_gap = max([q_gap] + [abs(x.q - y.q) / max(abs(x.q), abs(y.q), 1e-3) for x, y in same])
        if ea.new_tokens != eb.new_tokens:
            break
    return p_gap, q_gap


def judge(case: Case, dtype: torch.dtype, singles: list[Run], batch: list[Run], plain: list[Run] | None,
          exact_diff: float | None, quantized: bool = False, alone: bool = False) -> tuple[str, list[str]]:
    """(status, checks) of one case from its runs (module docstring); `quantized`: the drafter's products
    went through int8; `alone`: every number was computed row by row alone (row_alone), so judged bit for bit."""
    failed, differs, checks = False, False, []
    if plain is not None:  # greedy
        parts = [first_difference(s.token_ids, p.token_ids) for s, p in zip(singles, plain, strict=True)]
        apart = [at for at in parts if at is not None]
        checks.append(f"greedy = plain decoding {len(parts) - len(apart)}/{len(parts)}"
                      + (f" (first difference at token {min(apart)})" if apart else ""))
        failed |= bool(apart) and (dtype in GAP or alone)
        differs |= bool(apart)
    same = sum(b.token_ids == s.token_ids for b, s in zip(batch, singles, strict=True))
    gaps = [gap(b, s) for b, s in zip(batch, singles, strict=True)]
    p_gap, q_gap = (max(g[i] for g in gaps) for i in (0, 1))
    checks.append(f"batch rows = alone {same}/{len(batch)}"
                  + (f", p within {p_gap:.0e}, q within {q_gap:.0e}" if p_gap or q_gap else ""))
    if dtype in GAP and (p_gap > GAP[dtype] or q_gap > (QUANTIZED if quantized else GAP[dtype])):
        checks[-1] += " (beyond rounding: the batch computes other numbers)"
        failed = True
    differs |= same < len(batch)
    if alone:
        checks.append("judged bit for bit (every row computed alone)")
        failed |= differs or p_gap > 0 or q_gap > 0
    if exact_diff is not None:
        checks.append(f"first round exact: max|emitted−p| {exact_diff:.1e}")
        failed |= not exact_diff <= EXACT
    if not all(_in_range(r) for r in singles + batch):
        checks.append("a p, q or min(1, p/q) outside [0, 1]")
        failed = True
    if not any(r.n_tokens for r in singles):
        checks.append("no tokens")
        failed = True
    return ("failed" if failed else "differs" if differs else "ok"), checks


def run_case(pair: ModelPair, case: Case, prompts: list[str], max_new_tokens: int,
             plain: Callable[[Case], list[Run]]) -> Outcome:
    """One case: each prompt alone, then all as a batch, then the oracles; never raises."""
    settings = case.settings(max_new_tokens)
    try:
        encode_prompts(pair, prompts, settings)  # validation before any model work: a refusal is a skip
    except ValueError as err:
        return Outcome(case, "skipped", [str(err)])
    caught, skips = _Caught(), counters["inductor"]["cudagraph_skips"]
    graphs, shapes = counters["stats"]["unique_graphs"], LeanLlama.shapes_compiled
    logging.getLogger().addHandler(caught)
    try:
        with warnings.catch_warnings(record=True) as raised:
            warnings.simplefilter("always")
            counter = SyncCounter()
            with counter if not case.compiled else nullcontext():
                first = generate(pair, prompts[0], settings)
            singles = [first] + [generate(pair, p, settings) for p in prompts[1:]]
            batch = generate_batch(pair, prompts, settings)
            greedy = case.temperature == 0
            diff = None if greedy else exact_check(pair, prompts[0], replace(settings, compile=False)).max_diff
            status, checks = judge(case, pair.dtype, singles, batch, plain(case) if greedy else None, diff,
                                   _quantized(pair) and "eagle" in case.drafter, row_alone(pair, case))
        if counters["inductor"]["cudagraph_skips"] > skips:  # inductor ran a compiled graph without CUDA graphs
            checks.append(f"CUDA graphs skipped {counters['inductor']['cudagraph_skips'] - skips} times "
                          "(TORCH_LOGS=cudagraphs says why)")
        extra = counters["stats"]["unique_graphs"] - graphs - (LeanLlama.shapes_compiled - shapes)
        if extra > 0:  # dynamo compiled again for something other than a new shape (each: a compile, a recording)
            checks.append(f"{extra} graph(s) compiled beyond the shapes counted (TORCH_LOGS=recompiles says why)")
        found = caught.seen + [str(w.message).splitlines()[0][:200] for w in raised]
        waits = None if case.compiled else counter.total / max(1, len(first.events))
        return Outcome(case, status, checks, waits, list(dict.fromkeys(found)))
    except Exception as err:  # noqa: BLE001 - a case that raises is a finding, and the others still run
        return Outcome(case, "failed", [f"{type(err).__name__}: {err}".splitlines()[0][:300]],
                       error=traceback.format_exc())
    finally:
        logging.getLogger().removeHandler(caught)


def float32_rerun(pair32: ModelPair, case: Case, prompts: list[str], max_new_tokens: int) -> tuple[bool, str]:
    """A greedy case decoded again in float32 (eager), speculative against plain: whether their texts agree there,
    and the check's line. Where reduced precision parted them, this tells a near tie (float32 agrees) from a fault
    (float32 parts too)."""
    settings = replace(case.settings(max_new_tokens), compile=False)
    plain = Settings(cache=case.cache, max_new_tokens=max_new_tokens)
    parts = [first_difference(generate(pair32, p, settings).token_ids,
                              generate(pair32, p, plain, mode="baseline").token_ids) for p in prompts]
    apart = [at for at in parts if at is not None]
    line = f"float32 rerun: greedy = plain {len(parts) - len(apart)}/{len(parts)}"
    return not apart, line + (f" (first difference at token {min(apart)}): not rounding" if apart else
                              ": the reduced-precision texts parted at near ties")


def check(pair: ModelPair, compiled: bool, max_new_tokens: int = 24, prompts: list[str] | None = None,
          only: Callable[[Case], bool] | None = None, float32: Callable[[], ModelPair] | None = None
          ) -> Iterator[Outcome]:
    """Every case of the matrix on `pair`, an Outcome each as it finishes. float32: the pair in float32 (loaded
    when first asked), to rerun a greedy case whose texts parted in reduced precision (float32_rerun)."""
    prompts = prompts or PROMPTS
    plain_runs: dict[tuple[str, bool], list[Run]] = {}

    def plain(case: Case) -> list[Run]:  # plain decoding with the case's cache, once per cache
        key = (case.cache, case.compiled)
        if key not in plain_runs:
            settings = Settings(cache=case.cache, compile=case.compiled, max_new_tokens=max_new_tokens)
            plain_runs[key] = [generate(pair, p, settings, mode="baseline") for p in prompts]
        return plain_runs[key]

    lost = ""  # the error after which the device can run nothing more
    for case in cases(compiled):
        if only is not None and not only(case):
            continue
        if lost:
            yield Outcome(case, "skipped", [f"not run: the device failed in an earlier case ({lost})"])
            continue
        outcome = run_case(pair, case, prompts, max_new_tokens, plain)
        if outcome.error and any(sign in outcome.error for sign in DEVICE_LOST):
            lost = outcome.checks[0]
        elif outcome.status == "differs" and case.temperature == 0 and float32 is not None:
            agree, line = float32_rerun(float32(), case, prompts, max_new_tokens)
            outcome.checks.append(line)
            outcome.status = "differs" if agree else "failed"
        yield outcome


def report_line(o: Outcome) -> str:
    waits = "" if o.waits_per_round is None else f"; {o.waits_per_round:.1f} waits/round"
    return f"{o.status:8s} {o.case.name}: {'; '.join(o.checks)}{waits}"
