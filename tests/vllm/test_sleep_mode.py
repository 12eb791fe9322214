"""Sleep mode: hmacore's connectors do not follow vLLM's KV cache remap (their NIXL / store
registrations and the P/D handshake would name freed memory), so they say so through
``supports_sleep_mode`` and vLLM 0.33 refuses ``enable_sleep_mode`` with them at config time."""
import os
import pytest
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

import harness as H

from hmacore.integrations.vllm import HmaNixlConnector, HmaStoreConnector
from hmacore.integrations.vllm import _compat as C


@pytest.mark.parametrize("name", ["HmaNixlConnector", "HmaStoreConnector"])
def test_connectors_report_no_sleep_mode(name):
    vc = H.vllm_config(kv_connector=name, extra={"store_name": f"sleep-test-{os.getpid()}"}
                       if name == "HmaStoreConnector" else None)
    ktc = vc.kv_transfer_config
    cls = KVConnectorFactory.get_connector_class(ktc)       # how vLLM resolves it
    assert cls is {"HmaNixlConnector": HmaNixlConnector,
                   "HmaStoreConnector": HmaStoreConnector}[name]
    assert cls.supports_sleep_mode(ktc) is False
    with pytest.raises(NotImplementedError, match="does not support sleep mode"):
        cls.unregister_kv_caches(object.__new__(cls))
    with pytest.raises(NotImplementedError, match="does not support sleep mode"):
        cls.restore_kv_caches(object.__new__(cls))


@pytest.mark.skipif(not C.AT_LEAST_033, reason="vLLM 0.33 added the sleep-mode check")
@pytest.mark.parametrize("name", ["HmaNixlConnector", "HmaStoreConnector"])
def test_vllm_refuses_sleep_mode_with_hmacore_connectors(name):
    vc = H.vllm_config(kv_connector=name, extra={"store_name": f"sleep-test-{os.getpid()}"}
                       if name == "HmaStoreConnector" else None)
    vc._verify_kv_transfer_compat()          # sleep mode off: accepted
    mc = vc.model_config                     # the harness shares one ModelConfig: restore it
    # set after construction: CPU has no sleep mode, ModelConfig itself would refuse first
    mc.enable_sleep_mode = True
    try:
        with pytest.raises(ValueError, match=f"{name} does not support sleep mode"):
            vc._verify_kv_transfer_compat()
    finally:
        mc.enable_sleep_mode = False
