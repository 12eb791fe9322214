"""The handshake side channel's two addresses: what peers are told (``side_channel_host``)
and where the servers bind (``side_channel_listen_host``); a wildcard is never advertised, and
a prefill engine advertising loopback says so at start-up."""
import logging

import pytest

import harness as H
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from hmacore.errors import ConfigError
from hmacore.integrations.vllm import HmaNixlConnector
from hmacore.integrations.vllm._config import is_loopback, side_channel

pytestmark = pytest.mark.vllm


def scheduler(extra, role="kv_producer"):
    vc = H.vllm_config(kv_role=role, extra=extra)
    return HmaNixlConnector(vc, KVConnectorRole.SCHEDULER, H.gemma_like())


@pytest.mark.parametrize("extra,want", [
    ({}, ("127.0.0.1", "127.0.0.1")),
    ({"side_channel_host": "10.0.0.7"}, ("10.0.0.7", "10.0.0.7")),
    ({"side_channel_host": "10.0.0.7", "side_channel_listen_host": "0.0.0.0"},
     ("10.0.0.7", "0.0.0.0")),
    ({"side_channel_listen_host": "::"}, ("127.0.0.1", "::")),
])
def test_advertised_and_listen_hosts(extra, want):
    assert side_channel(extra) == want
    s = scheduler(extra).scheduler
    assert (s.host, s.listen_host) == want


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "*"])
def test_wildcard_is_never_advertised(host):
    with pytest.raises(ConfigError, match="side_channel_host is the address peers connect "
                                          "to and cannot be the wildcard"):
        scheduler({"side_channel_host": host})


def test_listen_host_must_be_text():
    with pytest.raises(ConfigError, match="side_channel_listen_host must be a string"):
        scheduler({"side_channel_listen_host": 0})


@pytest.mark.parametrize("host,loop", [("127.0.0.1", True), ("127.3.0.9", True),
                                       ("::1", True), ("localhost", True), ("10.1.2.3", False),
                                       ("prefill-0.cluster", False), ("fe80::1", False)])
def test_is_loopback(host, loop):
    assert is_loopback(host) is loop


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _warnings(extra, role):
    """Warnings the connector's loggers emit while it is built (vLLM's logger does not
    propagate to root, so a handler of our own on ``vllm.hmacore``)."""
    logger, h = logging.getLogger("vllm.hmacore"), _Records()
    logger.addHandler(h)
    try:
        scheduler(extra, role)
    finally:
        logger.removeHandler(h)
    return h.messages


def test_loopback_producer_warns_once_and_routable_does_not():
    msgs = _warnings({}, "kv_producer")
    assert sum("advertises the loopback side channel 127.0.0.1" in m for m in msgs) == 1, msgs
    assert not [m for m in _warnings({"side_channel_host": "10.9.8.7"}, "kv_producer")
                if "loopback" in m]
    # a decode engine's own address is never advertised in pull mode: no warning
    assert not [m for m in _warnings({}, "kv_consumer") if "loopback" in m]
