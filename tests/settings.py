"""Settings of the test suite: the production settings read with the suite's own config file,
so a developer's hypnos.toml or HYPNOS_* variables never change what the tests see."""

import atexit
import os
import shutil
import tempfile
from pathlib import Path

os.environ["HYPNOS_CONFIG"] = str(Path(__file__).with_name("hypnos.test.toml"))
for _name in ("HYPNOS_API_KEYS", "HYPNOS_DEPLOYMENT", "HYPNOS_DATABASE_URL", "HYPNOS_PORT", "HYPNOS_HOST"):
    os.environ.pop(_name, None)

# The in-process tests' data_dir (spool, files, pictures, secret key) is a temporary folder of
# this process's own, so that two pytest-xdist workers never see each other's spooled requests
# (several tests assert the spool is empty after theirs); the models stay where `./run.sh setup`
# placed them. Only this process's config reads the two variables: the servers a test starts
# get their own (tests/e2e/conftest.py base_env).
from hypnos_site.config import load_config  # noqa: E402

_given = {name: os.environ.get(name) for name in ("HYPNOS_MODELS_DIR", "HYPNOS_DATA_DIR")}
os.environ["HYPNOS_MODELS_DIR"] = str(load_config().models_dir)
# Removed at exit (a `manage.py` a test runs reads these settings too), and by tests/conftest.py's
# pytest_unconfigure (an xdist worker ends without atexit).
HYPNOS_TEST_DATA_DIR = os.environ["HYPNOS_DATA_DIR"] = tempfile.mkdtemp(prefix="hypnos-test-data-")
atexit.register(shutil.rmtree, HYPNOS_TEST_DATA_DIR, ignore_errors=True)

from hypnos_site.settings import *  # noqa: E402,F403

for _name, _value in _given.items():
    if _value is None:
        del os.environ[_name]
    else:
        os.environ[_name] = _value

# The test database in a file, not SQLite's shared-cache memory: there a write that meets another
# thread's lock fails at once ("database table is locked") instead of waiting out the busy
# timeout as the server's file database does, and the suite runs writers on several threads
# (the request log, the Celery jobs of the embedded deployment, the picture store).
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":  # noqa: F405
    DATABASES["default"]["TEST"] = {  # noqa: F405
        "NAME": str(Path(tempfile.gettempdir()) / f"hypnos-test-{os.getpid()}.sqlite3")
    }

# The admin tests' operators: a password hash made in microseconds, not PBKDF2's ~0.4 s (Django's
# own advice for test settings; no API key is a password: keys are SHA-256 digests).
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
