"""Span selection and the chat extractor's reading of an answer (inference/transport/entities.py,
inference/worker/entities.py): flat and nested choice, mentions found in the text, values read
from a JSON answer even when it was cut short, and scores from token probabilities."""

from __future__ import annotations

import json
import threading

from inference.engines.base import ChatWork
from inference.transport.entities import Span, label_families, select_spans
from inference.transport.wire import EntityWork
from inference.worker.entities import ChatExtractor, _Answer, answer_entities, entity_schema, find_mentions


def span(start: int, end: int, label: str, score: float) -> Span:
    return Span(start=start, end=end, label=label, score=score)


def test_flat_keeps_the_best_of_overlapping_spans():
    candidates = [span(0, 11, "person", 0.9), span(6, 11, "person", 0.95), span(21, 26, "city", 0.8)]
    assert select_spans(candidates, flat=True) == [span(6, 11, "person", 0.95), span(21, 26, "city", 0.8)]


def test_nested_keeps_a_span_inside_another_but_never_a_partial_overlap():
    org = span(0, 26, "organization", 0.9)
    city = span(20, 26, "city", 0.8)
    partial = span(15, 30, "organization", 0.85)
    assert select_spans([org, city, partial], flat=False) == [org, city]
    assert select_spans([org, city, partial], flat=True) == [org]


def test_the_same_characters_are_not_kept_under_two_labels():
    assert select_spans([span(0, 5, "city", 0.7), span(0, 5, "person", 0.9)], flat=False) == [span(0, 5, "person", 0.9)]


def test_a_span_found_twice_counts_once_at_its_best_score():
    assert select_spans([span(3, 8, "city", 0.6), span(3, 8, "city", 0.9)], flat=True) == [span(3, 8, "city", 0.9)]


def test_ties_go_to_the_earlier_then_the_longer_span():
    assert select_spans([span(4, 8, "x", 0.5), span(0, 6, "x", 0.5)], flat=True) == [span(0, 6, "x", 0.5)]
    assert select_spans([span(0, 4, "x", 0.5), span(0, 6, "x", 0.5)], flat=True) == [span(0, 6, "x", 0.5)]


def test_labels_run_in_families_of_eight():
    labels = [f"l{i}" for i in range(19)]
    families = label_families(labels)
    assert [len(f) for f in families] == [8, 8, 3]
    assert sum(families, []) == labels


def test_mentions_are_whole_words_and_every_one_is_found():
    text = "Milan is not Milano; Milan again."
    assert find_mentions(text, "Milan") == [(0, 5), (21, 26)]
    assert find_mentions(text, "Mil") == []


def test_a_mention_is_matched_ignoring_case_only_when_no_exact_one_exists():
    assert find_mentions("I met tim cook.", "Tim Cook") == [(6, 14)]
    assert find_mentions("Tim Cook met TIM COOK.", "Tim Cook") == [(0, 8)]


def test_an_invented_span_is_not_found():
    assert find_mentions("Mario Rossi works in Milan.", "Rome") == []
    assert find_mentions("Mario Rossi works in Milan.", "  ") == []


def test_mentions_with_punctuation_at_their_edges():
    assert find_mentions("We write C++ daily; C++!", "C++") == [(9, 12), (20, 23)]


def test_offsets_count_characters_after_emoji_and_combining_marks():
    text = "🎉😀 Cafe\u0301 owner Zoë Ørsted lives in Köln."
    for name in ("Zoë Ørsted", "Köln"):
        ((start, end),) = find_mentions(text, name)
        assert text[start:end] == name


def answer(*entities: tuple[str, str]) -> str:
    return json.dumps({"entities": [{"text": text, "label": label} for text, label in entities]})


def test_answer_entities_reads_each_text_and_label_with_their_place():
    text = answer(("Mario Rossi", "person"), ("Milan", "city"), ("Rome", "city"))
    entities = answer_entities(text, {"person", "city"})
    assert [(e.text, e.label) for e in entities] == [("Mario Rossi", "person"), ("Milan", "city"), ("Rome", "city")]
    for entity in entities:
        assert text[slice(*entity.text_at)] == entity.text
        assert text[slice(*entity.label_at)] == entity.label


def test_answer_entities_of_an_answer_cut_short_keeps_the_complete_ones():
    cut = answer(("Mario Rossi", "person"), ("Luigi", "person"), ("Milan", "city"))[:-12]
    assert [(e.text, e.label) for e in answer_entities(cut, {"person", "city"})] == [
        ("Mario Rossi", "person"),
        ("Luigi", "person"),
    ]


def test_answer_entities_unescapes_and_drops_unknown_labels_and_blank_texts():
    text = answer(('José "Pepe" Ruiz', "person"), ("x", "other"), (" ", "person"))
    assert [(e.text, e.label) for e in answer_entities(text, {"person"})] == [('José "Pepe" Ruiz', "person")]


def test_answer_entities_takes_the_fields_in_either_order():
    text = '{"entities": [{"label": "city", "text": "Milan"}]}'
    assert [(e.text, e.label) for e in answer_entities(text, {"city"})] == [("Milan", "city")]


def test_the_score_is_the_mean_probability_of_the_tokens_that_wrote_text_and_label():
    written = _Answer('{"city": ["Köln"]}', [(0, 11, 0.99), (11, 13, 0.5), (13, 15, 0.7), (15, 19, 1.0)])
    start = written.text.index("Köln")
    # "Köln" is bytes 11..16 of the UTF-8 answer ("ö" is two bytes): tokens 2, 3 and 4.
    assert written.score((start, start + 4)) == (0.5 + 0.7 + 1.0) / 3
    # Two pieces sharing a token count it once.
    assert written.score((start, start + 1), (start, start + 4)) == (0.5 + 0.7 + 1.0) / 3
    assert written.score((0, 2)) == 0.99
    assert _Answer("", []).score((0, 4)) == 0.0


def test_the_schema_asks_for_entities_whose_label_is_an_enum_of_the_labels():
    schema = entity_schema(["person", "date of birth"])
    item = schema["properties"]["entities"]["items"]
    assert item["properties"]["label"] == {"enum": ["person", "date of birth"]}
    assert item["required"] == ["text", "label"]
    assert schema["additionalProperties"] is False and item["additionalProperties"] is False


class _Written(ChatExtractor):
    """The chat extractor's reading of one answer, the answer given (what the model would write
    is not the point here: how much the server does with it is)."""

    def __init__(self, text: str, answer_text: str, threshold: float = 0.5):
        self.work = EntityWork(input=[text], labels=["letter"], threshold=threshold)
        self.cancel = threading.Event()
        self.prepared = [ChatWork(messages=[], max_tokens=1)]
        self._written = _Answer(answer_text, [(0, len(answer_text.encode()), 0.9)])

    def _answer(self, chat: ChatWork) -> _Answer:
        return self._written


def test_an_answer_repeating_a_short_entity_costs_in_proportion_to_the_text():
    # 20,000 mentions of "a" in the text, and an answer naming "a" 300 times and many longer runs:
    # every mention of every run would be millions of candidates; the extractor keeps the best
    # CANDIDATES_PER_WORD per word, and each distinct entity is looked for once.
    text = " ".join(["a"] * 20_000)
    runs = [" ".join(["a"] * n) for n in range(1, 40)]
    written = answer(*[("a", "letter")] * 300, *[(run, "letter") for run in runs])
    spans = _Written(text, written).extract(0)
    # Equal scores: the longest runs win, side by side, none overlapping.
    assert 0 < len(spans) <= 20_000
    assert all(text[s.start : s.end] in runs for s in spans)
    assert all(a.end <= b.start for a, b in zip(spans, spans[1:], strict=False))


def test_an_entity_below_the_threshold_is_dropped():
    assert _Written("Milan", answer(("Milan", "letter")), threshold=0.95).extract(0) == []
    assert [s.score for s in _Written("Milan", answer(("Milan", "letter"))).extract(0)] == [0.9]
