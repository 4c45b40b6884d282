"""Each stage of the engine's step on its own, on step items and logits made by hand: the
verifier's acceptance on a tree, the output processor's stop rules, the KV commit's
compaction of an accepted tree path, the scheduler's preemption, the draft stage's
trimming and reservation. No model: what each stage promises, checked where a
fault would show, not only through ``LLM(...)`` end to end."""

import torch

from specdec import SamplingParams, hookimpl
from specdec.drafting.interface import DraftProposal, StepResult
from specdec.drafting.tree import ancestor_mask
from specdec.executor.kv_commit import KVCommit
from specdec.executor.output_processor import OutputProcessor
from specdec.executor.request import Request
from specdec.executor.step_items import StepItem
from specdec.executor.verifier import Verifier
from specdec.kvcache import KVCacheManager, PagedKVCache

VOCAB, EOS = 16, 15


def request(prompt=(1, 2, 3), **params) -> Request:
    req = Request(request_id="r", token_ids=list(prompt), prompt_len=len(prompt),
                  sampling_params=SamplingParams(**{"temperature": 0.0, "max_tokens": 8, **params}),
                  generator=torch.Generator().manual_seed(0))
    req.num_computed = len(prompt) - 1  # the prompt is in the cache but for its last token
    return req


def tree_item(req: Request, proposal: DraftProposal) -> StepItem:
    from specdec.drafting.interface import TreeMask

    mask = ancestor_mask(proposal.parents)
    depths = [0] * len(proposal.parents)
    for i, p in enumerate(proposal.parents):
        depths[i] = 0 if p < 0 else depths[p] + 1
    offsets = torch.tensor([0] + [d + 1 for d in depths])
    return StepItem.decode(req, proposal, TreeMask(mask=mask, position_offsets=offsets))


def logits_choosing(rows: list[int]) -> torch.Tensor:
    """One row per given token, that token the clear argmax."""
    logits = torch.zeros(len(rows), VOCAB)
    for r, tok in enumerate(rows):
        logits[r, tok] = 10.0
    return logits


# -- the verifier ---------------------------------------------------------------------------

# a tree of three nodes: 5 and 6 below the root, 7 below 5
TREE = DraftProposal(token_ids=[5, 6, 7], parents=[-1, -1, 0])


def test_greedy_verification_keeps_the_path_the_target_chooses_then_its_own_token():
    req = request()
    item = tree_item(req, TREE)
    # rows: the root chooses 5 (node 0), node 0 chooses 7 (node 2), node 1 anything, node 2 chooses 9
    (result,) = Verifier({EOS}).verify([item], logits_choosing([5, 7, 4, 9]))
    assert result.accepted_nodes == [0, 2] and result.new_token_ids == [5, 7, 9]


def test_greedy_verification_stops_at_the_first_node_the_target_does_not_choose():
    req = request()
    (result,) = Verifier({EOS}).verify([tree_item(req, TREE)], logits_choosing([6, 7, 11, 9]))
    assert result.accepted_nodes == [1] and result.new_token_ids == [6, 11]  # node 1's own row decides
    (result,) = Verifier({EOS}).verify([tree_item(request(), TREE)], logits_choosing([3, 7, 11, 9]))
    assert result.accepted_nodes == [] and result.new_token_ids == [3]  # the correction token


def test_sampled_verification_never_keeps_a_token_the_target_cannot_draw():
    """The draft's first token has probability zero under the target: it is rejected,
    and the token kept is one the target can draw."""
    for seed in range(20):
        req = request(temperature=1.0, seed=seed)
        logits = torch.full((4, VOCAB), -1e9)
        logits[:, 2:4] = 0.0  # the target draws 2 or 3, never 5 or 6
        (result,) = Verifier({EOS}).verify([tree_item(req, TREE)], logits)
        assert result.accepted_nodes == [] and result.new_token_ids[0] in (2, 3)


# -- the output processor -------------------------------------------------------------------

def process(req: Request, new: list[int], **processor) -> tuple[list[int], str | None]:
    item = StepItem.decode(req)
    result = StepResult(request=req, new_token_ids=new, start=item.start, accepted_nodes=list(range(len(new) - 1)))
    (out,) = OutputProcessor({EOS}, None, processor.get("max_model_len", 64)).process(
        [item], [result], torch.zeros(1, VOCAB))
    return out.new_token_ids, req.finish_reason if out.finished else None


def test_the_output_processor_cuts_a_step_at_max_tokens_eos_stop_ids_and_the_context():
    assert process(request(max_tokens=2), [5, 7, 9]) == ([5, 7], "length")
    assert process(request(), [5, EOS, 9]) == ([5, EOS], "stop")
    assert process(request(ignore_eos=True), [5, EOS, 9]) == ([5, EOS, 9], None)
    assert process(request(stop_token_ids=[7]), [5, 7, 9]) == ([5, 7], "stop")
    assert process(request(), [5, 7, 9], max_model_len=5) == ([5, 7], "length")  # 3 prompt tokens + 2
    req = request()
    assert process(req, [5, 7, 9]) == ([5, 7, 9], None) and req.token_ids == [1, 2, 3, 5, 7, 9]


# -- the KV commit --------------------------------------------------------------------------

def test_the_commit_moves_the_accepted_paths_kv_after_the_root_and_frees_the_rest():
    block = 4
    cache = PagedKVCache([(1, 2, 2)], num_blocks=8, block_size=block, dtype=torch.float32, device=torch.device("cpu"))
    kv = KVCacheManager(cache, 8, block, enable_prefix_caching=False)
    req = request(prompt=(1, 2, 3, 4, 5, 6))
    kv.reserve(req, 1 + 3)  # the root and three nodes: positions 5..8, over two blocks
    item = tree_item(req, TREE)
    slots = kv.slots(req, item.start, 4)
    for row, slot in enumerate(slots):  # each verified token's K/V: its row number
        cache.keys[0][slot] = float(row)
        cache.values[0][slot] = float(10 + row)
    result = StepResult(request=req, new_token_ids=[5, 7, 9], start=item.start, accepted_nodes=[0, 2])
    req.token_ids += result.new_token_ids  # the output processor appends before the commit
    KVCommit(kv, None, torch.device("cpu")).commit([item], [result], {})
    kept = kv.slots(req, item.start, 3)
    assert [cache.keys[0][s, 0, 0].item() for s in kept] == [0.0, 1.0, 3.0]  # root, node 0, node 2
    assert [cache.values[0][s, 0, 0].item() for s in kept] == [10.0, 11.0, 13.0]
    assert req.num_computed == item.start + 3  # the bonus token (9) waits for the next step
    assert len(req.block_table) == kv.blocks_for(req.num_computed)  # the rejected node's block went back


# -- the scheduler --------------------------------------------------------------------------

def run_plan(kv: KVCacheManager, plan) -> None:
    """What a step does with the plan: the KV of its tokens committed, one token appended
    to each request that finished its prompt or decoded."""
    for req, n in plan.prefills:
        kv.commit(req, req.num_computed + n)
        if not req.is_prefilling:
            req.token_ids.append(9)
    for req in plan.decodes:
        kv.commit(req, req.num_computed + 1)
        req.token_ids.append(9)


def test_the_scheduler_preempts_the_newest_request_when_the_pool_runs_out_and_requeues_it_first():
    from specdec.config import EngineConfig
    from specdec.executor.request import Status
    from specdec.executor.scheduler import Scheduler

    cache = PagedKVCache([(1, 2, 2)], num_blocks=4, block_size=4, dtype=torch.float32, device=torch.device("cpu"))
    kv = KVCacheManager(cache, 4, 4, enable_prefix_caching=False)
    scheduler = Scheduler(EngineConfig(max_num_tokens=16), kv)
    a, b = request(prompt=range(1, 8)), request(prompt=range(11, 18))
    a.num_computed = b.num_computed = 0
    b.request_id = "b"
    scheduler.add(a)
    scheduler.add(b)
    plan = scheduler.schedule(draft_budget=4)
    assert [(r.request_id, n) for r, n in plan.prefills] == [("r", 7), ("b", 7)] and kv.pool.num_free == 0
    run_plan(kv, plan)
    plan = scheduler.schedule(draft_budget=4)  # position 7 still fits each one's second block
    assert plan.decodes == [a, b] and scheduler.num_preemptions == 0
    assert plan.draft_allowance == [4, 4]  # drafts get what the step's budget leaves
    run_plan(kv, plan)
    plan = scheduler.schedule(draft_budget=4)  # position 8 needs a block: none is free
    assert plan.decodes == [a] and scheduler.num_preemptions == 1
    # b lost its blocks and starts over from position 0, its output so far recomputed with the
    # prompt, in the one block a left free: a chunk of 4
    assert [(r.request_id, n) for r, n in plan.prefills] == [("b", 4)] and b.num_computed == 0
    assert b.token_ids[-2:] == [9, 9] and b.status is Status.RUNNING and len(b.block_table) == 1


# -- the draft stage ------------------------------------------------------------------------

class Proposing:
    """A drafter that proposes what it is told, whatever it was asked for."""

    def __init__(self, proposal):
        self.proposal = proposal
        self.asked = []

    @hookimpl
    def prepare_draft_tokens(self, requests, draft_lens, max_nodes):
        self.asked.append((list(draft_lens), list(max_nodes)))
        return [self.proposal for _ in requests]


class ProposingFor(Proposing):
    """A lookup drafter that proposes ``proposal`` for the requests in ``matches`` only."""

    def __init__(self, proposal, matches):
        super().__init__(proposal)
        self.matches = matches

    @hookimpl
    def prepare_draft_tokens(self, requests, draft_lens, max_nodes):
        self.asked.append((list(draft_lens), list(max_nodes)))
        return [self.proposal if req.request_id in self.matches else None for req in requests]


class Failing:
    @hookimpl
    def prepare_draft_tokens(self, requests, draft_lens, max_nodes):
        raise RuntimeError("lookup broke")


def draft_stage(proposal, num_blocks=8, shape=(3, 3), lookup=None, lookup_shape=(6, 6)):
    from specdec.executor.draft_stage import DraftStage
    from specdec.executor.planner import DraftPlanner
    from specdec.plugins import drafter_plugin_manager, proposal_callers

    cache = PagedKVCache([(1, 2, 2)], num_blocks=num_blocks, block_size=4, dtype=torch.float32,
                         device=torch.device("cpu"))
    kv = KVCacheManager(cache, num_blocks, 4, enable_prefix_caching=False)
    planner = DraftPlanner(lambda depth: depth, probe_interval=8, adaptive=False, shape_for_batch=lambda batch: shape,
                           lookup_shape_for_batch=(lambda batch: lookup_shape) if lookup is not None else None)
    drafter = Proposing(proposal)
    pm = drafter_plugin_manager(drafter, "test", lookup)
    stage = DraftStage(pm.hook, planner, kv, VOCAB, 64, "test", *proposal_callers(pm))
    return stage, kv, drafter


def test_the_draft_stage_asks_for_the_planned_depth_trims_longer_drafts_and_reserves_their_kv():
    stage, kv, drafter = draft_stage(DraftProposal(token_ids=[5, 6, 7, 8, 9, 10]), shape=(2, 4))
    req = request()
    kv.reserve(req, 1)
    (item,) = stage.decode_items([req], allowances=[3], batch_size=1, before_drafts=None)
    assert drafter.asked == [([2], [3])]  # the configured depth; 4 nodes within the scheduler's allowance of 3
    assert item.proposal.token_ids == [5, 6] and item.tokens == [3, 5, 6]
    assert len(kv.slots(req, item.start, len(item.tokens))) == 3  # room reserved for the root and both


def test_the_draft_stage_drops_invalid_drafts_and_drafts_without_room_and_decodes_anyway():
    stage, kv, _ = draft_stage(DraftProposal(token_ids=[5, VOCAB + 3]))  # a token outside the vocabulary
    req = request()
    kv.reserve(req, 1)
    (item,) = stage.decode_items([req], allowances=[3], batch_size=1, before_drafts=None)
    assert item.proposal is None and item.tokens == [3] and req.metrics.num_drafter_faults == 1
    stage, kv, _ = draft_stage(DraftProposal(token_ids=[5, 6, 7]), num_blocks=1)
    req = request()  # its prompt's 3 tokens and root fill the only block: no room for drafts
    kv.reserve(req, 1)
    (item,) = stage.decode_items([req], allowances=[3], batch_size=1, before_drafts=None)
    assert item.proposal is None and item.tokens == [3] and req.metrics.num_drafter_faults == 0


def test_a_lookup_drafts_where_it_has_a_draft_and_the_method_is_asked_for_the_others_only():
    from specdec.drafting.interface import LOOKUP_KIND

    lookup = ProposingFor(DraftProposal(token_ids=[7, 8, 9, 10, 11], kind=3), matches={"a"})
    stage, kv, drafter = draft_stage(DraftProposal(token_ids=[5, 6]), shape=(2, 2), lookup=lookup, lookup_shape=(4, 4))
    a, b = request(), request()
    a.request_id, b.request_id = "a", "b"
    for req in (a, b):
        kv.reserve(req, 1)
    items = stage.decode_items([a, b], allowances=[6, 6], batch_size=2, before_drafts=None)
    assert lookup.asked == [([4, 4], [4, 4])]  # every request, at the lookup's own shape
    assert drafter.asked == [([2], [2])]  # the method: b alone
    assert items[0].proposal.token_ids == [7, 8, 9, 10] and items[0].proposal.kind == (LOOKUP_KIND, 3)
    assert items[1].proposal.token_ids == [5, 6] and items[1].proposal.kind is None
    assert stage.draft_budget(2) == 4  # room for the deeper of the two shapes


def test_a_failing_lookup_costs_its_drafts_and_the_method_drafts_for_every_request():
    stage, kv, drafter = draft_stage(DraftProposal(token_ids=[5, 6]), shape=(2, 2), lookup=Failing())
    req = request()
    kv.reserve(req, 1)
    (item,) = stage.decode_items([req], allowances=[6], batch_size=1, before_drafts=None)
    assert drafter.asked == [([2], [2])] and item.proposal.token_ids == [5, 6]
    assert req.metrics.num_drafter_faults == 1 and stage.faults == {"lookup prepare_draft_tokens raised": 1}
