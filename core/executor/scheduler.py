"""Continuous batching: which requests run in the next step, and with how many tokens.

Running requests that decode come first; each needs one KV slot for its root token and is
charged one token against the step's token budget. Prompt chunks come next, and draft
nodes get what they leave, up to ``draft_budget`` per decoding request: a prompt chunk is
work its request needs, a draft pays only sometimes (and at batch 8 the adaptive planner
leaves most steps without drafts). The plan says how many draft nodes each may get (draft
slots are reserved later, when the drafts exist, and a draft without room is dropped).
When even that slot cannot be had, the most recently admitted request is preempted: its
blocks are freed and it goes back to the front of the queue, to be recomputed later.
The rest of the token budget goes to prompt chunks (chunked prefill), of running requests
first, then of waiting ones admitted in arrival order.
"""

from __future__ import annotations

from collections import deque

import attrs

from ..config import EngineConfig
from ..kvcache import KVCacheManager
from .request import Request, Status


@attrs.define
class Plan:
    prefills: list[tuple[Request, int]] = attrs.Factory(list)  # (request, prompt tokens to compute)
    decodes: list[Request] = attrs.Factory(list)
    draft_allowance: list[int] = attrs.Factory(list)  # per decode: the most draft nodes it may add

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if request.block_table:
            self.kv.free(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, victim: Request) -> None:
        self.num_preemptions += 1
        self.running.remove(victim)
        self.kv.free(victim)
        victim.status = Status.WAITING
        self.waiting.appendleft(victim)

    def schedule(self, draft_budget: int) -> Plan:
        """Plan one step. ``draft_budget``: draft nodes a decoding request may add.

        A step with work left is never empty: if nothing fits, running requests are
        preempted (newest first) until something does.
        """
        plan = self._plan(draft_budget)
        while plan.empty and self.running:
            self._preempt(self.running[-1])
            plan = self._plan(draft_budget)
        return plan

    def _plan(self, draft_budget: int) -> Plan:
        plan = Plan()
        budget = self.config.max_num_tokens
        for req in list(self.running):
            if req not in self.running or req.is_prefilling:
                continue
            while not self.kv.can_reserve(req, 1):
                self._preempt(self.running[-1])
                if req not in self.running:
                    break
            if req in self.running:
                self._decode(req, plan)
                budget -= 1
        for req in self.running:
            if req.is_prefilling and budget > 0:
                budget -= self._plan_chunk(req, budget, plan)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_batch_size:
            req = self.waiting[0]
            if not req.block_table:
                # cached tokens are not run, so a request asking their logprobs runs them all
                cacheable = req.sampling_params.prompt_logprobs is None
                reused = req.num_from_prefix_cache = self.kv.attach_prefix(req) if cacheable else 0
                if req.num_output_tokens == 0:
                    req.metrics.num_cached_prompt_tokens = reused
            if not req.is_prefilling and self.kv.can_reserve(req, 1):
                # A preempted request whose whole context came back from the prefix cache:
                # nothing to prefill, it decodes right away.
                self.waiting.popleft()
                req.status = Status.RUNNING
                self.running.append(req)
                self._decode(req, plan)
                budget -= 1
                continue
            chunk = self._plan_chunk(req, budget, plan)
            if chunk == 0:
                self.kv.free(req)  # no room yet: it stays first in line, pinning no blocks
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            budget -= chunk
        for _ in plan.decodes:  # drafts get what the prompt chunks left
            allowance = min(draft_budget, max(0, budget))
            plan.draft_allowance.append(allowance)
            budget -= allowance
        return plan

    def _decode(self, req: Request, plan: Plan) -> None:
        self.kv.reserve(req, 1)
        plan.decodes.append(req)

    def _plan_chunk(self, req: Request, budget: int, plan: Plan) -> int:
        n = min(budget, req.prefill_target - req.num_computed)
        while n > 0 and not self.kv.can_reserve(req, n):
            n //= 2
        if n > 0:
            self.kv.reserve(req, n)
            plan.prefills.append((req, n))
        return n
