"""Tokenizer and chat template, from a GGUF file's metadata or a Hugging Face folder.

GGUF byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``: SmolLM, Llama 3, Qwen2)
are rebuilt with the ``tokenizers`` library from the file's tokens, merges and pre-tokenizer
name. SentencePiece vocabularies (``"llama"``: Llama 2) go through ``transformers``' GGUF
converter, which is then needed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from tokenizers import AddedToken, Regex, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

# Pre-tokenizer split patterns of llama.cpp's pre-tokenizer names (llama-vocab.cpp).
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# GGUF token types (llama.cpp's llama_token_type): control and user-defined tokens are never split.
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in ("llama-bpe", "llama3", "dbrx", "smaug-bpe"):
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_LLAMA3_PATTERN), behavior="isolated"), byte_level]
        )
    if pre in ("qwen2", "deepseek-r1-qwen"):
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_QWEN2_PATTERN), behavior="isolated"), byte_level]
        )
    if pre in ("smollm", "starcoder", "refact"):
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        )
    if pre in ("gpt2", "default", ""):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre)")


@dataclass(frozen=True)
class ChatMessage:
    role: str  # "system", "user" or "assistant"
    content: str


class Tokenizer:
    """Text to token ids and back, with the checkpoint's chat template and stop tokens."""

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        add_bos: bool,
        chat_template: str | None,
    ) -> None:
        self._backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.add_bos = add_bos
        self.chat_template = chat_template

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def token_text(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; a BOS token first if the checkpoint asks for one."""
        # Through encode_batch, which lets go of the GIL while it works (encode does not, with
        # this pre-tokenizer): a server tokenizes a long prompt on a thread, and its event loop
        # must run meanwhile (a prompt of 3 MB held it for 1.9 s). The cost is the same.
        ids = self._backend.encode_batch([text], add_special_tokens=False)[0].ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[ChatMessage | dict[str, str]], *, add_generation_prompt: bool = True) -> str:
        """Render ``messages`` with the checkpoint's Jinja chat template."""
        if not self.chat_template:
            raise ValueError("this checkpoint has no chat template; pass a plain prompt instead")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise ValueError(f"chat template: {message}")

        # As transformers renders templates: loop controls on, and tojson without HTML escapes.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = _tojson
        rows = [m if isinstance(m, dict) else {"role": m.role, "content": m.content} for m in messages]
        special = lambda i: self._backend.id_to_token(i) if i is not None else ""  # noqa: E731
        return env.from_string(self.chat_template).render(
            messages=rows,
            add_generation_prompt=add_generation_prompt,
            bos_token=special(self.bos_token_id),
            eos_token=special(self.eos_token_ids[0] if self.eos_token_ids else None),
        )

    @classmethod
    def from_gguf_fields(cls, fields: dict[str, Any]) -> "Tokenizer":
        """Build from a GGUF file's ``tokenizer.*`` metadata (already decoded to Python values)."""
        kind = fields.get("tokenizer.ggml.model")
        if kind is None:
            raise ValueError("the GGUF file has no tokenizer (tokenizer.ggml.model is missing)")
        tokens: list[str] = fields["tokenizer.ggml.tokens"]
        bos = fields.get("tokenizer.ggml.bos_token_id")
        eos = fields.get("tokenizer.ggml.eos_token_id")
        eos_ids = [eos] if eos is not None else []
        eot = fields.get("tokenizer.ggml.eot_token_id")
        if eot is not None and eot not in eos_ids:
            eos_ids.append(eot)
        template = fields.get("tokenizer.chat_template")
        if kind == "gpt2":
            vocab = {tok: i for i, tok in enumerate(tokens)}
            merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
            backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
            backend.pre_tokenizer = _pre_tokenizer(fields.get("tokenizer.ggml.pre", "default"))
            backend.decoder = decoders.ByteLevel()
            token_types = fields.get("tokenizer.ggml.token_type") or []
            special = [
                AddedToken(tokens[i], special=True, normalized=False)
                for i, kind_id in enumerate(token_types)
                if kind_id in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)
            ]
            backend.add_special_tokens(special)
            add_bos = bool(fields.get("tokenizer.ggml.add_bos_token", False))
            return cls(backend, bos_token_id=bos, eos_token_ids=eos_ids, add_bos=add_bos, chat_template=template)
        if kind == "llama":
            return cls._from_sentencepiece_gguf(fields, bos, eos_ids, template)
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r}: expected 'gpt2' (byte-level BPE) or 'llama'")

    @classmethod
    def _from_sentencepiece_gguf(
        cls, fields: dict[str, Any], bos: int | None, eos_ids: list[int], template: str | None
    ) -> "Tokenizer":
        try:
            from transformers.integrations.ggml import GGUFLlamaConverter, GGUFTokenizerSkeleton
        except ImportError as exc:  # transformers is optional at run time
            raise ValueError("a SentencePiece GGUF tokenizer needs the `transformers` package") from exc
        skeleton = GGUFTokenizerSkeleton(
            {
                "tokens": fields["tokenizer.ggml.tokens"],
                "scores": fields.get("tokenizer.ggml.scores"),
                "token_type": fields.get("tokenizer.ggml.token_type"),
                "bos_token_id": bos,
                "eos_token_id": eos_ids[0] if eos_ids else None,
                "unknown_token_id": fields.get("tokenizer.ggml.unknown_token_id"),
                "padding_token_id": fields.get("tokenizer.ggml.padding_token_id"),
                "add_bos_token": fields.get("tokenizer.ggml.add_bos_token", True),
            }
        )
        backend = GGUFLlamaConverter(skeleton).converted()
        add_bos = bool(fields.get("tokenizer.ggml.add_bos_token", True))
        # The converter adds BOS through a post-processor; this class adds it itself.
        backend.post_processor = None
        return cls(backend, bos_token_id=bos, eos_token_ids=eos_ids, add_bos=add_bos, chat_template=template)

    @classmethod
    def from_hf_folder(cls, folder: Path, generation_eos: Sequence[int] = ()) -> "Tokenizer":
        """Build from ``tokenizer.json``, ``tokenizer_config.json`` (and ``chat_template.jinja``)."""
        import json

        path = folder / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{folder} has no tokenizer.json")
        backend = HFTokenizer.from_file(str(path))
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}

        def token_id(entry: Any) -> int | None:
            if isinstance(entry, dict):
                entry = entry.get("content")
            return backend.token_to_id(entry) if isinstance(entry, str) else None

        bos = token_id(config.get("bos_token"))
        eos_ids = [i for i in [token_id(config.get("eos_token")), *generation_eos] if i is not None]
        template = config.get("chat_template")
        template_file = folder / "chat_template.jinja"
        if template is None and template_file.is_file():
            template = template_file.read_text()
        # The post-processor may add BOS; ask whether encoding nothing yields it.
        add_bos = bos is not None and backend.encode("", add_special_tokens=True).ids[:1] == [bos]
        backend.post_processor = None
        return cls(backend, bos_token_id=bos, eos_token_ids=list(dict.fromkeys(eos_ids)), add_bos=add_bos,
                   chat_template=template)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    """Jinja's ``tojson`` as chat templates expect it: plain JSON, no HTML escapes."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without splitting a multi-byte character.

    Each ``add`` decodes a window of a few tokens, not the whole output (which made a long
    output's detokenisation quadratic: 1.5 ms a token at 16K tokens on the development CPU):
    the tokens read last time as context, then the new ones. The context's own text is taken off
    the window's, so a decoder that treats a text's first token differently (a leading space
    stripped) changes nothing of the delta.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._token_ids: list[int] = []
        self._prefix_offset = 0  # ids[prefix_offset:read_offset]: the context, already text
        self._read_offset = 0  # ids from here on are not text yet
        self.text = ""

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the newly completed text (may be empty)."""
        self._token_ids.extend(token_ids)
        delta = self._unread_text()
        # A trailing U+FFFD means an incomplete UTF-8 sequence: wait for the next token.
        if not delta or delta.endswith("\ufffd"):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._token_ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the output's end: the text held back waiting for the rest of a character, as the
        full decode renders it (U+FFFD for an incomplete one)."""
        delta = self._unread_text()
        self._prefix_offset = self._read_offset = len(self._token_ids)
        self.text += delta
        return delta

    def _unread_text(self) -> str:
        """The text of the tokens from ``read_offset`` on, decoded after their context."""
        decode = self._tokenizer.decode
        prefix_text = decode(self._token_ids[self._prefix_offset:self._read_offset])
        new_text = decode(self._token_ids[self._prefix_offset:])
        return new_text[len(prefix_text):]
