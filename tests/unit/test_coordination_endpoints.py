"""Endpoint lists in the controller's and the agent's configuration (issue 18, item 9)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from sailor.agent.agent_config import AgentConfig
from sailor.controller.config import ControllerConfig
from sailor.schemas.hardware import NodeSpec

NODE = NodeSpec(node_id="n1", gpu_type="cpu", gpus=1, zone="z", address="127.0.0.1")


def test_lists_are_taken_and_kept_in_order() -> None:
    cfg = ControllerConfig(
        nats_urls=["nats://10.0.0.2:4222", "tls://10.0.0.3:4222", "nats://10.0.0.4:4222"],
        etcd_endpoints=("10.0.0.2:2379", "10.0.0.3:2379", "[fd00::4]:2379"),
    )
    assert cfg.nats_urls == ("nats://10.0.0.2:4222", "tls://10.0.0.3:4222", "nats://10.0.0.4:4222")
    assert cfg.etcd_endpoints == ("10.0.0.2:2379", "10.0.0.3:2379", "[fd00::4]:2379")


@pytest.mark.parametrize("model", [ControllerConfig, AgentConfig])
def test_old_single_string_keys_still_load(model: type) -> None:
    extra = {"node": NODE} if model is AgentConfig else {}
    cfg = model.model_validate(
        {"nats_url": "nats://10.0.0.2:4222", "etcd_endpoint": "10.0.0.2:2379", **extra}
    )
    assert cfg.nats_urls == ("nats://10.0.0.2:4222",)
    assert cfg.etcd_endpoints == ("10.0.0.2:2379",)
    # a string under the new key, several servers separated by commas (an environment file)
    cfg = model.model_validate({"etcd_endpoints": "10.0.0.2:2379, 10.0.0.3:2379", **extra})
    assert cfg.etcd_endpoints == ("10.0.0.2:2379", "10.0.0.3:2379")


@pytest.mark.parametrize(
    ("data", "field", "value"),
    [
        ({"etcd_endpoints": ["10.0.0.2"]}, "etcd_endpoints", "10.0.0.2"),
        ({"etcd_endpoints": ["10.0.0.2:99999"]}, "etcd_endpoints", "10.0.0.2:99999"),
        ({"etcd_endpoints": ["https://10.0.0.2:2379"]}, "etcd_endpoints", "https://10.0.0.2:2379"),
        ({"etcd_endpoint": "host:port"}, "etcd_endpoints", "host:port"),
        ({"nats_urls": ["http://10.0.0.2:4222"]}, "nats_urls", "http://10.0.0.2:4222"),
        ({"nats_urls": ["nats://10.0.0.2"]}, "nats_urls", "nats://10.0.0.2"),
        ({"nats_url": "nats://:4222"}, "nats_urls", "nats://:4222"),
        ({"nats_urls": []}, "nats_urls", "[]"),
        ({"nats_urls": ["nats://a:1", "nats://a:1"]}, "nats_urls", "nats://a:1"),
        ({"etcd_endpoints": 2379}, "etcd_endpoints", "2379"),
    ],
)
def test_bad_endpoints_are_refused_naming_field_and_value(
    data: dict[str, object], field: str, value: str
) -> None:
    with pytest.raises(ValidationError) as err:
        ControllerConfig.model_validate(data)
    msg = str(err.value)
    assert field in msg and value in msg, msg


def test_old_and_new_key_together_are_refused() -> None:
    with pytest.raises(ValidationError, match="etcd_endpoint and etcd_endpoints both given"):
        ControllerConfig.model_validate({"etcd_endpoint": "a:1", "etcd_endpoints": ["a:1", "b:1"]})
