#!/usr/bin/env python3
"""Render kvroute's Envoy config (envoy/kvroute.yaml.tmpl) and optionally run Envoy.

`./build.sh serve` calls this with `--run`; tests and benchmarks call it the
same way, so every Envoy kvroute runs behind is rendered by this one file.
"""
import argparse
import ipaddress
import json
import os
import string
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEFAULT_WASM = os.path.join(ROOT, "target", "wasm32-wasip1", "release", "kvroute.wasm")
DEFAULT_ENVOY = os.path.join(ROOT, ".venv", "bin", "envoy")
# Set by kvroute on streaming inference requests (client copies removed),
# removed again before the request leaves Envoy: selects the route whose
# per-try timeout is failover.first_byte_timeout_ms.
STREAM_HEADER = "x-kvroute-stream"


def host_port(value: str, what: str):
    """Split HOST:PORT (IPv6 as [addr]:port); HOST must be an IP literal."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"{what} {value!r} is not HOST:PORT")
    host = host.strip("[]")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what} {value!r}: host must be an IP address")
    return host, int(port)


def endpoint_list(value: str):
    eps = [e.strip() for e in value.split(",") if e.strip()]
    if not eps:
        raise argparse.ArgumentTypeError("--endpoints needs at least one HOST:PORT")
    for e in eps:
        host_port(e, "endpoint")
    return eps


def build_plugin_config(args) -> dict:
    config = {}
    if args.config:
        with open(args.config) as f:
            config = json.load(f)
        if not isinstance(config, dict):
            sys.exit(f"render.py: {args.config} must hold a JSON object")
    if args.endpoints:
        config["endpoints"] = args.endpoints
    if args.peer_listen and "peers" not in config:
        config["peers"] = {"cluster": "kvroute_peers", "admin_cluster": "kvroute_admin"}
    if not config.get("endpoints") and config.get("discovery") is None:
        sys.exit("render.py: no endpoints: pass --endpoints or put them in --config (or enable discovery)")
    return config


def fragment(name: str, values: dict) -> str:
    """A template fragment from envoy/, filled in."""
    with open(os.path.join(HERE, name)) as f:
        return string.Template(f.read()).substitute(values).rstrip("\n")


def indent(text: str, spaces: int) -> str:
    pad = " " * spaces
    return "\n".join(pad + line if line.strip() else line for line in text.splitlines())


def membership(args, endpoints) -> str:
    """STATIC member list, or EDS from a watched file (live discovery)."""
    if args.eds_file:
        path = os.path.abspath(args.eds_file)
        return "\n".join([
            "  type: EDS",
            "  eds_cluster_config:",
            "    eds_config:",
            "      resource_api_version: V3",
            "      path_config_source:",
            f"        path: {json.dumps(path)}",
            f"        watched_directory: {{ path: {json.dumps(os.path.dirname(path))} }}",
        ])
    lines = ["  type: STATIC", "  load_assignment:", "    cluster_name: kvroute_upstream",
             "    endpoints:", "      - lb_endpoints:"]
    for e in endpoints:
        host, port = host_port(e, "endpoint")
        lines.append(f"          - endpoint: {{ address: {{ socket_address: {{ address: {json.dumps(host)}, port_value: {port} }} }} }}")
    return "\n".join(lines)


def render(args) -> str:
    baseline = args.lb != "kvroute"
    plugin = {} if baseline else build_plugin_config(args)
    endpoints = args.endpoints if baseline else plugin.get("endpoints", [])
    if baseline and not (endpoints or args.eds_file):
        sys.exit("render.py: baselines need --endpoints or --eds-file")
    handoff = plugin.get("handoff", "override_host")
    # Baselines (no kvroute) keep Envoy's plain connect-failure retries.
    failover = plugin.get("failover") or {}
    first_byte_ms = 0 if baseline else int(failover.get("first_byte_timeout_ms", 60_000))
    response_ms = 0 if baseline else int(failover.get("response_timeout_ms", 0))
    # Answers of the chosen endpoint that Envoy retries on a fallback
    # (override_host only: ORIGINAL_DST would retry the same host). The
    # filter validates the plugin config too; this keeps a bad list from
    # becoming an Envoy config error with no field name.
    retry_statuses = [] if baseline else failover.get("retry_statuses", [429, 503])
    if not (isinstance(retry_statuses, list)
            and all(isinstance(c, int) and not isinstance(c, bool) and 400 <= c <= 599 for c in retry_statuses)):
        sys.exit(f"render.py: failover.retry_statuses must be a list of 4xx/5xx statuses, got {retry_statuses!r}")
    if handoff == "original_dst":
        retry_statuses = []
    max_body = int(plugin.get("max_body_bytes", 8 * 1024 * 1024))
    listen_host, listen_port = args.listen
    admin_host, admin_port = args.admin
    values = {
        "listen_host": json.dumps(listen_host),
        "listen_port": listen_port,
        "admin_host": json.dumps(admin_host),
        "admin_port": admin_port,
        "wasm_path": json.dumps(os.path.abspath(args.wasm)),
        # JSON text inside a YAML double-quoted scalar (JSON strings are YAML).
        "plugin_config": json.dumps(json.dumps(plugin, separators=(",", ":"))),
        "destination_header": json.dumps(plugin.get("destination_header", "x-kvroute-destination")),
        # kvroute buffers up to max_body_bytes, then routes by load and lets
        # the rest stream; one socket read can land a whole window past that
        # point before the filter runs, so the buffer holds twice the body
        # (plus headers). Bodies up to this limit are always served.
        "buffer_limit_bytes": args.buffer_limit or 2 * max_body + 64 * 1024,
        "route_idle_timeout": args.idle_timeout,
        "retry_on": ",".join(["connect-failure", "refused-stream", "reset-before-request"]
                             + (["reset"] if not baseline and failover.get("retry_before_response", True) else [])
                             + (["retriable-status-codes"] if retry_statuses else [])),
        "retriable_status_codes": (f"      retriable_status_codes: [ {', '.join(map(str, retry_statuses))} ]\n"
                                   if retry_statuses else ""),
    }
    filters = [] if baseline else [fragment("filter_kvroute.yaml.tmpl", dict(values, root_id="kvroute"))]
    filters.append(fragment("filter_router.yaml.tmpl", values))
    original_dst = not baseline and handoff == "original_dst"

    def retry(per_try_ms: int) -> str:
        """The route's retry policy. failover.*: Envoy's per-try timeout cuts
        an attempt with no response headers yet (verified on Envoy 1.40: it
        stops once headers arrive, so it never cuts a stream that started)."""
        per_try = f"      per_try_timeout: {per_try_ms / 1000:g}s\n" if per_try_ms > 0 else ""
        if original_dst:
            if per_try_ms <= 0:
                return ""
            return fragment("retry_policy_original_dst.yaml.tmpl", dict(values, per_try_timeout=per_try))
        return fragment("retry_policy.yaml.tmpl", dict(values, per_try_timeout=per_try))

    def route(match: str, per_try_ms: int, remove_stream_header: bool) -> str:
        return fragment("route.yaml.tmpl", dict(
            values, match=match, retry_policy=retry(per_try_ms),
            headers_to_remove=("  request_headers_to_remove: [ " + STREAM_HEADER + " ]"
                               if remove_stream_header else "")))

    # kvroute marks streaming inference requests with STREAM_HEADER; their
    # response headers come before the first token, so they alone get the
    # first-byte bound. Other requests' headers come with the whole answer:
    # failover.response_timeout_ms (none by default) bounds them.
    if baseline or first_byte_ms == response_ms:
        routes = [route('{ prefix: "/" }', first_byte_ms, not baseline)]
    else:
        stream_match = ('{ prefix: "/", headers: [ { name: ' + STREAM_HEADER
                        + ', present_match: true } ] }')
        routes = [route(stream_match, first_byte_ms, True), route('{ prefix: "/" }', response_ms, True)]
    if original_dst:
        clusters = [fragment("cluster_original_dst.yaml.tmpl", values)]
    else:
        if baseline:
            lb = f"  lb_policy: {args.lb.upper()}"
        else:
            lb = fragment("lb_override_host.yaml.tmpl", values)
        clusters = [fragment("cluster_members.yaml.tmpl", dict(values, membership=membership(args, endpoints), lb=lb))]
    peers = not baseline and args.peer_listen is not None
    listeners = []
    if peers:
        peer_host, peer_port = args.peer_listen
        peer_filters = [fragment("filter_kvroute.yaml.tmpl", dict(values, root_id="kvroute_peer")),
                        fragment("filter_router.yaml.tmpl", values)]
        listeners.append(fragment("listener_peer.yaml.tmpl", dict(
            values, peer_host=json.dumps(peer_host), peer_port=peer_port,
            peer_filters=indent("\n".join(peer_filters), 14))))
        members = []
        for p in args.peers or []:
            host, port = host_port(p, "--peers")
            members.append(f"          - endpoint: {{ address: {{ socket_address: {{ address: {json.dumps(host)}, port_value: {port} }} }} }}")
        clusters.append(fragment("cluster_peers.yaml.tmpl", dict(
            values, peer_members="\n".join(members) if members else "          []")))
    if not baseline and (plugin.get("discovery") is not None or peers):
        clusters.append(fragment("cluster_admin.yaml.tmpl", values))
    values.update(
        http_filters=indent("\n".join(filters), 18),
        clusters=indent("\n".join(clusters), 4),
        routes=indent("\n".join(routes), 24),
        peer_listener=indent("\n".join(listeners), 4),
        local_reply=indent(fragment("local_reply.yaml.tmpl", values), 16),
    )
    with open(args.template) as f:
        return string.Template(f.read()).substitute(values)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--endpoints", type=endpoint_list, help="HOST:PORT[,HOST:PORT...] of the model servers")
    p.add_argument("--listen", type=lambda v: host_port(v, "--listen"), default=("127.0.0.1", 10000))
    p.add_argument("--admin", type=lambda v: host_port(v, "--admin"), default=("127.0.0.1", 9901))
    p.add_argument("--config", help="plugin config JSON file (see docs/CONFIG.md); --endpoints overrides its endpoints")
    p.add_argument("--concurrency", type=int, default=2, help="Envoy worker threads")
    p.add_argument("--idle-timeout", default="300s", help="route idle timeout (longest silence in a stream)")
    p.add_argument("--lb", choices=["kvroute", "round_robin", "least_request"], default="kvroute",
                   help="kvroute, or a plain Envoy baseline without the filter (for comparisons)")
    p.add_argument("--buffer-limit", type=int,
                   help="listener/route buffer in bytes (default 2 x max_body_bytes + 64 KiB); a smaller one "
                        "reproduces gateways with small buffers (Istio): larger bodies get Envoy's 413")
    p.add_argument("--peer-listen", type=lambda v: host_port(v, "--peer-listen"),
                   help="HOST:PORT where this replica serves its decisions to the other kvroute replicas "
                        "(a second listener, not the public one); turns peer sync on")
    p.add_argument("--peers", type=lambda v: [e for e in (x.strip() for x in v.split(",")) if e],
                   help="HOST:PORT[,...] of the other replicas' peer listeners (this one may be listed too)")
    p.add_argument("--eds-file", help="take cluster members from this EDS file (watched; live discovery)")
    p.add_argument("--wasm", default=DEFAULT_WASM)
    p.add_argument("--template", default=os.path.join(HERE, "kvroute.yaml.tmpl"))
    p.add_argument("--envoy", default=os.environ.get("KVROUTE_ENVOY", DEFAULT_ENVOY))
    p.add_argument("--out", help="write the rendered config here (default: a temp file)")
    p.add_argument("--log-level", default="info")
    p.add_argument("--run", action="store_true", help="exec Envoy with the rendered config")
    args = p.parse_args(argv)
    if args.peers and not args.peer_listen:
        p.error("--peers needs --peer-listen (where this replica serves its own sync)")
    for e in args.peers or []:
        try:
            host_port(e, "--peers")
        except argparse.ArgumentTypeError as err:
            p.error(str(err))

    if args.run and not os.path.exists(args.wasm):
        sys.exit(f"render.py: {args.wasm} not found: run ./build.sh build")
    text = render(args)
    if args.out:
        out = args.out
        with open(out, "w") as f:
            f.write(text)
    else:
        fd, out = tempfile.mkstemp(prefix="kvroute-envoy-", suffix=".yaml")
        with os.fdopen(fd, "w") as f:
            f.write(text)
    if not args.run:
        print(out)
        return
    cmd = [args.envoy, "-c", out, "--concurrency", str(args.concurrency),
           "--log-level", args.log_level, "--disable-hot-restart",
           "--base-id", str(os.getpid() % 100000)]
    print(f"kvroute: Envoy ({args.lb}) listening on {args.listen[0]}:{args.listen[1]} "
          f"(admin {args.admin[0]}:{args.admin[1]})", flush=True)
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main()
