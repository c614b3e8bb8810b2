"""Istio resources in deploy/istio validate against Istio's CRD schemas, and
the pieces agree with each other and with kvroute's config.

Validator: cloudcoil.models.istio (PyPI) holds models generated from Istio
1.24.2's CRD OpenAPI schemas (types, enums, string/array limits, one-of
variants). Their JSON schema is made strict here (unknown fields rejected, as
the API server's structural-schema pruning would silently drop them) and
checked with jsonschema; apiVersion and kind must be the CRD's.
"""

import copy
import json

import jsonschema
import pytest
from cloudcoil.models.istio.extensions import v1alpha1 as ext_v1alpha1
from cloudcoil.models.istio.networking import v1 as net_v1
from cloudcoil.models.istio.networking import v1alpha3 as net_v1alpha3

from conftest import find, istio_docs, patch_value

MODELS = {
    ("extensions.istio.io/v1alpha1", "WasmPlugin"): ext_v1alpha1.WasmPlugin,
    ("networking.istio.io/v1alpha3", "EnvoyFilter"): net_v1alpha3.EnvoyFilter,
    ("networking.istio.io/v1", "Gateway"): net_v1.Gateway,
    ("networking.istio.io/v1", "VirtualService"): net_v1.VirtualService,
    ("networking.istio.io/v1", "DestinationRule"): net_v1.DestinationRule,
}
ISTIO_OBJECTS = [(f, d) for f, d in istio_docs() if d["apiVersion"].split("/")[0].endswith("istio.io")]
_CACHE = {}


def _strict(node):
    """Close every object schema that lists properties (free-form maps such
    as pluginConfig or a patch `value` stay open, as in the CRDs)."""
    if isinstance(node, dict):
        if node.get("type") == "object" and "properties" in node and "additionalProperties" not in node:
            node["additionalProperties"] = False
        for v in node.values():
            _strict(v)
    elif isinstance(node, list):
        for v in node:
            _strict(v)
    return node


def schema_for(api_version, kind):
    key = (api_version, kind)
    if key not in MODELS:
        raise AssertionError(f"no Istio schema for {api_version} {kind}")
    if key not in _CACHE:
        s = _strict(MODELS[key].model_json_schema(by_alias=True, mode="validation"))
        s["properties"]["apiVersion"] = {"const": api_version}
        s["properties"]["kind"] = {"const": kind}
        s["required"] = sorted(set(s.get("required", [])) | {"apiVersion", "kind", "metadata", "spec"})
        jsonschema.Draft202012Validator.check_schema(s)
        _CACHE[key] = jsonschema.Draft202012Validator(s)
    return _CACHE[key]


def validate(obj):
    v = schema_for(obj["apiVersion"], obj["kind"])
    errors = sorted(v.iter_errors(obj), key=lambda e: list(e.path))
    if errors:
        raise jsonschema.ValidationError(
            "; ".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors[:5]))


@pytest.mark.parametrize("obj", [d for _, d in ISTIO_OBJECTS],
                         ids=[f"{f}:{d['kind']}/{d['metadata']['name']}" for f, d in ISTIO_OBJECTS])
def test_istio_object_validates(obj):
    validate(obj)


def test_all_istio_kinds_present():
    kinds = {d["kind"] for _, d in ISTIO_OBJECTS}
    assert kinds == {"WasmPlugin", "EnvoyFilter", "Gateway", "VirtualService", "DestinationRule"}


# --- each validator can fail -------------------------------------------------

def test_negative_unknown_field_rejected():
    bad = copy.deepcopy(find("WasmPlugin", "kvroute"))
    bad["spec"]["allowOnHeadersStopIteration"] = True  # the field WasmPlugin lacks
    with pytest.raises(jsonschema.ValidationError):
        validate(bad)


def test_negative_bad_enum_rejected():
    bad = copy.deepcopy(find("EnvoyFilter", "kvroute"))
    bad["spec"]["configPatches"][0]["patch"]["operation"] = "APPEND"
    with pytest.raises(jsonschema.ValidationError):
        validate(bad)


def test_negative_wrong_type_rejected():
    bad = copy.deepcopy(find("VirtualService", "kvroute"))
    bad["spec"]["http"][0]["retries"]["attempts"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        validate(bad)


def test_negative_wrong_api_version_rejected():
    bad = copy.deepcopy(find("Gateway", "kvroute-gateway"))
    bad["apiVersion"] = "networking.istio.io/v2"
    with pytest.raises(AssertionError):
        validate(bad)


# --- the pieces fit together -------------------------------------------------

def _patches(name="kvroute"):
    return find("EnvoyFilter", name)["spec"]["configPatches"]


def _wasm_config():
    return patch_value("kvroute", "EXTENSION_CONFIG", name="kvroute")


def _plugin_json():
    return json.loads(_wasm_config()["typed_config"]["config"]["configuration"]["value"])


def test_envoyfilter_sets_the_body_reading_switch():
    cfg = _wasm_config()["typed_config"]["config"]
    assert cfg["allow_on_headers_stop_iteration"] is True
    assert cfg["root_id"] == "kvroute"
    assert cfg["vm_config"]["code"]["remote"]["http_uri"]["uri"].startswith("oci://")


def test_http_filter_refers_to_the_extension_config():
    ins = next(p for p in _patches() if p["applyTo"] == "HTTP_FILTER")
    assert ins["patch"]["operation"] == "INSERT_BEFORE"
    assert ins["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"] == "envoy.filters.http.router"
    cd = ins["patch"]["value"]["config_discovery"]
    assert ins["patch"]["value"]["name"] == _wasm_config()["name"]
    assert cd["type_urls"] == [_wasm_config()["typed_config"]["@type"]]


def test_cluster_patch_reads_the_header_kvroute_writes():
    plugin = _plugin_json()
    merge = next(p for p in _patches() if p["applyTo"] == "CLUSTER" and p["patch"]["operation"] == "MERGE")
    c = merge["match"]["cluster"]
    assert plugin["upstream_cluster"] == f"outbound|{c['portNumber']}||{c['service']}"
    policy = merge["patch"]["value"]["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    assert policy["name"] == "envoy.load_balancing_policies.override_host"
    assert policy["typed_config"]["override_host_sources"] == [{"header": plugin["destination_header"]}]
    assert plugin["handoff"] == "override_host"


def test_bridge_writes_the_metadata_key_inferencepool_clusters_read():
    rule = _patches("kvroute-inferencepool-bridge")[0]["patch"]["value"]["typed_config"]["request_rules"][0]
    assert rule["header"] == _plugin_json()["destination_header"]
    assert rule["on_header_present"]["metadata_namespace"] == "envoy.lb"
    assert rule["on_header_present"]["key"] == "x-gateway-destination-endpoint"
    assert find("EnvoyFilter", "kvroute-inferencepool-bridge")["spec"]["priority"] > 0


def test_admin_cluster_for_discovery_exists():
    add = patch_value("kvroute", "CLUSTER", "ADD", name=_plugin_json()["discovery"]["admin_cluster"])
    sa = add["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    assert sa["address"] == "127.0.0.1"  # admin API stays on loopback


def test_buffers_hold_max_body_bytes_and_streams_have_no_deadline():
    max_body = _plugin_json()["max_body_bytes"]
    listener = patch_value("kvroute", "LISTENER", "MERGE")
    route = next(p for p in _patches() if p["applyTo"] == "HTTP_ROUTE")
    assert listener["per_connection_buffer_limit_bytes"] >= 2 * max_body
    assert route["patch"]["value"]["request_body_buffer_limit"] >= 2 * max_body
    assert route["patch"]["value"]["route"]["idle_timeout"]
    vs = find("VirtualService", "kvroute")
    patched = {p["match"]["routeConfiguration"]["vhost"]["route"]["name"]
               for p in _patches() if p["applyTo"] == "HTTP_ROUTE"}
    merge = next(p for p in _patches() if p["applyTo"] == "CLUSTER" and p["patch"]["operation"] == "MERGE")
    for http in vs["spec"]["http"]:
        assert http["name"] in patched, http["name"]
        assert http["timeout"] == "0s"
        retry_on = http["retries"]["retryOn"].split(",")
        assert "connect-failure" in retry_on
        # The refusals kvroute's failover.retry_statuses lists by default
        # (Istio turns status codes in retryOn into retriable_status_codes).
        assert {"429", "503"} <= set(retry_on)
        # kvroute's stream marker never leaves the gateway.
        assert "x-kvroute-stream" in http["headers"]["request"]["remove"]
        dest = http["route"][0]["destination"]
        assert (dest["host"], dest["port"]["number"]) == (merge["match"]["cluster"]["service"],
                                                          merge["match"]["cluster"]["portNumber"])
    # Only streaming requests (marked by kvroute) get a first-byte bound: a
    # non-streaming answer's headers come with its last token.
    stream, other = vs["spec"]["http"]
    assert stream["match"][0]["headers"] == {"x-kvroute-stream": {"exact": "1"}}
    assert "perTryTimeout" in stream["retries"]
    assert "perTryTimeout" not in other["retries"]


def test_destination_rule_keeps_locality_lb_off():
    dr = find("DestinationRule", "kvroute-sim")
    assert dr["spec"]["trafficPolicy"]["loadBalancer"]["localityLbSetting"]["enabled"] is False


def test_wasmplugin_matches_envoyfilter():
    wp = find("WasmPlugin", "kvroute")["spec"]
    assert wp["pluginConfig"] == _plugin_json()
    assert wp["pluginName"] == _wasm_config()["typed_config"]["config"]["root_id"]
    assert wp["url"] == _wasm_config()["typed_config"]["config"]["vm_config"]["code"]["remote"]["http_uri"]["uri"]
