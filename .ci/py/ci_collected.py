"""CI only, a pytest plugin (``.ci/run`` adds ``-p ci_collected`` to a stage's pytest command): once collection ends,
the pytest process appends to ``CI_PROC_LOG`` the CPU-seconds it has spent since it started (``time.process_time``:
user + system) -- its interpreter, pytest and its plugins, the conftests and every test module it imported.
"""

import os
import time


def pytest_collection_finish(session) -> None:
    path = os.environ.get("CI_PROC_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"collected\t{os.getpid()}\t{time.process_time():.2f}\t{len(session.items)}\n")
