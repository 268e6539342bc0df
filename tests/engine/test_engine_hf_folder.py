"""A Hugging Face folder (config.json, safetensors, tokenizer.json) loads and generates like the GGUF.

The folder is written by ``transformers`` from the embedded GGUF (weights dequantised to
float32), so both sources hold the same numbers and must give the same greedy tokens.
"""

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from infinite_llm.engine.config import EngineConfig
from infinite_llm.engine.engine import LLMEngine
from infinite_llm.engine.loader import embedded_model_path, load_checkpoint
from infinite_llm.engine.sampling import SamplingParams

PROMPTS = ["The capital of France is", "def add(a, b):\n    return"]


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory, hf_smollm2):
    # hf_smollm2 is the session's one float32 load of the GGUF (about 17 s on two cores); it is
    # only read here.
    transformers = pytest.importorskip("transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = embedded_model_path()
    folder = tmp_path_factory.mktemp("smollm2-hf")
    model = hf_smollm2
    # transformers will not re-save a GGUF-quantised model: write the float32 tensors and the
    # config (without its GGUF quantisation entry) as a plain Hugging Face folder.
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(folder / "model.safetensors"))
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (folder / "config.json").write_text(json.dumps(config))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer.save_pretrained(folder)
    return folder


def test_hf_folder_matches_gguf(hf_folder, smollm2):
    from_folder = load_checkpoint(hf_folder, show_progress=False)
    assert from_folder.config.num_layers == smollm2.config.num_layers
    assert from_folder.config.tie_word_embeddings == smollm2.config.tie_word_embeddings
    for prompt in PROMPTS:
        assert from_folder.tokenizer.encode(prompt) == smollm2.tokenizer.encode(prompt)
    params = SamplingParams(max_tokens=12)
    config = EngineConfig(pool_blocks=(256,))
    expected = [o.token_ids for o in LLMEngine(smollm2, config).generate(PROMPTS, params)]
    got = [o.token_ids for o in LLMEngine(from_folder, config).generate(PROMPTS, params)]
    assert got == expected


def tiny_folder(path, smollm2, tie, drop=()):
    """A one-layer random Llama folder with the embedded model's tokenizer, ``drop`` left out."""
    vocab, hidden, ff = smollm2.tokenizer.vocab_size, 8, 16
    layer = "model.layers.0."
    state = {"model.embed_tokens.weight": torch.randn(vocab, hidden), "model.norm.weight": torch.ones(hidden),
             "lm_head.weight": torch.randn(vocab, hidden),
             layer + "input_layernorm.weight": torch.ones(hidden), layer + "post_attention_layernorm.weight": torch.ones(hidden),
             layer + "self_attn.q_proj.weight": torch.randn(hidden, hidden), layer + "self_attn.k_proj.weight": torch.randn(4, hidden),
             layer + "self_attn.v_proj.weight": torch.randn(4, hidden), layer + "self_attn.o_proj.weight": torch.randn(hidden, hidden),
             layer + "mlp.gate_proj.weight": torch.randn(ff, hidden), layer + "mlp.up_proj.weight": torch.randn(ff, hidden),
             layer + "mlp.down_proj.weight": torch.randn(hidden, ff)}
    for name in drop:
        del state[name]
    path.mkdir()
    save_file(state, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(dict(
        model_type="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=ff, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, rms_norm_eps=1e-5,
        tie_word_embeddings=tie)))
    smollm2.tokenizer._backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    return path


def test_an_untied_folder_without_its_output_head_is_refused_not_tied(tmp_path, smollm2):
    with pytest.raises(ValueError, match="weight 'lm_head' is missing"):
        load_checkpoint(tiny_folder(tmp_path / "untied", smollm2, tie=False, drop=["lm_head.weight"]), show_progress=False)
    with pytest.raises(ValueError, match="weight 'embed_tokens' is missing"):
        load_checkpoint(tiny_folder(tmp_path / "tied", smollm2, tie=True, drop=["model.embed_tokens.weight"]),
                        show_progress=False)
    tied = load_checkpoint(tiny_folder(tmp_path / "ok", smollm2, tie=True, drop=["lm_head.weight"]), show_progress=False)
    assert tied.weights["lm_head"] is tied.weights["embed_tokens"]
