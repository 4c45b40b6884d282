"""Structured output: grammar masks on every verified position, drafts the grammar forbids
pruned, sampled output following the masked target distribution."""

import json
import re

import pytest
import torch
from specdec_test_support import embedded

from specdec import LLM, SamplingParams, hookimpl
from specdec.drafting.interface import DraftProposal
from specdec.errors import FieldError, RequestError
from specdec.sampler.grammar import GrammarCompiler, apply_masks
from specdec.sampling_params import StructuredOutputs

COLORS = r"(red|green|blue)( (red|green|blue)){3,6}"


@pytest.fixture(scope="module")
def compiler(smol):
    return GrammarCompiler(smol.tokenizer, smol.target.eos_token_ids)


def _bits(row: torch.Tensor, vocab: int) -> torch.Tensor:
    return ((row[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab].bool()


def test_tree_masks_come_from_each_nodes_own_path(smol, compiler):
    """A tree listed breadth first (a node's parent is not the node before it): each row is
    the mask a fresh matcher gives after that node's path; nodes under a forbidden token are
    unreachable and their rows allow everything; the matcher ends where it began."""
    tok = smol.tokenizer
    red, green, blue, sp_red, sp_blue = (tok.encode(w)[0] for w in ("red", "green", "blue", " red", " blue"))
    bad = tok.encode("{")[0]
    grammar = compiler.grammar(StructuredOutputs(regex=COLORS))
    # root children: red, bad, green; then " blue" under red, " red" under green, " red" under bad
    prop = DraftProposal(token_ids=[red, bad, green, sp_blue, sp_red, sp_red], parents=[-1, -1, -1, 0, 2, 1])
    bitmask, reachable = grammar.masks(prop)
    assert reachable == [True, False, True, True, True, False]
    vocab = len(tok)
    for node, path in {0: [red], 2: [green], 3: [red, sp_blue], 4: [green, sp_red]}.items():
        fresh = compiler.grammar(StructuredOutputs(regex=COLORS))
        fresh.advance(path)
        assert torch.equal(_bits(bitmask[node + 1], vocab), _bits(fresh.masks()[0][0], vocab)), node
    assert (bitmask[2] == -1).all() and (bitmask[6] == -1).all()
    root = _bits(bitmask[0], vocab)
    assert root[red] and root[green] and root[blue] and not root[bad] and not root[sp_red]
    assert torch.equal(grammar.masks()[0], bitmask[:1])  # rolled back to the committed output
    # the grammar complete (7 words): EOS alone
    grammar.advance([red] + [sp_red] * 6)
    eos = sorted(smol.target.eos_token_ids)
    assert _bits(grammar.masks()[0][0], vocab).nonzero().flatten().tolist() == eos


def test_apply_masks_sets_forbidden_logits_to_minus_infinity():
    logits = torch.zeros(3, 70)
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    bitmask[0, 0] = 0b101  # tokens 0 and 2
    bitmask[1, 1] = -(1 << 31)  # token 63; 64..69 lie past the mask's words
    apply_masks(logits, torch.tensor([2, 0]), bitmask)
    assert logits[2].isfinite().nonzero().flatten().tolist() == [0, 2]
    assert logits[0].isfinite().nonzero().flatten().tolist() == [63]
    assert logits[1].isfinite().all()


def test_structured_outputs_are_checked():
    with pytest.raises(FieldError, match="exactly one"):
        StructuredOutputs(regex="a", choice=["b"])
    with pytest.raises(FieldError, match="exactly one"):
        SamplingParams(structured_outputs={})
    with pytest.raises(FieldError, match="unknown fields"):
        SamplingParams(structured_outputs={"json_schema": {}})
    with pytest.raises(FieldError, match="non-empty list"):
        StructuredOutputs(choice=[])
    with pytest.raises(FieldError, match="ignore_eos or min_tokens"):
        SamplingParams(ignore_eos=True, structured_outputs={"regex": "a+"})


def test_a_bad_grammar_is_a_clear_request_error_and_the_engine_serves_on(smol):
    for spec, message in [({"regex": "[a-"}, "unclosed character class"),
                          ({"json": "{not json"}, "structured_outputs.json"),
                          ({"grammar": "start: undefined_rule"}, "undefined_rule")]:
        with pytest.raises(RequestError, match=re.escape(message)):
            smol.generate("Hi", SamplingParams(max_tokens=4, structured_outputs=spec))
    assert not smol.engine.requests
    assert smol.generate("Hi", SamplingParams(max_tokens=3, temperature=0.0))[0].token_ids


@pytest.mark.parametrize("spec, check", [
    ({"choice": ["yes", "no", "maybe"]}, lambda text: text in ("yes", "no", "maybe")),
    ({"regex": r"[0-9]{3}-[0-9]{4}"}, lambda text: re.fullmatch(r"[0-9]{3}-[0-9]{4}", text)),
    ({"json_object": True}, lambda text: isinstance(json.loads(text), dict)),
    ({"grammar": 'root ::= "A" | "B" "!"'}, lambda text: text in ("A", "B!")),  # GBNF
    ({"grammar": 'start: answer " (" /[0-9]{1,2}/ "%)"\nanswer: "yes" | "no"'},  # Lark
     lambda text: re.fullmatch(r"(yes|no) \([0-9]{1,2}%\)", text)),
])
def test_every_kind_of_grammar_shapes_the_output(smol, spec, check):
    out = smol.chat([[{"role": "user", "content": "Answer briefly: is water wet?"}]],
                    SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=spec))[0]
    assert out.finish_reason == "stop" and check(out.text), out.text


def test_forbidden_draft_branches_are_pruned_before_the_forward(smol):
    """A tree drafter offering the right continuation beside a decoy (``@``) at every level:
    output equals plain constrained output, drafts are accepted, and every node that
    reaches the forward is one the grammar allows (decoys outside JSON strings are cut)."""
    from helpers import OracleDrafter

    prompt = smol.apply_chat_template(embedded.STRUCTURED_CHECK_PROMPTS[0])
    params = embedded.STRUCTURED_CHECK_PARAMS
    plain = smol.generate([prompt], params)[0]
    decoy = smol.tokenizer.encode("@")[0]

    class Decoys(OracleDrafter):
        offered = 0

        def _rand(self):
            return decoy

        @hookimpl
        def prepare_draft_tokens(self, requests, draft_lens):
            proposals = super().prepare_draft_tokens(requests, draft_lens)
            Decoys.offered += sum(len(p.token_ids) for p in proposals)
            return proposals

    spec = LLM(dtype="float32", speculative_config={
        "decoding_type": "user", "drafter": Decoys, "max_draft_len": 4, "adaptive": False,
        "options": {"oracle": {tuple(prompt): plain.token_ids}, "tree": True}})
    verified, forbidden = [], []
    forward = spec.engine.forward

    def watch(items):
        for it in items:
            if it.proposal is not None:
                verified.append(it.proposal.token_ids)
                forbidden.extend(not ok for ok in it.request.grammar.masks(it.proposal)[1])
        return forward(items)

    spec.engine.forward = watch
    got = spec.generate([prompt], params)[0]
    assert got.token_ids == plain.token_ids and got.metrics.num_accepted_tokens > 0
    assert verified and not any(forbidden)
    assert spec.drafter.offered > sum(len(tokens) for tokens in verified)  # decoys were cut


@pytest.mark.slow
def test_sampled_constrained_output_follows_the_masked_target():
    """Rejection sampling against the masked, renormalised target, with ngram's
    deterministic drafts (forbidden ones pruned before the forward); drafts drawn from a
    distribution are checked in the EAGLE plugin's tests."""
    assert embedded.check_structured_sampling({"decoding_type": "ngram", "max_draft_len": 3}) > 0


def test_max_tokens_zero_scores_the_prompt_alone(smol, smol_hf):
    prompt = smol.tokenizer.encode("The capital of France is Paris.")
    out = smol.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    assert out.token_ids == [] and out.finish_reason == "length" and len(out.prompt_logprobs) == len(prompt)
    with torch.no_grad():
        reference = torch.log_softmax(smol_hf(torch.tensor([prompt])).logits[0].float(), -1)
    for row, token, entry in zip(reference, prompt[1:], out.prompt_logprobs[1:]):
        assert abs(entry[token] - float(row[token])) < 1e-3


def test_only_drafts_without_a_distribution_are_pruned(smol, compiler):
    """Dropping a forbidden node keeps the output's distribution only where its ``q`` is
    one-hot: a sampled request's draft drawn from a distribution keeps it (verification
    rejects it), a greedy request's or a deterministic draft loses it."""
    from specdec.executor.draft_stage import _grammatical
    from specdec.executor.request import Request

    tok = smol.tokenizer
    red, bad = tok.encode("red")[0], tok.encode("{")[0]
    q = torch.full((2, len(tok)), 1.0 / len(tok))

    def after(params, **draft):
        req = Request(request_id="r", token_ids=[1], prompt_len=1, sampling_params=params,
                      grammar=compiler.grammar(StructuredOutputs(regex=COLORS)))
        prop, _ = _grammatical(req, DraftProposal(token_ids=[red, bad], parents=[-1, -1], **draft))
        return prop.token_ids

    sampled, greedy = SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)
    assert after(sampled, draft_probs=q, sibling_sampling="iid") == [red, bad]
    assert after(greedy, draft_probs=q, sibling_sampling="iid") == [red]
    assert after(sampled) == [red]
