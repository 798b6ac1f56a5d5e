"""llama.cpp as a peer in `bench`: the same GGUF file decoded by llama-cpp-python, greedy, in a process of its own.

It is not a dependency of specviz: where the package is missing, `missing()` says how to install it. The worker
(`python -m specviz.tools.peer FILE THREADS`) loads the file once per kind of decoding (plain, and prompt lookup at
a number of tokens), then answers one JSON line per request on stdin: the prompt's token ids in, the new ids and
the seconds the call took out, prefill included, as specviz's tokens/s count it. Its own process keeps its threads
and memory apart from specviz's, and between requests it waits on a read, taking no CPU time from the other.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time

INSTALL = 'CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python==0.3.36'  # builds from source (minutes)
CONTEXT = 4096  # llama.cpp's context: the longest bench prompt and its new tokens fit


def missing() -> str:
    """"" where llama-cpp-python is installed, else how to install it."""
    return "" if importlib.util.find_spec("llama_cpp") else f"llama-cpp-python is not installed: {INSTALL}"


class LlamaPeer:
    """A llama.cpp worker process on one GGUF file; decode() asks it for one greedy run."""

    def __init__(self, gguf: str, threads: int):
        self.process = subprocess.Popen([sys.executable, "-m", "specviz.tools.peer", gguf, str(threads)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def decode(self, ids: list[int], max_new_tokens: int, eos: set[int], lookup: int = 0) -> tuple[float, list[int]]:
        """(tokens/s, new ids) of greedy decoding to max_new_tokens or an EOS (kept, as specviz keeps it); lookup:
        llama.cpp's prompt lookup decoding drafting that many tokens a round (0: plain)."""
        ask = {"ids": ids, "max_new_tokens": max_new_tokens, "eos": sorted(eos), "lookup": lookup}
        self.process.stdin.write(json.dumps(ask) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the llama.cpp worker stopped (exit code {self.process.wait()})")
        answer = json.loads(line)
        return len(answer["ids"]) / answer["seconds"], answer["ids"]

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait(timeout=30)

    def __enter__(self) -> LlamaPeer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def serve(gguf: str, threads: int) -> None:
    """The worker: one answer line per request line, until stdin closes."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    engines: dict[int, Llama] = {}
    for line in sys.stdin:
        ask = json.loads(line)
        lookup = int(ask["lookup"])
        if lookup not in engines:
            engines[lookup] = Llama(model_path=gguf, n_threads=threads, n_threads_batch=threads, n_ctx=CONTEXT,
                                    verbose=False, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=lookup)
                                    if lookup else None)
        llm, eos, out = engines[lookup], set(ask["eos"]), []
        llm.reset()  # no cached prefix: each run prefills its prompt, as specviz's do
        start = time.perf_counter()
        for token in llm.generate(ask["ids"], temp=0.0, top_k=1, repeat_penalty=1.0):
            out.append(token)
            if token in eos or len(out) == ask["max_new_tokens"]:
                break
        seconds = time.perf_counter() - start
        print(json.dumps({"ids": out, "seconds": seconds}), flush=True)


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
