"""vLLM's cache_salt: a request field that scopes what requests share.

Requests with different salts (different tenants) never share prefix-cached KV
(specdec/models/prefix_cache.py roots their block chains in the salt) nor what a
drafter learns across requests (DraftEntry.Start.tenant: the suffix drafter's past
replies). Without a salt a request shares with every other request without one.
"""

from __future__ import annotations

MAX_CACHE_SALT_CHARS = 256


def check_cache_salt(value: str, where: str = "cache_salt") -> str:
    """value, or ValueError naming `where`: at most MAX_CACHE_SALT_CHARS characters."""
    if len(value) > MAX_CACHE_SALT_CHARS:
        raise ValueError(f"{where}: at most {MAX_CACHE_SALT_CHARS} characters, "
                         f"got {len(value)}")
    return value
