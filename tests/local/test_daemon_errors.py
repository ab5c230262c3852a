"""Errors of the daemon's local tier as the client sees them."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest
import tierckpt


@pytest.mark.parametrize("damage", ["truncate", "remove"])
def test_local_copy_short_or_gone_is_a_tierckpt_error(daemon, damage):
    """A local data file shorter than its manifest says is a failed copy: DataLossError (and the
    next tier is tried); one gone (evicted or re-saved between the Restore reply and the
    client's map) is asked for again, then NotFoundError, and the daemon's copy is not dropped
    as corrupt. Never a ValueError/FileNotFoundError from mmap/open."""
    with daemon.client() as c:
        c.save("job", 1, 0, 1, {"x": np.arange(4096, dtype=np.int32)}).result(30)
    data_file = next(daemon.local_dir.glob("jobs/job/*/*/x.*"))
    if damage == "truncate":
        os.truncate(data_file, 100)
    else:
        data_file.unlink()
    with daemon.client() as c:
        if damage == "truncate":
            with pytest.raises(tierckpt.DataLossError):
                c.restore("job", 0)
        else:
            with pytest.raises(tierckpt.NotFoundError):
                c.restore("job", 0)
            assert c.latest("job") == 1  # not removed as "corrupt"


def test_enospc_on_the_daemon_is_resource_exhausted():
    """A full local_dir met outside begin (a streamed chunk, a commit's rename) is the capacity
    condition the contract names: RESOURCE_EXHAUSTED (CapacityError), not INTERNAL."""
    import asyncio

    import grpc
    from tierckptd import rpc

    class Aborted(Exception):
        pass

    class Context:
        async def abort(self, code, details):
            raise Aborted(code, details)

    @rpc.rpc
    async def handler(self, request, context):
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(Aborted) as info:
        asyncio.run(handler(rpc.Authorizing(), None, Context()))
    assert info.value.args[0] == grpc.StatusCode.RESOURCE_EXHAUSTED

