"""``task.environment`` through the REST API (issue 28): a POSTed environment file is confined
to the API's ``models_dir`` and never imported before that (a file elsewhere is refused with a
422 naming the field, unexecuted); one under it that does not import, or a module without the
named factory, is a 422 naming the field; a built-in name or a good file creates the run."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient

from services.api import create_app
from tests.integration.test_api import AUTH, TOKEN, api_cfg, small  # noqa: F401 (fixture)

GOOD = "from rollout.environment import Step\nclass Env:\n    def start(self, p): pass\n" \
       "    def step(self, m): return Step('', 1.0, True)\n"  # fmt: skip


def test_a_posted_environment_is_confined_and_checked(api_cfg, monkeypatch, tmp_path: Path):  # noqa: F811
    models = tmp_path / "models"
    models.mkdir()
    outside = tmp_path / "evil.py"
    marker = tmp_path / "executed"
    outside.write_text(f"open({str(marker)!r}, 'w').close()\nclass Env: pass\n")
    (models / "good.py").write_text(GOOD)
    (models / "broken.py").write_text("import no_such_module_xyz\n")
    monkeypatch.setenv(api_cfg.token_env, TOKEN)
    c = TestClient(create_app(api_cfg.model_copy(update={"models_dir": str(models)})))

    def post(name: str, env: str):
        config = {**small(name), "task": {"environment": env}}
        return c.post("/v1/runs", json={"config": config, "start": False}, headers=AUTH)

    r = post("r1", f"{outside}:Env")
    assert r.status_code == 422 and "models_dir" in r.text
    assert r.json()["detail"][0]["loc"] == ["body", "config", "task", "environment"]
    assert not marker.exists()  # the file outside models_dir never ran
    for name, env, words in (
        # (a generic line: the import's own error is never repeated, no probe of what is
        # installed; docs/api.md, "Security")
        ("r2", f"{models / 'broken.py'}:Env", "cannot be imported here"),
        ("r3", "rollout.calculator:NoSuchEnv", "is not on this API's plugin list"),
    ):
        r = post(name, env)
        assert r.status_code == 422, r.text
        detail = r.json()["detail"][0]
        assert detail["loc"] == ["body", "config", "task", "environment"]
        assert detail["msg"].startswith("task.environment:") and words in detail["msg"]
        assert "no_such_module_xyz" not in detail["msg"]
    assert post("r4", f"{models / 'good.py'}:Env").status_code == 201
    assert post("r5", "calculator").status_code == 201
