"""The several-replica (active-active) gateway in deploy/istio fits together.

kvroute's peer sync on Kubernetes needs pieces from four files to agree:
  * gateway-deployment.yaml: the gateway pods (>= 2 replicas), which expose
    the peer port, and the public Service, which must not;
  * peers.yaml: the headless Service `kvroute-peers` over exactly the pods
    that run kvroute;
  * peers-networkpolicy.yaml: admits the peer port only from those pods
    while leaving every other port as it was;
  * envoyfilter-kvroute.yaml: the plugin's `peers` section, the peer
    listener (root_id `kvroute_peer`, same VM and plugin JSON as the routing
    filter, nothing proxied), and the `kvroute_peers` cluster resolving the
    headless Service with override_host like the pool's cluster;
  * wasmplugin.yaml: the same `peers` section.
Schemas are checked in test_kubernetes.py / test_istio.py and the Envoy
pieces by the real Envoy in test_envoy.py; this file checks that the names,
labels and ports agree, and each check has a negative test (a broken copy
must be reported). Not checked here: Istio's translation, DNS and the CNI
(they need a cluster; docs/DEPLOY.md says what to look at there).
"""

import copy
import json

import pytest

from conftest import istio_docs

PEER_PORT = 15100
# Ports of Istio's own on a gateway pod (admin, agent, health, telemetry, ...):
# the peer listener must not take one.
ISTIO_PORTS = {15000, 15001, 15004, 15006, 15008, 15009, 15010, 15011, 15012,
               15014, 15017, 15020, 15021, 15053, 15090}


DOCS = [d for _, d in istio_docs()]


def _find(kind, name):
    return next(d for d in DOCS if d["kind"] == kind and d["metadata"]["name"] == name)


def world():
    """Fresh copies of every object the checks read."""
    return copy.deepcopy({
        "deployment": _find("Deployment", "kvroute-gateway"),
        "public": _find("Service", "kvroute-gateway"),
        "peers": _find("Service", "kvroute-peers"),
        "netpol": _find("NetworkPolicy", "kvroute-peers"),
        "envoyfilter": _find("EnvoyFilter", "kvroute"),
        "wasmplugin": _find("WasmPlugin", "kvroute"),
        "gateway": _find("Gateway", "kvroute-gateway"),
        "services": [d for d in DOCS if d["kind"] == "Service"],
    })


def _patch(w, apply_to, op, name):
    found = [p["patch"]["value"] for p in w["envoyfilter"]["spec"]["configPatches"]
             if p["applyTo"] == apply_to and p["patch"]["operation"] == op
             and p["patch"]["value"].get("name") == name]
    return found[0] if len(found) == 1 else None


def _wasm(w, name):
    ext = _patch(w, "EXTENSION_CONFIG", "ADD", name)
    return ext["typed_config"]["config"] if ext else None


def _plugin(w, name="kvroute"):
    return json.loads(_wasm(w, name)["configuration"]["value"])


def _selects(selector, labels):
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _container_ports(dep):
    return {p["name"]: p["containerPort"]
            for c in dep["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}


def _target(port, dep):
    """The container port a Service port reaches (number or named port)."""
    t = port.get("targetPort", port["port"])
    return _container_ports(dep).get(t) if isinstance(t, str) else t


# --- the checks ---------------------------------------------------------------

def check_replicas(w):
    n = w["deployment"]["spec"].get("replicas", 1)
    return [] if isinstance(n, int) and n >= 2 else [f"gateway Deployment: replicas {n}, want >= 2"]


def check_selectors(w):
    """The pods that run kvroute, serve the Gateway and are peers are the same."""
    problems = []
    labels = w["deployment"]["spec"]["template"]["metadata"]["labels"]
    ef_sel = w["envoyfilter"]["spec"]["workloadSelector"]["labels"]
    peer_sel = w["peers"]["spec"]["selector"]
    if not _selects(w["deployment"]["spec"]["selector"]["matchLabels"], labels):
        problems.append("gateway Deployment: selector does not match its own pods")
    if not _selects(ef_sel, labels):
        problems.append("EnvoyFilter workloadSelector: does not select the gateway pods")
    if not _selects(w["gateway"]["spec"]["selector"], labels):
        problems.append("Gateway selector: does not select the gateway pods")
    # Every pod that runs kvroute (and only those) is a peer.
    if peer_sel != ef_sel:
        problems.append(f"kvroute-peers selector {peer_sel} != EnvoyFilter workloadSelector {ef_sel}")
    if not _selects(w["public"]["spec"]["selector"], labels):
        problems.append("public Service: does not select the gateway pods")
    if w["netpol"]["spec"]["podSelector"]["matchLabels"] != ef_sel:
        problems.append("NetworkPolicy: podSelector is not the kvroute gateway pods")
    if w["wasmplugin"]["spec"]["selector"]["matchLabels"] != ef_sel:
        problems.append("WasmPlugin: selects other pods than the EnvoyFilter")
    for key in ("peers", "netpol"):
        if w[key]["metadata"]["namespace"] != w["deployment"]["metadata"]["namespace"]:
            problems.append(f"{key}: not in the gateway's namespace (it selects pods of its own namespace)")
    return problems


def check_headless_service(w):
    problems = []
    spec = w["peers"]["spec"]
    if spec.get("clusterIP") != "None":
        problems.append("kvroute-peers: not headless (clusterIP: None)")
    if spec.get("publishNotReadyAddresses") is not True:
        problems.append("kvroute-peers: publishNotReadyAddresses must be true (starting peers)")
    ports = spec.get("ports", [])
    if [p["port"] for p in ports] != [PEER_PORT]:
        problems.append(f"kvroute-peers: ports {[p['port'] for p in ports]}, want [{PEER_PORT}]")
    elif _target(ports[0], w["deployment"]) != PEER_PORT:
        problems.append("kvroute-peers: targetPort does not reach the gateway's peer port")
    if PEER_PORT not in _container_ports(w["deployment"]).values():
        problems.append("gateway Deployment: the peer port is not a container port")
    return problems


def check_public_service(w):
    """No Service but the headless one reaches the peer port of the gateway pods."""
    problems = []
    labels = w["deployment"]["spec"]["template"]["metadata"]["labels"]
    for svc in w["services"]:
        if svc["metadata"]["name"] == w["peers"]["metadata"]["name"]:
            continue
        if svc["metadata"].get("namespace") != w["deployment"]["metadata"]["namespace"]:
            continue
        if not _selects(svc["spec"].get("selector", {}), labels):
            continue
        for p in svc["spec"]["ports"]:
            if p["port"] == PEER_PORT or _target(p, w["deployment"]) == PEER_PORT:
                problems.append(f"Service {svc['metadata']['name']}: exposes the peer port")
    for server in w["gateway"]["spec"]["servers"]:
        if server["port"]["number"] == PEER_PORT:
            problems.append("Gateway: a public server on the peer port")
    return problems


def check_plugin_peers(w):
    """`peers` names the clusters the EnvoyFilter adds, in every plugin config."""
    problems = []
    configs = {"EnvoyFilter kvroute": _plugin(w, "kvroute"),
               "WasmPlugin": w["wasmplugin"]["spec"]["pluginConfig"]}
    peer_wasm = _wasm(w, "kvroute_peer")
    if peer_wasm:
        configs["EnvoyFilter kvroute_peer"] = _plugin(w, "kvroute_peer")
    for where, cfg in configs.items():
        peers = cfg.get("peers")
        if not isinstance(peers, dict):
            problems.append(f"{where}: no peers section")
            continue
        if _patch(w, "CLUSTER", "ADD", peers.get("cluster", "kvroute_peers")) is None:
            problems.append(f"{where}: peers.cluster {peers.get('cluster')!r} is not a CLUSTER ADD")
        admin = _patch(w, "CLUSTER", "ADD", peers.get("admin_cluster", "kvroute_admin"))
        if admin is None:
            problems.append(f"{where}: peers.admin_cluster {peers.get('admin_cluster')!r} is not a CLUSTER ADD")
        elif admin["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"][
                "socket_address"]["address"] != "127.0.0.1":
            problems.append(f"{where}: peers.admin_cluster is not the loopback admin API")
        if peers.get("cluster") == cfg.get("upstream_cluster"):
            problems.append(f"{where}: peers.cluster is the model servers' cluster")
    return problems


def check_peer_filter(w):
    """Piece 8: the routing filter's config with root_id kvroute_peer."""
    main, peer = _wasm(w, "kvroute"), _wasm(w, "kvroute_peer")
    if peer is None:
        return ["EnvoyFilter: no EXTENSION_CONFIG kvroute_peer"]
    problems = []
    if peer.get("root_id") != "kvroute_peer":
        problems.append(f"kvroute_peer filter: root_id {peer.get('root_id')!r}, want 'kvroute_peer'")
    if peer.get("vm_config") != main["vm_config"]:
        problems.append("kvroute_peer filter: vm_config differs from the routing filter's "
                        "(another VM: the peer root would not see kvroute's decisions)")
    if peer["vm_config"].get("vm_id") != "kvroute":
        problems.append("kvroute_peer filter: vm_id is not kvroute")
    if _plugin(w, "kvroute_peer") != _plugin(w, "kvroute"):
        problems.append("kvroute_peer filter: plugin configuration differs from the routing filter's")
    if {k: v for k, v in peer.items() if k != "root_id"} != {k: v for k, v in main.items() if k != "root_id"}:
        problems.append("kvroute_peer filter: settings other than root_id differ from the routing filter's")
    return problems


def check_peer_listener(w):
    """Piece 9: 0.0.0.0:15100, the peer filter over ECDS, nothing proxied."""
    lis = _patch(w, "LISTENER", "ADD", "kvroute_peer")
    if lis is None:
        return ["EnvoyFilter: no LISTENER ADD kvroute_peer"]
    problems = []
    add = next(p for p in w["envoyfilter"]["spec"]["configPatches"]
               if p["applyTo"] == "LISTENER" and p["patch"]["operation"] == "ADD")
    if add.get("match", {}).get("context") != "GATEWAY":
        problems.append("peer listener: ADD not limited to context GATEWAY")
    sa = lis["address"]["socket_address"]
    if (sa["address"], sa["port_value"]) != ("0.0.0.0", PEER_PORT):
        problems.append(f"peer listener: on {sa['address']}:{sa['port_value']}, want 0.0.0.0:{PEER_PORT}")
    if sa["port_value"] in ISTIO_PORTS:
        problems.append("peer listener: on one of Istio's own ports")
    if [p["port"] for p in w["peers"]["spec"]["ports"]] != [sa["port_value"]]:
        problems.append("peer listener: port differs from the kvroute-peers Service")
    chains = lis["filter_chains"]
    filters = [f for c in chains for f in c["filters"]]
    if len(chains) != 1 or [f["name"] for f in filters] != ["envoy.filters.network.http_connection_manager"]:
        return problems + ["peer listener: want one chain with only the HTTP connection manager"]
    hcm = filters[0]["typed_config"]
    http = hcm["http_filters"]
    ext = _patch(w, "EXTENSION_CONFIG", "ADD", "kvroute_peer")
    first = http[0] if http else {}
    if first.get("name") != "kvroute_peer" or ext is None or \
            first.get("config_discovery", {}).get("type_urls") != [ext["typed_config"]["@type"]]:
        problems.append("peer listener: first HTTP filter is not kvroute_peer over ECDS")
    if http[-1]["name"] != "envoy.filters.http.router":
        problems.append("peer listener: the router is not the last HTTP filter")
    if any(f["name"] == "kvroute" for f in http):
        problems.append("peer listener: runs the routing filter")
    routes = [r for vh in hcm["route_config"]["virtual_hosts"] for r in vh["routes"]]
    if [(r["match"], r.get("direct_response", {}).get("status")) for r in routes] != [({"prefix": "/"}, 404)]:
        problems.append("peer listener: want exactly one route, / -> direct_response 404")
    if any("route" in r or "redirect" in r for r in routes):
        problems.append("peer listener: a route proxies or redirects")
    return problems


def check_peers_cluster(w):
    """Piece 10: STRICT_DNS of the headless Service, override_host as the pool."""
    c = _patch(w, "CLUSTER", "ADD", "kvroute_peers")
    if c is None:
        return ["EnvoyFilter: no CLUSTER ADD kvroute_peers"]
    problems = []
    if c.get("type") != "STRICT_DNS":
        problems.append(f"kvroute_peers: type {c.get('type')}, want STRICT_DNS")
    if c.get("connect_timeout") != "0.25s":
        problems.append(f"kvroute_peers: connect_timeout {c.get('connect_timeout')}, want 0.25s")
    if c["load_assignment"]["cluster_name"] != c["name"]:
        problems.append("kvroute_peers: load_assignment.cluster_name differs")
    members = [e["endpoint"]["address"]["socket_address"]
               for group in c["load_assignment"]["endpoints"] for e in group["lb_endpoints"]]
    svc = w["peers"]["metadata"]
    want = {"address": f"{svc['name']}.{svc['namespace']}.svc.cluster.local", "port_value": PEER_PORT}
    if members != [want]:
        problems.append(f"kvroute_peers: members {members}, want [{want}]")
    pool = next(p["patch"]["value"] for p in w["envoyfilter"]["spec"]["configPatches"]
                if p["applyTo"] == "CLUSTER" and p["patch"]["operation"] == "MERGE")
    if c.get("load_balancing_policy") != pool["load_balancing_policy"]:
        problems.append("kvroute_peers: load_balancing_policy differs from the pool cluster's override_host")
    policy = c.get("load_balancing_policy", {}).get("policies", [{}])[0].get("typed_extension_config", {})
    header = policy.get("typed_config", {}).get("override_host_sources")
    if header != [{"header": _plugin(w)["destination_header"]}]:
        problems.append("kvroute_peers: override_host does not read kvroute's destination_header")
    return problems


def _admits(netpol, port, from_gateway):
    """Whether the NetworkPolicy lets TCP `port` in, from a gateway pod
    (`from_gateway`) or from some other pod (not in the gateway's labels)."""
    labels = netpol["spec"]["podSelector"]["matchLabels"]
    for rule in netpol["spec"].get("ingress", []):
        ports = rule.get("ports")
        port_ok = ports is None or any(
            p.get("protocol", "TCP") == "TCP" and
            (p.get("port") is None or p["port"] <= port <= p.get("endPort", p["port"]))
            for p in ports)
        if not port_ok:
            continue
        peers = rule.get("from")
        if peers is None:
            return True
        for peer in peers:
            sel = peer.get("podSelector")
            if set(peer) != {"podSelector"}:
                return True  # namespaceSelector / ipBlock: treat as open to others
            if not sel or not sel.get("matchLabels"):
                return True  # every pod of the namespace
            if from_gateway and _selects(sel["matchLabels"], labels):
                return True
    return False


def check_network_policy(w):
    np = w["netpol"]
    problems = []
    if np["spec"].get("policyTypes") != ["Ingress"]:
        problems.append("NetworkPolicy: want policyTypes [Ingress] (egress left alone)")
    if _admits(np, PEER_PORT, from_gateway=False):
        problems.append("NetworkPolicy: the peer port is open to pods other than the gateway's")
    if not _admits(np, PEER_PORT, from_gateway=True):
        problems.append("NetworkPolicy: the gateway pods cannot reach each other's peer port")
    # Every other port of the gateway stays reachable as before the policy.
    open_ports = [_target(p, w["deployment"]) for p in w["public"]["spec"]["ports"]]
    for port in open_ports + [80, 443, 8080, 8443, 15021, 15090, PEER_PORT - 1, PEER_PORT + 1, 65535]:
        if not _admits(np, port, from_gateway=False):
            problems.append(f"NetworkPolicy: blocks port {port} (only {PEER_PORT} should be restricted)")
    return problems


CHECKS = [check_replicas, check_selectors, check_headless_service, check_public_service,
          check_plugin_peers, check_peer_filter, check_peer_listener, check_peers_cluster,
          check_network_policy]


@pytest.mark.parametrize("check", CHECKS, ids=[c.__name__ for c in CHECKS])
def test_shipped_manifests_pass(check):
    assert check(world()) == []


# --- every check reports a broken copy ----------------------------------------

def _patches(w):
    return w["envoyfilter"]["spec"]["configPatches"]


def _set_plugin(w, name, cfg):
    _wasm(w, name)["configuration"]["value"] = json.dumps(cfg)


def _drop_peers(w):
    cfg = _plugin(w)
    del cfg["peers"]
    _set_plugin(w, "kvroute", cfg)


def _rename_peers_cluster(w):
    cfg = _plugin(w)
    cfg["peers"]["cluster"] = "kvroute_peer"
    _set_plugin(w, "kvroute", cfg)


def _wasmplugin_without_peers(w):
    del w["wasmplugin"]["spec"]["pluginConfig"]["peers"]


def _peer_root_is_kvroute(w):
    _wasm(w, "kvroute_peer")["root_id"] = "kvroute"


def _peer_vm_id(w):
    _wasm(w, "kvroute_peer")["vm_config"]["vm_id"] = "kvroute_peer"


def _peer_other_image(w):
    _wasm(w, "kvroute_peer")["vm_config"]["code"]["remote"]["sha256"] = "1" * 64


def _peer_fail_open(w):
    _wasm(w, "kvroute_peer")["failure_policy"] = "FAIL_OPEN"


def _peer_plugin_differs(w):
    cfg = _plugin(w, "kvroute_peer")
    cfg["max_body_bytes"] = 1 << 20
    _set_plugin(w, "kvroute_peer", cfg)


def _listener_on_public_port(w):
    _patch(w, "LISTENER", "ADD", "kvroute_peer")["address"]["socket_address"]["port_value"] = 8080


def _listener_proxies(w):
    hcm = _patch(w, "LISTENER", "ADD", "kvroute_peer")["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["route_config"]["virtual_hosts"][0]["routes"][0] = {
        "match": {"prefix": "/"}, "route": {"cluster": "kvroute_peers"}}


def _listener_runs_routing_filter(w):
    hcm = _patch(w, "LISTENER", "ADD", "kvroute_peer")["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"][0]["name"] = "kvroute"


def _cluster_static(w):
    _patch(w, "CLUSTER", "ADD", "kvroute_peers")["type"] = "STATIC"


def _cluster_other_namespace(w):
    c = _patch(w, "CLUSTER", "ADD", "kvroute_peers")
    sa = c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    sa["address"] = "kvroute-peers.default.svc.cluster.local"


def _cluster_round_robin(w):
    del _patch(w, "CLUSTER", "ADD", "kvroute_peers")["load_balancing_policy"]


def _cluster_slow_connect(w):
    _patch(w, "CLUSTER", "ADD", "kvroute_peers")["connect_timeout"] = "5s"


def _one_replica(w):
    w["deployment"]["spec"]["replicas"] = 1


def _peers_select_other_pods(w):
    w["peers"]["spec"]["selector"] = {"app": "kvroute-sim"}


def _netpol_elsewhere(w):
    w["netpol"]["metadata"]["namespace"] = "kvroute"


def _not_headless(w):
    del w["peers"]["spec"]["clusterIP"]


def _ready_only(w):
    w["peers"]["spec"]["publishNotReadyAddresses"] = False


def _public_exposes_peer_port(w):
    svc = next(s for s in w["services"] if s["metadata"]["name"] == "kvroute-gateway")
    svc["spec"]["ports"].append({"name": "peer", "port": 9100, "targetPort": "kvroute-peer"})


def _netpol_open(w):
    del w["netpol"]["spec"]["ingress"][1]["from"]


def _netpol_blocks_public(w):
    w["netpol"]["spec"]["ingress"][0]["ports"][0]["endPort"] = 79


def _netpol_whole_range(w):
    w["netpol"]["spec"]["ingress"][0]["ports"][1]["port"] = PEER_PORT


BROKEN = [
    (check_plugin_peers, _drop_peers),
    (check_plugin_peers, _rename_peers_cluster),
    (check_plugin_peers, _wasmplugin_without_peers),
    (check_peer_filter, _peer_root_is_kvroute),
    (check_peer_filter, _peer_vm_id),
    (check_peer_filter, _peer_other_image),
    (check_peer_filter, _peer_plugin_differs),
    (check_peer_filter, _peer_fail_open),
    (check_peer_listener, _listener_on_public_port),
    (check_peer_listener, _listener_proxies),
    (check_peer_listener, _listener_runs_routing_filter),
    (check_peers_cluster, _cluster_static),
    (check_peers_cluster, _cluster_other_namespace),
    (check_peers_cluster, _cluster_round_robin),
    (check_peers_cluster, _cluster_slow_connect),
    (check_replicas, _one_replica),
    (check_selectors, _peers_select_other_pods),
    (check_selectors, _netpol_elsewhere),
    (check_headless_service, _not_headless),
    (check_headless_service, _ready_only),
    (check_public_service, _public_exposes_peer_port),
    (check_network_policy, _netpol_open),
    (check_network_policy, _netpol_blocks_public),
    (check_network_policy, _netpol_whole_range),
]


@pytest.mark.parametrize("check,breakage", BROKEN, ids=[b.__name__.lstrip("_") for _, b in BROKEN])
def test_negative_broken_copy_reported(check, breakage):
    w = world()
    breakage(w)
    assert check(w) != []
