"""systemd's notify protocol (Type=notify, WatchdogSec=) spoken directly over $NOTIFY_SOCKET.

The protocol is one AF_UNIX datagram per message, newline-separated KEY=VALUE lines; a leading '@' in the socket
path names the Linux abstract namespace (a NUL byte in the real address). Done here in a few lines rather than
depending on python-systemd/sdnotify, which are not on every Jetson image. The environment is a parameter, so
tests point it at a socket of their own.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

log = logging.getLogger(__name__)


def socket_address(value: str) -> str | None:
    """The address to send to for a $NOTIFY_SOCKET value, or None for kinds this module does not speak (vsock)."""
    if value.startswith("@"):
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    return None


def watchdog_interval(env: Mapping[str, str], pid: int | None = None) -> float | None:
    """Seconds between WATCHDOG=1 pings: half of $WATCHDOG_USEC as sd_watchdog_enabled(3) advises, or None when
    the watchdog is off or meant for another process ($WATCHDOG_PID)."""
    usec = env.get("WATCHDOG_USEC", "").strip()
    if not usec:
        return None
    owner = env.get("WATCHDOG_PID", "").strip()
    if owner and owner != str(os.getpid() if pid is None else pid):
        return None
    try:
        value = int(usec)
    except ValueError:
        log.warning("ignoring WATCHDOG_USEC=%r: not an integer", usec)
        return None
    if value <= 0:
        return None
    return value / 2 / 1e6


def format_message(fields: Mapping[str, object]) -> bytes:
    """KEY=VALUE lines; a value cannot span lines, so newlines in STATUS texts become spaces."""
    lines = []
    for key, value in fields.items():
        text = str(value).replace("\n", " ")
        lines.append(f"{key}={text}")
    return "\n".join(lines).encode()


@dataclass(frozen=True)
class Notifier:
    """Sends notifications when started by systemd with Type=notify; a no-op otherwise."""

    socket_path: str | None = None
    watchdog_s: float | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Notifier:
        path = env.get("NOTIFY_SOCKET") or None
        return cls(socket_path=path, watchdog_s=watchdog_interval(env))

    @property
    def enabled(self) -> bool:
        return self.socket_path is not None

    def notify(self, **fields: object) -> bool:
        """Send one message; True if it was sent. Failures are logged, never raised: losing a status line must
        not take the server down (systemd notices a missing READY=1 or WATCHDOG=1 on its own)."""
        if not self.socket_path:
            return False
        address = socket_address(self.socket_path)
        if address is None:
            log.warning("NOTIFY_SOCKET=%s is not a unix socket path; not notifying systemd", self.socket_path)
            return False
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.connect(address)
                sock.sendall(format_message(fields))
        except OSError as exc:
            log.warning("could not notify systemd at %s: %s", self.socket_path, exc)
            return False
        return True

    def ready(self, status: str) -> bool:
        return self.notify(READY=1, STATUS=status, MAINPID=os.getpid())

    def status(self, status: str) -> bool:
        return self.notify(STATUS=status)

    def watchdog(self) -> bool:
        return self.notify(WATCHDOG=1)

    def stopping(self, status: str = "stopping") -> bool:
        return self.notify(STOPPING=1, STATUS=status)
