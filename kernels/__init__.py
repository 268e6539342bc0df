"""DistAttention kernels: MicroAttention over paged KV, exact merge of partial states, KV writes.

Every log-sum-exp in this package is a natural logarithm in float32.
"""

from .attention import (
    AttentionState,
    MicroAttentionConfig,
    MicroAttentionPlan,
    choose_num_splits,
    merge_attention_states,
    merge_two_attention_states,
    micro_attention,
    plan_micro_attention,
    run_micro_attention,
    write_kv,
)
from .kv_pool import KVPoolShape, allocate_kv_pool
from .prefix_attention import PrefixAttentionConfig, prefix_causal_attention, prefix_causal_attention_torch

__all__ = [
    "AttentionState",
    "KVPoolShape",
    "MicroAttentionConfig",
    "MicroAttentionPlan",
    "PrefixAttentionConfig",
    "allocate_kv_pool",
    "choose_num_splits",
    "merge_attention_states",
    "merge_two_attention_states",
    "micro_attention",
    "plan_micro_attention",
    "prefix_causal_attention",
    "prefix_causal_attention_torch",
    "run_micro_attention",
    "write_kv",
]
