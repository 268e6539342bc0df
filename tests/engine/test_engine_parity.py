"""The engine against Hugging Face ``transformers`` running the same GGUF file (float32)."""

import concurrent.futures

import torch

from infinite_llm.engine.config import EngineConfig
from infinite_llm.engine.engine import LLMEngine
from infinite_llm.engine.sampling import SamplingParams

# Last-position logits of the two implementations differ only by float32 rounding in a
# different order of operations (fused q/k/v and gate/up matmuls, attention kernels): observed
# max |diff| is a few 1e-4 on logits of magnitude ~20 for a 4K prompt.
LOGITS_ATOL = 2e-2
LOGITS_RTOL = 1e-3


def _hf_greedy(model, prompt: list[int], num_tokens: int) -> tuple[list[int], torch.Tensor]:
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = model.generate(ids, max_new_tokens=num_tokens, min_new_tokens=num_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=2)
    return out.sequences[0, len(prompt):].tolist(), out.logits[0][0]


def test_greedy_tokens_and_logits_match_transformers(smollm2, hf_smollm2, prompt_token_ids):
    # The oracle runs in a thread of its own beside the engine: each is one torch thread (the
    # one_thread fixture's setting reaches every thread), so on two cores the 4K prompt's two
    # prefills (about 20 s each) overlap instead of following each other.
    num_tokens = [4 if len(prompt) > 1000 else 12 for prompt in prompt_token_ids]
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        oracle = [pool.submit(_hf_greedy, hf_smollm2, prompt, n) for prompt, n in zip(prompt_token_ids, num_tokens)]
        engine = LLMEngine(smollm2, EngineConfig(pool_blocks=(1024,), max_num_batched_tokens=1024))
        for prompt, n, hf in zip(prompt_token_ids, num_tokens, oracle):
            request_id = engine.add_request(prompt, SamplingParams(max_tokens=n, ignore_eos=True))
            first_logits = None
            tokens = []
            while engine.has_unfinished:
                for output in engine.step():
                    if first_logits is None:
                        first_logits = engine.last_step_logits[request_id].clone()
                    tokens += output.new_token_ids
            expected, expected_logits = hf.result()
            assert tokens == expected, f"prompt of {len(prompt)} tokens"
            torch.testing.assert_close(first_logits, expected_logits.float(), atol=LOGITS_ATOL, rtol=LOGITS_RTOL)
