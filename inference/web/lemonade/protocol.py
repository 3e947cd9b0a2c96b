"""Lemonade's request bodies (lemonade-api.md)."""

from __future__ import annotations

from pydantic import Field, field_validator

from hypnos_site.config import MAX_CONTEXT_LEN
from hypnos_site.errors import InvalidRequest
from inference.web.common.protocol import _Wire


class LemonadeLoadRequest(_Wire):
    """POST /api/v1/load: promote to tier 1 with Lemonade's options; `save_options` keeps them
    as the model's saved options (GET /v1/models/{id}/options), so later loads use them."""

    model_name: str | None = Field(default=None, min_length=1)
    model: str | None = Field(default=None, min_length=1)
    # -1: the model's own context (Lemonade's "auto").
    ctx_size: int | None = None
    save_options: bool = False

    @field_validator("ctx_size")
    @classmethod
    def _context(cls, value: int | None) -> int | None:
        if value is not None and value != -1 and not 256 <= value <= MAX_CONTEXT_LEN:
            raise ValueError(f"must be -1 (the model's own) or between 256 and {MAX_CONTEXT_LEN}")
        return None if value == -1 else value

    @property
    def name(self) -> str:
        name = self.model_name or self.model
        if name is None:
            raise InvalidRequest("model_name is required", param="model_name")
        return name


class LemonadePullRequest(_Wire):
    """POST /api/v1/pull: a catalog variant (`<id>`, `<id>:<quant>`) into models_dir and the pool."""

    model_name: str = Field(min_length=1, max_length=512)
    stream: bool = False
