"""Measurements that take minutes, not pass/fail tests. Ratios are measured side by side in one run."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from statistics import median

from ..core.events import Run
from ..core.generator import (
    HEAD_DRAFTERS,
    Settings,
    draft_width,
    make_meta,
    parse_trees,
    speculative_events,
    tree_label,
)
from ..models.loading import ModelPair
from ..view import charts
from ..view.rendering import stats_html, stream_html


def render_page(run: Run) -> int:
    """What the app does each round: the stream and stats HTML and the four charts as Plotly JSON."""
    size = len(stream_html(run)) + len(stats_html(run))
    for fig in (charts.tokens_per_round(run), charts.tokens_over_time(run), charts.acceptance_by_position(run),
                charts.speedup_curve(run)):
        size += len(fig.to_json())
    return size


def render_cost(pair: ModelPair, prompt: str, prompt_ids: list[int], settings: Settings, repeats: int = 3) -> dict:
    """Seconds for the bare generator against the generator plus per-round page rendering.

    The two alternate, `repeats` times each, after a warm-up; medians are compared.
    """
    for _ in speculative_events(pair, prompt_ids, replace(settings, max_new_tokens=8)):
        pass
    bare, rendered = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in speculative_events(pair, prompt_ids, settings):
            pass
        bare.append(time.perf_counter() - start)

        run = Run(make_meta(pair, "speculative", prompt, prompt_ids, settings))
        start = time.perf_counter()
        for event in speculative_events(pair, prompt_ids, settings):
            run.events.append(event)
            render_page(run)
        rendered.append(time.perf_counter() - start)
    return {"bare_s": median(bare), "rendered_s": median(rendered), "ratio": median(rendered) / median(bare),
            "rounds": len(run.events), "tokens": run.n_tokens}


# --- forward passes: what one step costs, and what verifying k tokens costs ---------------------


MATMULS = "matrix products alone"


@dataclass
class StepRow:
    model: str  # "target" | "draft"
    cache: str  # "static, compiled" for the compiled forward
    ms: dict[int, float]  # tokens per forward -> ms, median over repeats

    def ratio(self, k: int) -> float:
        """A k-token forward in one-token forwards (what verifying k - 1 drafts costs in steps)."""
        return self.ms[k] / self.ms[1]


def step_times(pair: ModelPair, prompt_ids: list[int], caches: list[str], widths: tuple[int, ...] = (1, 5),
               repeats: int = 30, compile: bool = False) -> list[StepRow]:
    """ms per forward of k new tokens over a cached prompt, for each model and cache kind (and, with
    compile, the static cache's compiled forward beside its eager one). For a model with the lean
    static forward, also its matrix products alone (`MATMULS`): each weight matrix times k rows
    once, read from memory as in a step; no forward of that model can be faster.

    Each timed forward is rolled back (a verify pass whose drafts are all rejected), so every
    repeat runs at the same length; kinds and widths alternate within each repeat."""
    import torch

    from ..core.kvcache import KVState
    from ..models.leanllama import LeanLlama, Linear
    from .costs import timed_forward

    def timed_matmuls(lean: LeanLlama):
        linears = [m for m in lean.modules() if isinstance(m, Linear)]
        def run(k: int) -> float:
            inputs = {n: torch.randn(1, k, n, dtype=lean.head.weight.dtype, device=pair.device)
                      for n in {lin.weight.shape[1] for lin in linears}}
            start = time.perf_counter()
            for lin in linears:
                lin(inputs[lin.weight.shape[1]], True)
            if pair.device.type == "cuda":
                torch.cuda.synchronize()
            return 1000 * (time.perf_counter() - start)
        return run

    timers = {}  # (model, cache label) -> run(k) -> ms
    for model_name, model in (("target", pair.target), ("draft", pair.draft)):
        for cache in caches:
            for compiled in (False, True) if compile and cache == "static" else (False,):
                state = KVState(model, 1, cache, pair.vocab_size, len(prompt_ids) + max(widths) + 1, compiled)
                with torch.inference_mode():
                    state.prefill([prompt_ids], 0)
                timers[model_name, cache + (", compiled" if compiled else "")] = timed_forward(state, prompt_ids)
        if "static" in caches and LeanLlama.supports(model):
            timers[model_name, MATMULS] = timed_matmuls(LeanLlama.of(model))
    times: dict[tuple[str, str, int], list[float]] = {}
    with torch.inference_mode():
        for rep in range(repeats + 2):  # the first two warm up (and compile)
            for (model_name, cache), run in timers.items():
                for k in widths:
                    elapsed = run(k)
                    if rep >= 2:
                        times.setdefault((model_name, cache, k), []).append(elapsed)
    return [StepRow(model_name, cache, {k: median(times[model_name, cache, k]) for k in widths})
            for model_name, cache in timers]


def step_table(rows: list[StepRow]) -> str:
    widths = sorted(rows[0].ms)
    lines = ["| model | cache | " + " | ".join(f"ms, {k} token{'s' if k > 1 else ''}" for k in widths)
             + " | " + " | ".join(f"{k} tokens / 1" for k in widths[1:]) + " |",
             "|---|---|" + "---|" * (2 * len(widths) - 1)]
    for r in rows:
        lines.append(f"| {r.model} | {r.cache} | " + " | ".join(f"{r.ms[k]:.1f}" for k in widths) + " | "
                     + " | ".join(f"{r.ratio(k):.2f}" for k in widths[1:]) + " |")
    return "\n".join(lines) + "\n"


# --- the speedup benchmark: specviz against the baseline, Hugging Face and the theory ------------


@dataclass
class BenchRow:
    category: str
    prompt: str
    temperature: float
    gamma: int  # fixed γ, or the first round's under an adaptive policy
    alpha: float | None  # acceptance rate α̂ (median run)
    tokens_per_round: float
    c: float | None  # draft step / target step, measured
    baseline_tps: float  # specviz's plain target, tokens/s, median over repeats
    specviz_tps: float
    speedup: float  # median over repeats of specviz / baseline, each pair timed back to back
    bound: float | None  # Leviathan's bound for the measured α and c
    efficiency: float | None  # speedup / bound
    hf_plain_tps: float | None = None  # Hugging Face `generate` with the target alone
    speedup_vs_best: float | None = None  # median of specviz / max(baseline, HF plain) within each repeat
    hf_assisted_tps: float | None = None
    hf_lookup_tps: float | None = None
    specviz_over_hf: float | None = None  # median of specviz / HF assisted (or HF lookup) within each repeat
    tps_spread: float = 0.0  # (max - min) / median of specviz tokens/s over repeats
    identical_to_baseline: bool | None = None  # greedy only
    identical_to_hf: bool | None = None  # greedy only
    drafter: str = "model"  # a key of DRAFTER_KINDS
    policy: str = "fixed"  # γ policy (schedules.py)
    mean_gamma: float | None = None  # drafted tokens per round, for adaptive policies
    cache: str = "static"
    seed: int = 0  # sampled runs: one seed's text is one draw, so a bench may run several (a row each)
    tree: str = ""  # a tree's shape "γxbranch:nodes" (nodes 0: all drafted); "" for a chain
    depth_alpha: list[float] = field(default_factory=list)  # P(depth d kept | depth d - 1 kept), d = 1..
    # host-device syncs per round (syncs.py), counted in one eager run of the setting's first prompt
    syncs_per_round: float | None = None
    baseline_syncs_per_round: float | None = None
    # llama.cpp on the same GGUF file (peer.py), greedy, timed in the same blocks: plain, and prompt lookup at γ
    llama_plain_tps: float | None = None
    specviz_over_llama: float | None = None  # median of specviz / llama.cpp plain within each repeat
    baseline_over_llama: float | None = None  # the same for specviz's plain decoding
    llama_lookup_tps: float | None = None
    identical_to_llama: bool | None = None  # specviz's text = llama.cpp plain's
    # ms a round spends in each stage (events.STAGES), the median run's mean round; the baseline's, a plain step's
    stages_ms: dict[str, float] = field(default_factory=dict)
    baseline_stages_ms: dict[str, float] = field(default_factory=dict)


def _median_run(runs: list[Run]) -> Run:
    return sorted(runs, key=lambda r: r.tokens_per_s)[len(runs) // 2]


def _hf_generate(pair: ModelPair, prompt_ids: list[int], settings: Settings, **kwargs) -> tuple[float, list[int]]:
    """tokens/s and ids of HF `generate` with the same sampling settings (kwargs: assistant or lookup)."""
    import torch

    ids = torch.tensor([prompt_ids], device=pair.device)
    sampling = dict(do_sample=False) if settings.sampling.greedy else dict(
        do_sample=True, temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p)  # 0: off
    torch.manual_seed(settings.seed)
    start = time.perf_counter()
    with torch.inference_mode():
        out = pair.target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=settings.max_new_tokens,
                                   pad_token_id=pair.tokenizer.eos_token_id, **sampling, **kwargs)
    seconds = time.perf_counter() - start
    new = out[0, ids.shape[1]:].tolist()
    return len(new) / seconds, new


@contextmanager
def _assistant_drafts(draft, gamma: int):
    """HF's assisted generation drafting exactly γ tokens a round, like specviz. HF copies the
    assistant's generation_config when it starts, so it is set only for the call and restored."""
    config = draft.generation_config
    saved = {k: getattr(config, k) for k in ("num_assistant_tokens", "num_assistant_tokens_schedule",
                                             "assistant_confidence_threshold")}
    config.num_assistant_tokens, config.num_assistant_tokens_schedule = gamma, "constant"
    config.assistant_confidence_threshold = 0.0
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(config, k, v)


def _hf_counterpart(pair: ModelPair, prompt_ids: list[int], settings: Settings) -> tuple[float, list[int]] | None:
    """HF assisted generation (draft model) or HF prompt lookup at the same γ; None for adaptive γ
    and for the EAGLE head (transformers has no counterpart)."""
    if settings.gamma_policy != "fixed" or settings.drafter in HEAD_DRAFTERS:
        return None
    if settings.drafter == "lookup":
        return _hf_generate(pair, prompt_ids, settings, prompt_lookup_num_tokens=settings.gamma)
    with _assistant_drafts(pair.draft, settings.gamma):
        return _hf_generate(pair, prompt_ids, settings, assistant_model=pair.draft)


def _spec_row(category: str, prompt: str, settings: Settings, specs: list[Run], bases: list[Run],
              hf_plain: list[tuple[float, list[int]]], hf: list[tuple[float, list[int]]],
              llama: list[tuple[float, list[int]]] = (), llama_lookup: list[tuple[float, list[int]]] = ()
              ) -> BenchRow:
    """One setting against the baseline; repeat i of each list was timed in the same block."""
    from ..core.theory import cost_ratio, speedup_bound

    spec, base = _median_run(specs), _median_run(bases)
    kept = [e.n_accepted for e in spec.events if e.gamma]  # rounds that drafted
    tps = [r.tokens_per_s for r in specs]
    c = cost_ratio(spec, base)
    alpha = spec.acceptance_rate
    # The bound assumes i.i.d. acceptance at a fixed γ from a drafter with a cost: not lookup (copies are
    # kept in runs), not adaptive γ.
    bounded = "lookup" not in settings.drafter and settings.gamma_policy == "fixed" and settings.branch == 1
    bound = speedup_bound(alpha, settings.gamma, c) if bounded and alpha is not None and c is not None else None
    speedup = median(s.tokens_per_s / b.tokens_per_s for s, b in zip(specs, bases, strict=True))
    row = BenchRow(category, prompt, settings.temperature, settings.gamma, alpha, spec.tokens_per_round, c,
                   median(r.tokens_per_s for r in bases), median(tps), speedup, bound,
                   speedup / bound if bound else None, tps_spread=(max(tps) - min(tps)) / median(tps),
                   drafter=settings.drafter, policy=settings.gamma_policy, cache=settings.cache, seed=settings.seed,
                   tree=tree_label(settings.gamma, settings.branch, settings.nodes) if settings.branch > 1 else "",
                   depth_alpha=[sum(n >= d for n in kept) / max(1, sum(n >= d - 1 for n in kept))
                                for d in range(1, settings.gamma + 1)],
                   stages_ms=spec.mean_stages(), baseline_stages_ms=base.mean_stages())
    if hf_plain:
        row.hf_plain_tps = median(t for t, _ in hf_plain)
        row.speedup_vs_best = median(s.tokens_per_s / max(b.tokens_per_s, h)
                                     for s, b, (h, _) in zip(specs, bases, hf_plain, strict=True))
    if hf:
        hf_tps = median(t for t, _ in hf)
        if settings.drafter == "lookup":
            row.hf_lookup_tps = hf_tps
        else:
            row.hf_assisted_tps = hf_tps
        row.specviz_over_hf = median(s.tokens_per_s / h for s, (h, _) in zip(specs, hf, strict=True))
    if llama:
        row.llama_plain_tps = median(t for t, _ in llama)
        row.specviz_over_llama = median(s.tokens_per_s / t for s, (t, _) in zip(specs, llama, strict=True))
        row.baseline_over_llama = median(b.tokens_per_s / t for b, (t, _) in zip(bases, llama, strict=True))
        row.identical_to_llama = llama[0][1] == spec.token_ids
    if llama_lookup:
        row.llama_lookup_tps = median(t for t, _ in llama_lookup)
    if settings.gamma_policy != "fixed":
        row.mean_gamma = spec.mean_gamma
    if settings.sampling.greedy:
        row.identical_to_baseline = spec.token_ids == base.token_ids
        if hf or hf_plain:  # HF's counterpart at the same γ, else HF plain `generate`
            row.identical_to_hf = (hf or hf_plain)[0][1] == spec.token_ids
    return row


def bench_pair(pair: ModelPair, prompts: dict[str, list[str]], gammas: list[int], temperatures: list[float],
               max_new_tokens: int, repeats: int, with_hf: bool = True, progress=print,
               drafters: tuple[str, ...] = ("model", "lookup"), lookup_gammas: list[int] | None = None,
               policies: tuple[str, ...] = ("grow-shrink", "expected"), cache: str = "static",
               compile: bool = False, eagle_gammas: list[int] | None = None, seeds: int = 1,
               trees: list[tuple[int, int, int]] = (), record_top: int = 0,
               kept: Callable[[list[BenchRow], int], None] | None = None, peer=None) -> list[BenchRow]:
    """Per prompt and temperature, `repeats` blocks, each timing back to back: HF plain `generate`,
    specviz's baseline, then every setting (each drafter over its γ sweep with HF's assisted
    generation or prompt lookup at the same γ, then each adaptive policy with its defaults).
    This VM's speed drifts by tens of percent between runs, so ratios are taken within a block
    and their median reported. A temperature above 0 runs each prompt with seeds 0..seeds-1, a
    row each: two drafters decode different samples, and a median over a few prompts' single
    samples says more about those texts than about the drafters. Each head drafter also runs every
    tree shape (γ, branch, nodes) in `trees`. record_top: the candidates specviz's runs (speculative and
    baseline) record per position, as the app's do; 0 times the decode alone. kept(rows, prompts done) is called
    after each prompt's rows, so a caller can keep them before a run is stopped. peer: a peer.LlamaPeer on the
    target's GGUF file, timed in each greedy block too (plain, and prompt lookup beside specviz's at each γ)."""
    from ..core.generator import generate
    from ..models.loading import encode_prompt
    from .syncs import SyncCounter

    syncs: dict[tuple, float] = {}  # a setting's syncs per round, counted once (untimed: the counter is slow)

    def syncs_per_round(prompt: str, prompt_ids: list[int], settings: Settings, mode: str = "speculative") -> float:
        key = (mode, replace(settings, seed=0))
        if key not in syncs:
            with SyncCounter() as counter:
                run = generate(pair, prompt, replace(settings, compile=False), mode=mode, prompt_ids=prompt_ids)
            syncs[key] = counter.total / len(run.events)
        return syncs[key]

    sweep = {"model": gammas, "lookup": lookup_gammas or gammas, **dict.fromkeys(HEAD_DRAFTERS, eagle_gammas or gammas)}
    first = next(iter(prompts.values()))[0]
    for drafter in drafters:  # warm-up: first calls of every kernel and path (and every compiled width)
        for gamma in sweep[drafter]:
            generate(pair, first, Settings(gamma=gamma, max_new_tokens=gamma + 4, record_top=record_top,
                                           drafter=drafter, cache=cache, compile=compile))
        for gamma, branch, nodes in trees if drafter in HEAD_DRAFTERS else ():
            generate(pair, first, Settings(gamma=gamma, branch=branch, nodes=nodes, max_new_tokens=gamma + 4,
                                           record_top=record_top, drafter=drafter, cache=cache, compile=compile))
    generate(pair, first, Settings(max_new_tokens=8, record_top=record_top, cache=cache, compile=compile),
             mode="baseline")
    if peer is not None:
        first_ids = encode_prompt(pair.tokenizer, first)
        for lookup in (0, *(sweep["lookup"] if "lookup" in drafters else ())):
            peer.decode(first_ids, 8, pair.eos_token_ids, lookup)
    rows, done = [], 0
    for category, texts in prompts.items():
        for prompt in texts:
            prompt_ids = encode_prompt(pair.tokenizer, prompt)
            for temperature, seed in [(t, s) for t in temperatures for s in range(seeds if t > 0 else 1)]:
                base_settings = Settings(gamma=1, temperature=temperature, max_new_tokens=max_new_tokens,
                                         record_top=record_top, cache=cache, compile=compile, seed=seed)
                settings_list = [replace(base_settings, gamma=g, drafter=d) for d in drafters for g in sweep[d]]
                settings_list += [replace(base_settings, gamma=g, branch=k, nodes=n, drafter=d)
                                  for d in drafters if d in HEAD_DRAFTERS for g, k, n in trees]
                settings_list += [replace(base_settings, gamma=Settings.gamma, gamma_policy=p, drafter=d)
                                  for d in drafters for p in policies]
                bases, hf_plain, llama = [], [], []
                specs: list[list[Run]] = [[] for _ in settings_list]
                hfs: list[list] = [[] for _ in settings_list]
                lookups: list[list] = [[] for _ in settings_list]
                greedy = peer is not None and base_settings.sampling.greedy
                for _ in range(repeats):
                    if with_hf:
                        hf_plain.append(_hf_generate(pair, prompt_ids, base_settings))
                    if greedy:
                        llama.append(peer.decode(prompt_ids, max_new_tokens, pair.eos_token_ids))
                    bases.append(generate(pair, prompt, base_settings, mode="baseline", prompt_ids=prompt_ids))
                    for i, settings in enumerate(settings_list):
                        specs[i].append(generate(pair, prompt, settings, prompt_ids=prompt_ids))
                        hf = _hf_counterpart(pair, prompt_ids, settings) if with_hf else None
                        if hf is not None:
                            hfs[i].append(hf)
                        if greedy and settings.drafter == "lookup" and settings.gamma_policy == "fixed":
                            lookups[i].append(peer.decode(prompt_ids, max_new_tokens, pair.eos_token_ids,
                                                          settings.gamma))
                for settings, spec_runs, hf, lookup in zip(settings_list, specs, hfs, lookups, strict=True):
                    rows.append(_spec_row(category, prompt, settings, spec_runs, bases, hf_plain, hf, llama, lookup))
                    rows[-1].syncs_per_round = syncs_per_round(prompt, prompt_ids, settings)
                    rows[-1].baseline_syncs_per_round = syncs_per_round(prompt, prompt_ids, base_settings, "baseline")
                    label = settings.gamma if settings.gamma_policy == "fixed" else settings.gamma_policy
                    tree = f" tree {rows[-1].tree}" if rows[-1].tree else ""
                    progress(f"{category} T={temperature:g} seed {seed} {settings.drafter} γ={label}{tree}: "
                             f"α={_fmt(rows[-1].alpha)} tokens/round {rows[-1].tokens_per_round:.2f} "
                             f"speedup {rows[-1].speedup:.2f}x, vs the faster baseline "
                             f"{_fmt(rows[-1].speedup_vs_best)}x, {rows[-1].syncs_per_round:.1f} syncs/round")
            done += 1
            if kept is not None:
                kept(rows, done)
    return rows


def _fmt(x: float | None, spec: str = "{:.2f}") -> str:
    return "–" if x is None else spec.format(x)


@dataclass
class BatchRow:
    drafter: str
    gamma: int
    prompts: int
    batch_tps: float  # all rows' tokens over the batch's wall time, median over repeats
    sequential_tps: float  # the same prompts one after another, same settings
    ratio: float
    identical: bool  # every row's text equals its single-prompt run's


def bench_batch(pair: ModelPair, prompts: list[str], drafter: str, gamma: int, max_new_tokens: int,
                repeats: int, cache: str = "static", compile: bool = False) -> BatchRow:
    """Greedy: a batch of prompts against the same prompts run one after another, alternating."""
    from ..core.generator import generate, generate_batch
    from ..models.loading import encode_prompt

    settings = Settings(gamma=gamma, drafter=drafter, max_new_tokens=max_new_tokens, record_top=0, cache=cache,
                        compile=compile)
    ids = [encode_prompt(pair.tokenizer, p) for p in prompts]
    generate_batch(pair, prompts, replace(settings, max_new_tokens=8), prompts_ids=ids)  # warm-up
    batch_tps, seq_tps = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        rows = generate_batch(pair, prompts, settings, prompts_ids=ids)
        batch_tps.append(sum(r.n_tokens for r in rows) / (time.perf_counter() - start))
        start = time.perf_counter()
        alone = [generate(pair, p, settings, prompt_ids=i) for p, i in zip(prompts, ids, strict=True)]
        seq_tps.append(sum(r.n_tokens for r in alone) / (time.perf_counter() - start))
    identical = all(b.token_ids == a.token_ids for b, a in zip(rows, alone, strict=True))
    return BatchRow(drafter, gamma, len(prompts), median(batch_tps), median(seq_tps),
                    median(batch_tps) / median(seq_tps), identical)


def _shape_of(tree: str) -> tuple[int, int]:
    """(branch, nodes) of a tree label; (1, 0) for a chain's."""
    if not tree:
        return 1, 0
    _, branch, nodes = parse_trees(tree)[0]
    return branch, nodes


def _gamma_label(r: BenchRow) -> str:
    if r.tree:
        return f"tree {r.tree}"
    return str(r.gamma) if r.policy == "fixed" else f"{r.policy} (mean {r.mean_gamma:.1f})"


def markdown_table(rows: list[BenchRow]) -> str:
    head = ("| category | prompt | T | seed | drafter | γ | α | tokens/round | c | baseline tok/s | HF plain tok/s "
            "| specviz tok/s | speedup | vs faster baseline | bound | efficiency | HF assisted tok/s "
            "| HF lookup tok/s | specviz / HF | greedy text = baseline |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    body = ""
    for r in rows:
        same = "–" if r.identical_to_baseline is None else ("yes" if r.identical_to_baseline else "no")
        prompt = r.prompt.replace("\n", " ").replace("|", "\\|")[:40]
        body += (f"| {r.category} | {prompt} | {r.temperature:g} | {r.seed} | {r.drafter} | {_gamma_label(r)} | "
                 f"{_fmt(r.alpha)} | {r.tokens_per_round:.2f} | {_fmt(r.c, '{:.3f}')} | {r.baseline_tps:.1f} | "
                 f"{_fmt(r.hf_plain_tps, '{:.1f}')} | {r.specviz_tps:.1f} | {r.speedup:.2f}x | "
                 f"{_fmt(r.speedup_vs_best)}x | {_fmt(r.bound)} | {_fmt(r.efficiency)} | "
                 f"{_fmt(r.hf_assisted_tps, '{:.1f}')} | {_fmt(r.hf_lookup_tps, '{:.1f}')} | "
                 f"{_fmt(r.specviz_over_hf)} | {same} |\n")
    return head + body


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return median(values) if values else None


def summary_by_setting(rows: list[BenchRow]) -> str:
    """Median over prompts (and seeds) for each (drafter, temperature, γ or policy), and the mean tokens
    per round (the expectation a drafter's choice needs: costs.py). specviz / HF compares
    with HF assisted generation (draft model) or HF prompt lookup (lookup) at the same γ."""
    lines = ["| drafter | T | γ | median α | median tokens/round | mean tokens/round | median c | median speedup "
             "| median vs faster baseline | median bound | median efficiency | median specviz / HF | syncs/round |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    keys = sorted({(r.drafter, r.temperature, r.policy != "fixed", r.policy, r.tree, r.gamma) for r in rows})
    for drafter, t, _, policy, tree, g in keys:
        sel = [r for r in rows
               if (r.drafter, r.temperature, r.policy, r.tree, r.gamma) == (drafter, t, policy, tree, g)]
        label = str(g) if policy == "fixed" else f"{policy} (mean {_median(r.mean_gamma for r in sel):.1f})"
        label = f"tree {tree}" if tree else label
        lines.append(f"| {drafter} | {t:g} | {label} | {_fmt(_median(r.alpha for r in sel))} | "
                     f"{_fmt(_median(r.tokens_per_round for r in sel))} | "
                     f"{sum(r.tokens_per_round for r in sel) / len(sel):.2f} | {_fmt(_median(r.c for r in sel))} | "
                     f"{_fmt(_median(r.speedup for r in sel))}x | {_fmt(_median(r.speedup_vs_best for r in sel))}x | "
                     f"{_fmt(_median(r.bound for r in sel))} | {_fmt(_median(r.efficiency for r in sel))} | "
                     f"{_fmt(_median(r.specviz_over_hf for r in sel))} | "
                     f"{_fmt(_median(r.syncs_per_round for r in sel), '{:.1f}')} |")
    return "\n".join(lines) + "\n"


def baseline_summary(rows: list[BenchRow]) -> str:
    """specviz's plain target against HF plain `generate`, per temperature (median over prompts)."""
    lines = ["| T | median baseline tok/s | median HF plain tok/s | median baseline / HF plain | syncs/round |",
             "|---|---|---|---|---|"]
    for t in sorted({r.temperature for r in rows}):
        firsts = {}
        for r in rows:  # every row of a prompt and seed shares its baseline: take one of each
            if r.temperature == t and r.hf_plain_tps:
                firsts.setdefault((r.prompt, r.seed), r)
        if firsts:
            sel = list(firsts.values())
            lines.append(f"| {t:g} | {_median(r.baseline_tps for r in sel):.1f} | "
                         f"{_median(r.hf_plain_tps for r in sel):.1f} | "
                         f"{_median(r.baseline_tps / r.hf_plain_tps for r in sel):.2f}x | "
                         f"{_fmt(_median(r.baseline_syncs_per_round for r in sel), '{:.1f}')} |")
    return "\n".join(lines) + "\n"


def adaptive_summary(rows: list[BenchRow]) -> str:
    """Each adaptive policy against the best fixed γ of the sweep (by median speedup over prompts)."""
    lines = ["| drafter | T | best fixed γ | its median speedup | policy | median speedup | policy / best fixed |",
             "|---|---|---|---|---|---|---|"]
    for drafter, t in sorted({(r.drafter, r.temperature) for r in rows}):
        fixed = [r for r in rows if (r.drafter, r.temperature, r.policy, r.tree) == (drafter, t, "fixed", "")]
        by_gamma = {g: _median(r.speedup for r in fixed if r.gamma == g) for g in {r.gamma for r in fixed}}
        if not by_gamma:
            continue
        best = max(by_gamma, key=by_gamma.get)
        for policy in sorted({r.policy for r in rows} - {"fixed"}):
            adaptive = _median(r.speedup for r in rows if (r.drafter, r.temperature, r.policy) == (drafter, t, policy))
            if adaptive is not None:
                lines.append(f"| {drafter} | {t:g} | {best} | {by_gamma[best]:.2f}x | {policy} | {adaptive:.2f}x | "
                             f"{adaptive / by_gamma[best]:.3f} |")
    return "\n".join(lines) + "\n"


def category_summary(rows: list[BenchRow]) -> str:
    """Median speedup per prompt category, drafter and fixed γ, greedy: where each drafter pays."""
    greedy = [r for r in rows if r.temperature == 0 and r.policy == "fixed"]
    lines = ["| category | drafter | γ | median speedup | median α | median tokens/round |",
             "|---|---|---|---|---|---|"]
    for category, drafter, tree, g in sorted({(r.category, r.drafter, r.tree, r.gamma) for r in greedy}):
        sel = [r for r in greedy if (r.category, r.drafter, r.tree, r.gamma) == (category, drafter, tree, g)]
        lines.append(f"| {category} | {drafter} | {f'tree {tree}' if tree else g} | "
                     f"{_median(r.speedup for r in sel):.2f}x | "
                     f"{_fmt(_median(r.alpha for r in sel))} | {_median(r.tokens_per_round for r in sel):.2f} |")
    return "\n".join(lines) + "\n"


def tree_summary(rows: list[BenchRow]) -> str:
    """Every chain and tree of the head drafters, per temperature, best first: mean tokens per round,
    acceptance by depth (of rounds that kept d - 1 drafts, the share that kept d), median speedups."""
    lines = ["| drafter | T | shape | verify width | mean tokens/round | α by depth | median speedup "
             "| median vs faster baseline |", "|---|---|---|---|---|---|---|---|"]
    groups: dict[tuple, list[BenchRow]] = {}
    for r in rows:
        if r.drafter in HEAD_DRAFTERS and r.policy == "fixed":
            groups.setdefault((r.drafter, r.temperature, r.tree, r.gamma), []).append(r)

    def best(sel: list[BenchRow]) -> float:
        return _median(r.speedup_vs_best if r.speedup_vs_best is not None else r.speedup for r in sel) or 0.0

    for (drafter, t, tree, g), sel in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], -best(kv[1]))):
        depths = [_median(r.depth_alpha[d] for r in sel if len(r.depth_alpha) > d) for d in range(g)]
        branch, nodes = _shape_of(tree)
        width = draft_width(Settings(gamma=g, branch=branch, nodes=nodes, drafter="eagle")) + 1
        lines.append(f"| {drafter} | {t:g} | {f'tree {tree}' if tree else f'chain γ = {g}'} | {width} | "
                     f"{sum(r.tokens_per_round for r in sel) / len(sel):.2f} | {', '.join(map(_fmt, depths))} | "
                     f"{_fmt(_median(r.speedup for r in sel))}x | {_fmt(_median(r.speedup_vs_best for r in sel))}x |")
    return "\n".join(lines) + "\n"


def stage_summary(rows: list[BenchRow]) -> str:
    """Where a round's time goes, per (drafter, T, shape): the medians over prompts of each stage's ms in a mean
    round (events.STAGES) beside a plain step's; a head or draft model step (drafting over the γ levels drafted)
    and the round's work beside its forwards (judge, record, rest), each in the plain step's forwards."""
    from ..core.events import STAGES

    lines = ["| drafter | T | shape | round, ms | " + " | ".join(STAGES) + " | plain step, ms (its forward) "
             "| a draft step / a forward | judge + record + rest / a forward | tokens a round |",
             "|---|---|---|---|" + "---|" * len(STAGES) + "---|---|---|---|"]
    groups: dict[tuple, list[BenchRow]] = {}
    for r in rows:
        if r.stages_ms and r.policy == "fixed":
            groups.setdefault((r.drafter, r.temperature, r.tree, r.gamma), []).append(r)
    for (drafter, t, tree, g), sel in sorted(groups.items()):
        stage = {s: _median(r.stages_ms[s] for r in sel) for s in STAGES}
        plain = {s: _median(r.baseline_stages_ms[s] for r in sel) for s in STAGES}
        forward = plain["verify"]
        beside = stage["judge"] + stage["record"] + stage["rest"]
        lines.append(f"| {drafter} | {t:g} | {f'tree {tree}' if tree else f'chain γ = {g}'} | "
                     f"{sum(stage.values()):.2f} | " + " | ".join(f"{stage[s]:.2f}" for s in STAGES)
                     + f" | {sum(plain.values()):.2f} ({forward:.2f}) | {stage['draft'] / g / forward:.1%} | "
                     f"{beside / forward:.1%} | {_median(r.tokens_per_round for r in sel):.2f} |")
    return "\n".join(lines) + "\n"


def batch_table(batch_rows: list[BatchRow]) -> str:
    lines = ["| drafter | γ | prompts | batch tok/s | one after another tok/s | batch / sequential "
             "| same greedy text |",
             "|---|---|---|---|---|---|---|"]
    for b in batch_rows:
        lines.append(f"| {b.drafter} | {b.gamma} | {b.prompts} | {b.batch_tps:.1f} | {b.sequential_tps:.1f} | "
                     f"{b.ratio:.2f}x | {'yes' if b.identical else 'no'} |")
    return "\n".join(lines) + "\n"


def best_gamma(rows: list[BenchRow], drafter: str, temperature: float = 0.0) -> int | None:
    """The fixed γ with the best median speedup over prompts."""
    fixed = [r for r in rows if (r.drafter, r.temperature, r.policy, r.tree) == (drafter, temperature, "fixed", "")]
    by_gamma = {g: _median(r.speedup for r in fixed if r.gamma == g) for g in {r.gamma for r in fixed}}
    return max(by_gamma, key=by_gamma.get) if by_gamma else None


def speedup_chart(rows: list[BenchRow]):
    """Speedup against γ (median over prompts, fixed γ) with Leviathan's bound, per temperature;
    HF assisted generation; both lookups; the EAGLE head alone and after lookup."""
    from ..view.charts import COLOURS, PlotlySpec

    traces = []
    for t in sorted({r.temperature for r in rows}):
        dash = "solid" if t == 0 else "dash"

        def line(name: str, drafter: str, value, colour: str, mode: str = "lines+markers", t=t, dash=dash) -> None:
            sel = [r for r in rows if (r.temperature, r.drafter, r.policy, r.tree) == (t, drafter, "fixed", "")]
            gammas = sorted({r.gamma for r in sel})
            y = [_median(value(r) for r in sel if r.gamma == g) for g in gammas]
            if any(v is not None for v in y):
                traces.append({"type": "scatter", "mode": mode, "name": f"{name}, T={t:g}", "x": gammas, "y": y,
                               "line": {"color": colour, "dash": dash}})

        line("specviz, draft model", "model", lambda r: r.speedup, COLOURS["speculative"])
        line("Leviathan bound", "model", lambda r: r.bound, COLOURS["theory"], "lines")
        line("HF assisted", "model", lambda r: r.hf_assisted_tps and r.hf_assisted_tps / r.baseline_tps,
             COLOURS["correction"])
        line("specviz, prompt lookup", "lookup", lambda r: r.speedup, COLOURS["bonus"])
        line("HF prompt lookup", "lookup", lambda r: r.hf_lookup_tps and r.hf_lookup_tps / r.baseline_tps,
             COLOURS["baseline"])
        line("specviz, EAGLE head", "eagle", lambda r: r.speedup, COLOURS["eagle"])
        line("specviz, lookup then EAGLE head", "lookup+eagle", lambda r: r.speedup, COLOURS["lookup+eagle"])
    return PlotlySpec(data=traces, layout={
        "title": {"text": "Speedup over the plain target, median over prompts"}, "xaxis": {"title": {"text": "γ"}},
        "yaxis": {"title": {"text": "speedup (tokens/s over baseline tokens/s)"}}, "width": 900, "height": 500,
        "shapes": [{"type": "line", "xref": "paper", "x0": 0, "x1": 1, "y0": 1, "y1": 1,
                    "line": {"dash": "dot", "color": "#999"}}], "plot_bgcolor": "white",
    })


def environment(pair: ModelPair, others: float | None = None) -> dict:
    """The run's machine, versions and models; `others`: the part of the CPU time it needed that other
    processes took (contention.others_meter)."""
    import platform

    import torch
    import transformers

    from ..models import kernels

    env = {"device": str(pair.device), "dtype": str(pair.dtype).removeprefix("torch."),
           "threads": torch.get_num_threads(), "torch": torch.__version__, "transformers": transformers.__version__,
           "cpu": platform.processor() or platform.machine(), "target": pair.target_name, "draft": pair.draft_name}
    if pair.head is not None:
        env["head"] = pair.head_name
    if pair.weights:
        env["weights"] = pair.weights
    if pair.device.type == "cpu":
        env["cpu"], env["class"] = kernels.describe_machine(), kernels.cpu_class()
        chosen = kernels.summary(pair.dtype)
        env["kernels"], env["drafting_kernels"] = chosen["choice"], chosen["drafting"]
    elif pair.device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(pair.device)
    if others is not None:
        env["taken by other processes"] = f"{others:.0%} of the CPU time specviz needed"
    env["commit"], env["date"] = _commit(), time.strftime("%Y-%m-%d", time.gmtime())
    return env


@functools.cache
def _commit() -> str:
    """The checkout's short commit (with '+changes' when files differ from it), or 'unknown' outside git."""
    import subprocess
    from pathlib import Path

    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+changes" if dirty else "")


def write_results(rows: list[BenchRow], env: dict, out_dir: str, command: str,
                  batch_rows: list[BatchRow] = (), steps: list[StepRow] = (), stopped: str = "",
                  run: dict | None = None) -> dict[str, str]:
    """results.json, results.md and speedup.html (+ speedup.png when chromium and playwright are here). stopped:
    what a run still going has done (results.json and results.md only, each saying so); run: the settings every
    row shares (tokens, repeats, seeds), for the report."""
    import json
    from dataclasses import asdict
    from pathlib import Path

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "md": out / "results.md", "html": out / "speedup.html"}
    partial = {"stopped": stopped} if stopped else {}
    paths["json"].write_text(json.dumps({"environment": env, "command": command, "run": run or {}, **partial,
                                         "rows": [asdict(r) for r in rows], "batch": [asdict(b) for b in batch_rows],
                                         "steps": [asdict(r) for r in steps]},
                                        indent=2), encoding="utf-8")
    env_line = ", ".join(f"{k} {v}" for k, v in env.items() if k != "kernels")  # the choices are in results.json
    paths["md"].write_text(
        f"`{command}`\n\n{env_line}\n\n" + (f"**Not finished**: {stopped}.\n\n" if stopped else "")
        + (f"### Forward passes\n\n{step_table(steps)}\n" if steps else "")
        + f"### By setting\n\n{summary_by_setting(rows)}\n"
        + (f"### Chains and trees: tokens per round, acceptance by depth, speedup\n\n{tree_summary(rows)}\n"
           if any(r.tree for r in rows) else "")
        + (f"### Where a round's time goes\n\n{stage_summary(rows)}\n" if any(r.stages_ms for r in rows) else "")
        + f"### specviz's baseline against Hugging Face `generate`\n\n{baseline_summary(rows)}\n"
        f"### Adaptive γ against the best fixed γ\n\n{adaptive_summary(rows)}\n"
        f"### By prompt category (greedy)\n\n{category_summary(rows)}\n"
        + (f"### Batch against one after another (greedy)\n\n{batch_table(batch_rows)}\n" if batch_rows else "")
        + f"### Every run\n\n{markdown_table(rows)}", encoding="utf-8")
    if stopped:  # the charts come with the whole run; an earlier run's would not be this one's
        for chart in ("speedup.html", "speedup.png"):
            (out / chart).unlink(missing_ok=True)
        return {k: str(v) for k, v in paths.items() if k != "html"}
    fig = speedup_chart(rows).figure()
    fig.write_html(paths["html"], include_plotlyjs=True)
    try:  # PNG through a headless browser, where one is installed
        import shutil

        from playwright.sync_api import sync_playwright

        chromium = shutil.which("chromium")
        if chromium:
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
                page = browser.new_page(viewport={"width": 920, "height": 520})
                page.goto(paths["html"].resolve().as_uri())
                page.wait_for_selector(".main-svg")
                paths["png"] = out / "speedup.png"
                page.screenshot(path=str(paths["png"]))
                browser.close()
    except ImportError:
        pass
    return {k: str(v) for k, v in paths.items()}
