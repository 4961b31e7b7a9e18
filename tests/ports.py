"""Free local ports for services a test starts itself."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing holds now. Fixed ports in Linux's ephemeral
    range (32768-60999) can be held for a moment by any client socket; ask the kernel."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
