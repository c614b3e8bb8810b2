"""deploy/oci/build_oci.py writes an OCI image layout Istio can pull.

Checks: the layout's own verifier (every digest and size, media types, compat
annotation, diff_ids, `plugin.wasm` in the last layer); reproducibility (same
wasm, same digests); and, when Debian's skopeo is installed
(`apt-get install -y skopeo`), an independent reader: `skopeo inspect` reads
the layout and `skopeo copy` re-hashes every blob while copying it.
"""

import gzip
import hashlib
import json
import subprocess
import sys

import pytest

from conftest import DEPLOY, have

sys.path.insert(0, str(DEPLOY / "oci"))
import build_oci  # noqa: E402

sys.path.pop(0)


@pytest.fixture
def layout(tmp_path, wasm_module):
    wasm, _ = wasm_module
    out = tmp_path / "kvroute-oci"
    index = build_oci.build(wasm, out, "0.1.0")
    return out, index, wasm.read_bytes()


def _manifest(out, index):
    return json.loads((out / "blobs" / "sha256" / index["manifests"][0]["digest"][7:]).read_bytes())


def test_layout_verifies(layout):
    out, index, wasm = layout
    assert build_oci.verify(out, expect_wasm=wasm) == []
    m = _manifest(out, index)
    assert m["annotations"]["module.wasm.image/variant"] == "compat"
    assert [l["mediaType"] for l in m["layers"]] == ["application/vnd.oci.image.layer.v1.tar+gzip"]
    assert index["manifests"][0]["annotations"]["org.opencontainers.image.ref.name"] == "0.1.0"
    assert json.loads((out / "oci-layout").read_text()) == {"imageLayoutVersion": "1.0.0"}


def test_digests_recomputed_independently(layout):
    out, index, _ = layout
    blobs = list((out / "blobs" / "sha256").iterdir())
    assert len(blobs) == 3  # manifest, config, layer
    for b in blobs:
        assert hashlib.sha256(b.read_bytes()).hexdigest() == b.name


def test_build_is_reproducible(tmp_path, wasm_module):
    wasm, _ = wasm_module
    a = build_oci.build(wasm, tmp_path / "a", "t")
    b = build_oci.build(wasm, tmp_path / "b", "t")
    assert a == b


def test_cli(tmp_path, wasm_module):
    wasm, _ = wasm_module
    out = tmp_path / "cli"
    r = subprocess.run([sys.executable, str(DEPLOY / "oci" / "build_oci.py"), "--wasm", str(wasm),
                        "--out", str(out), "--tag", "x"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, str(DEPLOY / "oci" / "build_oci.py"), "--verify", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_negative_tampered_layer_detected(layout):
    out, index, _ = layout
    layer = _manifest(out, index)["layers"][0]["digest"][7:]
    path = out / "blobs" / "sha256" / layer
    path.write_bytes(gzip.compress(b"not the layer", mtime=0))
    problems = build_oci.verify(out)
    assert any("hashes to" in p for p in problems)


def test_negative_missing_plugin_and_wrong_size_detected(layout):
    out, index, _ = layout
    index["manifests"][0]["size"] += 1
    (out / "index.json").write_text(json.dumps(index))
    assert any("size" in p for p in build_oci.verify(out))


def test_negative_not_wasm_refused(tmp_path):
    src = tmp_path / "x.wasm"
    src.write_bytes(b"MZ not wasm")
    with pytest.raises(ValueError):
        build_oci.build(src, tmp_path / "o", "t")


skopeo = pytest.mark.skipif(not have("skopeo"), reason="skopeo not installed (apt-get install -y skopeo)")


@skopeo
def test_skopeo_reads_and_copies_layout(layout, tmp_path):
    out, index, _ = layout
    r = subprocess.run(["skopeo", "inspect", f"oci:{out}:0.1.0"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["Digest"] == index["manifests"][0]["digest"]
    assert info["Layers"] == [l["digest"] for l in _manifest(out, index)["layers"]]
    r = subprocess.run(["skopeo", "copy", "--quiet", f"oci:{out}:0.1.0", f"dir:{tmp_path / 'copy'}"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


@skopeo
def test_negative_skopeo_rejects_tampered_layer(layout, tmp_path):
    out, index, _ = layout
    layer = _manifest(out, index)["layers"][0]["digest"][7:]
    (out / "blobs" / "sha256" / layer).write_bytes(gzip.compress(b"tampered", mtime=0))
    r = subprocess.run(["skopeo", "copy", "--quiet", f"oci:{out}:0.1.0", f"dir:{tmp_path / 'copy'}"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
