"""Build what is missing of the control plane (``make control-plane``; ``make test`` runs it first).

    python tests/controlplane/build.py            # build every component not in the cache yet
    python tests/controlplane/build.py --check    # exit 1, naming them, if any is missing

A component is built with ``CGO_ENABLED=0`` (Kubernetes builds these statically too) into a temporary
folder beside its cache folder, then renamed into place with a ``.complete`` marker last: a build
killed half-way leaves nothing that looks built. On this machine (2 cores) a first build of everything
takes ~8 min with empty Go caches, half of it Kubernetes; once built, nothing is compiled again.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from controlplane.components import ALL, Component  # noqa: E402


def _go() -> str | None:
    """``go`` on PATH, else the official tarball's place (a PATH without it is common for CI shells)."""
    return shutil.which("go") or next((p for p in ("/usr/local/go/bin/go",) if os.access(p, os.X_OK)), None)


def _go_env() -> dict[str, str]:
    # -buildvcs=false: the module sits in a git work tree whose state is not the binary's version.
    return {**os.environ, "CGO_ENABLED": "0", "GOFLAGS": "-buildvcs=false -mod=readonly"}


def _module_dir(module_at_version: str, cwd: Path) -> Path:
    out = subprocess.run([GO, "mod", "download", "-json", module_at_version], cwd=cwd, env=_go_env(),
                         check=True, capture_output=True, text=True).stdout
    return Path(json.loads(out)["Dir"])


GO = _go()


def build(component: Component) -> None:
    started = time.monotonic()
    target = component.directory
    staging = target.with_name(target.name + ".building")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    print(f"control plane: building {component.name} {component.version} into {target} "
          f"({', '.join(component.binaries)}; a first build takes minutes)", flush=True)
    for package, binary in zip(component.packages, component.binaries, strict=True):
        print(f"control plane:   go build {package} ...", flush=True)
        command = [GO, "build", "-trimpath", "-ldflags", " ".join(("-s", "-w", *component.ldflags)),
                   *(["-tags", ",".join(component.tags)] if component.tags else []), "-o", str(staging / binary), package]
        subprocess.run(command, cwd=component.module_dir, env=_go_env(), check=True)
    for module, folder, name in component.data:
        source = _module_dir(module, component.module_dir) / folder
        (staging / name).mkdir()
        for path in sorted(source.glob("*.yaml")):
            if path.name not in ("kustomization.yaml", "kustomizeconfig.yaml"):
                shutil.copyfile(path, staging / name / path.name)
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    (target / ".complete").write_text(f"{component.name} {component.version}\n")
    print(f"control plane: {component.name} {component.version} built in {time.monotonic() - started:.0f} s", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only report what is missing (exit 1 if anything is)")
    args = parser.parse_args()
    missing = [c for c in ALL if not c.is_built()]
    if args.check:
        for component in missing:
            print(f"control plane: {component.name} {component.version} is not built ({component.directory})")
        return 1 if missing else 0
    if not missing:
        print(f"control plane: every component is built (cache {ALL[0].directory.parent})")
        return 0
    if GO is None:
        print("control plane: no `go` on PATH nor in /usr/local/go/bin; the Kubernetes tests need Go >= 1.24 and "
              "its module proxy to build " + ", ".join(f"{c.name} {c.version}" for c in missing), file=sys.stderr)
        return 2
    for index, component in enumerate(missing, 1):
        print(f"control plane: [{index}/{len(missing)}]", end=" ", flush=True)
        try:
            build(component)
        except subprocess.CalledProcessError as error:
            print(f"control plane: building {component.name} {component.version} failed: "
                  f"`{' '.join(map(str, error.cmd))}` exited {error.returncode}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
