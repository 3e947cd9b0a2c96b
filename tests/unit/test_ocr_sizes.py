"""The OCR's sizes: what a page is rendered at (document.ocr_scale) and what the detector sees
(ocr.detection_size), bounded whatever the page's shape."""

from __future__ import annotations

import pytest

from inference.engines.document import OCR_SCALE, READ_MAX_SIDE, ocr_scale
from inference.engines.ocr import DETECTION_MAX_SIDE, DETECTION_MIN_SIDE, DETECTION_PIXELS, detection_size

DEFAULT_MAX_PAGE_PIXELS = 4096 * 4096


@pytest.mark.parametrize(
    ("width", "height"),
    [(1414, 2000), (2000, 2000), (200, 150), (30, 2000), (2000, 3), (3, 36_000), (1, 1), (736, 736), (5000, 100)],
)
def test_the_detector_sees_a_bounded_stride_aligned_image(width, height):
    det_width, det_height = detection_size(width, height)
    assert det_width % 32 == 0 and det_height % 32 == 0
    assert det_width * det_height <= max(DETECTION_PIXELS, 32 * DETECTION_MAX_SIDE)
    assert max(det_width, det_height) <= DETECTION_MAX_SIDE


def test_an_a4_page_is_detected_within_the_budget_and_keeps_its_shape():
    width, height = detection_size(1414, 2000)
    assert 0.85 * DETECTION_PIXELS < width * height <= DETECTION_PIXELS
    assert abs(width / height - 1414 / 2000) < 0.03


def test_a_small_image_is_enlarged_as_rapidocr_does():
    width, height = detection_size(400, 300)
    assert min(width, height) == DETECTION_MIN_SIDE // 32 * 32


@pytest.mark.parametrize(("width_pt", "height_pt"), [(595, 842), (14_400, 14_400), (200, 14_400), (14_400, 20)])
def test_pages_are_rendered_within_the_read_limit(width_pt, height_pt):
    scale = ocr_scale(width_pt, height_pt, DEFAULT_MAX_PAGE_PIXELS)
    assert 0 < scale <= OCR_SCALE
    assert max(width_pt, height_pt) * scale <= READ_MAX_SIDE + 1e-6
    assert width_pt * height_pt * scale * scale <= DEFAULT_MAX_PAGE_PIXELS


def test_a_normal_page_is_rendered_as_before():
    # Letter: 612 x 792 pt at 2.5 px/pt is 1530 x 1980, within both limits.
    assert ocr_scale(612, 792, DEFAULT_MAX_PAGE_PIXELS) == OCR_SCALE
