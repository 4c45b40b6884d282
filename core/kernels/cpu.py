"""specdec's CPU kernels, compiled once per machine at first use with torch's C++ extension
builder (10-20 s; the result is cached under torch's extensions directory): the
batch-invariant attention (``invariant_attention.cpp``), bfloat16 linear layers for CPUs
without bfloat16 instructions (``bf16_linear.cpp``), quantized linear layers with
integer dot products (``int8_dot.cpp``, :mod:`.int8_dot`) and sampling distributions and
draws (``sampling.cpp``).

Why a kernel of our own: the torch version (:func:`.invariant_attention.invariant_attention_torch`)
must lay every key row out as plain decoding does and reduce over it with library
products, about a dozen operations a group of rows and two dozen for a step's draft trees,
and on a small CPU that dispatch is most of the attention's time. The kernel walks each token's own key row in column
order, as the Triton kernel does on CUDA, so a tree node costs what a chain token costs.
Where no compiler is found the torch version is used (logged once);
``SPECDEC_KERNELS=torch`` asks for it. One of the two serves a process for good: a token's
bits depend on which one computed it.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pathlib

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

SOURCES = [pathlib.Path(__file__).with_name(name)
           for name in ("invariant_attention.cpp", "bf16_linear.cpp", "int8_dot.cpp", "sampling.cpp")]
#: headers the sources include: the builder hashes only the sources, so the build's name carries these
HEADERS = [pathlib.Path(__file__).with_name("vector_math.h")]


def _machine_tag() -> str:
    """A short tag of this CPU's instruction sets: the kernel is built for the machine it runs
    on (``-march=native``), so a home directory shared with another CPU gets its own build."""
    try:
        flags = next(line for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = os.uname().machine
    return hashlib.sha1(flags.encode()).hexdigest()[:8]


def _headers_tag() -> str:
    return hashlib.sha1(b"".join(header.read_bytes() for header in HEADERS)).hexdigest()[:8]


@functools.cache
def kernel_available() -> bool:
    """Whether the CPU kernels are built and registered (``torch.ops.specdec_cpu``); builds
    them at the first call."""
    if os.environ.get("SPECDEC_KERNELS", "auto") == "torch":
        return False
    try:
        from torch.utils.cpp_extension import load

        # no -ffast-math: GCC links it with a start-up file that flushes denormals process-wide
        load(name=f"specdec_cpu_{_machine_tag()}_{_headers_tag()}", sources=[str(source) for source in SOURCES],
             extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-trapping-math", "-fno-math-errno"],
             extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    except Exception as exc:  # noqa: BLE001 - no compiler, no ninja, a failed build: the torch version serves
        log.warning("specdec's CPU kernels could not be built (%s: %s); using torch's products, which are "
                    "slower on draft trees and, without bfloat16 instructions, on every step of several tokens",
                    type(exc).__name__, str(exc).splitlines()[0])
        return False
    torch.library.register_fake("specdec_cpu::invariant_attention", _attention_output_like)
    return True


def _attention_output_like(query, key_pool, value_pool, slots, key_pos, offset, count, query_pos, scale, softcap,
                           window):
    return query.new_empty(query.shape[0], query.shape[1], value_pool.shape[2], dtype=key_pool.dtype)


#: the attention kernel's vector width in floats where the CPU has AVX-512 (8 on AVX2): head
#: dimensions must be multiples of it, so a model runs the same implementation on both
LANES = 16
POOL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def kernel_fits(query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor) -> bool:
    """Whether the kernel is built and takes these shapes and dtypes (head dimensions in whole
    vectors, pools of a 16- or 32-bit float type); the torch version serves the rest."""
    return (query.shape[-1] % LANES == 0 and value_pool.shape[-1] % LANES == 0 and key_pool.dtype in POOL_DTYPES
            and kernel_available())


def invariant_attention_cpu(query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor, layout,
                            scale: float, sliding_window: int | None = None,
                            softcap: float | None = None) -> torch.Tensor:
    """Same contract as :func:`specdec.kernels.invariant_attention.invariant_attention_torch` (whose bits
    it does not promise to match: one mode uses one of the two). ``query`` ``[heads, T,
    dim]``; returns ``[T, heads, value_dim]``."""
    if not kernel_available():
        raise RuntimeError("the CPU batch-invariant attention kernel is not built here (see the warning logged)")
    rows = layout.invariant_key_rows
    return attend_key_rows(query, key_pool, value_pool, rows["slots"], rows["key_pos"], rows["offset"], rows["count"],
                           layout.query_positions, scale, sliding_window, softcap)


def attend_key_rows(query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor, slots: torch.Tensor,
                    key_pos: torch.Tensor, offset: torch.Tensor, count: torch.Tensor, query_pos: torch.Tensor,
                    scale: float, sliding_window: int | None, softcap: float | None) -> torch.Tensor:
    """The kernel over key rows given as tensors (:attr:`AttentionLayout.invariant_key_rows`,
    the tokens' positions): what :func:`invariant_attention_cpu` runs, and what a compiled
    graph calls with the rows as its inputs. ``query`` ``[heads, T, dim]``; returns ``[T,
    heads, value_dim]`` in its dtype."""
    heads, tokens, dim = query.shape
    query_rows = torch.empty(tokens, heads, dim, dtype=torch.float32).copy_(query.transpose(0, 1))
    out = torch.ops.specdec_cpu.invariant_attention(query_rows, key_pool, value_pool, slots, key_pos, offset, count,
                                                    query_pos, float(scale), float(softcap or 0.0),
                                                    int(sliding_window or 0))
    return out.to(query.dtype)


# -- bfloat16 linear layers -------------------------------------------------------------
#
# Why: on a CPU without bfloat16 instructions (AVX2, no AVX-512) oneDNN takes no bfloat16
# products, and torch 2.13 multiplies a bfloat16 ``F.linear`` one row at a time: on a 2-core
# AVX2 EPYC a 16-token step of the embedded model cost 7.8 decodes, so verifying drafts cost
# more than they brought. The kernel widens each weight element once per call and multiplies
# it by every row with FMA instructions (``scripts/bench_cpu_linear.py`` times it). Not bit-identical to
# ``F.linear``; batch-invariant by construction (every output summed in one order whatever
# the row count).

#: the linear kernel's vector width in floats: input dimensions must be multiples of it
LINEAR_LANES = 8


@functools.cache
def native_bfloat16() -> bool:
    """Whether oneDNN multiplies bfloat16 on this CPU (AVX-512 and newer): there torch's own
    products are fast and :mod:`.prepacked` serves; elsewhere the linear kernel does."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


@functools.cache
def linear_kernel_available() -> bool:
    """Whether the linear kernel is built (it needs AVX2 and FMA; elsewhere it is left out)."""
    return kernel_available() and hasattr(torch.ops.specdec_cpu, "linear_bf16")


def linear_kernel_fits(weight: torch.Tensor) -> bool:
    """Whether products with ``weight`` should go to the linear kernel: a 2-D bfloat16 CPU
    weight whose input dimension is whole vectors, on a CPU without bfloat16 instructions."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and weight.shape[1] % LINEAR_LANES == 0 and weight.is_contiguous() and not native_bfloat16()
            and linear_kernel_available())


def kernel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` in bfloat16 through the linear kernel; ``F.linear`` itself
    where a gradient is wanted (the kernel has none)."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return F.linear(x, weight, bias)
    return torch.ops.specdec_cpu.linear_bf16(x, weight, bias)


def kernel_linear_forward(module: torch.nn.Linear) -> functools.partial:
    """A forward for ``module`` on the linear kernel (its weight and bias read, not copied)."""
    return functools.partial(kernel_linear, weight=module.weight.detach(),
                             bias=None if module.bias is None else module.bias.detach())


# -- sampling ---------------------------------------------------------------------------
#
# Why: a sampled step computes a distribution for every row it verifies and every token it
# drafts, and torch takes a dozen operations and a top-k selection a row, most of a
# millisecond on a small CPU, several times a step (``scripts/bench_sampling_kernel.py``).


def sampling_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """:func:`specdec.sampler.logits.probs_from_logits` of sampled requests, on the kernel:
    ``logits`` ``[rows, vocab]`` float32 on the CPU; ``top_k`` 0 for none."""
    return torch.ops.specdec_cpu.sampling_probs(logits, float(temperature), int(top_k), float(top_p), float(min_p))


def inverse_cdf(probs: torch.Tensor, uniforms: list[float]) -> torch.Tensor:
    """:func:`specdec.sampler.acceptance.sample_by_uniforms` on the kernel: ``probs``
    ``[rows, vocab]`` float32 on the CPU, one uniform number a row."""
    return torch.ops.specdec_cpu.inverse_cdf(probs, torch.tensor(uniforms, dtype=torch.float64))
