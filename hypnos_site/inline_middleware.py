"""Django's security middlewares with their hooks on the event loop.

SecurityMiddleware, XFrameOptionsMiddleware and CsrfViewMiddleware are `MiddlewareMixin`
classes: on the async path Django runs each of their hooks through `sync_to_async`, a hop to the
request's thread and back, six hops a request (py-spy on warm max_tokens=1 chat calls: the
handoffs, not the hooks, were the cost). Their hooks read headers and cookies and set headers,
nothing that blocks, so these subclasses run them inline. CSRF's view check is the exception: for
a view that is not csrf_exempt (the admin's forms) it may read the form body, so it keeps its hop.

MIDDLEWARE keeps naming Django's classes, where Django's deploy checks look for them;
`hypnos_site.handler.PooledASGIHandler` loads these subclasses in their place (`INLINE`)."""

from __future__ import annotations

from typing import Any

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponseBase
from django.middleware import clickjacking, csrf, security


class _InlineHooks:
    """`MiddlewareMixin.__acall__` without the hops: process_request, the rest of the chain,
    process_response."""

    get_response: Any

    async def __acall__(self, request: HttpRequest) -> HttpResponseBase:
        response = None
        if hasattr(self, "process_request"):
            response = self.process_request(request)
        response = response or await self.get_response(request)
        if hasattr(self, "process_response"):
            response = self.process_response(request, response)
        return response  # type: ignore[no-any-return]


class SecurityMiddleware(_InlineHooks, security.SecurityMiddleware):
    pass


class XFrameOptionsMiddleware(_InlineHooks, clickjacking.XFrameOptionsMiddleware):
    pass


class CsrfViewMiddleware(_InlineHooks, csrf.CsrfViewMiddleware):
    async def process_view(  # type: ignore[override]
        self, request: HttpRequest, callback: Any, callback_args: Any, callback_kwargs: Any
    ) -> HttpResponseBase | None:
        if getattr(callback, "csrf_exempt", False):
            return None
        check = sync_to_async(super().process_view, thread_sensitive=True)
        return await check(request, callback, callback_args, callback_kwargs)  # type: ignore[no-any-return]


# Django's dotted path -> the subclass the handler loads instead.
INLINE = {
    "django.middleware.security.SecurityMiddleware": f"{__name__}.SecurityMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware": f"{__name__}.XFrameOptionsMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware": f"{__name__}.CsrfViewMiddleware",
}
