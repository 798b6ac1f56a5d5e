"""The web app through gradio_client, launched in-process on loopback with the offline pair."""

import html
import json
import os
import re
import socket
import subprocess
import sys

import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError

from specviz.core.events import load_runs

pytestmark = [pytest.mark.slow, pytest.mark.offline_model]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def app_url():
    import app

    port = free_port()
    app.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    yield f"http://127.0.0.1:{port}/"
    app.demo.close()


def call(client, prompt="The future of AI", preset="offline", gamma=3, temperature=1.0, top_k=0, top_p=1.0, seed=1,
         max_new_tokens=12, compare=True, drafter="model", gamma_policy="fixed"):
    return client.predict(prompt, preset, "", "", gamma, temperature, top_k, top_p, seed, max_new_tokens, compare,
                          False, drafter, gamma_policy, api_name="/run")


def stat(stats_html: str, name: str) -> str:
    return re.search(rf"<td>{re.escape(name)}</td><td><b>([^<]*)</b>", stats_html).group(1)


def test_run_events_agree_with_the_stats_shown(app_url):
    client = Client(app_url, verbose=False)
    status, spec_html, base_html, diff, stats, *_figs, _pick, download, race, _stage, _how = call(client)
    assert "done: 12 tokens" in status
    spec, base = load_runs(download)
    counts, _, untested = stat(stats, "accepted / rejected / drafted").partition(" (")  # "3 / 1 / 8 (4 not reached)"
    accepted, rejected, drafted = (int(x) for x in counts.split(" / "))
    assert (accepted, rejected, drafted) == (spec.n_accepted, spec.n_rejected, spec.n_drafted)
    assert untested == (f"{spec.n_untested} not reached)" if spec.n_untested else "")
    assert int(stat(stats, "rounds (target passes)")) == len(spec.events)
    assert int(stat(stats, "baseline target passes")) == base.n_tokens == 12
    assert spec_html.count("sv-accepted") == accepted and spec_html.count("sv-rejected") == rejected
    assert "sv-race-row" in race and "Sampled mode" in diff


def test_bad_input_is_readable_and_the_next_request_works(app_url):
    client = Client(app_url, verbose=False)
    for kwargs, message in [
        (dict(prompt=""), "prompt is empty"),
        (dict(top_k=-3), "top_k"),
        (dict(temperature=-1), "temperature (0 = greedy): -1 is outside [0, 2]"),  # a slider's range check
        (dict(gamma=0), "γ (drafts per round): 0 is outside [1, "),
        (dict(preset="no-such-preset"), "not in the list of choices"),  # the dropdown's own check
        (dict(seed="lots"), "lots"),  # the number box cannot parse it
    ]:
        try:
            status = call(client, **kwargs)[0]
            assert "sv-error" in status, status
        except AppError as err:  # Gradio checks ranges and choices before the handler runs
            status = str(err)
        assert message in status, status
    status, spec_html, *_ = call(client, temperature=0.0, max_new_tokens=6)
    assert "done: 6 tokens" in status and "sv-tok" in spec_html


def test_replay_a_trace_without_models(app_url, tmp_path):
    client = Client(app_url, verbose=False)
    download = call(client, max_new_tokens=5)[-4]
    from gradio_client import handle_file

    status, spec_html, base_html, *_ = client.predict(handle_file(download), False, api_name="/replay")
    assert "replaying" in status and "sv-tok" in spec_html and "sv-target" in base_html
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert "not a specviz trace" in client.predict(handle_file(str(bad)), False, api_name="/replay")[0]


def test_prompt_lookup_with_adaptive_gamma_shows_gamma_per_round(app_url):
    import app

    client = Client(app_url, verbose=False)
    status, spec_html, _, diff, stats, fig_rounds, *_rest, download, _race, _stage, _how = call(
        client, prompt=app.EDIT_EXAMPLES[0], temperature=0.0, max_new_tokens=24, drafter="lookup",
        gamma_policy="grow-shrink")
    assert "done: 24 tokens" in status and "Greedy" in diff
    spec, _ = load_runs(download)
    assert spec.meta.draft == "prompt lookup" and spec.meta.gamma_policy == "grow-shrink"
    assert stat(stats, "drafter") == "prompt lookup" and stat(stats, "γ").startswith("γ grow-shrink")
    gammas = [e.gamma for e in spec.events]
    assert len(set(gammas)) > 1 and spec.n_accepted > 0  # the copy was found and γ moved
    figure = json.loads(fig_rounds["plot"])  # gr.Plot sends the Plotly JSON as a string
    assert next(t["y"] for t in figure["data"] if t["name"] == "γ drafted") == gammas


def test_eagle_head_runs_and_names_its_origin(app_url):
    client = Client(app_url, verbose=False)
    status, _, _, diff, stats, *_rest, download, _race, _stage, _how = call(client, temperature=0.0, drafter="eagle",
                                                                           gamma=3)
    assert "done: 12 tokens" in status
    spec, base = load_runs(download)
    assert stat(stats, "drafter").startswith("EAGLE head eagle-smollm2-135m (specviz distill --kind eagle")
    assert spec.meta.draft == html.unescape(stat(stats, "drafter")) and spec.n_accepted > 0
    assert spec.events[0].draft_cache_len > len(spec.meta.prompt_ids) - 2  # entries up to the last real position


def test_lookup_then_eagle_copies_where_the_answer_repeats_the_prompt(app_url):
    client = Client(app_url, verbose=False)
    prompt = ("Replace 'car' with 'bicycle' in this text: My car is parked outside. I bought the car last year, and "
              "the car has been very reliable.")
    status, _, _, _, stats, *_rest, download, _race, _stage, _how = call(
        client, prompt=prompt, temperature=0.0, drafter="lookup+eagle", gamma=2, max_new_tokens=24)
    assert "done: 24 tokens" in status
    spec, _ = load_runs(download)
    assert spec.meta.draft.startswith("prompt lookup where the text repeats, else the EAGLE head eagle-smollm2-135m")
    copied = sum(e.drafted_by == "lookup" for e in spec.events)
    assert copied and any(e.gamma and not e.drafted_by for e in spec.events)  # both drafters had rounds
    assert stat(stats, "rounds drafted by prompt lookup") == f"{copied} of {len(spec.events)}"


def test_the_status_says_what_a_run_waits_for(monkeypatch):
    """Before the first round shows, the status says what the wait is: "loading models…" only while the pair
    loads, then the speculative run's prefill with the prompt's length (seconds for a long prompt on a CPU, a wait
    that must not read "loading models…"), and at its last round the baseline's prefill, which follows; a batch's
    too."""
    from specviz.ui import handlers
    from specviz.ui import page as ui_page

    monkeypatch.setattr(ui_page, "_pairs", {})  # nothing loaded yet
    page = ui_page.Page(prompt="The future of AI", max_new_tokens=4, compare=True, drafter="model", gamma=2)
    for first_run in (True, False):
        outputs = list(handlers.run(page))
        statuses = [html.unescape(re.sub("<[^>]+>", "", out[0])) for out in outputs]
        spec, base = load_runs(outputs[-1][-4])
        prefill = f"prefill ({len(spec.meta.prompt_ids)} prompt tokens)…"
        assert statuses[: 1 + first_run] == ["loading models…"] * first_run + [f"speculative: {prefill}"]
        assert f"speculative: round {len(spec.events)}, 4 tokens; baseline: {prefill}" in statuses
        assert statuses[-1].startswith("done: 4 tokens") and base.n_tokens == 4
    batch = ui_page.Page(batch_prompts="The future of AI\n---\nWhy is the sky blue?", max_new_tokens=4, drafter="model")
    outputs = list(handlers.run_batch(batch))
    runs = load_runs(outputs[-1][2])
    tokens = sum(len(r.meta.prompt_ids) for r in runs)
    assert html.unescape(re.sub("<[^>]+>", "", outputs[0][0])) == f"batch of 2: prefill ({tokens} prompt tokens)…"
    # Step: the same, the status alone changing until the first round shows; then Next within the round at once
    from specviz.ui import stepping
    from specviz.ui.view import OUTPUT_NAMES

    monkeypatch.setattr(ui_page, "_pairs", {})
    monkeypatch.setattr(stepping, "_steppers", {})  # this test's session alone
    outputs = list(handlers.step(page))
    assert [html.unescape(re.sub("<[^>]+>", "", out[0])) for out in outputs[:2]] == [
        "loading models…", f"speculative: {prefill}"]
    assert all(value == handlers.gr.skip() for out in outputs[:2]
               for name, value in zip(OUTPUT_NAMES, out, strict=True) if name != "status")
    assert len(outputs) == 3 and "sv-stage-caption" in outputs[2][OUTPUT_NAMES.index("round_box")]
    assert len(list(handlers.next_stage(page))) == 1  # the shown round's next stage: no wait to tell of


def test_a_preset_brings_its_first_run_settings(monkeypatch):
    """Before this machine's first run is measured, a preset brings its own settings (measured ones: test_costs;
    another test's app may have measured them already in this process)."""
    import app
    from specviz.models.loading import PRESETS
    from specviz.ui import page

    monkeypatch.setattr(page, "_MACHINE_CHOICES", {})
    offline = PRESETS["offline"]
    _, _, drafter, gamma, policy, branch, nodes = app.preset_changed("offline")
    assert (branch["value"], nodes["value"]) == (offline.branch, offline.nodes)
    assert (drafter["value"], gamma["value"], policy["value"]) == (offline.drafter, offline.gamma, offline.gamma_policy)
    assert (app.FIRST_RUN.drafter, app.FIRST_RUN.gamma) == (offline.drafter, offline.gamma)
    custom_target, _, drafter, gamma, policy, branch, nodes = app.preset_changed(app.CUSTOM)
    assert custom_target["visible"] is True
    # a custom pair has no EAGLE head: its draft model drafts, a chain (not the head's tree a preset left)
    assert (drafter["value"], branch["value"], nodes["value"]) == ("model", 1, 0)


def test_a_chain_drafter_picked_turns_a_tree_into_a_chain():
    """Picking the draft model or prompt lookup while the controls ask for a tree (the offline preset's first run
    here may) would fail the next Run ("drafts chains"): one child per draft instead, said in the status."""
    from specviz.ui import handlers

    skip = handlers.gr.skip()
    for drafter in ("model", "lookup"):
        branch, nodes, status = handlers.drafter_picked(drafter, 2)
        assert (branch["value"], nodes["value"]) == (1, 0) and "drafts chains" in status
        assert handlers.drafter_picked(drafter, 1) == [skip] * 3  # a chain already: left as it is
    for drafter in ("eagle", "lookup+eagle"):  # these draft trees
        assert handlers.drafter_picked(drafter, 3) == [skip] * 3


def test_the_app_leaves_a_core_to_a_browser_on_this_machine(monkeypatch):
    """A browser drawing the page beside a decode on every core stalls the decode's threads (on a 2-core CPU the
    decode then runs far slower than on one core): the app decodes on one core fewer, on all in public mode or a
    Space (browsers elsewhere), on as many as SPECVIZ_THREADS says."""
    import torch

    from specviz.ui import page

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        monkeypatch.delenv("SPECVIZ_THREADS", raising=False)
        monkeypatch.delenv("SPACE_ID", raising=False)
        monkeypatch.setattr(page, "PUBLIC", False)
        assert "one core left to a browser" in page.share_the_cores() and torch.get_num_threads() == 3
        torch.set_num_threads(1)
        assert page.share_the_cores().startswith("decoding on 1 thread:") and torch.get_num_threads() == 1
        torch.set_num_threads(4)
        monkeypatch.setattr(page, "PUBLIC", True)
        assert "public mode" in page.share_the_cores() and torch.get_num_threads() == 4
        monkeypatch.setattr(page, "PUBLIC", False)
        monkeypatch.setenv("SPACE_ID", "someone/specviz")
        assert "a Space" in page.share_the_cores() and torch.get_num_threads() == 4
        monkeypatch.setenv("SPECVIZ_THREADS", "2")
        assert "SPECVIZ_THREADS" in page.share_the_cores() and torch.get_num_threads() == 2
        for bad in ("0", "two", "1.5"):
            monkeypatch.setenv("SPECVIZ_THREADS", bad)
            with pytest.raises(SystemExit, match=f"SPECVIZ_THREADS must be a whole number of at least 1, got '{bad}'"):
                page.share_the_cores()
    finally:
        torch.set_num_threads(before)


def test_a_bad_app_setting_stops_the_app_with_one_line_not_a_traceback():
    """The app's numeric environment settings are read when the page module loads: a value that is not a number of
    the right kind stops it with one line naming the variable and the value (not Python's ValueError from
    float() with a traceback); good values and empty ones load."""
    def load(**env):
        return subprocess.run([sys.executable, "-c", "import specviz.ui.page as p; print(p.UPDATE_S, p.CHARTS_S)"],
                              capture_output=True, text=True, env={**os.environ, **env}, timeout=300)

    for name, bad, kind in [("SPECVIZ_UPDATE_S", "fast", "a number of at least 0"),
                            ("SPECVIZ_CHARTS_S", "-1", "a number of at least 0"),
                            ("SPECVIZ_TIME_LIMIT_S", "nan", "a number of at least 0"),
                            ("SPECVIZ_QUEUE_SIZE", "0", "a whole number of at least 1")]:
        done = load(**{name: bad})
        assert done.returncode == 1 and done.stderr.strip() == f"{name} must be {kind}, got '{bad}'", done.stderr
    done = load(SPECVIZ_UPDATE_S="0.5", SPECVIZ_CHARTS_S="")
    assert done.returncode == 0 and done.stdout.split() == ["0.5", "3.0"], done.stderr


def test_batch_streams_one_row_per_prompt(app_url):
    import app

    client = Client(app_url, verbose=False)
    prompts = [app.EXAMPLES[0], app.EDIT_EXAMPLES[3]]
    status, streams, download = client.predict("\n---\n".join(prompts), "offline", "", "", 3, 0.0, 0, 1.0, 0, 10,
                                                "lookup", "fixed", api_name="/batch")
    assert "done: a batch of 2, 20 tokens" in status
    runs = load_runs(download)
    assert [r.meta.prompt for r in runs] == prompts and all(r.meta.batch_size == 2 for r in runs)
    assert streams.count('class="sv-batch-row"') == 2
    for run in runs:  # the stream shows each row's acceptance as the run recorded it
        alpha = run.acceptance_rate
        assert f"α̂ {'–' if alpha is None else f'{alpha:.0%}'}" in streams
    assert streams.count("sv-tok") >= sum(r.n_tokens for r in runs)  # every kept token is in the page


def caption(outputs) -> str:
    return html.unescape(re.search(r'sv-stage-caption">([^<]*)<', outputs[-2]).group(1))


def test_step_mode_runs_one_round_at_a_time_and_ends_with_the_plain_runs_text(app_url):
    client = Client(app_url, verbose=False)
    args = ("The future of AI", "offline", "", "", 2, 0.0, 0, 1.0, 0, 10, True, False, "eagle", "fixed")
    first = client.predict(*args, api_name="/step")
    assert caption(first).startswith("Round 1, stage 1 (draft)") and "Stepping" in first[0]
    stages = 1
    while " of " not in caption(first).split(":")[0]:  # the count is told at the round's last stage only
        stages += 1
        first = client.predict(*args, api_name="/next")
        assert caption(first).startswith(f"Round 1, stage {stages} ")
    assert caption(first).startswith(f"Round 1, stage {stages} of {stages} (add one token)")
    assert caption(client.predict(*args, api_name="/next")).startswith("Round 2, stage 1 (draft)")
    assert caption(client.predict(False, api_name="/back")).startswith(f"Round 1, stage {stages} of {stages}")
    outputs = client.predict(False, api_name="/continue")  # the last of its updates
    assert "done: 10 tokens" in outputs[0]
    spec, base = load_runs(outputs[-4])
    plain, plain_base = load_runs(call(client, temperature=0.0, drafter="eagle", gamma=2, max_new_tokens=10)[-4])
    assert spec.token_ids == plain.token_ids and base.token_ids == plain_base.token_ids


def test_a_replayed_trace_steps_like_a_live_run(app_url, tmp_path):
    from gradio_client import handle_file

    client = Client(app_url, verbose=False)
    download = call(client, max_new_tokens=6)[-4]
    spec, _ = load_runs(download)
    client.predict(handle_file(download), False, api_name="/replay")
    args = ("ignored: a replay steps its own run", "offline", "", "", 2, 0.0, 0, 1.0, 0, 6, True, False)
    outputs = client.predict(*args, api_name="/step")
    assert caption(outputs).startswith("Round 1, stage 1 (draft)")
    assert outputs[1].count("sv-tok") == 0  # stage 1 tells nothing of the round's outcome yet
    while " of " not in caption(outputs).split(":")[0]:  # to the round's last stage
        outputs = client.predict(*args, api_name="/next")
    assert outputs[1].count("sv-tok") == spec.events[0].n_accepted + spec.events[0].n_rejected + 1
    bad = json.loads(open(download).read())
    bad["runs"][0]["events"][0]["n_accepted"] = "2"
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    status = client.predict(handle_file(str(tmp_path / "bad.json")), False, api_name="/replay")[0]
    assert "runs[0].events[0].n_accepted must be a whole number" in html.unescape(status)


def test_float32_check_and_sample_n(app_url):
    client = Client(app_url, verbose=False)
    call(client, temperature=0.0, drafter="eagle", gamma=2, max_new_tokens=8)
    status = html.unescape(client.predict("offline", "", "", api_name="/check_float32"))
    assert "Rerun just now in float32" in status and "identical, token for token (8 tokens)" in status
    status, figure = client.predict("The future of AI", "offline", "", "", 2, 1.0, 0, 1.0, 0, "eagle", False, 200,
                                    api_name="/sample")
    assert "200 + 200 draws" in status and "within sampling noise" in status
    bars = {t["name"]: t["y"] for t in json.loads(figure["plot"])["data"]}
    assert sum(bars["speculative, 200 draws"]) == pytest.approx(1.0)
    status, _ = client.predict("The future of AI", "offline", "", "", 2, 0.0, 0, 1.0, 0, "eagle", False, 200,
                               api_name="/sample")
    assert "temperature > 0" in html.unescape(status)


def test_a_custom_pair_is_let_go_when_another_is_asked_for(monkeypatch, pattern_dirs):
    """The server keeps the default pair and the one asked for last: a custom pair's models are freed (no reference
    left) as soon as another pair is asked for."""
    import weakref

    from specviz.ui import page as ui_page

    target, draft = pattern_dirs("llama")
    default = object()  # the default pair, loaded (as a server keeps it)
    monkeypatch.setattr(ui_page, "_pairs", {ui_page._pair_key("offline", "", "", "auto")[0]: default})
    for other in (("offline", "", ""), (ui_page.CUSTOM, str(target), str(draft))):
        first = ui_page.get_pair(ui_page.CUSTOM, str(target), str(draft), "float32")
        models = [weakref.ref(first.target), weakref.ref(first.draft)]
        assert ui_page.get_pair(ui_page.CUSTOM, str(target), str(draft), "float32") is first  # kept while asked for
        del first
        ui_page.get_pair(*other, "auto" if other[0] == "offline" else "float64")  # the default; another dtype
        assert [m() for m in models] == [None, None], other
    assert list(ui_page._pairs.values())[0] is default and len(ui_page._pairs) == 2


def test_a_value_out_of_range_is_refused_in_one_sentence_and_one_console_line(app_url, capfd, caplog):
    """Over the API, a slider's value out of range is refused naming the control and its range; the server's
    console gets one line for it, not a traceback."""
    import logging

    client = Client(app_url, verbose=False)
    capfd.readouterr()
    with caplog.at_level(logging.INFO, logger="specviz"), pytest.raises(AppError) as refused:
        call(client, gamma=1000000)
    from specviz.ui.page import MAX_GAMMA_UI

    assert f"γ (drafts per round): 1000000 is outside [1, {MAX_GAMMA_UI}]" in str(refused.value)
    assert "Traceback" not in capfd.readouterr().err
    assert [r.getMessage() for r in caplog.records if "refused" in r.getMessage()] == [
        "refused γ (drafts per round) = 1000000"]


def test_while_the_app_measures_this_machine_the_page_says_the_step_and_a_run_waits_for_it(monkeypatch):
    """`python app.py` serves the page first and measures this machine after: a page opened meanwhile says the
    step (its timer asking again), and a Run pressed meanwhile waits, saying so, then runs once it is done."""
    import threading

    from specviz.ui import handlers
    from specviz.ui import page as ui_page

    warming = ui_page.Warming()
    monkeypatch.setattr(handlers, "WARMING", warming)
    warming.begin(3)
    warming.at("loading the models")
    *controls, note, timer = handlers.page_opened()
    assert controls == [handlers.gr.skip()] * 4 and timer.active
    assert "Measuring this machine, step 1 of 3: loading the models" in note
    run = handlers.run(ui_page.Page(prompt="The future of AI", max_new_tokens=4, drafter="lookup", gamma=2))
    first = next(run)[0]
    assert "Measuring this machine, step 1 of 3" in first and "Runs start when it is done" in first
    threading.Timer(1.5, warming.finish).start()
    statuses = [out[0] for out in run]
    assert "done: 4 tokens" in statuses[-1]
    *controls, note, timer = handlers.page_opened()
    assert not timer.active and controls[0] != handlers.gr.skip()
