"""The batch-invariant attention's CPU kernel (``invariant_attention.cpp``), compiled once
per machine at first use with torch's C++ extension builder (about 10 s; the result is
cached under torch's extensions directory).

Why a kernel of our own: the torch version (:func:`.invariant.invariant_attention_torch`)
must lay every key row out as plain decoding does and reduce over it with library
products, about a dozen operations a group of rows and two dozen for a step's draft trees;
on a 2-core AVX-512 CPU that dispatch was most of the attention's time (an 11-node tree
step of the embedded model 52.9 ms in the mode against 36.0 stock; 34.7 with this kernel,
BENCHMARKS.md "Bit-exact bfloat16"). The kernel walks each token's own key row in column
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

log = logging.getLogger(__name__)

SOURCE = pathlib.Path(__file__).with_name("invariant_attention.cpp")


def _machine_tag() -> str:
    """A short tag of this CPU's instruction sets: the kernel is built for the machine it runs
    on (``-march=native``), so a home directory shared with another CPU gets its own build."""
    try:
        flags = next(line for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = os.uname().machine
    return hashlib.sha1(flags.encode()).hexdigest()[:8]


@functools.cache
def kernel_available() -> bool:
    """Whether the CPU kernel is built and registered (``torch.ops.specdec_cpu``); builds it
    at the first call."""
    if os.environ.get("SPECDEC_KERNELS", "auto") == "torch":
        return False
    try:
        from torch.utils.cpp_extension import load

        # no -ffast-math: GCC links it with a start-up file that flushes denormals process-wide
        load(name=f"specdec_cpu_{_machine_tag()}", sources=[str(SOURCE)],
             extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-trapping-math", "-fno-math-errno"],
             extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    except Exception as exc:  # noqa: BLE001 - no compiler, no ninja, a failed build: the torch version serves
        log.warning("the CPU batch-invariant attention kernel could not be built (%s: %s); using the torch "
                    "version, which is slower on draft trees", type(exc).__name__, str(exc).splitlines()[0])
        return False
    return True


#: the kernel's vector width in floats: head dimensions must be multiples of it
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
    """Same contract as :func:`specdec.kernels.invariant.invariant_attention_torch` (whose bits
    it does not promise to match: one mode uses one of the two). ``query`` ``[heads, T,
    dim]``; returns ``[T, heads, value_dim]``."""
    if not kernel_available():
        raise RuntimeError("the CPU batch-invariant attention kernel is not built here (see the warning logged)")
    rows = layout.invariant_key_rows
    heads, tokens, dim = query.shape
    query_rows = torch.empty(tokens, heads, dim, dtype=torch.float32).copy_(query.transpose(0, 1))
    out = torch.ops.specdec_cpu.invariant_attention(
        query_rows, key_pool, value_pool, rows["slots"], rows["key_pos"], rows["offset"], rows["count"],
        layout.query_positions, float(scale), float(softcap or 0.0), int(sliding_window or 0))
    return out.to(query.dtype)
