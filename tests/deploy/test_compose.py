"""The compose demo validates against the Compose Specification's JSON schema,
and its addresses agree with kvroute's config and the rendered Envoy config.

Validator: the compose-spec JSON schema vendored in check-jsonschema (PyPI,
`check_jsonschema/builtin_schemas/vendor/compose-spec.json`), checked with
jsonschema (Draft 2020-12) plus format checks.
"""

import copy
import importlib.resources
import ipaddress
import json

import jsonschema
import pytest
import yaml

from conftest import COMPOSE, ROOT

SCHEMA = json.loads(importlib.resources.files("check_jsonschema")
                    .joinpath("builtin_schemas/vendor/compose-spec.json").read_text())


def compose():
    return yaml.safe_load((COMPOSE / "compose.yaml").read_text())


def validate(doc):
    jsonschema.Draft202012Validator(
        SCHEMA, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER).validate(doc)


def test_compose_file_validates():
    validate(compose())


def test_negative_unknown_service_key_rejected():
    bad = compose()
    bad["services"]["envoy"]["port"] = ["10000:10000"]  # typo of `ports`
    with pytest.raises(jsonschema.ValidationError):
        validate(bad)


def test_negative_bad_network_config_rejected():
    bad = compose()
    bad["networks"]["pool"]["ipam"]["config"] = "172.28.0.0/24"  # must be a list
    with pytest.raises(jsonschema.ValidationError):
        validate(bad)


def test_sim_addresses_match_the_plugin_config_and_subnet():
    doc = compose()
    subnet = ipaddress.ip_network(doc["networks"]["pool"]["ipam"]["config"][0]["subnet"])
    sims = {name: s["networks"]["pool"]["ipv4_address"]
            for name, s in doc["services"].items() if name.startswith("sim")}
    assert len(sims) >= 2
    assert all(ipaddress.ip_address(a) in subnet for a in sims.values())
    endpoints = json.loads((COMPOSE / "kvroute.json").read_text())["endpoints"]
    port = doc["services"]["sim1"]["command"][doc["services"]["sim1"]["command"].index("--base-port") + 1]
    assert sorted(endpoints) == sorted(f"{a}:{port}" for a in sims.values())
    assert ipaddress.ip_address(doc["services"]["envoy"]["networks"]["pool"]["ipv4_address"]) in subnet


def _envoys(doc):
    """The gateway replicas (services envoy, envoy2, ...)."""
    return {n: s for n, s in doc["services"].items() if n.startswith("envoy")}


def test_envoy_mounts_the_rendered_config_and_envoy_waits_for_the_pool():
    envoys = _envoys(compose())
    assert len(envoys) >= 2, "the demo runs two gateway replicas"
    host_ports = []
    for envoy in envoys.values():
        assert "./envoy.yaml:/etc/envoy/envoy.yaml:ro" in envoy["volumes"]
        assert set(envoy["depends_on"]) == {n for n in compose()["services"] if n.startswith("sim")}
        # Published on the host's loopback only, the API port only.
        assert all(p.startswith("127.0.0.1:") and p.endswith(":10000") for p in envoy["ports"])
        host_ports += [p.split(":")[1] for p in envoy["ports"]]
    assert len(host_ports) == len(set(host_ports)), "each replica on its own host port"


def check_replicas_are_peers(doc, cfg):
    """Every gateway replica is a member of the rendered kvroute_peers cluster
    (and nothing else is), on the peer listener's port, which no replica
    publishes."""
    problems = []
    peer = next((lis for lis in cfg["static_resources"]["listeners"] if lis["name"] == "kvroute_peer"), None)
    if peer is None:
        return ["envoy.yaml: no kvroute_peer listener"]
    port = peer["address"]["socket_address"]["port_value"]
    cluster = next(c for c in cfg["static_resources"]["clusters"] if c["name"] == "kvroute_peers")
    members = sorted(f"{e['endpoint']['address']['socket_address']['address']}:"
                     f"{e['endpoint']['address']['socket_address']['port_value']}"
                     for e in cluster["load_assignment"]["endpoints"][0]["lb_endpoints"])
    want = sorted(f"{s['networks']['pool']['ipv4_address']}:{port}" for s in _envoys(doc).values())
    if members != want:
        problems.append(f"kvroute_peers members {members}, want the replicas {want}")
    for name, s in _envoys(doc).items():
        if any(p.split(":")[-1] == str(port) for p in s.get("ports", [])):
            problems.append(f"{name}: publishes the peer port {port}")
    return problems


def test_the_replicas_are_each_others_peers():
    cfg = yaml.safe_load((COMPOSE / "envoy.yaml").read_text())
    assert check_replicas_are_peers(compose(), cfg) == []


def test_negative_replica_missing_from_peers_or_peer_port_published_reported():
    cfg = yaml.safe_load((COMPOSE / "envoy.yaml").read_text())
    doc = compose()
    doc["services"]["envoy3"] = copy.deepcopy(doc["services"]["envoy2"])
    doc["services"]["envoy3"]["networks"]["pool"]["ipv4_address"] = "172.28.0.4"
    assert any("members" in p for p in check_replicas_are_peers(doc, cfg))
    doc = compose()
    doc["services"]["envoy2"]["ports"].append("127.0.0.1:10100:10100")
    assert any("publishes" in p for p in check_replicas_are_peers(doc, cfg))


def _essentials(cfg):
    """What the compose demo depends on in its Envoy config."""
    listener = cfg["static_resources"]["listeners"][0]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    kv = next(f for f in hcm["http_filters"] if f["name"] == "kvroute")["typed_config"]["config"]
    clusters = {c["name"]: c for c in cfg["static_resources"]["clusters"]}
    up = clusters["kvroute_upstream"]
    peer = next((lis for lis in cfg["static_resources"]["listeners"] if lis["name"] == "kvroute_peer"), None)
    return {
        "peer_listen": peer and peer["address"],
        "peers": clusters.get("kvroute_peers", {}).get("load_assignment"),
        "listen": listener["address"],
        "admin": cfg["admin"]["address"],
        "buffer": listener["per_connection_buffer_limit_bytes"],
        "plugin": json.loads(kv["configuration"]["value"]),
        "wasm": kv["vm_config"]["code"],
        "switch": kv["allow_on_headers_stop_iteration"],
        "filters": [f["name"] for f in hcm["http_filters"]],
        "clusters": sorted(clusters),
        "members": up.get("load_assignment"),
        "lb": up.get("load_balancing_policy"),
    }


def test_committed_envoy_config_matches_a_fresh_render():
    """deploy/compose/envoy.yaml is envoy/render.py's output, not a fork of it.

    What the demo depends on (addresses, plugin config, wasm path, filters,
    clusters, policy) must equal a fresh render; cosmetic template changes
    only warn, so a template edit elsewhere does not break this test."""
    import sys
    import warnings
    sys.path.insert(0, str(COMPOSE))
    try:
        import render_envoy
    finally:
        sys.path.pop(0)
    fresh = render_envoy.render()
    committed = (COMPOSE / "envoy.yaml").read_text()
    assert _essentials(yaml.safe_load(committed)) == _essentials(yaml.safe_load(fresh)), (
        "deploy/compose/envoy.yaml is stale: run python3 deploy/compose/render_envoy.py")
    if committed != fresh:
        warnings.warn("deploy/compose/envoy.yaml differs textually from a fresh render "
                      "(templates changed): refresh with python3 deploy/compose/render_envoy.py")


def test_rendered_config_routes_to_exactly_the_sims():
    cfg = yaml.safe_load((COMPOSE / "envoy.yaml").read_text())
    cluster = next(c for c in cfg["static_resources"]["clusters"] if c["name"] == "kvroute_upstream")
    members = sorted(f"{e['endpoint']['address']['socket_address']['address']}:"
                     f"{e['endpoint']['address']['socket_address']['port_value']}"
                     for e in cluster["load_assignment"]["endpoints"][0]["lb_endpoints"])
    assert members == sorted(json.loads((COMPOSE / "kvroute.json").read_text())["endpoints"])
