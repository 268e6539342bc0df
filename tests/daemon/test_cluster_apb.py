"""APB prefill in the serving path: three real `infinited` processes on loopback UCX.

A request with ``prefill: "apb"`` has its document cut over the instances, each chunk computed
where it then stays (a segment the peer holds); the home decodes over them. With an anchor of 0
and passing blocks as long as a chunk nothing is dropped and APB is exact: the greedy tokens
must be those of the exact prefill. With APB's defaults the answer to a passkey question stays
right. Short documents fall back to exact with a note; more hosts than live instances is a 400.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from infinite_llm.daemon.local_cluster import LocalCluster, passkey_prompt

POOL_BLOCKS = 160
DOCUMENT = passkey_prompt(60).rsplit(" Question:", 1)[0]  # about 1,000 tokens of boxes and colours
QUERY = " Question: what is the colour of box 42? Answer: The colour of box 42 is"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("apb")
    cluster = LocalCluster(root, num_instances=3, pool_blocks=POOL_BLOCKS,
                           extra_args=["--apb-min-chunk-tokens", "64", "--held-audit-s", "0.5"])
    try:
        cluster.wait_ready()
        yield cluster
    finally:
        cluster.stop()


def local_generate(instance, prompt, prefill=None, max_tokens=8):
    body = {"prompt": prompt, "params": {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}}
    if prefill is not None:
        body["prefill"] = prefill
    return instance.local("POST", "/v1/generate", body, timeout=180)


def tokens_of(lines) -> list[int]:
    return [t for line in lines for t in line["token_ids"]]


def wait_all_blocks_back(cluster, timeout_s: float = 30.0) -> None:
    """Every peer's chunk of a finished request is freed (FreeSegment after the request ends)."""
    deadline = time.monotonic() + timeout_s
    while True:
        pools = {i: cluster[i].status()["pool"] for i in (1, 2, 3)}
        if all(p["num_blocks_held_for_others"] == 0 and p["num_blocks_reserved_for_others"] == 0
               for p in pools.values()):
            return
        assert time.monotonic() < deadline, pools
        time.sleep(0.2)


def openai_post(instance, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(instance.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=180) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_apb_that_drops_nothing_gives_the_exact_tokens(cluster):
    home = cluster[1]
    code, exact = local_generate(home, DOCUMENT, {"mode": "exact", "query": QUERY})
    assert code == 200, exact
    assert "prefill" not in exact[0]
    code, apb = local_generate(home, DOCUMENT, {"mode": "apb", "query": QUERY, "anchor_tokens": 0,
                                                "passing_tokens": 4096})
    assert code == 200, apb
    info = apb[0]["prefill"]
    assert info["mode"] == "apb" and info["note"] is None, info
    assert [h["instance"] for h in info["hosts"]][-1] == 1 and len(info["hosts"]) == 3
    bounds = [h["tokens"] for h in info["hosts"]]
    assert bounds[0][0] == 0 and all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert info["passing_bytes"] > 0 and info["anchor_tokens"] == 0
    assert tokens_of(apb) == tokens_of(exact)
    wait_all_blocks_back(cluster)


def test_apb_defaults_answer_over_the_openai_api(cluster):
    home = cluster[2]
    code, body = openai_post(home, "/v1/completions", {"prompt": DOCUMENT, "query": QUERY, "prefill": "apb",
                                                       "max_tokens": 4, "temperature": 0})
    assert code == 200, body
    info = body["prefill"]
    assert info["mode"] == "apb" and len(info["hosts"]) == 3 and info["hosts"][-1]["instance"] == 2
    chunk = info["hosts"][0]["tokens"][1]
    # Chunks this short are under the defaults' floors (an anchor of 1,024 tokens, cut to chunk
    # 0, and 512 keys passed): the whole of chunk 0 is the anchor and every host passes its chunk.
    assert info["anchor_tokens"] == chunk and info["passing_tokens"] == 512 > chunk
    # The small model answers this question wrongly (" blue") with an exact prefill too: APB
    # with its defaults answers the same.
    code, exact = openai_post(home, "/v1/completions", {"prompt": DOCUMENT, "query": QUERY, "max_tokens": 2,
                                                        "temperature": 0})
    assert code == 200 and "prefill" not in exact, exact
    assert body["choices"][0]["text"].startswith(exact["choices"][0]["text"]), (body, exact)
    assert body["usage"]["prompt_tokens"] > 900
    # Streamed: the first chunk says how the prompt was prefilled.
    request = urllib.request.Request(home.url + "/v1/completions", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"prompt": DOCUMENT, "query": QUERY, "prefill": "apb",
                                                      "max_tokens": 3, "temperature": 0, "stream": True}).encode())
    with urllib.request.urlopen(request, timeout=180) as response:
        events = [json.loads(line[6:]) for line in response.read().decode().splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert events[0]["prefill"]["mode"] == "apb" and all("prefill" not in e for e in events[1:])
    # Two hosts on request, and a chat whose last user turn is the query.
    code, chat = openai_post(home, "/v1/chat/completions", {
        "messages": [{"role": "system", "content": DOCUMENT}, {"role": "user", "content": QUERY.strip()}],
        "prefill": "apb", "apb_hosts": 2, "max_tokens": 4, "temperature": 0})
    assert code == 200, chat
    assert chat["prefill"]["mode"] == "apb" and len(chat["prefill"]["hosts"]) == 2
    wait_all_blocks_back(cluster)


def test_a_short_document_falls_back_to_exact_with_a_note(cluster):
    code, lines = local_generate(cluster[1], "The sky is", {"mode": "apb", "query": " blue because"})
    assert code == 200, lines
    info = lines[0]["prefill"]
    assert info["mode"] == "exact" and info["requested"] == "apb"
    assert "too few" in info["note"] and "apb_min_chunk_tokens" in info["note"]
    assert lines[-1]["finished"]


def test_bad_prefill_requests_get_a_400(cluster):
    home = cluster[3]
    code, body = openai_post(home, "/v1/completions", {"prompt": DOCUMENT, "prefill": "apb", "apb_hosts": 5,
                                                       "max_tokens": 2})
    assert code == 400 and "apb_hosts is 5" in body["error"]["message"], body
    for field, value in (("prefill", "fast"), ("apb_scorer", "best"), ("apb_hosts", 0), ("query", 3),
                         ("apb_passing_tokens", -1)):
        code, body = openai_post(home, "/v1/completions", {"prompt": DOCUMENT, "prefill": "apb", field: value,
                                                           "max_tokens": 2})
        assert code == 400 and body["error"]["param"] == field, (field, body)
    code, body = openai_post(home, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                            "query": "x"})
    assert code == 400 and body["error"]["param"] == "query", body
    code, body = local_generate(home, DOCUMENT, {"mode": "apb", "hosts": 9})
    assert code == 400 and "apb_hosts is 9" in body["error"], body
    code, body = local_generate(home, DOCUMENT, {"mode": "apb", "speed": 1})
    assert code == 400 and "unknown prefill field: speed" in body["error"], body
    code, body = local_generate(home, DOCUMENT, {"mode": "apb", "scorer": "best"})
    assert code == 400 and body["error"].startswith("prefill.scorer must be"), body
    # The daemons took no harm: the next request is served.
    code, lines = local_generate(home, "The sky is", max_tokens=2)
    assert code == 200 and lines[-1]["finished"]


def test_infctl_generate_with_apb(cluster):
    def infctl(*args: str) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        return subprocess.run([sys.executable, "-m", "infinite_llm.cli.main", "generate", *args,
                               "--state-dir", str(cluster.state_dir), "--instance", "2"],
                              capture_output=True, text=True, timeout=180, env=env)

    done = infctl(DOCUMENT, "--query", QUERY, "--prefill", "apb", "--apb-hosts", "2", "--max-tokens", "3")
    assert done.returncode == 0, done.stderr
    assert "infctl: prefill: apb over 2 instances" in done.stderr and done.stdout.strip(), done
    too_many = infctl(DOCUMENT, "--prefill", "apb", "--apb-hosts", "7")
    assert too_many.returncode not in (0, 2) and "apb_hosts is 7" in too_many.stderr, too_many
    assert "Traceback" not in too_many.stderr
    bad = infctl(DOCUMENT, "--prefill", "fast")
    assert bad.returncode == 2 and "--prefill must be exact or apb" in bad.stderr, bad


def test_a_host_killed_mid_prefill_leaves_the_request_prefilled_exactly(cluster):
    """Instance 3 kills itself (SIGKILL) at the 4th layer of its chunk: the home gives the APB
    prefill up, frees what the live host made, and prefills exactly; the tokens are exact's."""
    home = cluster[1]
    code, exact = local_generate(home, DOCUMENT, {"mode": "exact", "query": QUERY})
    assert code == 200, exact
    victim = cluster[3]
    victim.process.kill()
    victim.process.wait(timeout=30)
    cluster.restart(3, extra_env={"INFLLM_FAILPOINTS": "apb.layer=4"})
    time.sleep(2.5)  # one upkeep period: the home reads the new run's record
    started = time.monotonic()
    code, lines = local_generate(home, DOCUMENT, {"mode": "apb", "query": QUERY, "hosts": 3})
    assert code == 200, lines
    info = lines[0]["prefill"]
    assert info["mode"] == "exact" and "the APB prefill failed" in info["note"], info
    assert tokens_of(lines) == tokens_of(exact)
    assert time.monotonic() - started < 60
    assert victim.process.wait(timeout=30) == -9  # it died at the failpoint, for real
    deadline = time.monotonic() + 30
    while (pool := cluster[2].status()["pool"])["num_blocks_held_for_others"] or pool["num_blocks_reserved_for_others"]:
        assert time.monotonic() < deadline, pool
        time.sleep(0.2)
