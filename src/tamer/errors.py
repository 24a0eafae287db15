"""`RunError`: a run cannot start or go on for a reason outside the program.

Its subclasses (a held output directory, a full disk, a model directory that cannot be
loaded, a checkpoint that is missing) carry one line that names the path and the cause;
the CLI prints that line and exits with status 2 instead of showing a traceback.

    try:
        run_rl(config)
    except RunError as err:
        print(f"error: {err}")
"""

from __future__ import annotations


class RunError(Exception):
    """The message is one line naming the path (or field) and what is wrong with it."""
