"""Drafter weight files: int8 storage of large matrices round-trips within half a step per
row, leaves small tensors alone, halves the file, and is invisible to loaders; a broken
file is named."""

import pytest
import torch

from specdec.drafting.checkpoint import INT8_MIN_ELEMENTS, INT8_SCALE, load_tensors, save_tensors, store_int8
from specdec.errors import ModelLoadError


def test_int8_storage_round_trips_within_half_a_step(tmp_path):
    g = torch.Generator().manual_seed(0)
    big = (torch.randn(512, 256, generator=g) * torch.linspace(0.01, 3, 512)[:, None]).to(torch.bfloat16)
    tensors = {"big.weight": big, "bias": torch.randn(512, generator=g), "small.weight": torch.randn(8, 8, generator=g),
               "ids": torch.arange(5)}
    stored = store_int8(tensors)
    assert stored["big.weight"].dtype == torch.int8 and set(stored) == {*tensors, "big.weight" + INT8_SCALE}
    for key in ("bias", "small.weight", "ids"):
        assert stored[key] is tensors[key]
    save_tensors(tensors, tmp_path / "plain.safetensors")
    save_tensors(stored, tmp_path / "int8.safetensors")
    assert (tmp_path / "int8.safetensors").stat().st_size < 0.55 * (tmp_path / "plain.safetensors").stat().st_size
    loaded = load_tensors(tmp_path / "int8.safetensors")
    assert set(loaded) == set(tensors) and loaded["big.weight"].dtype == torch.float32
    step = big.float().abs().amax(dim=1) / 127
    error = (loaded["big.weight"] - big.float()).abs()
    assert bool((error <= step[:, None] / 2 + 1e-6).all()) and float(error.max()) > 0
    assert torch.equal(loaded["small.weight"], tensors["small.weight"])
    # storing again is exact: the rows' maxima are multiples of their own scales
    assert torch.equal(load_tensors(_saved(store_int8(loaded), tmp_path / "again.safetensors"))["big.weight"],
                       loaded["big.weight"])
    assert 512 * 256 >= INT8_MIN_ELEMENTS > 8 * 8


def _saved(tensors, path):
    save_tensors(tensors, path)
    return path


def test_a_scale_without_its_matrix_is_named(tmp_path):
    path = _saved({"w": torch.zeros(4, 4), "w" + INT8_SCALE: torch.ones(4)}, tmp_path / "bad.safetensors")
    with pytest.raises(ModelLoadError, match=r"bad.safetensors: w.int8_scale scales no int8 tensor w"):
        load_tensors(path)


def test_restricted_head_takes_the_rows_of_the_drafting_vocabulary(tmp_path):
    from specdec.drafting.checkpoint import restricted_head, save_draft_vocab

    head = torch.nn.Linear(8, 50, bias=False)
    projection, vocab = restricted_head(head, tmp_path, 50)
    assert vocab is None and projection is head
    save_draft_vocab(tmp_path, torch.tensor([7, 3, 49]))
    projection, vocab = restricted_head(head, tmp_path, 50)
    assert vocab.tolist() == [7, 3, 49] and torch.equal(projection.weight, head.weight[[7, 3, 49]])
    x = torch.randn(4, 8)
    torch.testing.assert_close(projection(x), head(x)[:, [7, 3, 49]])
    assert not projection.weight.requires_grad
    with pytest.raises(ModelLoadError, match=r"ids must lie in 0..39"):
        restricted_head(torch.nn.Linear(8, 40, bias=False), tmp_path, 40)
