"""Zero-shot entities (spec §13) with GLiNER's ONNX exports, on onnxruntime and the `tokenizers`
library: no torch, no gliner package.

A model folder is what the hub holds for an export: `onnx/model.onnx` (or `model.onnx`),
`tokenizer.json` and `gliner_config.json`. The model block's weights_path names the folder or
the `.onnx` file to run inside it (an export often ships quantized graphs beside the fp32 one).
Tier 2 holds the graph in a memfd and the parsed tokenizer, so a promotion reads no disk.

How a request runs, as GLiNER's own pipeline does (gliner/data_processing, gliner/decoding):

- each text is split into words with GLiNER's whitespace splitter, keeping every word's
  character offsets, so a span's [start, end) indexes the original string;
- the prompt is `<<ENT>> label` for each label, then `<<SEP>>`, then the text's words, encoded
  word by word (`is_pretokenized`); `words_mask` marks each text word's first sub-token with its
  1-based word number; span models also take every (start, start + width) up to max_width;
- more labels than LABELS_PER_FAMILY run family by family, and a text longer than a window
  (max_len words, and the TOKEN_LIMIT tokens the encoder takes with the prompt) runs in
  overlapping windows; the windows of a family go through the graph BATCH_WINDOWS at a time;
- scores are the logits' sigmoid; a span is a candidate at `threshold` or above, and
  inference.transport.entities.select_spans makes the answer from every family's and window's candidates.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime
from tokenizers import Tokenizer

from hypnos_site.config import ModelConfig
from hypnos_site.errors import Cancelled, ModelNotAvailable
from inference.engines.base import Engine, LoadPhases
from inference.engines.onnx_session import open_session
from inference.transport.entities import CANDIDATES_PER_WORD, Span, best_candidates, label_families, select_spans
from memory.planner import Footprint, footprint_from_files

# Estimated from the activations of a base-size export (768 wide, DeBERTa-v3's disentangled
# attention and the markerV0 span head) for a full batch of 512-token windows; not measured,
# since no GLiNER weights reach the machines the suite runs on.
WORKSPACE_BYTES = 512 << 20
# Windows per session.run: enough to keep the matrix kernels busy on a CPU, few enough that a
# batch's activations stay within WORKSPACE_BYTES.
BATCH_WINDOWS = 4
# The encoders GLiNER is built on (DeBERTa-v3, BERT) were pretrained on 512-token sequences,
# where GLiNER's processor truncates; a window's prompt and words stay within it.
TOKEN_LIMIT = 512
# GLiNER's whitespace splitter (gliner/data_processing/tokenizer.py, WhitespaceTokenSplitter):
# words with inner hyphens or underscores, and every other non-space character alone.
WORD = re.compile(r"\w+(?:[-_]\w+)*|\S")
TEXT_INPUTS = ("input_ids", "attention_mask", "words_mask", "text_lengths")
SPAN_INPUTS = (*TEXT_INPUTS, "span_idx", "span_mask")
# numpy dtypes of the input types an export may declare (GLiNER's: int64, span_mask bool).
INPUT_DTYPES: dict[str, type[np.generic]] = {
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(bool)": np.bool_,
}


@dataclass(frozen=True)
class GlinerConfig:
    """What the engine reads from gliner_config.json; a missing key takes GLiNER's default
    (gliner/config.py, BaseGLiNERConfig)."""

    max_width: int = 12
    max_len: int = 384
    ent_token: str = "<<ENT>>"
    sep_token: str = "<<SEP>>"
    span_mode: str = "markerV0"

    @property
    def token_level(self) -> bool:
        """Start/end/inside scores per word (UniEncoderToken) rather than scores per span."""
        return self.span_mode == "token_level"

    @classmethod
    def read(cls, path: Path) -> GlinerConfig:
        raw = json.loads(path.read_text())
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
        config = cls(**{f.name: raw[f.name] for f in fields(cls) if raw.get(f.name) is not None})
        for name in ("max_width", "max_len"):
            value = getattr(config, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, not {value!r}")
        return config


def split_words(text: str) -> list[tuple[int, int]]:
    """The text's words as GLiNER splits them: each word's [start, end) in the text."""
    return [match.span() for match in WORD.finditer(text)]


def plan_windows(token_counts: Sequence[int], budget: int, max_words: int, min_overlap: int) -> list[tuple[int, int]]:
    """The windows [first, end) of word indexes that cover a text whose words take
    `token_counts` tokens: each at most `max_words` words and `budget` tokens (but never empty:
    a word longer than the budget is a window of its own). The next window starts a quarter of
    the window back, at least `min_overlap` words (the model's max_width), so that a span of up
    to max_width words that a window cuts lies whole in the next one."""
    windows: list[tuple[int, int]] = []
    first, n = 0, len(token_counts)
    while first < n:
        end, used = first, 0
        while end < n and end - first < max_words and (end == first or used + token_counts[end] <= budget):
            used += token_counts[end]
            end += 1
        windows.append((first, end))
        if end == n:
            break
        first = max(first + 1, end - max(min_overlap, (end - first) // 4))
    return windows


def owning_window(windows: Sequence[tuple[int, int]], n_words: int, start: int, end: int, near: int = 0) -> int:
    """The window whose score a span of words [start, end] (inclusive) keeps: of the windows
    that hold it whole, the one where it has the most words of context on its narrower side (a
    side at the text's own edge is unlimited), the first of equals. A span at a window's cut
    edge is then scored where the model sees what follows it. `near` is a window that holds the
    span: the windows start in order, so only its neighbours can hold it too."""
    low = near
    while low > 0 and windows[low - 1][1] > end:
        low -= 1
    high = near
    while high + 1 < len(windows) and windows[high + 1][0] <= start:
        high += 1
    best, best_margin = -1, -1
    for index in range(low, high + 1):
        first, stop = windows[index]
        if first <= start and end < stop:
            before = start - first if first > 0 else n_words
            after = stop - 1 - end if stop < n_words else n_words
            if min(before, after) > best_margin:
                best, best_margin = index, min(before, after)
    return best


def words_mask(word_ids: Sequence[int | None], prompt_words: int) -> list[int]:
    """GLiNER's words_mask (gliner/data_processing/utils.py, prepare_word_mask): the first
    sub-token of each text word carries its 1-based number; the prompt, the special tokens and
    continuation sub-tokens carry 0. A word that makes no token keeps its number unused, so the
    words after it keep theirs."""
    mask, previous = [], None
    for word in word_ids:
        first = word is not None and word >= prompt_words and word != previous
        mask.append(word - prompt_words + 1 if first and word is not None else 0)
        previous = word
    return mask


def _sigmoid(logits: np.ndarray) -> np.ndarray:
    # The tanh form never overflows, whatever the logit.
    return 0.5 * (1.0 + np.tanh(logits.astype(np.float64) / 2.0))


@dataclass
class _Text:
    """One text of a request: its words' character offsets and strings, their token counts."""

    offsets: list[tuple[int, int]]
    words: list[str]
    token_counts: list[int]
    # The current family's windows (they depend on the prompt's length).
    windows: list[tuple[int, int]]


@dataclass(frozen=True)
class _Window:
    text: int  # the text's index in the request
    index: int  # the window's index among the text's windows
    first: int  # its first word
    end: int  # one past its last word


class GlinerEngine(Engine):
    """A GLiNER uni-encoder export, span-level (span_mode markerV0 and the others) or
    token-level (span_mode token_level)."""

    def __init__(self, model: ModelConfig, weights: Path, n_threads: int | None):
        super().__init__(model, weights, n_threads)
        self.graph, self.folder = self._find_graph()
        self.tokenizer_file = self._required("tokenizer.json")
        config_file = self._required("gliner_config.json")
        try:
            self.config = GlinerConfig.read(config_file)
        except (ValueError, TypeError) as exc:
            raise ModelNotAvailable(
                f"model {self.model.id!r}: {config_file} is not a usable GLiNER config: {exc}"
            ) from exc
        self._tokenizer: Tokenizer | None = None
        self._pad_id = 0
        self._session: onnxruntime.InferenceSession | None = None
        self._input_dtypes: dict[str, type[np.generic]] = {}

    def _find_graph(self) -> tuple[Path, Path]:
        """The graph to run and the folder holding its tokenizer and config."""
        if self.weights.is_file():
            graph = self.weights
            folders = [graph.parent, graph.parent.parent]
            folder = next((f for f in folders if (f / "gliner_config.json").is_file()), graph.parent)
            return graph, folder
        for graph in (self.weights / "onnx" / "model.onnx", self.weights / "model.onnx"):
            if graph.is_file():
                return graph, self.weights
        raise ModelNotAvailable(f"model {self.model.id!r}: {self.weights} holds neither onnx/model.onnx nor model.onnx")

    def _required(self, name: str) -> Path:
        path = self.folder / name
        if not path.is_file():
            raise ModelNotAvailable(f"model {self.model.id!r}: {self.folder} has no {name} (a GLiNER export ships one)")
        return path

    @property
    def files(self) -> list[Path]:
        """What the model holds: its graph, tokenizer and config (not the other graphs beside it)."""
        return [self.graph, self.tokenizer_file, self.folder / "gliner_config.json"]

    @property
    def loaded(self) -> bool:
        return self._session is not None

    def footprint(self) -> Footprint:
        return footprint_from_files(self.files, WORKSPACE_BYTES)

    def warm(self) -> float:
        """The graph into a memfd and the tokenizer parsed: what a load needs, off the disk."""
        started = time.perf_counter()
        if self._warm is not None and self._tokenizer is not None:
            return 0.0
        # The tokenizer first: a broken one refuses the model before the graph takes memory.
        if self._tokenizer is None:
            self._tokenizer = self._read_tokenizer()
        self._hold(self.graph)
        return (time.perf_counter() - started) * 1000

    def _read_tokenizer(self) -> Tokenizer:
        try:
            tokenizer = Tokenizer.from_file(str(self.tokenizer_file))
        except Exception as exc:  # tokenizers raises a bare Exception for a file it cannot read
            raise ModelNotAvailable(
                f"model {self.model.id!r}: {self.tokenizer_file} is not a tokenizer: {exc}"
            ) from exc
        for token in (self.config.ent_token, self.config.sep_token):
            if tokenizer.token_to_id(token) is None:
                raise ModelNotAvailable(
                    f"model {self.model.id!r}: the tokenizer has no {token!r} token, which GLiNER's prompt needs"
                )
        padding = tokenizer.padding
        self._pad_id = int(padding["pad_id"]) if padding else tokenizer.token_to_id("[PAD]") or 0
        # Windows are cut to fit here; the file's own truncation or padding would undo that.
        tokenizer.no_truncation()
        tokenizer.no_padding()
        return tokenizer

    def load(self, context_len: int, gpu_layers: int) -> LoadPhases:
        started = time.perf_counter()
        mode = "mmap" if self._warm is not None else "read"
        weights_ms = self.warm()
        assert self._warm is not None
        session = open_session(self.model.id, self._warm.path, self.graph, self.n_threads)
        self._input_dtypes = self._check_signature(session)
        self._session = session
        total_ms = (time.perf_counter() - started) * 1000
        return LoadPhases(load_mode=mode, weights_ms=weights_ms or total_ms, context_ms=0.0, total_ms=total_ms)

    def _check_signature(self, session: onnxruntime.InferenceSession) -> dict[str, type[np.generic]]:
        """The graph's input dtypes, once its inputs and output are those of GLiNER's export of
        this head (gliner/model.py, `_get_onnx_input_spec`)."""
        head = "token-level" if self.config.token_level else "span-level"
        expected = TEXT_INPUTS if self.config.token_level else SPAN_INPUTS
        declared = {i.name: i.type for i in session.get_inputs()}
        outputs = [o.name for o in session.get_outputs()]
        if set(declared) != set(expected) or "logits" not in outputs:
            hint = " (bi-encoder exports are not supported)" if "labels_input_ids" in declared else ""
            raise ModelNotAvailable(
                f"model {self.model.id!r}: {self.graph.name} takes {sorted(declared)} and gives {outputs}, not the "
                f"inputs {list(expected)} and logits of a {head} GLiNER export (span_mode "
                f"{self.config.span_mode!r}){hint}"
            )
        unknown = {name: kind for name, kind in declared.items() if kind not in INPUT_DTYPES}
        if unknown:
            raise ModelNotAvailable(f"model {self.model.id!r}: {self.graph.name} has inputs of unknown types {unknown}")
        return {name: INPUT_DTYPES[kind] for name, kind in declared.items()}

    def unload(self) -> None:
        self._session = None

    def cool(self) -> None:
        self.unload()
        self._tokenizer = None
        self._release(self.files)

    # -- extraction ------------------------------------------------------------------------------

    def extract(
        self, texts: list[str], labels: list[str], threshold: float, flat: bool, cancel: threading.Event
    ) -> list[list[Span]]:
        """Each text's spans of `labels` scoring at least `threshold`, flat or nested; offsets in
        the text's characters. Raises Cancelled when `cancel` is set between two batches."""
        assert self._session is not None and self._tokenizer is not None, "extract on an unloaded engine"
        labels = list(dict.fromkeys(labels))
        prepared = [self._prepare(text) for text in texts]
        found: list[list[Span]] = [[] for _ in texts]
        for family in label_families(labels):
            prompt = self._prompt(family)
            budget = TOKEN_LIMIT - len(self._tokenizer.encode(prompt, is_pretokenized=True).ids)
            windows = []
            for i, text in enumerate(prepared):
                text.windows = plan_windows(text.token_counts, budget, self.config.max_len, self.config.max_width)
                windows += [_Window(i, j, first, end) for j, (first, end) in enumerate(text.windows)]
            for at in range(0, len(windows), BATCH_WINDOWS):
                if cancel.is_set():
                    raise Cancelled("the request was cancelled")
                self._score(windows[at : at + BATCH_WINDOWS], prompt, family, threshold, prepared, found)
        limits = [CANDIDATES_PER_WORD * max(len(text.words), 1) for text in prepared]
        return [select_spans(best_candidates(spans, limit), flat) for spans, limit in zip(found, limits, strict=True)]

    def _prepare(self, text: str) -> _Text:
        assert self._tokenizer is not None
        offsets = split_words(text)
        words = [text[start:end] for start, end in offsets]
        counts = [0] * len(words)
        if words:
            encoding = self._tokenizer.encode(words, is_pretokenized=True, add_special_tokens=False)
            for word in encoding.word_ids:
                if word is not None:
                    counts[word] += 1
        return _Text(offsets=offsets, words=words, token_counts=counts, windows=[])

    def _prompt(self, family: list[str]) -> list[str]:
        """GLiNER's prompt words (BaseProcessor.prepare_inputs): <<ENT>> and each label, <<SEP>>."""
        prompt = []
        for label in family:
            prompt += [self.config.ent_token, label]
        return [*prompt, self.config.sep_token]

    def _score(
        self,
        batch: list[_Window],
        prompt: list[str],
        family: list[str],
        threshold: float,
        texts: list[_Text],
        found: list[list[Span]],
    ) -> None:
        """One session.run over a batch of windows; their candidates join their texts'."""
        assert self._session is not None and self._tokenizer is not None
        sequences = [prompt + texts[w.text].words[w.first : w.end] for w in batch]
        encodings = self._tokenizer.encode_batch(sequences, is_pretokenized=True)
        lengths = [w.end - w.first for w in batch]
        masks = [words_mask(e.word_ids, len(prompt)) for e in encodings]
        logits = self._session.run(["logits"], self._inputs([e.ids for e in encodings], masks, lengths))[0]
        self._check_logits(logits, len(batch), max(lengths), len(family))
        decode = self._token_spans if self.config.token_level else self._span_spans
        for row, window in enumerate(batch):
            text = texts[window.text]
            for first, last, label, score in decode(logits[row], lengths[row], threshold):
                start, end = window.first + first, window.first + last
                if owning_window(text.windows, len(text.words), start, end, window.index) != window.index:
                    continue
                span = Span(start=text.offsets[start][0], end=text.offsets[end][1], label=family[label], score=score)
                found[window.text].append(span)
        for index in {w.text for w in batch}:
            # The best candidates only, so memory stays in proportion to the text (threshold 0
            # makes every span a candidate); pruned at twice the limit, to prune rarely.
            limit = CANDIDATES_PER_WORD * max(len(texts[index].words), 1)
            if len(found[index]) > 2 * limit:
                found[index] = best_candidates(found[index], limit)

    def _inputs(self, ids: list[list[int]], masks: list[list[int]], lengths: list[int]) -> dict[str, np.ndarray]:
        """The batch's tensors, padded to its longest window (GLiNER's collator's layout)."""
        rows, width = len(ids), max(len(row) for row in ids)
        input_ids = np.full((rows, width), self._pad_id, dtype=np.int64)
        attention = np.zeros((rows, width), dtype=np.int64)
        mask = np.zeros((rows, width), dtype=np.int64)
        for i, (row, row_mask) in enumerate(zip(ids, masks, strict=True)):
            input_ids[i, : len(row)] = row
            attention[i, : len(row)] = 1
            mask[i, : len(row)] = row_mask
        inputs: dict[str, np.ndarray] = {
            "input_ids": input_ids,
            "attention_mask": attention,
            "words_mask": mask,
            "text_lengths": np.array(lengths, dtype=np.int64).reshape(-1, 1),
        }
        if not self.config.token_level:
            inputs.update(self._span_inputs(lengths))
        return {name: value.astype(self._input_dtypes[name], copy=False) for name, value in inputs.items()}

    def _span_inputs(self, lengths: list[int]) -> dict[str, np.ndarray]:
        """span_idx: every start word with every width up to max_width, padded with (0, 0);
        span_mask: the spans that end inside their window (UniEncoderSpanProcessor)."""
        width = self.config.max_width
        spans = np.zeros((len(lengths), max(lengths) * width, 2), dtype=np.int64)
        valid = np.zeros((len(lengths), max(lengths) * width), dtype=np.bool_)
        for i, n in enumerate(lengths):
            starts = np.repeat(np.arange(n, dtype=np.int64), width)
            ends = starts + np.tile(np.arange(width, dtype=np.int64), n)
            spans[i, : n * width, 0] = starts
            spans[i, : n * width, 1] = ends
            valid[i, : n * width] = ends < n
        return {"span_idx": spans, "span_mask": valid}

    def _check_logits(self, logits: Any, rows: int, words: int, labels: int) -> None:
        """The logits have the shape the head's decoder reads, or the export is not GLiNER's."""
        per_word = (labels, 3) if self.config.token_level else (self.config.max_width, labels)
        if not (
            logits.ndim == 4 and logits.shape[0] == rows and logits.shape[1] >= words and logits.shape[2:] == per_word
        ):
            raise ModelNotAvailable(
                f"model {self.model.id!r}: {self.graph.name} gave logits of shape {logits.shape} for {rows} windows "
                f"of up to {words} words and {labels} labels"
            )

    def _span_spans(self, logits: np.ndarray, n: int, threshold: float) -> list[tuple[int, int, int, float]]:
        """Span head, [words, max_width, labels]: (first word, last word, label, score) of every
        span inside the window scoring at least `threshold` (GLiNER's SpanDecoder)."""
        scores = _sigmoid(logits[:n])
        starts, widths, labels = np.nonzero(scores >= threshold)
        inside = starts + widths < n
        return [
            (int(s), int(s + k), int(c), float(scores[s, k, c]))
            for s, k, c in zip(starts[inside], widths[inside], labels[inside], strict=True)
        ]

    def _token_spans(self, logits: np.ndarray, n: int, threshold: float) -> list[tuple[int, int, int, float]]:
        """Token head, [words, labels, (start, end, inside)]: GLiNER's TokenDecoder. A span
        runs from a word whose start score reaches `threshold` to one whose end score does,
        every word of it inside at `threshold` or above; its score is the least of them all."""
        scores = _sigmoid(logits[:n])
        begin, finish, inside = scores[..., 0], scores[..., 1], scores[..., 2]
        spans = []
        for s, c in zip(*np.nonzero(begin >= threshold), strict=True):
            floor = begin[s, c]
            for e in range(s, n):
                if inside[e, c] < threshold:
                    break
                floor = min(floor, inside[e, c])
                if finish[e, c] >= threshold:
                    spans.append((int(s), e, int(c), float(min(floor, finish[e, c]))))
        return spans
