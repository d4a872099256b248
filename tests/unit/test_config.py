"""Job specs: parsing, defaults, validation messages, round trips, and the optimizer mapping."""

from __future__ import annotations

import ast
import dataclasses
import json
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

import fusion.config as config_module
from fusion.config import (
    CheckpointSpec,
    ClusterSpec,
    CompressionSpec,
    DataSpec,
    JobSpec,
    ModelSpec,
    OutputSpec,
    PlanSpec,
    TrainSpec,
    load_job,
)
from fusion.errors import ConfigError

FULL_JOB = """\
name = "full"

[model]
name = "gpt2"
preset = "tiny"
n_layer = 2
dropout = 0.0
bias = true
widths = [64, 128]

[data]
name = "tinyshakespeare"
batch_size = 12
shuffle = true
seq_len = 64
path = "data/input.txt"

[train]
steps = 7
micro_batches = 4
schedule = "gpipe"
optimizer = "adamw"
lr = 3e-4
weight_decay = 0.1
betas = [0.8, 0.95]
eps = 1e-6
seed = 1234
loss = "cross_entropy"

[cluster]
min_workers = 3
spares = 1
use_joiners = "always"

[plan]
strategy = "opfence"

[compression]
mode = "adatopk"
keep_ratio = 0.2
min_keep_ratio = 0.005
directions = ["gradients"]
bits = 4
cuts = "all"

[checkpoint]
replicate_every = 5
durable_every = 20
keep = 2
replicate_share = 0.25

[output]
dir = "out/full"
"""

MINIMAL_JOB = '[model]\nname = "resnet"\n'


def _job(extra: str = "", model: str = '[model]\nname = "gpt2"\n') -> JobSpec:
    return JobSpec.from_toml(model + extra)


def _error(text: str) -> str:
    with pytest.raises(ConfigError) as info:
        JobSpec.from_toml(text)
    return str(info.value)


# --------------------------------------------------------------------------------------
# Defaults and parsing.


def test_defaults_of_a_minimal_job() -> None:
    spec = JobSpec.from_toml(MINIMAL_JOB)
    assert spec.name == "job"
    assert spec.model == ModelSpec(name="resnet")
    assert spec.model.preset is None and spec.model.kwargs == {}
    assert spec.data == DataSpec()
    assert (spec.data.name, spec.data.batch_size, spec.data.shuffle) == (None, 8, False)
    t = spec.train
    assert (t.steps, t.micro_batches, t.schedule, t.optimizer) == (100, 1, "1f1b", "adamw")
    assert (t.lr, t.weight_decay, t.momentum, t.betas, t.eps) == (1e-3, None, 0.0, None, None)
    assert (t.seed, t.loss) == (0, "cross_entropy")
    assert spec.cluster.min_workers == 1
    assert spec.plan.strategy == "opfence"
    c = spec.compression
    assert (c.mode, c.keep_ratio, c.min_keep_ratio) == ("none", 0.1, 0.01)
    assert c.directions == ("activations", "gradients")
    assert (spec.checkpoint.replicate_every, spec.checkpoint.durable_every) == (10, 50)
    assert spec.checkpoint.keep == 3
    assert spec.output.dir == "fusion-out"
    assert spec.micro_batch_size == 8


def test_full_job_parses_every_section(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text(FULL_JOB)
    spec = load_job(path)
    assert spec == load_job(str(path))
    assert spec.name == "full"
    assert spec.model == ModelSpec(
        name="gpt2",
        preset="tiny",
        kwargs={"n_layer": 2, "dropout": 0.0, "bias": True, "widths": [64, 128]},
    )
    assert spec.data == DataSpec(
        name="tinyshakespeare",
        batch_size=12,
        shuffle=True,
        kwargs={"seq_len": 64, "path": "data/input.txt"},
    )
    assert spec.train == TrainSpec(
        steps=7,
        micro_batches=4,
        schedule="gpipe",
        optimizer="adamw",
        lr=3e-4,
        weight_decay=0.1,
        betas=(0.8, 0.95),
        eps=1e-6,
        seed=1234,
        loss="cross_entropy",
    )
    assert spec.cluster == ClusterSpec(min_workers=3, spares=1, use_joiners="always")
    assert spec.plan == PlanSpec(strategy="opfence")
    assert spec.compression == CompressionSpec(
        mode="adatopk", keep_ratio=0.2, min_keep_ratio=0.005, directions=("gradients",), bits=4, cuts="all"
    )
    assert spec.checkpoint == CheckpointSpec(replicate_every=5, durable_every=20, keep=2, replicate_share=0.25)
    assert spec.output == OutputSpec(dir="out/full")
    assert spec.micro_batch_size == 3


def test_full_job_round_trips_through_dict_and_json() -> None:
    spec = JobSpec.from_toml(FULL_JOB)
    d = spec.to_dict()
    # Same shape as the TOML: kwargs merged back, tuples as lists, nothing else added.
    assert d["model"] == {
        "name": "gpt2",
        "preset": "tiny",
        "n_layer": 2,
        "dropout": 0.0,
        "bias": True,
        "widths": [64, 128],
    }
    assert d["data"] == {
        "name": "tinyshakespeare",
        "batch_size": 12,
        "shuffle": True,
        "seq_len": 64,
        "path": "data/input.txt",
    }
    assert d["train"]["betas"] == [0.8, 0.95]
    assert d["compression"]["directions"] == ["gradients"]
    assert JobSpec.from_dict(d) == spec
    assert json.loads(json.dumps(d)) == d
    assert JobSpec.from_json(spec.to_json()) == spec
    assert JobSpec.from_json(spec.to_json(indent=None)) == spec
    # The dict is what tomllib parses from the file itself, plus the defaults made explicit.
    expected = tomllib.loads(FULL_JOB)
    expected["train"]["momentum"] = 0.0
    assert d == expected


def test_minimal_job_round_trips_and_leaves_out_none() -> None:
    spec = JobSpec.from_toml(MINIMAL_JOB)
    d = spec.to_dict()
    assert "preset" not in d["model"]
    assert "name" not in d["data"]
    for key in ("weight_decay", "betas", "eps"):
        assert key not in d["train"]
    assert JobSpec.from_dict(d) == spec
    assert JobSpec.from_json(spec.to_json()) == spec


def test_to_dict_does_not_alias_kwargs() -> None:
    spec = JobSpec.from_toml(FULL_JOB)
    d = spec.to_dict()
    d["model"]["widths"].append(1)
    assert spec.model.kwargs["widths"] == [64, 128]


def test_json_nulls_mean_not_given() -> None:
    d: dict[str, Any] = {
        "model": {"name": "gpt2", "preset": None},
        "data": {"name": None},
        "train": {"weight_decay": None, "betas": None, "eps": None},
        "plan": None,
    }
    assert JobSpec.from_dict(d) == JobSpec(model=ModelSpec(name="gpt2"))


def test_direct_construction_validates_and_normalises() -> None:
    t = TrainSpec(lr=1, weight_decay=0, betas=[0.5, 0], eps=1)  # type: ignore[arg-type]
    assert isinstance(t.lr, float) and t.lr == 1.0
    assert isinstance(t.weight_decay, float)
    assert t.betas == (0.5, 0.0)
    assert isinstance(t.eps, float)
    c = CompressionSpec(directions=["gradients", "activations"])  # type: ignore[arg-type]
    assert c.directions == ("activations", "gradients")
    with pytest.raises(ConfigError, match=r"train\.steps"):
        TrainSpec(steps=0)
    with pytest.raises(TypeError):
        TrainSpec(100)  # type: ignore[misc]  # keyword-only
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.steps = 3  # type: ignore[misc]


def test_kwargs_are_copied_on_construction() -> None:
    kwargs: dict[str, Any] = {"widths": [1, 2]}
    model = ModelSpec(name="gpt2", kwargs=kwargs)
    kwargs["widths"].append(3)
    kwargs["other"] = 1
    assert model.kwargs == {"widths": [1, 2]}


# --------------------------------------------------------------------------------------
# Keyword-argument routing.


def test_model_and_data_extra_keys_become_kwargs() -> None:
    spec = _job(
        "[data]\nbatch_size = 4\nimage_size = 32\n",
        model='[model]\nname = "resnet"\npreset = "resnet18"\nnum_classes = 10\n',
    )
    assert spec.model.preset == "resnet18"
    assert spec.model.kwargs == {"num_classes": 10}
    assert spec.data.batch_size == 4
    assert spec.data.kwargs == {"image_size": 32}


def test_import_path_model_names() -> None:
    spec = _job(model='[model]\nname = "my_pkg.models:build"\nhidden = 16\n')
    assert spec.model.name == "my_pkg.models:build"
    assert not spec.model.is_builtin
    assert spec.model.kwargs == {"hidden": 16}
    assert JobSpec.from_toml(MINIMAL_JOB).model.is_builtin
    assert ModelSpec(name="pkg:Outer.factory").name == "pkg:Outer.factory"


@pytest.mark.parametrize(
    ("toml", "key"),
    [
        ('[model]\nname = "gpt2"\nfoo = {a = 1}\n', "model.foo"),
        ('[model]\nname = "gpt2"\nfoo = [[1], [2]]\n', "model.foo"),
        ('[model]\nname = "gpt2"\nfoo = 1979-05-27\n', "model.foo"),
        ('[model]\nname = "gpt2"\nfoo = inf\n', "model.foo"),
        ('[model]\nname = "gpt2"\n"bad-key" = 1\n', "model.bad-key"),
        ('[model]\nname = "gpt2"\n[data]\nseq_len = {x = 1}\n', "data.seq_len"),
        ('[model]\nname = "gpt2"\n[data]\n"2d" = 1\n', "data.2d"),
    ],
)
def test_bad_kwargs_name_their_key(toml: str, key: str) -> None:
    assert key in _error(toml)


def test_kwargs_cannot_shadow_fields() -> None:
    with pytest.raises(ConfigError, match=r"model\.preset"):
        ModelSpec(name="gpt2", kwargs={"preset": "x"})
    with pytest.raises(ConfigError, match=r"data\.batch_size"):
        DataSpec(kwargs={"batch_size": 3})


def test_data_seed_points_to_train_seed() -> None:
    message = _error('[model]\nname = "gpt2"\n[data]\nseed = 3\n')
    assert "[data] seed" in message and "[train] seed" in message


# --------------------------------------------------------------------------------------
# Validation messages name section.key and the allowed values.


@pytest.mark.parametrize(
    ("extra", "key", "allowed"),
    [
        ("[train]\nsteps = 0\n", "train.steps", ">= 1"),
        ("[train]\nsteps = true\n", "train.steps", "integer"),
        ("[train]\nsteps = 1.5\n", "train.steps", "integer"),
        ('[train]\nsteps = "10"\n', "train.steps", "integer"),
        ("[train]\nmicro_batches = 0\n", "train.micro_batches", ">= 1"),
        ('[train]\nschedule = "zb"\n', "train.schedule", "'gpipe', '1f1b'"),
        ('[train]\noptimizer = "adam"\n', "train.optimizer", "'sgd', 'adamw'"),
        ("[train]\nlr = 0\n", "train.lr", "> 0"),
        ("[train]\nlr = -1e-3\n", "train.lr", "> 0"),
        ("[train]\nlr = nan\n", "train.lr", "finite"),
        ("[train]\nlr = inf\n", "train.lr", "finite"),
        ("[train]\nlr = true\n", "train.lr", "number"),
        ("[train]\nweight_decay = -0.1\n", "train.weight_decay", ">= 0"),
        ('[train]\noptimizer = "sgd"\nmomentum = -0.5\n', "train.momentum", ">= 0"),
        ("[train]\nmomentum = 0.9\n", "train.momentum", "'sgd'"),
        ("[train]\nbetas = [0.9]\n", "train.betas", "2 numbers in [0, 1)"),
        ("[train]\nbetas = [0.9, 1.0]\n", "train.betas", "< 1"),
        ("[train]\nbetas = [-0.1, 0.9]\n", "train.betas", ">= 0"),
        ("[train]\nbetas = 0.9\n", "train.betas", "2 numbers"),
        ('[train]\noptimizer = "sgd"\nbetas = [0.9, 0.99]\n', "train.betas", "'adamw'"),
        ("[train]\neps = 0\n", "train.eps", "> 0"),
        ('[train]\noptimizer = "sgd"\neps = 1e-8\n', "train.eps", "'adamw'"),
        ("[train]\nseed = -1\n", "train.seed", ">= 0"),
        ("[train]\nseed = 1.0\n", "train.seed", "integer"),
        ('[train]\nloss = ""\n', "train.loss", "non-empty string"),
        ("[train]\nloss = 3\n", "train.loss", "string"),
        ("[data]\nbatch_size = 0\n", "data.batch_size", ">= 1"),
        ("[data]\nbatch_size = false\n", "data.batch_size", "integer"),
        ("[data]\nshuffle = 1\n", "data.shuffle", "true or false"),
        ("[data]\nname = 3\n", "data.name", "string"),
        ("[cluster]\nmin_workers = 0\n", "cluster.min_workers", ">= 1"),
        (
            '[plan]\nstrategy = "random"\n',
            "plan.strategy",
            "'opfence', 'uniform', 'compute', 'exhaustive'",
        ),
        ('[compression]\nmode = "lz4"\n', "compression.mode", "'none', 'topk', 'adatopk'"),
        ("[compression]\nkeep_ratio = 0\n", "compression.keep_ratio", "> 0 and <= 1"),
        ("[compression]\nkeep_ratio = 1.5\n", "compression.keep_ratio", "<= 1"),
        ("[compression]\nmin_keep_ratio = 0.0\n", "compression.min_keep_ratio", "> 0"),
        ("[compression]\nmin_keep_ratio = 2\n", "compression.min_keep_ratio", "<= 1"),
        ("[compression]\ndirections = []\n", "compression.directions", "non-empty"),
        (
            '[compression]\ndirections = ["weights"]\n',
            "compression.directions",
            "'activations', 'gradients'",
        ),
        (
            '[compression]\ndirections = ["gradients", "gradients"]\n',
            "compression.directions",
            "distinct",
        ),
        ('[compression]\ndirections = "gradients"\n', "compression.directions", "array"),
        ("[checkpoint]\nreplicate_every = 0\n", "checkpoint.replicate_every", ">= 1"),
        ("[checkpoint]\ndurable_every = 0\n", "checkpoint.durable_every", ">= 1"),
        ("[checkpoint]\nkeep = 0\n", "checkpoint.keep", ">= 1"),
        ('[output]\ndir = ""\n', "output.dir", "non-empty string"),
        ("[output]\ndir = 1\n", "output.dir", "string"),
    ],
)
def test_bad_values_name_section_key_and_allowed_values(extra: str, key: str, allowed: str) -> None:
    message = _error('[model]\nname = "gpt2"\n' + extra)
    assert key in message
    assert allowed in message


@pytest.mark.parametrize(
    ("toml", "key"),
    [
        ('[model]\nname = "gpt2"\n[train]\nstep = 3\n', "train.step"),
        ('[model]\nname = "gpt2"\n[cluster]\nworkers = 3\n', "cluster.workers"),
        ('[model]\nname = "gpt2"\n[plan]\nsolver = "x"\n', "plan.solver"),
        ('[model]\nname = "gpt2"\n[compression]\nratio = 0.1\n', "compression.ratio"),
        ('[model]\nname = "gpt2"\n[checkpoint]\nevery = 3\n', "checkpoint.every"),
        ('[model]\nname = "gpt2"\n[output]\npath = "x"\n', "output.path"),
    ],
)
def test_unknown_keys_in_fixed_sections_are_rejected(toml: str, key: str) -> None:
    message = _error(toml)
    assert f"unknown key {key}" in message


def test_unknown_key_suggests_the_close_one() -> None:
    message = _error('[model]\nname = "gpt2"\n[train]\nstep = 3\n')
    assert "did you mean 'steps'" in message
    assert "micro_batches" in message  # lists the allowed keys


def test_unknown_section_and_top_level_key_are_rejected() -> None:
    message = _error('[model]\nname = "gpt2"\n[trian]\nsteps = 3\n')
    assert "unknown key trian" in message and "did you mean 'train'" in message
    assert "unknown key owner" in _error('owner = "me"\n[model]\nname = "gpt2"\n')


def test_section_that_is_not_a_table() -> None:
    assert "train must be a table" in _error('train = 3\n[model]\nname = "gpt2"\n')


def test_bad_job_name() -> None:
    assert "name must be a non-empty string" in _error('name = ""\n[model]\nname = "gpt2"\n')
    assert "name must be" in _error('name = 3\n[model]\nname = "gpt2"\n')


def test_missing_model_name() -> None:
    for text in ("", '[model]\npreset = "tiny"\n', "[train]\nsteps = 3\n"):
        message = _error(text)
        assert "model.name is required" in message
        assert "'gpt2'" in message and "package.module:factory" in message
    with pytest.raises(ConfigError, match=r"model\.name is required"):
        JobSpec.from_dict({})


@pytest.mark.parametrize("name", ["", "gpt3", "pkg.mod", "pkg:", ":f", "pkg-x:f", "a b:c", 3])
def test_bad_model_name(name: object) -> None:
    with pytest.raises(ConfigError) as info:
        JobSpec.from_dict({"model": {"name": name}})
    message = str(info.value)
    assert "model.name" in message and "package.module:factory" in message


def test_bad_model_preset() -> None:
    assert "model.preset" in _error('[model]\nname = "gpt2"\npreset = 1\n')


def test_batch_size_must_divide_into_micro_batches() -> None:
    message = _error('[model]\nname = "gpt2"\n[data]\nbatch_size = 8\n[train]\nmicro_batches = 3\n')
    assert "data.batch_size" in message and "train.micro_batches" in message
    assert "divisible" in message
    message = _error('[model]\nname = "gpt2"\n[data]\nbatch_size = 2\n[train]\nmicro_batches = 4\n')
    assert "train.micro_batches (4) must be <= data.batch_size (2)" in message
    spec = _job("[data]\nbatch_size = 8\n[train]\nmicro_batches = 8\n")
    assert spec.micro_batch_size == 1


def test_sgd_fields() -> None:
    spec = _job('[train]\noptimizer = "sgd"\nmomentum = 0.9\nweight_decay = 1e-4\n')
    assert (spec.train.momentum, spec.train.weight_decay) == (0.9, 1e-4)


def test_ints_are_accepted_where_floats_are_expected() -> None:
    spec = _job("[train]\nlr = 1\nweight_decay = 0\n[compression]\nkeep_ratio = 1\n")
    assert spec.train.lr == 1.0 and isinstance(spec.train.lr, float)
    assert spec.compression.keep_ratio == 1.0 and isinstance(spec.compression.keep_ratio, float)
    assert JobSpec.from_dict(spec.to_dict()) == spec


def test_min_keep_ratio_is_independent_of_keep_ratio() -> None:
    spec = _job('[compression]\nmode = "topk"\nkeep_ratio = 0.005\n')
    assert (spec.compression.keep_ratio, spec.compression.min_keep_ratio) == (0.005, 0.01)


# --------------------------------------------------------------------------------------
# Files, syntax errors, JSON errors.


def test_toml_syntax_error_gives_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.toml"
    path.write_text('[model]\nname = "gpt2"\n[train]\nsteps = = 3\n')
    with pytest.raises(ConfigError) as info:
        load_job(path)
    message = str(info.value)
    assert message.startswith(f"{path}:4:")
    assert "invalid TOML" in message
    assert isinstance(info.value.__cause__, Exception)


def test_toml_syntax_error_at_end_of_file_and_without_file() -> None:
    message = _error('[model]\nname = "gpt2"\nsteps =')
    assert message.startswith("<string>:3: invalid TOML")
    assert "end of file" in message
    message = _error("[model]\n[model]\n")
    assert message.startswith("<string>:2:")


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match="job file not found") as info:
        load_job(path)
    assert str(path) in str(info.value)
    with pytest.raises(ConfigError, match="cannot read job file"):
        load_job(tmp_path)  # a directory


def test_non_utf8_file(tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'[model]\nname = "caf\xe9"\n')
    with pytest.raises(ConfigError, match="UTF-8"):
        load_job(path)


def test_validation_errors_from_a_file_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text('[model]\nname = "gpt2"\n[train]\nsteps = 0\n')
    with pytest.raises(ConfigError) as info:
        load_job(path)
    assert str(info.value).startswith(f"{path}: train.steps must be an integer >= 1")


def test_bad_json() -> None:
    with pytest.raises(ConfigError, match="invalid job JSON at line 1"):
        JobSpec.from_json("{")
    with pytest.raises(ConfigError, match="a job must be a table"):
        JobSpec.from_json("[]")
    with pytest.raises(ConfigError, match=r"train\.steps"):
        JobSpec.from_json('{"model": {"name": "gpt2"}, "train": {"steps": 0}}')


# --------------------------------------------------------------------------------------
# replace()


def test_replace_returns_a_validated_copy() -> None:
    spec = JobSpec.from_toml(FULL_JOB)
    smaller = spec.replace(train={"steps": 3}, name="smoke")
    assert smaller.train.steps == 3 and smaller.name == "smoke"
    assert smaller.train.lr == spec.train.lr
    assert spec.train.steps == 7  # unchanged
    assert smaller.replace(train={"steps": 7}, name="full") == spec


def test_replace_sets_and_removes_kwargs_and_resets_defaults() -> None:
    spec = JobSpec.from_toml(FULL_JOB)
    changed = spec.replace(model={"n_layer": 4, "widths": None}, data={"name": None}, train={"weight_decay": None})
    assert changed.model.kwargs == {"n_layer": 4, "dropout": 0.0, "bias": True}
    assert changed.data.name is None
    assert changed.train.weight_decay is None


def test_replace_with_section_objects() -> None:
    spec = JobSpec.from_toml(MINIMAL_JOB)
    changed = spec.replace(plan=PlanSpec(strategy="compute"))
    assert changed.plan.strategy == "compute"
    with pytest.raises(ConfigError, match="plan must be a PlanSpec"):
        spec.replace(plan=OutputSpec())


def test_replace_rejects_bad_overrides() -> None:
    spec = JobSpec.from_toml(MINIMAL_JOB)
    with pytest.raises(ConfigError, match=r"train\.steps"):
        spec.replace(train={"steps": 0})
    with pytest.raises(ConfigError, match=r"unknown key train\.stepz"):
        spec.replace(train={"stepz": 3})
    with pytest.raises(ConfigError, match="unknown key trian"):
        spec.replace(trian={"steps": 3})
    with pytest.raises(ConfigError, match="data.batch_size"):
        spec.replace(train={"micro_batches": 3})
    with pytest.raises(ConfigError, match="train override must be a mapping"):
        spec.replace(train=3)  # type: ignore[arg-type]


def test_job_spec_type_checks_sections() -> None:
    with pytest.raises(ConfigError, match="train must be a TrainSpec"):
        JobSpec(model=ModelSpec(name="gpt2"), train={"steps": 3})  # type: ignore[arg-type]


@pytest.mark.parametrize("module", ["config", "job_sections", "config_checks"])
def test_config_modules_import_only_the_standard_library(module: str) -> None:
    tree = ast.parse((Path(config_module.__file__).parent / f"{module}.py").read_text())
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
    non_stdlib = {m for m in imported if m.split(".")[0] not in sys.stdlib_module_names and m != "__future__"}
    assert non_stdlib <= {"fusion.errors", "fusion.config_checks", "fusion.job_sections"}
