"""Sampling parameters (validated, pure) and the sampler that turns logits into token ids."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


# Temperatures below this sample greedily, so that logits / temperature stays finite.
MIN_TEMPERATURE = 1e-5
# The seeds torch.Generator.manual_seed takes: a signed or unsigned 64-bit integer.
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    ``temperature`` below ``MIN_TEMPERATURE`` (0 included) is greedy decoding (the other sampling
    fields are then unused): logits divided by a smaller one overflow to inf and NaN.
    ``top_k == 0`` and ``top_p == 1`` switch those filters off. With a ``seed`` a request's
    samples are reproducible whatever else is in its batch.
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()  # output text ends before the first of these
    stop_token_ids: tuple[int, ...] = ()  # besides the checkpoint's end-of-sequence tokens
    ignore_eos: bool = False  # keep going past the end-of-sequence tokens (benchmarks)

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if (isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float))
                or not self.temperature >= 0 or self.temperature == float("inf")):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0: off), got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not SEED_MIN <= self.seed <= SEED_MAX):
            # Checked here: torch.Generator.manual_seed refuses a seed outside this range only
            # when the step samples, failing every request of the batch.
            raise ValueError(f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}] or None, got {self.seed!r}")
        object.__setattr__(self, "stop", _as_tuple(self.stop, "stop", "non-empty strings"))
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must hold non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids, "stop_token_ids",
                                                             "non-negative integers"))
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE


def _as_tuple(value: object, name: str, what: str) -> tuple:
    """A field given as None (none), one string, or any iterable, as a tuple; ValueError for
    anything else."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    try:
        return tuple(value)
    except TypeError:
        raise ValueError(f"{name} must be a list of {what}, got {value!r}") from None


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to ``-inf``) the tokens outside top-k and outside the top-p nucleus.

    Args:
        logits: ``[vocab]`` float32, already divided by the temperature.
    """
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens before it already reach top_p; the first always stays.
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        # Said, not left to arithmetic: a top_p that rounds to 0 against float32 sums (under
        # about 1e-45) would otherwise drop the first too, and every token with it.
        drop[0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


class Sampler:
    """Picks the next token of each row; one random generator per seeded request."""

    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def sample(self, logits: torch.Tensor, request_ids: Sequence[str], params: Sequence[SamplingParams]) -> list[int]:
        """Args: logits ``[num_rows, vocab]`` (any float dtype); one request id and params per row."""
        greedy_rows = [i for i, p in enumerate(params) if p.greedy]
        tokens = [0] * len(params)
        if greedy_rows:
            picked = logits[greedy_rows].argmax(dim=-1).tolist()
            for row, token in zip(greedy_rows, picked):
                tokens[row] = token
        for row, (request_id, p) in enumerate(zip(request_ids, params)):
            if p.greedy:
                continue
            scaled = filter_logits(logits[row].float() / p.temperature, p.top_k, p.top_p)
            probs = torch.softmax(scaled, dim=-1)
            tokens[row] = int(torch.multinomial(probs, 1, generator=self._generator(request_id, p, logits.device)))
        return tokens

    def _generator(self, request_id: str, params: SamplingParams, device: torch.device) -> torch.Generator | None:
        if params.seed is None:
            return None
        if request_id not in self._generators:
            generator = torch.Generator(device=device)
            generator.manual_seed(params.seed)
            self._generators[request_id] = generator
        return self._generators[request_id]
