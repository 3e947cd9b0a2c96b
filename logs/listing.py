"""What the Files and Batch APIs' rows share: who sees a row (its owner's key, and admin keys),
and OpenAI's list page over rows ordered by creation (`data`, `first_id`, `last_id`,
`has_more`, the next page asked for with `after`, the last id of this one)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from django.db.models import Model, QuerySet

from models_registry.authentication import ApiPrincipal


class Owned(Protocol):
    id: str
    created_at: Any


R = TypeVar("R", bound=Model)


def owned_by(rows: QuerySet[R], principal: ApiPrincipal | None) -> QuerySet[R]:
    """The rows `principal` may see: all for admin keys and the open API (no key configured),
    else the key's own (`owner_label`)."""
    if principal is None or principal.admin:
        return rows
    return rows.filter(owner_label=principal.label)


def page(
    rows: QuerySet[R], *, limit: int, after: Owned | None, ascending: bool, render: Callable[[R], dict[str, Any]]
) -> dict[str, Any]:
    """One page of `rows` in creation order (ties by id), those after the row `after` only."""
    ordered = rows.order_by("created_at", "id") if ascending else rows.order_by("-created_at", "-id")
    if after is not None:
        if ascending:
            ordered = ordered.filter(created_at__gte=after.created_at).exclude(
                created_at=after.created_at, id__lte=after.id
            )
        else:
            ordered = ordered.filter(created_at__lte=after.created_at).exclude(
                created_at=after.created_at, id__gte=after.id
            )
    found = list(ordered[: limit + 1])
    data = [render(row) for row in found[:limit]]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(found) > limit,
    }
