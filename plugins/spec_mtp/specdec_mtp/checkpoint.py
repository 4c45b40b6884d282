"""Where an MTP module comes from, and its files.

* The target's own checkpoint, for models that ship MTP layers (DeepSeek-V3/R1 and the
  like, ``num_nextn_predict_layers`` in their config): transformers drops those tensors
  when it loads the model, so they are read here straight from the safetensors files
  (``model.layers.{N}.*``, only those bytes).
* A separate directory in the same layout: ``config.json`` with ``num_hidden_layers``
  (the target's ``N``) and ``num_nextn_predict_layers``, ``model.safetensors`` with the
  module under ``model.layers.{N}.``; what ``specdec train mtp`` writes, plus its
  ``specdec_draft`` target signature and, optionally, the reduced drafting vocabulary
  (``draft_vocab.safetensors``) that makes each draft step's logits cheaper.
* On the embedded model, the module shipped in this package.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specdec.plugin_api import (
    SECTION,
    ModelLoadError,
    check_target,
    drafter_directory,
    load_state_checked,
    load_tensors,
    read_config,
    save_tensors,
)

from .model import REQUIRED, MTPModule

SHIPPED_MODULE = Path(__file__).parent / "weights" / "smollm2-135m-instruct-mtp"
INDEX = "model.safetensors.index.json"
WEIGHTS = "model.safetensors"


def has_mtp_layers(directory: Path | None, hf_config) -> bool:
    """Whether a target checkpoint declares MTP layers (they are looked for when it does)."""
    return directory is not None and int(getattr(hf_config, "num_nextn_predict_layers", 0) or 0) > 0


def module_directory(speculative_model: str | None, target) -> Path:
    """The directory holding the module: ``speculative_model``; else the target's own
    checkpoint when its config declares MTP layers; else the shipped module (embedded
    model only; elsewhere a clear error)."""
    if speculative_model is None and has_mtp_layers(target.path, target.hf_config):
        return Path(target.path)
    return drafter_directory(speculative_model, target, SHIPPED_MODULE, "mtp", "an MTP module")


def _weight_files(directory: Path, prefix: str) -> list[Path]:
    index = directory / INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return sorted({directory / f for k, f in weight_map.items() if k.startswith(prefix)})
    if (directory / WEIGHTS).is_file():
        return [directory / WEIGHTS]
    raise ModelLoadError(f"MTP checkpoint {directory}: no {WEIGHTS} or {INDEX} there; give the directory "
                         "`specdec train mtp` wrote, or a checkpoint with MTP layers")


def layer_offset(directory: Path, target) -> int:
    """``N``: the module sits at ``model.layers.{N}``. The target's own checkpoint, or a
    module written for it, says ``num_hidden_layers``; it must be the target's."""
    cfg = read_config(directory)
    n = cfg.get("num_hidden_layers", target.num_layers)
    if n != target.num_layers:
        raise ModelLoadError(f"MTP checkpoint {directory / 'config.json'}: num_hidden_layers {n} puts the module at "
                             f"model.layers.{n}, but the target has {target.num_layers} layers; it was made for "
                             "another model")
    if SECTION in cfg:
        check_target(directory, cfg[SECTION], target)
    return n


def load_module(directory: Path, target, module: MTPModule) -> None:
    """Fill ``module`` (built for ``target``) from the checkpoint in ``directory``; errors
    name the file and what is missing or mis-sized."""
    prefix = f"model.layers.{layer_offset(directory, target)}."
    state: dict[str, torch.Tensor] = {}
    files = _weight_files(directory, prefix)
    for path in files:
        state.update({k[len(prefix):]: v for k, v in load_tensors(path, prefix).items()})
    where = ", ".join(str(p) for p in files) or str(directory)
    missing = [prefix + k for k in REQUIRED if k not in state]
    if missing:
        raise ModelLoadError(f"MTP checkpoint {where} has no MTP module tensors ({', '.join(missing)} missing): the "
                             "model ships no MTP layers; give a module trained with `specdec train mtp` as "
                             "speculative_model")
    hidden = target.hidden_size
    if tuple(state["eh_proj.weight"].shape) != (hidden, 2 * hidden):
        raise ModelLoadError(f"MTP checkpoint {where}: {prefix}eh_proj.weight is {tuple(state['eh_proj.weight'].shape)}"
                             f", the target (hidden size {hidden}) needs ({hidden}, {2 * hidden})")
    head = state.get("shared_head.head.weight")
    if head is not None and head.shape[0] != target.vocab_size:
        raise ModelLoadError(f"MTP checkpoint {where}: {prefix}shared_head.head.weight covers {head.shape[0]} tokens, "
                             f"the target's vocabulary has {target.vocab_size}")
    if head is not None and module.shared_head.head is None:
        module.shared_head.head = torch.nn.Linear(hidden, target.vocab_size, bias=False)
    load_state_checked(module, module.from_layout(state), Path(where), shared=("shared_head.head",))


def save_module(module: MTPModule, directory: Path, target, meta: dict) -> None:
    """Write ``module`` as ``model.layers.{N}.*`` in ``model.safetensors`` with its config."""
    directory.mkdir(parents=True, exist_ok=True)
    prefix = f"model.layers.{target.num_layers}."
    save_tensors({prefix + k: v for k, v in module.layout_state().items()}, directory / WEIGHTS)
    cfg = target.parts.hf_config
    config = {"model_type": getattr(cfg, "model_type", None), "hidden_size": target.hidden_size,
              "vocab_size": target.vocab_size, "num_hidden_layers": target.num_layers,
              "num_nextn_predict_layers": 1, SECTION: meta}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
