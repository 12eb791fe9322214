"""Exception types. Every error names the argument and the rule it broke."""


class HmacoreError(Exception):
    """Base class of every error hmacore raises on purpose."""


class LayoutError(HmacoreError, ValueError):
    """A layout (groups, block sizes, windows) breaks a rule hmacore relies on."""


class BlockTableError(HmacoreError, ValueError):
    """A block table or block-id array is malformed (group count, dtype, range)."""


class TrackerStateError(HmacoreError, RuntimeError):
    """A tracker operation is not allowed in the request's current state."""


class TransferError(HmacoreError, RuntimeError):
    """A block transfer failed; carries the request id and, where known, group and block index."""

    def __init__(self, message, *, request_id=None, group=None, block_index=None):
        super().__init__(message)
        self.request_id = request_id
        self.group = group
        self.block_index = block_index


class HandshakeError(HmacoreError, RuntimeError):
    """Two peers disagree on layout, plan or protocol version."""


class HashInputError(HmacoreError, ValueError):
    """A block-hash array, digest, group id or key given to the hit/store API breaks a rule."""


class StoreError(HmacoreError, RuntimeError):
    """A KV store backend could not be set up or used (never raised for a plain miss)."""
