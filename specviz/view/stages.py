"""One round in stages, for stepping through it in a classroom (Leviathan et al. 2023, Algorithm 1).

A speculative round is five steps: the drafter proposes γ tokens with q; the target scores them
all in one forward pass (p at γ + 1 positions); each draft in turn is kept with probability
min(1, p/q) (greedy: while it equals the target's argmax); the target adds one token (a
correction from the residual norm(max(0, p − q)) after a rejection, else a bonus from the last
p); both caches roll back past what was rejected. `round_stages` cuts a recorded `RoundEvent`
into the stages a viewer steps through (each draft, the verify pass, each decision, the added
token), and the HTML functions show a round as it stands at a stage. Everything here reads the
event alone, so a replayed trace steps exactly like a live run.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

from ..core.events import ACCEPTED, BONUS, CORRECTION, REJECTED, RoundEvent, RunMeta

DRAFT, VERIFY, DECIDE, ADD = "draft", "verify", "decide", "add"
# what a viewer reads for each draft's fate, the same word in the table, the tree chart and the stream: a draft the
# rule never tried (after a chain's first rejection, off a tree's kept path, after a kept end-of-text) was scored by
# the verify pass like every other, so it is "not reached", neither rejected nor unverified
NOT_REACHED = "not reached"
VERDICT = {ACCEPTED: "kept", REJECTED: "rejected"}
ADDED_NAME = {CORRECTION: "a correction", BONUS: "a bonus", "target": "the target's"}
STEP_OF = {DRAFT: 1, VERIFY: 2, DECIDE: 3, ADD: 4}  # which of the five steps a stage belongs to
STEP_NAME = {DRAFT: "draft", VERIFY: "verify", DECIDE: "accept or reject", ADD: "add one token"}


@dataclass(frozen=True)
class Stage:
    kind: str  # "draft" | "verify" | "decide" | "add"
    position: int  # the draft position (0-based) for "draft" and "decide"; -1 otherwise
    caption: str  # what the viewer sees happen, with this round's numbers


def _tok(text: str) -> str:
    return repr(text)


def verdict(status: str) -> str:
    """A draft's fate in the viewer's words: kept, rejected or not reached."""
    return VERDICT.get(status, NOT_REACHED)


def depth_of(event: RoundEvent) -> int:
    """γ of a round: how deep its drafts go (a chain's length; a tree's levels)."""
    return max(event.depths, default=0)


def _name(event: RoundEvent, i: int) -> str:
    """d3 in a chain; d4 (depth 2) in a tree, where a node's index and its depth differ."""
    return f"d{i + 1} (depth {event.depths[i]})" if event.parents else f"d{i + 1}"


def drafts_text(event: RoundEvent, asked: int | None = None) -> str:
    """'γ = 3 drafts' for a chain, 'a tree 3 deep (γ = 3) of 5 drafts' for a tree; where the round drafted less
    deep than the γ asked (prompt lookup found less, a sampled tree's budget, a policy), '(3 asked)' too."""
    n, depth = len(event.drafted), depth_of(event)
    also = f", {asked} asked" if asked is not None and asked != depth else ""
    if event.parents:
        return f"a tree {depth} deep (γ = {depth}{also}) of {n} draft{'s' * (n != 1)}"
    return f"γ = {n} draft{'s' * (n != 1)}" + (f" ({asked} asked)" if also else "")


def tree_levels(event: RoundEvent) -> list[list[int]]:
    """The drafted nodes by depth (a chain: one per level)."""
    levels: list[list[int]] = []
    for i, d in enumerate(event.depths):
        if d > len(levels):
            levels.append([])
        levels[d - 1].append(i)
    return levels


def tree_view(stage: Stage | None) -> tuple[int | None, int | None]:
    """(depth shown, last node decided) of the round's tree at a stage (charts.token_tree)."""
    if stage is None or stage.kind == ADD:
        return None, None
    if stage.kind == DRAFT:
        return stage.position + 1, -1
    return None, stage.position if stage.kind == DECIDE else -1


def stage_label(event: RoundEvent, stages: list[Stage], stage: int) -> str:
    """'Round 2, stage 3 (accept or reject)': no count of the stages to come, since it tells the outcome (a round
    that stops at its first rejection has fewer); the last stage says it is the last ('stage 5 of 5')."""
    of = f" of {len(stages)}" if stage == len(stages) - 1 else ""
    return f"Round {event.index + 1}, stage {stage + 1}{of} ({STEP_NAME[stages[stage].kind]})"


def round_stages(event: RoundEvent, meta: RunMeta) -> list[Stage]:
    """The stages of a round, in the order they happen."""
    greedy = meta.sampling.greedy
    one_hot = greedy or meta.draft_greedy
    copied = meta.drafter == "lookup" or event.drafted_by == "lookup"
    stages = []
    tree = bool(event.parents)
    for i, t in enumerate(event.drafted if not tree else []):
        how = ("copied from where the text's last tokens occurred before (prompt lookup)" if copied
               else "its most likely token" if one_hot else "a token sampled from q")
        stages.append(Stage(DRAFT, i, f"The drafter proposes d{i + 1} = {_tok(t.text)}, {how} "
                                      f"(q = {t.q:.3f})."))
    for level, nodes in enumerate(tree_levels(event) if tree else []):
        shown = ", ".join(_tok(event.drafted[i].text) for i in nodes[:6]) + (", …" if len(nodes) > 6 else "")
        stages.append(Stage(DRAFT, level, f"Depth {level + 1} of the tree: {len(nodes)} draft(s), the likeliest "
                                          f"continuations of the nodes above ({shown})."))
    if event.drafted:
        shape = " (a tree: each node attends to the text and its own ancestors only)" if tree else ""
        stages.append(Stage(VERIFY, -1, f"The target runs once over the last token and the {len(event.drafted)} "
                                        f"draft(s){shape}: p at {len(event.drafted) + 1} positions in one forward "
                                        "pass."))
    else:
        stages.append(Stage(VERIFY, -1, "Nothing drafted this round: one plain target forward pass."))
    for i, t in enumerate(event.drafted):
        if t.status not in (ACCEPTED, REJECTED):
            continue
        if greedy:
            test = (f"it is the target's most likely token (p = {t.p:.3f})" if t.status == ACCEPTED
                    else f"the target's most likely token is another (p(d{i + 1}) = {t.p:.3f})")
        elif tree:
            sign = "<" if t.status == ACCEPTED else "≥"
            test = (f"u = {t.u:.3f} {sign} {t.accept_prob:.3f}, its chance to be kept (p = {t.p:.3f}, less what "
                    "the siblings tried before it took)")
        else:
            sign = "<" if t.status == ACCEPTED else "≥"
            test = f"u = {t.u:.3f} {sign} min(1, p/q) = min(1, {t.p:.3f}/{t.q:.3f}) = {t.accept_prob:.3f}"
        stages.append(Stage(DECIDE, i, f"{_name(event, i)} = {_tok(t.text)}: {test}, so it is {verdict(t.status)}."))
    x = event.extra
    if x is None:
        stages.append(Stage(ADD, -1, "An accepted draft was the end-of-text token: the text ends there, nothing "
                                     "is added."))
    elif x.kind == CORRECTION:
        n, end = event.n_accepted, event.path[-1] if event.path else -1
        # the children of the kept path's end: those rejected elsewhere were siblings of a kept node
        rejected = [i for i, t in enumerate(event.drafted) if t.status == REJECTED and event.tree[i] == end]
        source = "the target's own most likely token" if greedy else "a sample from the residual norm(max(0, p − q))"
        what = (f"{'No' if not n else 'After the kept path, no'} child tried at depth {n + 1} was kept "
                f"({', '.join(_name(event, i) for i in rejected)} rejected)" if tree else f"d{n + 1} was rejected")
        unreached = sum(t.status not in (ACCEPTED, REJECTED) for t in event.drafted)
        rest = f", and {unreached} draft{'s' * (unreached != 1)} {NOT_REACHED}" if unreached else ""
        stages.append(Stage(ADD, -1, f"{what}: {source} takes its place, {_tok(x.text)} "
                                     f"(p = {x.p:.3f}){rest}."))
    elif x.kind == BONUS:
        n, total = event.n_accepted, len(event.drafted)
        kept = ("The draft was kept" if total == 1 else f"All {total} drafts were kept") if n == total else (
            f"The kept path ({n} of the {total} drafts) ends where the tree has no drafts below it")
        stages.append(Stage(ADD, -1, f"{kept}: the target's p after the last kept draft gives a bonus token for "
                                     f"free: {_tok(x.text)} (p = {x.p:.3f})."))
    else:
        stages.append(Stage(ADD, -1, f"The target's token: {_tok(x.text)} (p = {x.p:.3f})."))
    return stages


def _cell(value: str, shown: bool, current: bool = False, kind: str = "") -> str:
    classes = " ".join(c for c in ("sv-cur" if current else "", f"sv-{kind}" if kind and shown else "") if c)
    attr = f' class="{classes}"' if classes else ""
    return f"<td{attr}>{html.escape(value) if shown else '·'}</td>"


def stage_html(event: RoundEvent, meta: RunMeta, stage: int) -> str:
    """The round as it stands after `stage` (0-based): a column per drafted position plus the
    added token; rows for the token, q, p, the test and the verdict, filled in as they happen."""
    stages = round_stages(event, meta)
    stage = max(0, min(stage, len(stages) - 1))
    now = stages[stage]
    drafted_upto = max([s.position for s in stages[: stage + 1] if s.kind == DRAFT], default=-1)
    verified = any(s.kind == VERIFY for s in stages[: stage + 1])
    decided = {s.position for s in stages[: stage + 1] if s.kind == DECIDE}
    added = now.kind == ADD
    greedy = meta.sampling.greedy
    head = "".join(f"<th>d{i + 1}</th>" for i in range(len(event.drafted)))
    head += f"<th>{'added' if event.drafted else 'target'}</th>"
    tree = bool(event.parents)
    # a sampled tree's chance to keep a child is p less what the siblings tried before it took, over q: not p/q
    test_row = "greedy test" if greedy else "chance kept vs u" if tree else "min(1, p/q) vs u"
    rows: dict[str, list[str]] = {**({"depth": []} if tree else {}), "token": [], "q (draft)": [], "p (target)": [],
                                  test_row: [], "verdict": []}
    level = event.depths  # a chain's drafts are one per depth: its draft stages are its positions
    for i, t in enumerate(event.drafted):
        drafted = level[i] <= drafted_upto + 1
        here = (now.position == i and now.kind == DECIDE) or (now.kind == DRAFT and level[i] == now.position + 1)
        if tree:
            rows["depth"].append(_cell(str(level[i]), True))
        rows["token"].append(_cell(_tok(t.text), drafted, here and now.kind == DRAFT))
        rows["q (draft)"].append(_cell(f"{t.q:.3f}", drafted))
        rows["p (target)"].append(_cell(f"{t.p:.3f}", verified, now.kind == VERIFY))
        test = ("argmax" if t.status == ACCEPTED else "not argmax") if greedy else (
            f"{t.accept_prob:.3f} vs {t.u:.3f}" if t.u is not None else "–")
        rows[test_row].append(_cell(test, i in decided, here and now.kind == DECIDE))
        shown = i in decided or (added and t.status not in (ACCEPTED, REJECTED))
        rows["verdict"].append(_cell(verdict(t.status), shown, kind=t.status if shown else ""))
    x = event.extra
    if tree:
        rows["depth"].append(_cell("", False))
    rows["token"].append(_cell(_tok(x.text) if x else "(end)", added, added, kind=x.kind if x else ""))
    rows["q (draft)"].append(_cell("" if x is None or x.q is None else f"{x.q:.3f}", added))
    rows["p (target)"].append(_cell("" if x is None else f"{x.p:.3f}", added))  # which token it is: drawn last
    rows[test_row].append(_cell("", False))
    rows["verdict"].append(_cell(x.kind if x else "", added, kind=x.kind if x else ""))
    body = "".join(f"<tr><th>{html.escape(name)}</th>{''.join(cells)}</tr>" for name, cells in rows.items())
    caption = f"{stage_label(event, stages, stage)}: {now.caption}"
    return (f'<div class="sv-stage"><div class="sv-stage-caption">{html.escape(caption)}</div>'
            f'<table class="sv-stage-table"><tr><th></th>{head}</tr>{body}</table></div>')


def how_it_works_html(event: RoundEvent, meta: RunMeta, stage: int) -> str:
    """The five steps of a round, this round's numbers filled in up to `stage`, its step marked."""
    stages = round_stages(event, meta)
    stage = max(0, min(stage, len(stages) - 1))
    now, done = stages[stage], stages[: stage + 1]
    reached = max(STEP_OF[s.kind] for s in done) + (1 if now.kind == ADD else 0)  # rollback comes with the add
    greedy = meta.sampling.greedy
    drafted = event.drafted
    upto = max([s.position for s in done if s.kind == DRAFT], default=-1)
    shown = [t for t, d in zip(drafted, event.depths, strict=True) if d <= upto + 1]
    decisions = [f"{_name(event, s.position)} {verdict(drafted[s.position].status)}" for s in done
                 if s.kind == DECIDE]
    x = event.extra
    if event.parents:  # the rule walks the tree: a node's children in order, down from the first one kept
        rule = ("from the last kept token, keep the child that equals the target's most likely token and go on "
                "from it; stop where no child does" if greedy else
                "from the last kept token, try its children in order, keeping one if u < its chance (p less what "
                "the siblings tried before it took, over q); go on from the kept child, stop where none is kept")
    else:
        rule = ("for each draft in order, keep it while it equals the target's most likely token" if greedy else
                "for each draft in order, keep it if u < min(1, p/q), with u uniform on [0, 1)")
        rule += "; stop at the first rejection"
    steps = [
        ("Draft", f"the drafter proposes {drafts_text(event, meta.gamma if meta.gamma_policy == 'fixed' else None)}: "
                  + (", ".join(f"{_tok(t.text)} (q = {t.q:.2f})" for t in shown) or "…")),
        ("Verify", "one target forward pass over the last token and the drafts gives p at every position: "
                   + ", ".join(f"p(d{i + 1}) = {t.p:.2f}" for i, t in enumerate(drafted))
                   if drafted else "nothing drafted: one plain target step"),
        ("Accept or reject", f"{rule}: " + (", ".join(decisions) or "nothing to test")),
        ("Add one token", "nothing (an accepted end-of-text)" if x is None else
                          f"{ADDED_NAME[x.kind]} token {_tok(x.text)} (p = {x.p:.2f})"),
        ("Roll back", f"{event.n_accepted + (x is not None)} token(s) join the text; the caches forget the rest: "
                      f"target cache {event.target_cache_len} tokens"
                      + (f", draft cache {event.draft_cache_len}" if event.draft_cache_len else "")),
    ]
    items = []
    for number, (name, text) in enumerate(steps, start=1):
        state = "sv-now" if number == STEP_OF[now.kind] or (now.kind == ADD and number == 5) else ""
        body = html.escape(text) if number <= reached else "…"
        items.append(f'<li class="{state}"><b>{name}</b>: {body}</li>')
    return f'<ol class="sv-how">{"".join(items)}</ol>'
