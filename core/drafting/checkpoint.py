"""Drafter checkpoints that share the target's embeddings and LM head.

A trained drafter directory holds the method's own files (``config.json`` and weights in
its published layout) plus, in ``config.json``, a ``specdec_draft`` section saying which
target it was trained for. Weights the drafter shares with the target (input embeddings,
LM head) are left out of the file and taken from the target at load time, which keeps a
drafter for the embedded model a few MB. The reduced draft vocabulary, where there is one,
is a ``[draft_vocab]`` tensor of target token ids (``draft_vocab.safetensors``).

Shipped weight files may hold their large matrices as int8 with one float scale per row
(``NAME`` int8 and ``NAME.int8_scale``; :func:`store_int8`), which halves a bfloat16
file; :func:`load_tensors` gives them back as float32, so loaders never see the storage.
The drafter then runs at its usual precision on weights rounded to 8 bits; drafts change
slightly, never output (verification decides what is kept).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import ModelLoadError

SECTION = "specdec_draft"
DRAFT_VOCAB_FILE = "draft_vocab.safetensors"
INT8_SCALE = ".int8_scale"
#: Matrices smaller than this stay as they are: their scales would cost more than they save.
INT8_MIN_ELEMENTS = 65536


def target_signature(target) -> dict:
    """What a drafter must match of its target (``target``: a TargetModel or TrainTarget)."""
    return {"name": target.name, "hidden_size": target.hidden_size, "vocab_size": target.vocab_size,
            "num_layers": target.num_layers}


def check_target(directory: Path, meta: dict, target) -> None:
    """A clear error if the drafter in ``directory`` was trained for a target of other sizes."""
    want = meta.get("target", {})
    have = target_signature(target)
    for key in ("hidden_size", "vocab_size", "num_layers"):
        if key in want and want[key] != have[key]:
            raise ModelLoadError(
                f"drafter {directory} was trained for target {want.get('name', '?')!r} with {key} {want[key]}, "
                f"but the target {have['name']!r} has {key} {have[key]}; train a drafter for this target with "
                "`specdec train`")


def drafter_directory(source: str | None, target, shipped: Path, method: str, what: str) -> Path:
    """The directory of the drafter to load: ``source`` (``speculative_model``), or, when it
    is None, the drafter ``shipped`` for the embedded model; on another target a
    ModelLoadError says to give one or train one (``what``: "heads", "a drafter"...)."""
    from ..model.loading import EMBEDDED_NAME, resolve_model_dir

    if source is None:
        if target.name != EMBEDDED_NAME:
            raise ModelLoadError(f"speculative_config.speculative_model: {method} needs {what} trained for "
                                 f"{target.name!r}; give its directory, or train one with "
                                 f"`specdec train {method} --model ...`")
        source = str(shipped)
    return resolve_model_dir(source)


def read_config(directory: str | Path) -> dict:
    """A drafter directory's ``config.json``; a missing or unreadable one is an error naming it."""
    directory = Path(directory)
    path = directory / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"drafter {directory}: no config.json there; give the directory `specdec train` "
                             "wrote, or a checkpoint in the method's published layout")
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise ModelLoadError(f"drafter {path}: not valid JSON ({exc})") from None


def load_tensors(path: Path, prefix: str | None = None) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors or torch file (only the names starting with ``prefix``, when
    given: a safetensors file is then read selectively, so a drafter inside a large target
    checkpoint costs only its own bytes); a corrupt or partial file is named in the error."""
    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                tensors = {k: f.get_tensor(k) for k in f.keys() if prefix is None or k.startswith(prefix)}
        else:
            tensors = torch.load(path, map_location="cpu", weights_only=True)
            tensors = {k: v for k, v in tensors.items() if prefix is None or k.startswith(prefix)}
    except Exception as exc:
        raise ModelLoadError(f"drafter weights {path}: cannot read them ({type(exc).__name__}: {exc}); the "
                             "file is corrupt or incomplete") from None
    return _expand_int8(tensors, path)


def store_int8(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with every floating matrix of at least :data:`INT8_MIN_ELEMENTS`
    elements as int8 rows and their scales (symmetric, round to nearest)."""
    out = {}
    for key, value in tensors.items():
        if value.is_floating_point() and value.dim() == 2 and value.numel() >= INT8_MIN_ELEMENTS:
            value = value.float()
            scale = value.abs().amax(dim=1).clamp_min(1e-12) / 127
            out[key] = torch.round(value / scale[:, None]).clamp(-127, 127).to(torch.int8)
            out[key + INT8_SCALE] = scale
        else:
            out[key] = value
    return out


def _expand_int8(tensors: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    scaled = [k[:-len(INT8_SCALE)] for k in tensors if k.endswith(INT8_SCALE)]
    for key in scaled:
        if key not in tensors or tensors[key].dtype != torch.int8:
            raise ModelLoadError(f"drafter weights {path}: {key}{INT8_SCALE} scales no int8 tensor {key}")
        tensors[key] = tensors[key].float() * tensors.pop(key + INT8_SCALE).float()[:, None]
    return tensors


def save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Write ``tensors`` as one safetensors file (contiguous CPU copies, as the format needs)."""
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path))


def load_state_checked(module: torch.nn.Module, state: dict[str, torch.Tensor], path: Path,
                       shared: tuple[str, ...] = ()) -> None:
    """Load ``state`` into ``module``; keys in ``shared`` may be missing (the target's). Any
    other missing, unexpected or mis-shaped tensor is an error naming the file."""
    own = module.state_dict()
    missing = [k for k in own if k not in state and not k.startswith(shared)]
    unexpected = [k for k in state if k not in own]
    wrong = [f"{k} {tuple(state[k].shape)} (expected {tuple(own[k].shape)})"
             for k in state if k in own and state[k].shape != own[k].shape]
    if missing or unexpected or wrong:
        parts = [f"missing {missing[:4]}" if missing else "", f"unexpected {unexpected[:4]}" if unexpected else "",
                 f"wrong shapes {wrong[:3]}" if wrong else ""]
        raise ModelLoadError(f"drafter weights {path} do not fit the drafter: "
                             + "; ".join(p for p in parts if p))
    module.load_state_dict(state, strict=False)


def save_draft_vocab(directory: Path, token_ids: torch.Tensor) -> None:
    """Write a reduced drafting vocabulary (target token ids) for :func:`load_draft_vocab`."""
    save_tensors({"token_ids": token_ids.to(torch.int32)}, directory / DRAFT_VOCAB_FILE)


def load_draft_vocab(directory: Path, vocab_size: int) -> torch.Tensor | None:
    """The reduced drafting vocabulary saved in ``directory`` (target ids), or None if it has none."""
    path = directory / DRAFT_VOCAB_FILE
    if not path.exists():
        return None
    ids = load_tensors(path)["token_ids"].long()
    if ids.numel() == 0 or int(ids.max()) >= vocab_size or int(ids.min()) < 0:
        raise ModelLoadError(f"{path}: draft vocabulary ids must lie in 0..{vocab_size - 1}")
    return ids


def restricted_head(head: torch.nn.Module, directory: Path, vocab_size: int) -> tuple[torch.nn.Module,
                                                                                     torch.Tensor | None]:
    """``(projection, draft_to_target)``: an LM head narrowed to the drafting vocabulary
    saved in ``directory`` (the tokens a drafter was trained on: the other rows cost time
    every draft step and are rarely right) and that vocabulary's target ids; ``head`` itself
    and None where the directory has no vocabulary."""
    vocab = load_draft_vocab(directory, vocab_size)
    if vocab is None:
        return head, None
    vocab = vocab.to(head.weight.device)
    return head_rows(head.weight, vocab), vocab


def head_rows(weight: torch.Tensor, token_ids: torch.Tensor) -> torch.nn.Linear:
    """A frozen bias-free linear layer over the rows ``token_ids`` of an LM head ``weight``
    (a module, so that the engine can prepack it like the drafter's other layers)."""
    rows = weight.detach()[token_ids]
    layer = torch.nn.Linear(rows.shape[1], rows.shape[0], bias=False, device=rows.device, dtype=rows.dtype)
    layer.weight = torch.nn.Parameter(rows, requires_grad=False)
    return layer
