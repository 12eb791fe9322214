"""kv_connector_extra_config of both connectors: unknown keys refused with a suggestion,
every value typed and bounded, every error a ConfigError (also a ValueError) naming the key."""
import os
import pytest

import harness as H
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from hmacore.errors import ConfigError
from hmacore.integrations.vllm import HmaNixlConnector, HmaStoreConnector

pytestmark = pytest.mark.vllm


def nixl(extra):
    vc = H.vllm_config(extra=extra)
    return HmaNixlConnector(vc, KVConnectorRole.SCHEDULER, H.gemma_like())


def store(extra):
    vc = H.vllm_config(kv_connector="HmaStoreConnector", extra=extra)
    return HmaStoreConnector(vc, KVConnectorRole.SCHEDULER, H.gemma_like())


@pytest.mark.parametrize("extra,match", [
    ({"side_chanel_port": 5601}, r"'side_chanel_port' \(did you mean 'side_channel_port'\?\)"),
    ({"kv_lease_duration": "soon"}, "kv_lease_duration must be a number > 0, got 'soon'"),
    ({"kv_lease_duration": 0}, "kv_lease_duration must be a number > 0"),
    ({"kv_lease_duration": True}, "kv_lease_duration must be a number > 0"),
    ({"side_channel_port": 5600.5}, "side_channel_port must be an integer"),
    ({"side_channel_port": 70000}, r"side_channel_port must be a TCP port in \[1, 65535\]"),
    ({"sync_load": "no"}, "sync_load must be true or false, got 'no'"),
    ({"sync_load": 1}, "sync_load must be true or false"),
    ({"nixl_progress_delay_us": -1}, "nixl_progress_delay_us must be an integer >= 0"),
    ({"nixl_progress_delay_us": "fast"}, "nixl_progress_delay_us must be an integer >= 0"),
    ({"transfer_mode": "pushy"}, "transfer_mode must be one of"),
    ({"nixl_posting": "fast"}, r"nixl_posting must be one of \['auto', 'dynamic', 'prepped', "
                               r"'blocks'\], got 'fast'"),
    ({"transfer_mode": "push", "push_recv_timeout": -3}, "push_recv_timeout must be a number > 0"),
])
def test_nixl_config_errors_name_the_key(extra, match):
    with pytest.raises(ConfigError, match=match) as e:
        nixl(extra)
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize("extra,match", [
    ({"load_asynch": True}, r"'load_asynch' \(did you mean 'load_async'\?\)"),
    ({"load_async": "yes"}, "load_async must be true or false"),
    ({"store_capacity_bytes": "big", "store_name": f"cfg-test-{os.getpid()}"},
     "store_capacity_bytes must be an integer >= 1"),
    ({"store": "mooncake"}, '"store": "mooncake" needs'),
    ({"store": "nowhere"}, "is not \"embedded\""),
    ({"model_name": 7}, "model_name must be a string"),
])
def test_store_config_errors_name_the_key(extra, match):
    with pytest.raises(ConfigError, match=match):
        store(extra)


def test_good_configs_read_typed_values():
    c = nixl({"kv_lease_duration": "12.5", "side_channel_port": 5611, "sync_load": "true"})
    assert (c.scheduler.lease_s, c.scheduler.port, c.scheduler.sync_load) == (12.5, 5611, True)
    assert c.scheduler.posting == "auto"
    assert nixl({"nixl_posting": "blocks"}).scheduler.posting == "blocks"
    s = store({"load_async": True, "store_name": f"cfg-good-{os.getpid()}"})
    assert s.scheduler.load_async is True


@pytest.mark.parametrize("role,flag", [("kv_producer", "do_remote_prefill"),
                                       ("kv_consumer", "do_remote_decode")])
def test_roles_are_enforced(role, flag):
    """A decode request on a producer (or a P request on a consumer) runs as a plain request:
    no load is scheduled, no lease is taken, the engine does not stall."""
    vc = H.vllm_config(kv_role=role)
    s = H.make_scheduler(vc, H.gemma_like())
    hbs = H.C.resolve_kv_cache_block_sizes(H.gemma_like(), vc)[1]
    params = H.remote_params("r", H.gemma_like(), 40) if flag == "do_remote_prefill" else \
        {"do_remote_decode": True}
    req = H.make_request("r", list(range(1, 41)), hbs, max_tokens=2, params=params)
    s.add_request(req)
    assert not req.kv_transfer_params.get(flag)
    d = H.Driver(s)
    d.run()
    assert not any(m.reqs_to_recv for m in d.metas)
    assert d.conn.leases() == {} and not d.conn.awaiting()
    H.assert_no_leak(s)
