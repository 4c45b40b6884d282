"""Hook specifications: the contract between the specdec core and drafting methods.

Two kinds of implementers use them:

* a plugin *module*, found through the ``specdec.plugins`` entry-point group, implements
  :func:`register_decoding_types` to announce its methods;
* a *drafter* instance (one per ``LLM``) implements the per-step hooks. The engine
  registers it in its own plugin manager, so the hooks of one ``LLM`` reach only its
  drafter (plus any observers registered beside it).

The per-step hooks run in the order of the speculative step::

    target_hidden_layers, reads_prompt_hidden_states, compile_draft (once) -> prepare_draft_tokens -> build_tree_mask
        -> target forward -> sampler -> on_draft_verified ... -> on_request_finished

Each hook below says when it is called, its arguments and what it returns.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from ..executor.request import Request
    from ..model.target import TargetModel
    from ..plugins import DecodingType
    from .interface import DraftProposal, StepResult, TreeMask

PROJECT_NAME = "specdec"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def register_decoding_types(register: Callable[[DecodingType], None]) -> None:
    """Announce the decoding types this plugin provides.

    Called once per process, when the plugin registry is first used, on every plugin
    module loaded from the ``specdec.plugins`` entry-point group.

    :param register: call it once per method with a :class:`specdec.plugins.DecodingType`
        (name, config class, drafter class, aliases, and for ``specdec train`` a trainer
        class: a :class:`specdec.training.MethodTrainer` subclass giving the method's
        module, loss and save format).
    :return: nothing; results are ignored.

    Example::

        @hookimpl
        def register_decoding_types(register):
            register(DecodingType(name="ngram", aliases=("NGram",),
                                  config_class=NGramConfig, drafter_class=NGramDrafter))
    """


@hookspec
def target_hidden_layers(target: TargetModel) -> list[int]:
    """Ask for hidden states of target layers, captured during the target forward.

    Called once, when the engine starts, on the drafter (and observers). Layer ``i`` in
    ``0 .. num_layers-1`` is the output of decoder layer ``i``; ``-1`` is the final
    normalised hidden state the LM head reads (EAGLE-1/2, Medusa, MTP). EAGLE-3 asks for a
    low, a middle and a high layer. The states reach drafters in
    :attr:`specdec.drafting.interface.StepResult.hidden_states`, with no extra computation.

    :param target: the target model.
    :return: the layer indices wanted; the results of all implementations are merged.

    Example::

        @hookimpl
        def target_hidden_layers(self, target):
            n = target.num_layers
            return [1, n // 2 - 1, n - 4]
    """


@hookspec
def reads_prompt_hidden_states() -> bool:
    """Whether the hidden states asked for in :func:`target_hidden_layers` are read for
    every token of a prompt, or only for the newest token of each step.

    Called once, when the engine starts. A prompt prefix found in the prefix cache is not
    run through the target again, so its states are not computed. Unless every
    implementation of :func:`target_hidden_layers` also implements this hook and returns
    False (one that does not is taken to read every token), the engine keeps each committed
    token's states beside its K/V (memory: layers x hidden size per token of the KV
    budget) and hands a request whose prefix came from the cache its prefix's stored
    states with the first prompt chunk (``StepResult.start`` 0). Drafters keeping a KV
    cache of their own over the prompt (EAGLE, MTP) read them all; Medusa's heads and
    ReDrafter's RNN read the newest state only (:class:`specdec.drafting.last_state.LastStateDrafter`
    returns False: no states kept), and the last prompt token is always run.

    :return: True if the states of every prompt token are read.

    Example::

        @hookimpl
        def reads_prompt_hidden_states(self):
            return False
    """


@hookspec
def compile_draft(target: TargetModel) -> None:
    """Compile the draft side's forwards, since the target's run compiled (``engine.compile``).

    Called once, when the engine starts, after the target's graphs are compiled, and only
    then: a drafter whose levels run eagerly beside a compiled target pays the Python of
    every small operator while the target pays none, so drafts cost more than they save.
    Compile here, not on the first requests
    (:meth:`specdec.drafting.runner.DraftRunner.compile` compiles a runner's module).
    Drafts may then differ from the eager ones where logits differ in their last bits;
    the output never does, since the target verifies every draft.

    :param target: the target model.
    :return: nothing.

    Example::

        @hookimpl
        def compile_draft(self, target):
            self.runner.compile()
    """


@hookspec(firstresult=True)
def prepare_draft_tokens(requests: list[Request], draft_lens: list[int],
                         max_nodes: list[int]) -> list[DraftProposal | None]:
    """Propose draft tokens, a chain or a tree, for every request of this step.

    Called once per engine step for the requests that speculate this step (those still
    prefilling, or with speculation switched off, are left out). The first implementation
    returning a non-None list decides. The adaptive planner may then verify a proposal
    less deep than proposed (or not at all) where deeper drafts of its
    :attr:`~specdec.drafting.interface.DraftProposal.kind` do not pay.

    :param requests: the requests; ``request.token_ids`` holds prompt and accepted output,
        ``request.drafter_state`` is a dict the drafter may keep per-request state in, and
        ``request.generator`` the request's seeded ``torch.Generator`` for sampling drafts
        (worth it where ``request.sampling_params.draws_drafts``: greedy and seeded requests
        keep a draft only where it equals the target's own token, so their best draft is
        the drafter's likeliest, and its distribution goes unread).
    :param draft_lens: the most draft tokens (tree: most depth) each request may get this
        step: the adaptive planner's choice, or the draft-length schedule's and the
        acceptance-based switch's where those are configured.
    :param max_nodes: the most tree nodes each request may get this step
        (``max_total_draft_tokens`` within the step's token budget; for chains it equals
        ``draft_lens``). Nodes beyond it are trimmed, last nodes first: list the best first.
    :return: one :class:`~specdec.drafting.interface.DraftProposal` per request, or ``None`` for a
        request with nothing to propose (it then decodes one token this step).

    Example::

        @hookimpl
        def prepare_draft_tokens(self, requests, draft_lens):
            return [DraftProposal(token_ids=lookup(r.token_ids)[:k]) for r, k in zip(requests, draft_lens)]
    """


@hookspec(firstresult=True)
def build_tree_mask(request: Request, proposal: DraftProposal) -> TreeMask | None:
    """Build the attention mask and positions of one request's verification tokens.

    Called once per request and step with a proposal, after :func:`prepare_draft_tokens`.
    The core implements it (``trylast``) from ``proposal.parents``: each node sees the root
    and its ancestors, at position root + depth. A method whose proposal adds tokens with
    another pattern (lookahead's Jacobi window in ``aux_token_ids``) implements it for its
    own proposals and returns None for the others.

    :param request: the request the proposal is for.
    :param proposal: the proposal.
    :return: a :class:`~specdec.drafting.interface.TreeMask` over ``1 + len(token_ids) +
        len(aux_token_ids)`` tokens, or None to leave it to the next implementation.

    Example::

        @hookimpl
        def build_tree_mask(self, request, proposal):
            if not proposal.aux_token_ids:
                return None          # plain tree: the core's mask
            return TreeMask(mask=my_mask(proposal), position_offsets=my_positions(proposal))
    """


@hookspec
def on_draft_verified(results: list[StepResult]) -> None:
    """Learn what the target accepted: update pools, windows, draft KV caches.

    Called after every engine step, after the KV cache kept the accepted path, with one
    :class:`~specdec.drafting.interface.StepResult` per request that ran in the step (prefill chunks
    included, so a drafter that keeps its own KV can fill it from the prompt's hidden
    states). Every implementation is called.

    :param results: the per-request results; ``result.request.token_ids`` already holds
        the new tokens.
    :return: nothing.

    Example::

        @hookimpl
        def on_draft_verified(self, results):
            for r in results:
                self.pool(r.request).extend(r.request.token_ids, len(r.new_token_ids))
    """


@hookspec
def on_request_finished(request: Request) -> None:
    """Release what the drafter holds for a request (pools, draft KV blocks).

    Called once when a request ends for any reason: finished, cancelled or failed.

    :param request: the request that ended.
    :return: nothing.

    Example::

        @hookimpl
        def on_request_finished(self, request):
            self.kv.free(request.request_id)
    """
