import tempfile
from pathlib import Path

from hypothesis.configuration import set_hypothesis_home_dir

# The integration suite's fixtures: a worker started on a config, the views routed to it.
from tests.integration.conftest import serve, use_worker  # noqa: F401

# Hypothesis keeps caches (drawn constants) in its home folder; outside the checkout, so a run
# leaves nothing behind (the fuzz run is derandomized and uses no example database).
set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "hypnos-hypothesis")
