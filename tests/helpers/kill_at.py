"""Run `python -m miles.cli ARGS` and SIGKILL this process at one instant of a checkpoint
commit (the test's fault injection; the code under test runs unmodified):

    python tests/helpers/kill_at.py before_rename|after_rename|before_tracker ITERATION -- miles args...
"""

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from miles.ckpt import store  # noqa: E402
from miles.ckpt.policy import iter_name  # noqa: E402

point, iteration = sys.argv[1], int(sys.argv[2])
args = sys.argv[sys.argv.index("--") + 1:]
real_rename, real_tracker = os.rename, store.write_tracker


def die():
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def rename(src, dst, *a, **k):
    hit = os.path.basename(str(dst)) == iter_name(iteration)
    if hit and point == "before_rename":
        die()
    real_rename(src, dst, *a, **k)
    if hit and point == "after_rename":
        die()


def write_tracker(save_dir, it):
    if it == iteration and point == "before_tracker":
        die()
    real_tracker(save_dir, it)


store.os = type("os_proxy", (), {"__getattr__": lambda self, n: getattr(os, n), "rename": staticmethod(rename)})()
store.write_tracker = write_tracker
sys.argv = ["miles", *args]
from miles.cli import main  # noqa: E402

main()
