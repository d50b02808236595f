"""Process helpers: names, the parent-death hook, stop signals, killing a process tree,
reporting a child's failure, logging set-up."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import sys

import psutil
import setproctitle

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
# SGLang's SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION: a failing scheduler SIGKILLs its whole
# process group instead of asking the parent to shut the server down.
KILLPG_ENV = "TANDEM_KILLPG_ON_SCHEDULER_EXCEPTION"


def set_process_title(title: str) -> None:
    """Name this process (`tandem::scheduler_TP0`, ...) as `ps` and psutil show it."""
    setproctitle.setproctitle(title)


def set_process_name(name: str) -> None:
    """Set only the short process name (`ps -e`, `top`, psutil's `name()`; at most 15
    characters), keeping the command line that scripts match on."""
    setproctitle.setthreadtitle(name)


def set_parent_death_signal(sig: int = signal.SIGKILL) -> None:
    """Ask Linux to send `sig` to this process when its parent dies (no orphans)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, sig)
    except OSError:  # pragma: no cover
        logger.warning("prctl(PR_SET_PDEATHSIG) unavailable")


def release_free_heap() -> None:
    """Hand the heap's free pages back to the OS (glibc's `malloc_trim`): after the weights
    load, the dense copies and file buffers that were freed stay in the process's resident
    memory otherwise (the default model's Q4_0 file: 995 -> 726 MB resident)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # pragma: no cover - another C library
        pass


def ignore_stop_signals() -> None:
    """For subprocesses: ignore SIGINT and SIGTERM, which a terminal (Ctrl-C) or a
    service manager sends to the whole process group. The main process drains and then
    ends its children itself (SIGKILL); they must not die before the drain."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def kill_process_tree(pid: int, include_parent: bool = True, sig: int = signal.SIGTERM, timeout: float = 5.0) -> None:
    """Send `sig` to `pid` and all its descendants, then SIGKILL whatever is left after
    `timeout` seconds."""
    try:
        parent = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    procs = parent.children(recursive=True)
    if include_parent:
        procs.append(parent)
    for p in procs:
        try:
            p.send_signal(sig)
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


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def exit_now(code: int) -> None:
    """Flush the logs and exit at once, skipping the interpreter's teardown (about two
    seconds of finalizers for torch and friends). Only for a main process that has
    already ended its children and removed its files."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def notify_parent_of_failure() -> None:
    """Tell the main process that a subprocess failed (it shuts the whole tree down)."""
    try:
        os.kill(os.getppid(), signal.SIGQUIT)
    except OSError:  # pragma: no cover
        pass


def report_scheduler_failure() -> None:
    """A scheduler fault (an exception in its loop, a forward past the watchdog): tell
    the parent, or with TANDEM_KILLPG_ON_SCHEDULER_EXCEPTION=1 SIGKILL the whole process
    group at once (the parent included, so it gets no chance to clean up)."""
    if os.environ.get(KILLPG_ENV, "").lower() in ("1", "true", "yes"):
        logger.error("%s is set: killing the process group", KILLPG_ENV)
        os.killpg(0, signal.SIGKILL)
    notify_parent_of_failure()
