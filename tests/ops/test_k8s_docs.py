"""deploy/k8s/ against docs/DEPLOY.md, from the manifests as yaml: every Ingress terminates TLS for its hosts; every
Secret a manifest reads (API keys, TLS certificates) and the namespace they live in are created by the page's own
commands; every `kubectl` command there and in the manifests' comments names the namespace; every image the
manifests and the GPU patch run is built on the page (the GPU one with a CUDA torch) and loaded into the cluster."""

from __future__ import annotations

import re
import shlex
from typing import Any

import yaml

from tests.ops.tools import DEPLOY, REPO

K8S = DEPLOY / "k8s"
DOC = REPO / "docs" / "DEPLOY.md"


def manifests() -> list[dict[str, Any]]:
    """Every document of every manifest, the GPU patch included."""
    return [d for p in sorted(K8S.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]


def doc_commands(text: str, program: str) -> list[list[str]]:
    """The `program` command lines of the page's shell blocks and inline code, backslash continuations joined,
    each split as the shell would (comments dropped)."""
    text = text.replace("\\\n", " ")
    lines = [m for m in re.findall(rf"(?:^|`)\s*({program} [^`\n]*)", text, flags=re.M)]
    return [shlex.split(line, comments=True) for line in lines]


def namespaces() -> set[str]:
    return {d["metadata"]["namespace"] for d in manifests() if "metadata" in d}


def pod_specs() -> list[dict[str, Any]]:
    return [d["spec"]["template"]["spec"] for d in manifests()
            if d.get("kind") in ("Deployment", "StatefulSet", "Job")]


def secret_key_refs() -> set[tuple[str, str]]:
    """(Secret, key) of every secretKeyRef of every container."""
    refs = set()
    for pod in pod_specs():
        for c in [*pod.get("initContainers", []), *pod["containers"]]:
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    refs.add((ref["name"], ref["key"]))
    return refs


def ingresses() -> list[dict[str, Any]]:
    return [d for d in manifests() if d.get("kind") == "Ingress"]


def created_secrets(kind: str) -> dict[str, list[str]]:
    """{name: the command's words} of the page's `kubectl create secret KIND NAME ...` lines."""
    return {cmd[4]: cmd for cmd in doc_commands(DOC.read_text(), "kubectl")
            if cmd[1:4] == ["create", "secret", kind]}


def test_every_ingress_terminates_tls_for_each_of_its_hosts() -> None:
    assert {i["metadata"]["name"] for i in ingresses()} == {"specsplit-rest", "specsplit-grpc"}
    for ing in ingresses():
        hosts = {r["host"] for r in ing["spec"]["rules"]}
        tls = ing["spec"].get("tls", [])
        assert tls, f"the Ingress {ing['metadata']['name']} has no tls: section"
        covered = {h for t in tls for h in t["hosts"]}
        assert hosts <= covered and all(t.get("secretName") for t in tls), ing["metadata"]["name"]


def test_the_namespace_and_every_secret_the_manifests_read_are_created_on_the_page() -> None:
    (namespace,) = namespaces()
    kubectl = doc_commands(DOC.read_text(), "kubectl")
    assert ["kubectl", "create", "namespace", namespace] in kubectl
    generic = created_secrets("generic")
    assert secret_key_refs() == {("specsplit-api-keys", "keys")}
    for name, key in secret_key_refs():
        assert name in generic, f"docs/DEPLOY.md does not create the Secret {name}"
        cmd = generic[name]
        assert cmd[cmd.index("-n") + 1] == namespace
        assert any(w.startswith(f"--from-literal={key}=") for w in cmd), cmd
    tls = created_secrets("tls")
    for ing in ingresses():
        for t in ing["spec"]["tls"]:
            assert t["secretName"] in tls, f"docs/DEPLOY.md does not create the TLS Secret {t['secretName']}"
            cmd = tls[t["secretName"]]
            assert cmd[cmd.index("-n") + 1] == namespace and any(w.startswith("--cert=") for w in cmd)
            assert any(w.startswith("--key=") for w in cmd), cmd


def test_the_pages_certificate_names_every_ingress_host() -> None:
    """The page's self-signed certificate for the Ingresses has a DNS: entry for every host they serve."""
    (openssl,) = [c for c in doc_commands(DOC.read_text(), "openssl") if "-x509" in c]
    san = next(w for w in openssl if w.startswith("subjectAltName="))
    names = set(re.findall(r"DNS:([^,]+)", san))
    assert {r["host"] for ing in ingresses() for r in ing["spec"]["rules"]} <= names, san


def manifest_comment_commands() -> list[list[str]]:
    text = "\n".join(re.sub(r"^\s*#\s?", "", line) for p in sorted(K8S.glob("*.yaml"))
                     for line in p.read_text().splitlines() if line.lstrip().startswith("#"))
    return doc_commands(text, "kubectl")


def test_every_kubectl_command_names_the_namespace() -> None:
    """Every kubectl line of the page and of the manifests' comments, except creating the namespace and applying
    files (whose objects name it), says `-n NAMESPACE`."""
    (namespace,) = namespaces()
    commands = [*doc_commands(DOC.read_text(), "kubectl"), *manifest_comment_commands()]
    assert any(c[1] == "wait" for c in commands)
    for cmd in commands:
        if cmd[1:3] == ["create", "namespace"] or cmd[1] == "apply":
            continue
        assert "-n" in cmd and cmd[cmd.index("-n") + 1] == namespace, shlex.join(cmd)


def images() -> dict[str, set[str]]:
    """{image: the files that run it}: every container of every manifest, and the GPU patch's."""
    out: dict[str, set[str]] = {}
    for p in sorted(K8S.glob("*.yaml")):
        for d in yaml.safe_load_all(p.read_text()):
            pod = (d or {}).get("spec", {}).get("template", {}).get("spec", {})
            for c in [*pod.get("initContainers", []), *pod.get("containers", [])]:
                if "image" in c:
                    out.setdefault(c["image"], set()).add(p.name)
    return out


def test_every_image_is_built_on_the_page_and_loaded_into_the_cluster() -> None:
    text = DOC.read_text()
    built = {cmd[cmd.index("-t") + 1]: cmd for cmd in doc_commands(text, "docker") if cmd[1] == "build"}
    loaded = {cmd[-1] for cmd in doc_commands(text, "kind")} | {cmd[-1] for cmd in doc_commands(text, "minikube")}
    for image, files in images().items():
        assert image in built, f"{image} ({', '.join(sorted(files))}) is not built in docs/DEPLOY.md"
        assert image in loaded, f"{image} is built but not loaded into the cluster in docs/DEPLOY.md"


def test_the_gpu_patch_runs_an_image_with_a_cuda_torch() -> None:
    """The patch pins the device to cuda: it must not keep the CPU image, whose torch is the CPU build."""
    (patched,) = yaml.safe_load((K8S / "gpu-patch.yaml").read_text())["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in patched["env"]}
    assert env["SPECSPLIT_CLOUD_DEVICE"] == "cuda"
    cpu_images = {c["image"] for d in yaml.safe_load_all((K8S / "cloud.yaml").read_text())
                  if d and d["kind"] == "Deployment" for c in d["spec"]["template"]["spec"]["containers"]}
    assert patched.get("image") and patched["image"] not in cpu_images
    built = {cmd[cmd.index("-t") + 1]: cmd for cmd in doc_commands(DOC.read_text(), "docker") if cmd[1] == "build"}
    args = [w for w in built[patched["image"]] if w.startswith("TORCH_INDEX_URL=")]
    assert args and re.search(r"/whl/cu\d+$", args[0]), built[patched["image"]]
