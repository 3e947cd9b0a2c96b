"""Settings of the test suite: the production settings read with the suite's own config file,
so a developer's hypnos.toml or HYPNOS_* variables never change what the tests see."""

import os
from pathlib import Path

os.environ["HYPNOS_CONFIG"] = str(Path(__file__).with_name("hypnos.test.toml"))
for _name in ("HYPNOS_API_KEYS", "HYPNOS_DEPLOYMENT", "HYPNOS_DATABASE_URL", "HYPNOS_PORT", "HYPNOS_HOST"):
    os.environ.pop(_name, None)

from hypnos_site.settings import *  # noqa: E402,F403

# The test database in a file, not SQLite's shared-cache memory: there a write that meets another
# thread's lock fails at once ("database table is locked") instead of waiting out the busy
# timeout as the server's file database does, and the suite runs writers on several threads
# (the request log, the Celery jobs of the embedded deployment, the picture store).
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":  # noqa: F405
    import tempfile as _tempfile

    DATABASES["default"]["TEST"] = {  # noqa: F405
        "NAME": str(Path(_tempfile.gettempdir()) / f"hypnos-test-{os.getpid()}.sqlite3")
    }

# The admin tests' operators: a password hash made in microseconds, not PBKDF2's ~0.4 s (Django's
# own advice for test settings; no API key is a password: keys are SHA-256 digests).
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
