"""The OCI images of `make oci`, pushed by `make push` to a real registry and pulled back by another client
(docs/deploying.md, "OCI images").

scripts/oci.py (what `make oci` and `make push` run) builds the images of copies of the stock and the
Higress build and pushes them to Debian's docker-registry on loopback (tests/e2e/registry.py); oras-py, a
client that shares no code with umoci and skopeo, pulls them back. What a gateway relies on is checked on what
the registry serves:

1. The stock build's image is the compat variant Istio reads: an OCI manifest (the registry's Content-Type),
   one tar+gzip layer holding only `plugin.wasm`, byte for byte the artifact, the manifest annotation
   `module.wasm.image/variant: compat`, an OCI image config; the digest the push printed is the manifest's
   sha256, and the tag points at it.
2. The Higress build's image has Higress's layout: `spec.yaml`, `README.md`, then the module as
   `plugin.tar.gz` in the last layer (holding only `plugin.wasm`), each named by its title annotation, which
   `oras pull` writes out by name (and unpacks the module's layer).
3. The same module and version give the same digest on every build; another module, another digest.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import shutil
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path
from typing import Iterator, NamedTuple

import oras.client
import pytest
import yaml

import harness
from registry import Registry

SCRIPT = harness.REPO / "scripts" / "oci.py"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
TAR_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
TITLE = "org.opencontainers.image.title"
REPOSITORY = "erl/e2e"  # the path under the registry, as in `make push REGISTRY=host:port/erl/e2e`
BUILDS = ("envoy", "higress")


def oci(*args: str) -> list[str]:
    """Runs scripts/oci.py as `make oci` / `make push` do; its output lines (the test fails on exit != 0)."""
    result = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60,
                            check=False)
    assert result.returncode == 0, f"scripts/oci.py {' '.join(args)} exited {result.returncode}: {result.stderr}"
    return result.stdout.splitlines()


def cargo_version() -> str:
    """`[package] version` of Cargo.toml: the images' tag."""
    with open(harness.REPO / "Cargo.toml", "rb") as cargo:
        return tomllib.load(cargo)["package"]["version"]


class Pushed(NamedTuple):
    """What the module's images are: the registry, the version, each build's module bytes, the digest each
    build printed and the pinned reference each push printed (`host/path/name:version@sha256:...`)."""

    registry: Registry
    version: str
    modules: dict[str, bytes]
    built: dict[str, str]
    pinned: dict[str, str]
    workdir: Path

    def client(self) -> oras.client.OrasClient:
        return oras.client.OrasClient(hostname=self.registry.host, insecure=True)


def build_digests(lines: list[str]) -> dict[str, str]:
    """`build`'s lines (`<out>/edge-rate-limiter-<build>:<version> sha256:<hex>`) by build."""
    digests = {}
    for line in lines:
        layout, digest = line.split()
        digests[Path(layout.rsplit(":", 1)[0]).name.removeprefix("edge-rate-limiter-")] = digest
    return digests


@pytest.fixture(scope="module")
def pushed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pushed]:
    workdir = tmp_path_factory.mktemp("oci")
    # Copies: the artifacts in dist/ may be rebuilt while the test runs.
    dist = workdir / "dist"
    dist.mkdir()
    for build in BUILDS:
        shutil.copyfile(harness.BUILDS[build], dist / f"edge-rate-limiter-{build}.wasm")
    modules = {build: (dist / f"edge-rate-limiter-{build}.wasm").read_bytes() for build in BUILDS}
    out = workdir / "oci"
    built = build_digests(oci("build", "--dist", str(dist), "--out", str(out)))
    with Registry(workdir) as registry:
        lines = oci("push", f"{registry.host}/{REPOSITORY}", "--tls-verify", "false", "--out", str(out))
        pinned = {line.split("/")[-1].split(":")[0].removeprefix("edge-rate-limiter-"): line for line in lines}
        yield Pushed(registry, cargo_version(), modules, built, pinned, workdir)


def fetch_manifest(pushed: Pushed, reference: str) -> tuple[dict, str, str]:
    """The manifest at `host/path/name@digest` or `:tag` as the registry serves it: (the parsed manifest, its
    Content-Type, the sha256 of its bytes)."""
    client = pushed.client()
    container = client.get_container(reference)
    response = client.do_request(f"http://{container.manifest_url()}", "GET", headers={"Accept": OCI_MANIFEST})
    assert response.status_code == 200, f"GET manifest {reference}: {response.status_code} {response.text}"
    digest = "sha256:" + hashlib.sha256(response.content).hexdigest()
    assert response.headers.get("Docker-Content-Digest") == digest, "the registry names the bytes it serves"
    return json.loads(response.content), response.headers.get("Content-Type", ""), digest


def blob(pushed: Pushed, reference: str, descriptor: dict) -> bytes:
    """A blob the registry serves, checked against the descriptor's digest and size."""
    client = pushed.client()
    response = client.get_blob(client.get_container(reference), descriptor["digest"])
    assert response.status_code == 200, f"GET blob {descriptor['digest']}: {response.status_code}"
    assert "sha256:" + hashlib.sha256(response.content).hexdigest() == descriptor["digest"]
    assert len(response.content) == descriptor["size"]
    return response.content


def tar_members(layer: bytes) -> dict[str, bytes]:
    """The files of a tar+gzip layer, read to the end (a truncated tar raises)."""
    with tarfile.open(fileobj=io.BytesIO(layer), mode="r:gz") as archive:
        return {member.name: archive.extractfile(member).read() for member in archive.getmembers()}


def repository_of(pinned: str) -> str:
    """`host/path/name:version@sha256:...` without its tag and digest."""
    return pinned.split("@")[0].rsplit(":", 1)[0]


def test_the_stock_image_is_the_compat_variant_with_the_module_byte_for_byte(pushed: Pushed) -> None:
    pinned = pushed.pinned["envoy"]
    repository = repository_of(pinned)
    assert pinned == f"{pushed.registry.host}/{REPOSITORY}/edge-rate-limiter-envoy:{pushed.version}@" \
                     f"{pushed.built['envoy']}", "push prints the digest build printed, pinned to the tag"
    manifest, content_type, digest = fetch_manifest(pushed, f"{repository}@{pinned.split('@')[1]}")
    assert digest == pinned.split("@")[1], "the digest push reported is the manifest's sha256"
    assert content_type == OCI_MANIFEST
    assert manifest["schemaVersion"] == 2
    _, _, tagged_digest = fetch_manifest(pushed, f"{repository}:{pushed.version}")
    assert tagged_digest == digest, "the version tag points at the pinned manifest"

    assert manifest["annotations"]["module.wasm.image/variant"] == "compat"
    assert manifest["annotations"][TITLE] == "edge-rate-limiter-envoy"
    assert manifest["annotations"]["org.opencontainers.image.version"] == pushed.version

    [layer] = manifest["layers"]
    assert layer["mediaType"] == TAR_GZIP
    data = blob(pushed, repository, layer)
    assert tar_members(data) == {"plugin.wasm": pushed.modules["envoy"]}, "only plugin.wasm, the artifact"

    assert manifest["config"]["mediaType"] == OCI_CONFIG
    config = json.loads(blob(pushed, repository, manifest["config"]))
    assert (config["os"], config["architecture"]) == ("wasip1", "wasm")
    uncompressed = "sha256:" + hashlib.sha256(gzip.decompress(data)).hexdigest()
    assert config["rootfs"] == {"type": "layers", "diff_ids": [uncompressed]}


def test_the_higress_image_has_higress_layout_and_oras_pulls_its_files(pushed: Pushed, tmp_path: Path) -> None:
    pinned = pushed.pinned["higress"]
    manifest, content_type, digest = fetch_manifest(pushed, f"{repository_of(pinned)}@{pinned.split('@')[1]}")
    assert (content_type, digest) == (OCI_MANIFEST, pushed.built["higress"])
    assert [(layer["mediaType"], layer["annotations"][TITLE]) for layer in manifest["layers"]] == [
        ("application/vnd.module.wasm.spec.v1+yaml", "spec.yaml"),
        ("application/vnd.module.wasm.doc.v1+markdown", "README.md"),
        (TAR_GZIP, "plugin.tar.gz"),  # the module last: the layer the gateway reads
    ]
    assert "module.wasm.image/variant" not in manifest["annotations"], "three layers: not the compat variant"
    assert manifest["annotations"]["org.opencontainers.image.version"] == pushed.version

    # oras-py writes each layer out under its title, and unpacks a tar+gzip layer where it would go.
    pushed.client().pull(target=pinned, outdir=str(tmp_path))
    assert sorted(path.name for path in tmp_path.iterdir()) == ["README.md", "plugin.wasm", "spec.yaml"]
    assert (tmp_path / "plugin.wasm").read_bytes() == pushed.modules["higress"]
    spec = yaml.safe_load((tmp_path / "spec.yaml").read_text())
    assert spec["apiVersion"] == "1.0.0"
    assert (spec["info"]["name"], spec["info"]["version"]) == ("edge-rate-limiter/v1", pushed.version)
    assert spec["spec"]["configSchema"]["openAPIV3Schema"]["required"] == ["redis", "rules"]
    assert "transport: host" in (tmp_path / "README.md").read_text()
    plugin_layer = manifest["layers"][-1]
    assert tar_members(blob(pushed, repository_of(pinned), plugin_layer)) == {"plugin.wasm": pushed.modules["higress"]}


def test_the_same_module_gives_the_same_digest_and_another_module_another(pushed: Pushed) -> None:
    again = build_digests(oci("build", "--dist", str(pushed.workdir / "dist"), "--out",
                              str(pushed.workdir / "oci-again")))
    assert again == pushed.built, "a second build of the same modules has the same digests"
    changed = pushed.workdir / "changed"
    changed.mkdir()
    # A custom section appended (id 0, name "x", no payload): still a valid module, other bytes.
    (changed / "edge-rate-limiter-envoy.wasm").write_bytes(pushed.modules["envoy"] + b"\x00\x02\x01x")
    [line] = oci("build", "--dist", str(changed), "--out", str(pushed.workdir / "oci-changed"))
    assert build_digests([line])["envoy"] != pushed.built["envoy"]
