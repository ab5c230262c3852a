"""The daemon's Unix socket: claimed, never taken over; removed only by the daemon that made it.

Rules:

- ``<socket>.lock`` is locked (``flock``) for the daemon's lifetime and holds its pid: a second
  daemon given the same path finds it locked and refuses, naming the path and that pid.
- Whatever is at the path must be a socket nobody answers on (a dead daemon's leftover) before
  it is removed; a socket that accepts a connection is live and is never removed (the pid comes
  from ``SO_PEERCRED``), and anything that is not a socket is refused.
- gRPC binds a private name in the same directory (gRPC itself unlinks the path it binds, before
  binding and again at shutdown); the socket gets its mode and group there and is then renamed
  onto the path, atomically. At exit the path is removed only if it still names that socket.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import grp
import logging
import os
import secrets
import shutil
import socket
import stat
import struct
from dataclasses import dataclass

from .config import ConfigError

__all__ = ["SocketClaim", "claim_socket", "resolve_group"]

log = logging.getLogger(__name__)

_CONNECT_TIMEOUT = 2.0


def resolve_group(name: str, key: str = "socket_group") -> int | None:
    """The gid of ``socket_group`` (a name or a number), None when not set.

    Raises:
        ConfigError: no such group; the message names ``socket_group``.
    """
    if not name:
        return None
    if name.isdigit():
        return int(name)
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise ConfigError(f"{key}: no group named {name!r} on this host "
                          "(create it, or give a gid)") from None


def _peer_pid(sock: socket.socket) -> int | None:
    try:
        pid, _uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                              struct.calcsize("3i")))
    except (OSError, AttributeError):  # not Linux
        return None
    return pid or None


def _live_pid(path: str) -> tuple[bool, int | None]:
    """Whether something accepts connections on the Unix socket ``path``, and its pid if known."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(_CONNECT_TIMEOUT)
        try:
            s.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return False, None
        except TimeoutError:  # a full backlog: someone listens
            return True, None
        except PermissionError:
            raise ConfigError(f"socket: {path} exists and this user may not connect to it, so it cannot "
                              "tell whether another daemon serves it; remove it or choose another path") from None
        return True, _peer_pid(s)


def _holder(fd: int) -> str:
    return os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"


@dataclass
class SocketClaim:
    """The lock on a socket path, then the identity of the socket bound there."""

    path: str
    lock_fd: int
    ident: tuple[int, int] | None = None  # (st_dev, st_ino) of the socket this daemon bound
    bind_path: str = ""

    def __post_init__(self) -> None:
        if not self.bind_path:  # short: Unix socket paths are limited to ~107 bytes
            self.bind_path = os.path.join(os.path.dirname(self.path), f".t{secrets.token_hex(4)}")

    def bound(self, mode: int, gid: int | None) -> None:
        """Give the socket gRPC bound at ``bind_path`` its mode and group, then move it to ``path``.

        Raises:
            ConfigError: the group cannot be given (the daemon's user is not a member).
        """
        os.chmod(self.bind_path, mode)
        if gid is not None:
            try:
                shutil.chown(self.bind_path, group=gid)
            except PermissionError:
                raise ConfigError(f"socket_group: cannot give {self.path} to group {gid}: not permitted "
                                  "(the daemon's user must be a member of it)") from None
        st = os.lstat(self.bind_path)
        os.rename(self.bind_path, self.path)
        self.ident = (st.st_dev, st.st_ino)

    def release(self) -> None:
        """Remove the socket if the path still names the one this daemon bound; drop the lock."""
        with contextlib.suppress(OSError):
            os.unlink(self.bind_path)  # only there if start-up failed before the rename
        try:
            if self.ident is not None:
                try:
                    st = os.lstat(self.path)
                except FileNotFoundError:
                    pass
                else:
                    if (st.st_dev, st.st_ino) == self.ident:
                        os.unlink(self.path)
                    else:
                        log.warning("socket %s was replaced by someone else; leaving it in place", self.path)
        finally:
            if self.lock_fd >= 0:
                os.close(self.lock_fd)
                self.lock_fd = -1


def claim_socket(path: str) -> SocketClaim:
    """Lock ``path`` for this daemon and clear a dead daemon's leftover socket there.

    Raises:
        ConfigError: another daemon holds the path (its pid is named when known), or the path
            holds something other than a socket, or its directory cannot be used.
    """
    directory = os.path.dirname(path)
    try:
        os.makedirs(directory, exist_ok=True)
        fd = os.open(path + ".lock", os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640)
    except OSError as e:
        raise ConfigError(f"socket: cannot use {path}: {e.strerror} ({e.filename})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise ConfigError(f"socket: {path} is in use by another tierckptd (pid {holder}); "
                          "stop it or choose another --socket") from None
    try:
        _clear_leftover(path)
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return SocketClaim(path, fd)


def _clear_leftover(path: str) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ConfigError(f"socket: {path} exists and is not a socket; refusing to replace it")
    live, pid = _live_pid(path)
    if live:
        raise ConfigError(f"socket: {path} is served by another process (pid {pid or 'unknown'}); "
                          "stop it or choose another --socket")
    try:
        os.unlink(path)  # a dead daemon's leftover
    except OSError as e:
        if e.errno != errno.ENOENT:
            raise ConfigError(f"socket: cannot remove the stale socket {path}: {e.strerror}") from None
    log.info("removed the stale socket %s of a daemon that is gone", path)
