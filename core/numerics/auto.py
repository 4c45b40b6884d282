"""Every ``auto`` setting of the engine resolved in one place: quantization (the target's and
the drafter's), compile, batch invariance.

Each ``auto`` picks what measured fastest on the machine and target at hand without
changing what the target computes beyond what the user asked: the file's own 4-bit blocks
on the CPU integer-dot kernels (``quantization``), a compiled forward only where its
graph is batch-invariant (``compile``), and batch-invariant numerics only where they cost
nothing (``batch_invariant``), so that greedy speculative output stays bit-identical to
plain output wherever ``auto`` turns something on. The resolved values are logged by the
engine and shown by ``specdec config --resolved``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..config import EngineConfig
from ..errors import ConfigError, FieldError
from ..kernels import int8_dot, invariant_attention_is_kernel
from ..model.gguf_blocks import linear_schemes, taken_schemes
from ..model.quantization import Int4Linear, Int8Linear, PackedLinear, layer_classes
from ..model.target import TargetModel
from .invariant import mode_costs_nothing

log = logging.getLogger(__name__)


def resolve_quantization(mode: str | None, dtype: str, device: torch.device, gguf: Path | None,
                         tensor_parallel_size: int = 1) -> str | None:
    """``engine.quantization`` as the target is loaded. ``auto`` is ``w4a8`` for a GGUF target
    whose linear layers are all blocks the integer-dot layers take as they are (Q4_0, Q4_1,
    Q4_K, Q5_0, Q8_0, Q6_K), on a CPU where those kernels are built, with ``dtype`` left at ``auto``: the file's
    own weights, run as llama.cpp runs them. Anything else loads unquantized (a quantized file
    dequantized, with a log line naming its scheme). A 4-bit mode asked for by name on a GGUF file
    of other schemes is an error naming them: its weights would be rounded twice. A
    tensor-parallel target runs unquantized."""
    if mode == "auto" and tensor_parallel_size > 1:
        log.info("quantization auto: a tensor-parallel target runs unquantized")
        return None
    if mode != "auto":
        if mode is not None and layer_classes(mode)[0] is not None and gguf is not None:
            taken = taken_schemes(mode)
            others = linear_schemes(gguf) - set(taken)
            if others:
                raise ConfigError(f"engine.quantization: {mode} takes a GGUF file's {', '.join(taken)} "
                                  f"blocks as they are, but {gguf.name} holds {', '.join(sorted(others))} linear "
                                  f"layers; leave quantization at auto (bfloat16 here) or give the model as a "
                                  f"safetensors directory to quantize it from its full-precision weights")
        return mode
    if gguf is None or device.type != "cpu" or dtype != "auto":
        return None
    schemes, taken = linear_schemes(gguf), taken_schemes("w4a8")
    if not schemes or not schemes <= set(taken):
        log.info("quantization auto: %s's linear layers are %s, which specdec's kernels do not take as they are "
                 "(they take %s): its weights run dequantized in bfloat16", gguf.name,
                 ", ".join(sorted(schemes)) or "not a llama or Gemma 3 file's", ", ".join(taken))
        return None
    if not int8_dot.kernel_available():
        log.info("quantization auto: the integer-dot kernels are not available here; %s runs dequantized in "
                 "bfloat16", gguf.name)
        return None
    return "w4a8"


def resolve_draft_quantization(mode: str | None, target_quantization: str | None,
                               device: torch.device) -> str | None:
    """``engine.draft_quantization`` as the drafter is loaded: ``auto`` is ``w8a8`` where the
    target runs on the integer-dot kernels (``w4a8``, ``w8a8``), which are then built and
    take the drafter's layers as well; None elsewhere. A drafter's numerics never change the
    output, only how often its drafts are accepted, so ``auto`` may round them. ``w8a8``
    asked for where the kernels do not run is an error naming why."""
    if mode == "w8a8" and device.type != "cpu":
        raise FieldError("engine.draft_quantization", f"w8a8 runs on CPU kernels, not on {device.type}; set it "
                                                      "to none or auto")
    if mode == "w8a8" and not int8_dot.kernel_available():
        raise FieldError("engine.draft_quantization", "w8a8 runs on specdec's integer-dot CPU kernels, which are "
                                                      "not available here (they need a C++ compiler and a CPU with "
                                                      "AVX2 and F16C; see the warning logged); set it to none or auto")
    if mode != "auto":
        return mode
    return "w8a8" if target_quantization in ("w4a8", "w8a8") else None


def compiles_invariant(target: TargetModel) -> bool:
    """Whether ``target``'s compiled forward is batch-invariant: a CPU target whose every
    product runs the integer-dot kernels (invariant by construction) and whose attention
    runs the CPU invariant kernel, called from the graph
    (:class:`specdec.model.target.KeyRows`); inductor then fuses only each token's own
    work between them, in one graph for every step (:meth:`TargetModel.compile`)."""
    modules = list(target.model.modules())
    return (target.device.type == "cpu" and invariant_attention_is_kernel(target.device)
            and any(isinstance(m, PackedLinear) for m in modules)
            and not any(isinstance(m, (torch.nn.Linear, Int4Linear, Int8Linear)) for m in modules))


def resolve_compile(config: EngineConfig, target: TargetModel) -> bool:
    """``engine.compile`` as the engine runs it: ``auto`` is on for a bfloat16 target whose
    compiled forward is batch-invariant (:func:`compiles_invariant`) unless
    ``batch_invariant: false`` asks for stock numerics: there compiling keeps greedy
    speculative output bit-identical to plain output and halves a step's time."""
    if config.compile != "auto":
        return config.compile
    return config.batch_invariant is not False and target.dtype == torch.bfloat16 and compiles_invariant(target)


def resolve_batch_invariant(config: EngineConfig, target: TargetModel, compiled: bool = False) -> bool:
    """``engine.batch_invariant`` as the engine runs it: ``auto`` is on for a bfloat16 CPU
    target unquantized or on the integer-dot kernels (``w4a8``, ``w8a8``, invariant by
    construction; torch's packed int4/int8 layers were not measured), whose every layer the
    mode runs as cheaply as stock numerics
    (:func:`specdec.numerics.invariant.mode_costs_nothing`), where it was measured to cost what
    stock numerics cost; when ``compiled``, only where the compiled forward is invariant.
    ``true`` beside a compiled forward that cannot be is refused."""
    if config.batch_invariant is True and compiled and not compiles_invariant(target):
        raise FieldError("engine.batch_invariant", "true cannot be combined with compile: true on this target: the "
                                                   "compiled forward is batch-invariant only on a CPU with every "
                                                   "linear layer on the integer-dot kernels (quantization: w4a8 or "
                                                   "w8a8); turn compile or batch_invariant off")
    if config.batch_invariant != "auto":
        return config.batch_invariant
    on_torch_packed = any(isinstance(m, (Int4Linear, Int8Linear)) for m in target.model.modules())
    return (target.device.type == "cpu" and target.dtype == torch.bfloat16
            and (not compiled or compiles_invariant(target)) and not on_torch_packed
            and mode_costs_nothing(target.model, target.layer_shapes))
