"""The host-device sync counter (tools/syncs.py): what a GPU would wait for, counted on the CPU."""

import dataclasses

import pytest
import torch
from conftest import words
from test_trees import random_head_pair
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from specviz.core import sampling
from specviz.core.generator import Settings, generate, generate_batch
from specviz.core.kvcache import READS_WAIT, reads_wait
from specviz.tools.syncs import SyncCounter


def test_each_kind_of_wait_is_counted_and_device_side_work_is_not():
    x = torch.arange(6.0)
    with SyncCounter() as syncs:
        y = (x * 2 + 1).softmax(-1)[torch.tensor([0, 2])]  # maths and integer indexing: queued, no wait
        torch.zeros(3, device=x.device)
        torch.as_tensor(x)  # a tensor from a tensor: no host data
        torch.tensor([], device=x.device)  # nothing to copy
        y.argmax(-1)
        assert syncs.total == 0
        x.tolist()
        x[1].item()
        bool(x[2] > 1)
        int(x[3])
        float(x[4])
        range(x[0].long())
        x.nonzero()
        torch.where(x > 2)
        x[x > 3]
        x[x > 4] = 0
        torch.tensor([1, 2], device=x.device)
        torch.repeat_interleave(x, torch.ones(6, dtype=torch.long))
        if x.sum() > 0:  # the branch reads the comparison back
            pass
    assert dict(syncs.counts) == {"tolist": 1, "item": 1, "bool": 2, "int": 1, "float": 1, "index": 1, "nonzero": 2,
                                  "boolean index": 2, "tensor(list)": 1, "repeat_interleave": 1}
    assert syncs.total == 13


def test_a_round_waits_for_the_device_a_few_times(pattern_pair):
    """What a round reads back to the host: every row's values for the rule and the p and q shown, in one
    read (a sampled chain's too: its walk's last draw is made before the read, at every place the walk can
    end; the inspector's candidates, 2 more). Host lists go to the device without a wait (kvcache.on_device); the
    host keeps the text so far (prompt lookup searches it there) and a copy of each cache's mask (a
    roll-back reads nothing)."""
    pair = pattern_pair("llama")
    cases = [("baseline", Settings(max_new_tokens=12, record_top=0), 1),
             ("speculative", Settings(gamma=3, max_new_tokens=12, record_top=0), 1),
             ("speculative", Settings(gamma=3, max_new_tokens=12), 3),
             ("speculative", Settings(gamma=3, max_new_tokens=12, record_top=0, temperature=1.0), 1),
             ("baseline", Settings(max_new_tokens=12, record_top=0, temperature=1.0), 1),
             ("speculative", Settings(drafter="lookup", gamma=3, max_new_tokens=12, record_top=0), 1)]
    for mode, settings, most in cases:
        with SyncCounter() as syncs:
            run = generate(pair, "", settings, mode=mode, prompt_ids=words(2, 3, 4, 2, 3))
        assert syncs.total <= most * len(run.events), (mode, settings, dict(syncs.counts), len(run.events))
        assert mode == "baseline" or run.n_drafted > 0
    with SyncCounter() as syncs:
        runs = generate_batch(pair, [""] * 3, Settings(gamma=3, max_new_tokens=12, record_top=0),
                              prompts_ids=[words(2, 3, 4), words(7, 8), words(20, 21, 22, 23)])
    rounds = max(len(r.events) for r in runs)
    assert syncs.total == rounds, dict(syncs.counts)  # one read a round for all rows



def test_timing_a_rounds_stages_waits_for_no_device(pattern_pair, monkeypatch):
    """The counter sees reads, not torch.cuda.synchronize, which decode calls through generator._sync: that is
    once a run (the prefill's time), never a round (a GPU's stages are split where the host waits anyway), so the
    waits counted above are all a round makes."""
    from specviz.core import generator

    waits = []
    monkeypatch.setattr(generator, "_sync", lambda device: waits.append(device))
    for settings in (Settings(gamma=3, max_new_tokens=12), Settings(gamma=3, max_new_tokens=12, temperature=1.0)):
        waits.clear()
        run = generate(pattern_pair("llama"), "", settings, prompt_ids=words(2, 3, 4, 2, 3))
        assert len(run.events) > 1 and len(waits) == 1

@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_round_from_the_eagle_head_reads_once_chain_or_tree(random_pair, temperature):
    """Inspector off, greedy or sampled: a round reads once. A chain from the EAGLE head reads nothing of its own
    (its drafts are kept from the first: none is likelier than the one before it); a tree is ranked, kept and laid
    out for the verify pass on the device, and its parents and scores come back with the rule's values (sampled,
    the walk's later siblings and last draw too). Where prompt lookup joins a tree, the tree's shape and ids and
    the copied ids are read once more, for every row at once."""
    pair = dataclasses.replace(random_head_pair(random_pair), eos_token_ids=set())
    for drafter, branch, nodes in (("eagle", 1, 0), ("eagle", 1, 2), ("eagle", 3, 4), ("lookup+eagle", 3, 4)):
        settings = Settings(drafter=drafter, gamma=3, branch=branch, nodes=nodes, max_new_tokens=12, record_top=0,
                            temperature=temperature)
        with SyncCounter() as syncs:
            run = generate(pair, "", settings, prompt_ids=words(1, 2, 3, 4, 1, 2, 3))
        drafting = sum(1 for e in run.events if e.drafted)
        assert drafting > 1 and (branch > 1) == any(p >= 0 for e in run.events for p in e.parents)
        joined = sum(1 for e in run.events if e.drafted_by == "lookup")
        assert (drafter == "lookup+eagle") == (joined > 0)
        assert syncs.total == len(run.events) + joined, (drafter, branch, dict(syncs.counts))


def test_a_sampled_round_comes_out_the_same_whether_it_reads_ahead_or_asks(random_pair):
    """On a CPU a sampled walk asks for what it needs as it goes (a read is a load there); where a read waits
    for a queue (CUDA, MPS, or while counting), the round draws ahead for every node the walk could end at and
    reads once. Either way the run is the same, draw for draw: every drafted token with its p, q, ratio, uniform
    and status, the extra token with its p and q, and the inspector's candidates."""
    assert not reads_wait(torch.device("cpu")) and reads_wait(torch.device("cuda")) and reads_wait(torch.device("mps"))
    pair = dataclasses.replace(random_head_pair(random_pair), eos_token_ids=set())

    def seen(run):
        return [(e.drafted, e.extra, e.parents) for e in run.events]

    for settings in (Settings(drafter="eagle", gamma=3, branch=3, nodes=5, temperature=1.0, max_new_tokens=16),
                     Settings(gamma=3, temperature=0.8, top_k=6, max_new_tokens=16, record_top=0, seed=4)):
        asked = generate(pair, "", settings, prompt_ids=words(1, 2, 3))
        token = READS_WAIT.set(True)
        try:
            ahead = generate(pair, "", settings, prompt_ids=words(1, 2, 3))
        finally:
            READS_WAIT.reset(token)
        assert seen(ahead) == seen(asked)
        kinds = {e.extra.kind for e in asked.events} | {d.status for e in asked.events for d in e.drafted}
        assert {"correction", "bonus", "accepted", "rejected"} <= kinds, kinds


class _NoFloat64(TorchDispatchMode):
    """Fails the op that makes a float64 tensor, as mps would."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        made = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.dtype == torch.float64]
        assert not made, f"{func} made a float64 tensor"
        return out


def test_a_device_without_float64_is_never_asked_for_one(pattern_pair, monkeypatch):
    """mps has no float64. With the CPU taken for such a device (sampling.NO_FLOAT64) and reads that wait
    (mps's path), no op of a float32 run makes a float64 tensor: a round's values are read in float32 (ids
    exact below 2^24), greedy or sampled, chain or tree, lookup joined to a tree, the inspector on. Greedy,
    the tokens and every shown p and q are those read in float64."""
    pair = dataclasses.replace(random_head_pair(pattern_pair("llama"), draft_words=range(12)), eos_token_ids=set())
    cases = [Settings(gamma=3, max_new_tokens=12),
             Settings(gamma=3, max_new_tokens=12, temperature=1.0, top_p=0.9),
             Settings(drafter="eagle", gamma=3, branch=3, nodes=5, max_new_tokens=12),
             Settings(drafter="eagle", gamma=3, branch=3, nodes=5, max_new_tokens=12, temperature=1.0),
             Settings(drafter="lookup+eagle", gamma=3, branch=2, nodes=5, max_new_tokens=12)]
    prompt = words(1, 2, 3, 4, 1, 2, 3)

    def seen(run):
        return [([(d.id, d.p, d.q, d.status) for d in e.drafted], e.extra, e.parents) for e in run.events]

    token = READS_WAIT.set(True)
    try:
        wide = [seen(generate(pair, "", s, prompt_ids=prompt)) for s in cases if s.temperature == 0]
        monkeypatch.setattr(sampling, "NO_FLOAT64", {"cpu"})
        with _NoFloat64():
            runs = [generate(pair, "", s, prompt_ids=prompt) for s in cases]
    finally:
        READS_WAIT.reset(token)
    assert [seen(r) for r, s in zip(runs, cases, strict=True) if s.temperature == 0] == wide
    assert all(r.n_drafted > 0 for r in runs)
    assert any(e.drafted_by == "lookup" for e in runs[-1].events), "lookup was never joined to the tree"
