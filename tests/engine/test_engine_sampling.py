"""Sampling parameters and the sampler, without a model."""

import pytest
import torch

from infinite_llm.engine.sampling import Sampler, SamplingParams, filter_logits


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
        ({"temperature": -0.5}, "temperature must be a finite number >= 0"),
        ({"temperature": float("nan")}, "temperature must be a finite number >= 0"),
        ({"temperature": True}, "temperature must be a finite number >= 0"),
        ({"top_p": True}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -1}, "top_k must be an integer >= 0"),
        ({"seed": "x"}, "seed must be an integer in"),
        ({"seed": 1 << 64}, "seed must be an integer in"),
        ({"stop": ("",)}, "stop must hold non-empty strings"),
        ({"stop_token_ids": (-3,)}, "stop_token_ids must be non-negative integers"),
        ({"stop": 5}, "stop must be a list of non-empty strings"),
        ({"stop_token_ids": 7}, "stop_token_ids must be a list of non-negative integers"),
    ],
)
def test_bad_params_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_a_temperature_too_small_to_divide_by_samples_greedily():
    """Logits divided by 1e-300 are inf and NaN, and the sampler's multinomial fails the whole
    batch (on a GPU, a device-side assert that ends the process)."""
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.9]])
    for temperature in (1e-300, 5e-324, 1e-6):
        params = SamplingParams(temperature=temperature)
        assert params.greedy
        assert Sampler().sample(logits, ["r"], [params]) == [1]
    assert not SamplingParams(temperature=1e-4).greedy


def test_a_single_stop_string_becomes_a_tuple_and_none_is_none():
    assert SamplingParams(stop="\n").stop == ("\n",)
    assert SamplingParams(stop=None, stop_token_ids=None) == SamplingParams()


def test_filter_logits_keeps_top_k_and_the_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.isinf(filter_logits(logits, top_k=2, top_p=1.0)).tolist() == [False, False, True, True]
    assert torch.isinf(filter_logits(logits, top_k=0, top_p=0.7)).tolist() == [False, False, True, True]
    assert torch.isinf(filter_logits(logits, top_k=0, top_p=0.1)).tolist() == [False, True, True, True]


def test_greedy_takes_the_argmax_and_seeded_sampling_repeats():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    greedy = Sampler().sample(logits, ["a", "b", "c"], [SamplingParams()] * 3)
    assert greedy == logits.argmax(-1).tolist()
    params = SamplingParams(temperature=1.0, seed=42)

    def draw():
        sampler = Sampler()
        return [sampler.sample(logits[:1], ["r"], [params])[0] for _ in range(20)]

    first = draw()
    assert first == draw()
    assert len(set(first)) > 1  # it really samples


def test_top_k_one_is_greedy_whatever_the_temperature():
    logits = torch.randn(1, 100)
    params = SamplingParams(temperature=5.0, top_k=1, seed=1)
    assert Sampler().sample(logits, ["x"], [params]) == [int(logits.argmax())]


def test_a_nucleus_too_small_for_float32_keeps_the_top_token():
    """A top_p under float32's smallest step would drop the first token too by arithmetic, every
    logit would be -inf and the multinomial would fail the whole batch."""
    logits = torch.tensor([0.5, 3.0, -1.0, 2.9])
    for top_p in (1e-46, 5e-324):
        assert torch.isinf(filter_logits(logits, top_k=0, top_p=top_p)).tolist() == [True, False, True, True]
        assert Sampler().sample(logits[None], ["r"], [SamplingParams(temperature=1.0, top_p=top_p)]) == [1]
