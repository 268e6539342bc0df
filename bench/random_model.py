"""Write a Llama-shaped Hugging Face folder with random weights, for benchmarks on machines
that hold no real checkpoint (the GPU machine reaches no network).

The tokenizer comes from a folder given with ``--tokenizer`` (``tokenizer.json`` and
``tokenizer_config.json``, e.g. written by ``--export-tokenizer`` from the embedded SmolLM2
model); its vocabulary sets the embedding's rows. Weights are normal with a standard deviation
of 0.02 (norms 1.0), so activations stay finite over many layers; the tokens they produce mean
nothing, but every step does the work of a real model of this shape.

    python bench/random_model.py --export-tokenizer .bench-assets/tokenizer
    python bench/random_model.py --shape llama3.2-1b --tokenizer .bench-assets/tokenizer --out /tmp/llama1b
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

# hidden, intermediate, layers, heads, kv heads, head_dim, rope theta
SHAPES = {
    "smollm2-135m": (576, 1536, 30, 9, 3, 64, 100000.0),
    "llama3.2-1b": (2048, 8192, 16, 32, 8, 64, 500000.0),
    "llama3-8b": (4096, 14336, 32, 32, 8, 128, 500000.0),
}


def export_tokenizer(out: Path) -> None:
    """The embedded SmolLM2's tokenizer and chat template as Hugging Face files."""
    import transformers

    from infinite_llm.engine.loader import embedded_model_path

    path = embedded_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)


def write_model(shape: str, tokenizer: Path, out: Path, dtype: torch.dtype, seed: int) -> None:
    from safetensors.torch import save_file

    hidden, ff, layers, heads, kv_heads, head_dim, theta = SHAPES[shape]
    tokenizer_json = json.loads((tokenizer / "tokenizer.json").read_text())
    vocab = len(tokenizer_json["model"]["vocab"]) + len(tokenizer_json.get("added_tokens", []))
    vocab = (vocab + 63) // 64 * 64
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device=device).manual_seed(seed)

    def normal(*size: int) -> torch.Tensor:
        return (torch.randn(*size, generator=generator, device=device) * 0.02).to(dtype).cpu()

    q, kv = heads * head_dim, kv_heads * head_dim
    state = {"model.embed_tokens.weight": normal(vocab, hidden), "lm_head.weight": normal(vocab, hidden),
             "model.norm.weight": torch.ones(hidden, dtype=dtype)}
    for i in range(layers):
        p = f"model.layers.{i}."
        state |= {p + "input_layernorm.weight": torch.ones(hidden, dtype=dtype),
                  p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=dtype),
                  p + "self_attn.q_proj.weight": normal(q, hidden), p + "self_attn.k_proj.weight": normal(kv, hidden),
                  p + "self_attn.v_proj.weight": normal(kv, hidden), p + "self_attn.o_proj.weight": normal(hidden, q),
                  p + "mlp.gate_proj.weight": normal(ff, hidden), p + "mlp.up_proj.weight": normal(ff, hidden),
                  p + "mlp.down_proj.weight": normal(hidden, ff)}
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"))
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab,
              "hidden_size": hidden, "intermediate_size": ff, "num_hidden_layers": layers,
              "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
              "rms_norm_eps": 1e-5, "rope_theta": theta, "max_position_embeddings": 131072,
              "tie_word_embeddings": False, "torch_dtype": str(dtype).removeprefix("torch.")}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (tokenizer / name).is_file():
            shutil.copy(tokenizer / name, out / name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--export-tokenizer", type=Path, default=None, help="write the embedded model's tokenizer here and stop")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3.2-1b")
    parser.add_argument("--tokenizer", type=Path, help="folder with tokenizer.json and tokenizer_config.json")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.export_tokenizer is not None:
        export_tokenizer(args.export_tokenizer)
        return
    if args.tokenizer is None or args.out is None:
        parser.error("--tokenizer and --out are needed to write a model")
    write_model(args.shape, args.tokenizer, args.out, getattr(torch, args.dtype), args.seed)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
