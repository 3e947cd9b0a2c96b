"""The web playground at / (issue 19): one HTML page whose ES modules (static/playground/) call
the API like any other client, with the key the user typed, kept in the browser.

/ is also Ollama's liveness probe: its clients send HEAD / and some GET / expecting "Ollama is
running". A browser asks for text/html and gets the page; every other request gets the probe's
answer, as before."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponseBase
from django.shortcuts import render
from django.utils.cache import patch_vary_headers
from django.views.decorators.csrf import csrf_exempt

from inference.web.common.render import ollama_error
from inference.web.ollama import views as ollama_views


@csrf_exempt
async def index(request: HttpRequest) -> HttpResponseBase:
    """GET / from a browser: the playground; anything else: Ollama's answer on /."""
    if request.method == "GET" and "text/html" in request.headers.get("accept", ""):
        response: HttpResponseBase = render(request, "playground/index.html")
    else:
        response = await ollama_views.root(request)
    # The same URL answers two ways by Accept: a cache must not hand one to the other.
    patch_vary_headers(response, ("Accept",))
    return response


# A refusal by the middlewares (a foreign Origin's 403) in Ollama's shape, as on the probe itself.
index.error_response = ollama_error  # type: ignore[attr-defined]
