"""Config parsing, overrides, validation and identity (bench/config/__init__.py, `commbench run`)."""

import subprocess
import sys

import pytest

from bench.cli import main
from bench.config import (
    config_hash,
    describe,
    field_docs,
    from_dict,
    load_config,
    to_dict,
)
from bench.config.schema import ModelConfig
from tests.helpers import assert_bad_config

DDP_TINY = "configs/ddp-tiny.yaml"


def test_defaults_and_yaml_load():
    cfg = load_config(DDP_TINY)
    assert cfg.parallel.world_size == 4
    assert cfg.model.preset == "tiny"
    assert cfg.strategy.name == "ddp" and cfg.strategy.backend == "torch"
    assert cfg.optim.betas == (0.9, 0.95)


def test_overrides_are_typed():
    cfg = load_config(DDP_TINY, ["run.steps=7", "optim.lr=4e-4", "optim.betas=[0.8, 0.9]",
                                 "network.emulate=eth-10g", "run.target_loss=null"])
    assert cfg.run.steps == 7
    assert cfg.optim.lr == pytest.approx(4e-4)
    assert cfg.optim.betas == (0.8, 0.9)
    assert cfg.network.emulate == "eth-10g"
    assert cfg.run.target_loss is None


@pytest.mark.parametrize(
    "override, message",
    [
        ("run.stepz=3", "unknown config key 'run.stepz' (did you mean 'steps'?)"),
        ("run.steps=abc", "run.steps must be an integer, got 'abc'"),
        ("run.steps=0", "run.steps must be >= 1, got 0"),
        ("model.preset=huge", "model.preset must be one of"),
        ("network.emulate=dialup", "network.emulate must be null or one of"),
        ("network.profiles=[eth-10g, carrier-pigeon]", "network.profiles[1] must be one of"),
        ("parallel.group_size=3", "parallel.world_size (4) must be divisible by parallel.group_size (3)"),
        ("data.corpus=/no/such/corpus.txt", "data.corpus: no such file or directory: '/no/such/corpus.txt'"),
        ("data.tokenizer=sentencepiece", "data.tokenizer must be one of ['byte', 'gpt2'], got 'sentencepiece'"),
        ("strategy.name=magic", "strategy.name must be one of"),
        ("strategy.zero_stage=3", "strategy.zero_stage must be 0, 1 or 2, got 3"),
        ("model.compile=maybe", "model.compile must be true or false, got 'maybe'"),
        ("optim.betas=[0.9]", "optim.betas must be a list of 2 values"),
        ("run=5", "run must be a mapping"),
    ],
)
def test_bad_values_name_key_value_and_valid_choices(override, message):
    assert_bad_config(DDP_TINY, override, message)


def test_set_strategy_name_switches_and_drops_the_old_knobs():
    cfg = load_config(DDP_TINY, ["strategy.name=diloco", "strategy.inner_steps=5"])
    assert cfg.strategy.name == "diloco" and cfg.strategy.inner_steps == 5
    assert not hasattr(cfg.strategy, "backend")  # DDP's knob, from the file, is gone
    assert load_config(DDP_TINY, ["strategy.name=ddp"]).strategy.backend == "torch"


def test_override_syntax_errors():
    with pytest.raises(ValueError, match="KEY=VALUE"):
        load_config(DDP_TINY, ["run.steps"])
    with pytest.raises(ValueError, match="config file not found"):
        load_config("configs/nope.yaml")


def test_hash_is_identity_without_output_paths():
    a = load_config(DDP_TINY)
    b = load_config(DDP_TINY, ["run.output_dir=/tmp/elsewhere", "data.cache_dir=/tmp/c"])
    c = load_config(DDP_TINY, ["run.seed=1"])
    assert config_hash(a) == config_hash(b)
    assert config_hash(a) != config_hash(c)
    assert from_dict(to_dict(a)) == a  # the written config.yaml round-trips


def test_hash_is_stable_across_processes():
    code = "from bench.config import load_config, config_hash; " \
           f"print(config_hash(load_config({DDP_TINY!r})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == config_hash(load_config(DDP_TINY))


RECORDED_HASHES = {DDP_TINY: "43f6762dbd76"}
"""Identities of shipped configs as runs recorded them: a new config key must leave them
unchanged at its default (bench/config/__init__.py `IDENTITY_DEFAULTS`), or every recorded
run, sweep and checkpoint stops matching its config."""


def test_a_new_key_at_its_default_keeps_recorded_identities():
    for path, recorded in RECORDED_HASHES.items():
        assert config_hash(load_config(path)) == recorded, path
    profiled = load_config(DDP_TINY, ["optim.delay=1", "optim.delay_profile=pipeline",
                                      "optim.delay_stages=2"])
    delayed = load_config(DDP_TINY, ["optim.delay=1"])
    assert config_hash(profiled) != config_hash(delayed)  # used, the key is identity


def test_field_docs_feed_config_show():
    docs = field_docs(ModelConfig)
    assert docs["seq_len"] == "Context length in tokens."
    text = describe(load_config(DDP_TINY))
    assert "  steps: 100  # Optimizer steps to train." in text
    assert "backend: torch  # torch (DistributedDataParallel)" in text


def test_cli_bad_input_exits_before_launch(tmp_path, capsys):
    blocked = tmp_path / "file"
    blocked.write_text("")
    rc = main(["run", DDP_TINY, "--set", f"run.output_dir={blocked}/sub"])
    assert rc == 2
    assert "run.output_dir" in capsys.readouterr().err
    rc = main(["run", DDP_TINY, "--set", "parallel.group_size=3", "--set", f"run.output_dir={tmp_path}"])
    assert rc == 2
    assert not list(tmp_path.glob("**/config.yaml"))  # nothing was launched or written


def test_ci_runs_exactly_the_readme_test_command():
    readme = open("README.md").read()
    ci_command = open(".ci/run").read().strip().splitlines()[-1]
    assert ci_command.endswith(".venv/bin/pytest")  # the test command, not the main job
    assert f"```bash\n{ci_command}\n```" in readme


def test_the_typed_engine_reads_any_dataclass():
    from dataclasses import dataclass, field

    from bench.config.typed import from_mapping

    @dataclass
    class Inner:
        size: int = 1

    @dataclass
    class Outer:
        inner: Inner = field(default_factory=Inner)
        tags: list[str] = field(default_factory=list)
        picked: str = field(default="a", metadata={"parse": lambda v, p: f"{p}={v}"})

    got = from_mapping(Outer, {"inner": {"size": 3.0}, "tags": ["x"], "picked": "b"})
    assert got == Outer(Inner(3), ["x"], "picked=b")
    with pytest.raises(ValueError, match=r"unknown config key 'inner.sise' \(did you mean"):
        from_mapping(Outer, {"inner": {"sise": 3}})
    with pytest.raises(ValueError, match=r"tags\[0\] must be a string, got 5"):
        from_mapping(Outer, {"tags": [5]})
