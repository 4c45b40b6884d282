"""Target hidden states of every training sample, computed once and kept on disk.

Methods that learn from the target's features (EAGLE, Medusa, MTP) would otherwise run
the whole target for every batch of every epoch; on a CPU that costs more than the
drafter's own training. :class:`FeatureStore` runs the target once over all samples (in
the dtype the drafter will be served with, and quantized as served, so training sees the
features inference sees) and writes each requested layer as one flat file of rows, sample
after sample::

    OUT/features/index.json       layers, dtype, hidden size, tokens per sample, samples done
    OUT/features/layer_{L}.bin    [total tokens, hidden] raw rows (L = -1: final normalised)

It is built in chunks and records how many samples are done after each, so an
interrupted build resumes where it stopped, and samples appended to the data add their
rows after the old ones; a store built for other layers, another target or other samples
is rebuilt. A store holding more layers or more samples than asked for serves the ones
asked for: two methods may share one store, and runs on the first N samples
(``--max-samples``) share the store of all of them.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from .data import Sample
from .method import TrainTarget

log = logging.getLogger(__name__)

INDEX = "index.json"
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def _layer_file(directory: Path, layer: int) -> Path:
    return directory / f"layer_{layer}.bin"


class FeatureStore:
    """Hidden states of layers ``layers`` for each sample (truncated to ``max_len`` tokens)."""

    def __init__(self, directory: Path, layers: list[int], lengths: list[int], hidden: int, dtype: torch.dtype):
        self.directory = directory
        self.layers = list(layers)
        self.lengths = lengths
        self.hidden = hidden
        self.dtype = dtype
        self.offsets = [0]
        for n in lengths:
            self.offsets.append(self.offsets[-1] + n)
        self.wanted = self.layers
        self._rows: dict[int, torch.Tensor] = {}

    @classmethod
    def build(cls, directory: Path, target: TrainTarget, samples: list[Sample], layers: list[int], max_len: int,
              dtype: str = "bfloat16", batch_tokens: int = 4096,
              progress: Callable[[int, int], None] | None = None,
              quantized: tuple[str, Callable[[], torch.nn.Module]] | None = None) -> FeatureStore:
        """Open the store in ``directory``, computing what is missing. ``quantized``:
        ``(mode, load)`` where the target is served quantized; ``load()`` gives that model, whose
        states the drafter will read (those of another quantization are computed again)."""
        directory.mkdir(parents=True, exist_ok=True)
        lengths = [min(len(s.token_ids), max_len) for s in samples]
        index = {"layers": sorted(layers), "dtype": dtype, "hidden": target.hidden_size, "target": target.name,
                 "lengths": lengths, "done": 0}
        mode, load_quantized = quantized if quantized is not None else (None, None)
        if mode is not None:
            index["quantization"] = mode
        path = directory / INDEX
        if path.exists():
            old = json.loads(path.read_text())
            same = ("layers", "done", "lengths")
            # samples appended to a run's data (its answers are cached in that order too) keep the rows of the old
            # ones, and a run on the first N samples of a larger store's (--max-samples) reads its rows as they are
            shared = min(len(old["lengths"]), len(lengths))
            if ({k: v for k, v in old.items() if k not in same} == {k: v for k, v in index.items() if k not in same}
                    and old["lengths"][:shared] == lengths[:shared] and set(layers) <= set(old["layers"])):
                index["done"], index["layers"] = min(old["done"], len(lengths)), old["layers"]
            else:
                log.info("%s: features of other layers, target or samples; computing them again", directory)
        store = cls(directory, index["layers"], lengths, target.hidden_size, DTYPES[dtype])
        store.wanted = sorted(set(layers))
        done = index["done"]
        if done < len(samples):
            store._compute(target, samples, done, batch_tokens, index, progress, load_quantized)
        return store

    def _compute(self, target: TrainTarget, samples: list[Sample], done: int, batch_tokens: int, index: dict,
                 progress, load_quantized: Callable[[], torch.nn.Module] | None) -> None:
        model = load_quantized() if load_quantized is not None else copy.deepcopy(target.model).to(self.dtype)
        files = {}
        for layer in self.layers:
            f = _layer_file(self.directory, layer).open("r+b" if done else "wb")
            f.truncate(self.offsets[done] * self.hidden * self.dtype.itemsize)
            f.seek(0, 2)
            files[layer] = f
        run = TrainTarget(model, target.tokenizer, target.name, target.path)
        try:
            while done < len(samples):
                chunk, width = [done], self.lengths[done]
                while chunk[-1] + 1 < len(samples):
                    wider = max(width, self.lengths[chunk[-1] + 1])
                    if (len(chunk) + 1) * wider > batch_tokens:
                        break
                    chunk.append(chunk[-1] + 1)
                    width = wider
                ids = torch.zeros(len(chunk), width, dtype=torch.long)
                mask = torch.zeros(len(chunk), width, dtype=torch.long)
                for row, i in enumerate(chunk):
                    n = self.lengths[i]
                    ids[row, :n] = torch.tensor(samples[i].token_ids[:n])
                    mask[row, :n] = 1
                _, hidden = run.run(ids.to(run.device), mask.to(run.device), self.layers)
                for layer, states in hidden.items():
                    rows = torch.cat([states[row, :self.lengths[i]] for row, i in enumerate(chunk)])
                    files[layer].write(rows.to(self.dtype).contiguous().cpu().view(torch.uint8).numpy().tobytes())
                done = chunk[-1] + 1
                for f in files.values():
                    f.flush()
                index["done"] = done
                (self.directory / INDEX).write_text(json.dumps(index))
                if progress:
                    progress(done, len(samples))
        finally:
            for f in files.values():
                f.close()

    def rows(self, layer: int) -> torch.Tensor:
        """``[total tokens, hidden]`` rows of one layer (memory-mapped)."""
        if layer not in self._rows:
            size = self.offsets[-1] * self.hidden
            flat = torch.from_file(str(_layer_file(self.directory, layer)), shared=False, size=size, dtype=self.dtype)
            self._rows[layer] = flat.view(-1, self.hidden)
        return self._rows[layer]

    def batch(self, indices: list[int], width: int, device: torch.device) -> dict[int, torch.Tensor]:
        """layer -> ``[len(indices), width, hidden]`` float32, zero past each sample's end."""
        out = {}
        for layer in self.wanted:
            rows = self.rows(layer)
            dense = torch.zeros(len(indices), width, self.hidden)
            for b, i in enumerate(indices):
                n = min(self.lengths[i], width)
                dense[b, :n] = rows[self.offsets[i]:self.offsets[i] + n].float()
            out[layer] = dense.to(device)
        return out
