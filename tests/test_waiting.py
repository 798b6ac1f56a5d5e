"""A waiting page's estimate (specviz/ui/waiting.py), from the calls ahead of it in a queue shaped as Gradio's."""

from types import SimpleNamespace as NS

from specviz.ui import waiting

BUDGETS = waiting.Budgets({"run": (0, 1)})  # a Run's inputs: [max_new_tokens, compare, ...]


class Fn(NS):  # Gradio's BlockFunction: keys its dicts
    __hash__ = object.__hash__


RUN, SAMPLE = Fn(name="run"), Fn(name="sample_n")


def event(session, fn=RUN, data=None):
    return NS(session_hash=session, fn=fn, concurrency_id="device", data=NS(data=data))


def queue(running, waiting_events, started=100.0, timed=None):
    line = NS(queue=waiting_events, start_times_per_fn={running[0].fn: {started}} if running else {})
    return NS(event_queue_per_concurrency_id={"device": line}, active_jobs=[running or None, None],
              process_time_per_fn=timed or {})


def pace(ms, overhead_s=0.0):
    p = waiting.Pace()
    p.ms, p.overhead_s = ms, overhead_s
    return p


def test_the_wait_counts_the_runs_ahead_by_their_budgets_and_what_the_one_under_way_has_left():
    q = queue([event("a", data=[100, False])], [event("b", data=[50, True]), event("me", data=[8, False])])
    wait = waiting.wait_of(q, "device", "me", BUDGETS, pace(20.0), now=lambda: 101.0)
    # under way: 100 tokens at 20 ms, 1 s of 2 gone; ahead: 50 tokens and their baseline, 2 s
    assert (wait.place, wait.of, wait.tokens_ahead) == (2, 2, 200)
    assert abs(wait.seconds - 3.0) < 1e-9
    assert wait.text() == "About 3 s more to wait (the runs ahead ask for up to 200 tokens, at 20 ms a token here)."
    longer = queue([event("a", data=[100, False])], [event("b", data=[500, True]), event("me", data=[8, False])])
    assert waiting.wait_of(longer, "device", "me", BUDGETS, pace(20.0), now=lambda: 101.0).seconds > 20


def test_calls_of_other_kinds_count_gradios_average_and_an_unpriced_run_is_said_so():
    timed = {SAMPLE: NS(avg_time=4.0, count=3)}
    q = queue([event("a", SAMPLE)], [event("b", SAMPLE), event("me", data=[8, False])], started=100.0, timed=timed)
    wait = waiting.wait_of(q, "device", "me", BUDGETS, pace(None), now=lambda: 103.0)
    assert (wait.place, wait.tokens_ahead) == (2, 0) and abs(wait.seconds - 5.0) < 1e-9  # 1 s left, then 4
    assert "kinds ahead" in wait.text()
    unpriced = queue([event("a", data=[64, False])], [event("me", data=[8, False])])
    wait = waiting.wait_of(unpriced, "device", "me", BUDGETS, pace(None), now=lambda: 100.0)
    assert wait.seconds is None and wait.text().startswith("No run has finished on this server yet")


def test_no_line_for_a_page_with_nothing_waiting():
    q = queue([event("me", data=[64, False])], [event("b", data=[64, False])])
    assert waiting.wait_of(q, "device", "me", BUDGETS, pace(20.0)) is None  # its run is under way, not waiting
    assert waiting.wait_of(q, "other-group", "b", BUDGETS, pace(20.0)) is None
    assert BUDGETS.tokens("run", ["many", False]) is None and BUDGETS.tokens("next", [64, True]) is None


def test_the_pace_is_a_moving_mean_of_finished_runs_and_ignores_runs_too_short_to_time():
    p = waiting.Pace()
    p.learn(4, 1.0, 1.5)
    assert p.ms is None
    p.learn(100, 2.0, 2.5)  # 20 ms a token, 0.5 s besides
    assert (p.ms, p.overhead_s) == (20.0, 0.5)
    p.learn(100, 4.0, 4.0)
    assert abs(p.ms - (0.7 * 20 + 0.3 * 40)) < 1e-9 and abs(p.overhead_s - 0.35) < 1e-9
    assert abs(p.seconds(10) - (0.35 + 10 * p.ms / 1000)) < 1e-9


def test_each_run_ahead_pays_its_overhead_once():
    q = queue([], [event("b", data=[50, True]), event("c", data=[10, False]), event("me", data=[8, False])])
    wait = waiting.wait_of(q, "device", "me", BUDGETS, pace(20.0, overhead_s=0.5), now=lambda: 100.0)
    assert abs(wait.seconds - (0.5 + 2.0 + 0.5 + 0.2)) < 1e-9
