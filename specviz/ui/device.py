"""One thread for the app's model work.

Gradio runs a handler, and each step of a generator handler, on whichever of its worker threads is
free, so one run's rounds hop between threads. On a GPU that costs: torch keeps its CUDA-graph trees
per thread (torch/_inductor/cudagraph_trees.py holds the tree managers in a threading.local), so a
compiled forward whose graphs one thread recorded would be warmed up and recorded again, in a memory
pool of its own, by each thread that calls it next. Here every model call of the page runs on one
long-lived thread instead; the page's "device" concurrency already lets one long handler run at a
time, and this thread takes their steps in order.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

NAME = "specviz-device"
_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=NAME)


def run(fn: Callable, *args, **kwargs):
    """fn(*args, **kwargs) on the device thread, waiting for it (called from that thread: at once)."""
    if threading.current_thread().name.startswith(NAME):
        return fn(*args, **kwargs)
    return _thread.submit(fn, *args, **kwargs).result()


def on_device(fn: Callable) -> Callable:
    """fn with its work on the device thread. A generator function stays one for Gradio: each step
    (each `next`) runs there, and closing it (Stop) closes fn's generator there, after the step under way,
    without waiting (a generator closed as garbage must not hold up the thread that collects it)."""
    if not inspect.isgeneratorfunction(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            return run(fn, *args, **kwargs)

        return call

    @functools.wraps(fn)
    def steps(*args, **kwargs):
        inner = fn(*args, **kwargs)  # a generator: nothing of fn runs before its first step
        try:
            while True:
                try:
                    update = run(next, inner)
                except StopIteration:
                    return
                yield update
        finally:
            _thread.submit(inner.close)

    return steps
