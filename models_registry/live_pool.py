"""The running model pool as the apps below `inference` see it.

The worker owns the pool (spec §6: models join and leave it at run time), and only the inference
app can reach the worker. `models_registry` and `logs` sit below `inference` in the dependency
direction (ARCHITECTURE.md), so they never import it: the inference app installs its pool here
when it is ready (`pool.install`), and until then, or in a process without that app, the config
file's models stand for the pool and changing it is refused.
"""

from __future__ import annotations

from typing import Any, Protocol

from django.conf import settings

from hypnos_site.config import ModelConfig
from hypnos_site.errors import ModelNotAvailable


class PoolBackend(Protocol):
    """What the inference app provides: the pool as last seen, and the two changes the admin
    catalog page makes (the same operations as POST /v1/models and DELETE /v1/models/{id})."""

    def models(self) -> list[ModelConfig]: ...

    async def add_model(self, body: dict[str, Any]) -> dict[str, Any]: ...

    async def remove_model(self, model_id: str, drain_secs: object) -> dict[str, Any]: ...


class ConfigPool:
    """The pool before the inference app installs its own: the config file's models, read-only."""

    def models(self) -> list[ModelConfig]:
        return list(settings.HYPNOS.models)

    async def add_model(self, body: dict[str, Any]) -> dict[str, Any]:
        raise ModelNotAvailable("The model pool cannot change in this process (the inference app is not loaded).")

    async def remove_model(self, model_id: str, drain_secs: object) -> dict[str, Any]:
        raise ModelNotAvailable("The model pool cannot change in this process (the inference app is not loaded).")


class LivePool:
    """The installed backend, with the name lookups every caller needs."""

    def __init__(self) -> None:
        self._backend: PoolBackend = ConfigPool()

    def install(self, backend: PoolBackend) -> None:
        """Make `backend` the pool (the inference app calls this from its ready())."""
        self._backend = backend

    def models(self) -> list[ModelConfig]:
        return self._backend.models()

    def names(self, name: str) -> set[str]:
        """`name` with the id and aliases of the model it names, if any; `<name>:latest` (how
        Ollama's clients name a model) names the model itself."""
        for candidate in (name, name.removesuffix(":latest")):
            for model in self.models():
                if candidate in (model.id, *model.aliases):
                    return {model.id, *model.aliases, name}
        return {name}

    async def add_model(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self._backend.add_model(body)

    async def remove_model(self, model_id: str, drain_secs: object) -> dict[str, Any]:
        return await self._backend.remove_model(model_id, drain_secs)


pool = LivePool()
