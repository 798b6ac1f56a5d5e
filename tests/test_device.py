"""The app's model work runs on one thread (specviz/ui/device.py), whichever Gradio worker asks."""

import inspect
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from specviz.ui import device, handlers


def test_each_step_of_a_handler_runs_on_the_one_device_thread_and_stop_closes_it_there():
    steps, closed = [], []

    @device.on_device
    def numbers(n):
        try:
            for i in range(n):
                steps.append(threading.get_ident())
                yield i
        finally:
            closed.append(threading.get_ident())

    run = numbers(3)
    with ThreadPoolExecutor(2) as workers:  # Gradio's workers: each step may come from another thread
        assert [workers.submit(next, run).result() for _ in range(2)] == [0, 1]
    run.close()  # Stop: the handler's own generator is closed on the device thread, after any step under way
    home = device.run(threading.get_ident)  # queued after that close
    assert steps == [home, home] and closed == [home] and home != threading.get_ident()
    assert list(numbers(2)) == [0, 1] and steps[2:] == [home, home] and closed[1:] == [home]

    @device.on_device
    def plain(x):
        if x < 0:
            raise ValueError("negative")
        return threading.get_ident(), x

    assert plain(2) == (home, 2)  # a plain handler: its value, computed there
    with pytest.raises(ValueError, match="negative"):  # and its error, raised here
        plain(-1)
    assert device.run(plain, 3) == (home, 3)  # called from the device thread itself: at once, no wait on itself


def test_the_pages_handlers_take_the_device_thread_without_zerogpu():
    assert handlers.on_gpu is device.on_device  # `spaces` is not installed here
    assert handlers.sample_n.__wrapped__.__name__ == "sample_n"  # wrapped, and Gradio still sees a generator
    assert inspect.isgeneratorfunction(handlers.sample_n) and not inspect.isgeneratorfunction(handlers.exact)
