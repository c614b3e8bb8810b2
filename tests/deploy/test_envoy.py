"""The Envoy configurations that ship are accepted by the real Envoy.

Validator: Envoy 1.40's own `envoy --mode validate` (the binary from
`./build.sh setup`, or env KVROUTE_ENVOY). Validate mode parses the whole
bootstrap against Envoy's protos (unknown fields, types, required fields,
extension names), builds every filter and cluster, and loads the wasm module
and runs its on_configure: with the real kvroute.wasm that means kvroute's own
config parser accepts the plugin JSON. It opens no connections.

Checked here:
  * deploy/compose/envoy.yaml (addresses mapped to loopback for the run);
  * the Istio EnvoyFilter pieces, placed where Istio puts them in a gateway's
    config: the ECDS wasm filter config inline in the chain (code from a local
    file, as istio-agent hands it to Envoy), the header_to_metadata bridge,
    the LISTENER / HTTP_ROUTE / CLUSTER / NETWORK_FILTER MERGE values merged
    into an Istio-shaped listener, route, connection manager and EDS-like
    cluster, and the ADDed cluster;
    and the HTTP_FILTER insert itself (config_discovery over ADS);
  * every shipped plugin JSON through the real filter (when it is built).
Not checked: Istio's own translation (no istiod here).
"""

import copy
import json

import pytest
import yaml

from conftest import COMPOSE, ROOT, deep_merge, envoy_validate, find, patch_value, plugin_configs

ROUTER = {"name": "envoy.filters.http.router",
          "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}


def assert_valid(result):
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout + result.stderr


def assert_invalid(result):
    assert result.returncode != 0, "Envoy accepted a broken config:\n" + result.stdout


# --- compose ----------------------------------------------------------------

def compose_bootstrap(wasm):
    text = (COMPOSE / "envoy.yaml").read_text()
    # Validate mode connects nowhere; the demo's private addresses are still
    # swapped for loopback so nothing run here even names another network.
    text = text.replace("172.28.0.", "127.0.0.")
    text = text.replace('"/etc/envoy/kvroute.wasm"', json.dumps(str(wasm)))
    return text


def test_compose_envoy_config_validates(envoy, wasm_module, tmp_path):
    assert_valid(envoy_validate(envoy, compose_bootstrap(wasm_module[0]), tmp_path))


def test_negative_compose_config_with_typo_rejected(envoy, wasm_module, tmp_path):
    bad = compose_bootstrap(wasm_module[0]).replace("per_connection_buffer_limit_bytes:",
                                                    "per_connection_buffer_limit_byte:", 1)
    assert_invalid(envoy_validate(envoy, bad, tmp_path))


# --- Istio pieces -----------------------------------------------------------

def _patches(name):
    return find("EnvoyFilter", name)["spec"]["configPatches"]


def _one(envoyfilter, apply_to, op=None, name=None):
    return patch_value(envoyfilter, apply_to, op, name)


def wasm_filter(wasm, plugin_json=None, name="kvroute"):
    """The EXTENSION_CONFIG value `name` as an inline HTTP filter, code from a
    file (what istio-agent hands Envoy after fetching the oci:// image)."""
    ext = copy.deepcopy(_one("kvroute", "EXTENSION_CONFIG", name=name))
    cfg = ext["typed_config"]["config"]
    cfg["vm_config"]["code"] = {"local": {"filename": str(wasm)}}
    if plugin_json is not None:
        cfg["configuration"]["value"] = plugin_json
    return {"name": ext["name"], "typed_config": ext["typed_config"]}


def _route_patch(name):
    """The EnvoyFilter HTTP_ROUTE patch for the gateway route `name`."""
    return next(p["patch"]["value"] for p in _patches("kvroute")
                if p["applyTo"] == "HTTP_ROUTE"
                and p["match"]["routeConfiguration"]["vhost"]["route"]["name"] == name)


def _istio_route(http):
    """What Istio generates from one VirtualService http route (match,
    timeout, retries with its default previous_hosts predicate, request
    headers to remove), with the EnvoyFilter's patch of that route."""
    dest = http["route"][0]["destination"]
    match = {"prefix": http["match"][0]["uri"]["prefix"]}
    headers = http["match"][0].get("headers", {})
    if headers:
        match["headers"] = [{"name": k, "string_match": v} for k, v in headers.items()]
    retries = http["retries"]
    # Istio's retry.ConvertPolicy: parts of retryOn that are HTTP status
    # codes become retriable_status_codes, and retriable-status-codes joins
    # retry_on.
    parts = [p.strip() for p in retries["retryOn"].split(",") if p.strip()]
    codes = [int(p) for p in parts if p.isdigit()]
    retry_on = [p for p in parts if not p.isdigit()]
    if codes and "retriable-status-codes" not in retry_on:
        retry_on.append("retriable-status-codes")
    retry = {
        "retry_on": ",".join(retry_on),
        "num_retries": retries["attempts"],
        "retry_host_predicate": [{
            "name": "envoy.retry_host_predicates.previous_hosts",
            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"}}],
        "host_selection_retry_max_attempts": 5,
    }
    if codes:
        retry["retriable_status_codes"] = codes
    if "perTryTimeout" in retries:
        retry["per_try_timeout"] = retries["perTryTimeout"]
    route = {
        "name": http["name"],
        "match": match,
        "route": {
            "cluster": f"outbound|{dest['port']['number']}||{dest['host']}",
            "timeout": http["timeout"],
            "retry_policy": retry,
        },
        "request_headers_to_remove": http.get("headers", {}).get("request", {}).get("remove", []),
    }
    return deep_merge(route, _route_patch(http["name"]))


def istio_gateway_bootstrap(wasm, bridge=True, plugin_json=None):
    vs = find("VirtualService", "kvroute")["spec"]["http"]
    routes = [_istio_route(http) for http in vs]
    cluster_name = routes[0]["route"]["cluster"]
    assert all(r["route"]["cluster"] == cluster_name for r in routes)
    filters = [wasm_filter(wasm, plugin_json)]
    if bridge:
        filters.append(_one("kvroute-inferencepool-bridge", "HTTP_FILTER"))
    filters.append(ROUTER)
    listener = {
        "name": "0.0.0.0_8080",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": 18080}},
        "per_connection_buffer_limit_bytes": 32768,  # Istio EDGE profile default
        "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                "stat_prefix": "outbound_0.0.0.0_8080",
                "route_config": {"name": "http.8080", "virtual_hosts": [
                    {"name": "*:80", "domains": ["*"], "routes": routes}]},
                "http_filters": filters,
            }}]}],
    }
    listener = deep_merge(listener, _one("kvroute", "LISTENER", "MERGE"))
    hcm = listener["filter_chains"][0]["filters"][0]
    listener["filter_chains"][0]["filters"][0] = deep_merge(hcm, _one("kvroute", "NETWORK_FILTER"))
    # Istio's EDS cluster for the Service, with the DestinationRule's policy;
    # members listed statically here (EDS needs a control plane).
    pool = {
        "name": cluster_name,
        "type": "STATIC",
        "connect_timeout": "10s",
        "lb_policy": "LEAST_REQUEST",
        "load_assignment": {"cluster_name": cluster_name, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": f"127.0.0.{i}", "port_value": 8000}}}}
            for i in (11, 12, 13)]}]},
        "outlier_detection": {"consecutive_5xx": 5, "consecutive_gateway_failure": 2,
                              "interval": "5s", "base_ejection_time": "30s", "max_ejection_percent": 50},
    }
    pool = deep_merge(pool, _one("kvroute", "CLUSTER", "MERGE"))
    listeners = [listener]
    clusters = [pool, _one("kvroute", "CLUSTER", "ADD", name="kvroute_admin")]
    # The peer sync (pieces 8-10), as Istio appends them: the ADDed listener
    # untouched by the MERGE patches, its ECDS filter inline here. Left out
    # for a plugin config without `peers` (the compose demo's), as
    # `./build.sh serve` does without --peer-listen: the kvroute_peer root
    # refuses to start without that section.
    if plugin_json is None or "peers" in json.loads(plugin_json):
        listeners.append(peer_listener(wasm, plugin_json))
        clusters.append(_one("kvroute", "CLUSTER", "ADD", name="kvroute_peers"))
    return {"static_resources": {"listeners": listeners, "clusters": clusters}}


def peer_listener(wasm, plugin_json=None):
    """The LISTENER ADD `kvroute_peer` with its ECDS filter (piece 8) inline;
    bound to loopback for the run (validate mode binds nothing anyway)."""
    lis = copy.deepcopy(_one("kvroute", "LISTENER", "ADD", name="kvroute_peer"))
    lis["address"]["socket_address"]["address"] = "127.0.0.1"
    hcm = lis["filter_chains"][0]["filters"][0]["typed_config"]
    assert hcm["http_filters"][0]["name"] == "kvroute_peer"
    hcm["http_filters"][0] = wasm_filter(wasm, plugin_json, name="kvroute_peer")
    return lis


def test_istio_envoyfilter_pieces_validate(envoy, wasm_module, tmp_path):
    assert_valid(envoy_validate(envoy, istio_gateway_bootstrap(wasm_module[0]), tmp_path))


def test_istio_pieces_without_the_bridge_validate(envoy, wasm_module, tmp_path):
    assert_valid(envoy_validate(envoy, istio_gateway_bootstrap(wasm_module[0], bridge=False), tmp_path))


def test_negative_istio_pieces_with_bad_policy_rejected(envoy, wasm_module, tmp_path):
    cfg = istio_gateway_bootstrap(wasm_module[0])
    pool = cfg["static_resources"]["clusters"][0]
    policy = pool["load_balancing_policy"]["policies"][0]["typed_extension_config"]["typed_config"]
    policy["override_host_sources"] = [{"header_name": "x-kvroute-destination"}]
    assert_invalid(envoy_validate(envoy, cfg, tmp_path))


def test_istio_local_reply_mappers_match_the_template():
    """Istio's gateway maps Envoy's errors exactly as ./build.sh serve does."""
    tmpl = yaml.safe_load((ROOT / "envoy" / "local_reply.yaml.tmpl").read_text())
    hcm = _one("kvroute", "NETWORK_FILTER")["typed_config"]
    assert hcm["local_reply_config"] == tmpl["local_reply_config"]
    codes = [m["body_format_override"]["json_format"]["error"]["code"]
             for m in tmpl["local_reply_config"]["mappers"]]
    assert codes[:3] == ["request_too_large", "upstream_unavailable", "upstream_timeout"]


def test_negative_istio_local_reply_with_bad_filter_rejected(envoy, wasm_module, tmp_path):
    cfg = istio_gateway_bootstrap(wasm_module[0])
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["local_reply_config"]["mappers"][0]["filter"] = {"status_code_filter": {"comparison": {"op": "NE"}}}
    assert_invalid(envoy_validate(envoy, cfg, tmp_path))


def ecds_bootstrap(wasm, tmp_path):
    """The gateway with the HTTP_FILTER patch value itself (config_discovery
    over ADS), as Istio's bootstrap has it: an ADS source on an `xds-grpc`
    cluster (a unix socket; validate mode never connects)."""
    cfg = istio_gateway_bootstrap(wasm)
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"][0] = copy.deepcopy(_one("kvroute", "HTTP_FILTER"))
    # The peer listener exactly as patch 9 adds it (its filter over ECDS too).
    peer = copy.deepcopy(_one("kvroute", "LISTENER", "ADD", name="kvroute_peer"))
    peer["address"]["socket_address"]["address"] = "127.0.0.1"
    cfg["static_resources"]["listeners"][1] = peer
    cfg["node"] = {"id": "router~127.0.0.1~gateway.istio-system~istio-system.svc.cluster.local",
                   "cluster": "istio-ingressgateway.istio-system"}
    cfg["dynamic_resources"] = {"ads_config": {
        "api_type": "GRPC", "transport_api_version": "V3",
        "grpc_services": [{"envoy_grpc": {"cluster_name": "xds-grpc"}}]}}
    cfg["static_resources"]["clusters"].append({
        "name": "xds-grpc", "type": "STATIC", "connect_timeout": "1s",
        "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}}}},
        "load_assignment": {"cluster_name": "xds-grpc", "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"pipe": {"path": str(tmp_path / "XDS")}}}}]}]},
    })
    return cfg


def test_istio_http_filter_insert_via_ecds_validates(envoy, wasm_module, tmp_path):
    assert_valid(envoy_validate(envoy, ecds_bootstrap(wasm_module[0], tmp_path), tmp_path))


def test_negative_ecds_insert_with_wrong_type_url_rejected(envoy, wasm_module, tmp_path):
    cfg = ecds_bootstrap(wasm_module[0], tmp_path)
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"][0]["config_discovery"]["type_urls"] = [
        "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.WasmFilter"]
    assert_invalid(envoy_validate(envoy, cfg, tmp_path))


def _peer_hcm(cfg):
    lis = next(x for x in cfg["static_resources"]["listeners"] if x["name"] == "kvroute_peer")
    return lis["filter_chains"][0]["filters"][0]["typed_config"]


def test_negative_peer_listener_with_bad_direct_response_rejected(envoy, wasm_module, tmp_path):
    cfg = istio_gateway_bootstrap(wasm_module[0])
    route = _peer_hcm(cfg)["route_config"]["virtual_hosts"][0]["routes"][0]
    route["direct_response"]["status"] = 99  # not an HTTP status
    assert_invalid(envoy_validate(envoy, cfg, tmp_path))


def test_negative_peer_listener_filter_over_ecds_with_wrong_type_url_rejected(envoy, wasm_module, tmp_path):
    cfg = ecds_bootstrap(wasm_module[0], tmp_path)
    _peer_hcm(cfg)["http_filters"][0]["config_discovery"]["type_urls"] = [
        "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.WasmFilter"]
    assert_invalid(envoy_validate(envoy, cfg, tmp_path))


def test_negative_peers_cluster_with_bad_dns_family_rejected(envoy, wasm_module, tmp_path):
    cfg = istio_gateway_bootstrap(wasm_module[0])
    peers = next(c for c in cfg["static_resources"]["clusters"] if c["name"] == "kvroute_peers")
    peers["dns_lookup_family"] = "V4_PREFERED"
    assert_invalid(envoy_validate(envoy, cfg, tmp_path))


def test_negative_two_listeners_on_one_port_rejected(envoy, wasm_module, tmp_path):
    """Validate mode does check listener addresses: the peer listener on the
    public listener's port is refused (so the two really are distinct)."""
    cfg = istio_gateway_bootstrap(wasm_module[0])
    lis = cfg["static_resources"]["listeners"]
    lis[1]["address"] = copy.deepcopy(lis[0]["address"])
    assert_invalid(envoy_validate(envoy, cfg, tmp_path))


# --- the optional peer mTLS from docs/DEPLOY.md ------------------------------

def docs_snippet(marker):
    """The YAML block right after `<!-- tests/deploy/test_envoy.py: marker -->`
    in docs/DEPLOY.md (what an operator copies)."""
    text = (ROOT / "docs" / "DEPLOY.md").read_text()
    tag = f"<!-- tests/deploy/test_envoy.py: {marker} -->"
    assert text.count(tag) == 1, f"docs/DEPLOY.md: marker {marker} missing"
    after = text.split(tag, 1)[1].lstrip()
    assert after.startswith("```yaml\n"), f"docs/DEPLOY.md: no yaml block after {marker}"
    return yaml.safe_load(after[len("```yaml\n"):].split("```", 1)[0])


def mtls_bootstrap(wasm, tmp_path):
    """The gateway with the peer listener and cluster as docs/DEPLOY.md says
    to change them for mTLS, and Istio's bootstrap `sds-grpc` cluster (istio-
    agent's SDS socket; validate mode never connects)."""
    cfg = istio_gateway_bootstrap(wasm)
    lis = next(x for x in cfg["static_resources"]["listeners"] if x["name"] == "kvroute_peer")
    lis["filter_chains"][0].update(docs_snippet("peer-mtls-listener"))
    peers = next(c for c in cfg["static_resources"]["clusters"] if c["name"] == "kvroute_peers")
    peers.update(docs_snippet("peer-mtls-cluster"))
    # SDS needs a node identity, which Istio's bootstrap always has.
    cfg["node"] = {"id": "router~127.0.0.1~gateway.istio-system~istio-system.svc.cluster.local",
                   "cluster": "kvroute-gateway.istio-system"}
    cfg["static_resources"]["clusters"].append({
        "name": "sds-grpc", "type": "STATIC", "connect_timeout": "1s",
        "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}}}},
        "load_assignment": {"cluster_name": "sds-grpc", "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"pipe": {"path": str(tmp_path / "sds-socket")}}}}]}]},
    })
    return cfg


def test_docs_peer_mtls_snippets_validate(envoy, wasm_module, tmp_path):
    cfg = mtls_bootstrap(wasm_module[0], tmp_path)
    lis = next(x for x in cfg["static_resources"]["listeners"] if x["name"] == "kvroute_peer")
    ctx = lis["filter_chains"][0]["transport_socket"]["typed_config"]
    assert ctx["require_client_certificate"] is True
    sans = {json.dumps(c["transport_socket"]["typed_config"]["common_tls_context"]["combined_validation_context"]
                       ["default_validation_context"]["match_typed_subject_alt_names"])
            for c in (lis["filter_chains"][0], next(c for c in cfg["static_resources"]["clusters"]
                                                   if c["name"] == "kvroute_peers"))}
    assert len(sans) == 1, "listener and cluster must accept the same identity"
    sa = find("Deployment", "kvroute-gateway")["spec"]["template"]["spec"]["serviceAccountName"]
    ns = find("Deployment", "kvroute-gateway")["metadata"]["namespace"]
    assert f"/ns/{ns}/sa/{sa}" in sans.pop()
    assert_valid(envoy_validate(envoy, cfg, tmp_path))


def test_negative_docs_peer_mtls_with_bad_san_type_rejected(envoy, wasm_module, tmp_path):
    cfg = mtls_bootstrap(wasm_module[0], tmp_path)
    peers = next(c for c in cfg["static_resources"]["clusters"] if c["name"] == "kvroute_peers")
    ctx = peers["transport_socket"]["typed_config"]["common_tls_context"]
    ctx["combined_validation_context"]["default_validation_context"]["match_typed_subject_alt_names"][0][
        "san_type"] = "SPIFFE"
    assert_invalid(envoy_validate(envoy, cfg, tmp_path))


# --- plugin JSON through the real filter -------------------------------------

@pytest.mark.parametrize("where,cfg", plugin_configs(), ids=[w for w, _ in plugin_configs()])
def test_real_filter_accepts_shipped_plugin_config(envoy, wasm_module, tmp_path, where, cfg):
    wasm, real = wasm_module
    if not real:
        pytest.skip("kvroute.wasm not built (./build.sh build): keys checked in test_plugin_config.py only")
    cfg = json.loads(json.dumps(cfg).replace("172.28.0.", "127.0.0."))
    assert_valid(envoy_validate(envoy, istio_gateway_bootstrap(wasm, plugin_json=json.dumps(cfg)), tmp_path))


def test_negative_real_filter_rejects_bad_plugin_config(envoy, wasm_module, tmp_path):
    wasm, real = wasm_module
    if not real:
        pytest.skip("kvroute.wasm not built (./build.sh build)")
    _, cfg = plugin_configs()[0]
    bad = dict(cfg, max_body_bytes=1)  # below the parser's minimum
    assert_invalid(envoy_validate(envoy, istio_gateway_bootstrap(wasm, plugin_json=json.dumps(bad)), tmp_path))
    bad = dict(cfg, handof="override_host")  # unknown field
    assert_invalid(envoy_validate(envoy, istio_gateway_bootstrap(wasm, plugin_json=json.dumps(bad)), tmp_path))


def test_negative_real_peer_root_without_peers_rejected(envoy, wasm_module, tmp_path):
    """The peer listener's filter really starts kvroute's `kvroute_peer` root
    (which needs the `peers` section), not a second routing filter."""
    wasm, real = wasm_module
    if not real:
        pytest.skip("kvroute.wasm not built (./build.sh build)")
    cfg = istio_gateway_bootstrap(wasm)
    peer = _peer_hcm(cfg)["http_filters"][0]["typed_config"]["config"]["configuration"]
    plugin = json.loads(peer["value"])
    del plugin["peers"]
    peer["value"] = json.dumps(plugin)
    assert_invalid(envoy_validate(envoy, cfg, tmp_path))
