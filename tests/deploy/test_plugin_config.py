"""Every kvroute plugin config shipped in a manifest fits kvroute's own parser.

Two checks:
  * here, without building anything: the JSON's keys and enum values against
    the serde structs in core/src/config/mod.rs (parsed from the Rust source, so a
    renamed or removed field fails this test), plus the semantic rules the
    deploy files depend on (endpoints or discovery, discovery needs
    override_host);
  * in test_envoy.py, when kvroute.wasm is built: the real filter's
    on_configure parses each config inside `envoy --mode validate`.
"""

import copy
import re

import pytest

from conftest import CONFIG_RS, plugin_configs


def rust_schema():
    """{struct or enum name: {field: type}} / {enum: set(values)} from config/mod.rs."""
    src = CONFIG_RS.read_text()
    structs, enums = {}, {}
    for m in re.finditer(r"pub struct (\w+) \{(.*?)\n\}", src, re.S):
        structs[m.group(1)] = dict(re.findall(r"pub (\w+): ([^,\n]+),", m.group(2)))
    for m in re.finditer(r'(#\[serde\(rename_all = "(\w+)"\)\]\s*)?pub enum (\w+) \{(.*?)\n\}', src, re.S):
        rename, name, body = m.group(2), m.group(3), m.group(4)
        variants = re.findall(r"^\s*(\w+),", body, re.M)
        if rename == "snake_case":
            vals = {re.sub(r"(?<!^)(?=[A-Z])", "_", v).lower() for v in variants}
        elif rename == "lowercase":
            vals = {v.lower() for v in variants}
        else:
            vals = set(variants)
        enums[name] = vals
    return structs, enums


def check_keys(obj, struct="Config", path=""):
    structs, enums = rust_schema()
    problems = []

    def walk(value, typ, path):
        typ = typ.strip()
        inner = re.fullmatch(r"Option<(.+)>", typ)
        if inner:
            if value is None:
                return
            typ = inner.group(1)
        if typ in structs:
            if not isinstance(value, dict):
                problems.append(f"{path or '(config)'}: expected an object")
                return
            for k, v in value.items():
                if k not in structs[typ]:
                    problems.append(f"{path}{k}: unknown field (not in {typ})")
                else:
                    walk(v, structs[typ][k], f"{path}{k}.")
        elif typ in enums:
            if value not in enums[typ]:
                problems.append(f"{path.rstrip('.')}: {value!r} not one of {sorted(enums[typ])}")
        elif typ in ("String",):
            if not isinstance(value, str):
                problems.append(f"{path.rstrip('.')}: expected a string")
        elif re.fullmatch(r"u\d+|usize", typ):
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
                problems.append(f"{path.rstrip('.')}: expected an unsigned integer")
        elif typ == "bool":
            if not isinstance(value, bool):
                problems.append(f"{path.rstrip('.')}: expected true/false")
        elif typ.startswith("Vec<"):
            if not isinstance(value, list):
                problems.append(f"{path.rstrip('.')}: expected a list")

    walk(obj, struct, path)
    # Semantic rules of Config::validate the manifests rely on.
    if not obj.get("endpoints") and not obj.get("discovery"):
        problems.append("endpoints: empty and no discovery")
    if obj.get("discovery") is not None and obj.get("handoff") != "override_host":
        problems.append("discovery: needs handoff override_host")
    return problems


def test_config_rs_is_understood():
    structs, enums = rust_schema()
    assert {"endpoints", "handoff", "discovery", "destination_header", "max_body_bytes",
            "upstream_cluster", "metrics", "shared", "peers"} <= set(structs["Config"])
    assert {"cluster", "admin_cluster", "sync_interval_ms"} <= set(structs["PeersConfig"])
    assert enums["Handoff"] == {"original_dst", "override_host"}


@pytest.mark.parametrize("where,cfg", plugin_configs(), ids=[w for w, _ in plugin_configs()])
def test_shipped_plugin_config_fits_config_rs(where, cfg):
    assert check_keys(cfg) == []


def test_negative_typo_and_bad_enum_rejected():
    _, cfg = plugin_configs()[0]
    bad = copy.deepcopy(cfg)
    bad["metrics"]["scrape_intervall_ms"] = 50
    bad["handoff"] = "override-host"
    problems = check_keys(bad)
    assert any("scrape_intervall_ms" in p for p in problems)
    assert any("handoff" in p for p in problems)


def test_negative_peers_typo_rejected():
    _, cfg = plugin_configs()[0]
    bad = copy.deepcopy(cfg)
    bad["peers"]["clusters"] = "kvroute_peers"
    assert any("peers.clusters" in p for p in check_keys(bad))


def test_negative_discovery_without_override_host_rejected():
    _, cfg = plugin_configs()[0]
    bad = copy.deepcopy(cfg)
    bad["handoff"] = "original_dst"
    assert any("discovery" in p for p in check_keys(bad))
