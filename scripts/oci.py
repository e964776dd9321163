#!/usr/bin/env python3
"""`make oci` and `make push`: the artifacts of dist/ as OCI images that Istio and Higress pull (`oci://`).

    scripts/oci.py build [--dist dist] [--out dist/oci] [--artifact envoy ...]
    scripts/oci.py push REGISTRY [--tls-verify false] [--out dist/oci] [--artifact envoy ...]

`build` writes one OCI image layout per artifact, `<out>/edge-rate-limiter-<build>/`, tagged with the
version of Cargo.toml (`[package] version`), and prints `<layout>:<version> sha256:<manifest digest>`.
`push` copies each layout to `REGISTRY/edge-rate-limiter-<build>:<version>` (REGISTRY is `host[:port]/path`)
and prints the pinned reference `REGISTRY/edge-rate-limiter-<build>:<version>@sha256:<digest>`, the digest
the registry stores (the same as `build` printed). Credentials: `skopeo login HOST` first.

What the images hold (docs/deploying.md, "OCI images"):

- The stock builds (`envoy`, `envoy-regex`): the Wasm image specification's *compat* variant, which Istio's
  fetcher reads (solo-io/wasm spec/spec-compat.md; istio/istio pkg/wasm/imagefetcher.go,
  extractOCIStandardImage): an OCI image manifest whose one layer, `application/vnd.oci.image.layer.v1.tar+gzip`,
  holds `plugin.wasm`, and the manifest annotation `module.wasm.image/variant: compat` (required by
  spec-compat.md when the layer has that OCI media type).
- The Higress builds (`higress`, `higress-regex`): Higress's plugin image layout ("Wasm Plugin Image
  Specification", higress.cn/en/docs/latest/user/wasm-image-spec; source in higress-group/higress-group.github.io
  src/content/docs/latest/en/user/wasm-image-spec.md): one file per layer, `spec.yaml` as
  `application/vnd.module.wasm.spec.v1+yaml`, `README.md` as `application/vnd.module.wasm.doc.v1+markdown`, and
  `plugin.wasm` in the last layer, `application/vnd.oci.image.layer.v1.tar+gzip`. Higress's own tools push
  the metadata files as they are and the module as `plugin.tar.gz` (`oras push` in that page, section 4, and
  in alibaba/higress pkg/cmd/hgctl/plugin/build/templates.go), each layer named by the annotation
  `org.opencontainers.image.title` (what oras writes for a file, and reads back as its name; OCI image-spec
  annotations.md). The gateway reads only the last layer: Istio's fetcher (istio/istio
  pkg/wasm/imagefetcher.go, the same in Higress's fork higress-group/istio) takes `layers[len(layers)-1]`,
  checks its media type and looks for `plugin.wasm` in it.

Both carry the manifest annotations `org.opencontainers.image.title` (the image name),
`org.opencontainers.image.version` (Cargo.toml's version), `org.opencontainers.image.description` and
`org.opencontainers.image.licenses` (Cargo.toml's `description` and `license`), keys of OCI image-spec
annotations.md. The config is umoci's OCI image config with `os: wasip1`, `architecture: wasm`.

Tools: umoci (the layout, the tar+gzip layer by `umoci repack` of a bundle holding plugin.wasm, the config and
the manifest annotations) and skopeo (`skopeo copy --preserve-digests`: the registry gets the bytes built
here, so the digest printed by `build` is the one to pin). `umoci insert` is not used: umoci 0.4.7 (Debian)
leaves its layer's tar unterminated (opencontainers/umoci #436, fixed by #534), which GNU tar and Python's
tarfile refuse. umoci has no command to add a layer that is not a tar archive, so the two metadata layers of
the Higress image are added to the layout here, as the OCI image-layout spec lays out blobs (`blobs/sha256/`,
content addressed; `index.json` names the manifest), and the manifest is written anew around them.

Reproducible: the same .wasm and version give the same digest. The file's mtime, the config's `created`
(umoci config --created) are SOURCE_DATE_EPOCH (seconds; default 0, 1970-01-01T00:00:00Z), owner 0:0, mode
0644, no history entries; umoci's gzip writes no name or time.

Errors: a missing artifact, tool or Cargo.toml version, or a failing umoci or skopeo command (its stderr
shown) ends the script with exit code 1 and a message on stderr.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NAME = "edge-rate-limiter"

# Media types and annotations, with their sources (see the module docstring).
LAYER_TAR_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"  # OCI image-spec layer.md
MANIFEST_MEDIA_TYPE = "application/vnd.oci.image.manifest.v1+json"  # OCI image-spec manifest.md
HIGRESS_SPEC_MEDIA_TYPE = "application/vnd.module.wasm.spec.v1+yaml"  # Higress wasm-image-spec, section 2
HIGRESS_DOC_MEDIA_TYPE = "application/vnd.module.wasm.doc.v1+markdown"  # Higress wasm-image-spec, section 2
COMPAT_VARIANT = {"module.wasm.image/variant": "compat"}  # solo-io/wasm spec/spec-compat.md, "Annotation"
TITLE = "org.opencontainers.image.title"  # OCI image-spec annotations.md; oras names pulled files by it
REF_NAME = "org.opencontainers.image.ref.name"  # OCI image-spec image-layout.md: the tag in index.json
PLUGIN_FILE = "plugin.wasm"  # solo-io spec-compat.md "Layer"; Istio's extractWasmPluginBinary; Higress spec


class OciError(RuntimeError):
    """A step of `build` or `push` failed; the message says which and why."""


@dataclass(frozen=True)
class Package:
    """What Cargo.toml's `[package]` says about the module."""

    version: str
    description: str
    license: str


@dataclass(frozen=True)
class Image:
    """One built image: its OCI layout directory, the tag in it and the manifest's digest (`sha256:<hex>`)."""

    name: str  # edge-rate-limiter-<build>
    layout: Path
    tag: str
    digest: str

    @property
    def higress(self) -> bool:
        return is_higress(self.name)


def is_higress(name: str) -> bool:
    """The Higress builds (`make build`'s `higress`, `higress-regex`) get Higress's layout."""
    return name.removeprefix(f"{NAME}-").startswith("higress")


def read_package(cargo_toml: Path = REPO / "Cargo.toml") -> Package:
    """`[package]` of Cargo.toml read with tomllib; a `version.workspace = true` is looked up in
    `[workspace.package]`. OciError if there is no version."""
    data = tomllib.loads(cargo_toml.read_text())
    package, inherited = data.get("package", {}), data.get("workspace", {}).get("package", {})

    def field(key: str) -> str:
        value = package.get(key, "")
        return str(inherited.get(key, "") if isinstance(value, dict) and value.get("workspace") else value)

    version = field("version")
    if not version:
        raise OciError(f"{cargo_toml}: no [package] version")
    return Package(version, field("description"), field("license"))


def run(argv: list[str], what: str) -> str:
    """Runs a tool; its stdout, or OciError naming `what` with the tool's stderr."""
    if shutil.which(argv[0]) is None:
        raise OciError(f"{what}: {argv[0]} is not installed (make setup installs it)")
    result = subprocess.run(argv, capture_output=True, text=True, check=False, stdin=subprocess.DEVNULL)
    if result.returncode != 0:
        raise OciError(f"{what}: {' '.join(argv)} exited {result.returncode}\n{result.stderr.strip()}")
    return result.stdout


def source_date_epoch() -> int:
    """SOURCE_DATE_EPOCH (seconds since 1970, reproducible-builds.org), default 0."""
    return int(os.environ.get("SOURCE_DATE_EPOCH", "0"))


# ---------------------------------------------------------------------------------------------------------
# build


def build_image(wasm: Path, out: Path, package: Package, epoch: int) -> Image:
    """The OCI layout `<out>/<name>` (replaced if it exists) for one artifact, `dist/<name>.wasm`."""
    name = wasm.name.removesuffix(".wasm")
    layout, tag = out / name, package.version
    if layout.exists():
        shutil.rmtree(layout)
    layout.parent.mkdir(parents=True, exist_ok=True)
    image = f"{layout}:{tag}"
    run(["umoci", "init", "--layout", str(layout)], f"{name}: umoci init")
    run(["umoci", "new", "--image", image], f"{name}: umoci new")
    with tempfile.TemporaryDirectory(prefix="erl-oci-") as tmp:
        bundle = Path(tmp) / "bundle"
        # --rootless: no chown, so it runs as any user; files are recorded as owned by 0:0 either way.
        run(["umoci", "unpack", "--rootless", "--image", image, str(bundle)], f"{name}: umoci unpack")
        rootfs = bundle / "rootfs"
        plugin = rootfs / PLUGIN_FILE
        shutil.copyfile(wasm, plugin)
        plugin.chmod(0o644)
        # The root's mtime too: left as the copy set it, umoci would record the directory `.` in the layer.
        for path in (plugin, rootfs):
            os.utime(path, (epoch, epoch))
        run(["umoci", "repack", "--no-history", "--image", image, str(bundle)], f"{name}: umoci repack")
    created = datetime.fromtimestamp(epoch, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    annotations = {TITLE: name, "org.opencontainers.image.version": package.version,
                   "org.opencontainers.image.description": package.description,
                   "org.opencontainers.image.licenses": package.license}
    if not is_higress(name):
        annotations.update(COMPAT_VARIANT)
    config = ["umoci", "config", "--no-history", "--image", image, "--created", created, "--os", "wasip1",
              "--architecture", "wasm"]
    for key, value in annotations.items():
        config += ["--manifest.annotation", f"{key}={value}"]
    run(config, f"{name}: umoci config")
    if is_higress(name):
        add_higress_layers(layout, tag, package)
    # The blobs of the steps before (the empty image's manifest and config, ...) go.
    run(["umoci", "gc", "--layout", str(layout)], f"{name}: umoci gc")
    return Image(name, layout, tag, manifest_digest(layout, tag))


def add_higress_layers(layout: Path, tag: str, package: Package) -> None:
    """Puts `spec.yaml` and `README.md` in front of the plugin layer as layers of their own (raw files with
    Higress's media types), names every layer by its title annotation (the plugin layer `plugin.tar.gz`, as
    Higress's `oras push` names it), and writes the new manifest in place of the old in `index.json`."""
    index_path = layout / "index.json"
    index = json.loads(index_path.read_text())
    [entry] = [m for m in index["manifests"] if m.get("annotations", {}).get(REF_NAME) == tag]
    manifest = json.loads(blob_path(layout, entry["digest"]).read_bytes())
    [plugin_layer] = manifest["layers"]
    plugin_layer["annotations"] = {TITLE: "plugin.tar.gz"}
    metadata = [(higress_spec(package).encode(), HIGRESS_SPEC_MEDIA_TYPE, "spec.yaml"),
                (higress_readme(package).encode(), HIGRESS_DOC_MEDIA_TYPE, "README.md")]
    manifest["layers"] = [write_blob(layout, data, media_type, {TITLE: title})
                          for data, media_type, title in metadata] + [plugin_layer]
    entry.update(write_blob(layout, json.dumps(manifest, separators=(",", ":")).encode(), MANIFEST_MEDIA_TYPE))
    entry["annotations"] = {REF_NAME: tag}
    index_path.write_text(json.dumps(index, separators=(",", ":")))


def blob_path(layout: Path, digest: str) -> Path:
    """Where an OCI layout keeps a blob: `blobs/<algorithm>/<hex>` (OCI image-spec image-layout.md)."""
    algorithm, _, hex_digest = digest.partition(":")
    return layout / "blobs" / algorithm / hex_digest


def write_blob(layout: Path, data: bytes, media_type: str, annotations: dict[str, str] | None = None) -> dict:
    """Stores `data` as a blob of the layout; its descriptor (OCI image-spec descriptor.md)."""
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    blob_path(layout, digest).write_bytes(data)
    descriptor = {"mediaType": media_type, "digest": digest, "size": len(data)}
    return {**descriptor, "annotations": annotations} if annotations else descriptor


def manifest_digest(layout: Path, tag: str) -> str:
    """The digest of the manifest tagged `tag` in the layout's index.json."""
    index = json.loads((layout / "index.json").read_text())
    for manifest in index["manifests"]:
        if manifest.get("annotations", {}).get(REF_NAME) == tag:
            return str(manifest["digest"])
    raise OciError(f"{layout}: no manifest tagged {tag}")


def higress_spec(package: Package) -> str:
    """The image's `spec.yaml`, in the format of Higress's wasm-image-spec section 3 (apiVersion 1.0.0;
    `info`, then `spec` with phase, priority and the configuration's OpenAPI 3 schema). Phase and priority
    are those of envoy/higress-wasmplugin.yaml; the schema names the top-level fields of
    docs/configuration.md, which the plugin checks in full when it loads."""
    spec = {
        "apiVersion": "1.0.0",
        "info": {
            "category": "flow-control",
            "name": f"{NAME}/v1",
            "title": "Edge Rate Limiter",
            "description": package.description,
            "version": package.version,
        },
        "spec": {
            "phase": "UNSPECIFIED_PHASE",
            "priority": 20,
            "configSchema": {"openAPIV3Schema": {
                "type": "object",
                "properties": {
                    "redis": {"type": "object", "title": "Redis",
                              "description": "How Redis is reached: transport host, service_name, service_port, "
                                             "password, timeout (docs/configuration.md, redis)"},
                    "rules": {"type": "array", "title": "Rules",
                              "description": "What is limited, by which key, at which rate "
                                             "(docs/configuration.md, rules)",
                              "items": {"type": "object", "required": ["name", "limit_by", "rate", "interval"]}},
                    "failure_mode": {"type": "string", "enum": ["allow", "deny", "local"],
                                     "description": "When Redis fails: allow, deny or local (degraded mode)"},
                },
                "required": ["redis", "rules"],
            }},
        },
    }
    # JSON is YAML (YAML 1.2); written sorted and indented, the same bytes on every build.
    return json.dumps(spec, indent=2, sort_keys=True) + "\n"


def higress_readme(package: Package) -> str:
    """The image's `README.md` (Higress wasm-image-spec: required, usage documentation in Markdown)."""
    return (f"# {NAME} {package.version} (Higress build)\n\n{package.description}.\n\n"
            "Redis is reached through Higress's own Redis client (`redis.transport: host`), without a bridge.\n"
            "Every field of the configuration: docs/configuration.md in the source repository; a complete\n"
            "WasmPlugin: envoy/higress-wasmplugin.yaml.\n\n"
            "```yaml\nredis:\n  transport: host\n  service_name: redis.redis.svc.cluster.local\n"
            "  service_port: 6379\n  timeout: 200\nrules:\n  - name: per-ip\n    limit_by: client_ip\n"
            "    rate: 20\n    interval: 1s\nfailure_mode: allow\n```\n")


def artifacts(dist: Path, only: list[str]) -> list[Path]:
    """dist/edge-rate-limiter-<build>.wasm for each build in `only` (all of dist/ when empty)."""
    if only:
        paths = [dist / f"{NAME}-{build}.wasm" for build in only]
        missing = [str(path) for path in paths if not path.is_file()]
        if missing:
            raise OciError(f"no such artifact: {', '.join(missing)} (make build writes them)")
        return paths
    paths = sorted(dist.glob(f"{NAME}-*.wasm"))
    if not paths:
        raise OciError(f"no {NAME}-*.wasm in {dist} (make build writes them)")
    return paths


def build(dist: Path, out: Path, only: list[str]) -> list[Image]:
    """An image of each artifact; see the module docstring."""
    package, epoch = read_package(), source_date_epoch()
    return [build_image(wasm, out, package, epoch) for wasm in artifacts(dist, only)]


# ---------------------------------------------------------------------------------------------------------
# push


def push(images: list[Image], registry: str, tls_verify: bool) -> list[str]:
    """Copies each image to `registry/<name>:<tag>` with skopeo, byte for byte; returns the pinned
    references `registry/<name>:<tag>@sha256:<hex>`, the digest as skopeo reports the registry has it."""
    pinned = []
    with tempfile.TemporaryDirectory(prefix="erl-oci-push-") as tmp:
        for image in images:
            target = f"{registry.rstrip('/')}/{image.name}:{image.tag}"
            digest_file = Path(tmp) / f"{image.name}.digest"
            # --insecure-policy: no signature policy is asked of what this machine built (and a machine
            # without /etc/containers/policy.json can push); --preserve-digests: no recompression or
            # conversion, so the registry's digest is the layout's.
            argv = ["skopeo", "--insecure-policy", "copy", "--quiet", "--preserve-digests", "--format", "oci",
                    "--digestfile", str(digest_file), f"--dest-tls-verify={'true' if tls_verify else 'false'}",
                    f"oci:{image.layout}:{image.tag}", f"docker://{target}"]
            run(argv, f"{image.name}: skopeo copy to {target}")
            digest = digest_file.read_text().strip()
            if digest != image.digest:
                raise OciError(f"{target}: the registry has {digest}, the layout {image.digest}")
            pinned.append(f"{target}@{digest}")
    return pinned


def built_images(out: Path, only: list[str]) -> list[Image]:
    """The layouts `build` wrote to `out`, at Cargo.toml's version; OciError if there are none."""
    tag = read_package().version
    layouts = [out / f"{NAME}-{b}" for b in only] if only else sorted(out.glob(f"{NAME}-*"))
    images = [Image(layout.name, layout, tag, manifest_digest(layout, tag)) for layout in layouts
              if (layout / "index.json").is_file()]
    if not images:
        raise OciError(f"no image layouts in {out} (make oci builds them)")
    return images


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    build_command = commands.add_parser("build", help="an OCI image layout per artifact")
    build_command.add_argument("--dist", type=Path, default=REPO / "dist")
    push_command = commands.add_parser("push", help="copy the layouts to a registry")
    push_command.add_argument("registry", help="host[:port]/path, e.g. registry.example.com/gateway")
    push_command.add_argument("--tls-verify", choices=["true", "false"], default="true",
                              help="false: plain HTTP or a certificate not checked (a registry on loopback)")
    for command in (build_command, push_command):
        command.add_argument("--out", type=Path, default=REPO / "dist" / "oci")
        command.add_argument("--artifact", action="append", default=[],
                             help="a build of make build (envoy, higress, ...); repeatable; default: all")
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            for image in build(args.dist, args.out, args.artifact):
                print(f"{image.layout}:{image.tag} {image.digest}")
        else:
            for reference in push(built_images(args.out, args.artifact), args.registry, args.tls_verify == "true"):
                print(reference)
    except OciError as error:
        print(f"oci: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
