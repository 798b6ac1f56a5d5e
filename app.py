"""specviz web app: watch speculative decoding, round by round (Gradio 6).

Layout first, then the wiring: the first screen holds the prompt, Run / Step, both token streams
and the speedup; settings fold away and the checks, the inspector, the race, batches and traces sit
in tabs below. The handlers are plain (generator) functions of one `Page` (specviz/ui/handlers.py);
`reads` hands each its controls by name. `python app.py` serves on 0.0.0.0:7860
(GRADIO_SERVER_NAME / GRADIO_SERVER_PORT respected) with the offline default pair.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import signal

import gradio as gr

from specviz.core.events import MAX_TRACE_MB
from specviz.core.generator import HEAD_DRAFTERS, MAX_BRANCH, Settings, compile_by_default, generate
from specviz.models.loading import PRESETS
from specviz.ui import handlers, stepping, waiting
from specviz.ui.device import on_device
from specviz.ui.handlers import preset_changed  # noqa: F401 - part of the app's surface (tests, notebooks)
from specviz.ui.page import (
    BATCH_SEPARATOR,
    CACHE_CHOICES,
    CUSTOM,
    DRAFTER_CHOICES,
    EDIT_EXAMPLES,
    EXAMPLES,
    FIRST_RUN,
    GAMMA_MAX_ADAPTIVE,
    MAX_BATCH_UI,
    MAX_GAMMA_UI,
    MAX_NODES_UI,
    MAX_SAMPLES_UI,
    MAX_TOKENS_UI,
    POLICY_CHOICES,
    PUBLIC,
    QUEUE_SIZE,
    SERVED,  # noqa: F401 - counters the server tests read
    WARMING,
    Page,
    first_run_values,
    get_pair,
    machine_first_run,
    share_the_cores,
)
from specviz.ui.script import PAGE_JS, PROJECTOR_JS, bounded
from specviz.ui.view import OUTPUT_NAMES, STEP_HINT, empty_charts
from specviz.view.rendering import BASELINE_KINDS, CSS, SPECULATIVE_KINDS, legend_html

log = logging.getLogger("specviz")
# the controls a run reads, in the order of the HTTP API's parameters (/run, /step, /next)
RUN_FIELDS = ("prompt", "preset", "custom_target", "custom_draft", "gamma", "temperature", "top_k", "top_p", "seed",
              "max_new_tokens", "compare", "show_rounds", "drafter", "gamma_policy", "cache", "compiled",
              "draft_greedy", "branch", "nodes")
PAIR = ("preset", "custom_target", "custom_draft")
# a waiting Run's wait, priced from the token budgets ahead: a Run's inputs as the page sends them
WAIT_BUDGETS = waiting.Budgets({"run": (RUN_FIELDS.index("max_new_tokens"), RUN_FIELDS.index("compare"))})
TREE = ("branch", "nodes")
SAMPLING = ("gamma", "temperature", "top_k", "top_p", "seed")
EXACT_FIELDS = ("prompt", *PAIR, *SAMPLING, "drafter", "draft_greedy")
BATCH_FIELDS = ("batch_prompts", *PAIR, *SAMPLING, "max_new_tokens", "drafter", "gamma_policy", "cache", "compiled",
                *TREE)


def reads(names: tuple[str, ...], handler):
    """handler(page[, request]) as a Gradio function of the named controls, one API parameter each.

    Gradio passes one value per input and finds the request by a parameter's annotation, so the
    function gets a signature naming the controls; the handler sees them as one `Page`."""
    takes_request = "request" in inspect.signature(handler).parameters

    def call(values):
        page = Page.of(dict(zip(names, values, strict=False)))
        request = values[len(names)] if len(values) > len(names) else None
        return (page, request) if takes_request else (page,)

    if inspect.isgeneratorfunction(handler):
        def fn(*values):
            yield from handler(*call(values))
    else:
        def fn(*values):
            return handler(*call(values))
    functools.update_wrapper(fn, handler)
    param = inspect.Parameter
    fn.__signature__ = inspect.Signature([param(n, param.POSITIONAL_OR_KEYWORD) for n in names] + [
        param("request", param.POSITIONAL_OR_KEYWORD, default=None, annotation=gr.Request)])
    fn.__annotations__ = {"request": gr.Request}
    return fn


def projector_from_url(request: gr.Request = None) -> bool:
    return getattr(request, "query_params", {}).get("projector") == "1"


EMPTY = empty_charts()  # the charts' frames, drawn before any run
# delete_cache: files Gradio keeps (traces uploaded for replay) go after an hour, so a public server's disk stays
# flat; the runs' own trace files are served where they are, the newest 64 (specviz/ui/page.py, trace_dir)
with gr.Blocks(title="specviz: watch speculative decoding", delete_cache=(600, 3600)) as demo:
    # the first screen, down to the first line of both streams, fits a projector's 1280x720
    with gr.Row():
        with gr.Column(scale=5, min_width=320):
            gr.Markdown("## specviz: watch speculative decoding\nA small drafter proposes γ tokens; the target "
                        "checks them all in one forward pass and keeps each with probability min(1, p/q).")
        projector = gr.Checkbox(False, label="projector (large type)", elem_id="projector", scale=0, min_width=200,
                                container=False)
    with gr.Row():
        with gr.Column(scale=2):
            prompt = gr.Textbox(label="Prompt", lines=2, max_lines=8, value=EXAMPLES[0])
            with gr.Row():
                run_btn = gr.Button("Run", variant="primary", elem_id="run-btn", min_width=70)
                step_btn = gr.Button("Step", elem_id="step-btn", min_width=70)
                back_btn = gr.Button("◂ Back", elem_id="back-btn", min_width=70)
                next_btn = gr.Button("Next ▸", elem_id="next-btn", min_width=70)
                continue_btn = gr.Button("Continue", elem_id="continue-btn", min_width=70)
                stop_btn = gr.Button("Stop", variant="stop", elem_id="stop-btn", min_width=70)
        with gr.Column(scale=1, min_width=300):
            preset = gr.Dropdown([*PRESETS] if PUBLIC else [*PRESETS, CUSTOM], value="offline", label="Model pair")
            drafter = gr.Dropdown(DRAFTER_CHOICES, value=FIRST_RUN.drafter, label="Drafter", elem_id="drafter")
    with gr.Row():
        gamma = bounded(gr.Slider(1, MAX_GAMMA_UI, value=FIRST_RUN.gamma, step=1, label="γ (drafts per round)",
                                  min_width=160))
        temperature = bounded(gr.Slider(0, 2, value=0, step=0.05, label="temperature (0 = greedy)", min_width=160))
        max_new_tokens = bounded(gr.Slider(1, MAX_TOKENS_UI, value=64, step=1, label="max new tokens", min_width=160))
        branch = bounded(gr.Slider(1, MAX_BRANCH, value=FIRST_RUN.branch, step=1, elem_id="branch", min_width=160,
                                   label="children per draft (1 = a chain)"))
        nodes = bounded(gr.Slider(0, MAX_NODES_UI, value=FIRST_RUN.nodes, step=1, elem_id="nodes", min_width=160,
                                  label="tree: drafts verified (0 = all)"))
    with gr.Accordion("More settings and example prompts", open=False):
        with gr.Row():
            custom_target = gr.Textbox(label="Custom target (hub id or local dir)", visible=False)
            custom_draft = gr.Textbox(label="Custom draft (same tokenizer)", visible=False)
        with gr.Row():
            gamma_policy = gr.Dropdown(POLICY_CHOICES, value=FIRST_RUN.gamma_policy, label="γ policy",
                                       elem_id="gamma-policy",
                                       info=f"adaptive policies start at γ and draft at most {GAMMA_MAX_ADAPTIVE}")
            top_k = gr.Number(0, label="top-k (0 = off)", precision=0)
            top_p = bounded(gr.Slider(0.05, 1, value=1, step=0.05, label="top-p"))
            seed = gr.Number(0, label="seed", precision=0)
        with gr.Row():
            compare = gr.Checkbox(True, label="compare with baseline")
            show_rounds = gr.Checkbox(False, label="mark round boundaries")
            draft_greedy = gr.Checkbox(False, label="draft greedily", elem_id="draft-greedy",
                                       info="sampled runs: the drafter proposes its most likely token (q one-hot)")
        with gr.Row():
            cache = gr.Radio(CACHE_CHOICES, value="static", label="KV cache (both models)", elem_id="cache-kind",
                             info="'none' recomputes the whole text at every forward pass: what a KV cache buys")
            compiled = gr.Checkbox(compile_by_default(), label="compiled forwards (torch.compile)",
                                   elem_id="compile", info="static cache, Llama-family models; each new shape "
                                   "compiles once (a minute or so), later starts load it from disk")
        gr.Examples(EXAMPLES, inputs=prompt, label="Example prompts")
        gr.Examples(EDIT_EXAMPLES, inputs=prompt, label="Edits: try them with prompt lookup")
    status = gr.HTML(elem_id="status")
    wait_line = gr.HTML(elem_id="sv-wait")  # while a Run waits for the model: how long, from the runs ahead
    with gr.Row():
        with gr.Column():
            gr.HTML(legend_html("<b>Speculative</b>", SPECULATIVE_KINDS))
            spec_html = gr.HTML(elem_id="spec-stream")
        with gr.Column():
            gr.HTML(legend_html("<b>Baseline</b> (target alone)", BASELINE_KINDS))
            base_html = gr.HTML(elem_id="base-stream")
    diff_box = gr.HTML()
    with gr.Row():
        round_box = gr.HTML(STEP_HINT, elem_id="stage-view")
        fig_tree = gr.Plot(EMPTY["fig_tree"], elem_id="chart-tree", show_label=False)
    how_box = gr.HTML(elem_id="how-it-works")
    with gr.Tabs():
        with gr.Tab("Stats and charts"):
            stats = gr.HTML(elem_id="stats")
            with gr.Row():
                fig_rounds = gr.Plot(EMPTY["fig_rounds"], elem_id="chart-rounds", show_label=False)
                fig_time = gr.Plot(EMPTY["fig_time"], elem_id="chart-time", show_label=False)
            with gr.Row():
                fig_position = gr.Plot(EMPTY["fig_position"], elem_id="chart-position", show_label=False)
                fig_speedup = gr.Plot(EMPTY["fig_speedup"], elem_id="chart-speedup", show_label=False)
            fig_cache = gr.Plot(EMPTY["fig_cache"], elem_id="chart-cache", show_label=False)
        with gr.Tab("Lossless, visible", elem_id="lossless-tab"):
            gr.Markdown("Speculative sampling leaves the target's distribution unchanged. **Exact check**: one "
                        "round for this prompt and these settings, in closed form. **Sample N times**: the first "
                        "token drawn N times with speculation and N times from the target alone (temperature > 0). "
                        "**Check in float32**: a greedy run and its baseline again in float32.")
            with gr.Row():
                exact_btn = gr.Button("Exact check", elem_id="exact-btn", scale=0, min_width=160)
                exact_status = gr.HTML(elem_id="exact-status")
            with gr.Row():
                fp32_btn = gr.Button("Check in float32", elem_id="fp32-btn", scale=0, min_width=160)
                fp32_status = gr.HTML(elem_id="fp32-status")
            with gr.Row():
                samples = gr.Number(1000, label="N", precision=0, minimum=1, maximum=MAX_SAMPLES_UI,
                                    elem_id="samples", scale=0, min_width=160)
                sample_btn = gr.Button("Sample N times", elem_id="sample-btn", scale=0, min_width=160)
            lossless_status = gr.HTML(elem_id="lossless-status")
            fig_sample = gr.Plot(elem_id="chart-sample", show_label=False)
        with gr.Tab("Token inspector"):
            token_pick = gr.Dropdown([], label="drafted token", elem_id="token-pick")
            fig_inspect = gr.Plot(show_label=False)
        with gr.Tab("Race replay"):
            race_btn = gr.Button("Replay the race: both runs at their measured speeds")
            race_box = gr.HTML()
        with gr.Tab("Batch", elem_id="batch-tab"):
            gr.Markdown(f"Up to {MAX_BATCH_UI} prompts, separated by lines holding only `{BATCH_SEPARATOR}`. They "
                        "use the settings above; each row accepts drafts at its own pace, and a row that finishes "
                        "leaves the batch.")
            batch_prompts = gr.Textbox(label="Prompts", lines=6, elem_id="batch-prompts",
                                       value=f"\n{BATCH_SEPARATOR}\n".join(EXAMPLES[:2] + EDIT_EXAMPLES[:2]))
            batch_btn = gr.Button("Run batch", elem_id="batch-btn")
            batch_status = gr.HTML(elem_id="batch-status")
            batch_box = gr.HTML(elem_id="batch-streams")
            batch_download = gr.DownloadButton("Download batch (JSON)", value=None)
        with gr.Tab("Trace: download or replay"):
            download = gr.DownloadButton("Download run (JSON)", value=None)
            upload = gr.File(label="Replay a JSON run (no model needed)", file_types=[".json"])
    runs_state = gr.State([])

    CONTROLS = {"prompt": prompt, "preset": preset, "custom_target": custom_target, "custom_draft": custom_draft,
                "gamma": gamma, "temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed,
                "max_new_tokens": max_new_tokens, "compare": compare, "show_rounds": show_rounds,
                "drafter": drafter, "gamma_policy": gamma_policy, "cache": cache, "compiled": compiled,
                "draft_greedy": draft_greedy, "samples": samples, "batch_prompts": batch_prompts, "branch": branch,
                "nodes": nodes}
    OUTPUTS = [globals()[name] for name in OUTPUT_NAMES]  # the components named as View fills them

    def controls(names):
        return [CONTROLS[n] for n in names]

    def device(status_box) -> dict:
        """One model call at a time, in Gradio's queue; a waiting viewer's status box shows their place in it (and
        the line under it the wait, ui/waiting.py), a running one's only what the handler writes."""
        return {"concurrency_limit": 1, "concurrency_id": handlers.DEVICE_QUEUE, "show_progress": "minimal",
                "show_progress_on": status_box}

    run_inputs = controls(RUN_FIELDS)
    # a Run's wait (WAIT_BUDGETS); the timer is started before the Run's own event is bound: bound after it,
    # Gradio's page never sends it
    wait_timer = gr.Timer(1.0, active=False)  # ticks while this page's Run waits
    run_btn.click(lambda: gr.Timer(active=True), None, wait_timer, queue=False, api_visibility="private")

    def waiting_line(request: gr.Request):  # (a partial would hide the request from Gradio)
        return handlers.waiting_line(WAIT_BUDGETS, request)

    wait_timer.tick(waiting_line, None, [wait_line, wait_timer], queue=False, api_visibility="private",
                    show_progress="hidden")
    # Run and Continue see Stop themselves and end with their own last update (handlers.stop); Gradio cancels the rest
    run_btn.click(reads(RUN_FIELDS, handlers.run), run_inputs, OUTPUTS, api_name="run", **device(status))
    continue_btn.click(handlers.continue_run, show_rounds, OUTPUTS, api_name="continue", **device(status))
    cancelled = [
        # each press is a step: queued while the last is under way (Gradio's default drops a click made then)
        step_btn.click(reads(RUN_FIELDS, handlers.step), run_inputs, OUTPUTS, api_name="step", trigger_mode="multiple",
                       **device(status)),
        next_btn.click(reads(RUN_FIELDS, handlers.next_stage), run_inputs, OUTPUTS, api_name="next",
                       trigger_mode="multiple", **device(status)),
        fp32_btn.click(handlers.check_float32, [runs_state, *controls(PAIR)], fp32_status, api_name="check_float32",
                       **device(fp32_status)),
        sample_btn.click(reads((*EXACT_FIELDS, "samples", *TREE), handlers.sample_n),
                         controls((*EXACT_FIELDS, "samples", *TREE)),
                         [lossless_status, fig_sample], api_name="sample", **device(lossless_status)),
        exact_btn.click(reads((*EXACT_FIELDS, *TREE), handlers.exact), controls((*EXACT_FIELDS, *TREE)),
                        exact_status, api_name="exact", **device(exact_status)),
        batch_btn.click(reads(BATCH_FIELDS, handlers.run_batch), controls(BATCH_FIELDS),
                        [batch_status, batch_box, batch_download], api_name="batch", **device(batch_status)),
    ]
    stop_btn.click(handlers.stop, None, status, cancels=cancelled, queue=False, api_visibility="private")
    back_btn.click(handlers.previous_stage, show_rounds, OUTPUTS, api_name="back", show_progress="hidden",
                   trigger_mode="multiple")
    upload.upload(handlers.replay, [upload, show_rounds], OUTPUTS, api_name="replay")
    show_rounds.change(handlers.rerender, [runs_state, show_rounds], [spec_html, base_html], api_visibility="private")
    token_pick.change(handlers.inspect_token, [runs_state, token_pick], fig_inspect, api_visibility="private")
    race_btn.click(handlers.race, runs_state, race_box, api_visibility="private")
    preset.change(handlers.preset_changed, [preset, temperature],
                  [custom_target, custom_draft, drafter, gamma, gamma_policy, branch, nodes], api_visibility="private")
    drafter.input(handlers.drafter_picked, [drafter, branch], [branch, nodes, status], api_visibility="private")
    temperature.input(handlers.temperature_changed, [preset, temperature, drafter, gamma, branch, nodes],
                      [drafter, gamma, branch, nodes, status], api_visibility="private")
    projector.change(None, projector, None, js=PROJECTOR_JS)
    demo.load(projector_from_url, None, projector, api_visibility="private")
    warming = gr.Timer(2.0, active=False)  # while the app measures this machine (handlers.page_opened)
    opened = [drafter, gamma, branch, nodes, status, warming]
    demo.load(handlers.page_opened, None, opened, api_visibility="private", show_progress="hidden")
    warming.tick(handlers.page_opened, None, opened, api_visibility="private", show_progress="hidden")
    demo.unload(stepping.drop)


def launch(**kwargs):
    """Queue and launch with the app's CSS and script (Gradio 6 takes them at launch)."""
    demo.queue(max_size=QUEUE_SIZE)
    return demo.launch(css=CSS, js=PAGE_JS, show_error=True, max_file_size=f"{MAX_TRACE_MB}mb", **kwargs)


@on_device  # the thread that runs the page's model calls (specviz/ui/device.py)
def warm_up() -> None:
    """Load (on first use, convert) the default pair and run it once, speculative and baseline, so
    the first visitor's first round pays neither for loading nor for the kernels' first calls (nor,
    with SPECVIZ_COMPILE=1, for compiling the default settings' forwards). Its steps go to WARMING, which pages
    opened meanwhile show and Runs pressed meanwhile wait for."""
    WARMING.begin(3)
    try:
        WARMING.at("loading the models (a first start converts the model file and times this machine's kernels)")
        pair = get_pair("offline", "", "")
        WARMING.at("measuring what each drafter and tree shape costs here")
        if pair.head is not None:  # the first run's drafter and γ, measured best on this machine
            machine_first_run("offline")
        WARMING.at("a first round of each mode, so that a visitor's first round does not pay for first calls")
        drafter, gamma, branch, nodes, _ = first_run_values("offline")
        if drafter in HEAD_DRAFTERS and pair.head is None:
            drafter, branch, nodes = "model", 1, 0
        settings = Settings(gamma=gamma, drafter=drafter, branch=branch, nodes=nodes, max_new_tokens=gamma + 2,
                            record_top=0)  # a full round
        for mode in ("speculative", "baseline"):
            generate(pair, EXAMPLES[0], settings, mode=mode)
    finally:
        WARMING.finish()


if __name__ == "__main__":
    logging.basicConfig(format="%(message)s")  # specviz's warnings (compiling, falling back) on the console
    log.setLevel(logging.INFO)  # and its progress (loading, measuring this machine's kernels and costs)
    log.info(share_the_cores())  # before any model work: the kernel table and costs are per thread count
    # A stop from a supervisor, a container or a Space (SIGTERM) ends the app as Ctrl-C does, so the runs' trace
    # files are removed (page.trace_dir); killed outright, they stay in the temporary folder.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    # the page first, within seconds; the machine is measured while it is served, the page saying each step
    launch(server_name=os.environ.get("GRADIO_SERVER_NAME", "0.0.0.0"),
           server_port=int(os.environ.get("GRADIO_SERVER_PORT", "7860")), prevent_thread_lock=True)
    try:
        warm_up()
        demo.block_thread()
    except KeyboardInterrupt:  # Ctrl-C (or SIGTERM) while loading or measuring: a line, not a traceback (once
        # serving, Gradio's block_thread takes it and closes the server)
        demo.close()
        raise SystemExit("stopped (Ctrl-C or SIGTERM) while measuring this machine") from None
