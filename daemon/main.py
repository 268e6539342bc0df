"""``infinited``: run one instance. Flags override the TOML file (``--config``)."""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import logging
import os
import sys
from pathlib import Path

from .config import NCCL_LINK_MODES, ConfigError, InstanceConfig, check_device_present, load_config, read_gmanager_token
from .instance import DeviceFailed, InstanceDaemon, StartupError


_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, dict]:
    parser = argparse.ArgumentParser(prog="infinited", description="Run one Infinite-LLM instance.")
    parser.add_argument("--config", help="TOML file (see systemd/etc/infinited.toml.example)")
    parser.add_argument("--instance-id", type=int, dest="instance_id")
    parser.add_argument("--model", help="GGUF file or Hugging Face folder (default: the embedded SmolLM2)")
    parser.add_argument("--served-model-name", dest="served_model_name")
    parser.add_argument("--device")
    parser.add_argument("--dtype")
    parser.add_argument("--block-size", type=int, dest="block_size")
    parser.add_argument("--kv-pool-blocks", type=int, dest="kv_pool_blocks")
    parser.add_argument("--kv-pool-bytes", type=int, dest="kv_pool_bytes")
    parser.add_argument("--max-num-seqs", type=int, dest="max_num_seqs")
    parser.add_argument("--queue-bypass-limit", type=int, dest="queue_bypass_limit",
                        help="later requests that may start ahead of one that waits for memory (0: first come, first served)")
    parser.add_argument("--split-decode-interval", type=int, dest="split_decode_interval",
                        help="decoding requests with KV on peers run in one step of this many while others run (default 1)")
    parser.add_argument("--max-num-batched-tokens", type=int, dest="max_num_batched_tokens")
    parser.add_argument("--apb-min-chunk-tokens", type=int, dest="apb_min_chunk_tokens",
                        help="the shortest document chunk an APB prefill gives an instance (default 256)")
    parser.add_argument("--peer-host", dest="peer_host")
    parser.add_argument("--peer-port", type=int, dest="peer_port")
    parser.add_argument("--peer-spin-s", type=float, dest="peer_spin_s",
                        help="how long a wait on a peer spins before it sleeps, s (default 0.02 on a GPU, 0.0005 on the CPU)")
    parser.add_argument("--peer-header-ring-bytes", type=int, dest="peer_header_ring_bytes",
                        help="frame headers to instances on this host go through a ring of this many bytes "
                             "in shared memory (default 2 MiB; 0: over UCX)")
    parser.add_argument("--peer-device-pools", action=argparse.BooleanOptionalAction, dest="peer_device_pools",
                        help="on a GPU, KV moves to instances on this host go as block ids that the receiver copies "
                             "out of this instance's pool mapped through CUDA IPC (default); --no-peer-device-pools: "
                             "gathered and sent over UCX")
    parser.add_argument("--peer-pull-graphs", action=argparse.BooleanOptionalAction, dest="peer_pull_graphs",
                        help="blocks pulled out of a peer's mapped pool land through one replay of a captured CUDA "
                             "graph (default); --no-peer-pull-graphs: the copies launched one by one")
    parser.add_argument("--share-kv", action=argparse.BooleanOptionalAction, dest="share_kv",
                        help="spill KV to peers and lend them blocks (default); --no-share-kv: a static instance")
    parser.add_argument("--cpu-affinity", dest="cpu_affinity",
                        help='CPUs this instance runs on, e.g. "0-7,32-39" (default: those it was started with)')
    parser.add_argument("--creditor-cuda-graphs", action=argparse.BooleanOptionalAction, dest="creditor_cuda_graphs",
                        help="serve peers' decode rows from a CUDA graph per layer (default, on a GPU)")
    parser.add_argument("--remote-attention", choices=("auto", "mailboxes", "messages"), dest="remote_attention",
                        help="creditors of this host: one message a step and the layers through a mailbox "
                             "(mailboxes), or a message a layer (messages); auto: mailboxes on a GPU (default)")
    parser.add_argument("--nccl-links", choices=NCCL_LINK_MODES, dest="nccl_links",
                        help="with mailboxes on a GPU, creditors reached by an NCCL link: those of other hosts "
                             "(auto, default), every one (always), none (never)")
    parser.add_argument("--steps-ahead", type=int, dest="steps_ahead",
                        help="through a mailbox, steps a creditor keeps queued past the current one (0 or 1, default 1)")
    parser.add_argument("--http-host", dest="http_host")
    parser.add_argument("--http-port", type=int, dest="http_port")
    parser.add_argument("--socket-path", dest="socket_path")
    parser.add_argument("--admin-group", dest="admin_group")
    parser.add_argument("--gmanager-token-file", dest="gmanager_token_file",
                        help="the bearer token of the gManager's admin API over TCP (its --admin-token-file)")
    parser.add_argument("--state-dir", dest="state_dir")
    parser.add_argument("--etcd-endpoints", dest="etcd_endpoints", help="comma-separated host:port list")
    parser.add_argument("--etcd-prefix", dest="etcd_prefix", help="the cluster's keys in etcd (default /infinite-llm)")
    parser.add_argument("--etcd-lease-s", type=float, dest="timeouts.etcd_lease_s",
                        help="membership lease TTL, s: a killed instance leaves etcd after this")
    parser.add_argument("--etcd-request-s", type=float, dest="timeouts.etcd_request_s", help="one etcd request, s")
    parser.add_argument("--heartbeat-interval-s", type=float, dest="timeouts.heartbeat_interval_s")
    parser.add_argument("--reservation-s", type=float, dest="timeouts.reservation_s")
    parser.add_argument("--peer-request-s", type=float, dest="timeouts.peer_request_s",
                        help="one request to a peer, s (an APB prefill's hosts wait this long per layer)")
    parser.add_argument("--debtor-lost-s", type=float, dest="timeouts.debtor_lost_s")
    parser.add_argument("--held-audit-s", type=float, dest="timeouts.held_audit_s",
                        help="how often a creditor asks each home which held segments it still counts on, s")
    parser.add_argument("--drain-s", type=float, dest="timeouts.drain_s")
    parser.add_argument("--log-level", default=os.environ.get("INFLLM_LOG_LEVEL", "INFO"),
                        help=f"{', '.join(_LOG_LEVELS)} (default INFO, or $INFLLM_LOG_LEVEL)")
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if k not in ("config", "log_level")}
    return args, overrides


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    log_level = args.log_level.upper()
    if log_level not in _LOG_LEVELS:
        print(f"infinited: --log-level (or INFLLM_LOG_LEVEL) must be one of {', '.join(_LOG_LEVELS)}, "
              f"got {args.log_level!r}", file=sys.stderr)
        return 2
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(args.config, overrides)
        check_device_present(config.device)
        gmanager_token = read_gmanager_token(config)
    except ConfigError as exc:
        print(f"infinited: {exc}", file=sys.stderr)
        return 2
    if config.cpu_affinity:
        allowed = os.sched_getaffinity(0)
        if not set(config.cpu_affinity) <= allowed:
            print(f"infinited: cpu_affinity {list(config.cpu_affinity)} names CPUs outside those this process may "
                  f"use ({sorted(allowed)})", file=sys.stderr)
            return 2
        os.sched_setaffinity(0, config.cpu_affinity)  # threads started from here on inherit it
        # torch sized its CPU thread pool when it was imported, from all the CPUs then allowed.
        import torch

        torch.set_num_threads(len(set(config.cpu_affinity)))
    try:
        import uvloop
    except ImportError:  # uvloop is an optimisation; asyncio's loop serves too
        uvloop = None
    daemon = InstanceDaemon(config, gmanager_token=gmanager_token)
    # INFLLM_PROFILE_DIR: profile the daemon's thread (cProfile) and write
    # <dir>/infinited-<instance>.prof at a clean stop, to see where a step's time goes in place.
    profile_dir = os.environ.get("INFLLM_PROFILE_DIR")
    profiler = cProfile.Profile() if profile_dir else None
    try:
        if profiler is not None:
            profiler.enable()
        if uvloop is not None:
            uvloop.run(daemon.run())
        else:
            asyncio.run(daemon.run())
    except (OSError, ValueError) as exc:  # a missing file, etcd unreachable, a port or socket in use
        print(f"infinited: {one_line(exc)}", file=sys.stderr)
        return 1
    except DeviceFailed as exc:  # logged where it happened; systemd's Restart=on-failure starts afresh
        print(f"infinited: the device failed: {one_line(exc)}", file=sys.stderr)
        return 1
    except StartupError as exc:  # a stage of start-up (registration) did not complete
        print(f"infinited: {one_line(exc)}", file=sys.stderr)
        return 1
    except (RuntimeError, MemoryError) as exc:
        # The engine is built with the pool the configuration asked for; torch raises a
        # RuntimeError when the host or the GPU lacks the memory. Anything else is a fault.
        if daemon.engine is not None or not is_out_of_memory(exc):
            raise
        print(f"infinited: out of memory building the engine on {config.device} with a KV pool of "
              f"{pool_size_asked(config)}: {one_line(exc)}; give a smaller kv_pool_blocks or kv_pool_bytes",
              file=sys.stderr)
        return 1
    finally:
        if profiler is not None:
            profiler.disable()
            Path(profile_dir).mkdir(parents=True, exist_ok=True)
            profiler.dump_stats(str(Path(profile_dir) / f"infinited-{config.instance_id}.prof"))
    return 0


def one_line(exc: BaseException) -> str:
    """An error's message for a one-line report: its first line, or its type when it has no
    text (a bare TimeoutError), so that no report ends at ``infinited: ``."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether an error is an allocation that did not fit: torch's CUDA one has its own type,
    its CPU allocator raises a plain RuntimeError."""
    import torch

    return (isinstance(exc, (MemoryError, torch.OutOfMemoryError))
            or "can't allocate memory" in str(exc))


def pool_size_asked(config: InstanceConfig) -> str:
    """The KV pool size as the configuration gave it, for a message."""
    if config.kv_pool_blocks is not None:
        return f"{config.kv_pool_blocks} blocks (kv_pool_blocks)"
    if config.kv_pool_bytes is not None:
        return f"{config.kv_pool_bytes} bytes (kv_pool_bytes)"
    return "the default size (no kv_pool_blocks or kv_pool_bytes given)"


if __name__ == "__main__":
    sys.exit(main())
