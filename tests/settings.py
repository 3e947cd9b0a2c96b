"""Settings of the test suite: the production settings read with the suite's own config file,
so a developer's hypnos.toml or HYPNOS_* variables never change what the tests see."""

import os
from pathlib import Path

os.environ["HYPNOS_CONFIG"] = str(Path(__file__).with_name("hypnos.test.toml"))
for _name in ("HYPNOS_API_KEYS", "HYPNOS_DEPLOYMENT", "HYPNOS_DATABASE_URL", "HYPNOS_PORT", "HYPNOS_HOST"):
    os.environ.pop(_name, None)

from hypnos_site.settings import *  # noqa: E402,F403
