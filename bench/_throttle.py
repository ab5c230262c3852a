"""A token-bucket TCP proxy: a node's share of object-store bandwidth, for benchmarks.

Every connection accepted on ``--listen`` is relayed to ``--target``. All bytes towards the
target (uploads) share one token bucket and all bytes back (downloads) share another, each
refilled at ``--rate`` bytes per second with a burst of ``--burst-s`` seconds of tokens: the
limit holds for the sum over connections, as a node's NIC or its share of a storage front end
would. The relay itself is plain asyncio (64 KiB reads), well above the rates it is asked for.

Usage (prints ``listening HOST:PORT`` once ready)::

    python bench/_throttle.py --listen 127.0.0.1:0 --target 127.0.0.1:5000 --rate 134217728
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time

CHUNK = 64 * 1024


class TokenBucket:
    """``rate`` bytes per second, at most ``burst`` bytes banked; shared by every caller."""

    def __init__(self, rate: float, burst: float, clock=time.monotonic) -> None:
        if rate <= 0 or burst <= 0:
            raise ValueError("rate and burst must be > 0")
        self.rate, self.burst, self._clock = float(rate), float(burst), clock
        self.tokens, self._t = float(burst), clock()
        self._lock = asyncio.Lock()

    def _refill(self) -> None:
        now = self._clock()
        self.tokens = min(self.burst, self.tokens + (now - self._t) * self.rate)
        self._t = now

    def delay(self, n: int) -> float:
        """Takes ``n`` tokens (going into debt) and returns how long the caller must wait."""
        self._refill()
        self.tokens -= n
        return max(0.0, -self.tokens / self.rate)

    async def take(self, n: int) -> None:
        async with self._lock:  # first come, first served: waiting callers queue in order
            wait = self.delay(n)
            if wait > 0:
                await asyncio.sleep(wait)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, bucket: TokenBucket) -> None:
    try:
        while data := await reader.read(CHUNK):
            await bucket.take(len(data))
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        try:
            writer.close()
        except (ConnectionError, RuntimeError):
            pass


async def serve(listen: tuple[str, int], target: tuple[str, int], rate: float, burst_s: float) -> None:
    up, down = TokenBucket(rate, rate * burst_s), TokenBucket(rate, rate * burst_s)

    async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            tr, tw = await asyncio.open_connection(*target)
        except OSError:
            cw.close()
            return
        await asyncio.gather(_pipe(cr, tw, up), _pipe(tr, cw, down))

    server = await asyncio.start_server(handle, *listen)
    host, port = server.sockets[0].getsockname()[:2]
    print(f"listening {host}:{port}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host or "127.0.0.1", int(port)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--listen", type=_addr, default=("127.0.0.1", 0), help="HOST:PORT (port 0: any free one)")
    ap.add_argument("--target", type=_addr, required=True, help="HOST:PORT to relay to")
    ap.add_argument("--rate", type=float, default=128 * 2**20, help="bytes/s per direction (default 128 MiB/s)")
    ap.add_argument("--burst-s", type=float, default=0.05, help="bucket depth in seconds of --rate (default 0.05)")
    args = ap.parse_args(argv)
    asyncio.run(serve(args.listen, args.target, args.rate, args.burst_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
