"""hmacore.errors: one root, and every class also the builtin it replaces."""
import pickle

import pytest

import hmacore
from hmacore import errors

# class -> the builtin(s) it must also be (so existing ``except ValueError`` keeps working)
TAXONOMY = {
    "ConfigError": (ValueError,),
    "LayoutError": (ValueError,),
    "LayoutKeyError": (ValueError, KeyError),
    "ConfigFileError": (ValueError, OSError),
    "ArgumentValueError": (ValueError,),
    "ArgumentTypeError": (TypeError,),
    "ArgumentOverflowError": (OverflowError,),
    "BlockTableError": (ValueError,),
    "HashInputError": (ValueError,),
    "TrackerStateError": (RuntimeError,),
    "TransferError": (RuntimeError,),
    "HandshakeError": (RuntimeError,),
    "StoreError": (RuntimeError,),
    "PeerProcessError": (RuntimeError,),
    "DependencyError": (ImportError,),
}


@pytest.mark.parametrize("name,builtins", TAXONOMY.items(), ids=list(TAXONOMY))
def test_every_class_is_an_hmacore_error_and_its_builtin(name, builtins):
    cls = getattr(errors, name)
    assert issubclass(cls, errors.HmacoreError)
    for b in builtins:
        assert issubclass(cls, b), (name, b)
    assert getattr(hmacore, name) is cls            # exported from the package
    e = cls("the rule") if name != "TransferError" else cls("the rule", request_id="r")
    assert str(e) == "the rule"                     # KeyError/OSError would decorate it
    assert isinstance(pickle.loads(pickle.dumps(e)), cls)


def test_the_taxonomy_is_complete_and_documented():
    classes = {n for n in dir(errors) if isinstance(getattr(errors, n), type)
               and issubclass(getattr(errors, n), Exception)}
    assert classes == set(TAXONOMY) | {"HmacoreError"}
    assert set(errors.__all__) == classes
    for n in classes:
        assert n in errors.__doc__, n                 # the tree in the module docstring


def test_config_error_sits_above_layout_error():
    assert issubclass(errors.LayoutError, errors.ConfigError)
    assert issubclass(errors.LayoutKeyError, errors.LayoutError)
    assert issubclass(errors.ConfigFileError, errors.ConfigError)
    from hmacore.errors import ConfigError  # noqa: F401 - the import other modules use
    assert hmacore.ConfigError is errors.ConfigError


def test_existing_handlers_keep_catching():
    with pytest.raises(ValueError):
        raise errors.ConfigError("x")
    with pytest.raises(KeyError):
        raise errors.LayoutKeyError("x")
    with pytest.raises(TypeError):
        raise errors.ArgumentTypeError("x")
    with pytest.raises(OSError):
        raise errors.ConfigFileError("x")
