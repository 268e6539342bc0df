"""The main job: a local cluster answers a long passkey prompt whose KV spans every instance.

1. start a gManager and three `infinited` on this machine (the GPU when there is one), with KV
   pools too small for the prompt on any one of them;
2. send a passkey-retrieval prompt of several thousand tokens and stream the answer;
3. show where the request's KV lives while it decodes (`infctl status --instance 1`);
4. drain instance 3 while a second, smaller request decodes with part of its KV there: it admits
   nothing new, the gManager moves that KV to another instance, and it reports safe to stop;
5. stop the cluster, and exit 0 only if the answer holds the passkey.

    python -m infinite_llm.cli.demo            # several thousand tokens
    python -m infinite_llm.cli.demo --short    # the same steps on a shorter prompt (CI)
"""

from __future__ import annotations

import argparse
import importlib.resources
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from .client import ClusterClient

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
# Shipped with the package (bench/results, package data): the demo's gManager plans with it.
PERF_MODEL = Path(str(importlib.resources.files("infinite_llm.bench") / "results" / "perf_model-cpu.json"))


def passkey_messages(num_fillers: int, passkey: str, depth: float = 0.9) -> list[dict[str, str]]:
    """A chat asking for a passkey hidden at ``depth`` of ``num_fillers`` filler sentences."""
    before = int(num_fillers * depth)
    body = (FILLER * before + f"The pass key is {passkey}. Remember it. {passkey} is the pass key. "
            + FILLER * (num_fillers - before))
    return [{"role": "user", "content": "There is important info hidden inside a lot of irrelevant text. "
                                        f"Find it and memorize it.\n{body}\nWhat is the pass key?"}]


def section(title: str) -> None:
    print(f"\n== {title}", flush=True)


def show_placement(client: ClusterClient, inst_id: int) -> set[int]:
    status = client.instance_status(inst_id)
    holders: set[int] = set()
    for request in status["requests"]:
        for s in request["segments"]:
            holders.add(s["instance_id"])
            print(f"   request {request['request_id']}: tokens {s['token_start']:>5}-{s['token_start'] + s['num_tokens']:<5} "
                  f"on instance {s['instance_id']} ({len(s['block_ids'])} blocks)")
    return holders


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", action="store_true", help="a shorter prompt and smaller pools (CI)")
    parser.add_argument("--state-dir", type=Path, default=None, help="default: a temporary folder")
    args = parser.parse_args(argv)
    num_fillers, pool_blocks = (40, 32) if args.short else (150, 96)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    passkey = str(random.Random(7).randrange(10000, 99999))
    with tempfile.TemporaryDirectory(prefix="infllm-demo-") as tmp:
        client = ClusterClient(args.state_dir or Path(tmp))
        section(f"starting a gManager and 3 instances on the {device}, {pool_blocks} KV blocks "
                f"({pool_blocks * 16} tokens) each")
        if not PERF_MODEL.is_file():
            raise SystemExit(f"demo: the CPU perf model the gManager plans with is missing ({PERF_MODEL}): "
                             "reinstall the package")
        client.up(3, pool_blocks, None, device, PERF_MODEL, max_num_batched_tokens=128)
        try:
            messages = passkey_messages(num_fillers, passkey)
            section("asking instance 1 for the passkey hidden in a long prompt")
            answer, holders, shown = [], set(), False
            for step in client.generate(messages, 1, max_tokens=24):
                if not shown:
                    print(f"   prompt of {step['prompt_tokens']} tokens prefilled; the request's KV now lives here:")
                    holders = show_placement(client, 1)
                    shown = True
                    print("   answer: ", end="", flush=True)
                answer.append(step["text"])
                print(step["text"], end="", flush=True)
            print()
            text = "".join(answer)

            section("draining instance 3 while a second request decodes on instance 1")
            time.sleep(2.5)  # the instances republish the blocks the first request gave back
            # Smaller than the first, so that it fits without instance 3 once that one is drained.
            second: list[str] = []
            decoding = threading.Event()

            def second_request() -> None:
                for step in client.generate(passkey_messages(num_fillers * 3 // 5, passkey), 1, max_tokens=48,
                                            ignore_eos=True):
                    second.append(step["text"])
                    decoding.set()

            runner = threading.Thread(target=second_request)
            runner.start()
            decoding.wait(timeout=600)
            print("   the second request decodes; its KV lives here:")
            show_placement(client, 1)
            started = time.monotonic()
            report = client.drain(3, timeout_s=600)
            print(f"   instance 3 is safe to stop after {time.monotonic() - started:.1f} s: "
                  f"{report['running_requests']} requests, {report['blocks_held_for_others']} blocks held for others")
            runner.join(timeout=600)
            print(f"   the second request finished with {len(second)} steps")
        finally:
            section("stopping the cluster")
            print(f"   stopped {client.down()} daemons")
    ok = passkey in text and len(holders) == 3
    section(f"passkey {passkey}: {'found' if passkey in text else 'NOT found'} in the answer; "
            f"the request's KV spanned {len(holders)} instance(s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
