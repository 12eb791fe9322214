"""``kv_connector_extra_config.transport`` is validated at start-up (no engine, no transport
library needed)."""
import pytest

import harness as H

from hmacore.errors import ConfigError
from hmacore.integrations.vllm.nixl.transport_config import transport_name


def test_default_and_known_transports():
    assert transport_name(H.vllm_config(extra={})) == "nixl"
    assert transport_name(H.vllm_config(extra={"transport": "mooncake"})) == "mooncake"
    assert transport_name(H.vllm_config(extra={"transport": "nixl"}), "push") == "nixl"


@pytest.mark.parametrize("bad", ["ucx", "Mooncake", "", 3])
def test_unknown_transport_is_refused_naming_the_field(bad):
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config.transport must be one of"):
        transport_name(H.vllm_config(extra={"transport": bad}))


def test_mooncake_push_is_accepted_at_start_up():
    # push over Mooncake TE runs (tests/mooncake/test_te_connector.py); no refusal left
    assert transport_name(H.vllm_config(extra={"transport": "mooncake"}), "push") == "mooncake"
