"""What llama.cpp's converter (``convert_hf_to_gguf.py``, llama.cpp as vendored by llama-cpp-python
0.3.36) writes for the decoder architectures quantkit exports: the GGUF architecture, the
hyperparameter keys, tensor names (the ``gguf`` package's own HF -> GGUF name map), Llama's Q/K
row permutation, and the tokenizer (byte-level BPE, ``tokenizer.ggml.model = gpt2``).

Written from the converter's behaviour, not copied: ``TextModel.set_gguf_parameters`` (block
count, context, widths, heads, RoPE base, RMS eps, ``head_dim`` as key/value length),
``LlamaModel`` (``vocab_size``, ``rope.dimension_count``, Q/K permuted so that llama.cpp's RoPE
pairs are adjacent; no BOS for 49152-token vocabularies), ``Qwen2Model`` (biases, no permutation),
``get_vocab_base`` (token list and types) and ``gguf.SpecialVocab`` (merges, special ids, chat template).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .._errors import QuantkitError

__all__ = ["Arch", "ARCHITECTURES", "arch_for", "write_metadata", "write_tokenizer", "qk_rows", "gguf_name"]


@dataclass(frozen=True)
class Arch:
    """An HF architecture as llama.cpp's converter writes it: ``gguf`` the MODEL_ARCH name and
    ``permute_qk`` whether Q/K rows are reordered (Llama's converter does, Qwen2's does not)."""

    gguf: str
    permute_qk: bool


# HF `architectures[0]` -> how the converter writes it (LlamaModel registers Mistral too)
ARCHITECTURES = {
    "LlamaForCausalLM": Arch("LLAMA", True),
    "MistralForCausalLM": Arch("LLAMA", True),
    "Qwen2ForCausalLM": Arch("QWEN2", False),
}


def arch_for(config: dict) -> tuple[str, Arch]:
    """``(hf architecture, Arch)`` from config.json; a one-line error for the others."""
    archs = config.get("architectures") or []
    name = archs[0] if isinstance(archs, list) and archs else None
    if name not in ARCHITECTURES:
        raise QuantkitError(f"GGUF export supports {', '.join(ARCHITECTURES)}; config.json names {name!r}: "
                            "use --format pt2 or compressed-tensors for it")
    rope = _rope(config)
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind != "default":
        raise QuantkitError(f"GGUF export writes default RoPE only; config.json has rope_type {kind!r}")
    return name, ARCHITECTURES[name]


def _rope(config: dict) -> dict:
    # transformers 5 writes rope_parameters, older configs rope_theta / rope_scaling
    rope = dict(config.get("rope_scaling") or {})
    rope.update(config.get("rope_parameters") or {})
    if "rope_theta" not in rope and "rope_theta" in config:
        rope["rope_theta"] = config["rope_theta"]
    return rope


def _head_dim(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def write_metadata(writer, config: dict, arch: Arch, *, name: str, file_type: int) -> None:
    """The hyperparameters llama.cpp reads for ``arch``."""
    writer.add_name(name)
    writer.add_block_count(config["num_hidden_layers"])
    if "max_position_embeddings" in config:
        writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config.get("num_key_value_heads") or config["num_attention_heads"])
    theta = _rope(config).get("rope_theta")
    if theta is not None:
        writer.add_rope_freq_base(float(theta))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    if config.get("head_dim") is not None:
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    writer.add_file_type(file_type)
    if arch.gguf == "LLAMA":
        writer.add_vocab_size(config["vocab_size"])
        writer.add_rope_dimension_count(_head_dim(config))


def qk_rows(key: str, config: dict, arch: Arch, out_features: int) -> torch.Tensor | None:
    """The row order llama.cpp's converter gives a Llama ``q_proj`` / ``k_proj`` weight or bias
    (each head's rotary halves interleaved: ``reshape(heads, 2, d/2).swapaxes(1, 2)``), else None.
    A reordering of output rows: each row's 32-wide input blocks move whole."""
    if not arch.permute_qk or not key.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
        return None
    heads = config["num_attention_heads"]
    if ".k_proj." in key:
        heads = config.get("num_key_value_heads") or heads
    return torch.arange(out_features).reshape(heads, 2, out_features // heads // 2).swapaxes(1, 2).reshape(-1)


def gguf_name(names, key: str) -> str | None:
    """The GGUF tensor name of the HF tensor ``key`` (``gguf.get_tensor_name_map``), else None."""
    return names.get_name(key, try_suffixes=(".weight", ".bias"))


# --- tokenizer ----------------------------------------------------------------------------

def _pre_tokenizer(model_dir: Path, config: dict) -> str:
    """``tokenizer.ggml.pre``: the converter hashes the tokenization of a probe text; here the
    pre-tokenizer of tokenizer.json is read instead (SmolLM's digits + byte-level, Llama-3's
    split regex, Qwen2's), and "default" otherwise."""
    try:
        doc = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "default"
    if config.get("model_type") == "qwen2":
        return "qwen2"
    pre = doc.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers") if pre.get("type") == "Sequence" else [pre]
    types = [p.get("type") for p in parts or [] if isinstance(p, dict)]
    if types == ["Digits", "ByteLevel"] and parts[0].get("individual_digits"):
        return "smollm"
    if types[:1] == ["Split"] and "ByteLevel" in types and "\\p{N}{1,3}" in json.dumps(parts[0]):
        return "llama-bpe"
    return "default"


def write_tokenizer(writer, model_dir: Path, config: dict, arch: Arch) -> str:
    """The vocabulary as llama.cpp's converter writes a byte-level BPE (``gpt2``) tokenizer; returns
    the pre-tokenizer name. A one-line error for other tokenizers."""
    import gguf
    import transformers

    doc = {}
    try:
        doc = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        pass
    model = doc.get("model") or {}
    if model.get("type") != "BPE" or "ByteLevel" not in json.dumps(doc.get("pre_tokenizer")):
        raise QuantkitError(f"{str(model_dir)!r} has no byte-level BPE tokenizer.json (the gpt2 tokenizer model); "
                            "GGUF export writes that tokenizer only so far")
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    vocab = tok.get_vocab()
    n_vocab = config.get("vocab_size", len(vocab))
    if max(vocab.values()) >= n_vocab:
        raise QuantkitError(f"the tokenizer has ids up to {max(vocab.values())}, config.json's vocab_size is {n_vocab}")
    by_id = {i: t for t, i in vocab.items()}
    added = tok.get_added_vocab()
    decoder = tok.added_tokens_decoder
    tokens, types = [], []
    for i in range(n_vocab):
        if i not in by_id:  # ids the tokenizer never produces: placeholders, as the converter writes
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        text = by_id[i]
        if text in added:
            if not decoder[i].normalized:
                text = tok.decode(tok.encode(text, add_special_tokens=False))
            special = decoder[i].special or (text.startswith("<|") and text.endswith("|>")) or \
                (text.startswith("<") and text.endswith(">") and " " not in text and len(text) > 2)
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(text)
    pre = _pre_tokenizer(model_dir, config)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(str(model_dir), load_merges=True, n_vocab=n_vocab).add_to_gguf(writer)
    if arch.gguf == "LLAMA" and n_vocab == 49152:  # the converter's rule for these vocabularies (SmolLM2's too)
        writer.add_add_bos_token(False)
    return pre
