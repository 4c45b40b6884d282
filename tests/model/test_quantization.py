"""Weight-only int8 / int4 targets: the layers, the GGUF's own blocks, losslessness, errors."""

import re

import pytest
import torch
from helpers import long_document_prompt, specdec_main
from specdec_test_support import embedded

from specdec import LLM, SamplingParams, testing
from specdec.errors import ConfigError, FieldError, ModelLoadError
from specdec.model.loading import quantize_target
from specdec.model.quantization import (
    GROUP_SIZE,
    Int4Linear,
    Int8Embedding,
    Int8Linear,
    W4A8Linear,
    W8A8Linear,
    check_supported,
    quantize_groups_int4,
    quantize_linears_w8a8,
    quantize_rows_int8,
    rows_are_independent,
    weight_bytes,
)
from specdec.numerics.auto import resolve_draft_quantization


def test_layers_compute_their_dequantized_weights_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 128, generator=g)
    codes, scale, minimum = quantize_groups_int4(weight)
    step = scale.repeat_interleave(GROUP_SIZE, 1)
    deq4 = codes.float() * step + minimum.repeat_interleave(GROUP_SIZE, 1)
    assert codes.min() >= 0 and codes.max() <= 15
    assert ((deq4 - weight).abs() <= step / 2 + 1e-6).all()
    codes8, scale8 = quantize_rows_int8(weight)
    assert ((codes8.float() * scale8[:, None] - weight).abs() <= scale8[:, None] / 2 + 1e-6).all()

    x = torch.randn(5, 128, generator=g)
    int4 = Int4Linear.from_weight(weight, None, torch.float32)
    int8 = Int8Linear.from_weight(weight, None, torch.float32)
    torch.testing.assert_close(int4.weight, deq4, atol=1e-5, rtol=0)
    torch.testing.assert_close(int4(x), x @ deq4.T, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(int8(x), x @ int8.weight.T, atol=1e-4, rtol=1e-5)
    bias = torch.randn(96, generator=g)
    torch.testing.assert_close(Int4Linear.from_weight(weight, bias, torch.float32)(x), x @ deq4.T + bias,
                               atol=1e-4, rtol=1e-5)
    emb = Int8Embedding(codes8, scale8, torch.float32)
    ids = torch.tensor([[3, 0, 95]])
    torch.testing.assert_close(emb(ids), (codes8.float() * scale8[:, None])[ids])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_kernels_compute_each_row_alone(dtype):
    """What lets quantized targets verify drafts losslessly and need no batch-invariant plan."""
    weight = torch.randn(192, 576, generator=torch.Generator().manual_seed(1)) * 0.05
    assert rows_are_independent(Int4Linear.from_weight(weight, None, dtype), 576, dtype, max_rows=40)
    assert rows_are_independent(Int8Linear.from_weight(weight, None, dtype), 576, dtype, max_rows=40)


def test_gguf_blocks_are_the_files_own_weights(smol_hf):
    """The embedded Q4_1 file's blocks, taken as they are, equal transformers' dequantization
    of it; its Q8_0 embedding, rounded a few thousand rows at a time, equals the whole float32
    matrix rounded at once."""
    from specdec.model.gguf_blocks import quantized_layers
    from specdec.model.loading import embedded_gguf_path

    layers = quantized_layers(embedded_gguf_path(), smol_hf.config, torch.float32)
    embedding = layers.pop("model.embed_tokens")
    assert len(layers) == 7 * smol_hf.config.num_hidden_layers
    assert all(isinstance(layer, Int4Linear) for layer in layers.values())
    last = smol_hf.config.num_hidden_layers - 1
    for name, layer in layers.items():  # every kind of layer, in the first, a middle and the last block
        if int(name.split(".")[2]) in (0, last // 2, last):  # (reading a float32 weight back costs 0.3 s)
            assert torch.equal(layer.weight, smol_hf.get_submodule(name).weight), name
    codes, scale = quantize_rows_int8(smol_hf.get_input_embeddings().weight)
    assert embedding.codes.shape[0] > 4096  # rounded in more than one piece
    assert torch.equal(embedding.codes, codes) and torch.equal(embedding.scale, scale)


@pytest.fixture(scope="module")
def smol_int4():
    return LLM(device="cpu", dtype="float32", engine={"quantization": "int4"})


@pytest.fixture(scope="module")
def smol_int4_bf16():
    return LLM(device="cpu", dtype="bfloat16", engine={"quantization": "int4", "batch_invariant": True})


def test_embedded_int4_target_is_smaller_and_still_answers(smol_int4, smol):
    """The issue's memory goal, on what the weights hold: int4 at most 40% of bfloat16."""
    bf16_bytes = weight_bytes(smol.target.model) // 2  # the float32 model's tensors, at 2 bytes
    int4_bytes = weight_bytes(LLM(device="cpu", dtype="bfloat16", engine={"quantization": "int4"}).target.model)
    assert int4_bytes <= 0.4 * bf16_bytes, f"{int4_bytes / 2**20:.0f} MiB vs bfloat16 {bf16_bytes / 2**20:.0f} MiB"
    assert sum(isinstance(m, Int4Linear) for m in smol_int4.target.model.modules()) == 210
    params = SamplingParams(max_tokens=12, temperature=0.0)
    prompt = [{"role": "user", "content": "What is the capital of France?"}]
    assert "Paris" in smol_int4.chat([prompt], params)[0].text


@pytest.mark.parametrize("mode", ["int4", "int8", "w4a8", "w8a8"])
def test_quantized_tiny_target_greedy_lossless(tiny_models, mode):
    testing.check_greedy_lossless({"decoding_type": "ngram", "max_draft_len": 4}, tiny_models["llama"],
                                  engine={"quantization": mode}, device="cpu")


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_embedded_int4_greedy_lossless_with_trained_drafters(smol_int4_bf16, method):
    """The shipped drafters read the quantized head and embedding; output equals the int4
    target's (bfloat16 activations, where the packed kernels are fast, in the batch-invariant
    mode, so that equality is bit for bit)."""
    plain = smol_int4_bf16.chat(embedded.SHIPPED_CHECK_PROMPTS, embedded.SHIPPED_CHECK_PARAMS)
    spec = LLM(device="cpu", dtype="bfloat16", engine={"quantization": "int4", "batch_invariant": True},
               speculative_config={"decoding_type": method, "adaptive": False})
    got = spec.chat(embedded.SHIPPED_CHECK_PROMPTS, embedded.SHIPPED_CHECK_PARAMS)
    for a, b in zip(plain, got):
        assert a.token_ids == b.token_ids
    assert sum(o.metrics.num_accepted_tokens for o in got) >= 20


@pytest.fixture(scope="module")
def smol_w4a8_plain():
    """The check prompts and a 1,100-token summarization request (three prompt chunks)
    batched, and the w4a8 target's plain answers."""
    llm = embedded.embedded_llm()
    prompts = [llm.apply_chat_template(c) for c in embedded.SHIPPED_CHECK_PROMPTS]
    prompts.insert(1, long_document_prompt(llm.get_tokenizer(), 1100))
    return prompts, llm.generate(prompts, embedded.SHIPPED_CHECK_PARAMS)


@pytest.mark.parametrize("method", ["ngram", "lookahead", "suffix", "draft_target", "medusa", "eagle", "eagle3",
                                    "mtp", "redrafter"])
def test_embedded_w4a8_greedy_lossless_with_every_method(smol_w4a8_plain, method):
    """On the integer-dot kernels (8-bit activations, each token's quantized on its own)
    every method's output equals the w4a8 target's plain output, drafts accepted
    (bfloat16, the batch-invariant attention, the forward compiled as by default), a long
    prompt's chunks in the batch beside short requests."""
    prompts, plain = smol_w4a8_plain
    spec = LLM(speculative_config={"decoding_type": method, "adaptive": False})
    assert sum(isinstance(m, W4A8Linear) for m in spec.target.model.modules()) == 210
    assert spec.engine.compiled and spec.engine.batch_invariant
    assert spec.config.engine.draft_quantization == "w8a8"
    got = spec.generate(prompts, embedded.SHIPPED_CHECK_PARAMS)
    for i, (a, b) in enumerate(zip(plain, got)):
        assert a.token_ids == b.token_ids, f"prompt {i} departs at {testing.first_divergence(a.token_ids, b.token_ids)}"
    assert sum(o.metrics.num_accepted_tokens for o in got) > 0


def test_bfloat16_int4_batch_invariant_identical_with_drafts():
    """In bfloat16 with batch-invariant numerics, the int4 embedded target answers the same with
    drafts verified beside each token as alone."""
    testing.check_greedy_lossless({"decoding_type": "ngram", "max_draft_len": 6}, dtype="bfloat16",
                                  engine={"quantization": "int4", "batch_invariant": True}, max_tokens=32,
                                  min_accepted=5, device="cpu")


def test_quantized_sampling_follows_the_quantized_target(tiny_models):
    prompt = list(range(3, 11)) * 2
    _, accepted = testing.check_sampling_lossless({"decoding_type": "ngram", "max_draft_len": 4},
                                                  tiny_models["llama"], prompt, n=800,
                                                  engine={"quantization": "int4"}, device="cpu")
    assert accepted > 0


def test_low_memory_load_equals_load_then_quantize(tiny_models):
    from transformers import AutoModelForCausalLM

    from specdec.model.quantization import quantize_model

    path = tiny_models["llama"]
    streamed = quantize_target(path, "int4", torch.float32, torch.device("cpu"))
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    quantize_model(loaded, "int4", torch.float32)
    ids = torch.tensor([[1, 5, 9, 33, 2]])
    with torch.no_grad():
        assert torch.equal(streamed(ids).logits, loaded(ids).logits)
    assert not any(p.is_meta for p in streamed.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_drafters_linear_layers_run_w8a8_in_place_keeping_their_weights(dtype):
    """Every stock linear layer the kernel takes, the module itself included, multiplies as a
    W8A8Linear of its weights; it keeps its weight; a width the blocks do not divide and a
    layer already on another forward stay as they were."""
    g = torch.Generator().manual_seed(0)
    body = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.SiLU(), torch.nn.Linear(96, 40, bias=False),
                               torch.nn.Linear(40, 64)).to(dtype)
    head = torch.nn.Linear(64, 128).to(dtype)
    custom = torch.nn.Linear(64, 32).to(dtype)
    custom.forward = lambda x: x[..., :32]
    weights = [m.weight.clone() for m in (body[0], body[2], body[3], head)]
    assert quantize_linears_w8a8(body) == 2 and quantize_linears_w8a8(head) == 1
    assert quantize_linears_w8a8(custom) == 0 and quantize_linears_w8a8(body) == 0  # each once
    assert all(torch.equal(m.weight, w) for m, w in zip((body[0], body[2], body[3], head), weights))
    assert "forward" not in body[3].__dict__  # 40 input columns: not a whole number of blocks
    x = torch.randn(3, 5, 64, generator=g).to(dtype)
    for layer in (body[0], body[2], head):
        rows = x if layer.in_features == 64 else torch.randn(3, 5, 96, generator=g).to(dtype)
        reference = W8A8Linear.from_weight(layer.weight, layer.bias, dtype)(rows)
        assert torch.equal(layer(rows), reference) and reference.shape == (3, 5, layer.out_features)
        assert (layer(rows).float() - torch.nn.functional.linear(rows, layer.weight, layer.bias).float()).abs().max() \
            < 0.05 * rows.float().abs().max() * layer.weight.float().abs().sum(1).max()


def test_draft_quantization_resolves_with_the_target_and_refuses_where_it_cannot_run():
    cpu = torch.device("cpu")
    assert resolve_draft_quantization("auto", "w4a8", cpu) == resolve_draft_quantization("auto", "w8a8", cpu) == "w8a8"
    assert resolve_draft_quantization("auto", None, cpu) is resolve_draft_quantization("auto", "int4", cpu) is None
    assert resolve_draft_quantization(None, "w4a8", cpu) is None
    assert resolve_draft_quantization("w8a8", None, cpu) == "w8a8"
    with pytest.raises(FieldError, match=r"engine.draft_quantization: w8a8 runs on CPU kernels, not on cuda"):
        resolve_draft_quantization("w8a8", None, torch.device("cuda"))
    with pytest.raises(ConfigError, match=r"draft_quantization.*must be one of 'auto', 'none', 'w8a8'.*int4"):
        LLM(device="cpu", engine={"draft_quantization": "int4"})


def test_a_w8a8_drafter_on_an_unquantized_target_drafts_losslessly(tiny_models):
    """Asked for by name beside a float32 target, the draft model's layers run w8a8 while the
    target's stay stock; greedy output equals plain output, drafts accepted."""
    model = str(tiny_models["llama"])
    prompts = [list(range(3, 40, 3)) * 2, list(range(50, 9, -4)) * 2]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = LLM(model=model, dtype="float32", device="cpu").generate(prompts, params)
    spec = LLM(model=model, dtype="float32", device="cpu", engine={"draft_quantization": "w8a8"},
               speculative_config={"decoding_type": "draft_target", "speculative_model": model, "max_draft_len": 3,
                                   "adaptive": False})
    drafter_layers = [m for d in spec.drafter.draft_modules() for m in d.modules() if type(m) is torch.nn.Linear]
    assert drafter_layers and all(isinstance(m.forward.__self__, W8A8Linear) for m in drafter_layers)
    assert not any("forward" in m.__dict__ for m in spec.target.model.modules() if type(m) is torch.nn.Linear)
    got = spec.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    assert sum(o.metrics.num_accepted_tokens for o in got) > 10


def test_a_layer_skip_draft_leaves_the_layers_it_shares_with_the_target_as_they_are(tiny_models):
    """A layer-skip draft runs the target's own layers and head: the w8a8 forwards a
    drafter's modules are given skip them, so the target (shared with the plain LLM of the
    same process) keeps its numerics, and greedy output equals plain output."""
    model = str(tiny_models["llama"])
    prompts = [list(range(3, 40, 3)) * 2, list(range(50, 9, -4)) * 2]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = LLM(model=model, dtype="float32", device="cpu")
    want = [o.token_ids for o in plain.generate(prompts, params)]
    spec = LLM(model=model, dtype="float32", device="cpu", engine={"draft_quantization": "w8a8"},
               speculative_config={"decoding_type": "draft_target", "draft_layers": 1, "max_draft_len": 3,
                                   "adaptive": False})
    assert spec.target is plain.target
    assert not any("forward" in m.__dict__ for m in spec.target.model.modules() if type(m) is torch.nn.Linear)
    got = spec.generate(prompts, params)
    assert [o.token_ids for o in got] == want == [o.token_ids for o in plain.generate(prompts, params)]
    assert sum(o.metrics.num_accepted_tokens for o in got) > 10


def test_unsupported_quantization_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"quantization.*must be one of 'auto', 'none', 'int8', 'int4'.*int3"):
        LLM(device="cpu", engine={"quantization": "int3"})
    with pytest.raises(ConfigError, match="device: cpu only"):
        check_supported("int4", torch.device("cuda"), torch.bfloat16)
    with pytest.raises(ConfigError, match="bfloat16 or float32, not float16"):
        LLM(device="cpu", dtype="float16", engine={"quantization": "int8"})


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_a_drafter_for_another_target_is_refused_as_for_the_unquantized_target(tiny_models, mode, tmp_path):
    """Checkpoints are checked against the target's shape, which quantization leaves as it was."""
    from specdec_eagle import SHIPPED_HEADS
    from specdec_mtp import SHIPPED_MODULE

    def refusal(model, engine, options):
        with pytest.raises(ModelLoadError) as info:
            LLM(model=model, device="cpu", engine=engine, speculative_config=options)
        return str(info.value)

    narrow = testing.tiny_model_dir(tmp_path / "narrow", vocab_size=32)
    wide = testing.tiny_model_dir(tmp_path / "wide", vocab_size=64)
    cases = [(tiny_models["llama"], {"decoding_type": "eagle3", "speculative_model": SHIPPED_HEADS[3]},
              "hidden_size 576, but the target .* has hidden_size 64"),
             (tiny_models["llama"], {"decoding_type": "mtp", "speculative_model": SHIPPED_MODULE},
              "module at model.layers.30, but the target has 2 layers"),
             (narrow, {"decoding_type": "draft_target", "speculative_model": wide},
              "64 output tokens, more than the target")]
    for model, options, message in cases:
        quantized = refusal(model, {"quantization": mode}, options)
        assert re.search(message, quantized) and quantized == refusal(model, {}, options)


def test_auto_runs_a_q4_gguf_on_the_integer_dot_kernels(smol):
    """The default for a CPU user: the embedded Q4_1 file runs its own blocks (w4a8) in the
    batch-invariant mode, its forward compiled, unless a dtype is asked for or ``none`` is;
    the dequantized weights are one option away."""
    default = LLM(device="cpu")
    assert default.config.engine.quantization == "w4a8" and default.engine.batch_invariant
    assert default.engine.compiled
    assert sum(isinstance(m, W4A8Linear) for m in default.target.model.modules()) == 210
    assert LLM(device="cpu", engine={"quantization": "none"}).config.engine.quantization is None
    assert smol.config.engine.quantization is None  # dtype float32 asked for


def test_auto_leaves_other_gguf_schemes_unquantized_and_refuses_them_by_name(tmp_path, caplog):
    import gguf

    from specdec.numerics.auto import resolve_quantization

    path = tmp_path / "f16.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for name in ("blk.0.attn_q.weight", "blk.0.ffn_down.weight", "token_embd.weight"):
        writer.add_tensor(name, torch.zeros(64, 64, dtype=torch.float16).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    cpu = torch.device("cpu")
    with caplog.at_level("INFO", logger="specdec.numerics.auto"):
        assert resolve_quantization("auto", "auto", cpu, path) is None
    assert "linear layers are F16" in caplog.text
    with pytest.raises(ConfigError, match=r"w4a8 takes a GGUF file's Q4_0, Q4_1, Q4_K.* blocks.*holds F16 linear"):
        resolve_quantization("w4a8", "auto", cpu, path)
    assert resolve_quantization("w8a8", "auto", cpu, path) == "w8a8"  # int8 rows rounded from the weights


def test_cli_quantization_flag_and_yaml(tmp_path):
    out = specdec_main("generate", "--quantization", "int8", "--device", "cpu", "--dtype", "float32", "-n", "6",
                       "--set", "sampling.temperature=0", "The capital of France is")
    assert out.returncode == 0 and "Paris" in out.stdout, out.stderr
    config = tmp_path / "q.yaml"
    config.write_text("engine: {quantization: int5}\n")
    out = specdec_main("config", "check", str(config))
    assert out.returncode == 2 and "engine.quantization: must be one of 'auto', 'none', 'int8'" in out.stderr
    out = specdec_main("generate", "--quantization", "int2", "x")
    assert out.returncode == 2 and "invalid choice: 'int2'" in out.stderr


@pytest.mark.parametrize("tied", [False, True])
def test_a_scaled_embedding_keeps_its_scale_in_int8(tmp_path, tied):
    """Gemma multiplies looked-up rows by sqrt(hidden): the int8 table (its own, or a tied
    head's rows) keeps that factor, so the quantized model reads what the stock one reads,
    within the rows' int8 rounding."""
    from transformers import AutoModelForCausalLM

    directory = testing.tiny_model_dir(tmp_path, "gemma3_text")
    stock = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, tie_word_embeddings=tied)
    ids = torch.tensor([[1, 5, 17, 99]])
    want = stock.get_input_embeddings()(ids)
    from specdec.model.quantization import quantize_model

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, tie_word_embeddings=tied)
    quantize_model(model, "w8a8", torch.float32)
    got = model.get_input_embeddings()(ids)
    assert model.get_input_embeddings().embed_scale == float(stock.get_input_embeddings().embed_scale) == 8.0
    assert (got - want).abs().max() <= 0.01 * want.abs().max()
    assert not any(name.endswith("embed_scale") for name, _ in model.named_buffers())  # a cast cannot move it
