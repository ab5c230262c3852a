"""Entry point of a drain chunk worker process (``python -m tierckptd.persistent._chunkmain FD``):
see :mod:`.chunkproc`. A module of its own, so that running it does not import
:mod:`.chunkproc` twice."""

from __future__ import annotations

import socket
import sys

from .chunkproc import lower_priority, serve
from .compress import warm

if __name__ == "__main__":
    lower_priority()  # before the imports: threads they start (numpy's) inherit SCHED_IDLE and nice 19
    warm()
    serve(socket.socket(fileno=int(sys.argv[1])))
