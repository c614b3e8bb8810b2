"""Kubernetes objects in deploy/istio validate against Kubernetes' own schemas.

Validator: kubernetes-validate (PyPI), which ships the JSON schemas generated
from the Kubernetes OpenAPI spec, in strict mode (unknown fields rejected),
against the newest Kubernetes version it carries.
"""

import copy

import kubernetes_validate
import pytest

from conftest import istio_docs

K8S_KINDS = {"Namespace", "Deployment", "Service", "ServiceAccount", "PodDisruptionBudget",
             "NetworkPolicy"}
K8S_OBJECTS = [(f, d) for f, d in istio_docs() if d["kind"] in K8S_KINDS]
VERSION = kubernetes_validate.utils.latest_version()


def validate(obj):
    return kubernetes_validate.validate(obj, VERSION, strict=True)


def test_there_are_kubernetes_objects():
    kinds = {(d["kind"], d["metadata"]["name"]) for _, d in K8S_OBJECTS}
    for want in [("Deployment", "vllm"), ("Service", "vllm"),
                 ("Deployment", "kvroute-sim"), ("Service", "kvroute-sim"),
                 ("Deployment", "kvroute-gateway"), ("Service", "kvroute-gateway"),
                 ("Service", "kvroute-peers"), ("NetworkPolicy", "kvroute-peers"),
                 ("PodDisruptionBudget", "kvroute-gateway"), ("ServiceAccount", "kvroute-gateway")]:
        assert want in kinds


@pytest.mark.parametrize("obj", [d for _, d in K8S_OBJECTS],
                         ids=[f"{f}:{d['kind']}/{d['metadata']['name']}" for f, d in K8S_OBJECTS])
def test_kubernetes_object_validates(obj):
    validate(obj)


def test_every_object_is_checked_by_some_schema():
    """Nothing in deploy/istio escapes validation (Kubernetes or Istio)."""
    istio_kinds = {"Gateway", "VirtualService", "DestinationRule", "EnvoyFilter", "WasmPlugin"}
    for f, d in istio_docs():
        assert d["kind"] in K8S_KINDS | istio_kinds, f"{f}: {d['kind']} has no validator"


def _deployment(name):
    return copy.deepcopy(next(d for _, d in K8S_OBJECTS
                              if d["kind"] == "Deployment" and d["metadata"]["name"] == name))


def test_negative_unknown_field_rejected():
    bad = _deployment("vllm")
    bad["spec"]["template"]["spec"]["containers"][0]["argz"] = ["--oops"]
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(bad)


def test_negative_network_policy_bad_port_range_rejected():
    bad = copy.deepcopy(next(d for _, d in K8S_OBJECTS if d["kind"] == "NetworkPolicy"))
    bad["spec"]["ingress"][0]["ports"][0]["endPort"] = "15099"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(bad)


def test_negative_wrong_type_rejected():
    bad = _deployment("kvroute-sim")
    bad["spec"]["replicas"] = "four"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(bad)


def test_services_select_their_pods_and_port():
    for name in ["vllm", "kvroute-sim"]:
        dep = _deployment(name)
        svc = next(d for _, d in K8S_OBJECTS if d["kind"] == "Service" and d["metadata"]["name"] == name)
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert all(labels.get(k) == v for k, v in svc["spec"]["selector"].items())
        ports = {p["name"]: p["containerPort"] for p in dep["spec"]["template"]["spec"]["containers"][0]["ports"]}
        assert svc["spec"]["ports"][0]["port"] == 8000 and ports[svc["spec"]["ports"][0]["targetPort"]] == 8000


def test_vllm_arguments():
    c = _deployment("vllm")["spec"]["template"]["spec"]["containers"][0]
    assert c["command"] == ["vllm", "serve"]
    args = c["args"]
    assert "--enable-prefix-caching" in args and "--port=8000" in args
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_sim_arguments():
    c = _deployment("kvroute-sim")["spec"]["template"]["spec"]["containers"][0]
    assert c["command"] + c["args"] == ["kvroute-sim", "--pods", "1", "--base-port", "8000", "--host", "0.0.0.0"]
