"""specviz: watch speculative decoding, round by round."""

from .events import DraftedToken, ExtraToken, RoundEvent, Run, RunMeta, load_runs, save_runs
from .generator import Settings, baseline_events, generate, speculative_events
from .models import PRESETS, ModelPair, load_pair
from .sampling import SamplingParams, accept_or_resample, logits_to_probs

__all__ = [
    "PRESETS", "DraftedToken", "ExtraToken", "ModelPair", "RoundEvent", "Run", "RunMeta", "SamplingParams",
    "Settings", "accept_or_resample", "baseline_events", "generate", "load_pair", "load_runs",
    "logits_to_probs", "save_runs", "speculative_events",
]
