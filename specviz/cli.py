"""Command line: `python -m specviz generate | bench | distill | bench-render`."""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import replace

from .events import Run, save_runs
from .generator import (
    MAX_GAMMA,
    MAX_NEW_TOKENS,
    Settings,
    baseline_events,
    check_fits,
    make_meta,
    speculative_events,
    validate_prompt,
)
from .models import PRESETS, encode_prompt, load_pair
from .rendering import first_difference, legend, round_text, summary


def _add_generate(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("generate", help="generate with speculative decoding and show every round")
    g.add_argument("--prompt", required=True)
    g.add_argument("--preset", choices=list(PRESETS), help="a model pair (default: offline)")
    g.add_argument("--target", help="target model: hub id or local directory")
    g.add_argument("--draft", help="draft model: hub id or local directory (same tokenizer)")
    g.add_argument("--gamma", type=int, default=4, help=f"tokens drafted per round, 1..{MAX_GAMMA} (default 4)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-new-tokens", type=int, default=64, help=f"1..{MAX_NEW_TOKENS} (default 64)")
    g.add_argument("--compare", action="store_true", help="also run the plain target and report the speedup")
    g.add_argument("--trace", metavar="OUT.json", help="save the run(s) as JSON for replay")
    g.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    g.add_argument("--device", default="auto", help="auto (cuda, mps, cpu), or a torch device")
    g.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    g.add_argument("--color", choices=["auto", "always", "never"], default="auto")


def _stream(events, run: Run, colour: bool, out) -> Run:
    for event in events:
        run.events.append(event)
        out.write(round_text(event, colour))
        out.flush()
    out.write("\n")
    return run


def cmd_generate(args: argparse.Namespace) -> int:
    settings = Settings(
        gamma=args.gamma, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        seed=args.seed, max_new_tokens=args.max_new_tokens,
    )
    settings.validate()
    validate_prompt(args.prompt)
    preset = args.preset or (None if args.target or args.draft else "offline")

    def progress(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    pair = load_pair(args.target, args.draft, preset, args.device, args.dtype, progress=progress)
    prompt_ids = encode_prompt(pair.tokenizer, args.prompt, chat_template=not args.no_chat_template)
    check_fits(pair, prompt_ids, settings)
    colour = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    out = sys.stdout

    if args.compare:  # warm both paths up so that neither pays first-call costs in the timing
        warm = replace(settings, max_new_tokens=min(8, settings.max_new_tokens), record_top=0)
        for _ in speculative_events(pair, prompt_ids, warm):
            pass
        for _ in baseline_events(pair, prompt_ids, warm):
            pass

    print(f"target {pair.target_name} <- draft {pair.draft_name} ({pair.dtype}, {pair.device})", file=out)
    if pair.draft_note:
        print(f"note: {pair.draft_note}", file=out)
    print(f"legend: {legend(colour)}\n", file=out)
    spec = Run(make_meta(pair, "speculative", args.prompt, prompt_ids, settings))
    _stream(speculative_events(pair, prompt_ids, settings, spec.meta), spec, colour, out)
    spec.text = pair.tokenizer.decode(spec.token_ids, skip_special_tokens=True)
    print("\n" + summary(spec), file=out)
    runs = [spec]

    if args.compare:
        base = Run(make_meta(pair, "baseline", args.prompt, prompt_ids, settings))
        base.events.extend(baseline_events(pair, prompt_ids, settings, base.meta))
        base.text = pair.tokenizer.decode(base.token_ids, skip_special_tokens=True)
        runs.append(base)
        print(summary(base), file=out)
        speedup = spec.tokens_per_s / base.tokens_per_s if base.tokens_per_s else float("nan")
        print(f"speedup: {speedup:.2f}x (speculative over baseline tokens/s, same prompt and seed)", file=out)
        if settings.sampling.greedy:
            diff = first_difference(spec.token_ids, base.token_ids)
            if diff is None:
                print("greedy text: identical to the baseline, token for token", file=out)
            else:
                print(
                    f"greedy text: parts from the baseline at generated token {diff} "
                    f"(a numerical near-tie in {pair.dtype}, not the algorithm; see README)",
                    file=out,
                )
    if args.trace:
        save_runs(args.trace, runs)
        print(f"trace saved to {args.trace}", file=out)
    return 0


def _add_bench_render(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench-render", help="measure what per-round page rendering costs against the bare generator")
    b.add_argument("--preset", choices=list(PRESETS), default="offline")
    b.add_argument("--prompt", default="The future of AI")
    b.add_argument("--gamma", type=int, default=4)
    b.add_argument("--max-new-tokens", type=int, default=64)
    b.add_argument("--repeats", type=int, default=3)


def cmd_bench_render(args: argparse.Namespace) -> int:
    from .bench import render_cost

    settings = Settings(gamma=args.gamma, max_new_tokens=args.max_new_tokens)
    settings.validate()
    pair = load_pair(preset=args.preset, progress=lambda m: print(m, file=sys.stderr, flush=True))
    prompt_ids = encode_prompt(pair.tokenizer, args.prompt)
    r = render_cost(pair, args.prompt, prompt_ids, settings, args.repeats)
    print(f"{r['tokens']} tokens in {r['rounds']} rounds ({pair.target_name}, {pair.dtype}, {pair.device}, "
          f"median of {args.repeats}): bare generator {r['bare_s']:.2f} s, with per-round page rendering "
          f"{r['rendered_s']:.2f} s; ratio {r['ratio']:.3f}")
    return 0


def _add_distill(sub: argparse._SubParsersAction) -> None:
    from .distill import DistillConfig

    d = sub.add_parser("distill", help="distil a small draft model from a target (see specviz/distill.py)")
    d.add_argument("--target", required=True, help="hub id, local directory, or 'offline'")
    d.add_argument("--out", required=True, help="directory for the draft (safetensors, config, tokenizer)")
    defaults = DistillConfig("", "")
    for name in ["prompts", "new_tokens", "gen_batch", "top_k", "layers", "hidden", "heads", "kv_heads",
                 "intermediate", "max_steps", "batch", "seed"]:
        d.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    for name in ["gen_temperature", "train_minutes", "lr", "holdout"]:
        d.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(defaults, name))
    d.add_argument("--prompts-file", help="one training prompt per line (default: the built-in set)")
    d.add_argument("--no-chat-template", action="store_true")
    d.add_argument("--device", default="auto")


def cmd_distill(args: argparse.Namespace) -> int:
    from .distill import DistillConfig, distill
    from .models import OFFLINE_TARGET

    fields = {k: v for k, v in vars(args).items() if k in DistillConfig.__dataclass_fields__}
    fields["target"] = OFFLINE_TARGET if args.target == "offline" else args.target
    fields["chat_template"] = not args.no_chat_template
    report = distill(DistillConfig(**fields), progress=lambda m: print(m, file=sys.stderr, flush=True))
    held = report["held_out"]
    print(f"draft saved to {args.out}: {report['draft_parameters'] / 1e6:.1f} M parameters; "
          f"{report['data']['train_tokens']} training tokens from {report['data']['prompts']} prompts "
          f"({report['data']['generation_s']:.0f} s to generate), {report['training']['train_s'] / 60:.1f} min "
          f"training on {report['device']}; held-out greedy agreement {held['greedy_agreement']:.1%}, "
          f"expected sampled acceptance {held['sampled_acceptance']:.1%}")
    return 0


def _add_bench(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="speedup of specviz against the baseline, HF assisted generation and theory")
    b.add_argument("--preset", choices=list(PRESETS), default="offline")
    b.add_argument("--gammas", default="1,2,3,4,6", help="comma-separated γ values")
    b.add_argument("--temperatures", default="0,1", help="comma-separated temperatures")
    b.add_argument("--max-new-tokens", type=int, default=64)
    b.add_argument("--repeats", type=int, default=3, help="runs per setting; medians are reported")
    b.add_argument("--no-hf", action="store_true", help="skip Hugging Face assisted generation and prompt lookup")
    b.add_argument("--quick", action="store_true", help="smoke test: 2 prompts, γ 3, greedy, 24 tokens, 1 repeat")
    b.add_argument("--out", default="bench-results")
    b.add_argument("--device", default="auto")


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import bench_pair, environment, summary_by_setting, write_results
    from .prompts import BENCHMARK_PROMPTS

    prompts = BENCHMARK_PROMPTS
    gammas = [int(g) for g in args.gammas.split(",")]
    temperatures = [float(t) for t in args.temperatures.split(",")]
    max_new, repeats = args.max_new_tokens, args.repeats
    if args.quick:
        prompts = {"classic": BENCHMARK_PROMPTS["classic"][:1], "edit": BENCHMARK_PROMPTS["edit"][:1]}
        gammas, temperatures, max_new, repeats = [3], [0.0], 24, 1
    for g in gammas:
        Settings(gamma=g, max_new_tokens=max_new).validate()
    pair = load_pair(preset=args.preset, device=args.device, progress=lambda m: print(m, file=sys.stderr, flush=True))
    rows = bench_pair(pair, prompts, gammas, temperatures, max_new, repeats, with_hf=not args.no_hf,
                      progress=lambda m: print(m, file=sys.stderr, flush=True))
    command = "python -m specviz " + " ".join(shlex.quote(a) for a in args.argv)
    paths = write_results(rows, environment(pair), args.out, command)
    print(summary_by_setting(rows))
    print("wrote " + ", ".join(paths.values()))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specviz", description="Watch speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_bench_render(sub)
    _add_distill(sub)
    _add_bench(sub)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    args.argv = argv
    commands = {"generate": cmd_generate, "bench-render": cmd_bench_render, "distill": cmd_distill,
                "bench": cmd_bench}
    try:
        return commands[args.command](args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
