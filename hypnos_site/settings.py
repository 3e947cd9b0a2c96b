"""Django settings, derived from `hypnos.toml` and `HYPNOS_*` variables (hypnos_site.config)."""

from __future__ import annotations

import ipaddress
import os
import secrets
import tempfile
from pathlib import Path

import dj_database_url

from hypnos_site.config import BASE_DIR, HypnosConfig, get_config

HYPNOS = get_config()


def _secret_key(data_dir: Path) -> str:
    """HYPNOS_SECRET_KEY, else a random key made on the first start and kept in
    `data_dir/secret_key` (mode 0600), so sessions and signed values survive restarts and the key
    is not guessable from anything public. Several processes may start at once: the file appears
    whole (hard link of a finished temporary file) and the first one made wins."""
    if os.environ.get("HYPNOS_SECRET_KEY"):
        return os.environ["HYPNOS_SECRET_KEY"]
    path = data_dir / "secret_key"
    if not path.exists():
        data_dir.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=data_dir, prefix=".secret_key-")  # mode 0600
        try:
            with os.fdopen(fd, "w") as file:
                file.write(secrets.token_urlsafe(50) + "\n")
            os.link(temporary, path)
        except FileExistsError:
            pass
        finally:
            os.unlink(temporary)
    return path.read_text().strip()


def _allowed_hosts(config: HypnosConfig) -> list[str]:
    """The Host names answered (spec §1): loopback, the address bound, `server.allowed_hosts`.
    A wildcard bind address (0.0.0.0, ::) is no name a client should use."""
    hosts = ["localhost", "127.0.0.1", "[::1]"]
    bound = config.server.host
    try:
        address = ipaddress.ip_address(bound)
    except ValueError:
        hosts.append(bound)
    else:
        if not address.is_unspecified:
            hosts.append(f"[{address}]" if address.version == 6 else str(address))
    return [*dict.fromkeys([*hosts, *config.server.allowed_hosts])]


SECRET_KEY = _secret_key(HYPNOS.data_dir)
DEBUG = os.environ.get("HYPNOS_DEBUG", "") == "1"
ALLOWED_HOSTS = _allowed_hosts(HYPNOS)

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "corsheaders",
    "rest_framework",
    "channels",
    "django_prometheus",
    "django_celery_results",
    "models_registry",
    "logs",
    "inference",
]

MIDDLEWARE = [
    # django-prometheus's pair. The second one counts responses by status and view, so it sits
    # above the accounting middleware (not last, as its docs suggest) to see the 429 and 403
    # answers that never reach a view.
    "hypnos_site.metrics.PrometheusBeforeMiddleware",
    "inference.web.common.middleware.RequestIdMiddleware",
    # Host, Origin and content type: what keeps a web page from using the API (spec §1).
    "inference.web.common.middleware.BrowserGuardMiddleware",
    "inference.web.common.middleware.BodyLimitMiddleware",
    "corsheaders.middleware.CorsMiddleware",
    "hypnos_site.metrics.PrometheusAfterMiddleware",
    # Per-key limits, token charges, hypnos_* counters and the request log; inside CORS, so its
    # 429 and 403 answers carry the CORS headers too.
    "logs.middleware.InferenceAccountingMiddleware",
    "django.middleware.security.SecurityMiddleware",
    # /static/ (the admin's styles, the vendored pages' assets): answered here, before CSRF and
    # the browser pages' sessions (hypnos_site/static_files.py).
    "hypnos_site.static_files.StaticFilesMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    # Sessions, common, auth and messages on the admin's pages only (hypnos_site/browser.py: on
    # the API they were six thread hops per call).
    "hypnos_site.browser.BrowserPagesMiddleware",
]

# The admin's session, auth and messages middlewares are there, inside BrowserPagesMiddleware,
# which these checks do not look into.
SILENCED_SYSTEM_CHECKS = ["admin.E408", "admin.E409", "admin.E410"]

ROOT_URLCONF = "hypnos_site.urls"
ASGI_APPLICATION = "hypnos_site.asgi.application"
APPEND_SLASH = False

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

_default_db = f"sqlite:///{HYPNOS.data_dir / 'hypnos.sqlite3'}"
DATABASES = {"default": dj_database_url.parse(HYPNOS.server.database_url or _default_db, conn_max_age=60)}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    HYPNOS.data_dir.mkdir(parents=True, exist_ok=True)
    # Several threads of one process write the request log; wait instead of failing. WAL with
    # synchronous=NORMAL: a commit is an append, not an fsync of a rollback journal (the request
    # log's insert went from 2.2 ms to 0.4 ms; a power cut may lose the last commits, not the file).
    DATABASES["default"]["OPTIONS"] = {
        "timeout": 20,
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
    }
    DATABASES["default"]["CONN_MAX_AGE"] = 0
elif DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
    # A PostgreSQL that is down or unreachable fails a connection attempt within 3 s (libpq has
    # no limit of its own: the OS's TCP timeout, minutes, or for ever against a host that accepts
    # and never answers): GET /ready says so and a request that needs the database is a 503
    # (hypnos_site.errors.DatabaseUnavailable), not a hung thread. ?connect_timeout= in the URL wins.
    DATABASES["default"].setdefault("OPTIONS", {}).setdefault("connect_timeout", 3)
    # Each request's first query checks its thread's kept connection first (SELECT 1) and
    # reconnects when it is dead. The request threads are pooled (hypnos_site/handler.py), each
    # with its own connection: after PostgreSQL restarts, a thread that was idle through the
    # outage would otherwise answer its next request with "server closed the connection
    # unexpectedly" (a 503) although the database is back.
    DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

if HYPNOS.server.deployment == "distributed":
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {
                "hosts": [HYPNOS.server.redis_url],
                "prefix": HYPNOS.server.channel_prefix,
                "capacity": 1000,
                "expiry": 60,
            },
        }
    }
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}

# Long jobs (hypnos_site/celery.py). Embedded: tasks run in the server process, no broker.
_DISTRIBUTED = HYPNOS.server.deployment == "distributed"
CELERY_BROKER_URL = HYPNOS.server.redis_url if _DISTRIBUTED else "memory://"
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_ALWAYS_EAGER = not _DISTRIBUTED
CELERY_TASK_STORE_EAGER_RESULT = True
CELERY_RESULT_BACKEND = "django-db"
CELERY_RESULT_EXTENDED = True
CELERY_TASK_TRACK_STARTED = True
# One job per worker thread at a time; a job is acknowledged when it ends, so a worker that
# dies mid-job leaves it to be noticed (its stream ends with an error), not silently lost.
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_ACKS_LATE = False
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_TASK_DEFAULT_QUEUE = f"{HYPNOS.server.channel_prefix}.jobs"

# Django reads whole bodies into memory up to this size; above it RequestDataTooBig (413).
DATA_UPLOAD_MAX_MEMORY_SIZE = HYPNOS.limits.max_body_bytes
FILE_UPLOAD_MAX_MEMORY_SIZE = 8 << 20

REST_FRAMEWORK = {
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    # JSON nested at most 64 deep (inference/web/common/parsers.py).
    "DEFAULT_PARSER_CLASSES": ["inference.web.common.parsers.JSONParser"],
    "DEFAULT_AUTHENTICATION_CLASSES": ["models_registry.authentication.ApiKeyAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["models_registry.authentication.HasApiKeyWhenRequired"],
    "EXCEPTION_HANDLER": "hypnos_site.errors.exception_handler",
    "UNAUTHENTICATED_USER": None,
}

# CORS (spec §1): loopback origins by default, `server.allowed_origins` adds more.
CORS_ALLOWED_ORIGIN_REGEXES = [
    r"^https?://(localhost|127\.\d+\.\d+\.\d+|\[::1\])(:\d+)?$",
    *[
        "^" + o.rstrip("/").replace(".", r"\.").replace(":*", r"(:\d+)?").replace("*", r"[^/]*") + "$"
        for o in HYPNOS.server.allowed_origins
    ],
]
CORS_ALLOW_METHODS = ["GET", "POST", "OPTIONS"]
CORS_EXPOSE_HEADERS = [
    "x-request-id",
    "x-client-request-id",
    "x-hypnos-previous-tier",
    "x-hypnos-gpu-layers",
    "x-hypnos-switch-ms",
    "x-hypnos-inference-ms",
    "x-hypnos-audio-secs",
    "x-hypnos-rtf",
    "x-hypnos-audio-samples",
    "x-hypnos-estimated-wait-ms",
    "retry-after",
]
CORS_ALLOW_HEADERS = [
    "authorization",
    # A client's own id for its request, echoed back as x-client-request-id and logged.
    "x-client-request-id",
    "x-request-id",
    # Anthropic's SDKs: the key and the API version they send.
    "x-api-key",
    "anthropic-version",
    "anthropic-beta",
    "content-type",
    "x-hypnos-next-model",
    "x-hypnos-deadline-ms",
    "x-hypnos-workflow",
    "x-hypnos-workflow-end",
    "openai-organization",
    "openai-project",
    "x-stainless-arch",
    "x-stainless-lang",
    "x-stainless-os",
    "x-stainless-package-version",
    "x-stainless-runtime",
    "x-stainless-runtime-version",
    "x-stainless-retry-count",
    "x-stainless-timeout",
]

# With [server.tls] every request arrives over TLS: cookies only over it, and browsers told to
# use nothing else (HSTS). X-Content-Type-Options and X-Frame-Options on every response.
_TLS = HYPNOS.server.tls is not None
SESSION_COOKIE_SECURE = _TLS
CSRF_COOKIE_SECURE = _TLS
SECURE_SSL_REDIRECT = _TLS
SECURE_HSTS_SECONDS = 365 * 24 * 3600 if _TLS else 0
SECURE_HSTS_INCLUDE_SUBDOMAINS = _TLS
SECURE_HSTS_PRELOAD = _TLS
SECURE_CONTENT_TYPE_NOSNIFF = True
X_FRAME_OPTIONS = "DENY"

# Relative, so the script prefix of a reverse proxy (FORCE_SCRIPT_NAME, or daphne's --root-path)
# comes in front of it. The files are served from the finders (hypnos_site/static_files.py): no
# collectstatic step; one run into STATIC_ROOT is served too.
STATIC_URL = "static/"
STATIC_ROOT = HYPNOS.data_dir / "static"
STATICFILES_DIRS = [BASE_DIR / "static"]
WHITENOISE_USE_FINDERS = True
# The pages' own assets; no other origin reads them (WhiteNoise's default answers `*`).
WHITENOISE_ALLOW_ALL_ORIGINS = False
USE_TZ = True
TIME_ZONE = "UTC"

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"},
        # python-json-logger: every record as one JSON object, its `extra` fields included.
        "json": {
            "()": "pythonjsonlogger.json.JsonFormatter",
            "fmt": "%(asctime)s %(levelname)s %(name)s %(message)s",
            "rename_fields": {"asctime": "time", "levelname": "level", "name": "logger"},
        },
    },
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": HYPNOS.server.log_format}},
    "root": {"handlers": ["console"], "level": os.environ.get("HYPNOS_LOG_LEVEL", "INFO")},
    "loggers": {"django.request": {"level": "ERROR"}},
}
