"""MkDocs hooks of this site (mkdocs.yml `hooks:`): measured numbers come from committed result files, never
retyped, and the experiments page is experiments/README.md itself.

In a page, a directive (an HTML comment, so it is invisible on GitHub) is replaced at build time:

    <!-- result FILE -->                      the whole file, as a text block
    <!-- result FILE table -->                the first Markdown table in it
    <!-- result FILE line="PREFIX" -->        the first line starting with PREFIX, as inline code
    <!-- result FILE block="PREFIX" -->       from the first line starting with PREFIX to the next blank line
    <!-- result FILE grep="TEXT" -->          every line containing TEXT, as a text block
    <!-- result FILE after="TEXT" ... -->     any of those, searched from the first line starting with TEXT on
                                             (several after= narrow it step by step; before="TEXT" ends the
                                             search at the next line starting with TEXT)
    <!-- include FILE -->                     FILE's Markdown (its links made relative to this page)

FILE is relative to the repository root. A missing file, prefix or table stops the build: a re-run benchmark
whose output changed shape shows up as a failed `make docs`, not as a wrong number on a page.
"""

from __future__ import annotations

import posixpath
import re
import shlex
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

__all__ = ["on_files", "on_page_markdown"]

ROOT = Path(__file__).resolve().parent.parent
DIRECTIVE = re.compile(r"<!--\s*(result|include)\s+(.+?)\s*-->")
LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")
# Files of the repository published with the site, under the same path (the experiments' figures and tables).
PUBLISHED = [("experiments/results", (".png", ".md")), ("benchmarks/results/accelerator/science", (".png",))]


def on_files(files: Files, config) -> Files:
    for folder, suffixes in PUBLISHED:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in suffixes and "runs" not in path.relative_to(ROOT).parts:
                files.append(File(path.relative_to(ROOT).as_posix(), str(ROOT), config["site_dir"],
                                  config["use_directory_urls"]))
    return files


def on_page_markdown(markdown: str, page, config, files: Files) -> str:
    def replace(match: re.Match) -> str:
        kind, words = match.group(1), shlex.split(match.group(2))
        where = f"{page.file.src_uri}: <!-- {kind} {match.group(2)} -->"
        path = ROOT / words[0]
        if not path.is_file():
            raise PluginError(f"{where}: no such file {words[0]}")
        if kind == "include":
            return _relink(path.read_text(), words[0], page.file.src_uri, files)
        return _result(path.read_text().splitlines(), [_option(w) for w in words[1:]], where)

    markdown = DIRECTIVE.sub(replace, markdown)
    # A page's own links out of docs/ (`../experiments/...`, right on GitHub): re-aimed at the published copy.
    return _relink(markdown, posixpath.join("docs", page.file.src_uri), page.file.src_uri, files, outside_only=True)


def _option(word: str) -> tuple[str, str]:
    key, _, value = word.partition("=")
    return key, value


def _result(lines: list[str], options: list[tuple[str, str]], where: str) -> str:
    start = 0
    for key, value in options:
        if key == "after":
            start = _find(lines, value, start, where)
    opts = dict(options)
    if "before" in opts:
        lines = lines[: _find(lines, opts["before"], start + 1, where)]
    if "table" in opts:
        first = next((i for i in range(start, len(lines)) if lines[i].startswith("|")), None)
        if first is None:
            raise PluginError(f"{where}: no Markdown table")
        end = next((i for i in range(first, len(lines)) if not lines[i].startswith("|")), len(lines))
        return "\n".join(lines[first:end])
    if "line" in opts:
        return f"`{lines[_find(lines, opts['line'], start, where)].strip()}`"
    if "grep" in opts:
        hits = [line for line in lines[start:] if opts["grep"] in line]
        if not hits:
            raise PluginError(f"{where}: no line contains {opts['grep']!r}")
        return _fenced(hits)
    if "block" in opts:
        first = _find(lines, opts["block"], start, where)
        end = next((i for i in range(first, len(lines)) if not lines[i].strip()), len(lines))
        return _fenced(lines[first:end])
    return _fenced(lines[start:])


def _find(lines: list[str], prefix: str, start: int, where: str) -> int:
    for i in range(start, len(lines)):
        if lines[i].lstrip().startswith(prefix):
            return i
    raise PluginError(f"{where}: no line starts with {prefix!r}")


def _fenced(lines: list[str]) -> str:
    return "```text\n" + "\n".join(lines) + "\n```"


def _relink(text: str, source: str, page: str, files: Files, *, outside_only: bool = False) -> str:
    """`source`'s relative links re-aimed from its folder to the page's: a target the site publishes stays a link,
    any other (a folder, a data file, a page of the repository outside the site) becomes its repository path.
    `outside_only`: only the links that leave docs/ (`../...`)."""
    base, here = posixpath.dirname(source), posixpath.dirname(page)

    def fix(match: re.Match) -> str:
        bang, label, target = match.groups()
        if re.match(r"[a-z]+:|#|/", target) or (outside_only and not target.startswith("../")):
            return match.group(0)
        path, _, anchor = target.partition("#")
        repo_path = posixpath.normpath(posixpath.join(base, path))
        if files.get_file_from_path(repo_path) is not None:
            return f"{bang}[{label}]({posixpath.relpath(repo_path, here or '.')}{'#' + anchor if anchor else ''})"
        return f"{label} (`{repo_path}`)" if label else f"`{repo_path}`"

    return LINK.sub(fix, text)


