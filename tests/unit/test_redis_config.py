"""The ``redis`` config section (``redis.url``, ``redis.prefix``) and the old names it replaced,
``buffer.redis_url`` and ``buffer.key_prefix``, still read with a deprecation message."""

from __future__ import annotations

import json
import warnings

import pytest

from reval.config import ConfigError, build_config, dump_config, load_config, public_dump

URL = "redis://user:pw@redis.example:6380/2"


def _no_warnings():
    return warnings.catch_warnings(action="error")


def test_the_redis_section_is_where_the_url_and_prefix_live():
    with _no_warnings():
        cfg = load_config(None, [f"redis.url={URL}", "redis.prefix=team:"], environ={})
    assert (cfg.redis.url, cfg.redis.prefix) == (URL, "team:")
    assert public_dump(cfg)["redis"]["url"] == "redis://user:***@redis.example:6380/2"
    with _no_warnings():
        env = {"REVAL__REDIS__URL": URL, "REVAL__REDIS__PREFIX": "env:"}
        cfg = load_config(None, [], environ=env)
    assert (cfg.redis.url, cfg.redis.prefix) == (URL, "env:")
    defaults = load_config(None, [], environ={}).redis
    assert (defaults.url, defaults.prefix) == ("redis://127.0.0.1:6379/0", "reval:")


def test_the_old_names_are_still_read_with_a_deprecation_message():
    with pytest.warns(
        FutureWarning, match=r"buffer\.redis_url is deprecated: it is now redis\.url"
    ):
        cfg = load_config(None, [f"buffer.redis_url={URL}"], environ={})
    assert cfg.redis.url == URL
    env = {"REVAL__BUFFER__KEY_PREFIX": "old:"}
    with pytest.warns(FutureWarning, match=r"buffer\.key_prefix is deprecated.*REDIS__PREFIX"):
        cfg = load_config(None, [], environ=env)
    assert cfg.redis.prefix == "old:"
    with pytest.warns(FutureWarning, match="buffer.key_prefix"):  # a config the API was sent
        cfg = build_config({"buffer": {"backend": "redis", "key_prefix": "json:"}})
    assert cfg.redis.prefix == "json:"
    assert "redis_url" not in public_dump(cfg)["buffer"]  # written under the new name only


def test_a_later_source_overrides_an_earlier_one_under_either_name(tmp_path):
    """A run's config.json carries redis.url (its password redacted): the secret given again
    through the old environment name wins, as it did before the section existed."""
    path = tmp_path / "config.json"
    dump_config(build_config({"redis": {"url": URL}}), path)
    assert "pw" not in json.loads(path.read_text())["redis"]["url"]
    with pytest.warns(FutureWarning):
        cfg = load_config(path, [], environ={"REVAL__BUFFER__REDIS_URL": URL})
    assert cfg.redis.url == URL
    with pytest.warns(FutureWarning):
        cfg = load_config(path, [f"redis.url={URL}"], environ={"REVAL__BUFFER__REDIS_URL": "x"})
    assert cfg.redis.url == URL  # --set after the environment


def test_both_names_at_odds_in_one_source_is_one_clear_error():
    with pytest.raises(ConfigError, match=r"buffer\.redis_url .*and redis\.url are both set"):
        load_config(None, ["buffer.redis_url=redis://a:1/0", "redis.url=redis://b:1/0"], {})
    with pytest.warns(FutureWarning):  # the same value twice is no conflict
        cfg = load_config(None, ["buffer.key_prefix=p:", "redis.prefix=p:"], environ={})
    assert cfg.redis.prefix == "p:"


def test_the_mlflow_server_s_password_is_redacted_like_redis_s(tmp_path):
    """``metrics.mlflow.tracking_uri`` may hold a server's user and password: redacted wherever
    the config is written or shown (the trackers get ``public_dump`` too)."""
    cfg = load_config(overrides=["metrics.mlflow.tracking_uri=https://me:s3cret@mlflow.lab:5000"],
                      environ={})  # fmt: skip
    shown = public_dump(cfg)["metrics"]["mlflow"]["tracking_uri"]
    assert shown == "https://me:***@mlflow.lab:5000"
    dump_config(cfg, tmp_path / "config.json")
    assert "s3cret" not in (tmp_path / "config.json").read_text()
    assert cfg.metrics.mlflow.tracking_uri.endswith("s3cret@mlflow.lab:5000")  # (still usable)
