"""`hypnos pull <catalog id>[:quant]`: POST /api/pull, whose NDJSON lines (Ollama's: `status`,
and `digest`, `total`, `completed` while a file downloads) drive one progress bar per file.

The server downloads into its own models_dir (resumed after an interruption, checked for size
and sha256) and adds the model to its pool, so `hypnos run <id>` works right after. Leaving
with Ctrl-C closes the connection: the server stops the download and keeps the part to resume."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from tqdm import tqdm

from hypnos_cli.client import CliError, Server
from hypnos_cli.output import note

# A digest is `sha256:<64 hex>` (or a file name where the catalog lists no hash): its first
# characters tell files apart, as `ollama pull` shows them.
SHOWN_DIGEST_CHARS = 12


def _label(digest: str) -> str:
    _, colon, hexes = digest.partition(":")
    return f"pulling {hexes[:SHOWN_DIGEST_CHARS] if colon else digest}"


class Bars:
    """One tqdm bar (on stderr) per file of the pull, updated from the progress lines."""

    def __init__(self) -> None:
        self.bars: dict[str, tqdm] = {}

    def show(self, digest: str, completed: int, total: int) -> None:
        bar = self.bars.get(digest)
        if bar is None:
            for other in self.bars.values():
                other.close()
            bar = self.bars[digest] = tqdm(
                total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=_label(digest), file=sys.stderr
            )
        if bar.total != total:
            bar.total = total
        bar.update(completed - bar.n)

    def close(self) -> None:
        for bar in self.bars.values():
            bar.close()


def _error(event: dict[str, Any]) -> str:
    error = event["error"]
    return str(error.get("message", error) if isinstance(error, dict) else error)


def do_pull(server: Server, args: argparse.Namespace) -> int:
    started = time.monotonic()
    bars = Bars()
    status = None
    try:
        with server.stream("POST", "/api/pull", {"model": args.name, "stream": True}) as lines:
            for line in lines:
                if not line.strip():
                    continue
                event = json.loads(line)
                if "error" in event:
                    raise CliError(_error(event))
                if args.json:
                    print(line, flush=True)
                elif event.get("digest") and event.get("total") is not None:
                    bars.show(event["digest"], event.get("completed") or 0, event["total"])
                else:
                    bars.close()
                    print(event.get("status", line), flush=True)
                status = event.get("status")
    except CliError as error:
        if "not found" in str(error):
            raise CliError(f"{error} (GET /v1/models/catalog lists what this server can pull)") from error
        raise
    finally:
        bars.close()
    if status != "success":
        raise CliError(f"the pull of {args.name} ended without success (last status: {status})")
    if not args.json:
        note(f"pulled {args.name} in {time.monotonic() - started:.1f} s; `hypnos run {args.name.partition(':')[0]}`")
    return 0
