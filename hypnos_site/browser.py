"""The admin's session, auth and messages middlewares run only on the pages a browser uses (the
admin and its static files); the API's routes skip them.

Those middlewares are sync, so on the async path each of their hooks is a hop to a thread: six
hops per call for a login session, cookies and flash messages a bearer-key API never reads.
`BrowserPagesMiddleware` sits where they sat and runs them as one chain for the browser's paths
only. The security middlewares (security headers, X-Frame-Options, CSRF) stay in MIDDLEWARE
itself and run on every request, where Django's deploy checks see them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import reduce

from asgiref.sync import markcoroutinefunction
from django.http import HttpRequest, HttpResponseBase
from django.utils.module_loading import import_string

# In the order they had in MIDDLEWARE.
BROWSER_MIDDLEWARE = (
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
)
BROWSER_PATHS = ("/admin/", "/static/")

Handler = Callable[[HttpRequest], Awaitable[HttpResponseBase]]


class BrowserPagesMiddleware:
    async_capable = True
    sync_capable = False

    def __init__(self, get_response: Handler):
        self.get_response = get_response
        self.browser_chain: Handler = reduce(
            lambda handler, path: import_string(path)(handler), reversed(BROWSER_MIDDLEWARE), get_response
        )
        markcoroutinefunction(self)

    async def __call__(self, request: HttpRequest) -> HttpResponseBase:
        # path_info: the path without a reverse proxy's script prefix (daphne's --root-path,
        # FORCE_SCRIPT_NAME).
        if request.path_info.startswith(BROWSER_PATHS):
            return await self.browser_chain(request)
        return await self.get_response(request)
