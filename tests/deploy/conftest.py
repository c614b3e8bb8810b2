"""Shared helpers of the deploy-manifest tests (tests/deploy).

Why this exists: every shipped manifest (deploy/istio, deploy/compose,
deploy/oci) is checked here with real parsers and schemas, offline, because no
Kubernetes cluster or Docker engine runs on these machines. The helpers find
the repository, the manifests, the real Envoy binary (env KVROUTE_ENVOY,
default .venv/bin/envoy) and a wasm module for Envoy's validate mode (env
KVROUTE_WASM, default the release kvroute.wasm; a tiny stub when it is not
built yet, so the rest of each Envoy config is still validated).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
ISTIO = DEPLOY / "istio"
COMPOSE = DEPLOY / "compose"
CONFIG_RS = ROOT / "core" / "src" / "config" / "mod.rs"
REAL_WASM = ROOT / "target" / "wasm32-wasip1" / "release" / "kvroute.wasm"


def load_yaml_docs(path: Path) -> list[dict]:
    """All documents of a YAML file (empty documents dropped)."""
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def istio_docs() -> list[tuple[str, dict]]:
    """(file name, object) for every object in deploy/istio/*.yaml."""
    out = []
    for p in sorted(ISTIO.glob("*.yaml")):
        for d in load_yaml_docs(p):
            out.append((p.name, d))
    return out


def find(kind: str, name: str) -> dict:
    for _, d in istio_docs():
        if d.get("kind") == kind and d["metadata"]["name"] == name:
            return d
    raise KeyError(f"{kind}/{name} not in deploy/istio")


def deep_merge(base: dict, patch: dict) -> dict:
    """Merge `patch` into a copy of `base`: maps merge, the rest replaces
    (enough of proto merge semantics for EnvoyFilter MERGE values here)."""
    out = copy.deepcopy(base)
    for k, v in patch.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def envoy_path() -> Path | None:
    p = Path(os.environ.get("KVROUTE_ENVOY", ROOT / ".venv" / "bin" / "envoy"))
    if not p.is_absolute():
        p = ROOT / p
    return p if p.is_file() and os.access(p, os.X_OK) else None


@pytest.fixture(scope="session")
def envoy() -> Path:
    p = envoy_path()
    if p is None:
        pytest.skip("real Envoy not found: run ./build.sh setup or set KVROUTE_ENVOY")
    return p


@pytest.fixture(scope="session")
def wasm_module(tmp_path_factory) -> tuple[Path, bool]:
    """(path, is_real): the real kvroute.wasm if built, else the stub."""
    env = os.environ.get("KVROUTE_WASM")
    real = Path(env) if env else REAL_WASM
    if real.is_file():
        return real, True
    from wasm_stub import stub_wasm

    p = tmp_path_factory.mktemp("wasm") / "stub.wasm"
    p.write_bytes(stub_wasm())
    return p, False


def envoy_validate(envoy: Path, config: dict | str, workdir: Path) -> subprocess.CompletedProcess:
    """Run `envoy --mode validate` on a bootstrap (dict or YAML text)."""
    text = config if isinstance(config, str) else yaml.safe_dump(config, sort_keys=False)
    path = workdir / "bootstrap.yaml"
    path.write_text(text)
    return subprocess.run(
        [str(envoy), "--mode", "validate", "-c", str(path), "-l", "error",
         "--disable-hot-restart"],
        capture_output=True, text=True, timeout=60,
    )


def patch_value(envoyfilter: str, apply_to: str, op: str | None = None,
                name: str | None = None) -> dict:
    """The value of the one configPatch of EnvoyFilter `envoyfilter` that
    applies to `apply_to` (with operation `op` and value name `name` when
    given); fails when none or several match."""
    found = [p["patch"]["value"] for p in find("EnvoyFilter", envoyfilter)["spec"]["configPatches"]
             if p["applyTo"] == apply_to
             and (op is None or p["patch"]["operation"] == op)
             and (name is None or p["patch"].get("value", {}).get("name") == name)]
    assert len(found) == 1, f"{envoyfilter}: {len(found)} {apply_to} {op or ''} {name or ''} patches"
    return found[0]


def plugin_configs() -> list[tuple[str, dict]]:
    """Every kvroute plugin JSON config that ships in a manifest (both wasm
    filters of the EnvoyFilter: the routing one and the peer one)."""
    out = []
    ef = find("EnvoyFilter", "kvroute")
    for patch in ef["spec"]["configPatches"]:
        if patch["applyTo"] == "EXTENSION_CONFIG":
            value = patch["patch"]["value"]
            cfg = value["typed_config"]["config"]["configuration"]
            out.append((f"istio/envoyfilter-kvroute.yaml:{value['name']}", json.loads(cfg["value"])))
    wp = find("WasmPlugin", "kvroute")
    out.append(("istio/wasmplugin.yaml", wp["spec"]["pluginConfig"]))
    out.append(("compose/kvroute.json", json.loads((COMPOSE / "kvroute.json").read_text())))
    return out


def have(cmd: str) -> bool:
    return shutil.which(cmd) is not None
