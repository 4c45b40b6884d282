"""The directory `specdec train draft_target` writes: a transformers model directory whose
input embeddings and LM head are the target's.

    config.json             the draft's transformers config (the target's architecture with
                            fewer layers) and a ``specdec_draft`` section naming the target
    model.safetensors       the draft's own weights (bfloat16), without embeddings and head
    draft_vocab.safetensors the target token ids the draft predicts (``token_ids``)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specdec.plugin_api import (
    SECTION,
    TargetParts,
    load_state_checked,
    load_tensors,
    read_config,
    save_draft_vocab,
    save_tensors,
)

#: The draft shipped for the embedded SmolLM2-135M-Instruct (docs/training.md).
SHIPPED_DRAFT = Path(__file__).parent / "weights" / "smollm2-135m-instruct"
WEIGHTS = "model.safetensors"


def shared_prefixes(model) -> tuple[str, ...]:
    """State-dict prefixes of the modules the draft shares with its target."""
    names = {id(m): n for n, m in model.named_modules()}
    return tuple(names[id(m)] + "." for m in (model.get_input_embeddings(), model.get_output_embeddings()))


def build_draft_model(config, parts: TargetParts, dtype: torch.dtype):
    """A causal LM of ``config`` whose embeddings and LM head are the target's own modules."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.set_input_embeddings(parts.embed_tokens)
    model.set_output_embeddings(parts.lm_head)
    return model


def load_trained_draft(directory: Path, target):
    from transformers import AutoConfig

    data = read_config(directory)
    config = AutoConfig.for_model(data.pop("model_type"), **{k: v for k, v in data.items() if k != SECTION})
    model = build_draft_model(config, target.parts, target.dtype)
    load_state_checked(model, load_tensors(directory / WEIGHTS), directory / WEIGHTS, shared=shared_prefixes(model))
    return model.to(target.device).eval()


def save_trained_draft(model, directory: Path, meta: dict, draft_vocab: torch.Tensor | None) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    shared = shared_prefixes(model)
    state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items() if not k.startswith(shared)}
    save_tensors(state, directory / WEIGHTS)
    config = model.config.to_dict()
    config[SECTION] = meta
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if draft_vocab is not None:
        save_draft_vocab(directory, draft_vocab)
