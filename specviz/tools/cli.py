"""Command line: `python -m specviz generate | bench | kernels | check | distill | bench-render`."""

from __future__ import annotations

import argparse
import functools
import logging
import os
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path

from ..core.events import save_runs
from ..core.generator import (
    DRAFTER_KINDS,
    HEAD_DRAFTERS,
    MAX_BATCH,
    MAX_GAMMA,
    MAX_NEW_TOKENS,
    Settings,
    check_drafter,
    check_fits,
    compile_by_default,
    draft_width,
    drafter_name,
    generate,
    machine_name,
    parse_trees,
    tree_label,
    validate_prompt,
    with_texts,
)
from ..core.kvcache import CACHE_KINDS
from ..core.schedules import POLICIES
from ..models.loading import PRESETS, ModelPair, Preset, encode_prompt, load_pair
from ..view.rendering import batch_summary, first_difference, legend, round_text, run_text, slower_note, summary
from .stream import Finished, stream

PAIR_HELP = "a model pair (default: %(default)s)"
WARM_UP_TOKENS = 64  # of the prompt, for generate --compare's warm-up run


def _add_pair(p: argparse.ArgumentParser) -> None:
    """The model pair and its device, as generate and check take them."""
    p.add_argument("--preset", choices=list(PRESETS), help="a model pair (default: offline)")
    p.add_argument("--target", help="target model: hub id or local directory")
    p.add_argument("--draft", help="draft model: hub id or local directory (same tokenizer)")
    p.add_argument("--head", metavar="DIR", help="an EAGLE head for the target (from `distill --kind eagle`)")
    p.add_argument("--device", default="auto", help="auto (cuda, mps, cpu), or a torch device")


def _preset(args: argparse.Namespace) -> str | None:
    """The preset asked for; the offline one unless models were named."""
    return args.preset or (None if args.target or args.draft else "offline")


def _add_generate(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("generate", help="generate with speculative decoding and show every round")
    g.add_argument("text", nargs="*", metavar="PROMPT", help="the prompt, as --prompt")
    g.add_argument("--prompt", action="append", default=[],
                   help="the prompt; give it several times to decode a batch (one stream per prompt)")
    _add_pair(g)
    g.add_argument("--gamma", type=int,
                   help=f"tokens drafted per round, 1..{MAX_GAMMA} (default: the one expected fastest on this "
                        "machine for the preset, else the preset's, else 4); an adaptive policy starts here")
    g.add_argument("--drafter", choices=list(DRAFTER_KINDS),
                   help="default: the one expected fastest on this machine for the preset (measured once), else the "
                        "preset's. model: the pair's draft model; lookup: copy from the prompt and text "
                        "(n-grams); eagle: the target's EAGLE head (reads its hidden states; the offline preset "
                        "ships one); lookup+eagle: lookup where the text repeats itself (3 or more tokens match), "
                        "the head elsewhere")
    g.add_argument("--branch", type=int,
                   help="children per drafted node: 1 = a chain of γ drafts, more = a tree γ deep, verified in one "
                        "pass (sampled: that many chains, their first drafts distinct; EAGLE-head drafters; default: "
                        "the shape expected fastest on this machine, else 1)")
    g.add_argument("--nodes", type=int,
                   help="a tree's drafts verified per round, the likeliest first (sampled: the first drawn; 0 = all "
                        "it drafts; default: with the shape chosen for this machine, else 0)")
    g.add_argument("--gamma-policy", choices=list(POLICIES),
                   help="default: the preset's, else fixed. fixed; grow-shrink: +2 after a fully accepted round, "
                        "-1 after a rejection; expected: each round the γ with the best expected speedup from what "
                        "the run measured")
    g.add_argument("--gamma-max", type=int, default=16, help="the most an adaptive policy drafts (default 16)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    g.add_argument("--seed", type=int, default=0,
                   help="sampling seed: on one machine, the same seed gives the same text (default: 0)")
    g.add_argument("--draft-greedy", action="store_true",
                   help="with temperature > 0: the drafter proposes its argmax and the rule takes q as one-hot "
                        "(still exact; usually accepts more)")
    g.add_argument("--max-new-tokens", type=int, default=64, help=f"1..{MAX_NEW_TOKENS} (default 64)")
    g.add_argument("--sample-check", type=int, metavar="N",
                   help="instead of generating: draw the first token N times with speculation and N times from the "
                        "target alone and compare both with the exact distribution (needs --temperature > 0)")
    g.add_argument("--compare", action="store_true", help="also run the plain target and report the speedup")
    g.add_argument("--trace", metavar="OUT.json", help="save the run(s) as JSON for replay")
    g.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    g.add_argument("--cache", choices=list(CACHE_KINDS), default="static",
                   help="KV cache of both models: static (pre-allocated, rollback moves a length; default), "
                        "dynamic (grown at every forward, as transformers' DynamicCache), "
                        "none (recompute the whole sequence every forward)")
    g.add_argument("--compile", action="store_true", default=compile_by_default(),
                   help="torch.compile the static cache's forward (Llama-family models; graphs cached on disk: "
                        "the first start compiles for a minute or two, later starts load them). Default: on if "
                        "SPECVIZ_COMPILE=1")
    g.add_argument("--dtype", default="auto",
                   help="auto (on a CPU: bfloat16 or float32, whichever measures faster here), float32, bfloat16, "
                        "float16")
    g.add_argument("--retune", action="store_true", help="measure this CPU's kernels again (kept in the cache)")
    g.add_argument("--color", choices=["auto", "always", "never"], default="auto",
                   help="color each token by what became of it: accepted, rejected, correction, bonus (auto: when "
                        "printing to a terminal)")


def cmd_generate(args: argparse.Namespace) -> int:
    preset = _preset(args)
    first_run = PRESETS[preset] if preset else Preset("", "", "", "")  # the preset's settings for a first run
    gamma = args.gamma if args.gamma is not None else first_run.gamma
    settings = Settings(
        gamma=gamma, gamma_policy=args.gamma_policy or first_run.gamma_policy, gamma_max=max(args.gamma_max, gamma),
        drafter=args.drafter or first_run.drafter, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        seed=args.seed, max_new_tokens=args.max_new_tokens, cache=args.cache, compile=args.compile,
        draft_greedy=args.draft_greedy, branch=args.branch if args.branch is not None else first_run.branch,
        nodes=args.nodes if args.nodes is not None else first_run.nodes,
    )
    settings.validate()
    args.prompt = args.text + args.prompt
    if not args.prompt:
        raise ValueError('no prompt: give one, python -m specviz generate "TEXT" (or --prompt TEXT; several for a '
                         'batch)')
    for prompt in args.prompt:
        validate_prompt(prompt)
    if len(args.prompt) > MAX_BATCH:
        raise ValueError(f"a batch holds at most {MAX_BATCH} prompts, got {len(args.prompt)}")
    if args.sample_check is not None:
        _at_least("--sample-check", args.sample_check, 1)
        if settings.sampling.greedy:
            raise ValueError("--sample-check needs --temperature > 0: a greedy run has one outcome")
    if args.trace:
        _writable(args.trace, "--trace")

    def progress(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    pair = load_pair(args.target, args.draft, preset, args.device, args.dtype, progress=progress, head=args.head,
                     retune=args.retune)
    prompts_ids = [encode_prompt(pair.tokenizer, p, chat_template=not args.no_chat_template) for p in args.prompt]
    chosen_line, against = "", None  # the drafter and γ measured best on this machine, when the preset left them open
    if preset and args.drafter is None and args.gamma is None and args.branch is None and first_run.tokens_per_round:
        from . import costs as machine_costs

        sampled = not settings.sampling.greedy
        context = machine_costs.context_of(max(map(len, prompts_ids)), settings.max_new_tokens)
        choice, costs = machine_costs.first_run(pair, first_run.taus(sampled), progress, args.retune, sampled, context,
                                                settings.max_new_tokens)
        if choice:
            settings = replace(settings, drafter=choice.drafter, gamma=choice.gamma, branch=choice.branch,
                               nodes=choice.nodes, gamma_max=max(args.gamma_max, choice.gamma))
            chosen_line = machine_costs.describe(choice, costs)
            against = functools.partial(machine_costs.against, choice, costs, sampled=sampled)
    check_drafter(pair, settings)
    for ids in prompts_ids:
        check_fits(pair, ids, settings)
    colour = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    out = sys.stdout
    if args.sample_check is not None:
        return _sample_check(pair, args.prompt[0], settings, args.sample_check, not args.no_chat_template, out)
    if len(args.prompt) > 1:
        return _generate_batch(pair, args, prompts_ids, settings, colour, out)
    prompt, prompt_ids = args.prompt[0], prompts_ids[0]

    if args.compare:  # warm both paths up so that neither pays first-call costs in the timing
        for _ in stream(pair, prompt, replace(settings, max_new_tokens=min(8, settings.max_new_tokens), record_top=0),
                        compare=True, prompt_ids=warming(prompt_ids, settings)):
            pass

    print(_pair_line(pair, settings), file=out)
    if chosen_line:
        print(chosen_line, file=out)
    if pair.draft_note and settings.drafter == "model":
        print(f"note: {pair.draft_note}", file=out)
    print(f"legend: {legend(colour)}\n", file=out)
    runs, finished = _follow(stream(pair, prompt, settings, compare=args.compare, prompt_ids=prompt_ids), colour, out)
    if finished is None:  # Ctrl-C: what ran is kept, shown and saved
        with_texts(pair, runs)
        print("\n\nstopped (Ctrl-C); the rounds run so far:", file=out)
        for run in runs:
            print(summary(run), file=out)
        if args.trace and runs:
            save_runs(args.trace, runs)
            print(f"trace of the stopped run saved to {args.trace}", file=out)
        return 130
    spec, base = finished.spec, finished.base
    print("\n\n" + summary(spec), file=out)
    if base is not None:
        print(summary(base), file=out)
        speedup = spec.tokens_per_s / base.tokens_per_s if base.tokens_per_s else float("nan")
        print(f"speedup: {speedup:.2f}x (speculative over baseline tokens/s, same prompt and seed)", file=out)
        if note := slower_note(spec, base):
            print(f"on this machine: {note}", file=out)
        if against and (line := against(spec, base)):
            print(f"the machine's choice: {line}", file=out)
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


def _follow(updates, colour: bool, out) -> tuple[list, Finished | None]:
    """Print the speculative run's rounds as they come; (the runs, the Finished update), or (the runs so far, None)
    where Ctrl-C stopped them: the stream is closed, and a run keeps its whole rounds."""
    runs: list = []
    try:
        for update in updates:
            if isinstance(update, Finished):
                return update.runs, update
            if not runs or runs[-1] is not update.run:
                runs.append(update.run)
            if update.run.meta.mode == "speculative":
                out.write(round_text(update.event, colour))
                out.flush()
    except KeyboardInterrupt:
        updates.close()
    return runs, None


def _pair_line(pair, settings: Settings) -> str:
    from ..core.generator import machine_name

    return (f"target {pair.target_name} <- draft {drafter_name(pair, settings.drafter)} ({pair.dtype}, {pair.device})"
            f"\nmachine: {machine_name(pair.device)}; dtype {str(pair.dtype).removeprefix('torch.')}: "
            f"{pair.dtype_reason}" + (f"\nweights: {pair.weights}" if pair.weights else ""))


def warming(prompt_ids: list[int], settings: Settings) -> list[int]:
    """The prompt ids a warm-up run reads: the first WARM_UP_TOKENS, since a long prompt's prefill, twice more, would
    warm nothing further (and a few thousand tokens' prefill takes seconds on a CPU); compiled forwards compile per
    shape, so there the whole prompt."""
    return prompt_ids if settings.compile else prompt_ids[:WARM_UP_TOKENS]


def _generate_batch(pair, args, prompts_ids: list[list[int]], settings: Settings, colour: bool, out) -> int:
    """Decode the prompts as one batch; print each row's rounds, then the batch's throughput."""
    from ..core.generator import generate_batch

    print(f"{_pair_line(pair, settings)}, a batch of {len(prompts_ids)}", file=out)
    print(f"legend: {legend(colour)}\n", file=out)
    if args.compare:  # warm-up, as for a single prompt
        generate_batch(pair, args.prompt, replace(settings, max_new_tokens=8, record_top=0),
                       prompts_ids=[warming(ids, settings) for ids in prompts_ids])
    start = time.perf_counter()
    runs = generate_batch(pair, args.prompt, settings, prompts_ids=prompts_ids)
    batch_s = time.perf_counter() - start
    for row, run in enumerate(runs):
        print(f"[{row + 1}] {run.meta.prompt!r}\n{run_text(run, colour)}\n{summary(run)}\n", file=out)
    print(batch_summary(runs, batch_s), file=out)
    if args.compare:
        start = time.perf_counter()
        alone = [generate(pair, p, settings, prompt_ids=ids) for p, ids in zip(args.prompt, prompts_ids, strict=True)]
        alone_s = time.perf_counter() - start
        tokens = sum(r.n_tokens for r in alone)
        print(f"one after another: {tokens} tokens in {alone_s:.2f} s, {tokens / alone_s:.1f} tokens/s; the batch is "
              f"{sum(r.n_tokens for r in runs) / batch_s / (tokens / alone_s):.2f}x that", file=out)
        if settings.sampling.greedy:
            same = sum(a.token_ids == b.token_ids for a, b in zip(alone, runs, strict=True))
            print(f"greedy text: {same} of {len(runs)} rows identical to their single-prompt runs", file=out)
    if args.trace:
        save_runs(args.trace, runs)
        print(f"trace saved to {args.trace}", file=out)
    return 0


def _writable(path: str, option: str) -> None:
    """Before any model work: the file can be written (its folder made if missing), so a run is not lost at the
    end."""
    file = Path(path)
    if file.is_dir():
        raise ValueError(f"{option}: {path} is a folder; give a file name, e.g. {file / 'run.json'}")
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"{option}: cannot make the folder {file.parent}: {err.strerror}") from None
    if not os.access(file.parent, os.W_OK) or (file.exists() and not os.access(file, os.W_OK)):
        raise ValueError(f"{option}: {path} cannot be written here")


def _sample_check(pair, prompt: str, settings: Settings, n: int, chat_template: bool, out) -> int:
    from ..view.rendering import exact_check_text
    from .lossless import exact_check, sample_check

    print(_pair_line(pair, settings), file=out)
    print(exact_check_text(exact_check(pair, prompt, settings, chat_template)), file=out)
    check = sample_check(pair, prompt, settings, n, chat_template=chat_template)
    print(f"first token, {n} + {n} draws in {check.speculative_s + check.target_alone_s:.1f} s "
          f"(speculative {check.speculative_s:.1f} s, target alone {check.target_alone_s:.1f} s)", file=out)
    print(f"{'token':>16}  exact p  speculative  target alone", file=out)
    for c in check.top:
        name = c.text if c.id < 0 else repr(c.text)
        print(f"{name[:16]:>16}  {c.exact:7.4f}  {c.speculative:11.4f}  {c.target_alone:12.4f}", file=out)
    print(f"total variation to exact: speculative {check.tv_speculative:.4f}, target alone "
          f"{check.tv_target_alone:.4f}; sampling noise alone about {check.tv_noise:.4f}", file=out)
    if check.acceptance is not None:
        print(f"first draft kept in {check.acceptance:.1%} of the speculative draws", file=out)
    return 0


def _add_bench_render(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench-render", help="measure what per-round page rendering costs against the bare generator")
    b.add_argument("--preset", choices=list(PRESETS), default="offline", help=PAIR_HELP)
    b.add_argument("--prompt", default="The future of AI", help="the prompt (default: %(default)s)")
    b.add_argument("--gamma", type=int, default=4, help="drafts per round (default: %(default)s)")
    b.add_argument("--max-new-tokens", type=int, default=64, help="tokens per run (default: %(default)s)")
    b.add_argument("--repeats", type=int, default=3, help="runs of each; the medians are reported (default: "
                   "%(default)s)")


def _add_bench_page(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench-page", help="serve the app, press Run in Chromium on this machine, and report the "
                                          "speedup the page reads and the CPU time the server and the browser spent")
    b.add_argument("--prompt", default=None, help="the prompt typed in (default: the page's own)")
    b.add_argument("--runs", type=int, default=3, help="presses of Run, a row each (default: 3)")
    b.add_argument("--max-new-tokens", type=int, default=None, help="typed in (default: the page's own)")
    b.add_argument("--threads", type=int, default=None, help="SPECVIZ_THREADS for the app (default: the app's)")
    b.add_argument("--update-s", type=float, default=None,
                   help="SPECVIZ_UPDATE_S for the app: the page redrawn at most this often (0: every round)")
    b.add_argument("--charts-s", type=float, default=None,
                   help="SPECVIZ_CHARTS_S for the app: each chart redrawn at most this often, one at a time "
                        "(0: all with the page)")


def cmd_bench_page(args: argparse.Namespace) -> int:
    from .pagebench import page_runs, table

    _at_least("--runs", args.runs, 1)
    if args.threads is not None:
        _at_least("--threads", args.threads, 1)
    for option, value in (("--update-s", args.update_s), ("--charts-s", args.charts_s)):
        if value is not None and not value >= 0:  # NaN too
            raise ValueError(f"{option} must be a number of seconds >= 0, got {value}")
    if args.max_new_tokens is not None:
        Settings(max_new_tokens=args.max_new_tokens).validate()
    rows = page_runs(args.prompt, args.runs, args.max_new_tokens, args.threads, args.update_s, args.charts_s,
                     lambda m: print(m, file=sys.stderr, flush=True))
    print(table(rows))
    return 0


def cmd_bench_render(args: argparse.Namespace) -> int:
    from .bench import render_cost

    settings = Settings(gamma=args.gamma, max_new_tokens=args.max_new_tokens)
    settings.validate()
    _at_least("--repeats", args.repeats, 1)
    pair = load_pair(preset=args.preset, progress=lambda m: print(m, file=sys.stderr, flush=True))
    prompt_ids = encode_prompt(pair.tokenizer, args.prompt)
    r = render_cost(pair, args.prompt, prompt_ids, settings, args.repeats)
    print(f"{r['tokens']} tokens in {r['rounds']} rounds ({pair.target_name}, {pair.dtype}, {pair.device}, "
          f"median of {args.repeats}): bare generator {r['bare_s']:.2f} s, with per-round page rendering "
          f"{r['rendered_s']:.2f} s; ratio {r['ratio']:.3f}")
    return 0


def _add_kernels(sub: argparse._SubParsersAction) -> None:
    k = sub.add_parser("kernels", help="this machine: its CPU, the kernel chosen per matrix shape, and what a "
                                       "verify pass of k tokens costs in one-token steps")
    k.add_argument("--preset", choices=list(PRESETS), default="offline", help=PAIR_HELP)
    k.add_argument("--dtype", default="auto", help="auto, float32, bfloat16")
    k.add_argument("--retune", action="store_true", help="measure the kernels again, ignoring the stored table")
    k.add_argument("--repeats", type=int, default=10, help="timed forwards per width for c(k)")


def cmd_kernels(args: argparse.Namespace) -> int:
    import torch

    from ..models import kernels
    from ..models.loading import lean_linears
    from .bench import step_table, step_times

    _at_least("--repeats", args.repeats, 1)
    started = time.perf_counter()
    stored = bool(kernels.table(torch.float32).times)
    pair = load_pair(preset=args.preset, device="cpu", dtype=args.dtype, retune=args.retune,
                     progress=lambda m: print(m, file=sys.stderr, flush=True))
    loaded = time.perf_counter() - started
    kernels.forget()  # what a later start pays to read the stored table
    started = time.perf_counter()
    table = kernels.table(pair.dtype)
    read_ms = 1000 * (time.perf_counter() - started)
    print(f"machine: {kernels.describe_machine(table.machine)}")
    print(f"dtype: {str(pair.dtype).removeprefix('torch.')} ({pair.dtype_reason})")
    # what its products read: the blocks where a product keeps only those, else the parameters (stand-ins left out)
    weights = [p for p in pair.target.parameters() if p.untyped_storage().nbytes() >= p.numel() * p.element_size()]
    weights += [b for lin in lean_linears(pair) if lin.released and (b := lin.blocks()) is not None]
    print(f"bandwidth: {kernels.bandwidth_gbs(weights):.1f} GB/s (one read of the target's "
          f"{sum(p.numel() * p.element_size() for p in weights) / 1e6:.0f} MB of weights)")
    if pair.weights:
        print(f"weights: {pair.weights}")
    for name, why in table.skipped.items():
        print(f"skipped path {name}: {why}")
    print(f"table: {table.profile.file} (read in {read_ms:.1f} ms; this start took {loaded:.1f} s, loading and "
          f"{'measuring' if args.retune or not stored else 'reading'} included)\n")
    print(kernels.table_text(pair.dtype))
    first = encode_prompt(pair.tokenizer, "The future of AI")
    steps = step_times(pair, first, ["static"], widths=(1, 2, 3, 4, 5, 8, 16), repeats=args.repeats)
    print("c(k): a forward of k tokens in one-token forwards (a verify of k - 1 drafts), static cache\n")
    print(step_table(steps))
    print(_ways_text(pair))
    print(_bit_for_bit(pair) + "\n")
    from . import costs as machine_costs

    for sampled, taus in PRESETS[args.preset].first_run_tables():
        choice, costs = machine_costs.first_run(pair, taus, lambda m: print(m, file=sys.stderr, flush=True),
                                                args.retune and not sampled, sampled)
        print(f"{'sampled (temperature > 0)' if sampled else 'greedy'}: expected speedup over plain decoding here, "
              "S = τ · (step + overhead) / (verify(γ + 1) + γ · draft + overhead) over the rounds, in a run of "
              f"{machine_costs.RUN_TOKENS} new tokens with its prefill (tools/costs.py), τ measured on held-out "
              "prompts (the preset), costs on this machine:\n")
        long = costs.long_context  # the same choices priced over the long context the forwards were timed at too
        print("| drafter | γ | tree (children, drafts verified) | τ (tokens per round) | expected speedup |"
              + (f" over {long:,} tokens of context |" if long else "")
              + "\n|---|---|---|---|---|" + ("---|" if long else ""))
        for ch in machine_costs.rank(costs, taus, sampled)[:10]:
            tree = f"{ch.branch}, {machine_costs.width(ch.shape) - 1}" if ch.branch > 1 else "chain"
            there = machine_costs.expected_speedup(costs, ch.drafter, ch.shape, ch.tokens_per_round, sampled, long,
                                                   machine_costs.RUN_TOKENS)
            print(f"| {ch.drafter} | {ch.gamma} | {tree} | {taus[ch.drafter][ch.shape]:.2f} | {ch.expected:.2f}x |"
                  + (f" {there:.2f}x |" if long else ""))
        print(f"\n{machine_costs.describe(choice, costs)}\n")
    if costs.long_context:
        print(context_table(costs))
    return 0


def context_table(costs) -> str:
    """c(k) as priced (costs.Costs.forward) over the two contexts the forwards were timed at and over twice the
    long one."""
    widths = sorted(k for k in costs.forward_ms if k > 1)
    rows = [(f"{n:,}", n) for n in (costs.context, costs.long_context, 2 * costs.long_context)]
    return "\n".join([
        f"c(k) as priced by the tokens already in the cache (each of a forward's k tokens attends over all of them): "
        f"the forwards timed over {costs.context} and {costs.long_context:,} tokens; what a context token adds to a "
        "forward of k tokens, a + b k, fitted through every width's two timings\n",
        "| tokens of context | one step, ms | " + " | ".join(f"c({k})" for k in widths) + " |",
        "|---|---|" + "---|" * len(widths),
        *(f"| {label} | {costs.forward(1, n):.1f} | " + " | ".join(f"{costs.c(k, n):.2f}" for k in widths) + " |"
          for label, n in rows), ""])


def _ways_text(pair) -> str:
    """The target's forward by row count, each way timed on this machine (LeanLlama.timed_ways: its layers in one C
    call or op by op, the row-by-row C functions' rows shared among threads or on one), and the way taken."""
    from ..models import kernels
    from ..models.leanllama import LeanLlama

    lean = LeanLlama.of(pair.target)
    timed = kernels.stored_forwards(pair.dtype, lean.forwards_key())
    if not timed:
        return "the target's forward: one way only here (nothing timed between ways)\n"
    ways = sorted({way for ms in timed.values() for way in ms})
    lines = ["the target's forward, ms each way it may run (timed once per machine; the fastest is taken):\n",
             "| tokens | " + " | ".join(ways) + " | taken |", "|---|" + "---|" * (len(ways) + 1)]
    for rows, ms in sorted(timed.items(), key=lambda item: int(item[0])):
        lines.append(f"| {rows} | " + " | ".join(f"{ms[w]:.2f}" if w in ms else "" for w in ways)
                     + f" | {min(ms, key=ms.get)} |")
    return "\n".join(lines) + "\n"


def _bit_for_bit(pair) -> str:
    """Whether greedy speculation decodes plain decoding's tokens bit for bit on this machine (check.row_alone,
    over the row counts the forwards above took), and if not, which products mix kernels across row counts."""
    from ..models import kernels
    from ..models.leanllama import LeanLlama
    from .check import Case, one_family, row_alone

    if row_alone(pair, Case("lookup", 2, 1, 0, "static", False, 0.0)):
        return ("bit for bit: yes. Every product of the target takes one family of specviz's row-invariant kernels at "
                "every row count, and attention runs in specviz's C kernel (in float32 within the layers' one C "
                "call): a verify's rows carry the one-token steps' bits, so greedy speculation decodes plain "
                "decoding's tokens exactly (the static cache)")
    mixed = {}  # shape -> its paths by row count, where they are not one row-invariant family
    for lin in LeanLlama.of(pair.target).linears():
        if not one_family(lin):
            by_path: dict[str, list[str]] = {}
            for rows, name in sorted(lin.paths.items()):
                by_path.setdefault(name, []).append(str(rows))
            mixed[kernels.shape_key(lin.weight)] = ", ".join(f"{name} at {'/'.join(r)} rows" for name, r in
                                                              by_path.items())
    why = "; ".join(f"{shape} takes {paths}" for shape, paths in mixed.items())
    return ("bit for bit: no. A verify's rows may round otherwise than the one-token steps, so greedy speculative "
            "text can part from plain decoding's at near ties: " + (why or "attention does not run in specviz's C "
                                                                           "kernel here"))


def _add_distill(sub: argparse._SubParsersAction) -> None:
    from .distill import HELP, DistillConfig

    d = sub.add_parser("distill", help="distil a draft model or an EAGLE head from a target (specviz/tools/distill.py)")
    d.add_argument("--kind", choices=["draft", "eagle"], default="draft",
                   help="draft: a small independent model (default); eagle: a head on the target's hidden states")
    d.add_argument("--target", required=True, help="hub id, local directory, or 'offline'")
    d.add_argument("--out", required=True, help="directory for the draft or head (safetensors, config, report)")
    defaults = DistillConfig("", "")
    for name in ["prompts", "first_prompt", "new_tokens", "gen_batch", "top_k", "layers", "hidden", "heads", "kv_heads",
                 "intermediate", "max_steps", "batch", "seed", "draft_vocab", "ttt_steps", "head_intermediate"]:
        d.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name),
                       help=f"{HELP[name]} (default: %(default)s)")
    for name in ["gen_temperature", "train_minutes", "lr", "holdout"]:
        d.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(defaults, name),
                       help=f"{HELP[name]} (default: %(default)s)")
    d.add_argument("--temperatures", default=",".join(f"{t:g}" for t in defaults.temperatures),
                   help=f"{HELP['temperatures']} (default: %(default)s)")
    for name in ["data_file", "prompts_file"]:
        d.add_argument(f"--{name.replace('_', '-')}", help=HELP[name])
    d.add_argument("--init", metavar="DIR", help=HELP["init"])
    d.add_argument("--no-chat-template", action="store_true", help="feed prompts as plain text, not in the target's "
                   "chat template")
    d.add_argument("--device", default="auto", help=HELP["device"])


def cmd_distill(args: argparse.Namespace) -> int:
    from ..models.loading import OFFLINE_TARGET
    from .distill import DistillConfig, distill, distill_eagle

    if args.init and args.kind != "eagle":
        raise ValueError("--init goes on training an EAGLE head: it needs --kind eagle")
    fields = {k: v for k, v in vars(args).items() if k in DistillConfig.__dataclass_fields__}
    fields["target"] = OFFLINE_TARGET if args.target == "offline" else args.target
    fields["chat_template"] = not args.no_chat_template
    fields["temperatures"] = tuple(_csv(args.temperatures, float, "--temperatures"))
    cfg = DistillConfig(**fields)  # checked by distill and distill_eagle before any model work
    progress = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    if args.kind == "eagle":
        report = distill_eagle(cfg, progress=progress)
        data, held = report["data"], report["held_out_by_position"]
        print(f"EAGLE head saved to {args.out}: {report['head_parameters'] / 1e6:.1f} M parameters; "
              f"{data['train_tokens']} training tokens from {data['prompts']} prompts ({data['generation_s']:.0f} s "
              f"to generate), {report['training']['train_s'] / 60:.1f} min training on {report['device']}; "
              "held-out greedy agreement by draft position: "
              + ", ".join(f"{s['greedy_agreement']:.1%}" for s in held)
              + f"; {report['total_s'] / 60:.1f} min end to end")
        return 0
    report = distill(cfg, progress=progress)
    held = report["held_out"]
    print(f"draft saved to {args.out}: {report['draft_parameters'] / 1e6:.1f} M parameters; "
          f"{report['data']['train_tokens']} training tokens from {report['data']['prompts']} prompts "
          f"({report['data']['generation_s']:.0f} s to generate), {report['training']['train_s'] / 60:.1f} min "
          f"training on {report['device']}; held-out greedy agreement {held['greedy_agreement']:.1%}, "
          f"expected sampled acceptance {held['sampled_acceptance']:.1%}")
    return 0


def _add_bench(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="speedup of specviz against the baseline, HF assisted generation and theory")
    b.add_argument("--preset", choices=list(PRESETS), default="offline", help=PAIR_HELP)
    b.add_argument("--head", metavar="DIR", help="an EAGLE head (from `distill --kind eagle`) in place of the "
                   "pair's: heads compared on the same prompts, each bench naming its own in the results")
    b.add_argument("--gammas", default="1,2,4", help="comma-separated γ values for the draft model")
    b.add_argument("--lookup-gammas", default="2,4,8", help="comma-separated γ values for prompt lookup")
    b.add_argument("--eagle-gammas", default="2,3,4,6",
                   help="comma-separated γ values for the EAGLE head (eagle and lookup+eagle)")
    b.add_argument("--trees", default="",
                   help="comma-separated tree shapes γxbranch:nodes (e.g. 3x2:4,4x4:8: γ deep, branch children per "
                        "node, nodes verified; 0 = all) run by every EAGLE-head drafter beside its chains")
    b.add_argument("--drafters", default="model,lookup,eagle,lookup+eagle",
                   help="comma-separated: model, lookup, eagle, lookup+eagle (the last two are skipped for a pair "
                        "with no head)")
    b.add_argument("--policies", default="grow-shrink,expected",
                   help="adaptive γ policies to run with their defaults ('' for none)")
    b.add_argument("--temperatures", default="0,1", help="comma-separated temperatures")
    b.add_argument("--max-new-tokens", type=int, default=48, help="tokens per run (default: %(default)s)")
    b.add_argument("--repeats", type=int, default=2, help="runs per setting; medians are reported")
    b.add_argument("--seeds", type=int, default=1,
                   help="temperature > 0: run each prompt with seeds 0..N-1, a row each (one seed's text is one "
                        "sample; the medians then go over prompts and seeds)")
    b.add_argument("--batch", type=int, default=4,
                   help="also time a batch of this many prompts against them one after another (0: skip)")
    b.add_argument("--record-top", type=int, default=0,
                   help="candidates each timed run records per position for the inspector, as the app and generate "
                        "do (8 there): what the page's own reading pays (default 0: the decode alone)")
    b.add_argument("--no-hf", action="store_true", help="skip Hugging Face assisted generation and prompt lookup")
    b.add_argument("--peer", choices=("auto", "off"), default="auto", help="auto: time llama.cpp on the target's "
                   "GGUF file beside specviz (plain, and its prompt lookup), where llama-cpp-python is installed")
    b.add_argument("--quick", action="store_true",
                   help="smoke test: 2 prompts, γ 3, greedy, 16 tokens, 1 repeat, 'expected' policy, batch of 2")
    b.add_argument("--cache", choices=list(CACHE_KINDS), default="static", help="KV cache kind of the runs")
    b.add_argument("--compile", action="store_true", default=compile_by_default(),
                   help="compiled forwards for specviz's runs and the step timings (as generate --compile)")
    b.add_argument("--step-caches", default="static,dynamic",
                   help="cache kinds whose forward-pass cost is timed ('' to skip)")
    b.add_argument("--out", default="bench-results", help="folder for results.json, results.md and the speedup "
                   "chart (default: %(default)s)")
    b.add_argument("--device", default="auto", help="auto (cuda, mps, cpu), or a torch device")
    b.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    b.add_argument("--retune", action="store_true", help="measure this CPU's kernels again (kept in the cache)")
    b.add_argument("--save", metavar="DIR", help="also keep the results as DIR/<machine class>.json (e.g. "
                   "benchmarks/cpu-avx2.json), the per-machine file `--report` renders")
    b.add_argument("--no-choice", action="store_true", help="do not add this machine's first-run choice (measured "
                   "on a first run, like the app's) to the settings timed")
    b.add_argument("--report", action="store_true", help="measure nothing: render BENCHMARKS.md and the README's "
                   "speed tables from benchmarks/*.json (run in the repository's root)")


def _csv(text: str, kind=str, option: str = "") -> list:
    """A comma-separated option's values; one that is not a `kind` is an error naming the option."""
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{option}: expected comma-separated {kind.__name__} values, got {text!r}") from None


def _at_least(option: str, value: int, low: int) -> None:
    if value < low:
        raise ValueError(f"{option} must be at least {low}, got {value}")


def _first_run_choice(pair, preset: str):
    """The drafter and chain or tree a greedy first run takes on this machine (None where the preset measured no
    tokens a round), so a bench times what a user gets by default."""
    from . import costs as machine_costs

    taus = PRESETS[preset].taus() if PRESETS[preset].tokens_per_round else {}
    if pair.head is None:
        taus = {d: t for d, t in taus.items() if d not in HEAD_DRAFTERS}
    choice, _ = machine_costs.first_run(pair, taus, lambda m: print(m, file=sys.stderr, flush=True))
    return choice


def _llama_version() -> str:
    from importlib.metadata import version

    return f"llama-cpp-python {version('llama-cpp-python')}"


def cmd_bench(args: argparse.Namespace) -> int:
    from ..models.contention import BUSY, others_meter, took
    from .bench import (
        adaptive_summary,
        baseline_summary,
        bench_batch,
        bench_pair,
        best_gamma,
        environment,
        step_table,
        step_times,
        summary_by_setting,
        tree_summary,
        write_results,
    )
    from .prompts import BENCHMARK_PROMPTS

    if args.report:
        from . import report

        print("wrote " + ", ".join(map(str, report.write())))
        return 0
    prompts = BENCHMARK_PROMPTS
    gammas, lookup_gammas, eagle_gammas = (_csv(args.gammas, int, "--gammas"), _csv(args.lookup_gammas, int,
                                           "--lookup-gammas"), _csv(args.eagle_gammas, int, "--eagle-gammas"))
    temperatures = _csv(args.temperatures, float, "--temperatures")
    drafters, policies = _csv(args.drafters), _csv(args.policies)
    max_new, repeats, batch = args.max_new_tokens, args.repeats, args.batch
    if args.quick:
        prompts = {"classic": BENCHMARK_PROMPTS["classic"][:1], "edit": BENCHMARK_PROMPTS["edit"][-1:]}
        gammas, lookup_gammas, eagle_gammas, temperatures, max_new, repeats = [3], [3], [3], [0.0], 16, 1
        policies, batch = ["expected"], 2
    for d in drafters:
        if d not in DRAFTER_KINDS:
            raise ValueError(f"--drafters: {d!r} is not one of {', '.join(DRAFTER_KINDS)}")
    _at_least("--seeds", args.seeds, 1)
    _at_least("--repeats", repeats, 1)
    _at_least("--batch", batch, 0)
    for t in temperatures:
        Settings(temperature=t, record_top=args.record_top).validate()
    for p in policies:
        if p not in POLICIES or p == "fixed":
            raise ValueError(f"--policies: {p!r} is not one of grow-shrink, expected")
    step_caches = _csv(args.step_caches)
    for c in step_caches:
        if c not in CACHE_KINDS:
            raise ValueError(f"--step-caches: {c!r} is not one of {', '.join(CACHE_KINDS)}")
    trees = parse_trees(args.trees)
    for g in gammas + lookup_gammas + eagle_gammas:
        Settings(gamma=g, max_new_tokens=max_new, cache=args.cache).validate()
    for g, k, n in trees:
        Settings(gamma=g, branch=k, nodes=n, drafter="eagle", max_new_tokens=max_new, cache=args.cache).validate()
    pair = load_pair(preset=args.preset, device=args.device, dtype=args.dtype, retune=args.retune, head=args.head,
                     progress=lambda m: print(m, file=sys.stderr, flush=True))
    if pair.head is None and set(drafters) & set(HEAD_DRAFTERS):
        print("no EAGLE head for this pair: the drafters that need one are skipped", file=sys.stderr)
        drafters = [d for d in drafters if d not in HEAD_DRAFTERS]
    choice = None if args.quick or args.no_choice else _first_run_choice(pair, args.preset)
    if choice is not None:  # what a user gets by default runs beside the settings asked for
        if choice.drafter not in drafters:
            drafters.append(choice.drafter)
        if choice.branch > 1 and choice.shape not in trees:
            trees.append(choice.shape)
        sweep = lookup_gammas if choice.drafter == "lookup" else gammas if choice.drafter == "model" else eagle_gammas
        if choice.branch == 1 and choice.gamma not in sweep:
            sweep.append(choice.gamma)
    caps = [f"{k}={os.environ[k]}" for k in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY") if os.environ.get(k)]
    command = " ".join([*caps, "python -m specviz", *map(shlex.quote, args.argv)])  # caps: another class's kernels
    run = {"max_new_tokens": max_new, "repeats": repeats, "seeds": args.seeds, "temperatures": temperatures,
           "record_top": args.record_top, "cache": args.cache, "compiled": args.compile}

    def env(busy: float | None) -> dict:
        out = environment(pair, busy) | {"peer": peer_note}
        if choice is not None:
            out["first_run_choice"] = {"drafter": choice.drafter, "gamma": choice.gamma, "expected": choice.expected,
                                       "tree": tree_label(*choice.shape) if choice.branch > 1 else ""}
        return out

    peer, peer_note = None, "off"
    if args.peer == "auto" and not args.quick:
        import torch

        from ..models.loading import gguf_file
        from .peer import LlamaPeer, missing

        gguf = gguf_file(pair.target_name)
        peer_note = missing() if gguf else "llama.cpp decodes GGUF files: this target is none (the offline one is)"
        if peer_note:
            print(f"no llama.cpp row: {peer_note}", file=sys.stderr)
        else:
            peer, peer_note = LlamaPeer(str(gguf), torch.get_num_threads()), _llama_version()
    taken = others_meter()  # what other processes take of the CPU time the run needs, in its record
    steps = []
    if step_caches:
        first = encode_prompt(pair.tokenizer, next(iter(prompts.values()))[0])
        widths = sorted({1, 3, 5, *(draft_width(Settings(gamma=g, branch=k, nodes=n, drafter="eagle")) + 1
                                    for g, k, n in trees)})
        steps = step_times(pair, first, step_caches, widths=tuple(widths), repeats=5 if args.quick else 30,
                           compile=args.compile)
        print(step_table(steps), file=sys.stderr)
    n_prompts, prompts_kept = sum(map(len, prompts.values())), 0

    def keep(rows_so_far: list, done: int) -> None:  # each prompt's rows on disk: a stopped run keeps them
        nonlocal prompts_kept
        prompts_kept = done
        if done < n_prompts:
            write_results(rows_so_far, env(taken()), args.out, command, steps=steps,
                          stopped=f"{done} of {n_prompts} prompts", run=run)

    try:
        rows = bench_pair(pair, prompts, gammas, temperatures, max_new, repeats, with_hf=not args.no_hf,
                          progress=lambda m: print(m, file=sys.stderr, flush=True), drafters=tuple(drafters),
                          lookup_gammas=lookup_gammas, policies=tuple(policies), cache=args.cache,
                          compile=args.compile, eagle_gammas=eagle_gammas, seeds=args.seeds, trees=trees,
                          record_top=args.record_top, kept=keep, peer=peer)
    except KeyboardInterrupt:
        if prompts_kept:
            print(f"the rows of the {prompts_kept} of {n_prompts} prompts done are in {args.out}", file=sys.stderr)
        raise
    finally:
        if peer is not None:
            peer.close()
    write_results(rows, env(taken()), args.out, command, steps=steps, run=run)  # kept if the batch part fails
    batch_rows = []
    if batch > 1:  # one prompt of each category in turn, then the next of each, ...
        columns = [texts for texts in BENCHMARK_PROMPTS.values()]
        batch_prompts = [c[i] for i in range(max(map(len, columns))) for c in columns if i < len(c)][:batch]
        for drafter in drafters:
            batch_rows.append(bench_batch(pair, batch_prompts, drafter, best_gamma(rows, drafter) or 2, max_new,
                                          repeats, args.cache, args.compile))
            print(f"batch of {batch}, {drafter}: {batch_rows[-1].ratio:.2f}x one after another", file=sys.stderr)
    busy = taken()
    paths = write_results(rows, env(busy), args.out, command, batch_rows, steps, run=run)
    if args.save:
        from . import report

        kept = Path(args.save) / report.machine_file(env(busy), args.dtype)
        kept.parent.mkdir(parents=True, exist_ok=True)
        kept.write_text(Path(paths["json"]).read_text(encoding="utf-8"), encoding="utf-8")
        paths["saved"] = str(kept)
    if busy is not None and busy > BUSY:
        print(f"{took(busy)} during this run: its times are slower than this machine's, and its ratios noisier",
              file=sys.stderr)
    print(summary_by_setting(rows))
    if trees:
        print(tree_summary(rows))
    print(baseline_summary(rows))
    print(adaptive_summary(rows))
    print("wrote " + ", ".join(paths.values()))
    return 0


def _add_check(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("check", help="run every way specviz decodes once on this device (cache kinds, compiled, "
                                     "greedy and sampled, a batch, each drafter, chain and tree), each against an "
                                     "oracle (specviz/tools/check.py)")
    _add_pair(c)
    c.add_argument("--dtype", default="auto",
                   help="auto, float32, bfloat16, float16 (float32 decides greedy exactness; in the others a "
                        "near tie may part the texts, which is reported, not failed)")
    c.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="also the compiled static cache (default: on a GPU; compiling takes minutes on a CPU)")
    c.add_argument("--max-new-tokens", type=int, default=24, help="tokens each run decodes (default 24)")
    c.add_argument("--only", default="", help="only the cases whose name contains this text, e.g. 'T=1' or 'tree'")


def cmd_check(args: argparse.Namespace) -> int:
    import torch

    from .check import cases, check, report_line

    Settings(max_new_tokens=args.max_new_tokens).validate()
    every = cases(compiled=True)  # every case there can be, before loading
    if not any(args.only in c.name for c in every):
        raise ValueError(f"no case's name contains {args.only!r}; names look like {every[-1].name!r}")
    preset = _preset(args)
    pair = load_pair(args.target, args.draft, preset, args.device, args.dtype, head=args.head,
                     progress=lambda m: print(m, file=sys.stderr, flush=True))
    compiled = pair.device.type == "cuda" if args.compile is None else args.compile
    cuda = f", torch {torch.__version__}, CUDA {torch.version.cuda}" if pair.device.type == "cuda" else ""
    print(f"{machine_name(pair.device)}{cuda}; {str(pair.dtype).removeprefix('torch.')} "
          f"({pair.dtype_reason or 'asked'}); {pair.target_name} with {pair.draft_name}"
          + (f" and {pair.head_name}" if pair.head is not None else ""), flush=True)
    outcomes, reduced = [], pair.dtype not in (torch.float32, torch.float64)

    @functools.cache
    def float32() -> ModelPair:  # a reduced-precision greedy case whose texts part is rerun in float32
        return load_pair(args.target, args.draft, preset, str(pair.device), "float32", head=args.head,
                         progress=lambda m: print(m, file=sys.stderr, flush=True))

    for outcome in check(pair, compiled, args.max_new_tokens, only=lambda c: args.only in c.name,
                         float32=float32 if reduced else None):
        outcomes.append(outcome)
        print(report_line(outcome), flush=True)
        for said in outcome.warnings:
            print(f"         said: {said}", flush=True)
    if not outcomes:
        print(f"error: no case's name contains {args.only!r}", file=sys.stderr)
        return 2
    counts = {s: sum(o.status == s for o in outcomes) for s in ("ok", "differs", "failed", "skipped")}
    print(", ".join(f"{n} {s}" for s, n in counts.items() if n))
    if counts["differs"]:
        print("differs: texts parted where another row count takes another kernel, whose sums round apart (the "
              "last bits in float32, up to a step of a logit in bfloat16 or float16); that moves sampled draws near a "
              "boundary and near ties. In float32 the p and q must stay within rounding and greedy text must equal "
              "plain decoding's; in reduced precision the gaps are shown, not judged, unless every row is computed "
              "alone (then any difference fails), and a greedy case that parts is rerun in float32, where it "
              "must not")
    for o in outcomes:
        if o.error:
            print(f"\n{o.case.name}:\n{o.error}", file=sys.stderr)
    return 1 if counts["failed"] else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m specviz", description="Watch speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_generate, _add_bench_render, _add_bench_page, _add_distill, _add_bench, _add_kernels, _add_check):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    logging.basicConfig(format="%(message)s")  # specviz's warnings (compiling, falling back) on stderr
    args.argv = argv
    commands = {"generate": cmd_generate, "bench-render": cmd_bench_render, "bench-page": cmd_bench_page,
                "distill": cmd_distill,
                "bench": cmd_bench, "kernels": cmd_kernels, "check": cmd_check}
    try:
        return commands[args.command](args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nstopped (Ctrl-C)", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the output's reader left (`| head`): stop quietly, as other commands do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so that the exit's flush does not fail
        return 141  # 128 + SIGPIPE
