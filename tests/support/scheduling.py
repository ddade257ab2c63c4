"""How `make test` hands files to its pytest-xdist workers: whole files, except that the e2e
files go to one worker together.

`--dist loadfile` keeps a file's tests on one worker, so its module fixtures start once.
The e2e files share more than a module: one `llm-mesh up` (every service, the real model;
45–50 s to start on the CI VM) held by a session fixture (``tests/e2e/conftest.py``).
Split across two workers, they started it twice.
"""

from __future__ import annotations

from xdist.scheduler import LoadFileScheduling

#: Files under this directory are one work unit (they share the session's launched mesh).
SHARED_MESH_DIR = "tests/e2e/"


def work_unit(nodeid: str) -> str:
    """The unit a test is scheduled in: its file, or the whole e2e directory."""
    path = nodeid.split("::", 1)[0]
    return SHARED_MESH_DIR if path.startswith(SHARED_MESH_DIR) else path


class LoadFileSharingMesh(LoadFileScheduling):
    """``--dist loadfile`` with the e2e directory as one unit."""

    def _split_scope(self, nodeid: str) -> str:
        return work_unit(nodeid)
