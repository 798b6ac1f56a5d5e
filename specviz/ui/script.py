"""The page's own script and its sliders' refusals: what Gradio's components do not say by themselves."""

from __future__ import annotations

import logging

import gradio as gr

from ..core.events import MAX_TRACE_MB

log = logging.getLogger("specviz")

# The key n presses Next ▸, except while typing in a field. A number typed outside a slider's range is set to the
# nearest end by Gradio when the box is left; the page says so where everyone sees it (#sv-corrected), before a Run,
# as it says why a trace over the upload limit is refused.
PAGE_JS = r"""() => {
  document.addEventListener("keydown", (e) => {
    const t = e.target;
    if (e.key !== "n" || e.ctrlKey || e.metaKey || e.altKey) return;
    if (t && (t.tagName === "INPUT" || t.tagName === "TEXTAREA" || t.isContentEditable)) return;
    const next = document.getElementById("next-btn");
    if (next) { e.preventDefault(); next.click(); }
  });
  const say = (text, stays) => {  // stays: until clicked (Gradio's own toast leaves a bare "Error" behind)
    let note = document.getElementById("sv-corrected");
    if (!note) {
      note = document.createElement("div");
      note.id = "sv-corrected"; note.setAttribute("role", "alert"); note.title = "click to close";
      note.addEventListener("click", () => { note.hidden = true; });
      document.body.appendChild(note);
    }
    note.textContent = text;
    note.hidden = false;
    clearTimeout(window.svCorrected);
    if (!stays) window.svCorrected = setTimeout(() => { note.hidden = true; }, 12000);
  };
  const tell = (t) => {
    if (t && t.type === "file") {  // Gradio refuses a file over its limit with a bare "Error": say why first
      const big = Array.from(t.files || []).find((f) => f.size > LIMIT_MB * 1048576);
      const mb = big && (big.size / 1048576).toFixed(1);
      if (big) say(`${big.name} is ${mb} MB; a trace may be at most ${LIMIT_MB} MB.`, true);
      return;
    }
    if (!t || t.type !== "number" || t.min === "" || t.max === "") return;
    const v = parseFloat(t.value), lo = parseFloat(t.min), hi = parseFloat(t.max);
    if (isNaN(v) || (v >= lo && v <= hi)) return;
    const name = (t.getAttribute("aria-label") || "this box").replace("number input for ", "");
    const end = v < lo ? lo : hi;
    say(`${name}: ${v} is ${v < lo ? "below the least" : "above the most"} it takes, ${end}; set to ${end}.`);
  };
  document.addEventListener("change", (e) => tell(e.target), true);
  document.addEventListener("keydown", (e) => { if (e.key === "Enter") tell(e.target); }, true);
  // Gradio's "queue: 2/3 | 4.1/1.2s" said in words beside it, Gradio's own text hidden (its estimate is the average
  // call's time, not the runs ahead: the server's line #sv-wait says that). Gradio's text is left in place, as
  // Gradio keeps writing the time waited into it: a page that rewrote it froze that time at its first value
  new MutationObserver(() => {
    for (const t of document.querySelectorAll("#status .progress-text")) {
      const m = t.textContent.match(/^queue: (\d+)\/(\d+) \| ([\d.]+)/);
      const next = t.nextElementSibling;
      let said = next && next.classList.contains("sv-queue") ? next : null;
      t.classList.toggle("sv-hidden", !!m);
      if (!m) {
        if (said) said.remove();
        continue;
      }
      if (!said) {
        said = document.createElement("span");
        said.className = "sv-queue";
        t.after(said);
      }
      const text = `Waiting for the run${m[1] === "1" ? "" : "s"} ahead: place ${m[1]} of ${m[2]} in the queue, ` +
        `${Math.floor(+m[3])} s so far.`;
      if (said.textContent !== text) said.textContent = text;
    }
  }).observe(document.body, {subtree: true, childList: true, characterData: true});
  document.body.dataset.svReady = "1";  // Gradio runs this once the page is mounted: a test waits for it
}""".replace("LIMIT_MB", str(MAX_TRACE_MB))
# Projector mode: large type through a class on the page, kept in the URL (?projector=1).
PROJECTOR_JS = """(on) => {
  document.body.classList.toggle("sv-projector", on);
  const url = new URL(window.location.href);
  if (on) url.searchParams.set("projector", "1"); else url.searchParams.delete("projector");
  window.history.replaceState(null, "", url);
}"""


def bounded(slider: gr.Slider) -> gr.Slider:
    """The slider, refusing a value outside its range in one sentence naming the control (the API's caller reads
    it; the console gets one line, not Gradio's traceback). Its own preprocess, not a subclass: Gradio writes a
    stub file beside any module that subclasses a component."""
    plain = slider.preprocess

    def preprocess(payload):
        if isinstance(payload, int | float) and not slider.minimum <= payload <= slider.maximum:
            log.info("refused %s = %r", slider.label, payload)
            raise gr.Error(f"{slider.label}: {payload} is outside [{slider.minimum:g}, {slider.maximum:g}]",
                           print_exception=False)
        return plain(payload)

    slider.preprocess = preprocess
    return slider
