"""Exception types. Every error names the argument and the rule it broke.

One root, :class:`HmacoreError`; every class ALSO derives from the builtin it replaces, so an
existing ``except ValueError`` (``TypeError``, ``KeyError``, ``OSError``, ``OverflowError``,
``RuntimeError``) keeps catching it::

    HmacoreError (Exception)
    ├── ConfigError (ValueError)              connector / layout configuration
    │   ├── LayoutError                       a layout breaks a rule (groups, sizes, windows)
    │   │   └── LayoutKeyError (KeyError)     a layout document lacks a required key
    │   └── ConfigFileError (OSError)         a configuration file cannot be read
    ├── ArgumentValueError (ValueError)       an argument breaks a range rule (tokens >= 0 ...)
    ├── ArgumentTypeError (TypeError)         an argument has the wrong type (float/bool for int)
    ├── ArgumentOverflowError (OverflowError) an argument does not fit its fixed-width field
    ├── BlockTableError (ValueError)          a block table / block-id array is malformed
    ├── HashInputError (ValueError)           a hash, digest, group id or key breaks a rule
    ├── TrackerStateError (RuntimeError)      a tracker call not allowed in the request's state
    ├── TransferError (RuntimeError)          a block transfer failed (request, group, block)
    ├── HandshakeError (RuntimeError)         peers disagree on layout, plan or protocol
    ├── StoreError (RuntimeError)             a KV store backend cannot be set up or used
    ├── PeerProcessError (RuntimeError)       a helper process (the demo's prefill side) failed
    └── DependencyError (ImportError)         an optional dependency (NIXL, vLLM) is missing

``hmacore``'s command line prints any :class:`HmacoreError` as one ``hmacore: error: ...``
line (exit code 2 for :class:`ConfigError` and the argument errors, 1 for the runtime ones).
"""

__all__ = [
    "HmacoreError", "ConfigError", "LayoutError", "LayoutKeyError", "ConfigFileError",
    "ArgumentValueError", "ArgumentTypeError", "ArgumentOverflowError", "BlockTableError",
    "HashInputError", "TrackerStateError", "TransferError", "HandshakeError", "StoreError",
    "PeerProcessError", "DependencyError",
]


class HmacoreError(Exception):
    """Base class of every error hmacore raises on purpose."""


class ConfigError(HmacoreError, ValueError):
    """A connector or layout configuration is invalid (what the user wrote, not what ran)."""


class LayoutError(ConfigError):
    """A layout (groups, block sizes, windows) breaks a rule hmacore relies on."""


class LayoutKeyError(LayoutError, KeyError):
    """A layout document (dict, JSON, TOML) lacks a key it must have."""

    def __str__(self) -> str:  # KeyError would print repr(message)
        return str(self.args[0]) if self.args else ""


class ConfigFileError(ConfigError, OSError):
    """A configuration file (a JSON/TOML layout) cannot be opened or read."""

    def __str__(self) -> str:  # OSError would print "[Errno ...]" for two-argument forms
        return str(self.args[0]) if self.args else ""


class ArgumentValueError(HmacoreError, ValueError):
    """An argument has the right type but breaks a range or consistency rule."""


class ArgumentTypeError(HmacoreError, TypeError):
    """An argument has the wrong type (e.g. a float or a bool where an int is meant)."""


class ArgumentOverflowError(HmacoreError, OverflowError):
    """An argument does not fit the fixed-width field it is stored in (int32 ids, int64)."""


class BlockTableError(HmacoreError, ValueError):
    """A block table or block-id array is malformed (group count, dtype, range)."""

    # set (as attributes, after construction) only where one offending id is named
    group: int
    block_index: int


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

    # set (as attributes, after construction) by a save report naming the keys not stored
    request_id: str
    keys: list


class PeerProcessError(HmacoreError, RuntimeError):
    """A helper process hmacore started (the demo's prefill side) failed or went silent;
    the message carries its last error line, not its traceback."""


class DependencyError(HmacoreError, ImportError):
    """An optional dependency a command needs (NIXL, vLLM, Mooncake) cannot be imported."""
