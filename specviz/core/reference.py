"""Speculative decoding in one screen: one prompt, a chain of drafts, every value read on the host.

This is the algorithm as Leviathan et al. 2023 (Algorithm 1) write it, on specviz's drafters and KV state.
`decode` (generator.py) runs the same rounds for a batch, trees and the viewer's records, reading from the
device once a round; the tests hold it to this function token for token, greedy and seeded sampled alike
(the draws come in the same order: the drafter's, one uniform per draft, then the round's last token).
"""

from __future__ import annotations

import torch

from ..models.loading import ModelPair
from .generator import Settings, make_drafter, pad_id
from .kvcache import KVState, on_device
from .sampling import acceptance_probability, logits_to_probs, residual_distribution, sample


@torch.inference_mode()
def reference_decode(pair: ModelPair, prompt_ids: list[int], settings: Settings) -> list[int]:
    """The new token ids of a speculative run with a fixed γ and a chain drafter (settings.branch 1)."""
    if settings.branch != 1 or settings.gamma_policy != "fixed":
        raise ValueError("the reference decoder drafts a chain of a fixed γ")
    params, device, budget = settings.sampling, pair.device, settings.max_new_tokens
    gen = torch.Generator(device=device).manual_seed(settings.seed)
    capacity = len(prompt_ids) + budget + settings.gamma + 2
    drafter = make_drafter(pair, settings, "speculative", capacity)
    target = KVState(pair.target, 1, settings.cache, pair.vocab_size, capacity, settings.compile)
    seq = list(prompt_ids)
    drafter.start([seq], target.prefill([seq], pad_id(pair), hidden=drafter.requires_hidden).hidden)
    while len(seq) - len(prompt_ids) < budget:
        # 1. draft d_1..d_g with q_1..q_g (g <= γ, and never past the budget)
        gamma = min(settings.gamma, budget - (len(seq) - len(prompt_ids)) - 1)
        proposal = drafter.propose([seq], [gamma], params, [gen])[0].widened()  # q [g, V]
        drafts, g, start = proposal.tokens.tolist(), proposal.tokens.shape[0], target.width
        # 2. one target forward over [x_last, d_1..d_g]: p_1..p_{g+1} [g + 1, V]
        out = target.forward(on_device([[seq[-1]] + drafts], device), [[True] * (g + 1)],
                             hidden=drafter.requires_hidden)
        p = logits_to_probs(out.logits[0, : g + 1], params)
        # 3. keep d_i while u_i < min(1, p_i(d_i) / q_i(d_i)) (greedy: while d_i is p_i's argmax)
        u = [] if params.greedy else torch.rand(g, generator=gen, device=device).tolist()
        n = 0
        while n < g and (drafts[n] == int(p[n].argmax()) if params.greedy else
                         u[n] < float(acceptance_probability(p[n, drafts[n]], proposal.q[n, drafts[n]]))):
            n += 1
        # 4. add a token: the argmax, or from norm(max(0, p - q)) after a rejection, else the bonus from p_{g+1}
        r = p[n] if n == g else residual_distribution(p[n], proposal.q[n])
        new = drafts[:n] + [int(p[n].argmax()) if params.greedy else int(sample(r, gen))]
        eos = next((i for i, t in enumerate(drafts[:n]) if t in pair.eos_token_ids), None)
        if eos is not None:  # an accepted EOS ends the text there, with no token after it
            n, new = eos + 1, drafts[: eos + 1]
        # 5. roll both states back to x_last and the kept drafts
        target.keep(0, start + 1, start + g + 1, list(range(start + 1, start + 1 + n)))
        drafter.verified([n], None if out.hidden is None else out.hidden[:, : n + 1])
        target.trim()
        seq += new
        if any(t in pair.eos_token_ids for t in new):
            break
    return seq[len(prompt_ids) :]
