"""The draft planner: every rule that decides how much each request drafts in a step.

Each step, the draft depth of every request that maximises the expected tokens per second
of the whole step, zero included, from two live estimates measured while serving: what a
step and a draft level cost (:mod:`.cost_model`) and how often each draft position is
accepted (:mod:`.acceptance`). :mod:`.depth_choice` prices the choices; the planner runs it
before drafting (drafting time counted) and on the proposals (to trim each to the depth its
own kind earns). Where a drafter may grow a chain instead of its dynamic tree, each request
gets whichever pays more by its own estimates; where a method has a lookup drafter, its
draft replaces the method's where it pays as much (:meth:`DraftPlanner.prefer_lookup`),
and the lookup is asked where asking pays (:mod:`.lookup_worth`). The gains it prices are
scaled, position by position, by what the target accepted of the drafts verified against
what was expected of them (:class:`.acceptance.AcceptanceCalibration`): drafts are
verified where their estimates are high, so these estimates err high. Requests kept from
drafting are probed from a budget (:mod:`.probe_budget`), each probe priced with the
tokens its drafter catches up on (a drafter reading the target's states runs every row it
missed); a batch kept entirely from drafting goes a few steps without planning
(:data:`REST_STEPS`), since its estimates change only with verified drafts. Until a few
drafts were verified, one request a step verifies its draft, since the batch's acceptance
is a guess until then. The runs behind these rules: "Speculation that never loses" in the
benchmark diary (``git show dd80fd5:BENCHMARKS.md``).
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Hashable

import attrs

from ...config import SpeculativeConfig
from ...drafting.interface import TREE_KIND, first_child_path, is_lookup_kind
from .acceptance import AcceptanceCalibration, AcceptanceSpread, AcceptanceStats
from .cost_model import FixedCosts, StepCostModel
from .depth_choice import DraftOption, StepLoad, StepShape, attention_work, best_depths
from .lookup_worth import LookupWorth
from .probe_budget import ProbeBudget

#: drafts the engine verifies, one request a step, before a batch verifies drafts on the
#: acceptance it guesses
COLD_START_DRAFTS = 4

#: steps a batch that plan() kept entirely from drafting goes without planning, while its
#: requests stay the same: its estimates change only when drafts are verified
REST_STEPS = 4


def _nodes_by_depth(prop) -> list[int]:
    """The target tokens ``prop`` adds verified to each depth ``0..prop.depth`` (its aux
    tokens go with any depth)."""
    node_depths = prop.depths()
    return [0] + [sum(d <= j for d in node_depths) + len(prop.aux_token_ids) for j in range(1, prop.depth + 1)]


@attrs.define
class RequestDraftState:
    """What the planner keeps of one request."""

    stats: AcceptanceStats | None = None  # its own acceptance, leaning on the engine-wide estimate
    steps_without_drafts: int = 0  # decode steps since a draft was last verified
    probe_after: int = 0  # steps without drafts before the next probe (0: the planner's default)
    last_warm_up: int = -1  # serial number of its last aux-only warm-up (the oldest runs first)
    recent_acceptance: deque = attrs.Factory(lambda: deque(maxlen=64))  # accepted share of each recent draft
    paused_until: int = 0  # decode step at which a low-acceptance pause ends
    drafted_at: int = 0  # its tokens when its drafter was last asked (the drafter has seen them)
    block: list = attrs.Factory(lambda: [0, 0])  # its unfinished block of drafts (:class:`AcceptanceSpread`)


@attrs.frozen
class LowAcceptancePause:
    """A request whose mean accepted share over its last ``window`` drafts falls below
    ``min_rate`` stops drafting for ``retry_after`` steps (``min_acceptance_rate``)."""

    min_rate: float
    window: int
    retry_after: int


class DraftPlanner:
    """Every rule that decides how much a request drafts in a step, and the state they need.

    The fixed rules: the configured shape for the batch size (``draft_len_schedule``), the
    room left in the request and the context, the scheduler's allowance, and the
    low-acceptance pause. With ``adaptive`` on, the depth that maximises the step's
    expected tokens per second (see the module docstring), probes included.

    ``stats`` is the engine-wide acceptance, the prior of every request's own; ``costs``
    the step and drafting costs (learnt from the clock unless given); ``probes`` the probe
    budget; ``aux_tokens`` the mean number of aux tokens a proposal brings (lookahead's
    window), which drafting costs in the target forward whatever depth is verified;
    ``min_rows`` the rows the target's forward runs at least (2 where a lone token runs
    twice): a step's tokens are priced and observed as at least that many, so that the
    first draft token of a lone decode costs what it does there, no matrix row.
    """

    def __init__(self, nodes_for_depth: Callable[[int], int], probe_interval: int, probe_share: float = 0.03,
                 chain_or_tree: bool = False, adaptive: bool = True,
                 shape_for_batch: Callable[[int], tuple[int, int]] | None = None,
                 pause: LowAcceptancePause | None = None, costs: StepCostModel | FixedCosts | None = None,
                 padded_attention: bool = False, tree_batch: bool = False, min_rows: int = 1,
                 lookup_shape_for_batch: Callable[[int], tuple[int, int]] | None = None):
        self.nodes_for_depth = nodes_for_depth
        self.min_rows = min_rows
        self.shape_for_batch = shape_for_batch
        self.lookup_shape_for_batch = lookup_shape_for_batch
        self.adaptive = adaptive
        self.pause = pause
        self.chain_or_tree = chain_or_tree
        self.probes = ProbeBudget(probe_interval, probe_share)
        self.costs = costs if costs is not None else StepCostModel()
        self.padded_attention = padded_attention
        self.tree_batch = tree_batch
        self.stats = AcceptanceStats(decay=0.99, prior_weight=2.0)
        self.spread = AcceptanceSpread()
        self.calibration = AcceptanceCalibration()
        self.aux_tokens = 0.0
        self.requests: dict[str, RequestDraftState] = {}
        self._probing: set[int] = set()  # ids of the requests plan() asked for a probe this step
        self.rest_steps = REST_STEPS
        self._counted_off: set[int] = set()  # ids of the requests counted without drafts this step
        #: whether asking the lookup drafter pays (:mod:`.lookup_worth`)
        self.lookup_worth = LookupWorth()
        self._rest: tuple[tuple[str, ...], int] | None = None  # (requests, steps left) of a batch kept from drafting
        self.num_verified = 0  # drafts verified since the engine started
        self.num_warm_ups = 0
        #: how many observations the engine-wide estimate weighs as in a request's own
        #: (:class:`AcceptanceStats`): lower lets a request's own failures count sooner but
        #: makes its estimate noisier. Set from how far requests' acceptance is seen to
        #: differ (:attr:`spread`); ``spread.high=3`` in ``scripts/ab_planner.py`` pins it.
        self.request_prior_weight = self.spread.low

    @classmethod
    def for_config(cls, spec: SpeculativeConfig, padded_attention: bool, tree_batch: bool,
                   min_rows: int = 1) -> DraftPlanner:
        """The planner of an engine speculating with ``spec`` whose attention pads groups
        of sequences (``padded_attention``) and runs a step's draft trees as a batch of their
        own (``tree_batch``): see :mod:`.depth_choice`; ``min_rows`` as in the class."""
        pause = (LowAcceptancePause(spec.min_acceptance_rate, spec.acceptance_window, spec.retry_after)
                 if spec.min_acceptance_rate > 0 else None)
        # the config is frozen: its shapes are worked out once per depth and batch size
        lookup = functools.cache(spec.lookup.draft_shape_for_batch) if spec.lookup is not None else None
        return cls(functools.cache(spec.nodes_for_depth), spec.probe_interval, chain_or_tree=spec.chain_or_tree,
                   adaptive=spec.is_adaptive, shape_for_batch=functools.cache(spec.draft_shape_for_batch),
                   pause=pause, padded_attention=padded_attention, tree_batch=tree_batch, min_rows=min_rows,
                   lookup_shape_for_batch=lookup)

    # -- before drafting ----------------------------------------------------------------

    def step_shape(self, prefills: list, decodes: list) -> StepShape:
        """The step's sequences before drafts (prefill items, decoding requests), as the
        planner prices them."""
        return StepShape([(it.start, len(it.tokens)) for it in prefills] + [(r.num_computed, 1) for r in decodes],
                         padded=self.padded_attention, tree_batch=self.tree_batch)

    def draft_budget(self, batch_size: int) -> int:
        """Draft nodes the scheduler keeps room for per decoding request (the method's or
        its lookup's, whichever is more)."""
        shapes = [self.shape_for_batch] + ([self.lookup_shape_for_batch] if self.lookup_shape_for_batch else [])
        return max(shape(max(batch_size, 1))[1] for shape in shapes)

    def _caps(self, reqs: list, allowances: list[int], shape: tuple[int, int], max_model_len: int
              ) -> list[tuple[int, int]]:
        """(depth, nodes) of ``shape`` within the scheduler's allowance and the room left in
        each request and the context; none while the request is paused."""
        depth, nodes = shape
        caps = []
        for req, allowance in zip(reqs, allowances):
            room = min(req.sampling_params.max_tokens - req.num_output_tokens,
                       max_model_len - len(req.token_ids)) - 1
            d = 0 if self._paused(req) else max(0, min(depth, room, allowance))
            caps.append((d, min(nodes, allowance) if d else 0))
        return caps

    def lookup_shapes(self, reqs: list, allowances: list[int], batch_size: int, max_model_len: int,
                      shape: StepShape) -> list[tuple[int, int]]:
        """The (depth, nodes) to ask each request's lookup drafter for: its configured shape
        within the same bounds as the method's, none where asking does not pay this step
        (:mod:`.lookup_worth`); the planner prices what it proposes (:meth:`prefer_lookup`, :meth:`trim`)."""
        if self.adaptive and not self.lookup_worth.worth_asking(
                self.step_seconds(shape)(shape.tokens, 1, 0) / max(len(reqs), 1)):
            return [(0, 0)] * len(reqs)
        return self._caps(reqs, allowances, self.lookup_shape_for_batch(batch_size), max_model_len)

    def observe_lookup(self, requests: int, seconds: float) -> None:
        """Asking the lookup for ``requests`` requests and pricing its drafts took ``seconds``."""
        if self.adaptive:
            self.lookup_worth.observe_ask(requests, seconds)

    def shapes(self, reqs: list, allowances: list[int], batch_size: int, max_model_len: int,
               shape: StepShape) -> list[tuple[int, int]]:
        """The (depth, nodes) to ask each request's drafter for: the configured shape for
        ``batch_size`` within the scheduler's allowance and the room left in the request
        and the context, none while the request is paused, then, if adaptive, the depth
        that pays (:meth:`plan`), none while the batch rests from planning (:meth:`_resting`)."""
        caps = self._caps(reqs, allowances, self.shape_for_batch(batch_size), max_model_len)
        self._counted_off = set()
        if not self.adaptive:
            return caps
        if self._resting(reqs):
            for req, (d, _) in zip(reqs, caps):
                if d:
                    self._count_off(req)
            return [(0, 0)] * len(reqs)
        planned = self.plan(reqs, caps, shape)
        if any(d for d, _ in caps) and not any(d for d, _ in planned):
            self._rest = (tuple(req.request_id for req in reqs), self.rest_steps - 1)
        return planned

    def _resting(self, reqs: list) -> bool:
        """Whether this step's batch rests from planning (:data:`REST_STEPS`): plan() kept
        the same requests from drafting (probes included) a step or more ago. Nothing it
        planned on changes meanwhile but the step's shape; a probe due waits a few steps."""
        if self._rest is None:
            return False
        ids, left = self._rest
        if left <= 0 or ids != tuple(req.request_id for req in reqs):
            self._rest = None
            return False
        self._rest = (ids, left - 1)
        return True

    def _paused(self, req) -> bool:
        return self.pause is not None and req.metrics.num_steps < self.state(req).paused_until

    def _count_off(self, req) -> None:
        """``req`` could have drafted this step and will verify no draft (once a step)."""
        if id(req) not in self._counted_off:
            self._counted_off.add(id(req))
            req.metrics.num_steps_speculation_off += 1

    def prefer_lookup(self, reqs: list, lookups: list, shapes: list[tuple[int, int]], shape: StepShape
                      ) -> list[bool]:
        """For each request, whether its lookup drafter's proposal (None: none) is drafted in
        place of asking the method for the (depth, nodes) of ``shapes``: where it promises at
        least as many tokens per second, each priced alone in the step at the depth that pays
        most for it, the method with what drafting its levels costs, the lookup's draft with
        none (it is drafted already); without the planner, wherever there is one.
        :meth:`trim` then cuts it to the depth it is worth, as any draft."""
        if not self.adaptive:
            return [prop is not None for prop in lookups]
        calibrated = self.calibration.apply
        hit = max(self.stats.draft_rate(), 0.05)
        out = []
        for i, (req, prop, (depth, nodes)) in enumerate(zip(reqs, lookups, shapes)):
            if prop is None or not depth:
                out.append(prop is not None)
                continue
            stats = self.request_stats(req)
            tree = self.chain_or_tree and nodes > depth
            method = DraftOption(calibrated(stats.curve(TREE_KIND if tree else None, depth)),
                                 [0] + [min(self.nodes_for_depth(j), nodes) for j in range(1, depth + 1)])
            lookup = DraftOption(calibrated(stats.curve(prop.kind, prop.depth)), _nodes_by_depth(prop))
            drafting = functools.partial(self._drafting_seconds, trees=tree, hit=hit)
            out.append(self._rate_alone(i, lookup, len(reqs), shape, prop.verified_as_tree)
                       >= self._rate_alone(i, method, len(reqs), shape, tree, drafting))
        return out

    # -- after drafting and verification --------------------------------------------------

    def observe_drafting(self, reqs: list, depth: int, seconds: float, trees: bool) -> None:
        """A drafting call asked ``reqs`` for ``depth`` levels at most and took ``seconds``;
        the tokens they gained since their drafter was last asked are what it caught up on."""
        if not self.adaptive:
            return
        caught_up = 0
        for req in reqs:
            caught_up += self._behind(req)
            self.state(req).drafted_at = len(req.token_ids)
        self.costs.observe_draft(depth, seconds, trees, caught_up)

    def observe_decode(self, req, proposal, accepted_nodes: list[int]) -> None:
        """``req`` decoded a step, verifying ``proposal`` (None: no drafts) of which the
        target accepted ``accepted_nodes``."""
        state = self.state(req)
        depth = proposal.depth if proposal is not None else 0
        state.steps_without_drafts = 0 if depth else state.steps_without_drafts + 1
        if not depth:
            return
        if self.adaptive:
            self.observe_verified(req, proposal, accepted_nodes)
        if self.pause is None:
            return
        state.recent_acceptance.append(len(accepted_nodes) / depth)
        window = self.pause.window
        if len(state.recent_acceptance) >= window:
            if sum(list(state.recent_acceptance)[-window:]) / window < self.pause.min_rate:
                state.paused_until = req.metrics.num_steps + self.pause.retry_after
                state.recent_acceptance.clear()

    def observe_step(self, items: list, results: list, seconds: float) -> None:
        """A step ran in ``seconds`` (drafting excluded): each decoding request learns what the
        target accepted of its draft (:meth:`observe_decode`), and, if adaptive, the cost
        model the step's time and probes earn their share of its estimate."""
        for it, res in zip(items, results):
            if not it.is_prefill:
                self.observe_decode(it.request, it.proposal, res.accepted_nodes)
        if not self.adaptive:
            return
        if self.lookup_shape_for_batch is not None:
            self.lookup_worth.observe_step(sum(len(res.accepted_nodes) for it, res in zip(items, results)
                                               if it.proposal is not None and is_lookup_kind(it.proposal.kind)))
        sequences = [(it.start, len(it.tokens)) for it in items]
        tokens = sum(n for _, n in sequences)
        widest = max((len(it.tokens) for it in items if not it.is_prefill), default=1)
        trees = self.tree_batch and any(it.proposal is not None and it.proposal.verified_as_tree for it in items)
        self.observe_cost(tokens, attention_work(sequences, self.padded_attention, trees), seconds, widest)

    def observe_cost(self, num_tokens: int, work: float, seconds: float, widest: int) -> None:
        """A step of ``num_tokens`` target tokens doing ``work`` attention, ``widest`` the
        most new tokens of one decoding sequence, took ``seconds``: the cost model learns
        it, and probes earn their share of its estimate (:meth:`ProbeBudget.earn`)."""
        rows = max(num_tokens, self.min_rows)
        self.costs.observe_step(rows, work, seconds, widest)
        self.probes.earn(self.costs.step_seconds(rows, work, widest))

    def _overdue_first(self, reqs: list, candidates: list[int]) -> list[int]:
        """The requests among ``candidates`` due for a probe, the longest overdue first."""
        return self.probes.overdue_first({i: self.state(reqs[i]) for i in candidates})

    def state(self, req) -> RequestDraftState:
        """What the planner keeps of ``req`` (made on first use, dropped by :meth:`forget`)."""
        state = self.requests.get(req.request_id)
        if state is None:
            state = self.requests[req.request_id] = RequestDraftState()
        return state

    def forget(self, req) -> None:
        """``req`` ended: drop its state."""
        self.requests.pop(req.request_id, None)

    def request_stats(self, req) -> AcceptanceStats:
        state = self.state(req)
        if state.stats is None:
            state.stats = AcceptanceStats(prior=self.stats, prior_weight=self.request_prior_weight)
        return state.stats

    def step_seconds(self, shape: StepShape, trees: bool = False) -> Callable[[int, int, int], float]:
        """The step's estimated seconds by its target tokens, widest sequence and number of
        requests verifying drafts (``trees``: the drafts are trees)."""
        return lambda tokens, widest, drafting: self.costs.step_seconds(
            max(tokens, self.min_rows), shape.work_at(tokens, widest, drafting, trees), widest)

    def plan(self, reqs: list, caps: list[tuple[int, int]], shape: StepShape) -> list[tuple[int, int]]:
        """The (depth, nodes) to ask each request's drafter for, within ``caps`` (depth,
        nodes): the best depth for each request's most promising kind of draft, should the
        drafter propose one, with what asking costs (drafting time, aux tokens) divided by
        the chance that it does; where the drafter may grow a chain in place of its tree
        (``chain_or_tree``), whichever of the two pays more for this request
        (:meth:`_chain_or_tree`). A request due for a probe is asked for one level (a
        chain, where one may be asked for)."""
        candidates, hits = [], []
        calibrated = self.calibration.apply
        self._probing = set()
        for req, (depth, nodes) in zip(reqs, caps):
            stats = self.request_stats(req)
            hit = max(stats.draft_rate(), 0.05)
            hits.append(hit)
            aux = round(self.aux_tokens / hit)
            tree_nodes = [0] + [min(self.nodes_for_depth(j), nodes) + aux for j in range(1, depth + 1)]
            if self.chain_or_tree and tree_nodes[-1] > depth + aux:
                chain_nodes = [j + aux for j in range(depth + 1)]
                candidates.append([DraftOption(calibrated(stats.curve(TREE_KIND, depth)), tree_nodes),
                                   DraftOption(calibrated(stats.curve(None, depth)), chain_nodes)])
                continue
            kinds = {kind for kind in stats.kinds() if not is_lookup_kind(kind)} or {None}
            gains = max((stats.curve(kind, depth) for kind in kinds), key=sum)
            candidates.append([DraftOption(calibrated(gains), tree_nodes)])
        mean_hit = sum(hits) / len(hits) if hits else 1.0
        chains = self._chain_or_tree(candidates, shape, mean_hit)
        options = [c[1] if chain else c[0] for c, chain in zip(candidates, chains)]
        trees = any(opt.nodes[j] > j for opt in options for j in range(len(opt.nodes)))
        step = self.step_seconds(shape, trees)
        depths = best_depths(options, shape.tokens, step,
                             functools.partial(self._drafting_seconds, trees=trees, hit=mean_hit))
        load = StepLoad(shape.tokens, options, depths)
        off = [i for i in range(len(reqs)) if depths[i] == 0 and caps[i][0] > 0]
        drafting_level = self.costs.draft_seconds(1)
        for i in self._overdue_first(reqs, off):
            if not drafting_level and self._probing:  # drafting not timed yet: one probe
                break
            extra = (1 if self.chain_or_tree else min(self.nodes_for_depth(1), caps[i][1])) + round(self.aux_tokens)
            # every probe pays its own drafting, catching up on the tokens decoded while off
            drafting = self.costs.draft_seconds(1, caught_up=self._behind(reqs[i]))
            if self.probes.afford(load.extra_seconds(step, extra) + drafting):
                load.add(extra)
                depths[i] = 1
                chains[i] = self.chain_or_tree
                self.probes.probed(self.state(reqs[i]))
                self._probing.add(id(reqs[i]))
        for i in off:
            if depths[i] == 0:
                self._count_off(reqs[i])
        return [(d, d if chain else min(self.nodes_for_depth(d), nodes) if d else 0)
                for d, chain, (_, nodes) in zip(depths, chains, caps)]

    def _behind(self, req) -> int:
        """The tokens ``req`` gained since its drafter was last asked: what it catches up on."""
        return max(len(req.token_ids) - self.state(req).drafted_at, 0)

    def _drafting_seconds(self, depth: int, tokens: float, trees: bool, hit: float) -> float:
        """What asking for ``depth`` levels costs, the drafter catching up on the step's
        expected ``tokens`` at its next call: drafting time over the chance of a draft."""
        return self.costs.draft_seconds(depth, trees, tokens) / hit

    def _chain_or_tree(self, candidates: list[list[DraftOption]], shape: StepShape, hit: float) -> list[bool]:
        """For each request, whether its chain (the second of its ``candidates``) pays more
        than its tree (the first), each priced alone in the step, as the only request
        drafting, at the best depth for it. The tree's acceptance is learnt from the trees
        verified (:data:`TREE_KIND`), the chain's from the chains and from the chain inside
        each verified tree (:meth:`observe_verified`): a tree holds more nodes than the chain and
        is chosen while its estimate pays for them; an estimate not yet verified starts at
        the same guess for both, so the tree is tried where the chain does poorly."""
        chains = [False] * len(candidates)
        for i, pair in enumerate(candidates):
            if len(pair) < 2:
                continue
            tree, chain = (self._rate_alone(i, opt, len(candidates), shape, opt is pair[0],
                                            functools.partial(self._drafting_seconds, trees=opt is pair[0], hit=hit))
                           for opt in pair)
            chains[i] = chain >= tree
        return chains

    def _rate_alone(self, i: int, option: DraftOption, count: int, shape: StepShape, trees: bool,
                    drafting: Callable[[int, float], float] = lambda depth, tokens: 0.0) -> float:
        """Expected tokens per second of a step of ``count`` requests in which request ``i``
        alone drafts ``option``, at the depth that pays most for it (``drafting``: what
        asking for a depth costs)."""
        alone = [DraftOption([], [0])] * count
        alone[i] = option
        step = self.step_seconds(shape, trees=trees)
        depth = best_depths(alone, shape.tokens, step, drafting)[i]
        expected = count + sum(option.gains[:depth])
        return expected / (step(shape.tokens + option.nodes[depth], 1 + option.nodes[depth], int(depth > 0))
                           + (drafting(depth, expected) if depth else 0.0))

    def trim(self, reqs: list, proposals: list, shape: StepShape) -> list:
        """The proposals cut to the depth each is worth verifying (None: none of it), from
        the acceptance of its own kind; a request due for a probe keeps at least one level.
        A proposal of aux tokens only (lookahead filling its n-gram pool) brings no token
        this step: like a probe, it runs where plan() paid for a probe or the probe budget
        holds it, the request that warmed up longest ago first."""
        if not self.adaptive:
            return proposals
        options = []
        for prop in proposals:
            if prop is not None:
                self.aux_tokens += 0.2 * (len(prop.aux_token_ids) - self.aux_tokens)
        for req, prop in zip(reqs, proposals):
            if prop is None or prop.depth == 0:
                options.append(DraftOption([], [0]))
                continue
            options.append(DraftOption(self.calibration.apply(self.request_stats(req).curve(prop.kind, prop.depth)),
                                       _nodes_by_depth(prop)))
        step = self.step_seconds(shape, trees=any(prop is not None and prop.verified_as_tree for prop in proposals))
        depths = self._one_while_cold(best_depths(options, shape.tokens, step), options)
        load = StepLoad(shape.tokens, options, depths)
        probing, self._probing = self._probing, set()
        cut = []  # drafts the estimate refuses, not already probes
        warming, warm = [], set()  # aux-only proposals: not already probes; kept
        for i, (req, prop) in enumerate(zip(reqs, proposals)):
            if prop is None:
                continue
            if prop.depth == 0:
                if id(req) in probing:
                    load.add(len(prop.aux_token_ids))
                    warm.add(i)
                else:
                    warming.append(i)
            elif id(req) in probing:  # a probe paid for in plan(), whatever its draft is worth now
                if depths[i] == 0:
                    depths[i] = 1
                    load.add(options[i].nodes[1])
            elif depths[i] > 0:
                self.probes.paid_off(self.state(req))
            else:
                cut.append(i)
        for i in self.probes.paid_from(self._overdue_first(reqs, cut), lambda i: options[i].nodes[1], load, step):
            depths[i] = 1
            self.probes.probed(self.state(reqs[i]))
        for i in self.probes.paid_from(sorted(warming, key=lambda i: self.state(reqs[i]).last_warm_up),
                                       lambda i: len(proposals[i].aux_token_ids), load, step):
            warm.add(i)
            self.state(reqs[i]).last_warm_up = self.num_warm_ups
            self.num_warm_ups += 1
            self.probes.warmed_up()
        kept = [prop if i in warm else None if prop is None else prop.up_to_depth(depths[i])
                for i, prop in enumerate(proposals)]
        for req, prop, k in zip(reqs, proposals, kept):
            if prop is not None and k is None:
                self._count_off(req)
            elif k is not None and id(req) in self._counted_off:  # a lookup's draft where the method was off
                self._counted_off.discard(id(req))
                req.metrics.num_steps_speculation_off -= 1
        return kept

    def _one_while_cold(self, depths: list[int], options: list[DraftOption]) -> list[int]:
        """``depths``, but until :data:`COLD_START_DRAFTS` drafts have been verified only the
        request expecting the most verifies its draft: the acceptance of a batch's drafts is
        the initial guess until then, and one request finds out what they bring."""
        if self.num_verified >= COLD_START_DRAFTS or sum(d > 0 for d in depths) < 2:
            return depths
        first = max(range(len(depths)), key=lambda i: sum(options[i].gains[:depths[i]]))
        return [d if i == first else 0 for i, d in enumerate(depths)]

    def observe_asks(self, reqs: list, proposals: list) -> None:
        """Whether each request asked for a draft got one. A proposal of aux tokens only
        (lookahead filling its n-gram pool) is neither: the drafter is warming up."""
        if not self.adaptive:
            return
        for req, prop in zip(reqs, proposals):
            if prop is not None and prop.depth == 0:
                continue
            self.request_stats(req).observe_ask(prop is not None)
            self.stats.observe_ask(prop is not None)

    def observe_verified(self, req, proposal, accepted_nodes: list[int]) -> None:
        """What the target accepted of a verified ``proposal`` (its accepted nodes, root
        first); for a dynamic tree whose drafter may be asked for a chain, also how far its
        chain, the path of first children, would have been accepted, so that the chain's
        estimate is read where the trees run, not only where chains were tried. A draft
        of no kind of its own (a trained drafter's chain or tree) counts its first
        position towards how far requests differ (:attr:`spread`), which sets how far each
        request's estimate leans on the engine-wide one; drafts of kinds (ngram's and
        suffix's match lengths) already say which drafts are worth what, and their
        requests keep the light prior."""
        self.calibration.observe(self.request_stats(req).curve(proposal.kind, proposal.depth), len(accepted_nodes))
        self.observe(req, proposal.kind, proposal.depth, len(accepted_nodes))
        if proposal.kind in (None, TREE_KIND) and self.spread.observe(self.state(req).block, bool(accepted_nodes)):
            self._lean_requests(self.spread.prior_weight())
        if self.chain_or_tree and proposal.kind == TREE_KIND:
            chain = first_child_path(proposal.parents)
            kept = next((j for j, (a, c) in enumerate(zip(accepted_nodes, chain)) if a != c),
                        min(len(accepted_nodes), len(chain)))
            self.observe(req, None, len(chain), kept)

    def _lean_requests(self, weight: float) -> None:
        """Every request's estimate leans on the engine-wide one with ``weight`` from now on."""
        if abs(weight - self.request_prior_weight) <= 0.05 * self.request_prior_weight:
            return
        self.request_prior_weight = weight
        for state in self.requests.values():
            if state.stats is not None:
                state.stats.set_prior_weight(weight)

    def observe(self, req, kind: Hashable, depth: int, accepted: int) -> None:
        """What the target accepted of a verified draft of ``depth`` levels."""
        self.request_stats(req).observe(kind, depth, accepted)
        self.stats.observe(kind, depth, accepted)
        self.num_verified += 1
