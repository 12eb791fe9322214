"""Transports: NIXL agent driver and KV stores. Imports nixl/mooncake lazily, never at import."""
