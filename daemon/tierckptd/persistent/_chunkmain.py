"""Entry point of a drain chunk worker process (``python -m tierckptd.persistent._chunkmain FD``):
see :mod:`.chunkproc`. A module of its own, so that running it does not import
:mod:`.chunkproc` twice."""

from __future__ import annotations

import socket
import sys

from .chunkproc import READY, die_with_parent, lower_priority, serve
from .compress import warm

if __name__ == "__main__":
    die_with_parent(int(sys.argv[2]))  # first: a daemon killed while this child is stopped takes it along
    sock = socket.socket(fileno=int(sys.argv[1]))
    sock.send(READY)  # from here on the daemon may stop this child (.pause); it started at the normal policy
    lower_priority()  # before the imports: threads they start (numpy's) inherit SCHED_IDLE and nice 19
    warm()
    serve(sock)
