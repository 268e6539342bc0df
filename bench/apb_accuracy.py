"""APB prefill's task accuracy on a real model, against exact prefill and two ablations.

The embedded SmolLM2-135M-Instruct (GGUF, context 8192) answers synthetic long-context
retrieval tasks whose prompt is prefilled in one of these ways:

- ``exact``: causal prefill of the whole document on one host (``exact_prefill``);
- ``apb-h{H}``: APB over H hosts (``apb_prefill``, the hosts as coroutines of one process on
  one device): the document cut into H contiguous chunks of near-equal length, the anchor block
  the document's first ``--anchor-frac`` of a chunk, passing blocks of ``--passing-frac`` of a
  chunk per host and KV head, chosen by the attention the query rows pay the keys;
- ``nopass-h{H}``: the same without passing blocks (each host sees the anchor and its own
  chunk only, as Star Attention does);
- ``random-h{H}``: passing blocks of as many keys drawn at random (seeded per sample).

Whatever the prefill, the context's KV (the hosts' chunks in position order, per layer) is
what the serving path decodes over: the query is prefilled exactly over it
(``extend_prefill``), then up to ``--new-tokens`` tokens are decoded greedily, each step one
exact ``extend_prefill`` of the last token over the growing KV. The document is prefilled
exactly once per prompt, and each APB variant once.

Tasks (the prompt, document plus query, is at most ``L - new_tokens`` tokens of the model's
tokenizer, within a sentence of it, so that prompt and answer fit in L):

- ``passkey``: an instruction line, the filler "The grass is green. The sky is blue. ..."
  repeated, one sentence "The pass key is NNNNN. Remember it. NNNNN is the pass key." at a
  uniform random depth; query "What is the pass key? The pass key is". Correct if the 5-digit
  key is in the decoded text.
- ``multikey``: the same filler with 4 sentences "The special magic number for <word> is:
  NNNNNNN." at random depths (distinct words, 7-digit numbers); the query asks for one of them.

Prompt format: ``raw`` (plain text, the query right after the document) by default. The
chat template (``--prompt-format chat``: the document in the user turn, the question at its
end, the query being the question, the turn's end and the assistant header) gave this small
model far lower exact accuracy: at 2K on the CPU in float32, 6 samples per task, raw 4/6
passkey and 4/6 multikey, chat 0/6 and 0/6 (in chat the model explains what a pass key is,
and restates the multikey question until the tokens run out). Sample i of every (task,
length) is built from seed ``--seed + i``; every method sees the same prompts.

    python bench/apb_accuracy.py                                   # the full table on a GPU
    python bench/apb_accuracy.py --lengths 2048 --samples 5 --methods exact,apb-h2 --device cpu
    python bench/apb_accuracy.py --lengths 512 --samples 2 --passing-frac 1 --anchor-frac 0  # APB == exact

Writes ``bench/results/apb_accuracy-<device>.json`` (per method, task and length: accuracy,
samples, mean prompt tokens, wall time; each sample's decoded texts; the verdict whether APB is
at most 2 points below exact and above both ablations) and prints a table. The file is
rewritten after every sample with ``"complete": false``, so a run cut short leaves what it did.
Runs that split the table (``--tasks``, ``--lengths``, one ``--out`` each, say in parallel on
one GPU) join into one table with ``--merge PART... [--out PATH]``, which checks that they share
methods, samples, seeds and settings.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from infinite_llm.engine.loader import load_checkpoint
from infinite_llm.engine.model import LlamaModel
from infinite_llm.engine.seq_parallel import APBConfig, LocalHostGroup, apb_prefill, exact_prefill, extend_prefill
from infinite_llm.engine.tokenizer import Tokenizer

TASKS = ("passkey", "multikey")
DEFAULT_METHODS = ("exact", "apb-h2", "apb-h4", "nopass-h2", "nopass-h4", "random-h2", "random-h4")
PROMPT_FORMATS = ("raw", "chat")
PROMPT_FORMAT = "raw"  # the better of the two for exact prefill (module docstring)
GOAL_POINTS = 2.0  # APB may be at most this many points below exact

FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
PASSKEY_INSTRUCTION = "There is important information hidden in a lot of irrelevant text. Find it and memorize it."
MULTIKEY_INSTRUCTION = ("Some special magic numbers are hidden within the following text. Make sure to memorize "
                        "them. I will quiz you about the numbers afterwards.")
MULTIKEY_NEEDLES = 4
NOUNS = ("apple", "river", "window", "garden", "candle", "mountain", "pencil", "bridge", "forest", "hammer",
         "island", "jacket", "kettle", "ladder", "mirror", "needle", "orange", "pillow", "rabbit", "saddle",
         "teacup", "violin", "wallet", "anchor", "basket", "camera", "dragon", "engine", "feather", "guitar",
         "helmet", "lantern", "marble", "notebook", "oven", "parrot", "rocket", "shovel", "tiger", "umbrella",
         "village", "whistle", "button", "castle", "dolphin", "ferry", "glacier", "harbor", "compass", "meadow")


# --- prompts (pure: a seed and a tokenizer in, token ids out) --------------------------------


@dataclass(frozen=True)
class Prompt:
    task: str
    seed: int
    doc_ids: list[int]  # everything before the question: what APB splits over the hosts
    query_ids: list[int]  # the question (and, in chat format, the turn's end and assistant header)
    answer: str  # the digits the decoded text must contain

    @property
    def num_tokens(self) -> int:
        return len(self.doc_ids) + len(self.query_ids)


def _needles(task: str, rng: random.Random) -> tuple[list[tuple[float, str]], str, str, str]:
    """The task's needle sentences with their depths (0..1 of the filler), the instruction, the
    question and the answer, all drawn from ``rng``."""
    if task == "passkey":
        key = str(rng.randint(10_000, 99_999))
        needle = f"The pass key is {key}. Remember it. {key} is the pass key."
        return [(rng.random(), needle)], PASSKEY_INSTRUCTION, "What is the pass key? The pass key is", key
    if task == "multikey":
        words = rng.sample(NOUNS, MULTIKEY_NEEDLES)
        numbers = [str(rng.randint(1_000_000, 9_999_999)) for _ in words]
        needles = [(rng.random(), f"The special magic number for {w} is: {n}.") for w, n in zip(words, numbers)]
        asked = rng.randrange(MULTIKEY_NEEDLES)
        word = words[asked]
        question = f"What is the special magic number for {word}? The special magic number for {word} is:"
        return needles, MULTIKEY_INSTRUCTION, question, numbers[asked]
    raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")


def _body(instruction: str, needles: list[tuple[float, str]], num_filler: int) -> str:
    """The instruction, then ``num_filler`` filler sentences with each needle at its depth."""
    sentences = [FILLER[i % len(FILLER)] for i in range(num_filler)]
    # Insert the deepest first, so that each needle's index still counts filler sentences only.
    for depth, needle in sorted(needles, key=lambda n: -n[0]):
        sentences.insert(round(depth * num_filler), needle)
    return instruction + "\n" + " ".join(sentences)


def _split(tokenizer: Tokenizer, body: str, question: str, prompt_format: str) -> tuple[list[int], list[int]]:
    """Token ids of the document and of the query."""
    if prompt_format == "raw":
        return tokenizer.encode(body), tokenizer.encode("\n" + question, add_special_tokens=False)
    text = tokenizer.apply_chat_template([{"role": "user", "content": body + "\n\n" + question}])
    cut = text.rindex("\n\n" + question)
    return (tokenizer.encode(text[:cut], add_special_tokens=False),
            tokenizer.encode(text[cut:], add_special_tokens=False))


def build_prompt(task: str, seed: int, max_tokens: int, tokenizer: Tokenizer, prompt_format: str) -> Prompt:
    """The task's prompt for ``seed``: as many filler sentences as keep it at most ``max_tokens``
    tokens (it ends within about one sentence of that)."""
    needles, instruction, question, answer = _needles(task, random.Random(seed))

    def ids(num_filler: int) -> tuple[list[int], list[int]]:
        return _split(tokenizer, _body(instruction, needles, num_filler), question, prompt_format)

    def size(num_filler: int) -> int:
        doc, query = ids(num_filler)
        return len(doc) + len(query)

    fixed = size(0)
    if fixed > max_tokens:
        raise ValueError(f"{task}: the prompt without filler has {fixed} tokens, more than {max_tokens}")
    per_sentence = (size(len(FILLER) * 20) - fixed) / (len(FILLER) * 20)
    low, high = 0, int((max_tokens - fixed) / per_sentence * 1.1) + len(FILLER)
    while size(high) <= max_tokens:  # make sure ``high`` is too many
        high *= 2
    # The largest count that fits; tokens grow with the count (a sentence is a few whole tokens).
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if size(middle) <= max_tokens else (low, middle)
    doc, query = ids(low)
    return Prompt(task=task, seed=seed, doc_ids=doc, query_ids=query, answer=answer)


# --- methods ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Method:
    name: str  # "exact", "apb-h2", "nopass-h4", ...
    kind: str  # "exact", "apb", "nopass" or "random"
    hosts: int  # 1 for exact


def parse_method(name: str) -> Method:
    if name == "exact":
        return Method(name, "exact", 1)
    match = re.fullmatch(r"(apb|nopass|random)-h(\d+)", name)
    if not match or int(match.group(2)) < 2:
        raise ValueError(f"unknown method {name!r}: expected exact, apb-h<H>, nopass-h<H> or random-h<H> with H >= 2")
    return Method(name, match.group(1), int(match.group(2)))


def chunk_bounds(num_tokens: int, hosts: int) -> list[tuple[int, int]]:
    """``hosts`` contiguous chunks of ``[0, num_tokens)``, lengths differing by at most one."""
    cuts = [num_tokens * i // hosts for i in range(hosts + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


def apb_config(method: Method, doc_len: int, anchor_frac: float, passing_frac: float, seed: int,
               anchor_min: int = 0, passing_min: int = 0) -> APBConfig:
    """The method's APB settings for a document of ``doc_len`` tokens: anchor and passing
    lengths as fractions of the longest chunk, at least ``anchor_min`` and ``passing_min``
    tokens (the anchor no longer than host 0's chunk)."""
    bounds = chunk_bounds(doc_len, method.hosts)
    longest = max(b - a for a, b in bounds)
    anchor_len = min(max(round(anchor_frac * longest), anchor_min), bounds[0][1])
    passing_len = 0 if method.kind == "nopass" else max(round(passing_frac * longest), passing_min)
    scorer = "random" if method.kind == "random" else "attention"
    return APBConfig(anchor_len=anchor_len, passing_len=passing_len, scorer=scorer, seed=seed)


KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k, v), each [tokens, kv_heads, head_dim]


async def apb_context(model: LlamaModel, doc_ids: torch.Tensor, query_ids: torch.Tensor, hosts: int,
                      config: APBConfig) -> KV:
    """APB prefill of ``doc_ids [doc_len]`` over ``hosts`` coroutines; the hosts' chunk KV
    concatenated in position order, per layer."""
    groups = LocalHostGroup.create(hosts)
    anchor_ids = doc_ids[:config.anchor_len]
    parts = await asyncio.gather(*(apb_prefill(model, group, doc_ids[start:end], anchor_ids, query_ids, config)
                                   for group, (start, end) in zip(groups, chunk_bounds(doc_ids.shape[0], hosts))))
    return [(torch.cat([p.kv[layer][0] for p in parts]), torch.cat([p.kv[layer][1] for p in parts]))
            for layer in range(model.config.num_layers)]


async def greedy_decode(model: LlamaModel, context: KV, query_ids: torch.Tensor, max_new_tokens: int,
                        stop_ids: tuple[int, ...]) -> list[int]:
    """Exact prefill of ``query_ids [n]`` over ``context``, then greedy decoding of up to
    ``max_new_tokens`` tokens (stopping after a stop token); returns the new token ids."""
    context_len = context[0][0].shape[0]
    capacity = context_len + query_ids.shape[0] + max_new_tokens
    # Each layer's KV in one buffer that the steps fill, instead of a concatenation per step.
    buffers = []
    for k, v in context:
        k_all = k.new_empty((capacity, *k.shape[1:]))
        v_all = v.new_empty((capacity, *v.shape[1:]))
        k_all[:context_len], v_all[:context_len] = k, v
        buffers.append((k_all, v_all))
    length, ids, new_ids = context_len, query_ids.to(model.device), []
    for _ in range(max_new_tokens):
        step = await extend_prefill(model, [(k[:length], v[:length]) for k, v in buffers], ids)
        for (k_all, v_all), (k, v) in zip(buffers, step.kv):
            k_all[length:length + k.shape[0]], v_all[length:length + k.shape[0]] = k, v
        length += ids.shape[0]
        token = int(model.logits(step.hidden[-1:]).argmax(dim=-1))
        new_ids.append(token)
        if token in stop_ids:
            break
        ids = torch.tensor([token], device=model.device)
    return new_ids


# --- results (pure: plain data in, plain data out) -------------------------------------------


@dataclass
class Cell:
    """One (method, task, length): its samples so far."""

    correct: int = 0
    samples: int = 0
    prompt_tokens: int = 0  # summed over the samples
    anchor_len: int = 0  # summed
    passing_len: int = 0  # summed
    wall_s: float = 0.0  # prefill and decode, summed

    def row(self, method: Method, task: str, length: int) -> dict:
        n = max(self.samples, 1)
        return {"method": method.name, "hosts": method.hosts, "task": task, "length": length,
                "accuracy": self.correct / n, "correct": self.correct, "samples": self.samples,
                "mean_prompt_tokens": self.prompt_tokens / n, "mean_anchor_len": self.anchor_len / n,
                "mean_passing_len": self.passing_len / n, "wall_s": self.wall_s}


@dataclass
class Summary:
    columns: list[str]  # "passkey@2048", ...
    percent: dict[str, dict[str, float]]  # method -> column (and "mean") -> accuracy in %
    points_vs_exact: dict[str, dict[str, float]] = field(default_factory=dict)  # method -> column -> points
    verdict: dict = field(default_factory=dict)


def summarize(rows: list[dict], methods: list[Method]) -> Summary:
    """The table and the verdict: for each H, is APB at most ``GOAL_POINTS`` below exact and
    above both ablations (nopass, random), on the mean over every task and length."""
    columns = list(dict.fromkeys(f"{r['task']}@{r['length']}" for r in rows))
    percent: dict[str, dict[str, float]] = {}
    for method in methods:
        cells = {f"{r['task']}@{r['length']}": 100.0 * r["accuracy"] for r in rows if r["method"] == method.name}
        percent[method.name] = {**cells, "mean": sum(cells.values()) / max(len(cells), 1)}
    summary = Summary(columns, percent)
    if "exact" in percent:
        exact = percent["exact"]
        for name, cells in percent.items():
            if name != "exact":
                summary.points_vs_exact[name] = {c: cells[c] - exact[c] for c in [*columns, "mean"]}
    for hosts in sorted({m.hosts for m in methods if m.kind == "apb"}):
        apb, nopass, rand = (percent.get(f"{kind}-h{hosts}") for kind in ("apb", "nopass", "random"))
        entry: dict = {"apb_mean": apb["mean"]}
        if "exact" in percent:
            entry["points_vs_exact"] = apb["mean"] - percent["exact"]["mean"]
            entry["within_goal_of_exact"] = entry["points_vs_exact"] >= -GOAL_POINTS
        if nopass is not None:
            entry["above_nopass"] = apb["mean"] > nopass["mean"]
        if rand is not None:
            entry["above_random"] = apb["mean"] > rand["mean"]
        measured = all(k in entry for k in ("within_goal_of_exact", "above_nopass", "above_random"))
        entry["goal_met"] = (entry["within_goal_of_exact"] and entry["above_nopass"] and entry["above_random"]
                             if measured else None)
        summary.verdict[f"h{hosts}"] = entry
    met = [v["goal_met"] for v in summary.verdict.values()]
    summary.verdict["goal"] = (f"APB at most {GOAL_POINTS:g} points below exact and above both ablations "
                               "(mean accuracy over every task and length)")
    summary.verdict["goal_met"] = all(met) if met and None not in met else None
    return summary


def format_table(summary: Summary) -> str:
    width = max(12, *(len(c) for c in summary.columns)) + 1
    header = f"{'method':<12}" + "".join(f"{c:>{width}}" for c in [*summary.columns, "mean"])
    lines = ["accuracy, %", header]
    for name, cells in summary.percent.items():
        lines.append(f"{name:<12}" + "".join(f"{cells.get(c, float('nan')):>{width}.1f}"
                                             for c in [*summary.columns, "mean"]))
    if summary.points_vs_exact:
        lines += ["", "points against exact", header]
        for name, cells in summary.points_vs_exact.items():
            lines.append(f"{name:<12}" + "".join(f"{cells[c]:>+{width}.1f}" for c in [*summary.columns, "mean"]))
    lines.append("")
    for hosts, entry in summary.verdict.items():
        if isinstance(entry, dict):
            lines.append(f"{hosts}: " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                                                   for k, v in entry.items()))
    lines.append(f"goal met: {summary.verdict['goal_met']} ({summary.verdict['goal']})")
    return "\n".join(lines)


# --- the run ---------------------------------------------------------------------------------


def device_slug(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    return _slug(torch.cuda.get_device_name(device))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


async def run(ns: argparse.Namespace, model: LlamaModel, tokenizer: Tokenizer, methods: list[Method],
              tasks: list[str], lengths: list[int],
              on_sample: Callable[[list[dict], list[dict]], None] | None = None) -> tuple[list[dict], list[dict]]:
    """Every sample of every (task, length) through every method; returns the per-cell rows and
    the per-sample records (decoded texts included). ``on_sample(rows, records)``, if given, is
    called after each sample with the rows of the cells begun so far."""
    cells = {(m.name, t, n): Cell() for t in tasks for n in lengths for m in methods}
    records = []

    def rows_so_far() -> list[dict]:
        return [cells[(m.name, t, n)].row(m, t, n) for t in tasks for n in lengths for m in methods
                if cells[(m.name, t, n)].samples]
    for task in tasks:
        for length in lengths:
            for index in range(ns.samples):
                seed = ns.seed + index
                prompt = build_prompt(task, seed, length - ns.new_tokens, tokenizer, ns.prompt_format)
                doc_ids = torch.tensor(prompt.doc_ids, device=model.device)
                query_ids = torch.tensor(prompt.query_ids, device=model.device)
                outputs = {}
                for method in methods:
                    _synchronize(model.device)
                    started = time.perf_counter()
                    if method.kind == "exact":
                        config = None
                        context = (await exact_prefill(model, doc_ids)).kv
                    else:
                        config = apb_config(method, doc_ids.shape[0], ns.anchor_frac, ns.passing_frac, seed,
                                            ns.anchor_min, ns.passing_min)
                        context = await apb_context(model, doc_ids, query_ids, method.hosts, config)
                    new_ids = await greedy_decode(model, context, query_ids, ns.new_tokens, tokenizer.eos_token_ids)
                    del context
                    _synchronize(model.device)
                    cell = cells[(method.name, task, length)]
                    cell.wall_s += time.perf_counter() - started
                    text = tokenizer.decode(new_ids)
                    correct = prompt.answer in text
                    cell.correct += correct
                    cell.samples += 1
                    cell.prompt_tokens += prompt.num_tokens
                    cell.anchor_len += config.anchor_len if config else 0
                    cell.passing_len += config.passing_len if config else 0
                    outputs[method.name] = {"text": text, "correct": correct}
                records.append({"task": task, "length": length, "index": index, "seed": seed,
                                "prompt_tokens": prompt.num_tokens, "doc_tokens": len(prompt.doc_ids),
                                "query_tokens": len(prompt.query_ids), "answer": prompt.answer, "outputs": outputs})
                marks = " ".join(f"{name} {'ok' if o['correct'] else 'x'}" for name, o in outputs.items())
                print(f"[{task} {length} {index + 1}/{ns.samples}] {prompt.num_tokens} tokens, answer "
                      f"{prompt.answer}: {marks}", file=sys.stderr, flush=True)
                if on_sample is not None:
                    on_sample(rows_so_far(), records)
    rows = [cells[(m.name, t, n)].row(m, t, n) for t in tasks for n in lengths for m in methods]
    return rows, records


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                        help="comma-separated: exact, apb-h<H>, nopass-h<H>, random-h<H>")
    parser.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, of {', '.join(TASKS)}")
    parser.add_argument("--lengths", default="2048,4096,8192", help="target prompt lengths L, tokens, comma-separated")
    parser.add_argument("--samples", type=int, default=50, help="prompts per (task, length)")
    parser.add_argument("--seed", type=int, default=0, help="sample i is built from seed + i")
    parser.add_argument("--anchor-frac", type=float, default=0.25, help="anchor block, a fraction of a chunk")
    parser.add_argument("--passing-frac", type=float, default=0.125,
                        help="passing block per host and KV head, a fraction of a chunk (1: nothing dropped)")
    parser.add_argument("--anchor-min", type=int, default=0, help="anchor block at least this many tokens")
    parser.add_argument("--passing-min", type=int, default=0,
                        help="passing block at least this many keys per host and KV head (not for nopass)")
    parser.add_argument("--new-tokens", type=int, default=12, help="greedy decoding steps at most")
    parser.add_argument("--prompt-format", choices=PROMPT_FORMATS, default=PROMPT_FORMAT)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="default float32 on the CPU, bfloat16 on CUDA (its flash kernels take no float32)")
    parser.add_argument("--out", default="", help="default bench/results/apb_accuracy-<device>.json")
    parser.add_argument("--merge", nargs="+", metavar="PART", default=None,
                        help="run nothing: merge the JSONs of runs over other tasks or lengths (same methods "
                             "and settings) into one table at --out (default: the parts' device's path)")
    ns = parser.parse_args(argv)
    ns.dtype = ns.dtype or ("bfloat16" if ns.device == "cuda" else "float32")
    if ns.device == "cuda" and ns.dtype == "float32":
        parser.error("--dtype float32 does not run on CUDA: the flash attention kernels take float16 or bfloat16")
    if ns.samples < 1 or ns.new_tokens < 1:
        parser.error("--samples and --new-tokens must be at least 1")
    if not 0.0 <= ns.anchor_frac <= 1.0 or ns.passing_frac < 0.0:
        parser.error("--anchor-frac must be in [0, 1] and --passing-frac >= 0")
    if ns.anchor_min < 0 or ns.passing_min < 0:
        parser.error("--anchor-min and --passing-min must be >= 0")
    return ns


# Settings every part of a merged table must share (the seeds may differ: parts may split samples).
_MERGE_KEYS = ("bench", "model", "device", "torch", "dtype", "prompt_format", "methods", "anchor_frac",
               "passing_frac", "anchor_min", "passing_min", "new_tokens")


def result_document(meta: dict, rows: list[dict], records: list[dict], methods: list[Method],
                    complete: bool) -> tuple[dict, Summary]:
    """The JSON the bench writes: ``meta`` (settings), the rows, the summary, the samples."""
    summary = summarize(rows, methods)
    result = {
        **meta, "complete": complete,
        "unit": "accuracy: fraction of samples whose decoded text holds the answer; wall_s: prefill and decode, summed",
        "results": rows, "percent": summary.percent, "points_vs_exact": summary.points_vs_exact,
        "verdict": summary.verdict, "outputs": records,
    }
    return result, summary


def _combine(rows: list[dict]) -> dict:
    """One cell's row from the rows of parts that ran disjoint samples of it."""
    samples = sum(r["samples"] for r in rows)
    correct = sum(r["correct"] for r in rows)
    row = {**rows[0], "correct": correct, "samples": samples, "accuracy": correct / max(samples, 1),
           "wall_s": sum(r["wall_s"] for r in rows)}
    for key in ("mean_prompt_tokens", "mean_anchor_len", "mean_passing_len"):
        row[key] = sum(r[key] * r["samples"] for r in rows) / max(samples, 1)
    return row


def merge_parts(paths: list[str]) -> tuple[dict, Summary]:
    """One table from the JSONs of runs that split the tasks, lengths or samples (seeds)
    between them; a (task, length, seed) may come from one part only."""
    parts = [json.loads(Path(p).read_text()) for p in paths]
    first = parts[0]
    for path, part in zip(paths, parts):
        if differ := [k for k in _MERGE_KEYS if part.get(k) != first.get(k)]:
            raise ValueError(f"{path} differs from {paths[0]} in {differ}")
    methods = [parse_method(m) for m in first["methods"]]
    tasks = [t for t in TASKS if any(t in p["tasks"] for p in parts)]
    lengths = sorted({n for p in parts for n in p["lengths"]})
    covered = [(t, n, seed) for p in parts for t in p["tasks"] for n in p["lengths"] for seed in p["seeds"]]
    if len(covered) != len(set(covered)):
        raise ValueError("two parts cover the same (task, length) with the same seeds")
    cells: dict[tuple[str, str, int], list[dict]] = {}
    for part in parts:
        for r in part["results"]:
            cells.setdefault((r["method"], r["task"], r["length"]), []).append(r)
    rows = [_combine(cells[(m.name, t, n)]) for t in tasks for n in lengths for m in methods if (m.name, t, n) in cells]
    records = sorted((r for p in parts for r in p["outputs"]),
                     key=lambda r: (tasks.index(r["task"]), r["length"], r["seed"]))
    seeds = sorted({seed for p in parts for seed in p["seeds"]})
    samples = {f"{r['task']}@{r['length']}": r["samples"] for r in rows if r["method"] == methods[0].name}
    meta = {k: first[k] for k in _MERGE_KEYS} | {
        "host": first.get("host"), "tasks": tasks, "lengths": lengths,
        "samples": max(samples.values(), default=0), "samples_per_cell": samples, "seed": seeds[0] if seeds else 0,
        "seeds": seeds, "wall_s": max(p["wall_s"] for p in parts),
        "merged_from": [{"file": Path(path).name, "tasks": p["tasks"], "lengths": p["lengths"], "seeds": p["seeds"],
                         "wall_s": p["wall_s"], "complete": p.get("complete", True)} for path, p in zip(paths, parts)],
    }
    return result_document(meta, rows, records, methods, all(p.get("complete", True) for p in parts))


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def main(argv: list[str] | None = None) -> None:
    ns = parse_args(argv)
    if ns.merge:
        try:
            result, summary = merge_parts(ns.merge)
        except (ValueError, KeyError, OSError) as exc:
            sys.exit(f"cannot merge: {exc}")
        out = Path(ns.out or Path(__file__).parent / "results" / f"apb_accuracy-{_slug(result['device'])}.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(format_table(summary))
        print(f"wrote {out}")
        return
    try:
        methods = [parse_method(m) for m in ns.methods.split(",")]
    except ValueError as exc:
        sys.exit(str(exc))
    tasks = ns.tasks.split(",")
    if unknown := [t for t in tasks if t not in TASKS]:
        sys.exit(f"unknown tasks {unknown}; expected some of {TASKS}")
    lengths = [int(n) for n in ns.lengths.split(",")]

    device = torch.device(ns.device)
    checkpoint = load_checkpoint(None, show_progress=False)
    if max(lengths) > checkpoint.config.max_position:
        sys.exit(f"--lengths {max(lengths)} is past the model's context ({checkpoint.config.max_position})")
    model = LlamaModel(checkpoint.config, checkpoint.weights, device=device, dtype=getattr(torch, ns.dtype))
    print(f"{Path(checkpoint.source).name} on {device} in {ns.dtype}, {ns.prompt_format} prompts", file=sys.stderr)

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    meta = {
        "bench": "apb_accuracy", "model": Path(checkpoint.source).name, "device": name, "host": platform.node(),
        "torch": torch.__version__, "dtype": ns.dtype, "prompt_format": ns.prompt_format,
        "tasks": tasks, "lengths": lengths, "methods": [m.name for m in methods], "samples": ns.samples,
        "seed": ns.seed, "seeds": [ns.seed + i for i in range(ns.samples)], "anchor_frac": ns.anchor_frac,
        "passing_frac": ns.passing_frac, "anchor_min": ns.anchor_min, "passing_min": ns.passing_min,
        "new_tokens": ns.new_tokens,
    }
    out = Path(ns.out or Path(__file__).parent / "results" / f"apb_accuracy-{device_slug(device)}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    def write(rows: list[dict], records: list[dict], complete: bool) -> Summary:
        # After every sample too ("complete": false), so that a run cut short leaves its samples.
        result, summary = result_document({**meta, "wall_s": time.perf_counter() - started}, rows, records,
                                          methods, complete)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(result, indent=1) + "\n")
        tmp.replace(out)
        return summary

    with torch.inference_mode():
        rows, records = asyncio.run(run(ns, model, checkpoint.tokenizer, methods, tasks, lengths,
                                        on_sample=lambda r, s: write(r, s, complete=False)))
    summary = write(rows, records, complete=True)
    print(format_table(summary))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
