"""Bad input gives a clear error and leaves the engine usable."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter
from gguf import quants as gguf_quants

from infinite_llm.engine.config import EngineConfig
from infinite_llm.engine.engine import LLMEngine, RequestRejected
from infinite_llm.engine.loader import load_checkpoint
from infinite_llm.engine.quants import UnsupportedQuantization, dequantize
from infinite_llm.engine.sampling import SamplingParams


@pytest.fixture(scope="module")
def engine(smollm2):
    return LLMEngine(smollm2, EngineConfig(block_size=16, pool_blocks=(64,), max_num_batched_tokens=256))


def test_empty_prompt(engine):
    with pytest.raises(RequestRejected, match="the prompt is empty"):
        engine.add_request("")
    with pytest.raises(RequestRejected, match="the prompt is empty"):
        engine.add_request([])


def test_prompt_longer_than_the_context(engine):
    with pytest.raises(RequestRejected, match="the prompt has 8192 tokens; the model's context is 8192 tokens"):
        engine.add_request([1] * 8192)


def test_token_outside_the_vocabulary(engine):
    with pytest.raises(RequestRejected, match=r"prompt token id 49152 is outside the vocabulary \[0, 49152\)"):
        engine.add_request([1, 49152])


def test_request_larger_than_every_pool_is_refused(engine):
    with pytest.raises(RequestRejected, match="needs KV for up to 1099 tokens = 69 KV blocks, but the pools hold 64 blocks"):
        engine.add_request([1] * 100, SamplingParams(max_tokens=1000))
    assert not engine.has_unfinished


def test_a_request_whose_written_tokens_just_fit_is_accepted(engine):
    # 100 + 925 tokens, the last never written: 1024 tokens = the 64 blocks of 16.
    request_id = engine.add_request([1] * 100, SamplingParams(max_tokens=925))
    engine.abort(request_id)
    with pytest.raises(RequestRejected, match="up to 1025 tokens = 65 KV blocks"):
        engine.add_request([1] * 100, SamplingParams(max_tokens=926))
    assert not engine.has_unfinished


def test_generate_refuses_a_params_list_of_another_length(engine):
    with pytest.raises(RequestRejected, match="2 prompts but 1 sampling params"):
        engine.generate(["a", "b"], [SamplingParams(max_tokens=1)])
    assert not engine.has_unfinished


def test_a_bytes_prompt_is_refused_not_taken_as_token_ids(engine):
    for prompt in (b"hello", bytearray(b"hello")):
        with pytest.raises(RequestRejected, match="decode bytes to a string first"):
            engine.add_request(prompt)
    assert not engine.has_unfinished


def test_request_without_memory_waits_then_runs(engine):
    # Each request may need all 64 blocks; the second waits until the first is done.
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    first = engine.add_request([1] * 1000, params)
    second = engine.add_request([1] * 1000, params)
    done = []
    while engine.has_unfinished:
        outputs = engine.step()
        assert {o.request_id for o in outputs} <= {first, second}
        if second in {o.request_id for o in outputs}:
            assert first in done
        done += [o.request_id for o in outputs if o.finished]
    assert done == [first, second]


def test_missing_file():
    with pytest.raises(FileNotFoundError, match="no model at /nonexistent/model.gguf"):
        load_checkpoint("/nonexistent/model.gguf")


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="is not a GGUF file"):
        load_checkpoint(path)


def test_folder_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_checkpoint(tmp_path)


def test_unknown_quantisation_type_is_named(tmp_path):
    """A tensor in IQ2_XXS (not decoded by this engine) fails loading with its name and type."""
    writer = GGUFWriter(tmp_path / "tiny.gguf", "llama")
    block, size = gguf_quants.GGML_QUANT_SIZES[GGMLQuantizationType.IQ2_XXS]
    raw = np.zeros((4, size), dtype=np.uint8)
    with pytest.raises(UnsupportedQuantization, match="tensor 'blk.0.attn_q.weight' is stored as GGML type IQ2_XXS"):
        dequantize(raw, GGMLQuantizationType.IQ2_XXS, (4, block), "blk.0.attn_q.weight")
    writer.close()


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "F16", "BF16"])
def test_dequantize_matches_the_gguf_package(qtype):
    qtype = GGMLQuantizationType[qtype]
    weights = np.random.default_rng(0).standard_normal((8, 512)).astype(np.float32)
    raw = gguf_quants.quantize(weights, qtype)
    expected = gguf_quants.dequantize(raw, qtype)
    got = dequantize(raw, qtype, (8, 512), "w").numpy()
    np.testing.assert_array_equal(got, expected.astype(np.float32))


def test_chat_messages_the_template_cannot_render_are_refused():
    """No chat template, or one that refuses the messages (a role out of its order), is the
    request's error, not the server's."""
    from types import SimpleNamespace

    def no_template(messages):
        raise ValueError("this checkpoint has no chat template; pass a plain prompt instead")

    def strict_template(messages):
        from jinja2 import TemplateError
        raise TemplateError("conversation roles must alternate user/assistant")

    for render in (no_template, strict_template):
        stub = SimpleNamespace(tokenizer=SimpleNamespace(apply_chat_template=render))
        with pytest.raises(RequestRejected, match="chat template cannot render"):
            LLMEngine.prompt_token_ids(stub, [{"role": "assistant", "content": "hi"}])
    with pytest.raises(RequestRejected, match="a prompt is a string"):
        LLMEngine.prompt_token_ids(SimpleNamespace(), 5)


def _embedded_copy(tmp_path, edit):
    """The embedded GGUF copied, then ``edit(bytearray)`` applied to its bytes."""
    from infinite_llm.engine.loader import embedded_model_path
    data = bytearray(embedded_model_path().read_bytes())
    edit(data)
    path = tmp_path / "edited.gguf"
    path.write_bytes(bytes(data))
    return path


def test_a_truncated_gguf_file_is_named_as_such(tmp_path):
    path = _embedded_copy(tmp_path, lambda data: data.__delitem__(slice(983, None)))
    with pytest.raises(ValueError, match=f"cannot read GGUF file {path}"):
        load_checkpoint(path)


def _renaming(old: bytes, new: bytes):
    """An edit renaming the tensor ``old`` to ``new``, of the same length: the file stays well formed."""
    def rename(data):
        at = data.index(old)
        data[at:at + len(old)] = new
    return rename


def test_a_gguf_file_without_its_token_embedding_names_the_tensor(tmp_path):
    path = _embedded_copy(tmp_path, _renaming(b"token_embd.weight", b"token_embx.weight"))
    with pytest.raises(ValueError, match="tensor 'token_embd.weight' .* is missing"):
        load_checkpoint(path)


def test_a_gguf_layer_tensor_without_a_layer_number_is_named(tmp_path):
    path = _embedded_copy(tmp_path, _renaming(b"blk.0.ffn_up.weight", b"blk.X.ffn_up.weight"))
    with pytest.raises(ValueError, match="'blk.X.ffn_up.weight' does not name its layer by number"):
        load_checkpoint(path)


def test_streamed_text_equals_the_full_decode_over_a_long_output(smollm2):
    """The detokeniser decodes a window per token, not the whole output: its text, streamed,
    must equal a decode of every id, multi-byte characters split across tokens included; an
    output that ends inside a character flushes it as the full decode renders it."""
    from infinite_llm.engine.tokenizer import IncrementalDetokenizer
    tokenizer = smollm2.tokenizer
    text = "Grüße aus Köln! 東京タワー 🙂👍🏽 naïve café — ∑ x² " * 20
    ids = tokenizer.encode(text, add_special_tokens=False)
    rng = np.random.default_rng(0)
    ids = ids + [int(i) for i in rng.integers(0, 49000, 200)]  # random tokens, any bytes
    detokenizer = IncrementalDetokenizer(tokenizer)
    streamed = "".join(detokenizer.add([i]) for i in ids)
    streamed += detokenizer.flush()
    assert streamed == detokenizer.text == tokenizer.decode(ids)
    cut = tokenizer.encode("x🙂", add_special_tokens=False)[:-1]  # ends inside the emoji
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert "".join(detokenizer.add([i]) for i in cut) == "x"
    assert detokenizer.flush() == tokenizer.decode(cut)[1:] and detokenizer.text == tokenizer.decode(cut)


def test_chat_templates_render_as_transformers_does():
    """Loop controls work, and tojson writes plain JSON (no HTML escapes)."""
    from infinite_llm.engine.tokenizer import Tokenizer
    template = ("{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}"
                "{{ m.content | tojson }}{% endfor %}")
    tokenizer = Tokenizer.__new__(Tokenizer)
    tokenizer.chat_template = template
    tokenizer.bos_token_id, tokenizer.eos_token_ids = None, []
    rendered = tokenizer.apply_chat_template([{"role": "skip", "content": "no"}, {"role": "user", "content": "a<b & 'c'"}])
    assert rendered == '"a<b & \'c\'"'
