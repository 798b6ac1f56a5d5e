"""specviz: watch speculative decoding, round by round."""

from .core.events import DraftedToken, ExtraToken, RoundEvent, Run, RunMeta, load_runs, save_runs
from .core.generator import Settings, baseline_events, generate, generate_batch, speculative_events
from .core.rules import accept_or_resample
from .core.sampling import SamplingParams, logits_to_probs
from .models.loading import PRESETS, ModelPair, load_pair
from .tools.stream import BatchRound, Finished, RoundDone, stream, stream_batch
from .view import notebook as _notebook  # noqa: F401 - registers how a notebook draws a Run

__all__ = [
    "PRESETS", "BatchRound", "DraftedToken", "ExtraToken", "Finished", "ModelPair", "RoundDone", "RoundEvent", "Run",
    "RunMeta", "SamplingParams", "Settings", "accept_or_resample", "baseline_events", "generate", "generate_batch",
    "load_pair", "load_runs", "logits_to_probs", "save_runs", "speculative_events", "stream", "stream_batch",
]
