"""Free local ports for services a test starts itself."""

from specdec.launch import free_port

__all__ = ["free_port"]
