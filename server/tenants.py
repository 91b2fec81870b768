"""Which tenant a request belongs to, for what the engine caches across requests.

Prefix-cache blocks and the suffix proposer's global trie are shared only between requests of
one partition (engine Request.cache_salt): otherwise a request's speed, and the acceptance counts
in its `usage`, would tell one user what another sent or received. A partition is the API key the
request presented (hashed: the key itself never reaches the engine) joined with the optional
`cache_salt` the request sent (vLLM's field), so one key's users can keep apart from each other.
"""

from __future__ import annotations

import hashlib

from fastapi import Request


def cache_partition(request: Request, cache_salt: str | None) -> str:
    """"" for a request with neither a key nor a salt: the one shared partition."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    key = token.strip() if scheme.lower() == "bearer" else ""
    if not key and not cache_salt:
        return ""
    key_id = hashlib.blake2b(key.encode(), digest_size=12).hexdigest() if key else ""
    return f"{key_id}/{cache_salt or ''}"
