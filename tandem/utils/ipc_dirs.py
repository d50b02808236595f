"""The private directories that hold a server's `ipc://` sockets.

Each is named `tandem-ipc-{owner pid}-{random}` in the temporary directory, mode 0700.
The owner removes its directory at shutdown; one left by an owner that was killed
(SIGKILL, OOM) is removed by the next server that starts on the machine.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile

import psutil

logger = logging.getLogger(__name__)

PREFIX = "tandem-ipc-"
_NAME = re.compile(rf"^{PREFIX}(\d+)-")
# psutil's process start time is only accurate to about a second (boot time in whole seconds).
_CLOCK_SLACK_S = 2.0


def make_ipc_dir() -> str:
    """A fresh private directory (mode 0700) owned by this process."""
    path = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")
    os.chmod(path, 0o700)
    return path


def remove_stale_ipc_dirs(root: str | None = None) -> list[str]:
    """Remove the ipc directories (of this user) whose owner process is gone; return them."""
    root = root or tempfile.gettempdir()
    removed = []
    for name in os.listdir(root):
        match = _NAME.match(name)
        path = os.path.join(root, name)
        if match is None:
            continue
        try:
            st = os.stat(path)
        except OSError:
            continue
        if st.st_uid != os.getuid() or _owner_alive(int(match.group(1)), st.st_ctime):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    if removed:
        logger.info("removed %d ipc directories left by servers that are gone", len(removed))
    return removed


def _owner_alive(pid: int, dir_ctime: float) -> bool:
    """Whether `pid` still runs and is the process that made the directory (a pid
    reused by a process started after the directory is not its owner)."""
    try:
        return psutil.Process(pid).create_time() <= dir_ctime + _CLOCK_SLACK_S
    except psutil.NoSuchProcess:
        return False
