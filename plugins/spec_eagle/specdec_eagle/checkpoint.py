"""EAGLE head checkpoints in their published layouts, checked against the target.

A checkpoint is a directory with ``config.json`` (a Llama config of the head: one layer)
and ``model.safetensors`` or ``pytorch_model.bin``:

* EAGLE-1/2 (SafeAILab's release): ``fc.weight`` ``[H, 2H]``, ``fc.bias``, ``layers.0.*``
  (no ``input_layernorm``), optionally ``embed_tokens.weight``; the LM head is the target's.
* EAGLE-3 (its authors' release and SpecForge's export, ``LlamaForCausalLMEagle3``):
  ``fc.weight`` ``[H, 3H_target]``, ``midlayer.*`` (with ``hidden_norm``), ``norm.weight``,
  ``lm_head.weight`` ``[draft_vocab_size, H]``, ``d2t`` ``[draft_vocab_size]`` (target id
  minus draft id) and ``t2d`` ``[vocab]`` (bool), both absent when the vocabularies are
  equal; optionally ``embed_tokens.weight``. The captured target layers are read from
  ``eagle_config.eagle_aux_hidden_state_layer_ids`` where the config has them.

Heads written by ``specdec train eagle|eagle3`` use the same layouts, plus the
``specdec_draft`` section naming the target they were trained for; an EAGLE-1 head
trained on a reduced vocabulary also has ``draft_vocab.safetensors`` (the target ids it
drafts over, read by specdec only).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import LlamaConfig

from specdec.plugin_api import (
    SECTION,
    ModelLoadError,
    check_target,
    load_state_checked,
    load_tensors,
    read_config,
    save_draft_vocab,
    save_tensors,
)

from .modules import Eagle1Head, Eagle3Head, EagleHead

#: Heads shipped for the embedded SmolLM2-135M-Instruct (docs/training.md).
SHIPPED_HEADS = {1: Path(__file__).parent / "weights" / "smollm2-135m-instruct-eagle",
                 3: Path(__file__).parent / "weights" / "smollm2-135m-instruct-eagle3"}
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
WEIGHTS = WEIGHT_FILES[0]
#: Config keys that describe the file, not the head's shape.
_NOT_MODEL_KEYS = {SECTION, "architectures", "eagle_config", "transformers_version", "torch_dtype", "dtype"}


def default_capture_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low, middle and high layers, as its reference and SpecForge pick them
    (clamped to the target's layers for very shallow models)."""
    return [min(max(layer, 0), num_layers - 1) for layer in (1, num_layers // 2 - 1, num_layers - 4)]


def head_config(target_config, **overrides) -> LlamaConfig:
    """A one-layer Llama config of the target's sizes (heads trained here)."""
    data = target_config.to_dict()
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "rope_parameters", "max_position_embeddings", "vocab_size", "attention_bias")
    return LlamaConfig(**{k: data[k] for k in keep if data.get(k) is not None}, num_hidden_layers=1,
                       **overrides)


def _weights_path(directory: Path) -> Path:
    for name in WEIGHT_FILES:
        if (directory / name).is_file():
            return directory / name
    raise ModelLoadError(f"EAGLE head {directory}: no {' or '.join(WEIGHT_FILES)} there")


def _generation_of(state: dict) -> int | None:
    if any(k.startswith("midlayer.") for k in state):
        return 3
    if "fc.weight" in state and any(k.startswith("layers.0.") for k in state):
        return 1
    return None


def load_head(directory: Path, generation: int, target,
              capture_layers: list[int] | None) -> tuple[EagleHead, list[int]]:
    """The head in ``directory`` for ``target`` (a TargetModel), and the target layers it reads
    (``[-1]`` for EAGLE-1). A head of another generation or target is a ModelLoadError
    naming the mismatch."""
    data = read_config(directory)
    meta = data.get(SECTION)
    if meta is not None:
        check_target(directory, meta, target)
    path = _weights_path(directory)
    state = load_tensors(path)
    found = _generation_of(state)
    if found is None:
        raise ModelLoadError(f"{path} is not an EAGLE head: expected fc.weight with layers.0.* (EAGLE-1) or "
                             f"midlayer.* (EAGLE-3); it has {sorted(state)[:5]}")
    if found != generation:
        wanted = "eagle" if found == 1 else "eagle3"
        raise ModelLoadError(f"{directory} is an EAGLE-{found} head; use decoding_type {wanted!r} for it")
    cfg = LlamaConfig(**{k: v for k, v in data.items() if k not in _NOT_MODEL_KEYS})
    hidden, vocab = target.hidden_size, target.vocab_size
    if cfg.vocab_size != vocab:
        raise ModelLoadError(f"EAGLE head {directory} is for a vocabulary of {cfg.vocab_size} tokens, but the "
                             f"target {target.name!r} has {vocab}")
    if "embed_tokens.weight" in state and state["embed_tokens.weight"].shape[1] != cfg.hidden_size:
        raise ModelLoadError(f"{path}: embed_tokens.weight has width {state['embed_tokens.weight'].shape[1]}, "
                             f"the head's hidden size is {cfg.hidden_size}")
    if generation == 1:
        if cfg.hidden_size != hidden:
            raise ModelLoadError(f"EAGLE head {directory} has hidden size {cfg.hidden_size}, but the target "
                                 f"{target.name!r} has {hidden}; EAGLE-1 reads the target's features and LM head")
        head: EagleHead = Eagle1Head(cfg, fc_bias="fc.bias" in state)
        layers = [-1]
    else:
        layers = list(capture_layers or data.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids")
                      or default_capture_layers(target.num_layers))
        fc_in = state["fc.weight"].shape[1]
        if fc_in != len(layers) * hidden:
            raise ModelLoadError(f"EAGLE-3 head {directory}: fc.weight reads {fc_in} features, but "
                                 f"{len(layers)} target layers {layers} of the target {target.name!r} give "
                                 f"{len(layers) * hidden}")
        draft_vocab = int(getattr(cfg, "draft_vocab_size", None) or state["lm_head.weight"].shape[0])
        if draft_vocab != vocab and "d2t" not in state:
            raise ModelLoadError(f"EAGLE-3 head {directory}: its draft vocabulary ({draft_vocab} tokens) differs "
                                 f"from the target's ({vocab}) but the checkpoint has no d2t mapping")
        head = Eagle3Head(cfg, hidden, len(layers), draft_vocab, vocab)
        if draft_vocab == vocab:
            state = {k: v for k, v in state.items() if k not in ("d2t", "t2d")}
    if "embed_tokens.weight" in state:
        head.embed_tokens = torch.nn.Embedding(vocab, cfg.hidden_size)
    state = {k: (v.long() if k == "d2t" else v.bool() if k == "t2d" else v) for k, v in state.items()}
    load_state_checked(head, state, path)
    if generation == 3 and head.draft_to_target is not None:
        ids = head.draft_to_target
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ModelLoadError(f"{path}: d2t maps draft tokens outside the target's vocabulary 0..{vocab - 1}")
    return head, layers


def save_head(head: EagleHead, directory: Path, meta: dict, capture_layers: list[int],
              vocab: torch.Tensor | None = None) -> None:
    """Write ``head`` in its generation's published layout (bfloat16, target-shared
    tensors left out); ``vocab``: an EAGLE-1 head's drafting vocabulary."""
    directory.mkdir(parents=True, exist_ok=True)
    config = head.config.to_dict()
    config["architectures"] = ["LlamaForCausalLMEagle3" if head.generation == 3 else "LlamaForCausalLM"]
    if head.generation == 3:
        config["draft_vocab_size"] = head.lm_head.weight.shape[0]
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(capture_layers)}
    config[SECTION] = meta
    state = {k: (v if k in ("d2t", "t2d") else v.to(torch.bfloat16)) for k, v in head.state_dict().items()
             if not k.startswith(("rotary_emb.", "lm_head.", "embed_tokens.")) or
             (head.generation == 3 and k.startswith("lm_head."))}
    save_tensors(state, directory / WEIGHTS)
    if vocab is not None and head.generation == 1:
        save_draft_vocab(directory, vocab)
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
