"""A tiny Llama-shaped model with random weights, for tests of the engine's layers and of the
hosts of a sequence-parallel prefill (``tests/`` is on ``sys.path``: its ``conftest.py`` puts it there)."""

from __future__ import annotations

import torch

from infinite_llm.engine.config import ModelConfig
from infinite_llm.engine.model import LlamaModel

CONFIG = ModelConfig(architecture="llama", vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=3,
                     num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                     max_position=4096, tie_word_embeddings=False)


def tiny_model(seed: int = 0) -> LlamaModel:
    generator = torch.Generator().manual_seed(seed)
    c = CONFIG

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.2

    weights = {"embed_tokens": rand(c.vocab_size, c.hidden_size), "lm_head": rand(c.vocab_size, c.hidden_size),
               "norm": torch.ones(c.hidden_size)}
    for i in range(c.num_layers):
        weights |= {
            f"layers.{i}.input_norm": torch.ones(c.hidden_size),
            f"layers.{i}.post_attention_norm": torch.ones(c.hidden_size),
            f"layers.{i}.q_proj": rand(c.q_size, c.hidden_size), f"layers.{i}.k_proj": rand(c.kv_size, c.hidden_size),
            f"layers.{i}.v_proj": rand(c.kv_size, c.hidden_size), f"layers.{i}.o_proj": rand(c.hidden_size, c.q_size),
            f"layers.{i}.gate_proj": rand(c.intermediate_size, c.hidden_size),
            f"layers.{i}.up_proj": rand(c.intermediate_size, c.hidden_size),
            f"layers.{i}.down_proj": rand(c.hidden_size, c.intermediate_size),
        }
    return LlamaModel(c, weights, device="cpu", dtype=torch.float32)
