"""Decode-step bandwidth use and prefill speed of the engine's model on a GPU.

A Llama-3-8B-shaped model with random bf16 weights (no download). For each batch x context the
KV pool is filled with random values and one decode step (all layers, paged MicroAttention,
logits) is timed; model bandwidth utilisation is
``(weight bytes + KV bytes read) / step time / copy bandwidth``, the copy bandwidth being a
device-to-device copy measured in the same run (bytes read + written). Prefill tokens/s at each
prompt length compares the engine's attention with torch SDPA (causal, GQA) in the same model.

    python bench/engine_gpu.py                         # the H200 shapes
    python bench/engine_gpu.py --tiny                  # a small model on the CPU, to check the script

Writes ``bench/results/engine_gpu-<gpu>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from infinite_llm.engine.block_manager import Segment
from infinite_llm.engine.config import ModelConfig, RopeScaling
from infinite_llm.engine.cuda_graphs import LocalDecodeGraphs, PiecewiseDecodeGraphs
from infinite_llm.engine.dist_attention import DistAttention, build_step_attention
from infinite_llm.engine.model import LlamaModel
from infinite_llm.engine.scheduler import ScheduledChunk
from infinite_llm.kernels import KVPoolShape, allocate_kv_pool, write_kv

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                 num_kv_heads=8, head_dim=128)
TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=32)


def llama_config(shape: dict, max_position: int) -> ModelConfig:
    return ModelConfig(architecture="llama", rms_norm_eps=1e-5, rope_theta=500000.0, max_position=max_position,
                       tie_word_embeddings=False, rope_scaling=RopeScaling(
                           kind="llama3", factor=8.0, original_max_position=8192), **shape)


def random_weights(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype) * 0.02

    h, q, kv, ff = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    weights = {"embed_tokens": rand(config.vocab_size, h), "lm_head": rand(config.vocab_size, h),
               "norm": torch.ones(h, device=device, dtype=dtype)}
    for i in range(config.num_layers):
        weights |= {
            f"layers.{i}.input_norm": torch.ones(h, device=device, dtype=dtype),
            f"layers.{i}.post_attention_norm": torch.ones(h, device=device, dtype=dtype),
            f"layers.{i}.q_proj": rand(q, h), f"layers.{i}.k_proj": rand(kv, h), f"layers.{i}.v_proj": rand(kv, h),
            f"layers.{i}.o_proj": rand(h, q), f"layers.{i}.gate_proj": rand(ff, h), f"layers.{i}.up_proj": rand(ff, h),
            f"layers.{i}.down_proj": rand(h, ff),
        }
    return weights


def _timer(device: torch.device):
    def measure(fn, repeats: int) -> float:
        """Median seconds of ``fn`` after one warm-up call."""
        fn()
        times = []
        for _ in range(repeats):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]

    return measure


def copy_bandwidth(device: torch.device, num_bytes: int, measure) -> float:
    """Bytes read + written per second by a device-to-device copy."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    seconds = measure(lambda: dst.copy_(src), 10)
    return 2 * num_bytes / seconds


def decode_step(model: LlamaModel, pool: torch.Tensor, batch: int, context: int, block_size: int, measure,
                graphs: PiecewiseDecodeGraphs | None,
                step_graphs: LocalDecodeGraphs | None) -> tuple[float, float | None, float | None]:
    """Median seconds of one decode step of ``batch`` requests that each hold ``context`` keys:
    eager, replayed as piecewise CUDA graphs (attention eager between them, as when remote parts
    are awaited), and as one whole-step graph (all KV at home); None without CUDA."""
    blocks_per_seq = -(-(context + 1) // block_size)
    chunks, tables, slots = [], {}, []
    for b in range(batch):
        ids = tuple(range(b * blocks_per_seq, (b + 1) * blocks_per_seq))
        tables[str(b)] = (Segment(0, ids, 0, context + 1),)
        chunks.append(ScheduledChunk(str(b), context, 1, True))
        slots.append(ids[context // block_size] * block_size + context % block_size)
    layout = build_step_attention(0, chunks, tables, slots, home_instance_id=0, block_size=block_size,
                                  device=model.device)
    attention = DistAttention(layout, pool, 0, None, num_heads=model.config.num_heads, sm_scale=model.sm_scale)
    token_ids = torch.randint(0, model.config.vocab_size, (batch,), device=model.device)
    positions = torch.full((batch,), context, dtype=torch.int64, device=model.device)
    rows = torch.arange(batch, device=model.device)
    loop = asyncio.new_event_loop()
    eager = measure(lambda: loop.run_until_complete(model.forward(token_ids, positions, attention, rows)), 16)
    if graphs is None or step_graphs is None:
        return eager, None, None
    replayed = measure(lambda: loop.run_until_complete(graphs.forward(token_ids, positions, attention, rows)), 16)
    home = layout.batches[0]
    whole = measure(lambda: step_graphs.forward(token_ids, positions, layout.slot_mapping, home.block_tables,
                                                home.kv_lens, rows), 16)
    return eager, replayed, whole


def prefill(model: LlamaModel, pool: torch.Tensor, length: int, block_size: int, measure, use_sdpa: bool) -> float:
    """Median time of prefilling one prompt of ``length`` tokens in one chunk."""
    ids = tuple(range(-(-length // block_size)))
    chunk = ScheduledChunk("0", 0, length, True)
    slots = [ids[p // block_size] * block_size + p % block_size for p in range(length)]
    layout = build_step_attention(0, [chunk], {"0": (Segment(0, ids, 0, length),)}, slots, home_instance_id=0,
                                  block_size=block_size, device=model.device)
    attention = DistAttention(layout, pool, 0, None, num_heads=model.config.num_heads, sm_scale=model.sm_scale)

    async def sdpa(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        write_kv(k, v, pool, layer, layout.slot_mapping, check_bounds=False)
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                             is_causal=True, enable_gqa=True, scale=model.sm_scale)
        return out[0].transpose(0, 1)

    token_ids = torch.randint(0, model.config.vocab_size, (length,), device=model.device)
    positions = torch.arange(length, device=model.device)
    rows = torch.tensor([length - 1], device=model.device)
    loop = asyncio.new_event_loop()
    fn = sdpa if use_sdpa else attention
    return measure(lambda: loop.run_until_complete(model.forward(token_ids, positions, fn, rows)), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a small model and shapes (CPU check)")
    parser.add_argument("--batches", type=int, nargs="+")
    parser.add_argument("--contexts", type=int, nargs="+")
    parser.add_argument("--prefill-lengths", type=int, nargs="+")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--memory-fraction", type=float, default=0.85, help="of free memory the KV pool may take")
    parser.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = TINY if args.tiny else LLAMA3_8B
    batches = args.batches or ([1, 2] if args.tiny else [1, 8, 32])
    contexts = args.contexts or ([64, 256] if args.tiny else [4096, 32768, 131072])
    lengths = args.prefill_lengths or ([128, 256] if args.tiny else [8192, 32768])
    max_position = max(contexts + lengths) + 1
    config = llama_config(shape, max_position)
    model = LlamaModel(config, random_weights(config, device, dtype), device=device, dtype=dtype,
                       max_position=max_position)
    measure = _timer(device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    weight_bytes = config.weight_bytes(itemsize)
    bandwidth = copy_bandwidth(device, (1 << 32) if device.type == "cuda" else (1 << 26), measure)
    kv_bytes_per_token = 2 * config.num_layers * config.kv_size * itemsize
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info()
        pool_blocks = int(free * args.memory_fraction) // (kv_bytes_per_token * args.block_size)
    else:
        pool_blocks = max(max(batches) * (max(contexts) + 1), max(lengths)) // args.block_size + 3
    pool = allocate_kv_pool(KVPoolShape(pool_blocks, config.num_layers, args.block_size, config.num_kv_heads,
                                        config.head_dim), dtype, device)
    pool.normal_()

    graphs = PiecewiseDecodeGraphs(model, tuple(batches)) if device.type == "cuda" else None
    # The pool's last block takes the padded rows' K/V of whole-step graphs.
    step_graphs = (LocalDecodeGraphs(model, pool, (pool_blocks - 1) * args.block_size, tuple(batches),
                                     -(-max_position // args.block_size)) if device.type == "cuda" else None)
    decode_rows = []
    for context in contexts:
        for batch in batches:
            if batch * (-(-(context + 1) // args.block_size)) > pool_blocks - 1:
                decode_rows.append({"batch": batch, "context": context, "skipped": "KV does not fit in memory"})
                continue
            eager_s, graph_s, whole_s = decode_step(model, pool, batch, context, args.block_size, measure, graphs,
                                                    step_graphs)
            seconds = whole_s if whole_s is not None else eager_s
            kv_read = batch * (context + 1) * kv_bytes_per_token
            decode_rows.append({"batch": batch, "context": context, "step_ms": seconds * 1e3,
                                "eager_step_ms": eager_s * 1e3, "cuda_graphs": graph_s is not None,
                                "piecewise_step_ms": graph_s * 1e3 if graph_s else None,
                                "piecewise_mbu": (weight_bytes + kv_read) / graph_s / bandwidth if graph_s else None,
                                "tokens_per_s": batch / seconds, "bytes_read": weight_bytes + kv_read,
                                "mbu": (weight_bytes + kv_read) / seconds / bandwidth,
                                "eager_mbu": (weight_bytes + kv_read) / eager_s / bandwidth})
    prefill_rows = []
    for length in lengths:
        engine_s = prefill(model, pool, length, args.block_size, measure, use_sdpa=False)
        sdpa_s = prefill(model, pool, length, args.block_size, measure, use_sdpa=True)
        prefill_rows.append({"length": length, "engine_tok_s": length / engine_s, "sdpa_tok_s": length / sdpa_s,
                             "ratio": sdpa_s / engine_s})

    gpu = torch.cuda.get_device_name(device).replace(" ", "-") if device.type == "cuda" else "cpu"
    result = {"gpu": gpu, "machine": platform.node(), "torch": torch.__version__, "dtype": str(dtype),
              "model": "tiny" if args.tiny else "llama-3-8b-shaped", "weight_bytes": weight_bytes,
              "copy_bandwidth_bytes_per_s": bandwidth, "block_size": args.block_size,
              "decode": decode_rows, "prefill": prefill_rows}
    out = Path(args.out_dir) / f"engine_gpu-{gpu}{'-tiny' if args.tiny else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s, weights {weight_bytes / 1e9:.2f} GB")
    print(f"{'batch':>5} {'context':>8} {'step ms':>9} {'MBU':>6} {'piecewise MBU':>13} {'eager ms':>9} {'eager MBU':>9}")
    for r in decode_rows:
        if "skipped" in r:
            print(f"{r['batch']:>5} {r['context']:>8} {'skipped: ' + r['skipped']}")
        else:
            piecewise = f"{r['piecewise_mbu']:.2f}" if r.get("piecewise_mbu") else "-"
            print(f"{r['batch']:>5} {r['context']:>8} {r['step_ms']:>9.2f} {r['mbu']:>6.2f} {piecewise:>13} "
                  f"{r['eager_step_ms']:>9.2f} {r['eager_mbu']:>9.2f}")
    print(f"{'prefill':>8} {'engine tok/s':>13} {'SDPA tok/s':>11} {'ratio':>6}")
    for r in prefill_rows:
        print(f"{r['length']:>8} {r['engine_tok_s']:>13.0f} {r['sdpa_tok_s']:>11.0f} {r['ratio']:>6.2f}")


if __name__ == "__main__":
    main()
