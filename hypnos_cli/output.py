"""How the CLI writes what the server answers: aligned tables, byte counts and durations a person
reads at a glance, or the JSON as it came (`--json`)."""

from __future__ import annotations

import json
import sys
from typing import Any

TIER1, TIER2, TIER3 = "tier1_gpu_vram", "tier2_pinned_ram", "tier3_nvme_ssd"
TIER_NAMES = {TIER1: "1 vram", TIER2: "2 ram", TIER3: "3 disk"}


def dump(value: Any) -> int:
    """`--json`: the server's answer, indented, on stdout."""
    print(json.dumps(value, indent=2, ensure_ascii=False))
    return 0


def tier(name: str | None) -> str:
    return TIER_NAMES.get(name or "", name or "-")


def size(count: float | None) -> str:
    """Bytes in binary units: `0 B`, `812 KiB`, `101.3 MiB`, `7.7 GiB`."""
    if count is None:
        return "-"
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit in ("B", "KiB") else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def duration(secs: float | None) -> str:
    """`4s`, `2m13s`, `3h05m`, `2d4h`."""
    if secs is None:
        return "-"
    whole = int(secs)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600}h"


def table(headers: list[str], rows: list[list[str]]) -> str:
    """Left-aligned columns two spaces apart, as `ollama list` and `docker ps` print them."""
    widths = [max(len(row[i]) for row in [headers, *rows]) for i in range(len(headers))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in [headers, *rows]
    )


def note(message: str) -> None:
    """A line for the person at the terminal, on stderr so that stdout stays the answer."""
    print(message, file=sys.stderr)
