"""The web app through gradio_client, launched in-process on loopback with the offline pair."""

import re
import socket

import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError

from specviz.events import load_runs

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
         max_new_tokens=12, compare=True):
    return client.predict(prompt, preset, "", "", gamma, temperature, top_k, top_p, seed, max_new_tokens, compare,
                          False, api_name="/run")


def stat(stats_html: str, name: str) -> str:
    return re.search(rf"<td>{re.escape(name)}</td><td><b>([^<]*)</b>", stats_html).group(1)


def test_run_events_agree_with_the_stats_shown(app_url):
    client = Client(app_url, verbose=False)
    status, spec_html, base_html, diff, stats, *_figs, _pick, download, race = call(client)
    assert "done: 12 tokens" in status
    spec, base = load_runs(download)
    accepted, rejected, drafted = (int(x) for x in stat(stats, "accepted / rejected / drafted").split(" / "))
    assert (accepted, rejected, drafted) == (spec.n_accepted, spec.n_rejected, spec.n_drafted)
    assert int(stat(stats, "rounds (target passes)")) == len(spec.events)
    assert int(stat(stats, "baseline target passes")) == base.n_tokens == 12
    assert spec_html.count("sv-accepted") == accepted and spec_html.count("sv-rejected") == rejected
    assert "sv-race-row" in race and "Sampled mode" in diff


def test_bad_input_is_readable_and_the_next_request_works(app_url):
    client = Client(app_url, verbose=False)
    for kwargs, message in [
        (dict(prompt=""), "prompt is empty"),
        (dict(top_k=-3), "top_k"),
        (dict(temperature=-1), "less than minimum value 0"),  # a slider's own range check
        (dict(gamma=0), "less than minimum value 1"),
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
    download = call(client, max_new_tokens=5)[-2]
    from gradio_client import handle_file

    status, spec_html, base_html, *_ = client.predict(handle_file(download), False, api_name="/replay")
    assert "replaying" in status and "sv-tok" in spec_html and "sv-target" in base_html
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert "not a specviz trace" in client.predict(handle_file(str(bad)), False, api_name="/replay")[0]
