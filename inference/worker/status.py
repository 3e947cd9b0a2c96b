"""The worker's reports: what the web process shows in /ready and /v1/models, and
GET /v1/memory/status (spec §14) but for the web process's own latency figures."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from typing import Any

from hypnos_site.config import HypnosConfig
from inference.transport.wire import ModelPlace, WorkerAnnouncement
from inference.worker.runtime import ModelRuntime, ModelTable
from inference.worker.tier_moves import TierMoves
from memory.device import Device, process_memory_bytes
from memory.kv_park import KvParking
from memory.manager import TierManager
from memory.tiers import MemoryTier


class StatusReports:
    """The worker's part that reports; it reads the other parts and changes nothing. `ready`
    and `estimated_wait_ms` are the worker's own (staging and admission)."""

    def __init__(
        self,
        config: HypnosConfig,
        device: Device,
        tiers: TierManager,
        kv_parking: KvParking,
        table: ModelTable,
        moves: TierMoves,
        ready: Callable[[], bool],
        estimated_wait_ms: Callable[[ModelRuntime], float | None],
    ):
        self.config = config
        self.device = device
        self.tiers = tiers
        self.kv_parking = kv_parking
        self.table = table
        self.moves = moves
        self.ready = ready
        self.estimated_wait_ms = estimated_wait_ms
        # The name it announces itself by (inference/transport/cluster.py) and its answers carry.
        self.worker_id = config.server.worker_id or socket.gethostname()

    def status(self) -> dict[str, Any]:
        """What the web process shows in /ready and /v1/models."""
        models = {}
        for model_id, runtime in self.table.models.items():
            models[model_id] = {
                "current_tier": str(self.tiers.tier(model_id)),
                "placement": self.tiers.placement(model_id).as_dict(),
                "active_leases": self.tiers.leases(model_id),
                "loads": runtime.loads,
                "problem": runtime.problem,
                "enabled": runtime.enabled,
                "config": runtime.config.model_dump(mode="json"),
                # What the engine serves beyond its modality (tools, thinking, vision...), once
                # it exists: the Ollama API's `capabilities` (issue 17).
                "capabilities": sorted(runtime.engine.capabilities()) if runtime.engine is not None else [],
                # The context the weights were trained for (0 where the engine has none or
                # does not exist yet): /v1/models' max_context_window.
                "trained_context_len": runtime.engine.trained_context_len if runtime.engine is not None else 0,
                # Idle unload (server.keep_alive_secs): when it demotes the model, if it will.
                "expires_at": self.tiers.expires_at(model_id),
                # Requests queued or running, and those in the engine now (Lemonade's is_busy
                # and is_streaming).
                "admitted": runtime.admitted,
                "generating": runtime.engine_users,
            }
        return {
            "ready": self.ready(),
            "simulated": self.device.simulated,
            "models": models,
            "max_resident": self.tiers.max_resident,
            "pid": os.getpid(),
            "worker": self.worker_id,
        }

    def announcement(self, channel: str, draining: bool) -> WorkerAnnouncement:
        """What this worker announces to the web processes (inference/transport/cluster.py)."""
        models = {}
        for model_id, runtime in list(self.table.models.items()):
            config = runtime.config
            place: dict[str, Any] = {}
            if model_id in self.tiers:
                state = self.tiers.model_status(model_id)
                placement = self.tiers.placement(model_id)
                place = {
                    "tier": state["current_tier"],
                    "leases": state["active_leases"],
                    "weight_bytes": state["total_weight_bytes"],
                    "tier1_bytes": placement.vram_weight_bytes + placement.vram_kv_and_workspace_bytes,
                }
            models[model_id] = ModelPlace(
                aliases=config.aliases,
                enabled=runtime.enabled and runtime.problem is None,
                admitted=runtime.admitted,
                workers=config.workers,
                replicas=config.replicas,
                **place,
            )
        tier1 = self.tiers.tier1_counters()
        return WorkerAnnouncement(
            worker_id=self.worker_id,
            channel=channel,
            host=socket.gethostname(),
            pid=os.getpid(),
            device=self.device.capabilities.device_name,
            simulated=self.device.simulated,
            ready=self.ready(),
            draining=draining,
            tier1_budget_bytes=self.tiers.tier1_budget,
            tier1_free_bytes=int(tier1["effective_free"] or 0),
            tier2_budget_bytes=self.tiers.tier2_budget,
            tier2_free_bytes=max(self.tiers.tier2_budget - self.tiers.tier2_used(), 0),
            queue_depth=sum(runtime.admitted for runtime in list(self.table.models.values())),
            announced_at=time.time(),
            models=models,
        )

    def memory_status(self) -> dict[str, Any]:
        """GET /v1/memory/status (spec §14), all but the web process's own latency figures."""
        tier1 = self.tiers.tier1_counters()
        tier2_used = self.tiers.tier2_used()
        footprint = process_memory_bytes()
        models = []
        for model_id, runtime in self.table.models.items():
            config = runtime.config
            row: dict[str, Any] = {
                "id": model_id,
                "enabled": runtime.enabled,
                "modality": config.modality,
                # A chat model hears input_audio through its speech_to_text_model (spec §7.1)
                # and sees images through its projector (aux_path).
                "modalities": config.modalities,
                "engine": config.engine,
                # Execution slots: how many requests it decodes at once (the tier view shows them).
                "slots": config.slots,
                # Both replaced by the ledger's once the model's footprint is known.
                "moe_offload": config.moe_offload,
                "expert_bytes": 0,
                "loads": runtime.loads,
                "load_failures": runtime.load_failures,
                "service_ms": round(runtime.service_ms, 1) if runtime.service_ms is not None else None,
                "estimated_wait_ms": self.estimated_wait_ms(runtime),
                # Of the requests holding a slot, those of batches (x-hypnos-priority: background):
                # the model a batch holds, and that it yields the next slot to interactive traffic.
                "background_requests": runtime.background_running,
            }
            if model_id in self.tiers:
                row.update(self.tiers.model_status(model_id))
            else:
                row.update(
                    {
                        "current_tier": str(MemoryTier.TIER3),
                        "priority": config.priority,
                        "active_leases": 0,
                        "problem": runtime.problem,
                    }
                )
            models.append(row)
        return {
            "worker": {
                "worker_id": self.worker_id,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "device": self.device.capabilities.device_name,
                "simulated": self.device.simulated,
                "tier1_vram_budget_bytes": self.tiers.tier1_budget,
                "tier2_pinned_ram_budget_bytes": self.tiers.tier2_budget,
            },
            "capabilities": self.device.capabilities.as_dict(),
            "tier1_vram_used_bytes": tier1["used"],
            "tier1_vram_free_bytes": tier1["free"],
            "tier1_vram_real_free_bytes": tier1["real_free"],
            "tier1_vram_real_total_bytes": tier1["real_total"],
            "tier1_vram_unaccounted_bytes": tier1["unaccounted"],
            "tier1_vram_effective_free_bytes": tier1["effective_free"],
            "tier2_pinned_ram_used_bytes": tier2_used,
            "tier2_pinned_ram_free_bytes": max(self.tiers.tier2_budget - tier2_used, 0),
            "physical_pool_free_bytes": None,
            "process_footprint_bytes": footprint,
            "process_memory_bytes": footprint,
            "process_memory_cap_bytes": self.config.hardware.max_process_memory_bytes,
            "gpu": self.device.gpu_health(),
            "models": models,
            "recent_evictions": self.tiers.evictions(),
            "kv_park": self.kv_parking.status(),
            **(
                {"profile": self.config.server.profile.model_dump(exclude_none=True)}
                if self.config.server.profile
                else {}
            ),
            "evictions_total": self.moves.evictions_total,
        }
