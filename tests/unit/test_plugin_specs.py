"""The one parser of ``module:name`` specs (``reval.plugins.split_spec``, issue 40): a config's
``task.reward`` and ``task.environment``, a reward's file, the API's plugin allowlist and its
``module:*`` entries all read the form through it, and say a malformed one the same way."""

from __future__ import annotations

import re
import warnings

import pytest
from pydantic import ValidationError

from reval.config import ApiConfig, TaskConfig
from reval.paths import RewardNotFound, load_reward, reward_file
from reval.plugins import BUILTIN_PLUGINS, canonical_spec, listed, load_object, split_spec


@pytest.mark.parametrize(
    ("spec", "want"),
    [
        ("pkg.mod:fn", ("pkg.mod", "fn")),
        (" pkg.mod:Cls.method ", ("pkg.mod", "Cls.method")),
        ("rewards/mine.py:score", ("rewards/mine.py", "score")),
        ("C:/x/mine.py:score", ("C:/x/mine.py", "score")),  # (the last colon splits)
    ],
)
def test_a_spec_splits_at_its_last_colon(spec: str, want: tuple[str, str]) -> None:
    assert split_spec(spec) == want


@pytest.mark.parametrize("spec", ["pkg.mod", ":fn", "pkg.mod:", "pkg.mod:1fn", "pkg:a-b", "m:*"])
def test_a_malformed_spec_is_one_clear_error(spec: str) -> None:
    form = "is not 'package.module:name' or 'path/to/file.py:name'"
    with pytest.raises(ValueError, match=re.escape(form)):
        split_spec(spec)


def test_a_wildcard_is_a_form_only_for_an_allowlist_entry() -> None:
    assert split_spec("pkg.mod:*", wildcard=True) == ("pkg.mod", "*")
    with pytest.raises(ValueError):
        split_spec("pkg.mod:a*", wildcard=True)
    allow = ["pkg.mod:*", "other:fn"]
    assert listed("pkg.mod:score", allow) == "module"
    assert listed("pkg.mod:_private", allow) is None
    assert listed("other:fn", allow) == "name"
    assert listed("other:fn2", allow) is None


def test_the_config_fields_say_a_malformed_spec_through_the_one_parser() -> None:
    with pytest.raises(ValidationError, match=re.escape("not 'package.module:function'")):
        TaskConfig(reward="pkg.mod", dataset="d.jsonl")
    with pytest.raises(ValidationError, match=re.escape("not 'package.module:name'")):
        TaskConfig(environment="pkg.mod:")
    assert TaskConfig(reward=" r.py:score ", dataset="d.jsonl").reward == "r.py:score"
    assert reward_file("r.py:score") == "r.py" and reward_file("pkg.r:score") is None
    # A built-in environment's name is no import path: no file, and no error (the API's
    # _confine asks for every environment; the parser's ValueError was a 500 there).
    assert reward_file("calculator") is None
    with pytest.raises(RewardNotFound, match=r"task\.reward"):
        load_reward("no colon here")


def test_a_malformed_plugin_entry_stops_the_api_at_start_not_a_request() -> None:
    assert ApiConfig(plugins=[" pkg.mod:* ", "pkg.x:fn"]).plugins == ["pkg.mod:*", "pkg.x:fn"]
    with pytest.raises(ValidationError, match=re.escape("'pkg.mod' is not 'package.module:name'")):
        ApiConfig(plugins=["pkg.mod"])  # (before: accepted, and never matched anything)


def test_the_builtin_graders_are_named_by_their_package() -> None:
    """The canonical spelling is ``rollout.grading.graders:NAME``; the API's list names those,
    every one loads, and the REST allow-list accepts each by name."""
    from rollout.grading import graders

    for spec in BUILTIN_PLUGINS:
        module, name = split_spec(spec)
        assert module == "rollout.grading.graders"
        assert load_object(spec) is getattr(graders, name)
        assert listed(spec, BUILTIN_PLUGINS) == "name"
    assert listed("rollout.grading.graders:run_tests", BUILTIN_PLUGINS) is None


@pytest.mark.parametrize("name", ["exact_match", "code_tests", "http_reward"])
def test_the_old_module_of_the_builtin_graders_still_loads_with_a_warning(name: str) -> None:
    """``rollout.graders:NAME`` (before issue 40's move) names the same function, with a
    FutureWarning in one line that gives the new spelling; the REST allow-list takes it too."""
    from rollout.grading import graders

    old, new = f"rollout.graders:{name}", f"rollout.grading.graders:{name}"
    with pytest.warns(FutureWarning, match=re.escape("now rollout.grading.graders")) as caught:
        assert load_object(old) is getattr(graders, name)
    assert all("\n" not in str(w.message) for w in caught)
    with pytest.warns(FutureWarning):
        assert split_spec(old) == ("rollout.grading.graders", name)
    with pytest.warns(FutureWarning):
        assert canonical_spec(f" {old} ") == new
    with pytest.warns(FutureWarning):
        assert listed(old, BUILTIN_PLUGINS) == "name"
    with pytest.warns(FutureWarning):
        assert listed(new, ["rollout.graders:*"]) == "module"  # (an operator's old entry)
    with pytest.warns(FutureWarning):  # (the config keeps the new spelling: no warning later)
        assert TaskConfig(reward=old, dataset="d.jsonl").reward == new
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert TaskConfig(reward=new, dataset="d.jsonl").reward == new


def test_a_current_spec_warns_nothing() -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert canonical_spec("rollout.grading.graders:exact_match").endswith(":exact_match")
        assert split_spec("rollout.grading:x") == ("rollout.grading", "x")
        assert load_reward("rollout.grading.graders:exact_match") is not None
