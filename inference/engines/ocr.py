"""OCR of page images with the PP-OCRv4 ONNX models, through rapidocr-onnxruntime.

docling's own RapidOCR stage needs the `rapidocr` 3.x package and runs only inside the
StandardPdfPipeline, which needs the layout model no registry carries; so the engine reads the
pages without a text layer (and image inputs) here and lays the lines out itself
(inference/engines/page_layout.py). The three ONNX files come from the rapidocr-onnxruntime
wheel (`manage.py installmodels` places its `models/` folder); sessions open them from the
engine's warm copies."""

from __future__ import annotations

import numpy as np
from PIL import Image

from inference.engines.page_layout import Box, Line

DETECTOR = "ch_PP-OCRv4_det_infer.onnx"
RECOGNIZER = "ch_PP-OCRv4_rec_infer.onnx"
CLASSIFIER = "ch_ppocr_mobile_v2.0_cls_infer.onnx"
MODEL_FILES = (DETECTOR, RECOGNIZER, CLASSIFIER)
# Lines read with less confidence are dropped (rapidocr's own default threshold).
MIN_SCORE = 0.5


class PageReader:
    """The three PP-OCR sessions (detection, angle, recognition), built once per load."""

    def __init__(self, paths: dict[str, str], n_threads: int | None):
        from rapidocr_onnxruntime import RapidOCR

        threads = {"intra_op_num_threads": n_threads} if n_threads else {}
        self._ocr = RapidOCR(
            det_model_path=paths[DETECTOR],
            rec_model_path=paths[RECOGNIZER],
            cls_model_path=paths[CLASSIFIER],
            text_score=MIN_SCORE,
            **threads,
        )

    def read(self, image: Image.Image, scale: float) -> list[Line]:
        """The text lines of `image`, boxes divided by `scale` (pixels per page unit)."""
        # rapidocr takes OpenCV's BGR channel order.
        return self.read_pixels(np.asarray(image.convert("RGB"))[:, :, ::-1], scale)

    def read_pixels(self, bgr: np.ndarray, scale: float) -> list[Line]:
        """The text lines of an H x W x 3 BGR array (a page as pdfium renders it), boxes divided
        by `scale`. rapidocr shrinks an image to 2000 px on its longer side before it reads."""
        found, _ = self._ocr(np.ascontiguousarray(bgr))
        lines = []
        for points, text, score in found or []:
            if not text.strip() or float(score) < MIN_SCORE:
                continue
            xs, ys = [p[0] for p in points], [p[1] for p in points]
            box = Box(min(xs) / scale, min(ys) / scale, max(xs) / scale, max(ys) / scale)
            lines.append(Line(text.strip(), box))
        return lines
