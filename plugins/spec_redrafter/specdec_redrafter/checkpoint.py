"""Loading and saving recurrent drafters in the reference's layout.

A directory as ``Drafter.save_pretrained`` writes it: ``config.json`` (``model_type``
``recurrent_drafting_drafter``, ``hidden_size``, ``vocab_size``, ``exit_dim``,
``num_draft_layers``, ``rnn``) and ``model.safetensors`` or ``pytorch_model.bin``. The
sizes are read from the tensors themselves and checked against the config and the target;
a file without ``lm_head.{num_draft_layers}.weight`` shares the target's LM head.
``specdec train redrafter`` writes this layout plus the core's ``specdec_draft`` section
and, for a reduced drafting vocabulary, ``draft_vocab.safetensors``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from specdec.plugin_api import SECTION, ModelLoadError, check_target, load_tensors, read_config, save_tensors

from .model import MODEL_TYPE, DrafterShape, RecurrentDrafter

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
SHIPPED_DRAFTER = Path(__file__).parent / "weights" / "smollm2-135m-instruct-redrafter"
_BLOCK = re.compile(r"^lm_head\.(\d+)\.linear\.(weight|bias)$")
_OWN = {"input_proj.weight", "input_proj.bias", "rnn_u.weight", "rnn_u.bias", "rnn_w.weight"}


def read_state(directory: Path) -> tuple[dict[str, torch.Tensor], Path]:
    for name in WEIGHT_FILES:
        if (directory / name).is_file():
            return load_tensors(directory / name), directory / name
    raise ModelLoadError(f"{directory}: no drafter weights there: expected {' or '.join(WEIGHT_FILES)} "
                         "(the reference's Drafter.save_pretrained layout)")


def drafter_shape(state: dict[str, torch.Tensor], where: Path) -> DrafterShape:
    """The drafter's sizes, read from its tensor names and shapes."""
    blocks = sorted({int(m[1]) for k in state if (m := _BLOCK.match(k))})
    if blocks != list(range(len(blocks))):
        raise ModelLoadError(f"{where}: ResBlocks lm_head.{{i}}.linear must be numbered 0..N-1; found {blocks}")
    layers = len(blocks)
    projection = state.get(f"lm_head.{layers}.weight")
    known = _OWN | {f"lm_head.{layers}.weight"} | {f"lm_head.{i}.linear.{p}" for i in blocks
                                                   for p in ("weight", "bias")}
    unexpected = sorted(set(state) - known)
    if unexpected:
        raise ModelLoadError(f"{where}: unexpected tensors {unexpected[:4]} for a recurrent drafter (expected "
                             "input_proj.*, lm_head.{i}.linear.*, lm_head.{N}.weight, rnn_u.*, rnn_w.weight)")
    rnn = "rnn_w.weight" in state
    if rnn != ("rnn_u.weight" in state):
        raise ModelLoadError(f"{where}: rnn_w.weight and rnn_u.weight come together (rnn: true) or not at all")
    if "input_proj.weight" in state:
        exit_dim, hidden = state["input_proj.weight"].shape[0], state["input_proj.weight"].shape[1] // 2
    elif blocks or projection is not None:  # no input_proj: the head reads [h; s] directly
        exit_dim = state["lm_head.0.linear.weight"].shape[0] if blocks else projection.shape[1]
        hidden = exit_dim // 2
    else:
        raise ModelLoadError(f"{where}: no input_proj, ResBlock or projection: not a recurrent drafter")
    if rnn and state["rnn_w.weight"].shape[0] != hidden:
        raise ModelLoadError(f"{where}: rnn_w.weight is {tuple(state['rnn_w.weight'].shape)}, but the drafter "
                             f"reads [hidden; state] of 2 x {hidden}")
    return DrafterShape(hidden_size=hidden, exit_dim=exit_dim, num_draft_layers=layers, rnn=rnn,
                        vocab_size=None if projection is None else projection.shape[0])


def load_drafter(directory: Path, target) -> RecurrentDrafter:
    """The drafter in ``directory`` for ``target``; a ModelLoadError names what does not fit."""
    config = read_config(directory)
    if SECTION in config:
        check_target(directory, config[SECTION], target)
    state, where = read_state(directory)
    shape = drafter_shape(state, where)
    for key, have in (("hidden_size", shape.hidden_size), ("num_draft_layers", shape.num_draft_layers),
                      ("exit_dim", shape.exit_dim)):
        if key in config and config[key] != have:
            raise ModelLoadError(f"{directory / 'config.json'} says {key} {config[key]}, but {where} holds a "
                                 f"drafter with {key} {have}")
    if shape.hidden_size != target.hidden_size:
        raise ModelLoadError(f"recurrent drafter {where} reads hidden states of size {shape.hidden_size}, but the "
                             f"target {target.name!r} has hidden size {target.hidden_size}")
    if shape.vocab_size is not None and shape.vocab_size != target.vocab_size:
        raise ModelLoadError(f"recurrent drafter {where} predicts over {shape.vocab_size} tokens, but the target "
                             f"{target.name!r} has a vocabulary of {target.vocab_size}")
    if shape.shares_lm_head and shape.exit_dim != target.hidden_size:
        raise ModelLoadError(f"recurrent drafter {where} has no projection lm_head.{shape.num_draft_layers}.weight, "
                             f"so it reads the target's LM head, which needs exit_dim {target.hidden_size}, not "
                             f"{shape.exit_dim}")
    drafter = RecurrentDrafter(shape)
    drafter.load_state_dict(state)
    return drafter


def save_drafter(drafter: RecurrentDrafter, directory: Path, meta: dict) -> None:
    """Write ``drafter`` in the reference's layout (bfloat16 ``model.safetensors``)."""
    directory.mkdir(parents=True, exist_ok=True)
    save_tensors({k: v.to(torch.bfloat16) for k, v in drafter.state_dict().items()}, directory / WEIGHT_FILES[0])
    shape = drafter.shape
    config = {"model_type": MODEL_TYPE, "architectures": ["Drafter"], "hidden_size": shape.hidden_size,
              "vocab_size": shape.vocab_size or meta["target"]["vocab_size"], "exit_dim": shape.exit_dim,
              "num_draft_layers": shape.num_draft_layers, "rnn": shape.rnn,
              "shares_lm_head": shape.shares_lm_head, SECTION: meta}
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
