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
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from .models import encode_prompt, load_model, resolve_device, resolve_dtype
from .prompts import training_prompts

Progress = Callable[[str], None]


@dataclass
class DistillConfig:
    target: str
    out: str
    prompts: int = 512  # training prompts (a share is held out for the report)
    prompts_file: str | None = None  # one prompt per line, instead of the built-in set
    chat_template: bool = True
    new_tokens: int = 96  # continuation length per prompt
    gen_batch: int = 32
    gen_temperature: float = 0.8
    top_k: int = 32  # target probabilities kept per position
    layers: int = 4
    hidden: int = 192
    heads: int = 3
    kv_heads: int = 1
    intermediate: int = 512
    train_minutes: float = 10.0
    max_steps: int = 0  # 0: as many as the minutes allow
    batch: int = 16  # sequences per training step
    lr: float = 3e-3
    holdout: float = 0.1
    seed: int = 0
    device: str = "auto"


@dataclass
class Sample:
    ids: list[int]  # prompt + continuation
    start: int  # index of the first continuation token
    top_ids: torch.Tensor  # [T, k] int32: target's top-k at each continuation step
    top_probs: torch.Tensor  # [T, k] float16, renormalised over the k


def load_prompts(cfg: DistillConfig) -> list[str]:
    if cfg.prompts_file:
        lines = [line.strip() for line in Path(cfg.prompts_file).read_text(encoding="utf-8").splitlines()]
        return [line for line in lines if line][: cfg.prompts]
    return training_prompts(cfg.prompts, cfg.seed)


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
    opt = torch.optim.AdamW(draft.parameters(), lr=cfg.lr, weight_decay=0.01, betas=(0.9, 0.98))
    rng = random.Random(cfg.seed)
    budget = cfg.train_minutes * 60
    start, step, seen, last_report = time.perf_counter(), 0, 0, 0.0
    while True:
        elapsed = time.perf_counter() - start
        frac = elapsed / budget if not cfg.max_steps else step / cfg.max_steps
        if frac >= 1.0:
            break
        # linear warm-up over the first 3 %, then cosine down to a tenth
        scale = min(1.0, frac / 0.03) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for group in opt.param_groups:
            group["lr"] = cfg.lr * scale
        loss, stats = soft_cross_entropy(draft, rng.sample(train_set, min(cfg.batch, len(train_set))),
                                         vocab_size, device)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        step += 1
        seen += stats["tokens"]
        if elapsed - last_report > 30 or step == 1:
            last_report = elapsed
            progress(f"train: step {step}, {elapsed / 60:.1f} min, loss {loss.item():.3f}, "
                     f"batch agreement {stats['agreement']:.1%}")
    draft.eval()
    return {"steps": step, "tokens_seen": seen, "train_s": time.perf_counter() - start}


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


def distill(cfg: DistillConfig, progress: Progress = print) -> dict:
    """The whole recipe; saves the draft (bf16 safetensors, tokenizer, report) in cfg.out."""
    device = resolve_device(cfg.device)
    torch.manual_seed(cfg.seed)
    # bf16 generation where the hardware has it; training always in float32
    target, tokenizer = load_model(cfg.target, device, resolve_dtype("auto", device), progress)
    vocab_size = min(target.get_output_embeddings().weight.shape[0], len(tokenizer))
    prompts = load_prompts(cfg)
    if len(prompts) < 2:
        raise ValueError("distillation needs at least 2 prompts")
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
