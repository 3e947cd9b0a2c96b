"""Images in chat prompts through llama.cpp's multimodal library (libmtmd, shipped with
llama-cpp-python): the model block's projector GGUF (`aux_path`) encodes each image into
embeddings that the text model reads where the image stood in the prompt."""

from __future__ import annotations

import ctypes
import io
import warnings
from pathlib import Path

import llama_cpp
import llama_cpp.mtmd_cpp as mtmd
from llama_cpp._logger import llama_log_callback
from PIL import Image, UnidentifiedImageError

from hypnos_site.errors import ContextLengthExceeded, InvalidRequest, ModelNotAvailable, ServerError
from inference.transport.wire import IMAGE_MARKER

# Prompt positions holding image embeddings carry this id in the context's token list, so a
# later text-only prompt never takes them for cached text.
IMAGE_POSITION = -1

# libmtmd logs through its own hooks: send them where llama.cpp's go (errors only unless verbose).
mtmd.mtmd_log_set(llama_log_callback, ctypes.c_void_p(0))
mtmd.mtmd_helper_log_set(llama_log_callback, ctypes.c_void_p(0))


def decode_rgb(data: bytes, index: int) -> Image.Image:
    """RGB pixels decoded with Pillow (PNG, JPEG, WebP, GIF, BMP, TIFF, ...), which reads more
    formats than llama.cpp's own decoder. The web process checked the size already; this
    process's own cap (Image.MAX_IMAGE_PIXELS, set from limits.max_image_pixels) is checked
    again from the header, so no path decodes a larger image."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:
                width, height = image.size
                cap = Image.MAX_IMAGE_PIXELS
                if cap is not None and width * height > cap:
                    raise InvalidRequest(
                        f"image {index + 1} of the request is {width}x{height} pixels, above "
                        f"limits.max_image_pixels ({cap}).",
                        param="messages",
                    )
                return image.convert("RGB")
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
        raise InvalidRequest(f"image {index + 1} of the request cannot be decoded: {exc}", param="messages") from exc


class Projector:
    """One mtmd context: a projector bound to a loaded llama.cpp text model."""

    def __init__(self, path: Path, llm: llama_cpp.Llama, n_threads: int | None, use_gpu: bool):
        params = mtmd.mtmd_context_params_default()
        params.use_gpu = use_gpu
        params.print_timings = False
        params.n_threads = n_threads or llm.n_threads
        params.media_marker = IMAGE_MARKER.encode()
        ctx = mtmd.mtmd_init_from_file(str(path).encode(), llm.model, params)
        if not ctx:
            raise ModelNotAvailable(
                f"the projector {path} could not be loaded for this model "
                "(not an mmproj GGUF, or made for another text model)"
            )
        self.ctx = ctx
        if not mtmd.mtmd_support_vision(ctx):
            self.close()
            raise ModelNotAvailable(f"the projector {path} has no vision encoder")
        if mtmd.mtmd_decode_use_mrope(ctx):
            # llama-cpp-python counts one position per token; M-RoPE images take fewer.
            self.close()
            raise ModelNotAvailable(f"the projector {path} needs M-RoPE positions, which this engine does not place")

    def close(self) -> None:
        if self.ctx:
            mtmd.mtmd_free(self.ctx)
            self.ctx = None

    def evaluate(self, llm: llama_cpp.Llama, prompt: str, images: list[bytes]) -> list[int]:
        """Evaluate the prompt, its images in place of their markers, into the context from
        position 0, all but the last token (generation evaluates that one for its logits).
        Returns the context's token list, image positions as IMAGE_POSITION."""
        bitmaps = [self._bitmap(data, i) for i, data in enumerate(images)]
        chunks = mtmd.mtmd_input_chunks_init()
        try:
            self._tokenize(chunks, prompt, bitmaps)
            total = mtmd.mtmd_helper_get_n_tokens(chunks)
            if total >= llm.n_ctx():
                raise ContextLengthExceeded(
                    f"The prompt is {total} tokens with its images but the model's context is {llm.n_ctx()} tokens; "
                    "send fewer or smaller images, or ask for a larger num_ctx.",
                    param="messages",
                )
            llm.reset()
            llm._ctx.kv_cache_clear()
            return self._eval_chunks(llm, chunks)
        finally:
            mtmd.mtmd_input_chunks_free(chunks)
            for bitmap in bitmaps:
                mtmd.mtmd_bitmap_free(bitmap)

    def count(self, prompt: str, images: list[bytes]) -> int:
        """The tokens `evaluate` would put in the context for this prompt and its images,
        images tokenised (preprocessed) but not encoded."""
        bitmaps = [self._bitmap(data, i) for i, data in enumerate(images)]
        chunks = mtmd.mtmd_input_chunks_init()
        try:
            self._tokenize(chunks, prompt, bitmaps)
            return int(mtmd.mtmd_helper_get_n_tokens(chunks))
        finally:
            mtmd.mtmd_input_chunks_free(chunks)
            for bitmap in bitmaps:
                mtmd.mtmd_bitmap_free(bitmap)

    def _bitmap(self, data: bytes, index: int) -> int:
        rgb = decode_rgb(data, index)
        pixels = rgb.tobytes()
        bitmap = mtmd.mtmd_bitmap_init(rgb.width, rgb.height, (ctypes.c_uint8 * len(pixels)).from_buffer_copy(pixels))
        if not bitmap:
            raise ServerError("llama.cpp refused an image bitmap")
        return bitmap

    def _tokenize(self, chunks: int, prompt: str, bitmaps: list[int]) -> None:
        text = prompt.encode("utf-8")
        # The chat template already wrote the BOS text; special tokens are parsed as in text prompts.
        source = mtmd.mtmd_input_text(text=text, text_len=len(text), add_special=False, parse_special=True)
        array = (mtmd.mtmd_bitmap_p_ctypes * len(bitmaps))(*bitmaps)
        code = mtmd.mtmd_tokenize(self.ctx, chunks, ctypes.byref(source), array, len(bitmaps))
        if code == 1:
            raise InvalidRequest("the prompt's image markers do not match its images", param="messages")
        if code != 0:
            raise InvalidRequest(f"the projector could not preprocess the images (mtmd error {code})", param="messages")

    def _eval_chunks(self, llm: llama_cpp.Llama, chunks: int) -> list[int]:
        tokens: list[int] = []
        count = mtmd.mtmd_input_chunks_size(chunks)
        for i in range(count):
            chunk = mtmd.mtmd_input_chunks_get(chunks, i)
            if mtmd.mtmd_input_chunk_get_type(chunk) == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
                n = ctypes.c_size_t()
                pointer = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                text_tokens = [pointer[j] for j in range(n.value)]
                # The last token is left to generation, which re-evaluates it for the logits.
                llm.eval(text_tokens[:-1] if i == count - 1 else text_tokens)
                tokens += text_tokens
                continue
            n_past = llm.n_tokens
            new_past = llama_cpp.llama_pos(0)
            code = mtmd.mtmd_helper_eval_chunk_single(
                self.ctx, llm._ctx.ctx, chunk, n_past, 0, llm.n_batch, False, ctypes.byref(new_past)
            )
            if code != 0:
                raise ServerError(f"the projector failed to evaluate an image (mtmd error {code})")
            llm.input_ids[n_past : new_past.value] = IMAGE_POSITION
            llm.n_tokens = new_past.value
            tokens += [IMAGE_POSITION] * (new_past.value - n_past)
        if tokens[-1] == IMAGE_POSITION:
            raise InvalidRequest(
                "the prompt ends with an image; the chat template must write text after it", param="messages"
            )
        return tokens
