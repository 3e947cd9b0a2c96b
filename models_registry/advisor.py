"""The lineup advisor (spec §6, POST /v1/advisor): which catalog models and variants to run on a
machine for a set of needs, where each starts, and the config file that runs them.

Plain Python (no Django): the budgets are derived as the server derives them, every candidate is
placed with the scheduler's own planner (memory/planner.py), and the generated config is
validated by hypnos_site/config.py before it is handed out.

How a lineup scores: each need's role (chat, speech in, speech out, ...) counts the parameters of
the model doing it, speech in at a quarter and speech out at a tenth (their quality levels off
early), times how well that model fits: whole in tier 1 counts fully, a layer split counts
PARTIAL_FIT times its share of layers on the GPU, and an interactive model that cannot stay in
tier 1 counts ON_DEMAND_FIT (every use reloads it). A lineup whose interactive models all stay
whole in tier 1 together gets CORESIDENT_BONUS.

Which entries are tried: a machine without a GPU plans from the catalog's CPU entries only (an
entry with `gpu = true` is left out); a machine with one plans each role from the GPU entries
that serve it, and from the others only when none of those fits. Every combination of the
interactive roles' candidates is placed (a candidate another one beats on every count, serving
the same roles, is dropped first); a non-interactive role (images, documents, entities) takes
its largest candidate that fits alone, since it never changes where the interactive models go
(they are placed first) and counts fully wherever it starts.
"""

from __future__ import annotations

import itertools
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from hypnos_site.config import HardwareConfig, HypnosConfig
from memory.gguf import GgufError
from memory.planner import Footprint, footprint_from_gguf, plan_placement
from memory.tiers import MemoryTier, Placement
from models_registry.catalog import Catalog, CatalogEntry, CatalogEstimate, CatalogVariant, config_block
from models_registry.machine import Budgets, Machine, derive_budgets, gib

LOAD_BYTES_PER_S = 3e9
REDUCED_CONTEXT = 8192
CORESIDENT_BONUS = 1.25
PARTIAL_FIT = 0.75
ON_DEMAND_FIT = 0.5

Need = Literal["chat", "vision", "voice", "transcription", "speech", "embeddings", "images", "documents", "entities"]
NEEDS: tuple[str, ...] = get_args(Need)
# Each need is one or more roles; one model of the lineup plays each role.
NEED_ROLES: dict[str, tuple[str, ...]] = {
    "chat": ("chat",),
    "vision": ("vision",),
    "voice": ("chat", "speech_in", "speech_out"),
    "transcription": ("speech_in",),
    "speech": ("speech_out",),
    "embeddings": ("embeddings",),
    "images": ("images",),
    "documents": ("documents",),
    "entities": ("entities",),
}
ROLE_MODALITY = {
    "chat": "text_generation",
    "vision": "vision",
    "speech_in": "speech_to_text",
    "speech_out": "text_to_speech",
    "embeddings": "embeddings",
    "images": "image_generation",
    "documents": "document_conversion",
    "entities": "entity_extraction",
}
ROLE_WEIGHT = {"speech_in": 0.25, "speech_out": 0.1}
INTERACTIVE_ROLES = frozenset({"chat", "vision", "speech_in", "speech_out", "embeddings"})
# The roles a context reduction applies to (one slot, at most REDUCED_CONTEXT tokens).
CHAT_ROLES = frozenset({"chat", "vision"})
# Bits per weight of llama.cpp's mixed quantizations (its quantize tool's table, Llama-3-8B);
# plain types come from the gguf package's block sizes.
MIXED_QUANT_BITS = {
    "Q2_K": 2.96,
    "Q3_K_S": 3.5,
    "Q3_K_M": 3.91,
    "Q3_K_L": 4.27,
    "Q4_K_S": 4.58,
    "Q4_K_M": 4.89,
    "Q5_K_S": 5.54,
    "Q5_K_M": 5.7,
}
# A llama.cpp chat model's execution slots, as llama-server's default: concurrent clients share
# decode steps, and the KV cache is one unified context, so slots add no memory.
CHAT_SLOTS = 4
PLAIN_QUANT_BITS = {"fp32": 32, "float32": 32, "fp16": 16, "float16": 16, "bf16": 16, "int8": 8, "int4": 4}


class NoLineup(ValueError):
    """No lineup serves the needs on this machine; the message says which need and why."""


# -- candidates --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    """One catalog variant with what it needs, read from its GGUF or the catalog's estimate."""

    entry: CatalogEntry
    variant: CatalogVariant
    footprint: Footprint
    params: int

    @property
    def spec(self) -> str:
        return f"{self.entry.id}:{self.variant.quant}"

    def serves(self, role: str) -> bool:
        return entry_serves(self.entry, role)

    def context_len(self, reduced: bool) -> int:
        context = self.variant.context_len
        if self.footprint.trained_context_len:
            context = min(context, self.footprint.trained_context_len)
        return min(context, REDUCED_CONTEXT) if reduced else context


def entry_serves(entry: CatalogEntry, role: str) -> bool:
    """Whether the entry can play `role`: its modality is the role's, primary or additional. An
    upscaler (capability `upscale`, /v1/images/upscale) is an image model that makes no image of
    its own, so it plays no `images` role: the worker refuses it a generation."""
    if role == "images" and "upscale" in entry.capabilities:
        return False
    modality = ROLE_MODALITY[role]
    return modality == entry.modality or modality in entry.additional_modalities


def variant_footprint(
    entry: CatalogEntry, variant: CatalogVariant, models_dir: Path, machine_platform: str
) -> Footprint:
    """What the variant needs in memory: a GGUF on disk is read (plus its other files), else
    the catalog's estimate stands in; engines without a GGUF hold their files plus a workspace.
    A file the catalog lists no size for counts its size on disk; until it is there, weights
    count the estimate's params at the quant's bits per weight and any other file (a tokenizer,
    a config: small beside the weights) counts nothing. Raises LookupError when the weights can
    be neither measured nor estimated."""
    files = [f for f in variant.files if f.platform in ("all", machine_platform)]
    weights = next(f for f in files if f.role == "weights")
    beside = sum(f.known_size(models_dir) or 0 for f in files if f is not weights)
    estimate = variant.estimate or CatalogEstimate()
    weights_size = weights.known_size(models_dir)
    if weights_size is None:
        weights_size = _estimated_weights_bytes(entry, variant)
    if entry.engine != "ggml_llama":
        return Footprint(
            layer_bytes=(),
            other_bytes=weights_size + beside,
            kv_bytes_per_token=0,
            workspace_bytes=estimate.workspace_bytes,
        )
    path = models_dir / weights.local
    if path.is_file():
        try:
            read = footprint_from_gguf(path)
        except (OSError, GgufError, KeyError):
            read = None
        if read is not None:
            return Footprint(
                read.layer_bytes,
                read.other_bytes + beside,
                read.kv_bytes_per_token,
                read.workspace_bytes,
                read.trained_context_len,
                read.layer_expert_bytes,
            )
    if not estimate.num_layers:
        raise LookupError(f"{entry.id}:{variant.quant}: the weights are not on disk and the catalog gives no estimate")
    n = estimate.num_layers
    per_layer = max(weights_size - estimate.other_bytes, 0) // n
    experts = (estimate.expert_bytes // n,) * n if estimate.expert_bytes else ()
    return Footprint(
        layer_bytes=(per_layer,) * n,
        other_bytes=weights_size - per_layer * n + beside,
        kv_bytes_per_token=estimate.kv_bytes_per_token,
        workspace_bytes=estimate.workspace_bytes,
        trained_context_len=estimate.trained_context_len,
        layer_expert_bytes=experts,
    )


def _estimated_weights_bytes(entry: CatalogEntry, variant: CatalogVariant) -> int:
    params = variant.estimate.params if variant.estimate else None
    bits = bits_per_weight(variant.quant)
    if params is None or bits is None:
        raise LookupError(
            f"{entry.id}:{variant.quant}: the weights are not on disk, the catalog lists no size for them, "
            "and its estimate gives no params of a known quantization"
        )
    return round(params * bits / 8)


def bits_per_weight(quant: str) -> float | None:
    """Average bits per parameter of a quantization name (GGUF's or the plain fp32/fp16/int8)."""
    if quant.upper() in MIXED_QUANT_BITS:
        return MIXED_QUANT_BITS[quant.upper()]
    if quant.upper() in GGMLQuantizationType.__members__:
        kind = GGMLQuantizationType[quant.upper()]
        if kind in GGML_QUANT_SIZES:
            block, type_size = GGML_QUANT_SIZES[kind]
            return type_size * 8 / block
    return PLAIN_QUANT_BITS.get(quant.lower())


def load_candidates(catalog: Catalog, models_dir: Path, machine_platform: str) -> tuple[list[Candidate], list[str]]:
    """Every variant that has a weights file for this platform, and a warning per one left out."""
    candidates, skipped = [], []
    for entry in catalog.models:
        for variant in entry.variants:
            if not any(f.role == "weights" and f.platform in ("all", machine_platform) for f in variant.files):
                continue
            try:
                fp = variant_footprint(entry, variant, models_dir, machine_platform)
            except LookupError as exc:
                skipped.append(f"{exc}; left out.")
                continue
            params = variant.estimate.params if variant.estimate else None
            if params is None:
                bits = bits_per_weight(variant.quant)
                if bits is None:
                    skipped.append(
                        f"{entry.id}:{variant.quant}: no parameter count and an unknown quantization; left out."
                    )
                    continue
                params = round(fp.weights_bytes * 8 / bits)
            candidates.append(Candidate(entry, variant, fp, params))
    return candidates, skipped


# -- lineups -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlannedModel:
    candidate: Candidate
    roles: tuple[str, ...]
    context_len: int
    reduced: bool
    # Tier 1 placement when the model starts there, else None.
    placement: Placement | None
    initial_tier: MemoryTier

    @property
    def interactive(self) -> bool:
        return any(role in INTERACTIVE_ROLES for role in self.roles)

    @property
    def whole(self) -> bool:
        return self.placement is not None and self.placement.gpu_layers == self.candidate.footprint.n_layers

    @property
    def tier1_bytes(self) -> int:
        if self.placement is None:
            return 0
        return self.placement.vram_weight_bytes + self.placement.vram_kv_and_workspace_bytes

    @property
    def fit(self) -> float:
        if self.whole:
            return 1.0
        if self.placement is not None:
            return PARTIAL_FIT * self.placement.gpu_layers / self.candidate.footprint.n_layers
        return ON_DEMAND_FIT if self.interactive else 1.0

    @property
    def priority(self) -> str:
        # Staged first and ranked higher, a chat model is never evicted to stage the others.
        if CHAT_ROLES & set(self.roles):
            return "high"
        return "normal" if self.interactive else "low"


@dataclass(frozen=True)
class Plan:
    models: tuple[PlannedModel, ...]
    assignment: dict[str, Candidate]

    @property
    def coresident(self) -> bool:
        return all(m.whole for m in self.models if m.interactive)

    @property
    def interactive_bytes(self) -> int:
        return sum(m.tier1_bytes for m in self.models if m.interactive)

    @property
    def score(self) -> float:
        fit = {m.candidate.spec: m.fit for m in self.models}
        size = sum(ROLE_WEIGHT.get(role, 1.0) * c.params * fit[c.spec] for role, c in self.assignment.items())
        return size * (CORESIDENT_BONUS if self.coresident else 1.0)


def plan_lineup(assignment: dict[str, Candidate], budgets: Budgets, hardware: HardwareConfig, reduced: bool) -> Plan:
    """Place the lineup's models one by one with the planner, the interactive and larger ones
    first, as startup staging will: tier 1 while it has room, else tier 2, else disk."""
    roles: dict[str, list[str]] = {}
    by_spec: dict[str, Candidate] = {}
    for role, candidate in assignment.items():
        roles.setdefault(candidate.spec, []).append(role)
        by_spec[candidate.spec] = candidate

    def rank(spec: str) -> tuple[bool, float]:
        interactive = any(r in INTERACTIVE_ROLES for r in roles[spec])
        return not interactive, -max(ROLE_WEIGHT.get(r, 1.0) for r in roles[spec]) * by_spec[spec].params

    free1, free2 = budgets.tier1_bytes, budgets.tier2_bytes
    planned = []
    for spec in sorted(roles, key=rank):
        candidate = by_spec[spec]
        fp = candidate.footprint
        shrink = reduced and bool(CHAT_ROLES & set(roles[spec]))
        context = candidate.context_len(shrink)
        placement = plan_placement(fp, context, free1, hardware.min_gpu_layer_ratio, _moe_mode(fp, budgets))
        if placement is not None and placement.pinned_ram_bytes > free2:
            placement = None
        if placement is not None:
            tier = MemoryTier.TIER1
            free1 -= placement.vram_weight_bytes + placement.vram_kv_and_workspace_bytes
            free2 -= placement.pinned_ram_bytes
        elif fp.weights_bytes <= free2:
            tier, free2 = MemoryTier.TIER2, free2 - fp.weights_bytes
        else:
            tier = MemoryTier.TIER3
        planned.append(PlannedModel(candidate, tuple(roles[spec]), context, shrink, placement, tier))
    return Plan(tuple(planned), assignment)


def slots(candidate: Candidate) -> int:
    """CHAT_SLOTS for a llama.cpp text model; 1 for the rest (a projector serves images on one
    slot, ModelConfig's rule)."""
    entry, variant = candidate.entry, candidate.variant
    has_projector = any(f.role == "aux" for f in variant.files)
    text_chat = entry.engine == "ggml_llama" and entry.modality == "text_generation" and not has_projector
    return CHAT_SLOTS if text_chat else 1


def _moe_mode(fp: Footprint, budgets: Budgets) -> str:
    # Expert offload helps on a discrete GPU only: on unified memory the experts stay in the same RAM.
    return "auto" if fp.expert_bytes and budgets.gpu and not budgets.unified_memory else "off"


def fits_alone(candidate: Candidate, roles: set[str], budgets: Budgets, hardware: HardwareConfig) -> bool:
    context = candidate.context_len(bool(CHAT_ROLES & roles))
    fp = candidate.footprint
    placement = plan_placement(fp, context, budgets.tier1_bytes, hardware.min_gpu_layer_ratio, _moe_mode(fp, budgets))
    return placement is not None


def _assignments(choices: dict[str, list[Candidate]]) -> list[dict[str, Candidate]]:
    """Every way to give each role a model, one variant per catalog entry."""
    found = []
    for combo in itertools.product(*choices.values()):
        variants: dict[str, Candidate] = {}
        if all(variants.setdefault(c.entry.id, c) is c for c in combo):
            found.append(dict(zip(choices, combo, strict=True)))
    return found


def _frontier(found: list[Candidate], roles: set[str]) -> list[Candidate]:
    """The candidates no other one beats: serving the same of `roles`, with at least as many
    parameters and at most as many bytes in tier 1 at both the full and the reduced context
    (and better in one of them): in any lineup a dropped one would take as much of tier 1 for
    no more parameters than the one that beats it."""

    def counts(c: Candidate) -> tuple[frozenset[str], int, int, int]:
        fp = c.footprint
        served = frozenset(r for r in roles if c.serves(r))
        return served, c.params, fp.resident_bytes(c.context_len(False)), fp.resident_bytes(c.context_len(True))

    def beats(b: tuple[frozenset[str], int, int, int], a: tuple[frozenset[str], int, int, int]) -> bool:
        return b[0] == a[0] and b[1] >= a[1] and b[2] <= a[2] and b[3] <= a[3] and b != a

    measured = [(c, counts(c)) for c in found]
    return [c for c, mine in measured if not any(beats(other, mine) for _, other in measured)]


def _non_interactive(assignment: dict[str, Candidate], found: list[Candidate]) -> Candidate | None:
    """A non-interactive role's model next to `assignment`: the largest that fits alone, one
    already in the lineup on a tie; None when every candidate is another variant of an entry the
    lineup runs."""
    used = {c.entry.id: c for c in assignment.values()}
    allowed = [c for c in found if used.get(c.entry.id, c) is c]
    if not allowed:
        return None
    return min(allowed, key=lambda c: (-c.params, c.entry.id not in used, c.footprint.weights_bytes))


def best_plan(choices: dict[str, list[Candidate]], budgets: Budgets, hardware: HardwareConfig) -> Plan:
    """The best-scoring plan; a chat model's reduced context is tried when the full one keeps
    the interactive models from staying resident together."""
    interactive = {role for role in choices if role in INTERACTIVE_ROLES}
    front = {role: _frontier(found, interactive) for role, found in choices.items() if role in interactive}
    plans = []
    for partial in _assignments(front):
        assignment = dict(partial)
        for role, found in choices.items():
            if role not in interactive and (pick := _non_interactive(assignment, found)) is not None:
                assignment[role] = pick
        plan = plan_lineup(assignment, budgets, hardware, reduced=False)
        if not plan.coresident and CHAT_ROLES & set(assignment):
            plan = max(plan, plan_lineup(assignment, budgets, hardware, reduced=True), key=lambda p: p.score)
        plans.append(plan)
    # Equal scores: the one that leaves more of tier 1 free.
    return max(plans, key=lambda p: (p.score, -sum(m.tier1_bytes for m in p.models)))


# -- the advice --------------------------------------------------------------------------------


@dataclass
class Advice:
    needs: list[str]
    machine: Machine
    budgets: Budgets
    plan: Plan
    warnings: list[str] = field(default_factory=list)
    config: str = ""

    def serves(self, model: PlannedModel) -> list[str]:
        return [need for need in self.needs if set(NEED_ROLES[need]) & set(model.roles)]

    def model_dict(self, model: PlannedModel) -> dict[str, Any]:
        c, placement = model.candidate, model.placement
        load_secs = round(c.footprint.weights_bytes / LOAD_BYTES_PER_S, 2)
        return {
            "id": c.entry.id,
            "name": c.entry.name,
            "quant": c.variant.quant,
            "serves": self.serves(model),
            "weights_bytes": c.footprint.weights_bytes,
            "resident_bytes": c.footprint.resident_bytes(model.context_len),
            "runs_on_cpu": not self.budgets.gpu,
            "gpu_layers": placement.gpu_layers if placement else 0,
            "num_layers": c.footprint.n_layers,
            "cpu_expert_layers": placement.cpu_expert_layers if placement else 0,
            "context_len": model.context_len,
            "slots": slots(c),
            "initial_tier": str(model.initial_tier),
            "priority": model.priority,
            "keep_warm_in_ram": c.footprint.weights_bytes <= self.budgets.tier2_bytes,
            "moe_offload": _moe_mode(c.footprint, self.budgets),
            "load_secs_cold": load_secs,
            "load_secs_warm": load_secs,
        }

    def as_dict(self) -> dict[str, Any]:
        return {
            "machine": {
                "vram_bytes": self.machine.vram_bytes,
                "ram_bytes": self.machine.ram_bytes,
                "unified_memory": self.machine.unified_memory,
            },
            "budgets": self.budgets.as_dict(),
            "models": [self.model_dict(m) for m in self.plan.models],
            "interactive_coresident": self.plan.coresident,
            "interactive_bytes": self.plan.interactive_bytes,
            "warnings": self.warnings,
            "specs": [m.candidate.spec for m in self.plan.models],
            "config": self.config,
        }


def recommend(
    catalog: Catalog, needs: list[str], machine: Machine, models_dir: Path, hardware: HardwareConfig | None = None
) -> Advice:
    """The lineup for `needs` on `machine` (spec §6). Needs no catalog model serves become
    warnings; raises NoLineup when none is served or a needed model does not fit even alone."""
    hardware = hardware or HardwareConfig()
    needs = list(dict.fromkeys(needs))
    unknown = [n for n in needs if n not in NEEDS]
    if unknown:
        raise NoLineup(f"Unknown needs {unknown}; the needs are {', '.join(NEEDS)}.")
    budgets = derive_budgets(machine, hardware)
    candidates, warnings = load_candidates(catalog, models_dir, machine.platform)
    # Without a GPU the GPU lineup is left out (it would run, slowly, on the CPU).
    usable = [c for c in candidates if budgets.gpu or not c.entry.gpu]
    roles = list(dict.fromkeys(role for need in needs for role in NEED_ROLES[need]))
    choices = {role: [c for c in usable if c.serves(role)] for role in roles}
    for need in needs:
        for role in NEED_ROLES[need]:
            if not choices[role]:
                why = _unserved(catalog, role, budgets.gpu)
                warnings.append(f"{need}: {ROLE_MODALITY[role]}: {why}; the lineup leaves it out.")
    choices = {role: found for role, found in choices.items() if found}
    if not choices:
        raise NoLineup(f"No catalog model serves any of the needs {needs} on this machine.")
    for role, found in choices.items():
        fitting = [c for c in found if fits_alone(c, {role}, budgets, hardware)]
        if not fitting:
            smallest = min(found, key=lambda c: c.footprint.resident_bytes(c.context_len(True)))
            raise NoLineup(
                f"No lineup fits: {ROLE_MODALITY[role]} needs a model, and the smallest, {smallest.spec}, needs "
                f"{gib(smallest.footprint.resident_bytes(smallest.context_len(True)))} in tier 1, which holds "
                f"{gib(budgets.tier1_bytes)} on this machine ({machine.describe()})."
            )
        # With a GPU its lineup comes first: the CPU entries only where none of it fits.
        choices[role] = ([c for c in fitting if c.entry.gpu] or fitting) if budgets.gpu else fitting
    plan = best_plan(choices, budgets, hardware)
    advice = Advice(needs, machine, budgets, plan, warnings + _plan_warnings(plan))
    advice.config = render_config(advice)
    return advice


def _unserved(catalog: Catalog, role: str, gpu: bool) -> str:
    """Why no candidate serves `role`: no entry does, only GPU entries do (on a machine without
    one), or the entries that do were left out (no estimate, no weights for this platform)."""
    serving = [e for e in catalog.models if entry_serves(e, role)]
    if not serving:
        return "no catalog model serves it"
    if not gpu and all(e.gpu for e in serving):
        return "its catalog models are for a machine with a GPU"
    return "its catalog models were left out"


def _plan_warnings(plan: Plan) -> list[str]:
    warnings = []
    for model in plan.models:
        c = model.candidate
        if model.reduced:
            warnings.append(
                f"{c.entry.id}: {model.context_len} tokens of context and one slot, so that the "
                "interactive models stay in tier 1 together."
            )
        if model.placement is not None and not model.whole:
            warnings.append(
                f"{c.entry.id}: only {model.placement.gpu_layers} of {c.footprint.n_layers} layers fit "
                "tier 1; the rest run from host memory, slower."
            )
    outside = [m.candidate.entry.id for m in plan.models if m.interactive and m.placement is None]
    if outside:
        warnings.append(
            f"The interactive models do not fit tier 1 together: {', '.join(outside)} start outside it "
            "and load when asked for, evicting idle models."
        )
    return warnings


def render_config(advice: Advice) -> str:
    """A complete config file for the lineup, validated as the server validates it."""
    machine, budgets = advice.machine, advice.budgets
    lines = [
        f"# Generated by the Hypnos advisor for {machine.describe()}; needs: {', '.join(advice.needs)}.",
        f"# Tier 1 holds {gib(budgets.tier1_bytes)}, tier 2 {gib(budgets.tier2_bytes)}. The packaged models' "
        "files are placed by ./run.sh setup.",
        "config_version = 1",
        "",
    ]
    if not budgets.gpu or budgets.unified_memory:
        where = "unified memory" if budgets.unified_memory else "host memory (no GPU)"
        lines += [
            "[hardware]",
            f"# Tier 1 in {where}: the server books it as a simulated device.",
            f"simulated_vram_bytes = {budgets.tier1_bytes}",
        ]
        if budgets.unified_memory:
            lines.append(f"pinned_ram_budget_bytes = {budgets.tier2_bytes}")
        lines.append("")
    speech_in = advice.plan.assignment.get("speech_in")
    for model in advice.plan.models:
        settings: dict[str, object] = {
            "context_len": model.context_len,
            "slots": slots(model.candidate),
            "initial_tier": str(model.initial_tier),
            "priority": model.priority,
        }
        if "chat" in model.roles and speech_in is not None and not model.candidate.serves("speech_in"):
            # A chat model without an audio encoder answers input_audio through the lineup's transcriber.
            settings["speech_to_text_model"] = speech_in.entry.id
        if _moe_mode(model.candidate.footprint, budgets) != "off":
            settings["moe_offload"] = "auto"
        lines.append(config_block(model.candidate.entry, model.candidate.variant, settings))
    text = "\n".join(lines)
    HypnosConfig.model_validate(tomllib.loads(text))
    return text
