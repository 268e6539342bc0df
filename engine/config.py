"""Configuration: the model's shape (read from a checkpoint) and the engine's settings.

Both are frozen dataclasses validated on construction; nothing here reads files or touches a
device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

RopeKind = Literal["default", "linear", "llama3", "yarn"]


@dataclass(frozen=True)
class RopeScaling:
    """How the rotary frequencies are stretched for contexts longer than the pretraining one.

    ``default``: none. ``linear``: positions divided by ``factor``. ``llama3``: Llama 3.1's
    smooth interpolation between ``low_freq_factor`` and ``high_freq_factor``. ``yarn``: YaRN
    (NTK-by-parts plus an attention temperature).
    """

    kind: RopeKind = "default"
    factor: float = 1.0
    original_max_position: int = 0  # tokens of the pretraining context; 0 when unused
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn

    def __post_init__(self) -> None:
        if self.kind not in ("default", "linear", "llama3", "yarn"):
            raise ValueError(f"unsupported RoPE scaling {self.kind!r}: expected default, linear, llama3 or yarn")
        if self.factor <= 0:
            raise ValueError(f"RoPE scaling factor must be positive, got {self.factor}")
        if self.kind in ("llama3", "yarn") and self.original_max_position <= 0:
            raise ValueError(f"RoPE scaling {self.kind!r} needs original_max_position > 0")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and constants of a Llama-family decoder."""

    architecture: str  # "llama" or "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int  # tokens of context the checkpoint supports
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2 has q, k, v biases
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    rotary_dim: int = 0  # 0: the whole head_dim rotates

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ValueError(f"rotary_dim ({self.rotary_dim}) must be even and at most head_dim ({self.head_dim})")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def weight_bytes(self, itemsize: int) -> int:
        """Bytes of every weight matrix and vector at ``itemsize`` bytes per element."""
        per_layer = (
            self.hidden_size * (self.q_size + 2 * self.kv_size)
            + self.q_size * self.hidden_size
            + 3 * self.hidden_size * self.intermediate_size
            + 2 * self.hidden_size
        )
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return itemsize * (self.num_layers * per_layer + embed + self.hidden_size)


@dataclass(frozen=True)
class EngineConfig:
    """Settings of one engine (one home instance and the in-process pools standing for others).

    ``pool_blocks[0]`` is the home pool, where every new token's K and V are written; the
    others are creditor pools that hold older blocks lent out by the home.
    """

    block_size: int = 16  # tokens per KV block
    pool_blocks: tuple[int, ...] = (2048,)  # blocks per pool; index = instance id, 0 = home
    max_num_seqs: int = 32  # requests in one step
    max_num_batched_tokens: int = 512  # tokens in one step: the prefill chunk size
    max_model_len: int = 0  # 0: the checkpoint's context length
    device: str = "cpu"
    dtype: str = "auto"  # "auto": bfloat16 on CUDA, float32 on the CPU
    spill_to_creditors: bool = True  # lend a request's oldest blocks when the home pool is full
    cuda_graphs: bool = True  # replay decode steps as CUDA graphs (CUDA only)
    # Later requests that may start ahead of a waiting request that cannot start yet (its
    # context needs memory that is not free); 0: first come, first served.
    queue_bypass_limit: int = 0
    # Decoding requests whose KV spans other instances run in one step of this many while other
    # requests run (their steps wait on peers at every layer; see engine.scheduler).
    split_decode_interval: int = 1

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if not self.pool_blocks or any(n <= 0 for n in self.pool_blocks):
            raise ValueError(f"pool_blocks must list at least one positive block count, got {self.pool_blocks}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least block_size ({self.block_size})"
            )
        if self.split_decode_interval < 1:
            raise ValueError(f"split_decode_interval must be at least 1, got {self.split_decode_interval}")
        if self.queue_bypass_limit < 0:
            raise ValueError(f"queue_bypass_limit must be >= 0, got {self.queue_bypass_limit}")
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len must be >= 0, got {self.max_model_len}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")

    @property
    def num_instances(self) -> int:
        return len(self.pool_blocks)

    @property
    def home_instance_id(self) -> int:
        return 0
