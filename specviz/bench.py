"""Measurements that take minutes, not pass/fail tests. Ratios are measured side by side in one run."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from statistics import median

from . import charts
from .events import Run
from .generator import Settings, make_meta, speculative_events
from .models import ModelPair
from .rendering import stats_html, stream_html


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


# --- the speedup benchmark: specviz against the baseline, Hugging Face and the theory ------------


@dataclass
class BenchRow:
    category: str
    prompt: str
    temperature: float
    gamma: int
    alpha: float | None  # acceptance rate α̂ (median over repeats)
    tokens_per_round: float
    c: float | None  # draft step / target step, measured
    baseline_tps: float  # tokens/s, median over repeats
    specviz_tps: float
    speedup: float
    bound: float | None  # Leviathan's bound for the measured α and c
    efficiency: float | None  # speedup / bound
    hf_assisted_tps: float | None = None
    hf_lookup_tps: float | None = None
    tps_spread: float = 0.0  # (max - min) / median of specviz tokens/s over repeats
    identical_to_baseline: bool | None = None  # greedy only
    identical_to_hf: bool | None = None  # greedy only


def _median_run(runs: list[Run]) -> Run:
    return sorted(runs, key=lambda r: r.tokens_per_s)[len(runs) // 2]


def _hf_generate(pair: ModelPair, prompt_ids: list[int], settings: Settings, **kwargs) -> tuple[float, list[int]]:
    """tokens/s and ids of HF `generate` with the same sampling settings (kwargs: assistant or lookup)."""
    import torch

    ids = torch.tensor([prompt_ids], device=pair.device)
    sampling = dict(do_sample=False) if settings.temperature == 0 else dict(
        do_sample=True, temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p)  # 0: off
    torch.manual_seed(settings.seed)
    start = time.perf_counter()
    with torch.inference_mode():
        out = pair.target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=settings.max_new_tokens,
                                   pad_token_id=pair.tokenizer.eos_token_id, **sampling, **kwargs)
    seconds = time.perf_counter() - start
    new = out[0, ids.shape[1]:].tolist()
    return len(new) / seconds, new


def bench_pair(pair: ModelPair, prompts: dict[str, list[str]], gammas: list[int], temperatures: list[float],
               max_new_tokens: int, repeats: int, with_hf: bool = True, progress=print) -> list[BenchRow]:
    from .generator import generate
    from .models import encode_prompt
    from .theory import cost_ratio, speedup_bound

    if with_hf:  # HF drafts exactly γ tokens a round, like specviz
        pair.draft.generation_config.num_assistant_tokens_schedule = "constant"
        pair.draft.generation_config.assistant_confidence_threshold = 0.0
    rows = []
    first = next(iter(prompts.values()))[0]
    warm = Settings(gamma=max(gammas), max_new_tokens=8, record_top=0)
    generate(pair, first, warm)
    generate(pair, first, warm, mode="baseline")
    for category, texts in prompts.items():
        for prompt in texts:
            prompt_ids = encode_prompt(pair.tokenizer, prompt)
            for temperature in temperatures:
                base_settings = Settings(gamma=1, temperature=temperature, max_new_tokens=max_new_tokens, record_top=0)
                bases = [generate(pair, prompt, base_settings, mode="baseline", prompt_ids=prompt_ids)
                         for _ in range(repeats)]
                base = _median_run(bases)
                for gamma in gammas:
                    settings = replace(base_settings, gamma=gamma)
                    specs = [generate(pair, prompt, settings, prompt_ids=prompt_ids) for _ in range(repeats)]
                    spec = _median_run(specs)
                    tps = [r.tokens_per_s for r in specs]
                    c = cost_ratio(spec, base)
                    alpha = spec.acceptance_rate
                    bound = speedup_bound(alpha, gamma, c) if alpha is not None and c is not None else None
                    speedup = spec.tokens_per_s / base.tokens_per_s
                    row = BenchRow(category, prompt, temperature, gamma, alpha, spec.tokens_per_round, c,
                                   base.tokens_per_s, spec.tokens_per_s, speedup, bound,
                                   speedup / bound if bound else None, tps_spread=(max(tps) - min(tps)) / median(tps))
                    if temperature == 0:
                        row.identical_to_baseline = spec.token_ids == base.token_ids
                    if with_hf:
                        pair.draft.generation_config.num_assistant_tokens = gamma
                        hf = [_hf_generate(pair, prompt_ids, settings, assistant_model=pair.draft)
                              for _ in range(repeats)]
                        row.hf_assisted_tps = median(t for t, _ in hf)
                        lookup = [_hf_generate(pair, prompt_ids, settings, prompt_lookup_num_tokens=gamma)
                                  for _ in range(repeats)]
                        row.hf_lookup_tps = median(t for t, _ in lookup)
                        if temperature == 0:
                            row.identical_to_hf = hf[0][1] == spec.token_ids
                    rows.append(row)
                    progress(f"{category} T={temperature} γ={gamma}: α={alpha if alpha is None else round(alpha, 3)} "
                             f"speedup {speedup:.2f}x")
    return rows


def markdown_table(rows: list[BenchRow]) -> str:
    def f(x, spec="{:.2f}"):
        return "–" if x is None else spec.format(x)

    head = ("| category | prompt | T | γ | α | tokens/round | c | baseline tok/s | specviz tok/s | speedup | bound "
            "| efficiency | HF assisted tok/s | specviz / HF | HF lookup tok/s | greedy text = baseline |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    body = ""
    for r in rows:
        ratio = r.specviz_tps / r.hf_assisted_tps if r.hf_assisted_tps else None
        same = "–" if r.identical_to_baseline is None else ("yes" if r.identical_to_baseline else "no")
        prompt = r.prompt.replace("\n", " ").replace("|", "\\|")[:40]
        body += (f"| {r.category} | {prompt} | {r.temperature:g} | {r.gamma} | {f(r.alpha)} | "
                 f"{r.tokens_per_round:.2f} | {f(r.c, '{:.3f}')} | {r.baseline_tps:.1f} | {r.specviz_tps:.1f} | "
                 f"{r.speedup:.2f}x | {f(r.bound)} | {f(r.efficiency)} | {f(r.hf_assisted_tps, '{:.1f}')} | "
                 f"{f(ratio)} | {f(r.hf_lookup_tps, '{:.1f}')} | {same} |\n")
    return head + body


def summary_by_setting(rows: list[BenchRow]) -> str:
    """Median over prompts for each (temperature, γ)."""
    lines = ["| T | γ | median α | median tokens/round | median c | median speedup | median bound | median efficiency "
             "| median specviz / HF assisted |", "|---|---|---|---|---|---|---|---|---|"]
    keys = sorted({(r.temperature, r.gamma) for r in rows})
    for t, g in keys:
        sel = [r for r in rows if (r.temperature, r.gamma) == (t, g)]

        def med(values):
            values = [v for v in values if v is not None]
            return f"{median(values):.2f}" if values else "–"

        lines.append(f"| {t:g} | {g} | {med(r.alpha for r in sel)} | {med(r.tokens_per_round for r in sel)} | "
                     f"{med(r.c for r in sel)} | {med(r.speedup for r in sel)}x | {med(r.bound for r in sel)} | "
                     f"{med(r.efficiency for r in sel)} | "
                     f"{med(r.specviz_tps / r.hf_assisted_tps for r in sel if r.hf_assisted_tps)} |")
    return "\n".join(lines) + "\n"


def speedup_chart(rows: list[BenchRow]):
    """Speedup against γ (median over prompts) with Leviathan's bound, per temperature; and specviz vs HF."""
    from .charts import COLOURS, PlotlySpec

    traces = []
    for t in sorted({r.temperature for r in rows}):
        gammas = sorted({r.gamma for r in rows if r.temperature == t})

        def med(attr, g, t=t):
            values = [getattr(r, attr) for r in rows if (r.temperature, r.gamma) == (t, g)]
            values = [v for v in values if v is not None]
            return median(values) if values else None

        dash = "solid" if t == 0 else "dash"
        traces += [
            {"type": "scatter", "mode": "lines+markers", "name": f"specviz, T={t:g}", "x": gammas,
             "y": [med("speedup", g) for g in gammas], "line": {"color": COLOURS["speculative"], "dash": dash}},
            {"type": "scatter", "mode": "lines", "name": f"Leviathan bound, T={t:g}", "x": gammas,
             "y": [med("bound", g) for g in gammas], "line": {"color": COLOURS["theory"], "dash": dash}},
        ]
        if any(r.hf_assisted_tps for r in rows):
            traces.append({"type": "scatter", "mode": "lines+markers", "name": f"HF assisted, T={t:g}", "x": gammas,
                           "y": [median(r.hf_assisted_tps / r.baseline_tps for r in rows
                                        if (r.temperature, r.gamma) == (t, g) and r.hf_assisted_tps)
                                 for g in gammas], "line": {"color": COLOURS["correction"], "dash": dash}})
    return PlotlySpec(data=traces, layout={
        "title": {"text": "Speedup over the plain target, median over prompts"}, "xaxis": {"title": {"text": "γ"}},
        "yaxis": {"title": {"text": "speedup (tokens/s over baseline tokens/s)"}}, "width": 900, "height": 500,
        "shapes": [{"type": "line", "xref": "paper", "x0": 0, "x1": 1, "y0": 1, "y1": 1,
                    "line": {"dash": "dot", "color": "#999"}}], "plot_bgcolor": "white",
    })


def environment(pair: ModelPair) -> dict:
    import platform

    import torch
    import transformers

    return {"device": str(pair.device), "dtype": str(pair.dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "transformers": transformers.__version__,
            "cpu": platform.processor() or platform.machine(), "target": pair.target_name, "draft": pair.draft_name}


def write_results(rows: list[BenchRow], env: dict, out_dir: str, command: str) -> dict[str, str]:
    """results.json, results.md and speedup.html (+ speedup.png when chromium and playwright are here)."""
    import json
    from dataclasses import asdict
    from pathlib import Path

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "md": out / "results.md", "html": out / "speedup.html"}
    paths["json"].write_text(json.dumps({"environment": env, "command": command, "rows": [asdict(r) for r in rows]},
                                        indent=2), encoding="utf-8")
    env_line = ", ".join(f"{k} {v}" for k, v in env.items())
    paths["md"].write_text(f"`{command}`\n\n{env_line}\n\n### By setting\n\n{summary_by_setting(rows)}\n"
                           f"### Every run\n\n{markdown_table(rows)}", encoding="utf-8")
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
