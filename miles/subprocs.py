"""Servers miles starts as child processes (sglang-router, an SGLang engine) that do not
outlive their parent: the kernel sends them SIGTERM when the process that started them dies,
even by SIGKILL (a job killed with kill -9, a `ray job stop` that ran out of time), so a dead
job leaves no server holding ports or GPU memory.

Linux sends the signal when the *thread* that started the child exits: start them from a
thread that lives as long as they should (the main thread of a driver or an actor)."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

_PR_SET_PDEATHSIG = 1
# Resolved here, before any fork: the child between fork and exec must not load libraries.
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def popen_tied(cmd: list[str], **kwargs) -> subprocess.Popen:
    """subprocess.Popen(cmd, **kwargs), the child SIGTERMed when this process dies."""
    if _prctl is not None:
        parent = os.getpid()

        def tie() -> None:
            _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
            if os.getppid() != parent:  # the parent died before the tie was made
                os._exit(1)

        kwargs["preexec_fn"] = tie
    return subprocess.Popen(cmd, **kwargs)
