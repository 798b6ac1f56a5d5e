"""specviz web app: watch speculative decoding, round by round (Gradio 6).

Layout first, then handlers as plain generator functions; `python app.py` serves on
0.0.0.0:7860 (GRADIO_SERVER_NAME / GRADIO_SERVER_PORT respected) with the offline default pair.
The UI consumes events from the specviz library and never touches tensors.
"""

from __future__ import annotations

import itertools
import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import gradio as gr

from specviz import charts
from specviz.events import Run, load_runs
from specviz.generator import MAX_GAMMA, Settings, compile_by_default, generate
from specviz.generator import validate_prompt as check_prompt
from specviz.models import PRESETS, ModelPair, load_pair
from specviz.rendering import (
    CSS,
    batch_html,
    diff_html,
    error_html,
    first_difference,
    legend_html,
    note_html,
    race_html,
    stats_html,
    stream_html,
)
from specviz.stream import BatchRound, Finished, RoundDone, stream, stream_batch

CUSTOM = "custom (enter ids below)"
EXAMPLES = [
    "The future of AI",
    "Robot learning emotions",
    "Happy Birthday lyrics",
    "Rewrite this function to use a list comprehension:\n\ndef squares(n):\n    out = []\n    for i in range(n):\n"
    "        out.append(i * i)\n    return out",
]
# Edits copy most of their input: where prompt lookup drafts long runs that the target accepts.
EDIT_EXAMPLES = [
    "Correct the spelling in this note: Dear Sam, thank you for the lovley flowers. They brighten up the "
    "kitchen and remind me of our trip to the contryside last sumer.",
    "Add a docstring to this function:\n\ndef clamp(value, low, high):\n    if value < low:\n        return low\n"
    "    if value > high:\n        return high\n    return value",
    "Change this code to print the result instead of returning it:\n\ndef greet(name):\n    message = "
    "'Hello, ' + name + '!'\n    return message",
    "Replace 'car' with 'bicycle' in this text: My car is parked outside. I bought the car last year, and the car "
    "has been very reliable.",
]
DRAFTER_CHOICES = [("draft model", "model"), ("prompt lookup (copies from the prompt, no model)", "lookup"),
                   ("EAGLE head (reads the target's hidden states)", "eagle")]
POLICY_CHOICES = [("fixed", "fixed"), ("grow-shrink (+2 when all accepted, -1 on a rejection)", "grow-shrink"),
                  ("expected speedup (from measured α and costs)", "expected")]
CACHE_CHOICES = [("static (pre-allocated; rollback moves a length)", "static"),
                 ("dynamic (transformers' DynamicCache)", "dynamic"), ("none (recompute everything)", "none")]
QUEUE_SIZE = int(os.environ.get("SPECVIZ_QUEUE_SIZE", "16"))
# Public mode (on in the Docker image): presets only, and caps on what one request may ask for.
PUBLIC = os.environ.get("SPECVIZ_PUBLIC", "").lower() not in ("", "0", "false", "no")
MAX_PROMPT_CHARS = 2000 if PUBLIC else 50_000
MAX_TOKENS_UI = 256 if PUBLIC else 512
MAX_GAMMA_UI = 8 if PUBLIC else MAX_GAMMA
GAMMA_MAX_ADAPTIVE = min(16, MAX_GAMMA_UI)  # the cap an adaptive policy grows to
FIRST_RUN = PRESETS["offline"]  # the page opens with the offline preset's fastest measured settings
MAX_BATCH_UI = 4 if PUBLIC else 8
BATCH_SEPARATOR = "---"
TIME_LIMIT_S = float(os.environ.get("SPECVIZ_TIME_LIMIT_S", "120" if PUBLIC else "0"))  # 0: none

try:  # ZeroGPU on Hugging Face Spaces: borrow a GPU per request; elsewhere a no-op
    import spaces

    on_gpu = spaces.GPU(duration=120)
except ImportError:

    def on_gpu(fn):
        return fn


TRACE_DIR = Path(tempfile.mkdtemp(prefix="specviz-traces-"))

SERVED = {"runs": 0, "rounds": 0}  # counters: a cancelled run stops adding rounds
_pairs: dict[tuple[str, str], ModelPair] = {}
_pairs_lock = threading.Lock()


def get_pair(preset: str, custom_target: str, custom_draft: str) -> ModelPair:
    """Load a pair once and keep it: the default preset, plus the last other pair asked for."""
    if preset == CUSTOM and PUBLIC:
        raise ValueError("custom models are turned off on this public server; pick a preset")
    if preset == CUSTOM:
        if not custom_target.strip() or not custom_draft.strip():
            raise ValueError("a custom pair needs both a target id and a draft id")
        key, kwargs = (custom_target.strip(), custom_draft.strip()), {}
    else:
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; choose one of: {', '.join(PRESETS)}")
        key, kwargs = (PRESETS[preset].target, PRESETS[preset].draft), {"preset": preset}
    with _pairs_lock:
        if key not in _pairs:
            pair = load_pair(**kwargs) if kwargs else load_pair(*key)
            for old in [k for k in _pairs if k != (PRESETS["offline"].target, PRESETS["offline"].draft)]:
                del _pairs[old]  # keep memory bounded: one non-default pair at a time
            _pairs[key] = pair
        return _pairs[key]


@dataclass
class View:
    """Everything the page shows for a pair of runs; `outputs` orders it like OUTPUTS."""

    status: str = ""
    spec: Run | None = None
    base: Run | None = None
    show_rounds: bool = False

    def outputs(self, download: str | None = None, race: str = "", final: bool = True):
        """The page; between rounds (final=False) the inspector and the download stay as they are."""
        diff_at = greedy_diff(self.spec, self.base)
        runs = [r for r in (self.spec, self.base) if r is not None]
        picker = gr.skip()
        if final:  # the inspector's list only changes when a run ends, not every round
            choices = token_choices(self.spec)
            # open the inspector on the first rejection, where there is most to see
            first_rejected = next((value for label, value in choices if "(rejected)" in label), None)
            picker = gr.update(choices=choices, value=first_rejected)
        return (
            self.status,
            stream_html(self.spec, self.show_rounds, diff_at),
            stream_html(self.base, self.show_rounds, diff_at) if self.base else "",
            diff_html(self.spec, self.base) if self.spec and self.base else "",
            stats_html(self.spec, self.base),
            charts.tokens_per_round(self.spec),
            charts.tokens_over_time(self.spec, self.base),
            charts.acceptance_by_position(self.spec),
            charts.speedup_curve(self.spec, self.base),
            runs,
            picker,
            download if final else gr.skip(),
            race if final else gr.skip(),
        )


def greedy_diff(spec: Run | None, base: Run | None) -> int | None:
    """Where greedy texts part (None if identical, sampled, or no baseline)."""
    if spec and base and spec.meta.sampling.greedy:
        return first_difference(spec.token_ids, base.token_ids)
    return None


def split_runs(runs: list[Run] | None) -> tuple[Run | None, Run | None]:
    spec = next((r for r in runs or [] if r.meta.mode == "speculative"), None)
    base = next((r for r in runs or [] if r.meta.mode == "baseline"), None)
    return spec, base


def token_choices(run: Run | None) -> list[tuple[str, str]]:
    """Dropdown entries for the inspector: every tested drafted token."""
    out = []
    for e in run.events if run else []:
        for i, t in enumerate(e.drafted):
            if t.status != "unverified":
                out.append((f"round {e.index + 1} · position {i + 1} · {t.text!r} ({t.status})", f"{e.index}:{i}"))
    return out


def check_request(prompt: str, settings: Settings) -> None:
    """What this server accepts, beyond what the library does (ValueError otherwise)."""
    settings.validate()
    check_prompt(prompt)
    if len(prompt) > MAX_PROMPT_CHARS:
        raise ValueError(f"the prompt has {len(prompt)} characters; this server takes at most {MAX_PROMPT_CHARS}")
    if settings.max_new_tokens > MAX_TOKENS_UI:
        raise ValueError(f"max_new_tokens must be at most {MAX_TOKENS_UI} here, got {settings.max_new_tokens}")
    if settings.gamma > MAX_GAMMA_UI:
        raise ValueError(f"gamma must be at most {MAX_GAMMA_UI} here, got {settings.gamma}")


def make_settings(gamma, gamma_policy, drafter, temperature, top_k, top_p, seed, max_new_tokens,
                  cache="static", compiled=False) -> Settings:
    """Settings from the page's controls; ValueError with the control's name if one is off."""
    gamma = _int(gamma, "gamma")
    return Settings(gamma=gamma, gamma_policy=str(gamma_policy), gamma_max=max(gamma, GAMMA_MAX_ADAPTIVE),
                    drafter=str(drafter), temperature=_float(temperature, "temperature"), top_k=_int(top_k, "top_k"),
                    top_p=_float(top_p, "top_p"), seed=_int(seed, "seed"),
                    max_new_tokens=_int(max_new_tokens, "max_new_tokens"), cache=str(cache), compile=bool(compiled))


def split_batch(text: str) -> list[str]:
    """Prompts separated by lines holding only '---' (a prompt may span lines)."""
    prompts, lines = [], []
    for line in (text or "").splitlines() + [BATCH_SEPARATOR]:
        if line.strip() == BATCH_SEPARATOR:
            if "\n".join(lines).strip():
                prompts.append("\n".join(lines).strip())
            lines = []
        else:
            lines.append(line)
    return prompts


@on_gpu
def run_generation(prompt, preset, custom_target, custom_draft, gamma, temperature, top_k, top_p, seed,
                   max_new_tokens, compare, show_rounds, drafter="model", gamma_policy="fixed", cache="static",
                   compiled=False):
    """Speculative decoding (then the baseline, if asked): the page once per round."""
    view = View(show_rounds=bool(show_rounds))
    try:
        if not isinstance(prompt, str):
            raise ValueError("the prompt must be text")
        settings = make_settings(gamma, gamma_policy, drafter, temperature, top_k, top_p, seed, max_new_tokens, cache,
                                 compiled)
        check_request(prompt, settings)
        view.status = note_html("loading models…")
        yield view.outputs(final=False)
        pair = get_pair(preset, custom_target or "", custom_draft or "")
        updates = stream(pair, prompt, settings, compare=bool(compare), time_limit_s=TIME_LIMIT_S,
                         trace_dir=TRACE_DIR)
        first = next(updates)  # the request is checked against the pair before anything is shown
    except (ValueError, OSError, RuntimeError) as err:
        view.status = error_html(f"Error: {err}")
        yield view.outputs()
        return

    note = f"Draft note: {pair.draft_note}. " if pair.draft_note and settings.drafter == "model" else ""
    SERVED["runs"] += 1
    for update in itertools.chain([first], updates):
        if isinstance(update, RoundDone):
            event, speculative = update.event, update.run.meta.mode == "speculative"
            if speculative:
                SERVED["rounds"] += 1
                view.spec = update.run
            else:
                view.base = update.run
            if speculative or event.index % 8 == 0 or event.finish_reason:  # the baseline: every 8 tokens
                what = f"round {event.index + 1}, " if speculative else ""
                view.status = note_html(f"{note}{update.run.meta.mode}: {what}{event.tokens_so_far} tokens")
                yield view.outputs(final=False)
        elif isinstance(update, Finished):
            stopped = f" Stopped at this server's time limit ({TIME_LIMIT_S:.0f} s)." if update.stopped else ""
            view.spec, view.base = update.spec, update.base
            view.status = note_html(f"{note}done: {view.spec.n_tokens} tokens.{stopped}")
            yield view.outputs(download=str(update.trace), race=race_html(view.spec, view.base) if view.base else "")


@on_gpu
def run_batch(prompts_text, preset, custom_target, custom_draft, gamma, temperature, top_k, top_p, seed,
              max_new_tokens, drafter="model", gamma_policy="fixed", cache="static", compiled=False):
    """Several prompts decoded as one batch: (status, streams, download) once per round."""
    try:
        prompts = split_batch(prompts_text if isinstance(prompts_text, str) else "")
        if not prompts:
            raise ValueError(f"no prompts: write one or more, separated by lines holding only {BATCH_SEPARATOR}")
        if len(prompts) > MAX_BATCH_UI:
            raise ValueError(f"{len(prompts)} prompts; this server decodes at most {MAX_BATCH_UI} at once")
        settings = make_settings(gamma, gamma_policy, drafter, temperature, top_k, top_p, seed, max_new_tokens, cache,
                                 compiled)
        for prompt in prompts:
            check_request(prompt, settings)
        yield note_html("loading models…"), "", gr.skip()
        pair = get_pair(preset, custom_target or "", custom_draft or "")
        updates = stream_batch(pair, prompts, settings, time_limit_s=TIME_LIMIT_S, trace_dir=TRACE_DIR)
        first = next(updates)
    except (ValueError, OSError, RuntimeError) as err:
        yield error_html(f"Error: {err}"), "", gr.skip()
        return

    SERVED["runs"] += 1
    for update in itertools.chain([first], updates):
        if isinstance(update, BatchRound):
            SERVED["rounds"] += 1
            status = note_html(f"batch of {len(update.runs)}: round {update.index + 1}")
            yield status, batch_html(update.runs), gr.skip()
        elif isinstance(update, Finished):
            runs = update.runs
            tokens = sum(r.n_tokens for r in runs)
            seconds = max(r.decode_ms for r in runs) / 1000
            stopped = f" Stopped at this server's time limit ({TIME_LIMIT_S:.0f} s)." if update.stopped else ""
            yield (note_html(f"done: a batch of {len(runs)}, {tokens} tokens in {seconds:.2f} s "
                             f"({tokens / seconds:.1f} tokens/s over all rows).{stopped}"), batch_html(runs),
                   str(update.trace))


def _int(value, name: str) -> int:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not number.is_integer():
        raise ValueError(f"{name} must be a whole number, got {value!r}")
    return int(number)


def _float(value, name: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None


def replay(file, show_rounds):
    """Show a saved trace without loading any model."""
    if file is None:
        return View(status=note_html("no file")).outputs()
    try:
        runs = load_runs(file if isinstance(file, str) else file.name)
    except (ValueError, OSError, UnicodeDecodeError) as err:
        return View(status=error_html(f"Error: {err}")).outputs()
    spec, base = split_runs(runs)
    view = View(status=note_html(f"replaying a trace of {spec.meta.target if spec else '?'}"), spec=spec,
                base=base, show_rounds=bool(show_rounds))
    return view.outputs(race=race_html(spec, base) if spec and base else "")


def rerender(runs, show_rounds):
    spec, base = split_runs(runs)
    diff_at = greedy_diff(spec, base)
    return stream_html(spec, show_rounds, diff_at), stream_html(base, show_rounds, diff_at) if base else ""


def inspect_token(runs, choice):
    spec, _ = split_runs(runs)
    if spec is None or not choice:
        return charts.token_inspector(None)
    round_index, position = (int(x) for x in choice.split(":"))
    token = spec.events[round_index].drafted[position]
    return charts.token_inspector(token, f"round {round_index + 1}, position {position + 1}:")


def preset_changed(preset):
    """Custom boxes shown for a custom pair; a preset's own first-run settings (drafter, γ, policy)."""
    boxes = [gr.update(visible=preset == CUSTOM)] * 2
    if preset not in PRESETS:
        return [*boxes, gr.skip(), gr.skip(), gr.skip()]
    chosen = PRESETS[preset]
    return [*boxes, gr.update(value=chosen.drafter), gr.update(value=chosen.gamma),
            gr.update(value=chosen.gamma_policy)]


def race(runs):
    spec, base = split_runs(runs)
    if not (spec and base):
        return note_html("The race needs a run with 'compare with baseline'.")
    # a fresh comment makes the HTML differ, so the browser re-creates it and the animation restarts
    return race_html(spec, base) + f"<!-- {time.monotonic()} -->"


# delete_cache: Gradio's copies of downloaded traces go after an hour, so a public server's disk stays flat
with gr.Blocks(title="specviz: watch speculative decoding", delete_cache=(600, 3600)) as demo:
    gr.Markdown("# specviz: watch speculative decoding\nA small draft model proposes γ tokens; the target "
                "checks them all in one forward pass and keeps each with probability min(1, p/q).")
    with gr.Row():
        with gr.Column(scale=2):
            prompt = gr.Textbox(label="Prompt", lines=3, value=EXAMPLES[0])
            gr.Examples(EXAMPLES, inputs=prompt, label="Example prompts")
            gr.Examples(EDIT_EXAMPLES, inputs=prompt, label="Edits: try them with prompt lookup")
        with gr.Column(scale=1):
            preset = gr.Dropdown([*PRESETS] if PUBLIC else [*PRESETS, CUSTOM], value="offline", label="Model pair")
            custom_target = gr.Textbox(label="Custom target (hub id or local dir)", visible=False)
            custom_draft = gr.Textbox(label="Custom draft (same tokenizer)", visible=False)
            drafter = gr.Dropdown(DRAFTER_CHOICES, value=FIRST_RUN.drafter, label="Drafter", elem_id="drafter")
            gamma_policy = gr.Dropdown(POLICY_CHOICES, value=FIRST_RUN.gamma_policy, label="γ policy",
                                       elem_id="gamma-policy",
                                       info=f"adaptive policies start at γ and draft at most {GAMMA_MAX_ADAPTIVE}")
            with gr.Accordion("Advanced", open=False):
                cache = gr.Radio(CACHE_CHOICES, value="static", label="KV cache (both models)", elem_id="cache-kind",
                                 info="'none' recomputes the whole text at every forward pass: what a KV cache buys")
                compiled = gr.Checkbox(compile_by_default(), label="compiled forwards (torch.compile)",
                                       elem_id="compile", info="static cache, Llama-family models; each new shape "
                                       "compiles for a minute or more at start")
    with gr.Row():
        gamma = gr.Slider(1, MAX_GAMMA_UI, value=FIRST_RUN.gamma, step=1, label="γ (draft tokens per round)")
        temperature = gr.Slider(0, 2, value=0, step=0.05, label="temperature (0 = greedy)")
        top_k = gr.Number(0, label="top-k (0 = off)", precision=0)
        top_p = gr.Slider(0.05, 1, value=1, step=0.05, label="top-p")
        seed = gr.Number(0, label="seed", precision=0)
        max_new_tokens = gr.Slider(1, MAX_TOKENS_UI, value=64, step=1, label="max new tokens")
    with gr.Row():
        compare = gr.Checkbox(True, label="compare with baseline")
        show_rounds = gr.Checkbox(False, label="mark round boundaries")
        run_btn = gr.Button("Run", variant="primary", elem_id="run-btn")
        stop_btn = gr.Button("Stop", variant="stop", elem_id="stop-btn")
    status = gr.HTML(elem_id="status")
    gr.HTML(legend_html())
    with gr.Row():
        with gr.Column():
            gr.Markdown("### Speculative")
            spec_html = gr.HTML(elem_id="spec-stream")
        with gr.Column():
            gr.Markdown("### Baseline (target alone)")
            base_html = gr.HTML(elem_id="base-stream")
    diff_box = gr.HTML()
    stats = gr.HTML(elem_id="stats")
    with gr.Row():
        fig_rounds = gr.Plot(elem_id="chart-rounds", show_label=False)
        fig_time = gr.Plot(elem_id="chart-time", show_label=False)
    with gr.Row():
        fig_position = gr.Plot(elem_id="chart-position", show_label=False)
        fig_speedup = gr.Plot(elem_id="chart-speedup", show_label=False)
    with gr.Accordion("Token inspector", open=True):
        token_pick = gr.Dropdown([], label="drafted token", elem_id="token-pick")
        fig_inspect = gr.Plot(show_label=False)
    with gr.Accordion("Race replay: both runs at their measured speeds", open=True):
        race_btn = gr.Button("Replay the race")
        race_box = gr.HTML()
    with gr.Accordion("Batch: several prompts decoded together, one stream per prompt", open=False):
        gr.Markdown(f"Up to {MAX_BATCH_UI} prompts, separated by lines holding only `{BATCH_SEPARATOR}`. They use "
                    "the settings above; each row accepts drafts at its own pace, and a row that finishes leaves "
                    "the batch.")
        batch_prompts = gr.Textbox(label="Prompts", lines=6, elem_id="batch-prompts",
                                   value=f"\n{BATCH_SEPARATOR}\n".join(EXAMPLES[:2] + EDIT_EXAMPLES[:2]))
        batch_btn = gr.Button("Run batch", elem_id="batch-btn")
        batch_status = gr.HTML(elem_id="batch-status")
        batch_box = gr.HTML(elem_id="batch-streams")
        batch_download = gr.DownloadButton("Download batch (JSON)", value=None)
    with gr.Row():
        download = gr.DownloadButton("Download run (JSON)", value=None)
        upload = gr.File(label="Replay a JSON run (no model needed)", file_types=[".json"])
    runs_state = gr.State([])

    OUTPUTS = [status, spec_html, base_html, diff_box, stats, fig_rounds, fig_time, fig_position, fig_speedup,
               runs_state, token_pick, download, race_box]
    INPUTS = [prompt, preset, custom_target, custom_draft, gamma, temperature, top_k, top_p, seed, max_new_tokens,
              compare, show_rounds, drafter, gamma_policy, cache, compiled]
    run_event = run_btn.click(run_generation, INPUTS, OUTPUTS, api_name="run", concurrency_limit=1,
                              concurrency_id="device", show_progress="hidden")
    BATCH_INPUTS = [batch_prompts, preset, custom_target, custom_draft, gamma, temperature, top_k, top_p, seed,
                    max_new_tokens, drafter, gamma_policy, cache, compiled]
    batch_event = batch_btn.click(run_batch, BATCH_INPUTS, [batch_status, batch_box, batch_download],
                                  api_name="batch", concurrency_limit=1, concurrency_id="device",
                                  show_progress="hidden")
    stop_btn.click(None, None, None, cancels=[run_event, batch_event], api_visibility="private")
    upload.upload(replay, [upload, show_rounds], OUTPUTS, api_name="replay")
    show_rounds.change(rerender, [runs_state, show_rounds], [spec_html, base_html], api_visibility="private")
    token_pick.change(inspect_token, [runs_state, token_pick], fig_inspect, api_visibility="private")
    race_btn.click(race, runs_state, race_box, api_visibility="private")
    preset.change(preset_changed, preset, [custom_target, custom_draft, drafter, gamma, gamma_policy],
                  api_visibility="private")


def launch(**kwargs):
    """Queue and launch with the app's CSS (Gradio 6 takes css at launch)."""
    demo.queue(max_size=QUEUE_SIZE)
    return demo.launch(css=CSS, show_error=True, **kwargs)


def warm_up() -> None:
    """Load (on first use, convert) the default pair and run it once, speculative and baseline, so
    the first visitor's first round pays neither for loading nor for the kernels' first calls (nor,
    with SPECVIZ_COMPILE=1, for compiling the default settings' forwards)."""
    pair = get_pair("offline", "", "")
    drafter = FIRST_RUN.drafter if FIRST_RUN.drafter != "eagle" or pair.head is not None else "model"
    # a full round at the first run's γ
    settings = Settings(gamma=FIRST_RUN.gamma, drafter=drafter, max_new_tokens=FIRST_RUN.gamma + 2, record_top=0)
    for mode in ("speculative", "baseline"):
        generate(pair, EXAMPLES[0], settings, mode=mode)


if __name__ == "__main__":
    logging.basicConfig(format="%(message)s")  # specviz's warnings (compiling, falling back) on the console
    warm_up()
    launch(server_name=os.environ.get("GRADIO_SERVER_NAME", "0.0.0.0"),
           server_port=int(os.environ.get("GRADIO_SERVER_PORT", "7860")))
