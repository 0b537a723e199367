"""Preparing a large corpus: time, peak memory, and a peer's start-up once prepared.

Generates two synthetic corpora (directories of ~8 MB text files: sentences drawn from a fixed word list,
so the BPE's working set stays bounded), prepares each in a fresh process (BPE training + the streaming
pass into the memory-mapped token file) and then builds the data object again in another fresh process
(what a peer does at start-up: it maps the prepared file). Peak RSS is each child's own (ru_maxrss).
The point: the preparation's memory is bounded, not proportional to the corpus.

    python -m benchmarks.data_prep                 # 250 MB and 1 GB
    python -m benchmarks.data_prep --sizes-mb 20,80 --keep /tmp/corpora   # quick
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FILE_MB = 8
WORDS = ("all the world is a stage and men women merely players they have their exits entrances one man in his "
         "time plays many parts acts being seven ages at first infant mewling puking nurse arms then whining "
         "schoolboy with satchel shining morning face creeping like snail unwillingly to school lover sighing "
         "furnace woeful ballad made mistress eyebrow soldier full strange oaths bearded pard jealous honour "
         "sudden quick quarrel seeking bubble reputation even cannon mouth justice fair round belly good capon "
         "lined eyes severe beard formal cut wise saws modern instances so he part").split()


def make_corpus(root: Path, megabytes: int, seed: int = 0) -> int:
    """Files of about FILE_MB MB of sentences until `megabytes` MB; returns the bytes written."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    written, i = 0, 0
    while written < megabytes * 2**20:
        lines = []
        size = 0
        while size < FILE_MB * 2**20:
            line = " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 18))).capitalize() + ".\n"
            lines.append(line)
            size += len(line)
        (root / f"doc{i:05d}.txt").write_text("".join(lines))
        written += size
        i += 1
    return written


CHILD = """
import json, resource, sys, time
from checkfree.config import DataConfig
from checkfree.data import build_data
cfg = DataConfig(source=sys.argv[1], cache_dir=sys.argv[2])
t0 = time.perf_counter()
d = build_data(cfg, vocab_size=4096, context_length=256, seed=0, microbatch_size=8, progress=False)
x, _ = d.batch(12345, 3)
print(json.dumps({"seconds": time.perf_counter() - t0, "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "sequences": len(d.train) + len(d.val), "tokens": (len(d.train) + len(d.val)) * 257}))
"""


def child(corpus: Path, cache: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, str(corpus), str(cache)], capture_output=True, text=True,
                          timeout=7200)
    if done.returncode != 0:
        raise SystemExit(f"preparing {corpus} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mb", default="250,1024", help="corpus sizes in MB")
    p.add_argument("--keep", help="keep the corpora and caches in this directory (default: a temporary one)")
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes_mb.split(",")]
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="checkfree-data-"))
    print(f"cores={os.cpu_count()} load average {os.getloadavg()[0]:.2f}; corpora in {root}", flush=True)
    rows = []
    try:
        for mb in sizes:
            corpus, cache = root / f"corpus-{mb}mb", root / f"cache-{mb}mb"
            t0 = time.perf_counter()
            nbytes = make_corpus(corpus, mb)
            print(f"{mb} MB corpus generated ({nbytes / 2**20:.0f} MiB) in {time.perf_counter() - t0:.0f} s", flush=True)
            prep = child(corpus, cache)
            start = child(corpus, cache)
            rows.append((mb, nbytes, prep, start))
            print(f"{mb} MB: prepared in {prep['seconds']:.1f} s, peak RSS {prep['peak_mib']:.0f} MiB, "
                  f"{prep['tokens'] / 1e6:.1f} M tokens; start-up once prepared {start['seconds']:.2f} s, "
                  f"peak RSS {start['peak_mib']:.0f} MiB", flush=True)
            if not args.keep:
                shutil.rmtree(corpus)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print("\n| corpus | preparation | peak RSS preparing | tokens | start-up once prepared | peak RSS at start-up |")
    print("|---|---|---|---|---|---|")
    for mb, nbytes, prep, start in rows:
        print(f"| {nbytes / 2**20:.0f} MiB | {prep['seconds']:.1f} s | {prep['peak_mib']:.0f} MiB | "
              f"{prep['tokens'] / 1e6:.1f} M | {start['seconds']:.2f} s | {start['peak_mib']:.0f} MiB |")
    if len(rows) >= 2:
        (_, na, pa, _), (_, nb, pb, _) = rows[0], rows[-1]
        print(f"data prep peak RSS ratio ({nb / 2**20:.0f} vs {na / 2**20:.0f} MiB corpus, x{nb / na:.1f} larger): "
              f"{pb['peak_mib'] / pa['peak_mib']:.2f}")


if __name__ == "__main__":
    main()
