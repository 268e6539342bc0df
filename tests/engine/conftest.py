"""Fixtures of the engine tests: the embedded SmolLM2 checkpoint, its Hugging Face twin, prompts.

The machine running the suite may be shared, so each test runs torch on one thread (restored
after): small matmuls then cost a tenth of what two contended threads cost, and the engine and
the Hugging Face reference are timed and compared under the same setting.
"""

from __future__ import annotations

import os

import pytest
import torch

from infinite_llm.engine.loader import Checkpoint, embedded_model_path, load_checkpoint

SHORT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "List three colours of the rainbow:",
    "Once upon a time, in a small village by the sea, there lived",
]


def long_document(num_items: int = 225) -> str:
    """A long, varied, deterministic text ending in a question (about 4,100 SmolLM2 tokens)."""
    colours = ["red", "green", "blue", "yellow", "purple", "orange", "silver", "black", "white", "brown"]
    animals = ["cat", "owl", "horse", "fox", "whale", "sparrow", "otter", "goat", "lizard", "bee"]
    cities = ["Lyon", "Oslo", "Quito", "Perth", "Kyoto", "Cairo", "Lima", "Turin", "Dakar", "Riga"]
    lines = ["Inventory of the museum archive. Each entry lists a box, its colour, an animal and a city."]
    for i in range(num_items):
        lines.append(
            f"Box {i}: a {colours[i * 7 % 10]} box holding a carved {animals[i * 3 % 10]} "
            f"sent from {cities[(i * i) % 10]}."
        )
    lines.append("Question: which city sent the carved animal in Box 17? Answer:")
    return "\n".join(lines)


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smollm2() -> Checkpoint:
    return load_checkpoint(None, show_progress=False)


@pytest.fixture(scope="session")
def prompt_token_ids(smollm2: Checkpoint) -> list[list[int]]:
    """Five prompts as token ids; the last one is over 4,000 tokens."""
    prompts = [smollm2.tokenizer.encode(p) for p in SHORT_PROMPTS]
    prompts.append(smollm2.tokenizer.encode(long_document()))
    assert len(prompts[-1]) >= 4000
    return prompts


@pytest.fixture(scope="session")
def hf_smollm2():
    """``transformers`` running the same GGUF file, float32 (the test oracle)."""
    transformers = pytest.importorskip("transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = embedded_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    model.eval()
    return model
