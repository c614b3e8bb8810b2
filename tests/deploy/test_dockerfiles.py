"""The Dockerfiles parse, and say what the rest of the deployment expects.

Parser: dockerfile-parse (PyPI) splits each Dockerfile into instructions and
build stages. It accepts any text, so a structural check is layered on top:
known instructions only, FROM before anything but ARG, JSON-form CMD/
ENTRYPOINT are JSON string arrays, `COPY --from` names an earlier stage.
"""

import io
import json

import pytest
import yaml
from dockerfile_parse import DockerfileParser

from conftest import COMPOSE

INSTRUCTIONS = {"FROM", "RUN", "CMD", "LABEL", "MAINTAINER", "EXPOSE", "ENV", "ADD", "COPY",
                "ENTRYPOINT", "VOLUME", "USER", "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL",
                "HEALTHCHECK", "SHELL"}
DOCKERFILES = ["Dockerfile.envoy", "Dockerfile.sim"]


def parse(text):
    # An in-memory file: with no fileobj, dockerfile-parse writes the content
    # to ./Dockerfile in the working directory.
    p = DockerfileParser(fileobj=io.BytesIO())
    p.content = text
    return p


def check(text):
    """Problems in a Dockerfile (empty list = fine); returns (problems, parser)."""
    p = parse(text)
    problems, stages, seen_from = [], [], False
    for ins in p.structure:
        name = ins["instruction"]
        if name == "COMMENT":
            continue
        if name not in INSTRUCTIONS:
            problems.append(f"line {ins['startline'] + 1}: unknown instruction {name}")
            continue
        if name == "FROM":
            seen_from = True
            words = ins["value"].split()
            if len(words) == 3 and words[1].upper() == "AS":
                stages.append(words[2])
        elif not seen_from and name != "ARG":
            problems.append(f"line {ins['startline'] + 1}: {name} before FROM")
        if name in ("CMD", "ENTRYPOINT") and ins["value"].lstrip().startswith("["):
            try:
                arr = json.loads(ins["value"])
                assert isinstance(arr, list) and all(isinstance(a, str) for a in arr)
            except (ValueError, AssertionError):
                problems.append(f"line {ins['startline'] + 1}: {name} is not a JSON string array")
        if name == "COPY" and "--from=" in ins["value"]:
            src = ins["value"].split("--from=")[1].split()[0]
            if src not in stages:
                problems.append(f"line {ins['startline'] + 1}: COPY --from={src}: no earlier stage")
    if not seen_from:
        problems.append("no FROM")
    return problems, p


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_parses_cleanly(name):
    problems, p = check((COMPOSE / name).read_text())
    assert problems == []
    assert p.structure[0]["instruction"] == "COMMENT"  # header says why it exists


def test_negative_broken_dockerfile_rejected():
    text = (COMPOSE / "Dockerfile.sim").read_text()
    text = text.replace("ENTRYPOINT [\"kvroute-sim\"]", "ENTRYPOINT [\"kvroute-sim\",]")
    text = text.replace("RUN cargo", "RUNN cargo")
    problems, _ = check(text)
    assert any("unknown instruction RUNN" in x for x in problems)
    assert any("ENTRYPOINT is not a JSON string array" in x for x in problems)
    problems, _ = check("COPY --from=nowhere /a /b\n")
    assert problems


def test_envoy_image_is_official_1_40_and_holds_the_wasm_envoy_yaml_loads():
    _, p = check((COMPOSE / "Dockerfile.envoy").read_text())
    assert p.baseimage.startswith("envoyproxy/envoy:v1.40")
    copies = [i["value"] for i in p.structure if i["instruction"] == "COPY"]
    dest = [c.split()[-1] for c in copies if "kvroute.wasm" in c]
    cfg = yaml.safe_load((COMPOSE / "envoy.yaml").read_text())
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    kv = next(f for f in hcm["http_filters"] if f["name"] == "kvroute")
    assert dest == [kv["typed_config"]["config"]["vm_config"]["code"]["local"]["filename"]]


def test_sim_image_entrypoint_matches_manifests():
    _, p = check((COMPOSE / "Dockerfile.sim").read_text())
    entry = next(json.loads(i["value"]) for i in p.structure if i["instruction"] == "ENTRYPOINT")
    assert entry == ["kvroute-sim"]
    assert any("install -m 0755 target/release/kvroute-sim /usr/local/bin/kvroute-sim" in i["value"]
               for i in p.structure if i["instruction"] == "RUN")
