"""Tests for eval/: the lm-eval adapter's numbers, the smoke suite end to end, bad input,
and the Hugging Face export. No training: a seeded random GPT in a fake run directory."""

import dataclasses
import json
import sys

import pytest
import torch
import torch.nn.functional as F
from lm_eval.api.instance import Instance

from bench.config import load_config
from bench.data.tokenizers import get_tokenizer
from bench.model import GPT, GPTConfig
from bench.run.records import RunDir
from eval.export import export_hf
from eval.lm import CommbenchLM, score_windows
from eval.runner import evaluate_run, self_evaluate
from tests.fakes import make_summary, write_fake_run

SEQ_LEN = 32


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """As on a machine without network: the hub must never be tried."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, seq_len=SEQ_LEN, n_layer=2, n_head=2, n_embd=32)
    return GPT(cfg).eval()


@pytest.fixture(scope="module")
def tokenizer():
    return get_tokenizer("byte")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """Shared by the module's runs, so the corpus and smoke tasks are built once."""
    return tmp_path_factory.mktemp("cache")


FAKE_SUMMARY = make_summary(status="ok", run_name="fake", strategy="ddp", world_size=1)


@pytest.fixture
def run_dir(tmp_path, model, cache_dir):
    config = {
        "data": {
            "corpus": "embedded",
            "tokenizer": "byte",
            "cache_dir": str(cache_dir),
            "val_fraction": 0.05,
        },
        "model": {"seq_len": SEQ_LEN},
        "eval": {"suite": "smoke", "tasks": [], "limit": 4, "batch_size": 8},
    }
    run = write_fake_run(tmp_path / "run", config, summary=FAKE_SUMMARY)
    payload = {"model": model.state_dict(), "gpt_config": dataclasses.asdict(model.cfg),
               "tokenizer": "byte", "step": 3}
    run.save_torch(payload, run.final_checkpoint)
    return run.path


def _requests(kind, args_list):
    return [Instance(kind, {}, args, idx) for idx, args in enumerate(args_list)]


@torch.no_grad()
def _direct_logprob(model, context_ids, continuation_ids):
    """Sum of log p(continuation) and whether each token is the argmax, window cut on the left."""
    tokens = context_ids + continuation_ids
    inputs = torch.tensor([tokens[-(SEQ_LEN + 1) : -1]])
    logprobs = F.log_softmax(model(inputs)[0][0], -1)[-len(continuation_ids) :]
    targets = torch.tensor(continuation_ids)
    total = logprobs[torch.arange(len(targets)), targets].sum().item()
    return total, bool((logprobs.argmax(-1) == targets).all())


@torch.no_grad()
def _greedy_ids(model, ids, num):
    ids = list(ids)
    out = []
    for _ in range(num):
        out.append(model(torch.tensor([ids[-SEQ_LEN:]]))[0][0, -1].argmax().item())
        ids.append(out[-1])
    return out


def test_score_windows_score_every_token_once_with_maximal_context():
    tokens = list(range(100))
    for first in (1, 5, 31, 33, 99):
        scored = []
        for inputs, targets, num_scored in score_windows(tokens, first, SEQ_LEN):
            assert len(inputs) == len(targets) <= SEQ_LEN
            assert targets == [t + 1 for t in inputs]  # targets are the inputs shifted
            assert len(inputs) == min(SEQ_LEN, targets[-1])  # as much context as fits
            scored += targets[-num_scored:]
        assert scored == tokens[first:]


def test_loglikelihood_is_the_models_continuation_logprob(model, tokenizer):
    # greedy by construction, from the first context whose greedy bytes survive decoding
    # (a random model may pick bytes that are not valid UTF-8 on their own)
    greedy_context, greedy = next(
        (context, tokenizer.decode(ids)) for context in ("The cat", "A dog", "Hello", "x", "0")
        if tokenizer.encode(tokenizer.decode(
            ids := _greedy_ids(model, tokenizer.encode(context), 3))) == ids)
    # No context ends in a space: lm-eval moves such a space into the continuation.
    long_context = "a context far longer than the window of thirty-two tokens. " * 2
    long_context = long_context.strip()
    pairs = [
        ("The cat", " sat on the mat"),
        (greedy_context, greedy),  # greedy by construction
        ("The cat", " zq"),
        (long_context, " so it is cut on the left"),
        (long_context, " x"),
        ("", "no context at all"),
        ("Hello", "!"),
    ]
    lm = CommbenchLM(model, tokenizer, batch_size=3)  # several batches, padded rows
    results = lm.loglikelihood(_requests("loglikelihood", pairs), disable_tqdm=True)
    assert len(tokenizer.encode(long_context)) > SEQ_LEN
    for (context, continuation), (logprob, is_greedy) in zip(pairs, results, strict=True):
        context_ids = tokenizer.encode(context) if context else [tokenizer.eot_token]
        expected, expected_greedy = _direct_logprob(
            model, context_ids, tokenizer.encode(continuation)
        )
        assert logprob == pytest.approx(expected, abs=1e-4)
        assert is_greedy == expected_greedy
    assert results[1][1] is True
    assert results[2][1] is False


def test_loglikelihood_rolling_is_the_models_summed_token_loss(model, tokenizer):
    short = "Sixteen bytes!!!"
    long = "A text several windows long, scored in chunks of the window size. " * 2
    lm = CommbenchLM(model, tokenizer, batch_size=2)
    got = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [(short,), (long,)]), True)

    with torch.no_grad():
        tokens = [tokenizer.eot_token, *tokenizer.encode(short)]
        x, y = torch.tensor([tokens[:-1]]), torch.tensor([tokens[1:]])
        assert got[0] == pytest.approx(-model(x, y)[1].item() * y.numel(), abs=1e-4)

        # Longer than the window: disjoint chunks of SEQ_LEN targets; the last chunk
        # still sees a full window of context.
        tokens = [tokenizer.eot_token, *tokenizer.encode(long)]
        n = len(tokens) - 1
        assert n > 2 * SEQ_LEN
        expected = 0.0
        for start in range(0, n, SEQ_LEN):
            stop = min(start + SEQ_LEN, n)
            begin = max(0, stop - SEQ_LEN)
            logits = model(torch.tensor([tokens[begin:stop]]))[0][0]
            losses = F.cross_entropy(
                logits, torch.tensor(tokens[begin + 1 : stop + 1]), reduction="none"
            )
            expected -= losses[start - begin :].sum().item()
        assert got[1] == pytest.approx(expected, abs=1e-3)


def test_generate_until_is_greedy_and_honours_until_and_max_tokens(model, tokenizer):
    prompts = ["The cat", "x" * 50, "Hello there"]  # the second exceeds the window
    full = [tokenizer.decode(_greedy_ids(model, tokenizer.encode(p), 8)) for p in prompts]
    assert all(tokenizer.eot_token not in tokenizer.encode(t) for t in full)
    stop = full[0][3]  # a character the first continuation reaches after 3 tokens
    requests = _requests(
        "generate_until",
        [
            (prompts[0], {"until": [stop], "max_gen_toks": 8}),
            (prompts[1], {"until": [], "max_gen_toks": 5}),
            (prompts[2], {"until": "\u2603", "max_gen_toks": 8}),
        ],
    )
    got = CommbenchLM(model, tokenizer, batch_size=2).generate_until(requests, True)
    assert got[0] == full[0][: full[0].index(stop)]
    assert got[1] == tokenizer.decode(tokenizer.encode(full[1])[:5])
    assert got[2] == full[2]


def test_smoke_suite_runs_offline_and_records_results(run_dir, monkeypatch):
    def no_fork(*args, **kwargs):  # a pool forked from a threaded process can hang
        raise AssertionError("lm-eval's bootstrap forked a multiprocessing pool")

    monkeypatch.setattr("multiprocessing.Pool", no_fork)
    out = evaluate_run(run_dir, suite="smoke", limit=4, batch_size=8)

    written = json.loads(RunDir(run_dir).eval.read_text())
    assert written == out
    assert written["lm_eval_version"]
    assert set(written["tasks"]) == {"smoke_cloze", "smoke_choice", "smoke_gen", "smoke_ppl"}
    for task in written["tasks"].values():
        assert task["version"] == 1.0 and task["num_samples"] == 4 and task["step"] == 3
        assert all(set(m) == {"value", "stderr"} for m in task["metrics"].values())
    choice = written["tasks"]["smoke_choice"]["metrics"]["acc"]
    assert 0 <= choice["value"] <= 1 and choice["stderr"] is not None
    assert written["tasks"]["smoke_ppl"]["metrics"]["bits_per_byte"]["value"] > 0
    summary = RunDir(run_dir).read_summary()
    assert summary["status"] == "ok"
    assert summary["eval"]["smoke_choice/acc"] == choice["value"]
    assert "smoke_gen/exact_match" in summary["eval"]

    # Re-evaluating one task replaces it and keeps the others.
    again = evaluate_run(run_dir, suite="smoke", tasks=["smoke_cloze"], limit=2)
    assert again["tasks"]["smoke_cloze"]["num_samples"] == 2
    assert again["tasks"]["smoke_ppl"] == written["tasks"]["smoke_ppl"]


def _unchanged(run_dir):
    run = RunDir(run_dir)
    return not run.eval.exists() and run.read_summary() == FAKE_SUMMARY


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"suite": "nope"}, "eval.suite must be one of"),
        ({"tasks": ["smoke_cloze", "hellaswag"]}, r"unknown smoke task\(s\) \['hellaswag'\]"),
        ({"limit": 0}, "eval.limit must be"),
    ],
)
def test_bad_arguments_fail_clearly_and_write_nothing(run_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        evaluate_run(run_dir, **kwargs)
    assert _unchanged(run_dir)


def test_missing_run_or_checkpoint_fails_clearly(tmp_path, run_dir):
    with pytest.raises(ValueError, match="does not exist"):
        evaluate_run(tmp_path / "missing")
    RunDir(run_dir).final_checkpoint.unlink()
    with pytest.raises(ValueError, match="no evaluation model checkpoints/final.pt"):
        evaluate_run(run_dir)
    assert _unchanged(run_dir)


def test_self_evaluation_failure_is_recorded_not_raised(run_dir):
    """After training (eval.suite set), a failing evaluation leaves the record ok with the
    error in eval_error, and lm-eval's output in logs/eval.log rather than the terminal."""
    cfg = load_config(None, ["eval.suite=paper", "eval.tasks=[hellaswag]", "eval.limit=2"])
    summary = self_evaluate(cfg, run_dir)
    assert summary["status"] == "ok" and "'hellaswag'" in summary["eval_error"]
    assert RunDir(run_dir).read_summary() == summary and RunDir(run_dir).eval_log.exists()


def test_offline_hub_task_fails_fast_naming_it(run_dir):
    with pytest.raises(ValueError) as err:
        evaluate_run(run_dir, suite="paper", tasks=["hellaswag"], limit=2)
    assert "'hellaswag'" in str(err.value) and "download_tasks(['hellaswag'])" in str(err.value)
    assert _unchanged(run_dir)


def test_export_without_transformers_says_how_to_install(run_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes the import fail
    with pytest.raises(ValueError, match="pip install"):
        export_hf(run_dir, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_exported_hf_model_gives_our_logits(run_dir, tmp_path, model, tokenizer):
    transformers = pytest.importorskip(
        "transformers", reason="transformers is not installed (pip install 'commbench[hf]')"
    )
    out = export_hf(run_dir, tmp_path / "hf")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert hf_model.config.activation_function == "gelu"  # our MLP uses exact GELU
    text = "Exported models must agree, token for token, héllo!"
    ids = tokenizer.encode(text)
    assert transformers.AutoTokenizer.from_pretrained(out).encode(text) == ids
    with torch.no_grad():
        x = torch.tensor([ids[:SEQ_LEN]])
        torch.testing.assert_close(hf_model(x).logits, model(x)[0], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="already exists"):
        export_hf(run_dir, out)


def _train_and_validate(rank, world_size, arch, root):
    """A short real run on one rank; its validation batches come back for the reference."""
    from pathlib import Path

    from bench.run.train import Trainer

    cfg = load_config("configs/ddp-tiny.yaml", [
        f"model.arch={arch}", "parallel.world_size=1", "run.steps=3", "run.log_every=3",
        "run.val_every=0", "run.val_sequences=8", "model.seq_len=32", "data.batch_size=4",
        f"data.cache_dir={root}/cache"])
    run_dir = Path(root) / arch
    run_dir.mkdir(parents=True)
    trainer = Trainer(cfg, run_dir, torch.device("cpu"), "gloo")
    summary = trainer.run()
    RunDir(run_dir).write_summary(summary)
    return [(x.clone(), y.clone()) for x, y in trainer.val]


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_transformers_reproduces_the_recorded_validation_loss(arch, tmp_path):
    """`commbench export` of a trained run: Hugging Face's own GPT2LMHeadModel or
    LlamaForCausalLM, fed the run's validation batches, gives the run's recorded
    final_val_loss (to fp32 rounding: the two compute the same function with other kernels)."""
    transformers = pytest.importorskip(
        "transformers", reason="transformers is not installed (pip install 'commbench[hf]')"
    )
    from tests.distributed import run_distributed

    batches = run_distributed(_train_and_validate, 1, arch, str(tmp_path), timeout=180)[0]
    run = RunDir(tmp_path / arch)
    out = export_hf(run.path, tmp_path / f"hf-{arch}")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    expected = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}[arch]
    assert type(hf_model).__name__ == expected
    with torch.no_grad():
        losses = [F.cross_entropy(hf_model(x).logits.flatten(0, 1).float(), y.flatten()).item()
                  for x, y in batches]
    recorded = run.read_summary()["final_val_loss"]
    assert sum(losses) / len(losses) == pytest.approx(recorded, rel=1e-5)
