"""Every YAML/JSON file shipped under deploy/ parses and has a validator.

A manifest added later without a matching check fails here, so "every shipped
manifest validates" stays true as the folder grows.
"""

import json

import pytest
import yaml

from conftest import DEPLOY

# file (relative to deploy/) -> the test module that validates it
VALIDATED_BY = {
    "istio/model-server-sim.yaml": "test_kubernetes",
    "istio/model-server-vllm.yaml": "test_kubernetes",
    "istio/gateway.yaml": "test_istio",
    "istio/gateway-deployment.yaml": "test_kubernetes, test_peers",
    "istio/peers.yaml": "test_kubernetes, test_peers",
    "istio/peers-networkpolicy.yaml": "test_kubernetes, test_peers",
    "istio/envoyfilter-kvroute.yaml": "test_istio, test_envoy, test_peers",
    "istio/envoyfilter-inferencepool-bridge.yaml": "test_istio, test_envoy",
    "istio/wasmplugin.yaml": "test_istio, test_plugin_config",
    "compose/compose.yaml": "test_compose",
    "compose/envoy.yaml": "test_envoy, test_compose",
    "compose/kvroute.json": "test_plugin_config, test_envoy",
}
SHIPPED = sorted(str(p.relative_to(DEPLOY)) for p in DEPLOY.rglob("*")
                 if p.suffix in (".yaml", ".yml", ".json") and p.is_file())


def test_every_manifest_has_a_validator():
    assert set(SHIPPED) == set(VALIDATED_BY), "add a validator for new manifests"


@pytest.mark.parametrize("rel", SHIPPED)
def test_parses(rel):
    text = (DEPLOY / rel).read_text()
    docs = [json.loads(text)] if rel.endswith(".json") else list(yaml.safe_load_all(text))
    assert docs and all(isinstance(d, (dict, type(None))) for d in docs)


def test_negative_broken_yaml_rejected():
    with pytest.raises(yaml.YAMLError):
        yaml.safe_load("a: [1, 2\nb: 3")
