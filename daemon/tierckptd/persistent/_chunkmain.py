"""Entry point of a drain chunk worker process (``python -m tierckptd.persistent._chunkmain FD``):
see :mod:`.chunkproc`. A module of its own, so that running it does not import
:mod:`.chunkproc` twice."""

from __future__ import annotations

import socket
import sys

from .chunkproc import serve
from .compress import warm

if __name__ == "__main__":
    warm()
    serve(socket.socket(fileno=int(sys.argv[1])))
