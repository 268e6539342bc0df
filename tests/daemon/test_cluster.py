"""Three real `infinited` processes on loopback UCX, with pools too small for one long prompt."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from infinite_llm.engine.config import EngineConfig
from infinite_llm.engine.engine import LLMEngine
from infinite_llm.engine.loader import embedded_model_path, load_checkpoint
from infinite_llm.engine.sampling import SamplingParams

from infinite_llm.daemon.local_cluster import LocalCluster, passkey_prompt

POOL_BLOCKS = 36  # 576 tokens per instance; the long prompt needs about 75 blocks: more than a home
# and one peer can keep for it, so it spills over all three
LONG_PROMPT = passkey_prompt(75)
MODEL = "SmolLM2-135M-Instruct.Q4_1"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("cluster")
    # Creditors audit what they hold for the home every half second: while the long request
    # spills, moves and attends, no audit may free a segment the home still counts on.
    cluster = LocalCluster(root, num_instances=3, pool_blocks=POOL_BLOCKS, extra_args=["--held-audit-s", "0.5"])
    try:
        cluster.wait_ready()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def reference_engine():
    """One instance with room for everything, in this process."""
    torch.set_num_threads(1)
    config = EngineConfig(block_size=16, pool_blocks=(512,), max_num_batched_tokens=128)
    return LLMEngine(load_checkpoint(None, show_progress=False), config)


def reference_tokens(engine: LLMEngine, prompt: str, max_tokens: int) -> list[int]:
    (output,) = engine.generate([prompt], SamplingParams(max_tokens=max_tokens))
    return list(output.token_ids)


def test_long_prompt_spills_over_all_three_and_matches_one_instance(cluster, reference_engine):
    home = cluster[1]
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(out=home.generate(LONG_PROMPT, max_tokens=24)))
    thread.start()
    seen_on: set[int] = set()
    deadline = time.monotonic() + 240
    while thread.is_alive() and time.monotonic() < deadline:
        status = home.status()
        for request in status["requests"]:
            seen_on |= {s["instance_id"] for s in request["segments"]}
        if seen_on >= {1, 2, 3}:
            held = {inst.inst_id: inst.status()["held_segments"] for inst in cluster if inst.inst_id != 1}
            break
        time.sleep(0.05)
    thread.join(timeout=300)
    assert not thread.is_alive()
    assert seen_on >= {1, 2, 3}, f"the request's segments were seen only on {seen_on}"
    # The creditors hold the segments the home's table names, for the home's request.
    assert all(held[i] and all(s["home_instance_id"] == 1 for s in held[i]) for i in (2, 3))

    tokens, text = result["out"]
    assert tokens == reference_tokens(reference_engine, LONG_PROMPT, 24)
    assert "green" in text  # box 42 is green

    # The creditors served the home's layers and say so in their metrics.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(
            cluster[i].metrics().get('infllm_attend_plans_total{kind="new"}', 0) for i in (2, 3)):
        time.sleep(0.2)
    for i in (2, 3):
        metrics = cluster[i].metrics()
        assert metrics['infllm_attend_plans_total{kind="new"}'] >= 1
        assert metrics["infllm_attend_serve_seconds_count"] >= 30  # one request a layer, at least
        assert metrics["infllm_kv_blocks_lent"] >= 0
    assert cluster[1].metrics()["infllm_remote_attention_seconds_count"] >= 30
    # The creditors audited the home's segments while the request ran, and freed none of them.
    audits = sum(cluster[i].metrics()['infllm_held_audits_total{result="answered"}'] for i in (2, 3))
    assert audits >= 1
    assert all(inst.metrics()["infllm_held_blocks_reclaimed_total"] == 0 for inst in cluster)
    # The home's spilled blocks went to its peers on this host through its shared memory.
    shared = home.status()["peer_shared_memory"]
    assert shared["region"] and len(shared["peers"]) == 2 and shared["committed_bytes"] > 0, shared
    home_metrics = cluster[1].metrics()
    assert home_metrics["infllm_peer_shared_memory_peers"] == 2
    assert home_metrics['infllm_peer_shared_memory_bytes{state="committed"}'] == shared["committed_bytes"]
    # Its frame headers to them, and theirs back, went through header rings.
    assert len(shared["header_ring_peers"]) == 2, shared
    assert home_metrics['infllm_peer_header_rings{direction="outbound"}'] == 2
    for i in (2, 3):
        assert cluster[i].metrics()['infllm_peer_header_rings{direction="inbound"}'] >= 1

    # Finished: every creditor has freed what it held.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(inst.status()["pool"]["num_blocks_held_for_others"] for inst in cluster):
        time.sleep(0.1)
    for inst in cluster:
        status = inst.status()
        assert status["pool"]["num_blocks_held_for_others"] == 0
        assert status["pool"]["num_blocks_free"] == POOL_BLOCKS


def test_matches_hugging_face(cluster, reference_engine):
    transformers = pytest.importorskip("transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    prompt_ids = reference_engine.tokenizer.encode(LONG_PROMPT)
    # The cluster serves the prompt while this process loads the GGUF into transformers (about
    # 17 s on two cores) and runs it.
    served: dict = {}
    thread = threading.Thread(target=lambda: served.update(out=cluster[2].generate(prompt_ids, max_tokens=8,
                                                                                   ignore_eos=True)))
    thread.start()
    path = embedded_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32)
    with torch.no_grad():
        hf = model.generate(torch.tensor([prompt_ids]), max_new_tokens=8, do_sample=False)[0, len(prompt_ids):]
    thread.join(timeout=300)
    assert not thread.is_alive()
    tokens, _ = served["out"]
    assert tokens == hf.tolist()


def test_openai_client_chat_streaming_and_not(cluster):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=cluster[3].url + "/v1", api_key="unused", timeout=120)
    assert [m.id for m in client.models.list().data] == [MODEL]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert reply.choices[0].message.role == "assistant"
    assert "Paris" in reply.choices[0].message.content
    assert reply.usage.completion_tokens <= 12
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == reply.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=-1)


def test_bad_input_gets_clear_errors_and_harms_no_one(cluster):
    inst = cluster[1]
    code, body = inst.post("/v1/completions", b"{not json")
    assert code == 400 and "not valid JSON" in body["error"]["message"]
    code, body = inst.post("/v1/completions", {"model": MODEL, "prompt": "x", "colour": "red"})
    assert code == 400 and body["error"]["param"] == "colour"
    code, body = inst.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -3})
    assert code == 400 and "max_tokens" in body["error"]["message"]
    code, body = inst.post("/v1/completions", {"model": MODEL, "prompt": passkey_prompt(200), "max_tokens": 4})
    assert code == 400 and "KV blocks" in body["error"]["message"]
    # More output asked for than the context leaves is refused, as vLLM does (not cut short).
    code, body = inst.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1_000_000})
    assert code == 400 and "maximum context length is 8192 tokens" in body["error"]["message"], body
    code, body = inst.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                    "max_completion_tokens": 8192})
    assert code == 400 and "max_tokens is too large: 8192" in body["error"]["message"], body
    # A prompt longer than the context alone is named as such, not blamed on max_tokens.
    code, body = inst.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x" * 50_000}],
                                                    "max_tokens": 2})
    assert code == 400 and "the prompt is too long" in body["error"]["message"], body
    # The cluster still serves.
    code, body = inst.post("/v1/completions", {"model": MODEL, "prompt": "The sky is", "max_tokens": 3, "temperature": 0})
    assert code == 200 and body["usage"]["completion_tokens"] >= 1
    code, lines = inst.local("POST", "/v1/generate", {"prompt": "x", "params": {"top_p": 7}})
    assert code == 400 and "top_p" in lines["error"]
    for bad in ({"prompt": 5}, {"prompt": [1, "2"]}, {"messages": [5]}, {"messages": [{"role": "user"}]}):
        code, lines = inst.local("POST", "/v1/generate", bad)
        assert code == 400 and ("prompt" in lines["error"] or "messages" in lines["error"]), (bad, lines)
    # A temperature too small to divide by samples greedily rather than failing the batch.
    code, body = inst.post("/v1/completions", {"model": MODEL, "prompt": "The sky is", "max_tokens": 3,
                                               "temperature": 1e-300})
    assert code == 200 and body["choices"][0]["finish_reason"] in ("length", "stop")


def status_codes_as(uid: int, socket_path: Path, calls: list[tuple[str, str]]) -> list[int]:
    """HTTP status of each call on the Unix socket, made by a child process running as ``uid``."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to uid, call, report, exit without running any test code
        try:
            os.close(read_end)
            os.setgid(uid)
            os.setuid(uid)
            codes = []
            for method, path in calls:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                    sock.settimeout(30)
                    sock.connect(str(socket_path))
                    sock.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
                                 f"Connection: close\r\n\r\n{{}}".encode())
                    codes.append(sock.recv(64).split()[1].decode())
            os.write(write_end, " ".join(codes).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        out = pipe.read()
    os.waitpid(pid, 0)
    return [int(code) for code in out.split()]


def test_mutating_local_calls_need_root_or_the_admin_group(cluster):
    inst = cluster[2]
    os.chmod(inst.socket_path, 0o666)  # let an unprivileged user reach the socket at all
    codes = status_codes_as(65534, inst.socket_path, [("GET", "/v1/status"), ("POST", "/v1/drain"),
                                                      ("POST", "/v1/generate")])
    assert codes == [200, 403, 403]
    assert inst.status()["draining"] is False


def test_a_client_that_leaves_mid_stream_cancels_only_its_request(cluster, reference_engine):
    """The request's KV spans the instances, so its steps await creditors' parts: the abort of
    a client that left must wait for the step boundary and leave the instance serving."""
    from infinite_llm.daemon.local_cluster import UnixHTTPConnection, wait_for

    home = cluster[1]
    conn = UnixHTTPConnection(str(home.socket_path), timeout=120)
    body = json.dumps({"prompt": LONG_PROMPT, "params": {"max_tokens": 400, "ignore_eos": True}}).encode()
    conn.request("POST", "/v1/generate", body=body, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    response.readline()  # the prefill's token: the request is decoding over three pools
    response.readline()
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    wait_for("the left request to be cancelled", lambda: not home.status()["requests"], timeout_s=60)
    tokens, _ = home.generate("Say hello.", max_tokens=4)
    assert tokens == reference_tokens(reference_engine, "Say hello.", 4)
    log = home.log_path.read_text()
    assert "engine step failed" not in log and "requests ended" not in log


def test_a_client_that_leaves_a_non_streaming_request_cancels_it(cluster):
    """A non-streaming completion writes nothing until it ends: the client's leaving is seen
    through the handler's cancellation, which aborts the request (else it ran to its end)."""
    from urllib.parse import urlsplit

    from infinite_llm.daemon.local_cluster import wait_for

    inst = cluster[2]
    where = urlsplit(inst.url)
    body = json.dumps({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True,
                       "temperature": 0}).encode()
    with socket.create_connection((where.hostname, where.port), timeout=30) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        wait_for("the request to run", lambda: inst.status()["requests"], timeout_s=60)
    # 1000 tokens take over a minute here: gone within seconds means it was cancelled.
    wait_for("the left request to be cancelled", lambda: not inst.status()["requests"], timeout_s=20)
    code, body = inst.post("/v1/completions", {"model": MODEL, "prompt": "The sky is", "max_tokens": 3, "temperature": 0})
    assert code == 200
