#!/usr/bin/env python3
"""Package kvroute.wasm as an OCI image layout that Istio can pull, without Docker.

Why this exists: Istio's WasmPlugin (and the istio-agent behind an ECDS
EnvoyFilter) fetches wasm modules from OCI registries (`oci://...`). We have no
container engine on the build machines, so this script writes the image layout
directory by hand (OCI image-spec v1.0 "image layout": `oci-layout`,
`index.json`, `blobs/sha256/<hex>`), and `skopeo copy oci:DIR:TAG
docker://REGISTRY/REPO:TAG` pushes it.

Which variant: Istio understands two wasm image formats. We build the
**compat** variant: an ordinary OCI image (standard media types) whose single,
last layer is a gzip tar holding `plugin.wasm`, with the manifest annotation
`module.wasm.image/variant=compat`. Every registry and every image tool
(skopeo, crane, docker pull, ...) handles standard media types, whereas the
other ("oci" wasm-artifact) variant uses custom media types
(`application/vnd.module.wasm.content.layer.v1+wasm`) that some registries
reject. Istio reads the last layer of a compat image and extracts `plugin.wasm`.

The output is reproducible: fixed tar metadata (uid/gid 0, mode 0644, mtime
from SOURCE_DATE_EPOCH or 0) and a gzip header without a timestamp, so the same
wasm always gives the same digests (and Istio's `sha256` pin stays valid).

Usage:
    build_oci.py --wasm target/wasm32-wasip1/release/kvroute.wasm \
                 --out target/oci/kvroute --tag 0.1.0
    build_oci.py --verify target/oci/kvroute          # check an existing layout
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import shutil
import sys
import tarfile
from pathlib import Path

# Media types of the OCI image spec (v1.0+).
MT_INDEX = "application/vnd.oci.image.index.v1+json"
MT_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MT_CONFIG = "application/vnd.oci.image.config.v1+json"
MT_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
# Annotation that marks the compat wasm variant (required with MT_LAYER).
VARIANT_ANNOTATION = "module.wasm.image/variant"
# Standard annotation naming the tag inside an image layout's index.json.
REF_NAME = "org.opencontainers.image.ref.name"
# The file Istio extracts from the last layer.
PLUGIN_FILE = "plugin.wasm"
WASM_MAGIC = b"\x00asm"


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def canonical_json(obj) -> bytes:
    """Stable JSON bytes (sorted keys, no whitespace): stable digests."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def make_layer(wasm: bytes, mtime: int) -> tuple[bytes, bytes]:
    """Return (uncompressed tar, gzip of it) holding only plugin.wasm."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo(PLUGIN_FILE)
        info.size = len(wasm)
        info.mode = 0o644
        info.mtime = mtime
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        tar.addfile(info, io.BytesIO(wasm))
    tar_bytes = raw.getvalue()
    gz = io.BytesIO()
    # mtime=0 in the gzip header keeps the blob byte-identical across builds.
    with gzip.GzipFile(fileobj=gz, mode="wb", mtime=0, compresslevel=9) as f:
        f.write(tar_bytes)
    return tar_bytes, gz.getvalue()


def descriptor(media_type: str, data: bytes, annotations: dict | None = None) -> dict:
    d = {"mediaType": media_type, "digest": "sha256:" + sha256_hex(data), "size": len(data)}
    if annotations:
        d["annotations"] = annotations
    return d


def build(wasm_path: Path, out: Path, tag: str, mtime: int | None = None) -> dict:
    """Write the OCI layout at `out` (replacing it) and return the index."""
    wasm = wasm_path.read_bytes()
    if not wasm.startswith(WASM_MAGIC):
        raise ValueError(f"{wasm_path} is not a wasm module (no \\0asm magic)")
    if mtime is None:
        mtime = int(os.environ.get("SOURCE_DATE_EPOCH", "0"))
    tar_bytes, layer = make_layer(wasm, mtime)
    config = {
        # Nominal platform: wasm is portable, Istio ignores these, but image
        # tools and registries expect an os/architecture in an image config.
        "architecture": "amd64",
        "os": "linux",
        "config": {},
        "rootfs": {"type": "layers", "diff_ids": ["sha256:" + sha256_hex(tar_bytes)]},
    }
    config_bytes = canonical_json(config)
    manifest = {
        "schemaVersion": 2,
        "mediaType": MT_MANIFEST,
        "config": descriptor(MT_CONFIG, config_bytes),
        "layers": [descriptor(MT_LAYER, layer)],
        "annotations": {VARIANT_ANNOTATION: "compat"},
    }
    manifest_bytes = canonical_json(manifest)
    index = {
        "schemaVersion": 2,
        "mediaType": MT_INDEX,
        "manifests": [descriptor(MT_MANIFEST, manifest_bytes, {REF_NAME: tag})],
    }
    if out.exists():
        shutil.rmtree(out)
    blobs = out / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    for data in (layer, config_bytes, manifest_bytes):
        (blobs / sha256_hex(data)).write_bytes(data)
    (out / "oci-layout").write_bytes(canonical_json({"imageLayoutVersion": "1.0.0"}))
    (out / "index.json").write_bytes(canonical_json(index))
    return index


def _read_blob(layout: Path, desc: dict, errors: list[str]) -> bytes | None:
    digest = desc.get("digest", "")
    if not digest.startswith("sha256:") or len(digest) != 71:
        errors.append(f"bad digest {digest!r}")
        return None
    path = layout / "blobs" / "sha256" / digest[7:]
    if not path.is_file():
        errors.append(f"missing blob {digest}")
        return None
    data = path.read_bytes()
    if "sha256:" + sha256_hex(data) != digest:
        errors.append(f"blob {digest} content hashes to sha256:{sha256_hex(data)}")
    if desc.get("size") != len(data):
        errors.append(f"blob {digest} size {len(data)} != descriptor size {desc.get('size')}")
    return data


def verify(layout: Path, expect_wasm: bytes | None = None) -> list[str]:
    """Check an OCI layout built for Istio; return the problems (empty = OK).

    Checks: `oci-layout` version, every descriptor's digest and size against
    its blob, media types, the compat annotation, the config's diff_id against
    the uncompressed layer, and that the last layer holds a wasm `plugin.wasm`
    (equal to `expect_wasm` when given).
    """
    errors: list[str] = []
    try:
        marker = json.loads((layout / "oci-layout").read_bytes())
        if marker.get("imageLayoutVersion") != "1.0.0":
            errors.append(f"oci-layout version {marker.get('imageLayoutVersion')!r}")
        index = json.loads((layout / "index.json").read_bytes())
    except (OSError, ValueError) as e:
        return [f"unreadable layout: {e}"]
    if index.get("schemaVersion") != 2:
        errors.append("index.json schemaVersion != 2")
    manifests = index.get("manifests") or []
    if not manifests:
        errors.append("index.json lists no manifest")
    for mdesc in manifests:
        if mdesc.get("mediaType") != MT_MANIFEST:
            errors.append(f"manifest media type {mdesc.get('mediaType')!r}")
        mbytes = _read_blob(layout, mdesc, errors)
        if mbytes is None:
            continue
        try:
            manifest = json.loads(mbytes)
        except ValueError as e:
            errors.append(f"manifest is not JSON: {e}")
            continue
        if manifest.get("schemaVersion") != 2 or manifest.get("mediaType") != MT_MANIFEST:
            errors.append("manifest schemaVersion/mediaType wrong")
        if (manifest.get("annotations") or {}).get(VARIANT_ANNOTATION) != "compat":
            errors.append(f"manifest lacks annotation {VARIANT_ANNOTATION}=compat")
        cdesc = manifest.get("config") or {}
        if cdesc.get("mediaType") != MT_CONFIG:
            errors.append(f"config media type {cdesc.get('mediaType')!r}")
        cbytes = _read_blob(layout, cdesc, errors)
        layers = manifest.get("layers") or []
        if not layers:
            errors.append("manifest has no layer")
            continue
        diff_ids = []
        last_tar = None
        for ldesc in layers:
            if ldesc.get("mediaType") != MT_LAYER:
                errors.append(f"layer media type {ldesc.get('mediaType')!r}")
            lbytes = _read_blob(layout, ldesc, errors)
            if lbytes is None:
                continue
            try:
                last_tar = gzip.decompress(lbytes)
            except OSError as e:
                errors.append(f"layer {ldesc.get('digest')} is not gzip: {e}")
                last_tar = None
                continue
            diff_ids.append("sha256:" + sha256_hex(last_tar))
        if cbytes is not None:
            try:
                config = json.loads(cbytes)
            except ValueError:
                config = {}
            if (config.get("rootfs") or {}).get("diff_ids") != diff_ids:
                errors.append("config rootfs.diff_ids do not match the layers")
        if last_tar is not None:
            wasm = None
            try:
                with tarfile.open(fileobj=io.BytesIO(last_tar)) as tar:
                    wasm = tar.extractfile(tar.getmember(PLUGIN_FILE)).read()
            except KeyError:
                errors.append(f"last layer has no {PLUGIN_FILE}")
            except tarfile.TarError as e:
                errors.append(f"last layer is not a tar archive: {e}")
            if wasm is not None:
                if not wasm.startswith(WASM_MAGIC):
                    errors.append(f"{PLUGIN_FILE} is not a wasm module")
                if expect_wasm is not None and wasm != expect_wasm:
                    errors.append(f"{PLUGIN_FILE} differs from the expected wasm")
    return errors


def _workspace_version() -> str:
    """kvroute's version from the workspace Cargo.toml (the default tag)."""
    try:
        import tomllib

        root = Path(__file__).resolve().parents[2]
        with open(root / "Cargo.toml", "rb") as f:
            return tomllib.load(f)["workspace"]["package"]["version"]
    except (ImportError, OSError, KeyError, ValueError):
        return "latest"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wasm", type=Path, default=Path("target/wasm32-wasip1/release/kvroute.wasm"),
                    help="the built filter (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=Path("target/oci/kvroute"),
                    help="OCI layout directory to (re)create (default: %(default)s)")
    ap.add_argument("--tag", default=_workspace_version(),
                    help="tag recorded in index.json (skopeo: oci:OUT:TAG) (default: %(default)s)")
    ap.add_argument("--verify", type=Path, metavar="LAYOUT",
                    help="only verify an existing layout and exit")
    args = ap.parse_args(argv)
    if args.verify:
        errors = verify(args.verify)
    else:
        index = build(args.wasm, args.out, args.tag)
        errors = verify(args.out, expect_wasm=args.wasm.read_bytes())
        m = index["manifests"][0]
        print(f"wrote {args.out} (oci:{args.out}:{args.tag}, manifest {m['digest']})")
        print(f"push: skopeo copy oci:{args.out}:{args.tag} docker://REGISTRY/kvroute:{args.tag}")
        # For an oci:// url Istio checks WasmPlugin.spec.sha256 against the
        # image manifest digest (the wasm file's own hash is for http urls).
        print(f"WasmPlugin sha256 for this image: {m['digest'][7:]}")
    for e in errors:
        print(f"error: {e}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
