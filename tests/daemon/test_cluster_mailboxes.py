"""Real `infinited` processes on loopback UCX, attending through step mailboxes (host memory on
the CPU, device memory on a GPU): one StepBegin per step to each creditor, the layers through
the mailbox, and greedy tokens identical to one instance's."""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time

import pytest
import torch

from infinite_llm.daemon.local_cluster import LocalCluster, passkey_prompt
from infinite_llm.engine.config import EngineConfig
from infinite_llm.engine.engine import LLMEngine
from infinite_llm.engine.loader import load_checkpoint
from infinite_llm.engine.sampling import SamplingParams

POOL_BLOCKS = 36  # 576 tokens per instance: the long prompt (about 75 blocks) spills over all three
LONG_PROMPT = passkey_prompt(75)
NEW_TOKENS = 24


def generate_split(cluster: LocalCluster) -> tuple[list[int], str, set[int]]:
    home = cluster[1]
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(out=home.generate(LONG_PROMPT, max_tokens=NEW_TOKENS)))
    thread.start()
    seen_on: set[int] = set()
    deadline = time.monotonic() + 240
    while thread.is_alive() and time.monotonic() < deadline:
        for request in home.status()["requests"]:
            seen_on |= {s["instance_id"] for s in request["segments"]}
        time.sleep(0.05)
    thread.join(timeout=300)
    assert not thread.is_alive(), "the request did not finish"
    tokens, text = result["out"]
    return tokens, text, seen_on


def reference_tokens(device: str = "cpu", model: str | None = None) -> list[int]:
    torch.set_num_threads(1)
    engine = LLMEngine(load_checkpoint(model, show_progress=False),
                       EngineConfig(block_size=16, pool_blocks=(512,), max_num_batched_tokens=128, device=device,
                                    dtype="float32"))
    (output,) = engine.generate([LONG_PROMPT], SamplingParams(max_tokens=NEW_TOKENS))
    return list(output.token_ids)


def test_a_split_request_decodes_through_mailboxes_and_matches_one_instance(tmp_path):
    cluster = LocalCluster(tmp_path, num_instances=3, pool_blocks=POOL_BLOCKS,
                           extra_args=["--remote-attention", "mailboxes"])
    # The one-instance reference is computed in a worker thread (one torch thread) while the
    # cluster serves the two requests, which keep the two cores only partly busy.
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    try:
        cluster.wait_ready()
        expected = pool.submit(reference_tokens)
        tokens, text, seen_on = generate_split(cluster)
        # Between the two requests the home goes idle and stands its creditors down.
        again, _, _ = generate_split(cluster)
        home = cluster[1].status()["step_protocol"]
        creditors = {i: cluster[i].status()["step_protocol"] for i in (2, 3)}
    finally:
        cluster.stop()
        pool.shutdown(wait=True)
    assert seen_on >= {1, 2, 3}, f"the request's segments were seen only on {seen_on}"
    reference = expected.result()
    assert tokens == reference and again == reference
    assert "green" in text  # box 42 is green
    # Steps queued ahead: most decode steps found their layers queued; stand-downs were served.
    assert home["home_stand_downs"] >= 2, home
    for i, c in creditors.items():
        assert c["creditor_steps_assigned_ahead"] >= NEW_TOKENS // 2, (i, c)
        assert c["creditor_steps_let_go"] >= 1, (i, c)
    assert home["mode"] == "mailboxes" and home["home_steps_failed"] == 0
    # Decode steps went through both creditors' mailboxes: one StepBegin a step each, no
    # AttendRequest a layer (the first steps go by messages while a mailbox opens).
    assert home["home_mailboxes"] == [2, 3]
    for i, c in creditors.items():
        assert c["creditor_mailboxes"] == 1, (i, c)
        assert c["creditor_steps_begun"] >= NEW_TOKENS // 4, (i, c)
        assert c["creditor_steps_timed_out"] == 0, (i, c)
    assert home["home_steps_on_mailboxes"] == sum(c["creditor_steps_begun"] for c in creditors.values())


def gpu_cluster(tmp_path, num_instances: int, pool_blocks: int, *, links: bool = False,
                extra_args: tuple[str, ...] = ()) -> LocalCluster:
    """Daemons on the GPU through device mailboxes (fp32); with ``links``, every creditor over an
    NCCL link, each daemon a host of its own to NCCL (over the loopback), as between machines.
    The GPU machine may lack the embedded model's package: a SmolLM2-shaped folder
    (bench/random_model.py) named by INFLLM_GPU_TEST_MODEL stands in for it."""
    from infinite_llm.transport.nccl_link import loopback_host_env

    model = os.environ.get("INFLLM_GPU_TEST_MODEL")
    args = ["--remote-attention", "mailboxes", "--dtype", "float32", *extra_args]
    args += ["--nccl-links", "always"] if links else []
    args += ["--model", model] if model else []
    envs = [loopback_host_env(f"infinite-llm-test-host-{i}") for i in range(1, num_instances + 1)] if links else None
    return LocalCluster(tmp_path, num_instances=num_instances, pool_blocks=pool_blocks, device="cuda",
                        extra_args=args, instance_env=envs)


# Two instances: one part here and one on the creditor per row (the two-part merge); three:
# three parts per row (the general merge).
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("num_instances,pool_blocks", [(2, 48), (3, POOL_BLOCKS)])
def test_on_a_gpu_a_split_decode_step_is_one_graph_and_matches_one_instance(tmp_path, num_instances, pool_blocks):
    model = os.environ.get("INFLLM_GPU_TEST_MODEL")
    cluster = gpu_cluster(tmp_path, num_instances, pool_blocks)
    try:
        cluster.wait_ready()
        tokens, text, seen_on = generate_split(cluster)
        # A second request: the creditors' plans are replaced, and with them their graphs (and
        # the memory pool those held); its steps are graphs too.
        again, _, _ = generate_split(cluster)
        home = cluster[1].status()["step_protocol"]
        creditors = {i: cluster[i].status()["step_protocol"] for i in range(2, num_instances + 1)}
    finally:
        cluster.stop()
    assert seen_on >= set(range(1, num_instances + 1)), f"the request's segments were seen only on {seen_on}"
    assert tokens == reference_tokens("cuda", model) and again == tokens
    assert home["mode"] == "mailboxes" and home["home_steps_failed"] == 0
    # Once the mailboxes are open, each decode step is one graph replay at the home (the first
    # steps go by messages while they open) and one graph launch at each creditor.
    assert home["home_step_graph_replays"] >= NEW_TOKENS, home
    assert home["home_step_graph_captures"] <= 8, home
    for i, c in creditors.items():
        assert c["creditor_steps_timed_out"] == 0, (i, c)
        assert c["creditor_graphs_on"], (i, c)
        assert c["creditor_graph_replays"] >= NEW_TOKENS // 2 + NEW_TOKENS // 4, (i, c)


# Creditors reached by NCCL links, as those of other hosts are: each daemon names a host of its
# own (NCCL_HOSTID), so NCCL carries the layers over its network transport (sockets on the
# loopback here), and the home's step is still one graph.
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("num_instances,pool_blocks", [(2, 48), (3, POOL_BLOCKS)])
def test_on_a_gpu_creditors_of_other_hosts_take_the_step_over_nccl_links(tmp_path, num_instances, pool_blocks):
    model = os.environ.get("INFLLM_GPU_TEST_MODEL")
    cluster = gpu_cluster(tmp_path, num_instances, pool_blocks, links=True)
    try:
        cluster.wait_ready()
        tokens, text, seen_on = generate_split(cluster)
        again, _, _ = generate_split(cluster)
        home = cluster[1].status()["step_protocol"]
        creditors = {i: cluster[i].status()["step_protocol"] for i in range(2, num_instances + 1)}
    finally:
        cluster.stop()
    assert seen_on >= set(range(1, num_instances + 1)), f"the request's segments were seen only on {seen_on}"
    reference = reference_tokens("cuda", model)
    assert tokens == reference and again == reference
    assert home["home_steps_failed"] == 0, home
    assert home["home_links_made"] == num_instances - 1, home
    assert home["home_steps_on_links"] >= NEW_TOKENS, home
    assert home["home_step_graph_replays"] >= NEW_TOKENS, home
    for i, c in creditors.items():
        assert c["creditor_links_made"] == 1, (i, c)
        assert c["creditor_steps_timed_out"] == 0, (i, c)
        assert c["creditor_steps_assigned_ahead"] == 0, (i, c)  # nothing is queued ahead on a link
        assert c["creditor_graphs_on"], (i, c)
        assert c["creditor_graph_replays"] >= NEW_TOKENS // 2 + NEW_TOKENS // 4, (i, c)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_a_creditor_killed_mid_step_ends_its_link_and_the_request_goes_on(tmp_path):
    """kill -9 a creditor reached by an NCCL link while the home's steps wait on it: its link is
    aborted (NCCL has no timeout of its own), the step fails as a lost part does, the home
    recomputes the KV the creditor held, and the request ends as the undisturbed run did.

    Not under MPS: an MPS client killed while its kernels run takes every client of the GPU
    down with it (the daemons here share one GPU; a creditor on another host shares none)."""
    if os.environ.get("CUDA_MPS_PIPE_DIRECTORY") and os.path.exists(
            os.path.join(os.environ["CUDA_MPS_PIPE_DIRECTORY"], "control")):
        pytest.skip("under MPS a killed client takes the GPU's other clients down with it")
    import signal

    from infinite_llm.daemon.local_cluster import Generation, wait_for

    cluster = gpu_cluster(tmp_path, 3, 40, links=True, extra_args=("--heartbeat-interval-s", "0.5"))
    try:
        cluster.wait_ready()
        home = cluster[1]
        prompt = passkey_prompt(50)  # 752 tokens: more than the home's 40 blocks of 16 hold
        reference = Generation(home, prompt, max_tokens=200, timeout_s=300).join()
        wait_for("the creditors to free the reference's KV",
                 lambda: not any(cluster[i].status()["held_segments"] for i in (2, 3)), timeout_s=30)
        split = Generation(home, prompt, max_tokens=200, timeout_s=300)
        wait_for("the split request to decode over links",
                 lambda: len(split.tokens) >= 40 and home.status()["step_protocol"]["home_steps_on_links"] >= 10,
                 timeout_s=120)
        holder = wait_for("a creditor to hold part of the request's KV",
                          lambda: next((cluster[i] for i in (2, 3) if cluster[i].status()["held_segments"]), None))
        os.killpg(holder.process.pid, signal.SIGKILL)
        holder.process.wait(timeout=10)
        assert split.join() == reference and split.finish_reason == "length"
        assert home.metrics()["infllm_segments_recomputed_total"] >= 1
        protocol = home.status()["step_protocol"]
        assert protocol["home_links_made"] >= 2, protocol
    finally:
        cluster.stop()
