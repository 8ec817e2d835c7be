"""Issue 25: a local-looking model or dataset path that does not exist fails at once, in one line
naming the field, the path and what to do; it never reaches the hub (a minute of retries, then a
traceback) and never asks for the ``datasets`` package. Hub names still go to the hub."""

from __future__ import annotations

import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from reval.config import ModelConfig, TaskConfig, load_config
from reval.paths import (
    DatasetNotFound,
    ModelNotFound,
    check_run_paths,
    looks_local,
    nearest_existing,
)

CPU_MATH = Path(__file__).resolve().parents[2] / "configs" / "cpu_math.toml"


@pytest.fixture
def project(tmp_path: Path, monkeypatch) -> Path:
    """A working directory as after ``reval make-data runs/wordmath-data`` (no model yet)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "wordmath-data").mkdir(parents=True)
    for split in ("train", "test"):
        (tmp_path / "runs" / "wordmath-data" / f"{split}.jsonl").write_text(
            '{"problem": "1+1", "answer": "2"}\n'
        )
    return tmp_path


@pytest.fixture
def no_hub(monkeypatch):
    """Any from_pretrained call fails the test (the hub would be reached)."""
    import reval.policy

    def refuse(*args, **kwargs):
        raise AssertionError(f"from_pretrained reached with {args}")

    for cls in (reval.policy.AutoTokenizer, reval.policy.AutoModelForCausalLM,
                reval.policy.PreTrainedTokenizerFast):  # fmt: skip
        monkeypatch.setattr(cls, "from_pretrained", refuse)


@pytest.mark.parametrize(
    "name",
    ["Qwen/Qwen2.5-Math-7B", "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", "gpt2",
     "agentica-org/DeepScaleR-Preview-Dataset"],
)  # fmt: skip
def test_hub_names_are_not_local(project, name):
    from reval.policy import model_source

    assert not looks_local(name)
    assert model_source(name) == name


@pytest.mark.parametrize(
    "name", ["runs/wordmath-model", "runs/x/y", "./m", "../m", "/abs/m", "~/m", "m/", "a\\b"]
)
def test_local_looking_names(project, name):
    assert looks_local(name)  # ``runs/`` is a directory here: runs/NAME is no hub id


def test_the_cpu_math_model_before_make_model_fails_at_once_in_one_line(project, no_hub, capfd):
    from reval.policy import load_policy

    cfg = load_config(CPU_MATH, environ={})
    t0 = time.perf_counter()
    with pytest.raises(ModelNotFound) as err:
        load_policy(cfg.model)
    assert time.perf_counter() - t0 < 5
    message = str(err.value)
    assert message.startswith(
        "model.name_or_path: the local checkpoint directory 'runs/wordmath-model' does not exist"
    )
    assert "reval make-model runs/wordmath-model" in message and "\n" not in message
    assert "did you mean" not in message  # runs/wordmath-data is no checkpoint
    assert isinstance(err.value, FileNotFoundError) and isinstance(err.value, ValueError)
    assert (err.value.path, err.value.field) == ("runs/wordmath-model", "model.name_or_path")
    out, errs = capfd.readouterr()
    assert out == errs == ""  # no retry logs


def test_reval_eval_of_a_missing_checkpoint_fails_at_once(project, no_hub):
    from services.evaluate import run_eval

    cfg = load_config(environ={})
    cfg.model.name_or_path = "runs/no-such-model"  # what ``reval eval --checkpoint`` sets
    t0 = time.perf_counter()
    with pytest.raises(ModelNotFound, match="'runs/no-such-model' does not exist"):
        run_eval(cfg, ["wordmath"], None, project / "eval.json", progress=False)
    assert time.perf_counter() - t0 < 5


def test_a_mistyped_model_path_names_the_closest_and_a_non_checkpoint_says_so(project, no_hub):
    from reval.policy import model_source

    (project / "runs" / "wordmath-model").mkdir()
    with pytest.raises(ModelNotFound, match=r"is not a checkpoint \(no config\.json\)"):
        model_source("runs/wordmath-model")
    (project / "runs" / "wordmath-model" / "config.json").write_text("{}")
    with pytest.raises(ModelNotFound, match=r"has no tokenizer \(none of tokenizer\.json, "):
        model_source("runs/wordmath-model")  # (transformers: a ValueError of five lines)
    (project / "runs" / "wordmath-model" / "tokenizer.json").write_text("{}")
    assert model_source("runs/wordmath-model") == "runs/wordmath-model"
    with pytest.raises(ModelNotFound, match=r"did you mean 'runs/wordmath-model'\?"):
        model_source("runs/wordmath-modle")
    with pytest.raises(ModelNotFound, match=r"^--checkpoint: .* is not a directory"):
        model_source("runs/wordmath-data/train.jsonl", field="--checkpoint")


def test_the_run_paths_are_checked_without_torch(project):
    """What the CLI can check right after loading the config, before the heavy imports."""
    code = (
        "import sys, time\n"
        "from reval.config import load_config\n"
        "from reval.paths import check_run_paths\n"
        f"cfg = load_config({str(CPU_MATH)!r}, environ={{}})\n"
        "t0 = time.perf_counter()\n"
        "try:\n"
        "    check_run_paths(cfg, '--checkpoint')\n"
        "except FileNotFoundError as err:\n"
        "    print(err, time.perf_counter() - t0 < 1, 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("--checkpoint: the local checkpoint directory 'runs/wordmath")
    assert out.stdout.rstrip().endswith("True False")  # fast, and torch never imported
    cfg = load_config(CPU_MATH, environ={})
    (project / "runs" / "wordmath-model").mkdir()
    for name in ("config.json", "tokenizer.json"):
        (project / "runs" / "wordmath-model" / name).write_text("{}")
    check_run_paths(cfg)  # the preset's paths once made
    cfg.eval.dataset = "runs/wordmath-data/tset.jsonl"
    check_run_paths(cfg)  # a learner or a worker does not read the held-out file ...
    with pytest.raises(  # ... `reval train` evaluates on it
        DatasetNotFound,
        match=r"^eval\.dataset: .* \(did you mean 'runs/wordmath-data/test\.jsonl'\?\)",
    ):
        check_run_paths(cfg, held_out=True)


def test_a_mistyped_dataset_says_the_file_does_not_exist(project, monkeypatch):
    from rollout.math_task import MathTask

    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed: not what is reported
    cfg = TaskConfig(kind="math", dataset="runs/wordmath-dat/train.jsonl")
    with pytest.raises(DatasetNotFound) as err:
        MathTask.from_config(cfg)
    assert str(err.value) == (
        "task.dataset: the file 'runs/wordmath-dat/train.jsonl' does not exist (did you mean "
        "'runs/wordmath-data/train.jsonl'?); a local .jsonl/.json/.parquet file was expected "
        "(`reval make-data DIR` writes one)"
    )
    held = cfg.model_copy(update={"dataset": "held/out.jsonl"})  # no close sibling
    with pytest.raises(DatasetNotFound, match=r"^eval\.dataset: the file 'held/out\.jsonl' does"):
        MathTask.from_config(held, field="eval.dataset")
    with pytest.raises(DatasetNotFound, match=r"'test\.jsonl' does not exist"):
        MathTask.from_config(cfg.model_copy(update={"dataset": "test.jsonl"}))


def test_only_a_hub_name_goes_to_datasets(project, monkeypatch):
    from rollout.math_task import read_rows

    asked = []
    fake = types.ModuleType("datasets")
    fake.load_dataset = lambda name, split: asked.append((name, split)) or [{"problem": "p"}]
    monkeypatch.setitem(sys.modules, "datasets", fake)
    assert list(read_rows("agentica-org/DeepScaleR-Preview-Dataset")) == [{"problem": "p"}]
    assert list(read_rows("runs/wordmath-data/train.jsonl")) == [{"problem": "1+1", "answer": "2"}]
    with pytest.raises(FileNotFoundError, match=r"task\.dataset"):
        read_rows("runs/wordmath-data/tran.jsonl")
    (project / "rows.csv").write_text("problem,answer\n")
    with pytest.raises(ValueError, match=r"task\.dataset: 'rows\.csv' is not a \.jsonl"):
        read_rows("rows.csv")
    assert asked == [("agentica-org/DeepScaleR-Preview-Dataset", "train")]
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ValueError, match=r"needs the `datasets` package"):
        read_rows("org/name")


def test_nearest_existing(project):
    assert nearest_existing("runs/wordmath-dat/train.jsonl") == Path(
        "runs/wordmath-data/train.jsonl"
    )
    assert nearest_existing(project / "rnus" / "wordmath-data") == project / "runs" / (
        "wordmath-data"
    )
    assert nearest_existing("runs/wordmath-data/train.jsonl") is None  # it exists
    assert nearest_existing("elsewhere/x") is None


def test_model_config_with_a_missing_model_is_still_valid_config():
    """The check is at load time (the config may name a model made later)."""
    assert ModelConfig(name_or_path="runs/later").name_or_path == "runs/later"


def test_on_a_fresh_clone_the_output_dir_marks_a_path_local(tmp_path, monkeypatch):
    """No ``runs/`` yet (a fresh clone, before ``make demo``): ``runs/wordmath-model`` still
    names the run's output directory, not a hub organisation, so it fails at once."""
    monkeypatch.chdir(tmp_path)
    assert not looks_local("runs/wordmath-model")  # alone, it reads as ORG/NAME ...
    assert looks_local("runs/wordmath-model", local_roots=("runs",))  # ... not beside a run
    cfg = load_config(CPU_MATH, environ={})
    with pytest.raises(ModelNotFound, match="'runs/wordmath-model' does not exist"):
        check_run_paths(cfg)
    cfg.output_dir = "elsewhere"  # then it may be a hub id: the model passes, the data not
    with pytest.raises(DatasetNotFound, match=r"task\.dataset"):
        check_run_paths(cfg)


def test_a_dataset_with_no_usable_row_names_the_field_the_file_and_what_a_row_needs(tmp_path):
    from rollout.math_task import MathTask

    data = tmp_path / "rows.jsonl"
    data.write_text('{"question": "1+1", "answer": "2"}\n{"problem": "", "answer": "3"}\n')
    cfg = TaskConfig(kind="math", dataset=str(data))
    with pytest.raises(ValueError) as err:
        MathTask.from_config(cfg)
    message = str(err.value)
    assert message.startswith(f"task.dataset: {str(data)!r} (train) has no usable rows")
    assert "'missing_field': 1" in message and "'empty_problem': 1" in message
    assert "'problem'" in message and "\n" not in message
