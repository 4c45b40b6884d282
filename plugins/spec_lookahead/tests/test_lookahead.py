"""spec_lookahead: the window's attention pattern, greedy losslessness, sampling through the core sampler."""


from specdec_lookahead import LookaheadDrafter, LookaheadState
from specdec_test_support import embedded

from specdec import LLM, DraftProposal, SamplingParams, testing
from specdec.config_loading import config_from_dict


def test_conformance():
    testing.check_registration("lookahead", distribution="specdec-plugin-lookahead")
    testing.check_config_round_trip({"decoding_type": "lookahead", "max_window_size": 3, "max_ngram_size": 3,
                                     "max_verification_set_size": 2, "max_draft_len": 2})


def test_window_mask_is_one_jacobi_iteration_per_column():
    config = config_from_dict({"speculative_config": {"decoding_type": "lookahead", "max_window_size": 2,
                                                      "max_ngram_size": 3}}).speculative_config
    drafter = LookaheadDrafter(config, None)
    # one verification node, then levels 0 and 1 of a 2-column window: a, b | c, d
    prop = DraftProposal(token_ids=[4], aux_token_ids=[10, 11, 12, 13], aux_position_offsets=[1, 2, 2, 3])
    tm = drafter.build_tree_mask(None, prop)
    root, node, a, b, c, d = range(6)
    sees = lambda row: [j for j in range(6) if tm.mask[row, j]]  # noqa: E731
    assert sees(node) == [root, node]
    assert sees(a) == [root, a]
    assert sees(b) == [root, a, b]
    assert sees(c) == [root, a, c]  # column 0: level 0 then level 1
    assert sees(d) == [root, a, b, d]  # column 1: level 0 up to column 1, then level 1
    assert tm.position_offsets.tolist() == [0, 1, 1, 2, 2, 3]


def test_window_moves_up_and_feeds_the_pool():
    state = LookaheadState([1, 2, 3], window=2, ngram=3, seed=0)
    state.levels = [[1, 2], [3, 4]]
    state.add((1, 3, 9), keep=2)
    state.add((1, 3, 9), keep=2)
    state.add((1, 5, 6), keep=2)
    state.add((1, 7, 7), keep=2)
    assert state.pool[1] == [(5, 6), (7, 7)]  # newest kept, no duplicates


def test_greedy_lossless_on_embedded_model():
    prompts = [[{"role": "user", "content": "Give me three tips for keeping houseplants alive."}],
               [{"role": "user", "content": "Count from one to twenty in words."}]]
    params = SamplingParams(max_tokens=40, temperature=0.0)
    want = embedded.embedded_llm().chat(prompts, params)
    # adaptive off: the planner follows measured step times, and under load it may never draft
    spec = LLM(speculative_config={"decoding_type": "lookahead", "adaptive": False})
    got = spec.chat(prompts, params)
    for a, b in zip(want, got):
        assert b.token_ids == a.token_ids
    assert sum(o.metrics.num_accepted_tokens for o in got) > 0


def test_sampling_follows_target_distribution_through_core_sampler(tmp_path):
    """The 4th token: by then the Jacobi window has filled the pool and drafts are verified."""
    _, accepted = testing.check_sampling_lossless(
        {"decoding_type": "lookahead", "max_window_size": 4, "max_ngram_size": 2, "max_draft_len": 1},
        testing.tiny_model_dir(tmp_path, vocab_size=32), prompt=[3, 4, 5, 3, 4, 5, 3, 4],
        params=SamplingParams(temperature=0.7, top_k=3), position=3)
    assert accepted > 0


def test_the_window_seed_is_the_same_in_every_process():
    """Python's str hash is salted per process; the window must not depend on it: a process
    with another salt than this one's builds the same window."""
    import contextlib
    import io
    import os
    import subprocess
    import sys

    code = ("from specdec_lookahead import LookaheadDrafter, LookaheadState;"
            "import types, zlib;"
            "d = LookaheadDrafter.__new__(LookaheadDrafter);"
            "d.config = types.SimpleNamespace(max_window_size=4, max_ngram_size=3);"
            "r = types.SimpleNamespace(request_id='req-7', token_ids=list(range(100)), drafter_state={});"
            "print(d._state(r).levels)")
    other = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"
    there, salted = subprocess.run([sys.executable, "-c", code + ";print(hash('req-7'))"], capture_output=True,
                                   text=True, check=True,
                                   env={**os.environ, "PYTHONHASHSEED": other}).stdout.splitlines()
    here = io.StringIO()
    with contextlib.redirect_stdout(here):
        exec(code, {})
    assert hash("req-7") != int(salted)  # the other process's salt is another
    assert here.getvalue() == there + "\n" and there.startswith("[[")


def test_structured_output_is_the_constrained_targets():
    """JSON-schema output with the n-gram pool's drafts, drafts the grammar forbids pruned."""
    embedded.check_structured_lossless({"decoding_type": "lookahead"})
