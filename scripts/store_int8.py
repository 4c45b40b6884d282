"""Rewrite drafter weight files with their large matrices as int8 rows plus scales
(specdec.drafting.checkpoint.store_int8), in place: how the shipped drafters that would
otherwise overrun the shipped-weights budget are stored (BENCHMARKS.md, "Shipped drafters").

    python scripts/store_int8.py FILE.safetensors [...]
"""

import argparse
from pathlib import Path

from specdec.drafting.checkpoint import INT8_SCALE, load_tensors, save_tensors, store_int8


def store_file(path: Path) -> str:
    """Rewrite ``path`` with its large matrices as int8 rows; what was done, in a line."""
    before = path.stat().st_size
    tensors = load_tensors(path)  # already-int8 files come back as float32 and are stored again
    stored = store_int8(tensors)
    save_tensors(stored, path)
    count = sum(k.endswith(INT8_SCALE) for k in stored)
    return f"{path}: {count} matrices as int8, {before / 1e6:.1f} MB -> {path.stat().st_size / 1e6:.1f} MB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    for path in parser.parse_args().files:
        print(store_file(path))


if __name__ == "__main__":
    main()
