"""A real browser (Debian's chromium, driven by Playwright) runs the app on the offline pair."""

import itertools
import os
import re
import shutil
import socket
import sys
import traceback
from pathlib import Path

import pytest

from specviz.tools.pagebench import WATCH_STATUS, run_to_its_end

pytestmark = [pytest.mark.slow, pytest.mark.offline_model, pytest.mark.browser]

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
SCREENSHOT = Path(os.environ.get("SPECVIZ_SCREENSHOT", Path(__file__).parent.parent / "build" / "screenshot.png"))


@pytest.fixture(scope="module")
def app_url():
    import app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app.warm_up()  # as `python app.py` does before serving
    app.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    yield f"http://127.0.0.1:{port}/"
    app.demo.close()


def test_page_shows_coloured_tokens_charts_and_hover(app_url):
    from playwright.sync_api import expect, sync_playwright

    assert Path(CHROMIUM).exists(), "install Debian's chromium (the README's test command does)"
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM, headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--no-first-run"],
        )
        page = browser.new_page(viewport={"width": 1400, "height": 1800})
        page.goto(app_url, wait_until="domcontentloaded")
        page.locator("#run-btn").wait_for(timeout=60_000)
        page.get_by_label("Prompt").fill("The future of AI")
        raise_temperature(page)
        print(f"\nRun pressed -> first rendered round: {press_run(page):.2f} s (cold page)")
        page.locator("#status :text('done')").wait_for(timeout=300_000)

        assert page.locator("#spec-stream .sv-accepted").count() > 0
        assert page.locator("#spec-stream .sv-rejected").count() > 0
        rejected = page.locator("#spec-stream .sv-rejected").first
        assert rejected.evaluate("e => getComputedStyle(e).textDecorationLine") == "line-through"
        token = page.locator("#spec-stream .sv-accepted").first
        token.hover()
        title = token.get_attribute("title")
        assert "p = " in title and "q = " in title and "u = " in title
        page.wait_for_function("document.querySelectorAll('.js-plotly-plot').length >= 4", timeout=30_000)
        drawn(page, "#chart-rounds")
        # where a round's time went: the speculative round and the plain step, each bar its stages' sum, drawn to scale
        split = page.evaluate("""() => [...document.querySelectorAll('#sv-time-split .sv-split-row')].map(row => ({
            run: row.dataset.run, ms: +row.dataset.ms,
            stages: Object.fromEntries([...row.querySelectorAll('[data-stage]')]
                                       .map(s => [s.dataset.stage, +s.dataset.ms])),
            drawn: [...row.querySelectorAll('[data-stage]')].reduce((w, s) => w + s.getBoundingClientRect().width, 0),
            bar: row.querySelector('.sv-split-bar').getBoundingClientRect().width}))""")
        assert [bar["run"] for bar in split] == ["speculative", "baseline"], split
        for bar in split:
            assert list(bar["stages"]) == ["draft", "verify", "judge", "record", "rest"]
            assert sum(bar["stages"].values()) == pytest.approx(bar["ms"], abs=0.01) and bar["stages"]["verify"] > 0
        longer, shorter = sorted(split, key=lambda bar: -bar["ms"])
        assert longer["drawn"] == pytest.approx(longer["bar"], rel=0.02)
        assert shorter["drawn"] / longer["drawn"] == pytest.approx(shorter["ms"] / longer["ms"], rel=0.05)
        assert split[0]["stages"]["draft"] > 0
        assert "verify (target forward)" in page.locator("#sv-time-split").inner_text()
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOT), full_page=True)
        set_number(page, "max new tokens", "16")  # the second run is timed to its first round only
        print(f"Run pressed -> first rendered round: {press_run(page):.2f} s (second run)")
        page.locator("#status :text('done')").wait_for(timeout=300_000)

        # the batch panel: one stream per prompt, each with its own acceptance
        page.get_by_role("tab", name="Batch").click()
        batch_prompts = page.locator("#batch-prompts textarea")
        expect(batch_prompts).to_have_value(re.compile("---"))  # mounted with its example batch
        wanted = "The future of AI\n---\nHappy Birthday lyrics"
        for _ in range(10):  # the panel's first render can put its example back over a fill: fill again
            batch_prompts.fill(wanted)
            page.wait_for_timeout(300)
            if batch_prompts.input_value() == wanted:
                break
        expect(batch_prompts).to_have_value(wanted)
        page.locator("#batch-btn").click()
        page.wait_for_function("/done|Error/.test(document.querySelector('#batch-status').innerText)",
                               timeout=300_000)
        assert "done: a batch of 2" in page.locator("#batch-status").inner_text()
        rows = page.locator("#batch-streams .sv-batch-row")
        assert rows.count() == 2
        for i in range(2):
            assert "α̂" in rows.nth(i).inner_text() and rows.nth(i).locator(".sv-tok").count() > 0
        browser.close()


FIRST_ROUND_TIMER = """() => {
  const count = () => document.querySelectorAll('#spec-stream .sv-tok').length;
  window.svT0 = performance.now(); window.svFirst = null; window.svEmpty = count() === 0;
  new MutationObserver(() => {
    if (count() === 0) window.svEmpty = true;
    else if (window.svEmpty && window.svFirst === null) window.svFirst = performance.now() - window.svT0;
  }).observe(document.body, {subtree: true, childList: true, characterData: true});
}"""


def drawn(page, chart: str) -> None:
    """Plotly draws after the update that carries the figure: wait (up to 30 s) for its bars."""
    page.locator(f"{chart} .js-plotly-plot .bars").first.wait_for(timeout=30_000)


def set_number(page, name: str, value: str) -> None:
    box = page.get_by_role("spinbutton", name=f"number input for {name}")
    box.fill(value)
    box.press("Enter")


def raise_temperature(page, value: str = "1") -> None:
    """On a page just opened: the temperature above 0 moves the drafting controls from what is expected
    fastest here greedy to what is when sampling (the same values where one shape wins both)."""
    from playwright.sync_api import expect

    from specviz.ui.page import first_run_values

    for sampled in (False, True):
        if sampled:
            set_number(page, "temperature", value)
        _, _, branch, nodes, _ = first_run_values("offline", sampled)
        for box, want in (("#branch", branch), ("#nodes", nodes)):
            expect(page.locator(f'{box} input[type="number"]')).to_have_value(str(want), timeout=30_000)


def press_run(page) -> float:
    """Seconds from the click on Run to the first round's tokens in the page (timed in the page)."""
    page.evaluate(FIRST_ROUND_TIMER)
    page.locator("#run-btn").click()
    page.wait_for_function("window.svFirst !== null", timeout=120_000)
    return page.evaluate("window.svFirst") / 1000


STEP_SHOT = SCREENSHOT.with_name("step-mode.png")
CAPTION = "#stage-view .sv-stage-caption"
CAPTION_TIMER = """(wanted) => {
  window.svWanted = wanted; window.svT0 = performance.now(); window.svDone = null;
  if (window.svObserver) return;  // one observer for every timing: a stale one would match an old caption
  const check = () => {
    const caption = document.querySelector('#stage-view .sv-stage-caption');
    if (window.svDone === null && caption && caption.innerText.startsWith(window.svWanted)) {
      window.svDone = performance.now() - window.svT0;
    }
  };
  window.svObserver = new MutationObserver(check);
  window.svObserver.observe(document.body, {subtree: true, childList: true, characterData: true});
}"""


def timed(page, action, wanted: str) -> float:
    """Seconds from an action to the stage caption starting with `wanted` (timed in the page)."""
    page.evaluate(CAPTION_TIMER, wanted)
    action()
    page.wait_for_function("window.svDone !== null", timeout=120_000)
    return page.evaluate("window.svDone") / 1000


def opened(page, url: str) -> None:
    """Open the app and wait until the page's script is in place and the page's opening call has set the controls
    (what is typed before it lands is overwritten by the machine's first-run settings)."""
    from specviz.ui.page import first_run_values

    page.goto(url, wait_until="domcontentloaded")
    page.wait_for_function("document.body.dataset.svReady === '1'", timeout=60_000)
    if first_run_values("offline")[4]:
        page.wait_for_function("/This machine's choice/.test(document.querySelector('#status').innerText)",
                               timeout=60_000)


def last_stage(page) -> bool:
    """The caption tells the round's stage count at its last stage only ('stage 5 of 5')."""
    return " of " in page.locator(CAPTION).inner_text().split(":")[0]


def test_step_mode_walks_a_round_stage_by_stage_and_projector_mode_persists(app_url):
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                     args=["--no-sandbox", "--disable-gpu", "--no-first-run"])
        page = browser.new_page(viewport={"width": 1400, "height": 1600})
        page.goto(app_url + "?projector=1", wait_until="domcontentloaded")
        page.locator("#step-btn").wait_for(timeout=60_000)
        expect(page.locator("#projector input")).to_be_checked(timeout=30_000)  # from the URL
        page.wait_for_function("document.body.classList.contains('sv-projector')", timeout=30_000)
        raise_temperature(page)
        chain = page.locator('#branch input[type="number"]')  # a chain first (this machine may open on a tree)
        chain.fill("1")
        chain.press("Enter")

        first = timed(page, lambda: page.locator("#step-btn").click(), "Round 1, stage 1 ")
        assert "The drafter proposes d1" in page.locator(CAPTION).inner_text()
        tokens = page.locator("#spec-stream .sv-tok")
        assert tokens.count() == 0  # stage 1: the stream does not give the round's outcome away
        assert page.locator("#stage-view td.sv-cur").count() == 1  # the stage's own cell is marked
        page.locator("body").click(position={"x": 5, "y": 5})  # focus off any field: the key is for the page
        # two quick presses are two stages: the second is queued, not dropped while the first is under way
        page.keyboard.press("n")
        stage_s = timed(page, lambda: page.keyboard.press("n"), "Round 1, stage 3 ")
        stage = 3
        while not last_stage(page):  # the key n steps through the round's stages in order
            stage += 1
            stage_s = timed(page, lambda: page.keyboard.press("n"), f"Round 1, stage {stage} ")
        text = page.locator(CAPTION).inner_text()
        assert "takes its place" in text or "bonus" in text or "end-of-text" in text  # the added token is last
        told = tokens.count()
        assert told >= 1  # the round's tokens, now that its last stage has told them
        how = page.locator("#how-it-works").inner_text()
        assert all(step in how for step in ("Draft", "Verify", "Accept or reject", "Add one token", "Roll back"))
        assert "u = " in page.locator("#stage-view").inner_text() or "vs" in page.locator("#stage-view").inner_text()
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(STEP_SHOT), full_page=False)
        next_round = timed(page, lambda: page.keyboard.press("n"), "Round 2, stage 1 ")  # a live round
        assert tokens.count() == told  # round 1's tokens, none of round 2's yet
        again = timed(page, lambda: page.locator("#step-btn").click(), "Round 3, stage 1 ")
        print(f"\nstep mode: first Step {first:.2f} s (starts the run), a stage {stage_s:.2f} s, "
              f"the next round by key {next_round:.2f} s, by Step {again:.2f} s")
        page.locator("#continue-btn").click()
        page.wait_for_function("/done/.test(document.querySelector('#status').innerText)", timeout=300_000)

        page.get_by_label("projector (large type)").uncheck()
        page.wait_for_function("!document.body.classList.contains('sv-projector') && "
                               "!location.search.includes('projector')", timeout=30_000)

        # a tree: 3 children per draft, 6 verified. Step rounds until one keeps a draft; walked stage by stage,
        # its tree shows the kept path (green), the rejected drafts (red) and the token the target added
        for slider, value in (("#branch", "3"), ("#nodes", "6")):
            box = page.locator(f'{slider} input[type="number"]')
            box.fill(value)
            box.press("Enter")
        legend = "Array.from(document.querySelectorAll('#chart-tree .legendtext')).map(e => e.textContent)"
        names: list[str] = []
        for round_number in range(1, 13):
            timed(page, lambda: page.locator("#step-btn").click(), f"Round {round_number}, stage 1 ")
            caption = page.locator(CAPTION).inner_text()
            assert "Depth 1 of the tree" in caption, caption  # a tree round starts with its first level
            stage = 1
            while not last_stage(page):
                stage += 1
                timed(page, lambda: page.keyboard.press("n"), f"Round {round_number}, stage {stage} ")
            page.wait_for_function(f"{legend}.includes('last kept token')", timeout=60_000)
            names = page.evaluate(legend)
            if "kept" in names:
                break
        assert "kept" in names, names
        title = page.locator("#chart-tree .gtitle").text_content()
        assert "drafts as a tree" in title and "kept" in title, title
        page.locator("#chart-tree").screenshot(path=str(SCREENSHOT.with_name("tree-round.png")))
        page.get_by_label("projector (large type)").check()  # on a projector's 1280x720 the tree keeps off the table
        page.wait_for_function("document.body.classList.contains('sv-projector')", timeout=30_000)
        page.set_viewport_size({"width": 1280, "height": 720})
        table, tree = page.locator("#stage-view table").bounding_box(), page.locator("#chart-tree").bounding_box()
        assert table["y"] + table["height"] <= tree["y"] or table["x"] + table["width"] <= tree["x"], (table, tree)
        browser.close()


def test_a_number_out_of_range_or_a_trace_too_large_is_said_where_it_is_set(app_url, tmp_path):
    """A number typed outside a slider's range is set to the range's end when the box is left, and the page says so
    in a line everyone sees, before any Run; a trace over the upload limit is refused saying its size and the limit."""
    from playwright.sync_api import sync_playwright

    from specviz.core.events import MAX_TRACE_MB
    from specviz.ui.page import MAX_GAMMA_UI

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                     args=["--no-sandbox", "--disable-gpu", "--no-first-run"])
        page = browser.new_page(viewport={"width": 1400, "height": 1600})
        opened(page, app_url)
        note = page.locator("#sv-corrected")
        for name, typed, said, end in (("γ (drafts per round)", "1000000", "above the most", str(MAX_GAMMA_UI)),
                                       ("temperature (0 = greedy)", "-3", "below the least", "0")):
            box = page.get_by_role("spinbutton", name=f"number input for {name}")
            box.fill(typed)
            box.press("Tab")
            page.wait_for_function(f"document.querySelector('#sv-corrected')?.innerText.startsWith({name!r})",
                                   timeout=10_000)
            assert note.inner_text() == f"{name}: {typed} is {said} it takes, {end}; set to {end}.", note.inner_text()
            assert note.is_visible()
            page.wait_for_function(f"document.querySelector('[aria-label=\"number input for {name}\"]').value "
                                   f"== {end!r}", timeout=10_000)  # the box shows what a Run will use
        # a trace over the upload limit: the page says how large it is and what the limit is
        big = tmp_path / "big-trace.json"
        big.write_bytes(b" " * ((MAX_TRACE_MB + 3) * 2**20))
        page.get_by_role("tab", name="Trace: download or replay").click()
        page.locator('input[type="file"]').first.set_input_files(str(big))
        page.wait_for_function("document.querySelector('#sv-corrected')?.innerText.startsWith('big-trace')",
                               timeout=10_000)
        said = f"big-trace.json is {MAX_TRACE_MB + 3}.0 MB; a trace may be at most {MAX_TRACE_MB} MB."
        assert note.inner_text() == said
        note.click()  # it stays until clicked (a corrected number's note goes by itself)
        page.wait_for_function("document.querySelector('#sv-corrected').hidden", timeout=10_000)
        browser.close()


def test_projector_type_shows_a_rounds_stream_table_and_tree_on_one_screen(app_url):
    """In projector type at 1280x720, a stepped tree round's stream, table and tree fit one screen, and the tree's
    legend entries do not run into each other (screenshots at 1280x720 and 1920x1080 for the README)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                     args=["--no-sandbox", "--disable-gpu", "--no-first-run"])
        page = browser.new_page(viewport={"width": 1280, "height": 720})
        opened(page, app_url + "?projector=1")
        for name, value in (("children per draft (1 = a chain)", "3"), ("tree: drafts verified (0 = all)", "5")):
            set_number(page, name, value)
        page.locator("#step-btn").click()
        page.wait_for_function("document.querySelector('#stage-view .sv-stage-caption')", timeout=120_000)
        page.locator("body").click(position={"x": 5, "y": 5})
        while not last_stage(page):
            before = page.locator(CAPTION).inner_text()
            page.keyboard.press("n")
            page.wait_for_function(f"document.querySelector('{CAPTION}').innerText !== {before!r}", timeout=60_000)
        assert "tree" in page.locator("#chart-tree .gtitle").text_content()
        page.locator("#spec-stream").evaluate("e => e.scrollIntoView()")
        page.wait_for_timeout(500)
        stream, table, tree = (page.locator(s).bounding_box() for s in ("#spec-stream", "#stage-view", "#chart-tree"))
        assert stream["y"] >= 0 and table["y"] > stream["y"] and tree["y"] + tree["height"] <= 720, (stream, tree)
        caption = page.locator(CAPTION).bounding_box()  # the caption wraps inside the page
        assert caption["x"] + caption["width"] <= 1280 and caption["height"] > 40, caption
        entries = sorted((b["x"], b["x"] + b["width"]) for b in (
            page.locator("#chart-tree .legend .traces").nth(i).bounding_box()
            for i in range(page.locator("#chart-tree .legend .traces").count())))
        assert len(entries) >= 3 and all(a[1] <= b[0] + 1 for a, b in itertools.pairwise(entries)), entries
        page.screenshot(path=str(SCREENSHOT.with_name("projector-1280x720.png")))
        page.set_viewport_size({"width": 1920, "height": 1080})
        page.locator("#spec-stream").evaluate("e => e.scrollIntoView()")
        page.wait_for_timeout(500)
        page.screenshot(path=str(SCREENSHOT.with_name("projector-1920x1080.png")))
        browser.close()


SAMPLE_SHOT = SCREENSHOT.with_name("sample-check.png")


def test_lossless_checks_greedy_drafting_and_the_cache_chart(app_url):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                     args=["--no-sandbox", "--disable-gpu", "--no-first-run"])
        page = browser.new_page(viewport={"width": 1400, "height": 2400})
        page.goto(app_url, wait_until="domcontentloaded")
        page.locator("#run-btn").wait_for(timeout=60_000)
        for name, value in (("temperature", "1"), ("max new tokens", "16")):
            set_number(page, name, value)

        # greedy drafting under sampling: the stats say so, and the caches chart its rounds
        page.get_by_text("More settings and example prompts").click()
        page.get_by_label("draft greedily").check()
        assert "done" in run_to_its_end(page)
        assert "drafting greedily" in page.locator("#stats").inner_text()
        drawn(page, "#chart-cache")
        assert "rolled back" in page.locator("#chart-cache").inner_text()

        # the exact check: one round in closed form, beside what a broken rule would give
        page.get_by_role("tab", name="Lossless, visible").click()
        page.locator("#exact-btn").click()
        page.wait_for_function("/closed form|Error/.test(document.querySelector('#exact-status').innerText)",
                               timeout=120_000)
        exact = page.locator("#exact-status").inner_text()
        assert "differs from the target's p by at most" in exact and "would miss by" in exact, exact

        # sample N times: both histograms beside the exact distribution, and the distances
        samples = page.get_by_role("spinbutton", name="N", exact=True)
        samples.fill("400")
        samples.press("Enter")
        page.locator("#sample-btn").click()
        page.wait_for_function("/draws in|Error/.test(document.querySelector('#lossless-status').innerText)",
                               timeout=300_000)
        status = page.locator("#lossless-status").inner_text()
        assert "400 + 400 draws in" in status and "within sampling noise" in status, status
        drawn(page, "#chart-sample")
        print(f"\nsample N: {status}")
        page.locator("#chart-sample").scroll_into_view_if_needed()
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SAMPLE_SHOT), full_page=False)

        # greedy: the float32 check reruns both runs and says whether they agree
        page.get_by_label("draft greedily").uncheck()
        set_number(page, "temperature", "0")
        assert "done" in run_to_its_end(page)
        page.locator("#fp32-btn").click()
        page.wait_for_function("/Rerun just now|Error/.test(document.querySelector('#fp32-status').innerText)",
                               timeout=300_000)
        assert "Rerun just now in float32" in page.locator("#fp32-status").inner_text()
        browser.close()


NOTEBOOK_SHOT = SCREENSHOT.with_name("notebook.png")


def test_a_runs_notebook_html_renders_in_chromium():
    """What Jupyter shows for a Run (its _repr_html_), drawn by chromium with plotly.js embedded."""
    from playwright.sync_api import sync_playwright

    from specviz.core.generator import Settings, generate
    from specviz.models.loading import load_pair
    from specviz.view.notebook import run_html

    pair = load_pair(preset="offline")
    run = generate(pair, "The future of AI", Settings(drafter="eagle", gamma=2, temperature=1.0, max_new_tokens=24))
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1000, "height": 900})
        page.route("**/*", lambda route: route.abort())  # nothing leaves the machine
        page.set_content(f"<html><body>{run_html(run, plotlyjs=True)}</body></html>")
        page.locator(".js-plotly-plot .bars").first.wait_for(timeout=60_000)
        assert page.locator(".sv-stream .sv-tok").count() >= run.n_tokens
        assert "acceptance rate" in page.locator(".sv-stats").inner_text()
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(NOTEBOOK_SHOT), full_page=True)
        browser.close()


STOP_TIMER = """() => {
  const text = () => document.querySelector('#lossless-status').innerText;
  window.svStopAt = performance.now(); window.svLast = text(); window.svChanged = null; window.svUpdates = 0;
  new MutationObserver(() => {
    if (text() !== window.svLast) {
      window.svLast = text(); window.svUpdates += 1;
      if (window.svChanged === null) window.svChanged = performance.now() - window.svStopAt;
    }
  }).observe(document.querySelector('#lossless-status'), {subtree: true, childList: true, characterData: true});
}"""


def queue_state() -> str:
    """Gradio's queue as the server in this process holds it: running and waiting events, their outcomes."""
    import app

    try:  # Gradio's internals: a report must not fail on them
        queue = app.demo._queue
        lines = [f"active jobs: {[[e.fn.name for e in job] if job else None for job in queue.active_jobs]}"]
        lines += [f"concurrency {cid!r}: {len(q.queue)} waiting, {q.current_concurrency} of {q.concurrency_limit} "
                  f"running" for cid, q in queue.event_queue_per_concurrency_id.items()]
        lines.append(f"pending event ids by session: {queue.pending_event_ids_session}")
        lines += [f"event {a['function']}: {a['status']}" for a in list(queue.event_analytics.values())[-8:]]
    except Exception as err:  # noqa: BLE001
        return f"gradio's queue unreadable: {err!r}"
    return "\n".join(lines)


def test_the_first_screen_shows_the_run_and_stop_ends_a_sample_check(app_url):
    """At a projector's 1280x720 after a run: the speedup and both streams' first tokens without scrolling,
    in large type too. Stop during Sample N: no more of its updates, and the next run gets the device at once."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                     args=["--no-sandbox", "--disable-gpu", "--no-first-run"])
        page = browser.new_page(viewport={"width": 1280, "height": 720})
        sent = []  # the page's queue requests and console lines, for a failure's report
        page.on("request", lambda r: sent.append(f"{r.method} {r.url}") if "/queue/" in r.url or "/cancel" in r.url
                else None)
        page.on("console", lambda m: sent.append(f"console {m.type}: {m.text}"))
        page.goto(app_url, wait_until="domcontentloaded")
        page.locator("#run-btn").wait_for(timeout=60_000)
        set_number(page, "max new tokens", "24")
        page.locator("#run-btn").click()
        page.locator("#status :text('Speedup')").wait_for(timeout=300_000)
        assert page.evaluate("window.scrollY") == 0
        page.screenshot(path=str(SCREENSHOT.with_name("first-screen.png")))
        for projector in (False, True):
            if projector:
                page.get_by_label("projector (large type)").check()
                page.wait_for_function("document.body.classList.contains('sv-projector')", timeout=30_000)
            for element in ("#status", "#spec-stream .sv-tok >> nth=0", "#base-stream .sv-tok >> nth=0"):
                box = page.locator(element).bounding_box()
                assert box and box["y"] + box["height"] <= 720, (projector, element, box)  # on the first screen
        page.get_by_label("projector (large type)").uncheck()

        page.get_by_role("tab", name="Lossless, visible").click()
        samples = page.get_by_role("spinbutton", name="N", exact=True)
        samples.fill("20000")
        samples.press("Enter")
        set_number(page, "temperature", "1")
        page.locator("#sample-btn").click()
        page.locator("#lossless-status :text('Sampling')").wait_for(timeout=120_000)
        page.locator("#stop-btn").click()
        page.evaluate(STOP_TIMER)
        # the chunk under way may still report, and Gradio clears its progress: wait until 6 s pass without an
        # update (a batch aims at lossless.CHUNK_S, about 1 s, but can take several times that while the other
        # test worker measures kernels), at most 40 s
        settled, quiet = 0, 0
        for _ in range(80):
            page.wait_for_timeout(500)
            updates = page.evaluate("window.svUpdates")
            quiet, settled = (quiet + 1, settled) if updates == settled else (0, updates)
            if quiet == 12:
                break
        assert quiet == 12, settled  # still reporting 40 s after Stop
        late = page.evaluate("window.svChanged")
        page.wait_for_timeout(4000)
        updates = page.evaluate("window.svUpdates")
        assert updates == settled, (settled, updates)  # then nothing: a running sampler reports every batch
        assert "draws in" not in page.locator("#lossless-status").inner_text()  # it never finished
        started = page.evaluate("performance.now()")
        page.evaluate(WATCH_STATUS)  # from before the click: a run that ends before the next look still counts
        page.locator("#run-btn").click()  # the device is free: the run starts, and ends
        try:
            page.wait_for_function("() => window.svRunning", timeout=120_000)
        except Exception as err:  # the server's threads and queue (it runs in this process), for the next reader
            stacks = "\n".join(f"--- thread {ident}\n" + "".join(traceback.format_stack(frame))
                               for ident, frame in sys._current_frames().items())
            raise AssertionError(f"the run did not start within 120 s of Stop; status: "
                                 f"{page.locator('#status').inner_text()!r}; lossless: "
                                 f"{page.locator('#lossless-status').inner_text()!r}\nthe page's requests:\n"
                                 + "\n".join(sent) + f"\n{queue_state()}\n{stacks}") from err
        begun = page.evaluate("performance.now()")
        page.wait_for_function("() => window.svEnded", timeout=300_000)
        assert "Speedup" in page.evaluate("window.svEnded")
        print(f"\nStop during Sample N: {settled} update(s) after Stop, the first {late} ms after it; the next "
              f"run began {(begun - started) / 1000:.1f} s after Run and ended "
              f"{(page.evaluate('performance.now()') - started) / 1000:.1f} s after it")
        browser.close()


WATCH_STOPPED = """() => {
  const status = document.querySelector('#status');
  window.svStoppedAt = null; window.svAfterStop = 0; window.svClickAt = null;
  document.querySelector('#stop-btn').addEventListener('click', () => { window.svClickAt = performance.now(); },
                                                       {capture: true, once: true});
  new MutationObserver(() => {
    if (window.svStoppedAt !== null) window.svAfterStop += 1;
    else if (/Stopped after/.test(status.textContent)) window.svStoppedAt = performance.now();
  }).observe(status, {subtree: true, childList: true, characterData: true});
}"""


def test_a_waiting_viewer_sees_their_place_and_stop_ends_a_long_run_with_its_own_last_word(app_url):
    """Two viewers: while the first one's 4096-token run goes (long enough to outlast the second's steps on a loaded
    machine), the second's Run waits with its place in the queue on the page, and their Stop takes it out of the
    queue; the first one's Stop ends the run before its end, the status saying how far it got, and nothing is drawn
    after it. Prints how long after the click the page said so (the issue's bound is a second on the machine that
    measures it)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                     args=["--no-sandbox", "--disable-gpu", "--no-first-run"])
        first, second = (browser.new_page(viewport={"width": 1280, "height": 720}) for _ in range(2))
        for page, url in ((first, app_url), (second, app_url + "?projector=1")):
            page.goto(url, wait_until="domcontentloaded")
            page.locator("#run-btn").wait_for(timeout=60_000)
        set_number(first, "max new tokens", "16")  # a finished run: what the server prices a token at
        first.locator("#run-btn").click()
        first.locator("#status :text('done')").wait_for(timeout=120_000)
        set_number(first, "max new tokens", "4096")
        first.locator("#run-btn").click()
        first.wait_for_function("/speculative: round \\d+, [1-9]\\d+ tokens/.test("
                                "document.querySelector('#status').textContent)", timeout=120_000)
        second.locator("#run-btn").click()
        second.locator("#status :text('place 1 of 1 in the queue')").wait_for(timeout=60_000)  # place, time waited
        place = second.locator("#status .sv-queue")  # on a line of its own, in the projector's type
        box = place.bounding_box()
        assert place.is_visible() and box["height"] >= 24 and box["y"] + box["height"] <= 720, box
        assert float(place.evaluate("e => getComputedStyle(e).fontSize").replace("px", "")) >= 24
        # the wait from the run ahead's own budget (its box's tokens, as many again for its baseline), in the same type
        budget = int(first.get_by_role("spinbutton", name="number input for max new tokens").input_value())
        wait = second.locator("#sv-wait :text('About')")
        wait.wait_for(timeout=30_000)
        said = wait.inner_text()
        assert re.fullmatch(rf"About \d+ s more to wait \(the runs ahead ask for up to {2 * budget} tokens, at \d+ ms "
                            r"a token here\)\.", said.strip()), (said, budget)
        assert float(wait.evaluate("e => getComputedStyle(e).fontSize").replace("px", "")) >= 24
        first_said = int(said.split()[1])
        second.wait_for_function(f"() => {{ const m = document.querySelector('#sv-wait').textContent"
                                 f".match(/About (\\d+) s/); return m && +m[1] < {first_said}; }}", timeout=30_000)
        second.wait_for_function("/place 1 of 1 in the queue, [1-9]\\d* s so far/.test("
                                 "document.querySelector('#status').textContent)", timeout=10_000)  # the time goes on
        second.locator("#stop-btn").click()
        second.locator("#status :text('Stopped before it started')").wait_for(timeout=30_000)
        second.wait_for_function("() => !document.querySelector('#sv-wait').textContent.trim()", timeout=10_000)

        first.wait_for_function("/speculative: round \\d+, ([2-9]\\d\\d|\\d{4,}) tokens/.test("
                                "document.querySelector('#status').textContent)", timeout=120_000)  # a long stream
        first.evaluate(WATCH_STOPPED)
        clicked = first.evaluate("performance.now()")
        first.locator("#stop-btn").click()
        first.wait_for_function("() => window.svStoppedAt !== null", timeout=30_000)
        took = first.evaluate("window.svStoppedAt") - clicked
        said = first.locator("#status").inner_text()
        first.wait_for_timeout(3000)
        handled = first.evaluate("window.svClickAt") - clicked
        print(f"\nStop during a 4096-token run: '{said.strip()}' {took:.0f} ms after the click (the page took the "
              f"click {handled:.0f} ms after it was made)")
        # the time is printed, not asserted (a timing, on a CI machine shared with the other test worker); what is
        # asserted is that Stop took effect before the run's end and that nothing of the run came after its line
        assert re.search(r"Stopped after \d+ tokens(\.|, the baseline after \d+ tokens\.)", said), said
        assert "done:" not in said
        assert first.locator("#status").inner_text() == said  # no update of the run after its last
        assert second.locator("#status").inner_text().strip().startswith("Stopped before it started")
        browser.close()


def test_cpu_seconds_between_readings_never_count_a_process_that_ended():
    """A browser process that exits between two readings is left out: read as zero seconds at the second, it
    would make the browser's share negative."""
    from specviz.tools.pagebench import spent

    before = {10: ("app", 5.0), 20: ("browser", 3.0), 30: ("browser", 9.0)}
    after = {10: ("app", 5.5), 20: ("browser", 3.25), 40: ("browser", 0.5)}  # 30 ended, 40 started
    assert spent(before, after) == {"app": 0.5, "browser": 0.75}


def test_bench_page_reads_the_speedup_the_page_shows_and_who_spent_the_cpu(capsys):
    """`bench-page` serves the app as `python app.py` does, presses Run in Chromium and reads the page's status
    line: the speedup and both tokens/s, with the CPU-seconds of the server and of the browser (Linux)."""
    from specviz.tools import cli, pagebench

    assert cli.main(["bench-page", "--runs", "2", "--max-new-tokens", "6", "--update-s", "0.5"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if re.match(r"\| [12] \|", line)]
    assert len(rows) == 2, out
    for row in rows:
        speedup, tps, round_ms, step_ms, wall, *cpu = [c.strip() for c in row.strip("|").split("|")][1:]
        # the page's split: a round's draft, verify and the rest; a plain step's verify and the rest
        assert len(round_ms.split(" / ")) == 3 and len(step_ms.split(" / ")) == 2
        assert all(float(ms) >= 0 for ms in round_ms.split(" / ") + step_ms.split(" / "))
        assert float(round_ms.split(" / ")[1]) > 0 and float(step_ms.split(" / ")[0]) > 0
        spec, base = (float(x) for x in tps.split(" / "))  # shown to 0.1, the speedup (from the unrounded) to 0.01
        low, high = (spec - 0.05) / (base + 0.05) - 0.005, (spec + 0.05) / (base - 0.05) + 0.005
        assert low <= float(speedup.rstrip("x")) <= high
        assert float(wall) > 0
        assert len(cpu) == (2 if pagebench.cpu_seconds(os.getpid()) is not None else 0)
        assert all(float(c) > 0 for c in cpu)
