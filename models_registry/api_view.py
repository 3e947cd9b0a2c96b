"""The base of every route's view: adrf's async APIView, with DRF's `initial` on the event loop.

adrf runs `initial` (authentication, permissions, throttles, content negotiation) through
`sync_to_async`, a hop to the request's thread and back on every call, because an authenticator
may read the database. Here, when the request's key is resolved without one (the accounting
middleware did it, or `check_without_database` can: no keys at all, a missing key, a configured
key), ApiKeyAuthentication reads no database and the permissions are plain checks of the
principal, so `initial` runs inline. A key that only the database knows takes adrf's path, hop
included."""

from __future__ import annotations

from inspect import iscoroutinefunction
from typing import Any

from adrf.views import APIView as AsyncAPIView
from asgiref.sync import sync_to_async
from django.http import HttpRequest

from models_registry.authentication import authorization_header, check_without_database


class APIView(AsyncAPIView):
    async def async_dispatch(self, request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
        check = getattr(request, "hypnos_key_check", None) or check_without_database(authorization_header(request))
        if check is None:
            return await super().async_dispatch(request, *args, **kwargs)
        request.hypnos_key_check = check  # type: ignore[attr-defined]
        self.args, self.kwargs = args, kwargs
        drf_request = self.initialize_request(request, *args, **kwargs)
        self.request = drf_request
        self.headers = self.default_response_headers
        try:
            self.initial(drf_request, *args, **kwargs)
            method = (drf_request.method or "").lower()
            handler: Any = getattr(self, method, self.http_method_not_allowed)
            if method not in self.http_method_names:
                handler = self.http_method_not_allowed
            if iscoroutinefunction(handler):
                response = await handler(drf_request, *args, **kwargs)
            else:
                response = await sync_to_async(handler)(drf_request, *args, **kwargs)
        except Exception as exc:
            response = self.handle_exception(exc)
        self.response = self.finalize_response(drf_request, response, *args, **kwargs)
        return self.response
