"""lmtier — KV-cache tiering for LLM serving.

Moves vLLM's paged KV cache between GPU memory and cheaper tiers (pinned CPU RAM, local disk,
Redis/Valkey) in *chunks* with a canonical, backend-independent byte layout, so repeated prefixes
are loaded instead of prefilled. See README.md.
"""

__version__ = "0.1.0"
