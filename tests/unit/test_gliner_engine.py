"""The GLiNER engine (inference/engines/gliner.py) on GLiNER-shaped graphs with known scores
(tests/gliner_graph.py: plumbing, not a trained model): the prompt, words_mask and span tensors
it builds, both heads' decoding, label families, windows over long texts, character offsets,
the tiers and the failures. Every expected score is the graph's known function, computed here
in plain Python."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hypnos_site.config import ModelConfig
from hypnos_site.errors import Cancelled, ModelNotAvailable
from inference.engines.gliner import (
    WORKSPACE_BYTES,
    GlinerConfig,
    GlinerEngine,
    owning_window,
    plan_windows,
    split_words,
    words_mask,
)
from inference.transport.entities import Span, select_spans
from tests.gliner_graph import (
    ANNA,
    DISTRACTORS,
    LABELS,
    LUCA,
    MARIO,
    TIM,
    build_gliner_model,
    build_tokenizer,
    sigmoid,
    span_candidates,
    token_candidates,
)

FILLER = "we talked then walked home and met again".split()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gliner")
    return {
        "span": build_gliner_model(root / "span"),
        "token": build_gliner_model(root / "token", head="token"),
        # Windows of 16 words, overlapping by 4, so a text of 60 words takes five.
        "span-small": build_gliner_model(root / "span-small", max_width=4, max_len=16),
        "token-small": build_gliner_model(root / "token-small", head="token", max_width=4, max_len=16),
    }


def make_engine(weights: Path) -> GlinerEngine:
    config = ModelConfig.model_validate(
        {"id": "gliner-test", "modality": "entity_extraction", "engine": "gliner", "weights_path": str(weights)}
    )
    return GlinerEngine(config, weights, 2)


@pytest.fixture(scope="module")
def loaded(models: dict[str, Path]) -> dict[str, GlinerEngine]:
    engines = {name: make_engine(folder) for name, folder in models.items()}
    for engine in engines.values():
        engine.load(512, 0)
    return engines


def extract(engine: GlinerEngine, texts: list[str], labels: list[str], threshold: float = 0.5, flat: bool = True):
    return engine.extract(texts, labels, threshold, flat, threading.Event())


def entity(text: str, phrase: str, label: str, logit: float, occurrence: int = 0) -> Span:
    """The span of `phrase` (its `occurrence`-th appearance) in `text` at the graph's `logit`."""
    start = -1
    for _ in range(occurrence + 1):
        start = text.index(phrase, start + 1)
    return Span(start=start, end=start + len(phrase), label=label, score=sigmoid(logit))


def assert_spans(got: list[Span], expected: list[Span]) -> None:
    assert [(s.start, s.end, s.label) for s in got] == [(s.start, s.end, s.label) for s in expected]
    assert [s.score for s in got] == pytest.approx([s.score for s in expected], abs=1e-6)


class RecordingSession:
    """The engine's real session, passed through, keeping every run's inputs (a spy: the graph
    still computes every score); `after_run` is called after each run."""

    def __init__(self, session: Any, after_run: Callable[[], None] | None = None):
        self.session = session
        self.after_run = after_run
        self.runs: list[dict[str, Any]] = []

    def run(self, outputs: list[str], inputs: dict[str, Any]) -> list[Any]:
        self.runs.append(inputs)
        result = self.session.run(outputs, inputs)
        if self.after_run is not None:
            self.after_run()
        return result


def record_runs(engine: GlinerEngine, after_run: Callable[[], None] | None = None) -> RecordingSession:
    spy = RecordingSession(engine._session, after_run)
    engine._session = spy
    return spy


def restore(engine: GlinerEngine, spy: RecordingSession) -> None:
    engine._session = spy.session


def long_text(placed: dict[int, str], n_words: int) -> str:
    """`n_words` words: each phrase at its word position, filler words everywhere else."""
    words: list[str] = []
    while len(words) < n_words:
        phrase = placed.get(len(words))
        words += phrase.split() if phrase else [FILLER[len(words) % len(FILLER)]]
    return " ".join(words)


# -- the span head ---------------------------------------------------------------------------------


def test_it_finds_the_spec_entities_in_the_spec_sentences(loaded):
    got = extract(loaded["span"], [MARIO, TIM], LABELS)
    assert_spans(
        got[0],
        [
            entity(MARIO, "Mario Rossi", "person", 3.5),
            entity(MARIO, "Milan", "city", 2.5),
            entity(MARIO, "Ferrari", "company", 2.25),
        ],
    )
    assert [(s.start, s.end) for s in got[0]] == [(0, 11), (21, 26), (31, 38)]
    assert_spans(
        got[1],
        [
            entity(TIM, "Tim Cook", "person", 3.0),
            entity(TIM, "iPhone 17", "product", 3.0),
            entity(TIM, "Cupertino", "city", 3.0),
        ],
    )


def test_nested_keeps_a_city_inside_a_company_and_flat_keeps_the_company(loaded):
    bank, milan = entity(ANNA, "Bank of Milan", "company", 3.5), entity(ANNA, "Milan", "city", 2.5)
    anna = entity(ANNA, "Anna", "person", 3.0)
    assert_spans(extract(loaded["span"], [ANNA], LABELS, flat=True)[0], [anna, bank])
    assert_spans(extract(loaded["span"], [ANNA], LABELS, flat=False)[0], [anna, bank, milan])


def test_of_overlapping_candidates_flat_keeps_the_better_and_nested_both(loaded):
    flat, nested = (extract(loaded["span"], [TIM], LABELS, flat=f)[0] for f in (True, False))
    iphone17, iphone = entity(TIM, "iPhone 17", "product", 3.0), entity(TIM, "iPhone", "product", 1.0)
    assert_spans([s for s in flat if s.label == "product"], [iphone17])
    assert_spans([s for s in nested if s.label == "product"], [iphone, iphone17])


@pytest.mark.parametrize("threshold", [0.1, 0.5, 0.65, 0.8, 0.96])
@pytest.mark.parametrize("flat", [True, False])
def test_the_spans_are_the_graphs_known_scores_at_every_threshold(loaded, threshold, flat):
    texts = [MARIO, TIM, ANNA, LUCA]
    got = extract(loaded["span"], texts, LABELS, threshold, flat)
    for text, spans in zip(texts, got, strict=True):
        assert_spans(spans, select_spans(span_candidates(text, LABELS, threshold), flat))


def test_a_span_scoring_the_threshold_or_more_is_kept(loaded):
    [found] = extract(loaded["span"], [MARIO], ["city"], threshold=0.5)[0]
    assert extract(loaded["span"], [MARIO], ["city"], threshold=found.score)[0] == [found]
    milan = sigmoid(2.5)  # 0.92414...
    kept = extract(loaded["span"], [MARIO], ["city"], threshold=milan - 1e-9)[0]
    dropped = extract(loaded["span"], [MARIO], ["city"], threshold=milan + 1e-9)[0]
    assert_spans(kept, [entity(MARIO, "Milan", "city", 2.5)])
    assert dropped == []
    assert_spans(
        extract(loaded["span"], [MARIO], LABELS, threshold=0.96)[0], [entity(MARIO, "Mario Rossi", "person", 3.5)]
    )


def test_more_than_eight_labels_run_in_families_and_their_spans_merge(loaded):
    # company is the 1st label; person and city, the 9th and 10th, fall in the second family.
    labels = ["company", *DISTRACTORS[:7], "person", "city"]
    spy = record_runs(loaded["span"])
    try:
        got = extract(loaded["span"], [MARIO], labels)[0]
    finally:
        restore(loaded["span"], spy)
    assert_spans(
        got,
        [
            entity(MARIO, "Mario Rossi", "person", 3.5),
            entity(MARIO, "Milan", "city", 2.5),
            entity(MARIO, "Ferrari", "company", 2.25),
        ],
    )
    ent = build_tokenizer().token_to_id("<<ENT>>")
    assert [int((run["input_ids"][0] == ent).sum()) for run in spy.runs] == [8, 2]


def test_a_label_of_several_sub_tokens_is_prompted_whole(loaded):
    assert build_tokenizer().encode(["organisation"], is_pretokenized=True, add_special_tokens=False).tokens == [
        "organ",
        "##isation",
    ]
    # First in the prompt, so its two tokens come before every other label's and every word's.
    got = extract(loaded["span"], [LUCA], ["organisation", "person", "city"])[0]
    assert_spans(
        got,
        [
            entity(LUCA, "Luca", "person", 2.5),
            entity(LUCA, "Juventus", "organisation", 3.0),
            entity(LUCA, "Turin", "city", 2.0),
        ],
    )


def test_each_window_of_a_batch_takes_its_own_spans_and_words(loaded):
    spy = record_runs(loaded["span"])
    try:
        extract(loaded["span"], [MARIO, TIM, ""], ["person", "city"])
    finally:
        restore(loaded["span"], spy)
    [run] = spy.runs
    # GLiNER's layout: one row per window, padded to the longest; spans (start, start + width).
    assert run["text_lengths"].tolist() == [[8], [9]]
    assert run["span_idx"].shape == (2, 9 * 12, 2) and run["span_mask"].dtype == bool
    assert run["span_idx"][0, 13].tolist() == [1, 2] and bool(run["span_mask"][0, 13])
    assert run["span_idx"][0, 8 * 12 :].tolist() == [[0, 0]] * 12
    assert int(run["span_mask"][0].sum()) == sum(min(12, 8 - s) for s in range(8))
    # [CLS] <<ENT>> person <<ENT>> city <<SEP>> Mario Ros ##si works in Milan for
    assert run["words_mask"][0].tolist()[:13] == [0, 0, 0, 0, 0, 0, 1, 2, 0, 3, 4, 5, 6]
    # The first sentence is 17 tokens, the second 19: two padding tokens, masked out.
    assert run["attention_mask"].sum(axis=1).tolist() == [17, 19]
    assert run["input_ids"][0, 17:].tolist() == [0, 0] and run["words_mask"][0, 17:].tolist() == [0, 0]


def test_texts_scored_together_score_as_they_do_alone(loaded):
    texts = [MARIO, TIM, ANNA, LUCA, long_text({5: "Tim Cook", 40: "Bank of Milan"}, 50)]
    together = extract(loaded["span-small"], texts, LABELS + ["organisation"], 0.3, flat=False)
    alone = [extract(loaded["span-small"], [text], LABELS + ["organisation"], 0.3, flat=False)[0] for text in texts]
    for a, b in zip(together, alone, strict=True):
        assert_spans(a, b)


# -- long texts ------------------------------------------------------------------------------------


@pytest.mark.parametrize("head", ["span", "token"])
def test_a_long_text_runs_in_overlapping_windows_and_finds_each_entity_once(loaded, head):
    # Windows of 16 words overlapping by 4: [0, 16), [12, 28), [24, 40), [36, 52), [48, 60).
    placed = {0: "Anna", 12: "Mario Rossi", 15: "Milan", 24: "Cupertino", 27: "Tim Cook", 50: "Ferrari", 59: "Luca"}
    text = long_text(placed, 60)
    engine = loaded[f"{head}-small"]
    spy = record_runs(engine)
    try:
        got = extract(engine, [text], LABELS)[0]
    finally:
        restore(engine, spy)
    windows = [length for run in spy.runs for [length] in run["text_lengths"].tolist()]
    assert windows == [16, 16, 16, 16, 12]
    expected = [
        entity(text, "Anna", "person", 3.0),
        entity(text, "Mario Rossi", "person", 3.5),
        entity(text, "Milan", "city", 2.5),
        entity(text, "Cupertino", "city", 3.0),
        entity(text, "Tim Cook", "person", 3.0),
        entity(text, "Ferrari", "company", 2.25),
        entity(text, "Luca", "person", 2.5),
    ]
    assert_spans(got, expected)
    assert [text[s.start : s.end] for s in got] == [
        "Anna",
        "Mario Rossi",
        "Milan",
        "Cupertino",
        "Tim Cook",
        "Ferrari",
        "Luca",
    ]
    reference = (
        span_candidates(text, LABELS, 0.5, max_width=4) if head == "span" else token_candidates(text, LABELS, 0.5)
    )
    assert_spans(extract(engine, [text], LABELS, flat=False)[0], select_spans(reference, flat=False))


def test_a_text_beyond_the_token_limit_is_cut_into_windows_of_512_tokens(loaded):
    # 300 words of 600 tokens (Cupertino is 3 sub-tokens): under max_len, over the tokens.
    text = ", ".join(["Cupertino"] * 150)
    spy = record_runs(loaded["span"])
    try:
        got = extract(loaded["span"], [text], ["city"])[0]
    finally:
        restore(loaded["span"], spy)
    lengths = [run["input_ids"].shape[1] for run in spy.runs]
    assert len(spy.runs) == 1 and spy.runs[0]["input_ids"].shape[0] == 2 and max(lengths) <= 512
    assert_spans(got, [entity(text, "Cupertino", "city", 3.0, occurrence=i) for i in range(150)])


def test_windows_cover_the_words_within_both_limits_and_overlap_by_max_width():
    counts = [1, 3, 2, 1, 1, 4, 1, 2, 2, 1] * 6
    windows = plan_windows(counts, budget=20, max_words=12, min_overlap=4)
    assert windows[0][0] == 0 and windows[-1][1] == len(counts)
    for first, end in windows:
        assert 0 < end - first <= 12 and sum(counts[first:end]) <= 20
    for (_, end), (first, _) in zip(windows, windows[1:], strict=False):
        assert end - first >= 4
    # A word longer than the budget is a window of its own; the text still gets covered.
    assert plan_windows([1, 50, 1], budget=10, max_words=12, min_overlap=4) == [(0, 1), (1, 2), (2, 3)]
    assert plan_windows([], budget=10, max_words=12, min_overlap=4) == []


def test_a_span_at_a_windows_cut_edge_is_scored_by_the_next_window():
    windows = [(0, 16), (12, 28)]
    assert owning_window(windows, 28, 15, 15) == 1  # the last word of the first window
    assert owning_window(windows, 28, 12, 13) == 0  # two words after it in the first, none before in the next
    assert owning_window(windows, 28, 13, 14) == 0  # one word of context either way: the first of equals
    assert owning_window(windows, 28, 5, 6) == 0
    assert owning_window(windows, 28, 0, 0) == 0  # the text's own start needs no context


# -- words and offsets -----------------------------------------------------------------------------


def test_words_are_split_as_gliner_splits_them():
    text = "e-mail foo_bar, x"
    assert [text[a:b] for a, b in split_words(text)] == ["e-mail", "foo_bar", ",", "x"]


def test_words_mask_numbers_each_texts_words_first_sub_token():
    # [CLS] <<ENT>> organ ##isation <<SEP>> Mario Ros ##si (zero-width word) Milan [SEP]
    word_ids = [None, 0, 1, 1, 2, 3, 4, 4, 6, None]
    assert words_mask(word_ids, 3) == [0, 0, 0, 0, 0, 1, 2, 0, 4, 0]


def test_emoji_and_combining_marks_before_an_entity_keep_character_offsets(loaded):
    text = "🎉🎉 Ame\u0301lie 𝔘𝔫𝔦 \u200b met Mario Rossi in Milan."
    for head in ("span", "token"):
        got = extract(loaded[head], [text], LABELS)[0]
        assert [text[s.start : s.end] for s in got] == ["Mario Rossi", "Milan"]
        assert_spans(got, [entity(text, "Mario Rossi", "person", 3.5), entity(text, "Milan", "city", 2.5)])


def test_an_empty_text_or_one_without_words_has_no_entities(loaded):
    assert extract(loaded["span"], ["", " \n\t ", "...!?", MARIO], LABELS)[:3] == [[], [], []]
    assert extract(loaded["span"], [MARIO, TIM], []) == [[], []]
    assert extract(loaded["token"], ["", MARIO], LABELS)[0] == []


# -- the token head --------------------------------------------------------------------------------


def test_the_token_head_finds_the_spec_entities(loaded):
    got = extract(loaded["token"], [MARIO, TIM, ANNA], LABELS, flat=False)
    assert_spans(
        got[0],
        [
            entity(MARIO, "Mario", "person", 0.5),
            entity(MARIO, "Mario Rossi", "person", 3.5),
            entity(MARIO, "Milan", "city", 2.5),
            entity(MARIO, "Ferrari", "company", 2.25),
        ],
    )
    assert [TIM[s.start : s.end] for s in got[1]] == ["Tim Cook", "iPhone", "iPhone 17", "Cupertino"]
    assert [ANNA[s.start : s.end] for s in got[2]] == ["Anna", "Bank of Milan", "Milan"]


@pytest.mark.parametrize("threshold", [0.1, 0.5, 0.7, 0.93])
@pytest.mark.parametrize("flat", [True, False])
def test_the_token_heads_spans_are_the_least_of_start_end_and_inside(loaded, threshold, flat):
    texts = [MARIO, TIM, ANNA, LUCA]
    got = extract(loaded["token"], texts, LABELS + ["organisation"], threshold, flat)
    for text, spans in zip(texts, got, strict=True):
        assert_spans(spans, select_spans(token_candidates(text, LABELS + ["organisation"], threshold), flat))


# -- model folders and the tiers -------------------------------------------------------------------


def test_the_tiers_warm_load_from_the_memfd_unload_and_cool(tmp_path):
    folder = build_gliner_model(tmp_path / "model")
    engine = make_engine(folder)
    files = [folder / "onnx" / "model.onnx", folder / "tokenizer.json", folder / "gliner_config.json"]
    footprint = engine.footprint()
    assert footprint.weights_bytes == sum(f.stat().st_size for f in files) > 0
    assert footprint.workspace_bytes == WORKSPACE_BYTES and not engine.loaded and engine.warm_bytes == 0

    assert engine.warm() > 0 and engine.warm_bytes == files[0].stat().st_size
    assert engine.warm() == 0.0
    # Tier 2 holds all a load needs: with the files gone from the folder it still loads.
    for f in files[:2]:
        f.rename(f.with_name(f.name + ".away"))
    try:
        phases = engine.load(512, 0)
        assert engine.loaded and engine.context_len == engine.model.context_len and phases.load_mode == "mmap"
        assert_spans(extract(engine, [MARIO], ["city"])[0], [entity(MARIO, "Milan", "city", 2.5)])
        engine.unload()
        assert not engine.loaded and engine.warm_bytes > 0
        assert engine.load(512, 0).load_mode == "mmap" and engine.loaded
        assert_spans(extract(engine, [TIM], ["person"])[0], [entity(TIM, "Tim Cook", "person", 3.0)])
    finally:
        for f in files[:2]:
            f.with_name(f.name + ".away").rename(f)
    engine.cool()
    assert not engine.loaded and engine.warm_bytes == 0
    assert engine.load(512, 0).load_mode == "read" and engine.loaded


def test_weights_path_may_name_the_graph_or_a_folder_with_it_at_the_top(tmp_path):
    inside = build_gliner_model(tmp_path / "a")
    top = build_gliner_model(tmp_path / "b", graph_in_onnx_folder=False)
    for weights in (inside / "onnx" / "model.onnx", top, top / "model.onnx"):
        engine = make_engine(weights)
        engine.load(512, 0)
        assert_spans(extract(engine, [MARIO], ["city"])[0], [entity(MARIO, "Milan", "city", 2.5)])


def test_a_config_without_keys_takes_gliners_defaults(tmp_path):
    folder = build_gliner_model(tmp_path / "model")
    (folder / "gliner_config.json").write_text("{}")
    engine = make_engine(folder)
    assert engine.config == GlinerConfig(max_width=12, max_len=384, ent_token="<<ENT>>", sep_token="<<SEP>>")
    engine.load(512, 0)
    assert_spans(extract(engine, [MARIO], ["city"])[0], [entity(MARIO, "Milan", "city", 2.5)])


def test_cancel_stops_the_request_between_batches(loaded):
    engine = loaded["span-small"]
    cancel = threading.Event()
    text = long_text({}, 120)  # eleven windows: three batches
    spy = record_runs(engine, after_run=cancel.set)
    try:
        with pytest.raises(Cancelled):
            engine.extract([text], LABELS, 0.5, True, cancel)
    finally:
        restore(engine, spy)
    assert len(spy.runs) == 1
    with pytest.raises(Cancelled):
        engine.extract([MARIO], LABELS, 0.5, True, cancel)


def test_a_folder_without_a_tokenizer_or_graph_is_not_available(tmp_path):
    folder = build_gliner_model(tmp_path / "model")
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ModelNotAvailable, match="tokenizer.json"):
        make_engine(folder)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotAvailable, match="model.onnx"):
        make_engine(tmp_path / "empty")


@pytest.mark.parametrize("broken", ["onnx/model.onnx", "tokenizer.json", "gliner_config.json"])
def test_a_broken_file_is_not_available(tmp_path, broken):
    folder = build_gliner_model(tmp_path / "model")
    (folder / broken).write_bytes(b"\x08\x07 not what it claims to be")
    with pytest.raises(ModelNotAvailable):
        make_engine(folder).load(512, 0)


def test_a_graph_of_the_other_head_is_not_available(tmp_path):
    folder = build_gliner_model(tmp_path / "model", config={"span_mode": "token_level"})
    engine = make_engine(folder)
    with pytest.raises(ModelNotAvailable, match="token-level GLiNER export"):
        engine.load(512, 0)
    assert not engine.loaded


def test_a_tokenizer_without_the_prompt_tokens_is_not_available(tmp_path):
    folder = build_gliner_model(tmp_path / "model", config={"ent_token": "[ENT]"})
    with pytest.raises(ModelNotAvailable, match=r"\[ENT\]"):
        make_engine(folder).load(512, 0)


# -- what a hostile request costs ------------------------------------------------------------


def test_a_threshold_of_zero_keeps_memory_in_proportion_to_the_text(loaded: dict[str, GlinerEngine]):
    """threshold 0 makes every span of every width and label a candidate (here 960 words x 12
    widths x 12 labels, 138,240 of them); the engine keeps at most CANDIDATES_PER_WORD per word
    of the best, so its peak stays that of a few thousand spans."""
    import tracemalloc

    from inference.transport.entities import CANDIDATES_PER_WORD

    text = " ".join([MARIO] * 120)
    labels = [*LABELS, *DISTRACTORS]
    tracemalloc.start()
    try:
        nested = extract(loaded["span"], [text], labels, threshold=0.0, flat=False)[0]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    words = len(split_words(text))
    assert len(nested) <= CANDIDATES_PER_WORD * words
    # 138,240 spans would take over 25 MB as objects; the bounded candidates a few MB.
    assert peak < 20 << 20, peak
    flat = extract(loaded["span"], [text], labels, threshold=0.0, flat=True)[0]
    assert all(a.end <= b.start for a, b in zip(flat, flat[1:], strict=False))


def test_the_best_candidates_are_kept_in_the_order_selection_takes_them():
    from inference.transport.entities import best_candidates

    spans = [Span(start=i, end=i + 1, label="x", score=(i % 7) / 7) for i in range(100)]
    kept = best_candidates(spans, 10)
    assert len(kept) == 10
    assert min(s.score for s in kept) >= max(s.score for s in spans if s not in kept)
    assert best_candidates(spans[:5], 10) == spans[:5]
