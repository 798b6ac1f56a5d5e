"""The acceptance rule is exact: the token it emits is distributed as p, in closed form and by
sampling, with the same warping applied to p and q."""

import pytest
import torch
import torch.nn.functional as F

from specviz.core import rules
from specviz.core.reads import fetch
from specviz.core.rules import AHEAD, GREEDY, SAMPLED, Drafts, accept_or_resample
from specviz.core.sampling import (
    SamplingParams,
    children_of,
    logits_to_probs,
    residual_distribution,
    sample,
)

WARPS = [
    SamplingParams(1.0),
    SamplingParams(0.7, top_k=5),
    SamplingParams(1.3, top_p=0.8),
    SamplingParams(0.9, top_k=10, top_p=0.9),
]


def random_pq(seed: int, params: SamplingParams, vocab: int = 16):
    gen = torch.Generator().manual_seed(seed)
    p_logits = torch.randn(2, vocab, generator=gen, dtype=torch.float64) * 2
    q_logits = torch.randn(1, vocab, generator=gen, dtype=torch.float64) * 2
    return logits_to_probs(p_logits, params).double(), logits_to_probs(q_logits, params).double()


def emitted_distribution_closed_form(p, q):
    """P(emit x) = q(x) a(x) + (sum_y q(y) (1 - a(y))) r(x), with a and r from the implementation."""
    vocab = q.shape[-1]
    accept = torch.zeros(vocab, dtype=torch.float64)
    for y in range(vocab):
        if q[0, y] > 0:
            accept[y] = accept_or_resample(p, q, torch.tensor([y]), None, greedy=False).accept_probs[0]
    rejected_mass = (q[0] * (1 - accept)).sum()
    return q[0] * accept + rejected_mass * residual_distribution(p[0], q[0])


@pytest.mark.parametrize("params", WARPS, ids=str)
@pytest.mark.parametrize("seed", range(5))
def test_closed_form_equals_target(params, seed):
    p, q = random_pq(seed, params)
    emitted = emitted_distribution_closed_form(p, q)
    torch.testing.assert_close(emitted, p[0], atol=1e-12, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("params", WARPS[:1] + WARPS[3:], ids=str)
def test_sampled_rule_matches_target(params):
    """100 000 draws of (d ~ q, then the rule): total variation to p below 0.01."""
    p, q = random_pq(7, params)
    gen = torch.Generator().manual_seed(0)
    n = 100_000
    drafts = sample(q[0].expand(n, -1), gen)  # [n]
    counts = torch.zeros(p.shape[-1], dtype=torch.float64)
    for d in drafts.tolist():
        verdict = accept_or_resample(p, q, torch.tensor([d]), gen)
        counts[d if verdict.n_accepted == 1 else verdict.next_token] += 1
    tv = 0.5 * (counts / n - p[0]).abs().sum().item()
    assert tv < 0.01, f"total variation {tv:.4f}"


def test_one_hot_draft_is_exact():
    """A deterministic drafter (q one-hot) is the special case the n-gram drafter relies on:
    accept with probability p(x), else draw from p with x removed."""
    p, _ = random_pq(11, SamplingParams(1.0))
    for x in range(p.shape[-1]):
        q = torch.zeros(1, p.shape[-1], dtype=torch.float64)
        q[0, x] = 1.0
        torch.testing.assert_close(emitted_distribution_closed_form(p, q), p[0], atol=1e-12, rtol=0)


def test_greedy_is_argmax_agreement():
    logits = torch.tensor([[0.1, 2.0, 0.3], [1.0, 0.0, 0.5]])
    p = logits_to_probs(logits, SamplingParams(0.0))
    assert p.tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]
    # the decoder passes the argmax it has already: the same one-hot rows, from that argmax
    assert logits_to_probs(logits, SamplingParams(0.0), logits.argmax(-1)).tolist() == p.tolist()
    assert logits_to_probs(logits, SamplingParams(0.0), torch.tensor([2, 1])).tolist() == [[0, 0, 1], [0, 1, 0]]
    q = logits_to_probs(torch.tensor([[0.0, 3.0, 0.0]]), SamplingParams(0.0))
    kept = accept_or_resample(p, q, torch.tensor([1]), None, greedy=True)
    assert (kept.n_accepted, kept.next_token, kept.u) == (1, 0, [None])
    q_wrong = logits_to_probs(torch.tensor([[0.0, 0.0, 3.0]]), SamplingParams(0.0))
    rejected = accept_or_resample(p, q_wrong, torch.tensor([2]), None, greedy=True)
    assert (rejected.n_accepted, rejected.next_token) == (0, 1)


def test_warping_keeps_what_it_should():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    assert (logits_to_probs(logits, SamplingParams(1.0, top_k=2)) > 0).tolist() == [True, True, False, False, False]
    probs = logits.softmax(-1)  # 0.636, 0.234, 0.086, ...
    nucleus = logits_to_probs(logits, SamplingParams(1.0, top_p=0.8)) > 0
    assert nucleus.tolist() == [True, True, False, False, False]
    assert probs[0] < 0.8 < probs[:2].sum()
    assert (logits_to_probs(logits, SamplingParams(1.0, top_p=0.5)) > 0).sum() == 1  # the top token stays
    torch.testing.assert_close(logits_to_probs(logits, SamplingParams(2.0)), (logits / 2).softmax(-1))


def test_rule_records_u_only_for_tested_tokens():
    p, q = random_pq(3, SamplingParams(1.0))
    p = torch.cat([p[:1]] * 3 + [p[1:]])  # [4, V]
    q = torch.cat([q] * 3)  # [3, V]
    gen = torch.Generator().manual_seed(1)
    for _ in range(50):
        drafts = sample(q, gen)
        v = accept_or_resample(p, q, drafts, gen)
        tested = min(v.n_accepted + 1, 3)
        assert all(u is not None for u in v.u[:tested]) and all(u is None for u in v.u[tested:])
        for i in range(v.n_accepted):
            assert v.u[i] < v.accept_probs[i]
        if v.n_accepted < 3:
            assert v.u[v.n_accepted] >= v.accept_probs[v.n_accepted]


def test_sample_draws_each_token_at_its_probability_and_never_one_of_mass_zero(monkeypatch):
    """Inverse CDF against the law it must follow: 400 000 draws from a vocabulary with holes (TV below
    0.005; noise about 0.002), and the uniform's extremes, 0 and just below 1, land on tokens of mass."""
    p = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0])
    n = 400_000
    counts = torch.bincount(sample(p.expand(n, -1), torch.Generator().manual_seed(0)), minlength=6)
    assert counts[[0, 2, 5]].sum() == 0
    assert 0.5 * (counts / n - p).abs().sum() < 0.005
    assert sample(torch.rand(3, 4, 7), None).shape == (3, 4)
    for u in (0.0, 1.0 - 2**-53, 1.0):  # torch.rand never gives 1; float rounding of u · total might
        monkeypatch.setattr(torch, "rand", lambda shape, u=u, **kw: torch.full(shape, u, dtype=kw["dtype"]))
        assert int(sample(p, None)) == (1 if u == 0 else 4)



def judged(rule, drafts: Drafts, parents: list[int]):
    """The rule's verdict, its reads fetched as a round fetches them."""
    reads = rule.reads(drafts)
    fetch([reads])
    return rule.judge(drafts, reads, parents)


@pytest.mark.parametrize("parents", [[-1, 0, 1], [-1, -1, 0, 0, -1, 2]], ids=["chain", "tree"])
def test_what_the_walk_reads_ahead_is_what_it_would_have_asked_for(parents, monkeypatch):
    """A sampled round reads, with the rule's values, each node's ratio against the r it is tried with and the
    token drawn for every node the walk can end at (walk_ends), so the walk asks the device for nothing. From
    the same generator state it comes out draw for draw as the walk that asks: the same kept path, ratios,
    uniforms and last token, wherever it ends (after a rejection, after every child of a node, at a leaf), and
    the residual the correction came from, which it takes from walk_ends' rows without computing one (the
    rules SampledRule and AheadRule)."""
    g = len(parents)
    p, _ = random_pq(5, SamplingParams(0.8), vocab=12)
    p = torch.cat([p[:1], p[1:]] * 4)[: g + 1].float()  # [g + 1, V]
    q = torch.cat([logits_to_probs(torch.randn(g, 12, generator=torch.Generator().manual_seed(9)) * 2,
                                   SamplingParams(0.8)) * 0.5 + p[1:] * 0.5])  # [g, V], near p in part
    children = children_of(torch.tensor(parents), 1 if g == 3 else 3)
    assert children.tolist() == ([[0], [1], [2], [3]] if g == 3 else  # padded with g: no node
                                 [[0, 1, 4], [2, 3, 6], [6, 6, 6], [5, 6, 6], [6, 6, 6], [6, 6, 6], [6, 6, 6]])
    gen, ends_at, shapes, made = torch.Generator().manual_seed(2), set(), set(), []

    def counted(r, q_):  # residual_distribution, counting its calls
        made.append(1)
        return residual_distribution(r, q_)

    for _ in range(400):
        drafts = Drafts(p, q, sample(q, gen), gen, parents=torch.tensor(parents), branch=children.shape[1])
        state = gen.get_state()
        asked = judged(SAMPLED, drafts, parents)
        after = gen.get_state()
        gen.set_state(state)
        made.clear()
        monkeypatch.setattr(rules, "residual_distribution", counted)
        ahead = judged(AHEAD, drafts, parents)
        monkeypatch.undo()
        assert torch.equal(gen.get_state(), after) and not made  # the same draws, no more; no residual computed
        assert (ahead.path, ahead.next_token, ahead.u, ahead.accept_probs, ahead.rejected) == \
            (asked.path, asked.next_token, asked.u, asked.accept_probs, asked.rejected)
        assert (ahead.residual is None) == (asked.residual is None)  # what the correction was drawn from
        assert ahead.residual is None or torch.equal(ahead.residual, asked.residual)
        ends_at.add(ahead.path[-1] if ahead.path else -1)
        shapes.add(len(ahead.rejected))
    assert ends_at == set(range(-1, g)) and max(shapes) >= children.shape[1]  # a node whose every child failed


@pytest.mark.parametrize("parents", [[-1, 0, 1], [-1, -1, 0, 0, -1, 2]], ids=["chain", "tree"])
def test_the_three_rules_agree_where_p_and_q_are_one_hot(parents):
    """On greedy distributions (p and q one-hot) the sampled rules keep exactly what the greedy rule keeps and
    add the same token, whatever the seed: a draft is kept with probability p(d) in {0, 1}, and the last draw
    comes from a one-hot row."""
    g, vocab, ends_at = len(parents), 6, set()
    for seed in range(60):
        gen = torch.Generator().manual_seed(seed)
        best = torch.randint(0, vocab, (g + 1,), generator=gen)  # the target's argmax after the root and each node
        draft = torch.where(torch.rand(g, generator=gen) < 0.6, best[torch.tensor(parents) + 1],
                            torch.randint(0, vocab, (g,), generator=gen))  # drafts right in part
        p, q = F.one_hot(best, vocab).float(), F.one_hot(draft, vocab).float()
        d = Drafts(p, q, draft, gen, best=best, parents=torch.tensor(parents), branch=3)
        verdicts = [judged(rule, d, parents) for rule in (GREEDY, SAMPLED, AHEAD)]
        assert len({(tuple(v.path), v.next_token, tuple(v.rejected)) for v in verdicts}) == 1, seed
        ends_at.add(verdicts[0].path[-1] if verdicts[0].path else -1)
    assert len(ends_at) > 1  # walks that end at different places were tried
