"""BENCHMARKS.md and the README's speed tables, rendered from the per-machine results files that `bench --save`
writes (benchmarks/*.json). Nothing here measures: the files are the record, the documents are views of them."""

from __future__ import annotations

import json
import re
from pathlib import Path

from .bench import _median

README_START, README_END = "<!-- speed tables: written by `python -m specviz bench --report` -->", "<!-- /speed -->"

# a machine class's heading, in the order the report lists them (unknown classes follow, by name)
# the environment that makes a CPU run a lower class's kernels (kernels.cpu_class), for files that predate the command
# recording it
CAPS = {"cpu-avx2-capped": "ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2"}
CLASS_TITLES = {
    "cpu-avx2": "CPUs with AVX2 only (most laptops and many cloud VMs)",
    "cpu-avx2-capped": "AVX2 kernels on an AVX-512 CPU (ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2)",
    "cpu-avx512": "CPUs with AVX-512, no bfloat16 instructions",
    "cpu-avx512-bf16": "CPUs with AVX512-BF16, no AMX",
    "cpu-amx": "CPUs with AMX tiles (recent Intel Xeon)",
}

METHOD = """\
Every results file is one `python -m specviz bench` run on one machine, and its table below says which. A run
decodes the benchmark prompts (`specviz/tools/prompts.py`: classic, chat, code and edit prompts, none of them
used to train a drafter) greedily and at temperature 1, with the same seeds for every decoder. For each prompt
the run times, back to back in one block: Hugging Face plain `generate`, specviz's plain decoding, and every
speculative setting, with Hugging Face's assisted generation and prompt lookup at the same γ. A setting's
speedup on a prompt is the median over the blocks of its tokens/s over the faster of the two plain decoders *in
the same block*; a table's figure is the median over prompts (and seeds). Tokens/s are medians too and move
with the machine's load; ratios taken within a block move much less. Runs on the shared 2-core VMs these files
come from differ by 20-30 % in absolute speed from one run to the next.

"Greedy text = plain" counts the prompts whose greedy speculative text is token for token specviz's plain
decoding's. In float32 that is exactness; in bfloat16 a step and a verify can round a near tie apart (README,
"Exactness")."""


def machine_file(env: dict, dtype_asked: str = "auto") -> str:
    """The results file's name for a run's environment: the machine class (cpu-avx2, cpu-amx, gpu-<name>), and
    the dtype when it was not the machine's own choice."""
    if env.get("device", "cpu").startswith("cuda"):
        name = "gpu-" + re.sub(r"[^a-z0-9]+", "-", env.get("gpu", "cuda").lower()).strip("-")
    else:
        name = "cpu-" + env.get("class", "other").lower().replace(" (capped)", "-capped")
    return name + ("" if dtype_asked == "auto" else f"-{env.get('dtype', dtype_asked)}") + ".json"


def load(folder: str | Path) -> dict[str, dict]:
    """name -> results (a results.json's content), every *.json in the folder."""
    return {p.stem: json.loads(p.read_text(encoding="utf-8")) for p in sorted(Path(folder).glob("*.json"))}


def _x(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}x"


def _tps(v: float | None) -> str:
    return "–" if v is None else f"{v:.1f}"


def _label(r: dict) -> str:
    if r["tree"]:
        return f"{r['drafter']}, tree {r['tree']}"
    return f"{r['drafter']}, γ = {r['gamma']}" if r["policy"] == "fixed" else f"{r['drafter']}, {r['policy']} γ"


def _choice_label(choice: dict | None) -> str:
    return _label({"tree": "", "policy": "fixed", **choice}) if choice else ""


def rows_of(results: dict) -> list[dict]:
    """The table's rows, each a dict: name, tps (greedy tokens/s), vs (greedy, against the faster plain
    decoder), tau (mean tokens a round, greedy), hot (T > 0, against the faster plain decoder), same ('k of n'),
    choice (the machine's first-run choice), kind ('hf', 'plain' or 'specviz')."""
    rows = results["rows"]
    greedy = [r for r in rows if r["temperature"] == 0]
    hot = [r for r in rows if r["temperature"] > 0]

    def per_prompt(sel: list[dict]) -> list[dict]:  # every row of a prompt (and seed) shares its baselines
        return list({(r["prompt"], r["seed"]): r for r in sel}.values())

    def best(r: dict) -> float:
        return max(r["baseline_tps"], r["hf_plain_tps"] or 0.0)

    def over_llama(sel: list[dict], key: str) -> float | None:  # tokens/s against llama.cpp plain's, greedy
        return _median(r[key] / r["llama_plain_tps"] for r in sel if r.get("llama_plain_tps") and r[key])

    out = []
    for name, key in (("Hugging Face plain `generate`", "hf_plain_tps"), ("specviz plain", "baseline_tps")):
        firsts = [r for r in per_prompt(greedy) if r[key]]
        hot_firsts = [r for r in per_prompt(hot) if r[key]]
        if firsts:
            out.append({"name": name, "kind": "hf" if key.startswith("hf") else "plain",
                        "tps": _median(r[key] for r in firsts), "vs": _median(r[key] / best(r) for r in firsts),
                        "tau": None, "hot": _median(r[key] / best(r) for r in hot_firsts), "same": "",
                        "llama": _median(r.get("baseline_over_llama") for r in firsts) if key == "baseline_tps"
                        else over_llama(firsts, key)})
    llama = [r for r in per_prompt(greedy) if r.get("llama_plain_tps")]
    if llama:
        out.append({"name": "llama.cpp plain, the same GGUF file", "kind": "peer",
                    "tps": _median(r["llama_plain_tps"] for r in llama),
                    "vs": _median(r["llama_plain_tps"] / best(r) for r in llama), "tau": None, "hot": None,
                    "same": "", "llama": 1.0})
    for gamma in sorted({r["gamma"] for r in greedy if r.get("llama_lookup_tps")}):
        sel = [r for r in greedy if r["gamma"] == gamma and r.get("llama_lookup_tps")]
        out.append({"name": f"llama.cpp prompt lookup, γ = {gamma}", "kind": "peer",
                    "tps": _median(r["llama_lookup_tps"] for r in sel),
                    "vs": _median(r["llama_lookup_tps"] / best(r) for r in sel), "tau": None, "hot": None,
                    "same": "", "llama": over_llama(sel, "llama_lookup_tps")})
    for name, drafter, key in (("Hugging Face assisted (draft model)", "model", "hf_assisted_tps"),
                               ("Hugging Face prompt lookup", "lookup", "hf_lookup_tps")):
        for gamma in sorted({r["gamma"] for r in rows if r["drafter"] == drafter and r[key]}):
            def sel(part: list[dict], gamma=gamma, drafter=drafter, key=key) -> list[dict]:
                return [r for r in part if (r["drafter"], r["gamma"], r["policy"], r["tree"]) ==
                        (drafter, gamma, "fixed", "") and r[key]]
            out.append({"name": f"{name}, γ = {gamma}", "kind": "hf", "tps": _median(r[key] for r in sel(greedy)),
                        "vs": _median(r[key] / best(r) for r in sel(greedy)), "tau": None,
                        "hot": _median(r[key] / best(r) for r in sel(hot)), "same": "",
                        "llama": over_llama(sel(greedy), key)})
    choice = _choice_label(results["environment"].get("first_run_choice"))
    spec = []
    for label in dict.fromkeys(_label(r) for r in rows):
        g = [r for r in greedy if _label(r) == label]
        h = [r for r in hot if _label(r) == label]
        same = [r["identical_to_baseline"] for r in g if r["identical_to_baseline"] is not None]
        spec.append({"name": label, "kind": "specviz", "choice": label == choice,
                     "tps": _median(r["specviz_tps"] for r in g),
                     "vs": _median(r["speedup_vs_best"] or r["speedup"] for r in g),
                     "tau": sum(r["tokens_per_round"] for r in g) / len(g) if g else None,
                     "hot": _median(r["speedup_vs_best"] or r["speedup"] for r in h),
                     "same": f"{sum(same)} of {len(same)}" if same else "",
                     "llama": _median(r.get("specviz_over_llama") for r in g)})
    return out + sorted(spec, key=lambda s: -(s["vs"] if s["vs"] is not None else s["hot"] or 0.0))


def _table(rows: list[dict]) -> str:
    """The decoders' table; with a column against llama.cpp plain where the run timed it."""
    peer = any(r.get("llama") is not None for r in rows)
    lines = ["| decoder | tokens/s, greedy | vs the faster plain decoder, greedy | tokens a round | "
             "vs the faster plain decoder, T = 1 | greedy text = plain |" + (" vs llama.cpp plain, greedy |" * peer),
             "|---|---|---|---|---|---|" + "---|" * peer]
    for r in rows:
        name = r["name"] + (" (**this machine's first-run choice**)" if r.get("choice") else "")
        tau = "–" if r["tau"] is None else f"{r['tau']:.2f}"
        lines.append(f"| {name} | {_tps(r['tps'])} | {_x(r['vs'])} | {tau} | {_x(r['hot'])} | {r['same'] or '–'} |"
                     + (f" {_x(r.get('llama'))} |" if peer else ""))
    return "\n".join(lines)


def _class_of(name: str) -> str:
    """A results file's machine class: its name without the dtype a run asked for (machine_file)."""
    return re.sub(r"-(float32|bfloat16|float16)$", "", name)


def _title(name: str) -> str:
    base = _class_of(name)
    title = CLASS_TITLES.get(base, f"GPU: {base.removeprefix('gpu-')}" if base.startswith("gpu-") else base)
    return title + (f", {name[len(base) + 1:]}" if base != name else "")


def _order(name: str) -> tuple:
    base = _class_of(name)
    return (list(CLASS_TITLES).index(base) if base in CLASS_TITLES else len(CLASS_TITLES), name)


def _about(results: dict) -> str:
    env, run = results["environment"], results.get("run", {})
    rows = results["rows"]
    prompts = len({r["prompt"] for r in rows})
    seeds = run.get("seeds", 1)
    head = f"; EAGLE head {env['head']}" if env.get("head") else ""
    weights = f" (the target reads {env['weights']})" if env.get("weights") else ""
    peer = env.get("peer", "")
    peer = (f" llama.cpp: {peer}, {env.get('threads', '?')} threads, in its own process."
            if peer.startswith("llama-cpp") else f" No llama.cpp row: {peer}." if peer and peer != "off" else "")
    return (f"Machine: {env.get('cpu', env.get('device'))}; {env.get('dtype')}{weights}; target {env.get('target')}, "
            f"draft {env.get('draft')}{head}. {prompts} prompts, {run.get('max_new_tokens', '?')} new tokens each, "
            f"{run.get('repeats', '?')} timed blocks per prompt" + (f", {seeds} seeds at T = 1" if seeds > 1 else "")
            + "." + peer)


def _steps(results: dict) -> str:
    static = [s for s in results.get("steps", []) if (s["model"], s["cache"]) == ("target", "static")]
    if not static:
        return ""
    ms = {int(k): v for k, v in static[0]["ms"].items()}
    widths = ", ".join(f"{k} tokens {ms[k] / ms[1]:.2f}" for k in sorted(ms) if k > 1)
    return (f"The target's forward on the static cache: {ms[1]:.1f} ms for one token; a verify of k tokens costs, "
            f"in one-token forwards: {widths}.")


def _command(name: str, results: dict) -> str:
    """The command that re-measures this file's class: its caps first, where the class is a capped one."""
    caps = CAPS.get(_class_of(name), "")
    command = results["command"]
    return f"{caps} {command}" if caps and not command.startswith(caps) else command


def _footer(name: str, results: dict) -> str:
    env = results["environment"]
    bits = [f"`{_command(name, results)}`", f"commit {env.get('commit', '?')}", env.get("date", "?"),
            f"torch {env.get('torch', '?')}", f"{env.get('threads', '?')} threads"]
    if env.get("taken by other processes"):
        bits.append(f"other processes took {env['taken by other processes']}")
    if results.get("stopped"):
        bits.append(f"**not finished: {results['stopped']}**")
    return "<sub>" + " · ".join(bits) + "</sub>"


def benchmarks_md(files: dict[str, dict]) -> str:
    """BENCHMARKS.md: the method once, then per results file one table, best speculative setting first."""
    parts = ["# Benchmarks", "",
             "Written by `python -m specviz bench --report` from the results files in `benchmarks/` (one a machine "
             "class); do not edit it by hand. To add or re-measure your machine's class, run the command under a "
             "table (it ends in `--save benchmarks`; tens of minutes on two cores), then `python -m specviz bench "
             "--report`.", "",
             "## Method", "", METHOD, ""]
    if not files:
        parts += ["No machine has been measured yet.", ""]
    for name in sorted(files, key=_order):
        results = files[name]
        parts += [f"## {_title(name)}", "", _about(results), "", _table(rows_of(results)), ""]
        steps = _steps(results)
        parts += [steps, ""] if steps else []
        parts += [_footer(name, results), ""]
    parts += ["## Not measured", "", "No GPU has run this benchmark: what specviz gains on a GPU is not known yet.",
              "A class of CPU without a table here has not been measured with the current code.", ""]
    return "\n".join(parts)


def readme_tables(files: dict[str, dict]) -> str:
    """The README's short speed tables: per machine class the plain decoders and this machine's first-run choice
    (and the best setting measured, where it is another), greedy and at T = 1."""
    parts = [README_START]
    for name in sorted(files, key=_order):
        rows = rows_of(files[name])
        env = files[name]["environment"]
        keep = [r for r in rows
                if r["kind"] == "plain" or r["name"].startswith(("Hugging Face plain", "llama.cpp plain"))]
        spec = [r for r in rows if r["kind"] == "specviz"]
        keep += [r for r in spec if r.get("choice")] + ([spec[0]] if spec and not spec[0].get("choice") else [])
        parts += ["", f"**{_title(name)}**: {env.get('cpu', env.get('device'))}, {env.get('dtype')}", "",
                  _table(keep)]
    if not files:
        parts += ["", "No machine has been measured yet."]
    parts += ["", README_END]
    return "\n".join(parts)


def with_readme_tables(readme: str, files: dict[str, dict]) -> str:
    """The README with its block between the two markers rendered anew (a README without them is an error)."""
    start, end = readme.find(README_START), readme.find(README_END)
    if start < 0 or end < start:
        raise ValueError(f"README.md has no speed block: put {README_START!r} and {README_END!r} where it goes")
    return readme[:start] + readme_tables(files) + readme[end + len(README_END):]


def write(root: str | Path = ".", results_dir: str = "benchmarks") -> list[Path]:
    """Render BENCHMARKS.md and the README's speed block from root/results_dir; the paths written."""
    root = Path(root)
    files = load(root / results_dir)
    bench, readme = root / "BENCHMARKS.md", root / "README.md"
    bench.write_text(benchmarks_md(files), encoding="utf-8")
    readme.write_text(with_readme_tables(readme.read_text(encoding="utf-8"), files), encoding="utf-8")
    return [bench, readme]
