"""The streaming API that the CLI and the app consume: typed updates, a trace, a time limit."""

import html
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from specviz.core.events import load_runs
from specviz.core.generator import Settings, generate
from specviz.tools.stream import BatchRound, Finished, RoundDone, stream, stream_batch


def test_stream_yields_rounds_then_the_baseline_then_the_finished_runs(pattern_pair, tmp_path):
    pair = pattern_pair("llama")
    settings = Settings(gamma=3, max_new_tokens=12)
    updates = list(stream(pair, "w2 w3 w4", settings, compare=True, chat_template=False, trace_dir=tmp_path))
    *rounds, last = updates
    assert all(isinstance(u, RoundDone) for u in rounds) and isinstance(last, Finished)
    modes = [u.run.meta.mode for u in rounds]
    assert modes == sorted(modes, reverse=True) and modes[0] == "speculative" and modes[-1] == "baseline"
    spec, base = last.spec, last.base
    assert [u.event for u in rounds if u.run is spec] == spec.events  # every round was streamed, in order
    assert spec.token_ids == base.token_ids == generate(pair, "", settings, prompt_ids=spec.meta.prompt_ids).token_ids
    assert spec.text == pair.tokenizer.decode(spec.token_ids, skip_special_tokens=True) and spec.text
    assert last.stopped == "" and load_runs(last.trace) == [spec, base]


def test_a_time_limit_stops_after_the_round_that_passed_it(pattern_pair):
    pair = pattern_pair("llama")
    updates = list(stream(pair, "w2 w3 w4", Settings(gamma=1, max_new_tokens=40), compare=True,
                          chat_template=False, time_limit_s=1e-9))
    assert len(updates) == 2 and "time limit" in updates[-1].stopped
    assert [r.meta.mode for r in updates[-1].runs] == ["speculative"]  # no baseline after a stop
    assert updates[-1].spec.n_tokens < 40 and updates[-1].trace is None


def test_closing_the_stream_cancels_between_rounds(pattern_pair):
    updates = stream(pattern_pair("llama"), "w2 w3 w4", Settings(gamma=2, max_new_tokens=30), chat_template=False)
    first = next(updates)
    updates.close()
    assert isinstance(first, RoundDone) and first.run.n_tokens < 30
    with pytest.raises(StopIteration):
        next(updates)


def test_ctrl_c_in_the_command_line_keeps_the_rounds_run_so_far(pattern_dirs, pattern_pair, tmp_path, monkeypatch,
                                                                 capsys):
    """Ctrl-C during `generate`: no traceback; the stream is closed, the whole rounds so far are summed up and
    saved to --trace, and the exit code is 130 (as a shell's for SIGINT)."""
    from specviz.tools import cli

    closed = []

    def interrupted_after_three_rounds(*args, **kwargs):
        updates = stream(*args, **kwargs)
        try:
            for i, update in enumerate(updates):
                if i == 3:
                    raise KeyboardInterrupt
                yield update
        finally:
            updates.close()
            closed.append(True)

    monkeypatch.setattr(cli, "stream", interrupted_after_three_rounds)
    target, draft = pattern_dirs("llama")
    trace = tmp_path / "stopped.json"
    argv = ["generate", "--target", str(target), "--draft", str(draft), "--no-chat-template", "--dtype", "float32",
            "--prompt", "w2 w3 w4", "--gamma", "2", "--max-new-tokens", "40", "--trace", str(trace), "--color", "never"]
    assert cli.main(argv) == 130
    out = capsys.readouterr().out
    (run,) = load_runs(trace)
    assert closed == [True] and len(run.events) == 4 and 4 <= run.n_tokens < 40  # 3 shown, the 4th made whole
    assert "stopped (Ctrl-C)" in out and f"speculative: {run.n_tokens} tokens in" in out
    whole = generate(pattern_pair("llama"), "", Settings(gamma=2, max_new_tokens=40), prompt_ids=run.meta.prompt_ids)
    assert run.token_ids == whole.token_ids[: run.n_tokens]  # the stopped run is the whole run's beginning


def test_a_reader_that_leaves_ends_the_command_quietly(pattern_dirs):
    """`python -m specviz generate ... | head -2`: the pipe closes while rounds are printed; the command stops with
    141 (as for SIGPIPE) and no BrokenPipeError traceback."""
    target, draft = pattern_dirs("llama")
    proc = subprocess.Popen([sys.executable, "-m", "specviz", "generate", "--target", str(target), "--draft",
                             str(draft), "--no-chat-template", "--dtype", "float32", "--prompt", "w2 w3 w4",
                             "--max-new-tokens", "200", "--color", "never"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.readline()  # the first line, then the reader leaves
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141 and "Traceback" not in err and "BrokenPipe" not in err


def test_stream_batch_yields_one_update_per_round(pattern_pair):
    pair = pattern_pair("llama")
    *rounds, last = stream_batch(pair, ["w2 w3", "w30 w31 w32"], Settings(gamma=2, max_new_tokens=10),
                                 chat_template=False)
    assert [u.index for u in rounds] == list(range(len(rounds))) and all(isinstance(u, BatchRound) for u in rounds)
    assert len(last.runs) == 2 and last.runs[1].finish_reason == "eos" and last.runs[0].n_tokens == 10


def test_bad_input_fails_before_any_round(pattern_pair):
    with pytest.raises(ValueError, match="prompt is empty"):
        next(stream(pattern_pair("llama"), "  ", Settings()))
    with pytest.raises(ValueError, match="cache must be one of"):
        next(stream(pattern_pair("llama"), "w1", Settings(cache="paged")))


def test_time_between_updates_counts_neither_in_the_run_nor_against_the_limit(pattern_pair):
    """A viewer who pauses between rounds (step mode) pauses the run's clock too."""
    import time

    updates = stream(pattern_pair("llama"), "w2 w3 w4", Settings(gamma=2, max_new_tokens=8), chat_template=False,
                     time_limit_s=0.5)
    pauses = 0.0
    for update in updates:
        if isinstance(update, RoundDone):
            time.sleep(0.2)
            pauses += 0.2
    assert pauses >= 0.6 and not update.stopped  # 0.2 s after each round, well past the limit in all
    assert update.spec.decode_ms < 1000 * pauses / 2, update.spec.decode_ms


def test_the_apps_trace_folder_is_made_on_first_use_and_removed_at_exit(tmp_path):
    script = ("import os, sys, tempfile; tempfile.tempdir = sys.argv[1]; from specviz.ui import page; "
              "assert not os.listdir(sys.argv[1]); folder = page.trace_dir(); assert folder == page.trace_dir(); "
              "(folder / 'specviz-run-1.json').write_text('[]'); print(folder)")
    env = {k: v for k, v in os.environ.items() if k != "GRADIO_TEMP_DIR"}
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=300,
                         env=env)
    assert out.returncode == 0, out.stderr
    # inside Gradio's cache folder (the system's temporary folder's "gradio"), so Gradio serves it without copies
    assert Path(out.stdout.strip()).parent == tmp_path / "gradio" and list(tmp_path.rglob("specviz-*")) == []


def test_the_page_is_drawn_at_most_every_update_s_and_at_each_runs_last_round(pattern_pair, monkeypatch):
    """A 2-core CPU's browser spends longer drawing the page than a round takes: drawn every
    round, the page falls behind the decode it shows. Rounds come faster than UPDATE_S here, so the page is
    drawn at the first round, at each run's last round and at the end; with UPDATE_S 0, every round."""
    from specviz.ui import handlers
    from specviz.ui.view import View

    pair = pattern_pair("llama")
    settings = Settings(gamma=2, max_new_tokens=24)

    def drawn(update_s: float) -> tuple[list[str], Finished]:
        monkeypatch.setattr(handlers, "UPDATE_S", update_s)
        updates = list(stream(pair, "w2 w3 w4", settings, compare=True, chat_template=False))
        statuses = [re.sub("<[^>]+>", "", frame[0]) for frame in handlers.follow(View(), iter(updates), "")]
        return statuses, updates[-1]

    statuses, last = drawn(3600.0)
    first = last.spec.events[0].tokens_so_far
    assert statuses[:3] == [f"speculative: round 1, {first} token{'s' * (first != 1)}",
                            f"speculative: round {len(last.spec.events)}, 24 tokens", "baseline: 24 tokens"]
    assert len(statuses) == 4 and statuses[-1].startswith("done: 24 tokens. Speedup")
    every, _ = drawn(0.0)
    assert len(every) == len(last.spec.events) + len(last.base.events) + 1


def test_a_run_with_the_machines_choice_ends_saying_how_it_measured_against_the_expectation(pattern_pair,
                                                                                             monkeypatch):
    """The page's last status line, for a run with the drafter and shape this machine chose (and its baseline):
    the expected speedup beside the measured one, part by part (costs.against); for any other settings, nothing."""
    from specviz.tools.costs import Choice, Costs
    from specviz.ui import handlers, page
    from specviz.ui.view import View

    chosen = Choice("model", 2, 1.5, tokens_per_round=1.8), Costs("m", "float32", False, {1: 10.0, 3: 12.0},
                                                                   {"model": 2.0})
    monkeypatch.setattr(page, "_MACHINE_CHOICES", {("offline", False): chosen})
    assert page.measured_against("offline", True) is None and page.measured_against("opt-350m", False) is None

    def last_status(settings: Settings) -> tuple[str, str]:  # what the line reads, and what its hover adds
        updates = stream(pattern_pair("llama"), "w2 w3 w4", settings, compare=True, chat_template=False)
        frame = list(handlers.follow(View(), updates, "", page.measured_against("offline", False)))[-1][0]
        hover = re.search(r'title="([^"]*)"', frame)
        return html.unescape(re.sub("<[^>]+>", "", frame)), html.unescape(hover.group(1)) if hover else ""

    status, detail = last_status(Settings(gamma=2, max_new_tokens=24))  # the draft model at γ 2: the choice
    assert status.startswith("done: 24 tokens. Speedup")
    # one short sentence for a projector; the parts on hover
    assert re.search(r" This machine's choice: expected 1\.50x, measured \d+\.\d\dx\.$", status)
    assert "(priced at 1.20)" in detail and detail.endswith("(1.80 on a median benchmark prompt)")
    assert "priced" not in status
    assert "machine's choice" not in last_status(Settings(gamma=3, max_new_tokens=24))[0]


def test_the_charts_are_drawn_together_at_the_first_round_and_the_end_and_in_turn_between(pattern_pair, monkeypatch):
    """The browser lays each chart out anew at every redraw, in the page's one thread: with the page drawn every
    round, the six charts (the five under the streams and the round's tree) come together at the first round and
    when the runs finish, and in between one a frame, in turn, each at most every CHARTS_S; with CHARTS_S 0, all
    in every frame."""
    from specviz.ui import handlers
    from specviz.ui.view import FIGURES, OUTPUT_NAMES, View
    from specviz.view import charts

    pair = pattern_pair("llama")
    updates = list(stream(pair, "w2 w3 w4", Settings(gamma=2, max_new_tokens=24), compare=True, chat_template=False))
    last = updates[-1]
    n_spec, n_base = len(last.spec.events), len(last.base.events)
    monkeypatch.setattr(handlers, "UPDATE_S", 0.0)
    clock = iter(range(10_000))  # each frame one second after the last
    monkeypatch.setattr(handlers.time, "perf_counter", lambda: float(next(clock)))

    def frames(charts_s: float) -> list[list[str]]:
        monkeypatch.setattr(handlers, "CHARTS_S", charts_s)
        out = list(handlers.follow(View(), iter(updates), ""))
        return [[name for name in FIGURES if isinstance(frame[OUTPUT_NAMES.index(name)], charts.PlotlySpec)]
                for frame in out]

    every_second = frames(1.0)  # a sixth of a second per chart: one a frame, in turn
    assert len(every_second) == n_spec + n_base + 1
    assert every_second[0] == every_second[-1] == list(FIGURES)
    between = every_second[1:-1]
    assert all(len(drawn) == 1 for drawn in between)
    assert [drawn[0] for drawn in between[:len(FIGURES)]] == list(FIGURES)  # in turn
    slow = frames(3600.0)  # none between: each waits its turn of 600 s
    assert slow[0] == slow[-1] == list(FIGURES) and not any(slow[1:-1])
    assert all(drawn == list(FIGURES) for drawn in frames(0.0))
    final = handlers.follow(View(), iter(updates), "")
    *_, end = final
    assert end[OUTPUT_NAMES.index("fig_rounds")] == charts.tokens_per_round(last.spec)  # the whole run, at the end


def test_stop_ends_a_run_at_its_next_round_with_its_own_last_frame(pattern_pair, monkeypatch):
    """Stop seen by `follow`: no round after it is shown, the last frame says how far the runs got, and the
    caller's stream is left to close."""
    import html

    from specviz.ui import handlers
    from specviz.ui.view import OUTPUT_NAMES, View

    pair = pattern_pair("llama")
    monkeypatch.setattr(handlers, "UPDATE_S", 0.0)  # every round a frame
    updates = stream(pair, "w2 w3 w4", Settings(gamma=2, max_new_tokens=24), compare=True, chat_template=False)
    view = View()
    watch = handlers.Watch(view)
    shown = []
    for frame in handlers.follow(view, updates, "", baseline_next=True, watch=watch):
        shown.append(html.unescape(frame[OUTPUT_NAMES.index("status")]))
        if len(shown) == 3:
            watch.stop = True
    assert len(shown) == 5 and "round 3," in shown[2] and shown[3] == shown[4]
    tokens = view.spec.n_tokens
    assert 0 < tokens < 24 and view.base is None
    assert f"Stopped after {tokens} tokens." in shown[-1]
    updates.close()
    assert next(updates, None) is None  # closed: the decode ends there

    view = View()
    watch = handlers.Watch(view)
    updates = stream(pair, "w2 w3 w4", Settings(gamma=2, max_new_tokens=12), compare=True, chat_template=False)
    frames = []
    for frame in handlers.follow(view, updates, "", baseline_next=True, watch=watch):
        frames.append(frame)
        if view.base is not None and view.base.n_tokens >= 2:
            watch.stop = True
    said = html.unescape(frames[-1][OUTPUT_NAMES.index("status")])
    assert said.endswith(f"Stopped after 12 tokens, the baseline after {view.base.n_tokens} tokens.</div>"), said


def test_the_charts_open_as_titled_frames_until_a_run_draws_them(pattern_pair):
    """Before any run the page's six charts are frames with their titles and a note (so the browser loads Plotly
    with the page, not during the first run); a run's charts carry no note."""
    from specviz.ui.view import CHARTS, View, empty_charts

    empty = empty_charts()
    assert set(empty) == {*CHARTS, "fig_tree"}
    for figure in empty.values():
        layout = figure["layout"]
        assert layout["title"]["text"] and layout["annotations"][0]["text"] == "drawn as a run goes"
        assert not layout["xaxis"]["showticklabels"] and not layout["yaxis"]["showticklabels"]
    run = stream(pattern_pair("llama"), "w2 w3 w4", Settings(gamma=2, max_new_tokens=8), chat_template=False)
    view = View(spec=list(run)[-1].spec)
    assert all("annotations" not in figure["layout"] for figure in [*view.figures(), view.round_tree()])


def test_generate_compare_warms_up_on_the_prompts_start_not_on_the_whole_prompt(pattern_dirs, monkeypatch, capsys):
    """`generate --compare` warms both paths up before the timed runs; a long prompt's prefill, twice more, would warm
    nothing further (eager forwards have no per-length first calls), so the warm-up reads the prompt's first
    WARM_UP_TOKENS, and the timed runs the whole prompt; a batch's warm-up too."""
    from specviz.tools import cli

    seen = []

    def recording(pair, prompt, settings, **kwargs):
        seen.append((len(kwargs["prompt_ids"]), settings.max_new_tokens))
        return stream(pair, prompt, settings, **kwargs)

    monkeypatch.setattr(cli, "stream", recording)
    target, draft = pattern_dirs("llama")
    prompt = " ".join(f"w{i % 9 + 1}" for i in range(150))  # 150 tokens of the counting language
    assert cli.main(["generate", "--target", str(target), "--draft", str(draft), "--drafter", "model", "--prompt",
                     prompt, "--no-chat-template", "--compare", "--max-new-tokens", "12", "--device", "cpu",
                     "--dtype", "float32"]) == 0
    assert seen == [(cli.WARM_UP_TOKENS, 8), (150, 12)]
    assert "speedup:" in capsys.readouterr().out
    # a batch: its warm-up as well
    from specviz.core import generator

    batches = []
    real_batch = generator.generate_batch
    def recording_batch(*args, **kwargs):
        if "prompts_ids" in kwargs:  # the command's batch calls (a row alone comes through generate, positionally)
            batches.append([len(ids) for ids in kwargs["prompts_ids"]])
        return real_batch(*args, **kwargs)

    monkeypatch.setattr(generator, "generate_batch", recording_batch)
    assert cli.main(["generate", "--target", str(target), "--draft", str(draft), "--drafter", "model", "--prompt",
                     prompt, "--prompt", "w1 w2 w3", "--no-chat-template", "--compare", "--max-new-tokens", "4",
                     "--device", "cpu", "--dtype", "float32"]) == 0
    assert batches == [[cli.WARM_UP_TOKENS, 3], [150, 3]]
