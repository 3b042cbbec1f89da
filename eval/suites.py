"""Evaluation suites: which lm-eval tasks `commbench eval RUN_DIR --suite NAME` runs.

- `smoke`: four tasks built from the held-out split of the run's own corpus, written as
  lm-eval task YAMLs plus JSON-lines data into `data.cache_dir` and loaded with
  `TaskManager(include_path=..., include_defaults=False)`: nothing comes from the hub, so
  it runs offline in seconds. It checks the whole evaluation path, not model quality.
    smoke_cloze   next word after 20 words (loglikelihood; acc = greedy, perplexity)
    smoke_choice  which of 4 eight-word continuations follows (multiple_choice; acc)
    smoke_gen     greedy next word after a prompt (generate_until; exact_match)
    smoke_ppl     perplexity of ~120-word passages (loglikelihood_rolling)
- `paper`: the lm-eval tasks of the Pier evaluation plus hellaswag and ARC, from the
  Hugging Face hub. Pre-download them on a machine with network with
  `python -c "from eval.suites import download_tasks; download_tasks()"`.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import json
import os
import random
import shutil
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import yaml

SMOKE_TASKS = ("smoke_cloze", "smoke_choice", "smoke_gen", "smoke_ppl")
PAPER_TASKS = (
    "super-glue-lm-eval-v1",  # boolq cb copa multirc record rte wic wsc
    "lambada_openai",
    "lambada_standard",
    "race",
    "mathqa",
    "piqa",
    "winogrande",
    "hellaswag",
    "arc_easy",
    "arc_challenge",
)
SMOKE_VERSION = 1
"""Bump when the smoke items change: it keys the cache and is each task's version."""
SMOKE_NUM_DOCS = 100
"""Items per smoke task (smoke_ppl has half as many, longer ones)."""
_HELD_OUT_TOKENS = 1 << 20  # smoke items come from at most this many held-out tokens


@dataclass(frozen=True)
class Suite:
    name: str
    tasks: tuple[str, ...]
    """Default task list (`--tasks` may pick others: within the smoke tasks, or any
    lm-eval task, group or tag for hub suites)."""
    offline: bool
    """True when the suite's tasks are generated locally."""
    bootstrap_iters: int
    """Resamples for bootstrapped standard errors (lm-eval's default is 100000)."""


SUITES = {
    "smoke": Suite("smoke", SMOKE_TASKS, offline=True, bootstrap_iters=1000),
    "paper": Suite("paper", PAPER_TASKS, offline=False, bootstrap_iters=100000),
}


def get_suite(name: str) -> Suite:
    if name not in SUITES:
        raise ValueError(f"eval.suite must be one of {sorted(SUITES)}, got {name!r}")
    return SUITES[name]


def select_tasks(suite: Suite, tasks: list[str] | None) -> list[str]:
    """The tasks to run: the suite's, or `tasks` (checked here for offline suites; hub
    names are checked against lm-eval's index in `load_tasks`)."""
    if not tasks:
        return list(suite.tasks)
    names = list(dict.fromkeys(tasks))
    if suite.offline:
        unknown = [t for t in names if t not in suite.tasks]
        if unknown:
            raise ValueError(
                f"eval.tasks: unknown {suite.name} task(s) {unknown}; valid: {list(suite.tasks)}"
            )
    return names


# ---------------------------------------------------------------------------- smoke data
def _held_out_split(data_cfg: dict):
    """(uint16 held-out tokens, tokenizer, corpus identity) of the run's corpus."""
    from bench.data import load_corpus
    from bench.data.tokenizers import get_tokenizer

    for key in ("corpus", "tokenizer", "cache_dir"):
        if data_cfg.get(key) is None:
            raise ValueError(f"config.yaml lacks data.{key}, needed by the smoke suite")
    splits = load_corpus(
        data_cfg["corpus"],
        data_cfg["tokenizer"],
        data_cfg["cache_dir"],
        val_fraction=data_cfg.get("val_fraction", 0.05),
    )
    meta = {k: splits.meta.get(k) for k in ("sha256", "tokenizer", "num_val_tokens", "source")}
    return splits.val, get_tokenizer(data_cfg["tokenizer"]), json.dumps(meta, sort_keys=True)


def held_out_documents(val_tokens: np.ndarray, tokenizer) -> list[str]:
    """The held-out split's documents (cut at end-of-text tokens) as text."""
    val = np.asarray(val_tokens[:_HELD_OUT_TOKENS])
    ends = np.flatnonzero(val == tokenizer.eot_token).tolist()
    starts = [0, *(e + 1 for e in ends)]
    documents = [
        tokenizer.decode(val[a:b].tolist()) for a, b in zip(starts, [*ends, len(val)], strict=True)
    ]
    return [d for d in documents if d.strip()]


def _spans(documents: list[list[str]], length: int, count: int, rng: random.Random):
    """`count` random runs of `length` consecutive words, each inside one document."""
    eligible = [words for words in documents if len(words) >= length]
    if not eligible:
        raise ValueError(
            f"the held-out split has no document of {length} words; the smoke suite "
            "needs a larger corpus or data.val_fraction"
        )
    weights = [len(words) - length + 1 for words in eligible]
    for words in rng.choices(eligible, weights, k=count):
        start = rng.randrange(len(words) - length + 1)
        yield words[start : start + length]


def smoke_items(documents: list[str], num_docs: int = SMOKE_NUM_DOCS) -> dict[str, list[dict]]:
    """Items of each smoke task, drawn deterministically from the documents' words."""
    words = [d.split() for d in documents]
    rng = random.Random(SMOKE_VERSION)
    items: dict[str, list[dict]] = {"smoke_cloze": [], "smoke_choice": [], "smoke_gen": []}
    for span in _spans(words, 21, num_docs, rng):
        items["smoke_cloze"].append({"context": " ".join(span[:-1]), "target": " " + span[-1]})
    for span in _spans(words, 24, num_docs, rng):
        true = " ".join(span[16:])
        distractors: list[str] = []
        for other in _spans(words, 8, 20, rng):
            if " ".join(other) not in (true, *distractors):
                distractors.append(" ".join(other))
            if len(distractors) == 3:
                break
        label = rng.randrange(len(distractors) + 1)
        choices = distractors[:label] + [true] + distractors[label:]
        items["smoke_choice"].append(
            {"context": " ".join(span[:16]), "choices": choices, "label": label}
        )
    for span in _spans(words, 17, num_docs, rng):
        # The prompt ends with the space, so the answer is exactly the next word.
        items["smoke_gen"].append({"context": " ".join(span[:-1]) + " ", "target": span[-1]})
    items["smoke_ppl"] = [{"text": " ".join(s)} for s in _spans(words, 120, num_docs // 2, rng)]
    return items


def _task_config(name: str, data_file: Path, hf_cache: Path) -> dict:
    common = {
        "task": name,
        "tag": ["commbench_smoke"],
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data_file)}, "cache_dir": str(hf_cache)},
        "test_split": "test",
        "metadata": {"version": float(SMOKE_VERSION)},
    }
    acc = {"metric": "acc", "aggregation": "mean", "higher_is_better": True}
    specific = {
        "smoke_cloze": {
            "output_type": "loglikelihood",
            "doc_to_text": "context",
            "doc_to_target": "target",
            "metric_list": [
                {"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False},
                acc,
            ],
        },
        "smoke_choice": {
            "output_type": "multiple_choice",
            "doc_to_text": "context",
            "doc_to_choice": "choices",
            "doc_to_target": "label",
            "metric_list": [
                acc,
                {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
            ],
        },
        "smoke_gen": {
            "output_type": "generate_until",
            "doc_to_text": "context",
            "doc_to_target": "target",
            "generation_kwargs": {"until": [" ", "\n"], "max_gen_toks": 16, "do_sample": False},
            "metric_list": [
                {"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}
            ],
        },
        "smoke_ppl": {
            "output_type": "loglikelihood_rolling",
            "doc_to_text": "",
            "doc_to_target": "text",
            "metric_list": [
                {"metric": "word_perplexity"},
                {"metric": "byte_perplexity"},
                {"metric": "bits_per_byte"},
            ],
        },
    }
    return common | specific[name]


def write_smoke_tasks(
    documents: list[str], out_dir: str | Path, final_dir: str | Path | None = None
) -> Path:
    """Write the smoke tasks into out_dir: `tasks/*.yaml` (the include path) and
    `data/*.jsonl`. The YAMLs name their data by absolute path under `final_dir` (where
    out_dir will be renamed to; default out_dir). Returns out_dir/tasks."""
    out_dir = Path(out_dir).resolve()
    final_dir = Path(final_dir or out_dir).resolve()
    for sub in ("tasks", "data", "hf_cache"):
        (out_dir / sub).mkdir(parents=True, exist_ok=True)
    for name, rows in smoke_items(documents).items():
        data_file = Path("data") / f"{name}.jsonl"
        (out_dir / data_file).write_text("".join(json.dumps(row) + "\n" for row in rows))
        config = _task_config(name, final_dir / data_file, final_dir / "hf_cache")
        (out_dir / "tasks" / f"{name}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return out_dir / "tasks"


def smoke_task_dir(data_cfg: dict) -> Path:
    """The include path of the run corpus's smoke tasks, generated once per corpus into
    `data.cache_dir` (written to a temporary directory and renamed: concurrent runs of a
    sweep are safe, and an interrupted one leaves nothing half-written)."""
    val_tokens, tokenizer, identity = _held_out_split(data_cfg)
    key = hashlib.sha256(f"{identity}|{SMOKE_VERSION}|{SMOKE_NUM_DOCS}".encode()).hexdigest()
    final = (Path(data_cfg["cache_dir"]).expanduser() / "eval" / f"smoke-{key[:16]}").resolve()
    if not (final / "tasks").is_dir():
        work = final.with_name(f".{final.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            write_smoke_tasks(held_out_documents(val_tokens, tokenizer), work, final)
            try:
                os.rename(work, final)
            except OSError:
                if not (final / "tasks").is_dir():
                    raise
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return final / "tasks"


# ---------------------------------------------------------------------------- loading
def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _hub_unreachable() -> str | None:
    """Why the Hugging Face hub cannot be used now, or None if it can."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if _env_true(var):
            return f"disabled by {var}"
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=3).close()
    except OSError as err:
        return f"unreachable ({url.hostname}: {err})"
    return None


@contextlib.contextmanager
def _offline_hub():
    """Force the datasets library offline while loading tasks. Without this, an
    unreachable hub costs ~25 s of retries per dataset before the cached copy is used
    (or the task fails); offline, cached datasets load at once and others fail at once."""
    import datasets.config
    import huggingface_hub.constants as hub

    saved = (datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE)
    datasets.config.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE = saved


def _download_hint(task: str, why: str, err: Exception) -> str:
    import datasets.config

    return (
        f"lm-eval task {task!r} needs its dataset from the Hugging Face hub, which is {why}, "
        f"and it is not in the local datasets cache ({datasets.config.HF_DATASETS_CACHE}). "
        "On a machine with network, download it with\n"
        f'  python -c "from eval.suites import download_tasks; download_tasks([{task!r}])"\n'
        "then copy that machine's HF_HOME (or HF_DATASETS_CACHE) directory here and point "
        "HF_HOME (or HF_DATASETS_CACHE) at it; or run the smoke suite, which needs no "
        f"download. ({type(err).__name__}: {err})"
    )


def load_tasks(suite: Suite, names: list[str], data_cfg: dict | None = None):
    """(TaskManager, lm-eval Task/Group objects) for `names`, datasets loaded. Every failure
    is a ValueError naming the task, raised before any evaluation starts."""
    from lm_eval.tasks import TaskManager

    if suite.offline:
        manager = TaskManager(
            include_path=str(smoke_task_dir(data_cfg or {})), include_defaults=False
        )
    else:
        manager = TaskManager()
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        close = {n: difflib.get_close_matches(n, manager.all_tasks, n=3) for n in unknown}
        raise ValueError(f"eval.tasks: unknown lm-eval task(s) {unknown} (close matches: {close})")
    why = None if suite.offline else _hub_unreachable()
    objects = []
    with _offline_hub() if why else contextlib.nullcontext():
        for name in names:
            try:
                loaded = manager.load([name])
            except Exception as err:
                if why:
                    raise ValueError(_download_hint(name, why, err)) from err
                raise ValueError(f"cannot load lm-eval task {name!r}: {err}") from err
            group = loaded["groups"].get(name)
            objects.extend([group] if group is not None else loaded["tasks"].values())
    return manager, objects


def download_tasks(names: list[str] | tuple[str, ...] = PAPER_TASKS) -> None:
    """Download the hub datasets of `names` into the local datasets cache (needs network
    and HF_HUB_OFFLINE / HF_DATASETS_OFFLINE unset)."""
    from lm_eval.tasks import TaskManager

    why = _hub_unreachable()
    if why:
        raise ValueError(f"cannot download {list(names)}: the Hugging Face hub is {why}")
    manager = TaskManager()
    for name in names:
        manager.load([name])
        print(f"cached {name}")
