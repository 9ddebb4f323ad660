"""KV codec."""
