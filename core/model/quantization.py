"""Weight-only int8 and int4 targets on torch's own packed CPU kernels.

``engine.quantization: int8`` stores every linear layer of the target as int8 with one scale
per output row (``aten._weight_int8pack_mm``); ``int4`` stores them as 4-bit codes in groups
of 32 input columns with a scale and a minimum per group (``aten._weight_int4pack_mm_for_cpu``,
the layout of GGUF's Q4_1: ``w = q * d + m``). In both modes the LM head is int8 per row (GGUF
files keep their output matrix 8-bit too), and a plain ``nn.Embedding`` becomes int8 per row,
widened only for the rows looked up; a tied embedding and head share one int8 matrix.

Both kernels compute each output row from its own input row only (checked for 1..69 rows in
float32 and bfloat16: :func:`rows_are_independent`), so batch-invariant numerics and
lossless verification need nothing more: the quantized model *is* the target, and
speculative output equals that target's plain output.

A GGUF target's Q4_0 / Q4_1 linear blocks become int4 layers as they are (:mod:`.gguf_blocks`):
no second rounding, the same 4-bit weights llama.cpp runs; its embedding is rounded to int8
from the file's own 8-bit blocks, a few thousand rows at a time. Everything else is
quantized here from the weights transformers loaded (round to nearest).

``w4a8`` and ``w8a8`` store the same 4-bit groups and int8 rows for specdec's integer-dot
kernels (:mod:`specdec.kernels.int8_dot`), which quantize each token's activations to 8
bits and multiply with integer dot products as llama.cpp does: extra rows of a
verification step cost little beside the weights' streaming. Each token's outputs depend on
its own activations only, by construction. Their 4-bit scales and minimums are float16, as
in the GGUF blocks.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..kernels import int8_dot
from .hf_config import text_config

log = logging.getLogger(__name__)

#: input columns per int4 group (GGUF's Q4_0/Q4_1 block size).
GROUP_SIZE = 32


class PackedLinear(nn.Module):
    """A linear layer whose product is one packed-kernel call over its input rows (2-D, in
    the dtype of its scales). ``weight`` gives the dequantized matrix, for drafters that
    read a head's rows; the forward never builds it."""

    #: whose weights are 4-bit groups (constructed from codes, scales and minimums), not int8 rows
    four_bit = False

    def __init__(self, out_features: int, in_features: int, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.out_features, self.in_features, self.dtype = out_features, in_features, dtype
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> PackedLinear:
        """The layer of a full-precision ``weight``, rounded to nearest."""
        return cls(*(quantize_groups_int4(weight) if cls.four_bit else quantize_rows_int8(weight)), bias, dtype)

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.product(x.reshape(-1, self.in_features).to(self.dtype).contiguous())
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


class Int8Linear(PackedLinear):
    """``y = (x @ q.T) * scale (+ bias)``: int8 codes ``q [out, in]``, one scale per row."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__(*codes.shape, bias, dtype)
        self.register_buffer("codes", codes.contiguous())
        self.register_buffer("scale", scale.to(dtype))

    @property
    def weight(self) -> torch.Tensor:
        return self.codes.to(self.dtype) * self.scale[:, None]

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(rows, self.codes, self.scale)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per row"


class Int4Linear(PackedLinear):
    """``w = q * scale + minimum`` per group of :data:`GROUP_SIZE` input columns, ``q`` in 0..15,
    packed for torch's CPU int4 kernel (whose zero point is ``minimum + 8 * scale``)."""

    four_bit = True

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                 bias: torch.Tensor | None, dtype: torch.dtype):
        """``codes`` ``[out, in]`` integers 0..15; ``scale``, ``minimum`` ``[out, in / 32]``."""
        super().__init__(*codes.shape, bias, dtype)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
        scale_zero = torch.stack([scale.float(), minimum.float() + 8 * scale.float()], -1).transpose(0, 1)
        self.register_buffer("packed", packed)
        self.register_buffer("scale_zero", scale_zero.contiguous().to(dtype))

    @property
    def weight(self) -> torch.Tensor:
        eye = torch.eye(self.in_features, dtype=torch.float32)
        scale_zero = self.scale_zero.float()
        return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, GROUP_SIZE, scale_zero).T.to(self.dtype)

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, GROUP_SIZE, self.scale_zero)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 groups of {GROUP_SIZE}"


class W8A8Linear(PackedLinear):
    """``y = (x @ q.T) * scale (+ bias)`` with int8 codes per row, on the integer-dot kernel:
    ``x`` quantized to 8 bits per token and block of 32 columns."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        int8_dot.require_kernel()
        super().__init__(*codes.shape, bias, dtype)
        packed, scale = int8_dot.pack_q8(codes, scale)
        self.register_buffer("packed", packed)
        self.register_buffer("scale", scale)

    @property
    def weight(self) -> torch.Tensor:
        return self.rows(torch.arange(self.out_features))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The dequantized rows ``ids`` (an embedding's lookup of a tied head)."""
        return int8_dot.unpack_q8_rows(self.packed, ids).to(self.dtype) * self.scale[ids][..., None].to(self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one operator call: the kernel takes any leading shape, adds the bias, rounds once
        return int8_dot.q8_linear(x if x.dtype == self.dtype else x.to(self.dtype), self.packed, self.scale,
                                  self.out_features, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per row, 8-bit activations"


class W8A8BlockLinear(PackedLinear):
    """``w = q * scale`` with int8 codes and a float32 scale per 32 or per 16 input columns
    (GGUF's Q5_0, Q8_0 and Q6_K blocks as they are), on the integer-dot kernel."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        """``codes`` ``[out, in]`` int8; ``scales`` ``[out, in / 32]`` or ``[out, in / 16]``."""
        int8_dot.require_kernel()
        super().__init__(*codes.shape, bias, dtype)
        self.width = codes.shape[1] // scales.shape[1]
        packed, scales = int8_dot.pack_q8b(codes, scales)
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)

    @property
    def weight(self) -> torch.Tensor:
        return self.rows(torch.arange(self.out_features))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The dequantized rows ``ids`` (an embedding's lookup of a tied head)."""
        scales = int8_dot.unpack_q8b_scales(self.scales, ids, self.in_features)
        codes = int8_dot.unpack_q8_rows(self.packed, ids).float()
        return (codes * scales.repeat_interleave(self.width, -1)).to(self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_dot.q8b_linear(x if x.dtype == self.dtype else x.to(self.dtype), self.packed, self.scales,
                                   self.out_features, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int8 blocks of {self.width}, "
                f"8-bit activations")


class W4A8Linear(PackedLinear):
    """``w = q * scale + minimum`` per group of :data:`GROUP_SIZE` input columns (scale and
    minimum float16 as GGUF's Q4_0 / Q4_1 hold them, or float32 for Q4_K's sub-block
    products), on the integer-dot kernel: ``x`` quantized to 8 bits per token and block."""

    four_bit = True

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                 bias: torch.Tensor | None, dtype: torch.dtype, scale_dtype: torch.dtype = torch.float16):
        """``codes`` ``[out, in]`` integers 0..15; ``scale``, ``minimum`` ``[out, in / 32]``."""
        int8_dot.require_kernel()
        super().__init__(*codes.shape, bias, dtype)
        packed, dm = int8_dot.pack_q4(codes, scale, minimum, scale_dtype)
        self.register_buffer("packed", packed)
        self.register_buffer("dm", dm)

    @property
    def weight(self) -> torch.Tensor:
        codes, d, m = int8_dot.unpack_q4(self.packed, self.dm, self.out_features)
        groups = lambda t: t.float().repeat_interleave(GROUP_SIZE, 1)  # noqa: E731
        return (codes.float() * groups(d) + groups(m)).to(self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one operator call: the kernel takes any leading shape, adds the bias, rounds once
        return int8_dot.q4_linear(x if x.dtype == self.dtype else x.to(self.dtype), self.packed, self.dm,
                                  self.out_features, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int4 groups of {GROUP_SIZE}, "
                f"8-bit activations")


def _scaled(rows: torch.Tensor, embed_scale: float | None) -> torch.Tensor:
    """Looked-up rows times the model's embedding scale (Gemma's ``sqrt(hidden)``, already
    rounded to the rows' dtype as transformers' scaled embedding rounds it: the product is
    then the same). A number, not a buffer: a drafter sharing the embedding and casting
    its modules cannot change it, nor a compiled graph that read it."""
    return rows if embed_scale is None else rows * embed_scale


class Int8Embedding(nn.Module):
    """An embedding table stored as int8 rows with one scale each; looked-up rows are widened
    (and multiplied by ``embed_scale``, where the model scales its embeddings)."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, padding_idx: int | None = None,
                 embed_scale: float | None = None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = codes.shape
        self.padding_idx = padding_idx
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale.to(dtype))
        self.embed_scale = embed_scale

    @property
    def weight(self) -> torch.Tensor:
        return self.codes.to(self.scale.dtype) * self.scale[:, None]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return _scaled(self.codes[ids].to(self.scale.dtype) * self.scale[ids][..., None], self.embed_scale)


class HeadRowsEmbedding(nn.Module):
    """The embedding of a tied int8 head stored for the integer-dot kernel: looked-up rows
    are read from the head's packed codes and widened, as :class:`Int8Embedding` widens its own."""

    def __init__(self, head: W8A8Linear, padding_idx: int | None = None, embed_scale: float | None = None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        self.padding_idx = padding_idx
        self.head = [head]  # not a submodule: the head is the model's, its buffers counted there
        self.embed_scale = embed_scale

    @property
    def weight(self) -> torch.Tensor:
        return self.head[0].weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return _scaled(self.head[0].rows(ids), self.embed_scale)


def quantize_rows_int8(weight: torch.Tensor, chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric round-to-nearest int8 per row: ``(codes [out, in] int8, scale [out] float32)``,
    ``chunk`` rows at a time (an LM head's float32 temporaries would otherwise be several
    times the model's int4 weights)."""
    codes = torch.empty(weight.shape, dtype=torch.int8)
    scale = torch.empty(weight.shape[0], dtype=torch.float32)
    for start in range(0, weight.shape[0], chunk):
        w = weight[start:start + chunk].detach().float()
        s = (w.abs().amax(1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        codes[start:start + chunk] = torch.round(w / s[:, None]).clamp(-127, 127)
        scale[start:start + chunk] = s
    return codes, scale


def quantize_groups_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric round-to-nearest 4-bit per group of 32 columns (Q4_1's scheme):
    ``(codes [out, in] 0..15, scale [out, in/32], minimum [out, in/32])``."""
    out_features, in_features = weight.shape
    w = weight.detach().float().view(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
    minimum, maximum = w.amin(-1), w.amax(-1)
    scale = ((maximum - minimum) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    codes = torch.round((w - minimum[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    return codes.view(out_features, in_features), scale, minimum


def check_supported(mode: str, device: torch.device, dtype: torch.dtype) -> None:
    """Raise a clear error where the packed kernels do not exist."""
    from ..errors import ConfigError

    if mode in ("w4a8", "w8a8") and device.type == "cpu" and not int8_dot.kernel_available():
        raise ConfigError(f"engine.quantization: {mode} runs on specdec's integer-dot CPU kernels, which are not "
                          f"available here (they need a C++ compiler and a CPU with AVX2 and F16C; see the warning "
                          f"logged); use {'int4' if mode == 'w4a8' else 'int8'}, torch's own kernels")
    if device.type != "cpu":
        raise ConfigError(f"engine.quantization: {mode} runs on CPU kernels and is supported on "
                          f"device: cpu only (asked for {device.type}); leave it unset on {device.type}")
    if dtype == torch.float16:
        raise ConfigError(f"engine.quantization: {mode} runs with dtype bfloat16 or float32, not float16")


def rows_are_independent(module: nn.Module, in_features: int, dtype: torch.dtype, max_rows: int = 69) -> bool:
    """Whether every output row of ``module`` equals that row computed alone, for 1..max_rows rows."""
    g = torch.Generator().manual_seed(0)
    for n in range(2, max_rows + 1):
        x = torch.randn(n, in_features, generator=g).to(dtype)
        together = module(x)
        alone = torch.cat([module(x[i:i + 1]) for i in range(n)])
        if not torch.equal(together, alone):
            return False
    return True


def release_freed_memory() -> None:
    """Hand the loading's freed temporaries back to the system (glibc keeps them otherwise:
    about 90 MB after the embedded model's int4 blocks are decoded, as much as the weights)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def layer_classes(mode: str) -> tuple[type | None, type]:
    """The classes of ``mode``'s 4-bit layers (None: it has none) and of its int8 layers."""
    return {"int8": (None, Int8Linear), "int4": (Int4Linear, Int8Linear),
            "w8a8": (None, W8A8Linear), "w4a8": (W4A8Linear, W8A8Linear)}[mode]


def _int8_layer(mode: str, codes: torch.Tensor, scale: torch.Tensor, bias, dtype: torch.dtype) -> PackedLinear:
    """``mode``'s int8 layer, or torch's where the integer-dot kernel does not take the width."""
    eight_bit = layer_classes(mode)[1]
    if codes.shape[1] % GROUP_SIZE:
        eight_bit = Int8Linear
    return eight_bit(codes, scale, bias, dtype)


@torch.no_grad()
def quantize_model(model: nn.Module, mode: str, dtype: torch.dtype, blocks: dict | None = None,
                   read=None) -> dict:
    """Replace the model's linear layers and plain embeddings in place; return counts.

    ``blocks`` maps module names to ready layers (from a GGUF file's own blocks: 4-bit
    linear layers, an int8 embedding, which a tied head shares); the others are quantized
    from their weights (``read(parameter)`` gives the values of a parameter not loaded yet).
    Under a 4-bit mode the head and linear layers whose input width is not a multiple of
    :data:`GROUP_SIZE` get int8. A tied embedding reads the int8 head's rows. Parameters
    left (norms, ...) are loaded in ``dtype``.
    """
    blocks = blocks or {}
    read = read or (lambda tensor: tensor)
    four_bit, _ = layer_classes(mode)
    head = model.get_output_embeddings()
    embed = model.get_input_embeddings()
    tied = head is not None and embed is not None and head.weight is embed.weight
    file_embedding = blocks.get(next((n for n, m in model.named_modules() if m is embed), None))
    counts = {"int4": 0, "int8": 0, "from_file": 0, "embedding": 0}
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        bias = None if module.bias is None else read(module.bias)
        if name in blocks or (module is head and tied and file_embedding is not None):
            new = (blocks[name] if name in blocks
                   else _int8_layer(mode, file_embedding.codes, file_embedding.scale, None, dtype))
            if bias is not None:
                new.register_buffer("bias", bias.to(dtype))
            counts["from_file"] += 1
        elif four_bit is not None and module is not head and module.in_features % GROUP_SIZE == 0:
            new = four_bit.from_weight(read(module.weight), bias, dtype)
        else:
            new = _int8_layer(mode, *quantize_rows_int8(read(module.weight)), bias, dtype)
        counts["int4" if new.four_bit else "int8"] += 1
        _set_module(model, name, new)
    new_head = model.get_output_embeddings()
    plain = _is_plain_embedding(embed)
    embed_scale = _embed_scale(embed, dtype) if plain else None
    if tied and isinstance(new_head, W8A8Linear) and (file_embedding is not None or plain):
        model.set_input_embeddings(HeadRowsEmbedding(new_head, embed.padding_idx, embed_scale))
        counts["embedding"] = 1
    elif file_embedding is not None:
        file_embedding.embed_scale = embed_scale
        model.set_input_embeddings(file_embedding)
        counts["embedding"] = 1
    elif plain:
        if tied and isinstance(new_head, Int8Linear):
            codes, scale = new_head.codes, new_head.scale
        else:
            codes, scale = quantize_rows_int8(read(embed.weight))
        model.set_input_embeddings(Int8Embedding(codes, scale, dtype, embed.padding_idx, embed_scale))
        counts["embedding"] = 1
    elif embed is not None:
        log.info("quantization: %s kept in %s (not a plain nn.Embedding)", type(embed).__name__, dtype)
    for name, param in list(model.named_parameters()):
        if param.is_meta:
            owner, _, attr = name.rpartition(".")
            module = model.get_submodule(owner) if owner else model
            module._parameters[attr] = nn.Parameter(read(param).to(dtype), requires_grad=False)
    _mark_untied(model)
    log.info("quantization %s: %d int4 and %d int8 linear layers (%d from the file's own blocks), "
             "%d embedding int8", mode, counts["int4"], counts["int8"], counts["from_file"], counts["embedding"])
    return counts


def _is_plain_embedding(embed: nn.Module | None) -> bool:
    """Whether ``embed`` looks rows up as ``nn.Embedding`` does, times at most a constant
    ``embed_scale`` (Gemma's scaled embedding): what an int8 table reproduces."""
    return embed is not None and (type(embed) is nn.Embedding or (
        isinstance(embed, nn.Embedding) and type(embed).__name__.endswith("ScaledWordEmbedding")
        and hasattr(embed, "embed_scale")))


def _embed_scale(embed: nn.Embedding, dtype: torch.dtype) -> float | None:
    """The embedding's scale (Gemma's ``sqrt(hidden)``) rounded to ``dtype`` as transformers
    rounds it before multiplying, or None where it has none."""
    scale = getattr(embed, "embed_scale", None)
    return None if scale is None else float(torch.as_tensor(scale).to(dtype))


@torch.no_grad()
def quantize_linears_w8a8(module: nn.Module) -> int:
    """Give ``module``'s linear layers (stock ``nn.Linear`` on the CPU, bfloat16 or float32,
    whose input width the kernel's blocks divide) a forward on a :class:`W8A8Linear` of their
    weights; returns how many. Each layer keeps its ``weight`` (drafters read a head's rows
    from it) and its place in the module tree, top level included (undo with
    :func:`specdec.numerics.invariant.restore_linear`). For a drafter's layers, which nothing trains
    once drafting starts."""
    int8_dot.require_kernel()
    layers = [m for m in module.modules() if type(m) is nn.Linear and "forward" not in m.__dict__
              and m.in_features % GROUP_SIZE == 0 and m.weight.device.type == "cpu"
              and m.weight.dtype in (torch.bfloat16, torch.float32)]
    for layer in layers:
        layer.forward = W8A8Linear.from_weight(layer.weight.detach(), layer.bias, layer.weight.dtype).forward
    return len(layers)


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def _mark_untied(model: nn.Module) -> None:
    """The quantized head and embedding share codes, not an ``nn.Parameter``: keep transformers
    from re-tying them (``tie_weights`` would put a float parameter back)."""
    config = text_config(model.config)
    config.tie_word_embeddings = False
    if hasattr(model, "_tied_weights_keys"):
        model._tied_weights_keys = None


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer the model holds (shared tensors counted once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t is None or t.untyped_storage().data_ptr() in seen:
            continue
        seen.add(t.untyped_storage().data_ptr())
        total += t.untyped_storage().nbytes()
    return total
