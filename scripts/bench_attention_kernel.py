"""The batch-invariant mode's CPU attention kernel against another version of its source,
one layer of the embedded model's shape (9 query heads, 3 KV heads, head dim 64, bfloat16
pools), interleaved in one process, medians.

    python scripts/bench_attention_kernel.py --against REV [--rounds 21] [--threads 2]

REV is a git revision whose ``core/kernels/invariant_attention.cpp`` is built under another
operator namespace beside this checkout's kernel (BENCHMARKS.md, "Bit-exact bfloat16").
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from torch.utils.cpp_extension import load

from specdec.kernels.cpu import invariant_attention_cpu, kernel_available

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from helpers import random_layout  # noqa: E402

#: (name, (committed tokens, new tokens, tree?) per sequence)
SHAPES = [("decode over 500 keys", [(500, 1, False)]), ("decode over 3,000 keys", [(3000, 1, False)]),
          ("4-token chain over 3,000", [(3000, 4, False)]), ("8 decodes over 300", [(300, 1, False)] * 8),
          ("12-token verification over 500", [(500, 12, False)]), ("11-node tree over 300", [(300, 11, True)]),
          ("300-token prompt chunk", [(0, 300, False)]), ("512-token prompt chunk", [(0, 512, False)])]


def build_other(rev: str):
    """``rev``'s kernel as ``torch.ops.specdec_cpu_other.invariant_attention``."""
    source = subprocess.run(["git", "show", f"{rev}:core/kernels/invariant_attention.cpp"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    source = source.replace("(specdec_cpu,", "(specdec_cpu_other,")
    path = pathlib.Path(tempfile.mkdtemp()) / "other_attention.cpp"
    path.write_text(source)
    header = subprocess.run(["git", "show", f"{rev}:core/kernels/vector_math.h"], cwd=ROOT, capture_output=True,
                            text=True)
    if header.returncode == 0:  # revisions since the kernels shared their vector helpers include it
        path.with_name("vector_math.h").write_text(header.stdout)
    load(name=f"specdec_other_{rev}", sources=[str(path)], extra_ldflags=["-fopenmp"], is_python_module=False,
         extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-trapping-math", "-fno-math-errno"])

    def other(query, key_pool, value_pool, layout, scale):
        rows = layout.invariant_key_rows
        heads, tokens, dim = query.shape
        q = torch.empty(tokens, heads, dim, dtype=torch.float32).copy_(query.transpose(0, 1))
        return torch.ops.specdec_cpu_other.invariant_attention(
            q, key_pool, value_pool, rows["slots"], rows["key_pos"], rows["offset"], rows["count"],
            layout.query_positions, float(scale), 0.0, 0).to(query.dtype)
    return other


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--against", required=True, help="git revision of the other kernel source")
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if not kernel_available():
        raise SystemExit("the CPU kernels are not built here")
    other = build_other(args.against)
    gen = torch.Generator().manual_seed(7)
    print(f"# {args.threads} threads, bfloat16 pools, us a layer, medians of {args.rounds} interleaved rounds")
    for name, shapes in SHAPES:
        layout = random_layout(gen, 16, 256, shapes)
        keys = torch.randn(256 * 16, 3, 64, generator=gen).to(torch.bfloat16)
        values = torch.randn(256 * 16, 3, 64, generator=gen).to(torch.bfloat16)
        query = torch.randn(layout.num_tokens, 9, 64, generator=gen).to(torch.bfloat16).transpose(0, 1)
        inputs = (query, keys, values, layout, 0.125)
        runs = {"this checkout": invariant_attention_cpu, args.against: other}
        outputs = [f(*inputs) for f in runs.values()]
        torch.testing.assert_close(*outputs, atol=1e-2, rtol=1e-2)
        same = "bit-identical" if torch.equal(*outputs) else "other bits"
        times = {label: [] for label in runs}
        for _ in range(args.rounds):
            for label, f in runs.items():
                start = time.perf_counter()
                for _ in range(3):
                    f(*inputs)
                times[label].append((time.perf_counter() - start) / 3)
        a, b = (statistics.median(t) * 1e6 for t in times.values())
        print(f"{name}: this checkout {a:.0f} us, {args.against} {b:.0f} us ({a / b:.2f}x; {same})", flush=True)


if __name__ == "__main__":
    main()
