"""POST /api/pull and DELETE /api/delete of the Ollama API (issue 17), on the registry pulls of
`inference.web.common.pulls`: a pull streams Ollama's progress lines (or, with `stream: false`,
answers the last); a delete finds the model by Ollama's name (`<id>`, `<id>:latest`, `<id>:<quant>`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from django.http import HttpResponse, HttpResponseBase, JsonResponse

from hypnos_site.errors import HypnosError
from inference.transport.client import InferenceClient
from inference.web.common import pulls
from inference.web.common.render import ollama_ndjson_error
from inference.web.ollama.protocol import DeleteRequest, PullRequest
from inference.web.ollama.serving import line, ndjson_response
from inference.web.ollama.serving_models import find_model


async def pull(client: InferenceClient, body: PullRequest) -> HttpResponseBase:
    """POST /api/pull: the checks (a catalog name, the room on disk) before any byte; then the
    progress lines, or with `stream: false` only the last."""
    entry, variant, planned = await asyncio.to_thread(pulls.plan_pull, body.model)
    lines = pulls.pull_lines(client, planned, f"{entry.id}:{variant.quant}")
    if not body.stream:
        answered = [payload async for payload in lines]
        return JsonResponse(answered[-1])
    return ndjson_response(_ndjson(lines))


async def _ndjson(lines: AsyncGenerator[dict[str, Any], None]) -> AsyncIterator[str]:
    try:
        async for payload in lines:
            yield line(payload)
    except HypnosError as error:
        yield ollama_ndjson_error(error)
    finally:
        # A client that left stops the download at once, not when the generator is collected.
        await lines.aclose()


async def delete(client: InferenceClient, body: DeleteRequest) -> HttpResponse:
    """DELETE /api/delete: out of the pool once its requests are done, then its files."""
    await pulls.remove(client, await find_model(client, body.model))
    return HttpResponse(status=200)
