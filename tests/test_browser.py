"""A real browser (Debian's chromium, driven by Playwright) runs the app on the offline pair."""

import os
import re
import shutil
import socket
from pathlib import Path

import pytest

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
        temperature = page.get_by_role("spinbutton", name="number input for temperature")
        temperature.fill("1")
        temperature.press("Enter")
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
        assert page.locator(".js-plotly-plot").count() >= 4
        assert page.locator("#chart-rounds .js-plotly-plot .bars").count() > 0
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOT), full_page=True)
        print(f"Run pressed -> first rendered round: {press_run(page):.2f} s (second run)")
        page.locator("#status :text('done')").wait_for(timeout=300_000)

        # the batch panel: one stream per prompt, each with its own acceptance
        page.get_by_text("Batch: several prompts decoded together").click()
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


def press_run(page) -> float:
    """Seconds from the click on Run to the first round's tokens in the page (timed in the page)."""
    page.evaluate(FIRST_ROUND_TIMER)
    page.locator("#run-btn").click()
    page.wait_for_function("window.svFirst !== null", timeout=120_000)
    return page.evaluate("window.svFirst") / 1000
