"""Process helpers: the parent-death hook, killing a process tree, logging set-up."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import sys

import psutil

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int = signal.SIGKILL) -> None:
    """Ask Linux to send `sig` to this process when its parent dies (no orphans)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, sig)
    except OSError:  # pragma: no cover
        logger.warning("prctl(PR_SET_PDEATHSIG) unavailable")


def kill_process_tree(pid: int, include_parent: bool = True, timeout: float = 5.0) -> None:
    """SIGTERM `pid` and all its descendants, then SIGKILL whatever is left."""
    try:
        parent = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    procs = parent.children(recursive=True)
    if include_parent:
        procs.append(parent)
    for p in procs:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=timeout)


def configure_logging(level: str, prefix: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format=f"[%(asctime)s {prefix}] %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def notify_parent_of_failure() -> None:
    """Tell the main process that a subprocess crashed (it shuts the whole tree down)."""
    try:
        os.kill(os.getppid(), signal.SIGQUIT)
    except OSError:  # pragma: no cover
        pass
