"""`infctl`: status, drain, rebalance and a local cluster, as a thin shell over `client.py`.

Exit codes: 0 done, 1 failed, 2 usage, 3 no leader or a daemon unreachable, 4 timed out.
Errors are one line on stderr; ``INFCTL_DEBUG=1`` shows the traceback.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import typer

from .client import GENERATE_TIMEOUT_S, ClusterClient, ClusterError, Unreachable

DEFAULT_STATE_DIR = os.environ.get("INFLLM_STATE_DIR", "/var/lib/infinite-llm")

app = typer.Typer(help="Operate an Infinite-LLM cluster.", no_args_is_help=True, add_completion=True)
StateDir = typer.Option(DEFAULT_STATE_DIR, "--state-dir", envvar="INFLLM_STATE_DIR",
                        help="the cluster's state folder (shared by its daemons)")
Etcd = typer.Option("", "--etcd", envvar="INFCTL_ETCD", show_default=False,
                    help="comma-separated etcd host:port list: find the cluster there, not in the state folder")
EtcdPrefix = typer.Option("/infinite-llm", "--etcd-prefix", envvar="INFCTL_ETCD_PREFIX",
                          help="the cluster's keys in etcd")
AsJson = typer.Option(False, "--json", help="print JSON for scripts")


def _client(state_dir: Path, etcd: str = "", etcd_prefix: str = "/infinite-llm") -> ClusterClient:
    return ClusterClient(state_dir, etcd_endpoints=etcd, etcd_prefix=etcd_prefix)


def _run(action: Callable[[], Any]) -> Any:
    try:
        return action()
    except ClusterError as exc:
        if os.environ.get("INFCTL_DEBUG") == "1":
            traceback.print_exc()
        typer.echo(f"infctl: {exc}", err=True)
        raise typer.Exit(exc.exit_code) from None
    except Exception as exc:  # noqa: BLE001  one line, unless debugging
        if os.environ.get("INFCTL_DEBUG") == "1":
            traceback.print_exc()
        typer.echo(f"infctl: {type(exc).__name__}: {exc}", err=True)
        raise typer.Exit(1) from None


def _print_json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2, sort_keys=True))


@app.command()
def status(state_dir: Path = StateDir, instance: Optional[int] = typer.Option(None, "--instance", help="one instance, with per-request placement"),
           etcd: str = Etcd, etcd_prefix: str = EtcdPrefix, as_json: bool = AsJson) -> None:
    """The cluster (leader, epoch, instances), or one instance's requests and where their KV lives."""
    if instance is not None:
        data = _run(lambda: _client(state_dir, etcd, etcd_prefix).instance_status(instance))
        if as_json:
            return _print_json(data)
        pool = data["pool"]
        typer.echo(f"instance {data['instance_id']}  model {data['model']}  draining {data['draining']}  "
                   f"epoch {data['epoch']}")
        typer.echo(f"pool: {pool['num_blocks_free']}/{pool['num_blocks_total']} blocks free, "
                   f"{pool['num_blocks_held_for_others']} held for others ({pool['block_size']} tokens each)")
        for request in data["requests"]:
            where = ", ".join(f"{s['token_start']}-{s['token_start'] + s['num_tokens']} on {s['instance_id']}"
                              for s in request["segments"])
            typer.echo(f"  request {request['request_id']} ({request['state']}, {request['num_tokens']} tokens): {where}")
        for held in data["held_segments"]:
            typer.echo(f"  holds {held['num_blocks']} blocks of request {held['request_id']} "
                       f"of instance {held['home_instance_id']}")
        return None
    data = _run(lambda: _client(state_dir, etcd, etcd_prefix).status())
    unreachable, failed = data["instances_unreachable"], data["instances_failed"]
    if as_json:
        _print_json(data)
    else:
        if data.get("leader") is None:
            typer.echo(f"leader: none ({data.get('error', 'not found')})")
        elif data.get("leader") is False:
            typer.echo(f"leader: none (the gManager recorded as the leader, pid {data.get('pid')}, is a standby)")
        else:
            typer.echo(f"leader: epoch {data.get('epoch')}")
        typer.echo(f"{'instance':>8} {'free/total':>12} {'held':>6} {'requests':>9} {'draining':>9}")
        for inst_id in sorted({*data["instances_detail"], *unreachable, *failed}):
            if inst_id in unreachable:
                typer.echo(f"{inst_id:>8} does not answer")
                continue
            if inst_id in failed:
                typer.echo(f"{inst_id:>8} answered with an error")
                continue
            detail = data["instances_detail"][inst_id]
            pool = detail["pool"]
            typer.echo(f"{inst_id:>8} {pool['num_blocks_free']:>5}/{pool['num_blocks_total']:<6} "
                       f"{pool['num_blocks_held_for_others']:>6} {len(detail['requests']):>9} {str(detail['draining']):>9}")
    # After the table: the instances that answered are shown, the others make the exit code.
    for inst_id in sorted({**failed, **unreachable}):
        typer.echo(f"infctl: {unreachable.get(inst_id) or failed[inst_id]}", err=True)
    if unreachable:
        raise typer.Exit(Unreachable.exit_code)
    if failed:
        raise typer.Exit(ClusterError.exit_code)
    return None


@app.command()
def drain(inst_id: int = typer.Argument(..., metavar="INSTANCE"), state_dir: Path = StateDir,
          timeout: float = typer.Option(600.0, "--timeout", help="seconds to wait until it is safe to stop"),
          dry_run: bool = typer.Option(False, "--dry-run", help="print the moves a drain would make; change nothing"),
          etcd: str = Etcd, etcd_prefix: str = EtcdPrefix, as_json: bool = AsJson) -> None:
    """Cordon an instance, move its KV off through the gManager, and wait until it is safe to stop."""
    report = _run(lambda: _client(state_dir, etcd, etcd_prefix).drain(inst_id, timeout, dry_run))
    if as_json:
        return _print_json(report)
    moves = report.get("moves", [])
    for move in moves:
        result = "" if dry_run else f"  [{move['result']}]"
        typer.echo(f"request {move['req_id']} of instance {move['home_inst_id']}: {move['num_blocks']} blocks "
                   f"{move['src_inst_id']} -> {move['dst_inst_id']}{result}")
    if dry_run:
        if "running_requests" in report:  # no leader: the instance's own figures, nothing would move
            typer.echo(f"instance {inst_id}: {report['running_requests']} request(s) to finish, "
                       f"{report['blocks_held_for_others']} block(s) held for others; no gManager leader, "
                       f"nothing would be moved")
        else:
            typer.echo(f"instance {inst_id}: {len(moves)} move(s) planned, {report['num_blocks_held']} block(s) "
                       f"held for others and {report['num_blocks_own_movable']} of its own requests' blocks, "
                       f"{report['num_blocks_free_elsewhere']} free elsewhere")
    else:
        # The report lists its last round's moves; every round's are counted by kind and result.
        counts = [f"{kind} {result} {n}" for kind, results in sorted(report.get("move_results", {}).items())
                  for result, n in sorted(results.items())]
        if counts:
            typer.echo(f"moves over the drain: {', '.join(counts)}")
        typer.echo(f"instance {inst_id} is drained: safe to stop")
    return None


@app.command()
def uncordon(inst_id: int = typer.Argument(..., metavar="INSTANCE"), state_dir: Path = StateDir,
             etcd: str = Etcd, etcd_prefix: str = EtcdPrefix) -> None:
    """Let a drained instance admit requests again."""
    _run(lambda: _client(state_dir, etcd, etcd_prefix).uncordon(inst_id))
    typer.echo(f"instance {inst_id} admits requests")


@app.command()
def rebalance(state_dir: Path = StateDir, dry_run: bool = typer.Option(False, "--dry-run", help="plan only"),
              etcd: str = Etcd, etcd_prefix: str = EtcdPrefix, as_json: bool = AsJson) -> None:
    """Run a placement round now; with --dry-run print each planned move and its predicted gain."""
    report = _run(lambda: _client(state_dir, etcd, etcd_prefix).rebalance(dry_run))
    if as_json:
        return _print_json(report)
    moves = report.get("moves", [])
    if not moves:
        typer.echo("no move gains throughput")
    for move in moves:
        result = "" if report.get("dry_run") else f"  [{move['result']}]"
        typer.echo(f"request {move['req_id']} of instance {move['home_inst_id']}: {move['num_blocks']} blocks "
                   f"{move['src_inst_id']} -> {move['dst_inst_id']}, predicted gain "
                   f"{move['predicted_gain_tokens_per_s']:.4g} tokens/s{result}")
    return None


@app.command()
def up(state_dir: Path = StateDir, instances: int = typer.Option(3, "--instances", min=1),
       pool_blocks: int = typer.Option(2048, "--pool-blocks", min=1, help="KV blocks per instance"),
       model: Optional[str] = typer.Option(None, "--model", help="GGUF file or Hugging Face folder"),
       device: str = typer.Option("cpu", "--device"),
       perf_model: Optional[Path] = typer.Option(None, "--perf-model", help="run a gManager with this model")) -> None:
    """Start a local cluster in the background: N instances (and a gManager with --perf-model)."""
    _run(lambda: ClusterClient(state_dir).up(instances, pool_blocks, model, device, perf_model, log=typer.echo))
    typer.echo(f"cluster up in {state_dir}")


@app.command()
def down(state_dir: Path = StateDir) -> None:
    """Stop every daemon of the local cluster."""
    count = _run(lambda: ClusterClient(state_dir).down(log=lambda line: typer.echo(f"infctl: {line}", err=True)))
    typer.echo(f"stopped {count} daemon(s)")


@app.command()
def generate(prompt: str, state_dir: Path = StateDir, instance: Optional[int] = typer.Option(None, "--instance"),
             max_tokens: int = typer.Option(64, "--max-tokens", min=1),
             temperature: float = typer.Option(0.0, "--temperature", min=0.0),
             ignore_eos: bool = typer.Option(False, "--ignore-eos", help="go on past end-of-sequence (benchmarks)"),
             timeout: float = typer.Option(GENERATE_TIMEOUT_S, "--timeout",
                                           help="seconds to wait for the first token (a queued request waits "
                                                "for room) and for each next one"),
             prefill: str = typer.Option("exact", "--prefill",
                                         help="exact, or apb: the document (PROMPT) prefilled over several "
                                              "instances at once (docs/apb.md)"),
             query: Optional[str] = typer.Option(None, "--query", help="the question after the document"),
             apb_hosts: Optional[int] = typer.Option(None, "--apb-hosts", min=1,
                                                     help="instances to prefill over (default: every live one)"),
             etcd: str = Etcd, etcd_prefix: str = EtcdPrefix) -> None:
    """Stream a completion of PROMPT from the cluster (PROMPT then --query, if given)."""
    if prefill not in ("exact", "apb"):
        typer.echo(f"infctl: --prefill must be exact or apb, got {prefill!r}", err=True)
        raise typer.Exit(2)
    options: dict[str, object] = {"mode": prefill}
    if query is not None:
        options["query"] = query
    if apb_hosts is not None:
        options["hosts"] = apb_hosts

    def stream() -> None:
        client = _client(state_dir, etcd, etcd_prefix)
        wrote = False
        try:
            for step in client.generate(prompt, instance, timeout_s=timeout, max_tokens=max_tokens,
                                        temperature=temperature, ignore_eos=ignore_eos,
                                        prefill=options if (prefill != "exact" or query is not None) else None):
                if step.get("prefill"):
                    typer.echo(f"infctl: prefill: {_describe_prefill(step['prefill'])}", err=True)
                sys.stdout.write(step["text"])
                sys.stdout.flush()
                wrote = True
        finally:
            if wrote:  # the text so far stays on its own line, apart from an error
                sys.stdout.write("\n")
                sys.stdout.flush()

    _run(stream)


def _describe_prefill(info: dict) -> str:
    if info.get("mode") == "apb":
        hosts = ", ".join(f"instance {h['instance']} tokens {h['tokens'][0]}-{h['tokens'][1]}" for h in info["hosts"])
        return (f"apb over {len(info['hosts'])} instances ({hosts}), anchor {info['anchor_tokens']}, passing "
                f"{info['passing_tokens']}, {info['passing_bytes']} bytes passed, {info['seconds']:.3f} s")
    return f"{info.get('mode')} ({info.get('note')})"


def main() -> None:
    app()


if __name__ == "__main__":
    main()
