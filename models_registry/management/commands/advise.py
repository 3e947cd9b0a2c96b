"""`manage.py advise --needs chat,voice [--vram 24G --ram 64G | --unified --ram 32G] [--json | --config]`:
the advisor of POST /v1/advisor (spec §6) on the command line."""

from __future__ import annotations

import argparse
import json
import re

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from models_registry.advisor import NEEDS, Advice, NoLineup, recommend
from models_registry.catalog import catalog_path, load_catalog
from models_registry.machine import GIB, resolve_machine

_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def byte_size(text: str) -> int:
    """`24G`, `512M`, `64GiB` or plain bytes; the units are binary (24G = 24 GiB)."""
    match = _SIZE.match(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 24G, 512M or 25769803776")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def need_list(text: str) -> list[str]:
    needs = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in needs if n not in NEEDS]
    if not needs or unknown:
        raise argparse.ArgumentTypeError(f"needs are a comma-separated list of {', '.join(NEEDS)}")
    return needs


class Command(BaseCommand):
    help = "Recommend a lineup from the model catalog for a machine and a set of needs (spec §6 POST /v1/advisor)."
    requires_system_checks: list[str] = []

    def add_arguments(self, parser):  # type: ignore[no-untyped-def]
        parser.add_argument("--needs", required=True, type=need_list, help=f"comma-separated: {', '.join(NEEDS)}")
        parser.add_argument("--vram", type=byte_size, help="GPU memory, e.g. 24G (0: no GPU); default: this machine's")
        parser.add_argument("--ram", type=byte_size, help="installed memory, e.g. 64G; default: this machine's")
        parser.add_argument(
            "--unified", action="store_true", default=None, help="unified memory (Apple Silicon): --vram is ignored"
        )
        output = parser.add_mutually_exclusive_group()
        output.add_argument("--json", action="store_true", help="print the POST /v1/advisor answer")
        output.add_argument("--config", action="store_true", help="print only the generated config file")

    def handle(self, *args, needs, vram, ram, unified, **options):  # type: ignore[no-untyped-def]
        config = settings.HYPNOS
        path = catalog_path(config)
        if not path.exists():
            raise CommandError(f"there is no model catalog ({path})")
        machine = resolve_machine(vram, ram, unified, config.hardware)
        try:
            advice = recommend(load_catalog(path), needs, machine, config.models_dir)
        except NoLineup as exc:
            raise CommandError(str(exc)) from exc
        if options["json"]:
            self.stdout.write(json.dumps(advice.as_dict(), indent=2))
        elif options["config"]:
            self.stdout.write(advice.config, ending="")
        else:
            self.stdout.write(table(advice))


def table(advice: Advice) -> str:
    """The human-readable answer: budgets, one row per model, warnings, what to do next."""
    answer = advice.as_dict()
    budgets = answer["budgets"]
    lines = [
        f"Machine: {advice.machine.describe()}; tier 1 {_gib(budgets['tier1_bytes'])}, "
        f"tier 2 {_gib(budgets['tier2_bytes'])}.",
        "",
    ]
    rows = [("model", "quant", "serves", "starts in", "context", "resident", "layers in tier 1", "priority")]
    for m in answer["models"]:
        rows.append(
            (
                m["id"],
                m["quant"],
                ", ".join(m["serves"]),
                m["initial_tier"],
                str(m["context_len"]),
                _gib(m["resident_bytes"]),
                f"{m['gpu_layers']}/{m['num_layers']}" if m["num_layers"] else "all",
                m["priority"],
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    together = "yes" if answer["interactive_coresident"] else "no"
    lines += ["", f"Interactive models resident together: {together} ({_gib(answer['interactive_bytes'])} in tier 1)."]
    lines += [f"Warning: {w}" for w in answer["warnings"]]
    lines += [
        f"Catalog specs: {' '.join(answer['specs'])}",
        "The config file: the same command with --config (e.g. > hypnos.toml).",
    ]
    return "\n".join(lines)


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"
