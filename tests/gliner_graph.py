"""GLiNER-shaped model folders for tests: plumbing, not a trained model.

`build_gliner_model` writes what a GLiNER ONNX export on the hub holds (`onnx/model.onnx`,
`tokenizer.json`, `gliner_config.json`), but the graph is built here with `onnx.helper` and
computes known scores from lookup tables instead of running a transformer. Its inputs and its
output are exactly those of GLiNER's export (gliner/model.py, `_get_onnx_input_spec` of
UniEncoderSpanGLiNER and UniEncoderTokenGLiNER): the same names, dtypes (int64 everywhere,
`span_mask` bool), ranks and dynamic axis names, so the engine cannot tell it from a real one.

What the graph computes (context-free, so a window of a long text scores a span exactly as the
whole text would):

- the label of class c is the token right after the c-th `<<ENT>>` of the prompt (a real model
  reads the `<<ENT>>` token itself, contextualised by the encoder; here the next token stands in
  for that context), so a label that splits into several sub-tokens is known by its first one;
- word j (words_mask == j + 1) is known by that token: its first sub-token;
- span head: logit(start, end, c) = BEGIN[start word, c] + END[end word, c] - the OUT costs of
  the words from start to end; [batch, words, max_width, labels], words = num_spans / max_width;
- token head: START, END and INSIDE logits per word and label; [batch, words, labels, 3] with
  words = max(text_lengths); GLiNER decodes a span as min(start, end, every inside) after the
  sigmoid.

The tables are the dictionaries below, keyed by (first sub-token of the word, first sub-token
of the label); anything not listed scores DEFAULT_LOGIT. `span_candidates` and
`token_candidates` compute the same scores in plain Python, for the tests to compare against.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

from inference.transport.entities import Span

ENT = "<<ENT>>"
SEP = "<<SEP>>"
OPSET = 17
DEFAULT_LOGIT = -6.0
# A word that belongs to no entity costs this much inside a span, so spans running across plain
# words (two persons and the verb between them) score far below any threshold.
OUT_COST = 4.0

# The spec's sentences (§13) and the ones the tests add: a nested city, a label of two sub-tokens.
MARIO = "Mario Rossi works in Milan for Ferrari."
TIM = "Tim Cook announced the iPhone 17 in Cupertino."
ANNA = "Anna opened an account at the Bank of Milan."
LUCA = "Luca joined Juventus in Turin."
LABELS = ["person", "city", "company", "product"]
# Labels that no word scores for: they fill families when a request has more than eight.
DISTRACTORS = ["date", "country", "language", "event", "animal", "color", "sport", "vehicle"]

# Whole words of the vocabulary; the pieces below split the words the tests need split
# ("Rossi" -> Ros ##si, "Cupertino" -> Cup ##ert ##ino, "organisation" -> organ ##isation).
WORDS = (
    "Mario works in Milan for Tim Cook announced the 17 Anna opened an account at Bank of Luca joined "
    "Juventus Turin . , we talked then walked home and met again".split()
    + LABELS
    + DISTRACTORS
)
PIECES = ["Ros", "##si", "Fer", "##rari", "Cup", "##ert", "##ino", "i", "##Phone", "organ", "##isation"]
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]

# Span head, keyed by first sub-tokens. Scores after the sigmoid: Mario Rossi 0.9707 (Mario
# alone 0.6225), Milan 0.9241, Ferrari 0.9047, Tim Cook 0.9526, iPhone 17 0.9526 (iPhone alone
# 0.7311), Cupertino 0.9526, Anna 0.9526, Bank of Milan 0.9707, Luca 0.9241, Turin 0.8808,
# Juventus (organisation) 0.9526.
SPAN_BEGIN = {
    ("Mario", "person"): 2.0,
    ("Tim", "person"): 2.0,
    ("Anna", "person"): 1.5,
    ("Luca", "person"): 1.25,
    ("Milan", "city"): 1.25,
    ("Cup", "city"): 1.5,
    ("Turin", "city"): 1.0,
    ("Fer", "company"): 1.125,
    ("Bank", "company"): 2.0,
    ("i", "product"): 2.0,
    ("Juventus", "organ"): 1.5,
}
SPAN_END = {
    ("Ros", "person"): 1.5,
    ("Mario", "person"): -1.5,
    ("Cook", "person"): 1.0,
    ("Anna", "person"): 1.5,
    ("Luca", "person"): 1.25,
    ("Milan", "city"): 1.25,
    ("Cup", "city"): 1.5,
    ("Turin", "city"): 1.0,
    ("Fer", "company"): 1.125,
    ("Milan", "company"): 1.5,
    ("17", "product"): 1.0,
    ("i", "product"): -1.0,
    ("Juventus", "organ"): 1.5,
}
# Words inside entities cost nothing ("of" in "Bank of Milan"); every other word costs OUT_COST.
ENTITY_TOKENS = set("Mario Ros Tim Cook Anna Luca Juventus Milan Cup Turin Fer Bank of i 17".split())

# Token head: each phrase (first sub-tokens of its words, label token, logit) sets START on its
# first word, END on its last and INSIDE on all of them (the highest wins where phrases meet).
PHRASES = [
    (("Mario", "Ros"), "person", 3.5),
    (("Mario",), "person", 0.5),
    (("Tim", "Cook"), "person", 3.0),
    (("Anna",), "person", 3.0),
    (("Luca",), "person", 2.5),
    (("Milan",), "city", 2.5),
    (("Cup",), "city", 3.0),
    (("Turin",), "city", 2.0),
    (("Fer",), "company", 2.25),
    (("Bank", "of", "Milan"), "company", 3.5),
    (("i", "17"), "product", 3.0),
    (("i",), "product", 1.0),
    (("Juventus",), "organ", 3.0),
]


def token_tables() -> tuple[dict[tuple[str, str], float], ...]:
    """START, END and INSIDE of the token head, from PHRASES."""
    start: dict[tuple[str, str], float] = {}
    end: dict[tuple[str, str], float] = {}
    inside: dict[tuple[str, str], float] = {}
    for words, label, logit in PHRASES:
        for table, keys in ((start, words[:1]), (end, words[-1:]), (inside, words)):
            for word in keys:
                table[word, label] = max(table.get((word, label), logit), logit)
    return start, end, inside


def build_tokenizer() -> Tokenizer:
    """A small WordPiece tokenizer over the test sentences, with GLiNER's two prompt tokens
    added the way GLiNER adds them (plain added tokens) and BERT's [CLS] ... [SEP] template.
    The BERT normalizer drops format characters, so a zero-width space is a word of no token."""
    vocab = {token: i for i, token in enumerate(dict.fromkeys(SPECIALS + WORDS + PIECES))}
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=False, strip_accents=False, lowercase=False
    )
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])]
    )
    tokenizer.add_tokens([ENT, SEP])
    return tokenizer


def build_gliner_model(
    folder: Path,
    *,
    head: str = "span",
    max_width: int = 12,
    max_len: int = 384,
    graph_in_onnx_folder: bool = True,
    config: dict[str, object] | None = None,
) -> Path:
    """Write a GLiNER model folder: `onnx/model.onnx` (or `model.onnx` with
    `graph_in_onnx_folder` false), `tokenizer.json` and `gliner_config.json`. `head` is "span"
    (span_mode markerV0) or "token" (span_mode token_level); `config` adds or replaces keys of
    gliner_config.json. Returns the folder (the model block's weights_path)."""
    assert head in ("span", "token")
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    tokenizer.save(str(folder / "tokenizer.json"))
    settings: dict[str, object] = {
        "model_name": "plumbing/gliner-shaped-test-graph",
        "max_width": max_width,
        "max_len": max_len,
        "span_mode": "markerV0" if head == "span" else "token_level",
        "ent_token": ENT,
        "sep_token": SEP,
        "words_splitter_type": "whitespace",
        "max_types": 25,
        **(config or {}),
    }
    (folder / "gliner_config.json").write_text(json.dumps(settings, indent=2))
    graph = folder / "onnx" / "model.onnx" if graph_in_onnx_folder else folder / "model.onnx"
    graph.parent.mkdir(exist_ok=True)
    model = _span_graph(tokenizer, max_width) if head == "span" else _token_graph(tokenizer)
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(graph))
    return folder


# -- the graphs ----------------------------------------------------------------------------------


def _table(tokenizer: Tokenizer, values: dict[tuple[str, str], float]) -> np.ndarray:
    """A [vocab * vocab] float32 table indexed by word token * vocab + label token."""
    size = tokenizer.get_vocab_size()
    table = np.full((size, size), DEFAULT_LOGIT, dtype=np.float32)
    for (word, label), value in values.items():
        table[_id(tokenizer, word), _id(tokenizer, label)] = value
    return table.reshape(-1)


def _id(tokenizer: Tokenizer, token: str) -> int:
    found = tokenizer.token_to_id(token)
    assert found is not None, f"{token!r} is not in the test vocabulary"
    return found


def _const(name: str, value: np.ndarray) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(value, name))


def _i64(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def _text_inputs() -> list[onnx.ValueInfoProto]:
    """input_ids, attention_mask, words_mask and text_lengths, as GLiNER's export declares them."""
    seq = ["batch_size", "sequence_length"]
    return [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, seq),
        helper.make_tensor_value_info("attention_mask", TensorProto.INT64, seq),
        helper.make_tensor_value_info("words_mask", TensorProto.INT64, seq),
        helper.make_tensor_value_info("text_lengths", TensorProto.INT64, ["batch_size", "value"]),
    ]


def _words_and_labels(tokenizer: Tokenizer, n_words: str) -> list[onnx.NodeProto]:
    """Nodes that compute `word_tok` [B, W] (each word's first sub-token; 0 for a word with no
    token) and `label_tok` [B, C] (the token after each <<ENT>>), W being the scalar `n_words`."""
    size = tokenizer.get_vocab_size()
    n = helper.make_node
    return [
        # The labels: the token after each <<ENT>>, in prompt order, one row per batch item.
        _const("ent_id", _i64(_id(tokenizer, ENT))),
        n("Equal", ["input_ids", "ent_id"], ["ent_hits"]),
        n("NonZero", ["ent_hits"], ["ent_at"]),
        n("Transpose", ["ent_at"], ["ent_at_rows"], perm=[1, 0]),
        _const("next_token", _i64(0, 1).reshape(1, 2)),
        n("Add", ["ent_at_rows", "next_token"], ["label_at"]),
        n("GatherND", ["input_ids", "label_at"], ["label_tok_flat"]),
        n("Shape", ["input_ids"], ["batch"], start=0, end=1),
        _const("minus_one", _i64(-1)),
        n("Concat", ["batch", "minus_one"], ["label_shape"], axis=0),
        n("Reshape", ["label_tok_flat", "label_shape"], ["label_tok"]),
        n("Shape", ["label_tok"], ["n_labels"], start=1, end=2),
        # The words: word j is the token whose words_mask is j + 1 (padding has mask 0).
        _const("one", _i64(1)),
        _const("one_scalar", np.array(1, dtype=np.int64)),
        n("Add", [n_words, "one_scalar"], ["word_limit"]),
        n("Range", ["one_scalar", "word_limit", "one_scalar"], ["word_numbers"]),
        _const("word_axis", _i64(1, -1, 1)),
        n("Reshape", ["word_numbers", "word_axis"], ["word_numbers_3d"]),
        n("Mul", ["words_mask", "attention_mask"], ["live_words_mask"]),
        n("Unsqueeze", ["live_words_mask", "one"], ["words_mask_3d"]),
        n("Equal", ["words_mask_3d", "word_numbers_3d"], ["word_hits"]),
        n("Cast", ["word_hits"], ["word_hits_f"], to=TensorProto.FLOAT),
        n("Unsqueeze", ["input_ids", "one"], ["ids_3d"]),
        n("Cast", ["ids_3d"], ["ids_3d_f"], to=TensorProto.FLOAT),
        n("Mul", ["word_hits_f", "ids_3d_f"], ["word_ids_f"]),
        _const("token_axis", _i64(2)),
        n("ReduceSum", ["word_ids_f", "token_axis"], ["word_tok_f"], keepdims=0),
        n("Cast", ["word_tok_f"], ["word_tok"], to=TensorProto.INT64),
        # Table index word * vocab + label, [B, W, C].
        _const("vocab", _i64(size)),
        _const("two", _i64(2)),
        n("Unsqueeze", ["word_tok", "two"], ["word_tok_3d"]),
        n("Mul", ["word_tok_3d", "vocab"], ["word_rows"]),
        n("Unsqueeze", ["label_tok", "one"], ["label_tok_3d"]),
        n("Add", ["word_rows", "label_tok_3d"], ["pair_index"]),
    ]


def _span_graph(tokenizer: Tokenizer, max_width: int) -> onnx.ModelProto:
    n = helper.make_node
    inputs = _text_inputs() + [
        helper.make_tensor_value_info("span_idx", TensorProto.INT64, ["batch_size", "num_spans", "idx"]),
        helper.make_tensor_value_info("span_mask", TensorProto.BOOL, ["batch_size", "num_spans"]),
    ]
    # GLiNER's export names the axes of the [batch, words, max_width, labels] logits so.
    output = helper.make_tensor_value_info(
        "logits", TensorProto.FLOAT, ["batch_size", "sequence_length", "num_spans", "num_classes"]
    )
    out_costs = np.full(tokenizer.get_vocab_size(), OUT_COST, dtype=np.float32)
    for token in ENTITY_TOKENS:
        out_costs[_id(tokenizer, token)] = 0.0
    nodes = [
        # As in GLiNER: the words are num_spans / max_width, and masked spans become (0, 0).
        n("Shape", ["span_idx"], ["n_spans"], start=1, end=2),
        _const("max_width", _i64(max_width)),
        n("Div", ["n_spans", "max_width"], ["n_words_1d"]),
        n("Squeeze", ["n_words_1d"], ["n_words"]),
        *_words_and_labels(tokenizer, "n_words"),
        _const("begin_table", _table(tokenizer, SPAN_BEGIN)),
        _const("end_table", _table(tokenizer, SPAN_END)),
        _const("out_table", out_costs),
        n("Gather", ["begin_table", "pair_index"], ["begin"]),
        n("Gather", ["end_table", "pair_index"], ["end"]),
        n("Gather", ["out_table", "word_tok"], ["out"]),
        n("CumSum", ["out", "one_scalar"], ["out_sum"]),
        n("Cast", ["span_mask"], ["span_mask_i"], to=TensorProto.INT64),
        n("Unsqueeze", ["span_mask_i", "two"], ["span_mask_3d"]),
        n("Mul", ["span_idx", "span_mask_3d"], ["spans"]),
        _const("first", np.array(0, dtype=np.int64)),
        _const("last", np.array(1, dtype=np.int64)),
        n("Gather", ["spans", "first"], ["starts"], axis=2),
        n("Gather", ["spans", "last"], ["ends"], axis=2),
        n("Shape", ["starts"], ["starts_shape"]),
        n("Concat", ["starts_shape", "n_labels"], ["per_label_shape"], axis=0),
        n("Unsqueeze", ["starts", "two"], ["starts_3d"]),
        n("Unsqueeze", ["ends", "two"], ["ends_3d"]),
        n("Expand", ["starts_3d", "per_label_shape"], ["starts_per_label"]),
        n("Expand", ["ends_3d", "per_label_shape"], ["ends_per_label"]),
        n("GatherElements", ["begin", "starts_per_label"], ["span_begin"], axis=1),
        n("GatherElements", ["end", "ends_per_label"], ["span_end"], axis=1),
        n("GatherElements", ["out_sum", "ends"], ["out_to_end"], axis=1),
        n("GatherElements", ["out_sum", "starts"], ["out_to_start"], axis=1),
        n("GatherElements", ["out", "starts"], ["out_at_start"], axis=1),
        n("Sub", ["out_to_end", "out_to_start"], ["out_after_start"]),
        n("Add", ["out_after_start", "out_at_start"], ["span_out"]),
        n("Unsqueeze", ["span_out", "two"], ["span_out_3d"]),
        n("Add", ["span_begin", "span_end"], ["span_edges"]),
        n("Sub", ["span_edges", "span_out_3d"], ["span_logits"]),
        n("Concat", ["batch", "n_words_1d", "max_width", "n_labels"], ["logits_shape"], axis=0),
        n("Reshape", ["span_logits", "logits_shape"], ["logits"]),
    ]
    graph = helper.make_graph(nodes, "gliner_span_plumbing", inputs, [output])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])


def _token_graph(tokenizer: Tokenizer) -> onnx.ModelProto:
    n = helper.make_node
    # GLiNER's export names the axes of the [batch, words, labels, 3] logits so (its names are
    # those of another layout; the decoder reads the tensor as [batch, words, labels, 3]).
    output = helper.make_tensor_value_info(
        "logits", TensorProto.FLOAT, ["position", "batch_size", "sequence_length", "num_classes"]
    )
    start, end, inside = token_tables()
    nodes = [
        # As in GLiNER's token model: as many words as the longest text of the batch.
        n("ReduceMax", ["text_lengths"], ["n_words_2d"], keepdims=0),
        n("Identity", ["n_words_2d"], ["n_words"]),
        *_words_and_labels(tokenizer, "n_words"),
        _const("start_table", _table(tokenizer, start)),
        _const("end_table", _table(tokenizer, end)),
        _const("inside_table", _table(tokenizer, inside)),
        _const("three", _i64(3)),
    ]
    for part in ("start", "end", "inside"):
        nodes += [
            n("Gather", [f"{part}_table", "pair_index"], [part]),
            n("Unsqueeze", [part, "three"], [f"{part}_4d"]),
        ]
    nodes.append(n("Concat", ["start_4d", "end_4d", "inside_4d"], ["logits"], axis=3))
    graph = helper.make_graph(nodes, "gliner_token_plumbing", _text_inputs(), [output])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])


# -- the same scores in plain Python ---------------------------------------------------------------

WORD = re.compile(r"\w+(?:[-_]\w+)*|\S")


def words_of(text: str) -> list[tuple[int, int]]:
    """GLiNER's whitespace splitter: each word's [start, end) in the text."""
    return [(m.start(), m.end()) for m in WORD.finditer(text)]


def first_token(tokenizer: Tokenizer, word: str) -> str:
    """The word's first sub-token ([PAD], the graph's 0, for a word that makes none)."""
    tokens = tokenizer.encode([word], is_pretokenized=True, add_special_tokens=False).tokens
    return tokens[0] if tokens else "[PAD]"


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def span_candidates(text: str, labels: list[str], threshold: float, max_width: int = 12) -> list[Span]:
    """Every span of the span head scoring at least `threshold`, by brute force over the words."""
    tokenizer = build_tokenizer()
    words = words_of(text)
    tokens = [first_token(tokenizer, text[a:b]) for a, b in words]
    found = []
    for label in dict.fromkeys(labels):
        key = first_token(tokenizer, label)
        for s in range(len(words)):
            for e in range(s, min(s + max_width, len(words))):
                cost = sum(0.0 if t in ENTITY_TOKENS else OUT_COST for t in tokens[s : e + 1])
                logit = SPAN_BEGIN.get((tokens[s], key), DEFAULT_LOGIT) + SPAN_END.get((tokens[e], key), DEFAULT_LOGIT)
                score = sigmoid(logit - cost)
                if score >= threshold:
                    found.append(Span(start=words[s][0], end=words[e][1], label=label, score=score))
    return found


def token_candidates(text: str, labels: list[str], threshold: float) -> list[Span]:
    """Every span of the token head scoring at least `threshold`: GLiNER's token decoding, the
    minimum of its start, end and every inside score."""
    tokenizer = build_tokenizer()
    start, end, inside = token_tables()
    words = words_of(text)
    tokens = [first_token(tokenizer, text[a:b]) for a, b in words]
    found = []
    for label in dict.fromkeys(labels):
        key = first_token(tokenizer, label)
        for s in range(len(words)):
            for e in range(s, len(words)):
                scores = [sigmoid(start.get((tokens[s], key), DEFAULT_LOGIT))]
                scores.append(sigmoid(end.get((tokens[e], key), DEFAULT_LOGIT)))
                scores += [sigmoid(inside.get((t, key), DEFAULT_LOGIT)) for t in tokens[s : e + 1]]
                if min(scores) >= threshold:
                    found.append(Span(start=words[s][0], end=words[e][1], label=label, score=min(scores)))
    return found
