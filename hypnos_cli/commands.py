"""The verbs that read or move the server's state: list, ps, status, load, unload, logs, keys.
Each takes the Server and the parsed arguments and returns the exit status."""

from __future__ import annotations

import argparse
import json
import time
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

from hypnos_cli.client import LONG, LONG_TIMEOUT_SECS, CliError, Server
from hypnos_cli.output import TIER1, TIER2, TIER3, dump, duration, note, size, table, tier

# `logs -f` asks for this many records each poll, enough for a busy second.
FOLLOW_PAGE = 200
# A move that outlasts the server's request_timeout_secs (a 202): how often to look again.
MOVE_POLL_SECS = 1.0


# -- list, ps, status ---------------------------------------------------------------------------


def do_list(server: Server, args: argparse.Namespace) -> int:
    """GET /v1/models: the models in service, with what a picker reads."""
    listed = server.get("/v1/models")
    if args.json:
        return dump(listed)
    rows = [
        [
            model["id"],
            model.get("modality") or "-",
            tier(model.get("current_tier")) + ("" if model.get("downloaded", True) else " (no file)"),
            str(model.get("context_length") or "-"),
            ",".join(model.get("capabilities") or []) or "-",
        ]
        for model in listed["data"]
    ]
    print(table(["ID", "MODALITY", "TIER", "CONTEXT", "CAPABILITIES"], rows))
    return 0


def memory_lines(status: dict[str, Any]) -> list[str]:
    """The device and the tiers' byte counters of GET /v1/memory/status, one line each."""
    device = status.get("capabilities") or {}
    simulated = ", simulated" if device.get("simulated") else ""
    used, free = status.get("tier1_vram_used_bytes"), status.get("tier1_vram_free_bytes")
    budget = used + free if used is not None and free is not None else None
    lines = [
        f"device   {device.get('device_name', '-')} ({device.get('accelerator', '-')}{simulated})",
        f"tier 1   {size(used)} booked of {size(budget)}, "
        f"{size(status.get('tier1_vram_effective_free_bytes'))} free for a promotion now",
        f"tier 2   {size(status.get('tier2_pinned_ram_used_bytes'))} used, "
        f"{size(status.get('tier2_pinned_ram_free_bytes'))} free",
    ]
    cap = status.get("process_memory_cap_bytes")
    lines.append(f"process  {size(status.get('process_memory_bytes'))}" + (f" of {size(cap)} allowed" if cap else ""))
    return lines


def _ps_row(model: dict[str, Any], with_expiry: bool) -> list[str]:
    placement = model.get("placement") or {}
    vram = (placement.get("vram_weight_bytes") or 0) + (placement.get("vram_kv_and_workspace_bytes") or 0)
    row = [
        model["id"],
        tier(model.get("current_tier")),
        size(model.get("total_weight_bytes")),
        size(vram),
        size(placement.get("pinned_ram_bytes") or 0),
        str(placement.get("allocated_context_len") or "-"),
        str(model.get("active_leases", 0)),
        duration(model.get("idle_seconds")),
        str(model.get("total_requests_served", 0)),
    ]
    return [*row, _until(model.get("expires_at"))] if with_expiry else row


def _until(expires_at: str | None) -> str:
    """`in 4m59s` for an idle unload due at `expires_at` (ISO 8601); `-` when none is coming."""
    if not expires_at:
        return "-"
    try:
        due = datetime.fromisoformat(expires_at.replace("Z", "+00:00"))
    except ValueError:
        return expires_at
    return "in " + duration(max((due - datetime.now(UTC)).total_seconds(), 0))


def do_ps(server: Server, args: argparse.Namespace) -> int:
    """GET /v1/memory/status: what is resident, the bytes each tier holds and the leases."""
    status = server.get("/v1/memory/status")
    if args.json:
        return dump(status)
    print("\n".join(memory_lines(status)))
    shown = [m for m in status.get("models", []) if args.all or m.get("current_tier") in (TIER1, TIER2)]
    if not shown:
        print("\nno model is resident (hypnos ps --all lists every model)")
        return 0
    with_expiry = any("expires_at" in m for m in shown)
    headers = ["MODEL", "TIER", "WEIGHTS", "VRAM", "RAM", "CONTEXT", "LEASES", "IDLE", "REQUESTS"]
    print()
    print(table(headers + (["EXPIRES"] if with_expiry else []), [_ps_row(m, with_expiry) for m in shown]))
    return 0


def do_batches(server: Server, args: argparse.Namespace) -> int:
    """GET /v1/batches: the key's batches (an admin key's: everyone's), newest first, with the
    lines done and the model a running batch holds."""
    listed = server.get("/v1/batches", params={"limit": args.limit})
    if args.json:
        return dump(listed)
    if not listed["data"]:
        print("no batch")
        return 0
    now = time.time()
    rows = []
    for batch in listed["data"]:
        counts = batch["request_counts"]
        rows.append(
            [
                batch["id"],
                batch["status"],
                batch["endpoint"],
                f"{counts['completed'] + counts['failed']}/{counts['total']}",
                str(counts["failed"]),
                batch.get("hypnos_current_model") or "-",
                duration(now - batch["created_at"]) + " ago",
            ]
        )
    print(table(["BATCH", "STATUS", "ENDPOINT", "DONE", "FAILED", "MODEL", "CREATED"], rows))
    return 0


def do_status(server: Server, args: argparse.Namespace) -> int:
    """GET /health, /ready and the memory summary; status 1 while the server is not ready."""
    health = server.get("/health")
    ready = server.get("/ready", allow=(503,))
    if not args.json:
        print(f"server   {server.url}: hypnos {health.get('version', '?')}, up {duration(health.get('uptime_secs'))}")
        print("ready    " + ("yes" if ready.get("ready") else f"no: {ready.get('reason', 'not ready')}"))
    memory = server.get("/v1/memory/status")
    if args.json:
        dump({"health": health, "ready": ready, "memory": memory})
    else:
        print("\n".join(memory_lines(memory)))
        models = memory.get("models", [])
        counts = [sum(m.get("current_tier") == name for m in models) for name in (TIER1, TIER2, TIER3)]
        leased = sum(1 for m in models if m.get("active_leases"))
        print(f"models   {counts[0]} in tier 1, {counts[1]} in tier 2, {counts[2]} in tier 3; {leased} serving")
    return 0 if ready.get("ready") else 1


# -- load, unload -------------------------------------------------------------------------------


def _move(server: Server, args: argparse.Namespace, target: str, body: dict[str, Any]) -> int:
    started = time.monotonic()
    moved = server.call(
        "POST", "/v1/memory/tier", body={"model": args.model, "target_tier": target, **body}, timeout=LONG
    )
    if moved.get("status") == "moving":  # 202: past the server's request_timeout_secs, still going
        moved = _until_moved(server, moved.get("model") or args.model, target, started)
    if args.json:
        return dump(moved)
    placement = moved.get("placement") or {}
    where = {
        TIER1: f"{size(placement.get('vram_weight_bytes'))} of weights in VRAM, "
        f"context {placement.get('allocated_context_len') or '-'}",
        TIER2: f"{size(placement.get('pinned_ram_bytes'))} in host RAM",
        TIER3: "on disk only",
    }[target]
    print(f"{moved.get('model', args.model)} is in tier {tier(target)} ({where}), {time.monotonic() - started:.1f} s")
    return 0


def _until_moved(server: Server, model: str, target: str, started: float) -> dict[str, Any]:
    """Poll GET /v1/memory/status until the model is in `target`: its row there."""
    while time.monotonic() - started < LONG_TIMEOUT_SECS:
        time.sleep(MOVE_POLL_SECS)
        rows = server.get("/v1/memory/status").get("models") or []
        row = next((r for r in rows if r.get("id") == model), None)
        if row is not None and row.get("current_tier") == target:
            return {"model": model, "placement": row.get("placement") or {}}
    raise CliError(f"{model} is not in tier {tier(target)} after {LONG_TIMEOUT_SECS:g} s")


def do_load(server: Server, args: argparse.Namespace) -> int:
    """POST /v1/memory/tier: promote to tier 1 (or warm into tier 2 with --warm)."""
    if args.warm:
        return _move(server, args, TIER2, {})
    return _move(server, args, TIER1, {"context_len": args.ctx} if args.ctx else {})


def do_unload(server: Server, args: argparse.Namespace) -> int:
    """POST /v1/memory/tier: demote to tier 2, host RAM (to tier 3, disk, with --disk)."""
    return _move(server, args, TIER3 if args.disk else TIER2, {})


# -- logs ---------------------------------------------------------------------------------------


def log_line(record: dict[str, Any]) -> str:
    started = str(record.get("started_at") or "")[:19].replace("T", " ")
    tokens = f"{record.get('tokens_in') or 0}+{record.get('tokens_out') or 0} tok"
    parts = [
        started,
        record.get("id") or "-",
        f"{record.get('method', '')} {record.get('route', '')}",
        str(record.get("status", "")),
        record.get("model") or "-",
        f"{record.get('duration_ms') or 0:.0f} ms",
        tokens,
    ]
    if record.get("key"):
        parts.append(f"key={record['key']}")
    if record.get("error"):
        parts.append(f"error: {record['error']}")
    return "  ".join(parts)


def do_logs(server: Server, args: argparse.Namespace) -> int:
    """GET /v1/logs, oldest first; -f polls for new records until interrupted."""
    params = {k: v for k, v in {"model": args.model, "route": args.route, "status": args.status}.items() if v}
    seen: dict[str, None] = {}
    limit = args.limit
    while True:
        page = server.get("/v1/logs", params={**params, "limit": limit})
        for record in reversed(page.get("records", [])):
            if record["id"] in seen:
                continue
            seen[record["id"]] = None
            print(dump_line(record) if args.json else log_line(record), flush=True)
        if not args.follow:
            return 0
        # Only ids that can still come back in a page are worth remembering.
        for old in list(seen)[: max(len(seen) - 2 * FOLLOW_PAGE, 0)]:
            del seen[old]
        limit = FOLLOW_PAGE
        time.sleep(args.interval)


def dump_line(record: dict[str, Any]) -> str:
    """`logs --json`: one record a line (NDJSON), so that `-f` can be piped on."""
    return json.dumps(record, ensure_ascii=False)


# -- keys ---------------------------------------------------------------------------------------


def do_keys_create(server: Server, args: argparse.Namespace) -> int:
    """POST /v1/keys: the new key alone on stdout (it is never shown again), notes on stderr."""
    body: dict[str, Any] = {"label": args.label, "admin": args.admin}
    for name in ("requests_per_minute", "max_concurrent", "tokens_per_day"):
        if getattr(args, name) is not None:
            body[name] = getattr(args, name)
    if args.models:
        body["models"] = [m.strip() for m in args.models.split(",") if m.strip()]
    created = server.call("POST", "/v1/keys", body=body)
    if args.json:
        return dump(created)
    print(created["key"])
    kind = "an admin key" if created.get("admin") else "a key"
    note(f"{kind} labelled {created['label']!r}: store it now, the server keeps only its hash")
    if created.get("warning"):
        note(created["warning"])
    return 0


def _limits(key: dict[str, Any]) -> str:
    limits = [
        f"{key[name]} {unit}"
        for name, unit in (
            ("requests_per_minute", "req/min"),
            ("max_concurrent", "at once"),
            ("tokens_per_day", "tok/day"),
        )
        if key.get(name)
    ]
    if key.get("models"):
        limits.append("models " + ",".join(key["models"]))
    return "; ".join(limits) or "-"


def do_keys_list(server: Server, args: argparse.Namespace) -> int:
    """GET /v1/keys: every key the server knows, the config's and the database's."""
    listed = server.get("/v1/keys")
    if args.json:
        return dump(listed)
    rows = [
        [
            key["label"],
            key.get("key_prefix") or "-",
            "yes" if key.get("admin") else "no",
            "yes" if key.get("active") else "revoked",
            key.get("source", "-"),
            _limits(key),
            str(key.get("created") or "-")[:19].replace("T", " "),
        ]
        for key in listed["data"]
    ]
    print(table(["LABEL", "PREFIX", "ADMIN", "ACTIVE", "SOURCE", "LIMITS", "CREATED"], rows))
    return 0


def do_keys_revoke(server: Server, args: argparse.Namespace) -> int:
    """DELETE /v1/keys/{label or id}: the key answers 401 from now on."""
    revoked = server.call("DELETE", f"/v1/keys/{quote(args.name, safe='')}")
    if args.json:
        return dump(revoked)
    print(f"revoked the key {revoked['label']!r} ({revoked.get('key_prefix') or '-'}…)")
    return 0
