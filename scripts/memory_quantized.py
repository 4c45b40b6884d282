"""Resident memory of the embedded model as a target in bfloat16, int8 and int4, each in
its own process: after the imports, after building ``LLM`` (peak and steady) and after a
32-token answer, with a 16 MiB KV cache so the weights dominate (BENCHMARKS.md,
"Quantized targets"). ``bfloat16-stock`` is bfloat16 with ``engine.prepack_weights`` off
(no second, oneDNN-packed copy of the linear weights); a ``-compiled`` suffix turns
``engine.compile`` on (its graphs compile while ``LLM`` is built).

    .venv/bin/python scripts/memory_quantized.py [MODE ...]   (default: bfloat16 bfloat16-stock int8 int4)
"""

from __future__ import annotations

import json
import subprocess
import sys


def status() -> dict[str, float]:
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {key: int(fields[key].split()[0]) / 1024 for key in ("VmRSS", "VmHWM")}


def measure(mode: str) -> dict:
    import torch

    from specdec import LLM, SamplingParams
    from specdec.model.quantization import weight_bytes

    torch.set_num_threads(2)
    imports = status()
    base = mode.removesuffix("-compiled")
    quantization = base if base in ("int8", "int4") else None
    llm = LLM(dtype="bfloat16", engine={"quantization": quantization, "kv_cache_memory_mb": 16,
                                        "prepack_weights": base != "bfloat16-stock", "compile": mode != base})
    loaded = status()
    llm.chat([[{"role": "user", "content": "Name three rivers."}]], SamplingParams(max_tokens=32, temperature=0))
    answered = status()
    return {"weights_mib": weight_bytes(llm.target.model) / 2**20, "imports_rss_mib": imports["VmRSS"],
            "loaded_rss_mib": loaded["VmRSS"], "answered_rss_mib": answered["VmRSS"],
            "peak_rss_mib": answered["VmHWM"]}


def main() -> None:
    if sys.argv[1:2] == ["--one"]:
        print(json.dumps(measure(sys.argv[2])))
        return
    rows = {}
    for mode in ["bfloat16"] + [m for m in sys.argv[1:] or ["bfloat16-stock", "int8", "int4"] if m != "bfloat16"]:
        out = subprocess.run([sys.executable, __file__, "--one", mode], capture_output=True, text=True,
                             check=True).stdout
        rows[mode] = json.loads(out.strip().splitlines()[-1])
    base = rows["bfloat16"]
    print(f"{'target':<20}{'weights MiB':>12}{'peak RSS':>10}{'steady RSS':>12}{'peak over imports':>19}"
          f"{'vs bf16':>9}{'weights vs bf16':>17}")
    for mode, r in rows.items():
        over = r["peak_rss_mib"] - r["imports_rss_mib"]
        base_over = base["peak_rss_mib"] - base["imports_rss_mib"]
        print(f"{mode:<20}{r['weights_mib']:>12.0f}{r['peak_rss_mib']:>10.0f}{r['answered_rss_mib']:>12.0f}"
              f"{over:>19.0f}{over / base_over:>8.0%}{r['weights_mib'] / base['weights_mib']:>16.0%}")


if __name__ == "__main__":
    main()
