"""A class pressing Run at once: N viewers (another process, gradio_client) each ask for a 16-token run with its
baseline while the app serves in this one. Says how many were served or refused, and, for each waiting viewer, the
wait the page told them (specviz/ui/waiting.py) against when their run ended.

    PYTHONPATH=. python benchmarks/viewers.py 120
"""

import json
import resource
import socket
import statistics
import subprocess
import sys
import threading
import time
import traceback

from gradio_client import Client

TOKENS = 16
ARGS = ("offline", "", "", 2, 0.0, 0, 1.0, 0, TOKENS, True, False, "lookup+eagle", "fixed")


def viewers(url: str, n: int, out: str) -> None:
    """The viewers' side: connect all, print their sessions, press Run together on a line from stdin."""
    clients = [Client(url, verbose=False) for _ in range(n)]  # the page opened beforehand
    print(json.dumps([c.session_hash for c in clients]), flush=True)
    sys.stdin.readline()
    done, errors = {}, {}

    def press(i: int) -> None:
        try:
            clients[i].predict(f"Viewer {i}: the future of AI", *ARGS, api_name="/run")
            done[i] = time.time()
        except Exception as e:  # noqa: BLE001 - a refusal or a timeout is what is counted
            errors[i] = f"{e!r:.150} at {traceback.extract_tb(e.__traceback__)[-1].name}"

    threads = [threading.Thread(target=press, args=(i,)) for i in range(n)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    json.dump({"done": done, "errors": errors}, open(out, "w"))


def serve(n: int) -> None:
    import app
    from specviz.ui import handlers, waiting

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app.warm_up()
    app.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    url, out = f"http://127.0.0.1:{port}/", "/tmp/specviz-viewers.json"
    Client(url, verbose=False).predict("The future of AI", *ARGS, api_name="/run")  # one finished run: the pace
    side = subprocess.Popen([sys.executable, __file__, "--viewers", url, str(n), out], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    sessions = json.loads(side.stdout.readline())
    side.stdin.write("go\n")
    side.stdin.flush()
    queue, t0 = app.demo._queue, time.time()
    told, last, still = {}, -1, 0
    while still < 2 and time.time() - t0 < 60:  # until no press is still joining
        time.sleep(0.5)
        for i, session in enumerate(sessions):
            if i not in told and (w := waiting.wait_of(queue, handlers.DEVICE_QUEUE, session, app.WAIT_BUDGETS)):
                told[i] = (w.place, w.seconds, time.time())  # the first a page would be told
        still, last = (still + 1 if len(told) == last else 0), len(told)
    side.wait()
    result = json.load(open(out))
    done = {int(k): v for k, v in result["done"].items()}
    print(f"{n} viewers: served {len(done)}, refused or failed {len(result['errors'])}, all done "
          f"{max(done.values()) - t0:.1f} s after the presses; {len(told)} told a wait (place up to "
          f"{max(w[0] for w in told.values())}); errors: {list(result['errors'].values())[:2]}")
    rows = sorted((place, sec + waiting.PACE.seconds(2 * TOKENS), done[i] - at)
                  for i, (place, sec, at) in told.items() if i in done and sec is not None)
    for place, said, took in rows[:: max(1, len(rows) // 8)] + rows[-1:]:
        print(f"place {place:3d}: told about {said:6.1f} s to its end, took {took:6.1f} s ({took / said:.2f}x)")
    print(f"median took/told {statistics.median(t / s for _, s, t in rows):.2f}; pace at the end "
          f"{waiting.PACE.ms:.1f} ms a token + {waiting.PACE.overhead_s:.2f} s a run; "
          f"max RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")
    app.demo.close()


if __name__ == "__main__":
    if sys.argv[1] == "--viewers":
        viewers(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else:
        serve(int(sys.argv[1]))
