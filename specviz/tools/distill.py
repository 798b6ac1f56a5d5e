"""Distil a small draft model from a causal-LM target, for speculative decoding.

Knowledge distillation (Hinton et al. 2015) aimed at acceptance, as in DistillSpec (Zhou et al.
2024): the draft learns the target's own distribution on text the target itself writes, because
acceptance is min(1, p/q) on exactly that text.
  1. data: the target answers a diverse prompt set (sampled), and at every step its top-k
     next-token probabilities are kept;
  2. draft: a small Llama with the target's tokenizer, its tied embedding initialised from a
     PCA of the target's embedding, so it starts out speaking the same vocabulary geometry;
  3. training: cross-entropy against the recorded top-k distribution (KL up to a constant);
  4. report: greedy agreement with the target on held-out prompts, and the expected sampled
     acceptance sum_k min(p_k, q_k) over the top-k; saved as a normal Hugging Face directory.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ..core.drafters import Columns
from ..core.kvcache import KVState, on_device
from ..models import contention, kernels
from ..models.eagle import EagleHead, HeadConfig
from ..models.loading import choose_dtype, encode_prompt, eos_ids_of, load_model, resolve_device
from .prompts import training_prompts

Progress = Callable[[str], None]


@dataclass
class DistillConfig:
    """What to distil and how (HELP says what each field means; the command line's options are these)."""

    target: str
    out: str
    prompts: int = 512
    first_prompt: int = 0
    prompts_file: str | None = None
    chat_template: bool = True
    new_tokens: int = 96
    gen_batch: int = 32
    gen_temperature: float = 0.8
    top_k: int = 32
    layers: int = 4
    hidden: int = 192
    heads: int = 3
    kv_heads: int = 1
    intermediate: int = 512
    train_minutes: float = 10.0
    max_steps: int = 0
    batch: int = 16
    lr: float = 3e-3
    holdout: float = 0.1
    seed: int = 0
    device: str = "auto"
    temperatures: tuple[float, ...] = (0.0, 1.0)
    draft_vocab: int = 8192
    ttt_steps: int = 3
    head_intermediate: int = 1536
    data_file: str | None = None
    init: str | None = None

    def validate(self, kind: str = "eagle") -> None:
        """A ValueError naming the first setting no run of `kind` ("draft" or "eagle") can use; called before any
        model work, so a bad setting does not surface minutes into making the data."""
        whole = {"prompts": 2, "first_prompt": 0, "new_tokens": 1, "gen_batch": 1, "top_k": 1, "max_steps": 0,
                 "batch": 1, "seed": 0}
        whole |= ({"draft_vocab": 1, "ttt_steps": 1, "head_intermediate": 1} if kind == "eagle" else
                  {"layers": 1, "hidden": 1, "heads": 1, "kv_heads": 1, "intermediate": 1})
        for name, low in whole.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r} ({name}: {HELP[name]})")
        reals = {"train_minutes": self.train_minutes, "lr": self.lr, "holdout": self.holdout}
        reals |= {"gen_temperature": self.gen_temperature} if kind == "draft" else {
            f"temperatures[{i}]": t for i, t in enumerate(self.temperatures)}
        for name, value in reals.items():
            if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if kind == "eagle" and not self.temperatures:
            raise ValueError("temperatures: give at least one (0: greedy)")
        if kind == "draft" and self.gen_temperature == 0:
            raise ValueError("gen_temperature must be > 0: the draft learns from sampled answers")
        if self.holdout >= 1:
            raise ValueError(f"holdout must be below 1, got {self.holdout}: nothing would be left to train on")
        if self.train_minutes == 0 and self.max_steps == 0:
            raise ValueError("training needs train_minutes > 0 or max_steps > 0")
        if kind == "draft" and (self.hidden % self.heads or self.heads % self.kv_heads):
            raise ValueError(f"the draft's width ({self.hidden}) must split into its heads ({self.heads}), and the "
                             f"heads into key-value heads ({self.kv_heads})")


HELP = {
    "prompts": "training prompts (a share is held out for the report)",
    "first_prompt": "skip this many of the prompts first (those an earlier head or draft was trained on)",
    "prompts_file": "one training prompt per line, or a .json list of prompt strings (default: the built-in set)",
    "new_tokens": "tokens the target writes per prompt",
    "gen_batch": "prompts the target answers at once while making the data",
    "gen_temperature": "draft: the temperature the target's answers are sampled at",
    "top_k": "the target's likeliest tokens kept per position (their probabilities, renormalised, are the labels)",
    "layers": "draft: layers of the draft model",
    "hidden": "draft: the draft model's width",
    "heads": "draft: attention heads",
    "kv_heads": "draft: key-value heads",
    "intermediate": "draft: the MLP's width",
    "train_minutes": "training stops after this long",
    "max_steps": "training stops after this many steps (0: as many as the minutes allow)",
    "batch": "sequences per training step",
    "lr": "peak learning rate",
    "holdout": "share of the prompts held out for the report",
    "seed": "seed for prompt order, initial weights and sampling",
    "device": "auto, cpu, cuda or mps",
    "temperatures": "eagle: answer each prompt once at each of these temperatures (0: greedy)",
    "draft_vocab": "eagle: how many of the target's most frequent tokens the head can draft",
    "ttt_steps": "eagle: draft positions unrolled in training (training-time test)",
    "head_intermediate": "eagle: the head's MLP width",
    "data_file": "eagle: reuse the generated data from this file, and save it there as it is made (a stopped run "
                 "keeps what it answered)",
    "init": "eagle: go on training this head on the new data (its shape and draft vocabulary kept), e.g. with "
            "--first-prompt past the prompts it was trained on",
}


@dataclass
class Sample:
    ids: list[int]  # prompt + continuation
    start: int  # index of the first continuation token
    top_ids: torch.Tensor  # [T, k] int32: target's top-k at each continuation step
    top_probs: torch.Tensor  # [T, k] float16, renormalised over the k


def load_prompts(cfg: DistillConfig) -> list[str]:
    if cfg.prompts_file:
        text = Path(cfg.prompts_file).read_text(encoding="utf-8")
        if cfg.prompts_file.endswith(".json"):  # a list of strings: prompts may hold line breaks (code)
            listed = json.loads(text)
            if not isinstance(listed, list) or not all(isinstance(p, str) for p in listed):
                raise ValueError(f"{cfg.prompts_file}: expected a JSON list of prompt strings")
            lines = [p.strip() for p in listed]
        else:
            lines = [line.strip() for line in text.splitlines()]
        return [line for line in lines if line][cfg.first_prompt : cfg.first_prompt + cfg.prompts]
    return training_prompts(cfg.first_prompt + cfg.prompts, cfg.seed)[cfg.first_prompt :]


@torch.inference_mode()
def generate_data(target, tokenizer, prompts: list[str], cfg: DistillConfig, progress: Progress) -> list[Sample]:
    """The target continues each prompt; its top-k probabilities are kept at every step."""
    device = next(target.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    eos = target.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    samples: list[Sample] = []
    start_time = time.perf_counter()
    for b in range(0, len(prompts), cfg.gen_batch):
        encoded = [encode_prompt(tokenizer, p, cfg.chat_template) for p in prompts[b : b + cfg.gen_batch]]
        width = max(map(len, encoded))
        ids = torch.tensor([[pad] * (width - len(e)) + e for e in encoded], device=device)  # left padding
        mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded], device=device)
        tops_ids, tops_probs, tokens = [], [], []
        cache = None
        done = torch.zeros(len(encoded), dtype=torch.bool, device=device)
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        step_ids = ids
        for _ in range(cfg.new_tokens):
            out = target(input_ids=step_ids, attention_mask=mask, position_ids=positions[:, -step_ids.shape[1]:],
                         past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache = out.past_key_values
            probs = out.logits[:, -1].float().softmax(-1)  # [B, V] the target's own distribution
            top = probs.topk(cfg.top_k, dim=-1)
            tops_ids.append(top.indices.int().cpu())
            tops_probs.append((top.values / top.values.sum(-1, keepdim=True)).half().cpu())
            warped = (out.logits[:, -1].float() / cfg.gen_temperature).softmax(-1)
            nxt = torch.multinomial(warped, 1, generator=gen).squeeze(-1)  # [B]
            nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
            tokens.append(nxt.cpu())
            done |= torch.isin(nxt, torch.tensor(sorted(eos_ids), device=device)) if eos_ids else done
            step_ids = nxt[:, None]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            positions = torch.cat([positions, positions[:, -1:] + 1], dim=1)
            if bool(done.all()):
                break
        tokens_t = torch.stack(tokens, 1)  # [B, T]
        ids_t, probs_t = torch.stack(tops_ids, 1), torch.stack(tops_probs, 1)  # [B, T, k]
        for row, prompt_ids in enumerate(encoded):
            gen_ids = tokens_t[row].tolist()
            n = next((i + 1 for i, t in enumerate(gen_ids) if t in eos_ids), len(gen_ids))
            samples.append(Sample(prompt_ids + gen_ids[:n], len(prompt_ids), ids_t[row, :n], probs_t[row, :n]))
        n_tok = sum(len(s.top_ids) for s in samples)
        rate = n_tok / (time.perf_counter() - start_time)
        progress(f"data: {len(samples)}/{len(prompts)} prompts, {n_tok} target tokens ({rate:.0f} tokens/s)")
    return samples


@dataclass
class FeatureSample:
    """One sequence for a feature-level (EAGLE) head: the target's hidden states at every position."""

    ids: list[int]  # prompt + continuation, L tokens
    start: int  # P: index of the first continuation token
    features: torch.Tensor  # [L - 1, H] bf16: the target's last hidden state at positions 0..L-2
    top_ids: torch.Tensor  # [L - P, k] int32: the target's top-k at positions P-1..L-2 (for x_P..x_{L-1})
    top_probs: torch.Tensor  # [L - P, k] float16, renormalised over the k


def _close_segment(steps: list[tuple[torch.Tensor, ...]], live: list[int], parts: list[list]) -> None:
    """Per-step tensors [live rows, ...] of a batch's segment -> row r's [T, ...] appended to parts[live[r]]."""
    if steps:
        stacked = [torch.stack(x, 1) for x in zip(*steps, strict=True)]
        for r, row in enumerate(live):
            parts[row].append(tuple(x[r] for x in stacked))
        steps.clear()


def _drawing(temps: list[float], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows that sample ([n] indices) and their temperatures ([n]), sent without a wait."""
    drawn = [i for i, t in enumerate(temps) if t > 0]
    return on_device(drawn, device, torch.long), on_device([temps[i] for i in drawn], device, torch.float32)


@torch.inference_mode()
def generate_feature_data(target, tokenizer, prompts: list[str], cfg: DistillConfig, vocab_size: int,
                          progress: Progress) -> list[FeatureSample]:
    """The target answers every prompt once per temperature in cfg.temperatures (0: greedy), in
    batches through specviz's own KV state, keeping at every position the hidden state a verify
    pass would hand a drafter (same forward, same numerics) and its top-k next-token probabilities.
    Answers that end leave the batch once a quarter of it has (their rows' work is no longer done).
    Samples come back grouped by prompt: all answers to prompt i before those to prompt i + 1."""
    device = next(target.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    eos_ids = eos_ids_of(target, tokenizer)
    eos = on_device(sorted(eos_ids), device)
    jobs = [(i, t) for i in range(len(prompts)) for t in cfg.temperatures]
    encoded = [encode_prompt(tokenizer, p, cfg.chat_template) for p in prompts]
    jobs.sort(key=lambda job: len(encoded[job[0]]))  # similar lengths together: less padding
    by_job: dict[tuple[int, float], FeatureSample] = {}
    start_time, n_tok = time.perf_counter(), 0
    for b in range(0, len(jobs), cfg.gen_batch):
        batch = jobs[b : b + cfg.gen_batch]
        rows = [encoded[i] for i, _ in batch]
        temps = [t for _, t in batch]  # per live row, on the host: which rows draw is known without a read
        gen = torch.Generator(device=device).manual_seed(cfg.seed + b)
        state = KVState(target, len(rows), "static", vocab_size, max(map(len, rows)) + cfg.new_tokens + 2)
        prefill = state.prefill(rows, pad, hidden=True).hidden  # [B, w, H], right-aligned
        last = on_device([r[-1] for r in rows], device)
        done = torch.zeros(len(rows), dtype=torch.bool, device=device)
        live = list(range(len(rows)))  # the batch rows still answering, in the state's row order
        parts: list[list[tuple[torch.Tensor, ...]]] = [[] for _ in rows]  # per batch row: its segments
        steps: list[tuple[torch.Tensor, ...]] = []  # this segment's (feature, top ids, top probs, token) per step
        drawn, drawn_t = _drawing(temps, device)
        for t in range(cfg.new_tokens):  # a step reads one thing back: which rows have ended
            step = state.forward(last[:, None], ~done[:, None], hidden=True)
            logits = step.logits[:, 0]  # [B, V] float32
            # the top k, sorted; softmax over their logits = the full softmax's top k renormalised over the k
            top = logits.topk(cfg.top_k, dim=-1)
            nxt = top.indices[:, 0].clone()  # greedy
            if len(drawn):  # inverse CDF: torch.multinomial costs many times more at this width
                cdf = (logits.index_select(0, drawn) / drawn_t[:, None]).softmax(-1).cumsum(-1)
                u = torch.rand(len(drawn), 1, generator=gen, device=device) * cdf[:, -1:]
                nxt.index_copy_(0, drawn, torch.searchsorted(cdf, u)[:, 0].clamp_max(logits.shape[-1] - 1))
            nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
            steps.append((step.hidden[:, 0].to(torch.bfloat16), top.indices.int(), top.values.softmax(-1).half(), nxt))
            done |= torch.isin(nxt, eos)
            last = nxt
            ended = done.tolist()
            if all(ended):
                break
            if 4 * sum(ended) >= len(live) and t + 1 < cfg.new_tokens:  # a quarter answered: they leave the batch
                _close_segment(steps, live, parts)
                keep = [i for i, end in enumerate(ended) if not end]
                state.select(keep)
                live, temps = [live[i] for i in keep], [temps[i] for i in keep]
                keep_d = on_device(keep, device, torch.long)
                last, done = last[keep_d], done[keep_d]
                drawn, drawn_t = _drawing(temps, device)
        _close_segment(steps, live, parts)
        width = prefill.shape[1]
        for row, (job, prompt_ids) in enumerate(zip(batch, rows, strict=True)):
            feats, ids, probs, gen_ids = (torch.cat(x) for x in zip(*parts[row], strict=True))
            gen_ids = gen_ids.tolist()
            n = next((i + 1 for i, t in enumerate(gen_ids) if t in eos_ids), len(gen_ids))
            prompt_feats = prefill[row, width - (len(prompt_ids) - 1) :].to(torch.bfloat16)  # positions 0..P-2
            # copies in host memory: the batch's tensors are freed, and a data file made on a GPU loads anywhere
            by_job[job] = FeatureSample(prompt_ids + gen_ids[:n], len(prompt_ids),
                                        torch.cat([prompt_feats, feats[:n]]).to("cpu", copy=True),
                                        ids[:n].to("cpu", copy=True), probs[:n].to("cpu", copy=True))
            n_tok += n
        rate = n_tok / (time.perf_counter() - start_time)
        progress(f"data: {min(b + cfg.gen_batch, len(jobs))}/{len(jobs)} answers, {n_tok} target tokens "
                 f"({rate:.0f} tokens/s)")
    return [by_job[(i, t)] for i in range(len(prompts)) for t in cfg.temperatures]


def draft_vocabulary(samples: list[FeatureSample], size: int, vocab_size: int) -> list[int]:
    """The `size` target ids the target writes most often in the samples (its continuations)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in samples:
        counts += torch.bincount(torch.tensor(s.ids[s.start :]).clamp_max(vocab_size - 1), minlength=vocab_size)
    return counts.argsort(descending=True, stable=True)[: min(size, vocab_size)].tolist()


def _eagle_batch(samples: list[FeatureSample], steps: int, to_draft: torch.Tensor, device):
    """tokens [B, L], features [B, L-1, F] (zero-padded), and the labels by position k (predicting
    x_{k+1}): target ids [B, L+steps, k], their draft ids (N outside the draft vocabulary of N) and
    probabilities (0 where position k has no label)."""
    length = max(len(s.ids) for s in samples)
    k = samples[0].top_ids.shape[1]
    tokens = torch.zeros(len(samples), length, dtype=torch.long)
    feats = torch.zeros(len(samples), length - 1, samples[0].features.shape[1])
    ids = torch.zeros(len(samples), length + steps, k, dtype=torch.long)
    probs = torch.zeros(len(samples), length + steps, k)
    for r, s in enumerate(samples):
        tokens[r, : len(s.ids)] = torch.tensor(s.ids)
        feats[r, : len(s.ids) - 1] = s.features.float()
        ids[r, s.start - 1 : len(s.ids) - 1] = s.top_ids.long()
        probs[r, s.start - 1 : len(s.ids) - 1] = s.top_probs.float()
    return tokens.to(device), feats.to(device), ids.to(device), to_draft[ids].to(device), probs.to(device)


def eagle_loss(head, samples: list[FeatureSample], steps: int, to_draft: torch.Tensor, device,
               decay: float = 0.8) -> tuple[torch.Tensor, list[dict]]:
    """Soft cross-entropy against the target's top-k at every draft position 1..steps (weights
    decay^(j-1)), and per position: greedy agreement with the target's argmax and the expected
    sampled acceptance sum_k min(p_k, q_k)."""
    tokens, feats, ids, draft_ids, probs = _eagle_batch(samples, steps, to_draft, device)
    n = feats.shape[1]
    total, stats = 0.0, []
    for j, h in enumerate(head.forward_train(tokens, feats, steps), start=1):
        has = probs[:, j : j + n, 0] > 0  # [B, n] entries with a label: only their logits are computed
        label_ids, label_draft = ids[:, j : j + n][has], draft_ids[:, j : j + n][has]  # [M, k]
        logq = head.logits(h[has]).float().log_softmax(-1)  # [M, N]
        label_p, reachable = probs[:, j : j + n][has], label_draft < logq.shape[-1]
        logq_label = logq.gather(-1, label_draft.clamp_max(logq.shape[-1] - 1))  # [M, k]
        loss = -(label_p * reachable * logq_label).sum(-1).mean()  # the mass the head can reach
        total = total + decay ** (j - 1) * loss
        with torch.no_grad():
            agree = (head.draft_ids[logq.argmax(-1)] == label_ids[:, 0]).float()
            accept = torch.minimum(label_p, logq_label.exp() * reachable).sum(-1)
        stats.append({"agreement": agree.mean().item(), "sampled_acceptance": accept.mean().item(),
                      "tokens": len(label_ids)})
    return total, stats


def fit(params: list[torch.nn.Parameter], cfg: DistillConfig, batch_loss: Callable[[], tuple[torch.Tensor, int, str]],
        progress: Progress, floor: float, betas: tuple[float, float]) -> dict:
    """AdamW for cfg.train_minutes (or cfg.max_steps): linear warm-up over the first 3 %, then cosine
    down to `floor` x cfg.lr; gradients clipped at 1. batch_loss() gives the next batch's loss, its
    labelled tokens, and a few words on it for the progress line (one a minute)."""
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.01, betas=betas)
    budget, start, step, seen, last_report = cfg.train_minutes * 60, time.perf_counter(), 0, 0, 0.0
    while True:
        elapsed = time.perf_counter() - start
        frac = elapsed / budget if not cfg.max_steps else step / cfg.max_steps
        if frac >= 1.0:
            break
        scale = min(1.0, frac / 0.03) * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac)))
        for group in opt.param_groups:
            group["lr"] = cfg.lr * scale
        loss, tokens, note = batch_loss()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        seen += tokens
        if elapsed - last_report > 60 or step == 1:
            last_report = elapsed
            progress(f"train: step {step}, {elapsed / 60:.1f} min, {seen} tokens, loss {loss.item():.3f}, {note}")
    return {"steps": step, "tokens_seen": seen, "train_s": round(time.perf_counter() - start, 1)}


TRAINING_REPEATS = 3  # training_dtype: timed steps per precision, interleaved, after one each to warm up
# training_dtype: the rows of the timed step. A batch trains thousands of rows; at a few dozen rows an AMX CPU's bf16
# step costs about float32's, so a timing there can flip between runs; from a few hundred rows bf16 is clearly faster
TRAINING_ROWS = 512


def _train_step_ms(lin: torch.nn.Linear, x: torch.Tensor, bf16: bool) -> float:
    """One forward and backward pass of lin over x, in ms (bf16: under autocast)."""
    start = time.perf_counter()
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16):
        y = lin(x)
    y.float().square().mean().backward()
    return 1000 * (time.perf_counter() - start)


def training_dtype(device: torch.device, width: int, intermediate: int,
                   step_ms: Callable[..., float] = _train_step_ms) -> tuple[torch.dtype, str]:
    """(dtype, why): bfloat16 autocast where training runs faster in it here, else float32. On a GPU, where it
    computes bfloat16 natively; on a CPU, measured on a step of the head's MLP product (TRAINING_ROWS rows, forward
    and backward; the fastest of TRAINING_REPEATS in each precision, interleaved), once per machine: kept in the
    profile's float32 `forwards`, so every later run here trains in the same precision (`specviz kernels
    --retune --dtype float32` measures it again). Not the inference choice (resolve_dtype's `auto`): without bf16
    instructions our kernels make a bfloat16 decode step the faster one, while ATen's bfloat16 training products
    there take many times float32's."""
    if device.type == "cuda":
        native = torch.cuda.is_bf16_supported(including_emulation=False)
        return (torch.bfloat16, "the GPU computes bfloat16 natively") if native else (
            torch.float32, "the GPU has no native bfloat16")
    if device.type != "cpu":
        return torch.float32, f"float32 on {device.type}"
    key = f"training {width}x{intermediate}"
    ms = kernels.stored_forward(torch.float32, key, TRAINING_ROWS)
    if set(ms) != {"float32", "bfloat16"}:
        with torch.random.fork_rng(devices=[]), torch.enable_grad():  # the caller's random state as it was
            lin = torch.nn.Linear(width, intermediate, device=device)
            x = torch.randn(TRAINING_ROWS, width, device=device, requires_grad=True)

            def time_them() -> dict[str, float]:
                times: dict[str, list[float]] = {"float32": [], "bfloat16": []}
                for _ in range(TRAINING_REPEATS + 1):  # the first of each warms up
                    for name in times:
                        times[name].append(step_ms(lin, x, name == "bfloat16"))
                return {name: min(t[1:]) for name, t in times.items()}

            ms, busy = contention.quietest(time_them)  # timed again while other programs take much of the CPU
        kernels.keep_forward(torch.float32, key, TRAINING_ROWS, ms, busy)
    label = f"a {width}x{intermediate} training product costs {{:.1f}} ms against {{:.1f}} ms"
    fp32, bf16 = ms["float32"], ms["bfloat16"]
    if bf16 < kernels.BF16_MARGIN * fp32:
        return torch.bfloat16, "bfloat16 autocast: " + label.format(bf16, fp32) + " in float32 here"
    return torch.float32, "float32: " + label.format(fp32, bf16) + " in bfloat16 here"


def train_eagle(head, train_set: list[FeatureSample], cfg: DistillConfig, to_draft: torch.Tensor, device,
                progress: Progress) -> dict:
    """Every sample once per epoch, in bf16 autocast where that trains faster here (training_dtype)."""
    rng = random.Random(cfg.seed)
    fast, why = training_dtype(device, head.config.width, head.config.intermediate)
    progress(f"train: {why}")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=fast == torch.bfloat16)
    order: list[int] = []

    def batch_loss():
        nonlocal order
        if len(order) < cfg.batch:
            order += rng.sample(range(len(train_set)), len(train_set))
        batch, order = [train_set[i] for i in order[: cfg.batch]], order[cfg.batch :]
        with autocast:
            loss, stats = eagle_loss(head, batch, cfg.ttt_steps, to_draft, device)
        by_position = ", ".join(f"{s['agreement']:.0%}" for s in stats)
        return loss, stats[0]["tokens"], f"batch agreement by draft position {by_position}"

    head.train()
    result = fit([p for p in head.parameters() if p.requires_grad], cfg, batch_loss, progress, 0.05, (0.9, 0.95))
    head.eval()
    result["precision"] = why
    result["epochs"] = round(result["tokens_seen"] / max(1, sum(len(s.top_ids) for s in train_set)), 2)
    return result


@torch.no_grad()
def evaluate_eagle(head, samples: list[FeatureSample], steps: int, to_draft: torch.Tensor, device) -> list[dict]:
    """Held-out scores per draft position j (teacher-forced: given positions < j right)."""
    sums = [{"agreement": 0.0, "sampled_acceptance": 0.0, "tokens": 0} for _ in range(steps)]
    for i in range(0, len(samples), 16):
        _, stats = eagle_loss(head, samples[i : i + 16], steps, to_draft, device)
        for total, s in zip(sums, stats, strict=True):
            for key in ("agreement", "sampled_acceptance"):
                total[key] += s[key] * s["tokens"]
            total["tokens"] += s["tokens"]
    return [{"position": j + 1, "greedy_agreement": round(t["agreement"] / max(1, t["tokens"]), 4),
             "sampled_acceptance": round(t["sampled_acceptance"] / max(1, t["tokens"]), 4), "tokens": t["tokens"]}
            for j, t in enumerate(sums)]


def build_draft(target, cfg: DistillConfig, vocab_size: int) -> LlamaForCausalLM:
    """A small Llama sharing the target's vocabulary; embedding from a PCA of the target's."""
    tc = target.config
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=getattr(tc, "max_position_embeddings", 2048), tie_word_embeddings=True,
        rope_theta=getattr(tc, "rope_theta", 10000.0), bos_token_id=tc.bos_token_id, eos_token_id=tc.eos_token_id,
        pad_token_id=getattr(tc, "pad_token_id", None),
    )
    torch.manual_seed(cfg.seed)
    draft = LlamaForCausalLM(config)
    emb = target.get_input_embeddings().weight.detach().float()[:vocab_size]  # [V, D]
    centred = emb - emb.mean(0, keepdim=True)
    k = min(cfg.hidden, centred.shape[1])
    _, _, v = torch.pca_lowrank(centred, q=k, center=False)  # v: [D, k] principal directions
    projected = centred @ v  # [V, k]
    # small, like a fresh init: the tied head multiplies it by a unit-RMS hidden state of width k
    projected = projected / projected.std() * 0.05
    with torch.no_grad():
        draft.get_input_embeddings().weight.zero_()
        draft.get_input_embeddings().weight[:, :k] = projected
    return draft


def _batch(samples: list[Sample], vocab_size: int):
    """Right-padded ids [B, L], and for each target position (row, col) its top-k ids and probs."""
    width = max(len(s.ids) for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    rows, cols, top_ids, top_probs = [], [], [], []
    for r, s in enumerate(samples):
        ids[r, : len(s.ids)] = torch.tensor(s.ids)
        n = len(s.top_ids)
        rows += [r] * n
        cols += list(range(s.start - 1, s.start - 1 + n))  # position t predicts token t + 1
        top_ids.append(s.top_ids.long().clamp_max(vocab_size - 1))
        top_probs.append(s.top_probs.float())
    return ids, torch.tensor(rows), torch.tensor(cols), torch.cat(top_ids), torch.cat(top_probs)


def soft_cross_entropy(draft, samples: list[Sample], vocab_size: int, device) -> tuple[torch.Tensor, dict]:
    ids, rows, cols, top_ids, top_probs = (t.to(device) for t in _batch(samples, vocab_size))
    hidden = draft.model(input_ids=ids).last_hidden_state[rows, cols]  # [N, H]: only where there are targets
    logits = draft.lm_head(hidden)[:, :vocab_size].float()  # [N, V]
    logq = logits.log_softmax(-1)
    loss = -(top_probs * logq.gather(-1, top_ids)).sum(-1).mean()
    with torch.no_grad():
        agree = (logits.argmax(-1) == top_ids[:, 0]).float().mean().item()
        accept = torch.minimum(top_probs, logq.gather(-1, top_ids).exp()).sum(-1).mean().item()
    return loss, {"agreement": agree, "sampled_acceptance": accept, "tokens": len(rows)}


def train(draft, train_set: list[Sample], cfg: DistillConfig, vocab_size: int, device, progress: Progress) -> dict:
    draft.to(device).train()
    rng = random.Random(cfg.seed)

    def batch_loss():
        loss, stats = soft_cross_entropy(draft, rng.sample(train_set, min(cfg.batch, len(train_set))), vocab_size,
                                         device)
        return loss, stats["tokens"], f"batch agreement {stats['agreement']:.1%}"

    result = fit(list(draft.parameters()), cfg, batch_loss, progress, 0.1, (0.9, 0.98))
    draft.eval()
    return result


@torch.inference_mode()
def evaluate(draft, samples: list[Sample], vocab_size: int, device) -> dict:
    totals = {"agreement": 0.0, "sampled_acceptance": 0.0, "tokens": 0}
    for i in range(0, len(samples), 16):
        _, stats = soft_cross_entropy(draft, samples[i : i + 16], vocab_size, device)
        for key in ("agreement", "sampled_acceptance"):
            totals[key] += stats[key] * stats["tokens"]
        totals["tokens"] += stats["tokens"]
    n = max(totals["tokens"], 1)
    return {"greedy_agreement": totals["agreement"] / n, "sampled_acceptance": totals["sampled_acceptance"] / n,
            "tokens": totals["tokens"]}


SAVE_EVERY = 1024  # prompts answered, at least, between two saves of a data file


def _load_or_generate(cfg: DistillConfig, target, tokenizer, prompts: list[str], vocab_size: int,
                      progress: Progress) -> tuple[list[FeatureSample], float]:
    """The feature data, grouped by prompt as generate_feature_data gives it. cfg.data_file, when
    given, keeps every answer made so far, keyed by (prompt, temperature): answers found there are
    reused, only the missing prompts are answered, and the file is saved again with all of them after
    each part (so a run with more prompts extends the data of an earlier run, and one that is stopped
    keeps what it answered). Returns the samples and the seconds spent generating all of them, earlier
    runs' included."""
    path = Path(cfg.data_file) if cfg.data_file else None
    known: dict[tuple[str, float], dict] = {}
    earlier_s = 0.0
    if path and path.is_file():
        saved = torch.load(path, weights_only=True, map_location="cpu")  # older files may hold GPU tensors
        # older files hold prompts x temperatures
        jobs = saved.get("jobs") or [(p, t) for p in saved["prompts"] for t in saved["temperatures"]]
        known = {(p, float(t)): sample for (p, t), sample in zip(jobs, saved["samples"], strict=True)}
        earlier_s = saved["generation_s"]
    missing = [p for p in prompts if any((p, float(t)) not in known for t in cfg.temperatures)]
    if path:
        progress(f"data: {len(prompts) - len(missing)} of {len(prompts)} prompts' answers found in {path}")
    t0 = time.perf_counter()
    done = 0
    while done < len(missing):
        # with a file, saved after each part, so a stopped run keeps what it answered; parts grow with the data
        # (each at least as large as what is saved), so rewriting the file costs at most about twice its final size
        part = max(SAVE_EVERY, len(known) // len(cfg.temperatures)) if path else len(missing)
        todo = missing[done : done + part]
        made = generate_feature_data(target, tokenizer, todo, cfg, vocab_size, progress)
        known.update(zip([(p, float(t)) for p in todo for t in cfg.temperatures], (asdict(s) for s in made),
                         strict=True))
        done += len(todo)
        if path:
            path.parent.mkdir(parents=True, exist_ok=True)
            seconds = round(earlier_s + time.perf_counter() - t0, 1)
            partial = path.with_name(path.name + ".partial")  # replaced whole: a save cut short loses nothing
            torch.save({"jobs": list(known), "samples": list(known.values()), "generation_s": seconds}, partial)
            os.replace(partial, path)
            progress(f"data: {len(prompts) - len(missing) + done} of {len(prompts)} prompts' answers saved in {path}")
    seconds = round(earlier_s + time.perf_counter() - t0, 1)
    return [FeatureSample(**known[(p, float(t))]) for p in prompts for t in cfg.temperatures], seconds


def _target_and_prompts(cfg: DistillConfig, kind: str, progress: Progress):
    """(device, target, tokenizer, vocabulary size, prompts): the target in the dtype that runs its output head
    faster at the generation batch's rows (on a CPU, measured: a decode step's choice may not hold for a batch);
    training is float32 or autocast (training_dtype)."""
    cfg.validate(kind)
    prompts = load_prompts(cfg)  # a bad prompts file fails before any model work
    if len(prompts) < 2:
        raise ValueError("distillation needs at least 2 prompts")
    if len(prompts) < cfg.prompts:  # more data then comes from more answers per prompt, or a prompts file
        held = f"{len(prompts)} from prompt {cfg.first_prompt} on" if cfg.first_prompt else str(len(prompts))
        progress(f"data: {len(prompts)} prompts, not {cfg.prompts}: {cfg.prompts_file or 'the built-in set'} holds "
                 f"{held} (more answers per prompt: --temperatures, --new-tokens)")
    device = resolve_device(cfg.device)
    torch.manual_seed(cfg.seed)
    dtype, why = choose_dtype(cfg.target, "auto", device, progress, rows=(kernels.timed_rows(cfg.gen_batch),))
    progress(f"data: {why}")
    target, tokenizer = load_model(cfg.target, device, dtype, progress)
    vocab_size = min(target.get_output_embeddings().weight.shape[0], len(tokenizer))
    if cfg.top_k > vocab_size:
        raise ValueError(f"top_k ({cfg.top_k}) is more than the target's vocabulary ({vocab_size} tokens)")
    return device, target, tokenizer, vocab_size, prompts


def distill_eagle(cfg: DistillConfig, progress: Progress = print) -> dict:
    """An EAGLE head for cfg.target (eagle.py): data from the target itself, training with the
    training-time test, held-out scores by draft position; saved with its report in cfg.out."""
    t0 = time.perf_counter()
    device, target, tokenizer, vocab_size, prompts = _target_and_prompts(cfg, "eagle", progress)
    samples, data_s = _load_or_generate(cfg, target, tokenizer, prompts, vocab_size, progress)
    per_prompt = len(cfg.temperatures)  # held out by prompt: no answer to a held-out prompt is trained on
    n_held = max(1, int(len(prompts) * cfg.holdout)) * per_prompt
    held_out, train_set = samples[:n_held], samples[n_held:]

    train_tokens = sum(len(s.top_ids) for s in train_set)
    if cfg.init:  # the earlier head, bound to this target, in float32 to train; its draft vocabulary kept
        head = EagleHead.load(cfg.init, target, vocab_size).float().requires_grad_(True)
        config = head.config
        config.origin += f"; then {train_tokens} tokens more (distill --init)"
    else:
        draft_vocab = draft_vocabulary(train_set, cfg.draft_vocab, vocab_size)
        config = HeadConfig.for_target(target, draft_vocab, vocab_size, cfg.head_intermediate, cfg.target)
        config.origin = f"specviz distill --kind eagle: {train_tokens} tokens of the target's own answers"
        torch.manual_seed(cfg.seed)  # the first weights from the seed alone, not from what ran before (data, tuning)
        head = EagleHead(config).to(device).bind(target, vocab_size)
        final_norm = getattr(getattr(target, "model", None), "norm", None)  # Llama-family: start at the target's scale
        if isinstance(getattr(final_norm, "weight", None), torch.Tensor) and final_norm.weight.shape == (config.width,):
            with torch.no_grad():
                head.final_norm.copy_(final_norm.weight.float())
    draft_vocab = config.draft_vocab
    to_draft = Columns.of_ids(torch.tensor(draft_vocab), vocab_size).of  # [V]: N where the head cannot draft
    held_tokens = torch.cat([torch.tensor(s.ids[s.start :]) for s in held_out])
    coverage = float((to_draft[held_tokens.clamp_max(vocab_size - 1)] < len(draft_vocab)).float().mean())
    progress(f"draft vocabulary: {len(draft_vocab)} ids cover {coverage:.1%} of the held-out answers' tokens")
    head.embed_weight, head.out_weight = head.embed_weight.float(), head.out_weight.float()  # frozen, fp32 maths
    del target
    fit = train_eagle(head, train_set, cfg, to_draft, device, progress)
    scores = evaluate_eagle(head, held_out, cfg.ttt_steps, to_draft, device)
    progress("held-out, by draft position: " + ", ".join(
        f"{s['position']}: agreement {s['greedy_agreement']:.1%}, sampled acceptance {s['sampled_acceptance']:.1%}"
        for s in scores))
    out = Path(cfg.out)
    head.save(out)
    report = {
        "kind": "eagle", "config": asdict(cfg), "device": str(device),
        "head_parameters": sum(p.numel() for p in head.parameters()),
        "data": {"prompts": len(prompts), "answers": len(samples), "train_tokens": train_tokens,
                 "held_out_tokens": scores[0]["tokens"], "generation_s": data_s,
                 "draft_vocab": len(draft_vocab), "held_out_vocab_coverage": round(coverage, 4)},
        "training": fit, "held_out_by_position": scores,
        "total_s": round(time.perf_counter() - t0, 1),  # end to end: loading, data, training, scoring
    }
    (out / "distill_report.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
    progress(f"saved {out}")
    return report


def distill(cfg: DistillConfig, progress: Progress = print) -> dict:
    """The whole recipe; saves the draft (bf16 safetensors, tokenizer, report) in cfg.out."""
    device, target, tokenizer, vocab_size, prompts = _target_and_prompts(cfg, "draft", progress)
    t0 = time.perf_counter()
    samples = generate_data(target, tokenizer, prompts, cfg, progress)
    data_s = time.perf_counter() - t0
    n_held = max(1, int(len(samples) * cfg.holdout))
    held_out, train_set = samples[:n_held], samples[n_held:]

    draft = build_draft(target.float(), cfg, vocab_size)
    del target
    before = evaluate(draft.to(device), held_out, vocab_size, device)
    progress(f"held-out greedy agreement before training: {before['greedy_agreement']:.1%}")
    fit = train(draft, train_set, cfg, vocab_size, device, progress)
    after = evaluate(draft, held_out, vocab_size, device)
    progress(f"held-out greedy agreement {after['greedy_agreement']:.1%}, "
             f"expected sampled acceptance {after['sampled_acceptance']:.1%} ({after['tokens']} tokens)")

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    draft.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    report = {
        "config": asdict(cfg), "device": str(device), "draft_parameters": sum(p.numel() for p in draft.parameters()),
        "data": {"prompts": len(samples), "train_tokens": sum(len(s.top_ids) for s in train_set),
                 "held_out_tokens": after["tokens"], "generation_s": round(data_s, 1)},
        "training": fit, "held_out_before": before, "held_out": after,
    }
    (out / "distill_report.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
    progress(f"saved {out}")
    return report
