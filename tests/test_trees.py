"""Token trees: the tree rule against closed forms and against draws (and a broken residual
caught by both), tree attention in every cache kind against fresh forwards, the kept path moved to
consecutive slots, the EAGLE head's tree, a copied branch grafted on, and greedy trees equal to the
baseline token for token."""

import dataclasses
from collections import Counter

import pytest
import torch
from conftest import ARCHS, seeded_runs, word_id, words
from test_generator import exact_baseline_distribution

from specviz.core import rules, sampling
from specviz.core.drafters import Proposal, graft
from specviz.core.events import Run, runs_from_json, runs_to_json
from specviz.core.generator import Settings, decode, draft_width, generate, parse_trees, tree_label
from specviz.core.kvcache import CACHE_KINDS, KVState, Tree
from specviz.core.rules import accept_or_resample
from specviz.core.sampling import SamplingParams
from specviz.models.eagle import EagleHead, HeadConfig

V = 6
# root -> 0, 1, 2; 0 -> 3, 4; 1 -> 5
PARENTS = [-1, -1, -1, 0, 0, 1]


def one_hot(x: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(x), V).double()


def _dirichlet(gen: torch.Generator, rows: int) -> torch.Tensor:
    x = -torch.log(torch.rand(rows, V, generator=gen, dtype=torch.float64)) ** 2  # skewed, every entry > 0
    return x / x.sum(-1, keepdim=True)


def emitted(r: torch.Tensor, children: list[torch.Tensor], without_replacement: bool = False,
            out: tuple[int, ...] = ()) -> torch.Tensor:
    """Closed form of the first token a node emits under the rule, with r its target distribution and
    children the q each child is drawn from (one-hot: chosen), summed over the draws. Without
    replacement, children[0] is the one q they all come from, each with the tokens of the children
    before it (`out`) removed and renormalised, as draw_children draws them."""
    if not children:
        return r
    q = children[0]
    if without_replacement:
        q = q.clone()
        q[list(out)] = 0.0
        q /= q.sum()
    result = torch.zeros(V, dtype=torch.float64)
    for x in range(V):
        if q[x] > 0:
            keep = float(sampling.acceptance_probability(r[x], q[x]))
            later = [children[0]] * (len(children) - 1) if without_replacement else children[1:]
            rest = emitted(sampling.residual_distribution(r, q), later, without_replacement, (*out, x))
            result += q[x] * (keep * one_hot(x) + (1 - keep) * rest)
    return result


@pytest.mark.parametrize("children", ["chosen", "drawn", "without replacement"])
def test_closed_form_of_a_node_is_p_and_a_broken_residual_is_not(children, monkeypatch):
    """At any node the rule emits p exactly (float64), for children chosen (one-hot q, EAGLE-2's top k),
    drawn from their own q (SpecInfer) or drawn from one q without replacement (each with its own row:
    draw_children); resampling from r instead of the residual is off by far more."""
    gen = torch.Generator().manual_seed(1)
    for seed in range(20):
        p, qs = _dirichlet(gen, 1)[0], _dirichlet(gen, 3)
        rows = {"chosen": [one_hot(x) for x in (seed % V, (seed + 2) % V, 5)], "drawn": list(qs),
                "without replacement": [qs[0]] * 3}[children]
        torch.testing.assert_close(emitted(p, rows, children == "without replacement"), p, atol=1e-9, rtol=0)
    with monkeypatch.context() as m:
        m.setattr(sampling, "residual_distribution", lambda r, q: r)
        assert (emitted(p, rows, children == "without replacement") - p).abs().max() > 1e-3


def test_children_drawn_without_replacement_follow_sequential_draws():
    """draw_children's first two ids follow q(a) q(b) / (1 - q(a)) (20 000 draws: total variation < 0.03,
    noise alone about 0.02), never repeat, and come with the rows they were drawn from."""
    gen = torch.Generator().manual_seed(3)
    q = _dirichlet(gen, 1)[0].float()
    pairs = Counter()
    for _ in range(20_000):
        ids, rows = sampling.draw_children(q, 3, gen)
        assert len(set(ids.tolist())) == 3
        pairs[tuple(ids[:2].tolist())] += 1
    a, b = ids[:2].tolist()
    torch.testing.assert_close(rows[0], q)
    torch.testing.assert_close(rows[2], q.index_fill(0, torch.tensor([a, b]), 0.0) / (1 - q[a] - q[b]))
    exact = {(a, b): float(q[a] * q[b] / (1 - q[a])) for a in range(V) for b in range(V) if a != b}
    assert 0.5 * sum(abs(pairs[k] / 20_000 - exact[k]) for k in exact) < 0.03
    one_token = torch.zeros(V).index_fill(0, torch.tensor([4]), 1.0)  # support of one token: the rest chosen
    ids, rows = sampling.draw_children(one_token, 3, gen)
    assert ids[0] == 4 and len(set(ids.tolist())) == 3 and (rows.sum(-1) == 1).all()
    assert all(rows[j, ids[j]] == 1 for j in (1, 2))


def run_rule(p, q, tokens, gen, greedy=False):
    return accept_or_resample(p, q, torch.tensor(tokens), gen, greedy, PARENTS)


def tree_draws(p: torch.Tensor, qs: torch.Tensor, n: int, children: str, seed: int = 0):
    """n rounds of the rule on the PARENTS tree: (first token, second token if the first was node 0)."""
    gen = torch.Generator().manual_seed(seed)
    firsts, seconds = Counter(), Counter()
    for _ in range(n):
        if children == "without replacement":  # each parent's children as the EAGLE drafter draws them
            drawn = {parent: sampling.draw_children(qs[parent + 1], PARENTS.count(parent), gen)
                     for parent in dict.fromkeys(PARENTS)}
            tokens = [int(drawn[parent][0][PARENTS[:i].count(parent)]) for i, parent in enumerate(PARENTS)]
            q = torch.stack([drawn[parent][1][PARENTS[:i].count(parent)] for i, parent in enumerate(PARENTS)])
        else:  # children chosen: distinct tokens per parent, q one-hot
            tokens = [0, 3, 1, 2, 5, 4]
            q = torch.stack([one_hot(t) for t in tokens])
        verdict = run_rule(p, q, tokens, gen)
        emitted_ids = [tokens[i] for i in verdict.path] + [verdict.next_token]
        firsts[emitted_ids[0]] += 1
        if verdict.path[:1] == [0]:
            seconds[emitted_ids[1]] += 1
    return firsts, seconds


def tv(counts: Counter, p: torch.Tensor) -> float:
    n = sum(counts.values())
    return 0.5 * sum(abs(counts[x] / n - float(p[x])) for x in range(V))


@pytest.mark.parametrize("children", ["chosen", "without replacement"])  # as the EAGLE drafter proposes them
def test_draws_of_the_tree_rule_follow_p_and_a_broken_residual_does_not(children, monkeypatch):
    """20 000 rounds: the first token follows p at the root, the token after node 0 (when kept) follows
    p at node 0; total variation < 0.025 (sampling noise alone: about 0.006 and 0.012)."""
    gen = torch.Generator().manual_seed(7)
    p, qs = _dirichlet(gen, len(PARENTS) + 1), _dirichlet(gen, len(PARENTS) + 1)
    firsts, seconds = tree_draws(p, qs, 20_000, children)
    assert sum(seconds.values()) > 2000  # node 0 was kept often enough to measure what follows it
    assert tv(firsts, p[0]) < 0.025 and tv(seconds, p[1]) < 0.025, (tv(firsts, p[0]), tv(seconds, p[1]))
    monkeypatch.setattr(rules, "residual_distribution", lambda r, q: r)
    firsts, _ = tree_draws(p, qs, 4_000, children)  # misses by about 0.12; noise at 4 000 rounds about 0.013
    assert tv(firsts, p[0]) > 0.05


def test_greedy_tree_walks_the_argmax_path():
    p = torch.stack([one_hot(x) for x in (3, 4, 0, 0, 0, 0, 2)])  # argmax at root 3, after node 1 (token 3): 0
    tokens = [1, 3, 2, 0, 4, 0]
    q = torch.stack([one_hot(t) for t in tokens])
    verdict = run_rule(p, q, tokens, None, greedy=True)
    # root's children 1, 3, 2: node 1 (token 3) kept; its child node 5 (token 0) is p's argmax there: kept;
    # node 5 has no children: the bonus is p's argmax after it (row 6: token 2)
    assert verdict.path == [1, 5] and verdict.next_token == 2 and verdict.rejected == [0]
    assert verdict.u == [None] * 6 and verdict.accept_probs[1] == 1.0 and verdict.accept_probs[0] == 0.0


def test_a_chain_is_a_tree_of_width_one_draw_for_draw():
    """parents None and the chain's parents give the same verdict with the same generator state."""
    gen = torch.Generator().manual_seed(3)
    p, q = _dirichlet(gen, 4), _dirichlet(gen, 3)
    tokens = torch.tensor([1, 2, 3])
    for seed in range(30):
        a = accept_or_resample(p, q, tokens, torch.Generator().manual_seed(seed))
        b = accept_or_resample(p, q, tokens, torch.Generator().manual_seed(seed), parents=[-1, 0, 1])
        assert (a.path, a.next_token, a.u) == (b.path, b.next_token, b.u)
        assert a.path == list(range(a.n_accepted))


@pytest.mark.parametrize("kind", CACHE_KINDS)
def test_tree_attention_and_the_moved_path_equal_fresh_forwards(random_pair, kind):
    """Each node's logits equal a fresh forward over the prompt and its path; after keeping a path of
    non-consecutive slots (moved together), the next token's logits equal a fresh forward too."""
    model, prompt = random_pair.target, words(1, 2, 3, 4)
    nodes = words(5, 6, 7, 0, 1, 2)  # PARENTS' tokens

    def fresh(ids):
        with torch.inference_mode():
            return model(torch.tensor([ids])).logits[0, -1, : random_pair.vocab_size]

    def path_to(i):
        return [] if i < 0 else path_to(PARENTS[i]) + [i]

    with torch.inference_mode():
        state = KVState(model, 1, kind, random_pair.vocab_size, 32)
        state.prefill([prompt], 0)
        base = state.width
        ids = torch.tensor([[prompt[-1]] + nodes])
        out = state.forward(ids, torch.ones_like(ids, dtype=torch.bool), tree=Tree.of([PARENTS], 7, "cpu"))
        for i in range(-1, len(nodes)):
            torch.testing.assert_close(out.logits[0, i + 1], fresh(prompt + [nodes[j] for j in path_to(i)]))
        kept = path_to(4)  # nodes 0 and 4: slots base+1 and base+5
        state.keep(0, base + 1, base + 7, [base + 1 + j for j in kept])
        state.trim()
        assert state.width == base + 3 and state.lengths.tolist() == [len(prompt) + 2]
        nxt = words(3)
        out = state.forward(torch.tensor([[nxt[0]]]), torch.ones(1, 1, dtype=torch.bool))
        torch.testing.assert_close(out.logits[0, 0], fresh(prompt + [nodes[j] for j in kept] + nxt))


def test_a_tree_made_on_the_device_is_the_one_its_parents_spell():
    """Depths and who sees whom, made with matrix products on the device (so a drafted tree is verified without
    a read) and from host lists on the CPU, both against the definition walked node by node: random trees of up
    to 12 nodes, rows of other sizes (holes: depth 0, seeing only themselves), a chain and a lone root."""
    def walked(row, width):
        depth, seen = [0] * width, [{i} for i in range(width)]
        for i, parent in enumerate(row):
            depth[1 + i] = depth[1 + parent] + 1 if parent >= 0 else 1
            seen[1 + i] |= seen[1 + parent] if parent >= 0 else {0}
        return depth, [[j in s for j in range(width)] for s in seen]

    gen = torch.Generator().manual_seed(0)
    for width in (1, 2, 5, 13):
        rows = [[int(torch.randint(-1, i, (), generator=gen)) for i in range(int(n))]
                for n in torch.randint(0, width, (4,), generator=gen)] + [list(range(-1, width - 2)), []]
        tree = Tree.of(rows, width, torch.device("cpu"))  # on the CPU, from host lists
        padded = [row + [-2] * (width - 1 - len(row)) for row in rows]
        doubled = Tree._by_doubling(torch.tensor(padded, dtype=torch.long))
        for b, row in enumerate(rows):
            depth, visible = walked(row, width)
            for made in (tree, doubled):
                assert made.depth[b].tolist() == depth and made.visible[b].tolist() == visible, (width, row)
        assert tree.depth.dtype == doubled.depth.dtype and tree.visible.dtype == doubled.visible.dtype


def test_tree_shape_and_validation():
    assert draft_width(Settings(gamma=3)) == 3
    assert draft_width(Settings(gamma=3, branch=2, drafter="eagle")) == 2 + 2 * 4
    assert draft_width(Settings(gamma=5, branch=4, nodes=15, drafter="eagle")) == 15
    with pytest.raises(ValueError, match="drafts chains"):
        Settings(branch=2, drafter="model").validate()
    with pytest.raises(ValueError, match="branch"):
        Settings(branch=0, drafter="eagle").validate()
    with pytest.raises(ValueError, match="nodes"):
        Settings(branch=2, nodes=64, drafter="eagle").validate()


def test_a_tree_label_reads_back_as_its_shape():
    shapes = [(4, 4, 8), (3, 2, 0), (1, 5, 3)]
    assert parse_trees(",".join(tree_label(*s) for s in shapes)) == shapes
    assert parse_trees(" 3x2 , ,5x4:16") == [(3, 2, 0), (5, 4, 16)]  # nodes left out: all; blanks skipped
    for bad in ("3x", "3:2", "3x2:y", "3x2x4"):
        with pytest.raises(ValueError, match="γxbranch:nodes"):
            parse_trees(bad)


def test_a_copied_branch_joins_the_tree_within_the_budget():
    def prop(tokens, parents, scores):
        q = torch.zeros(len(tokens), 10).scatter_(1, torch.tensor(tokens)[:, None], 1.0)
        return Proposal(torch.tensor(tokens), q, torch.log(q), parents=parents, scores=scores)

    tree = prop([4, 5, 6, 7], [-1, -1, 0, 0], [0.5, 0.3, 0.2, 0.1])
    chain = Proposal(torch.tensor([4, 8, 9]), torch.zeros(3, 10).scatter_(1, torch.tensor([[4], [8], [9]]), 1.0))
    merged = graft(tree, chain, budget=4)
    # 4 is shared, 8 and 9 hang below it; two nodes over the budget: the least likely leaves, 7 then 6, go
    assert merged.tokens.tolist() == [4, 5, 8, 9] and merged.parents == [-1, -1, 0, 2]
    assert merged.q[3, 9] == 1 and merged.logits[3, 9] == 0 and merged.source == "lookup"


def random_head_pair(random_pair, draft_words=(0, 1, 2, 5, 6)):
    target, vocab = random_pair.target, random_pair.vocab_size
    torch.manual_seed(0)
    head = EagleHead(HeadConfig.for_target(target, [word_id(k) for k in draft_words], vocab, 16))
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return dataclasses.replace(random_pair, head=head.to(random_pair.dtype).bind(target, vocab), head_name="random")


def test_the_head_drafts_a_tree_whose_greedy_path_is_the_chain(random_pair):
    """γ = 2, branch 3, every node kept: the tree holds the chain's two drafts with the same q (siblings fed
    together do not see each other), and its nodes are the head's 3 likeliest at each fed node."""
    pair = random_head_pair(random_pair)
    base = Settings(gamma=2, drafter="eagle", max_new_tokens=3, record_top=0)
    chain = generate(pair, "", base, prompt_ids=words(1, 2, 3)).events[0]
    tree = generate(pair, "", dataclasses.replace(base, branch=3), prompt_ids=words(1, 2, 3)).events[0]
    assert len(tree.drafted) == 3 + 3 * 3 and tree.parents[:3] == [-1, -1, -1]
    greedy = [0] + [i for i in range(3, 12) if tree.parents[i] == 0]  # the top child, then its children
    assert [tree.drafted[i].id for i in greedy[:1]] == [chain.drafted[0].id]
    second = next(i for i in greedy[1:] if tree.drafted[i].id == chain.drafted[1].id)
    assert abs(tree.drafted[second].q - chain.drafted[1].q) < 1e-9
    scores = [t.score for t in tree.drafted]
    assert all(scores[i] <= scores[p] + 1e-12 for i, p in enumerate(tree.parents) if p >= 0)


def test_a_sampled_tree_is_chains_and_drafts_no_level_its_budget_cannot_keep(random_pair, monkeypatch):
    """Sampled, 3 deep, 2 children, 4 nodes: two chains (the root's two children drawn without replacement,
    one child drawn under each) of two, so the head steps twice a round (the catch-up and one fed level),
    not three times; greedy, whose nodes are chosen by score from every level, steps three times."""
    pair = dataclasses.replace(random_head_pair(random_pair), eos_token_ids=set())  # rounds to spare
    steps = []
    step = EagleHead.step
    monkeypatch.setattr(EagleHead, "step", lambda self, *a, **k: steps.append(1) or step(self, *a, **k))
    for temperature, per_round in ((1.0, 2), (0.0, 3)):
        settings = Settings(gamma=3, branch=2, nodes=4, drafter="eagle", temperature=temperature, max_new_tokens=40)
        rounds = decode(pair, [words(1, 2, 3)], settings)
        for _ in range(3):  # rounds with room for all three levels
            steps.clear()
            ((_, event),) = next(rounds)
            assert len(steps) == per_round and len(event.drafted) == 4
            if temperature:
                assert event.depths == [1, 1, 2, 2] and sorted(event.parents[2:]) == [0, 1]
        rounds.close()


@pytest.mark.parametrize("kind", CACHE_KINDS)
def test_greedy_trees_equal_the_baseline(random_pair, kind):
    pair = random_head_pair(random_pair)
    settings = Settings(gamma=3, drafter="eagle", max_new_tokens=24, cache=kind, record_top=2)
    base = generate(pair, "", settings, mode="baseline", prompt_ids=words(1, 2, 3)).token_ids
    for branch, nodes, drafter in ((2, 0, "eagle"), (3, 5, "eagle"), (2, 4, "lookup+eagle")):
        run = generate(pair, "", dataclasses.replace(settings, branch=branch, nodes=nodes, drafter=drafter),
                       prompt_ids=words(1, 2, 3, 1, 2))
        base_run = generate(pair, "", settings, mode="baseline", prompt_ids=words(1, 2, 3, 1, 2))
        assert run.token_ids == base_run.token_ids, (branch, nodes, drafter)
        assert all(len(e.drafted) <= (nodes or 99) + 3 for e in run.events)
    assert base  # the first prompt decodes too
    again = runs_from_json(runs_to_json([run]))[0]
    assert again.events[1].parents == run.events[1].parents and again.token_ids == run.token_ids


def test_a_trace_with_a_broken_tree_is_refused(random_pair):
    pair = random_head_pair(random_pair)
    run = generate(pair, "", Settings(gamma=2, branch=2, drafter="eagle", max_new_tokens=4), prompt_ids=words(1, 2))
    data = run.to_dict()
    data["events"][0]["parents"][0] = 3
    with pytest.raises(ValueError, match="parents"):
        Run.from_dict(data)


@pytest.mark.slow
@pytest.mark.parametrize(("drafter", "nodes", "prompt"), [("eagle", 0, (1, 2)), ("eagle", 2, (1, 2)),
                                                       ("lookup+eagle", 3, (1, 2, 1))])
def test_sampled_trees_follow_the_target(random_pair, drafter, nodes, prompt):
    """A random head, branch 3 (three chains: the root's children drawn without replacement, one drawn below
    each), every node kept or a budget of 2 (the rest dropped), or 3 with prompt lookup's copied branch
    grafted on: 20 000 runs, the first two tokens follow the target's exact law (total variation < 0.03,
    noise alone about 0.015).
    Dropping drawn nodes by their own value (keeping the likeliest) misses by far more at the budget of 2:
    what is kept is then no draw from q."""
    pair = random_head_pair(random_pair)
    params = SamplingParams(0.9, top_k=7, top_p=0.95)
    prompt = words(*prompt)
    exact = exact_baseline_distribution(pair, prompt, params)
    n = 20_000
    settings = Settings(gamma=2, branch=3, nodes=nodes, temperature=0.9, top_k=7, top_p=0.95, max_new_tokens=2,
                        record_top=0, drafter=drafter)
    runs = seeded_runs(pair, prompt, settings, n)
    assert sum(e.n_accepted for events in runs for e in events) > 1000  # the rule ran both ways
    assert sum(e.n_rejected > 1 for events in runs for e in events) > 500  # often past the first child
    counts = Counter(tuple([t for e in events for t in e.new_tokens][:2]) for events in runs)
    tv2 = 0.5 * sum(abs(counts[k] / n - exact[k]) for k in exact)
    assert tv2 < 0.03, f"total variation {tv2:.4f}"


@pytest.mark.parametrize("arch", ARCHS[:1])
def test_a_trained_head_keeps_more_per_round_as_a_tree(eagle_pair, arch):
    """On the pattern target the head's tree keeps at least as many tokens per round as its chain, and
    both decode the baseline's text."""
    pair = eagle_pair(arch)
    settings = Settings(gamma=3, drafter="eagle", max_new_tokens=32)
    base = generate(pair, "", settings, mode="baseline", prompt_ids=words(4, 5, 6)).token_ids
    chain = generate(pair, "", settings, prompt_ids=words(4, 5, 6))
    tree = generate(pair, "", dataclasses.replace(settings, branch=3, nodes=8), prompt_ids=words(4, 5, 6))
    assert chain.token_ids == tree.token_ids == base
    assert tree.tokens_per_round >= chain.tokens_per_round


def test_the_tree_is_drawn_and_stepped_level_by_level(random_pair):
    """The figure of a tree round: the kept path green, the rejected red, the target's token hanging from the
    path's end; in step mode the levels appear one by one and outcomes only once decided. A chain draws as a
    tree of one branch."""
    from specviz.view import charts
    from specviz.view.stages import DRAFT, round_stages, tree_view

    pair = random_head_pair(random_pair)
    run = generate(pair, "", Settings(gamma=3, branch=3, drafter="eagle", max_new_tokens=48, temperature=1.0),
                   prompt_ids=words(1, 2, 3))
    event = next(e for e in run.events if e.n_accepted and e.n_rejected)
    fig = charts.token_tree(event)
    names = {t.get("name") for t in fig["data"]}
    assert {"kept", "rejected", "last kept token", event.extra.kind} <= names
    accepted = next(t for t in fig["data"] if t.get("name") == "kept")
    assert accepted["x"] == list(range(1, event.n_accepted + 1))  # the kept path, one per depth
    assert "as a tree" in fig["layout"]["title"]["text"] and "chance kept" in accepted["hovertext"][0]
    stages = round_stages(event, run.meta)
    levels = [s for s in stages if s.kind == DRAFT]
    assert len(levels) == max(event.depths) and levels[0].caption.startswith("Depth 1 of the tree")
    first = charts.token_tree(event, *tree_view(levels[0]))
    drawn = [t for t in first["data"] if t.get("name") == "drafted"]
    assert len(drawn) == 1 and len(drawn[0]["x"]) == event.depths.count(1)  # the first level only, undecided
    assert not {"kept", "rejected", event.extra.kind} & {t.get("name") for t in first["data"]}
    chain = generate(pair, "", Settings(gamma=3, drafter="eagle", max_new_tokens=8), prompt_ids=words(1, 2, 3))
    drafted = next(e for e in chain.events if e.drafted)
    assert "as a chain" in charts.token_tree(drafted)["layout"]["title"]["text"]


def test_the_exact_check_of_a_tree_round_matches_p_and_shows_a_broken_rule(random_pair):
    """The app's exact check on a sampled tree: the first level's three children tried in order, in closed form."""
    from specviz.tools.lossless import exact_check, first_round_distributions

    pair = random_head_pair(random_pair)
    settings = Settings(gamma=2, branch=3, temperature=1.0, top_p=0.9, drafter="eagle")
    _, qs = first_round_distributions(pair, words(1, 2, 1), settings)
    # three children drawn from the head's q without replacement: each from q without the ones before it
    assert len(qs) == 3 and all(0 < float(q.max()) < 1.0 for q in qs)
    for j in (1, 2):
        out = (qs[j] == 0) & (qs[0] > 0)  # the earlier children's tokens, and nothing else
        assert int(out.sum()) == j and torch.allclose(qs[j][~out], qs[0][~out] / qs[0][~out].sum())
    check = exact_check(pair, "w1 w2 w1", settings, chat_template=False)
    assert check.drafted and check.max_diff < 1e-9
    assert check.broken_max_diff > 1e3 * max(check.max_diff, 1e-15) and 0 < check.first_draft_kept <= 1


def test_batch_rows_of_trees_decode_what_single_runs_decode(random_pair):
    """Rows of different lengths, each with its own tree per round (padded with holes), keep their own paths."""
    from specviz.core.generator import generate_batch

    pair = random_head_pair(random_pair)
    settings = Settings(gamma=3, branch=2, nodes=5, drafter="lookup+eagle", max_new_tokens=16)
    prompts = [words(1, 2, 3), words(4, 5, 6, 7, 4, 5), words(2)]
    rows = generate_batch(pair, [""] * 3, settings, prompts_ids=prompts)
    for row, ids in zip(rows, prompts, strict=True):
        assert row.token_ids == generate(pair, "", settings, prompt_ids=ids).token_ids
