"""Data pipeline speed (issue 33), measured in one run: tokenization throughput, the loader's
rows per second against the tiny preset's training need, and the host memory of training from a
small and from a large tokenized corpus.

    python scripts/data_speed.py                  # ~50 MB of text, a 10 MB and a 2 GB corpus
    python scripts/data_speed.py --quick          # small sizes, for a smoke run
    python scripts/data_speed.py --json out.json --workdir /tmp/ds --keep

1. ``jaxpar tokenize`` in a subprocess (what a user gets, interpreter start-up included) over
   ``--text-mb`` of generated text, with the byte tokenizer and with a BPE ``tokenizer.json``
   trained here, ``--workers 1`` and ``2``: MB/s of text and tokens/s.
2. ``DataIterator`` over a tokenized directory at the tiny preset's batch (train.batch_size rows
   of train.seq_len), rows/s, against the rows/s a short ``jaxpar train tiny`` run consumes
   (its ``step_time_s`` after warm-up); goal: the loader at least 20x ahead.
3. Peak RSS of ``jaxpar train tiny`` (one host device, no checkpoints) from a 10 MB and from a
   2 GB tokenized corpus, each in its own subprocess; goal: within 64 MiB of each other.

The two training corpora are not tokenized from text: they are written directly with the shard
writer (random byte ids, documents of random length), so 2 GB costs a disk write, not an hour of
tokenizing; the train runs read them as any ``jaxpar tokenize`` output. The figures come from
whatever machine runs this, sharing its cores with whatever else runs: the load average is
printed beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from jaxpar.config import load_config
from jaxpar.data import DataIterator, open_tokenized
from jaxpar.data.pretokenize import DEFAULT_SHARD_TOKENS
from jaxpar.data.shards import (
    INDEX_FILE,
    ShardWriter,
    TokenIndex,
    token_dtype,
    tokenizer_info,
    write_json_atomically,
)
from jaxpar.data.tokenizer import make_tokenizer

MB = 10**6  # text throughput in decimal MB/s, as disks and networks are quoted
MIB = 2**20
LOADER_GOAL = 20.0  # the loader keeps at least this many times ahead of the train step
MEMORY_GOAL_MIB = 64.0  # peak RSS, large corpus minus small corpus
WARMUP_STEPS = 10  # metrics rows up to this step are left out of the step time (compile, warm-up)


# -- 1. tokenization ----------------------------------------------------------------------------


def write_text(path: Path, megabytes: float, seed: int = 0) -> int:
    """A .jsonl of documents of 1-8 KB made of Zipf-distributed made-up words (so BPE has
    frequent and rare words to merge, as in real text); deterministic. Returns its text bytes."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    lengths = rng.integers(2, 10, size=20_000)
    vocab = ["".join(rng.choice(letters, size=n)) for n in lengths]
    target, written = int(megabytes * MB), 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            words = rng.zipf(1.3, size=int(rng.integers(150, 1200))) % len(vocab)
            text = " ".join(vocab[w] for w in words) + "."
            f.write(json.dumps({"text": text}) + "\n")
            written += len(text.encode("utf-8"))
    return written


def train_bpe(path: Path, corpus: Path, vocab_size: int, sample_bytes: int) -> Path:
    """A byte-level BPE tokenizer.json (end-of-text id 0) trained on the corpus's first
    `sample_bytes`: enough for its merges, and quick."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def sample():
        seen = 0
        with open(corpus, encoding="utf-8") as f:
            for line in f:
                text = json.loads(line)["text"]
                yield text
                seen += len(text)
                if seen >= sample_bytes:
                    return

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(sample(), trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.save(str(path))
    return path


def jaxpar(*args: str) -> list[str]:
    """The command line of ``jaxpar ARGS`` under this interpreter."""
    return [sys.executable, "-m", "jaxpar.cli", *args]


def time_tokenize(corpus: Path, out: Path, tokenizer: str, workers: int,
                  text_bytes: int) -> dict:
    """One ``jaxpar tokenize`` subprocess, wall-clock timed (start-up included)."""
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    subprocess.run(jaxpar("tokenize", str(corpus), "--to", str(out), "--tokenizer", tokenizer,
                          "--workers", str(workers)), check=True, capture_output=True)
    seconds = time.perf_counter() - start
    tokens = json.loads((out / INDEX_FILE).read_text())["total"]["tokens"]
    return {"tokenizer": "byte" if tokenizer == "byte" else "bpe", "workers": workers,
            "seconds": seconds, "text_mb_per_s": text_bytes / MB / seconds,
            "tokens_per_s": tokens / seconds, "tokens": tokens}


# -- 2 and 3: synthetic tokenized corpora, the loader, training runs ----------------------------


def write_corpus(directory: Path, megabytes: float, seed: int) -> int:
    """A tokenized directory of about `megabytes` of uint16 byte-tokenizer ids, written with
    the shard writer (no text, no tokenizer): random ids, documents of 256-8191 tokens, shards
    of the default size, a train split only. Returns its token count."""
    tokenizer = make_tokenizer("byte")
    dtype = token_dtype(tokenizer.vocab_size)
    total = int(megabytes * MB) // np.dtype(dtype).itemsize
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    shards, written, chunk = [], 0, 1 << 22  # 4 Mi tokens per write
    while written < total:
        writer = ShardWriter(directory, "train", len(shards), dtype)
        while writer.tokens < DEFAULT_SHARD_TOKENS and written < total:
            n = min(chunk, total - written)
            ids = rng.integers(1, tokenizer.vocab_size, size=n, dtype=np.uint16)
            starts = np.concatenate([[0], np.cumsum(rng.integers(256, 8192, size=n // 256))])
            starts = starts[starts < n]
            ids[starts[1:] - 1] = tokenizer.eos_id  # each document ends with end-of-text
            ids[-1] = tokenizer.eos_id
            writer.add(ids, starts)
            written += n
        shards.append(writer.finish())
    index = TokenIndex(tokenizer=tokenizer_info(tokenizer, "byte"), dtype=dtype,
                       sources=("synthetic (scripts/data_speed.py)",), text_field="text",
                       val_fraction=0.0, shard_tokens=DEFAULT_SHARD_TOKENS,
                       splits={"train": tuple(shards)})
    write_json_atomically(directory / INDEX_FILE, index.to_json())
    return written


def loader_rows_per_s(directory: Path, batch: int, seq_len: int, seconds: float) -> float:
    """Rows/s of DataIterator (shuffled, the whole global batch) over `directory`, read for
    about `seconds` after one warm-up batch."""
    ds = open_tokenized(str(directory), "train", seq_len, tokenizer="byte")
    it = DataIterator(ds, global_batch=batch, seed=0)
    next(it)
    batches, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        for _ in range(100):
            next(it)
        batches += 100
    return batches * batch / elapsed


def train(directory: Path, run_dir: Path, steps: int) -> dict:
    """``jaxpar train tiny`` on one host device from `directory`: its peak RSS and median step
    time after warm-up. os.wait4 gives this child's own rusage (RUSAGE_CHILDREN would be the
    maximum over every child this script has run, the tokenizer runs included)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    cmd = jaxpar("train", "tiny", f"data.source={directory}", "data.tokenizer=byte",
                 f"train.steps={steps}", "host_devices=1", "checkpoint.enabled=false",
                 "logging.every=5", f"run_dir={run_dir}")
    with open(run_dir.with_name(run_dir.name + ".log"), "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env={k: v for k, v in os.environ.items()
                                     if k not in ("XLA_FLAGS", "JAX_PLATFORMS")})
        # RssAnon and RssFile apart tell the process's own memory from the mapped shard pages
        # it touched (file-backed, shared with the page cache): sampled while it runs.
        peaks = {"RssAnon": 0, "RssFile": 0}
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            for key, kib in _status(proc.pid).items():
                peaks[key] = max(peaks[key], kib)
            time.sleep(0.02)
        proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}); see {log.name}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in rows if r["step"] > WARMUP_STEPS]
    return {"peak_rss_mib": usage.ru_maxrss * 1024 / MIB,  # ru_maxrss is in KiB on Linux
            "peak_anon_mib": peaks["RssAnon"] * 1024 / MIB,
            "peak_file_mib": peaks["RssFile"] * 1024 / MIB,
            "step_time_s": statistics.median(times)}


def _status(pid: int) -> dict[str, int]:
    """RssAnon and RssFile of a running process, KiB (empty once it has exited)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    fields = dict(line.split(":", 1) for line in lines if ":" in line)
    return {k: int(fields[k].split()[0]) for k in ("RssAnon", "RssFile") if k in fields}


# -- the run ------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--text-mb", type=float, help="MB of text to tokenize (default 50; "
                        "--quick 2)")
    parser.add_argument("--small-mb", type=float, default=10, help="the small corpus, MB")
    parser.add_argument("--large-mb", type=float, help="the large corpus, MB (default 2000; "
                        "--quick 50)")
    parser.add_argument("--steps", type=int, help="train steps per run (default 60; --quick 20)")
    parser.add_argument("--workdir", metavar="DIR", help="where the corpora go (default: a new "
                        "directory in the temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the workdir")
    parser.add_argument("--json", metavar="FILE", help="write every figure as JSON")
    args = parser.parse_args()
    text_mb = args.text_mb or (2 if args.quick else 50)
    large_mb = args.large_mb or (50 if args.quick else 2000)
    steps = args.steps or (20 if args.quick else 60)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="jaxpar-data-speed-"))
    work.mkdir(parents=True, exist_ok=True)
    cfg = load_config("tiny", [])
    batch, seq_len = cfg.train.batch_size, cfg.train.seq_len
    out: dict = {"load_average_start": os.getloadavg(), "cores": os.cpu_count()}
    try:
        print(f"load average at start {_load()} on {os.cpu_count()} cores (a shared machine: "
              "others' work counts in every figure)", flush=True)

        print(f"\n== tokenization: {text_mb:g} MB of text, jaxpar tokenize in a subprocess")
        corpus = work / "text.jsonl"
        text_bytes = write_text(corpus, text_mb)
        bpe = train_bpe(work / "tokenizer.json", corpus, 4096, min(text_bytes, 4 * MB))
        print(f"{'tokenizer':<10} {'workers':>7} {'s':>7} {'MB/s':>7} {'tokens/s':>12}")
        out["tokenize"] = []
        for tokenizer in ("byte", str(bpe)):
            for workers in (1, 2):
                r = time_tokenize(corpus, work / "tokenized", tokenizer, workers, text_bytes)
                out["tokenize"].append(r)
                print(f"{r['tokenizer']:<10} {workers:>7} {r['seconds']:7.2f} "
                      f"{r['text_mb_per_s']:7.2f} {r['tokens_per_s']:12,.0f}", flush=True)
        out["text_bytes"] = text_bytes

        print(f"\n== corpora: {args.small_mb:g} MB and {large_mb:g} MB of uint16 ids, written "
              "with the shard writer (random ids, not tokenized text)")
        corpora = {}
        for name, mb, seed in (("small", args.small_mb, 1), ("large", large_mb, 2)):
            start = time.perf_counter()
            tokens = write_corpus(work / name, mb, seed)
            corpora[name] = {"megabytes": mb, "tokens": tokens}
            print(f"{name}: {tokens:,} tokens in {time.perf_counter() - start:.1f} s", flush=True)
        out["corpora"] = corpora

        print(f"\n== loader against training: tiny, batch {batch} x seq_len {seq_len}")
        runs = {name: train(work / name, work / f"run-{name}", steps) for name in corpora}
        loader = {name: loader_rows_per_s(work / name, batch, seq_len, 2 if args.quick else 5)
                  for name in corpora}
        need = batch / runs["small"]["step_time_s"]
        for name in corpora:
            print(f"DataIterator over the {name} corpus: {loader[name]:,.0f} rows/s, "
                  f"{loader[name] / need:.1f}x the training need")
        step_ms = runs["small"]["step_time_s"] * 1e3
        print(f"training need: {need:,.0f} rows/s (median step {step_ms:.2f} ms after step"
              f" {WARMUP_STEPS}, host_devices=1, from the small corpus)")
        worst = min(loader.values()) / need
        print(f"loader / need: {worst:.1f}x ({'meets' if worst >= LOADER_GOAL else 'misses'} "
              f"the {LOADER_GOAL:g}x goal)", flush=True)
        out["loader"] = {"rows_per_s": loader, "need_rows_per_s": need, "ratio": worst,
                         "goal": LOADER_GOAL}

        print(f"\n== host memory: peak RSS of jaxpar train tiny ({steps} steps, host_devices=1)")
        for name in corpora:
            r = runs[name]
            print(f"{name} corpus ({corpora[name]['megabytes']:g} MB): peak RSS "
                  f"{r['peak_rss_mib']:,.1f} MiB (sampled peaks: anonymous "
                  f"{r['peak_anon_mib']:,.1f} MiB, file-backed {r['peak_file_mib']:,.1f} MiB)")
        diff = runs["large"]["peak_rss_mib"] - runs["small"]["peak_rss_mib"]
        verdict = "meets" if abs(diff) <= MEMORY_GOAL_MIB else "misses"
        print(f"large - small: {diff:+.1f} MiB ({verdict} "
              f"the {MEMORY_GOAL_MIB:g} MiB goal)")
        anon = runs["large"]["peak_anon_mib"] - runs["small"]["peak_anon_mib"]
        print(f"anonymous memory alone (the process's own), large - small: {anon:+.1f} MiB")
        print(f"(a run reads {steps * batch} rows; each touched row maps the shard's pages "
              "around it, which count in RSS as file-backed pages)")
        out["train"] = runs
        out["memory"] = {"difference_mib": diff, "anonymous_difference_mib": anon,
                         "goal_mib": MEMORY_GOAL_MIB}
        out["load_average_end"] = os.getloadavg()
        print(f"\nload average at end {_load()}")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


if __name__ == "__main__":
    raise SystemExit(main())
