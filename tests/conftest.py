import os
import warnings

import torch

if not torch.cuda.is_available():
    # Triton kernels run on the CPU through the interpreter; it must be chosen before any
    # kernel module is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore", category=UserWarning)


#: the files whose end-to-end checks run ``LLM()``'s compiled default target (the embedded
#: model's GGUF blocks, :func:`specdec_test_support.embedded.embedded_llm`)
DEFAULT_TARGET_FILES = frozenset({
    "tests/executor/test_engine.py", "tests/executor/test_lookup_drafts.py", "tests/executor/test_prefix_cache.py",
    "tests/model/test_quantization.py",
    *(f"plugins/spec_{name}/tests/test_{name}.py" for name in (
        "draft_target", "eagle", "lookahead", "medusa", "mtp", "ngram", "redrafter", "suffix"))})


#: files of a few tests that run long (end to end, or compiling): xdist hands out files by
#: their number of tests, most first, which would leave these last, one worker running one
#: while the other is idle
LONG_FEW_TEST_FILES = frozenset({
    "tests/executor/test_long_context.py", "tests/executor/test_seeded_sampling.py", "tests/model/test_compile.py",
    "tests/parallel/test_parallel_embedded.py", "tests/parallel/test_parallel_serving.py",
    "tests/serving/test_soak.py", *(f"plugins/spec_{name}/tests/test_{name}_train.py"
                                    for name in ("eagle", "medusa", "mtp", "redrafter"))})

DEFAULT_TARGET_GROUP = "the default target's files"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under ``--dist loadfile`` (CI's command) a file's tests run on one worker, and the
    :data:`DEFAULT_TARGET_FILES` on one worker together: it compiles the target's and the
    drafters' graphs once for all of them, where each worker would compile them (a minute
    or more a graph with torch's caches empty). That group goes out first, then the
    :data:`LONG_FEW_TEST_FILES`, then the rest in xdist's order, so that the suite ends on
    short files."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class DefaultTargetTogether(LoadFileScheduling):
        ordered = False

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return DEFAULT_TARGET_GROUP if path in DEFAULT_TARGET_FILES else path

        def _assign_work_unit(self, node) -> None:
            if not self.ordered:  # once, when the first file goes out
                self.ordered = True
                for scope in sorted(self.workqueue, key=lambda scope: (scope != DEFAULT_TARGET_GROUP,
                                                                       scope not in LONG_FEW_TEST_FILES)):
                    self.workqueue.move_to_end(scope)
            super()._assign_work_unit(node)

    return DefaultTargetTogether(config, log)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """arch -> directory of a tiny random model of that architecture."""
    from specdec import testing

    root = tmp_path_factory.mktemp("tiny")
    return {arch: testing.tiny_model_dir(root, arch) for arch in testing.TINY_ARCHITECTURES}


@pytest.fixture(scope="session")
def smol():
    """The embedded SmolLM2-135M-Instruct in float32, no speculation."""
    from specdec import LLM

    return LLM(dtype="float32")


@pytest.fixture(scope="session")
def w4a8():
    """The embedded model on the default target (the GGUF's blocks on the integer-dot
    kernels, batch-invariant), eager (``compile: false``): for checks of the engine's and the
    server's behaviour rather than of float32 numerics. Its answers are the same however
    requests are batched, and it decodes four times as fast as float32, whose weights a step
    streams four times over."""
    from specdec import LLM

    return LLM(engine={"compile": False})


@pytest.fixture(scope="session")
def smol_hf():
    """The same weights as a stock transformers model (the reference)."""
    from transformers import AutoModelForCausalLM

    from specdec.model.loading import resolve_model_dir

    return AutoModelForCausalLM.from_pretrained(resolve_model_dir(None), dtype=torch.float32).eval()


def stock_model(directory):
    """The stock transformers model of ``directory`` in float32, with eager attention: the
    reference attention of every transformers version (5.17 gives Gemma-2 sdpa by default,
    which drops its attention soft-capping; 5.24 refuses sdpa for it)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager").eval()


def reference_greedy(model, prompt: list[int], n: int, cached: bool = False) -> list[int]:
    """Greedy continuation by full forwards of the stock model, no KV cache involved; or
    (``cached``) by its decoding with transformers' own KV cache, for a model whose full
    forwards cost seconds a token (its sums then differ from ours by float32 rounding only:
    a divergence must be a near-tie). End of sequence is a token like any other."""
    seq = list(prompt)
    with torch.no_grad():
        if not cached:
            for _ in range(n):
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
            return seq[len(prompt):]
        out = model(torch.tensor([seq]), use_cache=True)
        for i in range(n):
            seq.append(int(out.logits[0, -1].argmax()))
            if i + 1 < n:
                out = model(torch.tensor([seq[-1:]]), cache=out.cache, use_cache=True)
    return seq[len(prompt):]
