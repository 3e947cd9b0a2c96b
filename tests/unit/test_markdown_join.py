from __future__ import annotations

from inference.jobs.markdown_join import join_pages

TABLE_PAGE_1 = "## Results\n\n| Model | Size |\n|-------|------|\n| smollm2 | 135M |\n| qwen | 0.5B |"


def test_it_separates_pages_with_a_blank_line() -> None:
    assert join_pages(["# Title\n\nDone.", "Next page starts here."]) == "# Title\n\nDone.\n\nNext page starts here."


def test_it_joins_a_sentence_cut_by_the_page_break() -> None:
    pages = ["Intro.\n\nThe team shipped the server and then", "measured its throughput.\n\nMore."]
    assert join_pages(pages) == "Intro.\n\nThe team shipped the server and then measured its throughput.\n\nMore."


def test_it_keeps_a_finished_sentence_apart_from_the_next_page() -> None:
    assert join_pages(["It ended.", "starts lower case."]) == "It ended.\n\nstarts lower case."


def test_it_keeps_a_sentence_apart_when_the_next_page_starts_a_new_one() -> None:
    assert join_pages(["A heading without a stop", "The next page."]) == "A heading without a stop\n\nThe next page."


def test_it_rejoins_a_word_hyphenated_at_the_break() -> None:
    assert join_pages(["The infer-", "ence server."]) == "The inference server."


def test_it_does_not_join_a_heading_with_the_next_page() -> None:
    assert join_pages(["## Method", "and then"]) == "## Method\n\nand then"


def test_it_continues_a_numbered_list_that_restarts_on_the_next_page() -> None:
    pages = ["Steps:\n\n1. Install.\n2. Load.", "1. Run.\n2. Compare.\n\nDone."]
    assert join_pages(pages) == "Steps:\n\n1. Install.\n2. Load.\n3. Run.\n4. Compare.\n\nDone."


def test_it_joins_a_numbered_list_that_already_goes_on() -> None:
    assert join_pages(["1. Install.\n2. Load.", "3. Run."]) == "1. Install.\n2. Load.\n3. Run."


def test_it_leaves_a_list_starting_elsewhere_alone() -> None:
    assert join_pages(["1. Install.", "7. Unrelated."]) == "1. Install.\n\n7. Unrelated."


def test_it_merges_a_table_split_across_pages_dropping_the_repeated_header() -> None:
    page_2 = "| Model | Size |\n|-------|------|\n| gemma | 4B |\n\nAfter the table."
    assert join_pages([TABLE_PAGE_1, page_2]) == (
        "## Results\n\n| Model | Size |\n|-------|------|\n| smollm2 | 135M |\n| qwen | 0.5B |\n| gemma | 4B |"
        "\n\nAfter the table."
    )


def test_it_keeps_the_first_row_of_a_continued_table_without_a_repeated_header() -> None:
    page_2 = "| gemma | 4B |\n|---|---|\n| phi | 3.8B |"
    assert join_pages([TABLE_PAGE_1, page_2]) == f"{TABLE_PAGE_1}\n| gemma | 4B |\n| phi | 3.8B |"


def test_it_keeps_tables_with_other_column_counts_apart() -> None:
    page_2 = "| A | B | C |\n|---|---|---|\n| 1 | 2 | 3 |"
    assert join_pages([TABLE_PAGE_1, page_2]) == f"{TABLE_PAGE_1}\n\n{page_2}"


def test_it_keeps_a_table_apart_when_text_comes_first_on_the_next_page() -> None:
    page_2 = "Some text.\n\n| Model | Size |\n|---|---|\n| gemma | 4B |"
    assert join_pages([TABLE_PAGE_1, page_2]) == f"{TABLE_PAGE_1}\n\n{page_2}"


def test_it_skips_empty_pages() -> None:
    assert join_pages(["", "One.", "\n", "Two."]) == "One.\n\nTwo."
    assert join_pages([]) == ""


def test_it_does_not_join_a_picture_placeholder_with_text() -> None:
    assert join_pages(["<!-- image -->", "and more"]) == "<!-- image -->\n\nand more"
