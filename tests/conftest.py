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


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation by full forwards of the stock model, no KV cache involved."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]
