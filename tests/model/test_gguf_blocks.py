"""A GGUF file's blocks taken as they are: every block type decodes to the weights
llama.cpp's dequantization gives, and a Gemma 3 file of K-quant blocks loads onto the
integer-dot layers, whose products equal the kernels' torch reference."""

import numpy as np
import pytest
import torch

from specdec.kernels import int8_dot
from specdec.model.gguf_blocks import _BLOCK_TYPES, _decode, linear_schemes, quantized_layers
from specdec.model.quantization import W4A8Linear, W8A8BlockLinear

gguf = pytest.importorskip("gguf")

#: byte offsets of each block type's float16 scales (random bytes there could be inf or NaN)
_SCALE_OFFSETS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q5_0": (0,), "Q8_0": (0,), "Q6_K": (208,)}


def _random_blocks(kind: str, rows: int, blocks: int, seed: int = 0) -> np.ndarray:
    """``rows`` rows of ``blocks`` random ``kind`` blocks with finite, small scales."""
    rng = np.random.default_rng(seed)
    ggml_type = next(t for t, (name, _, _) in _BLOCK_TYPES.items() if name == kind)
    width = _BLOCK_TYPES[ggml_type][1]
    raw = rng.integers(0, 256, (rows, blocks, width), dtype=np.uint8)
    for offset in _SCALE_OFFSETS[kind]:
        sign = -1 if (kind, offset) == ("Q4_1", 2) else 1  # Q4_1's minimum
        scale = (sign * rng.random((rows, blocks)) * 0.02).astype(np.float16)
        raw[..., offset:offset + 2] = scale.view(np.uint8).reshape(rows, blocks, 2)
    return raw.reshape(rows, -1)


def _weights(parts) -> torch.Tensor:
    """The float32 weights of :func:`_decode`'s output."""
    if len(parts) == 3:
        codes, d, m = parts
        return codes.float() * d.repeat_interleave(32, 1) + m.repeat_interleave(32, 1)
    codes, scales = parts
    return codes.float() * scales.repeat_interleave(codes.shape[1] // scales.shape[1], 1)


@pytest.mark.parametrize("kind", [name for name, _, _ in _BLOCK_TYPES.values()])
def test_every_block_type_decodes_to_llama_cpps_weights(kind):
    ggml_type = next(t for t, (name, _, _) in _BLOCK_TYPES.items() if name == kind)
    raw = _random_blocks(kind, 5, 3)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(ggml_type)).astype(np.float32)
    got = _weights(_decode(kind, raw, _BLOCK_TYPES[ggml_type][1]))
    assert np.array_equal(got.numpy(), want)


#: a Gemma 3 layer as llama.cpp's Q4_K_M recipe stores a 640-wide model: Q5_0 and Q8_0 where
#: the width is not a multiple of 256, Q4_K and Q6_K where it is
#: (type, input columns, output rows)
_LAYER = {"attn_q": ("Q5_0", 64, 256), "attn_k": ("Q5_0", 64, 64), "attn_v": ("Q8_0", 64, 64),
          "attn_output": ("Q4_K", 256, 64), "ffn_gate": ("Q5_0", 64, 96), "ffn_up": ("Q5_0", 64, 96),
          "ffn_down": ("Q6_K", 256, 64)}


@pytest.fixture(scope="module")
def k_quant_file(tmp_path_factory):
    """A Gemma 3 GGUF file holding one layer of K-quant and legacy blocks (no tokenizer: the
    blocks are what is read here)."""
    path = tmp_path_factory.mktemp("gguf") / "gemma3-blocks.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma3")
    raws = {}
    for i, (name, (kind, columns, rows)) in enumerate(_LAYER.items()):
        ggml_type = next(t for t, (n, _, _) in _BLOCK_TYPES.items() if n == kind)
        _, width, weights = _BLOCK_TYPES[ggml_type]
        raws[name] = raw = _random_blocks(kind, rows, columns // weights, seed=i)
        writer.add_tensor(f"blk.0.{name}.weight", raw, raw_shape=raw.shape,
                          raw_dtype=gguf.GGMLQuantizationType(ggml_type))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, raws


def test_a_files_schemes_are_read_again_when_it_is_rewritten(tmp_path):
    """:func:`linear_schemes` is kept per version of a file: the same path written anew
    with other blocks is read anew."""
    path = tmp_path / "one-layer.gguf"
    for kind in ("Q4_K", "Q8_0", "Q4_K"):
        ggml_type = next(t for t, (n, _, _) in _BLOCK_TYPES.items() if n == kind)
        raw = _random_blocks(kind, 64, 256 // _BLOCK_TYPES[ggml_type][2], seed=0)
        writer = gguf.GGUFWriter(str(path), "gemma3")
        writer.add_tensor("blk.0.ffn_down.weight", raw, raw_shape=raw.shape,
                          raw_dtype=gguf.GGMLQuantizationType(ggml_type))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        assert linear_schemes(path) == {kind}


@pytest.mark.skipif(not int8_dot.kernel_available(), reason="the integer-dot kernels are not built here")
def test_a_gemma3_files_k_quant_blocks_become_integer_dot_layers_as_they_are(k_quant_file):
    from types import SimpleNamespace

    from specdec.numerics.auto import resolve_quantization

    path, raws = k_quant_file
    assert linear_schemes(path) == {"Q5_0", "Q8_0", "Q4_K", "Q6_K"}
    assert resolve_quantization("auto", "auto", torch.device("cpu"), path) == "w4a8"
    config = SimpleNamespace(num_attention_heads=4, num_key_value_heads=1, pad_token_id=0)
    layers = quantized_layers(path, config, torch.float32, "w4a8")
    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj"}
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(0))
    for file_name, (kind, columns, rows) in _LAYER.items():
        layer = layers[f"model.layers.0.{names[file_name]}"]
        ggml_type = next(t for t, (n, _, _) in _BLOCK_TYPES.items() if n == kind)
        want = gguf.quants.dequantize(raws[file_name], gguf.GGMLQuantizationType(ggml_type))
        # the file's own weights, in the file's row order (Gemma's rows are not permuted)
        assert torch.equal(layer.weight, torch.from_numpy(want.astype(np.float32))), file_name
        parts = _decode(kind, raws[file_name], _BLOCK_TYPES[ggml_type][1])
        if kind == "Q4_K":
            assert isinstance(layer, W4A8Linear) and layer.dm.dtype == torch.float32
            reference = int8_dot.q4_linear_reference(x[:, :columns], *parts, torch.float32)
        else:
            assert isinstance(layer, W8A8BlockLinear) and layer.width == (16 if kind == "Q6_K" else 32)
            reference = int8_dot.q8b_linear_reference(x[:, :columns], *parts)
        assert torch.equal(layer(x[:, :columns]), reference), file_name
