"""Loading and saving Medusa heads in the published layouts.

- Medusa-1 (the reference's ``MedusaModel``): a directory with ``config.json``
  (``medusa_num_heads``, ``medusa_num_layers``, ``base_model_name_or_path``) and
  ``medusa_lm_head.safetensors`` or ``medusa_lm_head.pt`` holding ``{k}.{j}.linear.*`` and
  ``{k}.{L}.weight``. Published configs often understate the head count, so it is read
  from the weights.
- Medusa-2 (heads trained together with the model): the model's own safetensors files
  with the same keys under ``medusa_head.``.

``specdec train medusa`` writes the Medusa-1 layout, without the per-head projection when
the heads share the target's LM head, plus the core's ``specdec_draft`` section.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from specdec.plugin_api import SECTION, ModelLoadError, check_target, load_tensors, read_config, save_tensors

from .heads import MedusaHeads

MEDUSA1_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
MEDUSA2_PREFIX = "medusa_head."
SHIPPED_HEADS = Path(__file__).parent / "weights" / "smollm2-135m-instruct-medusa"
_KEY = re.compile(r"^(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)$")


def _medusa2_state(directory: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                if key.startswith(MEDUSA2_PREFIX):
                    state[key[len(MEDUSA2_PREFIX):]] = f.get_tensor(key)
    return state


def read_state(directory: Path) -> tuple[dict[str, torch.Tensor], Path]:
    """The heads' tensors (Medusa-1 file, or Medusa-2 keys inside the model) and their file."""
    for name in MEDUSA1_FILES:
        if (directory / name).is_file():
            return load_tensors(directory / name), directory / name
    state = _medusa2_state(directory)
    if not state:
        raise ModelLoadError(f"{directory}: no Medusa heads there: expected {' or '.join(MEDUSA1_FILES)} "
                             f"(Medusa-1) or tensors named {MEDUSA2_PREFIX}* in its safetensors files (Medusa-2)")
    return state, directory


def heads_shape(state: dict[str, torch.Tensor], where: Path) -> tuple[int, int, int, int | None]:
    """(hidden size, heads, blocks per head, vocabulary of the projection or None) from the keys."""
    heads: dict[int, set[int]] = {}
    projection: dict[int, int] = {}
    for key, tensor in state.items():
        match = _KEY.match(key)
        if match is None:
            raise ModelLoadError(f"{where}: unexpected tensor {key!r} for Medusa heads (expected "
                                 "{head}.{block}.linear.weight/bias and {head}.{num_layers}.weight)")
        head, block, kind = int(match[1]), int(match[2]), match[3]
        if kind == "weight":
            projection[head] = tensor.shape[0]
        else:
            heads.setdefault(head, set()).add(block)
    if not heads or sorted(heads) != list(range(len(heads))):
        raise ModelLoadError(f"{where}: Medusa heads must be numbered 0..N-1; found {sorted(heads)}")
    layers = {len(blocks) for blocks in heads.values()}
    if len(layers) != 1:
        raise ModelLoadError(f"{where}: the heads have different numbers of blocks {sorted(layers)}")
    vocabs = set(projection.values())
    if projection and (len(projection) != len(heads) or len(vocabs) != 1):
        raise ModelLoadError(f"{where}: every head needs its projection {{head}}.{layers.pop()}.weight, or none")
    hidden = state["0.0.linear.weight"].shape[1]
    return hidden, len(heads), layers.pop(), vocabs.pop() if vocabs else None


def load_heads(directory: Path, target) -> MedusaHeads:
    """The heads in ``directory`` for ``target``; a ModelLoadError names what does not fit."""
    config = read_config(directory)
    meta = config.get(SECTION)
    if meta is not None:
        check_target(directory, meta, target)
    state, where = read_state(directory)
    hidden, num_heads, num_layers, vocab = heads_shape(state, where)
    if hidden != target.hidden_size:
        raise ModelLoadError(f"Medusa heads {where} read hidden states of size {hidden}, but the target "
                             f"{target.name!r} has hidden size {target.hidden_size}")
    if vocab is not None and vocab != target.vocab_size:
        raise ModelLoadError(f"Medusa heads {where} predict over {vocab} tokens, but the target {target.name!r} "
                             f"has a vocabulary of {target.vocab_size}")
    heads = MedusaHeads(hidden, num_heads, num_layers, vocab)
    heads.load_state_dict(state)
    return heads


def save_heads(heads: MedusaHeads, directory: Path, meta: dict) -> None:
    """Write ``heads`` in the Medusa-1 layout (bfloat16)."""
    directory.mkdir(parents=True, exist_ok=True)
    save_tensors({k: v.to(torch.bfloat16) for k, v in heads.state_dict().items()},
                 directory / MEDUSA1_FILES[0])
    config = {"medusa_num_heads": len(heads), "medusa_num_layers": heads.num_layers,
              "hidden_size": heads.hidden_size, "base_model_name_or_path": meta["target"]["name"],
              "shares_lm_head": heads.shares_lm_head, SECTION: meta}
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
