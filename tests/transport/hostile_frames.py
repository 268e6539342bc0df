"""Hostile frames for a live UCX listener: frames its decoder must refuse, each sent raw on a
connection of its own, and the listener's answer read back.

Shared by the transport's live-listener fuzz (test_ucx_loopback.py) and the daemon's flood
(tests/daemon/test_hostile_peers.py), which runs this file as a process of its own, so that the
pytest process never makes a UCX context (one per process, bound to the event loop that first
used it: the transport tests' loop)::

    hostile_frames.py flood COUNT [CONCURRENCY] [SEED]

generates COUNT frames the listener must refuse (from the codec fuzz's strategies), prints
"GENERATED <COUNT>", reads "HOST PORT" of the listener from stdin (so that the frames can be
made while the listener starts), sends them CONCURRENCY at a time and prints one JSON line: how
many were answered with an ErrorReply (by code), how many got no answer, and what else came
back.
"""

from __future__ import annotations

import asyncio
import collections
import json
import sys
import time

import numpy as np

from infinite_llm.transport import codec
from infinite_llm.transport import messages as m
from infinite_llm.transport.interface import PeerAddress

REPLY_BUFFER_BYTES = 1 << 16
ANSWER_TIMEOUT_S = 5.0
SPIN_S = 500e-6  # as an instance on the CPU spins (CPU_PEER_SPIN_S)


def peer_refuses(data: bytes) -> bool:
    """Whether the listener must refuse ``data``: it sees the announced length, zero-padded."""
    limits = codec.FrameLimits()
    if len(data) >= codec.PREAMBLE.size:
        announced = codec.frame_length(data[:codec.PREAMBLE.size])
        if announced > limits.max_header_bytes:
            return True
        data = data[:announced] + bytes(max(0, announced - len(data)))
    else:
        data = data + bytes(codec.PREAMBLE.size - len(data))
    try:
        codec.decode_header(data, limits)
    except Exception:  # noqa: BLE001  (any refusal counts here)
        return True
    return False


async def send_raw_and_read_refusal(address: PeerAddress, data: bytes,
                                    timeout_s: float = ANSWER_TIMEOUT_S) -> m.Message:
    """Connect, send ``data`` as one UCX message, and return the message of the first answer.

    Its sends and receives wait as the transport's do (``UcxProgress``: spin briefly, then sleep
    on the worker's fd), not through ucxx's ``await request.wait()``, a loop of
    ``asyncio.sleep(0)``: dozens of those in flight kept a sender on a core while it waited,
    taking CPU from the daemon it floods on a 2-core host."""
    import ucxx  # here, not at import: the caller has checked that it is there
    from ucxx._lib.arr import Array
    from ucxx.types import Tag, TagMaskFull

    from infinite_llm.transport.ucx import _progress_for_loop

    progress = _progress_for_loop(SPIN_S)
    endpoint = await ucxx.create_endpoint(address.host, address.port)
    try:
        deadline = time.monotonic() + timeout_s
        payload = np.frombuffer(data, dtype=np.uint8) if data else np.zeros(0, np.uint8)
        reply_buffer = np.zeros(REPLY_BUFFER_BYTES, dtype=np.uint8)
        sent = endpoint._ep.tag_send(Array(payload), Tag(endpoint._tags["msg_send"]))
        received = endpoint._ep.tag_recv(Array(reply_buffer), Tag(endpoint._tags["msg_recv"]), TagMaskFull)
        # Only the answer is awaited: it proves the frame arrived, and the listener's close
        # right after it may end the send's request as cancelled before this side has seen
        # it complete.
        await progress.wait(received, deadline)
        del sent  # ended by the abort below if it has not ended yet
        header = codec.decode_header(
            reply_buffer[:codec.frame_length(reply_buffer[:codec.PREAMBLE.size])].tobytes(),
            codec.FrameLimits())
        # It answers the refused frame where the listener could read its id, else nothing.
        assert header.reply_to is None or type(header.reply_to) is int
        return header.message
    finally:
        endpoint.abort()


def generate(count: int, seed: int = 0, per_example: int = 50) -> list[bytes]:
    """``count`` frames the listener must refuse, drawn from the codec fuzz's strategies (as
    the live fuzz draws them, but ``per_example`` distinct ones to a Hypothesis example: one
    frame an example costs about 5 ms here, which 10,000 frames cannot afford)."""
    from hypothesis import HealthCheck, given, seed as hypothesis_seed, settings
    from hypothesis import strategies as st

    from test_codec_fuzz import STRATEGIES

    frames: list[bytes] = []
    batches = st.lists(st.one_of(*STRATEGIES.values()), min_size=per_example, max_size=per_example, unique=True)

    def draw_from(run_seed: int) -> None:
        @hypothesis_seed(run_seed)
        @settings(max_examples=(count - len(frames)) * 10 // (9 * per_example) + 1, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(batches)
        def draw(batch: list[bytes]) -> None:
            frames.extend(data for data in batch if len(frames) < count and peer_refuses(data))
        draw()

    for run in range(10):  # one run gives ``count`` unless Hypothesis stops early
        if len(frames) >= count:
            break
        draw_from(seed + run)
    if len(frames) < count:
        raise RuntimeError(f"the strategies gave only {len(frames)} of {count} frames the listener must refuse")
    return frames[:count]


async def flood(address: PeerAddress, frames: list[bytes], concurrency: int) -> dict:
    """Send every frame on a connection of its own, ``concurrency`` at a time; sort the answers."""
    codes: collections.Counter[str] = collections.Counter()
    unanswered: collections.Counter[str] = collections.Counter()
    other: list[str] = []
    queue = iter(enumerate(frames))

    async def sender() -> None:
        for i, data in queue:
            try:
                reply = await send_raw_and_read_refusal(address, data)
            except (TimeoutError, ConnectionError, OSError) as exc:
                unanswered[type(exc).__name__] += 1
                continue
            except Exception as exc:  # noqa: BLE001  ucxx's errors, or an answer that does not decode
                if type(exc).__module__.startswith("ucxx"):
                    unanswered[type(exc).__name__] += 1
                else:
                    other.append(f"frame {i} {data[:64]!r}: {type(exc).__name__}: {exc}")
                continue
            if isinstance(reply, m.ErrorReply):
                codes[str(reply.code)] += 1
            else:
                other.append(f"frame {i} {data[:64]!r}: answered {reply!r}")

    started = time.monotonic()
    await asyncio.gather(*(sender() for _ in range(concurrency)))
    return {"sent": len(frames), "error_replies": sum(codes.values()), "codes": dict(codes),
            "unanswered": dict(unanswered), "other": other[:20], "num_other": len(other),
            "send_s": round(time.monotonic() - started, 3)}


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[0] != "flood":
        raise SystemExit(__doc__)
    count = int(argv[1])
    concurrency = int(argv[2]) if len(argv) > 2 else 32
    seed = int(argv[3]) if len(argv) > 3 else 0
    started = time.monotonic()
    frames = generate(count, seed)
    generate_s = time.monotonic() - started
    print(f"GENERATED {len(frames)}", flush=True)
    host, port = sys.stdin.readline().split()  # the listener, once the caller has one
    cpu_before = time.process_time()
    result = asyncio.new_event_loop().run_until_complete(flood(PeerAddress(host, int(port)), frames, concurrency))
    result.update(generate_s=round(generate_s, 3), send_cpu_s=round(time.process_time() - cpu_before, 3),
                  distinct=len(set(frames)))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
