"""Time to first token of one long request through the daemons: APB prefill against exact.

Real `infinited` processes (a local cluster), one request on instance 1 through the local API:
a document of N random token ids and a query of 64 after it, answered with 4 greedy tokens.
``exact`` is the home's own chunked prefill (``--max-num-batched-tokens`` a step, the whole
KV in its pool); ``apb-h{H}`` cuts the document over H instances (the home and the peers with
the most free blocks), each computing its chunk where its KV then stays, with APB's defaults
(anchor a quarter of a chunk, passing blocks an eighth). Time to first token is measured at
the client, from the request to the first streamed line (which carries the first token); the
home's own figure for the APB part (reservations, the hosts' chunks, the adoption) comes with
it. Each case runs ``--repeats`` times after a warm-up at 8K tokens (Triton autotuning, CUDA
graphs); the best is kept.

The model is a Llama-shaped folder with random weights (``bench/random_model.py --shape
llama3-8b``): the work of every step is a real model's of that shape, the tokens mean nothing.
With ``--spread-gpus`` instance i runs on GPU i mod the GPU count; otherwise all share one GPU
(start CUDA MPS first and say ``--mps``): then APB saves only attention work, which at 128K is
most of a prefill's.

    python bench/random_model.py --shape llama3-8b --tokenizer .bench-assets/tokenizer --out /tmp/llama8b
    python bench/apb_serving.py --model /tmp/llama8b --tokens 32768,130944 --hosts 2,4 --mps

Writes ``bench/results/apb_serving-<gpu>[-x<gpus>].json``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import tempfile
import time
from pathlib import Path

import torch

from infinite_llm.daemon.local_cluster import LocalCluster, UnixHTTPConnection

BLOCK_SIZE = 16
QUERY_TOKENS = 64
NEW_TOKENS = 4
WARMUP_TOKENS = 8192


def timed_request(inst, prompt: list[int], query: list[int], prefill: dict, timeout_s: float = 580.0) -> dict:
    """Stream one request; its time to first token and to the end, the first line's prefill info."""
    body = json.dumps({"prompt": prompt, "prefill": dict(prefill, query=query),
                       "params": {"temperature": 0, "max_tokens": NEW_TOKENS, "ignore_eos": True}}).encode()
    conn = UnixHTTPConnection(str(inst.socket_path), timeout=timeout_s)
    started = time.perf_counter()
    conn.request("POST", "/v1/generate", body=body, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"generate failed ({response.status}): {response.read()[:500]!r}")
    first_at, first, tokens = None, None, 0
    for line in response:
        if not line.strip():
            continue
        step = json.loads(line)
        if first_at is None:
            first_at, first = time.perf_counter(), step
        tokens += len(step["token_ids"])
        if step.get("finish_reason") in ("error", "abort"):
            raise RuntimeError(f"the request failed: {step}")
    conn.close()
    return {"ttft_s": first_at - started, "total_s": time.perf_counter() - started, "tokens": tokens,
            "prefill": first.get("prefill")}


def write_report(rows: list[dict], args, config: dict, pools: list[int], devices: list[str], gpus: int) -> Path:
    """The report so far (after each length: a run cut short keeps what it measured)."""
    for row in rows:
        exact = next((r for r in rows if r["doc_tokens"] == row["doc_tokens"] and r["case"] == "exact"
                      and "ttft_s" in r), None)
        if exact is not None and "ttft_s" in row:
            row["ttft_vs_exact"] = row["ttft_s"] / exact["ttft_s"]
            row["speedup_vs_exact"] = exact["ttft_s"] / row["ttft_s"]
    gpu = torch.cuda.get_device_name(0) if gpus else "cpu"
    tag = gpu.replace(" ", "-") + (f"-x{gpus}" if args.spread_gpus and gpus > 1 else "")
    report = {"gpu": gpu, "gpus_used": len(set(devices)), "mps": args.mps, "model": config, "pools": pools,
              "devices": devices, "query_tokens": QUERY_TOKENS, "new_tokens": NEW_TOKENS,
              "max_num_batched_tokens": args.max_num_batched_tokens, "repeats": args.repeats,
              "torch": torch.__version__, "python": platform.python_version(), "rows": rows}
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / f"apb_serving-{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="Hugging Face folder (bench/random_model.py)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", default="32768,130944", help="document lengths, comma-separated")
    parser.add_argument("--hosts", default="2", help="APB host counts, comma-separated")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--spread-gpus", action="store_true", help="instance i on GPU i mod the GPU count")
    parser.add_argument("--mps", action="store_true", help="record that the processes share a GPU through MPS")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    lengths = [int(x) for x in args.tokens.split(",")]
    host_counts = [int(x) for x in args.hosts.split(",")]
    num_instances = max(host_counts)
    config = json.loads((Path(args.model) / "config.json").read_text())
    vocab = config["vocab_size"]
    longest = max(lengths)
    if longest + QUERY_TOKENS + NEW_TOKENS >= config["max_position_embeddings"]:
        raise SystemExit(f"--tokens {longest} leaves no room for the query and output in the model's context "
                         f"({config['max_position_embeddings']})")
    # The home holds a whole exact request; each peer the largest chunk it may get.
    context_blocks = math.ceil((longest + QUERY_TOKENS + NEW_TOKENS) / BLOCK_SIZE)
    chunk_blocks = math.ceil(longest / min(host_counts) / BLOCK_SIZE)
    pools = [context_blocks + 64] + [chunk_blocks + 64] * (num_instances - 1)
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    devices = ([f"cuda:{i % gpus}" for i in range(num_instances)] if args.spread_gpus
               else [args.device] * num_instances)
    rng = random.Random(0)
    query = [rng.randrange(vocab) for _ in range(QUERY_TOKENS)]
    cases = [("exact", {"mode": "exact"})] + [(f"apb-h{h}", {"mode": "apb", "hosts": h}) for h in host_counts]
    rows = []
    with tempfile.TemporaryDirectory(prefix="infllm-apb-") as root:
        cluster = LocalCluster(Path(root), num_instances, pools[0], device=args.device, devices=devices,
                               pool_blocks_per_instance=pools,
                               max_num_batched_tokens=args.max_num_batched_tokens,
                               extra_args=["--model", args.model, "--peer-request-s", "60",
                                           "--max-num-seqs", "8"])
        try:
            cluster.wait_ready(timeout_s=400)
            warm = [rng.randrange(vocab) for _ in range(min(WARMUP_TOKENS, min(lengths)))]
            for name, prefill in cases:
                timed_request(cluster[1], warm, query, prefill)
                time.sleep(2.5)  # peers publish their freed blocks again
            for length in lengths:
                prompt = [rng.randrange(vocab) for _ in range(length)]
                for name, prefill in cases:
                    runs = []
                    try:
                        for _ in range(args.repeats):
                            runs.append(timed_request(cluster[1], prompt, query, prefill))
                            time.sleep(2.5)
                            print(f"{length:>7} {name:>8} ttft {runs[-1]['ttft_s']:.3f} s "
                                  f"({(runs[-1]['prefill'] or {}).get('mode', 'exact')})", flush=True)
                    except RuntimeError as exc:
                        # One case that fails (a daemon's error reply) is reported, with the
                        # daemons' last log lines, and the others still run.
                        print(f"{length:>7} {name:>8} failed: {exc}", flush=True)
                        for inst in cluster.instances.values():
                            tail = inst.log_path.read_text(errors="replace").splitlines()[-40:]
                            print(f"--- instance {inst.inst_id} log:\n" + "\n".join(tail), flush=True)
                        rows.append({"doc_tokens": length, "case": name, "error": str(exc)[:2000]})
                        time.sleep(2.5)
                        continue
                    best = min(runs, key=lambda r: r["ttft_s"])
                    rows.append({"doc_tokens": length, "case": name, "ttft_s": best["ttft_s"],
                                 "ttft_runs_s": [r["ttft_s"] for r in runs], "prefill": best["prefill"]})
                write_report(rows, args, config, pools, devices, gpus)
        finally:
            cluster.stop()
    out = write_report(rows, args, config, pools, devices, gpus)
    print(f"{'tokens':>8} {'case':>8} {'ttft s':>8} {'vs exact':>9}")
    for row in rows:
        if "ttft_s" not in row:
            print(f"{row['doc_tokens']:>8} {row['case']:>8}   failed")
            continue
        print(f"{row['doc_tokens']:>8} {row['case']:>8} {row['ttft_s']:>8.3f} {row.get('ttft_vs_exact', 0):>9.3f}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
