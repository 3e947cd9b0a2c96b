"""OCR of page images with the PP-OCRv4 ONNX models, through rapidocr-onnxruntime.

docling's own RapidOCR stage needs the `rapidocr` 3.x package and runs only inside the
StandardPdfPipeline, which needs the layout model no registry carries; so the engine reads the
pages without a text layer (and image inputs) here and lays the lines out itself
(inference/engines/page_layout.py). The three ONNX files come from the rapidocr-onnxruntime
wheel (`manage.py installmodels` places its `models/` folder); sessions open them from the
engine's warm copies. rapidocr's classifier and recognizer read the lines; the detector's input
size is set here (detection_size), so that no page, however large or thin, costs more than a
bounded workspace."""

from __future__ import annotations

import math

import numpy as np
from PIL import Image

from inference.engines.page_layout import Box, Line

DETECTOR = "ch_PP-OCRv4_det_infer.onnx"
RECOGNIZER = "ch_PP-OCRv4_rec_infer.onnx"
CLASSIFIER = "ch_ppocr_mobile_v2.0_cls_infer.onnx"
MODEL_FILES = (DETECTOR, RECOGNIZER, CLASSIFIER)
# Lines read with less confidence are dropped (rapidocr's own default threshold).
MIN_SCORE = 0.5
# The detector (a DB network) takes ~150 bytes per input pixel whatever the session options
# (measured: 593 MB for 1984 x 1984 on onnxruntime 1.32), so it sees at most this many pixels:
# ~150 MB. An A4 page is detected at ~832 x 1184 (12 pt text ~17 px tall; PaddleOCR's own default
# detects at 960 px on the longer side, ~14 px) and each line is then read from the full render.
DETECTION_PIXELS = 1_000_000
# rapidocr's defaults: small images are enlarged to this shorter side, large ones reduced to
# that longer side.
DETECTION_MIN_SIDE = 736
DETECTION_MAX_SIDE = 2000


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
        # PP-OCR takes OpenCV's BGR channel order.
        return self.read_pixels(np.asarray(image.convert("RGB"))[:, :, ::-1], scale)

    def read_pixels(self, bgr: np.ndarray, scale: float) -> list[Line]:
        """The text lines of an H x W x 3 BGR array (a page as pdfium renders it), boxes divided
        by `scale`: the lines found at detection_size(), each read from `bgr` itself."""
        bgr = np.ascontiguousarray(bgr)
        boxes = self._detect(bgr)
        if not boxes:
            return []
        crops = self._ocr.get_crop_img_list(bgr, boxes)
        crops, _, _ = self._ocr.text_cls(crops)
        read, _ = self._ocr.text_rec(crops, False)
        lines = []
        for points, (text, score) in zip(boxes, read, strict=True):
            if not text.strip() or float(score) < MIN_SCORE:
                continue
            xs, ys = [float(p[0]) for p in points], [float(p[1]) for p in points]
            box = Box(min(xs) / scale, min(ys) / scale, max(xs) / scale, max(ys) / scale)
            lines.append(Line(text.strip(), box))
        return lines

    def _detect(self, bgr: np.ndarray) -> list[np.ndarray]:
        """The text boxes of `bgr` (its own coordinates, top to bottom): PP-OCR's detector run at
        detection_size(), so that its activations stay within DETECTION_PIXELS whatever the
        page (rapidocr's own sizing let a 260 x 2000 strip grow to 4.2 Mpx, ~630 MB)."""
        import cv2
        from rapidocr_onnxruntime.ch_ppocr_det.utils import DetPreProcess

        height, width = bgr.shape[:2]
        det_width, det_height = detection_size(width, height)
        shrink = det_width * det_height < width * height
        resized = cv2.resize(bgr, (det_width, det_height), interpolation=cv2.INTER_AREA if shrink else cv2.INTER_LINEAR)
        detector = self._ocr.text_det
        # limit "max" at the size it already has: normalised and laid out, not resized again.
        tensor = DetPreProcess(max(det_width, det_height), "max", detector.mean, detector.std)(resized)
        del resized
        found, _ = detector.postprocess_op(detector.infer(tensor)[0], (height, width))
        found = detector.filter_tag_det_res(found, (height, width))
        return list(self._ocr.sorted_boxes(found)) if len(found) else []


def detection_size(width: int, height: int) -> tuple[int, int]:
    """The size (multiples of 32) the detector sees a width x height image at: rapidocr's own
    (a shorter side of at least DETECTION_MIN_SIDE, a longer side of at most
    DETECTION_MAX_SIDE), then shrunk to at most DETECTION_PIXELS."""
    scale = max(DETECTION_MIN_SIDE / min(width, height), 1.0)
    scale = min(scale, DETECTION_MAX_SIDE / max(width, height), math.sqrt(DETECTION_PIXELS / (width * height)))
    # Rounded down to the network's stride, at least one stride.
    return max(32, int(width * scale) // 32 * 32), max(32, int(height * scale) // 32 * 32)
