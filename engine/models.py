"""Policy models and tokenizers: the embedded demo model built from a config, or a local HF directory."""

from __future__ import annotations

from pathlib import Path

import torch

from bitrl.engine.tasks import CharTokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_demo_model(cfg, vocab_size: int, max_positions: int = 64):
    """A small randomly initialised Qwen2- or Llama-architecture causal LM. cfg: ModelConfig."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = {
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "llama": (LlamaConfig, LlamaForCausalLM),
    }[cfg.arch]
    config = config_cls(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=cfg.tie_embeddings,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return model_cls(config).to(DTYPES[cfg.dtype])


def load_pretrained(path: str | Path, dtype: str = "float32"):
    """(model, tokenizer) from a local directory holding config.json, safetensors weights and a tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"model.path: {str(path)!r} has no config.json")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
    if (path / "char_tokenizer.json").is_file():
        tokenizer = CharTokenizer.from_pretrained(path)
    else:
        tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"model.path: the tokenizer in {path} has no eos token")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token_id = tokenizer.eos_token_id
    return model, tokenizer
