"""A torchrun node's settings, read once from torch's parameters (rdzv_client.conf.NodeConf):
the job's settings are one JobSettings whose defaults are the wire's, every --rdzv-conf key is
converted where it is read, and what cannot be used is refused before the node joins."""

from __future__ import annotations

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from rdzv_client import JobSettings
from rdzv_client.conf import NodeConf


def params(**conf: str) -> RendezvousParameters:
    return RendezvousParameters("rdzv-server", "rdzv.example:29400", "job-1", 2, 4, local_addr="10.0.0.7", **conf)


def test_a_node_given_no_rdzv_conf_proposes_the_wire_defaults_and_torchs_heartbeat() -> None:
    conf = NodeConf.read(params())
    defaults = JobSettings()
    assert conf.settings == JobSettings(
        min_nodes=2,
        max_nodes=4,
        last_call_timeout=defaults.last_call_timeout,
        join_timeout=defaults.join_timeout,
        heartbeat_ttl=2.0 * 5,  # torch's keep_alive_interval x keep_alive_max_attempt
        max_restarts=None,
    )
    assert (conf.run_id, conf.endpoint, conf.addr) == ("job-1", "rdzv.example:29400", "10.0.0.7")
    assert (conf.close_timeout, conf.keep_alive_interval, conf.store_timeout) == (30.0, 2.0, 300.0)
    assert conf.nproc_per_node is None and conf.client_options == {} and conf.gpu_check
    assert conf.node_id.count("-") >= 2  # host, pid and a random part


def test_every_rdzv_conf_key_is_read_into_the_record() -> None:
    conf = NodeConf.read(params(
        join_timeout="60", last_call_timeout="1", keep_alive_interval="0.5", keep_alive_max_attempt="4",
        max_restarts="3", node_id="node-a", nproc_per_node="2", close_timeout="7", store_timeout="9",
        health_check="true", health_check_timeout="5", gpu_check="0", tls="1", token_file="/etc/rdzv/token",
        min_round_seconds="30", max_fast_failures="4",
    ))  # fmt: skip
    assert conf.settings == JobSettings(2, 4, last_call_timeout=1.0, join_timeout=60.0, heartbeat_ttl=2.0, max_restarts=3,
                                        min_round_seconds=30.0, max_fast_failures=4)
    assert (conf.node_id, conf.nproc_per_node, conf.close_timeout, conf.store_timeout) == ("node-a", 2, 7.0, 9.0)
    assert (conf.keep_alive_interval, conf.health_check, conf.health_check_timeout, conf.gpu_check) == (
        0.5, "true", 5.0, False,
    )  # fmt: skip
    assert conf.client_options == {"tls": True, "token_file": "/etc/rdzv/token"}


@pytest.mark.parametrize(
    ("endpoint", "conf"),
    [("", {}), ("h:1", {"node_id": "no spaces allowed"}), ("h:1", {"tls": "maybe"}), ("h:1", {"join_timeout": "x"})],
)
def test_what_the_node_cannot_use_is_refused_before_it_joins(endpoint: str, conf: dict[str, str]) -> None:
    with pytest.raises(ValueError):
        NodeConf.read(RendezvousParameters("rdzv-server", endpoint, "job-1", 1, 1, **conf))
