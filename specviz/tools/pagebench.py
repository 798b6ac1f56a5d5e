"""What the page shows on this machine: the app served, Chromium on the same machine pressing Run, and the
speedup the page then reads, with the CPU time the server and the browser spent on each run.

The CLI and `bench` time decoding alone. A person watching the app has a browser drawing the page on the
same CPU, which a decode on every core waits for (page.share_the_cores); this measures what they see. The
app runs as `python app.py` does (its warm-up included), with SPECVIZ_THREADS, SPECVIZ_UPDATE_S and
SPECVIZ_CHARTS_S passed on when given, so the page's settings can be compared run against run. Needs the
repository's app.py, Playwright and a Chromium (`chromium` on the PATH). CPU times are read from Linux's /proc
(elsewhere: none).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

APP = Path(__file__).resolve().parents[2] / "app.py"
SPEEDUP = re.compile(r"Speedup ([\d.]+)× \(([\d.]+) against ([\d.]+) tokens/s\)")
READ = ("speedup", "spec_tps", "base_tps")  # what SPEEDUP reads from the page's status line
Progress = Callable[[str], None]


def cpu_seconds(app_pid: int) -> dict[int, tuple[str, float]] | None:
    """pid -> ("app" or "browser", CPU-seconds so far) for the app's process and the Chromium processes this
    process started (not another program's browser); None without /proc."""
    if not Path("/proc/self/stat").exists():
        return None
    tick, parent, seen = os.sysconf("SC_CLK_TCK"), {}, {}
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        parent[pid] = int(fields[1])
        seen[pid] = ("chrom" in cmd, (int(fields[11]) + int(fields[12])) / tick)  # utime + stime

    def ours(pid: int) -> bool:
        while pid > 1 and pid != os.getpid():
            pid = parent.get(pid, 0)
        return pid == os.getpid()

    return {pid: ("app" if pid == app_pid else "browser", secs) for pid, (chrome, secs) in seen.items()
            if pid == app_pid or (chrome and ours(pid))}


def spent(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU-seconds between two readings, by "app" and "browser": a process that ended meanwhile is left out (its
    last seconds are lost, never counted below zero), one that started counts whole."""
    out = {"app": 0.0, "browser": 0.0}
    for pid, (who, secs) in after.items():
        out[who] += secs - before.get(pid, (who, 0.0))[1]
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(env: dict[str, str], progress: Progress) -> tuple[subprocess.Popen, str]:
    """The app started as `python app.py` with `env` added; its output goes to a temporary file, whose last
    lines say why where it stops (or hangs) before serving."""
    port = _free_port()
    log = tempfile.TemporaryFile()
    app = subprocess.Popen([sys.executable, str(APP)], cwd=APP.parent, stdout=log, stderr=subprocess.STDOUT,
                           env={**os.environ, **env, "GRADIO_SERVER_NAME": "127.0.0.1",
                                "GRADIO_SERVER_PORT": str(port)})
    url, deadline = f"http://127.0.0.1:{port}/", time.monotonic() + 600
    progress("starting the app (loading, and on a first start measuring this machine's kernels)...")
    while time.monotonic() < deadline and app.poll() is None:
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return app, url
        except OSError:
            time.sleep(0.5)
    app.kill()
    app.wait()
    log.seek(0)
    said = log.read().decode(errors="replace").strip().splitlines()[-3:]
    log.close()
    raise RuntimeError("the app did not start serving; its last words: " + (" | ".join(said) or "none"))


# Watches the status line from before a click: the run under way once a line says neither "done" nor "Error",
# ended at the first line after that which says either (window.svEnded: that line)
WATCH_STATUS = """() => {
  const status = document.querySelector('#status');
  const ended = (text) => /done|Error/.test(text);
  window.svRunning = false; window.svEnded = null;
  if (window.svWatch) window.svWatch.disconnect();
  window.svWatch = new MutationObserver(() => {
    const text = status.innerText;
    if (!ended(text)) window.svRunning = true;
    else if (window.svRunning && window.svEnded === null) window.svEnded = text;
  });
  window.svWatch.observe(status, {subtree: true, childList: true, characterData: true});
}"""


# The page's time split (rendering.time_split_html): per bar ("speculative", "baseline"), ms a round per stage
READ_SPLIT = """() => Object.fromEntries([...document.querySelectorAll('#sv-time-split .sv-split-row')].map(row => [
  row.dataset.run,
  Object.fromEntries([...row.querySelectorAll('[data-stage]')].map(s => [s.dataset.stage, +s.dataset.ms]))]))"""


def split_text(split: dict[str, float] | None, drafted: bool) -> str:
    """A bar of the page's split as 'draft / verify / the rest' ms ('verify / the rest' for a plain step)."""
    if not split:
        return "–"
    rest = sum(ms for stage, ms in split.items() if stage not in ("draft", "verify"))
    return " / ".join(f"{ms:.1f}" for ms in ([split["draft"]] if drafted else []) + [split["verify"], rest])


def run_to_its_end(page, timeout: float = 600_000) -> str:
    """Press Run and return that run's last status line, watched from before the click (WATCH_STATUS)."""
    page.evaluate(WATCH_STATUS)
    page.locator("#run-btn").click()
    page.wait_for_function("() => window.svEnded", timeout=timeout)
    return page.evaluate("window.svEnded").strip()


def page_runs(prompt: str | None, runs: int, max_new_tokens: int | None = None, threads: int | None = None,
              update_s: float | None = None, charts_s: float | None = None, progress: Progress = print) -> list[dict]:
    """Per run: the page's status line, the speedup and tokens/s it reads, its time split (a round's and a plain
    step's ms per stage), the wall time from the click to "done", and the app's and the browser's CPU-seconds over
    it."""
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium")
    if not APP.is_file() or not chromium:
        raise RuntimeError("bench-page needs the repository's app.py and a `chromium` on the PATH")
    env = {k: str(v) for k, v in (("SPECVIZ_THREADS", threads), ("SPECVIZ_UPDATE_S", update_s),
                                  ("SPECVIZ_CHARTS_S", charts_s)) if v is not None}
    app, url = _serve(env, progress)
    rows = []
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": 1366, "height": 900})
            page.goto(url, wait_until="domcontentloaded")
            page.locator("#run-btn").wait_for(timeout=120_000)
            if prompt is not None:
                page.get_by_label("Prompt").fill(prompt)
            if max_new_tokens is not None:
                box = page.get_by_role("spinbutton", name="number input for max new tokens")
                box.fill(str(max_new_tokens))
                box.press("Enter")
            time.sleep(2)  # the page's first drawing done
            for i in range(runs):
                before, start = cpu_seconds(app.pid), time.perf_counter()
                status = run_to_its_end(page)
                wall, after = time.perf_counter() - start, cpu_seconds(app.pid)
                if "done" not in status:
                    raise RuntimeError(f"run {i + 1} ended with: {status}")
                read = [float(x) for x in found.groups()] if (found := SPEEDUP.search(status)) else [None] * 3
                cpu = spent(before, after) if after is not None else {}
                split = page.evaluate(READ_SPLIT)
                rows.append({"run": i + 1, "status": status, "wall_s": wall, **dict(zip(READ, read, strict=True)),
                             **{f"{k}_cpu_s": v for k, v in cpu.items()},
                             "spec_split": split.get("speculative"), "base_split": split.get("baseline")})
                progress(f"run {i + 1}: {status}")
                time.sleep(1)
            browser.close()
    finally:
        app.terminate()
        app.wait(timeout=30)
    return rows


def table(rows: list[dict]) -> str:
    cpu = "app_cpu_s" in rows[0]
    lines = ["| run | speedup the page reads | speculative / baseline tokens/s "
             "| a round, ms: draft / verify / the rest | a plain step, ms: verify / the rest | click to done, s"
             + (" | app CPU-s | browser CPU-s |" if cpu else " |"),
             "|---|---|---|---|---|---|" + ("---|---|" if cpu else "")]
    for r in rows:
        tps = f"{r['spec_tps']:.1f} / {r['base_tps']:.1f}" if r["speedup"] is not None else "–"
        speedup = f"{r['speedup']:.2f}x" if r["speedup"] is not None else "–"
        lines.append(f"| {r['run']} | {speedup} | {tps} | {split_text(r.get('spec_split'), True)} | "
                     f"{split_text(r.get('base_split'), False)} | {r['wall_s']:.1f}"
                     + (f" | {r['app_cpu_s']:.1f} | {r['browser_cpu_s']:.1f} |" if cpu else " |"))
    return "\n".join(lines) + "\n"
