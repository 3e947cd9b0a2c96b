"""Settings of the test suite: the production settings read with the suite's own config file,
so a developer's hypnos.toml or HYPNOS_* variables never change what the tests see."""

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import psutil

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
# One folder per process under TEST_DATA_ROOT, named by its pid. Removed at exit, and by
# tests/conftest.py's pytest_unconfigure (an xdist worker ends without atexit); those of
# processes that ended without either (mypy's django plugin reads these settings and leaves by
# os._exit) are swept by the next process that reads them.
TEST_DATA_ROOT = Path(tempfile.gettempdir()) / "hypnos-test-data"
TEST_DATA_ROOT.mkdir(exist_ok=True)
for _left in TEST_DATA_ROOT.iterdir():
    _pid = _left.name.partition("-")[0]
    if _pid.isdigit() and not psutil.pid_exists(int(_pid)):
        shutil.rmtree(_left, ignore_errors=True)
HYPNOS_TEST_DATA_DIR = tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=TEST_DATA_ROOT)
os.environ["HYPNOS_DATA_DIR"] = HYPNOS_TEST_DATA_DIR
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
        # In the process's data dir: its -wal and -shm files, which can outlive the database
        # pytest-django deletes, go with the folder.
        "NAME": str(Path(HYPNOS_TEST_DATA_DIR) / "test.sqlite3")
    }

# The admin tests' operators: a password hash made in microseconds, not PBKDF2's ~0.4 s (Django's
# own advice for test settings; no API key is a password: keys are SHA-256 digests).
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
